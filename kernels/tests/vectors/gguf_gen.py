"""llama.cpp's own quantizers (`quantize_<type>` in ggml-quants.c, what `llama-quantize` calls
through `ggml_quantize_chunk`, from the llama-cpp-python 0.3.36 source distribution on PyPI) run
on random and adversarial inputs, without importance weights (`quant_weights` NULL: the
`quantize_row_*_ref` code for most types) and with them (what `llama-quantize --imatrix` runs),
written to gguf_cases.json for kernels/tests/gguf_vectors.rs, which checks kiln's `ops::gguf`
against every output byte.

    python kernels/tests/vectors/gguf_gen.py [LLAMA_CPP_DIR]

Without LLAMA_CPP_DIR it downloads the pinned sdist with pip (a C compiler and numpy are all
it needs). ggml-quants.c is compiled alone, with `-O2 -ffp-contract=off` (no fused
multiply-add: the arithmetic C's source order states), beside four stubs for the ggml
functions its validation code names. gguf-py's numpy quantizers (same sdist) are run too for the
types they have, and must agree with the C code; gguf-py's dequantizers give the decoded values
(`y`) that kiln's decoding is compared with.
"""

import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

SDIST = "llama-cpp-python==0.3.36"
OUT = pathlib.Path(__file__).with_name("gguf_cases.json")
TYPES = {  # name → (C function suffix, block elements, block bytes, ggml type number)
    "Q4_0": ("q4_0", 32, 18, 2), "Q4_1": ("q4_1", 32, 20, 3), "Q5_0": ("q5_0", 32, 22, 6),
    "Q5_1": ("q5_1", 32, 24, 7), "Q8_0": ("q8_0", 32, 34, 8), "Q2_K": ("q2_K", 256, 84, 10),
    "Q3_K": ("q3_K", 256, 110, 11), "Q4_K": ("q4_K", 256, 144, 12),
    "Q5_K": ("q5_K", 256, 176, 13), "Q6_K": ("q6_K", 256, 210, 14),
    "IQ4_NL": ("iq4_nl", 32, 18, 20), "IQ4_XS": ("iq4_xs", 256, 136, 23),
    "IQ2_XXS": ("iq2_xxs", 256, 66, 16), "IQ2_XS": ("iq2_xs", 256, 74, 17),
    "IQ2_S": ("iq2_s", 256, 82, 22), "IQ3_XXS": ("iq3_xxs", 256, 98, 18),
    "IQ3_S": ("iq3_s", 256, 110, 21),
    "MXFP4": ("mxfp4", 32, 17, 39),
}
# ggml asserts importance weights for these (llama-quantize refuses them without an imatrix).
NEEDS_WEIGHTS = ("IQ2_XXS", "IQ2_XS")
# The types whose quantizer reads importance weights (ggml's Q8_0 and MXFP4 ignore them).
WEIGHTED = [t for t in TYPES if t not in ("Q8_0", "MXFP4")]
STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    fprintf(stderr, "ggml_abort %s:%d %s\n", file, line, fmt); abort();
}
size_t ggml_row_size(int type, long long ne) {
    switch (type) {
SIZES
    }
    abort();
}
const char * ggml_type_name(int type) { (void) type; abort(); }
size_t ggml_type_size(int type) { (void) type; abort(); }
"""
HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
%s
static float * slurp(const char * path, long * n) {
    FILE * f = fopen(path, "rb");
    fseek(f, 0, SEEK_END); *n = ftell(f) / 4; fseek(f, 0, SEEK_SET);
    float * x = malloc(*n * 4); if (fread(x, 4, *n, f) != (size_t) *n) exit(2); fclose(f);
    return x;
}
/* quantize TYPE X.bin COLS OUT.bin [WEIGHTS.bin] */
int main(int argc, char ** argv) {
    long n, nw = 0;
    float * x = slurp(argv[2], &n);
    long cols = atol(argv[3]);
    float * w = argc > 5 ? slurp(argv[5], &nw) : NULL;
    if (w && nw != cols) return 3;
    unsigned char * y = calloc(n, 4);
    long bytes = 0;
    /* ggml_quantize_init: only the lattice this type uses (building one takes seconds). */
    if (!strcmp(argv[1], "IQ2_XXS")) iq2xs_init_impl(16);
    if (!strcmp(argv[1], "IQ2_XS")) iq2xs_init_impl(17);
    if (!strcmp(argv[1], "IQ2_S")) iq2xs_init_impl(22);
    if (!strcmp(argv[1], "IQ3_XXS")) iq3xs_init_impl(256);
    if (!strcmp(argv[1], "IQ3_S")) iq3xs_init_impl(512);
%s
    FILE * o = fopen(argv[4], "wb"); fwrite(y, 1, bytes, o); fclose(o);
    return 0;
}
"""


