"""PEFT's view of an adapter kiln wrote: loads tests/train/peft/adapter (written by
`kiln train`, see tests/it/train.rs) onto the tiny Llama with `peft`, runs fixed token ids and
saves the logits, which kiln must reproduce when it loads the same adapter.

    venv/bin/python tests/train/peft_check.py     # rewrites tests/train/peft/peft_logits.safetensors
"""

import os

import torch
from peft import PeftModel
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
IDS = [[1, 53, 47, 54, 61, 55, 2, 3], [1, 72, 73, 74, 75, 76, 77, 78]]


def main():
    base = LlamaForCausalLM.from_pretrained(os.path.join(HERE, "tiny", "model"), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, os.path.join(HERE, "peft", "adapter"))
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(IDS)).logits.contiguous()
        merged = model.merge_and_unload()
        merged_logits = merged(torch.tensor(IDS)).logits.contiguous()
    save_file({"ids": torch.tensor(IDS, dtype=torch.int64), "logits": logits, "merged_logits": merged_logits},
              os.path.join(HERE, "peft", "peft_logits.safetensors"))
    print("max |adapter − merged|", (logits - merged_logits).abs().max().item())


if __name__ == "__main__":
    main()
