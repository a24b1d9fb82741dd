#!/usr/bin/env python3
"""GGUF quality on a real model, kiln beside llama.cpp, with and without an importance matrix
(BENCHMARKS.md §GGUF).

For a Hugging Face model folder and public-domain text split into calibration and held-out
parts:
- the bf16 GGUF (`kiln export --output-format gguf --format bf16`): llama.cpp's input and the
  reference of every comparison;
- two importance matrices on the calibration text (chunks of --ctx tokens, the first
  --imatrix-chunks of them): `kiln imatrix` on the Hugging Face folder and `llama-imatrix` on the
  bf16 GGUF, each timed with its peak RSS (`/usr/bin/time -v`), compared entry by entry;
- for each file type (--types; q4-k-m q3-k-m q2-k iq4-xs by default): `kiln export` without an
  importance matrix (where llama-quantize allows one: not for IQ3_XXS and the IQ2/IQ1 types)
  and with kiln's, `llama-quantize` of the bf16 GGUF the same ways and, for a scored type, with
  llama-imatrix's; as each type is made, kiln's files are compared tensor by tensor (type,
  shape, bytes; gguf-py) and as whole files with llama-quantize's made from the same importance
  matrix (none, or kiln's file): kiln promises llama-quantize's tensor bytes (the tensors'
  order may differ: llama-quantize writes them sorted by layer, then name, kiln in the
  converter's order);
- every GGUF of a scored type (--score-types, by default all of --types; given with no type,
  the files are only made and compared, and with --discard-unscored deleted once compared)
  scored by `llama-perplexity --kl-divergence` against the bf16 GGUF on the held-out
  text (chunks of --ctx tokens, the first --chunks of them, the second half of each scored):
  perplexity, KL divergence of each token's distribution from the base's (mean, median, 99th
  percentile), how often the top token is the base's;
- `kiln eval --ctx --kl-divergence` (same protocol) on two of them, llama-quantize's --kiln-eval
  type (q4-k-m) without and with llama-imatrix's matrix, beside llama-perplexity's figures for
  the same files. They are not expected to agree to the digit: llama.cpp's CPU matmuls round
  the activations to the weights' `vec_dot_type` (Q8_0 / Q8_K for the quantized types, bf16 for
  bf16), kiln's evaluator decodes the weights and keeps the activations unquantized.

llama-imatrix skips every matmul of fewer than 16 rows, and at -c 512 runs 4 chunks a batch,
split into ubatches of 512 with equal tokens per sequence: when the last batch holds 3 chunks
(n mod 4 = 3), 3 × 170 tokens go in each of 3 ubatches and the last 3 × 2 are dropped (a count
of 512·n − 6 and `chunk_count` n − 1). kiln counts every token, so the two matrices' counts
agree for any other n.

    python benches/peers/gguf_quality.py --make-text /tmp/gq/text      # Debian's KJV Bible
    python benches/peers/gguf_quality.py --kiln target/release/kiln --llama-bin .llama-cpp/bin \\
        --model SMOLLM2_HF --calib /tmp/gq/text/calib.txt --heldout /tmp/gq/text/heldout.txt \\
        --work /tmp/gq/run [--chunks 20] [--imatrix-chunks N] [--threads 2]

--make-text downloads Debian's `bible-kjv-text` (the King James Bible, public domain, in the
`bible` program's compressed format) and `bible-kjv` (the program) with `apt-get download`,
dumps Genesis 1:1 to Revelation 22:21 in book order, one verse a line without its reference, and
writes calib.txt (the first 200 000 characters) and heldout.txt (the last 300 000).
SMOLLM2_HF comes from `benches/peers/smollm2_hf.py` (576-wide rows: the K and IQ types fall back
on most matrices); `benches/peers/qwen25_coder_hf.py` makes a model whose rows are all whole
256-blocks. A kiln file whose tensors equal llama-quantize's is not scored twice. Needs numpy and pyyaml (gguf-py's) and
llama.cpp's tools and gguf-py (`scripts/gguf/build-llama-cpp.sh`). Nothing is written into the
repository; the table it prints is what BENCHMARKS.md records.
"""
import argparse
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
GGUF_PY = ROOT / ".llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"
TYPES = ["q4-k-m", "q3-k-m", "q2-k", "iq4-xs"]


# ---------------------------------------------------------------------------------------------
# Text


