#!/usr/bin/env python3
"""Checks a GGUF file kiln exported against its input model, with llama.cpp's gguf-py.

Usage: check_export.py MODEL_DIR GGUF_FILE FILE_TYPE

Independent of kiln's code: the input safetensors are decoded here with numpy, names and the
Q/K row order follow llama.cpp's converter (`LlamaModel.permute`), the per-tensor types follow
llama-quantize's mix as written out below, and every tensor is read and dequantized by gguf-py
(`GGUFReader`, `gguf.quants.dequantize`). Where gguf-py can quantize a type (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, MXFP4, F16, BF16) the bytes must equal its quantization of the input; K-quants
(which gguf-py cannot make) must decode within the type's error bound. Exits non-zero with a
message naming the tensor or key at fault.
"""
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import quants

model_dir, gguf_path, ftype = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = json.loads((model_dir / "config.json").read_text())
arch_name = cfg["architectures"][0]
ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
}[arch_name]
FTYPES = {
    "f32": (0, T.F32), "f16": (1, T.F16), "bf16": (32, T.BF16), "q8-0": (7, T.Q8_0),
    "q4-0": (2, T.Q4_0), "q4-1": (3, T.Q4_1), "q5-0": (8, T.Q5_0), "q5-1": (9, T.Q5_1),
    "q4-k-m": (15, T.Q4_K), "q5-k-m": (17, T.Q5_K), "q6-k": (18, T.Q6_K),
    "mxfp4-moe": (38, T.MXFP4),
}
ftype_number, default = FTYPES[ftype]
failures = []


def fail(msg):
    failures.append(msg)


