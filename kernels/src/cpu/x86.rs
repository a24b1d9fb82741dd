//! AVX2 (+F16C, FMA) kernels, lane-for-lane the steps of `cpu::bits`. Callers check
//! `is_x86_feature_detected!` first (see `cpu::dispatch`).

use super::bits;
use crate::element::Element;
use half::{bf16, f16};
use std::any::TypeId;
use std::arch::x86_64::*;

/// Loads 8 elements of `T` (bf16, f16 or f32) as f32 lanes.
///
/// # Safety
/// AVX2 and F16C must be available; `p` must point to 8 readable elements of `T`.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load8<T: Element>(p: *const T) -> __m256 {
    let t = TypeId::of::<T>();
    // SAFETY: the caller guarantees 8 readable elements at `p` and the CPU features; the
    // TypeId checks make each cast the element's real layout.
    unsafe {
        if t == TypeId::of::<bf16>() {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        } else if t == TypeId::of::<f16>() {
            _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
        } else {
            debug_assert!(t == TypeId::of::<f32>());
            _mm256_loadu_ps(p as *const f32)
        }
    }
}

/// Rounds f32 lanes to `T` and back (RNE); identity for f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn round_to<T: Element>(x: __m256) -> __m256 {
    let t = TypeId::of::<T>();
    if t == TypeId::of::<bf16>() {
        let b = _mm256_castps_si256(x);
        let odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
        let r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
        let r = _mm256_and_si256(r, _mm256_set1_epi32(0xffff_0000u32 as i32));
        // NaN: keep the sign, set the quiet bit, truncate (as `half`).
        let a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
        let nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f80_0000));
        let q = _mm256_and_si256(
            _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000)),
            _mm256_set1_epi32(0xffff_0000u32 as i32),
        );
        _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan))
    } else if t == TypeId::of::<f16>() {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    } else {
        x
    }
}

/// `bits::e4m3_out` on 8 lanes; the codes in the low byte of each i32 lane.
#[inline]
#[target_feature(enable = "avx2")]
fn e4m3_lanes(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
    let a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
    let nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f80_0000));
    let big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43e7_ffff));
    let tie = _mm256_cmpeq_epi32(a, _mm256_set1_epi32(0x43e8_0000));
    let sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c80_0000), a);
    // Subnormal: add 2^14 as a float so the ulp is 2^-9, then subtract its bits.
    let f = _mm256_add_ps(
        _mm256_castsi256_ps(a),
        _mm256_castsi256_ps(_mm256_set1_epi32(141 << 23)),
    );
    let subcode = _mm256_sub_epi32(_mm256_castps_si256(f), _mm256_set1_epi32(141 << 23));
    // Normal: rebias and round the dropped 20 bits to nearest even.
    let odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    let bias = _mm256_set1_epi32(((7i32 - 127) << 23).wrapping_add(0x7_ffff));
    let normcode = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, bias), odd), 20);
    let code = _mm256_blendv_epi8(normcode, subcode, sub);
    let over = _mm256_blendv_epi8(_mm256_set1_epi32(0x7f), _mm256_set1_epi32(0x7e), tie);
    let code = _mm256_blendv_epi8(code, over, big);
    let is_nan_code = _mm256_or_si256(_mm256_cmpeq_epi32(code, _mm256_set1_epi32(0x7f)), nan);
    _mm256_blendv_epi8(
        _mm256_or_si256(code, sign),
        _mm256_set1_epi32(0x7f),
        is_nan_code,
    )
}

