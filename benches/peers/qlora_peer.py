#!/usr/bin/env python3
"""QLoRA's memory and speed, one run each on the same machine (BENCHMARKS.md §QLoRA):

- kiln LoRA on the bf16 base (its Linears kept in bf16, widened a tile at a time);
- kiln QLoRA on the same model exported as bitsandbytes NF4 (`--output-format bnb`), its
  Linear weights kept packed and decoded a tile at a time per use;
- PEFT + bitsandbytes + TRL on the CPU: the bf16 model loaded with
  `BitsAndBytesConfig(load_in_4bit, nf4, double quantization, compute dtype float32)`, LoRA
  from PEFT, TRL's SFTTrainer.

Same demo Llama (`kiln demo-model --size ...`), data (synthetic, ~128 tokens an example),
settings (SFT, LoRA r 16 / α 32 on every Linear but lm_head, batch 8, f32 compute), each
trainer with gradient checkpointing off and on (TRL's default). Each trainer runs in its own process under /usr/bin/time: its peak RSS is its
own. kiln's time per step is (N steps − 1 step) / (N − 1) so loading cancels; TRL's excludes
its first step.

    .venv-trl/bin/python benches/peers/qlora_peer.py --kiln target/release/kiln --size 254m --steps 4
"""
import argparse
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_peer import peak_kb, write_data  # noqa: E402

PEFT = r'''
import json, os, sys, time, torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer
model_dir, data, steps, ckpt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "on"
torch.set_num_threads(len(os.sched_getaffinity(0)))
tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.float32)
model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=q, device_map="cpu",
                                             dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                         task_type="CAUSAL_LM"))
ds = load_dataset("json", data_files=data, split="train")
times = []
class T(TrainerCallback):
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)
args = SFTConfig(output_dir="/tmp/peft-bench", max_steps=steps, logging_steps=1, bf16=False, use_cpu=True,
                 gradient_checkpointing=ckpt, report_to=[], save_strategy="no", learning_rate=1e-4,
                 per_device_train_batch_size=8, train_sampling_strategy="sequential")
tr = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[T()])
tr.train()
print(json.dumps({"step_s": sum(times[1:]) / len(times[1:])}))
'''


def kiln_run(kiln, model, data, steps, out, ckpt):
    cmd = ["/usr/bin/time", "-v", kiln, "train", "--task", "sft", "--model", model, "--data", data, "--out", out,
           "--gradient-checkpointing", "true" if ckpt == "on" else "false",
           "--max-steps", str(steps), "--lora-r", "16", "--lora-alpha", "32", "--lora-dropout", "0",
           "--learning-rate", "1e-4", "--per-device-train-batch-size", "8", "--train-sampling-strategy",
           "sequential", "--quiet", "--force"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"kiln failed:\n{p.stderr[-3000:]}")
    return float(re.search(r"steps in ([0-9.]+)s", p.stdout).group(1)), peak_kb(p.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--size", default="254m")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--checkpointing", nargs="+", default=["off", "on"], choices=["off", "on"])
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    # A model, checkpoints and adapters: gigabytes at the larger sizes; gone when the script ends.
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = os.path.join(tmp, "model")
    subprocess.run([a.kiln, "demo-model", "--size", a.size, "--out", model], check=True, capture_output=True)
    nf4 = os.path.join(tmp, "nf4")
    subprocess.run([a.kiln, "export", "--model", model, "--output-format", "bnb", "--format", "nf4", "--out", nf4],
                   check=True, capture_output=True)
    write_data(tmp)
    data = os.path.join(tmp, "sft.jsonl")
    print(f"model {a.size}, SFT, LoRA r 16, {a.steps} steps, batch 8, f32 compute, {os.cpu_count()} cores")
    print("| trainer | base | gradient checkpointing | s/step | peak RSS |")
    print("|---|---|---|---:|---:|")
    for ckpt in a.checkpointing:
        for label, base in [("kiln LoRA", model), ("kiln QLoRA", nf4)]:
            one, _ = kiln_run(a.kiln, base, data, 1, os.path.join(tmp, "o1"), ckpt)
            full, rss = kiln_run(a.kiln, base, data, a.steps, os.path.join(tmp, "on"), ckpt)
            kind = "bf16 (Linears kept bf16)" if base == model else "bitsandbytes NF4, packed"
            print(f"| {label} | {kind} | {ckpt} | {(full - one) / (a.steps - 1):.2f} | {rss / 1024:,.0f} MB |",
                  flush=True)
        if not a.skip_peft:
            p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", PEFT, model, data, str(a.steps), ckpt],
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(f"| PEFT + bitsandbytes + TRL | NF4 | {ckpt} | failed: {p.stderr.strip().splitlines()[-1]} | |")
            else:
                r = json.loads(p.stdout.strip().splitlines()[-1])
                print(f"| PEFT + bitsandbytes + TRL | bitsandbytes NF4 | {ckpt} | {r['step_s']:.2f} | "
                      f"{peak_kb(p.stderr) / 1024:,.0f} MB |", flush=True)

if __name__ == "__main__":
    main()
