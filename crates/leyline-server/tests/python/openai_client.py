"""Drives a running Leyline server with the official `openai` client.

Run by tests/openai_client.rs:
    python3 openai_client.py BASE_URL MODEL KEY_A KEY_B
Exits non-zero with a message on the first failed check.
"""

import sys
import threading

import openai

BASE, MODEL, KEY_A, KEY_B = sys.argv[1:5]
A = openai.OpenAI(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=300)
B = openai.OpenAI(base_url=BASE, api_key=KEY_B, max_retries=0, timeout=300)


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


def plain_chat():
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = A.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    c = r.choices[0]
    check(r.object == "chat.completion", r.object)
    check(c.message.role == "assistant" and isinstance(c.message.content, str), c)
    check(c.finish_reason in ("stop", "length"), c.finish_reason)
    check(1 <= r.usage.completion_tokens <= 8, r.usage)
    check(isinstance(r.usage.prompt_tokens_details.cached_tokens, int), r.usage)

    stream = A.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    text, finishes, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            if ch.finish_reason:
                finishes.append(ch.finish_reason)
    check(text == c.message.content, f"stream text {text!r} == {c.message.content!r}")
    check(finishes == [c.finish_reason], finishes)
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage)
    # The repeat was served from the prefix cache.
    check(usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1, usage)

    comp = A.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    check(comp.object == "text_completion" and isinstance(comp.choices[0].text, str), comp)


TOOL_OUTPUT = " ".join(f"file_{i}.txt size={i * 37 % 1000}" for i in range(40))


