//! MLX's quantize (feature `mlx`, MLX's CPU device here; its Metal GPU where MLX sees one)
//! against kiln's readable reference `ops::mlx`, bit for bit, on property-generated inputs;
//! and where MLX's modes differ from the ModelOpt formats of the same name, the exact
//! differences docs/MLX.md lists.

use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::mlx::{MlxKernels, metal_available};
use kiln_kernels::ops::mlx::{FpMode, affine_words, quantize_affine, quantize_fp};
use kiln_kernels::ops::{mx, nvfp4};
use proptest::prelude::*;

fn reference_fp<T: Element>(
    mode: FpMode,
    w: &[T],
    cols: usize,
    g: Option<f32>,
) -> (Vec<u8>, Vec<u8>) {
    let mut p = vec![0u8; mode.packed_len(w.len())];
    let mut s = vec![0u8; w.len() / mode.group()];
    quantize_fp(mode, w, cols, g, &mut p, &mut s).unwrap();
    (p, s)
}

fn reference_affine<T: Element>(
    w: &[T],
    cols: usize,
    group: usize,
    bits: usize,
) -> (Vec<u32>, Vec<T>, Vec<T>) {
    let mut p = vec![0u32; affine_words(w.len(), bits)];
    let mut s = vec![T::from_f32_zero(); w.len() / group];
    let mut b = s.clone();
    quantize_affine(w, cols, group, bits, &mut p, &mut s, &mut b).unwrap();
    (p, s, b)
}

fn kernels() -> Vec<(&'static str, MlxKernels)> {
    let mut k = vec![("cpu", MlxKernels::cpu().unwrap())];
    if metal_available() {
        k.push(("gpu", MlxKernels::gpu().unwrap()));
    } else {
        eprintln!("MLX sees no Metal GPU here: the GPU half of these tests did not run");
    }
    k
}

/// Every mode and dtype on one input.
fn check_all<T: Element + std::fmt::Debug>(w: &[T], cols: usize) -> Result<(), TestCaseError> {
    let amax = w.iter().fold(0f32, |m, x| m.max(x.to_f32().abs()));
    for (device, k) in kernels() {
        for mode in [FpMode::Mxfp4, FpMode::Mxfp8, FpMode::Nvfp4] {
            for g in [None, Some(amax)] {
                if g.is_some() && (mode != FpMode::Nvfp4 || amax == 0.0) {
                    continue;
                }
                let got = k.quantize_fp(mode, w, cols, g).unwrap();
                let want = reference_fp(mode, w, cols, g);
                prop_assert_eq!(&got.1, &want.1, "{} {} {:?} scales", device, mode.name(), g);
                prop_assert_eq!(&got.0, &want.0, "{} {} {:?} codes", device, mode.name(), g);
            }
        }
        for bits in [2, 4, 8] {
            for group in [32, 64, 128] {
                if !cols.is_multiple_of(group) {
                    continue;
                }
                let got = k.quantize_affine(w, cols, group, bits).unwrap();
                let got = (got.packed, got.scales, got.biases);
                let want = reference_affine(w, cols, group, bits);
                prop_assert_eq!(got.0, want.0, "{} affine {}/{} codes", device, bits, group);
                prop_assert_eq!(
                    bytemuck::cast_slice::<T, u8>(&got.1),
                    bytemuck::cast_slice::<T, u8>(&want.1),
                    "{} affine {}/{} scales",
                    device,
                    bits,
                    group
                );
                prop_assert_eq!(
                    bytemuck::cast_slice::<T, u8>(&got.2),
                    bytemuck::cast_slice::<T, u8>(&want.2),
                    "{} affine {}/{} biases",
                    device,
                    bits,
                    group
                );
            }
        }
    }
    Ok(())
}

