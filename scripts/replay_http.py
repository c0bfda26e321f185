#!/usr/bin/env python3
"""Replays agent trajectories against an OpenAI-compatible HTTP server, as a client sees it.

The side-by-side half of BENCHMARKS.md "Replay over HTTP: Leyline vs. llama.cpp": the same
turns, prompts and policy as `leyline bench replay`, sent over the chat completions API to
any server (Leyline's `serve`, llama.cpp's `llama-server`), and timed at the client.

Each trajectory is a session; each recorded assistant message is one request whose prompt is
the history before it with `truncate_tool_outputs` applied (a tool output followed by more
than N assistant messages becomes a stub), rendered by the server's own chat template. The
generated reply is discarded and the recorded one stays in the history, as in the in-process
replay. An edit turn is one whose prompt changed a message the previous request had seen.

Arms: `plain` sends the edited history alone, as a stock client does: on Leyline (implicit
splices on, its default) the server finds the cached conversation the edit changed and splices
it; with `--header-mode prefix` (the `X-Leyline-Mode` header a stock SDK can set as a default
header) or on another server the prefix cache is all it has. `session` adds Leyline's
`session_id` and `leyline.mode` (ignored by other servers). `--no-policy` sends the history
as recorded. `messages` sends the recorded history over Anthropic's `/v1/messages` (tool calls
as `tool_use` / `tool_result` blocks) with server-side `clear_tool_uses_20250919`: the client
never edits, the server clears old tool results and, on Leyline, splices the placeholders into
the cached conversation; its TTFT column is its E2E (not streamed).

`--recording FILE.jsonl` replays instead what `leyline serve --record DIR` wrote of a real
client's session (Claude Code over `/v1/messages`, Codex over `/v1/responses`, or chat
completions): every recorded request in order, its body as recorded except `stream: false`,
`temperature: 0` where the API takes one, and optionally `--model` and a `--max-tokens` cap; its
conversation headers as recorded, the key from `--api-key`. A turn is an edit turn when its
messages (system and messages; instructions and input) are not an extension of the previous
request's in the same conversation (the `x-claude-code-session-id` or `session-id` header, or
`prompt_cache_key`; with the API and the model), cache markers aside. It prints a Markdown
table of the turns, with the `leyline` object's `spliced` and `tokens_prefilled`, and writes
them to --out.

Only the standard library; prints a Markdown table and writes every request to --out.
"""

import argparse
import http.client
import json
import math
import queue
import re
import sys
import threading
import time
import urllib.parse
import urllib.request

STUB = "[evicted: older tool output]"  # leyline-policy's DEFAULT_STUB


class ContextFull(RuntimeError):
    """The server refused a prompt longer than its context (HTTP 400 naming the context).

    The session ends there, as `leyline bench replay`'s length rule cuts a trajectory: its
    later prompts are longer still. The summary counts the sessions cut and the turns dropped.
    """


class Refused(RuntimeError):
    """A non-200 answer; `status` is its HTTP status."""

    def __init__(self, status, text):
        super().__init__(f"HTTP {status}: {text[:500]}")
        self.status = status


def refuse(status, text):
    """The exception for a non-200 answer: ContextFull for a prompt over the context."""
    if status == 400 and re.search(r"context", text, re.I):
        return ContextFull(f"HTTP {status}: {text[:300]}")
    return Refused(status, text)


def truncate_tool_outputs(messages, older_than):
    """The policy of crates/leyline-policy/src/truncate.rs, stateless over the history."""
    out = [dict(m) for m in messages]
    after = 0
    for m in reversed(out):
        if m["role"] == "assistant":
            after += 1
        elif m["role"] == "tool" and after > older_than:
            m["content"] = STUB
    return out


def wire(m):
    w = {"role": m["role"], "content": m["content"]}
    if m.get("name"):
        w["name"] = m["name"]
    return w


