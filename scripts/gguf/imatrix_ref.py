#!/usr/bin/env python3
"""References for kiln's importance matrix and low-bit GGUF types, made by llama.cpp itself
(the tools `scripts/gguf/build-llama-cpp.sh` builds from llama-cpp-python 0.3.36's sources):

1. kiln writes its demo model (the default, 17M parameters: widths 512 and 1536, whole
   256-blocks, so every K and IQ type is exercised) and exports it as F32 and BF16 GGUF.
2. `llama-imatrix` computes the importance matrix of the F32 file on `text.txt` (chunks of
   128 tokens, the first 32; flash attention off and an F32 KV cache, so that its activations
   are f32 throughout like kiln's), in both file layouts: `llama-imatrix.gguf`, `.dat`.
3. `llama-quantize` quantizes the BF16 file to every file type kiln writes, without and with
   the importance matrix (`--imatrix llama-imatrix.gguf`, and once with the `.dat`), and the
   type and SHA-256 of every tensor of each result, and of the whole file, go to
   `llama-quantize.json`. The importance matrix is named by its file name (llama-quantize runs
   in its folder): llama-quantize records the path as given, and so does kiln.

4. `llama-perplexity` scores the F32 file and three quantized ones on the same text (chunks of
   128, the first 8; `--kl-divergence` against the F32 file's distributions; flash attention
   off, F32 KV cache): `llama-perplexity.json`.

tests/it/gguf_imatrix.rs checks kiln against these: `kiln imatrix` against llama-imatrix's
sums, every `kiln export --output-format gguf [--imatrix]` tensor by tensor, and `kiln eval
--ctx --kl-divergence` against llama-perplexity's figures.

    python3 scripts/gguf/imatrix_ref.py --kiln target/release/kiln --llama .llama-cpp/bin
"""
import argparse
import hashlib
import json
import pathlib
import random
import re
import subprocess
import sys

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "gguf" / "imatrix"
CTX, CHUNKS = 128, 32
TYPES = ["q2-k", "q3-k-s", "q3-k-m", "q3-k-l", "q4-k-s", "q4-k-m", "q5-k-s", "q5-k-m", "q6-k",
         "q4-0", "q4-1", "q5-0", "q5-1", "q8-0", "iq4-nl", "iq4-xs", "iq3-s", "iq3-m"]
# llama-quantize makes these only with an importance matrix.
IMATRIX_ONLY = ["iq3-xs", "iq3-xxs", "iq2-m", "iq2-s", "iq2-xs", "iq2-xxs"]


def run(cmd, cwd=None):
    """Runs `cmd`; its stdout and stderr together (llama.cpp's tools log to stderr)."""
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd)
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def text(path):
    """Deterministic English-like text (a fixed word list, seeded): activation statistics
    need tokens, not meaning, and this keeps the fixture small and free of any licence."""
    if path.exists():
        return
    words = ("the of and to in a is that for it as was with be by on not he this are or his "
             "from at which but have an they you were her she there one all we their been has "
             "would when who will more if no out so said what up its about into than them can "
             "only other new some could time these two may then do first any my now such like "
             "our over man me even most made after also did many before must through back years "
             "where much your way well down should because each just those people how too "
             "little state good very make world still own see men work long get here between "
             "both life being under never day same another know while last might us great old "
             "year off come since against go came right used take three").split()
    rng = random.Random(7)
    paragraphs = []
    for _ in range(60):
        sentences = []
        for _ in range(rng.randint(3, 7)):
            s = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
            sentences.append(s[0].upper() + s[1:] + ".")
        paragraphs.append(" ".join(sentences))
    path.write_text("\n\n".join(paragraphs) + "\n")