/// Packs the low bytes of 4 × 8 i32 lanes into 32 bytes, in order.
#[inline]
#[target_feature(enable = "avx2")]
fn pack32(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    let ab = _mm256_packus_epi32(a, b); // per 128-bit lane: a0..3 b0..3 | a4..7 b4..7
    let cd = _mm256_packus_epi32(c, d);
    let abcd = _mm256_packus_epi16(ab, cd); // a0..3 b0..3 c0..3 d0..3 | a4..7 b4..7 c4..7 d4..7
    _mm256_permutevar8x32_epi32(abcd, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// max |x| with NaN winning (`ops::amax::amax`).
///
/// # Safety
/// AVX2 and F16C must be available.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn amax<T: Element>(x: &[T]) -> f32 {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (mut m0, mut m1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut nan = _mm256_setzero_ps();
    let chunks = x.chunks_exact(16);
    let tail = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` has 16 elements: two loads of 8.
        let (v0, v1) = unsafe { (load8(c.as_ptr()), load8(c.as_ptr().add(8))) };
        let (v0, v1) = (_mm256_and_ps(v0, abs_mask), _mm256_and_ps(v1, abs_mask));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v0, v1));
        m0 = _mm256_max_ps(m0, v0);
        m1 = _mm256_max_ps(m1, v1);
    }
    let m = _mm256_max_ps(m0, m1);
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 f32.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), m) };
    let any_nan = _mm256_movemask_ps(nan) != 0;
    let head = lanes.iter().fold(0f32, |a, &v| a.max(v));
    let tail = crate::ops::amax::amax(tail);
    if any_nan || tail.is_nan() {
        f32::NAN
    } else {
        head.max(tail)
    }
}

/// `portable::fp8_scaled`: FP8 of `w / scale`, the quotient rounded to `T` when `ROUND`.
///
/// # Safety
/// AVX2 and F16C must be available; `out.len() == w.len()`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn fp8_scaled<T: Element, const ROUND: bool>(w: &[T], scale: f32, out: &mut [u8]) {
    let s = _mm256_set1_ps(scale);
    let n32 = w.len() / 32 * 32;
    for (c, o) in w[..n32]
        .chunks_exact(32)
        .zip(out[..n32].chunks_exact_mut(32))
    {
        let p = c.as_ptr();
        // SAFETY: 32 readable elements at `p`, 32 writable bytes in `o`.
        unsafe {
            let q = |i: usize| {
                let x = _mm256_div_ps(load8(p.add(i)), s);
                e4m3_lanes(if ROUND { round_to::<T>(x) } else { x })
            };
            _mm256_storeu_si256(
                o.as_mut_ptr() as *mut __m256i,
                pack32(q(0), q(8), q(16), q(24)),
            );
        }
    }
    super::portable::fp8_scaled::<T, ROUND>(&w[n32..], scale, &mut out[n32..]);
}

/// `bits::e2m1_nvfp4` on 8 lanes (codes in i32 lanes).
#[inline]
#[target_feature(enable = "avx2")]
fn e2m1_lanes(x: __m256) -> __m256i {
    let a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
    let one = _mm256_set1_epi32(1);
    let gt = |b: f32| {
        _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(b))),
            one,
        )
    };
    let ge = |b: f32| {
        _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(b))),
            one,
        )
    };
    let idx = _mm256_add_epi32(
        _mm256_add_epi32(
            _mm256_add_epi32(gt(0.25), ge(0.75)),
            _mm256_add_epi32(gt(1.25), ge(1.75)),
        ),
        _mm256_add_epi32(_mm256_add_epi32(gt(2.5), ge(3.5)), gt(5.0)),
    );
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(a, a));
    let idx = _mm256_blendv_epi8(idx, _mm256_set1_epi32(7), nan);
    let neg = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_setzero_ps()));
    _mm256_or_si256(idx, _mm256_and_si256(neg, _mm256_set1_epi32(8)))
}

/// Packs 8 codes (i32 lanes, even element low) into 4 bytes.
#[inline]
#[target_feature(enable = "avx2")]
fn nibbles4(c: __m256i) -> u32 {
    // Each 64-bit lane holds (even, odd): even | odd << 4 in its low byte.
    let pairs = _mm256_or_si256(c, _mm256_srli_epi64(c, 28));
    let bytes = _mm256_shuffle_epi8(
        pairs,
        _mm256_setr_epi8(
            0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 8, -1, -1, -1, -1, -1,
            -1, -1, -1, -1, -1, -1, -1, -1, -1,
        ),
    );
    let lo = _mm256_extract_epi16::<0>(bytes) as u32 & 0xffff;
    let hi = _mm256_extract_epi16::<8>(bytes) as u32 & 0xffff;
    lo | hi << 16
}

/// `bits::e4m3_to_f32` on 8 lanes of codes.
#[inline]
#[target_feature(enable = "avx2")]
fn e4m3_decode_lanes(c: __m256i) -> __m256 {
    let exp = _mm256_and_si256(_mm256_srli_epi32(c, 3), _mm256_set1_epi32(0xf));
    let man = _mm256_and_si256(c, _mm256_set1_epi32(7));
    let normal = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_add_epi32(exp, _mm256_set1_epi32(120)), 23),
        _mm256_slli_epi32(man, 20),
    );
    let sub = _mm256_castps_si256(_mm256_mul_ps(
        _mm256_cvtepi32_ps(man),
        _mm256_set1_ps(1.0 / 512.0),
    ));
    let is_sub = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
    let m = _mm256_blendv_epi8(normal, sub, is_sub);
    let is_nan = _mm256_cmpeq_epi32(
        _mm256_and_si256(c, _mm256_set1_epi32(0x7f)),
        _mm256_set1_epi32(0x7f),
    );
    let m = _mm256_blendv_epi8(m, _mm256_set1_epi32(0x7fc0_0000), is_nan);
    let sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    _mm256_castsi256_ps(_mm256_or_si256(m, sign))
}

/// Lane i = max of the 8 lanes of `m[i]` (an 8×8 transpose-reduce).
#[inline]
#[target_feature(enable = "avx2")]
fn hmax8(m: [__m256; 8]) -> __m256 {
    let pair =
        |a: __m256, b: __m256| _mm256_max_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    let (x01, x23, x45, x67) = (
        pair(m[0], m[1]),
        pair(m[2], m[3]),
        pair(m[4], m[5]),
        pair(m[6], m[7]),
    );
    let quad = |a: __m256, b: __m256| {
        _mm256_max_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    };
    let (y0, y1) = (quad(x01, x23), quad(x45, x67));
    _mm256_max_ps(
        _mm256_permute2f128_ps::<0x20>(y0, y1),
        _mm256_permute2f128_ps::<0x31>(y0, y1),
    )
}

/// Eight NVFP4 block scales at once from their blocks' `bmax` (NaN lanes where a block has
/// NaN): `bits::nvfp4_block_scale` on 8 lanes. Returns the codes and the divisors
/// `e4m3(scale) · ws2`.
#[inline]
#[target_feature(enable = "avx2")]
fn nvfp4_scales8(bmax: __m256, ws2: f32) -> (__m256i, __m256) {
    let s = _mm256_div_ps(bmax, _mm256_set1_ps(6.0 * ws2));
    let s = _mm256_blendv_ps(
        s,
        _mm256_set1_ps(1.0),
        _mm256_cmp_ps::<_CMP_EQ_OQ>(s, _mm256_setzero_ps()),
    );
    let c = _mm256_min_ps(
        _mm256_max_ps(s, _mm256_set1_ps(1.0 / 512.0)),
        _mm256_set1_ps(448.0),
    );
    let c = _mm256_blendv_ps(c, s, _mm256_cmp_ps::<_CMP_UNORD_Q>(s, s)); // clamp keeps NaN
    let codes = e4m3_lanes(c);
    (
        codes,
        _mm256_mul_ps(e4m3_decode_lanes(codes), _mm256_set1_ps(ws2)),
    )
}

/// NVFP4 of whole 16-element blocks (`ops::nvfp4::quantize_nvfp4` without shape checks):
/// block scales eight at a time, then each block's 16 quotients and codes.
///
/// # Safety
/// AVX2 and F16C must be available; `w.len()` is a multiple of 16, `packed` half of it,
/// `scales` a sixteenth.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn nvfp4<T: Element>(w: &[T], ws2: f32, packed: &mut [u8], scales: &mut [u8]) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let groups = w.len() / 128;
    for g in 0..groups {
        let p = w[g * 128..].as_ptr();
        // SAFETY: 128 readable elements from `p` (g < groups); 64 packed bytes and 8 scale
        // bytes at g·64 and g·8 (the caller sized the buffers).
        unsafe {
            let mut m = [_mm256_setzero_ps(); 8];
            let mut nan_bits = 0;
            for (i, mi) in m.iter_mut().enumerate() {
                let a0 = _mm256_and_ps(load8(p.add(16 * i)), abs_mask);
                let a1 = _mm256_and_ps(load8(p.add(16 * i + 8)), abs_mask);
                nan_bits |=
                    ((_mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(a0, a1)) != 0) as i32) << i;
                *mi = _mm256_max_ps(a0, a1);
            }
            let lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
            let nan_lanes = _mm256_cmpeq_epi32(
                _mm256_and_si256(_mm256_set1_epi32(nan_bits), lane_bit),
                lane_bit,
            );
            let bmax = _mm256_blendv_ps(
                hmax8(m),
                _mm256_set1_ps(f32::NAN),
                _mm256_castsi256_ps(nan_lanes),
            );
            let (codes, divisors) = nvfp4_scales8(bmax, ws2);
            let mut d = [0f32; 8];
            _mm256_storeu_ps(d.as_mut_ptr(), divisors);
            let mut c = [0i32; 8];
            _mm256_storeu_si256(c.as_mut_ptr() as *mut __m256i, codes);
            for i in 0..8 {
                scales[g * 8 + i] = c[i] as u8;
                let di = _mm256_set1_ps(d[i]);
                let lo = nibbles4(e2m1_lanes(_mm256_div_ps(load8(p.add(16 * i)), di)));
                let hi = nibbles4(e2m1_lanes(_mm256_div_ps(load8(p.add(16 * i + 8)), di)));
                let out = packed.as_mut_ptr().add(g * 64 + i * 8);
                std::ptr::write_unaligned(out as *mut u64, (lo as u64) | (hi as u64) << 32);
            }
        }
    }
    let (w, packed, scales) = (
        &w[groups * 128..],
        &mut packed[groups * 64..],
        &mut scales[groups * 8..],
    );
    super::portable::nvfp4(w, ws2, packed, scales);
}

/// Rounds half to even and clamps to [lo, hi]; NaN becomes 0 (`ops::int`'s rule). Lanes as i32.
#[inline]
#[target_feature(enable = "avx2")]
fn to_int_lanes(x: __m256, lo: f32, hi: f32) -> __m256i {
    let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
    let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
    let r = _mm256_blendv_ps(r, _mm256_setzero_ps(), nan);
    _mm256_cvtps_epi32(r)
}

/// Packs 4 × 8 i32 lanes (each in -128..=127) into 32 signed bytes, in order.
#[inline]
#[target_feature(enable = "avx2")]
fn pack32_signed(a: __m256i, b: __m256i, c: __m256i, d: __m256i) -> __m256i {
    let ab = _mm256_packs_epi32(a, b);
    let cd = _mm256_packs_epi32(c, d);
    _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(ab, cd),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    )
}

/// INT8 of one row with one scale (`ops::int::quantize_int8_per_channel` for a row).
///
/// # Safety
/// AVX2 and F16C must be available; `out.len() == w.len()`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn int8_row<T: Element>(w: &[T], scale: f32, out: &mut [i8]) {
    let s = _mm256_set1_ps(scale);
    let n32 = w.len() / 32 * 32;
    for (c, o) in w[..n32]
        .chunks_exact(32)
        .zip(out[..n32].chunks_exact_mut(32))
    {
        let p = c.as_ptr();
        // SAFETY: 32 readable elements at `p`, 32 writable bytes in `o`.
        unsafe {
            let q = |i: usize| to_int_lanes(_mm256_div_ps(load8(p.add(i)), s), -128.0, 127.0);
            _mm256_storeu_si256(
                o.as_mut_ptr() as *mut __m256i,
                pack32_signed(q(0), q(8), q(16), q(24)),
            );
        }
    }
    super::portable::int8_tail(&w[n32..], scale, &mut out[n32..]);
}

/// INT4 of one pair of rows (`ops::int::quantize_int4_groups` with `rows = 2`): `out[c] =
/// q0[c] & 0xF | (q1[c] & 0xF) << 4`, scales `[2, cols / group]`.
///
/// # Safety
/// AVX2 and F16C must be available; `w.len() == 2 * out.len()`, `group` divides `out.len()`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn int4_row_pair<T: Element>(w: &[T], group: usize, scales: &[f32], out: &mut [u8]) {
    let cols = out.len();
    let groups = cols / group;
    let (r0, r1) = w.split_at(cols);
    let mask = _mm256_set1_epi32(0xf);
    let mut c = 0;
    while c + 32 <= cols && (c % group) + 32 <= group {
        let (s0, s1) = (
            _mm256_set1_ps(scales[c / group]),
            _mm256_set1_ps(scales[groups + c / group]),
        );
        // SAFETY: c + 32 ≤ cols: 32 readable elements in each row, 32 writable bytes.
        unsafe {
            let q = |i: usize| {
                let a = to_int_lanes(_mm256_div_ps(load8(r0.as_ptr().add(c + i)), s0), -8.0, 7.0);
                let b = to_int_lanes(_mm256_div_ps(load8(r1.as_ptr().add(c + i)), s1), -8.0, 7.0);
                _mm256_or_si256(
                    _mm256_and_si256(a, mask),
                    _mm256_slli_epi32(_mm256_and_si256(b, mask), 4),
                )
            };
            _mm256_storeu_si256(
                out.as_mut_ptr().add(c) as *mut __m256i,
                pack32(q(0), q(8), q(16), q(24)),
            );
        }
        c += 32;
    }
    super::portable::int4_pair_tail(r0, r1, group, scales, out, c);
}

/// max |x| of 32 elements at `p` as (value, any NaN).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn block32_amax<T: Element>(p: *const T) -> (f32, bool) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // SAFETY: the caller guarantees 32 readable elements at `p`.
    let v = unsafe {
        [
            load8(p),
            load8(p.add(8)),
            load8(p.add(16)),
            load8(p.add(24)),
        ]
    };
    let a = v.map(|x| _mm256_and_ps(x, abs_mask));
    let unord = _mm256_or_ps(
        _mm256_cmp_ps::<_CMP_UNORD_Q>(a[0], a[1]),
        _mm256_cmp_ps::<_CMP_UNORD_Q>(a[2], a[3]),
    );
    let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
    (_mm_cvtss_f32(m), _mm256_movemask_ps(unord) != 0)
}

