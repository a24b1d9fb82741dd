#!/usr/bin/env bash
# Prepares kiln's `mlx` feature on Linux x86-64 (MLX's CPU device). Stock mlx-rs / mlx-sys do not
# build there (mlx-c fetches MLX with git, Apple-only link lines, std::format, aarch64-only
# half types, a mach clock). This script:
#   1. installs cmake, libclang (bindgen) and {fmt} (std::format for g++ 12) from apt;
#   2. takes MLX itself prebuilt from PyPI (mlx-cpu, the version mlx-c pins) into target/mlx/dist,
#      and points the wheel's BLAS and LAPACK (netlib's reference code, about 7x slower than
#      candle's GEMMs) at OpenBLAS (apt's libopenblas0-pthread, the same ABI); set
#      KILN_MLX_BLAS=reference to keep the wheel's own;
#   3. copies the registry's mlx-sys / mlx-rs sources into target/mlx/src and applies kiln's
#      own patches (scripts/mlx/*.patch);
#   4. writes target/mlx/cargo.toml: a cargo config that patches crates.io to those copies and
#      tells the build (and `cargo test` / `cargo run`) where libmlx.so is.
# Then: cargo build --features mlx --config target/mlx/cargo.toml (or scripts/mlx/cargo.sh …).
# On macOS none of this is needed: `cargo build --features mlx` uses stock mlx-rs with Metal.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT="$ROOT/target/mlx"
MLX_VERSION=0.32.2
MLX_SYS=0.7.0
MLX_RS=0.33.0
PYTHON=${PYTHON:-python3}

if [ "$(uname -s)" != Linux ] || [ "$(uname -m)" != x86_64 ]; then
  echo "scripts/mlx/setup.sh is for Linux x86-64; on macOS build with --features mlx as is" >&2
  exit 1
fi

# What bindgen loads (clang-sys): libclang.so, libclang-N.so, libclang.so.N or libclang-N.so.N, in
# LIBCLANG_PATH or the usual folders. libclang-cpp (the C++ library, which the machine image
# ships as libclang-cpp14) is not it, and neither are the LLVM libraries beside it. ROOT_FS (for
# the self-test) is where the folders are looked for.
ROOT_FS=${MLX_SETUP_ROOT_FS:-}
has_libclang() {
  local dir f
  for dir in ${LIBCLANG_PATH:-} "$ROOT_FS"/usr/lib/llvm-*/lib "$ROOT_FS"/usr/lib/x86_64-linux-gnu \
    "$ROOT_FS"/usr/lib "$ROOT_FS"/usr/local/lib; do
    for f in "$dir"/libclang.so "$dir"/libclang.so.* "$dir"/libclang-[0-9]*.so "$dir"/libclang-[0-9]*.so.*; do
      [ -e "$f" ] && return 0
    done
  done
  return 1
}
needed_packages() {
  command -v cmake >/dev/null && [ -z "$ROOT_FS" ] || echo cmake
  [ -e "$ROOT_FS/usr/include/fmt/format.h" ] || echo libfmt-dev
  has_libclang || echo libclang-dev
  [ "${KILN_MLX_BLAS:-openblas}" = reference ] \
    || [ -e "$ROOT_FS/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3" ] \
    || echo libopenblas0-pthread
}
# `setup.sh --needs`: print the packages it would install, and stop (CI's self-test).
if [ "${1:-}" = --needs ]; then
  needed_packages
  exit 0
fi

mapfile -t need < <(needed_packages)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need[@]}"
  if ! has_libclang; then
    echo "scripts/mlx/setup.sh: libclang-dev is installed but no libclang.so is where bindgen looks; set LIBCLANG_PATH" >&2
    exit 1
  fi
fi

mkdir -p "$OUT"
if [ ! -e "$OUT/dist/mlx/lib/libmlx.so" ]; then
  rm -rf "$OUT/wheel" "$OUT/dist"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "mlx-cpu==$MLX_VERSION" -d "$OUT/wheel"
  mkdir -p "$OUT/dist"
  "$PYTHON" -m zipfile -e "$OUT"/wheel/mlx_cpu-*.whl "$OUT/dist"
fi

# BLAS and LAPACK under MLX: the wheel's libmlx.so finds its bundled copies by rpath
# (mlx_cpu.libs/libblas-*.so.*, liblapack-*.so.*); each becomes a link to OpenBLAS's library
# of the same interface, the wheel's own kept beside it (*.reference) to switch back.
OPENBLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread
for lib in blas lapack; do
  for f in "$OUT"/dist/mlx_cpu.libs/lib$lib-*.so.*; do
    case "$f" in *.reference) continue ;; esac
    [ -e "$f.reference" ] || { [ -L "$f" ] || cp "$f" "$f.reference"; }
    if [ "${KILN_MLX_BLAS:-openblas}" = reference ]; then
      rm -f "$f" && cp "$f.reference" "$f"
    else
      ln -sf "$OPENBLAS/lib$lib.so.3" "$f"
    fi
  done
done

# The registry sources (cargo fetch brings every locked package, the optional ones too).
(cd "$ROOT" && cargo fetch -q)
REG="${CARGO_HOME:-$HOME/.cargo}/registry/src"
find_src() {
  local d
  d=$(ls -d "$REG"/*/"$1" 2>/dev/null | head -n 1)
  [ -n "$d" ] || { echo "no $1 in $REG (cargo fetch did not bring it)" >&2; exit 1; }
  echo "$d"
}
# Patched once per set of patches (a rebuild of mlx-c takes minutes).
STAMP=$(cat "$ROOT"/scripts/mlx/*.patch | sha256sum | cut -c1-16)
if [ "$(cat "$OUT/src/.patched" 2>/dev/null)" != "$STAMP" ]; then
  rm -rf "$OUT/src"
  mkdir -p "$OUT/src"
  cp -r "$(find_src "mlx-sys-$MLX_SYS")" "$OUT/src/mlx-sys"
  cp -r "$(find_src "mlx-rs-$MLX_RS")" "$OUT/src/mlx-rs"
  for p in "$ROOT"/scripts/mlx/*.patch; do
    patch -s -d "$OUT/src" -p1 < "$p"
  done
  echo "$STAMP" > "$OUT/src/.patched"
fi

cat > "$OUT/cargo.toml" <<CFG
# Written by scripts/mlx/setup.sh: cargo --config target/mlx/cargo.toml
[patch.crates-io]
mlx-sys = { path = "$OUT/src/mlx-sys" }
mlx-rs = { path = "$OUT/src/mlx-rs" }

[env]
MLX_DIR = "$OUT/dist/mlx"
CFG
echo "$OUT/cargo.toml"
