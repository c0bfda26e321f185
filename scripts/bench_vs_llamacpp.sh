#!/usr/bin/env bash
# Side-by-side prefill/decode figures of llama.cpp and Leyline on the same GGUF, threads and
# machine, back to back (BENCHMARKS.md, "Engine").
#
# llama.cpp is built outside the repository by scripts/llamacpp.sh; nothing of it is committed.
#
#   scripts/bench_vs_llamacpp.sh [THREADS] [REPEAT]
#
# Needs python3 with pip, cmake and a C++ compiler; a release build of leyline.
set -euo pipefail

threads=${1:-2}
repeat=${2:-3}
repo=$(cd "$(dirname "$0")/.." && pwd)
leyline="$repo/target/release/leyline"
# shellcheck source=llamacpp.sh
source "$repo/scripts/llamacpp.sh"
bench=$(llamacpp_bin llama-bench)
if [[ ! -x "$leyline" ]]; then
    (cd "$repo" && cargo build --release -p leyline)
fi
# `model fetch` prints the cached path of the default model.
gguf=$("$leyline" model fetch | tail -n 1 | awk '{print $NF}')
[[ -f "$gguf" ]] || { echo "cannot find the default model (got '$gguf')" >&2; exit 1; }

echo "## $(date -u '+%F %T') UTC, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$bench" -m "$gguf" -t "$threads" -p 512 -n 128 -r "$repeat"
"$leyline" bench engine --prompt-tokens 512 --gen-tokens 128 --repeat "$repeat" --threads "$threads"