def source_dir(arg):
    if arg:
        return pathlib.Path(arg)
    tmp = pathlib.Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(tmp), SDIST], check=True)
    (archive,) = tmp.glob("*.tar.gz")
    with tarfile.open(archive) as t:
        t.extractall(tmp, filter="data")
    (root,) = [p for p in tmp.iterdir() if p.is_dir()]
    return root / "vendor" / "llama.cpp"


def build(llama, work):
    ggml = llama / "ggml"
    decls = "\n".join(f"size_t quantize_{c}(const float * src, void * dst, int64_t nrow, "
                      "int64_t n_per_row, const float * quant_weights);"
                      for c, _, _, _ in TYPES.values())
    decls += "\nvoid iq2xs_init_impl(int type);\nvoid iq3xs_init_impl(int grid_size);"
    calls = "\n".join(
        f'    if (!strcmp(argv[1], "{name}")) bytes = quantize_{c}(x, y, n / cols, cols, w);'
        for name, (c, _, _, _) in TYPES.items())
    (work / "harness.c").write_text(HARNESS % (decls, calls))
    sizes = "\n".join(f"    case {t}: return ne / {e} * {b};" for _, e, b, t in TYPES.values())
    (work / "stubs.c").write_text(STUBS.replace("SIZES", sizes))
    exe = work / "quantize"
    flags = ["-O2", "-ffp-contract=off", "-std=gnu11", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}"]
    subprocess.run(["cc", *flags, "-o", str(exe), str(work / "harness.c"), str(work / "stubs.c"),
                    str(ggml / "src" / "ggml-quants.c"), "-lm"], check=True)
    return exe


def inputs(rng):
    """(name, f32 matrix [rows, 512]) pairs."""
    cols = 512
    yield "normal", (rng.standard_normal((4, cols)) * 0.02).astype(np.float32)
    yield "wide", (rng.standard_normal((4, cols)) * 10.0 ** rng.uniform(-4, 3, (4, 1))).astype(np.float32)
    yield "heavy-tails", (rng.standard_t(2, (4, cols)) * 0.01).astype(np.float32)
    yield "positive", np.abs(rng.standard_normal((2, cols))).astype(np.float32)
    yield "negative", -np.abs(rng.standard_normal((2, cols))).astype(np.float32) - 0.5
    z = rng.standard_normal((4, cols)).astype(np.float32)
    z[0] = 0.0
    z[1, :256] = 0.0
    z[1, 256:288] = 1e-3
    z[2, ::7] = 0.0
    z[3, 5] = 100.0
    yield "zeros-outlier", z
    yield "constant", np.full((2, cols), 0.25, np.float32)
    g = rng.integers(-8, 8, (4, cols)).astype(np.float32) * np.float32(0.125)
    yield "grid", g  # exact grid points and ties of the legacy types
    # All-zero groups of 32 (and 16) inside blocks whose other groups are not zero, as a model
    # dequantized from a 4-bit file has them: ggml's IQ3_S skips such a group without advancing
    # its point and sign pointers, so the later groups' bytes move up a slot.
    zg = (rng.standard_normal((4, cols)) * 0.02).astype(np.float32)
    zg[0, 0:32] = 0.0
    zg[1, 64:96] = 0.0
    zg[1, 160:192] = 0.0
    zg[1, 256 + 224:] = 0.0
    zg[2, :224] = 0.0
    zg[2, 256 + 32:256 + 64] = 0.0
    zg[3, 16:32] = 0.0
    zg[3, 192:224] = 0.0
    zg[3, 256::3] = 0.0
    yield "zero-groups", zg


