#!/usr/bin/env python3
"""Soak benchmark of `leyline serve`: many clients for a long time on a small KV pool, then an
erasure check and a slot-leak check (the soak of the "Trust" issue).

What one run does:

1. Starts the server (--server-bin) with two API keys, so two tenants exist, and a KV pool
   of --pool-fraction of the demand: demand = clients x --max-context, the peak context
   (prompt plus max_tokens) each client's plan allows, since every client keeps each of its
   conversations under --max-context tokens. The server's output goes to OUT/server.log.
2. Runs --clients threads for --minutes. Each loops over random actions, each session under
   a random one of the two keys: chat turns in sessions (mode AMORTIZE or FORGET, fixed per
   session; a session is created by POST /v1/sessions or by a first turn that sends
   `leyline.mode` without `session_id`); edits of earlier messages before a turn (replace a
   user, assistant or system message, stub or drop older ones), which the server turns into
   AMORTIZE or FORGET splices; explicit directive batches (POST /v1/sessions/{id}/directives
   on the session's current token range; the conversation then restarts in that session or
   the session is deleted); deletes; disconnects (a request closed right after it is sent,
   or a stream closed after one or two events); sessionless turns; lookups of a session
   under the other key, which must answer 404; and turns of the Messages and Responses
   APIs as Claude Code and Codex send them (system messages inside `messages`, thinking and
   reasoning items, tool round trips, hosted tools, the conversation headers and
   prompt_cache_key, stored responses continued by previous_response_id), with old tool
   results cleared now and then (an edit the server splices). Once per conversation such an
   edited request goes under the other key with the same conversation id: nothing may be
   spliced from the first key's conversation; a stored response looked up under the other
   key must answer 404. A 404 for a session the server dropped, a
   409 (busy) and a 503 (Retry-After) are retried or lead to a new session, never fatal.
3. In FORGET sessions some user messages carry a unique canary (CANARY-<hex> repeated in a
   short paragraph). A later edit replaces, stubs or drops that message; once a FORGET turn
   without it succeeds, the canary is forgotten, and the message prefixes it was sent with
   are kept. At the end, before any cleanup and without flushing, each such prefix is
   probed under both keys (a fresh FORGET session, max_tokens 1): its
   `usage.prompt_tokens_details.cached_tokens` must not reach past the canary's first
   token. Where the canary starts is measured, not guessed: two fresh decoy prompts that
   differ from the canary message only from the canary on are sent first, and the second
   one's cached tokens are the tokens before the canary (a count-based estimate is kept
   beside it as a cross-check). Each probe's own copy of the canary is then forgotten by a
   FORGET turn in its session, so the next probe starts clean. A control canary that was
   never forgotten must be found reachable, or the check proves nothing.
4. Deletes every session it knows, flushes the prefix cache (POST /v1/cache/flush under each
   key; a 404 there is reported as "flush route missing" and the leak check is skipped),
   and reads the pool's used slots from /metrics (target 0).
5. Writes OUT/summary.json and prints a Markdown summary: requests by route and status,
   latency percentiles, panics in the server log, canaries checked / reachable, used slots
   after the flush, resident memory (VmRSS) at start, end of load and end.

Exit status: 0 when there are no panics, no reachable canary, no 5xx but 503 (client or
server side) and no leaked slots (when the flush route exists); 1 when a check fails; 2 when
the run could not be made (bad flags, the server did not start).

Usage (from the repository root; standard library only):

    nice -n 10 python3 scripts/soak.py                    # the full soak: 16 clients, 30 min
    nice -n 10 python3 scripts/soak.py --minutes 2 --clients 4 --out-dir /tmp/soak-short
    python3 scripts/soak.py --server-bin /tmp/leyline-copy --max-context 1000 --seed 7

`python3 scripts/soak.py --help` explains every flag.
"""

import argparse
import collections
import http.client
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Words for generated text; any will do, they only have to tokenize like prose.
WORDS = """
the a river stone bridge market harbor town copper salt wool linen grain barley orchard
winter summer autumn spring morning evening lantern window garden valley mountain forest
meadow north south east west quiet busy old new bright dark slow quick small large careful
merchant sailor baker weaver miller farmer scholar painter clerk captain child traveler
walks carries builds trades counts writes reads paints mends sells buys keeps finds opens
closes remembers forgets asks answers waits rests sings listens under over near beside
behind through along across before after because while although and but or so then
map letter ledger wagon barrel basket rope sail anchor bell tower road path gate wall roof
""".split()

SYSTEMS = (
    "You are a concise assistant. Answer in one short sentence.",
    "You are a helpful assistant for a small harbor town's archive.",
    "You answer questions about trade ledgers briefly and plainly.",
)

STUB = "[earlier message removed]"
CANARY_PREFIX = "CANARY-"
MAX_TOKENS = (8, 24)
# Error codes of a stream that fails after its 200 (the edit or the admission comes after the
# headers) that a small pool explains: the streamed forms of a 503 or a 409.
SSE_RETRY = ("kv_pool_exhausted", "session_busy", "overloaded_error")
# Statuses a client expects on a small pool: counted, retried or worked around.
EXPECTED = (200, 404, 409, 429, 503, "disconnected") + tuple("sse:" + c for c in SSE_RETRY)
RETRY = (409, 429, 503) + tuple("sse:" + c for c in SSE_RETRY)


# First words of decoys: their initials start no canary, no word of WORDS and no other
# decoy, so a decoy shares with the canary message, and with every other text sent after the
# same prefix, exactly the tokens before the canary.
STARTERS = ("Zebra", "Yonder", "Xylophone", "Jasper")


def decoys(n):
    """The two decoys of the `n`-th probe of a prefix."""
    if 2 * n + 1 >= len(STARTERS):
        raise ValueError(f"no decoys left for probe {n}: add STARTERS")
    tail = uuid.uuid4().hex[:8]
    return (f"{STARTERS[2 * n]} crossing {tail} is painted white.",
            f"{STARTERS[2 * n + 1]} clock {tail} keeps steady time.")


# ---------------------------------------------------------------------------------------
# Recording


def route_of(path):
    """The server's metrics label of a path (session ids folded)."""
    path = path.split("?", 1)[0]
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}"
    if path.startswith("/v1/sessions/"):
        if path.endswith("/directives"):
            return "/v1/sessions/{id}/directives"
        return "/v1/sessions/{id}"
    return path


def pct(xs, p):
    """Nearest-rank percentile."""
    if not xs:
        return None
    xs = sorted(xs)
    rank = max(1, math.ceil(p / 100 * len(xs)))
    return xs[min(rank, len(xs)) - 1]


class Stats:
    """Responses by (route, status), latencies by route, action outcomes, anomalies."""

    MAX_ANOMALIES = 200

    def __init__(self):
        self.lock = threading.Lock()
        self.counts = collections.Counter()
        self.latency = collections.defaultdict(list)
        self.actions = collections.Counter()
        self.anomalies = []
        self.anomaly_counts = collections.Counter()

    def record(self, route, status, seconds):
        with self.lock:
            self.counts[(route, str(status))] += 1
            if seconds is not None:
                self.latency[route].append(seconds)

    def action(self, name, outcome):
        with self.lock:
            self.actions[(name, outcome)] += 1

    def anomaly(self, kind, **detail):
        with self.lock:
            self.anomaly_counts[kind] += 1
            if len(self.anomalies) < self.MAX_ANOMALIES:
                self.anomalies.append({"kind": kind, "t": time.time(), **detail})

    def totals(self):
        with self.lock:
            n = sum(self.counts.values())
            ok = sum(v for (_, st), v in self.counts.items() if st == "200")
        return n, ok

    def by_route(self):
        out = collections.defaultdict(dict)
        for (route, status), n in sorted(self.counts.items()):
            out[route][status] = n
        return dict(out)

    def latency_table(self):
        return {
            r: {
                "n": len(v),
                "p50_ms": round(pct(v, 50) * 1e3, 1),
                "p95_ms": round(pct(v, 95) * 1e3, 1),
                "max_ms": round(max(v) * 1e3, 1),
            }
            for r, v in sorted(self.latency.items())
        }


class Resp:
    """One HTTP exchange. `status` is the HTTP status, or a word where there was none:
    timeout, conn_error, disconnected, sse:CODE (an error event with that code in a 200
    stream), stream_cut (a stream that ended without its usage chunk and [DONE])."""

    def __init__(self, status, body=None, seconds=None, headers=None):
        self.status = status
        self.body = body
        self.seconds = seconds
        self.headers = headers or {}
        self.text = ""
        self.usage = None
        self.leyline = None

    @property
    def ok(self):
        return self.status == 200

    def retry_after(self, default):
        try:
            return float(self.headers.get("retry-after", default))
        except ValueError:
            return default

    def brief(self, limit=400):
        b = self.body if isinstance(self.body, str) else json.dumps(self.body)
        return (b or "")[:limit]


def wire(m):
    """A message as sent: role and content only (the client's own marks stay local)."""
    return {"role": m["role"], "content": m["content"]}


def parse_body(raw):
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode(errors="replace")


