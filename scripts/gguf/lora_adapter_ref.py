#!/usr/bin/env python3
"""References for kiln's llama.cpp LoRA adapters (`kiln train --adapter-format gguf`), made by
llama.cpp itself (its sources as vendored in llama-cpp-python 0.3.36; the tools that
`scripts/gguf/build-llama-cpp.sh` builds):

1. `convert_lora_to_gguf.py` converts kiln's PEFT adapter tests/train/qtiny/kiln-adapter (Q, V
   and gate projections of the 64-wide tiny Llama; Q's rows are reordered for llama.cpp) with
   the base's config (tests/train/qtiny/model) into tests/train/qtiny/kiln-adapter.gguf:
   tests/it/qlora.rs requires kiln's file for the same adapter to be these bytes.
2. With `--kiln` and `--llama`: kiln writes its demo model (17M, a real BPE tokenizer) and its
   F32 GGUF, trains a LoRA adapter on it (Q and V, two steps of SFT on kiln's sample data) with
   `--adapter-format gguf`, checks that the converter makes the same `adapter.gguf` from the
   PEFT files written beside it, and scores the model with and without the adapter with
   `llama-perplexity --lora` on tests/gguf/imatrix/text.txt (chunks of 128, the first 8;
   flash attention off, F32 KV cache). The PEFT adapter goes to tests/gguf/lora/adapter and
   the figures to tests/gguf/lora/llama-perplexity.json; tests/it/qlora.rs requires `kiln eval
   --adapter` to give llama-perplexity's perplexity.

    .venv-trl/bin/python scripts/gguf/lora_adapter_ref.py \
        [--kiln target/release/kiln --llama .llama-cpp/bin]
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA_SRC = ROOT / ".llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
QTINY = ROOT / "tests/train/qtiny"
OUT = ROOT / "tests/gguf/lora"
TEXT = ROOT / "tests/gguf/imatrix/text.txt"
CTX, CHUNKS = 128, 8


def run(cmd, cwd=None):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def convert(adapter, base, out):
    """llama.cpp's converter (f32, its default) on the PEFT folder `adapter`."""
    env_path = f"{LLAMA_SRC / 'gguf-py'}:{LLAMA_SRC}"
    cmd = [sys.executable, LLAMA_SRC / "convert_lora_to_gguf.py", "--base", base, "--outfile", out, adapter]
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": env_path})
    if p.returncode != 0:
        sys.exit(f"convert_lora_to_gguf.py failed:\n{p.stderr[-3000:]}")


def ppl(llama, model, lora=None):
    cmd = [llama / "llama-perplexity", "-m", model, "-f", TEXT, "-c", CTX, "--chunks", CHUNKS, "-t", 2,
           "-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    if lora:
        cmd += ["--lora", lora]
    out = run(cmd)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--kiln")
    a.add_argument("--llama", type=pathlib.Path)
    a.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/kiln-lora-ref"))
    o = a.parse_args()
    convert(QTINY / "kiln-adapter", QTINY / "model", QTINY / "kiln-adapter.gguf")
    print("wrote", QTINY / "kiln-adapter.gguf")
    if not (o.kiln and o.llama):
        return
    work = o.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = work / "model"
    run([o.kiln, "demo-model", "--out", model, "--force"])
    run([o.kiln, "export", "--model", model, "--output-format", "gguf", "--format", "f32", "--out", work / "f32",
         "--force"])
    adapter = work / "adapter"
    run([o.kiln, "train", "--task", "sft", "--model", model, "--out", adapter, "--max-steps", 2,
         "--learning-rate", "1e-2", "--lora-r", 4, "--lora-alpha", 8, "--lora-dropout", 0,
         "--lora-target-modules", "q_proj,v_proj", "--per-device-train-batch-size", 2, "--adapter-format", "gguf",
         "--quiet", "--force"])
    convert(adapter, model, work / "converted.gguf")
    same = (adapter / "adapter.gguf").read_bytes() == (work / "converted.gguf").read_bytes()
    print("kiln's adapter.gguf == convert_lora_to_gguf.py's:", same)
    if not same:
        sys.exit("kiln's adapter.gguf differs from the converter's")
    res = {"ctx": CTX, "chunks": CHUNKS, "base_ppl": ppl(o.llama, work / "f32/model.gguf"),
           "lora_ppl": ppl(o.llama, work / "f32/model.gguf", adapter / "adapter.gguf")}
    print(res)
    shutil.rmtree(OUT, ignore_errors=True)
    (OUT / "adapter").mkdir(parents=True)
    for f in ["adapter_config.json", "adapter_model.safetensors"]:
        shutil.copy(adapter / f, OUT / "adapter" / f)
    (OUT / "llama-perplexity.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
