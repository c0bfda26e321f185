"""Drives a running Leyline server with the official `anthropic` client (Messages API).

Run by tests/anthropic_client.rs:
    python3 anthropic_client.py BASE_URL MODEL KEY_A KEY_B
Exits non-zero with a message on the first failed check. tests/qwen_tools.rs covers the
rest on a model whose template renders tools (tool_use round trips, tool_choice any / tool
forcing a call).

Coverage (field or behaviour x check):
| field / behaviour                            | check                                            |
|----------------------------------------------|--------------------------------------------------|
| system, messages, usage with cache reads     | plain_and_cached                                 |
| stream=True, event order                     | streamed                                         |
| ping keep-alive during a long prefill        | pings_during_a_long_prefill (raw SSE)            |
| stop_sequences                               | stop_sequence                                    |
| tool_use / tool_result blocks in history     | tool_blocks_in_history                           |
| session_id, leyline.mode in the body         | session_edit                                     |
| context_management clear_tool_uses_20250919  | context_editing: cleared, spliced                |
| system messages inside messages              | claude_code_shapes: rendered (count_tokens       |
|                                              |   differs without them)                          |
| thinking / redacted_thinking blocks          | claude_code_shapes: accepted, none returned      |
| thinking adaptive, output_config.effort,     | claude_code_shapes: accepted; errors: malformed  |
|   metadata, max_tokens 32000                 |   thinking named                                 |
| clear_thinking_20251015                      | claude_code_shapes: applied_edits reported       |
| cache_control on system, tool and user       | claude_code_shapes: usage input + cache read +   |
|   blocks                                     |   cache creation add up, split at the breakpoint |
| POST /v1/messages/count_tokens               | claude_code_shapes: equals the prompt            |
| server tools (web_search_*)                  | claude_code_shapes: leyline.unsupported_tools    |
| X-Claude-Code-Session-Id                     | claude_code_shapes: continued turn cached >= 80%;|
|                                              |   under another key nothing cached               |
| --served-model-name aliases, /v1/models      | claude_code_shapes: alias served, listed         |
| unknown fields, tool_choice without tools,   | errors: 400 invalid_request_error naming the     |
|   image blocks, tool_result without id       |   field                                          |
| prompt over the context                      | errors: "prompt is too long: N tokens > M"       |
| bad key, unknown model                       | errors: authentication_error, not_found_error    |
| leyline.logprobs (extension)                 | logprobs: one entry per output token, greedy     |
|                                              |   token first, spelling the text                 |
"""

import sys

import anthropic

BASE, MODEL, KEY_A, KEY_B = sys.argv[1:5]
# The test server's alias for MODEL (`--served-model-name MODEL,ALIAS`).
ALIAS = MODEL + "-alias"
# The SDK sends the key as `x-api-key` and appends /v1/messages to the base URL.
A = anthropic.Anthropic(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=300)
BAD = anthropic.Anthropic(base_url=BASE, api_key="not-a-key", max_retries=0, timeout=300)
# This SDK version has no sampling arguments; the server reads them from the body.
GREEDY = {"temperature": 0}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def expect(exc, fn, what):
    try:
        fn()
    except exc as e:
        return e
    raise AssertionError(f"{what}: expected {exc.__name__}")


def text_of(msg):
    return "".join(b.text for b in msg.content if b.type == "text")


def plain_and_cached():
    system = "You are a terse assistant. " * 10
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    r = A.messages.create(model=MODEL, max_tokens=12, system=system, messages=msgs,
                          metadata={"user_id": "u-1"}, extra_body={"temperature": 0, "top_k": 40})
    check(r.type == "message" and r.role == "assistant", f"message shape: {r}")
    check(r.id.startswith("msg_"), r.id)
    check(r.content and r.content[0].type == "text" and text_of(r), f"text content: {r.content}")
    check(r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason)
    check(r.usage.output_tokens > 0, f"usage: {r.usage}")
    first_in = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    again = A.messages.create(model=MODEL, max_tokens=12, system=system, messages=msgs,
                              extra_body=GREEDY)
    check(text_of(again) == text_of(r), "greedy answers repeat")
    cached = again.usage.cache_read_input_tokens or 0
    check(cached >= first_in - 2, f"the repeat reads the prompt from the cache: {again.usage}")
    # Anthropic's meaning: input_tokens excludes what was read from the cache.
    check(again.usage.input_tokens + cached == first_in,
          f"input_tokens + cache_read_input_tokens is the prompt: {again.usage} vs {first_in}")
    return text_of(r)


