#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/): small valid inputs of each
reader, from the repository's own test data where it has some. Deterministic.

    python3 fuzz/seeds.py
"""
import json
import shutil
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "fuzz/corpus"


def safetensors(tensors, metadata=None):
    header, data, offset = {}, b"", 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data += raw
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


def write(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


shutil.rmtree(OUT, ignore_errors=True)
embed = ("F32", [4, 2], f32(*[i * 0.25 for i in range(8)]))
write("safetensors", "tiny", safetensors({"model.embed_tokens.weight": embed}))
write("safetensors", "layer", safetensors({
    "model.embed_tokens.weight": embed,
    "model.layers.0.self_attn.q_proj.weight": ("BF16", [2, 2], b"\x80\x3f" * 4),
    "model.layers.0.input_layernorm.weight": ("F16", [2], b"\x00\x3c" * 2),
    "model.norm.weight": ("F32", [2], f32(1, 1)),
}, {"format": "pt"}))
write("safetensors", "empty", safetensors({"a": ("F32", [0, 2], b"")}))
write("safetensors_index", "index", json.dumps({
    "metadata": {"total_size": 64},
    "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
write("safetensors_index", "two", json.dumps({
    "weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors",
                   "lm_head.weight": "model-00001-of-00002.safetensors"}}))
for c in sorted((ROOT / "tests/compat").glob("*/model/config.json")):
    write("config_json", c.parent.parent.name, c.read_text())
write("config_json", "tiny", json.dumps({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 2, "vocab_size": 4,
    "num_hidden_layers": 1, "num_attention_heads": 1, "intermediate_size": 4}))
write("gguf", "gguf_py", (ROOT / "tests/gguf/gguf_py.gguf").read_bytes())
for c in sorted((ROOT / "tests/compat").glob("*/calib.jsonl"))[:3]:
    write("calib_jsonl", c.parent.name, c.read_text())
write("calib_jsonl", "text", '{"text": "hello world"}\n{"input_ids": [1, 2, 3]}\n')
for a in sorted((ROOT / "tests/compat").glob("*/nvfp4/amax.json"))[:2]:
    write("act_amax", a.parent.parent.name, a.read_text())
write("act_amax", "kv", json.dumps({
    "model.layers.0.self_attn.q_proj.input_quantizer": 1.5,
    "model.layers.0.self_attn.k_bmm_quantizer": 0.25}))
write("chat_template", "sentencepiece", (ROOT / "tests/gguf/sentencepiece/tokenizer_config.json").read_text())
write("chat_template", "llama-hf", (ROOT / "tests/gguf/llama-hf/tokenizer_config.json").read_text())
write("chat_template", "generation", json.dumps({
    "bos_token": "<s>", "eos_token": "</s>",
    "chat_template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                     "{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}<|{{ m.role }}|>"
                     "{{ m.content }}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"}))
print({p.name: len(list(p.iterdir())) for p in sorted(OUT.iterdir())})
