#!/usr/bin/env python3
"""The forward pass (evaluation, calibration's cost) beside transformers, one run each on the
same machine: tokens/s and peak RSS of `kiln eval --ctx N` and of transformers running the same
chunks (BENCHMARKS.md §Training, "Forward").

Both: the model in f32 (or both in bf16, `--dtype bf16`: transformers' `dtype=torch.bfloat16`
with its default SDPA attention, `kiln eval --dtype bf16`) on the CPU, every core; llama-perplexity's protocol (non-overlapping chunks
of `--ctx` tokens, a BOS first, the second half scored), one chunk at a time; the time is the
chunks' forward passes and scoring only (kiln's `seconds`, transformers' timed loop), not
loading; each chunk's first token becomes BOS where the tokenizer adds one (llama-perplexity). Each side runs in its own process under /usr/bin/time, so its peak RSS is its own.
Both perplexities are printed: they must agree.

    .venv-trl/bin/python benches/peers/forward_peer.py --kiln target/release/kiln \\
        --model SMOLLM2_HF --text heldout.txt --ctx 512 --chunks 8
"""
import argparse
import json
import re
import subprocess
import sys

TORCH = r'''
import json, math, os, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, text, ctx, chunks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[5]]
torch.set_num_threads(len(os.sched_getaffinity(0)))
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
ids = tok(open(text).read(), add_special_tokens=False)["input_ids"]
# llama-perplexity's protocol: the chunk's first token becomes BOS where the tokenizer adds one.
bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
nll, n = 0.0, 0
t0 = time.perf_counter()
with torch.no_grad():
    for c in range(chunks):
        x = ids[c * ctx:(c + 1) * ctx]
        if bos is not None:
            x = [bos] + x[1:]
        logits = model(torch.tensor([x])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        for i in range(ctx // 2, ctx - 1):
            nll -= lp[i, x[i + 1]].item()
            n += 1
dt = time.perf_counter() - t0
print(json.dumps({"seconds": dt, "tokens": chunks * ctx, "perplexity": math.exp(nll / n)}))
'''


def peak_mb(stderr):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return int(m.group(1)) / 1024 if m else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    a = ap.parse_args()
    p = subprocess.run(["/usr/bin/time", "-v", a.kiln, "eval", "--model", a.model, "--data", a.text, "--ctx",
                        str(a.ctx), "--chunks", str(a.chunks), "--dtype", a.dtype, "--json"], capture_output=True, text=True, check=True)
    k = json.loads(p.stdout)
    kt = a.chunks * a.ctx / k["seconds"]
    p2 = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-c", TORCH, a.model, a.text, str(a.ctx),
                         str(a.chunks), a.dtype], capture_output=True, text=True, check=True)
    t = json.loads(p2.stdout.strip().splitlines()[-1])
    tt = t["tokens"] / t["seconds"]
    print(f"{a.chunks} chunks of {a.ctx} tokens, {a.dtype}")
    print("| runner | tokens/s | peak RSS | perplexity |")
    print("|---|---:|---:|---:|")
    print(f"| kiln eval | {kt:.0f} | {peak_mb(p.stderr):,.0f} MB | {k['perplexity']:.4f} |")
    print(f"| transformers | {tt:.0f} | {peak_mb(p2.stderr):,.0f} MB | {t['perplexity']:.4f} |")
    print(f"kiln / transformers: {kt / tt:.2f}x")


if __name__ == "__main__":
    main()
