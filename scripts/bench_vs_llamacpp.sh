#!/usr/bin/env bash
# Side-by-side prefill/decode figures of llama.cpp and Leyline on the same GGUF, threads and
# machine, back to back (BENCHMARKS.md, "Engine").
#
# llama.cpp is built outside the repository by scripts/side_by_side.sh; nothing of it is committed.
#
#   scripts/bench_vs_llamacpp.sh [THREADS] [REPEAT] [MODEL]    # MODEL: a registry name
#
# Needs python3 with pip, cmake and a C++ compiler; a release build of leyline.
set -euo pipefail

threads=${1:-2}
repeat=${2:-3}
model=${3:-}
# shellcheck source=side_by_side.sh
source "$(dirname "$0")/side_by_side.sh"
leyline_and_model "$model"
bench=$(llamacpp_bin llama-bench)

echo "## $(date -u '+%F %T') UTC, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$bench" -m "$gguf" -t "$threads" -p 512 -n 128 -r "$repeat"
"$leyline" bench engine --model "$gguf" --prompt-tokens 512 --gen-tokens 128 --repeat "$repeat" \
    --threads "$threads"