def make_text(out, calib_chars=200_000, heldout_chars=300_000):
    """Debian's King James Bible, one verse a line in book order: calib.txt (its first
    `calib_chars` characters) and heldout.txt (its last `heldout_chars`), into `out`."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        for pkg in ["bible-kjv-text", "bible-kjv"]:
            p = subprocess.run(["apt-get", "download", pkg], cwd=tmp, capture_output=True, text=True)
            if p.returncode != 0:
                subprocess.run(["apt-get", "update", "-q"], check=True, capture_output=True)
                subprocess.run(["apt-get", "download", pkg], cwd=tmp, check=True, capture_output=True)
        for deb in sorted(tmp.glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(tmp / "root")], check=True)
        # `bible -f` (no pretty-printing): one verse a line, "Ge1:1 In the beginning ...".
        dump = subprocess.run(
            [str(tmp / "root/usr/bin/bible"), "-f", "-p", str(tmp / "root/usr/lib"), "Gen1:1-Rev22:21"],
            capture_output=True, text=True, check=True,
        ).stdout
    ref = re.compile(r"^[1-3]?[A-Za-z]+\d+:\d+ ")
    lines = dump.splitlines()
    assert len(lines) == 31102 and all(ref.match(l) for l in lines), "unexpected bible output"
    text = "".join(ref.sub("", l) + "\n" for l in lines)
    (out / "kjv.txt").write_text(text)
    (out / "calib.txt").write_text(text[:calib_chars])
    (out / "heldout.txt").write_text(text[-heldout_chars:])
    print(f"{out}: kjv.txt {len(text)} characters ({len(lines)} verses), calib.txt the first "
          f"{calib_chars}, heldout.txt the last {heldout_chars}")


# ---------------------------------------------------------------------------------------------
# Running the tools


def run(cmd, log, timed=True):
    """Runs `cmd` (under /usr/bin/time -v when `timed`), its output to `log`. Returns (seconds,
    peak RSS in MB, output)."""
    cmd = [str(c) for c in cmd]
    full = (["/usr/bin/time", "-v"] if timed else []) + cmd
    t = time.time()
    p = subprocess.run(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    secs = time.time() - t
    log.write_text(" ".join(cmd) + "\n\n" + p.stdout)
    if p.returncode != 0:
        sys.exit(f"{cmd[0]} failed ({p.returncode}), see {log}:\n{p.stdout[-3000:]}")
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stdout)
    return secs, (int(m.group(1)) / 1024 if m else None), p.stdout


# llama-quantize refuses these without an importance matrix.
NEED_IMATRIX = {"iq3-xxs", "iq2-xxs", "iq2-xs", "iq2-s", "iq1-s", "iq1-m", "q2-k-s"}


def imatrices(typ, tool, o):
    """The importance matrices `tool` quantizes `typ` with: none (where allowed) and kiln's for
    both tools; llama-imatrix's too for llama-quantize on a scored type."""
    ims = ([] if typ in NEED_IMATRIX else ["none"]) + ["kiln"]
    return ims + (["llama.cpp"] if tool == "llama.cpp" and typ in o.score_types else [])


def llama_type(t):
    return t.replace("-", "_").upper()  # q4-k-m -> Q4_K_M, iq4-xs -> IQ4_XS


def perplexity_kl(o, model, base_kld, log):
    """llama-perplexity --kl-divergence of `model` against the base's saved log-probabilities."""
    secs, _, out = run([o.llama_bin / "llama-perplexity", "-m", model, "-f", o.heldout, "-c", o.ctx,
                        "--chunks", o.chunks, "-t", o.threads, "--kl-divergence",
                        "--kl-divergence-base", base_kld], log, timed=False)
    num = r"\s*([-+0-9.naif]+)"
    get = lambda pat: float(re.search(pat + num, out).group(1))
    return {
        "ppl": get(r"Mean PPL\(Q\)\s*:"),
        "ppl_base": get(r"Mean PPL\(base\)\s*:"),
        "kl_mean": get(r"Mean\s+KLD:"),
        "kl_median": get(r"Median\s+KLD:"),
        "kl_p99": get(r"99\.0%\s+KLD:"),
        "kl_max": get(r"Maximum KLD:"),
        "same_top": get(r"Same top p:"),
        "eval_s": secs,
    }


# ---------------------------------------------------------------------------------------------
# Reading GGUF files (gguf-py)


def gguf_reader(path):
    import gguf

    return gguf.GGUFReader(str(path))


