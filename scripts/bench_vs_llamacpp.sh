#!/usr/bin/env bash
# Leyline against llama.cpp on the same GGUF, threads and machine: alternated pairs of
# `llama-bench -p 512 -n 128 -r 1 -fa 0,1` (its faster of flash attention off and on per
# figure) and `leyline bench engine --prompt-tokens 512 --gen-tokens 128 --repeat 1`; prints
# each pair, then the median of the per-pair ratios (range) and the median tok/s of each side.
# The acceptance runs of BENCHMARKS.md take 7 pairs, fixed in advance.
#
#   scripts/bench_vs_llamacpp.sh [--pairs N] [--threads T] [--depth D] [--fa LIST] [--out FILE] [MODEL]
#
#   --pairs N    alternated pairs (default 7)
#   --threads T  threads of both engines (default 2)
#   --depth D    pp and tg after D tokens already in the context (llama-bench -d D,
#                bench engine --depth D); slow: a pair prefills D tokens four times in
#                llama.cpp (pp and tg, fa off and on) and once in Leyline
#   --fa LIST    llama.cpp's flash-attention settings to take the faster of (default 0,1).
#                Only with a pilot that measured both at the same depth on the same
#                machine and found one faster in pp and tg alike; say so beside the figures.
#                It halves llama.cpp's share of a depth pair.
#   --out FILE   also append the raw JSON lines of every run to FILE
#   MODEL        a registry name (default: the default model)
#
# LEYLINE_BIN overrides the leyline binary (e.g. an older build for an A/B). llama.cpp is built
# outside the repository by scripts/side_by_side.sh; nothing of it is committed. Needs python3
# with pip, cmake and a C++ compiler; a release build of leyline.
set -euo pipefail

pairs=7
threads=2
depth=0
fa=0,1
out=
model=
while [[ $# -gt 0 ]]; do
    case "$1" in
        --pairs) pairs=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --depth) depth=$2; shift 2 ;;
        --fa) fa=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        -h | --help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option $1 (see --help)" >&2; exit 2 ;;
        *) model=$1; shift ;;
    esac
done

# shellcheck source=side_by_side.sh
source "$(dirname "$0")/side_by_side.sh"
leyline_and_model "$model"
leyline=${LEYLINE_BIN:-$leyline}
bench=$(llamacpp_bin llama-bench)
runs=$(mktemp)
trap 'rm -f "$runs"' EXIT

echo "## $(date -u '+%F %T') UTC, $pairs pairs, $threads threads, depth $depth, llama.cpp fa $fa, $(basename "$gguf")"
echo "## leyline $("$leyline" --version 2>/dev/null || echo "$leyline"), load average $(cut -d' ' -f1-3 /proc/loadavg)"
for p in $(seq 1 "$pairs"); do
    "$bench" -m "$gguf" -t "$threads" -p 512 -n 128 -d "$depth" -r 1 -fa "$fa" -o jsonl |
        sed "s/^/{\"pair\": $p, \"engine\": \"llama.cpp\", \"run\": /; s/\$/}/" >>"$runs"
    "$leyline" bench engine --model "$gguf" --prompt-tokens 512 --gen-tokens 128 --repeat 1 \
        --threads "$threads" --depth "$depth" --json |
        sed "s/^/{\"pair\": $p, \"engine\": \"leyline\", \"run\": /; s/\$/}/" >>"$runs"
    echo "pair $p done ($(date -u '+%T'))"
done
[[ -n "$out" ]] && cat "$runs" >>"$out"

python3 - "$runs" <<'EOF'
import json, statistics, sys

pairs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    p = pairs.setdefault(r["pair"], {"llama": {"pp": 0.0, "tg": 0.0}, "ley": {}})
    run = r["run"]
    if r["engine"] == "llama.cpp":
        test = "pp" if run["n_gen"] == 0 else "tg"
        p["llama"][test] = max(p["llama"][test], run["avg_ts"])
    else:
        p["ley"] = {"pp": run["prefill_tok_s"], "tg": run["decode_tok_s"]}

print("| pair | llama.cpp pp / tg | Leyline pp / tg | ratio pp / tg |")
print("|---|---|---|---|")
ratios = {"pp": [], "tg": []}
for k in sorted(pairs):
    l, y = pairs[k]["llama"], pairs[k]["ley"]
    rp, rt = y["pp"] / l["pp"], y["tg"] / l["tg"]
    ratios["pp"].append(rp)
    ratios["tg"].append(rt)
    print(f"| {k} | {l['pp']:.1f} / {l['tg']:.1f} | {y['pp']:.1f} / {y['tg']:.1f} | {rp:.2f} / {rt:.2f} |")
med = lambda side, t: statistics.median(pairs[k][side][t] for k in pairs)
print()
for t in ("pp", "tg"):
    r = ratios[t]
    print(f"{t}: Leyline / llama.cpp median {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f});"
          f" medians llama.cpp {med('llama', t):.1f}, Leyline {med('ley', t):.1f} tok/s")
EOF
