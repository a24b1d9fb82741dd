//! Every fast CPU path equals the readable reference, bit for bit: the dispatched function
//! (AVX-512 or AVX2 where the CPU has it), the portable path, and the AVX2 and AVX-512 kernels
//! called directly where the CPU has them (the test says which it could not run) — on
//! random shapes (tails shorter than a vector included) and values mixing magnitudes, exact
//! E2M1/E4M3 ties and special values, in bf16, f16 and f32.

use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::cpu::{self, portable};
use kiln_kernels::ops::{amax as ramax, fp8, int, mx, nvfp4};
use proptest::prelude::*;

fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -1.0f32..1.0,
        2 => -500.0f32..500.0,
        1 => -1e-3f32..1e-3,
        1 => prop::sample::select(vec![
            0.0, -0.0, 0.25, -0.75, 1.25, 1.75, 2.5, -3.5, 5.0, 6.0, 448.0, 464.0, -465.0, 1e30,
            f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-39, -2e-45,
        ]),
        1 => any::<u32>().prop_map(f32::from_bits),
    ]
}

fn as_t<T: Element>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn same_f32(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn check_all<T: Element>(
    v: &[f32],
    rows: usize,
    cols: usize,
    blocks16: bool,
) -> Result<(), TestCaseError> {
    let w: Vec<T> = as_t(v);
    let n = w.len();

    // amax: NaN is NaN; otherwise exact.
    let want = ramax::amax(&w);
    prop_assert!(same_f32(cpu::amax(&w), want));
    prop_assert!(same_f32(portable::amax(&w), want));
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        // SAFETY: features detected just above.
        let got = unsafe { cpu::x86::amax(&w) };
        prop_assert!(same_f32(got, want));
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: feature detected just above.
        let got = unsafe { cpu::x86_512::amax(&w) };
        prop_assert!(same_f32(got, want));
    }
    let (mut r1, mut r2) = (vec![0f32; rows], vec![0f32; rows]);
    ramax::amax_rows(&w, rows, cols, &mut r1).unwrap();
    cpu::amax_rows(&w, rows, cols, &mut r2).unwrap();
    prop_assert!(r1.iter().zip(&r2).all(|(a, b)| same_f32(*a, *b)));

    // FP8 per tensor (quotient rounded to T) and per channel (f32 quotient).
    let scale = fp8::fp8_scale(if want.is_finite() && want > 0.0 {
        want
    } else {
        1.0
    });
    let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
    fp8::quantize_fp8_per_tensor(&w, scale, &mut a).unwrap();
    cpu::quantize_fp8_per_tensor(&w, scale, &mut b).unwrap();
    prop_assert_eq!(&a, &b);
    portable::fp8_scaled::<T, true>(&w, scale, &mut b);
    prop_assert_eq!(&a, &b);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        // SAFETY: features detected; equal lengths.
        unsafe { cpu::x86::fp8_scaled::<T, true>(&w, scale, &mut b) };
        prop_assert_eq!(&a, &b);
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: feature detected; equal lengths.
        unsafe { cpu::x86_512::fp8_scaled::<T, true>(&w, scale, &mut b) };
        prop_assert_eq!(&a, &b);
        // The f32 quotient (per expert / per channel), against the reference's stacked form.
        fp8::quantize_fp8_stacked(&w, &[1, 1, n], &[scale], &mut a).unwrap();
        // SAFETY: as above.
        unsafe { cpu::x86_512::fp8_scaled::<T, false>(&w, scale, &mut b) };
        prop_assert_eq!(&a, &b);
        fp8::quantize_fp8_per_tensor(&w, scale, &mut a).unwrap();
    }
    let scales: Vec<f32> = r1
        .iter()
        .map(|&m| fp8::fp8_scale(if m.is_finite() && m > 0.0 { m } else { 1.0 }))
        .collect();
    fp8::quantize_fp8_per_channel(&w, rows, cols, &scales, &mut a).unwrap();
    cpu::quantize_fp8_per_channel(&w, rows, cols, &scales, &mut b).unwrap();
    prop_assert_eq!(&a, &b);

    // FP8 tiles of 4 (small, so edge tiles appear).
    let t = 4;
    let nt = rows.div_ceil(t) * cols.div_ceil(t);
    let (mut t1, mut t2) = (vec![0f32; nt], vec![1f32; nt]);
    ramax::amax_tiles(&w, rows, cols, t, &mut t1).unwrap();
    cpu::amax_tiles(&w, rows, cols, t, &mut t2).unwrap();
    prop_assert!(t1.iter().zip(&t2).all(|(a, b)| same_f32(*a, *b)));
    let ts: Vec<f32> = (0..rows.div_ceil(t) * cols.div_ceil(t))
        .map(|i| 0.01 + i as f32)
        .collect();
    fp8::quantize_fp8_tiles(&w, rows, cols, t, &ts, &mut a).unwrap();
    cpu::quantize_fp8_tiles(&w, rows, cols, t, &ts, &mut b).unwrap();
    prop_assert_eq!(&a, &b);

    // INT8 per channel.
    let (mut qa, mut qb) = (vec![0i8; n], vec![0i8; n]);
    int::quantize_int8_per_channel(&w, rows, cols, &scales, &mut qa).unwrap();
    cpu::quantize_int8_per_channel(&w, rows, cols, &scales, &mut qb).unwrap();
    prop_assert_eq!(&qa, &qb);

    if blocks16 {
        // NVFP4 (cols % 16 == 0).
        let ws2 = nvfp4::nvfp4_global_scale(want);
        let (mut pa, mut sa, mut pb, mut sb) = (
            vec![0u8; n / 2],
            vec![0u8; n / 16],
            vec![0u8; n / 2],
            vec![0u8; n / 16],
        );
        nvfp4::quantize_nvfp4(&w, &[rows, cols], ws2, &mut pa, &mut sa).unwrap();
        cpu::quantize_nvfp4(&w, &[rows, cols], ws2, &mut pb, &mut sb).unwrap();
        prop_assert_eq!(&sa, &sb);
        prop_assert_eq!(&pa, &pb);
        portable::nvfp4(&w, ws2, &mut pb, &mut sb);
        prop_assert_eq!((&sa, &pa), (&sb, &pb));
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            // SAFETY: features detected; whole blocks, buffers sized above.
            unsafe { cpu::x86::nvfp4(&w, ws2, &mut pb, &mut sb) };
            prop_assert_eq!((&sa, &pa), (&sb, &pb));
        }
    }
    if cols.is_multiple_of(32) {
        let (mut qa, mut sa, mut qb, mut sb) = (
            vec![0u8; n],
            vec![0u8; n / 32],
            vec![0u8; n],
            vec![0u8; n / 32],
        );
        mx::quantize_mxfp8(&w, cols, &mut qa, &mut sa).unwrap();
        cpu::quantize_mxfp8(&w, cols, &mut qb, &mut sb).unwrap();
        prop_assert_eq!((&sa, &qa), (&sb, &qb));
        let (mut pa, mut pb) = (vec![0u8; n / 2], vec![0u8; n / 2]);
        mx::quantize_mxfp4(&w, cols, &mut pa, &mut sa).unwrap();
        cpu::quantize_mxfp4(&w, cols, &mut pb, &mut sb).unwrap();
        prop_assert_eq!((&sa, &pa), (&sb, &pb));
    }
    if rows.is_multiple_of(2) && cols.is_multiple_of(8) {
        let gs: Vec<f32> = (0..rows * cols / 8)
            .map(|i| 0.05 + (i % 7) as f32)
            .collect();
        let (mut pa, mut pb) = (vec![0u8; n / 2], vec![0u8; n / 2]);
        int::quantize_int4_groups(&w, rows, cols, 8, &gs, &mut pa).unwrap();
        cpu::quantize_int4_groups(&w, rows, cols, 8, &gs, &mut pb).unwrap();
        prop_assert_eq!(&pa, &pb);
    }
    #[cfg(target_arch = "x86_64")]
    direct_kernels(&w, rows, cols, &scales)?;
    Ok(())
}