class Api:
    """The server's HTTP API, one connection per request, every exchange recorded."""

    def __init__(self, port, keys, model, timeout, stats):
        self.port, self.keys = port, keys
        self.model, self.timeout, self.stats = model, timeout, stats

    def _conn(self, timeout=None):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout or self.timeout)

    def _headers(self, key):
        return {"Content-Type": "application/json", "Authorization": "Bearer " + self.keys[key]}

    def request(self, method, path, body=None, key=0, timeout=None, label=None,
                extra_headers=None):
        route = label or route_of(path)
        data = None if body is None else json.dumps(body).encode()
        t0 = time.perf_counter()
        conn = self._conn(timeout)
        try:
            conn.request(method, path, body=data,
                         headers={**self._headers(key), **(extra_headers or {})})
            resp = conn.getresponse()
            raw = resp.read()
            headers = {k.lower(): v for k, v in resp.getheaders()}
        except socket.timeout:
            self.stats.record(route, "timeout", None)
            return Resp("timeout", seconds=time.perf_counter() - t0)
        except (OSError, http.client.HTTPException) as e:
            self.stats.record(route, "conn_error", None)
            return Resp("conn_error", body=str(e), seconds=time.perf_counter() - t0)
        finally:
            conn.close()
        dt = time.perf_counter() - t0
        self.stats.record(route, resp.status, dt)
        return Resp(resp.status, parse_body(raw), dt, headers)

    def chat_body(self, messages, *, session_id=None, mode=None, max_tokens=1, temperature=0.0,
                  stream=False):
        body = {
            "model": self.model,
            "messages": [wire(m) for m in messages],
            "max_tokens": max_tokens,
            "temperature": temperature,
        }
        if session_id:
            body["session_id"] = session_id
        if mode:
            body["leyline"] = {"mode": mode}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def chat(self, messages, key, stream=False, **fields):
        """A chat completion; on 200 `text`, `usage` and `leyline` are filled in."""
        body = self.chat_body(messages, stream=stream, **fields)
        if stream:
            return self._stream(body, key)
        r = self.request("POST", "/v1/chat/completions", body, key)
        if r.ok and isinstance(r.body, dict):
            choices = r.body.get("choices") or [{}]
            r.text = (choices[0].get("message") or {}).get("content") or ""
            r.usage = r.body.get("usage")
            r.leyline = r.body.get("leyline")
        return r

    def _sse(self, route, body, key, extra, on_data):
        """POSTs `body` to `route` and feeds each `data:` payload of a 200 stream to `on_data`
        (bytes; it returns True to stop reading). Returns `(resp, seconds, headers)`: `resp`
        is the recorded answer when there was no 200 stream (another status, a timeout, a
        lost connection, a payload `on_data` could not parse), else None and the caller
        records the stream's outcome."""
        t0 = time.perf_counter()
        conn = self._conn()
        headers = {}
        try:
            conn.request("POST", route, body=json.dumps(body).encode(),
                         headers={**self._headers(key), **extra})
            resp = conn.getresponse()
            headers = {k.lower(): v for k, v in resp.getheaders()}
            if resp.status != 200:
                raw = resp.read()
                dt = time.perf_counter() - t0
                self.stats.record(route, resp.status, dt)
                return Resp(resp.status, parse_body(raw), dt, headers), dt, headers
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if line.startswith(b"data:") and on_data(line[5:].strip()):
                    break
        except socket.timeout:
            self.stats.record(route, "timeout", None)
            return Resp("timeout", seconds=time.perf_counter() - t0), None, headers
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.stats.record(route, "conn_error", None)
            return (Resp("conn_error", body=str(e), seconds=time.perf_counter() - t0), None,
                    headers)
        finally:
            conn.close()
        return None, time.perf_counter() - t0, headers

    def _stream(self, body, key):
        route = "/v1/chat/completions"
        st = {"parts": [], "usage": None, "leyline": None, "error": None, "done": False}

        def on_data(payload):
            if payload == b"[DONE]":
                st["done"] = True
                return True
            chunk = json.loads(payload)
            if "error" in chunk:
                st["error"] = chunk["error"]
                return False
            for c in chunk.get("choices") or []:
                st["parts"].append((c.get("delta") or {}).get("content") or "")
            st["usage"] = chunk.get("usage") or st["usage"]
            st["leyline"] = chunk.get("leyline") or st["leyline"]
            return False

        early, dt, headers = self._sse(route, body, key, {}, on_data)
        if early is not None:
            return early
        error = st["error"]
        if error is not None:
            status = f"sse:{error.get('code') if isinstance(error, dict) else None}"
        elif not st["done"] or st["usage"] is None:
            status = "stream_cut"
        else:
            status = 200
        self.stats.record(route, status, dt)
        r = Resp(status, {"error": error} if error else None, dt, headers)
        r.text, r.usage, r.leyline = "".join(st["parts"]), st["usage"], st["leyline"]
        return r

    def post_api(self, route, body, key, headers=None, stream=False):
        """A Messages or Responses request; on 200 `usage` and `leyline` are filled in (for a
        stream, from its final events: `message_delta` / `response.completed` or
        `.incomplete`). A stream's error event gives status `sse:TYPE` (Messages) or
        `sse:CODE` (Responses); one that ends without its final event, `stream_cut`."""
        extra = dict(headers or {})
        if not stream:
            r = self.request("POST", route, body, key, extra_headers=extra)
            if r.ok and isinstance(r.body, dict):
                r.usage, r.leyline = r.body.get("usage"), r.body.get("leyline")
            return r
        messages = route == "/v1/messages"
        st = {"usage": {}, "leyline": None, "error": None, "done": False, "body": None}

        def on_data(payload):
            ev = json.loads(payload)
            kind = ev.get("type")
            if kind == "error":
                e = ev.get("error") or ev
                st["error"] = ((e.get("type") if messages else e.get("code"))
                               or e.get("type") or e.get("code") or "unknown")
            elif kind == "response.failed":
                st["error"] = ((ev.get("response") or {}).get("error") or {}).get("code") or "failed"
            elif kind == "message_start":
                st["usage"].update((ev.get("message") or {}).get("usage") or {})
                st["body"] = {"content": []}
            elif kind == "content_block_start" and st["body"] is not None:
                st["body"]["content"].append(dict(ev.get("content_block") or {}))
            elif kind == "content_block_delta" and st["body"] and st["body"]["content"]:
                block, d = st["body"]["content"][-1], ev.get("delta") or {}
                if d.get("type") == "text_delta":
                    block["text"] = block.get("text", "") + d.get("text", "")
                elif d.get("type") == "input_json_delta":
                    block["partial"] = block.get("partial", "") + d.get("partial_json", "")
            elif kind == "message_delta":
                st["usage"].update(ev.get("usage") or {})
                st["leyline"] = ev.get("leyline") or st["leyline"]
            elif kind in ("response.completed", "response.incomplete"):
                st["body"] = ev.get("response") or {}
                st["usage"] = st["body"].get("usage") or {}
                st["leyline"] = st["body"].get("leyline")
            if kind in ("message_stop", "response.completed", "response.incomplete"):
                st["done"] = True
                return True
            return False

        early, dt, headers_in = self._sse(route, body, key, extra, on_data)
        if early is not None:
            return early
        error = st["error"]
        status = f"sse:{error}" if error else (200 if st["done"] else "stream_cut")
        self.stats.record(route, status, dt)
        r = Resp(status, st["body"], dt, headers_in)
        r.usage, r.leyline = st["usage"], st["leyline"]
        return r

    def disconnect(self, body, key, events):
        """Sends a chat request and closes the socket: at once (events 0), or after that
        many SSE events of a stream. Returns the status counted."""
        route = "/v1/chat/completions"
        conn = self._conn()
        status = "disconnected"
        try:
            conn.request("POST", route, body=json.dumps(body).encode(), headers=self._headers(key))
            if events:
                resp = conn.getresponse()
                if resp.status != 200:
                    status = resp.status
                    resp.read()
                else:
                    seen = 0
                    while seen < events:
                        line = resp.readline()
                        if not line:
                            break
                        seen += line.startswith(b"data:")
        except socket.timeout:
            status = "timeout"
        except (OSError, http.client.HTTPException):
            status = "conn_error"
        finally:
            conn.close()
        # A disconnect's time says nothing of the server's.
        self.stats.record(route, status, None)
        return status


def call_with_retry(fn, tries):
    """Calls `fn` until it answers something other than 409, 429 or 503 (or their streamed
    forms), at most `tries` times, sleeping as the server asks (Retry-After) or briefly."""
    r = fn()
    for _ in range(tries - 1):
        if r.status not in RETRY:
            break
        wait = r.retry_after(1.0) if r.status == 503 else 0.5 + random.random()
        time.sleep(min(wait, 10.0))
        r = fn()
    return r


# ---------------------------------------------------------------------------------------
# Workload


def words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def sentence(rng, lo, hi):
    s = words(rng, lo, hi)
    return s[:1].upper() + s[1:] + "."


def paragraph(rng, lo, hi):
    return " ".join(sentence(rng, 4, 12) for _ in range(rng.randint(lo, hi)))


def est_added(content):
    """Tokens of a message, rounded well up (hex canaries take about a token per 2 chars)."""
    return len(content) // 2 + 8


