#!/usr/bin/env bash
# Measure how long llama-cpp-python takes to build from source on this machine,
# once per CMAKE_ARGS variant given (default: the stock build and -DLLAVA_BUILD=OFF).
#   scripts/build_time.sh ["CMAKE ARGS" ...] [> build-time.txt]
# Each build runs in a fresh temporary venv with pip's cache off; nothing is installed.
# The first line says when and where.
set -euo pipefail
VERSION=0.3.36
[ $# -gt 0 ] || set -- "" "-DLLAVA_BUILD=OFF"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
"$work/venv/bin/python" -m pip download --quiet --no-deps --no-binary :all: \
    "llama-cpp-python==$VERSION" -d "$work/sdist"
echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), $(nproc) cores, commit $(git -C "$(dirname "$0")" rev-parse --short HEAD 2>/dev/null || echo unknown)"
for args in "$@"; do
    start=$(date +%s)
    CMAKE_ARGS="$args" "$work/venv/bin/python" -m pip wheel --quiet --no-deps --no-cache-dir \
        "$work"/sdist/llama_cpp_python-"$VERSION".tar.gz -w "$work/wheel"
    rm -rf "$work/wheel"
    echo "CMAKE_ARGS=\"$args\": $(( $(date +%s) - start )) s on $(nproc) cores"
done
