//! bitsandbytes' 4-bit layout against bitsandbytes and transformers themselves
//! (`tests/compat/llama-tiny/bnb-<type>/`, made by `tests/compat/bnb_ref.py`: the tiny Llama
//! loaded with `BitsAndBytesConfig(load_in_4bit, nf4 | fp4, double quantization)` and saved):
//!
//! - `kiln export --output-format bnb` writes what transformers saves: the same tensors, the
//!   same 4-bit codes, the same quant maps and `quantization_config`; the double-quantized
//!   absmax agree but for the offset's last bit (torch sums the absmax in an order that
//!   depends on the CPU's vector width; kiln's mean is the correctly rounded one);
//! - kiln reads transformers' checkpoint: each decoded weight equals bitsandbytes'
//!   `dequantize_4bit`.

use crate::common;
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::export::recipe::{Format, Recipe};
use kiln_runtime::export::run::{ExportOptions, OutputFormat, run};
use kiln_runtime::model::candle::{DType, Device};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn refs(ty: &str) -> PathBuf {
    common::root().join(format!("tests/compat/llama-tiny/bnb-{ty}"))
}

fn export(ty: &str, out: &Path) {
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "bnb".into(),
            format: ty.into(),
        }),
        force: true,
        ..ExportOptions::new(
            common::root().join("tests/compat/llama-tiny/model"),
            out,
            Recipe::new(Format::Fp8),
        )
    };
    run(&options).unwrap_or_else(|e| panic!("{e}"));
}

fn bytes(c: &Checkpoint, name: &str) -> Vec<u8> {
    let mut b = Vec::new();
    c.read(name, &mut b).unwrap();
    b
}

fn f32s(c: &Checkpoint, name: &str) -> Vec<f32> {
    c.read_as::<f32>(name).unwrap()
}

#[test]
fn kiln_writes_what_transformers_saves() {
    let tmp = tempfile::tempdir().unwrap();
    for ty in ["nf4", "fp4"] {
        let out = tmp.path().join(ty);
        export(ty, &out);
        let (ours, theirs) = (
            Checkpoint::open(&out).unwrap(),
            Checkpoint::open(refs(ty).join("transformers")).unwrap(),
        );
        let names = |c: &Checkpoint| {
            let mut v: Vec<String> = c.tensors().map(|t| t.name.clone()).collect();
            v.sort();
            v
        };
        assert_eq!(names(&ours), names(&theirs), "{ty}: tensor names");
        let (mut codes, mut same_codes) = (0usize, 0usize);
        for t in theirs.tensors() {
            let o = ours.tensor(&t.name).unwrap();
            assert_eq!(
                (o.dtype, &o.shape),
                (t.dtype, &t.shape),
                "{ty} `{}`",
                t.name
            );
            let n = &t.name;
            if n.ends_with(".absmax") {
                // 8-bit codes of absmax − offset: the offset may be an ulp apart.
                let (a, b) = (bytes(&ours, n), bytes(&theirs, n));
                codes += b.len();
                same_codes += a.iter().zip(&b).filter(|(x, y)| x == y).count();
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.abs_diff(*y) <= 1),
                    "{ty} `{n}`: absmax codes more than one step apart"
                );
            } else if n.ends_with(".nested_absmax") {
                for (x, y) in f32s(&ours, n).iter().zip(f32s(&theirs, n)) {
                    assert!(
                        (x - y).abs() <= 4.0 * f32::EPSILON * y.abs(),
                        "{ty} `{n}`: {x} vs {y}"
                    );
                }
            } else if n.contains(".quant_state.") {
                let parse =
                    |c: &Checkpoint| -> Value { serde_json::from_slice(&bytes(c, n)).unwrap() };
                let (mut a, mut b) = (parse(&ours), parse(&theirs));
                let (oa, ob) = (
                    a["nested_offset"].take().as_f64().unwrap(),
                    b["nested_offset"].take().as_f64().unwrap(),
                );
                assert!(
                    (oa - ob).abs() <= 2.0 * f64::from(f32::EPSILON) * ob.abs(),
                    "{ty} `{n}`: offset {oa} vs {ob}"
                );
                assert_eq!(a, b, "{ty} `{n}`");
            } else {
                assert_eq!(bytes(&ours, n), bytes(&theirs, n), "{ty} `{n}`");
            }
        }
        assert!(
            same_codes * 100 >= codes * 99,
            "{ty}: {same_codes} of {codes} absmax codes"
        );
        eprintln!("{ty}: {same_codes} of {codes} double-quantized absmax codes identical");
        let qc = |d: &Path| -> Value {
            serde_json::from_str::<Value>(&std::fs::read_to_string(d.join("config.json")).unwrap())
                .unwrap()["quantization_config"]
                .clone()
        };
        assert_eq!(
            qc(&out),
            qc(&refs(ty).join("transformers")),
            "{ty}: quantization_config"
        );
        // kiln verify reads it back against the original.
        let v = kiln_runtime::formats::verify(
            &common::root().join("tests/compat/llama-tiny/model"),
            &out,
        )
        .unwrap();
        assert!(v.problems.is_empty(), "{ty}: {:?}", v.problems);
        assert_eq!(v.weight_errors.len(), 14, "{ty}");
    }
}

#[test]
fn kiln_decodes_transformers_checkpoints_as_bitsandbytes_does() {
    for ty in ["nf4", "fp4"] {
        let w = kiln_runtime::formats::load_weights(
            &refs(ty).join("transformers"),
            DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let file = std::fs::read(refs(ty).join("dequantized.safetensors")).unwrap();
        let want = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(want.len(), 2, "{ty}");
        for (name, view) in want.tensors() {
            assert_eq!(view.dtype(), safetensors::Dtype::BF16);
            let theirs: Vec<f32> = view
                .data()
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect();
            let ours: Vec<f32> = w
                .get(&name)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(ours, theirs, "{ty} `{name}`");
        }
    }
}
