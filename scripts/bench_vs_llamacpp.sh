#!/usr/bin/env bash
# Side-by-side prefill/decode figures of llama.cpp and Leyline on the same GGUF, threads and
# machine, back to back (BENCHMARKS.md, "Engine").
#
# llama.cpp is fetched as the llama-cpp-python sdist from PyPI (it vendors llama.cpp) and
# built OUTSIDE the repository (default /tmp/llamacpp); nothing of it is committed.
#
#   scripts/bench_vs_llamacpp.sh [THREADS] [REPEAT]
#
# Needs python3 with pip, cmake and a C++ compiler; a release build of leyline.
set -euo pipefail

threads=${1:-2}
repeat=${2:-3}
work=${LLAMACPP_DIR:-/tmp/llamacpp}
version=0.3.36
repo=$(cd "$(dirname "$0")/.." && pwd)
leyline="$repo/target/release/leyline"
bench="$work/llama_cpp_python-$version/vendor/llama.cpp/build/bin/llama-bench"

if [[ ! -x "$bench" ]]; then
    mkdir -p "$work"
    echo "building llama-bench in $work (a few minutes)" >&2
    python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
    tar -xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
    src="$work/llama_cpp_python-$version/vendor/llama.cpp"
    cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
    cmake --build "$src/build" --target llama-bench -j "$(nproc)" >&2
fi
if [[ ! -x "$leyline" ]]; then
    (cd "$repo" && cargo build --release -p leyline)
fi
# `model fetch` prints the cached path of the default model.
gguf=$("$leyline" model fetch | tail -n 1 | awk '{print $NF}')
[[ -f "$gguf" ]] || { echo "cannot find the default model (got '$gguf')" >&2; exit 1; }

echo "## $(date -u '+%F %T') UTC, load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$bench" -m "$gguf" -t "$threads" -p 512 -n 128 -r "$repeat"
"$leyline" bench engine --prompt-tokens 512 --gen-tokens 128 --repeat "$repeat" --threads "$threads"
