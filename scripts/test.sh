#!/usr/bin/env bash
# Install everything the tests need, from nothing, then run them:
#   1. a virtual environment (.venv-test, or $SPECULATE_TEST_VENV);
#   2. llama-cpp-python built from source with batch-invariant CPU kernels, so that
#      greedy speculative output can be compared token for token with target-only
#      output (see docs/exactness-and-builds.md); the wheel is kept in
#      .cache/wheels under a key of the flags and this machine, and rebuilt when absent;
#      the source distribution it is built from is kept in .cache/sdist, from which
#      tests/test_ngram_llama.py compiles llama.cpp's own n-gram cache code (g++) to
#      check that our -lcs/-lcd files and llama.cpp's read each other;
#   3. speculate itself with its test extras;
#   4. the real models the tests use (verified by sha256 on pull);
# then pytest, with any arguments given to this script.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SPECULATE_TEST_VENV:-.venv-test}
LLAMA_VERSION=0.3.36
LLAMA_CMAKE_ARGS="-DGGML_LLAMAFILE=OFF -DGGML_CPU_REPACK=OFF -DLLAVA_BUILD=OFF -DGGML_RPC=ON"
TEST_MODELS="smollm2-135m-instruct qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct"
# On a CPU with AMX (Intel Xeon since Sapphire Rapids) the native build compiles llama.cpp's AMX
# matmul, which crashes in the pinned version (llama.cpp issue 20824): left out of the build,
# since tests also load models with llama.cpp's defaults (speculate keeps weights out of it itself)
LLAMA_CFLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    LLAMA_CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip

machine=$(uname -m; "$VENV/bin/python" -c 'import sys; print(sys.version_info[:2])'; grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
key=$(printf '%s\n%s\n%s\n%s\n' "$LLAMA_VERSION" "$LLAMA_CMAKE_ARGS" "$LLAMA_CFLAGS" "$machine" | sha256sum | cut -c1-16)
sdist=.cache/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz
if [ ! -f "$sdist" ]; then
    "$VENV/bin/python" -m pip download --quiet --no-binary :all: --no-deps \
        "llama-cpp-python==$LLAMA_VERSION" -d .cache/sdist
fi
wheels=.cache/wheels/$key
if ! ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_VERSION with CMAKE_ARGS=\"$LLAMA_CMAKE_ARGS\"${LLAMA_CFLAGS:+ CFLAGS=\"$LLAMA_CFLAGS\"} (several minutes)"
    start=$SECONDS
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CFLAGS="${CFLAGS:-} $LLAMA_CFLAGS" CXXFLAGS="${CXXFLAGS:-} $LLAMA_CFLAGS" "$VENV/bin/python" -m pip wheel --quiet --no-deps --no-cache-dir \
        "$sdist" -w "$wheels.tmp"
    mv "$wheels.tmp" "$wheels"
    echo "built in $((SECONDS - start)) s"
fi
wheel=$(ls "$wheels"/llama_cpp_python-"$LLAMA_VERSION"-*.whl)
"$VENV/bin/python" -m pip install --quiet "$wheel" -e ".[test]"
# the same version from another build may already be installed: make sure it is this one
"$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps "$wheel"

for model in $TEST_MODELS; do
    "$VENV/bin/speculate" models pull "$model" >/dev/null
done

exec "$VENV/bin/python" -m pytest "$@"
