#!/usr/bin/env python3
"""Reference logits for kiln's forward pass (runtime/src/model, tests/it/forward.rs).

For each tiny model of the compatibility suite (and a copy of the Llama with llama3 RoPE
scaling), runs transformers in float32 with eager attention on fixed token ids and writes
`tests/compat/<model>/logits.safetensors`: `input_ids` [1, T] (i64) and `logits` [1, T, V] (f32).

    .venv/bin/python tests/compat/logits_ref.py [MODEL ...]   # the venv of requirements.txt
"""
import sys
import json
import pathlib
import shutil

import torch
import transformers
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).resolve().parent
MODELS = ["llama-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny", "qwen3-moe-tiny", "mixtral-tiny",
          "llama3-rope-tiny", "gpt-oss-tiny"]


def llama3_rope_copy():
    """llama-tiny's weights with Llama 3.1's RoPE scaling in config.json."""
    src, dst = HERE / "llama-tiny" / "model", HERE / "llama3-rope-tiny" / "model"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main():
    print("transformers", transformers.__version__, "torch", torch.__version__)
    llama3_rope_copy()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(7))
    only = set(sys.argv[1:])
    for name in MODELS:
        if only and name not in only:
            continue
        d = HERE / name / "model"
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, torch_dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(ids).logits.float().contiguous()
        save_file({"input_ids": ids.to(torch.int64), "logits": logits},
                  str(HERE / name / "logits.safetensors"))
        print(name, tuple(logits.shape), float(logits.abs().max()))


if __name__ == "__main__":
    main()
