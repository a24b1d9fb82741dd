#!/usr/bin/env python3
"""bitsandbytes references for kiln's `--output-format bnb` and its bitsandbytes reader
(tests/it/bnb.rs): transformers loads the committed tiny Llama (bf16) with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=T, bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.bfloat16)` on the CPU and saves it, for T in nf4 and fp4:

    tests/compat/llama-tiny/bnb-<T>/transformers/   what `save_pretrained` writes
    tests/compat/llama-tiny/bnb-<T>/dequantized.safetensors
                                                    two 4-bit weights as bitsandbytes'
                                                    `dequantize_4bit` decodes them (bf16)

    python3 -m venv .venv-llmc && .venv-llmc/bin/pip install -r tests/compat/requirements-llmc.txt
    .venv-llmc/bin/python tests/compat/bnb_ref.py
"""
import pathlib
import shutil

import bitsandbytes as bnb
import bitsandbytes.functional as F
import torch
import transformers
from safetensors.torch import save_file

HERE = pathlib.Path(__file__).resolve().parent / "llama-tiny"
# The weights whose decoded values are kept (two shapes, the fixture small).
KEPT = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"]


def main():
    assert bnb.__version__ == "0.50.2", bnb.__version__
    for quant_type in ["nf4", "fp4"]:
        cfg = transformers.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            HERE / "model", quantization_config=cfg, device_map="cpu", dtype=torch.bfloat16)
        dst = HERE / f"bnb-{quant_type}"
        if dst.exists():
            shutil.rmtree(dst)
        model.save_pretrained(dst / "transformers")
        for junk in ["generation_config.json"]:
            (dst / "transformers" / junk).unlink(missing_ok=True)
        decoded = {}
        for name, m in model.named_modules():
            if isinstance(m, bnb.nn.Linear4bit) and name in KEPT:
                decoded[f"{name}.weight"] = F.dequantize_4bit(m.weight.data, m.weight.quant_state).contiguous()
        save_file(decoded, dst / "dequantized.safetensors")
        print(f"{dst.name}: {len(decoded)} decoded weights kept")


if __name__ == "__main__":
    main()
