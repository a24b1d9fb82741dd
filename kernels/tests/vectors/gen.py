#!/usr/bin/env python3
"""Writes the reference vectors kiln-kernels' tests compare against, bit for bit.

    pip install -r requirements.txt && python3 gen.py

Outputs (all committed, all small):
  bf16_to_e4m3fn.bin      65,536 bytes: every bf16 bit pattern (index = pattern) cast to float8_e4m3fn (ml_dtypes)
  bf16_to_e5m2.bin        65,536 bytes: the same, to float8_e5m2
  bf16_to_e4m3fn_sat.bin  65,536 bytes: clip to ±448 first (NaN stays NaN), then cast
  e4m3fn_to_f32.bin       256 little-endian f32: every E4M3FN byte decoded (ml_dtypes)
  e5m2_to_f32.bin         256 little-endian f32: every E5M2 byte decoded
  e2m1_sweep.bin          f32 inputs then u8 codes: a dense sweep of [-7, 7] with every tie, under
                          docs/FORMATS.md's NVFP4 rule (searchsorted), implemented here in numpy
  quant_cases.json        every quantizer on random and adversarial tensors, computed by this
                          script's own PyTorch implementation of docs/FORMATS.md (hex-encoded bytes)
"""
import pathlib

import ml_dtypes
import numpy as np

OUT = pathlib.Path(__file__).resolve().parent


def every_bf16() -> np.ndarray:
    return np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)


def write(name: str, data: np.ndarray) -> None:
    (OUT / name).write_bytes(data.tobytes())
    print(f"{name}: {data.nbytes} bytes")


def e2m1_nvfp4(x: np.ndarray) -> np.ndarray:
    """docs/FORMATS.md: code = (x<0)<<3 | idx, idx = searchsorted(bounds, |x|) (+1 on .75, 1.75, 3.5)."""
    bounds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    a = np.abs(x)
    idx = np.searchsorted(bounds, a, side="left")
    idx = idx + np.isin(a, np.array([0.75, 1.75, 3.5], dtype=np.float32))
    return ((x < 0).astype(np.uint8) << 3) | idx.astype(np.uint8)


def main() -> None:
    bf = every_bf16()
    f32 = bf.astype(np.float32)
    write("bf16_to_e4m3fn.bin", bf.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    write("bf16_to_e5m2.bin", bf.astype(ml_dtypes.float8_e5m2).view(np.uint8))
    clipped = np.where(np.isnan(f32), f32, np.clip(f32, -448.0, 448.0)).astype(np.float32)
    write("bf16_to_e4m3fn_sat.bin", clipped.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    codes = np.arange(256, dtype=np.uint8)
    write("e4m3fn_to_f32.bin", codes.view(ml_dtypes.float8_e4m3fn).astype("<f4"))
    write("e5m2_to_f32.bin", codes.view(ml_dtypes.float8_e5m2).astype("<f4"))

    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    near = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, 10)]).astype(np.float32)
    grid = np.linspace(0.0, 7.0, 2801, dtype=np.float32)
    sweep = np.concatenate([near, grid, [0.0, 1e30, np.float32(1e-40)]]).astype(np.float32)
    sweep = np.concatenate([sweep, -sweep]).astype("<f4")
    sweep = np.concatenate([sweep, np.array([-0.0], dtype="<f4")])
    write("e2m1_sweep.bin", np.concatenate([sweep.view(np.uint8), e2m1_nvfp4(sweep)]))


# ---- quantizers, in PyTorch, as docs/FORMATS.md and ModelOpt's dtype rules define them ----

