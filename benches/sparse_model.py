#!/usr/bin/env python3
"""Writes a Llama checkpoint of any size as sparse files: real headers, shards and index, and
data that is a hole (zeros) taking no disk. For the resource-bound check in RELIABILITY.md: an
export of a checkpoint several times larger than the machine's memory.

    python3 benches/sparse_model.py OUT --layers 36 [--hidden 8192 --intermediate 28672]

bf16; each layer in its own shard (about 2 GB at the default sizes).
"""
import argparse
import json
import os
import struct
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("out", type=Path)
p.add_argument("--layers", type=int, default=36)
p.add_argument("--hidden", type=int, default=8192)
p.add_argument("--intermediate", type=int, default=28672)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--heads", type=int, default=64)
p.add_argument("--kv-heads", type=int, default=8)
a = p.parse_args()
h, i, v = a.hidden, a.intermediate, a.vocab
hd = h // a.heads
kv = a.kv_heads * hd
a.out.mkdir(parents=True, exist_ok=True)
(a.out / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
    "intermediate_size": i, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
    "num_key_value_heads": a.kv_heads, "head_dim": hd, "vocab_size": v, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}, indent=2))

shards = [{"model.embed_tokens.weight": [v, h]}]
for l in range(a.layers):
    q = f"model.layers.{l}"
    shards.append({
        f"{q}.input_layernorm.weight": [h], f"{q}.post_attention_layernorm.weight": [h],
        f"{q}.self_attn.q_proj.weight": [h, h], f"{q}.self_attn.k_proj.weight": [kv, h],
        f"{q}.self_attn.v_proj.weight": [kv, h], f"{q}.self_attn.o_proj.weight": [h, h],
        f"{q}.mlp.gate_proj.weight": [i, h], f"{q}.mlp.up_proj.weight": [i, h],
        f"{q}.mlp.down_proj.weight": [h, i]})
shards.append({"model.norm.weight": [h], "lm_head.weight": [v, h]})

weight_map, total = {}, 0
n = len(shards)
for k, tensors in enumerate(shards):
    name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    header, offset = {}, 0
    for t, shape in tensors.items():
        size = 2
        for d in shape:
            size *= d
        header[t] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        weight_map[t] = name
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(a.out / name, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # the data: a hole
    total += offset
(a.out / "model.safetensors.index.json").write_text(json.dumps(
    {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
print(f"{a.out}: {n} shards, {total / 2**30:.1f} GiB of bf16 weights, "
      f"{sum(os.stat(f).st_blocks for f in a.out.iterdir()) * 512 / 2**20:.1f} MiB on disk")
