#!/usr/bin/env python3
"""ModelOpt reference exports for kiln's compatibility tests (tests/it/compat.rs).

Builds tiny random models (bf16, fixed seeds) — a Llama, a Qwen2 with attention biases, a
Qwen3 with q/k norms, a Mistral, a Mixtral (per-expert w1/w2/w3), a Qwen3-MoE whose 8 experts see few calibration tokens, so
some see none, and a GPT-OSS (3-D BMM experts) — calibrates them with ModelOpt on fixed token ids,
dumps every input quantizer's amax under ModelOpt's quantizer names, and exports them with
ModelOpt for each format kiln implements. Everything it writes is small and committed:

    tests/compat/<model>/model/              the input checkpoint
    tests/compat/<model>/<format>/amax.json  ModelOpt's calibrated input amax
    tests/compat/<model>/<format>/modelopt/  ModelOpt's export

    python3 -m venv --system-site-packages .venv && .venv/bin/pip install -r requirements.txt
    .venv/bin/python tests/compat/modelopt_ref.py [MODEL ...] [FORMAT ...]   # all by default
    # and, for the transformers-5 models (fused experts), the same in a second venv:
    python3 -m venv --system-site-packages .venv5 && .venv5/bin/pip install -r requirements-tf5.txt
    .venv5/bin/python tests/compat/modelopt_ref.py [MODEL ...] [FORMAT ...]
    # transformers 5 dumps of the committed per-expert Mixtral and Qwen3-MoE (fused experts in
    # memory, `<experts>.gate_up_proj_input_quantizer`), written to <model>/<format>-tf5/:
    .venv5/bin/python tests/compat/modelopt_ref.py --tf5-dumps
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


def with_algorithm(cfg, algorithm):
    cfg = copy.deepcopy(cfg)
    cfg["algorithm"] = algorithm
    return cfg


def bf16_exact_smoothing():
    """AWQ and SmoothQuant smooth a weight by an f32 scale but store that scale as bf16
    (`pre_quant_scale`). Round the scale to bf16 before it is applied, so the dumped
    `pre_quant_scale` is exactly what smoothed the weights: kiln takes the dump as its given
    scales (the scale search itself belongs to calibration)."""
    import modelopt.torch.quantization.model_calib as calib

    original = calib.apply_pre_quant_scale_and_smooth

    def rounded(linear, pre_quant_scale=None):
        if pre_quant_scale is not None:
            pre_quant_scale = pre_quant_scale.to(torch.bfloat16).to(torch.float32)
        return original(linear, pre_quant_scale)

    calib.apply_pre_quant_scale_and_smooth = rounded


bf16_exact_smoothing()


def with_fp8_lm_head(cfg):
    """`cfg` with `lm_head` quantized to FP8 (per-tensor weight and input scales): two formats
    in one checkpoint, which ModelOpt writes as MIXED_PRECISION."""
    cfg = copy.deepcopy(cfg)
    fp8 = {"num_bits": (4, 3), "axis": None}
    cfg["quant_cfg"].extend([
        {"quantizer_name": "*lm_head.weight_quantizer", "cfg": fp8, "enable": True},
        {"quantizer_name": "*lm_head.input_quantizer", "cfg": fp8, "enable": True},
    ])
    return cfg


def with_block(cfg, block):
    """`cfg` with its INT4 weight blocks of `block` columns (`block_sizes {-1: block}`), what
    kiln's `--group-size` sets."""
    cfg = copy.deepcopy(cfg)

    def visit(c):
        if isinstance(c, dict):
            b = c.get("block_sizes")
            if isinstance(b, dict) and -1 in b and c.get("num_bits") == 4:
                b[-1] = block
            for v in c.values():
                visit(v)
        elif isinstance(c, list):
            for v in c:
                visit(v)

    visit(cfg["quant_cfg"])
    return cfg