# --- the input, decoded with numpy ------------------------------------------------------------
def read_safetensors(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        buf = np.frombuffer(data[a:b], dtype=np.uint8)
        dt = info["dtype"]
        if dt == "BF16":
            v = (buf.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dt == "F16":
            v = buf.view(np.float16).astype(np.float32)
        elif dt == "F32":
            v = buf.view(np.float32)
        else:
            continue
        out[name] = (v.reshape(info["shape"]), dt)
    return out


weights = {}
for f in sorted(model_dir.glob("*.safetensors")):
    weights.update(read_safetensors(f))

heads = cfg["num_attention_heads"]
kv_heads = cfg.get("num_key_value_heads", heads)
layers = cfg["num_hidden_layers"]
experts = cfg.get("num_local_experts", cfg.get("num_experts", 0)) or 0
tied = "lm_head.weight" not in weights or cfg.get("tie_word_embeddings") is True


def permute(w, n_head):
    # convert_hf_to_gguf.py, LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# The GGUF tensors expected, from the input's names: name -> float32 values.
expected = {}
stacks = {}
LOCAL = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}
for p in "qkvo":
    for s in ("weight", "bias"):
        LOCAL[f"self_attn.{p}_proj.{s}"] = f"attn_{'output' if p == 'o' else p}.{s}"
EXPERT = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
          "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
for name, (w, _) in weights.items():
    if name == "model.embed_tokens.weight":
        expected["token_embd.weight"] = w
    elif name == "model.norm.weight":
        expected["output_norm.weight"] = w
    elif name == "lm_head.weight":
        if not tied:
            expected["output.weight"] = w
    elif name.startswith("model.layers."):
        n, rest = name[len("model.layers."):].split(".", 1)
        if rest in LOCAL:
            if ARCH == "llama" and rest.startswith("self_attn.q_proj"):
                w = permute(w, heads)
            if ARCH == "llama" and rest.startswith("self_attn.k_proj"):
                w = permute(w, kv_heads)
            expected[f"blk.{n}.{LOCAL[rest]}"] = w
        elif ".experts." in rest and rest.endswith(".weight") and w.ndim == 2:
            _, e, proj, _ = rest.rsplit(".", 3)
            stacks.setdefault(f"blk.{n}.{EXPERT[proj]}.weight", {})[int(e)] = w
        elif rest.endswith(("experts.gate_up_proj", "experts.down_proj")) and w.ndim == 3:
            # transformers 5's fused experts: gate_up [E, 2I, H], down [E, H, I].
            if rest.endswith("gate_up_proj"):
                i = w.shape[1] // 2
                for e in range(w.shape[0]):
                    stacks.setdefault(f"blk.{n}.ffn_gate_exps.weight", {})[e] = w[e, :i]
                    stacks.setdefault(f"blk.{n}.ffn_up_exps.weight", {})[e] = w[e, i:]
            else:
                for e in range(w.shape[0]):
                    stacks.setdefault(f"blk.{n}.ffn_down_exps.weight", {})[e] = w[e]
        else:
            fail(f"input tensor {name}: the checker has no GGUF name for it")
for name, parts in stacks.items():
    expected[name] = np.stack([parts[e] for e in range(len(parts))])

# llama3 RoPE scaling: the converter generates `rope_freqs` first (LlamaModel.
# generate_extra_tensors), per-frequency factors computed in float32.
rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
rope = rope.get("full_attention", rope)
if str(rope.get("rope_type", rope.get("type"))).lower() == "llama3":
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    freqs = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor = np.float32(rope.get("factor", 8.0))
    low, high = np.float32(rope.get("low_freq_factor", 1.0)), np.float32(rope.get("high_freq_factor", 4.0))
    orig = np.float32(rope.get("original_max_position_embeddings", 8192))
    factors = []
    for freq in freqs:
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < orig / high:
            factors.append(np.float32(1.0))
        elif wavelen > orig / low:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(np.float32(1.0) / ((np.float32(1.0) - smooth) / factor + smooth))
    expected["rope_freqs.weight"] = np.array(factors, dtype=np.float32)


# --- llama-quantize's mix (src/llama-quant.cpp), for the file types kiln writes ---------------
BLOCK = {T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.MXFP4: 32,
         T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256, T.F16: 1, T.BF16: 1, T.F32: 1}
base = {"BF16": T.BF16, "F16": T.F16, "F32": T.F32}[weights["model.embed_tokens.weight"][1]]


def more_bits(i, n):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def expected_type(name, w):
    quantizable = w.ndim >= 2 and name.endswith("weight") and "_norm.weight" not in name \
        and "ffn_gate_inp.weight" not in name
    if not quantizable:
        return T.F32
    if ftype in ("f32", "f16", "bf16"):
        return default
    cols = w.shape[-1]
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    km = ftype in ("q4-k-m", "q5-k-m")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        if ftype == "mxfp4-moe" or cols % BLOCK[default]:
            t = T.Q8_0
        elif default != T.Q8_0:
            t = T.Q6_K
        else:
            t = default
    elif ftype == "mxfp4-moe":
        t = T.MXFP4 if w.ndim == 3 else T.Q8_0
    elif "attn_v.weight" in name:
        t = T.Q6_K if km and more_bits(layer, layers) else default
        if experts == 8:
            t = T.Q8_0
    elif "attn_k.weight" in name and experts == 8:
        t = T.Q8_0
    elif "ffn_down" in name and km and more_bits(layer, layers):
        t = T.Q6_K
    elif "attn_output.weight" in name and experts == 8 and ftype == "q4-k-m":
        t = T.Q5_K
    else:
        t = default
    if cols % BLOCK[t]:
        t = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(t, t)
        if cols % BLOCK[t]:
            t = T.F16
    return t


# --- the file, read by gguf-py ----------------------------------------------------------------
reader = GGUFReader(gguf_path)
fields = {k: f for k, f in reader.fields.items()}


def field(key):
    f = fields.get(key)
    if f is None:
        fail(f"metadata {key} missing")
        return None
    return f.contents()


# The converter's LlamaModel reads a SentencePiece tokenizer.model before tokenizer.json.
SENTENCEPIECE = ARCH == "llama" and (model_dir / "tokenizer.model").is_file()


def sentencepiece_vocab():
    """`_create_vocab_sentencepiece`, from the sentencepiece library's reading of the model."""
    from sentencepiece import SentencePieceProcessor
    sp = SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
    n = cfg["vocab_size"]
    tokens, scores, types = [f"[PAD{i}]" for i in range(n)], [-10000.0] * n, [5] * n
    for i in range(min(sp.vocab_size(), n)):
        kind = 1
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_unused(i):
            kind = 5
        elif sp.is_byte(i):
            kind = 6
        tokens[i], scores[i], types[i] = sp.id_to_piece(i), sp.get_score(i), kind
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text()) if tc_path.is_file() else {}
    for i, data in tc.get("added_tokens_decoder", {}).items():
        i, content = int(i), data["content"]
        special = data.get("special") or content.startswith("<|") and content.endswith("|>")
        tokens[i] = content if special else content.replace("\u2581", " ")
        types[i] = 3 if special else 4
        scores[i] = -1000.0
    return tokens, scores, types


