#!/usr/bin/env bash
# Runs kiln's CUDA kernel tests and benchmarks on a machine with an NVIDIA GPU but no Rust
# toolchain, from binaries built elsewhere:
#   cargo test  --release -p kiln-kernels --features cuda --test cuda  --no-run
#   cargo bench           -p kiln-kernels --features cuda --bench cuda --no-run
# then copy both executables into one folder and run `scripts/cuda-device-check.sh FOLDER`.
# Optional beside them: `simd-test` (tests/simd_equals_reference) and `cpu-bench`
# (benches/kernels) to measure the CPU kernels on that machine's processor too.
# Finds libnvrtc (CUDA toolkit or the PyPI wheel) and the driver's libcuda itself.
set -uo pipefail
bin=${1:?usage: cuda-device-check.sh FOLDER-WITH-cuda-test-AND-cuda-bench}
out=${OUT:-/tmp/kiln-cuda}
mkdir -p "$out"

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
# The toolkit's stubs/ folder holds link-time stand-ins (libcuda, libnvrtc) that fail at run
# time: never take a library from there.
nvrtc=$(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | grep -v -e builtins -e alt -e stubs | sort | tail -1)
[ -n "$nvrtc" ] || { echo "no libnvrtc found"; exit 1; }
echo "libnvrtc: $nvrtc"
mkdir -p /tmp/kiln-nvlib && ln -sf "$nvrtc" /tmp/kiln-nvlib/libnvrtc.so
export LD_LIBRARY_PATH=/tmp/kiln-nvlib:/usr/local/nvidia/lib64:$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}
ldconfig -p | grep -m2 'libcuda.so' || ls /usr/local/nvidia/lib64 | grep -m3 libcuda

status=0
echo "== tests (every kernel vs the CPU reference) =="
"$bin/cuda-test" --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$out/cuda-test.log" || status=1
echo "== benchmarks =="
"$bin/cuda-bench" --bench 2>&1 | grep -e "^GPU" -e "^cuda" -e "thrpt" -e skipped | tee "$out/cuda-bench.log" || status=1
if [ -x "$bin/simd-test" ]; then
  echo "== CPU: SIMD == scalar on this machine's CPU =="
  grep -o -w -e avx2 -e avx512f -e avx512bw -e avx512vl -e avx512_fp16 -e avx512_bf16 /proc/cpuinfo | sort | uniq -c
  "$bin/simd-test" 2>&1 | tail -3 | tee "$out/simd-test.log" || status=1
fi
if [ -x "$bin/cpu-bench" ]; then
  echo "== CPU benchmarks (KILN_BENCH_SIZES=${KILN_BENCH_SIZES:=8192}) =="
  KILN_BENCH_SIZES=$KILN_BENCH_SIZES "$bin/cpu-bench" --bench 2>&1 | grep -e "^kernels" -e "thrpt" | tee "$out/cpu-bench.log" || status=1
fi
exit $status