FORMATS = {
    "fp8": mtq.FP8_DEFAULT_CFG,
    "fp8+kv-fp8": with_fp8_kv(mtq.FP8_DEFAULT_CFG),
    "nvfp4+kv-fp8": with_fp8_kv(mtq.NVFP4_DEFAULT_CFG),
    "nvfp4": mtq.NVFP4_DEFAULT_CFG,
    "nvfp4+fp8-lm-head": with_fp8_lm_head(mtq.NVFP4_DEFAULT_CFG),
    "w4a16-nvfp4": mtq.W4A16_NVFP4_CFG,
    "fp8-per-channel": mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG,
    "int8-wo": mtq.INT8_WEIGHT_ONLY_CFG,
    "mxfp8": mtq.MXFP8_DEFAULT_CFG,
    "mxfp4": mtq.MXFP4_DEFAULT_CFG,
    "fp8-block": mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
    "int4-awq": mtq.INT4_AWQ_CFG,
    "w4a8-awq": mtq.W4A8_AWQ_BETA_CFG,
    "int8-sq": mtq.INT8_SMOOTHQUANT_CFG,
    # ModelOpt's NVFP4 AWQ search needs a GPU: made on one with --reuse-input (below).
    "nvfp4-awq": mtq.NVFP4_AWQ_LITE_CFG,
    # AWQ with the clipping search after the scale search (`awq_full`): the dump also holds
    # each Linear's clipped INT4 block amax (`<linear>.weight_quantizer`).
    "int4-awq-full": with_algorithm(mtq.INT4_AWQ_CFG, {"method": "awq_full", "alpha_step": 0.1}),
    # AWQ's INT4 blocks of 64 and 32 columns (kiln's --group-size).
    "int4-awq-g64": with_block(mtq.INT4_AWQ_CFG, 64),
    "int4-awq-g32": with_block(mtq.INT4_AWQ_CFG, 32),
    "w4a8-awq-g64": with_block(mtq.W4A8_AWQ_BETA_CFG, 64),
}

# Calibrate on the GPU when there is one (NVFP4 AWQ needs it); everything else runs on the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# --reuse-input: keep the committed input model (written by the pinned environment) instead of
# re-creating it, so a reference made elsewhere (another transformers, a GPU machine) matches it.
REUSE_INPUT = "--reuse-input" in sys.argv


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


def tiny_llama_tied():
    """A Llama whose lm_head is tied to the input embeddings: no `lm_head.weight` on disk, and
    ModelOpt still lists `lm_head` as excluded."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True,
    )
    return _random_norms(transformers.LlamaForCausalLM(config))


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

def tiny_gpt_oss():
    """GPT-OSS: BMM experts (3-D `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`, with biases)
    that stay 3-D, attention sinks, a router with a bias."""
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = _random_norms(transformers.GptOssForCausalLM(config))
    with torch.no_grad():
        # transformers initialises the experts to zeros: give them (and biases) values.
        for name, p in model.named_parameters():
            if p.dim() == 3 or (p.dim() == 2 and name.endswith("_bias")):
                p.copy_((0.02 * torch.randn_like(p, dtype=torch.float32)).to(p.dtype))
    return model


def tiny_qwen3_moe_fused():
    """Qwen3-MoE as transformers 5 holds it in memory: fused experts `gate_up_proj [E, 2I, H]`
    and `down_proj [E, H, I]` (one input quantizer per projection in ModelOpt)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = _random_norms(transformers.Qwen3MoeForCausalLM(config))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.copy_((0.02 * torch.randn_like(p, dtype=torch.float32)).to(p.dtype))
    return model


def tiny_qwen3_moe_awq():
    """Qwen3-MoE wide enough for INT4's 128-groups (hidden and expert width 128): AWQ on experts."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return _random_norms(transformers.Qwen3MoeForCausalLM(config))


def tiny_mixtral_awq():
    """Mixtral wide enough for INT4's 128-groups: AWQ on w1/w2/w3 experts."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, tie_word_embeddings=False,
    )
    return _random_norms(transformers.MixtralForCausalLM(config))


