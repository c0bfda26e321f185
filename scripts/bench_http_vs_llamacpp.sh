#!/usr/bin/env bash
# Replay over HTTP, side by side (BENCHMARKS.md, "Replay over HTTP: Leyline vs. llama.cpp"):
# the turns of the first SESSIONS tau-bench trajectories (truncate_tool_outputs:2, greedy,
# 8 tokens) sent as streamed chat completions to four servers in turn, each started fresh:
#   leyline-prefix     `leyline serve --implicit-splices off`, the full edited history each turn
#                      (prefix cache only)
#   leyline-implicit   `leyline serve`, the same stock requests (implicit splices)
#   leyline-amortize   `leyline serve`, one AMORTIZE session per trajectory
#   llamacpp           llama-server -np 1 --cache-ram 0 (its slot's prefix cache)
#   llamacpp-reuse     the same with --cache-reuse 256 (KV shifting of matching chunks)
# Timed at the client by scripts/replay_http.py; one line per server goes to OUT/table.md.
#
#   [TRACES=FILE] [ARMS="llamacpp ..."] scripts/bench_http_vs_llamacpp.sh [SESSIONS] [TURNS] [OUT] [CONCURRENCY]
#
# Needs python3 with pip, cmake and a C++ compiler (llama.cpp is built outside the repository
# by scripts/side_by_side.sh); a release build of leyline. Run it on a quiet machine.
set -euo pipefail

sessions=${1:-16}
turns=${2:-6}
out=${3:-/tmp/replay-http}
conc=${4:-1}
threads=2
port=${PORT:-18431}
# shellcheck source=side_by_side.sh
source "$(dirname "$0")/side_by_side.sh"
leyline_and_model
server=$(llamacpp_bin llama-server)
traces="${TRACES:-$repo/data/traces/tau-bench.jsonl}"
mkdir -p "$out"

# arm LABEL plain|session COMMAND...: starts the server, replays, stops it.
arm() {
    local label=$1 kind=$2
    shift 2
    [[ " ${ARMS:-$label} " == *" $label "* ]] || return 0
    "$@" > "$out/$label.server.log" 2>&1 &
    pid=$!
    trap 'kill "$pid" 2>/dev/null || true' EXIT
    wait_up "$out/$label.server.log"
    python3 "$repo/scripts/replay_http.py" --url "http://127.0.0.1:$port" --label "$label" \
        --arm "$kind" --traces "$traces" --sessions "$sessions" --max-turns "$turns" \
        --concurrency "$conc" --out "$out/$label.json" | tee -a "$out/table.md"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    trap - EXIT
}

{
    echo "## $(date -u '+%F %T') UTC, $(git -C "$repo" rev-parse --short HEAD), load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "sessions $sessions, turns $turns, concurrency $conc, threads $threads"
    echo
    echo "| server | C | requests | prompt tokens | cache hit | TTFT p50 / p95 ms | E2E p50 / p95 ms | edit-turn TTFT p50 ms | edit-turn E2E p50 ms | plain-turn E2E p50 ms | wall s |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
} >> "$out/table.md"
slots=$((conc * 8192 + 4096))
arm leyline-prefix plain "$leyline" serve --addr "127.0.0.1:$port" --kv-slots "$slots" --implicit-splices off
arm leyline-implicit plain "$leyline" serve --addr "127.0.0.1:$port" --kv-slots "$slots"
arm leyline-amortize session "$leyline" serve --addr "127.0.0.1:$port" --kv-slots "$slots"
llama=("$server" -m "$gguf" -t "$threads" -c $((conc * 8192)) -np "$conc" --cache-ram 0
    --port "$port" --no-webui)
arm llamacpp plain "${llama[@]}"
arm llamacpp-reuse plain "${llama[@]}" --cache-reuse 256
echo "wrote $out/table.md" >&2
