"""Drives a running Leyline server's Responses API with the official `openai` client.

Run by tests/responses_client.rs:
    python3 responses_client.py BASE_URL MODEL KEY_A KEY_B
Exits non-zero with a message on the first failed check.

Coverage (field or behaviour x check):
| field / behaviour                         | check                                              |
|-------------------------------------------|----------------------------------------------------|
| input: string                             | plain_create: object, status, output_text, usage   |
| input: items, instructions, developer,    | item_list: parts input_text/output_text, an        |
|   system, assistant history               |   assistant turn; longer prompt than plain         |
| max_output_tokens, temperature            | plain_create: output_tokens <= limit; incomplete   |
|                                           |   status and incomplete_details when cut           |
| stream=True                               | streamed: event order, sequence numbers, deltas    |
|                                           |   joined == non-streamed text                      |
| responses.stream() helper                 | streamed: text deltas, final response              |
| usage.input_tokens_details.cached_tokens  | streamed: a greedy repeat is read from the cache   |
| store (default true), GET, DELETE         | stored: retrieve equals create; delete; 404 after; |
|                                           |   GET ?stream=true is a 400 naming stream          |
| previous_response_id                      | stored: continuation reads turn 1 from the cache;  |
|                                           |   404 previous_response_not_found after DELETE     |
| API keys own responses                    | stored: key B gets 404 on GET and on continuation  |
| store=false                               | codex_fields: not retrievable                      |
| unknown / unapplicable fields             | refusals: 400 with param = the field               |
| malformed items, tool_choice=required,    | refusals: 400 naming input[1].call_id,             |
|   text.format json_schema                 |   tool_choice, text.format                         |
| Codex fields: reasoning, include,         | codex_fields: accepted; web_search listed in       |
|   client_metadata, prompt_cache_key,      |   leyline.unsupported_tools; function tool echoed  |
|   parallel_tool_calls, text.verbosity,    |                                                    |
|   session_id header, hosted tools         |                                                    |
| leyline.logprobs (extension)              | plain_create: one entry per output token, the      |
|                                           |   greedy token first                               |
"""

import sys

import openai

BASE, MODEL, KEY_A, KEY_B = sys.argv[1:5]
A = openai.OpenAI(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=300)
B = openai.OpenAI(base_url=BASE, api_key=KEY_B, max_retries=0, timeout=300)
QUESTION = "What is the capital of France?"


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect(exc, fn, what):
    try:
        fn()
    except exc as e:
        return e
    raise AssertionError(f"{what}: expected {exc.__name__}")


def leyline(resp):
    extra = resp.model_extra or {}
    check("leyline" in extra, f"response has a leyline object: {resp}")
    return extra["leyline"]


def check_usage(r, limit):
    u = r.usage
    check(u.input_tokens > 0 and 1 <= u.output_tokens <= limit, f"usage: {u}")
    check(u.total_tokens == u.input_tokens + u.output_tokens, f"total: {u}")
    check(isinstance(u.input_tokens_details.cached_tokens, int), f"cached: {u}")
    check(u.output_tokens_details.reasoning_tokens == 0, f"reasoning: {u}")


def check_finished(r, limit):
    check(r.object == "response" and r.id.startswith("resp_"), f"response: {r}")
    check(r.status in ("completed", "incomplete"), f"status: {r.status}")
    if r.status == "incomplete":
        check(r.incomplete_details.reason == "max_output_tokens", f"{r.incomplete_details}")
        check(r.usage.output_tokens == limit, f"cut at the limit: {r.usage}")
    else:
        check(r.incomplete_details is None, f"{r.incomplete_details}")
    check(r.error is None, f"error: {r.error}")
    check(len(r.output) >= 1 and r.output[0].type == "message", f"output: {r.output}")
    msg = r.output[0]
    check(msg.role == "assistant" and msg.id.startswith("msg_"), f"message: {msg}")
    check(msg.content[0].type == "output_text", f"content: {msg.content}")
    check(isinstance(r.output_text, str) and r.output_text == msg.content[0].text, r.output_text)
    check_usage(r, limit)