def importance(rng, cols):
    """(name, per-column weights) pairs shaped like llama-imatrix's means of squared
    activations: positive, spread over decades, with a few dead (zero) columns."""
    yield "imatrix", (rng.lognormal(0.0, 1.5, cols) * 1e-2).astype(np.float32)
    w = (rng.lognormal(0.0, 0.5, cols)).astype(np.float32)
    w[::13] = 0.0
    w[64:96] = 0.0  # a whole 32-block without weight
    yield "imatrix-dead", w


def gguf_py_quantize(llama, name, x):
    sys.path.insert(0, str(llama / "gguf-py"))
    from gguf import quants, GGMLQuantizationType  # noqa: E402
    qt = getattr(GGMLQuantizationType, name)
    try:
        return quants.quantize(x, qt).tobytes()
    except NotImplementedError:
        return None


def gguf_py_dequantize(llama, name, q, shape):
    sys.path.insert(0, str(llama / "gguf-py"))
    from gguf import quants, GGMLQuantizationType  # noqa: E402
    qt = getattr(GGMLQuantizationType, name)
    rows = np.frombuffer(q, np.uint8).reshape(shape[0], -1)
    return np.ascontiguousarray(quants.dequantize(rows, qt), np.float32).tobytes()


def main():
    llama = source_dir(sys.argv[1] if len(sys.argv) > 1 else None)
    work = pathlib.Path(tempfile.mkdtemp())
    exe = build(llama, work)
    rng = np.random.default_rng(20261201)
    cases, checked = [], 0
    for input_name, x in inputs(rng):
        x = np.ascontiguousarray(x, np.float32)
        (work / "x.bin").write_bytes(x.tobytes())
        cols = x.shape[1]
        for name in TYPES:
            if name in NEEDS_WEIGHTS:
                q = None
            else:
                subprocess.run([str(exe), name, str(work / "x.bin"), str(cols),
                                str(work / "q.bin")], check=True)
                q = (work / "q.bin").read_bytes()
            if q is not None:
                py = gguf_py_quantize(llama, name, x)
                if py is not None:
                    assert py == q, f"gguf-py disagrees with ggml-quants.c: {name} {input_name}"
                    checked += 1
                y = gguf_py_dequantize(llama, name, q, x.shape)
                cases.append({"input": input_name, "type": name, "shape": list(x.shape),
                              "x": x.tobytes().hex(), "q": q.hex(), "y": y.hex()})
            for wname, w in importance(np.random.default_rng(20261204), cols):
                if name not in WEIGHTED:
                    continue
                (work / "w.bin").write_bytes(w.tobytes())
                subprocess.run([str(exe), name, str(work / "x.bin"), str(cols),
                                str(work / "q.bin"), str(work / "w.bin")], check=True)
                q = (work / "q.bin").read_bytes()
                y = gguf_py_dequantize(llama, name, q, x.shape)
                cases.append({"input": f"{input_name}+{wname}", "type": name,
                              "shape": list(x.shape), "x": x.tobytes().hex(), "w": w.tobytes().hex(),
                              "q": q.hex(), "y": y.hex()})
    OUT.write_text(json.dumps({"source": SDIST, "cases": cases}, indent=0))
    print(f"{len(cases)} cases ({checked} also checked against gguf-py) → {OUT}")


if __name__ == "__main__":
    main()
