#!/usr/bin/env bash
# Alternated A/B runs of two leyline binaries on the default model: `bench engine` and
# `bench splice`, PAIRS pairs, A first in odd pairs and B first in even ones. Prints each
# run's figures and, per figure, both medians and the median of the per-pair ratios B/A.
# Usage: [GEN_TOKENS=32] [SPLICE=1] scripts/ab_bench.sh BASE_BINARY NEW_BINARY [PAIRS=5]
# (SPLICE=0 leaves out `bench splice`, for a decode-only A/B with a longer GEN_TOKENS.)
set -euo pipefail
a=$1 b=$2 pairs=${3:-5}
gen=${GEN_TOKENS:-32}
out=$(mktemp -d)
run() { # binary tag pair
  "$1" bench engine --prompt-tokens 512 --gen-tokens "$gen" --repeat 3 --json >"$out/engine-$2-$3.json" 2>/dev/null
  if [[ ${SPLICE:-1} != 0 ]]; then
    "$1" bench splice --downstream 1024 --repeat 5 --json >"$out/splice-$2-$3.json" 2>/dev/null
  fi
}
for p in $(seq 1 "$pairs"); do
  if (( p % 2 )); then run "$a" a "$p"; run "$b" b "$p"; else run "$b" b "$p"; run "$a" a "$p"; fi
  echo "pair $p done" >&2
done
python3 - "$out" "$pairs" <<'PY'
import json, os, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
def figures(kind, tag, p):
    j = json.load(open(f"{out}/{kind}-{tag}-{p}.json"))
    flat = {}
    def walk(x, pre=""):
        if isinstance(x, dict):
            for k, v in x.items(): walk(v, f"{pre}{k}.")
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            flat[pre[:-1]] = float(x)
    walk(j)
    return {f"{kind}.{k}": v for k, v in flat.items()}
rows = {}
for p in range(1, pairs + 1):
    for kind in ("engine", "splice"):
        if kind == "splice" and os.environ.get("SPLICE", "1") == "0":
            continue
        fa, fb = figures(kind, "a", p), figures(kind, "b", p)
        for k in fa:
            if k in fb:
                rows.setdefault(k, []).append((fa[k], fb[k]))
print("| figure | A median | B median | B/A median (range) |")
print("|---|---|---|---|")
for k, v in rows.items():
    if not any("ms" in k or "tok" in k or "ratio" in k for _ in [0]): continue
    ra = [b / a for a, b in v if a]
    if not ra: continue
    print(f"| {k} | {statistics.median(a for a, _ in v):.4g} | {statistics.median(b for _, b in v):.4g} | "
          f"{statistics.median(ra):.3f} ({min(ra):.3f}-{max(ra):.3f}) |")
PY