def turns(trajectory, older_than, max_turns):
    """(turn, prompt, edit_turn) for the first `max_turns` assistant messages."""
    msgs = trajectory["messages"]
    seen = []
    k = 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        if k >= max_turns:
            return
        prompt = msgs[:i] if older_than is None else truncate_tool_outputs(msgs[:i], older_than)
        edit = any(j >= len(prompt) or prompt[j] != s for j, s in enumerate(seen))
        seen = prompt + [m]
        yield k, prompt, edit
        k += 1


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def to_anthropic(messages):
    """(system, messages) in Anthropic's form: a recorded `<tool_call>` JSON becomes a
    `tool_use` block, the tool output that follows it a `tool_result` block, and consecutive
    messages of one role merge (the API alternates user and assistant)."""
    system, out, pending, k = None, [], [], 0

    def add(role, blocks):
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})

    for m in messages:
        text = m["content"] or ""
        if m["role"] == "system":
            system = text
        elif m["role"] == "assistant":
            blocks = []
            rest = TOOL_CALL.sub("", text).strip()
            if rest:
                blocks.append({"type": "text", "text": rest})
            for call in TOOL_CALL.findall(text):
                try:
                    j = json.loads(call)
                except ValueError:
                    blocks.append({"type": "text", "text": call})
                    continue
                k += 1
                pending.append(f"toolu_{k:04d}")
                args = j.get("arguments")
                blocks.append({"type": "tool_use", "id": pending[-1], "name": j.get("name", "tool"),
                               "input": args if isinstance(args, dict) else {}})
            add("assistant", blocks or [{"type": "text", "text": text or "."}])
        elif m["role"] == "tool" and pending:
            add("user", [{"type": "tool_result", "tool_use_id": pending.pop(0), "content": text}])
        else:
            add("user", [{"type": "text", "text": text or "."}])
    return system, out


class Client:
    def __init__(self, url, model, max_tokens, timeout):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.base = u.path.rstrip("/")
        self.model, self.max_tokens, self.timeout = model, max_tokens, timeout
        # The last chat answer's headers, names lower-cased.
        self.last_headers = {}

    def connect(self):
        # One connection per request: llama-server closes a connection after a streamed
        # response, and on localhost a connect costs microseconds.
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def chat(self, messages, extra, headers=None):
        """Streams one greedy completion; returns (ttft_s, e2e_s, last usage, leyline, timings)."""
        body = {
            "model": self.model,
            "messages": [wire(m) for m in messages],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(extra)
        data = json.dumps(body).encode()
        conn = self.connect()
        t0 = time.perf_counter()
        conn.request(
            "POST",
            self.base + "/v1/chat/completions",
            body=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        resp = conn.getresponse()
        self.last_headers = {k.lower(): v for k, v in resp.getheaders()}
        if resp.status != 200:
            raise refuse(resp.status, resp.read().decode(errors="replace"))
        ttft = None
        usage = leyline = timings = None
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            for c in chunk.get("choices") or []:
                if ttft is None and (c.get("delta") or {}).get("content"):
                    ttft = time.perf_counter() - t0
            usage = chunk.get("usage") or usage
            leyline = chunk.get("leyline") or leyline
            timings = chunk.get("timings") or timings
        resp.read()
        e2e = time.perf_counter() - t0
        conn.close()
        return (ttft if ttft is not None else e2e), e2e, usage, leyline, timings

    def messages(self, messages, context_management, headers=None):
        """One greedy `/v1/messages` request with server-side context editing (not streamed:
        the SDK's beta path); returns (e2e_s, usage, applied_edits)."""
        system, msgs = to_anthropic(messages)
        body = {"model": self.model, "messages": msgs, "max_tokens": self.max_tokens,
                "temperature": 0, "context_management": context_management}
        if system:
            body["system"] = system
        conn = self.connect()
        t0 = time.perf_counter()
        conn.request("POST", self.base + "/v1/messages?beta=true", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json",
                              "anthropic-beta": "context-management-2025-06-27", **(headers or {})})
        resp = conn.getresponse()
        data = resp.read()
        e2e = time.perf_counter() - t0
        conn.close()
        if resp.status != 200:
            raise refuse(resp.status, data.decode(errors="replace"))
        r = json.loads(data)
        return e2e, r.get("usage") or {}, (r.get("context_management") or {}).get("applied_edits") or []

    def delete_session(self, sid):
        """Drops a Leyline session, as a harness does when its agent is done (frees its KV)."""
        conn = self.connect()
        conn.request("DELETE", f"{self.base}/v1/sessions/{sid}")
        resp = conn.getresponse()
        resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"DELETE session {sid}: HTTP {resp.status}")


