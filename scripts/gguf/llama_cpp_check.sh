#!/usr/bin/env bash
# kiln's GGUF checked by llama.cpp itself: builds llama-cpp-python 0.3.36 from its PyPI sdist
# (a C++ build of llama.cpp: ~25 min on 2 cores) into .venv-llama-cpp with torch (CPU),
# transformers and gguf-py, builds kiln, and runs llama_cpp_check.py. Not part of CI (the build
# is long); its last result is in BENCHMARKS.md / docs/FORMATS.md §7.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-llama-cpp}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q scikit-build-core diskcache jinja2 numpy gguf==0.19.0 transformers==5.0.0 \
    --extra-index-url https://download.pytorch.org/whl/cpu torch
fi
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  # No -march=native: the result must not depend on the building machine; AVX2/FMA as most x86.
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF" \
    "$VENV/bin/pip" install --no-deps --no-build-isolation --no-binary :all: llama-cpp-python==0.3.36
fi
cargo build --release
exec "$VENV/bin/python" scripts/gguf/llama_cpp_check.py --kiln target/release/kiln \
  --work "${WORK:-/tmp/kiln-llama-cpp}" "$@"
