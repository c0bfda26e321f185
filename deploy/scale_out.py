#!/usr/bin/env python3
"""Replicas behind nginx: routing, failover and rebalancing, measured as a client sees them.

Starts N replicas and nginx on loopback (deploy/local.sh) and replays agent trajectories
through nginx, one conversation per trajectory, each naming itself with `X-Session-Id` from
its first turn. Turns go in rounds (every conversation's turn 1, then every turn 2, ...), and
a replica is killed while a round is in flight (`--kill-in-round`), so it dies with
requests running and conversations that still have turns to come. The client retries a turn once on a connection error or a 5xx, as the SDKs
do. Each turn records the replica that answered (nginx's X-Leyline-Upstream header) and the
server's `leyline` report (`session_rebuilt`, tokens reused).

With `--check` (the failover test of .ci/run): every conversation completes; before the kill
every turn reaches the replica that holds its conversation; then exactly the killed replica's
conversations move, each once and rebuilt on its new replica, and no other moves or rebuilds.

`--join` measures rebalancing instead: the replica each conversation id routes to with N
replicas, then with one more (`deploy/local.sh add`), by a cheap `GET /health` per id.

Only the standard library (and scripts/replay_http.py's turns and client).
"""

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
import replay_http  # noqa: E402

LOCAL = os.path.join(HERE, "local.sh")


def local(*args):
    subprocess.run([LOCAL, *map(str, args)], check=True, stdout=sys.stderr)


def upstream(headers):
    """The replica that answered: the last address nginx tried."""
    ups = headers.get("x-leyline-upstream")
    if not ups:
        raise RuntimeError("no X-Leyline-Upstream header: is nginx in front (deploy/local.sh)?")
    return ups.split(",")[-1].strip()


def route(url, sid):
    """The replica nginx sends `sid` to now (GET /health carries no work)."""
    u = url.split("//", 1)[1]
    host, port = u.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/health", headers={"X-Session-Id": sid})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return upstream({k.lower(): v for k, v in resp.getheaders()})


def one_turn(client, sid, prompt):
    """One chat turn through nginx, retried once on a connection error or a 5xx."""
    retries = 0
    while True:
        try:
            ttft, e2e, usage, leyline, _ = client.chat(prompt, {}, {"X-Session-Id": sid})
            if usage is None:
                # The stream ended without its usage chunk: the replica died mid-answer.
                raise ConnectionError("the stream ended early")
            return {
                "upstream": upstream(client.last_headers),
                "ttft_ms": ttft * 1e3,
                "e2e_ms": e2e * 1e3,
                "prompt_tokens": usage.get("prompt_tokens"),
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                "rebuilt": bool((leyline or {}).get("session_rebuilt")),
                "tokens_prefilled": (leyline or {}).get("tokens_prefilled"),
                "retries": retries,
            }
        except (OSError, http.client.HTTPException, replay_http.Refused) as e:
            status = getattr(e, "status", None)
            if retries >= 1 or (status is not None and status < 500):
                raise
            retries += 1
            time.sleep(0.2)


def replay(args, trajs):
    conv = [
        {
            "name": f"{t['source']}/{t['id']}",
            "sid": f"conv-{i:04d}-{uuid.uuid4().hex[:16]}",
            "turns": list(replay_http.turns(t, args.older_than, args.turns)),
        }
        for i, t in enumerate(trajs)
    ]
    records, killed, lock = [], [], threading.Lock()
    rounds = max(len(c["turns"]) for c in conv)

    def kill():
        # The replica that holds the most conversations goes down, mid-round.
        with lock:
            homes = {}
            for rec in sorted(records, key=lambda x: x["round"]):
                homes.setdefault(rec["sid"], rec["upstream"])
        count = {}
        for h in homes.values():
            count[h] = count.get(h, 0) + 1
        victim = max(sorted(count), key=count.get)
        local("kill", int(victim.rsplit(":", 1)[1]) - args.port)
        killed.append(victim)

    t0 = time.perf_counter()
    for r in range(rounds):
        timer = None
        if args.kill_in_round is not None and r == args.kill_in_round:
            timer = threading.Timer(args.kill_delay, kill)
            timer.start()

        def run(c):
            client = replay_http.Client(args.url, args.model, args.max_tokens, args.timeout)
            k, prompt, edit = c["turns"][r]
            rec = one_turn(client, c["sid"], prompt)
            rec.update(session=c["name"], sid=c["sid"], turn=k, edit_turn=edit, round=r)
            with lock:
                records.append(rec)
                print(f"\rround {r + 1}/{rounds}: {len(records)} turns", end="",
                      file=sys.stderr, flush=True)

        todo = [c for c in conv if r < len(c["turns"])]
        with ThreadPoolExecutor(args.concurrency) as pool:
            for f in [pool.submit(run, c) for c in todo]:
                f.result()
        if timer:
            timer.join()
    print(file=sys.stderr)
    return conv, records, (killed or [None])[0], time.perf_counter() - t0


