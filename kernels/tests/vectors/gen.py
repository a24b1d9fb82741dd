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
                          FORMATS.md's NVFP4 rule (searchsorted), implemented here in numpy
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
    """FORMATS.md: code = (x<0)<<3 | idx, idx = searchsorted(bounds, |x|) (+1 on .75, 1.75, 3.5)."""
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


if __name__ == "__main__":
    main()
