//! GGUF files against llama.cpp's own Python package, gguf-py (`tests/gguf/check.py`): kiln
//! reads a file gguf-py wrote, and gguf-py reads a file kiln wrote — every metadata type, and
//! tensors in F32 / F16 / BF16 and each block quantization kiln writes, decoded by gguf-py's
//! dequantizers to kiln's values.

use half::{bf16, f16};
use kiln_kernels::ops::gguf::{GgufType, dequantize, quantize};
use kiln_runtime::formats::gguf::container::{GgufFile, GgufWriter, Value};
use serde_json::json;
use std::path::Path;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn kiln_reads_a_file_gguf_py_wrote() {
    let f = GgufFile::open(&root().join("tests/gguf/gguf_py.gguf")).unwrap();
    assert_eq!(f.metadata["general.architecture"].as_str(), Some("llama"));
    assert_eq!(f.metadata["llama.block_count"], Value::U32(2));
    assert_eq!(f.metadata["llama.rope.freq_base"], Value::F32(10000.0));
    assert_eq!(f.metadata["general.flag"], Value::Bool(true));
    assert_eq!(f.metadata["general.big"], Value::I64(-(1 << 40)));
    assert_eq!(
        f.metadata["tokenizer.ggml.tokens"],
        Value::Array(
            ["<s>", "</s>", "hello"]
                .map(|s| Value::String(s.into()))
                .to_vec()
        )
    );
    assert_eq!(
        f.metadata["tokenizer.ggml.token_type"],
        Value::Array(vec![Value::I32(3), Value::I32(3), Value::I32(1)])
    );
    let names: Vec<&str> = f.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "token_embd.weight",
            "blk.0.attn_norm.weight",
            "blk.0.attn_q.weight"
        ]
    );
    let norm = f.tensor("blk.0.attn_norm.weight").unwrap();
    assert_eq!((norm.dims.clone(), norm.ggml_type), (vec![8], 1));
    let values: Vec<f32> = f
        .read(norm)
        .unwrap()
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    assert_eq!(values, (0..8).map(|i| i as f32).collect::<Vec<_>>());
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!((q.dims.clone(), q.ggml_type), (vec![64, 2], 8));
    let mut x = vec![0f32; 128];
    dequantize(GgufType::Q8_0, &f.read(q).unwrap(), &mut x).unwrap();
    assert!(x.iter().all(|v| v.is_finite() && v.abs() < 6.0));
}

