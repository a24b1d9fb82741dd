#!/usr/bin/env python3
"""Writes tests/gguf/converter_tokenizer.json: the `tokenizer.*` keys (in file order, with
their values) that llama.cpp's own convert_hf_to_gguf.py writes for three tokenizers, one per
path of the GGUF writer's vocabulary code:
  bpe            the demo model's byte-level BPE (`_set_vocab_gpt2`; its pre-tokenizer is in
                 no table, so the converter's lookup is made to answer `default`, as kiln writes)
  sentencepiece  tests/gguf/sentencepiece (tokenizer.model: `_set_vocab_sentencepiece`)
  llama-hf       tests/gguf/llama-hf (byte-fallback BPE tokenizer.json: `_set_vocab_llama_hf`)
each beside the weights of tests/compat/llama-tiny. tests/it/gguf_export.rs exports the same
folders with kiln and compares.

    python scripts/gguf/converter_tokenizer_keys.py KILN LLAMA_CPP_DIR
KILN: a kiln binary (writes the demo model); LLAMA_CPP_DIR: llama.cpp's sources as vendored in
llama-cpp-python 0.3.36. The Python needs torch, transformers, sentencepiece and numpy.
"""
import json
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KILN, LLAMA = sys.argv[1], Path(sys.argv[2])
sys.path[:0] = [str(LLAMA), str(LLAMA / "gguf-py")]
import gguf  # noqa: E402


def convert(model: Path, out: Path, pre_default: bool) -> None:
    if pre_default:
        import conversion.base as b
        b.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outtype", "f32", "--outfile", str(out)]
    try:
        runpy.run_path(str(LLAMA / "convert_hf_to_gguf.py"), run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise


def keys(path: Path) -> list:
    r = gguf.GGUFReader(path)
    return [[k, f.contents()] for k, f in r.fields.items() if k.startswith("tokenizer.")]


cases = {}
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    for name, fixture in [("sentencepiece", "tests/gguf/sentencepiece"), ("llama-hf", "tests/gguf/llama-hf")]:
        d = tmp / name
        shutil.copytree(ROOT / "tests/compat/llama-tiny/model", d)
        for f in (ROOT / fixture).iterdir():
            shutil.copy(f, d / f.name)
        convert(d, tmp / f"{name}.gguf", False)
        cases[name] = keys(tmp / f"{name}.gguf")
    demo = tmp / "bpe"
    subprocess.run([KILN, "demo-model", "--out", str(demo)], check=True, capture_output=True)
    convert(demo, tmp / "bpe.gguf", True)
    cases["bpe"] = keys(tmp / "bpe.gguf")
out = ROOT / "tests/gguf/converter_tokenizer.json"
out.write_text(json.dumps({"source": "llama-cpp-python==0.3.36 convert_hf_to_gguf.py", "cases": cases},
                          ensure_ascii=False) + "\n")
print(out, {k: len(v) for k, v in cases.items()})
