#!/usr/bin/env bash
# Agents unchanged, over HTTP (BENCHMARKS.md, "Agents unchanged: implicit splices and
# server-side clearing"): the turns of the first SESSIONS tau-bench trajectories sent to
# `leyline serve` (started fresh for each arm) by scripts/replay_http.py as a client sees them:
#   prefix            a stock client with `X-Leyline-Mode: prefix` (the prefix cache alone),
#                     client-side truncate_tool_outputs:2
#   implicit          the same stock client without the header: implicit splices
#   session           one explicit AMORTIZE session per trajectory (session_id, leyline.mode)
#   stock-nopolicy    a stock client sending the history as recorded
#   messages          /v1/messages with server-side clear_tool_uses (trigger 3, keep 2)
#   messages-prefix   the same with `X-Leyline-Mode: prefix` (clearing without the splice)
# One line per arm goes to OUT/table.md.
#
#   [TRACES=FILE] [ARMS="prefix implicit ..."] scripts/bench_http_arms.sh [SESSIONS] [TURNS] [OUT] [CONCURRENCY] [MODEL]
#
# A trajectory whose prompt outgrows the model's context is cut there (replay_http.py counts
# the sessions cut); ARMS picks arms by label (default: all six); SERVE_ARGS adds flags to
# `leyline serve` (e.g. "--rotation lazy"), KV_SLOTS sets its pool. Each arm's JSON summary
# holds the KV the server held at its end (resident_kv_bytes, from /metrics): with a pool
# too large to evict from, what the replay's conversations and cached prefixes take.
#
# Needs python3 and a release build of leyline. Run it on a quiet machine.
set -euo pipefail

sessions=${1:-16}
turns=${2:-6}
out=${3:-/tmp/replay-arms}
conc=${4:-1}
model=${5:-}
port=${PORT:-18432}
# shellcheck source=side_by_side.sh
source "$(dirname "$0")/side_by_side.sh"
leyline_and_model "$model"
traces="${TRACES:-$repo/data/traces/tau-bench.jsonl}"
mkdir -p "$out"

# arm LABEL REPLAY_ARGS...: starts a fresh server, replays, stops it.
arm() {
    local label=$1
    shift
    [[ " ${ARMS:-$label} " == *" $label "* ]] || return 0
    # shellcheck disable=SC2086 # SERVE_ARGS is a list of flags
    "$leyline" serve --model "${model:-smollm2-135m}" --addr "127.0.0.1:$port" --kv-slots "${KV_SLOTS:-$((conc * 8192 + 4096))}" \
        ${SERVE_ARGS:-} > "$out/$label.server.log" 2>&1 &
    pid=$!
    trap 'kill "$pid" 2>/dev/null || true' EXIT
    wait_up "$out/$label.server.log"
    python3 "$repo/scripts/replay_http.py" --url "http://127.0.0.1:$port" --label "$label" \
        --traces "$traces" --sessions "$sessions" --max-turns "$turns" \
        --concurrency "$conc" --model "${model:-smollm2-135m}" \
        --out "$out/$label.json" "$@" | tee -a "$out/table.md"
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    trap - EXIT
}

{
    echo "## $(date -u '+%F %T') UTC, $(git -C "$repo" rev-parse --short HEAD), load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "sessions $sessions, turns $turns, concurrency $conc, model ${model:-default}"
    echo
    echo "| arm | C | requests | prompt tokens | cache hit | TTFT p50 / p95 ms | E2E p50 / p95 ms | edit-turn TTFT p50 ms | edit-turn E2E p50 ms | plain-turn E2E p50 ms | wall s |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
} >> "$out/table.md"
arm prefix --arm plain --header-mode prefix
arm implicit --arm plain
arm session --arm session
arm stock-nopolicy --arm plain --no-policy
arm messages --arm messages
arm messages-prefix --arm messages --header-mode prefix
echo "wrote $out/table.md" >&2
