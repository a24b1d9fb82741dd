"""kiln train beside PyTorch + TRL 0.29.1 on the same model, data and settings, one run each:
step time, tokens/s and peak RSS for SFT, DPO, GRPO (`--tasks grpo`: one prompt a step, 8
completions of up to 16 tokens, an exact-match reward) and GKD distillation (`--tasks distill`:
the teacher the model after two SFT steps at learning rate 1e-3, `lmbda` 0: no sampling), full
fine-tuning or LoRA.

    venv/bin/python benches/peers/train_peer.py --kiln target/release/kiln --size small
    venv/bin/python benches/peers/train_peer.py --kiln target/release/kiln --size 254m --steps 6
    venv/bin/python benches/peers/train_peer.py --kiln target/release/kiln --size 254m --steps 4 --lora

Both sides: the demo Llama (`kiln demo-model --size ...`, bf16 on disk) trained in f32 (with
`--precisions f32,bf16` also in mixed precision: TRL's `bf16=True`, kiln's `--bf16 true`), full
fine-tuning (or with `--lora` LoRA r 16, α 32, dropout 0.05 on every Linear but lm_head:
TRL's `ModelConfig` defaults, PEFT's `LoraConfig` on the PyTorch side), per-device batch 8, the same synthetic examples (about 128 tokens each) in file
order, AdamW, linear schedule, gradient clipping 1, gradient checkpointing off on both sides
(`--checkpointing on`: on on both, TRL's default), as many threads as cores. Each trainer runs
in its own process under /usr/bin/time, so its peak RSS is its own.
The time per step excludes loading and the first step (warm-up); tokens are the real (unpadded)
tokens of the batch.
"""

