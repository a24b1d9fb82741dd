#!/usr/bin/env python3
"""mlx-lm references for kiln's MLX GPTQ (tests/it/gptq.rs).

mlx-lm 0.32.2's own `mlx_lm.quant.gptq.gptq_quantize` quantizes the committed tiny Llama
(tests/compat/llama-tiny/model; its bf16 weights widened to f32, MLX's CPU device: MLX's Linux
CPU kernels are exact in f32 only) on the token ids of calib-32x64.jsonl (32 rows of 64, in
batches of 8 as the script's default), for each case below, into

    tests/compat/llama-tiny/mlx-gptq-<case>/{model.safetensors,config.json}

with every quantized layer's `weight` (packed codes), `scales` and `biases`. GPTQ covers every
Linear, `lm_head` included; the embedding is rounded to nearest with the same bits and group
(`--fallback-bits` / `--fallback-group-size` set to them, where the script's defaults are 6
and 64). kiln must choose the same codes (≥ 99 %) with the same scales and biases (within 1 %;
kiln stores them in the checkpoint's bf16, mlx-lm in the f32 it ran in):

    python3 -m pip install "mlx[cpu]==0.32.4" mlx-lm==0.32.2    # scripts/ci-deps.sh pins these
    python3 tests/compat/mlx_gptq_ref.py [CASE ...]              # all by default

Runs in a few seconds.
"""
import json
import pathlib
import shutil
import sys

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.quant.gptq import gptq_quantize
from mlx_lm.utils import load_model

HERE = pathlib.Path(__file__).resolve().parent
MODEL = HERE / "llama-tiny"
# case -> (bits, group size)
CASES = {"q4": (4, 64), "q8": (8, 64), "q4-g32": (4, 32)}


def main(argv):
    rows = [json.loads(l)["input_ids"] for l in (MODEL / "calib-32x64.jsonl").read_text().splitlines()]
    data = mx.array(rows)
    for case, (bits, group) in CASES.items():
        if argv and case not in argv:
            continue
        mx.random.seed(123)
        model, _ = load_model(MODEL / "model", lazy=False)
        model.set_dtype(mx.float32)
        model, config = gptq_quantize(model, data, bits, group, bits, group, batch_size=8)
        dst = MODEL / f"mlx-gptq-{case}"
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir()
        cfg = json.loads((MODEL / "model" / "config.json").read_text())
        cfg["quantization"] = cfg["quantization_config"] = config
        (dst / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
        weights = dict(tree_flatten(model.parameters()))
        mx.save_safetensors(str(dst / "model.safetensors"), weights,
                            metadata={"source": "mlx-lm 0.32.2 mlx_lm.quant.gptq.gptq_quantize",
                                      "quantization": json.dumps(config)})
        print(f"{dst.name}: {len(weights)} tensors, quantization {config}")


if __name__ == "__main__":
    main(sys.argv[1:])
