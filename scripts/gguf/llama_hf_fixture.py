#!/usr/bin/env python3
"""Writes tests/gguf/llama-hf/: a Llama-2-style byte-fallback BPE tokenizer.json (no
tokenizer.model) for the GGUF writer's `LlamaHfVocab` path, built from the SentencePiece
fixture's pieces (tests/gguf/sentencepiece/tokenizer.model) in the layout transformers writes
for Llama 2: `Prepend`/`Replace` normalizer, BPE with `byte_fallback`, a `Sequence` decoder and
a `TemplateProcessing` post-processor adding BOS. Added tokens inside the vocabulary and past
it; tokenizer_config.json with special tokens and a chat template. Deterministic.

    python3 -m pip install sentencepiece==0.2.3
    python3 scripts/gguf/llama_hf_fixture.py
"""
import json
from pathlib import Path

import sentencepiece as spm

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/gguf/llama-hf"
sp = spm.SentencePieceProcessor(model_file=str(ROOT / "tests/gguf/sentencepiece/tokenizer.model"))
vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
# Byte pieces for a few bytes (a real Llama 2 vocabulary has all 256 at ids 3..258).
for b in (0x0A, 0x21, 0xE2):
    vocab[f"<0x{b:02X}>"] = len(vocab)
# Merges of the pieces that are two known pieces joined (enough for transformers to load it).
pieces = sorted(vocab, key=vocab.get)
merges = []
for p in pieces:
    for cut in range(1, len(p)):
        a, b = p[:cut], p[cut:]
        if a in vocab and b in vocab:
            merges.append([a, b])
            break
added = [
    {"id": 0, "content": "<unk>", "special": True},
    {"id": 1, "content": "<s>", "special": True},
    {"id": 2, "content": "</s>", "special": True},
    {"id": len(vocab), "content": "<|im_end|>", "special": True},
    {"id": len(vocab) + 1, "content": "<tool>", "special": False},
]
for a in added:
    a.update({"single_word": False, "lstrip": False, "rstrip": False, "normalized": False})
tokenizer = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": added,
    "normalizer": {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "pre_tokenizer": None,
    "post_processor": {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
              "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True,
              "ignore_merges": False, "vocab": vocab, "merges": merges},
}
OUT.mkdir(parents=True, exist_ok=True)
(OUT / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False, indent=1) + "\n")
(OUT / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
    "add_bos_token": True, "add_eos_token": False,
    "additional_special_tokens": ["<|im_end|>"],
    "tokenizer_class": "LlamaTokenizer",
    "chat_template": "{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}",
}, indent=2) + "\n")
print(len(vocab), "base tokens,", len(merges), "merges")