/// INT8, INT4, NVFP4, MXFP4 and MXFP8 from each instruction set's kernels called directly (the dispatcher
/// picks only one of them), where the CPU has it.
#[cfg(target_arch = "x86_64")]
fn direct_kernels<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[f32],
) -> Result<(), TestCaseError> {
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
    let avx512 = is_x86_feature_detected!("avx512f");
    let n = w.len();
    if cols > 0 {
        let row = &w[..cols];
        let (mut want, mut got) = (vec![0i8; cols], vec![0i8; cols]);
        int::quantize_int8_per_channel(row, 1, cols, &scales[..1], &mut want).unwrap();
        if avx2 {
            // SAFETY: features detected; equal lengths.
            unsafe { cpu::x86::int8_row(row, scales[0], &mut got) };
            prop_assert_eq!(&want, &got);
        }
        if avx512 {
            // SAFETY: feature detected; equal lengths.
            unsafe { cpu::x86_512::int8_row(row, scales[0], &mut got) };
            prop_assert_eq!(&want, &got);
        }
    }
    if rows >= 2 && cols > 0 && cols.is_multiple_of(16) {
        // Groups of 32 where they fit (both kernels vectorize them), else 16.
        let group = if cols.is_multiple_of(32) { 32 } else { 16 };
        let pair = &w[..2 * cols];
        let gs: Vec<f32> = (0..2 * cols / group)
            .map(|i| 0.05 + (i % 7) as f32)
            .collect();
        let (mut want, mut got) = (vec![0u8; cols], vec![0u8; cols]);
        int::quantize_int4_groups(pair, 2, cols, group, &gs, &mut want).unwrap();
        if avx2 {
            // SAFETY: features detected; a row pair and its scales.
            unsafe { cpu::x86::int4_row_pair(pair, group, &gs, &mut got) };
            prop_assert_eq!(&want, &got);
        }
        if avx512 {
            // SAFETY: feature detected; a row pair and its scales.
            unsafe { cpu::x86_512::int4_row_pair(pair, group, &gs, &mut got) };
            prop_assert_eq!(&want, &got);
        }
    }
    if n > 0 && cols.is_multiple_of(16) && avx512 {
        let ws2 = nvfp4::nvfp4_global_scale(ramax::amax(w));
        let (mut pa, mut sa) = (vec![0u8; n / 2], vec![0u8; n / 16]);
        let (mut pb, mut sb) = (vec![0u8; n / 2], vec![0u8; n / 16]);
        nvfp4::quantize_nvfp4(w, &[rows, cols], ws2, &mut pa, &mut sa).unwrap();
        // SAFETY: feature detected; whole blocks, buffers sized above.
        unsafe { cpu::x86_512::nvfp4(w, ws2, &mut pb, &mut sb) };
        prop_assert_eq!((&sa, &pa), (&sb, &pb));
    }
    if n > 0 && cols.is_multiple_of(32) {
        let (mut pa, mut sa) = (vec![0u8; n / 2], vec![0u8; n / 32]);
        let (mut pb, mut sb) = (vec![0u8; n / 2], vec![0u8; n / 32]);
        mx::quantize_mxfp4(w, cols, &mut pa, &mut sa).unwrap();
        if avx2 {
            // SAFETY: features detected; whole blocks.
            unsafe { cpu::x86::mxfp4(w, &mut pb, &mut sb) };
            prop_assert_eq!((&sa, &pa), (&sb, &pb));
        }
        if avx512 {
            // SAFETY: feature detected; whole blocks.
            unsafe { cpu::x86_512::mxfp4(w, &mut pb, &mut sb) };
            prop_assert_eq!((&sa, &pa), (&sb, &pb));
        }
    }
    if n > 0 && cols.is_multiple_of(32) {
        let (mut qa, mut sa) = (vec![0u8; n], vec![0u8; n / 32]);
        let (mut qb, mut sb) = (vec![0u8; n], vec![0u8; n / 32]);
        mx::quantize_mxfp8(w, cols, &mut qa, &mut sa).unwrap();
        if avx2 {
            // SAFETY: features detected; whole blocks.
            unsafe { cpu::x86::mxfp8(w, &mut qb, &mut sb) };
            prop_assert_eq!((&sa, &qa), (&sb, &qb));
        }
        if avx512 {
            // SAFETY: feature detected; whole blocks.
            unsafe { cpu::x86_512::mxfp8(w, &mut qb, &mut sb) };
            prop_assert_eq!((&sa, &qa), (&sb, &qb));
        }
    }
    Ok(())
}

