#!/usr/bin/env bash
# SFT step time on the demo Llama (full fine-tuning, batch 8, the sample data), candle vs MLX
# on the same CPU, with the same binary (built with --features mlx). Time per step is the
# difference between an N-step and a 1-step run over N − 1 (loading and the first step cancel);
# tokens/s likewise from the runs' num_tokens.
#   scripts/mlx/cargo.sh build --features mlx            # (or --release)
#   bash benches/mlx_vs_candle.sh target/debug/kiln 6
set -euo pipefail
KILN=${1:-target/debug/kiln}
N=${2:-6}
# Prints "<seconds> <tokens>": the run's wall time and the tokens trained on (num_tokens of
# the last logged step).
run() {
  local backend=$1 steps=$2
  local t0 t1 dir
  dir=$(mktemp -d)
  t0=$(date +%s.%N)
  "$KILN" train --task sft --backend "$backend" --lora-r 0 --max-steps "$steps" \
    --per-device-train-batch-size 8 --quiet --force --out "$dir/out" \
    --metrics "$dir/metrics.jsonl" >/dev/null 2>&1
  t1=$(date +%s.%N)
  echo "$(echo "$t1 - $t0" | bc) $(tail -1 "$dir/metrics.jsonl" | sed 's/.*"num_tokens":\([0-9.]*\).*/\1/')"
}
for backend in candle mlx; do
  read -r one tok1 <<<"$(run "$backend" 1)"
  read -r many tokn <<<"$(run "$backend" "$N")"
  step=$(echo "scale=3; ($many - $one) / ($N - 1)" | bc)
  tps=$(echo "scale=1; ($tokn - $tok1) / ($many - $one)" | bc)
  echo "$backend: $step s/step, $tps tokens/s (1 step: ${one}s, $N steps: ${many}s, $tokn tokens)"
done
