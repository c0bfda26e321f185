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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--label", required=True, help="name of this arm in the table")
    ap.add_argument("--traces", required=True, help="JSONL trajectories (data/traces/)")
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
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--older-than", type=int, default=2, help="truncate_tool_outputs:N")
    ap.add_argument("--no-policy", action="store_true", help="send the history as recorded")
    ap.add_argument("--concurrency", type=int, default=1, help="sessions in flight at once")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--out", required=True, help="JSON file for the records and the summary")
    args = ap.parse_args()
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
