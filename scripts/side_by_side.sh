# Sourced by the side-by-side scripts (bench_vs_llamacpp.sh, bench_http_vs_llamacpp.sh).
#
#   llamacpp_bin TARGET   # prints the path of llama.cpp's build/bin/TARGET, building it first
#   wait_up LOG               # waits for a server on $port (LOG named if it never answers)
#   leyline_and_model [NAME]  # sets $repo, $leyline (a release build, built if missing) and $gguf
#                             # (the registry model NAME, default: the default model)
#
# llama.cpp is fetched as the llama-cpp-python sdist from PyPI (it vendors llama.cpp) and built
# under $LLAMACPP_DIR (default /tmp/llamacpp), outside the repository; nothing of it is
# committed. Needs python3 with pip and a C++ compiler (cmake comes from PyPI if missing).

llamacpp_version=0.3.36

llamacpp_bin() {
    local target=$1
    local work=${LLAMACPP_DIR:-/tmp/llamacpp}
    local src="$work/llama_cpp_python-$llamacpp_version/vendor/llama.cpp"
    local bin="$src/build/bin/$target"
    if [[ ! -x "$bin" ]]; then
        mkdir -p "$work"
        echo "building $target in $work (a few minutes)" >&2
        if [[ ! -d "$src" ]]; then
            # cmake and the build backend as wheels: `--no-binary :all:` would build cmake
            # itself from source first (most of an hour on 2 cores).
            command -v cmake >/dev/null || python3 -m pip install cmake >&2
            python3 -m pip install scikit-build-core >&2
            python3 -m pip download --no-deps --no-build-isolation \
                --no-binary llama-cpp-python "llama-cpp-python==$llamacpp_version" -d "$work" >&2
            tar -xzf "$work/llama_cpp_python-$llamacpp_version.tar.gz" -C "$work"
        fi
        # The instruction sets are named rather than detected (GGML_NATIVE): on a CPU with AMX
        # this llama.cpp's AMX matmul dies (SIGILL, or SIGSEGV at `ldtilecfg` once the process
        # holds the AMX permission; seen 2026-12-01, and a general protection fault at
        # `ldtilecfg` on 2026-12-08 on a VM where other programs' tiles run), so its AVX-512
        # kernels are what runs.
        # The AVX-512 flags only where the CPU has AVX-512F (else the build dies with SIGILL).
        local avx512=()
        if grep -qw avx512f /proc/cpuinfo; then
            avx512=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
                -DGGML_AVX512_BF16=ON)
        fi
        cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
            -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
            "${avx512[@]}" \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
        cmake --build "$src/build" --target "$target" -j "$(nproc)" >&2
    fi
    echo "$bin"
}

# wait_up LOG: waits (up to 4 minutes) until the server on 127.0.0.1:$port answers /health.
wait_up() {
    for _ in $(seq 1 480); do
        if python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null; then
            return 0
        fi
        sleep 0.5
    done
    echo "the server did not come up; see $1" >&2
    return 1
}

leyline_and_model() {
    local name=${1:-}
    repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    leyline="$repo/target/release/leyline"
    if [[ ! -x "$leyline" ]]; then
        (cd "$repo" && cargo build --release -p leyline)
    fi
    # `model fetch [NAME]` prints the cached path of the model (default: the default model).
    # shellcheck disable=SC2086
    gguf=$("$leyline" model fetch $name | tail -n 1 | awk '{print $NF}')
    [[ -f "$gguf" ]] || { echo "cannot find the model ${name:-default} (got '$gguf')" >&2; exit 1; }
}
