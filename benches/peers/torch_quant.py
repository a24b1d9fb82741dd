#!/usr/bin/env python3
"""PyTorch on the CPU as the peer of `cargo bench -p kiln-kernels`: the same operations on the
same sizes (bf16 weights), written as ModelOpt / docs/FORMATS.md compute them, timed the same way
(bytes read + written per second, mean of repeated runs after a warm-up).

    pip install -r ../../kernels/tests/vectors/requirements.txt
    python3 benches/peers/torch_quant.py [--sizes 4096,8192] [--json out.json]
"""
import argparse
import json
import time

import torch

F8 = torch.float8_e4m3fn
BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def e2m1(x):
    a = x.abs()
    idx = torch.searchsorted(BOUNDS, a.contiguous(), out_int32=True).to(torch.uint8)
    idx = idx + torch.any(a.unsqueeze(-1) == BOUNDS[[1, 3, 5]], dim=-1).to(torch.uint8)
    return ((x < 0).to(torch.uint8) << 3) | idx


def ops(w):
    rows, cols = w.shape
    amax = w.abs().amax().float()
    row_amax = w.abs().amax(dim=1).float()
    s = amax / 448.0
    ws2 = amax / 2688.0

    def fp8_per_tensor():
        return (w / s).to(F8)

    def fp8_per_channel():
        return (w / (row_amax / 448.0)[:, None]).to(F8)

    # Scales that kiln's benchmark receives precomputed are precomputed here too.
    tile_scales = w.float().view(rows // 128, 128, cols // 128, 128).abs().amax(dim=(1, 3), keepdim=True) / 448.0
    group_scales = w.float().view(rows, cols // 128, 128).abs().amax(dim=-1, keepdim=True) / 7.0

    def fp8_block128():
        return (w.float().view(rows // 128, 128, cols // 128, 128) / tile_scales).to(F8)

    def int8_per_channel():
        return torch.clamp(torch.round(w.float() / (row_amax / 127.0)[:, None]), -128, 127).to(torch.int8)

    def int4_g128():
        g = w.float().view(rows, cols // 128, 128)
        q = torch.clamp(torch.round(g / group_scales), -8, 7).to(torch.int8).view(rows, cols)
        return (q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)

    def nvfp4():
        b = w.float().view(rows, cols // 16, 16)
        sb = b.abs().amax(dim=-1) / (6.0 * ws2)
        sb[sb == 0] = 1.0
        ws = torch.clamp(sb, 2**-9, 448).to(F8)
        c = e2m1((b / (ws.float() * ws2)[..., None]).view(rows, cols))
        return (c[:, 1::2] << 4) | c[:, 0::2], ws

    def mxfp4():
        # ModelOpt 0.47: the block amax in f32, so f32 throughout.
        v = w.view(-1, 32).float()
        e = torch.ceil(torch.maximum(torch.log2(v.abs().max(dim=-1, keepdim=True).values / 6.0), torch.tensor(-127.0)))
        x = v / torch.exp2(e)
        sign = (2 - torch.sign(x)) // 2
        c = (sign * 8 + torch.sum((x.abs().unsqueeze(-1) - BOUNDS) > 0, dim=-1)).to(torch.uint8).view(rows, cols)
        return (c[:, 1::2] << 4) | c[:, 0::2], (e + 127).to(torch.uint8)

    def mxfp8():
        v = w.view(rows, cols // 32, 32)
        d = v.abs().amax(dim=-1).float() / 448.0
        ex = torch.clamp(torch.ceil(torch.where(d > 0, torch.log2(d), torch.tensor(-127.0))), -127, 127)
        byte = (ex + 127).to(torch.uint8)
        return torch.clamp(v * torch.exp2(127 - byte.float())[..., None], -448, 448).to(F8), byte

    n = rows * cols
    return {
        "amax": (lambda: w.abs().amax(), 2 * n),
        "fp8_per_tensor": (fp8_per_tensor, 3 * n),
        "fp8_per_channel": (fp8_per_channel, 3 * n),
        "fp8_block128": (fp8_block128, 3 * n),
        "int8_per_channel": (int8_per_channel, 3 * n),
        "int4_g128": (int4_g128, 2 * n + n // 2),
        "nvfp4": (nvfp4, 2 * n + n // 2 + n // 16),
        "mxfp4": (mxfp4, 2 * n + n // 2 + n // 32),
        "mxfp8": (mxfp8, 3 * n + n // 32),
    }


def timed(f, budget=2.0):
    f()
    runs, start = 0, time.perf_counter()
    while True:
        f()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed > budget or runs >= 50:
            return elapsed / runs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4096,8192")
    p.add_argument("--json")
    p.add_argument("--ops", help="comma-separated subset of the operations")
    args = p.parse_args()
    all_threads = torch.get_num_threads()
    results = []
    for side in [int(s) for s in args.sizes.split(",")]:
        torch.manual_seed(0)
        w = (torch.randn(side, side) * 0.05).to(torch.bfloat16)
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            for name, (f, nbytes) in ops(w).items():
                if args.ops and name not in args.ops.split(","):
                    continue
                t = timed(f)
                results.append({"size": side, "threads": threads, "op": name, "seconds": t, "gbps": nbytes / t / 1e9})
                print(f"{side}x{side} {threads}t {name:18s} {t * 1e3:10.2f} ms {nbytes / t / 1e9:8.3f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
