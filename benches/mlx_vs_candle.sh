#!/usr/bin/env bash
# SFT step time on the demo Llama (full fine-tuning, batch 8, the sample data), candle vs MLX
# on the same CPU, with the same binary (built with --features mlx). Time per step is the
# difference between an N-step and a 1-step run over N − 1 (loading and the first step cancel).
#   scripts/mlx/cargo.sh build --features mlx            # (or --release)
#   bash benches/mlx_vs_candle.sh target/debug/kiln 6
set -euo pipefail
KILN=${1:-target/debug/kiln}
N=${2:-6}
run() {
  local backend=$1 steps=$2
  local t0 t1
  t0=$(date +%s.%N)
  "$KILN" train --task sft --backend "$backend" --lora-r 0 --max-steps "$steps" \
    --per-device-train-batch-size 8 --quiet --force --out "$(mktemp -d)/out" >/dev/null 2>&1
  t1=$(date +%s.%N)
  echo "$t1 - $t0" | bc
}
for backend in candle mlx; do
  one=$(run "$backend" 1)
  many=$(run "$backend" "$N")
  echo "$backend: $(echo "scale=3; ($many - $one) / ($N - 1)" | bc) s/step (1 step: ${one}s, $N steps: ${many}s)"
done