def shell_history(system, ask):
    """An agent's history: a request, one tool call, its long output, a question."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": "I will call the ls tool."},
        {"role": "tool", "tool_call_id": "call_1", "content": TOOL_OUTPUT},
        {"role": "user", "content": "Which of these files is the largest one, and how large is it?"},
    ]


def session_edit(mode):
    """Turn 1 with a long tool output; turn 2 replaces it by a stub (as a policy would)."""
    history = shell_history("You are a helpful assistant with a shell tool.",
                            "List the files in the project directory.")
    r1 = A.chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0,
        extra_body={"leyline": {"mode": mode}},
    )
    sid = leyline(r1)["session_id"]
    check(isinstance(sid, str) and sid.startswith("sess_"), sid)
    edited = [dict(m) for m in history]
    edited[3]["content"] = "[evicted: 1 older tool output]"
    edited += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Thanks. Now summarize."},
    ]
    r2 = A.chat.completions.create(
        model=MODEL, messages=edited, max_tokens=8, temperature=0,
        extra_body={"session_id": sid, "leyline": {"mode": mode}},
    )
    ley = leyline(r2)
    check(ley["session_id"] == sid and ley["mode"] == mode, ley)
    # A session of key A does not exist for key B: naming its id opens B's own session of
    # that name, built from B's history (a rebuild), never A's.
    rb = B.chat.completions.create(
        model=MODEL, messages=edited, max_tokens=2, extra_body={"session_id": sid})
    check(leyline(rb)["session_rebuilt"] is True, leyline(rb))
    B.delete(f"/sessions/{sid}", cast_to=object)
    expect(openai.NotFoundError, lambda: B.get(f"/sessions/{sid}", cast_to=object),
           "foreign session")
    return r1, r2, ley


def sessions():
    # Tokens of the tool output alone (no BOS for this model), measured by the server's
    # tokenizer through the plain completions endpoint.
    tool_tokens = A.completions.create(model=MODEL, prompt=TOOL_OUTPUT, max_tokens=1).usage.prompt_tokens
    a1, a2, la = session_edit("amortize")
    f1, f2, lf = session_edit("forget")
    cached_a = a2.usage.prompt_tokens_details.cached_tokens
    cached_f = f2.usage.prompt_tokens_details.cached_tokens
    print(f"amortize: cached {cached_a} of {a2.usage.prompt_tokens}, leyline {la}")
    print(f"forget:   cached {cached_f} of {f2.usage.prompt_tokens}, leyline {lf}")
    check(a2.usage.prompt_tokens == f2.usage.prompt_tokens, "same prompt in both modes")
    # Everything after the edited tool output was cached in turn 1: the last user message,
    # the assistant header and reply. Turn 1's prompt minus the tool output and the prefix
    # before it (cached_f) bounds it from below.
    downstream = a1.usage.prompt_tokens - tool_tokens - cached_f
    check(downstream >= 15, f"downstream span is {downstream} tokens")
    # FORGET reuses only the prefix before the edit.
    check(cached_f + tool_tokens <= f1.usage.prompt_tokens, "FORGET reused nothing past the edit")
    check(lf["tokens_rotated"] == 0, lf)
    # AMORTIZE keeps the downstream tokens (rotated) on top of that prefix.
    check(cached_a >= cached_f + downstream, f"AMORTIZE cached {cached_a} >= {cached_f} + {downstream}")
    check(la["directives_applied"] >= 1 and la["tokens_rotated"] >= downstream, la)
    # The stub AMORTIZE prefilled is work done for this request, not a cache hit: cached and
    # prefilled tokens add up to the prompt in both modes.
    for usage, ley in ((a2.usage, la), (f2.usage, lf)):
        cached = usage.prompt_tokens_details.cached_tokens
        check(cached + ley["tokens_prefilled"] == usage.prompt_tokens, (usage, ley))
        check(ley["tokens_reused"] == cached, (usage, ley))


def stock_client():
    """No session id, no extra_body: the server splices the conversation the edit changed."""
    history = shell_history("You are a careful assistant with a shell tool.", "Show me the project files.")
    r1 = A.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    check(not leyline(r1)["spliced"] and leyline(r1)["session_id"] is None, leyline(r1))

    def edited(stub, question):
        e = [dict(m) for m in history]
        e[3]["content"] = stub
        return e + [
            {"role": "assistant", "content": r1.choices[0].message.content},
            {"role": "user", "content": question},
        ]

    # Another API key is another tenant: nothing of A's conversation is found.
    rb = B.chat.completions.create(model=MODEL, messages=edited("[cleared]", "Summarize."), max_tokens=4, temperature=0)
    check(not leyline(rb)["spliced"], leyline(rb))
    # Opted out by the header a stock SDK sets as a default: the prefix cache alone.
    prefix_only = openai.OpenAI(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=300,
                                default_headers={"X-Leyline-Mode": "prefix"})
    rp = prefix_only.chat.completions.create(model=MODEL, messages=edited("[gone]", "Summarize."), max_tokens=4, temperature=0)
    check(not leyline(rp)["spliced"], leyline(rp))
    before_tool = rp.usage.prompt_tokens_details.cached_tokens
    r2 = A.chat.completions.create(model=MODEL, messages=edited("[cleared]", "Summarize."), max_tokens=4, temperature=0)
    ley = leyline(r2)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    print(f"stock client: cached {cached} of {r2.usage.prompt_tokens} (prefix only: {before_tool}), leyline {ley}")
    check(ley["spliced"] and ley["session_id"] is None and ley["directives_applied"] >= 1, ley)
    # The last user message of turn 1 and everything after it stayed cached, rotated.
    check(cached >= before_tool + 15 and ley["tokens_rotated"] >= 15, (cached, before_tool, ley))
    check(cached + ley["tokens_prefilled"] == r2.usage.prompt_tokens, (r2.usage, ley))
    # The next turn continues the spliced branch: no new edit, everything cached.
    turn3 = edited("[cleared]", "Summarize.") + [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "Thanks."},
    ]
    r3 = A.chat.completions.create(model=MODEL, messages=turn3, max_tokens=4, temperature=0)
    check(r3.usage.prompt_tokens_details.cached_tokens >= r2.usage.prompt_tokens - 1, (r3.usage, leyline(r3)))
    expect(openai.BadRequestError, lambda: openai.OpenAI(
        base_url=BASE, api_key=KEY_A, max_retries=0, default_headers={"X-Leyline-Mode": "sometimes"},
    ).chat.completions.create(model=MODEL, messages=history, max_tokens=2), "a bad X-Leyline-Mode")


def concurrent_streams(n=16):
    errors = []

    def one(i):
        try:
            s = A.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                max_tokens=8, temperature=0, stream=True,
            )
            finishes, ids = [], set()
            for chunk in s:
                ids.add(chunk.id)
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            check(len(ids) == 1 and finishes in (["stop"], ["length"]), (ids, finishes))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"stream {i}: {e!r}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    check(not any(t.is_alive() for t in threads), "a stream hung")
    check(not errors, errors)


def logprobs():
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = A.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=3)
    c = r.choices[0]
    entries = c.logprobs.content
    check(len(entries) == r.usage.completion_tokens, f"{len(entries)} entries, {r.usage}")
    check("".join(e.token for e in entries) == c.message.content,
          f"tokens {[e.token for e in entries]} spell {c.message.content!r}")
    for e in entries:
        check(len(e.top_logprobs) == 3 and e.logprob <= 0, e)
        # Greedy: the token chosen is the most likely one, and the list is sorted.
        check(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob, e)
        check(all(a.logprob >= b.logprob for a, b in zip(e.top_logprobs, e.top_logprobs[1:])), e)
        check(bytes(e.bytes).decode(errors="replace") == e.token, e)

    stream = A.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for ch in stream for c2 in ch.choices if c2.logprobs for e in c2.logprobs.content]
    check([e.token for e in streamed] == [e.token for e in entries], "streamed tokens")
    check(all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, entries)),
          "streamed logprobs")

    # Without the field: none.
    plain = A.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    check(plain.choices[0].logprobs is None, plain.choices[0])

    t = A.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                             logprobs=2)
    lp = t.choices[0].logprobs
    check(len(lp.tokens) == t.usage.completion_tokens == len(lp.token_logprobs), lp)
    check("".join(lp.tokens) == t.choices[0].text, lp)
    check(all(len(d) == 2 for d in lp.top_logprobs), lp.top_logprobs)
    check(lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0, lp.text_offset)

    # Leyline's own field, the same in every API.
    r = A.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                  extra_body={"leyline": {"logprobs": 1}})
    mine = leyline(r).get("logprobs")
    check(isinstance(mine, list) and len(mine) == r.usage.completion_tokens, leyline(r))
    check(r.choices[0].logprobs is None, "leyline.logprobs alone leaves the choice's null")

    e = expect(openai.BadRequestError, lambda: A.chat.completions.create(
        model=MODEL, messages=msgs, logprobs=True, top_logprobs=21), "top_logprobs 21")
    check("top_logprobs" in str(e), e)
    e = expect(openai.BadRequestError, lambda: A.chat.completions.create(
        model=MODEL, messages=msgs, top_logprobs=2), "top_logprobs without logprobs")
    check("top_logprobs" in str(e), e)


def errors():
    bad = openai.OpenAI(base_url=BASE, api_key="not-a-key", max_retries=0)
    expect(openai.AuthenticationError, lambda: bad.models.list(), "wrong key")
    msgs = [{"role": "user", "content": "hi"}]
    e = expect(openai.NotFoundError, lambda: A.chat.completions.create(model="no-such-model", messages=msgs), "model")
    check("no-such-model" in str(e), e)
    e = expect(openai.BadRequestError, lambda: A.chat.completions.create(model=MODEL, messages=msgs, max_tokens=-1), "-1")
    check("max_tokens" in str(e), e)
    check([m.id for m in A.models.list().data] == [MODEL, MODEL + "-alias"], "models list: the name, then its alias")
    check(A.chat.completions.create(model=MODEL + "-alias", messages=msgs, max_tokens=2).model == MODEL, "an alias serves the model")


for name, fn in [("plain chat", plain_chat), ("sessions", sessions), ("stock client", stock_client), ("16 streams", concurrent_streams), ("logprobs", logprobs), ("errors", errors)]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test harness reads the message
        print(f"FAILED {name}: {e!r}")
        sys.exit(1)
    print(f"ok {name}")
