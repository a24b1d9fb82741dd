"""mlx-lm's view of an adapter kiln wrote: loads tests/train/mlx-lm/adapter (kiln's
`--adapter-format mlx-lm` layout of tests/train/peft/adapter, see tests/it/train.rs) onto the tiny
Llama with `mlx_lm.load`, runs fixed token ids on MLX's CPU device and saves the logits, which
kiln must reproduce when it loads the same adapter.

    venv/bin/pip install mlx-cpu==0.32.2 mlx==0.32.2 mlx-lm==0.32.2
    # kiln's QLoRA adapter in mlx-lm's layout (what tests/it/qlora.rs loads):
    kiln train --task sft --backend mlx --model tests/train/qtiny/mlx-q4 --data tests/train/data/sft.jsonl \
        --out tests/train/qtiny/kiln-mlx-adapter --max-steps 3 --learning-rate 1e-2 --lora-r 4 \
        --lora-alpha 8 --lora-dropout 0 --lora-target-modules q_proj,v_proj,down_proj \
        --per-device-train-batch-size 4 --train-sampling-strategy sequential --adapter-format mlx-lm --quiet --force
    venv/bin/python tests/train/mlx_lm_check.py   # rewrites tests/train/mlx-lm/mlx_lm_logits.safetensors
                                                  # and tests/train/qtiny/mlx_lm_logits.safetensors
"""

import os

import mlx.core as mx
import numpy as np
from mlx_lm import load
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
IDS = [[1, 53, 47, 54, 61, 55, 2, 3], [1, 72, 73, 74, 75, 76, 77, 78]]


def logits(model_dir, adapter_dir, out):
    model, _ = load(model_dir, adapter_path=adapter_dir)
    model.eval()
    logits = model(mx.array(IDS)).astype(mx.float32)
    mx.eval(logits)
    save_file({"ids": np.array(IDS, dtype=np.int64), "logits": np.array(logits)}, out)
    print(out, np.array(logits).shape)


def main():
    mx.set_default_device(mx.cpu)
    logits(os.path.join(HERE, "tiny", "model"), os.path.join(HERE, "mlx-lm", "adapter"),
           os.path.join(HERE, "mlx-lm", "mlx_lm_logits.safetensors"))
    logits(os.path.join(HERE, "qtiny", "mlx-q4"), os.path.join(HERE, "qtiny", "kiln-mlx-adapter"),
           os.path.join(HERE, "qtiny", "mlx_lm_logits.safetensors"))


if __name__ == "__main__":
    main()