def tensors(path):
    """{name: [ggml type name, sha256 of the bytes]} of a GGUF file, by gguf-py."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    return {t.name: [t.tensor_type.name, hashlib.sha256(bytes(t.data.tobytes())).hexdigest()]
            for t in r.tensors}


PPL_CHUNKS = 8
SCORED = ["q4-k-m+gguf", "iq3-s", "q2-k+gguf"]


def perplexity(llama, work):
    """llama-perplexity's figures for the F32 file and the SCORED files."""
    common = ["-f", OUT / "text.txt", "-c", CTX, "--chunks", PPL_CHUNKS, "-t", 2, "-fa", "off",
              "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", work / "base.kld"]
    out = run([llama / "llama-perplexity", "-m", work / "f32" / "model.gguf"] + common)
    res = {"ctx": CTX, "chunks": PPL_CHUNKS,
           "f32": {"ppl": float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))}}
    pats = {"ppl": r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", "kl_mean": r"Mean\s+KLD:\s*([0-9.]+)",
            "kl_median": r"Median\s+KLD:\s*([0-9.]+)", "kl_p99": r"99\.0%\s+KLD:\s*([0-9.]+)",
            "kl_max": r"Maximum KLD:\s*([0-9.]+)", "same_top": r"Same top p:\s*([0-9.]+)"}
    for key in SCORED:
        t, _, im = key.partition("+")
        f = work / f"{t}-{im or 'plain'}.gguf"
        out = run([llama / "llama-perplexity", "-m", f, "--kl-divergence"] + common)
        res[key] = {k: float(re.search(p, out).group(1)) for k, p in pats.items()}
        print(key, res[key])
    (OUT / "llama-perplexity.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--kiln", required=True)
    a.add_argument("--llama", required=True, help="folder of llama-imatrix and llama-quantize")
    a.add_argument("--work", default="/tmp/kiln-imatrix-ref")
    a.add_argument("--keep-imatrix", action="store_true",
                   help="reuse the committed llama-imatrix files (redo the quantizations only)")
    o = a.parse_args()
    llama, work = pathlib.Path(o.llama).resolve(), pathlib.Path(o.work).resolve()
    sys.path.insert(0, str(llama.parent / "src" / "llama_cpp_python-0.3.36" / "vendor" /
                           "llama.cpp" / "gguf-py"))
    work.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    text(OUT / "text.txt")
    model = work / "demo"
    run([o.kiln, "demo-model", "--out", model, "--force"])
    for f in ["f32", "bf16"]:
        run([o.kiln, "export", "--model", model, "--output-format", "gguf", "--format", f,
             "--out", work / f, "--force"])
    for layout in [] if o.keep_imatrix else ["gguf", "dat"]:
        run([llama / "llama-imatrix", "-m", work / "f32" / "model.gguf", "-f", OUT / "text.txt",
             "-o", OUT / f"llama-imatrix.{layout}", "-c", CTX, "--chunks", CHUNKS, "-t", 2,
             "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--output-format", layout])
    refs = {"source": "llama.cpp of llama-cpp-python 0.3.36", "ctx": CTX, "chunks": CHUNKS,
            "files": {}, "file_sha256": {}}
    runs = ([(t, None) for t in TYPES] + [(t, "gguf") for t in TYPES + IMATRIX_ONLY]
            + [("q4-k-m", "dat")])
    for t, imatrix in runs:
        out = work / f"{t}-{imatrix or 'plain'}.gguf"
        cmd = [llama / "llama-quantize"]
        if imatrix:
            cmd += ["--imatrix", f"llama-imatrix.{imatrix}"]
        llama_name = t.upper().replace("-", "_")
        run(cmd + [work / "bf16" / "model.gguf", out, llama_name, "2"], cwd=OUT)
        key = f"{t}+{imatrix}" if imatrix else t
        refs["files"][key] = tensors(out)
        refs["file_sha256"][key] = hashlib.sha256(out.read_bytes()).hexdigest()
        print(f"{t} {imatrix or ''}: {len(refs['files'][key])} tensors")
    (OUT / "llama-quantize.json").write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")
    perplexity(llama, work)
    print(f"→ {OUT}")


if __name__ == "__main__":
    main()
