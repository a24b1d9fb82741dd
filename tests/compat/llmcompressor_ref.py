#!/usr/bin/env python3
"""llm-compressor reference exports for kiln's compressed-tensors writer (tests/it/compressed_tensors.rs).

Quantizes the committed tiny models (tests/compat/<model>/model, bf16) with llm-compressor's
`QuantizationModifier` (round-to-nearest, no GPTQ) for each scheme kiln's compressed-tensors
writer implements, and saves them compressed. Schemes with static activation scales (FP8, NVFP4,
the FP8 KV cache) are calibrated on the model's committed token ids (calib.jsonl); the amax each
of llm-compressor's activation observers saw is dumped beside the export in kiln's `--act-amax`
format, so kiln is given the same statistics (the calibration itself is not what is compared).
Everything it writes is small and committed:

    tests/compat/<model>/ct-<scheme>/amax.json         what the observers saw (static schemes)
    tests/compat/<model>/ct-<scheme>/llmcompressor/    llm-compressor's export

    python3 -m venv .venv-llmc && .venv-llmc/bin/pip install -r tests/compat/requirements-llmc.txt
    .venv-llmc/bin/python tests/compat/llmcompressor_ref.py [MODEL ...] [SCHEME ...]   # all by default
    .venv-llmc/bin/python tests/compat/llmcompressor_ref.py --self-calibrated [MODEL ...]  # ct-calib-*

Runs on the CPU (seconds per scheme).
"""
import json
import pathlib
import shutil
import sys

import torch
import transformers
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.observers.base import Observer

HERE = pathlib.Path(__file__).resolve().parent

# kiln's --format name -> (llm-compressor preset, calibrated?, FP8 KV cache?)
SCHEMES = {
    "fp8-dynamic": ("FP8_DYNAMIC", False, False),
    "fp8": ("FP8", True, False),
    "fp8-block": ("FP8_BLOCK", False, False),
    "w8a8": ("W8A8", False, False),
    "w4a16": ("W4A16", False, False),
    "w4a16-asym": ("W4A16_ASYM", False, False),
    "nvfp4a16": ("NVFP4A16", False, False),
    "nvfp4": ("NVFP4", True, False),
    "fp8+kv-fp8": ("FP8", True, True),
}
# Group-128 schemes need input features that are whole groups: only llama-tiny has them.
MODELS = {
    "llama-tiny": list(SCHEMES),
    "qwen3-moe-tiny": ["fp8-dynamic", "fp8", "w8a8", "nvfp4a16", "nvfp4"],
    # tie_word_embeddings: llm-compressor lists the tied lm_head in `ignore`.
    "llama-tied-tiny": ["fp8", "nvfp4"],
}
IGNORE = ["lm_head", "re:.*mlp.gate$"]

SEEN = {}


def record_observers(model):
    """Every activation observer's min/max, keyed by kiln's --act-amax names, as the observer
    computes its scale (the observers are deleted after calibration)."""
    original = Observer.get_qparams

    def get_qparams(self):
        if not self.is_weight_obs and self.has_statistics:
            for name, module in model.named_modules():
                for attr, value in vars(module).get("_modules", {}).items():
                    if value is self:
                        amax = torch.max(self.min_vals.abs().max(), self.max_vals.abs().max())
                        SEEN[(name, self.base_name)] = amax.float().item()
        return original(self)

    Observer.get_qparams = get_qparams


def amax_json():
    out = {}
    for (module, base), amax in sorted(SEEN.items()):
        if base == "input":
            out[f"{module}.input_quantizer"] = amax
        elif base in ("k", "v"):
            out[f"{module}.{base}_bmm_quantizer"] = amax
        else:
            raise SystemExit(f"unexpected observer {module}.{base}")
    return out


def tokenizer(vocab_size):
    """A word-level tokenizer over the model's ids: oneshot wants a processor beside a dataset,
    and the committed calibration data is token ids already."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t0")


def calibration(model_dir):
    rows = [json.loads(l) for l in (model_dir / "calib.jsonl").read_text().splitlines() if l]
    return Dataset.from_list(
        [{"input_ids": r["input_ids"], "attention_mask": [1] * len(r["input_ids"])} for r in rows]
    )


def make_recipe(preset, kv):
    """llm-compressor's round-to-nearest recipe for `preset`, with an FP8 KV cache if `kv`."""
    kwargs = {}
    if kv:
        kwargs["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
        }
    return QuantizationModifier(targets="Linear", scheme=preset, ignore=IGNORE, **kwargs)