fn shape_and_values() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (
        1usize..6,
        prop_oneof![1usize..40, Just(16), Just(32), Just(48), Just(64), Just(96)],
    )
        .prop_flat_map(|(r, c)| (Just(r), Just(c), prop::collection::vec(value(), r * c)))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fast_paths_equal_the_reference_bf16((rows, cols, v) in shape_and_values()) {
        check_all::<bf16>(&v, rows, cols, cols.is_multiple_of(16))?;
    }

    #[test]
    fn fast_paths_equal_the_reference_f16((rows, cols, v) in shape_and_values()) {
        check_all::<f16>(&v, rows, cols, cols.is_multiple_of(16))?;
    }

    #[test]
    fn fast_paths_equal_the_reference_f32((rows, cols, v) in shape_and_values()) {
        check_all::<f32>(&v, rows, cols, cols.is_multiple_of(16))?;
    }
}

#[test]
fn large_tensors_split_over_threads_give_the_same_bytes() {
    // 3 × CHUNK + a ragged tail, so several rayon tasks and a SIMD tail are involved.
    let n = 3 * (1 << 16) + 16 * 37;
    let w: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(((i * 7919) % 2003) as f32 / 97.0 - 10.0))
        .collect();
    let ws2 = nvfp4::nvfp4_global_scale(ramax::amax(&w));
    let (mut pa, mut sa, mut pb, mut sb) = (
        vec![0u8; n / 2],
        vec![0u8; n / 16],
        vec![0u8; n / 2],
        vec![0u8; n / 16],
    );
    nvfp4::quantize_nvfp4(&w, &[n / 16, 16], ws2, &mut pa, &mut sa).unwrap();
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| cpu::quantize_nvfp4(&w, &[n / 16, 16], ws2, &mut pb, &mut sb))
            .unwrap();
        assert_eq!((&sa, &pa), (&sb, &pb), "{threads} threads");
        assert_eq!(pool.install(|| cpu::amax(&w)), ramax::amax(&w));
    }
}

/// Every f32 whose low 12 mantissa bits are zero, and neighbours: every exponent, sign and
/// rounding position the 8-bit formats can see.
fn dense_f32() -> Vec<f32> {
    (0u32..1 << 20)
        .flat_map(|hi| {
            let b = hi << 12;
            [
                b,
                b.wrapping_add(1),
                b.wrapping_sub(1),
                b | 0x800,
                (b | 0x800).wrapping_add(1),
            ]
            .map(f32::from_bits)
        })
        .collect()
}

