"""MLX's own quantize (mlx-cpu 0.32.2, CPU device) on random and adversarial inputs, written to
mlx_cases.json for kernels/tests/mlx_vectors.rs, which checks kiln's readable reference
(kiln_kernels::ops::mlx) against every output byte.

    pip install mlx-cpu==0.32.2 numpy ml_dtypes   # mlx_requirements.txt
    python kernels/tests/vectors/mlx_gen.py

Inputs exclude NaN and Inf, where MLX's result is undefined (a float→int cast of NaN).
"""

import json
import pathlib

import ml_dtypes
import mlx.core as mx
import numpy as np

mx.set_default_device(mx.cpu)
OUT = pathlib.Path(__file__).with_name("mlx_cases.json")
DTYPES = {"F32": (np.float32, mx.float32), "BF16": (ml_dtypes.bfloat16, mx.bfloat16),
          "F16": (np.float16, mx.float16)}
TIES = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)


def inputs(rng, rows=4, cols=128):
    """(name, f32 matrix) pairs, before rounding to the case's dtype."""
    yield "normal", rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    for p in (-20, -6, 0, 6):
        yield f"wide-{p}", (rng.standard_normal((rows, cols)) * 10.0 ** rng.uniform(-2, 2, (rows, 1))
                            * 2.0 ** p).astype(np.float32)
    t = rng.standard_normal((rows, cols)).astype(np.float32)
    # Exact E2M1 ties in every 16-element group whose largest magnitude is 6 · 2^k: the scale
    # is a power of two, so the ties survive the division.
    for g in range(0, cols, 16):
        k = np.float32(2.0 ** rng.integers(-3, 3))
        t[:, g:g + 8] = TIES * k * np.where(rng.random(8) < 0.5, -1, 1)
        t[:, g + 8:g + 16] = rng.uniform(-5, 5, (rows, 8)) * k
    yield "ties", t
    z = rng.standard_normal((rows, cols)).astype(np.float32)
    z[0, :] = 0.0
    z[1, :64] = -0.0
    z[2, 5] = 1e4
    z[3, :] = rng.standard_normal(cols) * 1e-39  # subnormal in f32
    yield "zeros-outlier-subnormal", z
    # Largest magnitudes a few ulps either side of 6 · 2^k and 448 · 2^k: where an exponent
    # computed through a rounded log2 would differ from MLX's exact ceiling.
    n = rng.uniform(-1, 1, (rows, cols)).astype(np.float32)
    for g in range(0, cols, 16):
        top = np.float32(rng.choice([6.0, 448.0]) * 2.0 ** rng.integers(-20, 20))
        bits = top.view(np.uint32) + np.uint32(rng.integers(0, 4)) - np.uint32(rng.integers(0, 3))
        n[:, g] = bits.view(np.float32)
        n[:, g + 1:g + 16] *= np.abs(n[:, g:g + 1])
    yield "near-powers", n
    c = np.full((rows, cols), 0.3, np.float32)
    c[1] = -0.3
    yield "constant", c


def hexes(a):
    return np.ascontiguousarray(a).tobytes().hex()


def main():
    rng = np.random.default_rng(20261201)
    cases = []
    for name, w32 in inputs(rng):
        for dname, (npt, _) in DTYPES.items():
            w = w32.astype(npt)
            wm = mx.array(w)
            amax = float(np.abs(w.astype(np.float32)).max())
            for mode in ("mxfp4", "mxfp8", "nvfp4"):
                for gs in ([None, amax] if mode == "nvfp4" else [None]):
                    if gs is not None and amax == 0:
                        continue
                    kw = {} if gs is None else {"global_scale": mx.array(np.float32(gs))}
                    q, s = mx.quantize(wm, mode=mode, **kw)
                    cases.append({"input": name, "dtype": dname, "mode": mode,
                                  "shape": list(w.shape), "global_amax": gs, "w": hexes(w),
                                  "q": hexes(np.array(q)), "scales": hexes(np.array(s))})
            for bits in (2, 4, 8):
                for group in (32, 64, 128):
                    q, s, b = mx.quantize(wm, group_size=group, bits=bits, mode="affine")
                    cases.append({"input": name, "dtype": dname, "mode": "affine", "bits": bits,
                                  "group": group, "shape": list(w.shape), "w": hexes(w),
                                  "q": hexes(np.array(q)),
                                  "scales": hexes(np.array(s.view(mx.uint16) if dname != "F32" else s)),
                                  "biases": hexes(np.array(b.view(mx.uint16) if dname != "F32" else b))})
    OUT.write_text(json.dumps({"mlx": mx.__version__, "cases": cases}, indent=0))
    print(f"{len(cases)} cases → {OUT}")


if __name__ == "__main__":
    main()
