#!/usr/bin/env bash
# llama.cpp's command-line tools (llama-quantize, llama-imatrix, llama-perplexity) built from the
# llama.cpp source that llama-cpp-python 0.3.36's PyPI sdist vendors (the registry reachable here;
# no git clone; cmake from Debian's packages, installed here when missing). Output:
# ${LLAMA_CPP:-.llama-cpp}/bin/. About 15 minutes on 2 cores. Not part of CI; the peers'
# figures in BENCHMARKS.md come from these binaries.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${LLAMA_CPP:-$PWD/.llama-cpp}
VERSION=0.3.36
if ! command -v cmake >/dev/null; then
  apt-get install -y -q cmake >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q cmake >/dev/null; }
fi
mkdir -p "$DEST/src"
if [ ! -d "$DEST/src/llama_cpp_python-$VERSION" ]; then
  # The sdist itself, from PyPI's simple index: `pip download` of an sdist would first build its
  # metadata, which compiles ninja and cmake from source (a quarter of an hour on 2 cores).
  python3 - "$DEST/src" "$VERSION" <<'PY'
import re, sys, urllib.request
dest, version = sys.argv[1], sys.argv[2]
name = f"llama_cpp_python-{version}.tar.gz"
index = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
url = re.search(r'href="(https://[^"#]*/' + re.escape(name) + ')', index).group(1)
urllib.request.urlretrieve(url, f"{dest}/{name}")
PY
  tar -xzf "$DEST/src/llama_cpp_python-$VERSION.tar.gz" -C "$DEST/src"
fi
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
# No -march=native: the result must not depend on the building machine; AVX2/FMA as most x86.
cmake -S "$SRC" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$DEST/build" -j "$(nproc)" --target llama-quantize llama-imatrix llama-perplexity
mkdir -p "$DEST/bin"
for t in llama-quantize llama-imatrix llama-perplexity; do
  cp "$DEST/build/bin/$t" "$DEST/bin/"
done
echo "$DEST/bin: $(ls "$DEST/bin" | tr '\n' ' ')"