want_meta = {
    "general.architecture": ARCH,
    "general.file_type": ftype_number,
    f"{ARCH}.block_count": layers,
    f"{ARCH}.embedding_length": cfg["hidden_size"],
    f"{ARCH}.attention.head_count": heads,
    f"{ARCH}.attention.head_count_kv": kv_heads,
    f"{ARCH}.context_length": cfg.get("max_position_embeddings"),
    "tokenizer.ggml.model": "llama" if SENTENCEPIECE else "gpt2",
}
if experts:
    want_meta[f"{ARCH}.expert_count"] = experts
    want_meta[f"{ARCH}.expert_used_count"] = cfg["num_experts_per_tok"]
if "head_dim" in cfg:
    want_meta[f"{ARCH}.attention.key_length"] = cfg["head_dim"]
for k, v in want_meta.items():
    if v is not None and field(k) != v:
        fail(f"metadata {k}: {field(k)!r}, expected {v!r}")
eps = field(f"{ARCH}.attention.layer_norm_rms_epsilon")
if eps is None or abs(eps - cfg["rms_norm_eps"]) > 1e-9:
    fail(f"metadata rms eps {eps}")
if SENTENCEPIECE:
    want_tokens, want_scores, want_types = sentencepiece_vocab()
    if field("tokenizer.ggml.tokens") != want_tokens:
        fail("tokenizer.ggml.tokens differ from the SentencePiece model's pieces")
    got_scores = field("tokenizer.ggml.scores")
    if got_scores is None or np.asarray(got_scores, np.float32).tobytes() != np.asarray(want_scores, np.float32).tobytes():
        fail("tokenizer.ggml.scores differ from the SentencePiece model's")
    if field("tokenizer.ggml.token_type") != want_types:
        fail("tokenizer.ggml.token_type differs from the SentencePiece model's piece types")
    if "tokenizer.ggml.merges" in fields:
        fail("a SentencePiece vocabulary has no merges")
    if field("tokenizer.ggml.pre") != "default":
        fail("tokenizer.ggml.pre is not `default`")
tokens = field("tokenizer.ggml.tokens")
if tokens is not None and len(tokens) != cfg["vocab_size"]:
    fail(f"tokenizer.ggml.tokens: {len(tokens)} tokens, config.json's vocab_size is {cfg['vocab_size']}")

seen = set()
checked_bytes = 0
for t in reader.tensors:
    name = t.name
    seen.add(name)
    if name not in expected:
        fail(f"{name}: not expected from the input")
        continue
    w = expected[name].astype(np.float32)
    want_t = expected_type(name, w)
    if t.tensor_type != want_t:
        fail(f"{name}: {t.tensor_type.name}, llama-quantize's mix gives {want_t.name}")
        continue
    got = quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
    try:
        ref_bytes = quants.quantize(w, t.tensor_type)
    except NotImplementedError:
        ref_bytes = None
    if ref_bytes is not None:
        if np.asarray(t.data).tobytes() != np.asarray(ref_bytes).tobytes():
            fail(f"{name} ({t.tensor_type.name}): bytes differ from gguf-py's quantization of the input")
        checked_bytes += 1
    else:
        # K-quants: decoded within the type's step of the block's range.
        bits = {T.Q4_K: 4, T.Q5_K: 5, T.Q6_K: 6}[t.tensor_type]
        blocks = w.reshape(-1, 32)
        rng = (blocks.max(1) - np.minimum(blocks.min(1), 0)).repeat(32).reshape(w.shape)
        err = np.abs(got - w)
        bound = rng / (2 ** bits - 1) * 1.5 + 1e-6
        if np.any(err > bound):
            i = np.unravel_index(np.argmax(err - bound), w.shape)
            fail(f"{name} ({t.tensor_type.name}): |Δ| {err[i]:.3g} at {i} exceeds {bound[i]:.3g}")
    if not np.all(np.isfinite(got)):
        fail(f"{name}: non-finite values after decoding")
missing = sorted(set(expected) - seen)
if missing:
    fail(f"tensors missing from the file: {missing}")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"ok: {len(reader.tensors)} tensors ({checked_bytes} byte-compared with gguf-py), {len(fields)} keys")
