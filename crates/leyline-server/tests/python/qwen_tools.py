"""Tool round trips on Qwen2.5-Coder-0.5B (its template renders tools) through the official
`openai` client, with no `extra_body` (Chat Completions and the Responses API), and the
official `anthropic` client.

Run by tests/qwen_tools.rs:
    python3 qwen_tools.py BASE_URL MODEL KEY_A KEY_B
Exits non-zero with a message on the first failed check.
"""

import json
import sys

import anthropic
import openai

BASE, MODEL, KEY_A, _ = sys.argv[1:5]
O = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY_A, max_retries=0, timeout=300)
A = anthropic.Anthropic(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=300)
QUESTION = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "parameters": WEATHER}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather",
                    "description": "Current weather of a city", "parameters": WEATHER}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
                    "input_schema": WEATHER}]


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def openai_round_trip():
    msgs = [{"role": "user", "content": QUESTION}]
    r = O.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS,
                                  temperature=0, max_tokens=60)
    choice = r.choices[0]
    check(choice.finish_reason == "tool_calls", f"finish_reason tool_calls: {choice}")
    calls = choice.message.tool_calls
    check(calls and len(calls) == 1 and calls[0].type == "function", f"one call: {choice}")
    check(calls[0].function.name == "get_weather", f"the offered tool: {calls[0]}")
    check(json.loads(calls[0].function.arguments) == {"city": "Paris"}, f"arguments: {calls[0]}")
    check(calls[0].id.startswith("call_"), f"call id: {calls[0].id}")

    # Streamed: the same call, whole in one delta, and the same finish reason.
    deltas, finish = [], None
    for ch in O.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS,
                                        temperature=0, max_tokens=60, stream=True):
        if ch.choices:
            deltas.extend(ch.choices[0].delta.tool_calls or [])
            finish = ch.choices[0].finish_reason or finish
    check(len(deltas) == 1 and deltas[0].index == 0, f"one streamed call: {deltas}")
    check(deltas[0].function.name == "get_weather", f"streamed name: {deltas[0]}")
    check(json.loads(deltas[0].function.arguments) == {"city": "Paris"}, f"{deltas[0]}")
    check(finish == "tool_calls", f"streamed finish_reason: {finish}")

    # The result goes back; the call renders as the template wants (arguments an object),
    # and the first turn's prompt is served from the cache.
    msgs.append({"role": "assistant", "content": None,
                 "tool_calls": [c.model_dump() for c in calls]})
    msgs.append({"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 C"})
    r2 = O.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS,
                                   temperature=0, max_tokens=16)
    check(r2.usage.prompt_tokens > r.usage.prompt_tokens, f"longer prompt: {r2.usage}")
    cached = r2.usage.prompt_tokens_details.cached_tokens
    check(cached >= r.usage.prompt_tokens, f"turn 1 reused ({r.usage.prompt_tokens}): {r2.usage}")
    print("openai: tool call, streamed call, round trip with", cached, "cached tokens")


def openai_context_management():
    # leyline.context_management on chat completions: the same edit as on /v1/messages.
    msgs = [{"role": "user", "content": QUESTION}]
    for i, city in enumerate(["Paris", "Rome", "Oslo"]):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}",
                     "content": f"{city}: sunny, 2{i} C, light wind from the west"})
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
            "keep": {"type": "tool_uses", "value": 1}}
    r = O.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS,
                                  temperature=0, max_tokens=4,
                                  extra_body={"leyline": {"context_management": {"edits": [edit]}}})
    applied = r.model_extra["leyline"]["context_management"]["applied_edits"]
    check(len(applied) == 1 and applied[0]["cleared_tool_uses"] == 2, f"applied: {applied}")
    check(applied[0]["cleared_input_tokens"] > 0, f"tokens cleared: {applied}")
    plain = O.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS,
                                      temperature=0, max_tokens=4)
    check(plain.usage.prompt_tokens > r.usage.prompt_tokens,
          f"the edit shortens the prompt: {plain.usage} vs {r.usage}")
    print("openai: leyline.context_management cleared", applied[0]["cleared_input_tokens"], "tokens")


