#!/usr/bin/env bash
# BENCHMARKS.md "Scale-out": tau-bench conversations through nginx, in four runs:
#   3 replicas (1 compute thread each), no failure;   1 replica (2 threads), no failure;
#   3 replicas, the busiest one killed in round KILL_ROUND;   a 4th replica joining (routing only).
# Usage: deploy/bench_scale_out.sh OUTDIR   (SESSIONS=48 TURNS=6 CONCURRENCY=4 KILL_ROUND=3)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: deploy/bench_scale_out.sh OUTDIR}
mkdir -p "$out"
traces=${TRACES:-$here/../data/traces/tau-bench.jsonl}
common=(--traces "$traces" --sessions "${SESSIONS:-48}" --turns "${TURNS:-6}"
    --concurrency "${CONCURRENCY:-4}" --max-tokens 8)
LEYLINE_SERVE_ARGS="--threads 1 --kv-slots 32768" \
    python3 "$here/scale_out.py" --replicas 3 "${common[@]}" --out "$out/three.json" >/dev/null
LEYLINE_SERVE_ARGS="--threads 2 --kv-slots 98304" \
    python3 "$here/scale_out.py" --replicas 1 "${common[@]}" --out "$out/one.json" >/dev/null
LEYLINE_SERVE_ARGS="--threads 1 --kv-slots 32768" \
    python3 "$here/scale_out.py" --replicas 3 "${common[@]}" --kill-in-round "${KILL_ROUND:-3}" \
    --out "$out/kill.json" >/dev/null
LEYLINE_SERVE_ARGS="--threads 1 --kv-slots 32768" \
    python3 "$here/scale_out.py" --replicas 3 --join --traces "$traces" --sessions "${SESSIONS:-48}" \
    --out "$out/join.json" >/dev/null
python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
for name in ("three", "one", "kill", "join"):
    s = json.load(open(f"{d}/{name}.json"))["summary"]
    keep = {k: v for k, v in s.items() if not isinstance(v, (list, dict))}
    print(name, json.dumps(keep))
PY
