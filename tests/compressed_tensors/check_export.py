#!/usr/bin/env python3
"""Loads compressed-tensors exports kiln wrote with transformers + compressed-tensors (their
real consumer on the CPU) and checks their logits against kiln's decoded model.

Usage: check_export.py CASES_JSON

CASES_JSON is a list of {"out": export folder, "ids": [token ids], "weights": logits [T][V] of
kiln's model with the export's weights decoded and activations unquantized, "run": the same
with each Linear's input quantized as the export declares (kiln eval's model)}. For each case:

1. `AutoModelForCausalLM.from_pretrained(out, quantization_config=CompressedTensorsConfig(
   dequantize=True))`: transformers' compressed-tensors quantizer builds the declared scheme,
   loads the compressed tensors and decompresses them. Every Linear the export quantized must
   carry its scheme, every Linear in `quantization_config.ignore` none.
2. With compressed-tensors' activation quantization switched off, its float32 logits agree
   with kiln's weights-only logits: correlation > 0.99999, max |Δ| ≤ 1e-2 · max |logit|.
   (compressed-tensors decompresses into bf16, kiln into f32: that rounding is the gap.)
3. As compressed-tensors runs the model — each Linear's input quantized (FP8 per token or per
   tensor, INT8 per token, NVFP4) — its logits agree with kiln's: correlation > 0.995. The
   bf16-rounded weights move a few activations across an FP8 / FP4 rounding boundary, so the
   bound is looser than step 2's.
Exits non-zero naming the case and the figure at fault.
"""
import json
import sys

import numpy as np
import torch
import transformers

cases = json.loads(open(sys.argv[1]).read())
failed = []
for case in cases:
    out = case["out"]
    # The decompressed weights come back in the model's dtype (bf16); the comparison runs in
    # f32 (transformers refuses `.float()` on a quantized model: torch's own cast is used).
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)
    )
    torch.nn.Module.float(model)
    model.eval()
    config = json.loads(open(f"{out}/config.json").read())["quantization_config"]
    ignore = set(config["ignore"])
    schemes = {
        name: getattr(m, "quantization_scheme", None)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    for name, scheme in schemes.items():
        if name in ignore and scheme is not None:
            failed.append(f"{out}: `{name}` is ignored but carries a quantization scheme")
        if name not in ignore and scheme is None:
            failed.append(f"{out}: `{name}` is quantized in the export but transformers loaded it plain")
    ids = torch.tensor([case["ids"]])

    def logits(quantize):
        for m in model.modules():
            m.quantization_enabled = quantize
        with torch.no_grad():
            return model(ids).logits[0].float().numpy()

    for what, quantize, key, min_corr, max_rel in [
        ("weights only", False, "weights", 0.99999, 1e-2),
        ("as run", True, "run", 0.995, None),
    ]:
        theirs, ours = logits(quantize), np.array(case[key], dtype=np.float32)
        if theirs.shape != ours.shape:
            failed.append(f"{out}: logits {theirs.shape} from transformers, {ours.shape} from kiln")
            continue
        corr = np.corrcoef(theirs.ravel(), ours.ravel())[0, 1]
        diff = float(np.abs(theirs - ours).max())
        scale = float(np.abs(ours).max())
        print(f"{out} ({what}): correlation {corr:.7f}, max |Δ| {diff:.3e} (max |logit| {scale:.3f})")
        if not (corr > min_corr and (max_rel is None or diff <= max_rel * scale)):
            failed.append(f"{out} ({what}): logits disagree (correlation {corr:.7f}, max |Δ| {diff:.3e})")
if failed:
    sys.exit("\n".join(failed))
print(f"transformers {transformers.__version__} loaded {len(cases)} export(s)")
