#!/usr/bin/env python3
"""llm-compressor reference exports for kiln's compressed-tensors writer (tests/compressed_tensors.rs).

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


def export(model_name, scheme):
    preset, calibrated, kv = SCHEMES[scheme]
    src = HERE / model_name / "model"
    dst = HERE / model_name / f"ct-{scheme}"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    SEEN.clear()
    record_observers(model)
    kwargs = {}
    if kv:
        kwargs["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
        }
    recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=IGNORE, **kwargs)
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


def main(argv):
    models = [a for a in argv if a in MODELS] or list(MODELS)
    schemes = [a for a in argv if a in SCHEMES]
    for m in models:
        for s in MODELS[m]:
            if not schemes or s in schemes:
                export(m, s)


if __name__ == "__main__":
    main(sys.argv[1:])