def run_messages_session(client, name, trajectory, args, records, lock):
    """The `messages` arm: the whole recorded history every turn, cleared by the server."""
    cm = {"edits": [{"type": "clear_tool_uses_20250919",
                     "trigger": {"type": "tool_uses", "value": args.clear_trigger},
                     "keep": {"type": "tool_uses", "value": args.clear_keep}}]}
    headers = {"X-Leyline-Mode": args.header_mode} if args.header_mode else None
    cleared_before = 0
    for k, prompt, _ in turns(trajectory, None, args.max_turns):
        e2e, usage, applied = client.messages(prompt, cm, headers)
        cleared = sum(a.get("cleared_tool_uses", 0) for a in applied)
        cached = usage.get("cache_read_input_tokens") or 0
        rec = {
            "session": name,
            "turn": k,
            # What the model sees changed where the server cleared more than last turn.
            "edit_turn": cleared > cleared_before,
            "prompt_tokens": (usage.get("input_tokens") or 0) + cached,
            "cached_tokens": cached,
            "ttft_ms": e2e * 1e3,
            "e2e_ms": e2e * 1e3,
            "cleared_tool_uses": cleared,
        }
        cleared_before = cleared
        with lock:
            records.append(rec)
            n = len(records)
        print(f"\r{args.label}: {n}/{args.total} requests", end="", file=sys.stderr, flush=True)


def run_session(client, name, trajectory, args, records, lock):
    if args.arm == "messages":
        return run_messages_session(client, name, trajectory, args, records, lock)
    sid = None
    try:
        for k, prompt, edit in turns(trajectory, args.older_than, args.max_turns):
            extra = {}
            if args.arm == "session":
                extra["leyline"] = {"mode": args.mode}
                if sid:
                    extra["session_id"] = sid
            headers = {"X-Leyline-Mode": args.header_mode} if args.header_mode else None
            ttft, e2e, usage, leyline, timings = client.chat(prompt, extra, headers)
            if leyline and leyline.get("session_id"):
                sid = leyline["session_id"]
            usage = usage or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is None and timings:
                cached = timings.get("cache_n")
            rec = {
                "session": name,
                "turn": k,
                "edit_turn": edit,
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": cached,
                "ttft_ms": ttft * 1e3,
                "e2e_ms": e2e * 1e3,
            }
            if leyline:
                rec["leyline"] = leyline
            if timings:
                rec["server_prompt_n"] = timings.get("prompt_n")
                rec["server_prompt_ms"] = timings.get("prompt_ms")
            with lock:
                records.append(rec)
                n = len(records)
            print(
                f"\r{args.label}: {n}/{args.total} requests",
                end="",
                file=sys.stderr,
                flush=True,
            )
    finally:
        # Also when the server refused a turn (ContextFull): free the session's KV.
        if sid:
            client.delete_session(sid)


def pct(xs, p):
    """Nearest-rank percentile, the definition of `leyline bench replay` (report.rs)."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    rank = max(1, math.ceil(p / 100 * len(xs)))
    return xs[min(rank, len(xs)) - 1]


def summary(records, wall):
    def col(sel, key):
        return [r[key] for r in records if sel(r)]

    prompt = sum(r["prompt_tokens"] or 0 for r in records)
    cached = sum(r["cached_tokens"] or 0 for r in records)
    edit = lambda r: r["edit_turn"]  # noqa: E731
    plain = lambda r: not r["edit_turn"]  # noqa: E731
    every = lambda r: True  # noqa: E731
    return {
        "requests": len(records),
        "edit_turns": sum(1 for r in records if r["edit_turn"]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else float("nan"),
        "ttft_p50_ms": pct(col(every, "ttft_ms"), 50),
        "ttft_p95_ms": pct(col(every, "ttft_ms"), 95),
        "e2e_p50_ms": pct(col(every, "e2e_ms"), 50),
        "e2e_p95_ms": pct(col(every, "e2e_ms"), 95),
        "ttft_p50_ms_edit_turns": pct(col(edit, "ttft_ms"), 50),
        "e2e_p50_ms_edit_turns": pct(col(edit, "e2e_ms"), 50),
        "e2e_p50_ms_plain_turns": pct(col(plain, "e2e_ms"), 50),
        "wall_s": wall,
    }


def resident_kv(url):
    """The KV the server holds now, from its /metrics gauges (slots in use times bytes per
    slot); empty when the server does not report them."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    g = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("leyline_pool_used_slots", "leyline_pool_slot_bytes"):
            g[name[len("leyline_"):]] = int(float(value))
    if len(g) < 2:
        return {}
    return {"pool_used_slots": g["pool_used_slots"],
            "resident_kv_bytes": g["pool_used_slots"] * g["pool_slot_bytes"]}


