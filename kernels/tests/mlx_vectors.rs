//! kiln's reference of MLX's quantization modes (`ops::mlx`) against MLX itself:
//! `tests/vectors/mlx_cases.json`, written by MLX 0.32.2 on its CPU device
//! (`tests/vectors/mlx_gen.py`) for random, tied, zero, constant, subnormal and outlier inputs in
//! f32, bf16 and f16. Every output byte must match. Runs in the default build; with feature
//! `mlx`, `tests/mlx.rs` also checks live MLX against the reference.

use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::ops::mlx::{FpMode, affine_words, quantize_affine, quantize_fp};
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn cases() -> Vec<Value> {
    let path = format!(
        "{}/tests/vectors/mlx_cases.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["mlx"], "0.32.2");
    v["cases"].as_array().unwrap().clone()
}

fn check<T: Element>(case: &Value) {
    let id = format!(
        "{} {} {} bits={} group={} global={}",
        case["input"],
        case["dtype"],
        case["mode"],
        case["bits"],
        case["group"],
        case["global_amax"]
    );
    let w: Vec<T> = bytemuck::pod_collect_to_vec(&unhex(case["w"].as_str().unwrap()));
    let cols = case["shape"][1].as_u64().unwrap() as usize;
    let (q, scales) = (
        unhex(case["q"].as_str().unwrap()),
        unhex(case["scales"].as_str().unwrap()),
    );
    let mode = case["mode"].as_str().unwrap();
    if mode == "affine" {
        let bits = case["bits"].as_u64().unwrap() as usize;
        let group = case["group"].as_u64().unwrap() as usize;
        let mut p = vec![0u32; affine_words(w.len(), bits)];
        let mut s = vec![T::from_f32_zero(); w.len() / group];
        let mut b = s.clone();
        quantize_affine(&w, cols, group, bits, &mut p, &mut s, &mut b).unwrap();
        assert_eq!(bytemuck::cast_slice::<u32, u8>(&p), &q[..], "{id}: codes");
        assert_eq!(
            bytemuck::cast_slice::<T, u8>(&s),
            &scales[..],
            "{id}: scales"
        );
        let biases = unhex(case["biases"].as_str().unwrap());
        assert_eq!(
            bytemuck::cast_slice::<T, u8>(&b),
            &biases[..],
            "{id}: biases"
        );
    } else {
        let mode = match mode {
            "mxfp4" => FpMode::Mxfp4,
            "mxfp8" => FpMode::Mxfp8,
            _ => FpMode::Nvfp4,
        };
        let global = case["global_amax"].as_f64().map(|a| a as f32);
        let mut p = vec![0u8; mode.packed_len(w.len())];
        let mut s = vec![0u8; w.len() / mode.group()];
        quantize_fp(mode, &w, cols, global, &mut p, &mut s).unwrap();
        assert_eq!(s, scales, "{id}: scales");
        assert_eq!(p, q, "{id}: codes");
    }
}

#[test]
fn the_reference_reproduces_mlx_bit_for_bit() {
    let cases = cases();
    assert!(cases.len() > 300);
    for case in &cases {
        match case["dtype"].as_str().unwrap() {
            "F32" => check::<f32>(case),
            "BF16" => check::<bf16>(case),
            _ => check::<f16>(case),
        }
    }
}
