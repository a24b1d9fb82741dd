#!/usr/bin/env python3
"""Checks an MLX export kiln wrote against mlx-lm itself (mlx-lm 0.32.2 on MLX's CPU device).

Usage: check_export.py MODEL_DIR KILN_OUT FORMAT WORK_DIR

1. Runs `mlx_lm.convert -q` on MODEL_DIR with the same settings into WORK_DIR and compares
   every tensor (name, dtype, shape, values bit for bit) and config.json's `quantization`
   with kiln's output.
2. Loads kiln's output with `mlx_lm.load`, checks its logits on a token sequence against the
   unquantized model's (mlx-lm, float32), and generates a few tokens with `mlx_lm.generate`.
Exits non-zero naming the tensor, key or figure at fault.
"""
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

model, ours, fmt, work = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
FLAGS = {"mxfp4": ["--q-mode", "mxfp4"], "mxfp8": ["--q-mode", "mxfp8"], "nvfp4": ["--q-mode", "nvfp4"]}
if fmt in FLAGS:
    flags = FLAGS[fmt]
else:
    bits, _, g = fmt[1:].partition("-g")
    flags = ["--q-bits", bits, "--q-group-size", g or "64", "--q-mode", "affine"]
ref = work / f"mlx-lm-{model.name}-{fmt}"
# mlx-lm 0.32 reads transformers 4's config names; a transformers 5 config is given them (as
# kiln's writer adds them) in a copy before mlx-lm converts it.
cfg = json.loads((model / "config.json").read_text())
source = model
if "rope_theta" not in cfg and "rope_parameters" in cfg:
    import shutil
    source = work / f"tf4-names-{model.name}"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(model, source)
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    if cfg.get("model_type") == "qwen3_moe" and "num_experts" not in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    (source / "config.json").write_text(json.dumps(cfg))
    # ... and transformers 5's fused experts (gate_up_proj [E, 2I, H], down_proj [E, H, I])
    # are split into transformers 4's per-expert tensors, which mlx-lm stacks itself.
    for f in sorted(source.glob("*.safetensors")):
        w = mx.load(str(f))
        for k in [k for k in w if k.endswith("mlp.experts.gate_up_proj")]:
            head, v = k[: -len("gate_up_proj")], w.pop(k)
            i = v.shape[1] // 2
            for e in range(v.shape[0]):
                w[f"{head}{e}.gate_proj.weight"] = v[e, :i]
                w[f"{head}{e}.up_proj.weight"] = v[e, i:]
        for k in [k for k in w if k.endswith("mlp.experts.down_proj")]:
            head, v = k[: -len("down_proj")], w.pop(k)
            for e in range(v.shape[0]):
                w[f"{head}{e}.down_proj.weight"] = v[e]
        mx.save_safetensors(str(f), w, metadata={"format": "pt"})
r = subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(source),
                    "--mlx-path", str(ref), "-q", *flags], capture_output=True, text=True)
if r.returncode != 0:
    sys.exit(f"mlx_lm.convert failed:\n{r.stdout}{r.stderr}")

failures = []


def load_all(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


a, b = load_all(ref), load_all(ours)
for k in sorted(set(a) | set(b)):
    if k not in b:
        failures.append(f"{k}: mlx-lm wrote it, kiln did not")
    elif k not in a:
        failures.append(f"{k}: kiln wrote it, mlx-lm did not")
    elif a[k].dtype != b[k].dtype or a[k].shape != b[k].shape:
        failures.append(f"{k}: kiln {b[k].dtype}{b[k].shape}, mlx-lm {a[k].dtype}{a[k].shape}")
    elif not mx.array_equal(a[k], b[k], equal_nan=True).item():
        failures.append(f"{k}: values differ from mlx-lm's")
qa = json.loads((ref / "config.json").read_text())["quantization"]
qb = json.loads((ours / "config.json").read_text())
if qb.get("quantization") != qa:
    failures.append(f"config.json quantization: kiln {qb.get('quantization')}, mlx-lm {qa}")
if qb.get("quantization_config") != qa:
    failures.append("config.json quantization_config differs from quantization")

from mlx_lm import generate, load  # noqa: E402

qmodel, tok = load(str(ours))
fmodel, _ = load(str(source))
# MLX's CPU runs unquantized expert (gather) matmuls in float32 only: both models compute in
# float32 (scales and biases widen exactly).
fmodel.set_dtype(mx.float32)
qmodel.set_dtype(mx.float32)
cfg = json.loads((model / "config.json").read_text())
tokens = mx.array([[1] + [2 + (i * 37) % (cfg["vocab_size"] - 2) for i in range(31)]])
lq = np.array(qmodel(tokens).astype(mx.float32))
lf = np.array(fmodel(tokens))
d = np.abs(lq - lf)
# A random model's logits are small and its 4-bit error large, so closeness is measured as the
# correlation of the quantized logits with the float ones: a misplaced or mis-scaled tensor
# drops it towards 0.
corr = float(np.corrcoef(lq.ravel(), lf.ravel())[0, 1])
floor = {"q8": 0.99, "q8-g32": 0.99, "q8-g128": 0.99, "mxfp8": 0.99,
         "q2": 0.3, "q2-g32": 0.3, "q2-g128": 0.3}.get(fmt, 0.85)
if not corr >= floor:
    failures.append(f"logits: correlation {corr:.4f} with the float model's is below {floor}")
text = generate(qmodel, tok, prompt="hi", max_tokens=4, verbose=False)
if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"ok: {len(b)} tensors equal mlx-lm's; logits vs float: correlation {corr:.4f}, max |Δ| {d.max():.3e}, mean |Δ| {d.mean():.3e}; generated {text!r}")