/// MXFP8 of whole 32-element blocks (`portable::mxfp8`).
///
/// # Safety
/// AVX2 and F16C must be available; `w.len()` a multiple of 32, `q.len() == w.len()`,
/// `scales.len() == w.len() / 32`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn mxfp8<T: Element>(w: &[T], q: &mut [u8], scales: &mut [u8]) {
    use crate::formats::e8m0::e8m0_from_exponent;
    let (lo, hi) = (_mm256_set1_ps(-448.0), _mm256_set1_ps(448.0));
    for ((block, out), scale) in w
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .zip(scales.iter_mut())
    {
        let p = block.as_ptr();
        // SAFETY: 32 readable elements at `p`, 32 writable bytes in `out`.
        unsafe {
            let (m, nan) = block32_amax(p);
            let k = bits::mxfp8_exponent(if nan { f32::NAN } else { m });
            *scale = e8m0_from_exponent(k);
            let f = _mm256_set1_ps(2f64.powi(-k) as f32);
            let e = |i: usize| {
                let x = _mm256_mul_ps(load8(p.add(i)), f);
                // clamp keeps NaN (as f32::clamp does): blend it back after min/max.
                let c = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
                e4m3_lanes(_mm256_blendv_ps(c, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x)))
            };
            _mm256_storeu_si256(
                out.as_mut_ptr() as *mut __m256i,
                pack32(e(0), e(8), e(16), e(24)),
            );
        }
    }
}

