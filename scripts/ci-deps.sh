#!/usr/bin/env bash
# Installs what .ci/run needs beyond the Rust toolchain the machine ships with:
# - the rustfmt and clippy components;
# - NVRTC from PyPI (`nvidia-cuda-nvrtc-cu12`, no GPU needed), so CI compiles every CUDA kernel
#   to PTX. Prints the folder holding libnvrtc on its last line;
# - llama.cpp's Python package gguf (gguf-py), numpy and sentencepiece, pinned: tests/it/gguf.rs
#   and tests/it/gguf_export.rs have them read the GGUF files kiln writes (sentencepiece reads the
#   SentencePiece fixture's pieces independently of kiln);
# - MLX on the CPU and mlx-lm, pinned: tests/it/mlx_export.rs compares kiln's MLX exports with
#   `mlx_lm.convert` and runs them in mlx-lm;
# - torch, transformers and compressed-tensors, pinned (tests/compressed_tensors/requirements.txt),
#   in their own venv target/ct-venv: tests/it/compressed_tensors.rs has transformers load kiln's
#   compressed-tensors exports.
set -euo pipefail
need=()
cargo fmt --version >/dev/null 2>&1 || need+=(rustfmt)
cargo clippy --version >/dev/null 2>&1 || need+=(clippy)
if [ ${#need[@]} -gt 0 ]; then
  echo "ci-deps: installing rust components: ${need[*]}" >&2
  rustup component add "${need[@]}" >&2
fi
if ! python3 -c "import gguf, numpy, sentencepiece" 2>/dev/null; then
  echo "ci-deps: installing gguf-py (gguf==0.19.0, numpy==2.4.6) and sentencepiece==0.2.3" >&2
  python3 -m pip install -q --disable-pip-version-check gguf==0.19.0 numpy==2.4.6 \
    sentencepiece==0.2.3 >&2
fi
if ! python3 -c "import mlx_lm" 2>/dev/null; then
  echo "ci-deps: installing mlx[cpu]==0.32.4 and mlx-lm==0.32.2" >&2
  python3 -m pip install -q --disable-pip-version-check "mlx[cpu]==0.32.4" mlx-lm==0.32.2 >&2
fi
ct_venv=target/ct-venv
if ! "$ct_venv/bin/python" -c "import compressed_tensors, torch, transformers" 2>/dev/null; then
  echo "ci-deps: installing torch, transformers and compressed-tensors into $ct_venv" >&2
  python3 -m venv "$ct_venv" >&2
  "$ct_venv/bin/pip" install -q --disable-pip-version-check \
    -r tests/compressed_tensors/requirements.txt >&2
fi
nvrtc_dir() {
  python3 -c "import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null
}
if ! nvrtc_dir >/dev/null; then
  echo "ci-deps: installing nvidia-cuda-nvrtc-cu12 (NVRTC for the PTX compile test)" >&2
  python3 -m pip install -q --disable-pip-version-check nvidia-cuda-nvrtc-cu12==12.8.93 >&2
fi
nvrtc_dir