def est_removed(content):
    """Tokens of a message, rounded down."""
    return len(content) // 8 + 3


class Canary:
    """A canary placed in a FORGET session, and every message prefix it was sent with."""

    def __init__(self, tag, key):
        self.tag = tag
        self.key = key
        self.variants = []
        self._seen = set()
        self.how = None
        self.forgotten = None

    def note_prefix(self, messages):
        for i, m in enumerate(messages):
            if m.get("canary") == self.tag:
                v = [wire(x) for x in messages[: i + 1]]
                s = json.dumps(v)
                if s not in self._seen:
                    self._seen.add(s)
                    self.variants.append(v)
                return

    def in_messages(self, messages):
        return any(self.tag in m["content"] for m in messages)


class Conv:
    """A session as its client knows it: key, mode, id, and the message history."""

    def __init__(self, key, mode, system):
        self.key, self.mode = key, mode
        self.sid = None
        self.messages = [{"role": "system", "content": system}]
        # The messages of the last 200 turn (reply included) and their tokens.
        self.base = None
        # After a directive batch the history no longer describes the session.
        self.stale = False
        self.pending = []


class ApiConv:
    """A Messages or Responses conversation: key, conversation id (the session header and
    prompt_cache_key), its items in the API's own shape, the calls awaiting results."""

    def __init__(self, kind, key, system, stored=False):
        self.kind, self.key, self.system, self.stored = kind, key, system, stored
        self.cid = str(uuid.uuid4())
        self.items = []
        self.open_calls = []
        self.prompt_tokens = 0
        self.last_id = None
        self.cross_checked = False


LOOKUP_SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}},
                 "required": ["query"]}
LOOKUP_TOOL_ANTHROPIC = {"name": "lookup", "description": "Looks a word up in the archive.",
                         "input_schema": LOOKUP_SCHEMA}
LOOKUP_TOOL_OPENAI = {"type": "function", "name": "lookup",
                      "description": "Looks a word up in the archive.",
                      "parameters": LOOKUP_SCHEMA}
CLEARED = "[Old tool result content cleared]"


class Shared:
    """What the clients share: known sessions, canaries, peak context, the stop flag."""

    def __init__(self, args):
        self.lock = threading.Lock()
        self.sessions = {}
        self.placed = 0
        self.forgotten = []
        self.untracked = 0
        self.peak_context = 0
        self.max_canaries = args.max_canaries
        self.stop = threading.Event()

    def add_session(self, sid, key):
        with self.lock:
            self.sessions[sid] = key

    def drop_session(self, sid):
        with self.lock:
            self.sessions.pop(sid, None)

    def take_canary_slot(self):
        with self.lock:
            if self.placed >= self.max_canaries:
                return False
            self.placed += 1
            return True


ACTIONS = (
    ("turn", 48),
    ("edit", 20),
    ("batch", 7),
    ("delete", 5),
    ("disconnect", 6),
    ("plain", 6),
    ("isolation", 3),
    ("messages", 10),
    ("responses", 10),
)


