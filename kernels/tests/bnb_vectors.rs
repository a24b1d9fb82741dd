//! kiln's bitsandbytes arithmetic (`ops::bnb`) against bitsandbytes 0.50.2 itself
//! (`tests/vectors/bnb_cases.json`, made by `tests/vectors/bnb_gen.py` on the CPU): for seeded
//! weights in f32, bf16 and f16, NF4 and FP4, with and without double quantization, the same
//! packed codes, the same absmax (and with double quantization the same nested codes and
//! nested absmax, given bitsandbytes' offset), and the same decoded values.

use half::{bf16, f16};
use kiln_kernels::ops::bnb::{self, DYNAMIC, QuantType};
use serde_json::Value;

/// The generator `bnb_gen.py` draws the inputs from.
fn inputs(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed;
    let mut out: Vec<f64> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 2001) as f64 - 1000.0
        })
        .map(|k| k / 20000.0)
        .collect();
    for v in out.iter_mut().take(7) {
        *v = 0.0;
    }
    if n >= 256 {
        for v in &mut out[64..128] {
            *v = 0.0;
        }
        out[133] = 1.5;
    }
    out
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn kiln_quantizes_as_bitsandbytes_does() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vectors/bnb_cases.json"),
    )
    .unwrap();
    let d: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(floats(&d["nf4"]), bnb::NF4.to_vec());
    assert_eq!(floats(&d["fp4"]), bnb::FP4.to_vec());
    assert_eq!(floats(&d["dynamic"]), DYNAMIC.to_vec());
    let cases = d["cases"].as_array().unwrap();
    assert!(cases.len() >= 17);
    for c in cases {
        let (rows, cols) = (
            c["rows"].as_u64().unwrap() as usize,
            c["cols"].as_u64().unwrap() as usize,
        );
        let n = rows * cols;
        let name = format!(
            "{}×{} {} {} nested={}",
            rows, cols, c["dtype"], c["quant_type"], c["nested"]
        );
        // The input as bitsandbytes saw it: f64 → f32 → the weight's dtype, widened to f32.
        let x: Vec<f32> = inputs(c["seed"].as_u64().unwrap(), n)
            .into_iter()
            .map(|v| {
                let v = v as f32;
                match c["dtype"].as_str().unwrap() {
                    "bfloat16" => bf16::from_f32(v).to_f32(),
                    "float16" => f16::from_f32(v).to_f32(),
                    _ => v,
                }
            })
            .collect();
        let ty = match c["quant_type"].as_str().unwrap() {
            "nf4" => QuantType::Nf4,
            _ => QuantType::Fp4,
        };
        let mut packed = vec![0u8; n.div_ceil(2)];
        let mut absmax = vec![0f32; n.div_ceil(64)];
        bnb::quantize_4bit(ty, &x, 64, &mut packed, &mut absmax).unwrap();
        let want: Vec<u8> = (0..c["packed"].as_str().unwrap().len() / 2)
            .map(|i| {
                u8::from_str_radix(&c["packed"].as_str().unwrap()[2 * i..2 * i + 2], 16).unwrap()
            })
            .collect();
        let same = packed.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert_eq!(same, want.len(), "{name}: packed codes");
        let block_absmax = if c["nested"].as_bool().unwrap() {
            let offset = c["offset"].as_f64().unwrap() as f32;
            // kiln's offset: the correctly rounded mean (torch's sum order is the CPU's).
            let ours = bnb::mean(&absmax);
            assert!(
                (ours - offset).abs() <= 2.0 * f32::EPSILON * offset.abs(),
                "{name}: offset {ours} vs {offset}"
            );
            let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
            let mut codes = vec![0u8; centred.len()];
            let mut nested = vec![0f32; centred.len().div_ceil(256)];
            bnb::quantize_blockwise(&DYNAMIC, &centred, 256, &mut codes, &mut nested).unwrap();
            let want_codes: Vec<u8> = c["absmax_codes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u8)
                .collect();
            assert_eq!(codes, want_codes, "{name}: nested codes");
            assert_eq!(nested, floats(&c["nested_absmax"]), "{name}: nested absmax");
            let mut back = vec![0f32; codes.len()];
            bnb::dequantize_blockwise(&DYNAMIC, &codes, &nested, 256, &mut back).unwrap();
            let back: Vec<f32> = back.iter().map(|v| v + offset).collect();
            assert_eq!(back, floats(&c["block_absmax"]), "{name}: decoded absmax");
            back
        } else {
            assert_eq!(absmax, floats(&c["absmax"]), "{name}: absmax");
            absmax
        };
        if let Some(deq) = c.get("dequantized") {
            let mut out = vec![0f32; n];
            bnb::dequantize_4bit(ty, &packed, &block_absmax, 64, &mut out).unwrap();
            // bitsandbytes returns the weight's dtype.
            let out: Vec<f32> = out
                .into_iter()
                .map(|v| match c["dtype"].as_str().unwrap() {
                    "bfloat16" => bf16::from_f32(v).to_f32(),
                    "float16" => f16::from_f32(v).to_f32(),
                    _ => v,
                })
                .collect();
            assert_eq!(out, floats(deq), "{name}: decoded");
        }
    }
}