/// E2M1 under the MX rule on 8 lanes: `#(bounds < |x|)`, sign bit unless `x > 0`.
#[inline]
#[target_feature(enable = "avx2")]
fn e2m1_mx_lanes(x: __m256) -> __m256i {
    let a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)));
    let one = _mm256_set1_epi32(1);
    let gt = |b: f32| {
        _mm256_and_si256(
            _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(a, _mm256_set1_ps(b))),
            one,
        )
    };
    let idx = _mm256_add_epi32(
        _mm256_add_epi32(
            _mm256_add_epi32(gt(0.25), gt(0.75)),
            _mm256_add_epi32(gt(1.25), gt(1.75)),
        ),
        _mm256_add_epi32(_mm256_add_epi32(gt(2.5), gt(3.5)), gt(5.0)),
    );
    let positive = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_setzero_ps()));
    _mm256_or_si256(idx, _mm256_andnot_si256(positive, _mm256_set1_epi32(8)))
}

/// MXFP4 of whole 32-element blocks (`ops::mx::quantize_mxfp4`).
///
/// # Safety
/// AVX2 and F16C must be available; `w.len()` a multiple of 32, `packed.len() == w.len() / 2`,
/// `scales.len() == w.len() / 32`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn mxfp4<T: Element>(w: &[T], packed: &mut [u8], scales: &mut [u8]) {
    use crate::formats::e8m0::{E8M0_NAN, e8m0_from_exponent};
    for ((block, out), scale) in w
        .chunks_exact(32)
        .zip(packed.chunks_exact_mut(16))
        .zip(scales.iter_mut())
    {
        let p = block.as_ptr();
        // SAFETY: 32 readable elements at `p`, 16 writable bytes in `out`.
        unsafe {
            let (m, nan) = block32_amax(p);
            let k = bits::mxfp4_exponent(if nan { f32::NAN } else { m });
            *scale = k.map_or(E8M0_NAN, e8m0_from_exponent);
            // w / 2^k and w · 2^-k are the same exact value rounded once (2^-k is exact for
            // every k in [-127, 127]), so the multiply gives the reference's bits.
            let f = _mm256_set1_ps(k.map_or(f32::NAN, |k| 2f64.powi(-k) as f32));
            let c = |i: usize| nibbles4(e2m1_mx_lanes(_mm256_mul_ps(load8(p.add(i)), f)));
            let (a, b, e, f) = (c(0), c(8), c(16), c(24));
            std::ptr::write_unaligned(out.as_mut_ptr() as *mut u64, (a as u64) | (b as u64) << 32);
            std::ptr::write_unaligned(
                out.as_mut_ptr().add(8) as *mut u64,
                (e as u64) | (f as u64) << 32,
            );
        }
    }
}