class Client(threading.Thread):
    def __init__(self, idx, api, shared, args, seed, deadline):
        super().__init__(name=f"client-{idx}", daemon=True)
        self.api, self.shared, self.args = api, shared, args
        self.rng = random.Random(seed)
        self.convs = []
        self.api_convs = []
        self.deadline = deadline

    def run(self):
        names = [a for a, _ in ACTIONS]
        weights = [w for _, w in ACTIONS]
        while not self.shared.stop.is_set() and time.monotonic() < self.deadline:
            name = self.rng.choices(names, weights)[0]
            try:
                outcome = getattr(self, "act_" + name)()
            except Exception:
                outcome = "exception"
                self.api.stats.anomaly("client_exception", action=name,
                                       traceback=traceback.format_exc())
            self.api.stats.action(name, outcome)

    # -- bookkeeping --------------------------------------------------------------------

    def new_conv(self):
        rng = self.rng
        conv = Conv(rng.randrange(2), rng.choice(("amortize", "forget")), rng.choice(SYSTEMS))
        if rng.random() < 0.5:
            r = call_with_retry(lambda: self.api.request("POST", "/v1/sessions", {}, conv.key),
                                self.args.retries)
            if not r.ok:
                self.unexpected(r, "POST /v1/sessions")
                return None
            conv.sid = r.body["id"]
            self.shared.add_session(conv.sid, conv.key)
        self.convs.append(conv)
        return conv

    def drop_conv(self, conv, gone):
        """Stops using `conv` (`gone`: its server session is gone too); its pending
        canaries are no longer tracked."""
        if conv in self.convs:
            self.convs.remove(conv)
        with self.shared.lock:
            self.shared.untracked += len(conv.pending)
        conv.pending = []
        if gone and conv.sid:
            self.shared.drop_session(conv.sid)

    def pick(self, need_sid=False, min_messages=0, fresh=False):
        cands = [
            c for c in self.convs
            if (c.sid or not need_sid) and len(c.messages) >= min_messages
            and not (fresh and c.stale)
        ]
        return self.rng.choice(cands) if cands else None

    def conv_for_turn(self):
        room = len(self.convs) < self.args.sessions_per_client
        if not self.convs or (room and self.rng.random() < 0.25):
            return self.new_conv()
        return self.rng.choice(self.convs)

    def unexpected(self, r, what, **extra):
        """Records what a sound server never answers this client."""
        if r.status in EXPECTED:
            return
        kind = f"status_{r.status}" if isinstance(r.status, int) else r.status
        self.api.stats.anomaly(kind, request=what, response=r.brief(), **extra)

    def restart(self, conv):
        """A new conversation in the same session."""
        conv.messages = [{"role": "system", "content": self.rng.choice(SYSTEMS)}]
        conv.base = None
        conv.stale = False
        for c in conv.pending:
            c.how = c.how or "restart"

    def user_message(self, conv):
        rng = self.rng
        if (conv.mode == "forget" and rng.random() < self.args.canary_rate
                and self.shared.take_canary_slot()):
            tag = CANARY_PREFIX + uuid.uuid4().hex
            # The text before the canary ends in a newline: the canary's first token then
            # starts a word, in the decoys alike.
            before = "" if rng.random() < 0.2 else sentence(rng, 3, 10) + "\n"
            content = f"{before}{tag} is the vault phrase. Tell {tag} to nobody. Once more: {tag}."
            conv.pending.append(Canary(tag, conv.key))
            return {"role": "user", "content": content, "canary": tag}
        return {"role": "user", "content": paragraph(rng, 1, 4)}

    def estimate(self, conv, msgs):
        """Tokens of `msgs`: the last turn's exact count, corrected by what changed."""
        if conv.base is None:
            return 16 + sum(est_added(m["content"]) for m in msgs)
        old, tokens = conv.base
        key = lambda m: (m["role"], m["content"])  # noqa: E731
        before = collections.Counter(map(key, old))
        after = collections.Counter(map(key, msgs))
        added = sum(est_added(c) * n for (_, c), n in (after - before).items())
        removed = sum(est_removed(c) * n for (_, c), n in (before - after).items())
        return tokens + added - removed

    def fit(self, conv, base, new, max_tokens):
        """`base` with its oldest messages dropped until base + new + max_tokens stays under
        --max-context; None when that takes all of it."""
        base = list(base)
        while self.estimate(conv, base + new) + max_tokens > self.args.max_context:
            if len(base) <= 2:
                return None
            dropped = base[1:3]
            del base[1:3]
            for c in conv.pending:
                if c.in_messages(dropped) and not c.in_messages(base + new):
                    c.how = c.how or "trim"
        return base

    # -- actions ------------------------------------------------------------------------

    def send_turn(self, conv, base, new, what="turn"):
        """One turn: `base` (the history, maybe edited) plus the `new` messages."""
        rng = self.rng
        max_tokens = rng.randint(*MAX_TOKENS)
        fitted = self.fit(conv, base, new, max_tokens)
        if fitted is None:
            self.restart(conv)
            fitted = self.fit(conv, conv.messages, new, max_tokens)
            if fitted is None:
                return "too_long"
        msgs = fitted + new
        for c in conv.pending:
            c.note_prefix(msgs)
        stream = rng.random() < 0.25
        temperature = rng.choice((0.0, 0.7))
        sid_before = conv.sid
        r = call_with_retry(
            lambda: self.api.chat(msgs, conv.key, stream=stream, session_id=conv.sid,
                                  mode=conv.mode, max_tokens=max_tokens, temperature=temperature),
            self.args.retries,
        )
        if r.ok:
            sid = (r.leyline or {}).get("session_id")
            if conv.sid is None:
                if not sid:
                    self.api.stats.anomaly("no_session_id", request=what, response=r.brief())
                    self.drop_conv(conv, gone=False)
                    return "no_session_id"
                conv.sid = sid
                self.shared.add_session(sid, conv.key)
            elif sid != conv.sid:
                self.api.stats.anomaly("wrong_session_id", request=what, sent=conv.sid, got=sid)
            conv.messages = msgs + [{"role": "assistant", "content": r.text}]
            usage = r.usage or {}
            ctx = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            conv.base = ([dict(m) for m in conv.messages], ctx)
            with self.shared.lock:
                self.shared.peak_context = max(self.shared.peak_context, ctx)
            if conv.mode == "forget":
                self.settle_canaries(conv, msgs, r)
            return "ok"
        self.unexpected(r, what, session=conv.sid, mode=conv.mode, messages=len(msgs))
        if r.status == 404:
            self.drop_conv(conv, gone=True)
            return "404"
        if sid_before is None:
            # The request may have made a session whose id never came back: what it holds
            # is out of reach, canaries included.
            self.drop_conv(conv, gone=False)
            return f"failed_{r.status}"
        if r.status == 409:
            # Busy past the retries (a disconnected or timed-out request runs on): left to
            # the final cleanup.
            self.drop_conv(conv, gone=False)
            return "busy"
        conv.messages = fitted
        conv.base = None
        return f"failed_{r.status}"

    def settle_canaries(self, conv, msgs, r):
        """After a 200 FORGET turn: the canaries its prompt no longer holds are forgotten."""
        keep = []
        for c in conv.pending:
            if c.in_messages(msgs):
                keep.append(c)
            elif c.variants:
                c.forgotten = {
                    "how": c.how or "edit",
                    "session": conv.sid,
                    "t": time.time(),
                    "leyline": r.leyline,
                    "usage": r.usage,
                }
                with self.shared.lock:
                    self.shared.forgotten.append(c)
        conv.pending = keep

    def act_turn(self):
        conv = self.conv_for_turn()
        if conv is None:
            return "no_session"
        if conv.stale:
            self.restart(conv)
        return self.send_turn(conv, conv.messages, [self.user_message(conv)])

    def act_edit(self):
        conv = self.pick(need_sid=True, min_messages=5, fresh=True)
        if conv is None:
            return self.act_turn()
        rng = self.rng
        msgs = [dict(m) for m in conv.messages]
        marked = [c for c in conv.pending if any(m.get("canary") == c.tag for m in msgs)]
        if marked and rng.random() < 0.6:
            c = rng.choice(marked)
            i = next(k for k, m in enumerate(msgs) if m.get("canary") == c.tag)
            if rng.random() < 0.6:
                keep = msgs[i]["content"].split(c.tag, 1)[0] if rng.random() < 0.5 else ""
                msgs[i] = {"role": "user", "content": keep + sentence(rng, 4, 14)}
                kind = "replace"
            elif rng.random() < 0.5:
                msgs[i] = {"role": "user", "content": STUB}
                kind = "stub"
            else:
                pair = i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant"
                del msgs[i:i + 2 if pair else i + 1]
                kind = "drop"
            # The model may have echoed the canary: no message keeps it.
            for m in msgs:
                if c.tag in m["content"]:
                    m["content"] = m["content"].replace(c.tag, "the phrase")
            c.how = c.how or kind
        else:
            kinds = ("user", "assistant", "stub", "drop", "system")
            kind = rng.choices(kinds, (30, 25, 20, 20, 5))[0]
            older = range(1, len(msgs) - 1)
            if kind == "system":
                msgs[0] = {"role": "system",
                           "content": rng.choice(SYSTEMS) + " " + sentence(rng, 2, 6)}
            elif kind == "drop":
                i = rng.choice(older)
                del msgs[i:i + 2]
            else:
                idx = [k for k in older if kind == "stub" or msgs[k]["role"] == kind]
                if not idx:
                    return self.act_turn()
                i = rng.choice(idx)
                if kind == "stub":
                    text = STUB
                elif kind == "user":
                    text = paragraph(rng, 1, 3)
                else:
                    text = sentence(rng, 3, 12)
                msgs[i] = {"role": msgs[i]["role"], "content": text}
            for c in conv.pending:
                if not c.in_messages(msgs):
                    c.how = c.how or kind
        return self.send_turn(conv, msgs, [self.user_message(conv)], what=f"edit:{kind}")

    def act_batch(self):
        conv = self.pick(need_sid=True, min_messages=3)
        if conv is None:
            return self.act_turn()
        r = self.api.request("GET", f"/v1/sessions/{conv.sid}", None, conv.key)
        if r.status == 404:
            self.drop_conv(conv, gone=True)
            return "404"
        if not r.ok:
            self.unexpected(r, "GET session")
            return f"failed_{r.status}"
        length = r.body.get("length", 0)
        if length < 12 or r.body.get("busy"):
            return "skipped"
        rng = self.rng
        n = rng.randint(1, 3)
        points = sorted(rng.sample(range(1, length + 1), 2 * n))
        directives = []
        for k in range(n):
            start, end = points[2 * k], points[2 * k + 1]
            if rng.random() < 0.2:
                end = start  # an insertion
            text = words(rng, 0, 8) if start < end else words(rng, 1, 6)
            directives.append({"start": start, "end": end, "text": text})
        body = {"mode": conv.mode, "directives": directives}
        path = f"/v1/sessions/{conv.sid}/directives"
        r = call_with_retry(lambda: self.api.request("POST", path, body, conv.key),
                            self.args.retries)
        if r.status == 404:
            self.drop_conv(conv, gone=True)
            return "404"
        if r.status == 400:
            # Shed between the GET and the batch (its KV went to other work), the session
            # holds fewer tokens than the batch names.
            now = self.api.request("GET", f"/v1/sessions/{conv.sid}", None, conv.key)
            if now.ok and now.body.get("length", 0) < max(d["end"] for d in directives):
                self.api.stats.anomaly("batch_after_shedding", length_before=length,
                                       length_now=now.body.get("length"), response=r.brief())
                return "shed_meanwhile"
        if not r.ok:
            self.unexpected(r, "directives", body=body, length=length)
            return f"failed_{r.status}"
        if r.body.get("length_before") != length:
            self.api.stats.anomaly("batch_length_mismatch", get_length=length,
                                   response=r.brief())
        conv.stale = True
        for c in conv.pending:
            c.how = c.how or "batch"
        if rng.random() < 0.4:
            self.delete(conv)
        return "ok"

    def delete(self, conv):
        if conv.sid is None:
            self.drop_conv(conv, gone=False)
            return "ok"
        r = call_with_retry(
            lambda: self.api.request("DELETE", f"/v1/sessions/{conv.sid}", None, conv.key),
            self.args.retries,
        )
        if r.ok or r.status == 404:
            self.drop_conv(conv, gone=True)
            return "ok" if r.ok else "404"
        self.unexpected(r, "DELETE session")
        return f"failed_{r.status}"

    def act_delete(self):
        conv = self.pick()
        return self.delete(conv) if conv else "skipped"

    def act_disconnect(self):
        """A request abandoned by its client: in a session (a plain append, never an edit or
        a canary) or without one."""
        rng = self.rng
        conv = self.pick(need_sid=True, fresh=True)
        events = rng.choice((0, 1, 2))
        stream = events > 0
        max_tokens = rng.randint(*MAX_TOKENS)
        if conv is not None and rng.random() < 0.7:
            new = [{"role": "user", "content": paragraph(rng, 1, 3)}]
            base = self.fit(conv, conv.messages, new, max_tokens)
            if base is None:
                return "skipped"
            msgs = base + new
            for c in conv.pending:
                c.note_prefix(msgs)
            body = self.api.chat_body(msgs, session_id=conv.sid, mode=conv.mode,
                                      max_tokens=max_tokens, temperature=0.7, stream=stream)
            key = conv.key
        else:
            msgs = [{"role": "system", "content": rng.choice(SYSTEMS)},
                    {"role": "user", "content": paragraph(rng, 1, 4)}]
            body = self.api.chat_body(msgs, max_tokens=max_tokens, temperature=0.7, stream=stream)
            key = rng.randrange(2)
            conv = None
        status = self.api.disconnect(body, key, events)
        if status == 404 and conv is not None:
            self.drop_conv(conv, gone=True)
        return "stream" if stream else "closed"

    def act_plain(self):
        rng = self.rng
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)},
                {"role": "user", "content": paragraph(rng, 1, 5)}]
        key, stream = rng.randrange(2), rng.random() < 0.3
        fields = {"max_tokens": rng.randint(*MAX_TOKENS), "temperature": rng.choice((0.0, 0.7))}
        r = call_with_retry(lambda: self.api.chat(msgs, key, stream=stream, **fields),
                            self.args.retries)
        self.unexpected(r, "plain turn")
        return "ok" if r.ok else f"failed_{r.status}"

    def act_isolation(self):
        conv = self.pick(need_sid=True)
        if conv is None:
            return "skipped"
        r = self.api.request("GET", f"/v1/sessions/{conv.sid}", None, 1 - conv.key,
                             label="/v1/sessions/{id} (other key)")
        if r.status != 404:
            self.api.stats.anomaly("cross_key_session_access", session=conv.sid,
                                   status=r.status, response=r.brief())
            return "violation"
        return "ok"


    # -- Messages and Responses APIs --------------------------------------------------

    def api_conv(self, kind):
        """A Messages or Responses conversation of this client: a running one, or a new one
        (under a random key, with its own conversation id) when there is none or by chance."""
        convs = [c for c in self.api_convs if c.kind == kind]
        if convs and self.rng.random() < 0.8:
            return self.rng.choice(convs)
        if len(convs) >= self.args.sessions_per_client:
            self.api_convs.remove(convs[0])
        conv = ApiConv(kind, self.rng.randrange(2), self.rng.choice(SYSTEMS),
                       stored=kind == "responses" and self.rng.random() < 0.3)
        self.api_convs.append(conv)
        return conv

    def api_turn(self, conv, body, headers, what):
        """Sends one Messages or Responses turn (streamed or not) with retries; returns the
        response, recording what a sound server never answers."""
        stream = self.rng.random() < 0.4
        body = dict(body, stream=True) if stream else body
        route = "/v1/messages" if conv.kind == "messages" else "/v1/responses"
        r = call_with_retry(
            lambda: self.api.post_api(route, body, conv.key, headers, stream=stream),
            self.args.retries)
        if not r.ok:
            self.unexpected(r, what, stream=stream)
        elif not isinstance(r.usage, dict) or not isinstance(r.leyline, dict):
            self.api.stats.anomaly("no_usage", request=what, stream=stream, response=r.brief())
        return r

    def check_cross_key(self, conv, body, headers, what):
        """The conversation's edited history, sent once under the other key with the same
        conversation id: that key never saw it, so nothing may be spliced from it."""
        conv.cross_checked = True
        route = "/v1/messages" if conv.kind == "messages" else "/v1/responses"
        body = dict(body, max_tokens=1) if conv.kind == "messages" else dict(
            body, max_output_tokens=1)
        r = call_with_retry(
            lambda: self.api.post_api(route, body, 1 - conv.key, headers), self.args.retries)
        if not r.ok:
            self.unexpected(r, what + " (other key)")
            return f"failed_{r.status}"
        rep = r.leyline or {}
        if rep.get("spliced") or rep.get("directives_applied"):
            self.api.stats.anomaly("cross_key_conversation", request=what, leyline=rep)
            return "violation"
        return "cross_key_ok"

    def fits(self, conv):
        return conv.prompt_tokens + 2 * MAX_TOKENS[1] + 200 < self.args.max_context

    def act_messages(self):
        """A Messages turn as Claude Code sends one: system blocks with cache_control, a
        system message inside `messages`, thinking blocks in the history, tool round trips,
        the session header; now and then an old tool result cleared (an edit), and once per
        conversation the same request under the other key."""
        conv = self.api_conv("messages")
        rng = self.rng
        if not self.fits(conv):
            self.api_convs.remove(conv)
            return "restarted"
        history = json.loads(json.dumps(conv.items))
        edited = False
        results = [b for m in history if m["role"] == "user" and isinstance(m["content"], list)
                   for b in m["content"] if b.get("type") == "tool_result"
                   and b.get("content") != CLEARED]
        if len(results) > 1 and rng.random() < 0.4:
            rng.choice(results[:-1])["content"] = CLEARED
            edited = True
        new = []
        if history and rng.random() < 0.3:
            new.append({"role": "system", "content": sentence(rng, 4, 10)})
        blocks = [{"type": "tool_result", "tool_use_id": i, "content": paragraph(rng, 1, 2)}
                  for i in conv.open_calls]
        if not blocks and history and rng.random() < 0.4:
            # A call the model did not make, as a client's own history may hold: appended to
            # the last reply, answered in the next message.
            cid = "toolu_" + uuid.uuid4().hex[:12]
            history[-1]["content"].append({"type": "tool_use", "id": cid, "name": "lookup",
                                           "input": {"query": rng.choice(WORDS)}})
            blocks = [{"type": "tool_result", "tool_use_id": cid,
                       "content": paragraph(rng, 1, 2)}]
        blocks.append({"type": "text", "text": paragraph(rng, 1, 3),
                       "cache_control": {"type": "ephemeral"}})
        new.append({"role": "user", "content": blocks})
        body = {
            "model": self.api.model,
            "max_tokens": rng.randint(*MAX_TOKENS),
            "system": [{"type": "text", "text": conv.system,
                        "cache_control": {"type": "ephemeral"}}],
            "messages": history + new,
            "tools": [LOOKUP_TOOL_ANTHROPIC, {"type": "web_search_20250305",
                                              "name": "web_search"}],
            "thinking": {"type": rng.choice(("adaptive", "disabled"))},
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                              "keep": "all"}]},
            "metadata": {"user_id": f"soak-{conv.key}"},
            "temperature": rng.choice((0.0, 0.7)),
        }
        headers = {"anthropic-version": "2023-06-01", "x-claude-code-session-id": conv.cid}
        what = "messages" + (":edit" if edited else "")
        if edited and not conv.cross_checked and rng.random() < 0.3:
            return self.check_cross_key(conv, body, headers, what)
        r = self.api_turn(conv, body, headers, what)
        if not r.ok:
            return f"failed_{r.status}"
        content = []
        for b in (r.body or {}).get("content") or []:
            if b.get("type") == "text":
                content.append({"type": "text", "text": b.get("text", "")})
            elif b.get("type") == "tool_use":
                args = b.get("input")
                if args is None or "partial" in b:
                    try:
                        args = json.loads(b.get("partial") or "{}")
                    except ValueError:
                        self.api.stats.anomaly("bad_tool_input", response=b)
                        args = {}
                content.append({"type": "tool_use", "id": b.get("id"), "name": b.get("name"),
                                "input": args})
        if rng.random() < 0.2:
            # What a thinking model's reply holds; the server drops it from the prompt.
            content.insert(0, {"type": "thinking", "thinking": sentence(rng, 3, 8),
                               "signature": uuid.uuid4().hex})
        if not any(b["type"] == "text" for b in content):
            content.append({"type": "text", "text": "."})
        conv.open_calls = [b["id"] for b in content if b["type"] == "tool_use"]
        conv.items = history + new + [{"role": "assistant", "content": content}]
        u = r.usage or {}
        conv.prompt_tokens = sum(int(u.get(k) or 0) for k in (
            "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
        return "ok_spliced" if (r.leyline or {}).get("spliced") else "ok"

    def act_responses(self):
        """A Responses turn as Codex sends one: instructions, a developer message, input_text
        parts, function_call / function_call_output / reasoning items, a hosted tool,
        prompt_cache_key; some conversations stored and continued by previous_response_id
        (with a lookup of the stored response under the other key, which must be a 404)."""
        conv = self.api_conv("responses")
        rng = self.rng
        if not self.fits(conv):
            self.api_convs.remove(conv)
            if conv.last_id and rng.random() < 0.5:
                self.api.request("DELETE", f"/v1/responses/{conv.last_id}", None, conv.key)
            return "restarted"
        history = json.loads(json.dumps(conv.items))
        edited = False
        outputs = [i for i in history if i.get("type") == "function_call_output"
                   and i.get("output") != CLEARED]
        if not conv.stored and len(outputs) > 1 and rng.random() < 0.4:
            rng.choice(outputs[:-1])["output"] = CLEARED
            edited = True
        new = []
        if not history:
            new.append({"role": "developer",
                        "content": [{"type": "input_text", "text": sentence(rng, 4, 10)}]})
        calls = list(conv.open_calls)
        if not calls and history and rng.random() < 0.4:
            cid = "call_" + uuid.uuid4().hex[:12]
            new.append({"type": "function_call", "call_id": cid, "name": "lookup",
                        "arguments": json.dumps({"query": rng.choice(WORDS)})})
            calls = [cid]
        for cid in calls:
            new.append({"type": "function_call_output", "call_id": cid,
                        "output": paragraph(rng, 1, 2)})
        new.append({"role": "user",
                    "content": [{"type": "input_text", "text": paragraph(rng, 1, 3)}]})
        body = {
            "model": self.api.model,
            "instructions": conv.system,
            "input": new if conv.stored and conv.last_id else history + new,
            "tools": [LOOKUP_TOOL_OPENAI, {"type": "web_search"}],
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "reasoning": {"summary": "auto"},
            "include": ["reasoning.encrypted_content"],
            "store": conv.stored,
            "prompt_cache_key": conv.cid,
            "max_output_tokens": rng.randint(*MAX_TOKENS),
            "temperature": rng.choice((0.0, 0.7)),
        }
        if conv.stored and conv.last_id:
            body["previous_response_id"] = conv.last_id
        headers = {"session-id": conv.cid}
        what = "responses" + (":edit" if edited else "") + (":stored" if conv.stored else "")
        if edited and not conv.cross_checked and rng.random() < 0.3:
            return self.check_cross_key(conv, body, headers, what)
        r = self.api_turn(conv, body, headers, what)
        if r.status == 404 and conv.stored:
            # Evicted from the store (or never stored): the client starts over.
            self.api_convs.remove(conv)
            return "404"
        if not r.ok:
            return f"failed_{r.status}"
        out = []
        for item in (r.body or {}).get("output") or []:
            if item.get("type") == "message":
                out.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": p.get("text", "")}
                    for p in item.get("content") or [] if p.get("type") == "output_text"]})
            elif item.get("type") == "function_call":
                out.append({"type": "function_call", "call_id": item.get("call_id"),
                            "name": item.get("name"), "arguments": item.get("arguments", "")})
        if rng.random() < 0.2:
            out.insert(0, {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex[:12],
                           "summary": []})
        conv.open_calls = [i["call_id"] for i in out if i["type"] == "function_call"]
        conv.items = history + new + out
        conv.prompt_tokens = int((r.usage or {}).get("input_tokens") or 0)
        rid = (r.body or {}).get("id")
        if conv.stored and rid:
            conv.last_id = rid
            other = self.api.request("GET", f"/v1/responses/{rid}", None, 1 - conv.key,
                                     label="/v1/responses/{id} (other key)")
            if other.status != 404:
                self.api.stats.anomaly("cross_key_response", response_id=rid,
                                       status=other.status, response=other.brief())
                return "violation"
        return "ok_spliced" if (r.leyline or {}).get("spliced") else "ok"