def responses_round_trip():
    args = dict(model=MODEL, input=QUESTION, tools=RESPONSES_TOOLS, temperature=0,
                max_output_tokens=60)
    r = O.responses.create(**args)
    calls = [o for o in r.output if o.type == "function_call"]
    check(r.status == "completed", f"status: {r}")
    check(len(calls) == 1 and calls[0].name == "get_weather", f"one function_call: {r.output}")
    check(json.loads(calls[0].arguments) == {"city": "Paris"}, f"arguments: {calls[0]}")
    check(calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_"), f"{calls[0]}")

    # Streamed: the call is announced, its arguments delivered, the item finished.
    events = list(O.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    check(kinds[-1] == "response.completed", f"stream ends: {kinds}")
    for k in ["response.output_item.added", "response.function_call_arguments.delta",
              "response.function_call_arguments.done", "response.output_item.done"]:
        check(k in kinds, f"{k} in {kinds}")
    done = [e.item for e in events
            if e.type == "response.output_item.done" and e.item.type == "function_call"]
    check(len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}, f"{done}")
    with O.responses.stream(**args) as s:
        final = s.get_final_response()
    fcalls = [o for o in final.output if o.type == "function_call"]
    check(len(fcalls) == 1 and fcalls[0].name == "get_weather", f"helper: {final.output}")

    # The result goes back with the whole history (as Codex sends it, store=false): a
    # message answers, and turn 1 is read from the cache.
    result = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "Sunny, 21 C"}
    history = [{"role": "user", "content": QUESTION}] + [o.model_dump() for o in r.output]
    r2 = O.responses.create(model=MODEL, input=history + [result], tools=RESPONSES_TOOLS,
                            temperature=0, max_output_tokens=24, store=False)
    # This 0.5B model answers the tool result with the call again, as untagged JSON lines:
    # that is its reply, a message or calls; what must hold is the API's part.
    check(r2.status == "completed" and r2.output, f"answer: {r2.output}")
    # The items render as Chat Completions renders the same turns: the same prompt and the
    # same greedy reply.
    msgs = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": calls[0].call_id, "type": "function",
                "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 21 C"}]
    c = O.chat.completions.create(model=MODEL, messages=msgs, tools=OPENAI_TOOLS,
                                  temperature=0, max_tokens=24)
    check(c.usage.prompt_tokens == r2.usage.input_tokens, f"{c.usage} vs {r2.usage}")
    check(chat_reply(c) == response_reply(r2), f"{c.choices[0]} vs {r2.output}")
    cached = r2.usage.input_tokens_details.cached_tokens
    check(cached >= r.usage.input_tokens, f"turn 1 reused ({r.usage.input_tokens}): {r2.usage}")
    # The same through previous_response_id: the same prompt, so the same greedy answer.
    r3 = O.responses.create(model=MODEL, previous_response_id=r.id, input=[result],
                            tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=24)
    check(r3.usage.input_tokens == r2.usage.input_tokens, f"{r3.usage} vs {r2.usage}")
    check(response_reply(r3) == response_reply(r2), f"{r3.output} vs {r2.output}")
    print("responses: function_call, streamed, round trip", response_reply(r2), "with",
          cached, "cached tokens")


def chat_reply(c):
    """A chat completion's reply: its text (if any), then its calls as (name, arguments)."""
    m = c.choices[0].message
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
    return ((m.content or "").strip(), calls)


def response_reply(r):
    """A response's reply in the same form."""
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    return (r.output_text.strip(), calls)


def anthropic_round_trip():
    msgs = [{"role": "user", "content": QUESTION}]
    r = A.messages.create(model=MODEL, max_tokens=60, messages=msgs, tools=ANTHROPIC_TOOLS,
                          extra_body={"temperature": 0})
    uses = [b for b in r.content if b.type == "tool_use"]
    check(r.stop_reason == "tool_use", f"stop_reason tool_use: {r}")
    check(len(uses) == 1 and uses[0].name == "get_weather", f"one tool_use: {r.content}")
    check(uses[0].input == {"city": "Paris"}, f"input: {uses[0]}")
    with A.messages.stream(model=MODEL, max_tokens=60, messages=msgs, tools=ANTHROPIC_TOOLS,
                           extra_body={"temperature": 0}) as s:
        final = s.get_final_message()
    suses = [b for b in final.content if b.type == "tool_use"]
    check(len(suses) == 1 and suses[0].input == {"city": "Paris"}, f"streamed: {final.content}")
    msgs.append({"role": "assistant", "content": [b.model_dump() for b in r.content]})
    msgs.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]})
    r2 = A.messages.create(model=MODEL, max_tokens=16, messages=msgs, tools=ANTHROPIC_TOOLS,
                           extra_body={"temperature": 0})
    check(r2.usage.cache_read_input_tokens >= r.usage.input_tokens,
          f"turn 1 reused ({r.usage.input_tokens}): {r2.usage}")
    print("anthropic: tool_use, streamed tool_use, round trip with",
          r2.usage.cache_read_input_tokens, "cached tokens")


def anthropic_forced_call():
    """tool_choice any / tool on a greeting the model answers in text when left to choose."""
    msgs = [{"role": "user", "content": "Hello! Please just say hi back."}]
    free = A.messages.create(model=MODEL, max_tokens=16, messages=msgs, tools=ANTHROPIC_TOOLS,
                             extra_body={"temperature": 0})
    check(all(b.type == "text" for b in free.content), f"auto answers in text: {free.content}")
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any"}):
        r = A.messages.create(model=MODEL, max_tokens=40, messages=msgs, tools=ANTHROPIC_TOOLS,
                              tool_choice=choice, extra_body={"temperature": 0})
        uses = [b for b in r.content if b.type == "tool_use"]
        check(r.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"],
              f"tool_choice {choice} forces the call: {r.content}")
        with A.messages.stream(model=MODEL, max_tokens=40, messages=msgs, tools=ANTHROPIC_TOOLS,
                               tool_choice=choice, extra_body={"temperature": 0}) as s:
            final = s.get_final_message()
        suses = [b for b in final.content if b.type == "tool_use"]
        check([(u.name, u.input) for u in suses] == [(u.name, u.input) for u in uses],
              f"streamed the same call: {final.content}")
        print(f"anthropic: tool_choice {choice['type']} forced {uses[0].input}")


openai_round_trip()
openai_context_management()
responses_round_trip()
anthropic_round_trip()
anthropic_forced_call()
print("ok")