def quant_cases() -> None:
    import json

    import torch

    torch.manual_seed(0)
    bf16, f8 = torch.bfloat16, torch.float8_e4m3fn
    shape = (8, 256)

    def hexs(t: torch.Tensor) -> str:
        if t.dtype == f8:
            # kiln writes every E4M3 NaN as 0x7F (PyTorch's CPU path writes 0xFF, CUDA 0x7F).
            b = t.contiguous().view(torch.uint8).clone()
            b[b == 0xFF] = 0x7F
            return b.numpy().tobytes().hex()
        return t.contiguous().view(torch.uint8).numpy().tobytes().hex()

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    inputs = {
        "random": torch.randn(shape) * 0.05,
        "heavy_tailed": torch.randn(shape) ** 3,
        "zeros": torch.zeros(shape),
        "all_equal": torch.full(shape, 0.3),
        # every block has max 6 and the E2M1 ties, so NVFP4 quotients land on the ties exactly
        "ties": (ties.repeat(shape[0] * shape[1] // 8) * torch.tensor([1.0, -1.0]).repeat(shape[0] * shape[1] // 2)).view(shape),
        "outlier": (torch.randn(shape) * 0.01).index_put_((torch.tensor([3]), torch.tensor([77])), torch.tensor(1e30)),
        "subnormal": torch.randn(shape) * 1e-39,
        "inf": (torch.randn(shape)).index_put_((torch.tensor([1, 6]), torch.tensor([5, 200])), torch.tensor([float("inf"), -float("inf")])),
        "nan": (torch.randn(shape)).index_put_((torch.tensor([2]), torch.tensor([33])), torch.tensor(float("nan"))),
    }
    cases = {name: t.to(bf16) for name, t in inputs.items()}
    cases["random_f16"] = (torch.randn(shape) * 0.05).to(torch.float16)
    cases["random_f32"] = torch.randn(shape) * 0.05
    tiles_input = (torch.randn(136, 200) * 0.1).to(bf16)
    finite = lambda name: name not in ("inf", "nan")

    results = []

    def add(op, case, outputs, **params):
        results.append({"op": op, "case": case, "params": params, "outputs": {k: hexs(v) for k, v in outputs.items()}})

    for name, w in cases.items():
        amax = w.abs().amax().float()
        # FP8 per tensor: the 2-D quotient stays in the weight's dtype (0-d f32 divisor).
        s = amax / 448.0
        add("fp8_per_tensor", name, {"q": (w / s).to(f8), "scale": s.reshape(1)})
        # FP8 stacked [2, 4, 256]: a 1-D divisor promotes to f32.
        w3 = w.view(2, 4, 256)
        s3 = w3.abs().amax(dim=(1, 2)).float() / 448.0
        add("fp8_stacked", name, {"q": (w3 / s3[:, None, None]).to(f8), "scales": s3})
        # FP8 per channel.
        sc = w.abs().amax(dim=1).float() / 448.0
        add("fp8_per_channel", name, {"q": (w / sc[:, None]).to(f8), "scales": sc})
        if finite(name):
            # INT8 per channel, INT4 groups of 128 (NaN → int is undefined in PyTorch).
            si = w.abs().amax(dim=1).float() / 127.0
            q8 = torch.clamp(torch.round(w.float() / si[:, None]), -128, 127).to(torch.int8)
            add("int8_per_channel", name, {"q": q8, "scales": si})
            g = w.float().view(8, 2, 128)
            s4 = g.abs().amax(dim=-1) / 7.0
            q4 = torch.clamp(torch.round(g / s4[..., None]), -8, 7).to(torch.int8).view(8, 256)
            packed = (q4[0::2] & 0xF) | ((q4[1::2] & 0xF) << 4)
            add("int4_groups", name, {"q": packed.to(torch.uint8), "scales": s4}, group=128)
        # NVFP4 (all f32).
        ws2 = amax / (6.0 * 448.0)
        blocks = w.float().view(8, 16, 16)
        bmax = blocks.abs().amax(dim=-1)
        sb = bmax / (6.0 * ws2)
        sb[sb == 0] = 1.0
        ws = torch.clamp(sb, 2**-9, 448).to(f8)
        ws_bytes = ws.view(torch.uint8).clone()
        ws_bytes[torch.isnan(ws.float())] = 0x7F  # kiln writes NaN scales as 0x7F on every machine
        x = blocks / (ws.float() * ws2)[..., None]
        codes = e2m1_torch(x.view(8, 256))
        packed = (codes[:, 1::2] << 4) | codes[:, 0::2]
        deq = E2M1_TABLE[codes.long()] * (ws.float() * ws2).repeat_interleave(16, dim=1)
        add("nvfp4", name, {"q": packed, "scales": ws_bytes, "deq": deq, "ws2": ws2.reshape(1)})
        # NVFP4, BMM-experts layout [2, 32, 32]: transpose, quantize along the last dim, back.
        wt = w.view(2, 32, 32).transpose(1, 2).float().reshape(2, 32, 2, 16)
        bmt = wt.abs().amax(dim=-1)
        st = bmt / (6.0 * ws2)
        st[st == 0] = 1.0
        wst = torch.clamp(st, 2**-9, 448).to(f8)
        wst_bytes = wst.view(torch.uint8).clone()
        wst_bytes[torch.isnan(wst.float())] = 0x7F
        ct = e2m1_torch((wt / (wst.float() * ws2)[..., None]).reshape(2, 32, 32))  # [E, cols, rows]
        pt = (ct[..., 1::2] << 4) | ct[..., 0::2]  # pairs along rows
        add("nvfp4_transposed", name, {"q": pt.transpose(1, 2), "scales": wst_bytes.reshape(2, 32, 2).transpose(1, 2), "ws2": ws2.reshape(1)})
        if finite(name):
            # MXFP4: ModelOpt 0.47's arithmetic: the block amax in f32, so f32 throughout.
            v = w.view(-1, 32)
            descale = v.float().abs().max(dim=-1, keepdim=True).values / 6.0
            e = torch.ceil(torch.maximum(torch.log2(descale), torch.tensor(-127.0)))
            xm = (v / torch.exp2(e)).view(shape)
            sign_bit = (2 - torch.sign(xm)) // 2
            ord_ = torch.sum((xm.abs().unsqueeze(-1) - torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5])) > 0, dim=-1)
            c4 = (sign_bit * 8 + ord_).to(torch.uint8)
            add("mxfp4", name, {"q": (c4[:, 1::2] << 4) | c4[:, 0::2], "scales": (e + 127).to(torch.uint8).view(8, 8)})
        # MXFP8: f32 exponent, f32 product.
        am = w.view(8, 8, 32).abs().amax(dim=-1)
        d = am.float() / 448.0
        ex = torch.clamp(torch.ceil(torch.where(d > 0, torch.log2(d), torch.tensor(-127.0))), -127, 127)
        byte = (ex + 127).to(torch.uint8)
        scaled = torch.clamp(w.view(8, 8, 32) * torch.exp2(127 - byte.float())[..., None], -448, 448)
        add("mxfp8", name, {"q": scaled.to(f8).view(shape), "scales": byte})

    # FP8 128×128 tiles with partial edge tiles: pad, reduce, divide, crop.
    t = tiles_input.float()
    padded = torch.nn.functional.pad(t, (0, 256 - 200, 0, 256 - 136))
    tmax = padded.view(2, 128, 2, 128).abs().amax(dim=(1, 3))
    st = tmax / 448.0
    full = st.repeat_interleave(128, 0).repeat_interleave(128, 1)[:136, :200]
    cases["tiles"] = tiles_input
    add("fp8_tiles", "tiles", {"q": (t / full).to(f8), "scales": st}, tile=128)

    doc = {
        "inputs": {n: {"dtype": str(w.dtype).removeprefix("torch."), "shape": list(w.shape), "hex": hexs(w)} for n, w in cases.items()},
        "results": results,
    }
    text = json.dumps(doc, indent=0, allow_nan=False)
    (OUT / "quant_cases.json").write_text(text)
    print(f"quant_cases.json: {len(results)} results, {len(text)} bytes")


E2M1_TABLE = None


def e2m1_torch(x):
    """docs/FORMATS.md's NVFP4 E2M1 rule, in torch: (x<0)<<3 | searchsorted(bounds, |x|) (+1 on ties)."""
    import torch

    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    a = x.abs()
    idx = torch.searchsorted(bounds, a.contiguous(), out_int32=True).to(torch.uint8)
    idx = idx + torch.any(a.unsqueeze(-1) == bounds[[1, 3, 5]], dim=-1).to(torch.uint8)
    return ((x < 0).to(torch.uint8) << 3) | idx


if __name__ == "__main__":
    import torch

    E2M1_TABLE = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    main()
    quant_cases()
