"""Two kiln builds side by side on train_peer.py's runs (the same demo model, data, flags and
per-step arithmetic, gradient checkpointing off): time per step, tokens/s, peak RSS and the
first losses of each, one binary after the other in one run.

    python3 benches/peers/kiln_ab.py --size small --steps 8 --tasks sft,dpo BEFORE AFTER
    python3 benches/peers/kiln_ab.py --size 254m --steps 4 --tasks sft,dpo --lora BEFORE AFTER

`--backend mlx` runs the MLX backend; `--checkpointing off,on` runs each binary both ways
(gradient checkpointing; default off).
"""
import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_peer as tp  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kiln", nargs="+", help="kiln binaries, compared in this order")
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tasks", default="sft,dpo")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--backend", default="candle")
    ap.add_argument("--checkpointing", default="off", help="off, on, or both: off,on")
    ap.add_argument("--precision", default="f32", help="f32, or bf16 (kiln's --bf16 true)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    # A model, checkpoints and adapters: gigabytes at the larger sizes; gone when the script ends.
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model = os.path.join(tmp, "model")
    subprocess.run([args.kiln[0], "demo-model", "--size", args.size, "--out", model], check=True,
                   capture_output=True)
    tp.write_data(tmp)
    print("| task | kiln | checkpointing | s/step | tokens/s | peak RSS | first losses |")
    print("|---|---|---|---:|---:|---:|---|")
    for task in args.tasks.split(","):
        data = os.path.join(tmp, f"{task}.jsonl")
        for b, ckpt in [(b, c) for b in args.kiln for c in args.checkpointing.split(",")]:
            one = tp.run_kiln(b, task, model, data, 1, tmp, args.lora, ckpt, args.backend, args.precision)
            full = tp.run_kiln(b, task, model, data, args.steps, tmp, args.lora, ckpt, args.backend,
                               args.precision)
            s = (full["run_s"] - one["run_s"]) / (args.steps - 1)
            # GKD logs no num_tokens (TRL's GKDTrainer neither): no tokens/s there.
            rate = "—"
            if full["tokens"] is not None:
                rate = f"{(full['tokens'] - one['tokens']) / (args.steps - 1) / s:.0f}"
            losses = [round(l.get("loss", 0), 4) for l in full["lines"]][:3]
            print(f"| {task} | {b} | {ckpt} | {s:.3f} | {rate} | {full['rss_kb'] / 1024:.0f} MB | {losses} |",
                  flush=True)


if __name__ == "__main__":
    main()