# ---------------------------------------------------------------------------------------
# Server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def read_metrics(api):
    r = api.request("GET", "/metrics", None, 0)
    if not r.ok or not isinstance(r.body, str):
        return None
    return parse_metrics(r.body)


def gauges(metrics):
    """The unlabelled values of /metrics, without the `leyline_` prefix."""
    return {k[len("leyline_"):]: v for k, v in (metrics or {}).items()
            if k.startswith("leyline_") and "{" not in k}


def server_responses(metrics):
    """The server's own leyline_http_responses_total, as {route: {status: n}}."""
    out = collections.defaultdict(dict)
    for name, v in (metrics or {}).items():
        if name.startswith("leyline_http_responses_total{"):
            inner = name[name.index("{") + 1:-1]
            labels = dict(p.split("=", 1) for p in inner.split(","))
            out[labels["route"].strip('"')][labels["status"].strip('"')] = int(v)
    return dict(out)


class Server:
    def __init__(self, args, keys, pool, out_dir):
        self.port = args.port or free_port()
        self.cmd = [
            args.server_bin, "serve",
            "--addr", f"127.0.0.1:{self.port}",
            "--api-key", ",".join(keys),
            "--kv-slots", str(pool),
            "--max-sessions", str(args.max_sessions),
            "--session-idle-timeout", str(args.session_idle_timeout),
        ]
        if args.model:
            self.cmd += ["--model", args.model]
        for extra in args.server_arg:
            self.cmd += extra.split()
        self.log_path = os.path.join(out_dir, "server.log")
        self.proc = None
        self.log = None
        self.exit_code = None

    def start(self, timeout):
        env = dict(os.environ)
        env.pop("LEYLINE_API_KEY", None)  # the keys are this script's own
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with status {self.proc.returncode} while starting; "
                    f"the end of {self.log_path}:\n{self.tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s; "
                           f"see {self.log_path}")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace):
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self.log.close()

    def tail(self, n=20):
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def panics(self):
        try:
            with open(self.log_path, errors="replace") as f:
                return [line.rstrip() for line in f if "panicked" in line]
        except OSError:
            return []


