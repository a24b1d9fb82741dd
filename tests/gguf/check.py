"""llama.cpp's Python package `gguf` (gguf-py, pinned 0.19.0) against kiln's GGUF files.

    python3 tests/gguf/check.py read FILE.gguf EXPECTED.json
        reads a file kiln wrote with gguf-py's GGUFReader: every metadata key, its GGUF value
        type and value, every tensor's name, ggml type, dimensions, bytes, and its values
        decoded by gguf-py's own dequantizers, must equal EXPECTED.json (written by kiln's
        test, tests/it/gguf.rs). Exit 0 and "ok" when they do.
    python3 tests/gguf/check.py write OUT.gguf
        writes the fixture kiln's reader is tested on (tests/gguf/gguf_py.gguf) with gguf-py's
        GGUFWriter.
"""

import json
import sys

import numpy as np
import gguf
from gguf import GGUFReader, GGUFValueType, GGMLQuantizationType, quants


def read(path, expected_path):
    want = json.load(open(expected_path))
    r = GGUFReader(path)
    fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert sorted(fields) == sorted(want["metadata"]), (sorted(fields), sorted(want["metadata"]))
    for key, (ty, value) in want["metadata"].items():
        f = fields[key]
        assert f.types[0].name == ty, (key, f.types, ty)
        got = f.contents()
        if ty == "FLOAT32":
            got = float(np.float32(got))
        elif ty == "ARRAY" and f.types[1] == GGUFValueType.FLOAT32:
            got = [float(np.float32(v)) for v in got]
        assert got == value, (key, got, value)
    assert [t.name for t in r.tensors] == [t["name"] for t in want["tensors"]]
    for t, w in zip(r.tensors, want["tensors"]):
        assert t.tensor_type.name == w["type"], (t.name, t.tensor_type, w["type"])
        assert [int(d) for d in t.shape] == w["dims"], (t.name, t.shape, w["dims"])
        raw = np.asarray(t.data).tobytes()
        assert raw.hex() == w["bytes"], t.name
        values = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(-1)
        want_v = np.array(w["values"], np.float32)
        assert values.shape == want_v.shape, (t.name, values.shape, want_v.shape)
        assert np.allclose(values, want_v, rtol=1e-6, atol=0), (t.name, values[:4], want_v[:4])
    print(f"ok: {len(fields)} metadata keys, {len(r.tensors)} tensors")


def write(path):
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_string("general.name", "fixture")
    w.add_bool("general.flag", True)
    w.add_int64("general.big", -(1 << 40))
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "hello"])
    w.add_array("tokenizer.ggml.token_type", [3, 3, 1])
    rng = np.random.default_rng(7)
    w.add_tensor("token_embd.weight", rng.standard_normal((2, 8)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.arange(8, dtype=np.float16))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", quants.quantize(x, GGMLQuantizationType.Q8_0),
                 raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    if sys.argv[1] == "read":
        read(sys.argv[2], sys.argv[3])
    else:
        write(sys.argv[2])
