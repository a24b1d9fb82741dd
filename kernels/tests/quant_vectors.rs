//! Every quantizer against `tests/vectors/quant_cases.json`: the same operations computed by
//! the generator's own PyTorch implementation of docs/FORMATS.md, on random and adversarial inputs
//! (zeros, all equal, exact E2M1 ties, a huge outlier, subnormals, ±Inf, NaN) in bf16, f16 and
//! f32. Scales are recomputed here from kiln's own amax; every output byte must match.

use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::ops::{amax, fp8, int, mx, nvfp4};
use serde_json::Value;
use std::collections::BTreeMap;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn i8s(v: &[i8]) -> Vec<u8> {
    v.iter().map(|&x| x as u8).collect()
}

fn elements<T: bytemuck_free::FromLe>(bytes: &[u8]) -> Vec<T> {
    bytes.chunks_exact(T::SIZE).map(T::from_le).collect()
}

mod bytemuck_free {
    pub trait FromLe: Sized {
        const SIZE: usize;
        fn from_le(b: &[u8]) -> Self;
    }
    impl FromLe for half::bf16 {
        const SIZE: usize = 2;
        fn from_le(b: &[u8]) -> Self {
            half::bf16::from_le_bytes([b[0], b[1]])
        }
    }
    impl FromLe for half::f16 {
        const SIZE: usize = 2;
        fn from_le(b: &[u8]) -> Self {
            half::f16::from_le_bytes([b[0], b[1]])
        }
    }
    impl FromLe for f32 {
        const SIZE: usize = 4;
        fn from_le(b: &[u8]) -> Self {
            f32::from_le_bytes([b[0], b[1], b[2], b[3]])
        }
    }
}

/// kiln's outputs for one op, as bytes keyed like the generator's.
fn run<T: Element>(op: &str, w: &[T], shape: &[usize]) -> BTreeMap<&'static str, Vec<u8>> {
    let (rows, cols) = (shape[0], shape[1]);
    let n = w.len();
    let mut out = BTreeMap::new();
    match op {
        "fp8_per_tensor" => {
            let s = fp8::fp8_scale(amax::amax(w));
            let mut q = vec![0u8; n];
            fp8::quantize_fp8_per_tensor(w, s, &mut q).unwrap();
            out.insert("q", q);
            out.insert("scale", f32s(&[s]));
        }
        "fp8_stacked" => {
            let per = n / 2;
            let scales: Vec<f32> = w
                .chunks_exact(per)
                .map(|e| fp8::fp8_scale(amax::amax(e)))
                .collect();
            let mut q = vec![0u8; n];
            fp8::quantize_fp8_stacked(w, &[2, 4, 256], &scales, &mut q).unwrap();
            out.insert("q", q);
            out.insert("scales", f32s(&scales));
        }
        "fp8_per_channel" => {
            let mut a = vec![0f32; rows];
            amax::amax_rows(w, rows, cols, &mut a).unwrap();
            let scales: Vec<f32> = a.iter().map(|&x| fp8::fp8_scale(x)).collect();
            let mut q = vec![0u8; n];
            fp8::quantize_fp8_per_channel(w, rows, cols, &scales, &mut q).unwrap();
            out.insert("q", q);
            out.insert("scales", f32s(&scales));
        }
        "fp8_tiles" => {
            let mut a = vec![0f32; rows.div_ceil(128) * cols.div_ceil(128)];
            amax::amax_tiles(w, rows, cols, 128, &mut a).unwrap();
            let scales: Vec<f32> = a.iter().map(|&x| fp8::fp8_scale(x)).collect();
            let mut q = vec![0u8; n];
            fp8::quantize_fp8_tiles(w, rows, cols, 128, &scales, &mut q).unwrap();
            out.insert("q", q);
            out.insert("scales", f32s(&scales));
        }
        "int8_per_channel" => {
            let mut a = vec![0f32; rows];
            amax::amax_rows(w, rows, cols, &mut a).unwrap();
            let scales: Vec<f32> = a.iter().map(|&x| int::int8_scale(x)).collect();
            let mut q = vec![0i8; n];
            int::quantize_int8_per_channel(w, rows, cols, &scales, &mut q).unwrap();
            out.insert("q", i8s(&q));
            out.insert("scales", f32s(&scales));
        }
        "int4_groups" => {
            let mut a = vec![0f32; n / 128];
            amax::amax_blocks(w, rows, cols, 128, &mut a).unwrap();
            let scales: Vec<f32> = a.iter().map(|&x| int::int4_scale(x)).collect();
            let mut q = vec![0u8; n / 2];
            int::quantize_int4_groups(w, rows, cols, 128, &scales, &mut q).unwrap();
            out.insert("q", q);
            out.insert("scales", f32s(&scales));
        }
        "nvfp4" | "nvfp4_transposed" => {
            let ws2 = nvfp4::nvfp4_global_scale(amax::amax(w));
            let (mut q, mut s) = (vec![0u8; n / 2], vec![0u8; n / 16]);
            if op == "nvfp4" {
                nvfp4::quantize_nvfp4(w, shape, ws2, &mut q, &mut s).unwrap();
                let mut deq = vec![0f32; n];
                nvfp4::dequantize_nvfp4(&q, &s, ws2, &mut deq).unwrap();
                out.insert("deq", f32s(&deq));
            } else {
                nvfp4::quantize_nvfp4_transposed(w, &[2, 32, 32], ws2, &mut q, &mut s).unwrap();
            }
            out.insert("q", q);
            out.insert("scales", s);
            out.insert("ws2", f32s(&[ws2]));
        }
        "mxfp4" => {
            let (mut q, mut s) = (vec![0u8; n / 2], vec![0u8; n / 32]);
            mx::quantize_mxfp4(w, cols, &mut q, &mut s).unwrap();
            out.insert("q", q);
            out.insert("scales", s);
        }
        "mxfp8" => {
            let (mut q, mut s) = (vec![0u8; n], vec![0u8; n / 32]);
            mx::quantize_mxfp8(w, cols, &mut q, &mut s).unwrap();
            out.insert("q", q);
            out.insert("scales", s);
        }
        other => panic!("unknown op {other} in quant_cases.json"),
    }
    out
}