def tensor_mix(path):
    """{type name: count} over the file's 2-D tensors, and {tensor name: type name}."""
    types = {t.name: t.tensor_type.name for t in gguf_reader(path).tensors}
    mix = {}
    for t in gguf_reader(path).tensors:
        if len(t.shape) > 1:
            mix[t.tensor_type.name] = mix.get(t.tensor_type.name, 0) + 1
    return mix, types


def compare_gguf(a, b):
    """Tensor by tensor, by name: types, shapes and data bytes. Returns {identical (the tensor
    data), n (tensors), diffs (the first few differences), same_order (the tensors' order in the
    files), meta (the metadata keys whose values differ), same_file (the whole files' bytes)}."""
    ra, rb = gguf_reader(a), gguf_reader(b)
    ta = {t.name: t for t in ra.tensors}
    tb = {t.name: t for t in rb.tensors}
    diffs = [f"only in one file: {n}" for n in sorted(set(ta) ^ set(tb))]
    for n in sorted(ta.keys() & tb.keys()):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            diffs.append(f"{n}: {x.tensor_type.name}{list(x.shape)} vs {y.tensor_type.name}{list(y.shape)}")
        elif x.data.tobytes() != y.data.tobytes():
            diffs.append(f"{n} ({x.tensor_type.name}): bytes differ")

    def kv(r):
        out = {}
        for k, f in r.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                out[k] = f.contents()
            except Exception:  # noqa: BLE001 - an unreadable field compares by its raw bytes
                out[k] = [bytes(p) for p in f.parts]
        return out

    ka, kb = kv(ra), kv(rb)
    digest = lambda p: hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest()
    return {
        "identical": not diffs,
        "n": len(ta),
        "diffs": diffs[:5] + ([f"... {len(diffs) - 5} more"] if len(diffs) > 5 else []),
        "same_order": list(ta) == list(tb),
        "meta": sorted(k for k in ka.keys() | kb.keys() if ka.get(k) != kb.get(k)),
        "same_file": digest(a) == digest(b),
    }


def compare_imatrix(a, b):
    """Two importance matrices (GGUF): their entries, counts, and the relative difference of
    each column's mean square (in_sum2 / counts), median / 99th percentile / max over all."""
    import numpy as np

    def load(path):
        r = gguf_reader(path)
        t = {x.name: x for x in r.tensors}
        mean, counts, dims = {}, {}, set()
        for n, x in t.items():
            if n.endswith(".in_sum2"):
                base = n[: -len(".in_sum2")]
                counts[base] = np.array(t[base + ".counts"].data, dtype=np.float64).reshape(-1)
                mean[base] = np.array(x.data, dtype=np.float64).reshape(-1) / counts[base][0]
                dims.add(len(x.shape))
        chunks = r.fields.get("imatrix.chunk_count")
        return mean, counts, (chunks.contents() if chunks else None), sorted(dims)

    ma, ca, na, da = load(a)
    mb, cb, nb, db = load(b)
    common = sorted(ma.keys() & mb.keys())
    rel = np.concatenate([np.abs(ma[n] - mb[n]) / np.maximum(np.abs(mb[n]), 1e-30) for n in common]) if common else np.zeros(1)
    return {
        "entries": (len(ma), len(mb)),
        "only_a": sorted(ma.keys() - mb.keys())[:5],
        "only_b": sorted(mb.keys() - ma.keys())[:5],
        "counts_equal": all(np.array_equal(ca[n], cb[n]) for n in common),
        "counts": (sorted({float(ca[n][0]) for n in common}), sorted({float(cb[n][0]) for n in common})),
        "rel_diff_median": float(np.median(rel)),
        "rel_diff_p99": float(np.quantile(rel, 0.99)),
        "rel_diff_max": float(rel.max()),
        "in_sum2_dims": (da, db),
        "chunks": (na, nb),
    }


def describe(c):
    data = f"tensor data identical ({c['n']} tensors)" if c["identical"] else "DIFFERENT: " + "; ".join(c["diffs"])
    return (f"{data}; tensor order {'same' if c['same_order'] else 'differs'}; metadata keys that differ: "
            f"{c['meta'] or 'none'}; whole file {'identical' if c['same_file'] else 'differs'}")


# ---------------------------------------------------------------------------------------------


