#!/usr/bin/env python3
"""W4A16 quality on a real model, kiln beside llm-compressor in one run (BENCHMARKS.md §GPTQ).

For a Hugging Face model folder (bf16) and public-domain text split into calibration and
held-out parts, makes four compressed-tensors W4A16 checkpoints — round to nearest and GPTQ, by
kiln and by llm-compressor 0.14 — on the same token ids, timing each and reading its peak RSS,
then scores each with one evaluator (transformers + compressed-tensors, f32) under
llama-perplexity's protocol: non-overlapping chunks of CTX tokens, the second half of each
scored. Reports perplexity, the KL divergence of each token's distribution from the base
model's (mean, median, 99th percentile), top-1 agreement with the base, time and peak memory.

    .venv-llmc/bin/python benches/peers/gptq_quality.py --model DIR --calib calib.txt \\
        --heldout heldout.txt --kiln target/release/kiln [--group-size 64] [--samples 32] \\
        [--seq-len 512] [--ctx 512] [--chunks 40] [--work /tmp/kiln-gptq-quality]

The model, text and outputs stay out of the repository; the table it prints is what
BENCHMARKS.md records.
"""
import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time


def tokenize(model_dir, path, n, length):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(pathlib.Path(path).read_text(), add_special_tokens=False)["input_ids"]
    rows = [ids[i * length : (i + 1) * length] for i in range(min(n, len(ids) // length))]
    return rows, ids


def run_timed(cmd, log):
    t = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(p.stdout)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed, see {log}:\n{p.stdout[-3000:]}")
    return time.time() - t


LLMC = r'''
import json, sys, torch, transformers
from datasets import Dataset
from compressed_tensors.quantization import preset_name_to_scheme
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
model_dir, out, method, group, calib = sys.argv[1:6]
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
s = preset_name_to_scheme("W4A16", ["Linear"])
s.weights.group_size = int(group)
groups = {"group_0": s}
args = dict(model=model, output_dir=out)
if method == "gptq":
    rows = [json.loads(l)["input_ids"] for l in open(calib)]
    ds = Dataset.from_list([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows])
    args.update(recipe=GPTQModifier(config_groups=groups, ignore=["lm_head"]), dataset=ds,
                num_calibration_samples=len(rows), shuffle_calibration_samples=False,
                batch_size=1, pipeline="sequential",
                tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir))
else:
    args.update(recipe=QuantizationModifier(config_groups=groups, ignore=["lm_head"]))
oneshot(**args)
'''


def timed_log(log):
    """(wall seconds, peak RSS in MB) from the `/usr/bin/time -v` report at the end of `log`."""
    secs = peak = None
    if log.exists():
        for line in log.read_text().splitlines():
            if "Elapsed (wall clock) time" in line:
                parts = [float(v) for v in line.rsplit(": ", 1)[1].split(":")]
                secs = sum(v * 60 ** i for i, v in enumerate(reversed(parts)))
            elif "Maximum resident set size" in line:
                peak = int(line.split(":")[1]) / 1024
    return secs, peak


def evaluate(path, ids, ctx, chunks, base_logprobs=None):
    """llama-perplexity's protocol on `ids`: per chunk of `ctx` tokens, the log-probabilities of
    tokens ctx/2+1 .. ctx-1 given what precedes them in the chunk. Returns (nll per token,
    log-softmax rows) — the rows only for the base model, to compare the others against."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    nll, count, kls, top1, rows = 0.0, 0, [], 0, []
    with torch.no_grad():
        for c in range(chunks):
            x = torch.tensor([ids[c * ctx : (c + 1) * ctx]])
            logits = model(x).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[ctx // 2 : ctx - 1]
            target = x[0, ctx // 2 + 1 : ctx]
            nll -= lp.gather(1, target[:, None]).sum().item()
            count += len(target)
            if base_logprobs is None:
                rows.append(lp)
            else:
                base = base_logprobs[c]
                kls.append((base.exp() * (base - lp)).sum(-1))
                top1 += (base.argmax(-1) == lp.argmax(-1)).sum().item()
    # Free the model before the next one loads (a 1.5B model in f32 is 7 GB, and three of
    # them left to the garbage collector exhausted 24 GB).
    del model
    __import__("gc").collect()
    out = {"ppl": float(torch.tensor(nll / count).exp()), "tokens": count}
    if base_logprobs is None:
        return out, rows
    kl = torch.cat(kls)
    out.update(
        kl_mean=kl.mean().item(),
        kl_median=kl.median().item(),
        kl_p99=kl.quantile(0.99).item(),
        top1=top1 / count,
    )
    return out, None


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--model", required=True)
    a.add_argument("--calib", required=True)
    a.add_argument("--heldout", required=True)
    a.add_argument("--kiln", required=True)
    a.add_argument("--group-size", type=int, default=64)
    a.add_argument("--samples", type=int, default=32)
    a.add_argument("--seq-len", type=int, default=512)
    a.add_argument("--ctx", type=int, default=512)
    a.add_argument("--chunks", type=int, default=40)
    a.add_argument("--work", default="/tmp/kiln-gptq-quality")
    a.add_argument("--skip", nargs="*", default=[],
                   help="runs already made (reuse; their time and peak RSS read from WORK/RUN.log)")
    a.add_argument("--runs", nargs="*", default=None,
                   help="make only these runs (kiln-rtn kiln-gptq kiln-gptq_f32 llm-compressor-rtn llm-compressor-gptq)")
    a.add_argument("--no-eval", action="store_true", help="make the checkpoints and stop")
    a.add_argument("--kiln-f32", action="store_true",
                   help="also kiln's GPTQ calibrated in f32 (--calib-dtype f32), its most exact")
    o = a.parse_args()
    work = pathlib.Path(o.work)
    work.mkdir(parents=True, exist_ok=True)
    rows, _ = tokenize(o.model, o.calib, o.samples, o.seq_len)
    calib = work / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    _, held = tokenize(o.model, o.heldout, 0, 1)
    chunks = min(o.chunks, len(held) // o.ctx)
    print(f"calibration: {len(rows)} × {o.seq_len} tokens; held-out: {chunks} chunks of {o.ctx}")

    made = {}
    g = str(o.group_size)
    runs = [("kiln", "rtn"), ("kiln", "gptq")] + [("kiln", "gptq_f32")] * o.kiln_f32
    for tool, method in runs + [("llm-compressor", "rtn"), ("llm-compressor", "gptq")]:
        out = work / f"{tool}-{method}"
        key = f"{tool}-{method}"
        if o.runs is not None and key not in o.runs:
            continue
        if key in o.skip and out.exists():
            made[key] = (out, *timed_log(work / f"{key}.log"))
            continue
        shutil.rmtree(out, ignore_errors=True)
        if tool == "kiln":
            cmd = [o.kiln, "export", "--model", o.model, "--out", str(out), "--output-format",
                   "compressed-tensors", "--format", "w4a16", "--group-size", g, "--force"]
            if method.startswith("gptq"):
                dtype = "f32" if method == "gptq_f32" else "bf16"
                cmd += ["--calib", str(calib), "--algorithm", "gptq", "--calib-dtype", dtype]
            cmd = ["/usr/bin/time", "-v"] + cmd
        else:
            cmd = ["/usr/bin/time", "-v", sys.executable, "-c", LLMC, o.model, str(out), method, g, str(calib)]
        log = work / f"{key}.log"
        run_timed(cmd, log)
        made[key] = (out, *timed_log(log))
        print(f"{key}: {made[key][1]:.1f} s, peak RSS {made[key][2]:.0f} MB")
    if o.no_eval:
        return

    base, base_rows = evaluate(o.model, held, o.ctx, chunks)
    print(f"\n| model | method | ppl | Δppl | KL mean | KL median | KL p99 | top-1 | quantize s | peak RSS MB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| base (bf16) | — | {base['ppl']:.3f} | — | — | — | — | — | — | — |")
    for key, (path, secs, peak) in made.items():
        r, _ = evaluate(path, held, o.ctx, chunks, base_rows)
        tool, method = key.rsplit("-", 1)
        s = f"{secs:.1f}" if secs else "—"
        p = f"{peak:.0f}" if peak else "—"
        label = f"GPTQ W4A16 g{g}, f32 calibration" if method == "gptq_f32" else f"{method.upper()} W4A16 g{g}"
        print(
            f"| {tool} | {label} | {r['ppl']:.3f} | {r['ppl'] - base['ppl']:+.3f} | "
            f"{r['kl_mean']:.4f} | {r['kl_median']:.4f} | {r['kl_p99']:.4f} | {100 * r['top1']:.2f} % | {s} | {p} |"
        )
    print(f"\n{base['tokens']} scored tokens ({chunks} chunks of {o.ctx}, second halves).")


if __name__ == "__main__":
    main()