#[test]
fn every_quantizer_matches_the_pytorch_reference_bit_for_bit() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/vectors/quant_cases.json"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for r in doc["results"].as_array().unwrap() {
        let (op, case) = (r["op"].as_str().unwrap(), r["case"].as_str().unwrap());
        let input = &doc["inputs"][case];
        let shape: Vec<usize> = input["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let bytes = unhex(input["hex"].as_str().unwrap());
        let got = match input["dtype"].as_str().unwrap() {
            "bfloat16" => run(op, &elements::<bf16>(&bytes), &shape),
            "float16" => run(op, &elements::<f16>(&bytes), &shape),
            "float32" => run(op, &elements::<f32>(&bytes), &shape),
            d => panic!("dtype {d}"),
        };
        for (key, want) in r["outputs"].as_object().unwrap() {
            let want = unhex(want.as_str().unwrap());
            let Some(got) = got.get(key.as_str()) else {
                failures.push(format!("{op}/{case}: kiln has no output `{key}`"));
                continue;
            };
            checked += 1;
            // Dequantized floats feed error statistics only: a NaN is a NaN whatever its sign.
            let same = if key == "deq" {
                got.chunks_exact(4).zip(want.chunks_exact(4)).all(|(a, b)| {
                    let (a, b) = (
                        f32::from_le_bytes(a.try_into().unwrap()),
                        f32::from_le_bytes(b.try_into().unwrap()),
                    );
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
                }) && got.len() == want.len()
            } else {
                *got == want
            };
            if !same {
                let first = got.iter().zip(&want).position(|(a, b)| a != b);
                let count = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                failures.push(format!(
                    "{op}/{case}/{key}: {count} of {} bytes differ (first at {first:?}; len {} vs {})",
                    want.len(),
                    got.len(),
                    want.len()
                ));
            }
        }
    }
    assert!(checked > 150, "only {checked} outputs checked");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