def plain_create():
    r = A.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    check_finished(r, 8)
    check(r.model == MODEL and r.temperature == 0 and r.max_output_tokens == 8, f"echo: {r}")
    check(r.store is True and r.previous_response_id is None, f"store: {r}")
    # A reply cut by the limit says so.
    cut = A.responses.create(model=MODEL, input="Count from one to one hundred in words.",
                             max_output_tokens=3, temperature=0)
    check(cut.status == "incomplete", f"cut: {cut.status}")
    check(cut.incomplete_details.reason == "max_output_tokens", f"{cut.incomplete_details}")
    check(cut.output[0].status == "incomplete", f"item status: {cut.output[0]}")
    lp = A.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0,
                            extra_body={"leyline": {"logprobs": 2}})
    entries = leyline(lp).get("logprobs")
    check(isinstance(entries, list) and len(entries) == lp.usage.output_tokens, f"{entries}")
    check("".join(e["token"] for e in entries) == lp.output_text, f"{entries} spell text")
    check(all(e["top_logprobs"][0]["token"] == e["token"] for e in entries), f"{entries}")
    print("plain:", repr(r.output_text), r.usage.input_tokens, "input tokens")
    return r


def item_list(plain):
    r = A.responses.create(
        model=MODEL,
        instructions="You are a geography quiz.",
        input=[
            {"role": "developer", "content": "Answer in one word."},
            {"role": "system", "content": [{"type": "input_text", "text": "Be terse."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "What is the capital of Italy?"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Rome.", "annotations": []}]},
            {"role": "user", "content": QUESTION},
        ],
        max_output_tokens=8, temperature=0,
    )
    check_finished(r, 8)
    check(r.instructions == "You are a geography quiz.", f"instructions: {r.instructions}")
    check(r.usage.input_tokens > plain.usage.input_tokens + 10,
          f"all items rendered: {r.usage} vs {plain.usage}")
    print("items:", repr(r.output_text))


ORDER = ["response.created", "response.in_progress", "response.output_item.added",
         "response.content_part.added", "response.output_text.delta", "response.output_text.done",
         "response.content_part.done", "response.output_item.done"]


def streamed():
    args = dict(model=MODEL, input="What is 2+2?", max_output_tokens=24, temperature=0)
    plain = A.responses.create(**args)
    events = list(A.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    seqs = [e.sequence_number for e in events]
    check(seqs == list(range(len(events))), f"sequence numbers: {seqs}")
    # Keep-alive in_progress events may repeat; the rest follow the fixed order.
    squashed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    last = "response.incomplete" if plain.status == "incomplete" else "response.completed"
    check(squashed == ORDER + [last], f"event order: {kinds}")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"][0]
    final = events[-1].response
    check(text == done.text == final.output_text == plain.output_text,
          f"streamed {text!r} == {plain.output_text!r}")
    check(events[0].response.id == final.id and final.status == plain.status, f"{final}")
    # The repeat was read from the prefix cache.
    u = final.usage
    check(u.input_tokens == plain.usage.input_tokens, f"same prompt: {u}")
    check(u.input_tokens_details.cached_tokens >= u.input_tokens - 1, f"cached repeat: {u}")
    check("tokens_reused" in (final.model_extra or {}).get("leyline", {}), f"leyline: {final}")

    # The SDK's stream helper accumulates the same response.
    with A.responses.stream(**args) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        if plain.status == "completed":
            helper = s.get_final_response()
            check(helper.output_text == plain.output_text, f"helper: {helper.output_text!r}")
        else:
            expect(RuntimeError, s.get_final_response, "an incomplete stream has no final")
    check("".join(deltas) == plain.output_text, f"helper deltas: {deltas}")
    print("streamed:", len(events), "events ending", last + ",",
          u.input_tokens_details.cached_tokens, "cached")


def stored():
    r1 = A.responses.create(model=MODEL, input="My name is Ada and I like tea. Say hello to me.",
                            max_output_tokens=8, temperature=0)
    check(r1.store is True, f"stored: {r1.store}")
    got = A.responses.retrieve(r1.id)
    check(got.id == r1.id and got.output_text == r1.output_text, f"retrieve: {got}")
    check(got.usage.input_tokens == r1.usage.input_tokens, f"retrieve usage: {got.usage}")
    e = expect(openai.BadRequestError, lambda: A.responses.retrieve(r1.id, stream=True),
               "a stored response is not streamed again")
    check(e.body["param"] == "stream", f"{e.body}")

    r2 = A.responses.create(model=MODEL, previous_response_id=r1.id, input="What is my name?",
                            max_output_tokens=8, temperature=0)
    check(r2.previous_response_id == r1.id, f"echo: {r2.previous_response_id}")
    check(r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens,
          f"turn 1 and its reply are in the prompt: {r2.usage} vs {r1.usage}")
    cached = r2.usage.input_tokens_details.cached_tokens
    check(cached >= r1.usage.input_tokens, f"turn 1 read from the cache: {r2.usage} vs {r1.usage}")

    # Another key sees none of it.
    e = expect(openai.NotFoundError, lambda: B.responses.retrieve(r2.id), "key B reads A's")
    check(e.status_code == 404, e)
    e = expect(openai.NotFoundError, lambda: B.responses.create(
        model=MODEL, previous_response_id=r2.id, input="Hi", max_output_tokens=2),
        "key B continues A's")
    check(e.body["code"] == "previous_response_not_found", f"{e.body}")
    check(A.responses.retrieve(r2.id).id == r2.id, "A still reads it")

    # Deleted: gone for GET and for continuation.
    check(A.responses.delete(r1.id) is None, "delete")
    expect(openai.NotFoundError, lambda: A.responses.retrieve(r1.id), "deleted")
    expect(openai.NotFoundError, lambda: A.responses.delete(r1.id), "deleted twice")
    e = expect(openai.NotFoundError, lambda: A.responses.create(
        model=MODEL, previous_response_id=r1.id, input="Hi", max_output_tokens=2),
        "continue a deleted response")
    check(e.body["code"] == "previous_response_not_found", f"{e.body}")
    check(e.body["param"] == "previous_response_id", f"{e.body}")
    check(e.body["type"] == "invalid_request_error", f"{e.body}")
    # The continuation is stored too, and carries the whole conversation.
    r3 = A.responses.create(model=MODEL, previous_response_id=r2.id, input="And what do I like?",
                            max_output_tokens=4, temperature=0)
    check(r3.usage.input_tokens > r2.usage.input_tokens, f"{r3.usage} vs {r2.usage}")
    check(r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens, f"{r3.usage}")
    print("stored: continuation read", cached, "of", r2.usage.input_tokens, "from the cache")


def refusals():
    def bad(param, **kw):
        kw.setdefault("input", "Hi")
        kw.setdefault("max_output_tokens", 2)
        e = expect(openai.BadRequestError,
                   lambda: A.responses.create(model=MODEL, **kw), param)
        check(e.status_code == 400 and e.body["param"] == param, f"{param}: {e.body}")

    bad("frobnicate", extra_body={"frobnicate": 1})
    bad("max_tool_calls", max_tool_calls=2)
    bad("tool_choice", tool_choice="required")
    bad("text.format", text={"format": {"type": "json_schema", "name": "x", "schema": {}}})
    bad("background", background=True)
    bad("input[1].call_id", input=[{"role": "user", "content": "Hi"},
                                   {"type": "function_call", "name": "f", "arguments": "{}"}])
    bad("input[0].content[0].type", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x/y.png"}]}])
    bad("max_output_tokens", max_output_tokens=0)
    e = expect(openai.NotFoundError,
               lambda: A.responses.create(model="no-such-model", input="Hi"), "model")
    check(e.body["code"] == "model_not_found", e.body)
    print("refusals: ok")


def codex_fields():
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command",
             "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                            "required": ["command"]}, "strict": False}
    r = A.responses.create(
        model=MODEL,
        instructions="You are a coding agent.",
        input=[{"type": "message", "role": "developer",
                "content": [{"type": "input_text", "text": "Work in /tmp."}]},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Say hi."}]}],
        tools=[shell, {"type": "web_search"}],
        tool_choice="auto", parallel_tool_calls=False,
        reasoning={"effort": "medium", "summary": "auto"},
        include=["reasoning.encrypted_content"],
        store=False, prompt_cache_key="codex-conversation-1",
        text={"verbosity": "low"}, max_output_tokens=6, temperature=0,
        extra_body={"client_metadata": {"originator": "codex_cli_rs"}},
        extra_headers={"session_id": "codex-conversation-1"},
    )
    check(r.status in ("completed", "incomplete"), f"status: {r.status}")
    check(r.store is False and r.parallel_tool_calls is False, f"echo: {r}")
    check([t.name for t in r.tools if t.type == "function"] == ["shell"], f"tools: {r.tools}")
    unsupported = leyline(r).get("unsupported_tools")
    check(unsupported == [{"type": "web_search"}], f"unsupported_tools: {unsupported}")
    expect(openai.NotFoundError, lambda: A.responses.retrieve(r.id), "store=false is not kept")
    # Streamed, as Codex sends it.
    events = list(A.responses.create(
        model=MODEL, input="Say hi.", tools=[shell, {"type": "web_search_preview"}],
        store=False, stream=True, include=["reasoning.encrypted_content"],
        reasoning={"effort": "low"}, prompt_cache_key="codex-conversation-2",
        max_output_tokens=6, temperature=0))
    final = events[-1].response
    check(final.status in ("completed", "incomplete"), f"{final.status}")
    check(leyline(final).get("unsupported_tools") == [{"type": "web_search_preview"}], f"{final}")
    print("codex fields: accepted")


plain = plain_create()
item_list(plain)
streamed()
stored()
refusals()
codex_fields()
print("ok")
