//! The number formats against vectors from ml_dtypes (`tests/vectors/gen.py`), bit for bit:
//! every bf16 value to E4M3FN and E5M2, every FP8 code decoded, and the E2M1 sweep.

use half::bf16;
use kiln_kernels::formats::{Overflow, fp4, fp8};

fn vector(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/vectors/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e} (run tests/vectors/gen.py)"))
}

/// Every bf16 bit pattern as f32, in pattern order.
fn every_bf16() -> impl Iterator<Item = (u16, f32)> {
    (0..=u16::MAX).map(|bits| (bits, bf16::from_bits(bits).to_f32()))
}

fn check_all(name: &str, convert: impl Fn(f32) -> u8) {
    let expected = vector(name);
    assert_eq!(expected.len(), 1 << 16);
    let mut wrong = Vec::new();
    for (bits, x) in every_bf16() {
        let got = convert(x);
        if got != expected[bits as usize] {
            wrong.push(format!(
                "bf16 {bits:#06x} ({x:e}): got {got:#04x}, ml_dtypes {:#04x}",
                expected[bits as usize]
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{name}: {} of 65536 differ, first: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(8)]
    );
}

#[test]
fn every_bf16_to_e4m3fn_matches_ml_dtypes() {
    check_all("bf16_to_e4m3fn.bin", |x| {
        fp8::f32_to_e4m3(x, Overflow::NonSaturating)
    });
}

#[test]
fn every_bf16_to_e4m3fn_saturating_matches_clip_then_cast() {
    check_all("bf16_to_e4m3fn_sat.bin", |x| {
        fp8::f32_to_e4m3(x, Overflow::Saturate)
    });
}

#[test]
fn every_bf16_to_e5m2_matches_ml_dtypes() {
    check_all("bf16_to_e5m2.bin", |x| {
        fp8::f32_to_e5m2(x, Overflow::NonSaturating)
    });
}

fn check_decode(name: &str, decode: impl Fn(u8) -> f32) {
    let expected: Vec<f32> = vector(name)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    for code in 0..=255u8 {
        let (got, want) = (decode(code), expected[code as usize]);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "{name}: code {code:#04x} → {got}, ml_dtypes {want}"
        );
    }
}

#[test]
fn every_fp8_code_decodes_like_ml_dtypes() {
    check_decode("e4m3fn_to_f32.bin", fp8::e4m3_to_f32);
    check_decode("e5m2_to_f32.bin", fp8::e5m2_to_f32);
}

#[test]
fn e2m1_sweep_with_every_tie_matches_the_formats_rule() {
    let data = vector("e2m1_sweep.bin");
    let n = data.len() / 5;
    let (inputs, codes) = data.split_at(n * 4);
    for (x, &want) in inputs
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .zip(codes)
    {
        assert_eq!(
            fp4::f32_to_e2m1_nvfp4(x),
            want,
            "x = {x:e} ({:#010x})",
            x.to_bits()
        );
    }
}
