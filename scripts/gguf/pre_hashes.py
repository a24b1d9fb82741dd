#!/usr/bin/env python3
"""Extracts llama.cpp's BPE pre-tokenizer table into runtime/src/formats/gguf_pre.json.

llama.cpp's converter names a BPE tokenizer's pre-tokenizer (`tokenizer.ggml.pre`) by the
SHA-256 of `str(tokenizer.encode(chktxt))` — the Python list repr of the token ids of one fixed
text — looked up in a table of known hashes. kiln's GGUF writer does the same; this script
takes the text and the table from the pinned llama.cpp (vendored in llama-cpp-python 0.3.36,
the version kiln's GGUF checks use) so they are data kiln reads, not code it copies.

Usage: python3 scripts/gguf/pre_hashes.py LLAMA_CPP_DIR > runtime/src/formats/gguf_pre.json
"""
import ast
import json
import re
import sys
from pathlib import Path

src = (Path(sys.argv[1]) / "conversion" / "base.py").read_text(encoding="utf-8")
body = src[src.index("def get_vocab_base_pre"):]
body = body[: body.index("    def ", 10)]
m = re.search(r"^\s*chktxt = (.+)$", body, re.M)
chktxt = ast.literal_eval(m.group(1))
table = []
for h, ref, name in re.findall(
    r'if chkhsh == "([0-9a-f]{64})":\s*\n\s*# ref: (\S+)\s*\n\s*res = "([^"]+)"', body
):
    table.append({"hash": h, "pre": name, "ref": ref})
assert len(table) == body.count("if chkhsh =="), "every hash parsed"
json.dump(
    {"source": "llama.cpp conversion/base.py (llama-cpp-python 0.3.36)", "chktxt": chktxt, "hashes": table},
    sys.stdout,
    ensure_ascii=False,
    indent=1,
)
print()