def export(model_name, scheme):
    preset, calibrated, kv = SCHEMES[scheme]
    src = HERE / model_name / "model"
    dst = HERE / model_name / f"ct-{scheme}"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    SEEN.clear()
    record_observers(model)
    recipe = make_recipe(preset, kv)
    if dst.exists():
        shutil.rmtree(dst)
    args = dict(model=model, recipe=recipe, output_dir=str(dst / "llmcompressor"))
    if calibrated:
        ds = calibration(HERE / model_name)
        args.update(
            dataset=ds,
            tokenizer=tokenizer(model.config.vocab_size),
            num_calibration_samples=len(ds),
            shuffle_calibration_samples=False,
        )
    oneshot(**args)
    if calibrated:
        (dst / "amax.json").write_text(json.dumps(amax_json(), indent=1, sort_keys=True) + "\n")
    for junk in ("recipe.yaml", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / "llmcompressor" / junk).unlink(missing_ok=True)
    print(f"{model_name}/{scheme}: {sorted(p.name for p in (dst / 'llmcompressor').iterdir())}")


# Self-calibration references (tests/it/compressed_tensors.rs `self_calibrated_scales_*`): kiln runs
# its own --calib on the same ids and its static scales must be within 1 % of these.
SELF_CALIBRATED = {
    "llama-tiny": ["fp8", "nvfp4", "fp8+kv-fp8"],
    "llama-tied-tiny": ["fp8", "nvfp4"],
    "qwen3-moe-tiny": ["fp8", "nvfp4"],
}


def calib_ids(model_name):
    """8 rows of 32 token ids, seeded: tests/compat/<model>/calib-8x32.jsonl."""
    import random

    vocab = json.loads((HERE / model_name / "model" / "config.json").read_text())["vocab_size"]
    rnd = random.Random(7)
    rows = [[rnd.randrange(vocab) for _ in range(32)] for _ in range(8)]
    path = HERE / model_name / "calib-8x32.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return Dataset.from_list([{"input_ids": r, "attention_mask": [1] * len(r)} for r in rows])


def self_calibrated(model_name, scheme):
    """llm-compressor calibrating on calib-8x32.jsonl itself, each row its own batch of one
    (`oneshot(batch_size=1)`, its default), saved to ct-calib-<scheme>/llmcompressor."""
    preset, _, kv = SCHEMES[scheme]
    src = HERE / model_name / "model"
    dst = HERE / model_name / f"ct-calib-{scheme}"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    recipe = make_recipe(preset, kv)
    if dst.exists():
        shutil.rmtree(dst)
    ds = calib_ids(model_name)
    SEEN.clear()
    record_observers(model)
    # The sequential pipeline (llm-compressor's default) drops Qwen3-MoE's causal mask: its
    # decoder layers get attention_mask=None and run eager attention, so every token attends
    # to the whole row (o_proj's observed amax is half the causal forward's; transformers'
    # own forward with a zero 4-D mask gives llm-compressor's figure). kiln calibrates with
    # the causal attention the model is served with, so the MoE reference comes from the
    # basic pipeline, which keeps the mask; the dense models use the default.
    pipeline = "basic" if model_name.startswith("qwen3-moe") else "independent"
    oneshot(model=model, recipe=recipe, output_dir=str(dst / "llmcompressor"), dataset=ds,
            tokenizer=tokenizer(model.config.vocab_size), num_calibration_samples=len(ds),
            shuffle_calibration_samples=False, batch_size=1, pipeline=pipeline)
    (dst / "amax.json").write_text(json.dumps(amax_json(), indent=1, sort_keys=True) + "\n")
    for junk in ("recipe.yaml", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / "llmcompressor" / junk).unlink(missing_ok=True)
    print(f"{model_name}/calib-{scheme}: {sorted(p.name for p in (dst / 'llmcompressor').iterdir())}")


def main(argv):
    if argv and argv[0] == "--self-calibrated":
        models = [a for a in argv[1:] if a in SELF_CALIBRATED] or list(SELF_CALIBRATED)
        for m in models:
            for s in SELF_CALIBRATED[m]:
                self_calibrated(m, s)
        return
    models = [a for a in argv if a in MODELS] or list(MODELS)
    schemes = [a for a in argv if a in SCHEMES]
    for m in models:
        for s in MODELS[m]:
            if not schemes or s in schemes:
                export(m, s)


if __name__ == "__main__":
    main(sys.argv[1:])
