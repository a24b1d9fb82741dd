#!/usr/bin/env bash
# The calibration benchmark (BENCHMARKS.md "Calibration"): whole-process wall time, calibration
# time and peak RSS of `kiln export --calib` (max calibration for fp8, AWQ's scale search for
# int4-awq) on a generated 1.1B-parameter Llama, beside ModelOpt's calibration and export on the
# CPU on the same model and the same 8 × 64 token ids.
#
#   bash benches/calib.sh [WORKDIR] [PYTHON_WITH_MODELOPT]
# WORKDIR needs ~10 GB free; PYTHON_WITH_MODELOPT (a venv made from
# tests/compat/requirements.txt) also writes the token ids; without it kiln calibrates on ids
# it draws itself.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-target/calib-bench}
py=${2:-}
mkdir -p "$work"
cargo build --release --quiet
kiln=target/release/kiln

. benches/measure.sh
measure() { # label, command... — with the calibration time kiln or the ModelOpt peer reports
  local label=$1 calib
  timed "$@"
  calib=$(grep -ho 'in [0-9.]* s' "$work/$label.time" "$work/$label.out" | head -n 1 || true)
  [ -n "$calib" ] || calib=$(grep -ho 'calibration: [0-9.]* s' "$work/$label.out" | head -n 1 || true)
  printf '| %s | %s | %s | %s MB |\n' "$label" "$wall" "${calib:-—}" "$rss_mb"
}

[ -d "$work/llama-1b" ] || $kiln demo-model --size 1b --out "$work/llama-1b"
du -sh "$work/llama-1b"
ids="$work/calib.jsonl"
if [ -n "$py" ]; then
  # ModelOpt's run also writes the ids kiln then calibrates on.
  rm -rf "$work/modelopt-fp8"
  measure "modelopt fp8" "$py" benches/peers/modelopt_export.py --model "$work/llama-1b" \
    --format fp8 --out "$work/modelopt-fp8" --ids-out "$ids"
  for fmt in int4-awq int4-awq-full; do
    rm -rf "$work/modelopt-$fmt"
    measure "modelopt $fmt" "$py" benches/peers/modelopt_export.py --model "$work/llama-1b" \
      --format $fmt --out "$work/modelopt-$fmt"
  done
elif [ ! -f "$ids" ]; then
  python3 -c 'import json, random; r = random.Random(0); print("\n".join(json.dumps({"input_ids": [r.randrange(32000) for _ in range(64)]}) for _ in range(8)))' > "$ids"
fi
echo "| run | wall (m:ss) | calibration | peak RSS |"
echo "|---|---:|---:|---:|"
for fmt in fp8 int4-awq; do
  rm -rf "$work/kiln-$fmt"
  measure "kiln $fmt" $kiln export --model "$work/llama-1b" --format $fmt --calib "$ids" \
    --out "$work/kiln-$fmt"
done
rm -rf "$work/kiln-int4-awq-clip"
measure "kiln int4-awq --awq-clip" $kiln export --model "$work/llama-1b" --format int4-awq \
  --calib "$ids" --awq-clip --out "$work/kiln-int4-awq-clip"
