"""mlx-lm's view of an adapter kiln wrote: loads tests/train/mlx-lm/adapter (kiln's
`--adapter-format mlx-lm` layout of tests/train/peft/adapter, see tests/it/train.rs) onto the tiny
Llama with `mlx_lm.load`, runs fixed token ids on MLX's CPU device and saves the logits, which
kiln must reproduce when it loads the same adapter.

    venv/bin/pip install mlx-cpu==0.32.2 mlx==0.32.2 mlx-lm==0.32.2
    venv/bin/python tests/train/mlx_lm_check.py   # rewrites tests/train/mlx-lm/mlx_lm_logits.safetensors
"""

import os

import mlx.core as mx
import numpy as np
from mlx_lm import load
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
IDS = [[1, 53, 47, 54, 61, 55, 2, 3], [1, 72, 73, 74, 75, 76, 77, 78]]


def main():
    model, _ = load(os.path.join(HERE, "tiny", "model"),
                    adapter_path=os.path.join(HERE, "mlx-lm", "adapter"))
    model.eval()
    logits = model(mx.array(IDS)).astype(mx.float32)
    mx.eval(logits)
    save_file({"ids": np.array(IDS, dtype=np.int64), "logits": np.array(logits)},
              os.path.join(HERE, "mlx-lm", "mlx_lm_logits.safetensors"))
    print("logits", np.array(logits).shape)


if __name__ == "__main__":
    main()