# --- Replaying `leyline serve --record` recordings -------------------------------------------

#: Recorded paths (query aside) and the API each is.
RECORDED_APIS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/responses": "responses",
}

#: Headers naming a client's conversation, in the order the server reads them.
CONVERSATION_HEADERS = ("x-claude-code-session-id", "session-id")


def load_recording(path):
    """The recorded requests of a `serve --record` file, in the order they arrived."""
    with open(path) as f:
        entries = [json.loads(line) for line in f if line.strip()]
    return sorted(entries, key=lambda e: (e.get("seq", 0), e.get("t", 0.0)))


def api_of(path):
    """The API of a recorded path (`messages`, `responses`, ...), or None."""
    return RECORDED_APIS.get(urllib.parse.urlsplit(path).path)


def conversation_of(entry):
    """The conversation a recorded request belongs to: (api, model, name), where the name is
    its conversation header or `prompt_cache_key`; None when it names none."""
    headers = {k.lower(): v for k, v in (entry.get("headers") or {}).items()}
    body = entry.get("body") if isinstance(entry.get("body"), dict) else {}
    name = next((headers[h] for h in CONVERSATION_HEADERS if headers.get(h)), None)
    name = name or body.get("prompt_cache_key")
    if not name:
        return None
    return api_of(entry.get("path", "")), body.get("model"), name


def _plain(v):
    """`v` without cache markers (`cache_control`, which clients move every turn), a lone
    string content as one text block."""
    if isinstance(v, dict):
        out = {k: _plain(x) for k, x in v.items() if k != "cache_control"}
        if isinstance(out.get("content"), str) and out.get("type") != "tool_result" \
                and out.get("role") is not None:
            out["content"] = [{"type": "text", "text": out["content"]}]
        return out
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def items_of(api, body):
    """The conversation a request body carries, as a list to compare by prefix: the system
    prompt (or instructions) first, then the messages (or input items)."""
    if not isinstance(body, dict):
        return []
    if api in ("messages", "count_tokens"):
        system = body.get("system")
        head = [{"system": _plain(system)}] if system else []
        return head + _plain(body.get("messages") or [])
    if api == "responses":
        inp = body.get("input") or []
        if isinstance(inp, str):
            inp = [{"role": "user", "content": inp}]
        head = [{"instructions": body["instructions"]}] if body.get("instructions") else []
        return head + _plain(inp)
    if api == "chat":
        return _plain(body.get("messages") or [])
    if api == "completions":
        return [body.get("prompt")]
    return []


def extends(previous, current):
    """Whether `current` starts with all of `previous` (the conversation only grew)."""
    return len(current) >= len(previous) and current[: len(previous)] == previous


def mark_edits(entries):
    """Per recorded request: True when its conversation is not an extension of the previous
    request's in the same conversation (an edit turn), False when it is, None for the first
    request of a conversation and for requests that name none."""
    last = {}
    out = []
    for e in entries:
        conv = conversation_of(e)
        api = api_of(e.get("path", ""))
        if conv is None or api is None:
            out.append(None)
            continue
        items = items_of(api, e.get("body"))
        prev = last.get(conv)
        out.append(None if prev is None else not extends(prev, items))
        last[conv] = items
    return out


def replay_body(api, body, model=None, max_tokens=None):
    """A recorded body as replayed: not streamed, greedy where the API takes a temperature,
    optionally under another model id and with max tokens capped; otherwise as recorded."""
    b = json.loads(json.dumps(body))
    if model:
        b["model"] = model
    if api == "count_tokens":
        return b
    b["stream"] = False
    b.pop("stream_options", None)
    b["temperature"] = 0
    if max_tokens is not None:
        field = "max_output_tokens" if api == "responses" else "max_tokens"
        b[field] = min(b.get(field) or max_tokens, max_tokens)
    return b


