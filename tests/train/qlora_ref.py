"""QLoRA references for kiln (tests/it/qlora.rs): PEFT + bitsandbytes + TRL 0.29.1 on the CPU.

transformers quantizes the tiny training model (tests/train/tiny/model) with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.float32)` and saves it (tests/train/tiny/bnb-nf4, the base kiln
trains from); then, as a PEFT user does, each run loads that saved base, puts the shared initial
adapter (tests/train/tiny/init-adapter) on it and trains with TRL for six steps, logging every
step into tests/train/qlora_reference.json.

    python3 -m venv .venv-trl && .venv-trl/bin/pip install -r tests/train/requirements.txt bitsandbytes==0.50.2
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
from trl_ref import Record  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny")
BASE = os.path.join(TINY, "bnb-nf4")
DATA = os.path.join(HERE, "data")


def quantize():
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "model"), quantization_config=cfg,
                                                 device_map="cpu", dtype=torch.float32)
    if os.path.exists(BASE):
        shutil.rmtree(BASE)
    model.save_pretrained(BASE)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(TINY, "model", f), BASE)


def run(task, data, **overrides):
    from datasets import load_dataset
    from peft import PeftModel

    ds = load_dataset("json", data_files=os.path.join(DATA, data), split="train")
    tok = PreTrainedTokenizerFast.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE, device_map="cpu", dtype=torch.float32)
    model = PeftModel.from_pretrained(model, os.path.join(TINY, "init-adapter"), is_trainable=True)
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
    trainer.train()
    return rec.logs


def main():
    quantize()
    runs = {
        "qlora-sft": ("sft", "sft.jsonl", dict(learning_rate=1e-2)),
        "qlora-dpo": ("dpo", "dpo.jsonl", dict(learning_rate=1e-2)),
    }
    out = {}
    for name, (task, data, over) in runs.items():
        out[name] = {"task": task, "data": f"data/{data}", "settings": over, "logs": run(task, data, **over)}
        print(name, [round(l["loss"], 6) for l in out[name]["logs"]])
    with open(os.path.join(HERE, "qlora_reference.json"), "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