def streamed(expected_text):
    system = "You are a terse assistant. " * 10
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    kinds = []
    with A.messages.stream(model=MODEL, max_tokens=12, system=system, messages=msgs,
                           extra_body=GREEDY) as s:
        for event in s:
            kinds.append(event.type)
        final = s.get_final_message()
    for k in ("message_start", "content_block_start", "content_block_delta",
              "content_block_stop", "message_delta", "message_stop"):
        check(k in kinds, f"stream has {k}: {kinds}")
    check(kinds.index("message_start") < kinds.index("content_block_start")
          < kinds.index("content_block_stop") < kinds.index("message_delta")
          < kinds.index("message_stop"), f"event order: {kinds}")
    check(text_of(final) == expected_text, f"streamed {text_of(final)!r} vs {expected_text!r}")
    check(final.stop_reason in ("end_turn", "max_tokens"), final.stop_reason)
    check(final.usage.output_tokens > 0 and final.usage.cache_read_input_tokens > 0,
          f"final usage from message_delta: {final.usage}")


def pings_during_a_long_prefill():
    """The test server pings after 200 ms without an event; a 4K-token prefill takes longer.
    Read as raw SSE: the SDK drops ping events before its caller sees them."""
    import json
    import urllib.request
    long = " ".join(f"item {i}," for i in range(600))
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": long + " Which item came first?"}]}
    req = urllib.request.Request(BASE + "/v1/messages", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "x-api-key": KEY_A})
    kinds = [line[len(b"event: "):].strip().decode()
             for line in urllib.request.urlopen(req, timeout=300) if line.startswith(b"event: ")]
    check("content_block_start" in kinds, f"the stream answered: {kinds}")
    pings = kinds[: kinds.index("content_block_start")].count("ping")
    check(pings >= 3, f"pings before the first token of a long prefill: {kinds}")


def stop_sequence():
    msgs = [{"role": "user", "content": "Write a sentence about the sea."}]
    r = A.messages.create(model=MODEL, max_tokens=32, messages=msgs, extra_body=GREEDY,
                          stop_sequences=[" "])
    check(r.stop_reason == "stop_sequence" and r.stop_sequence == " ",
          f"stopped at the space: {r.stop_reason} {r.stop_sequence!r}")
    check(" " not in text_of(r), repr(text_of(r)))


def tool_blocks_in_history():
    msgs = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "18 C and sunny"}]},
            {"type": "text", "text": "Summarize it."},
        ]},
    ]
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    r = A.messages.create(model=MODEL, max_tokens=8, messages=msgs, tools=tools,
                          tool_choice={"type": "auto"}, extra_body=GREEDY)
    check(r.content is not None and r.usage.input_tokens > 20, f"tool history served: {r}")


def session_edit():
    history = [
        {"role": "user", "content": "Remember: the code word is heron. " * 8},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Say the code word."},
    ]
    r = A.messages.create(model=MODEL, max_tokens=6, messages=history,
                          extra_body={**GREEDY, "leyline": {"mode": "amortize"}})
    ly = (r.model_extra or {}).get("leyline") or {}
    sid = ly.get("session_id")
    check(sid, f"a session was opened: {r.model_extra}")
    edited = [dict(history[0], content="Remember: the code word is crane."), *history[1:]]
    r2 = A.messages.create(model=MODEL, max_tokens=6, messages=edited,
                           extra_body={**GREEDY, "session_id": sid, "leyline": {"mode": "amortize"}})
    ly2 = r2.model_extra["leyline"]
    check(ly2["directives_applied"] >= 1, f"the edit was spliced: {ly2}")
    check(r2.usage.cache_read_input_tokens > 0, f"downstream tokens kept: {r2.usage}")


