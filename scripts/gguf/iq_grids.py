#!/usr/bin/env python3
"""Extracts llama.cpp's i-quant lattices from the pinned sources into
kernels/src/ops/gguf_iq_grids.rs: the five `kgrid_*` tables of `ggml-quants.c`
(`iq2xs_init_impl`: 256, 512 and 1024 points of eight 2-bit levels for IQ2_XXS, IQ2_XS and
IQ2_S; `iq3xs_init_impl`: 256 and 512 points of four 3-bit levels for IQ3_XXS and IQ3_S). They
are data (chosen by search, not by a formula); the dequantization grids of `ggml-common.h`
follow from them level by level, and kiln derives those and the neighbour maps at run time
as llama.cpp does.

    python3 scripts/gguf/iq_grids.py [LLAMA_CPP_DIR]   # default: .llama-cpp/src/…/vendor/llama.cpp
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / ".llama-cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
OUT = ROOT / "kernels/src/ops/gguf_iq_grids.rs"
TABLES = [("kgrid_2bit_256", "IQ2_XXS", 256), ("kgrid_2bit_512", "IQ2_XS", 512),
          ("kgrid_2bit_1024", "IQ2_S", 1024), ("kgrid_256", "IQ3_XXS", 256),
          ("kgrid_512", "IQ3_S", 512)]


def main():
    src = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else SRC
    c = (src / "ggml/src/ggml-quants.c").read_text()
    out = ["//! llama.cpp's i-quant lattices (`kgrid_*` of `ggml-quants.c`, llama-cpp-python 0.3.36),",
           "//! written by `scripts/gguf/iq_grids.py`: each point packs its levels, 2 or 3 bits each,",
           "//! lowest first. Do not edit.", ""]
    for name, ty, n in TABLES:
        i = c.index(f"static const uint16_t {name}[")
        body = c[c.index("{", i) + 1:c.index("}", i)]
        vals = [int(v) for v in re.findall(r"\d+", re.sub(r"//.*", "", body))]
        assert len(vals) == n, (name, len(vals))
        out.append(f"/// {ty}'s {n} points (`{name}`).")
        out.append(f"pub(super) const {name.upper()}: [u16; {n}] = [")
        for k in range(0, n, 12):
            out.append("    " + " ".join(f"{v}," for v in vals[k:k + 12]))
        out.append("];")
        out.append("")
    OUT.write_text("\n".join(out))
    print(f"→ {OUT}")


if __name__ == "__main__":
    main()
