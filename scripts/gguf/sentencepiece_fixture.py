#!/usr/bin/env python3
"""Writes tests/gguf/sentencepiece/: a tiny SentencePiece tokenizer.model (BPE, 212 pieces
under the compat models' vocabulary of 256: unknown, control, user-defined and normal pieces)
and a tokenizer_config.json with added tokens inside and past the pieces, for
tests/it/gguf_export.rs. Deterministic (fixed corpus and seed).

    python3 -m pip install sentencepiece==0.2.3
    python3 scripts/gguf/sentencepiece_fixture.py
"""
import json
import random
import shutil
import tempfile
from pathlib import Path

import sentencepiece as spm

OUT = Path(__file__).resolve().parents[2] / "tests/gguf/sentencepiece"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "kiln", "export", "model",
         "tensor", "quant", "scale", "layer", "token", "hello", "world", "llama", "mistral"]

random.seed(0)
with tempfile.TemporaryDirectory() as tmp:
    corpus = Path(tmp) / "corpus.txt"
    corpus.write_text("\n".join(" ".join(random.choice(WORDS) for _ in range(12)) for _ in range(2000)))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(Path(tmp) / "sp"), vocab_size=240, model_type="bpe",
        user_defined_symbols=["<|im_start|>"], control_symbols=["<pad>"], character_coverage=1.0,
        normalization_rule_name="identity", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2, hard_vocab_limit=False, num_threads=1)
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(tmp) / "sp.model", OUT / "tokenizer.model")
(OUT / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "add_bos_token": True, "add_eos_token": False, "add_prefix_space": True,
    "added_tokens_decoder": {
        "4": {"content": "<|im_start|>", "special": True},
        "230": {"content": "<|im_end|>", "special": True},
        "231": {"content": "\u2581kiln", "special": False},
    },
    "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
}, indent=2) + "\n")
print(sorted(p.name for p in OUT.iterdir()))