/// (name, dims, ggml type, gguf-py's type name, bytes, kiln's decoded values)
type Written = (String, Vec<u64>, u32, String, Vec<u8>, Vec<f32>);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn gguf_py_reads_a_file_kiln_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kiln.gguf");
    let s = |v: &str| Value::String(v.into());
    let metadata: Vec<(String, Value, &str, serde_json::Value)> = vec![
        (
            "general.architecture".into(),
            s("llama"),
            "STRING",
            json!("llama"),
        ),
        ("t.u8".into(), Value::U8(200), "UINT8", json!(200)),
        ("t.i8".into(), Value::I8(-100), "INT8", json!(-100)),
        ("t.u16".into(), Value::U16(60000), "UINT16", json!(60000)),
        ("t.i16".into(), Value::I16(-30000), "INT16", json!(-30000)),
        (
            "t.u32".into(),
            Value::U32(4_000_000_000),
            "UINT32",
            json!(4_000_000_000u32),
        ),
        (
            "t.i32".into(),
            Value::I32(-2_000_000_000),
            "INT32",
            json!(-2_000_000_000),
        ),
        ("t.f32".into(), Value::F32(0.5), "FLOAT32", json!(0.5)),
        ("t.bool".into(), Value::Bool(false), "BOOL", json!(false)),
        (
            "t.u64".into(),
            Value::U64(1 << 50),
            "UINT64",
            json!(1u64 << 50),
        ),
        (
            "t.i64".into(),
            Value::I64(-(1 << 50)),
            "INT64",
            json!(-(1i64 << 50)),
        ),
        ("t.f64".into(), Value::F64(0.25), "FLOAT64", json!(0.25)),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(vec![s("<s>"), s("ü"), s("")]),
            "ARRAY",
            json!(["<s>", "ü", ""]),
        ),
        (
            "t.f32s".into(),
            Value::Array(vec![Value::F32(1.5), Value::F32(-2.0)]),
            "ARRAY",
            json!([1.5, -2.0]),
        ),
    ];
    let x: Vec<f32> = (0..512)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.05)
        .collect();
    let mut tensors: Vec<Written> = vec![
        (
            "f32".into(),
            vec![8, 2],
            0,
            "F32".into(),
            x[..16].iter().flat_map(|v| v.to_le_bytes()).collect(),
            x[..16].to_vec(),
        ),
        (
            "f16".into(),
            vec![16],
            1,
            "F16".into(),
            x[..16]
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            x[..16].iter().map(|v| f16::from_f32(*v).to_f32()).collect(),
        ),
        (
            "bf16".into(),
            vec![16],
            30,
            "BF16".into(),
            x[..16]
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            x[..16]
                .iter()
                .map(|v| bf16::from_f32(*v).to_f32())
                .collect(),
        ),
    ];
    for ty in GgufType::ALL {
        let mut q = vec![0u8; ty.bytes_for(x.len())];
        if kiln_kernels::ops::gguf::needs_weights(ty) {
            let w = vec![1f32; 256];
            kiln_kernels::ops::gguf::quantize_with(ty, &x, 256, Some(&w), &mut q).unwrap();
        } else {
            quantize(ty, &x, 256, &mut q).unwrap();
        }
        let mut y = vec![0f32; x.len()];
        dequantize(ty, &q, &mut y).unwrap();
        tensors.push((
            format!("blk.0.{}", ty.name().to_lowercase()),
            vec![256, 2],
            ty.ggml_type(),
            ty.name().into(),
            q,
            y,
        ));
    }
    let meta: Vec<(String, Value)> = metadata
        .iter()
        .map(|m| (m.0.clone(), m.1.clone()))
        .collect();
    let infos: Vec<(String, Vec<u64>, u32)> = tensors
        .iter()
        .map(|t| (t.0.clone(), t.1.clone(), t.2))
        .collect();
    let mut w = GgufWriter::create(&path, &meta, &infos).unwrap();
    for t in &tensors {
        w.write_tensor(&t.0, &t.4).unwrap();
    }
    w.finish().unwrap();
    // kiln reads its own file back.
    let back = GgufFile::open(&path).unwrap();
    for (k, v, _, _) in &metadata {
        assert_eq!(&back.metadata[k], v, "{k}");
    }
    for t in &tensors {
        let info = back.tensor(&t.0).unwrap();
        assert_eq!(back.read(info).unwrap(), t.4, "{}", t.0);
    }
    let expected = json!({
        "metadata": metadata.iter().map(|m| (m.0.clone(), json!([m.2, m.3]))).collect::<serde_json::Map<_, _>>(),
        "tensors": tensors.iter().map(|t| json!({
            "name": t.0, "dims": t.1, "type": t.3, "bytes": hex(&t.4), "values": t.5,
        })).collect::<Vec<_>>(),
    });
    let want = dir.path().join("expected.json");
    std::fs::write(&want, serde_json::to_vec(&expected).unwrap()).unwrap();
    let has_gguf_py = std::process::Command::new("python3")
        .args(["-c", "import gguf"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_gguf_py {
        assert!(
            std::env::var_os("KILN_REQUIRE_GGUF_PY").is_none(),
            "KILN_REQUIRE_GGUF_PY is set but python3 cannot import gguf (pip install gguf==0.19.0)"
        );
        eprintln!(
            "skipped: python3 has no gguf-py (pip install gguf==0.19.0); the check did not run"
        );
        return;
    }
    let out = std::process::Command::new("python3")
        .arg(root().join("tests/gguf/check.py"))
        .args(["read".as_ref(), path.as_os_str(), want.as_os_str()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gguf-py refused kiln's file:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok:"));
}
