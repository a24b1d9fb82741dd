"""QLoRA references for kiln (tests/it/qlora.rs): PEFT + bitsandbytes + TRL 0.29.1 on the CPU.

A tiny Llama 64 wide (tests/train/qtiny/model, f32, with an initial adapter in
tests/train/qtiny/init-adapter) is quantized by transformers with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.float32)` and saved (tests/train/qtiny/bnb-nf4, the base kiln
trains from); then, as a PEFT user does, each run loads that saved base, puts the initial
adapter on it and trains with TRL for six steps, logging every
step into tests/train/qlora_reference.json — with the adapter in f32 (kiln's), undoing TRL's
cast of a 4-bit model's adapter to bf16, and once each as TRL does by default.

    python3 -m venv .venv-trl && .venv-trl/bin/pip install -r tests/train/requirements.txt
    .venv-trl/bin/python tests/train/qlora_ref.py
"""
import json
import os
import shutil
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_ref import Record, build_adapter, random_llama  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny")
# The QLoRA model: the tiny one 64 wide, so every row holds whole blocks of 64 (bitsandbytes'
# CPU kernels index a row's absmax as if it did: on 32-wide rows they decode other values than
# its own dequantize_4bit of the flat blocks).
QTINY = os.path.join(HERE, "qtiny")
MODEL = os.path.join(QTINY, "model")
ADAPTER = os.path.join(QTINY, "init-adapter")
BASE = os.path.join(QTINY, "bnb-nf4")
DATA = os.path.join(HERE, "data")


def build():
    """The 64-wide tiny Llama and its initial adapter, as trl_ref.py builds its own."""
    for d in [MODEL, ADAPTER, BASE]:
        shutil.rmtree(d, ignore_errors=True)
    random_llama(MODEL, hidden=64, intermediate=128)
    build_adapter(MODEL, ADAPTER)


def quantize():
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(MODEL, quantization_config=cfg, device_map="cpu",
                                                 dtype=torch.float32)
    model.save_pretrained(BASE)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(MODEL, f), BASE)


def run(task, data, f32_adapter=True, **overrides):
    from datasets import load_dataset
    from peft import PeftModel

    ds = load_dataset("json", data_files=os.path.join(DATA, data), split="train")
    tok = PreTrainedTokenizerFast.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, device_map="cpu", dtype=torch.float32)
    model = PeftModel.from_pretrained(model, ADAPTER, is_trainable=True)
    # TRL 0.29.1 casts a 4-bit model's trainable parameters (the adapter) to bf16 in SFT, DPO
    # and GRPO ("following the QLoRA paper"). kiln trains adapters in f32: the references kiln
    # compares with undo that cast, restoring the exact f32 values (`f32_adapter`).
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    common = dict(output_dir=tempfile.mkdtemp(), max_steps=6, logging_steps=1, bf16=False, use_cpu=True,
                  gradient_checkpointing=False, report_to=[], save_strategy="no", seed=42,
                  train_sampling_strategy="sequential", per_device_train_batch_size=2)
    common.update(overrides)
    rec = Record()
    if task == "sft":
        from trl import SFTConfig, SFTTrainer
        trainer = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=ds, processing_class=tok,
                             callbacks=[rec])
    else:
        from trl import DPOConfig, DPOTrainer
        trainer = DPOTrainer(model=model, args=DPOConfig(**common), train_dataset=ds, processing_class=tok,
                             callbacks=[rec])
    if f32_adapter:
        for n, p in trainer.model.named_parameters():
            if n in saved and p.requires_grad:
                p.data = saved[n].clone()
    trainer.train()
    return rec.logs


def main():
    build()
    quantize()
    runs = {
        "qlora-sft": ("sft", "sft.jsonl", True, dict(learning_rate=1e-2)),
        "qlora-dpo": ("dpo", "dpo.jsonl", True, dict(learning_rate=1e-2)),
        # TRL's own default (bf16 adapters), recorded for the comparison in docs/TRAINING.md.
        "qlora-sft-bf16-adapter": ("sft", "sft.jsonl", False, dict(learning_rate=1e-2)),
        "qlora-dpo-bf16-adapter": ("dpo", "dpo.jsonl", False, dict(learning_rate=1e-2)),
    }
    out = {}
    for name, (task, data, f32, over) in runs.items():
        logs = run(task, data, f32_adapter=f32, **over)
        out[name] = {"task": task, "data": f"data/{data}", "f32_adapter": f32, "settings": over, "logs": logs}
        print(name, [round(l["loss"], 6) for l in out[name]["logs"]])
    with open(os.path.join(HERE, "qlora_reference.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
