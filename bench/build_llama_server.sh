#!/bin/bash
# Builds llama.cpp's llama-server (CPU only), the real engine tests/integration/test_realengine.py runs
# txlb in front of, from the llama.cpp tree vendored in the PyPI source distribution of
# llama-cpp-python 0.3.36 (llama.cpp commit 0c1e570), so nothing depends on a prebuilt
# binary.  About 10 minutes on two cores; needs cmake and a C++ compiler (installed with
# apt-get when missing and run as root).
#
#   bench/build_llama_server.sh [DEST_DIR]      # default: ../shared/realengine
#
# DEST_DIR gets llama-server; the tests look there (or in $TXLB_REALENGINE).  The model
# generator is bench/make_model.py (copied beside the binary too when missing).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
DEST="${1:-$ROOT/../shared/realengine}"
WORK="${WORK:-$(mktemp -d)}"
VERSION=0.3.36
mkdir -p "$DEST"
python3 -m pip download --no-deps --no-binary :all: -d "$WORK/dl" "llama-cpp-python==$VERSION"
tar -xzf "$WORK/dl/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "cmake and g++ are needed" >&2; exit 1; }
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake build-essential
fi
cmake -S "$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$WORK/build" \
  -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF
cmake --build "$WORK/build" --target llama-server -j"$(nproc)"
cp "$WORK/build/bin/llama-server" "$DEST/llama-server"
if [ ! -e "$DEST/make_model.py" ]; then
  cp "$HERE/make_model.py" "$DEST/make_model.py"
fi
echo "built $DEST/llama-server"
