#!/usr/bin/env python3
"""ModelOpt reference exports for kiln's compatibility tests (tests/compat.rs).

Builds tiny random models (bf16, fixed seeds) — a Llama, a Qwen2 with attention biases, a
Qwen3 with q/k norms, a Mistral, a Mixtral (per-expert w1/w2/w3) and a Qwen3-MoE whose 8 experts see few calibration tokens, so
some see none — calibrates them with ModelOpt on fixed token ids,
dumps every input quantizer's amax under ModelOpt's quantizer names, and exports them with
ModelOpt for each format kiln implements. Everything it writes is small and committed:

    tests/compat/<model>/model/              the input checkpoint
    tests/compat/<model>/<format>/amax.json  ModelOpt's calibrated input amax
    tests/compat/<model>/<format>/modelopt/  ModelOpt's export

    python3 -m venv --system-site-packages .venv && .venv/bin/pip install -r requirements.txt
    .venv/bin/python tests/compat/modelopt_ref.py [FORMAT ...]   # all formats by default
Runs on the CPU (a few seconds per format).
"""
import copy
import json
import pathlib
import shutil
import sys

import torch
import transformers
import modelopt
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint

HERE = pathlib.Path(__file__).resolve().parent

def with_fp8_kv(cfg):
    """`cfg` plus ModelOpt's FP8 KV-cache quantizers (calibrated k/v BMM amax)."""
    cfg = copy.deepcopy(cfg)
    kv = mtq.FP8_KV_CFG["quant_cfg"]
    if isinstance(cfg["quant_cfg"], dict):
        cfg["quant_cfg"].update(kv)
    else:
        cfg["quant_cfg"].extend(kv)
    return cfg


FORMATS = {
    "fp8": mtq.FP8_DEFAULT_CFG,
    "fp8+kv-fp8": with_fp8_kv(mtq.FP8_DEFAULT_CFG),
    "nvfp4+kv-fp8": with_fp8_kv(mtq.NVFP4_DEFAULT_CFG),
    "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    "w4a16-nvfp4": mtq.W4A16_NVFP4_CFG,
    "fp8-per-channel": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG,
    "int8-wo": mtq.INT8_WEIGHT_ONLY_CFG,
    "mxfp8": mtq.MXFP8_DEFAULT_CFG,
    "mxfp4": mtq.MXFP4_DEFAULT_CFG,
    "fp8-block": mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
}


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    return model


def tiny_qwen3_moe():
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=8,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    return model



def tiny_mixtral():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )
    return _random_norms(transformers.MixtralForCausalLM(config))


def tiny_qwen2():
    """Qwen2: q/k/v carry biases, which are copied unquantized."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
    )
    model = _random_norms(transformers.Qwen2ForCausalLM(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    return model



def tiny_qwen3():
    """Qwen3 (dense): per-head q_norm / k_norm, copied unquantized."""
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return _random_norms(transformers.Qwen3ForCausalLM(config))


def tiny_mistral():
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False,
    )
    return _random_norms(transformers.MistralForCausalLM(config))

def _random_norms(model):
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p, dtype=torch.float32).to(p.dtype))
    return model


# model name → (constructor, transformers class, calibration shape, formats)
MODELS = {
    "llama-tiny": (tiny_llama, transformers.LlamaForCausalLM, (4, 32), list(FORMATS)),
    # Few tokens over 8 experts: some experts get none and ModelOpt fills their input amax.
    "qwen3-moe-tiny": (tiny_qwen3_moe, transformers.Qwen3MoeForCausalLM, (1, 6),
                       ["fp8", "nvfp4", "w4a16-nvfp4", "fp8-per-channel", "int8-wo", "mxfp8", "fp8-block"]),
    "mixtral-tiny": (tiny_mixtral, transformers.MixtralForCausalLM, (2, 16),
                     ["fp8", "nvfp4", "fp8-per-channel", "int8-wo", "mxfp8", "fp8-block"]),
    "qwen2-tiny": (tiny_qwen2, transformers.Qwen2ForCausalLM, (2, 16),
                   ["fp8", "nvfp4", "int8-wo", "fp8-block"]),
    "qwen3-tiny": (tiny_qwen3, transformers.Qwen3ForCausalLM, (2, 16),
                   ["fp8", "nvfp4", "w4a16-nvfp4", "mxfp4"]),
    "mistral-tiny": (tiny_mistral, transformers.MistralForCausalLM, (2, 16),
                     ["fp8", "nvfp4", "fp8-per-channel", "mxfp8"]),
}


def calibration_ids(shape):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, shape, generator=g)


def main():
    print("modelopt", modelopt.__version__, "transformers", transformers.__version__, "torch", torch.__version__)
    only = set(sys.argv[1:])  # optional: regenerate only these formats
    for model_name, (make, cls, calib_shape, formats) in MODELS.items():
        formats = [f for f in formats if not only or f in only]
        export_model(HERE / model_name, make, cls, calibration_ids(calib_shape), formats)


def export_model(root, make, cls, ids, formats):
    input_dir = root / "model"
    if input_dir.exists():
        shutil.rmtree(input_dir)
    make().save_pretrained(input_dir, safe_serialization=True)
    for name in formats:
        cfg = FORMATS[name]
        # Loaded from disk so config.torch_dtype is set (ModelOpt's MoE export needs it).
        model = cls.from_pretrained(input_dir, torch_dtype=torch.bfloat16).eval()

        def forward_loop(m):
            with torch.no_grad():
                for row in ids:
                    m(row[None, :])

        mtq.quantize(model, cfg, forward_loop)
        amax = {}
        for mod_name, module in model.named_modules():
            for quantizer in ("input_quantizer", "k_bmm_quantizer", "v_bmm_quantizer"):
                q = getattr(module, quantizer, None)
                if q is not None and getattr(q, "amax", None) is not None and q.amax.numel() == 1:
                    amax[f"{mod_name}.{quantizer}"] = float(q.amax.float())
        out = root / name
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / "amax.json").write_text(json.dumps(amax, indent=1, sort_keys=True) + "\n")
        try:
            export_hf_checkpoint(model, export_dir=out / "modelopt")
            print(f"{root.name} {name}: exported ({len(amax)} input amax)")
        except Exception as e:  # a format ModelOpt cannot export on the CPU
            shutil.rmtree(out)
            print(f"{root.name} {name}: ModelOpt failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
