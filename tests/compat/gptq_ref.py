#!/usr/bin/env python3
"""llm-compressor references for kiln's group sizes, W8A16 and GPTQ (tests/it/gptq.rs).

For the committed tiny Llama (tests/compat/llama-tiny/model, bf16), llm-compressor 0.14 writes:

    tests/compat/llama-tiny/ct-<case>/llmcompressor/     round to nearest (`QuantizationModifier`)
    tests/compat/llama-tiny/gptq-<case>/llmcompressor/   `GPTQModifier` (block 128, dampening 0.01),
                                                         calibrated on calib-32x64.jsonl, each row
                                                         its own sample, the sequential pipeline

for the cases below: W4A16 with groups of 128, 64 and 32, W4A16_ASYM, W8A16 (groups of 128) and
W8A16 in groups of 32; GPTQ with llm-compressor's default activation ordering (`static`) and without,
and GPTQ of NVFP4A16.
kiln must write the same integer codes (≥ 99 %) and scales (within 1 %) from the same ids:

    python3 -m venv .venv-llmc && .venv-llmc/bin/pip install -r tests/compat/requirements-llmc.txt
    .venv-llmc/bin/python tests/compat/gptq_ref.py [CASE ...]   # all by default

Runs on the CPU in about a minute.
"""
import json
import pathlib
import shutil
import sys

import torch
import transformers
from compressed_tensors.quantization import preset_name_to_scheme
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier

HERE = pathlib.Path(__file__).resolve().parent
MODEL = "llama-tiny"
IGNORE = ["lm_head"]

# ct-<case>: round to nearest, case -> (preset, group size or None for the preset's)
RTN = {
    "w4a16-g64": ("W4A16", 64),
    "w4a16-g32": ("W4A16", 32),
    "w4a16-asym-g64": ("W4A16_ASYM", 64),
    "w8a16": ("W8A16", None),
    "w8a16-g32": ("W8A16", 32),
}
# gptq-<case>: GPTQ, case -> (preset, group size, actorder)
GPTQ = {
    "w4a16": ("W4A16", None, "static"),
    "w4a16-g64": ("W4A16", 64, "static"),
    "w4a16-noorder": ("W4A16", None, None),
    "w4a16-asym": ("W4A16_ASYM", None, "static"),
    "w8a16": ("W8A16", None, "static"),
    # The model loaded in f32 (its bf16 weights widened): no bf16 rounding in the forward
    # pass, so kiln's and PyTorch's activations agree to f32 rounding.
    "f32-w4a16": ("W4A16", None, "static"),
    "f32-w4a16-asym": ("W4A16_ASYM", None, "static"),
    "f32-w8a16-g64": ("W8A16", 64, "static"),
    # NVFP4A16 (TENSOR_GROUP: FP8 group scales under a global scale shared by q/k/v and
    # gate/up), GPTQ choosing its E2M1 codes.
    "nvfp4a16": ("NVFP4A16", None, "static"),
    "f32-nvfp4a16": ("NVFP4A16", None, "static"),
}


def scheme(preset, group):
    s = preset_name_to_scheme(preset, ["Linear"])
    if group is not None:
        s.weights.strategy = "group"
        s.weights.group_size = group
    return s


def tokenizer(vocab_size):
    """A word-level tokenizer over the model's ids (oneshot wants one beside a dataset)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t0")


def calibration():
    """32 rows of 64 token ids, seeded: tests/compat/llama-tiny/calib-32x64.jsonl. GPTQ needs
    more tokens than the widest input (256) for a well-conditioned Hessian; with fewer, its
    choices turn on float rounding and no two implementations agree."""
    import random

    vocab = json.loads((HERE / MODEL / "model" / "config.json").read_text())["vocab_size"]
    rnd = random.Random(11)
    rows = [[rnd.randrange(vocab) for _ in range(64)] for _ in range(32)]
    path = HERE / MODEL / "calib-32x64.jsonl"
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    rows = [{"input_ids": r} for r in rows]
    return Dataset.from_list(
        [{"input_ids": r["input_ids"], "attention_mask": [1] * len(r["input_ids"])} for r in rows]
    )


def run(name, gptq):
    preset, group, actorder = GPTQ[name] if gptq else (*RTN[name], None)
    dst = HERE / MODEL / (f"gptq-{name}" if gptq else f"ct-{name}")
    dtype = torch.float32 if name.startswith("f32-") else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(HERE / MODEL / "model", dtype=dtype)
    groups = {"group_0": scheme(preset, group)}
    if dst.exists():
        shutil.rmtree(dst)
    args = dict(model=model, output_dir=str(dst / "llmcompressor"))
    if gptq:
        args["recipe"] = GPTQModifier(
            config_groups=groups, ignore=IGNORE, block_size=128, dampening_frac=0.01, actorder=actorder
        )
        ds = calibration()
        args.update(
            dataset=ds,
            tokenizer=tokenizer(model.config.vocab_size),
            num_calibration_samples=len(ds),
            shuffle_calibration_samples=False,
            batch_size=1,
            pipeline="sequential",
        )
    else:
        args["recipe"] = QuantizationModifier(config_groups=groups, ignore=IGNORE)
    oneshot(**args)
    for junk in ("recipe.yaml", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (dst / "llmcompressor" / junk).unlink(missing_ok=True)
    print(f"{dst.name}: {sorted(p.name for p in (dst / 'llmcompressor').iterdir())}")


def main(argv):
    for name in RTN:
        if not argv or f"ct-{name}" in argv:
            run(name, gptq=False)
    for name in GPTQ:
        if not argv or f"gptq-{name}" in argv:
            run(name, gptq=True)


if __name__ == "__main__":
    main(sys.argv[1:])
