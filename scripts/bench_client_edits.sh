#!/usr/bin/env bash
# Replays recorded client sessions (`leyline serve --record`) against a fresh server per run,
# in rounds of arms, their order rotated every round: `default` (implicit splices) and
# `prefix` (X-Leyline-Mode: prefix, the prefix cache alone). Prints, per recording, the
# median over the rounds of each edit turn's prompt, cached and prefilled tokens and E2E
# seconds per arm, the per-round ratio default / prefix, and the turn's fresh-token floor
# (the tokens of the messages the previous request of the conversation did not hold,
# counted by the server's tokenizer, with ChatML's 5 framing tokens each and the 3 of the
# generation prompt).
#
# --llamacpp adds a third arm to each round: llama.cpp's `llama-server` (built by
# scripts/side_by_side.sh) on the same GGUF, 2 threads, one slot, its prefix cache as it
# comes (extra flags in $LLAMACPP_ARGS, e.g. "--cache-reuse 256"); its prefilled tokens are
# the prompt less its cached ones.
#
# --max-output-tokens N caps every reply (default 256); at 1, each request's E2E is its time
# to first token (the replay does not stream). $LEYLINE_SERVE_ARGS adds flags to both Leyline
# arms' `leyline serve` (e.g. "--reuse-min-tokens 0").
#
#   scripts/bench_client_edits.sh [--pairs N] [--model NAME] [--max-output-tokens N] [--llamacpp]
#       RECORDING.jsonl...
#
# Recordings of Claude Code or Codex hold their vendors' prompts: keep them out of the
# repository (make them as BENCHMARKS.md "Claude Code and Codex" says).
set -euo pipefail
cd "$(dirname "$0")/.."

pairs=5
model=qwen2.5-coder-0.5b
max_out=256
arms=(default prefix)
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pairs) pairs=$2; shift 2 ;;
        --model) model=$2; shift 2 ;;
        --max-output-tokens) max_out=$2; shift 2 ;;
        --llamacpp) arms+=(llamacpp); shift ;;
        -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || {
    echo "usage: $0 [--pairs N] [--model NAME] [--max-output-tokens N] [--llamacpp] RECORDING.jsonl..." >&2
    exit 2
}

bin=target/release/leyline
[[ -x $bin ]] || cargo build --release -p leyline
out=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
base=http://127.0.0.1:$port
pid=
stop() { [[ -n $pid ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true; pid=; }
trap stop EXIT
llama=
if [[ " ${arms[*]} " == *" llamacpp "* ]]; then
    # shellcheck source=scripts/side_by_side.sh
    source scripts/side_by_side.sh
    llama=$(llamacpp_bin llama-server)
    gguf=$("$bin" model fetch "$model" | tail -n 1 | awk '{print $NF}')
fi
start_llamacpp() {
    # shellcheck disable=SC2086
    "$llama" -m "$gguf" --host 127.0.0.1 --port "$port" -c 40000 -t 2 -np 1 --jinja -n "$max_out" \
        ${LLAMACPP_ARGS:-} > "$out/llama-server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do curl -sf "$base/health" > /dev/null && return; sleep 0.2; done
    echo "llama-server did not start: $out/llama-server.log" >&2; exit 1
}
start() {
    # shellcheck disable=SC2086
    "$bin" serve --model "$model" --addr "127.0.0.1:$port" --kv-slots 40000 \
        --max-output-tokens "$max_out" ${LEYLINE_SERVE_ARGS:-} > "$out/serve.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do curl -sf "$base/health" > /dev/null && return; sleep 0.2; done
    echo "the server did not start: $out/serve.log" >&2; exit 1
}

for i in $(seq 1 "$pairs"); do
    # The arms' order rotates every round (with two arms: flips), so that whatever the
    # machine carries over from one server to the next does not weigh on one arm only.
    k=$(( (i - 1) % ${#arms[@]} ))
    order=("${arms[@]:k}" "${arms[@]:0:k}")
    for rec in "$@"; do
        name=$(basename "$rec" .jsonl)
        for arm in "${order[@]}"; do
            if [[ $arm == llamacpp ]]; then start_llamacpp; else start; fi
            header=()
            [[ $arm == prefix ]] && header=(--header-mode prefix)
            echo "pair $i: $name, $arm" >&2
            python3 scripts/replay_http.py --recording "$rec" --base "$base" "${header[@]}" \
                --out "$out/$name-$arm-$i.json" > /dev/null
            stop
        done
    done
done

start
python3 - "$out" "$base" "$pairs" "${arms[*]}" "$@" <<'EOF'
import json, statistics, sys, urllib.request
out, base, pairs, arms, recs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(), sys.argv[5:]

def tokens(text):
    body = json.dumps({"model": MODEL, "prompt": text or " ", "max_tokens": 1}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req))["usage"]["prompt_tokens"]

def messages(body):
    """(role, text) of a recorded request's messages or input items."""
    items = body.get("messages") or body.get("input") or []
    if isinstance(items, str):
        return [("user", items)]
    out = []
    for m in items:
        c = m.get("content", m.get("output", m.get("arguments", "")))
        if isinstance(c, list):
            c = "\n".join(p.get("text", "") or json.dumps(p) for p in c if isinstance(p, dict))
        out.append((m.get("role", m.get("type")), c if isinstance(c, str) else json.dumps(c)))
    return out

MODEL = json.loads(open(recs[0]).readline())["body"]["model"]
for rec in recs:
    name = rec.rsplit("/", 1)[-1][: -len(".jsonl")]
    lines = [json.loads(l) for l in open(rec)]
    runs = {arm: [json.load(open(f"{out}/{name}-{arm}-{i}.json"))["turns"] for i in range(1, pairs + 1)]
            for arm in arms}
    for r in runs.get("llamacpp", []):
        for turn in r:
            if turn.get("prompt_tokens") is not None and turn.get("cached_tokens") is not None:
                turn["tokens_prefilled"] = turn["prompt_tokens"] - turn["cached_tokens"]
    print(f"\n{name}: {pairs} rounds, medians (per-round ratios of E2E to the prefix arm)\n")
    print("| turn | floor | arm | prompt | cached | prefilled | prefilled / floor | spliced | E2E s |")
    print("|---:|---:|---|---:|---:|---:|---:|---|---:|")
    for t, turn in enumerate(runs["default"][0]):
        if not turn.get("edit_turn"):
            continue
        seen = set(messages(lines[t - 1]["body"])) if t else set()
        floor = 3 + sum(5 + tokens(text) for role, text in messages(lines[t]["body"]) if (role, text) not in seen)
        e2e = {}
        for arm in arms:
            col = lambda k: statistics.median(r[t][k] or 0 for r in runs[arm])
            e2e[arm] = [r[t]["e2e_s"] for r in runs[arm]]
            spliced = sum(bool(r[t]["spliced"]) for r in runs[arm])
            print(f"| {t} | {floor} | {arm} | {col('prompt_tokens'):.0f} | {col('cached_tokens'):.0f} | "
                  f"{col('tokens_prefilled'):.0f} | {col('tokens_prefilled') / floor:.2f} | {spliced}/{pairs} | "
                  f"{col('e2e_s'):.3f} |")
        for arm in arms:
            if arm == "prefix":
                continue
            ratios = [d / p for d, p in zip(e2e[arm], e2e["prefix"])]
            print(f"| {t} | | {arm} / prefix E2E | | | | | | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) |")
EOF
