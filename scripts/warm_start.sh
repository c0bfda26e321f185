#!/usr/bin/env bash
# Warm start of a model: time from the start of `leyline run` to the first token of a
# 16-token prompt with the file in the page cache, and the process's peak RSS against
# issue 59's budget (1.25 x (file + KV pool + 300 MB)).
#
#   scripts/warm_start.sh [--runs N] [MODEL]     # MODEL: a known name or a GGUF path
#                                                # (default qwen2.5-coder-1.5b), N default 5
#
# One untimed run first fills the page cache; then N runs, each a fresh process. Prints each
# run and the medians. LEYLINE_BIN picks the binary (default: the release build).
set -euo pipefail
runs=5
model=qwen2.5-coder-1.5b
while [[ $# -gt 0 ]]; do
    case $1 in
        --runs) runs=$2; shift 2 ;;
        -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
        *) model=$1; shift ;;
    esac
done
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=${LEYLINE_BIN:-$repo/target/release/leyline}
[[ -x $bin ]] || (cd "$repo" && cargo build --release -p leyline >&2)
command -v /usr/bin/time >/dev/null || { echo "needs /usr/bin/time (apt-get install time)" >&2; exit 1; }
# 16 tokens with the Qwen2.5 tokenizer (the table shows the count each run reports).
prompt="def fibonacci(n): return the nth Fibonacci number, computed iteratively in plain Python"
file=$("$bin" model list 2>/dev/null | awk -v m="$model" '$1 == m {gsub(/[][]/, "", $NF); print $NF}')
[[ -n $file && -f $file ]] || file=$model
once() {
    /usr/bin/time -f "rss_kb %M" "$bin" run -m "$model" -p "$prompt" -n 1 --stats 2>&1 >/dev/null
}
once >/dev/null
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
printf "%-4s %-10s %-12s %-12s %-8s\n" run tokens "load ms" "first ms" "RSS MB"
for i in $(seq 1 "$runs"); do
    out=$(once)
    tokens=$(sed -n 's/^prompt \([0-9]*\) tokens.*/\1/p' <<<"$out")
    load=$(sed -n 's/^model loaded in \([0-9.]*\) ms.*/\1/p' <<<"$out")
    first=$(sed -n 's/.*first token \([0-9.]*\) ms after.*/\1/p' <<<"$out")
    kv=$(sed -n 's/.*KV pool \([0-9.]*\) MB.*/\1/p' <<<"$out")
    rss=$(( $(sed -n 's/^rss_kb \([0-9]*\)/\1/p' <<<"$out") / 1000 ))
    [[ -n $first ]] || { echo "no timing in the output:"; echo "$out"; exit 1; } >&2
    printf "%-4s %-10s %-12s %-12s %-8s\n" "$i" "$tokens" "$load" "$first" "$rss"
    echo "$load $first $rss $kv" >>"$tmp"
done
file_mb=$(( $(stat -c %s "$file" 2>/dev/null || echo 0) / 1000000 ))
python3 - "$tmp" "$file_mb" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
file_mb = float(sys.argv[2])
load, first, rss, kv = (statistics.median(c) for c in zip(*rows))
peak = max(r[2] for r in rows)
budget = 1.25 * (file_mb + kv + 300)
print(f"median: load {load:.0f} ms, first token {first:.0f} ms after the start")
print(f"peak RSS {peak:.0f} MB; budget 1.25 x (file {file_mb:.0f} + KV pool {kv:.0f} + 300) = {budget:.0f} MB")
PY
