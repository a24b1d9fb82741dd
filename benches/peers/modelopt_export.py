#!/usr/bin/env python3
"""ModelOpt 0.47 on the CPU as the peer of `kiln export` (benches/export.sh): load a model folder,
calibrate on fixed random token ids (8 × 64), quantize and export to the ModelOpt HF layout.
The whole process is timed from outside (`/usr/bin/time -v`).

    python3 benches/peers/modelopt_export.py --model DIR --format fp8|nvfp4|int4-awq|int4-awq-full --out DIR
        [--ids-out FILE]   # also write the calibration ids as JSONL, for `kiln export --calib`
(needs tests/compat/requirements.txt)
"""
import argparse
import copy
import json
import time

import torch
import transformers
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint

CONFIGS = {"fp8": mtq.FP8_DEFAULT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG, "int4-awq": mtq.INT4_AWQ_CFG,
           # AWQ with the clipping search (kiln's --awq-clip)
           "int4-awq-full": {**copy.deepcopy(mtq.INT4_AWQ_CFG),
                             "algorithm": {"method": "awq_full", "alpha_step": 0.1}}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--format", choices=sorted(CONFIGS), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ids-out")
    args = p.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (8, 64), generator=torch.Generator().manual_seed(0))
    if args.ids_out:
        with open(args.ids_out, "w") as f:
            f.writelines(json.dumps({"input_ids": row.tolist()}) + "\n" for row in ids)

    def forward_loop(m):
        with torch.no_grad():
            for row in ids:
                m(row[None, :])

    started = time.perf_counter()
    mtq.quantize(model, CONFIGS[args.format], forward_loop)
    print(f"calibration: {time.perf_counter() - started:.2f} s ({ids.numel()} tokens)", flush=True)
    export_hf_checkpoint(model, export_dir=args.out)


if __name__ == "__main__":
    main()