def save_in_memory_layout(model, path):
    """Writes the state dict as transformers 5 holds it (fused 3-D experts) — what a checkpoint
    saved without transformers' reverse conversion contains."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


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
    "llama-tied-tiny": (tiny_llama_tied, transformers.LlamaForCausalLM, (2, 16), ["fp8", "nvfp4"]),
    "qwen3-moe-tiny": (tiny_qwen3_moe, transformers.Qwen3MoeForCausalLM, (1, 6),
                       ["fp8", "nvfp4", "w4a16-nvfp4", "fp8-per-channel", "int8-wo", "mxfp8", "fp8-block", "int8-sq"]),
    "mixtral-tiny": (tiny_mixtral, transformers.MixtralForCausalLM, (2, 16),
                     ["fp8", "nvfp4", "fp8-per-channel", "int8-wo", "mxfp8", "fp8-block", "int8-sq"]),
    "qwen2-tiny": (tiny_qwen2, transformers.Qwen2ForCausalLM, (2, 16),
                   ["fp8", "nvfp4", "int8-wo", "fp8-block", "int8-sq"]),
    "qwen3-tiny": (tiny_qwen3, transformers.Qwen3ForCausalLM, (2, 16),
                   ["fp8", "nvfp4", "w4a16-nvfp4", "mxfp4", "int8-sq"]),
    "mistral-tiny": (tiny_mistral, transformers.MistralForCausalLM, (2, 16),
                     ["fp8", "nvfp4", "fp8-per-channel", "mxfp8", "int8-sq"]),
    # AWQ on experts: scales averaged over experts, then over gate/up (int4 needs width 128).
    # ModelOpt 0.47 fails on w4a8-awq for MoE ("Changing shape when setting amax").
    "qwen3-moe-awq-tiny": (tiny_qwen3_moe_awq, transformers.Qwen3MoeForCausalLM, (2, 16),
                           ["int4-awq"]),
    "mixtral-awq-tiny": (tiny_mixtral_awq, transformers.MixtralForCausalLM, (2, 16),
                         ["int4-awq"]),
    # ModelOpt 0.47 fails on int8-wo for these experts (a shape error in its exporter).
    "gpt-oss-tiny": (tiny_gpt_oss, transformers.GptOssForCausalLM, (2, 16),
                     ["fp8", "nvfp4", "w4a16-nvfp4", "fp8-per-channel", "mxfp8", "mxfp4", "fp8-block"]),
}

# Models that need transformers 5 (run the script a second time in a venv from
# requirements-tf5.txt): name → (constructor, class, calibration shape, formats, saver).
MODELS_TF5 = {
    "qwen3-moe-fused-tiny": (tiny_qwen3_moe_fused, "Qwen3MoeForCausalLM", (2, 16),
                             ["fp8", "nvfp4", "w4a16-nvfp4", "fp8-per-channel", "int8-wo", "mxfp8",
                              "mxfp4", "fp8-block"], save_in_memory_layout),
}


# --tf5-dumps (transformers 5): calibrate these committed per-expert checkpoints as transformers 5
# holds them in memory (fused experts: one input quantizer per projection, dumped as
# `<experts>.gate_up_proj_input_quantizer`, and Mixtral's `block_sparse_moe` as `mlp`) and export
# them; ModelOpt writes the hub names back. Output: `<model>/<format>-tf5/`.
TF5_DUMPS = {
    "mixtral-tiny": ["fp8", "nvfp4"],
    "qwen3-moe-tiny": ["fp8", "nvfp4"],
}


def calibration_ids(shape):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, shape, generator=g)


def main():
    print("modelopt", modelopt.__version__, "transformers", transformers.__version__, "torch", torch.__version__)
    # Optional arguments: regenerate only these models and/or formats. Each transformers major
    # version makes its own models (transformers 5 holds MoE experts fused).
    major = int(transformers.__version__.split(".")[0])
    tf4 = {k: (m, c, sh, f, None) for k, (m, c, sh, f) in MODELS.items()}
    tf5 = {k: (m, getattr(transformers, c), sh, f, save) for k, (m, c, sh, f, save) in MODELS_TF5.items()}
    if "--tf5-dumps" in sys.argv:
        assert major >= 5, "--tf5-dumps needs transformers 5"
        for model_name, formats in TF5_DUMPS.items():
            _, cls, calib_shape, _ = MODELS[model_name]
            export_model(HERE / model_name, None, cls, calibration_ids(calib_shape), formats,
                         suffix="-tf5")
        return
    # With --reuse-input the inputs already exist, so any transformers can export any model.
    models = {**tf4, **tf5} if REUSE_INPUT else tf5 if major >= 5 else tf4
    names = set(MODELS) | set(MODELS_TF5)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    only_models = {a for a in args if a in names}
    only = {a for a in args if a not in names}
    for model_name, (make, cls, calib_shape, formats, save) in models.items():
        if only_models and model_name not in only_models:
            continue
        formats = [f for f in formats if not only or f in only]
        export_model(HERE / model_name, make, cls, calibration_ids(calib_shape), formats, save)


def export_model(root, make, cls, ids, formats, save=None, suffix=""):
    reuse = REUSE_INPUT or bool(suffix)
    input_dir = root / "model"
    if input_dir.exists() and not reuse:
        shutil.rmtree(input_dir)
    load_dir = input_dir
    if reuse and input_dir.exists():
        pass
    elif save is None:
        make().save_pretrained(input_dir, safe_serialization=True)
    else:
        # kiln reads `save`'s layout; ModelOpt loads the same weights from transformers' own
        # (hub) layout, which it handles — in memory the two are the same model.
        model = make()
        save(model, input_dir)
        load_dir = root / ".hub-layout"
        if load_dir.exists():
            shutil.rmtree(load_dir)
        model.save_pretrained(load_dir, safe_serialization=True)
    # The calibration token ids, for kiln's calibration-agreement tests.
    (root / "calib.jsonl").write_text(
        "".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in ids))
    for name in formats:
        cfg = FORMATS[name]
        # Loaded from disk so config.torch_dtype is set (ModelOpt's MoE export needs it).
        model = cls.from_pretrained(load_dir, torch_dtype=torch.bfloat16).eval().to(DEVICE)

        def forward_loop(m):
            with torch.no_grad():
                for row in ids:
                    m(row[None, :].to(DEVICE))

        try:
            mtq.quantize(model, cfg, forward_loop)
        except Exception as e:  # e.g. NVFP4 AWQ on a machine without a GPU
            print(f"{root.name} {name}: ModelOpt failed to calibrate: {type(e).__name__}: {e}")
            continue
        amax = {}
        # Every per-tensor input / KV quantizer under its module name: `<linear>.input_quantizer`,
        # `<experts>.<param>_input_quantizer` (3-D experts), `<attention>.{k,v}_bmm_quantizer`.
        for q_name, q in model.named_modules():
            if name.endswith("-full") and q_name.endswith("weight_quantizer") \
                    and getattr(q, "amax", None) is not None:
                # The clipped block amax, row-major over [out, in / block].
                amax[q_name] = [float(v) for v in q.amax.float().flatten()]
            if not q_name.endswith(("input_quantizer", "k_bmm_quantizer", "v_bmm_quantizer")):
                continue
            if getattr(q, "amax", None) is not None and q.amax.numel() == 1:
                amax[q_name] = float(q.amax.float())
            # AWQ / SmoothQuant: the per-input-channel scale the weight was smoothed by.
            pqs = getattr(q, "_pre_quant_scale", None)
            if pqs is not None:
                amax[f"{q_name}._pre_quant_scale"] = [float(v) for v in pqs.float().flatten()]
        out = root / (name + suffix)
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
    if load_dir != input_dir:
        shutil.rmtree(load_dir)


if __name__ == "__main__":
    main()