def main():
    a = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a.add_argument("--make-text", metavar="DIR", help="write DIR/calib.txt and DIR/heldout.txt (Debian's KJV) and stop")
    a.add_argument("--kiln")
    a.add_argument("--llama-bin", type=pathlib.Path, help="folder of llama-quantize, llama-imatrix, llama-perplexity")
    a.add_argument("--model", help="the Hugging Face folder (bf16)")
    a.add_argument("--calib")
    a.add_argument("--heldout")
    a.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/kiln-gguf-quality"))
    a.add_argument("--ctx", type=int, default=512)
    a.add_argument("--chunks", type=int, default=20, help="held-out chunks scored")
    a.add_argument("--imatrix-chunks", type=int, help="calibration chunks (default: all)")
    a.add_argument("--types", nargs="+", default=TYPES, help="the file types made by both tools and compared")
    a.add_argument("--score-types", nargs="*", help="the types scored by llama-perplexity (default: --types; "
                   "none given: the files are only made and compared)")
    a.add_argument("--threads", type=int, default=2, help="llama.cpp tools' -t")
    a.add_argument("--kiln-eval", default="q4-k-m", help="the type whose files kiln eval scores too ('' for none)")
    a.add_argument("--gguf-py", default=str(GGUF_PY))
    a.add_argument("--discard-unscored", action="store_true",
                   help="delete an unscored type's files once compared (a large model's files fill the disk)")
    a.add_argument("--reuse", action="store_true", help="keep files already made in --work (their time is then not measured)")
    o = a.parse_args()
    if o.make_text:
        make_text(o.make_text)
        return
    o.score_types = o.types if o.score_types is None else o.score_types
    if not set(o.score_types) <= set(o.types):
        a.error("--score-types must be among --types")
    for k in ["kiln", "llama_bin", "model", "calib", "heldout"]:
        if getattr(o, k) is None:
            a.error(f"--{k.replace('_', '-')} is required")
    sys.path.insert(0, o.gguf_py)
    work = o.work
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    bin_ = o.llama_bin
    t0 = time.time()
    versions = {
        "kiln": subprocess.run([o.kiln, "--version"], capture_output=True, text=True).stdout.strip(),
        "llama.cpp": re.search(r"version: .*", subprocess.run([bin_ / "llama-perplexity", "--version"],
                                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                                 text=True).stdout).group(0),
    }
    print(f"versions: {versions}")

    def made(path):
        return o.reuse and pathlib.Path(path).exists()

    # The bf16 GGUF: llama.cpp's input and everyone's reference.
    base = work / "bf16" / "model.gguf"
    if not made(base):
        run([o.kiln, "export", "--model", o.model, "--output-format", "gguf", "--format", "bf16",
             "--out", base.parent, "--force"], logs / "export-bf16.log")
    chunks_arg = ["--chunks", o.imatrix_chunks] if o.imatrix_chunks else []

    # Importance matrices.
    stats = {}
    imx = {"kiln": work / "imatrix-kiln.gguf", "llama.cpp": work / "imatrix-llama.gguf"}
    cmds = {
        "kiln": [o.kiln, "imatrix", "--model", o.model, "--data", o.calib, "--out", imx["kiln"], "--ctx", o.ctx] + chunks_arg,
        "llama.cpp": [bin_ / "llama-imatrix", "-m", base, "-f", o.calib, "-o", imx["llama.cpp"], "-c", o.ctx,
                      "-t", o.threads] + chunks_arg,
    }
    for tool, cmd in cmds.items():
        if made(imx[tool]):
            continue
        secs, peak, _ = run(cmd, logs / f"imatrix-{tool}.log")
        stats[("imatrix", tool)] = (secs, peak)
        print(f"imatrix {tool}: {secs:.1f} s, peak RSS {peak:.0f} MB")
    imx_cmp = compare_imatrix(imx["kiln"], imx["llama.cpp"])
    print(f"imatrix kiln vs llama.cpp: {imx_cmp}")

    # Quantized files: (tool, type, imatrix) -> path. Every type is made by both tools without an
    # importance matrix (where llama-quantize allows it) and with kiln's; the scored ones with
    # llama-imatrix's too.
    files, same, mixes_of = {}, {}, {}
    for typ in o.types:
        for im in imatrices(typ, "kiln", o):
            out = work / f"kiln-{typ}-{im}"
            files[("kiln", typ, im)] = out / "model.gguf"
            if made(out / "model.gguf"):
                continue
            cmd = [o.kiln, "export", "--model", o.model, "--output-format", "gguf", "--format", typ,
                   "--out", out, "--force"] + (["--imatrix", imx["kiln"]] if im == "kiln" else [])
            stats[("kiln", typ, im)] = run(cmd, logs / f"kiln-{typ}-{im}.log")[:2]
        for im in imatrices(typ, "llama.cpp", o):
            out = work / f"llama-{typ}-{im}.gguf"
            files[("llama.cpp", typ, im)] = out
            if made(out):
                continue
            cmd = [bin_ / "llama-quantize"] + (["--imatrix", imx[im]] if im != "none" else []) + \
                  [base, out, llama_type(typ), o.threads]
            stats[("llama.cpp", typ, im)] = run(cmd, logs / f"llama-{typ}-{im}.log")[:2]
        # kiln's file against llama-quantize's from the same importance matrix, as each is made.
        for im in imatrices(typ, "kiln", o):
            s = [stats.get((t, typ, im)) for t in ("kiln", "llama.cpp")]
            c = same[(typ, im)] = compare_gguf(files[("kiln", typ, im)], files[("llama.cpp", typ, im)])
            print(f"{typ} imatrix {im}: " + ", ".join(
                f"{t} {x[0]:.1f} s {x[1]:.0f} MB" for t, x in zip(("kiln", "llama-quantize"), s) if x)
                + f"; kiln vs llama-quantize: {describe(c)}", flush=True)
        if o.discard_unscored and typ not in o.score_types:
            for im in imatrices(typ, "llama.cpp", o):
                mixes_of[typ, im] = tensor_mix(files[("llama.cpp", typ, im)])
            for tool in ("kiln", "llama.cpp"):
                for im in imatrices(typ, tool, o):
                    pathlib.Path(files[(tool, typ, im)]).unlink()

    # The type mix (what the 256-wide types fell back to), from the files and llama-quantize's log.
    mixes = {}
    for typ in o.types:
        for im in [im for im in imatrices(typ, "llama.cpp", o) if im != "kiln"]:
            mix, types = mixes_of.get((typ, im)) or tensor_mix(files[("llama.cpp", typ, im)])
            log = (logs / f"llama-{typ}-{im}.log")
            fallbacks = {}
            if log.exists():
                for m in re.finditer(r"required for type\s+(\S+)\)\s.*?-> falling back to\s+(\S+)", log.read_text()):
                    fallbacks[f"{m.group(1)}->{m.group(2)}"] = fallbacks.get(f"{m.group(1)}->{m.group(2)}", 0) + 1
            by_role = {}
            for n, t in types.items():
                role = re.sub(r"^blk\.\d+\.", "", n)
                by_role.setdefault(role, {}).setdefault(t, 0)
                by_role[role][t] += 1
            mixes[(typ, im)] = (mix, fallbacks, by_role)
            print(f"{typ} (imatrix {im}) mix: {mix}; fallbacks: {fallbacks}")
            print("   by tensor: " + "; ".join(
                f"{r}: " + ", ".join(f"{c} {t}" for t, c in sorted(v.items())) for r, v in sorted(by_role.items())
                if not r.endswith("norm.weight")))

    if not o.score_types:
        print("\nkiln's file == llama-quantize's from the same importance matrix (tensor data, gguf-py):")
        for (typ, im), c in same.items():
            print(f"- {typ}, imatrix {im}: {describe(c)}")
        print(f"\nimportance matrices, kiln vs llama-imatrix: {imx_cmp}")
        print(f"{versions}; total {time.time() - t0:.0f} s")
        return

    # Scores: llama-perplexity, the bf16 GGUF's log-probabilities saved once.
    base_kld = work / "bf16.kld"
    secs, _, out = run([bin_ / "llama-perplexity", "-m", base, "-f", o.heldout, "-c", o.ctx, "--chunks", o.chunks,
                        "-t", o.threads, "--kl-divergence-base", base_kld], logs / "ppl-bf16.log", timed=False)
    base_ppl = float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))
    n_chunks = int(re.search(r"calculating perplexity over (\d+) chunks", out).group(1))
    print(f"bf16 base: ppl {base_ppl:.4f} over {n_chunks} chunks ({secs:.1f} s)")
    scores = {}
    for key, path in files.items():
        tool, typ, im = key
        if typ not in o.score_types:
            continue
        if tool == "kiln" and same[(typ, im)]["identical"]:
            # The same tensors, type for type and byte for byte: the same figures.
            scores[key] = dict(scores.get(("llama.cpp", typ, im)) or perplexity_kl(
                o, files[("llama.cpp", typ, im)], base_kld, logs / f"ppl-llama.cpp-{typ}-{im}.log"), eval_s=0.0)
            scores[("llama.cpp", typ, im)] = scores.get(("llama.cpp", typ, im)) or dict(scores[key])
            continue
        if key in scores:
            continue
        scores[key] = perplexity_kl(o, path, base_kld, logs / f"ppl-{tool}-{typ}-{im}.log")
        s = scores[key]
        print(f"{tool} {typ} imatrix {im}: ppl {s['ppl']:.4f}, KL {s['kl_mean']:.5f} ({s['eval_s']:.0f} s)", flush=True)

    # kiln eval on two of the same files: llama-quantize's, without and with llama-imatrix's matrix.
    kiln_eval = {}
    if o.kiln_eval:
        tok = pathlib.Path(o.model) / "tokenizer.json"
        for im in ["none", "llama.cpp"]:
            path = files[("llama.cpp", o.kiln_eval, im)]
            secs, _, out = run([o.kiln, "eval", "--model", path, "--data", o.heldout, "--ctx", o.ctx, "--chunks", o.chunks,
                                "--kl-divergence", base, "--tokenizer", tok, "--json"],
                               logs / f"kiln-eval-llama-{o.kiln_eval}-{im}.log", timed=False)
            e = json.loads(out[out.index("{"): out.rindex("}") + 1])
            kl = e["kl_divergence"]
            kiln_eval[im] = {"ppl": e["perplexity"], "ppl_base": kl["reference_perplexity"], "kl_mean": kl["mean"],
                             "kl_median": kl["median"], "kl_p99": kl["p99"], "kl_max": kl["max"],
                             "same_top": 100 * kl["same_top1"], "eval_s": secs}
            print(f"kiln eval llama-quantize {o.kiln_eval} imatrix {im}: {kiln_eval[im]}")

    # The table.
    def fmt(x, f):
        return "—" if x is None else format(x, f)

    print("\n| tool | type | imatrix | ppl | Δppl | KL mean | KL median | KL p99 | same top % | quantize s | peak RSS MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| kiln export | bf16 (base) | — | {base_ppl:.4f} | — | — | — | — | — | — | — |")
    for typ in o.score_types:
        for tool, im in [("kiln", "none"), ("llama.cpp", "none"), ("kiln", "kiln"), ("llama.cpp", "kiln"),
                         ("llama.cpp", "llama.cpp")]:
            if (tool, typ, im) not in scores:
                continue
            s = scores[(tool, typ, im)]
            secs, peak = stats.get((tool, typ, im), (None, None))
            name = "kiln export" if tool == "kiln" else "llama-quantize"
            print(f"| {name} | {typ} | {im} | {s['ppl']:.4f} | {s['ppl'] - base_ppl:+.4f} | {s['kl_mean']:.5f} | "
                  f"{s['kl_median']:.5f} | {s['kl_p99']:.5f} | {s['same_top']:.2f} | {fmt(secs, '.1f')} | {fmt(peak, '.0f')} |")

    print("\n| importance matrix | chunks × ctx | s | peak RSS MB |")
    print("|---|---|---:|---:|")
    for tool in ["kiln", "llama.cpp"]:
        secs, peak = stats.get(("imatrix", tool), (None, None))
        print(f"| {'kiln imatrix' if tool == 'kiln' else 'llama-imatrix'} | {imx_cmp['chunks'][0 if tool == 'kiln' else 1]} × {o.ctx} "
              f"| {fmt(secs, '.1f')} | {fmt(peak, '.0f')} |")

    if kiln_eval:
        print(f"\n| file | evaluator | base ppl | ppl | KL mean | KL median | KL p99 | KL max | same top % | s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for im, e in kiln_eval.items():
            for who, s in [("llama-perplexity", scores[("llama.cpp", o.kiln_eval, im)]), ("kiln eval", e)]:
                print(f"| llama-quantize {o.kiln_eval}, imatrix {im} | {who} | {s['ppl_base']:.4f} | {s['ppl']:.4f} | "
                      f"{s['kl_mean']:.6f} | {s['kl_median']:.6f} | {s['kl_p99']:.6f} | {s['kl_max']:.4f} | "
                      f"{s['same_top']:.3f} | {s['eval_s']:.0f} |")

    print("\nkiln's file == llama-quantize's from the same importance matrix (tensor data, gguf-py):")
    for (typ, im), c in same.items():
        print(f"- {typ}, imatrix {im}: {describe(c)}")
    print(f"\nimportance matrices, kiln vs llama-imatrix: {imx_cmp}")
    print(f"{versions}; held-out: {n_chunks} chunks of {o.ctx}; total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
