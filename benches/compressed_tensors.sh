#!/usr/bin/env bash
# Export time and peak memory of kiln's compressed-tensors writer on the 254M demo model
# (Llama, bf16), beside llm-compressor 0.14.0.1 writing the same schemes (`oneshot` with
# `QuantizationModifier`, round to nearest, on the CPU), whole process (`/usr/bin/time`).
# Usage: benches/compressed_tensors.sh KILN LLMC_PY
#   KILN: a release kiln; LLMC_PY: a Python with tests/compat/requirements-llmc.txt installed.
# Figures go to stdout; BENCHMARKS.md records them.
set -euo pipefail
KILN=${1:?kiln binary}
LLMC_PY=${2:?python with llmcompressor}
W=${WORK:-/tmp/kiln-ct-bench}
mkdir -p "$W"
[ -f "$W/model/config.json" ] || "$KILN" demo-model --size 254m --out "$W/model" >/dev/null
# shellcheck source=benches/measure.sh
source "$(dirname "$0")/measure.sh"
echo "| export | wall time | peak RSS |"
echo "|---|---|---|"
for f in fp8-dynamic w4a16 nvfp4a16; do
  measure "kiln compressed-tensors $f" "$KILN" export --model "$W/model" \
    --output-format compressed-tensors --format $f --out "$W/k-$f" --force
done
for s in FP8_DYNAMIC W4A16 NVFP4A16; do
  rm -rf "$W/l-$s"
  measure "llm-compressor $s" "$LLMC_PY" -c "
import torch, transformers
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
m = transformers.AutoModelForCausalLM.from_pretrained('$W/model', dtype=torch.bfloat16)
oneshot(model=m, recipe=QuantizationModifier(targets='Linear', scheme='$s', ignore=['lm_head']),
        output_dir='$W/l-$s')"
done
# The two agree tensor by tensor (tests/it/compressed_tensors.rs requires it on the tiny models).
for f in fp8-dynamic:FP8_DYNAMIC w4a16:W4A16 nvfp4a16:NVFP4A16; do
  "$LLMC_PY" -c "
from safetensors import safe_open
import glob
def load(d):
    out = {}
    for f in glob.glob(d + '/*.safetensors'):
        with safe_open(f, 'pt') as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out
a, b = load('$W/k-${f%%:*}'), load('$W/l-${f##*:}')
same = a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                    and a[k].view(-1).view(__import__('torch').uint8).equal(b[k].view(-1).view(__import__('torch').uint8)) for k in a)
print(('identical' if same else 'DIFFERENT') + ': kiln ${f%%:*} and llm-compressor ${f##*:}, %d tensors' % len(a))"
done