def analyse(conv, records, killed, kill_round):
    """The failover's figures, and what went wrong (empty when failover was clean)."""
    by = {}
    for rec in sorted(records, key=lambda x: x["round"]):
        by.setdefault(rec["sid"], []).append(rec)
    follow = stay = rebuilt_turns = 0
    moved, bad = [], []
    for c in conv:
        recs = by.get(c["sid"], [])
        if len(recs) != len(c["turns"]):
            bad.append(f"{c['name']}: {len(recs)} of {len(c['turns'])} turns")
            continue
        ups = [x["upstream"] for x in recs]
        rebuilt = [i for i, x in enumerate(recs) if x["rebuilt"]]
        rebuilt_turns += len(rebuilt)
        # A turn reaches the replica holding its KV when it goes where the previous went.
        for i in range(1, len(recs)):
            if kill_round is None or recs[i]["round"] < kill_round:
                follow += 1
                stay += ups[i] == ups[i - 1]
        switches = [i for i in range(1, len(ups)) if ups[i] != ups[i - 1]]
        if killed is not None and ups[0] == killed and switches:
            # The killed replica's conversation: one move, to one live replica, rebuilt there.
            i = switches[0]
            moved.append(c["sid"])
            if len(switches) > 1 or killed in ups[i:]:
                bad.append(f"{c['name']}: went {ups} after the kill")
            if rebuilt != [i]:
                bad.append(f"{c['name']}: rebuilt at turns {rebuilt}, want [{i}] only")
        else:
            if switches:
                bad.append(f"{c['name']}: moved off a live replica ({ups})")
            if rebuilt:
                bad.append(f"{c['name']}: rebuilt at turns {rebuilt} without a failure")
    if killed is not None and not moved:
        bad.append(f"no conversation moved off the killed replica {killed}")
    s = replay_http.summary(records, 0.0)
    s.update(
        conversations=len(conv),
        follow_turns_before_kill=follow,
        reached_holder_before_kill=stay,
        reached_holder_share=stay / follow if follow else float("nan"),
        killed=killed,
        conversations_moved=len(moved),
        rebuilt_turns=rebuilt_turns,
        retried_turns=sum(1 for x in records if x["retries"]),
        replicas_used=sorted({x["upstream"] for x in records}),
    )
    return s, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--traces", required=True, help="JSONL trajectories (data/traces/)")
    ap.add_argument("--sessions", type=int, default=24, help="conversations (trajectories)")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--older-than", type=int, default=2, help="truncate_tool_outputs:N")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kill-in-round", type=int,
                    help="SIGKILL the replica holding most conversations during this round "
                         "(0-based), --kill-delay seconds after it starts")
    ap.add_argument("--kill-delay", type=float, default=0.5)
    ap.add_argument("--join", action="store_true",
                    help="measure the conversations a joining replica takes, then exit")
    ap.add_argument("--check", action="store_true", help="fail unless failover was clean")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", help="JSON file for the records and the summary")
    args = ap.parse_args()
    args.port = int(os.environ.get("LEYLINE_PORT", "18000"))
    args.url = f"http://127.0.0.1:{args.port}"
    with open(args.traces) as f:
        trajs = [json.loads(line) for line in f if line.strip()][: args.sessions]
    if len(trajs) < args.sessions:
        sys.exit(f"{args.traces} has {len(trajs)} trajectories, fewer than --sessions")

    local("start", args.replicas)
    try:
        if args.join:
            sids = [f"conv-{i:04d}-{uuid.uuid4().hex[:16]}" for i in range(args.sessions)]
            before = {s: route(args.url, s) for s in sids}
            local("add")
            after = {s: route(args.url, s) for s in sids}
            moved = [s for s in sids if before[s] != after[s]]
            new = sorted(set(after.values()) - set(before.values()))
            s = {
                "conversations": len(sids),
                "replicas_before": args.replicas,
                "moved": len(moved),
                "moved_share": len(moved) / len(sids),
                "moved_to_new_replica": sum(1 for x in moved if after[x] in new),
                "per_replica_before": {u: list(before.values()).count(u) for u in set(before.values())},
                "per_replica_after": {u: list(after.values()).count(u) for u in set(after.values())},
            }
            bad = [] if s["moved"] == s["moved_to_new_replica"] else [
                "a conversation moved between old replicas"]
            records = []
        else:
            conv, records, killed, wall = replay(args, trajs)
            s, bad = analyse(conv, records, killed, args.kill_in_round)
            s["wall_s"] = wall
    finally:
        local("stop")
    # No NaN in the JSON (medians of empty sets, e.g. no edit turn in a short run).
    s = {k: (None if isinstance(v, float) and v != v else v) for k, v in s.items()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": s, "args": vars(args), "requests": records}, f, indent=1)
    print(json.dumps(s, indent=1))
    if bad:
        print("failover check failed:\n  " + "\n  ".join(bad), file=sys.stderr)
        if args.check:
            sys.exit(1)


if __name__ == "__main__":
    main()
