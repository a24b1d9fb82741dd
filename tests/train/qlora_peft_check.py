"""PEFT's view of a QLoRA adapter kiln wrote: loads tests/train/qtiny/kiln-adapter (written by
`kiln train` over the NF4 base tests/train/qtiny/bnb-nf4, see tests/it/qlora.rs) onto that base
in transformers + bitsandbytes, as a PEFT user deploys it, and onto the full-precision model
(tests/train/qtiny/model); runs fixed token ids and saves both logits, which kiln must
reproduce with the same adapter over the same bases (bitsandbytes' exact path: see `logits`).

    # kiln's adapter (what tests/it/qlora.rs loads), then PEFT's logits with it:
    kiln train --task sft --model tests/train/qtiny/bnb-nf4 --data tests/train/data/sft.jsonl \
        --out tests/train/qtiny/kiln-adapter --max-steps 3 --learning-rate 1e-2 --lora-r 4 \
        --lora-alpha 8 --lora-dropout 0 --lora-target-modules q_proj,v_proj,gate_proj \
        --per-device-train-batch-size 4 --train-sampling-strategy sequential --quiet --force
    .venv-trl/bin/python tests/train/qlora_peft_check.py   # writes tests/train/qtiny/peft_logits.safetensors
"""
import os

import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
Q = os.path.join(HERE, "qtiny")
IDS = [[1, 53, 47, 54, 61, 55, 2, 3], [1, 72, 73, 74, 75, 76, 77, 78]]


def logits(base):
    model = PeftModel.from_pretrained(base, os.path.join(Q, "kiln-adapter"))
    # Train mode (the model and adapter have no dropout): in eval mode on a CPU with AVX512-BF16,
    # bitsandbytes swaps in a fused inference kernel that computes in bf16; train mode runs its
    # exact path (dequantize_4bit, then an f32 matmul).
    model.train()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.contiguous()


def main():
    nf4 = AutoModelForCausalLM.from_pretrained(os.path.join(Q, "bnb-nf4"), device_map="cpu", dtype=torch.float32)
    full = AutoModelForCausalLM.from_pretrained(os.path.join(Q, "model"), dtype=torch.float32)
    out = {"ids": torch.tensor(IDS, dtype=torch.int64), "nf4_logits": logits(nf4), "full_logits": logits(full)}
    save_file(out, os.path.join(Q, "peft_logits.safetensors"))
    print("max |nf4 − full|", (out["nf4_logits"] - out["full_logits"]).abs().max().item())


if __name__ == "__main__":
    main()