import argparse
import atexit
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def write_data(d, n=64):
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "kiln", "model", "train", "data", "token", "layer"]
    sft, dpo, grpo, distill = [], [], [], []
    for _ in range(n):
        prompt = " ".join(rng.choice(words) for _ in range(12)) + ": "
        comp = " ".join(rng.choice(words) for _ in range(10))
        other = " ".join(rng.choice(words) for _ in range(10))
        sft.append({"prompt": prompt, "completion": comp})
        dpo.append({"prompt": prompt, "chosen": comp, "rejected": other})
        grpo.append({"prompt": prompt, "answer": comp.split()[0]})
        distill.append({"messages": [{"role": "user", "content": prompt},
                                     {"role": "assistant", "content": comp}]})
    for name, rows in [("sft.jsonl", sft), ("dpo.jsonl", dpo), ("grpo.jsonl", grpo),
                       ("distill.jsonl", distill)]:
        with open(os.path.join(d, name), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


TRL = r'''
import json, sys, time, torch
from datasets import load_dataset
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
task, model_dir, data, steps, mode, ckpt = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6] == "on"
bf16 = sys.argv[8] == "bf16"
torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ds = load_dataset("json", data_files=data, split="train")
common = dict(output_dir="/tmp/trl-bench", max_steps=steps, logging_steps=1, bf16=bf16, use_cpu=True,
              gradient_checkpointing=ckpt, report_to=[], save_strategy="no", learning_rate=1e-5,
              per_device_train_batch_size=8, train_sampling_strategy="sequential")
peft = {}
if mode == "lora":
    from peft import LoraConfig
    peft = dict(peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                       task_type="CAUSAL_LM"))
times = []
class T(TrainerCallback):
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)
if task == "sft":
    from trl import SFTConfig, SFTTrainer
    tr = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=ds, processing_class=tok, callbacks=[T()],
                     **peft)
elif task == "grpo":
    from trl import GRPOConfig, GRPOTrainer
    def exact_match(completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
    args = GRPOConfig(**common, num_generations=8, max_completion_length=16, shuffle_dataset=False)
    tr = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=ds, processing_class=tok,
                     callbacks=[T()], **peft)
elif task == "distill":
    # GKD from the teacher `train_peer.teacher` made, off-policy only (lmbda 0: no sampling in the step).
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    teacher = LlamaForCausalLM.from_pretrained(sys.argv[7], dtype=torch.float32)
    tr = GKDTrainer(model=model, teacher_model=teacher, args=GKDConfig(**common, lmbda=0.0), train_dataset=ds,
                    processing_class=tok, callbacks=[T()], **peft)
else:
    from trl import DPOConfig, DPOTrainer
    tr = DPOTrainer(model=model, args=DPOConfig(**common), train_dataset=ds, processing_class=tok, callbacks=[T()],
                    **peft)
tr.train()
num = [l for l in tr.state.log_history if "num_tokens" in l]
# GKD logs no num_tokens.
tokens = (num[-1]["num_tokens"] - num[0]["num_tokens"]) / (len(num) - 1) if len(num) > 1 else None
print(json.dumps({"step_s": sum(times[1:]) / len(times[1:]), "tokens_per_step": tokens}))
'''


def peak_kb(stderr):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return int(m.group(1)) if m else None


def teacher(kiln, model, tmp):
    """GKD's teacher: the model after two SFT steps at a high learning rate (made once)."""
    out = os.path.join(tmp, "teacher")
    if not os.path.exists(out):
        subprocess.run([kiln, "train", "--task", "sft", "--model", model, "--data", os.path.join(tmp, "sft.jsonl"),
                        "--out", out, "--max-steps", "2", "--learning-rate", "1e-3", "--lora-r", "0",
                        "--per-device-train-batch-size", "8", "--quiet"], check=True, capture_output=True)
    return out


def run_kiln(kiln, task, model, data, steps, tmp, lora=False, ckpt="off", backend="candle", precision="f32"):
    m = os.path.join(tmp, f"kiln-{task}.jsonl")
    adapter = ["--lora-r", "16", "--lora-alpha", "32", "--lora-dropout", "0.05"] if lora else ["--lora-r", "0"]
    if task == "grpo":
        # One prompt a step, 8 completions of up to 16 tokens, rewarded by exact match.
        adapter += ["--num-generations", "8", "--max-completion-length", "16", "--reward-funcs", "exact_match"]
    if task == "distill":
        # GKD from `teacher`'s model, off-policy only (as the TRL run).
        adapter += ["--teacher-model-name-or-path", teacher(kiln, model, tmp), "--lmbda", "0"]
    cmd = ["/usr/bin/time", "-v", kiln, "train", "--task", task, "--backend", backend, "--model", model, "--data", data, "--out",
           os.path.join(tmp, f"kiln-{task}"), "--metrics", m, "--max-steps", str(steps), *adapter,
           "--gradient-checkpointing", "true" if ckpt == "on" else "false",
           "--bf16", "true" if precision == "bf16" else "false",
           "--learning-rate", "1e-5", "--per-device-train-batch-size", "8", "--train-sampling-strategy",
           "sequential", "--quiet", "--force"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [json.loads(l) for l in open(m)]
    # kiln logs each step's cumulative tokens; its run time is printed, per step below.
    total = float(re.search(r"steps in ([0-9.]+)s", p.stdout).group(1))
    return {"run_s": total, "tokens": lines[-1].get("num_tokens"), "rss_kb": peak_kb(p.stderr), "lines": lines}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lora", action="store_true", help="LoRA (TRL's defaults) instead of full fine-tuning")
    ap.add_argument("--tasks", default="sft,dpo")
    ap.add_argument("--checkpointing", default="off", choices=["off", "on"],
                    help="gradient checkpointing on both sides (TRL's default is on)")
    ap.add_argument("--precisions", default="f32",
                    help="f32, bf16 (TRL's bf16=True: CPU autocast; kiln's --bf16), or f32,bf16: each "
                         "task runs on both sides in each")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    # A model, checkpoints and adapters: gigabytes at the larger sizes; gone when the script ends.
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = os.path.join(tmp, "model")
    subprocess.run([args.kiln, "demo-model", "--size", args.size, "--out", model], check=True,
                   capture_output=True)
    write_data(tmp)
    mode = "LoRA r 16" if args.lora else "full fine-tuning"
    print(f"model {args.size}, {args.steps} steps, batch 8, {args.precisions}, {mode}, gradient checkpointing "
          f"{args.checkpointing}, {os.cpu_count()} cores")
    print("| task | trainer | s/step | tokens/s | peak RSS |")
    print("|---|---|---|---|---|")
    runs = [(t, p) for t in args.tasks.split(",") for p in args.precisions.split(",")]
    for task, precision in runs:
        data = os.path.join(tmp, f"{task}.jsonl")
        # kiln: time per step from two runs (1 step and N steps), so loading and the first step cancel.
        one = run_kiln(args.kiln, task, model, data, 1, tmp, args.lora, args.checkpointing, precision=precision)
        full = run_kiln(args.kiln, task, model, data, args.steps, tmp, args.lora, args.checkpointing,
                        precision=precision)
        step_s = (full["run_s"] - one["run_s"]) / (args.steps - 1)
        # GKD logs no num_tokens (kiln as TRL): no tokens/s there.
        rate = "—"
        if full["tokens"] is not None:
            rate = f"{(full['tokens'] - one['tokens']) / (args.steps - 1) / step_s:.0f}"
        print(f"| {task} | kiln {precision} | {step_s:.3f} | {rate} | {full['rss_kb'] / 1024:.0f} MB |", flush=True)
        p = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", TRL, task, model, data, str(args.steps),
                            "lora" if args.lora else "full", args.checkpointing, teacher(args.kiln, model, tmp),
                            precision],
                           capture_output=True, text=True, check=True)
        r = json.loads(p.stdout.strip().splitlines()[-1])
        rate = "—" if r["tokens_per_step"] is None else f"{r['tokens_per_step'] / r['step_s']:.0f}"
        print(f"| {task} | PyTorch + TRL {precision} | {r['step_s']:.3f} | {rate} | "
              f"{peak_kb(p.stderr) / 1024:.0f} MB |", flush=True)

if __name__ == "__main__":
    main()
