#!/usr/bin/env bash
# The export benchmark (BENCHMARKS.md "Export"): whole-process wall time and peak RSS of
# `kiln export` on a generated 254M-parameter Llama (fp8, nvfp4), beside ModelOpt on the CPU on
# the same model when a Python with ModelOpt is given, and of `kiln export` on a generated
# ~7.6 GB model (peak memory must not grow with the model).
#
#   bash benches/export.sh [WORKDIR] [PYTHON_WITH_MODELOPT]
# WORKDIR needs ~25 GB free; PYTHON_WITH_MODELOPT (e.g. a venv made from
# tests/compat/requirements.txt) is optional.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-target/export-bench}
py=${2:-}
mkdir -p "$work"
cargo build --release --quiet
kiln=target/release/kiln

. benches/measure.sh
measure() { # label, command...
  timed "$@"
  printf '| %s | %s | %s MB |\n' "$1" "$wall" "$rss_mb"
}

[ -d "$work/llama-254m" ] || $kiln demo-model --size 254m --out "$work/llama-254m"
[ -d "$work/llama-8gb" ] || $kiln demo-model --size 8gb --out "$work/llama-8gb"
du -sh "$work/llama-254m" "$work/llama-8gb"

echo "| run | wall (m:ss) | peak RSS |"
echo "|---|---:|---:|"
# Outputs are removed before each run (as for ModelOpt), so no run pays for deleting the last.
for fmt in fp8 nvfp4; do
  rm -rf "$work/kiln-254m-$fmt"
  measure "kiln $fmt 254M" $kiln export --model "$work/llama-254m" --format $fmt \
    --act-amax "$work/llama-254m/amax.json" --out "$work/kiln-254m-$fmt"
done
if [ -n "$py" ]; then
  for fmt in fp8 nvfp4; do
    rm -rf "$work/modelopt-254m-$fmt"
    measure "modelopt $fmt 254M" "$py" benches/peers/modelopt_export.py --model "$work/llama-254m" \
      --format $fmt --out "$work/modelopt-254m-$fmt"
  done
fi
for fmt in fp8 nvfp4; do
  rm -rf "$work/kiln-8gb-$fmt"
  measure "kiln $fmt 7.6GB" $kiln export --model "$work/llama-8gb" --format $fmt \
    --act-amax "$work/llama-8gb/amax.json" --out "$work/kiln-8gb-$fmt"
done
