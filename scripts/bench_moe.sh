#!/usr/bin/env bash
# The MoE speed benchmark of issue 60: llama.cpp and Leyline on the same synthetic qwen3moe
# GGUF (Qwen3-30B-A3B's per-layer shapes, 8 layers, Q4_K_M by llama.cpp's llama-quantize),
# pp512 and tg128, PAIRS alternated pairs, median ratio Leyline / llama.cpp.
#
#   scripts/bench_moe.sh [PAIRS] [THREADS] [WORKDIR]
#   LEYLINE_FLAGS=--f32-activations scripts/bench_moe.sh    # extra flags for leyline bench engine
#
# The file (about 2.8 GB; its F16 source, about 9.7 GB, is deleted after quantizing) is made
# once under WORKDIR (default /tmp/leyline-moe-bench) by scripts/make_moe_bench_gguf.py,
# which needs numpy and gguf-py. llama.cpp comes from scripts/side_by_side.sh (built outside
# the repository). Nothing else may run meanwhile: the two cores are shared.
set -euo pipefail

pairs=${1:-7}
threads=${2:-2}
work=${3:-/tmp/leyline-moe-bench}
# shellcheck source=side_by_side.sh
source "$(dirname "$0")/side_by_side.sh"
leyline_and_model ""
bench=$(llamacpp_bin llama-bench)
quantize=$(llamacpp_bin llama-quantize)
mkdir -p "$work"
gguf="$work/qwen3moe-30b-a3b-shapes-8l.q4_k_m.gguf"
if [[ ! -f "$gguf" ]]; then
    python3 "$repo/scripts/make_moe_bench_gguf.py" "$work/f16.gguf"
    "$quantize" "$work/f16.gguf" "$gguf.partial" Q4_K_M "$threads"
    rm -f "$work/f16.gguf"
    mv "$gguf.partial" "$gguf"
fi

echo "## $(date -u '+%F %T') UTC, $(nproc) cores, threads $threads, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
echo "## file $gguf, leyline flags: ${LEYLINE_FLAGS:-none}, commit $(git -C "$repo" rev-parse --short HEAD)"
ratios=()
for i in $(seq 1 "$pairs"); do
    l=$("$bench" -m "$gguf" -t "$threads" -p 512 -n 128 -r 1 -o json 2>/dev/null |
        python3 -c "import json,sys; d=json.load(sys.stdin); print(' '.join(str(r['avg_ts']) for r in d))")
    # shellcheck disable=SC2086
    y=$("$leyline" bench engine --model "$gguf" --prompt-tokens 512 --gen-tokens 128 --repeat 1 \
        --threads "$threads" --json ${LEYLINE_FLAGS:-} 2>/dev/null |
        python3 -c "import json,sys; d=json.load(sys.stdin); print(d['prefill_tok_s'], d['decode_tok_s'])")
    read -r lpp ltg <<<"$l"
    read -r ypp ytg <<<"$y"
    echo "pair $i: llama.cpp pp512 $lpp tg128 $ltg | leyline pp512 $ypp tg128 $ytg"
    ratios+=("$ypp $lpp $ytg $ltg")
done
printf '%s\n' "${ratios[@]}" | python3 -c "
import statistics, sys
rows = [list(map(float, l.split())) for l in sys.stdin if l.strip()]
pp = statistics.median(r[0] / r[1] for r in rows)
tg = statistics.median(r[2] / r[3] for r in rows)
print(f'median ratio Leyline / llama.cpp over {len(rows)} pairs: pp512 {pp:.2f}x, tg128 {tg:.2f}x')
"