/// Rows of finite values over many magnitudes, with exact E2M1 ties and zeros mixed in.
fn matrix() -> impl Strategy<Value = (Vec<f32>, usize)> {
    (1usize..4, prop::sample::select(vec![128usize, 256]), -30i32..10).prop_flat_map(|(rows, cols, p)| {
        let scale = 2f32.powi(p);
        let value = prop_oneof![
            6 => (-1.0f32..1.0).prop_map(move |x| x * scale),
            1 => prop::sample::select(vec![0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, -2.5])
                .prop_map(move |x| x * scale),
            1 => Just(0.0f32),
            1 => Just(-0.0f32),
        ];
        (prop::collection::vec(value, rows * cols), Just(cols))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn mlx_equals_the_reference_f32((w, cols) in matrix()) {
        check_all(&w, cols)?;
    }

    #[test]
    fn mlx_equals_the_reference_bf16((w, cols) in matrix()) {
        let w: Vec<bf16> = w.iter().map(|&x| bf16::from_f32(x)).collect();
        check_all(&w, cols)?;
    }

    #[test]
    fn mlx_equals_the_reference_f16((w, cols) in matrix()) {
        let w: Vec<f16> = w.iter().map(|&x| f16::from_f32(x)).collect();
        check_all(&w, cols)?;
    }
}

/// One group of ties and zeros whose largest magnitude is 6 (all scales exactly 1).
fn ties() -> Vec<f32> {
    let mut w = vec![0f32; 32];
    w[..12].copy_from_slice(&[
        6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 0.0, -0.75, -0.0,
    ]);
    w[16..20].copy_from_slice(&[6.0, 0.75, 1.75, 3.5]);
    w
}

#[test]
fn mxfp8_equals_modelopts_except_the_scale_of_an_all_zero_block() {
    let k = MlxKernels::cpu().unwrap();
    let mut w: Vec<f32> = (0..256)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
        .collect();
    w[32..64].fill(0.0);
    let (q, s) = k.quantize_fp(FpMode::Mxfp8, &w, 128, None).unwrap();
    let (mut mq, mut ms) = (vec![0u8; 256], vec![0u8; 8]);
    mx::quantize_mxfp8(&w, 128, &mut mq, &mut ms).unwrap();
    assert_eq!(q, mq);
    assert_eq!(
        (s[1], ms[1]),
        (127, 0),
        "all zero: MLX 2^0, ModelOpt 2^-127"
    );
    s.iter()
        .zip(&ms)
        .enumerate()
        .filter(|(i, _)| *i != 1)
        .for_each(|(i, (a, b))| assert_eq!(a, b, "block {i}"));
}

#[test]
fn mxfp4_equals_modelopts_up_to_the_sign_of_zero_codes() {
    let k = MlxKernels::cpu().unwrap();
    let w = ties();
    let (q, s) = k.quantize_fp(FpMode::Mxfp4, &w, 32, None).unwrap();
    let (mut mq, mut ms) = (vec![0u8; 16], vec![0u8; 1]);
    mx::quantize_mxfp4(&w, 32, &mut mq, &mut ms).unwrap();
    assert_eq!(s, ms);
    let codes = |b: &[u8]| b.iter().flat_map(|x| [x & 15, x >> 4]).collect::<Vec<u8>>();
    let (mlx, modelopt) = (codes(&q), codes(&mq));
    for (i, (a, b)) in mlx.iter().zip(&modelopt).enumerate() {
        if a & 7 == 0 {
            // ModelOpt writes 0x8 for zero and for negatives that round to zero; MLX 0x0.
            assert_eq!((*a, b & 7), (0, 0), "element {i}");
        } else {
            assert_eq!(a, b, "element {i}: both round ties toward zero");
        }
    }
    assert_eq!((mlx[9], modelopt[9]), (0x0, 0x8), "exact zero");
}

#[test]
fn nvfp4_rounds_ties_toward_zero_where_modelopt_rounds_to_even() {
    let k = MlxKernels::cpu().unwrap();
    let w = ties();
    let amax = 6.0;
    let (q, s) = k.quantize_fp(FpMode::Nvfp4, &w, 32, Some(amax)).unwrap();
    let (mut mq, mut ms) = (vec![0u8; 16], vec![0u8; 2]);
    nvfp4::quantize_nvfp4(
        &w,
        &[1, 32],
        nvfp4::nvfp4_global_scale(amax),
        &mut mq,
        &mut ms,
    )
    .unwrap();
    assert_eq!(s, ms, "bmax = amax: both scales are 448");
    // 0.75, 1.75 and 3.5 are the ties where half-even rounds up; MLX rounds them down.
    assert_eq!(
        (q[1] & 15, mq[1] & 15),
        (1, 2),
        "0.75 → 0.5 (MLX) / 1.0 (ModelOpt)"
    );
    assert_eq!((q[2] & 15, mq[2] & 15), (3, 4), "1.75 → 1.5 / 2.0");
    assert_eq!((q[3] & 15, mq[3] & 15), (5, 6), "3.5 → 3 / 4");
    assert_eq!((q[1] >> 4, mq[1] >> 4), (2, 2), "1.25 → 1.0 in both");
}

#[test]
fn bad_shapes_and_parameters_are_named_errors() {
    let k = MlxKernels::cpu().unwrap();
    let w = vec![0f32; 48];
    let e = k
        .quantize_fp(FpMode::Mxfp4, &w, 48, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of the block size 32"), "{e}");
    let e = k.quantize_affine(&w, 48, 64, 3).unwrap_err().to_string();
    assert!(e.contains("bits 3 with group size 64"), "{e}");
    let e = k.quantize_affine(&w, 48, 32, 4).unwrap_err().to_string();
    assert!(e.contains("multiple of the block size 32"), "{e}");
}