def errors():
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "image block")
    check(e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", e.body)
    check("messages[0].content[0].type" in e.body["error"]["message"]
          or "image" in e.body["error"]["message"], e.body)
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "tool_result"}]}]), "tool_result without id")
    check("tool_use_id" in e.body["error"]["message"], e.body)
    e = expect(anthropic.AuthenticationError, lambda: BAD.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]), "bad key")
    check(e.body["error"]["type"] == "authentication_error", e.body)
    e = expect(anthropic.NotFoundError, lambda: A.messages.create(
        model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]), "model")
    check(e.body["error"]["type"] == "not_found_error", e.body)
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
        tool_choice={"type": "any"}), "tool_choice any without tools")
    check("tool_choice" in e.body["error"]["message"], e.body)
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
        extra_body={"mcp_servers": []}), "a field the server cannot apply")
    check("mcp_servers" in e.body["error"]["message"], e.body)
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
        extra_body={"thinking": {"type": "enabled"}}), "thinking without a budget")
    check("thinking.budget_tokens" in e.body["error"]["message"], e.body)
    # A prompt over the context: the error Claude Code answers by compacting.
    long = " ".join(f"w{i}" for i in range(9000))
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": long}]), "too long")
    check(e.body["error"]["type"] == "invalid_request_error"
          and e.body["error"]["message"].startswith("prompt is too long: "), e.body)


def context_editing():
    msgs = [{"role": "user", "content": "Check the weather in four cities."}]
    for i, city in enumerate(["Paris", "Rome", "Oslo", "Lima"]):
        msgs.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}",
             "content": f"{city}: " + "sunny and mild, a light wind from the west. " * 6}]})
    msgs[-1]["content"].append({"type": "text", "text": "Summarize."})
    # The history as the agent keeps it, unedited: its conversation is now cached.
    plain = A.messages.create(model=MODEL, max_tokens=4, messages=msgs, extra_body=GREEDY)
    # The SDK sends this through its beta namespace: /v1/messages?beta=true with a header.
    r = A.beta.messages.create(
        model=MODEL, max_tokens=4, messages=msgs, betas=["context-management-2025-06-27"],
        context_management={"edits": [{"type": "clear_tool_uses_20250919",
                                       "trigger": {"type": "tool_uses", "value": 1},
                                       "keep": {"type": "tool_uses", "value": 1}}]},
        extra_body=GREEDY)
    edits = r.context_management.applied_edits
    check(len(edits) == 1 and edits[0].type == "clear_tool_uses_20250919", f"{edits}")
    check(edits[0].cleared_tool_uses == 3, f"all but the last tool use cleared: {edits}")
    check(edits[0].cleared_input_tokens > 100, f"{edits}")
    seen = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    full = plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)
    check(seen + 100 < full, f"the model saw the edited history: {seen} vs {full} tokens")
    # The clearing was spliced into the cached conversation: only the three placeholders
    # ("[cleared: old tool result]", under 12 tokens each) were prefilled, not everything
    # after the first cleared result.
    print(f"context editing: {r.usage.input_tokens} prefilled, {r.usage.cache_read_input_tokens} read")
    check(r.usage.input_tokens <= 3 * 12 + 4, f"{r.usage}")
    e = expect(anthropic.BadRequestError, lambda: A.beta.messages.create(
        model=MODEL, max_tokens=4, messages=msgs, betas=["context-management-2025-06-27"],
        context_management={"edits": [{"type": "clear_everything_2099"}]}), "unknown edit")
    check("context_management.edits[0]" in e.body["error"]["message"] or
          "clear_everything" in e.body["error"]["message"], e.body)