/// The i-quants' neighbour search of `cpu::iquants` compiled for AVX2: the best neighbour of
/// pattern `u` in `lists`, eight neighbours a vector.
///
/// # Safety
/// AVX2 and F16C must be available.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn iq_best(
    lists: &super::iquants::LaneLists,
    u: usize,
    xval: &[f32],
    weight: &[f32],
    scale: f32,
) -> usize {
    use super::{iquants::best, kquants::Avx2};
    if lists.dims() == 8 {
        best::<Avx2, 8>(lists, u, xval, weight, scale)
    } else {
        best::<Avx2, 4>(lists, u, xval, weight, scale)
    }
}

/// The i-quants' candidate fits of `cpu::iquants` compiled for AVX2, eight candidates a
/// vector.
///
/// # Safety
/// AVX2 and F16C must be available.
#[target_feature(enable = "avx2,f16c")]
pub(crate) unsafe fn iq_fits(
    weight: &[f32],
    xval: &[f32],
    cands: &[[i8; 32]],
    out: &mut [(f32, f32)],
) {
    super::iquants::fits::<super::kquants::Avx2>(weight, xval, cands, out)
}

/// Whole blocks of `ty` from `x` into `out`: the legacy types and MXFP4 a block of 32 at a time
/// in vectors (`cpu::legacy`), the k-quant searches of `cpu::kquants` (Q2_K, Q4_K, Q5_K, Q6_K,
/// IQ4) eight sub-blocks a vector and Q3_K's a sub-block's codes at once, the i-quants by
/// `cpu::iquants`.
///
/// # Safety
/// AVX2 and F16C must be available.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn quantize_gguf(
    ty: crate::ops::gguf::GgufType,
    x: &[f32],
    out: &mut [u8],
) -> Result<(), crate::KernelError> {
    if super::legacy::handles(ty) {
        crate::ops::gguf::check_layout(ty, x.len(), x.len().max(32), out.len())?;
        super::legacy::quantize(ty, x, out);
        return Ok(());
    }
    super::kquants::quantize_blocks::<super::kquants::Avx2>(ty, x, out)
}

/// [`quantize_gguf`] under importance weights `qw` (one per column of rows of `cols`): the
/// legacy types', the k-quants' and IQ4's weighted searches compiled for AVX2, the i-quants by
/// the reference's code with `cpu::iquants`' AVX2 neighbour search and fits.
///
/// # Safety
/// AVX2 and F16C must be available.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn quantize_gguf_with(
    ty: crate::ops::gguf::GgufType,
    x: &[f32],
    cols: usize,
    qw: &[f32],
    out: &mut [u8],
) -> Result<(), crate::KernelError> {
    super::kquants::quantize_rows_with::<super::kquants::Avx2>(ty, x, cols, qw, out)
}
