#!/usr/bin/env python3
"""4-bit quality on a real model beyond W4A16: kiln's AWQ (ModelOpt int4-awq in blocks of 64),
MLX q4 (round to nearest and GPTQ) beside mlx-lm's own GPTQ, and NVFP4A16 (round to nearest
and GPTQ) beside llm-compressor's GPTQ — one run, one machine, one evaluator
(BENCHMARKS.md §"Low-bit quality").

Every checkpoint is made from the same Hugging Face folder (bf16) and the same calibration
token ids (the first SAMPLES × SEQ_LEN tokens of the calibration text), timed, with its peak
RSS; then `kiln eval --ctx CTX --chunks N --kl-divergence BASE --weights-only` scores each on
the held-out text (llama-perplexity's protocol: non-overlapping chunks, the second half of each
scored), which reads every one of these layouts. GPTQ runs in f32 for kiln and for mlx-lm (MLX's
Linux CPU kernels are exact in f32 only); llm-compressor calibrates in bf16, as its users do.

    python3 benches/peers/lowbit_quality.py --model SMOLLM2_HF --calib calib.txt \\
        --heldout heldout.txt --kiln target/release/kiln --llmc-python .venv-llmc/bin/python \\
        [--samples 32] [--seq-len 512] [--ctx 512] [--chunks 40] [--skip KEY ...]

mlx-lm (`mlx[cpu]==0.32.4`, `mlx-lm==0.32.2`) must import in the Python that runs this script.
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

MLX_GPTQ = r'''
import json, sys
import mlx.core as mx
from mlx_lm.quant.gptq import gptq_quantize
from mlx_lm.utils import load, save
model_dir, out, calib = sys.argv[1:4]
model, tokenizer, config = load(model_dir, lazy=False, return_config=True)
model.set_dtype(mx.float32)
data = mx.array([json.loads(l)["input_ids"] for l in open(calib)])
model, config["quantization"] = gptq_quantize(model, data, 4, 64, 4, 64, batch_size=8)
save(out, model_dir, model, tokenizer, config)
'''

LLMC_NVFP4_GPTQ = r'''
import json, sys, torch, transformers
from datasets import Dataset
from compressed_tensors.quantization import preset_name_to_scheme
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
model_dir, out, calib = sys.argv[1:4]
model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
rows = [json.loads(l)["input_ids"] for l in open(calib)]
ds = Dataset.from_list([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows])
oneshot(model=model, output_dir=out,
        recipe=GPTQModifier(config_groups={"group_0": preset_name_to_scheme("NVFP4A16", ["Linear"])},
                            ignore=["lm_head"]),
        dataset=ds, num_calibration_samples=len(rows), shuffle_calibration_samples=False,
        batch_size=1, pipeline="sequential",
        tokenizer=transformers.AutoTokenizer.from_pretrained(model_dir))
'''


def token_ids(model_dir, path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pathlib.Path(model_dir) / "tokenizer.json"))
    return tok.encode(pathlib.Path(path).read_text(), add_special_tokens=False).ids


def timed(cmd, log):
    """Runs `cmd` under /usr/bin/time -v: (seconds, peak RSS MB)."""
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-v"] + [str(c) for c in cmd],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(p.stdout)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed, see {log}:\n{p.stdout[-3000:]}")
    peak = next((int(l.split(":")[1]) / 1024 for l in p.stdout.splitlines()
                 if "Maximum resident set size" in l), float("nan"))
    return time.time() - t, peak


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--model", required=True)
    a.add_argument("--calib", required=True)
    a.add_argument("--heldout", required=True)
    a.add_argument("--kiln", required=True)
    a.add_argument("--llmc-python", default=".venv-llmc/bin/python")
    a.add_argument("--samples", type=int, default=32)
    a.add_argument("--seq-len", type=int, default=512)
    a.add_argument("--ctx", type=int, default=512)
    a.add_argument("--chunks", type=int, default=40)
    a.add_argument("--work", default="/tmp/kiln-lowbit-quality")
    a.add_argument("--skip", nargs="*", default=[], help="methods already made (reused)")
    a.add_argument("--without", nargs="*", default=[], help="methods not run (their keys)")
    o = a.parse_args()
    work = pathlib.Path(o.work)
    work.mkdir(parents=True, exist_ok=True)
    ids = token_ids(o.model, o.calib)
    rows = [ids[i * o.seq_len:(i + 1) * o.seq_len] for i in range(min(o.samples, len(ids) // o.seq_len))]
    calib = work / "calib.jsonl"
    calib.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    print(f"calibration: {len(rows)} × {o.seq_len} tokens")

    kiln, m, c = o.kiln, o.model, calib
    ct = ["--output-format", "compressed-tensors"]
    gptq = ["--calib", c, "--algorithm", "gptq"]
    methods = [
        ("kiln", "AWQ int4-awq g64 (ModelOpt)",
         lambda out: [kiln, "export", "--model", m, "--out", out, "--format", "int4-awq",
                      "--group-size", "64", "--calib", c, "--force"]),
        ("kiln", "RTN mlx q4 g64",
         lambda out: [kiln, "export", "--model", m, "--out", out, "--output-format", "mlx",
                      "--format", "q4", "--force"]),
        ("kiln", "GPTQ mlx q4 g64",
         lambda out: [kiln, "export", "--model", m, "--out", out, "--output-format", "mlx",
                      "--format", "q4", "--force"] + gptq),
        ("mlx-lm", "GPTQ mlx q4 g64",
         lambda out: [sys.executable, "-c", MLX_GPTQ, m, out, c]),
        ("kiln", "RTN NVFP4A16",
         lambda out: [kiln, "export", "--model", m, "--out", out] + ct + ["--format", "nvfp4a16", "--force"]),
        ("kiln", "GPTQ NVFP4A16",
         lambda out: [kiln, "export", "--model", m, "--out", out] + ct
         + ["--format", "nvfp4a16", "--force", "--calib-dtype", "bf16"] + gptq),
        ("llm-compressor", "GPTQ NVFP4A16",
         lambda out: [o.llmc_python, "-c", LLMC_NVFP4_GPTQ, m, out, c]),
    ]
    made = []
    for tool, method, cmd in methods:
        key = f"{tool}-{method.split(' (')[0]}".replace(" ", "-").lower()
        out = work / key
        if key in o.without:
            print(f"{key}: not run (--without)", flush=True)
            continue
        if key in o.skip and out.exists():
            made.append((tool, method, out, None, None))
            continue
        shutil.rmtree(out, ignore_errors=True)
        secs, peak = timed(cmd(out), work / f"{key}.log")
        made.append((tool, method, out, secs, peak))
        print(f"{key}: {secs:.1f} s, peak RSS {peak:.0f} MB", flush=True)

    print(f"\n| tool | method | ppl | Δppl | KL mean | KL median | KL p99 | same top token | quantize | peak RSS |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base_ppl = None
    for tool, method, out, secs, peak in made:
        p = subprocess.run([kiln, "eval", "--model", out, "--data", o.heldout, "--ctx", str(o.ctx),
                            "--chunks", str(o.chunks), "--kl-divergence", m, "--weights-only",
                            "--tokenizer", str(pathlib.Path(m) / "tokenizer.json"), "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0:
            sys.exit(f"kiln eval {out} failed:\n{p.stderr[-3000:]}")
        r = json.loads(p.stdout)
        kl = r["kl_divergence"]
        if base_ppl is None:
            base_ppl = kl["reference_perplexity"]
            print(f"| base (bf16) | — | {base_ppl:.3f} | — | — | — | — | — | — | — |")
        s = f"{secs:.1f} s" if secs else "—"
        q = f"{peak:,.0f} MB" if peak else "—"
        print(f"| {tool} | {method} | {r['perplexity']:.3f} | {kl['delta_perplexity']:+.3f} | "
              f"{kl['mean']:.4f} | {kl['median']:.4f} | {kl['p99']:.4f} | {100 * kl['same_top1']:.2f} % | "
              f"{s} | {q} |", flush=True)
    print(f"\n{r['scored_tokens']} scored tokens ({r['chunks']} chunks of {o.ctx}, second halves).")


if __name__ == "__main__":
    main()