#[test]
fn fp8_lanes_equal_the_reference_on_a_dense_f32_sweep() {
    // Scale 1 makes the quotient the input itself: the E4M3 encoder sees every pattern.
    let x = dense_f32();
    let (mut want, mut got) = (vec![0u8; x.len()], vec![0u8; x.len()]);
    fp8::quantize_fp8_stacked(&x, &[1, 1, x.len()], &[1.0], &mut want).unwrap();
    cpu::quantize_fp8_stacked(&x, &[1, 1, x.len()], &[1.0], &mut got).unwrap();
    let bad = want.iter().zip(&got).position(|(a, b)| a != b);
    assert!(
        bad.is_none(),
        "x = {:e}: {:#x} vs {:#x}",
        x[bad.unwrap()],
        want[bad.unwrap()],
        got[bad.unwrap()]
    );
}

#[test]
fn bf16_rounding_lanes_equal_the_reference() {
    // bf16 inputs over several scales: the f32 quotients hit every bf16 rounding case.
    let w: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
    for scale in [1.0f32, 3.0, 0.1, 7.3e-5, 1e30] {
        let (mut want, mut got) = (vec![0u8; w.len()], vec![0u8; w.len()]);
        fp8::quantize_fp8_per_tensor(&w, scale, &mut want).unwrap();
        cpu::quantize_fp8_per_tensor(&w, scale, &mut got).unwrap();
        assert_eq!(want, got, "scale {scale}");
    }
}

#[test]
fn e2m1_lanes_equal_the_reference_on_every_tie() {
    // Blocks whose max is 6 with ws2 = 6/2688: the block scale is 448, the divisor exactly 1,
    // so the E2M1 encoder sees the values themselves.
    let mut sweep: Vec<f32> = (0..=6000).map(|i| i as f32 / 1000.0).collect();
    for t in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] {
        sweep.extend([
            t,
            f32::from_bits(t.to_bits() - 1),
            f32::from_bits(t.to_bits() + 1),
        ]);
    }
    sweep.extend([0.0, -0.0, 1e-40]);
    let mut w = Vec::new();
    for chunk in sweep.chunks(15) {
        w.push(6.0f32);
        w.extend(
            chunk
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % 2 == 0 { v } else { -v }),
        );
        w.resize(w.len().div_ceil(16) * 16, 0.5);
    }
    let ws2 = nvfp4::nvfp4_global_scale(6.0);
    let n = w.len();
    let (mut pa, mut sa, mut pb, mut sb) = (
        vec![0u8; n / 2],
        vec![0u8; n / 16],
        vec![0u8; n / 2],
        vec![0u8; n / 16],
    );
    nvfp4::quantize_nvfp4(&w, &[n / 16, 16], ws2, &mut pa, &mut sa).unwrap();
    cpu::quantize_nvfp4(&w, &[n / 16, 16], ws2, &mut pb, &mut sb).unwrap();
    assert!(sa.iter().all(|&s| s == 0x7e), "divisor is 1");
    assert_eq!(sa, sb);
    assert_eq!(pa, pb);
}

#[test]
fn int_lanes_round_half_even_clamp_and_zero_nan_like_the_reference() {
    // Quarter steps over ±150 at scale 1: every .5 tie, both clamps, and specials.
    let mut v: Vec<f32> = (-600..=600).map(|i| i as f32 / 4.0).collect();
    v.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -0.0, 1e-40]);
    v.resize(v.len().div_ceil(256) * 256, 7.5);
    int_ties::<f32>(&v);
    int_ties::<bf16>(&v);
    int_ties::<f16>(&v);
}

fn int_ties<T: Element>(v: &[f32]) {
    let (rows, cols) = (v.len() / 256, 256);
    {
        let w: Vec<T> = as_t(v);
        let ones = vec![1.0f32; rows];
        let (mut a, mut b) = (vec![0i8; v.len()], vec![0i8; v.len()]);
        int::quantize_int8_per_channel(&w, rows, cols, &ones, &mut a).unwrap();
        cpu::quantize_int8_per_channel(&w, rows, cols, &ones, &mut b).unwrap();
        assert_eq!(a, b);
        let rows2 = rows / 2 * 2;
        let n2 = rows2 * cols;
        let gs = vec![1.0f32; rows2 * 2];
        let (mut pa, mut pb) = (vec![0u8; n2 / 2], vec![0u8; n2 / 2]);
        int::quantize_int4_groups(&w[..n2], rows2, cols, 128, &gs, &mut pa).unwrap();
        cpu::quantize_int4_groups(&w[..n2], rows2, cols, 128, &gs, &mut pb).unwrap();
        assert_eq!(pa, pb);
    }
}

