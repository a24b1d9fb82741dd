#!/usr/bin/env bash
# Installs NVIDIA's CUDA 13.0 compiler from PyPI into target/cuda-toolkit, so that candle's CUDA
# backend (`--features candle-cuda`: candle-kernels compiles its kernels with nvcc at build
# time) builds on machines without a CUDA installation or a GPU. No root, no apt.
#
# Why 13.0: the lent H200s run driver 580.159.04 (BENCHMARKS.md), which accepts CUDA 13.0
# binaries and PTX; a newer toolkit's PTX would be refused by that driver. The `-cu12` wheels
# carry ptxas / libnvvm only, not nvcc.
#
# Wheels (pinned), merged under target/cuda-toolkit/nvidia/cu13:
#   nvidia-cuda-nvcc     bin/nvcc, ptxas, fatbinary, nvlink
#   nvidia-cuda-crt      include/crt (host_config.h, …: every .cu includes them)
#   nvidia-nvvm          nvvm/bin/cicc (nvcc's front end) and libdevice
#   nvidia-cuda-runtime  include/cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, cuda_fp8.h; libcudart
#   nvidia-cuda-cccl     include/cccl (cub, thrust, libcu++)
#
# Link stubs (lib/stubs): candle links cudarc at build time (`-lcuda -lnvrtc -lcublas
# -lcublasLt -lcurand`). The driver's libcuda exists only where a driver is installed, and the
# math libraries are hundreds of MB of wheels; for a build check, stub libraries with the real
# sonames (libcuda.so.1, libnvrtc.so.13, libcublas.so.13, libcublasLt.so.13, libcurand.so.10)
# and every function cudarc declares are generated instead, as NVIDIA's own `lib/stubs` are.
# A binary linked against them runs where the real libraries are (the driver's and CUDA 13's);
# it is not for running here.
#
# Prints, on its last line, the toolkit root (CUDA_ROOT / CUDA_PATH): bin/nvcc, include, lib.
# Use:  root=$(bash scripts/cuda-toolkit.sh | tail -n 1)
#       PATH="$root/bin:$PATH" CUDA_ROOT="$root" CUDA_COMPUTE_CAP=90 CUDAFORGE_THREADS=2 \
#         LIBRARY_PATH="$root/lib:$root/lib/stubs" cargo build --features candle-cuda,cuda
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/cuda-toolkit
root="$PWD/$dir/nvidia/cu13"
if [ ! -x "$root/bin/nvcc" ] || [ ! -x "$root/nvvm/bin/cicc" ] \
  || [ ! -f "$root/include/cuda_runtime.h" ] || [ ! -f "$root/include/crt/host_config.h" ]; then
  echo "cuda-toolkit: installing nvcc, crt, nvvm 13.0.88, cudart 13.0.96, cccl 13.0.85 into $dir" >&2
  python3 -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$dir" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 >&2
fi
# pip keeps the wheels' files but not always their execute bits; the linker wants an unversioned
# libcudart.so (candle-kernels links `-lcudart`).
chmod +x "$root"/bin/* "$root"/nvvm/bin/* 2>/dev/null || true
[ -e "$root/lib/libcudart.so" ] || ln -s libcudart.so.13 "$root/lib/libcudart.so"
if [ ! -f "$root/lib/stubs/libcuda.so" ]; then
  cudarc=$(cargo metadata --format-version 1 --features kiln/candle-cuda 2>/dev/null | python3 -c '
import json, sys
m = json.load(sys.stdin)
print(next(p["manifest_path"] for p in m["packages"] if p["name"] == "cudarc").rsplit("/", 1)[0])')
  mkdir -p "$root/lib/stubs"
  python3 - "$cudarc/src" "$root/lib/stubs" <<'PY'
import re, subprocess, sys
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
libs = {"driver": ("libcuda.so", "libcuda.so.1"), "nvrtc": ("libnvrtc.so", "libnvrtc.so.13"),
        "cublas": ("libcublas.so", "libcublas.so.13"), "cublaslt": ("libcublasLt.so", "libcublasLt.so.13"),
        "curand": ("libcurand.so", "libcurand.so.10")}
for module, (name, soname) in libs.items():
    names = sorted(set(re.findall(r"^pub unsafe fn (\w+)\(", (src / module / "sys/mod.rs").read_text(), re.M)))
    c = out / f"{module}.c"
    c.write_text("".join(f"void {n}(void) {{}}\n" for n in names))
    subprocess.run(["cc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out / name), str(c)], check=True)
    print(f"cuda-toolkit: link stub {soname}: {len(names)} functions", file=sys.stderr)
PY
fi
"$root/bin/nvcc" --version | tail -n 2 >&2
echo "$root"