def replay_headers(recorded, api_key=None, header_mode=None):
    """The headers of a replayed request: the recorded ones (conversation names, API
    versions), JSON, the replay's key, and `X-Leyline-Mode` when asked."""
    h = {k.lower(): v for k, v in (recorded or {}).items()
         if k.lower() not in ("content-length", "authorization", "x-api-key", "host")}
    h["content-type"] = "application/json"
    if header_mode:
        h["x-leyline-mode"] = header_mode
    if api_key:
        h["authorization"] = f"Bearer {api_key}"
    return h


def read_usage(api, r):
    """(prompt tokens, cached tokens) of a response of `api`."""
    u = r.get("usage") or {}
    if api == "messages":
        cached = u.get("cache_read_input_tokens") or 0
        return (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0), cached
    if api == "responses":
        return u.get("input_tokens"), (u.get("input_tokens_details") or {}).get("cached_tokens")
    if api == "count_tokens":
        return r.get("input_tokens"), None
    return u.get("prompt_tokens"), (u.get("prompt_tokens_details") or {}).get("cached_tokens")


def replay_recording(args):
    """Sends every recorded request in order; returns the turn records."""
    entries = [e for e in load_recording(args.recording) if api_of(e.get("path", ""))]
    edits = mark_edits(entries)
    u = urllib.parse.urlparse(args.url)
    base = u.path.rstrip("/")
    records = []
    for turn, (e, edit) in enumerate(zip(entries, edits)):
        api = api_of(e["path"])
        body = e.get("body")
        if not isinstance(body, dict):
            print(f"turn {turn}: recorded body is not JSON; skipped", file=sys.stderr)
            continue
        data = json.dumps(replay_body(api, body, args.model, args.max_tokens)).encode()
        headers = replay_headers(e.get("headers"), args.api_key, args.header_mode)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=args.timeout)
        t0 = time.perf_counter()
        conn.request("POST", base + e["path"], body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
        e2e = time.perf_counter() - t0
        conn.close()
        rec = {"turn": turn, "seq": e.get("seq"), "api": api, "status": resp.status,
               "recorded_status": e.get("status"), "edit_turn": edit, "e2e_s": e2e,
               "prompt_tokens": None, "cached_tokens": None, "tokens_prefilled": None,
               "tokens_reused": None, "spliced": None}
        try:
            r = json.loads(raw)
        except ValueError:
            r = {}
        if resp.status == 200 and isinstance(r, dict):
            rec["prompt_tokens"], rec["cached_tokens"] = read_usage(api, r)
            ley = r.get("leyline") or {}
            for k in ("spliced", "tokens_prefilled", "tokens_reused"):
                rec[k] = ley.get(k)
            if ley:
                rec["leyline"] = ley
        else:
            rec["error"] = raw.decode(errors="replace")[:500]
        records.append(rec)
        print(f"\rreplayed {turn + 1}/{len(entries)} requests", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return records


def recording_table(records):
    """The turns as a Markdown table."""
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "no"
        return str(v)

    rows = ["| turn | api | status | prompt tokens | cached | prefilled | spliced | E2E s | edit? |",
            "|---:|---|---:|---:|---:|---:|---|---:|---|"]
    for r in records:
        rows.append(f"| {r['turn']} | {r['api']} | {r['status']} | {cell(r['prompt_tokens'])} "
                    f"| {cell(r['cached_tokens'])} | {cell(r['tokens_prefilled'])} "
                    f"| {cell(r['spliced'])} | {r['e2e_s']:.3f} | {cell(r['edit_turn'])} |")
    return "\n".join(rows)


def main_recording(args):
    records = replay_recording(args)
    print(recording_table(records))
    failed = [r for r in records if r["status"] != 200 and (r["recorded_status"] or 200) < 400]
    summary = {
        "requests": len(records),
        "failed": len(failed),
        "edit_turns": sum(1 for r in records if r["edit_turn"]),
        "spliced_turns": sum(1 for r in records if r["spliced"]),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in records),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in records),
        "tokens_prefilled": sum(r["tokens_prefilled"] or 0 for r in records),
        "e2e_s": sum(r["e2e_s"] for r in records),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "args": vars(args), "turns": records}, f, indent=1)
    if failed:
        sys.exit("requests failed:\n" + "\n".join(
            f"turn {r['turn']} ({r['api']}): HTTP {r['status']}: {r.get('error', '')}" for r in failed))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", "--base", dest="url", required=True,
                    help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--label", help="name of this arm in the table (trajectory mode)")
    ap.add_argument("--traces", help="JSONL trajectories (data/traces/)")
    ap.add_argument("--recording", help="replay this `leyline serve --record` file instead")
    ap.add_argument("--api-key", help="--recording: the Bearer key to send")
    ap.add_argument("--arm", choices=["plain", "session", "messages"], default="plain")
    ap.add_argument("--clear-trigger", type=int, default=3,
                    help="--arm messages: clear_tool_uses trigger, in tool uses")
    ap.add_argument("--clear-keep", type=int, default=2,
                    help="--arm messages: tool uses clear_tool_uses keeps")
    ap.add_argument("--mode", default="amortize", help="leyline.mode for --arm session")
    ap.add_argument(
        "--header-mode",
        choices=["amortize", "forget", "prefix"],
        help="X-Leyline-Mode header on every request (prefix: no implicit splices)",
    )
    ap.add_argument("--model", help="model id to send (default: smollm2-135m; --recording: as recorded)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int,
                    help="max tokens per request (default 8; --recording: a cap, default as recorded)")
    ap.add_argument("--older-than", type=int, default=2, help="truncate_tool_outputs:N")
    ap.add_argument("--no-policy", action="store_true", help="send the history as recorded")
    ap.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--out", help="JSON file for the records and the summary")
    args = ap.parse_args()
    if args.recording:
        return main_recording(args)
    for need in ("label", "traces", "out"):
        if getattr(args, need) is None:
            ap.error(f"--{need} is required (or give --recording)")
    args.model = args.model or "smollm2-135m"
    args.max_tokens = 8 if args.max_tokens is None else args.max_tokens
    if args.no_policy:
        args.older_than = None

    with open(args.traces) as f:
        trajs = [json.loads(line) for line in f if line.strip()][: args.sessions]
    args.total = sum(len(list(turns(t, args.older_than, args.max_turns))) for t in trajs)
    work = queue.Queue()
    for t in trajs:
        work.put(t)
    records, lock, errors, cuts = [], threading.Lock(), [], []

    def worker():
        client = Client(args.url, args.model, args.max_tokens, args.timeout)
        while True:
            try:
                t = work.get_nowait()
            except queue.Empty:
                return
            try:
                name = f"{t['source']}/{t['id']}"
                run_session(client, name, t, args, records, lock)
            except ContextFull:
                with lock:
                    done = sum(1 for r in records if r["session"] == name)
                cuts.append(len(list(turns(t, args.older_than, args.max_turns))) - done)
            except Exception as e:  # reported below; the other sessions go on
                errors.append(f"{t['id']}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    print(file=sys.stderr)
    if errors:
        sys.exit("requests failed:\n" + "\n".join(errors))
    s = summary(records, wall)
    s.update(label=args.label, arm=args.arm, concurrency=args.concurrency,
             sessions_cut=len(cuts), turns_dropped=sum(cuts), **resident_kv(args.url))
    if s.get("resident_kv_bytes") is not None:
        print(f"{args.label}: resident KV at the end: {s['pool_used_slots']} slots, "
              f"{s['resident_kv_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
    if cuts:
        print(f"{args.label}: {len(cuts)} sessions cut at the context length, "
              f"{sum(cuts)} turns dropped", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"summary": s, "args": vars(args), "requests": records}, f, indent=1)
    print(
        f"| {args.label} | {args.concurrency} | {s['requests']} ({s['edit_turns']} edit"
        f"{f', {len(cuts)} cut' if cuts else ''}) "
        f"| {s['prompt_tokens']} | {s['cache_hit_rate']:.3f} "
        f"| {s['ttft_p50_ms']:.0f} / {s['ttft_p95_ms']:.0f} "
        f"| {s['e2e_p50_ms']:.0f} / {s['e2e_p95_ms']:.0f} "
        f"| {s['ttft_p50_ms_edit_turns']:.0f} | {s['e2e_p50_ms_edit_turns']:.0f} "
        f"| {s['e2e_p50_ms_plain_turns']:.0f} | {wall:.0f} |"
    )


if __name__ == "__main__":
    main()