def wait_idle(api, seconds):
    """Waits until nothing runs, waits or streams; returns the last metrics."""
    t0 = time.monotonic()
    m = None
    while time.monotonic() - t0 < seconds:
        m = read_metrics(api)
        g = gauges(m)
        if m and g.get("running") == 0 and g.get("queue_depth") == 0 \
                and g.get("streams_open") == 0:
            break
        time.sleep(1)
    return m


# ---------------------------------------------------------------------------------------
# Erasure check


def chat_once(api, msgs, key, **fields):
    """A greedy one-token chat completion, retried past 409/429/503."""
    return call_with_retry(
        lambda: api.chat(msgs, key, max_tokens=1, temperature=0.0, **fields), 5)


def cached_of(r):
    return ((r.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")


def probe(api, variant, tag, key, n):
    """One probe of a message prefix ending with a canary, under one key:
    {boundary, cached, reachable, clean} or an `error`. `clean` says the probe's own copy
    of the canary was forgotten again (or never made). `n` numbers the probes of a prefix."""
    before, msg = variant[:-1], variant[-1]
    text_before = msg["content"].split(tag, 1)[0]
    decoy = [before + [{"role": msg["role"], "content": text_before + d}] for d in decoys(n)]
    out = {"key": key, "clean": True}
    for i, d in enumerate(decoy):
        r = chat_once(api, d, key)
        if not r.ok:
            return {**out, "error": f"decoy {i + 1}: {r.status} {r.brief(200)}"}
    # The first decoy is cached now: the second matches it up to the canary's position.
    out["boundary"] = cached_of(r)
    if out["boundary"] is None:
        return {**out, "error": "no usage.prompt_tokens_details.cached_tokens in the answer"}
    # In a FORGET session of its own, so that its copy of the canary can be forgotten; a
    # new session's prefix comes from the prefix cache alone.
    r = chat_once(api, variant, key, mode="forget")
    if not r.ok:
        # Refused before it ran (400, 404, 503): it cached nothing.
        return {**out, "error": f"probe: {r.status} {r.brief(200)}",
                "clean": r.status in (400, 404, 503)}
    out["cached"] = cached_of(r)
    out["prompt_tokens"] = (r.usage or {}).get("prompt_tokens")
    if out["cached"] is not None:
        out["reachable"] = out["cached"] > out["boundary"]
    else:
        out["error"] = "no usage.prompt_tokens_details.cached_tokens in the answer"
    sid = (r.leyline or {}).get("session_id")
    if not sid:
        return {**out, "error": "probe: no session id in the answer", "clean": False}
    c = chat_once(api, decoy[0], key, session_id=sid, mode="forget")
    if not c.ok:
        out["clean"] = False
        out["cleanup_error"] = f"{c.status} {c.brief(200)}"
    d = call_with_retry(lambda: api.request("DELETE", f"/v1/sessions/{sid}", None, key), 5)
    if not d.ok:
        out["delete_error"] = f"{d.status} {d.brief(200)}"
    return out


def count_boundary(api, variant, tag, key):
    """A count-based estimate of the tokens before the canary, the probe's cross-check: the
    prompt tokens of the messages before it, plus those of its text before the canary. It
    is off by the size difference of the template's generation prompt and message header."""
    before, msg = variant[:-1], variant[-1]
    text_before = msg["content"].split(tag, 1)[0]
    counts = []
    for msgs in (before,
                 before + [{"role": msg["role"], "content": text_before}],
                 before + [{"role": msg["role"], "content": ""}]):
        r = chat_once(api, msgs, key)
        if not r.ok:
            return None
        counts.append((r.usage or {}).get("prompt_tokens"))
    if None in counts:
        return None
    return counts[0] + counts[1] - counts[2]


def erasure_check(api, canaries, nkeys, log):
    """Probes the original and the latest prefix of each forgotten canary under each key."""
    results = []
    for n, c in enumerate(canaries, 1):
        variants = c.variants[:1] + c.variants[-1:] if len(c.variants) > 1 else c.variants
        for vi, variant in enumerate(variants):
            entry = {
                "tag": c.tag,
                "placed_under_key": c.key,
                "variant": "original" if vi == 0 else "latest",
                "how": c.forgotten["how"],
                "forget_turn": {"session": c.forgotten["session"],
                                "leyline": c.forgotten["leyline"]},
                "messages": len(variant),
                "count_boundary": count_boundary(api, variant, c.tag, 0),
                "probes": [],
            }
            dirty = False
            for key in range(nkeys):
                if dirty:
                    entry["probes"].append(
                        {"key": key, "error": "skipped: the previous probe's copy stayed"})
                    continue
                p = probe(api, variant, c.tag, key, key)
                entry["probes"].append(p)
                dirty = not p["clean"]
            results.append(entry)
        log(f"erasure check: {n}/{len(canaries)} canaries", n == len(canaries))
    return results


def control_check(api, base_variant, rng):
    """A canary that is never forgotten must be found: proof that the probe sees one."""
    tag = CANARY_PREFIX + "control-" + uuid.uuid4().hex
    if base_variant is None:
        before = [{"role": "system", "content": SYSTEMS[0]},
                  {"role": "user", "content": paragraph(rng, 1, 2)},
                  {"role": "assistant", "content": sentence(rng, 3, 8)}]
    else:
        before = base_variant[:-1]
    msg = {"role": "user", "content": f"{sentence(rng, 3, 8)}\n{tag} is the vault phrase. {tag}."}
    variant = before + [msg]
    r = chat_once(api, variant, 0)
    if not r.ok:
        return {"tag": tag, "error": f"{r.status} {r.brief(200)}"}
    return {"tag": tag, **probe(api, variant, tag, 0, 0)}


# ---------------------------------------------------------------------------------------
# Cleanup


def cleanup(api, shared, keys, args, log):
    """Deletes every known session, waits for ones the clients never learned of to time
    out, flushes the prefix cache under each key and reads the used slots."""
    for sid, key in list(shared.sessions.items()):
        d = call_with_retry(lambda: api.request("DELETE", f"/v1/sessions/{sid}", None, key), 10)
        if d.status not in (200, 404):
            api.stats.anomaly("cleanup_delete", session=sid, status=d.status,
                              response=d.brief())
    left = int(gauges(read_metrics(api)).get("sessions", 0))
    if left:
        wait = args.session_idle_timeout * 1.25 + 15
        log(f"{left} sessions unknown to the clients are open; waiting up to {wait:.0f} s "
            f"for their idle timeout", True)
        t0 = time.monotonic()
        while left and time.monotonic() - t0 < wait:
            time.sleep(5)
            left = int(gauges(read_metrics(api)).get("sessions", 0))
    flush = {"responses": []}
    for key in range(len(keys)):
        r = api.request("POST", "/v1/cache/flush", {}, key)
        flush["responses"].append({"key": key, "status": r.status, "body": r.body})
    statuses = [x["status"] for x in flush["responses"]]
    if any(s in (404, 405) for s in statuses):
        flush["status"] = "flush route missing"
    else:
        flush["status"] = "ok" if all(s == 200 for s in statuses) else "failed"
    g = {}
    for _ in range(10):
        g = gauges(read_metrics(api))
        if g.get("pool_used_slots") == 0:
            break
        time.sleep(0.5)
    used = g.get("pool_used_slots")
    used = None if used is None else int(used)
    left = int(g.get("sessions", 0))
    leak = {"used_slots": used, "sessions_left": left, "flush": flush["status"], "leaked": None}
    if flush["status"] == "flush route missing":
        leak["verdict"] = (f"skipped: flush route missing ({used} slots used, prefix cache "
                           "not flushed)")
    elif flush["status"] != "ok":
        leak["verdict"] = f"skipped: the flush failed ({used} slots used)"
    elif left:
        leak["verdict"] = f"{used} (inconclusive: {left} sessions still open)"
    else:
        leak["verdict"] = f"{used}" + (" (leaked)" if used else "")
        leak["leaked"] = used
    return flush, leak


# ---------------------------------------------------------------------------------------
# Report


def fmt_ms(x):
    return "-" if x is None else f"{x:.0f}"


def five_xx(pairs):
    """Responses with a 5xx status other than 503, of (status, n) pairs; a stream's error
    event counts as one unless a small pool explains it."""
    def bad(st):
        if st.isdigit():
            return int(st) >= 500 and int(st) != 503
        return st.startswith("sse:") and st[4:] not in SSE_RETRY
    return sum(n for st, n in pairs if bad(st))


def markdown(s):
    a, p, e, r = s["args"], s["pool"], s["erasure"], s["rss_mib"]
    out = [f"# Leyline soak: {'PASS' if s['pass'] else 'FAIL'}", "", "| | |", "|---|---|"]
    row = lambda k, v: out.append(f"| {k} | {v} |")  # noqa: E731
    row("duration", f"{s['duration_s'] / 60:.1f} min of load (planned {a['minutes']:g}), "
                    f"{s['wall_s'] / 60:.1f} min in all")
    row("clients", a["clients"])
    raised = f" (raised from {p['from_fraction']} to fit one conversation)" if p["raised"] else ""
    row("KV pool", f"{p['slots']} slots for a demand of {p['demand']} ({a['clients']} clients x "
                   f"{a['max_context']} tokens): {100 * p['slots'] / p['demand']:.1f}%{raised}")
    row("peak context seen", f"{s['peak_context']} tokens (cap {a['max_context']})")
    row("requests during the load", f"{s['requests']['total']} sent, "
                                    f"{s['requests']['ok']} answered 200")
    row("panics in the server log", s["panics"]["count"])
    control = "found" if e["control_found"] else "NOT found"
    row("canaries", f"{e['placed']} placed, {e['forgotten']} forgotten, {e['checked']} checked "
                    f"({e['prefixes']} prefixes, {e['probes']} probes): **{e['reachable']} "
                    f"reachable**, {e['inconclusive']} inconclusive; control canary {control}")
    row("used slots after cleanup", s["leak"]["verdict"])
    row("server RSS", f"{r['start']} MiB at start, {r['end_of_load']} MiB at the end of the "
                      f"load, {r['end']} MiB at the end")
    row("5xx other than 503", f"{s['five_xx']['client']} seen by the clients, "
                              f"{s['five_xx']['server']} counted by the server")
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(s["anomaly_counts"].items()))
    row("anomalies", f"{sum(s['anomaly_counts'].values())}" + (f" ({kinds})" if kinds else ""))
    out += ["", "## Responses during the load", ""]
    statuses = sorted({st for v in s["responses"].values() for st in v},
                      key=lambda x: (not x.isdigit(), x))
    out.append("| route | " + " | ".join(statuses) + " | p50 ms | p95 ms |")
    out.append("|---|" + "---:|" * (len(statuses) + 2))
    for route, v in s["responses"].items():
        lat = s["latency"].get(route, {})
        cells = " | ".join(str(v.get(st, "")) for st in statuses)
        out.append(f"| {route} | {cells} | {fmt_ms(lat.get('p50_ms'))} "
                   f"| {fmt_ms(lat.get('p95_ms'))} |")
    out += ["", "## Actions", "", "| action | outcomes |", "|---|---|"]
    for action, outs in s["actions"].items():
        out.append(f"| {action} | " + ", ".join(f"{o} {n}" for o, n in sorted(outs.items())) + " |")
    out.append("")
    if e["reachable_list"]:
        out += ["## Reachable canaries", ""]
        for x in e["reachable_list"][:20]:
            out.append(f"- `{x['tag']}` ({x['how']}, {x['variant']} prefix, key {x['key']}): "
                       f"{x['cached']} cached tokens, {x['boundary']} before the canary; "
                       f"forget turn {json.dumps(x['forget_turn'])}")
        out.append("")
    if s["anomalies_shown"]:
        out += ["## Anomalies (the first of each kind)", ""]
        out += ["- " + json.dumps(x)[:800] for x in s["anomalies_shown"]]
        out.append("")
    if s["panics"]["lines"]:
        out += ["## Panics", ""]
        out += [f"- `{line[:300]}`" for line in s["panics"]["lines"][:10]]
        out.append("")
    failed = [k for k, v in s["checks"].items() if not v]
    if failed:
        out += [f"Failed checks: {', '.join(failed)}.", ""]
    out.append(f"Server log: {s['server']['log']}; summary: {s['summary_path']}")
    return "\n".join(out)


def report(ctx, stats, check_stats, shared, erasure, control, flush, leak, rss, m_load, m_end,
           panics, died):
    args = ctx["args"]
    total, ok = stats.totals()
    probes = [p for e in erasure for p in e["probes"]]
    reachable = [
        {"tag": e["tag"], "how": e["how"], "variant": e["variant"],
         "forget_turn": e["forget_turn"], **p}
        for e in erasure for p in e["probes"] if p.get("reachable")
    ]
    mismatches = [
        {"tag": e["tag"], "key": p["key"], "count": e["count_boundary"], "measured": p["boundary"]}
        for e in erasure for p in e["probes"]
        if e["count_boundary"] is not None and p.get("boundary") is not None
        and abs(e["count_boundary"] - p["boundary"]) > 4
    ]
    server_resp = server_responses(m_end)
    client_pairs = [(st, n) for (_, st), n in stats.counts.items()]
    client_pairs += [(st, n) for (_, st), n in check_stats.counts.items()]
    client_5xx = five_xx(client_pairs)
    server_5xx = five_xx([(st, n) for v in server_resp.values() for st, n in v.items()])
    anomaly_counts = stats.anomaly_counts + check_stats.anomaly_counts
    shown, kinds = [], set()
    for x in stats.anomalies + check_stats.anomalies:
        if x["kind"] not in kinds:
            kinds.add(x["kind"])
            shown.append(x)
    actions = collections.defaultdict(dict)
    for (name, outcome), n in sorted(stats.actions.items()):
        actions[name][outcome] = n
    control_found = bool(control.get("reachable"))
    checks = {
        "no_panics": not panics,
        "server_alive": not died,
        "no_reachable_canary": not reachable,
        # Without it, zero reachable canaries proves nothing.
        "control_canary_found": control_found or not erasure,
        "no_5xx_but_503": client_5xx == 0 and server_5xx == 0,
        "no_leaked_slots": leak.get("leaked") in (None, 0),
        "no_cross_key_access": anomaly_counts.get("cross_key_session_access", 0) == 0,
        "no_client_exceptions": anomaly_counts.get("client_exception", 0) == 0,
        "no_check_exceptions": anomaly_counts.get("check_exception", 0) == 0,
    }
    summary_path = os.path.join(ctx["out_dir"], "summary.json")
    s = {
        "pass": all(checks.values()),
        "checks": checks,
        "args": vars(args),
        "server": {"cmd": ctx["server"].cmd, "log": ctx["server"].log_path,
                   "exit_code": ctx["server"].exit_code, "died_during_load": died},
        "duration_s": round(ctx["duration"], 1),
        "wall_s": round(time.time() - ctx["t_start"], 1),
        "pool": ctx["pool"],
        "peak_context": shared.peak_context,
        "requests": {"total": total, "ok": ok},
        "responses": stats.by_route(),
        "latency": stats.latency_table(),
        "actions": dict(actions),
        "check_phase_responses": check_stats.by_route(),
        "server_responses": server_resp,
        "five_xx": {"client": client_5xx, "server": server_5xx},
        "panics": {"count": len(panics), "lines": panics[:50]},
        "erasure": {
            "placed": shared.placed,
            "forgotten": len(shared.forgotten),
            "untracked": shared.untracked,
            "checked": len({e["tag"] for e in erasure}),
            "prefixes": len(erasure),
            "probes": len(probes),
            "reachable": len(reachable),
            "inconclusive": sum(1 for p in probes if "reachable" not in p),
            "count_boundary_mismatches": mismatches,
            "control": control,
            "control_found": control_found,
            "reachable_list": reachable,
            "results": erasure,
        },
        "flush": flush,
        "leak": leak,
        "rss_mib": rss,
        "metrics_end_of_load": gauges(m_load),
        "metrics_end": gauges(m_end),
        "anomaly_counts": dict(anomaly_counts),
        "anomalies_shown": shown,
        "anomalies": stats.anomalies + check_stats.anomalies,
        "summary_path": summary_path,
    }
    with open(summary_path, "w") as f:
        json.dump(s, f, indent=1, default=str)
    print(markdown(s))
    return 0 if s["pass"] else 1


# ---------------------------------------------------------------------------------------
# Main


def parse_args():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="What is checked, and how: the docstring at the top of this file.",
    )
    ap.add_argument("--server-bin", default=os.path.join(REPO, "target", "release", "leyline"),
                    help="the leyline binary, run as `serve` (default: target/release/leyline "
                         "of this repository; pass a copy if it may be rebuilt meanwhile)")
    ap.add_argument("--model", default=None,
                    help="passed to the server as --model (default: the server's own default)")
    ap.add_argument("--port", type=int, default=0,
                    help="port on 127.0.0.1 for the server (default 0: a free one)")
    ap.add_argument("--clients", type=int, default=16,
                    help="concurrent client threads (default 16)")
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="length of the load phase; the checks come after it (default 30)")
    ap.add_argument("--max-context", type=int, default=1500,
                    help="cap in tokens on each conversation's prompt plus max_tokens: older "
                         "messages are dropped, or the conversation restarts (default 1500)")
    ap.add_argument("--pool-fraction", type=float, default=0.10,
                    help="KV pool size as a fraction of the demand, clients x --max-context; "
                         "raised to one conversation's cap if it is smaller (default 0.10)")
    ap.add_argument("--kv-slots", type=int, default=None,
                    help="KV pool size in slots, instead of --pool-fraction")
    ap.add_argument("--sessions-per-client", type=int, default=2,
                    help="most sessions one client keeps at once (default 2)")
    ap.add_argument("--max-sessions", type=int, default=None,
                    help="the server's --max-sessions (default 1.5 x clients: fewer than the "
                         "clients may keep, so least recently used sessions get dropped)")
    ap.add_argument("--session-idle-timeout", type=int, default=120,
                    help="the server's --session-idle-timeout in seconds (default 120)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="more arguments for `serve`, split on spaces (repeatable)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="client timeout of each request in seconds (default 600)")
    ap.add_argument("--retries", type=int, default=4,
                    help="tries of a request while the server answers 409, 429 or 503 "
                         "(default 4)")
    ap.add_argument("--canary-rate", type=float, default=0.15,
                    help="chance that a user message of a FORGET session carries a canary "
                         "(default 0.15)")
    ap.add_argument("--max-canaries", type=int, default=80,
                    help="most canaries placed in a run; each forgotten one costs about 13 "
                         "requests per prefix in the check (default 80)")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds to wait for the server's /health; the first run may download "
                         "the model (default 600)")
    ap.add_argument("--shutdown-grace", type=float, default=60.0,
                    help="seconds the server has to exit after SIGINT before it is killed "
                         "(default 60)")
    ap.add_argument("--seed", type=int, default=None,
                    help="random seed of the workload (default: the clock)")
    ap.add_argument("--out-dir", default="soak-out",
                    help="directory for server.log and summary.json (default soak-out)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args()
    if args.clients < 1 or args.minutes <= 0:
        ap.error("--clients must be at least 1 and --minutes above 0")
    if args.max_context < 256:
        ap.error("--max-context must be at least 256: a conversation needs a few turns")
    if args.pool_fraction <= 0 or (args.kv_slots is not None and args.kv_slots < 1):
        ap.error("--pool-fraction and --kv-slots must be positive")
    if args.max_sessions is None:
        args.max_sessions = max(4, (3 * args.clients) // 2)
    if args.seed is None:
        args.seed = int(time.time())
    if not (os.path.isfile(args.server_bin) and os.access(args.server_bin, os.X_OK)):
        ap.error(f"--server-bin {args.server_bin}: no executable file there")
    return args


def make_log(quiet):
    """Progress on stderr: rewritten in place on a terminal, every 30 s otherwise."""
    tty = sys.stderr.isatty()
    last = [0.0]

    def log(text, final=False):
        if quiet:
            return
        if tty:
            print("\r" + text + ("\n" if final else "   "), end="", file=sys.stderr, flush=True)
        elif final or time.monotonic() - last[0] >= 30:
            last[0] = time.monotonic()
            print(text, file=sys.stderr, flush=True)

    return log


def main():
    args = parse_args()
    out_dir = os.path.abspath(args.out_dir)
    os.makedirs(out_dir, exist_ok=True)
    log = make_log(args.quiet)
    demand = args.clients * args.max_context
    from_fraction = math.ceil(args.pool_fraction * demand)
    # Below one conversation at its cap, long prompts would be refused outright.
    floor = args.max_context + MAX_TOKENS[1] + 1
    pool = args.kv_slots or max(from_fraction, floor)
    ctx = {
        "args": args,
        "out_dir": out_dir,
        "t_start": time.time(),
        "pool": {"slots": pool, "demand": demand, "from_fraction": from_fraction,
                 "raised": args.kv_slots is None and pool > from_fraction},
    }
    keys = [f"soak-{n}-{uuid.uuid4().hex[:12]}" for n in "ab"]
    server = Server(args, keys, pool, out_dir)
    ctx["server"] = server
    log(f"starting {args.server_bin} serve on port {server.port}: {pool} KV slots, "
        f"demand {demand}", True)
    try:
        try:
            server.start(args.startup_timeout)
        except RuntimeError as e:
            print(f"soak: {e}", file=sys.stderr)
            return 2
        return run(ctx, server, keys, log)
    finally:
        server.stop(args.shutdown_grace)


def run(ctx, server, keys, log):
    args = ctx["args"]
    rng = random.Random(args.seed)
    boot = Api(server.port, keys, None, args.timeout, Stats())
    r = boot.request("GET", "/v1/models", None, 0)
    if not r.ok:
        print(f"soak: GET /v1/models answered {r.status}: {r.brief()}", file=sys.stderr)
        return 2
    model = r.body["data"][0]["id"]
    boot.model = model
    first = boot.chat([{"role": "user", "content": "Hello."}], 0, max_tokens=4)
    if not first.ok:
        print(f"soak: the first chat request answered {first.status}: {first.brief()}",
              file=sys.stderr)
        return 2
    rss = {"start": rss_mib(server.proc.pid), "end_of_load": None, "end": None}

    stats = Stats()
    api = Api(server.port, keys, model, args.timeout, stats)
    shared = Shared(args)
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    clients = [Client(i, api, shared, args, args.seed * 1000 + i, deadline)
               for i in range(args.clients)]
    for c in clients:
        c.start()
    died = False
    while any(c.is_alive() for c in clients):
        time.sleep(1)
        if not server.alive():
            died = True
            shared.stop.set()
        n, ok = stats.totals()
        left = max(0, deadline - time.monotonic())
        log(f"load: {n} requests, {ok} ok, {shared.placed} canaries placed, "
            f"{len(shared.forgotten)} forgotten, {left:.0f} s left")
        if time.monotonic() > deadline + args.timeout + 60:
            break  # a client stuck past its own timeout; it is left behind
    ctx["duration"] = time.monotonic() - t0
    n, ok = stats.totals()
    log(f"load done: {n} requests, {ok} ok", True)

    check_stats = Stats()
    capi = Api(server.port, keys, model, args.timeout, check_stats)
    erasure, control = [], {"error": "not run"}
    flush, leak = {"status": "not run"}, {"verdict": "not run", "leaked": None}
    m_load = None
    if not died:
        m_load = wait_idle(capi, 120)
        rss["end_of_load"] = rss_mib(server.proc.pid)
        forgotten = list(shared.forgotten)
        log(f"erasure check of {len(forgotten)} forgotten canaries", True)
        try:
            erasure = erasure_check(capi, forgotten, len(keys), log)
            control = control_check(capi, forgotten[0].variants[0] if forgotten else None, rng)
            flush, leak = cleanup(capi, shared, keys, args, log)
        except Exception:
            # Reported, and what was gathered so far with it.
            check_stats.anomaly("check_exception", traceback=traceback.format_exc())
        rss["end"] = rss_mib(server.proc.pid)
    m_end = read_metrics(capi) if server.alive() else None
    server.stop(args.shutdown_grace)
    return report(ctx, stats, check_stats, shared, erasure, control, flush, leak, rss, m_load,
                  m_end, server.panics(), died)


if __name__ == "__main__":
    sys.exit(main())
