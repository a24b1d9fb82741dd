#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/): small valid inputs of each
reader, from the repository's own test data where it has some. Deterministic.

    python3 fuzz/seeds.py
"""
import json
import random
import shutil
import struct
import subprocess
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
for d in sorted((ROOT / "examples/data").glob("*.jsonl")):
    write("train_jsonl", d.stem, "\n".join(d.read_text().splitlines()[:3]) + "\n")
write("train_jsonl", "prompt_completion", json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
write("train_jsonl", "text", json.dumps({"text": "hello"}) + "\n")
write("train_toml", "sft", 'learning_rate = 1e-5\nmax_steps = 3\nlora_r = 8\nlora_target_modules = ["q_proj", "v_proj"]\n')
write("train_toml", "grpo", 'num_generations = 4\ntemperature = 0.7\nreward_funcs = ["format"]\nscale_rewards = "group"\nbeta = 0.04\n')
write("train_toml", "schedule", 'lr_scheduler_type = "cosine"\nwarmup_steps = 2\nnum_train_epochs = 1.5\nseed = 7\n')
adapter_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
adapter_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
write("peft_config", "peft", json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4,
                                         "target_modules": ["q_proj"], "bias": "none"}))
write("peft_config", "mlx_lm", json.dumps({"fine_tune_type": "lora", "num_layers": 1,
                                           "lora_parameters": {"rank": 2, "scale": 2.0, "dropout": 0.0,
                                                               "keys": ["self_attn.q_proj"]}}))
write("peft_weights", "rank2", safetensors({
    adapter_a: ("F32", [2, 4], f32(*[i * 0.125 - 1.0 for i in range(8)])),
    adapter_b: ("F32", [4, 2], f32(*[i * 0.125 for i in range(8)]))}))
write("peft_weights", "bf16", safetensors({
    adapter_a: ("BF16", [2, 4], b"\x80\x3f" * 8), adapter_b: ("BF16", [4, 2], b"\x00\x00" * 8)}))
# The compressed-tensors and MLX readers' targets start from real exports of a one-layer Llama
# (fuzz/fixtures/{tiny,ct,mlx,bnb}, written by kiln's own writers; the readers' consumers check
# those writers elsewhere): the fuzzed config.json beside the real weights, and the reverse.
FIX = ROOT / "fuzz/fixtures"
shutil.rmtree(FIX, ignore_errors=True)
rng = random.Random(7)
h, inter, vocab = 128, 128, 32


def bf16(n):
    return b"".join(struct.pack("<f", rng.uniform(-0.1, 0.1))[2:] for _ in range(n))


shapes = {"model.embed_tokens.weight": [vocab, h], "model.norm.weight": [h], "lm_head.weight": [vocab, h]}
for n, shape in [("input_layernorm", [h]), ("post_attention_layernorm", [h]),
                 ("self_attn.q_proj", [h, h]), ("self_attn.k_proj", [64, h]),
                 ("self_attn.v_proj", [64, h]), ("self_attn.o_proj", [h, h]),
                 ("mlp.gate_proj", [inter, h]), ("mlp.up_proj", [inter, h]),
                 ("mlp.down_proj", [h, inter])]:
    shapes[f"model.layers.0.{n}.weight"] = shape
(FIX / "tiny").mkdir(parents=True)
(FIX / "tiny/model.safetensors").write_bytes(safetensors(
    {k: ("BF16", v, bf16(v[0] * (v[1] if len(v) > 1 else 1))) for k, v in shapes.items()}))
(FIX / "tiny/config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
    "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": vocab, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": False}))
kiln = ROOT / "target/debug/kiln"
for out, writer, fmt in [("ct", "compressed-tensors", "w4a16"), ("mlx", "mlx", "q4"), ("bnb", "bnb", "nf4")]:
    subprocess.run([kiln, "export", "--model", FIX / "tiny", "--output-format", writer,
                    "--format", fmt, "--out", FIX / out], check=True, stdout=subprocess.DEVNULL)
    (FIX / out / "generation_config.json").unlink(missing_ok=True)
    write(f"{out}_config", out, (FIX / out / "config.json").read_text())
    write(f"{out}_weights", out, (FIX / out / "model.safetensors").read_bytes())
shutil.rmtree(FIX / "tiny")
print({p.name: len(list(p.iterdir())) for p in sorted(OUT.iterdir())})
