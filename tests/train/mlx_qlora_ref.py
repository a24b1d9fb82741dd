"""mlx-lm QLoRA references for kiln (tests/it/qlora.rs): mlx-lm's LoRA on its own 4-bit model,
on MLX's CPU device, in f32.

1. mlx-lm quantizes the 64-wide tiny Llama (tests/train/qtiny/model, f32) as `mlx_lm.convert
   -q` does, with its defaults (affine, 4 bits, groups of 64; embeddings and lm_head too),
   keeping f32: tests/train/qtiny/mlx-q4, the base kiln trains from.
2. The initial adapter is mlx-lm's own (`linear_to_lora_layers`, rank 4, scale 2, every
   projection of both layers, seeded), with `lora_b` drawn non-zero so that the first steps
   move `lora_a` too: tests/train/qtiny/mlx-init-adapter, in mlx-lm's adapter layout.
3. mlx-lm's `train` runs six steps on tests/train/data/sft-text.jsonl (six texts, one batch of
   six: every step sees the same batch, whatever the order), AdamW with bias correction and no
   weight decay (the optimizer TRL's defaults describe; mlx-lm's CLI takes it as `--optimizer
   adamw` with `bias_correction: true, weight_decay: 0.0` in its config), no gradient clipping,
   a constant learning rate, reporting every step.

mlx-lm 0.32.2's `default_loss` counts one target past each row's end (`steps <= length`: the pad
id 0 after the last token, ml-explore/mlx-lm PR 1697), which TRL (and kiln) do not; the
reference run uses the same loss with `steps < length`, and the run with mlx-lm's own loss is
recorded beside it (`default_loss`).

    python3 -m pip install mlx==0.32.4 mlx-lm==0.32.2      # MLX's CPU build on Linux
    python3 tests/train/mlx_qlora_ref.py                   # rewrites tests/train/mlx_qlora_reference.json
"""
import json
import os
import shutil
import tempfile

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
from mlx_lm import convert, load
from mlx_lm.tuner.datasets import CacheDataset, TextDataset
from mlx_lm.tuner.trainer import TrainingArgs, TrainingCallback, default_loss, train
from mlx_lm.tuner.utils import linear_to_lora_layers

HERE = os.path.dirname(os.path.abspath(__file__))
QTINY = os.path.join(HERE, "qtiny")
MODEL = os.path.join(QTINY, "model")
BASE = os.path.join(QTINY, "mlx-q4")
ADAPTER = os.path.join(QTINY, "mlx-init-adapter")
DATA = os.path.join(HERE, "data", "sft-text.jsonl")
OUT = os.path.join(HERE, "mlx_qlora_reference.json")

KEYS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
LORA = {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": KEYS}
STEPS = 6
LR = 1e-2


def quantize():
    shutil.rmtree(BASE, ignore_errors=True)
    convert(MODEL, mlx_path=BASE, quantize=True, dtype="float32")


def initial_adapter():
    shutil.rmtree(ADAPTER, ignore_errors=True)
    os.makedirs(ADAPTER)
    mx.random.seed(7)
    model, _ = load(BASE)
    model.freeze()
    linear_to_lora_layers(model, 2, LORA)
    rng = np.random.default_rng(7)
    for layer in model.layers:
        for _, m in layer.named_modules():
            if hasattr(m, "lora_b"):
                m.lora_b = mx.array(rng.normal(0.0, 0.05, m.lora_b.shape).astype(np.float32))
    weights = dict(mlx_lm.utils.tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(os.path.join(ADAPTER, "adapters.safetensors"), weights)
    with open(os.path.join(ADAPTER, "adapter_config.json"), "w") as f:
        json.dump({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": LORA}, f, indent=2)
        f.write("\n")


def loss_within_rows(model, batch, lengths):
    """mlx-lm's default_loss with `steps < length`: each row's own targets only."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps < lengths[:, 1:])
    ce = nn.losses.cross_entropy(logits, targets) * mask
    ntoks = mask.sum()
    return ce.astype(mx.float32).sum() / ntoks, ntoks


class Losses(TrainingCallback):
    def __init__(self):
        self.losses = []

    def on_train_loss_report(self, info):
        self.losses.append(info["train_loss"])


def run(loss):
    mx.random.seed(0)
    model, tok = load(BASE, adapter_path=ADAPTER)
    model.freeze()
    for layer in model.layers:
        for _, m in layer.named_modules():
            if hasattr(m, "lora_a"):
                m.unfreeze(keys=["lora_a", "lora_b"], recurse=False)
    with open(DATA) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    data = CacheDataset(TextDataset(rows, tok))
    opt = optim.AdamW(learning_rate=LR, weight_decay=0.0, bias_correction=True)
    rec = Losses()
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArgs(batch_size=len(rows), iters=STEPS, steps_per_report=1, steps_per_eval=10**9,
                            steps_per_save=10**9, adapter_file=os.path.join(tmp, "adapters.safetensors"))
        train(model, opt, data, args=args, loss=loss, training_callback=rec)
    return rec.losses


def main():
    mx.set_default_device(mx.cpu)
    quantize()
    initial_adapter()
    ref = {
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "settings": {"steps": STEPS, "learning_rate": LR, "batch": 6, "optimizer": "adamw",
                     "bias_correction": True, "weight_decay": 0.0, "max_grad_norm": None},
        "losses": run(loss_within_rows),
        "default_loss": run(default_loss),
    }
    with open(OUT, "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(json.dumps(ref, indent=1))


if __name__ == "__main__":
    main()