def claude_code_shapes():
    """What Claude Code sends on every request, through the beta namespace it uses."""
    system = [{"type": "text", "text": "You are a terse assistant. " * 6},
              {"type": "text", "text": "Answer in one word.", "cache_control": {"type": "ephemeral"}}]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Which colour is the sky?"}]},
        # Mid-conversation system messages (beta mid-conversation-system-2026-04-07).
        {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief.",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "The sky is blue.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Blue."}]},
        {"role": "user", "content": [{"type": "text", "text": "And grass?",
                                      "cache_control": {"type": "ephemeral"}}]},
    ]
    tools = [{"name": "Read", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
              "cache_control": {"type": "ephemeral"}},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    body = dict(model=MODEL, max_tokens=32000, system=system, messages=msgs, tools=tools,
                metadata={"user_id": '{"session_id": "s"}'}, betas=["context-management-2025-06-27"],
                context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                extra_headers={"X-Claude-Code-Session-Id": "cc-session-1"},
                extra_body={**GREEDY, "thinking": {"type": "adaptive", "display": "omitted"},
                            "output_config": {"effort": "high"}})
    r = A.beta.messages.create(**body)
    check(all(b.type in ("text", "tool_use") for b in r.content), f"no thinking blocks: {r.content}")
    u = r.usage
    prompt = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    n = A.messages.count_tokens(model=MODEL, system=system, messages=msgs, tools=tools[:1])
    check(n.input_tokens == prompt, f"count_tokens {n.input_tokens} vs the prompt {prompt}: {u}")
    # The breakpoint on the last user block covers all but the generation prompt.
    check(u.cache_creation_input_tokens + u.cache_read_input_tokens >= prompt - 4
          and u.input_tokens <= 4, f"usage split at the last breakpoint: {u}")
    edits = r.context_management.applied_edits
    check(len(edits) == 1 and edits[0].type == "clear_thinking_20251015", f"{edits}")
    ly = r.model_extra["leyline"]
    check(ly.get("unsupported_tools") == ["web_search"], f"server tool listed: {ly}")
    # The next turn under the same conversation key reads the history from the cache.
    msgs2 = msgs + [{"role": "assistant", "content": r.content and [b.model_dump(exclude_none=True) for b in r.content] or "Green."},
                    {"role": "user", "content": "And snow?"}]
    r2 = A.beta.messages.create(**{**body, "messages": msgs2})
    u2 = r2.usage
    total2 = u2.input_tokens + u2.cache_read_input_tokens + u2.cache_creation_input_tokens
    check(u2.cache_read_input_tokens >= 0.8 * total2, f"continued turn read from the cache: {u2}")
    # The same conversation key under another API key reaches nothing of this one.
    B = anthropic.Anthropic(base_url=BASE, api_key=KEY_B, max_retries=0, timeout=300)
    rb = B.beta.messages.create(**{**body, "messages": msgs2})
    check(rb.usage.cache_read_input_tokens == 0, f"another key's conversation stays apart: {rb.usage}")
    # The same history without the mid-conversation system message is a different prompt.
    n2 = A.messages.count_tokens(model=MODEL, system=system,
                                 messages=[m for m in msgs if m["role"] != "system"])
    check(n2.input_tokens < n.input_tokens, f"the system message is rendered: {n2} vs {n}")
    # Its alias for side requests (titles) names the same model; an unknown id is a 404.
    side = A.messages.create(model=ALIAS, max_tokens=4, extra_body=GREEDY,
                             messages=[{"role": "user", "content": "Title: a chat about colours"}])
    check(side.model == MODEL and side.usage.output_tokens > 0, f"{side}")
    models = {m["id"] for m in __import__("json").loads(
        __import__("urllib.request").request.urlopen(__import__("urllib.request").request.Request(
            BASE + "/v1/models", headers={"Authorization": f"Bearer {KEY_A}"})).read())["data"]}
    check({MODEL, ALIAS} <= models, f"/v1/models lists the alias: {models}")


def forced_tool_call():
    tools = [{"name": "get_weather", "description": "Weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        r = A.messages.create(model=MODEL, max_tokens=48, messages=msgs, tools=tools,
                              tool_choice=choice, extra_body=GREEDY)
        calls = [b for b in r.content if b.type == "tool_use"]
        print(f"forced {choice['type']}: {r.content}")
        check(r.stop_reason == "tool_use" and calls and calls[0].name == "get_weather",
              f"tool_choice {choice} forces a call: {r.content}")
        with A.messages.stream(model=MODEL, max_tokens=48, messages=msgs, tools=tools,
                               tool_choice=choice, extra_body=GREEDY) as s:
            final = s.get_final_message()
        check([b.name for b in final.content if b.type == "tool_use"] == [c.name for c in calls],
              f"streamed the same call: {final.content}")


def logprobs():
    msgs = [{"role": "user", "content": "Name three colours of the rainbow."}]
    r = A.messages.create(model=MODEL, max_tokens=6, messages=msgs,
                          extra_body={"temperature": 0, "leyline": {"logprobs": 2}})
    entries = (r.model_extra or {}).get("leyline", {}).get("logprobs")
    check(isinstance(entries, list) and len(entries) == r.usage.output_tokens,
          f"one entry per output token: {entries} vs {r.usage}")
    check("".join(e["token"] for e in entries) == text_of(r), f"{entries} spell {text_of(r)!r}")
    for e in entries:
        check(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"], e)
    e = expect(anthropic.BadRequestError, lambda: A.messages.create(
        model=MODEL, max_tokens=2, messages=msgs, extra_body={"leyline": {"logprobs": 99}}),
        "leyline.logprobs 99")
    check("leyline.logprobs" in str(e), e)


text = plain_and_cached()
logprobs()
claude_code_shapes()
streamed(text)
pings_during_a_long_prefill()
stop_sequence()
tool_blocks_in_history()
session_edit()
context_editing()
errors()
print("anthropic client: all checks passed")
