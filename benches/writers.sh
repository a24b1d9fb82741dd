#!/usr/bin/env bash
# Export time and peak memory of each kiln writer on the 254M demo model (Llama, bf16), beside
# the consumers' own converters, whole process (`/usr/bin/time`):
#   gguf q4-k-m / q8-0   vs  llama.cpp's convert_hf_to_gguf.py --outtype bf16, then
#                            llama_model_quantize (llama-quantize's code, through
#                            llama-cpp-python: this build has no llama-quantize binary)
#   mlx q4 / mxfp4       vs  mlx_lm.convert -q
#   modelopt nvfp4           (the reference point)
# Usage: benches/writers.sh KILN LLAMA_PY MLX_PY [LLAMA_CPP_DIR]
#   KILN: a release kiln; LLAMA_PY: a Python with llama_cpp, torch, transformers and numpy
#   (scripts/gguf/llama_cpp_check.sh makes one); MLX_PY: a Python with mlx[cpu] and mlx-lm;
#   LLAMA_CPP_DIR: llama.cpp's sources as vendored in llama-cpp-python 0.3.36 (downloaded from
#   PyPI when absent). Figures go to stdout; BENCHMARKS.md records them.
set -euo pipefail
KILN=${1:?kiln binary}
LLAMA_PY=${2:?python with llama_cpp}
MLX_PY=${3:?python with mlx-lm}
LLAMA=${4:-}
W=${WORK:-/tmp/kiln-writers-bench}
mkdir -p "$W"
if [ -z "$LLAMA" ]; then
  if [ ! -d "$W/llama_cpp_python-0.3.36" ]; then
    "$LLAMA_PY" -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$W"
    tar -xzf "$W"/llama_cpp_python-0.3.36.tar.gz -C "$W"
  fi
  LLAMA="$W/llama_cpp_python-0.3.36/vendor/llama.cpp"
fi
[ -f "$W/model/config.json" ] || "$KILN" demo-model --size 254m --out "$W/model" >/dev/null
# shellcheck source=benches/measure.sh
source "$(dirname "$0")/measure.sh"
echo "| export | wall time | peak RSS |"
echo "|---|---|---|"
measure "kiln modelopt nvfp4" "$KILN" export --model "$W/model" --format nvfp4 --act-amax "$W/model/amax.json" --out "$W/k-nvfp4" --force
for f in q4-k-m q8-0; do
  measure "kiln gguf $f" "$KILN" export --model "$W/model" --output-format gguf --format $f --out "$W/k-gguf-$f" --force
done
for f in q4 mxfp4; do
  measure "kiln mlx $f" "$KILN" export --model "$W/model" --output-format mlx --format $f --out "$W/k-mlx-$f" --force
done
# The converter refuses the demo's byte-level tokenizer (its pre-tokenizer hash is in no table:
# "BPE pre-tokenizer was not recognized"); it is run with that lookup answering `default`, which
# is what kiln writes for it. The tensors, which are the work, are converted unchanged.
measure "llama.cpp convert_hf_to_gguf.py --outtype bf16" env PYTHONPATH="$LLAMA:$LLAMA/gguf-py" \
  "$LLAMA_PY" -c "
import runpy, sys
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'default'
sys.argv = ['convert_hf_to_gguf.py', '$W/model', '--outtype', 'bf16', '--outfile', '$W/l-bf16.gguf']
runpy.run_path('$LLAMA/convert_hf_to_gguf.py', run_name='__main__')"
for f in q4-k-m:15 q8-0:7; do
  measure "llama.cpp quantize ${f%%:*} (from the bf16 file)" "$LLAMA_PY" -c "
import ctypes, llama_cpp
p = llama_cpp.llama_model_quantize_default_params(); p.ftype = ${f##*:}; p.nthread = $(nproc)
assert llama_cpp.llama_model_quantize(b'$W/l-bf16.gguf', b'$W/l-${f%%:*}.gguf', ctypes.byref(p)) == 0"
done
for f in "q4:--q-bits 4 --q-group-size 64" "mxfp4:--q-mode mxfp4"; do
  rm -rf "$W/m-${f%%:*}"
  # shellcheck disable=SC2086
  measure "mlx_lm.convert -q ${f#*:}" "$MLX_PY" -m mlx_lm convert --hf-path "$W/model" --mlx-path "$W/m-${f%%:*}" -q ${f#*:}
done
