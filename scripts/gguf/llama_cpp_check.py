#!/usr/bin/env python3
"""kiln's GGUF checked by llama.cpp itself (llama-cpp-python 0.3.36, built from PyPI).

1. Writes kiln's demo model and exports it with `--output-format gguf` in several file types.
2. Quantizes kiln's BF16 GGUF with llama.cpp's own `llama_model_quantize` (what
   `llama-quantize` runs) to the same file types, and compares the two files tensor by
   tensor: the type llama.cpp chose, and the bytes (blocks that differ are counted).
3. Loads every kiln file in llama.cpp, evaluates one token sequence, and compares the logits
   with the original model's (transformers, float32).

Usage (scripts/gguf/llama_cpp_check.sh sets up the environment):
    python llama_cpp_check.py --kiln target/release/kiln --work /tmp/kiln-llama-cpp
Prints a table; exits non-zero when a type or the logits disagree beyond the stated bounds.
"""
import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

import numpy as np

FTYPES = {"bf16": 32, "q8-0": 7, "q4-0": 2, "q4-1": 3, "q5-0": 8, "q5-1": 9,
          "q4-k-m": 15, "q5-k-m": 17, "q6-k": 18}
# Smallest correlation of llama.cpp's logits with the float32 original's accepted, per file
# type. The demo model is random: its logits are small and near-uniform, so 4-bit noise is
# large against them and top-1 agreement says little; a misplaced tensor, a wrong row order or
# a wrong scale drops the correlation towards 0.
CORR_FLOOR = {"bf16": 0.999, "q8-0": 0.99, "q6-k": 0.98, "q5-k-m": 0.95, "q5-0": 0.95,
              "q5-1": 0.95, "q4-k-m": 0.85, "q4-0": 0.85, "q4-1": 0.85}


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


FAMILIES = ["llama-tiny", "llama-tied-tiny", "mistral-tiny", "qwen2-tiny", "qwen3-tiny",
            "qwen3-moe-tiny", "mixtral-tiny", "llama3-rope-tiny"]


def write_tokenizer(d, vocab):
    """A byte-level BPE tokenizer of `vocab` ids for the compat suite's tiny models (as
    tests/common/mod.rs writes it)."""
    import json
    symbols = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    v = {chr(b): i + 2 for i, b in enumerate(symbols[: vocab - 2])}
    special = lambda i, c: {"id": i, "content": c, "special": True, "single_word": False,
                            "lstrip": False, "rstrip": False, "normalized": False}
    tok = {"version": "1.0", "added_tokens": [special(0, "<s>"), special(1, "</s>")],
           "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
           "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": v, "merges": []}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--size", default="small")
    ap.add_argument("--compat", default="tests/compat",
                    help="the compat suite's folder: its tiny families are checked too")
    a = ap.parse_args()
    import shutil

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        run([a.kiln, "demo-model", "--size", a.size, "--out", model])
    bad = check_model(a.kiln, model, work / "demo", FTYPES)
    for name in FAMILIES:
        src = Path(a.compat) / name / "model"
        dst = work / name / "model"
        if not dst.exists():
            shutil.copytree(src, dst)
            write_tokenizer(dst, 256)
        print(f"\n## {name}")
        bad += check_model(a.kiln, dst, work / name, {"bf16": 32, "q8-0": 7, "q4-k-m": 15})
    if bad:
        print("\n".join(bad))
        sys.exit(1)
    print("ok")


def check_model(kiln, model, work, ftypes):
    import llama_cpp
    from gguf import GGUFReader

    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for ft in ftypes:
        out = work / f"kiln-{ft}"
        run([kiln, "export", "--output-format", "gguf", "--format", ft, "--model", model,
             "--out", out, "--force"])
        files[ft] = out / "model.gguf"

    # 2. llama.cpp's quantizer on kiln's BF16 file.
    bad = []
    print("file type | tensors | types as llama.cpp | identical tensors | differing bytes")
    for ft, num in ftypes.items():
        if ft == "bf16":
            continue
        theirs = work / f"llama-{ft}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = num
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(files["bf16"]).encode(), str(theirs).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            sys.exit(f"llama_model_quantize {ft}: {rc}")
        ours = {t.name: t for t in GGUFReader(files[ft]).tensors}
        same_type = identical = blocks = 0
        for t in GGUFReader(theirs).tensors:
            o = ours.get(t.name)
            if o is None:
                bad.append(f"{model}: {ft}: {t.name} missing from kiln's file")
                continue
            if o.tensor_type != t.tensor_type:
                bad.append(f"{model}: {ft}: {t.name} is {o.tensor_type.name}, llama.cpp wrote {t.tensor_type.name}")
                continue
            same_type += 1
            x, y = np.asarray(o.data).tobytes(), np.asarray(t.data).tobytes()
            if x == y:
                identical += 1
            else:
                diff = np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8)
                blocks += int(diff.sum())
        print(f"{ft:9} | {len(ours):7} | {same_type:18} | {identical:17} | {blocks}")
        if identical != len(ours):
            bad.append(f"{model}: {ft}: {len(ours) - identical} tensor(s) differ from llama.cpp's bytes")

    # 3. Logits in llama.cpp against the original (transformers, float32).
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    vocab = hf.config.vocab_size
    tokens = [1] + [2 + (i * 37) % (vocab - 2) for i in range(47)]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0].numpy()
    print("\nfile type | correlation | max |Δlogit| | mean |Δlogit| | top-1 agreement")
    for ft, path in files.items():
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False,
                              n_threads=2, n_batch=64)
        llm.eval(tokens)
        got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        d = np.abs(got - ref)
        top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
        corr = float(np.corrcoef(got.ravel(), ref.ravel())[0, 1])
        print(f"{ft:9} | {corr:11.5f} | {d.max():12.3e} | {d.mean():13.3e} | {top1:.3f}")
        if not corr >= CORR_FLOOR[ft]:
            bad.append(f"{model.name}: {ft}: logits correlate {corr:.5f} with the original's, below {CORR_FLOOR[ft]}")
    return bad

if __name__ == "__main__":
    main()
