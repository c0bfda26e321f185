"""A model that reasons, through the official `openai` and `anthropic` clients.

Run by tests/reasoning.rs against a server whose chat template opens a `<think>` block in
its generation prompt (so the model's whole greedy output, cut at max tokens, is reasoning):
    python3 reasoning_clients.py BASE_URL MODEL KEY_A KEY_B
BASE_URL has no `/v1`. Exits non-zero with a message on the first failed check.

| API                     | check                                                        |
|-------------------------|--------------------------------------------------------------|
| chat completions        | reasoning_content holds the text, content is empty; streamed |
|                         |   reasoning_content deltas join to the same text             |
| Messages                | one thinking block, no text block; the stream helper's final |
|                         |   message has the same block; thinking_delta events          |
| Responses               | one reasoning item (reasoning_text content), no message;      |
|                         |   streamed reasoning_text deltas join to the same text        |
| thinking switched off   | Messages thinking.type disabled and Responses reasoning       |
|                         |   effort none: no reasoning, only the answer                 |
"""

import sys

import anthropic
import openai

BASE, MODEL, KEY_A, _ = sys.argv[1:5]
OA = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY_A, max_retries=0, timeout=300)
AN = anthropic.Anthropic(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=300)
GREEDY = {"temperature": 0}  # this client version takes it only as an extra field
ASK = [{"role": "user", "content": "Is 91 a prime number?"}]


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def chat():
    r = OA.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    m = r.choices[0].message
    thought = (m.model_extra or {}).get("reasoning_content")
    check(isinstance(thought, str) and thought.strip(), f"chat: reasoning_content {thought!r}")
    check(not m.content, f"chat: content {m.content!r} (all output was reasoning)")
    parts = []
    for c in OA.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=12, temperature=0, stream=True
    ):
        if c.choices and c.choices[0].delta:
            d = c.choices[0].delta
            check(not d.content, f"chat stream: content delta {d.content!r}")
            parts.append((d.model_extra or {}).get("reasoning_content") or "")
    check("".join(parts) == thought, f"chat stream: {''.join(parts)!r} != {thought!r}")
    return thought


def messages(thought):
    r = AN.messages.create(model=MODEL, messages=ASK, max_tokens=12, extra_body=GREEDY)
    kinds = [b.type for b in r.content]
    check(kinds == ["thinking"], f"messages: blocks {kinds}")
    check(r.content[0].thinking == thought, f"messages: {r.content[0].thinking!r}")
    deltas = []
    with AN.messages.stream(model=MODEL, messages=ASK, max_tokens=12, extra_body=GREEDY) as s:
        for e in s:
            if e.type == "content_block_delta":
                check(e.delta.type == "thinking_delta", f"messages stream: {e.delta.type}")
                deltas.append(e.delta.thinking)
        final = s.get_final_message()
    check([b.type for b in final.content] == ["thinking"], f"stream: {final.content}")
    check(final.content[0].thinking == thought, f"stream: {final.content[0].thinking!r}")
    check("".join(deltas) == thought, "messages stream: deltas")
    # The thinking block sent back in the history is accepted.
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in final.content] + [
            {"type": "text", "text": "No: 7 x 13."}]},
        {"role": "user", "content": "And 97?"},
    ]
    again = AN.messages.create(model=MODEL, messages=history, max_tokens=4, extra_body=GREEDY)
    check(again.content, "messages: a turn after a thinking block")


def responses(thought):
    r = OA.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=12, temperature=0)
    kinds = [o.type for o in r.output]
    check(kinds == ["reasoning"], f"responses: items {kinds}")
    item = r.output[0]
    texts = [c.text for c in (item.content or [])]
    check(texts == [thought], f"responses: reasoning content {texts!r}")
    deltas, final = [], None
    for e in OA.responses.create(
        model=MODEL, input=ASK[0]["content"], max_output_tokens=12, temperature=0, stream=True
    ):
        if e.type == "response.reasoning_text.delta":
            deltas.append(e.delta)
        check(e.type != "response.output_text.delta", "responses stream: answer text")
        if e.type in ("response.completed", "response.incomplete"):
            final = e.response
    check("".join(deltas) == thought, f"responses stream: {''.join(deltas)!r}")
    check(final is not None and [o.type for o in final.output] == ["reasoning"], "final")


def switched_off():
    # The switch reaches the template (its prompt closes an empty block, so it is longer)
    # and no reasoning comes back.
    on = AN.messages.create(model=MODEL, messages=ASK, max_tokens=12, extra_body=GREEDY)
    r = AN.messages.create(model=MODEL, messages=ASK, max_tokens=12, extra_body=GREEDY,
                           thinking={"type": "disabled"})
    kinds = [b.type for b in r.content]
    check("thinking" not in kinds, f"thinking disabled: blocks {kinds}")
    def prompt(u):
        return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    check(prompt(r.usage) > prompt(on.usage), "thinking disabled: the same prompt")
    r = OA.responses.create(model=MODEL, input=ASK[0]["content"], max_output_tokens=12,
                            temperature=0, reasoning={"effort": "none"})
    kinds = [o.type for o in r.output]
    check(kinds == ["message"], f"reasoning effort none: items {kinds}")


thought = chat()
messages(thought)
responses(thought)
switched_off()
print("reasoning through all three APIs: ok;", repr(thought))