#[test]
fn mx_lanes_equal_the_reference_across_magnitudes_and_specials() {
    // Blocks spanning 2^-140 … 2^120, with E2M1 ties, zeros, Inf and NaN sprinkled in.
    let mut v = Vec::new();
    for e in (-140..120).step_by(3) {
        let base = 2f32.powi(e);
        for i in 0..32 {
            let x = match i {
                0 => 6.0 * base,
                1 => 0.25 * base,
                2 => -5.0 * base,
                3 => 0.0,
                4 if e % 7 == 0 => f32::NAN,
                5 if e % 11 == 0 => f32::INFINITY,
                _ => base * (i as f32 / 5.0 - 3.0),
            };
            v.push(x);
        }
    }
    // Blocks with max 6 (exponent 0): every bound and its neighbours one ulp away, both signs.
    let mut near = Vec::new();
    for b in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] {
        near.extend([
            b,
            f32::from_bits(b.to_bits() - 1),
            f32::from_bits(b.to_bits() + 1),
        ]);
    }
    for chunk in near.chunks(15) {
        v.push(6.0);
        v.extend(chunk.iter().flat_map(|&x| [x, -x]));
        v.resize(v.len().div_ceil(32) * 32, 0.0);
    }
    for w in [
        as_t::<bf16>(&v)
            .iter()
            .map(|x| x.to_f32())
            .collect::<Vec<f32>>(),
        v.clone(),
    ] {
        let n = w.len();
        let (mut qa, mut sa, mut qb, mut sb) = (
            vec![0u8; n],
            vec![0u8; n / 32],
            vec![0u8; n],
            vec![0u8; n / 32],
        );
        mx::quantize_mxfp8(&w, 32, &mut qa, &mut sa).unwrap();
        cpu::quantize_mxfp8(&w, 32, &mut qb, &mut sb).unwrap();
        assert_eq!((&sa, &qa), (&sb, &qb));
        let (mut pa, mut pb) = (vec![0u8; n / 2], vec![0u8; n / 2]);
        mx::quantize_mxfp4(&w, 32, &mut pa, &mut sa).unwrap();
        cpu::quantize_mxfp4(&w, 32, &mut pb, &mut sb).unwrap();
        assert_eq!((&sa, &pa), (&sb, &pb));
        let wb: Vec<bf16> = as_t(&w);
        mx::quantize_mxfp4(&wb, 32, &mut pa, &mut sa).unwrap();
        cpu::quantize_mxfp4(&wb, 32, &mut pb, &mut sb).unwrap();
        assert_eq!((&sa, &pa), (&sb, &pb));
    }
}

#[test]
fn reports_which_instruction_sets_were_exercised() {
    println!("dispatched kernels: {:?}", cpu::isa());
    // The dispatcher picks the widest set the CPU has, unless KILN_CPU narrows it.
    #[cfg(target_arch = "x86_64")]
    {
        let forced = std::env::var("KILN_CPU").unwrap_or_default();
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
        let want = if forced == "scalar" || !avx2 {
            cpu::Isa::Portable
        } else if forced != "avx2" && is_x86_feature_detected!("avx512f") {
            cpu::Isa::Avx512
        } else {
            cpu::Isa::Avx2
        };
        assert_eq!(cpu::isa(), want, "KILN_CPU={forced:?}");
    }
    #[cfg(target_arch = "x86_64")]
    for (feature, present) in [
        (
            "avx2+f16c",
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"),
        ),
        ("avx512f", is_x86_feature_detected!("avx512f")),
        ("avx512bf16 (bf16 GEMM)", cpu::bf16_matmul::available()),
    ] {
        if present {
            println!("{feature}: present, its kernels are compared with the reference");
        } else {
            println!("{feature}: not on this CPU, its kernels are NOT exercised here (skipped)");
        }
    }
}

/// Values for the k-quant searches: ordinary weights, sub-blocks that are constant (the
/// searches' early exits), zero, one-signed or near the search's ties, heavy tails and
/// infinities. No NaN: a NaN's payload reaches the bytes through the scale searches' sums, and
/// which of two NaN operands an addition returns is left open by IEEE 754 and chosen by the
/// compiler (llama.cpp's C has the same freedom), so a NaN input has no single right answer.
fn kquant_values() -> impl Strategy<Value = Vec<f32>> {
    let block = prop_oneof![
        4 => prop::collection::vec(-1.0f32..1.0, 256),
        2 => prop::collection::vec(0.0f32..0.05, 256),
        1 => prop::collection::vec(
            prop::sample::select(vec![0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -3.0, 1e-20, -7.5]),
            256
        ),
        1 => (-2.0f32..2.0, 0usize..16).prop_map(|(c, k)| {
            // Constant sub-blocks (of 16 and of 32) in an otherwise varied block.
            (0..256)
                .map(|i| if (i / 16) % 4 == k % 4 { c } else { (i as f32 * 0.37).sin() })
                .collect()
        }),
        1 => prop::collection::vec(
            value().prop_map(|v| if v.is_nan() { f32::NEG_INFINITY } else { v }),
            256
        ),
    ];
    prop::collection::vec(block, 1..4).prop_map(|b| b.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The lane searches (portable, AVX2) write the reference's k-quant and IQ4 bytes (IQ4_NL
    /// also on a length that leaves blocks past the last group of eight).
    #[test]
    fn kquant_searches_equal_the_reference(x in kquant_values()) {
        use kiln_kernels::ops::gguf::{GgufType, quantize};
        let short = &x[..x.len() - 96];
        for (ty, x) in [
            (GgufType::Q2K, &x[..]),
            (GgufType::Q3K, &x[..]),
            (GgufType::Q4K, &x[..]),
            (GgufType::Q5K, &x[..]),
            (GgufType::Q6K, &x[..]),
            (GgufType::Iq4Xs, &x[..]),
            (GgufType::Iq4Nl, &x[..]),
            (GgufType::Iq4Nl, short),
        ] {
            let cols = if ty == GgufType::Iq4Nl { 32 } else { 256 };
            let mut want = vec![0u8; ty.bytes_for(x.len())];
            quantize(ty, x, cols, &mut want).unwrap();
            let mut got = vec![0u8; want.len()];
            portable::quantize_gguf(ty, x, &mut got).unwrap();
            prop_assert!(
                got == want,
                "{} portable: byte {:?}",
                ty.name(),
                got.iter().zip(&want).position(|(a, b)| a != b)
            );
            cpu::quantize_gguf(ty, x, cols, &mut got).unwrap();
            prop_assert!(got == want, "{} dispatched", ty.name());
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                // SAFETY: features detected just above.
                unsafe { cpu::x86::quantize_gguf(ty, x, &mut got) }.unwrap();
                prop_assert!(got == want, "{} avx2", ty.name());
            }
        }
    }
}

