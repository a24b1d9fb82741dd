#!/usr/bin/env bash
# Max calibration in bf16 (BENCHMARKS.md "bf16 GEMMs for calibration"): `kiln export --format
# fp8 --calib --calib-dtype bf16` before and after a change, kiln in f32, and ModelOpt's bf16
# calibration, on the generated 1.1B Llama and the same 8 × 64 token ids, the runs interleaved
# ROUNDS times (this machine's timings drift by ±15 % from run to run).
#
#   bash benches/calib_bf16.sh KILN_BEFORE KILN_AFTER PYTHON_WITH_MODELOPT [WORKDIR] [ROUNDS]
# One row per run: label, whole process, calibration (as each side reports it), peak RSS.
set -euo pipefail
before=$1 after=$2 py=$3 work=${4:-target/calib-bench} rounds=${5:-3}
cd "$(dirname "$0")/.."
mkdir -p "$work"
[ -d "$work/llama-1b" ] || "$after" demo-model --size 1b --out "$work/llama-1b"
ids="$work/calib.jsonl"
run() { # label, command...
  local label=$1; shift
  /usr/bin/time -f "%e %M" -o "$work/time" "$@" >"$work/out" 2>&1 || { cat "$work/out"; exit 1; }
  read -r secs kb <"$work/time"
  calib=$(grep -ho 'quantizers in [0-9.]* s\|calibration: [0-9.]* s' "$work/out" | grep -o '[0-9.]* s' | head -n 1)
  printf '| %s | %.1f s | %s | %d MB |\n' "$label" "$secs" "$calib" "$((kb / 1024))"
}
run "ModelOpt 0.47 fp8 (bf16)" "$py" benches/peers/modelopt_export.py --model "$work/llama-1b" \
  --format fp8 --out "$work/modelopt-fp8" --ids-out "$ids" >/dev/null
echo "| run | whole process | calibration | peak RSS |"
echo "|---|---:|---:|---:|"
for _ in $(seq "$rounds"); do
  run "ModelOpt 0.47 fp8 (bf16)" "$py" benches/peers/modelopt_export.py --model "$work/llama-1b" \
    --format fp8 --out "$work/modelopt-fp8"
  for side in before after; do
    bin=$before; [ $side = after ] && bin=$after
    run "kiln $side, --calib-dtype bf16" "$bin" export --model "$work/llama-1b" --format fp8 \
      --calib "$ids" --calib-dtype bf16 --out "$work/kiln-bf16-$side" --force
  done
  run "kiln after, f32" "$after" export --model "$work/llama-1b" --format fp8 --calib "$ids" \
    --out "$work/kiln-f32" --force
done