/// Values for the legacy types' blocks of 32: ordinary weights, blocks whose extreme appears
/// with both signs or as a signed zero, exact halves of the scale (the codes' ties), subnormal
/// extremes (whose scale's inverse overflows), magnitudes whose range overflows, and blocks with
/// infinities and NaN (which run the reference's own code).
fn legacy_values() -> impl Strategy<Value = Vec<f32>> {
    let block = prop_oneof![
        4 => prop::collection::vec(-1.0f32..1.0, 32),
        2 => prop::collection::vec(value(), 32),
        1 => prop::collection::vec(
            prop::sample::select(vec![0.0, -0.0, 3.0, -3.0, 1.5, -1.5, 0.375, 2.625, -0.1875]),
            32
        ),
        1 => (1u32..64, any::<bool>()).prop_map(|(k, neg)| {
            // Multiples of max / 16 and max / 62: the halves `v · id + 8.5` lands on.
            let m = if neg { -(k as f32) } else { k as f32 };
            (0..32).map(|i| m * ((i as f32) - 16.0) / [16.0, 62.0][i % 2]).collect()
        }),
        1 => prop::collection::vec(
            prop::sample::select(vec![0.0, -0.0, 1e-45, -1e-45, 3e-44, -2e-40, 1e-39]),
            32
        ),
        // Zeros of both signs alone, and one-signed blocks with both zeros: the least
        // (greatest) value is a signed zero.
        1 => prop::collection::vec(prop::sample::select(vec![0.0f32, -0.0]), 32),
        1 => (prop::collection::vec(
            prop::sample::select(vec![0.0, -0.0, 0.25, 1.0, 0.0, -0.0]),
            32
        ), any::<bool>()).prop_map(|(v, neg)| {
            if neg { v.into_iter().map(|x| -x).collect() } else { v }
        }),
        1 => prop::collection::vec(
            prop::sample::select(vec![3e38, -3e38, 1e38, 0.5, -0.0, f32::MAX, -f32::MAX]),
            32
        ),
    ];
    prop::collection::vec(block, 1..9).prop_map(|b| b.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The legacy types' and MXFP4's vector kernels (AVX2, and the dispatched threads) write the
    /// reference's bytes, NaN and infinities included.
    #[test]
    fn legacy_blocks_equal_the_reference(x in legacy_values()) {
        use kiln_kernels::ops::gguf::{GgufType, quantize};
        for ty in [
            GgufType::Q4_0,
            GgufType::Q4_1,
            GgufType::Q5_0,
            GgufType::Q5_1,
            GgufType::Q8_0,
            GgufType::Mxfp4,
        ] {
            let mut want = vec![0u8; ty.bytes_for(x.len())];
            quantize(ty, &x, 32, &mut want).unwrap();
            let mut got = vec![0u8; want.len()];
            cpu::quantize_gguf(ty, &x, 32, &mut got).unwrap();
            prop_assert!(
                got == want,
                "{} dispatched: byte {:?}",
                ty.name(),
                got.iter().zip(&want).position(|(a, b)| a != b)
            );
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                got.fill(0);
                // SAFETY: features detected just above.
                unsafe { cpu::x86::quantize_gguf(ty, &x, &mut got) }.unwrap();
                prop_assert!(
                    got == want,
                    "{} avx2: byte {:?} of blocks {:?}",
                    ty.name(),
                    got.iter().zip(&want).position(|(a, b)| a != b),
                    x.len() / 32
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(120))]

    /// Under an importance matrix, the legacy types', the k-quants' and IQ4's weighted lane
    /// searches (portable, dispatched, AVX2) write the reference's bytes
    /// (`quantize_row_q{4,5}_{0,1}_impl`, `quantize_row_q{2,3,4,5,6}_K_impl`,
    /// `quantize_row_iq4_nl_impl`).
    #[test]
    fn weighted_kquant_searches_equal_the_reference(
        x in kquant_values(),
        w in prop::collection::vec(-3.0f32..3.0, 768),
    ) {
        use kiln_kernels::ops::gguf::{GgufType, quantize_with};
        let cols = 256;
        // Importance weights spread over six decades, one per column.
        let wide: Vec<f32> = w.iter().map(|e| 10f32.powf(*e)).collect();
        let qw = &wide[..256];
        // The legacy types' σ² runs over the whole row: also one row of 288 (a group of eight
        // blocks and one left over).
        let long: Vec<f32> = qw.iter().chain(&qw[..32]).copied().collect();
        let legacy_row = (x.len() >= 512).then(|| &x[..288]);
        let mut cases: Vec<(GgufType, &[f32], usize, &[f32])> = [
            GgufType::Q4_0,
            GgufType::Q4_1,
            GgufType::Q5_0,
            GgufType::Q5_1,
            GgufType::Q2K,
            GgufType::Q3K,
            GgufType::Q4K,
            GgufType::Q5K,
            GgufType::Q6K,
            GgufType::Iq4Nl,
            GgufType::Iq4Xs,
        ]
        .into_iter()
        .map(|ty| (ty, &x[..], cols, qw))
        .collect();
        // The k-quants also on one row of all the super-blocks (Q4_K and Q5_K search two
        // at a time, the last one of an odd count alone).
        if x.len() >= 512 {
            for ty in [GgufType::Q2K, GgufType::Q3K, GgufType::Q4K, GgufType::Q5K, GgufType::Q6K] {
                cases.push((ty, &x[..], x.len(), &wide[..x.len()]));
            }
        }
        if let Some(row) = legacy_row {
            for ty in [GgufType::Q4_0, GgufType::Q4_1, GgufType::Q5_0, GgufType::Q5_1] {
                cases.push((ty, row, 288, &long[..]));
            }
        }
        for (ty, x, cols, qw) in cases {
            let mut want = vec![0u8; ty.bytes_for(x.len())];
            quantize_with(ty, x, cols, Some(qw), &mut want).unwrap();
            let mut got = vec![0u8; want.len()];
            portable::quantize_gguf_with(ty, x, cols, qw, &mut got).unwrap();
            prop_assert!(
                got == want,
                "{} portable: byte {:?}",
                ty.name(),
                got.iter().zip(&want).position(|(a, b)| a != b)
            );
            cpu::quantize_gguf_with(ty, x, cols, Some(qw), &mut got).unwrap();
            prop_assert!(got == want, "{} dispatched", ty.name());
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                // SAFETY: features detected just above.
                unsafe { cpu::x86::quantize_gguf_with(ty, x, cols, qw, &mut got) }.unwrap();
                prop_assert!(got == want, "{} avx2", ty.name());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    /// The i-quants' neighbour search in lanes (portable, dispatched, AVX2) picks the
    /// reference's neighbours: the same bytes for every i-quant, with importance weights and
    /// (IQ2_S, IQ3_XXS, IQ3_S) without, on rows of two blocks.
    #[test]
    fn iquant_neighbour_searches_equal_the_reference(
        x in kquant_values(),
        w in prop::collection::vec(-3.0f32..3.0, 512),
    ) {
        use kiln_kernels::ops::gguf::{GgufType, quantize_with};
        let x = &x[..x.len() / 512 * 512];
        prop_assume!(!x.is_empty());
        let cols = 512;
        let qw: Vec<f32> = w.iter().map(|e| 10f32.powf(*e)).collect();
        for ty in [
            GgufType::Iq2Xxs,
            GgufType::Iq2Xs,
            GgufType::Iq2S,
            GgufType::Iq3Xxs,
            GgufType::Iq3S,
        ] {
            let plain = !kiln_kernels::ops::gguf::needs_weights(ty);
            for qw in [Some(&qw[..]), None].into_iter().filter(|q| q.is_some() || plain) {
                let mut want = vec![0u8; ty.bytes_for(x.len())];
                quantize_with(ty, x, cols, qw, &mut want).unwrap();
                let mut got = vec![0u8; want.len()];
                let which = if qw.is_some() { "imatrix" } else { "plain" };
                match qw {
                    Some(qw) => portable::quantize_gguf_with(ty, x, cols, qw, &mut got).unwrap(),
                    None => portable::quantize_gguf(ty, x, &mut got).unwrap(),
                }
                prop_assert!(
                    got == want,
                    "{} {which} portable: byte {:?}",
                    ty.name(),
                    got.iter().zip(&want).position(|(a, b)| a != b)
                );
                got.fill(0);
                cpu::quantize_gguf_with(ty, x, cols, qw, &mut got).unwrap();
                prop_assert!(got == want, "{} {which} dispatched", ty.name());
                #[cfg(target_arch = "x86_64")]
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                    got.fill(0);
                    // SAFETY: features detected just above.
                    match qw {
                        Some(qw) => unsafe { cpu::x86::quantize_gguf_with(ty, x, cols, qw, &mut got) }.unwrap(),
                        None => unsafe { cpu::x86::quantize_gguf(ty, x, &mut got) }.unwrap(),
                    }
                    prop_assert!(got == want, "{} {which} avx2", ty.name());
                }
            }
        }
    }
}

/// bf16 values for the bf16 GEMM: ordinary weights and activations, magnitudes far apart (the
/// order of the sums shows), exact ties of the f32 rounding, denormals (flushed), zeros of both
/// signs, infinities, NaN, and any bit pattern.
fn bf16_bits() -> impl Strategy<Value = u16> {
    prop_oneof![
        6 => (-2.0f32..2.0).prop_map(|x| bf16::from_f32(x).to_bits()),
        2 => (-30i32..30, -1.0f32..1.0)
            .prop_map(|(e, x)| bf16::from_f32(x * 2f32.powi(e)).to_bits()),
        1 => prop::sample::select(vec![
            0x0000u16, 0x8000, 0x0001, 0x807f, 0x0080, 0x3f80, 0x3380, 0x7f80, 0xff80, 0x7fc0,
            0x7f7f, 0xff7f,
        ]),
        1 => any::<u16>(),
    ]
}

fn same_bits(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| !same_f32(*x, *y))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The AVX-512 BF16 GEMM equals `ops::bf16_matmul`'s dot products bit for bit: shapes with
    /// tails of every kind (rows short of a tile, `k` short of a chunk), values from
    /// [`bf16_bits`].
    #[test]
    fn bf16_gemm_equals_the_reference(
        (m, n, k, x, w) in (1usize..11, 1usize..60, 0usize..100).prop_flat_map(|(m, n, k)| (
            Just(m),
            Just(n),
            Just(k),
            prop::collection::vec(bf16_bits(), m * k),
            prop::collection::vec(bf16_bits(), n * k),
        ))
    ) {
        use kiln_kernels::ops::bf16_matmul as r;
        let mut want = vec![0f32; m * n];
        r::matmul_wt(&x, &w, &mut want, (m, n, k)).unwrap();
        let mut got = vec![f32::NAN; m * n];
        if cpu::bf16_matmul::available() {
            cpu::bf16_matmul::matmul_wt(&x, &w, &mut got, (m, n, k)).unwrap();
            prop_assert!(same_bits(&got, &want).is_none(), "({m}, {n}, {k}): {:?}", same_bits(&got, &want));
            // Rounded to bf16 by the threads: the reference's sums, rounded.
            let mut bits = vec![0u16; m * n];
            cpu::bf16_matmul::matmul_wt_bf16(&x, &w, &mut bits, (m, n, k)).unwrap();
            // (A NaN's sign and payload are the hardware's: NaN is NaN, as for the f32 sums.)
            let nan = |b: u16| bf16::from_bits(b).is_nan();
            for (i, (&b, &v)) in bits.iter().zip(&want).enumerate() {
                let r = bf16::from_f32(v).to_bits();
                prop_assert!(b == r || (nan(b) && nan(r)), "({m}, {n}, {k}) output {i}: {b:#06x} vs {r:#06x}");
            }
            // Rounded where the sums lie (autocast's products): the same roundings, as f32.
            let mut rounded = vec![f32::NAN; m * n];
            cpu::bf16_matmul::matmul_wt_rounded(&x, &w, &mut rounded, (m, n, k)).unwrap();
            for (i, (&g, &v)) in rounded.iter().zip(&want).enumerate() {
                let r = bf16::from_f32(v).to_f32();
                prop_assert!(g.to_bits() == r.to_bits() || (g.is_nan() && r.is_nan()), "({m}, {n}, {k}) output {i}: {g} vs {r}");
            }
        } else {
            // Where the CPU lacks it, the kernel refuses by name (the reason is printed by
            // `reports_which_instruction_sets_were_exercised`).
            prop_assert!(cpu::bf16_matmul::matmul_wt(&x, &w, &mut got, (m, n, k)).is_err());
        }
    }
}

/// Real-sized rows (k = 2048, 4099) through whole blocks and threads, values like a
/// Linear's inputs and weights, against the reference.
#[test]
fn bf16_gemm_equals_the_reference_on_layer_shapes() {
    if !cpu::bf16_matmul::available() {
        println!("avx512bf16: not on this CPU (or KILN_CPU narrows it): skipped");
        return;
    }
    use kiln_kernels::ops::bf16_matmul as r;
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for (m, n, k) in [(9, 101, 2048), (5, 50, 4099)] {
        let x: Vec<u16> = (0..m * k)
            .map(|_| bf16::from_f32(next() * 3.0).to_bits())
            .collect();
        let w: Vec<u16> = (0..n * k)
            .map(|_| bf16::from_f32(next() * 0.05).to_bits())
            .collect();
        let mut want = vec![0f32; m * n];
        r::matmul_wt(&x, &w, &mut want, (m, n, k)).unwrap();
        let mut got = vec![0f32; m * n];
        cpu::bf16_matmul::matmul_wt(&x, &w, &mut got, (m, n, k)).unwrap();
        assert_eq!(same_bits(&got, &want), None, "({m}, {n}, {k})");
    }
    // More weight rows than one task's block, so several tasks write the same rows' columns.
    let (m, n, k) = (7, 3 * cpu::bf16_matmul::BLOCK + 5, 300);
    let x: Vec<u16> = (0..m * k)
        .map(|_| bf16::from_f32(next()).to_bits())
        .collect();
    let w: Vec<u16> = (0..n * k)
        .map(|_| bf16::from_f32(next()).to_bits())
        .collect();
    let mut want = vec![0f32; m * n];
    r::matmul_wt(&x, &w, &mut want, (m, n, k)).unwrap();
    let mut got = vec![0f32; m * n];
    cpu::bf16_matmul::matmul_wt(&x, &w, &mut got, (m, n, k)).unwrap();
    assert_eq!(same_bits(&got, &want), None, "({m}, {n}, {k})");
}
