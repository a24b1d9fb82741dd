//! llama.cpp's legacy block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and MXFP4 without importance
//! weights, in AVX2: one 32-element block as four vectors, its scale found by vector maxima and
//! its codes computed, clamped and packed eight at a time.
//!
//! The bytes are the reference's (`ops::gguf::q4_0` …, `tests/simd_equals_reference.rs`):
//! - Each code is the reference's f32 expression, operation for operation (`v · id + 8.5`, a
//!   multiply and an add, never fused), and its integer conversion keeps the reference's
//!   semantics exactly: Rust's `as i32` truncates and saturates, `cvttps2dq` truncates and gives
//!   `i32::MIN` out of range or for NaN, so a code is clamped from above in f32 first (`15 < t`
//!   keeps NaN, which then lands on `i32::MIN`, whose low byte is the reference's 0) and only its
//!   low byte is kept, as the reference's `as u8` keeps it.
//! - The block's extremes are order-free for finite values (a maximum is a maximum) except in the
//!   sign of a zero and in which of `±m` is "the first of largest magnitude": those are taken
//!   from the first element that equals the extreme, as the reference's strict-comparison scan
//!   picks it.
//! - A block holding an infinity or a NaN runs the reference's own code: its scans are
//!   order-dependent there (a NaN skipped or kept depending on where it lies).
//!
//! MXFP4's search over its 16 code values becomes a search over the 8 magnitudes on `|v|`: for
//! `v ≥ 0` a negative code's error `|−k·d − v|` rounds to at least the error of code 0 (`|v|`),
//! so it never wins the reference's strict `<`; for `v < 0` the positive ones never do; and the
//! remaining errors are the same numbers, `fl(|k·d − |v||)`, negation being exact.

use crate::ops::gguf::{GgufType, KVALUES_MXFP4, mxfp4_scale, mxfp4_step, quantize_blocks};
use std::arch::x86_64::*;

/// Whether [`quantize`] has a vector kernel for `ty`.
pub(crate) fn handles(ty: GgufType) -> bool {
    matches!(
        ty,
        GgufType::Q4_0
            | GgufType::Q4_1
            | GgufType::Q5_0
            | GgufType::Q5_1
            | GgufType::Q8_0
            | GgufType::Mxfp4
    )
}

/// Whole blocks of `ty` (one [`handles`]) from `x` into `out`, which the caller sized.
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn quantize(ty: GgufType, x: &[f32], out: &mut [u8]) {
    let bytes = ty.block_bytes();
    for (b, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(bytes)) {
        let b: &[f32; 32] = b.try_into().expect("chunks of 32");
        let v = load(b);
        if !finite(&v) {
            // Infinities and NaN: the reference's scans, whose order matters there.
            quantize_blocks(ty, b, o).expect("a type without importance weights");
            continue;
        }
        match ty {
            GgufType::Q4_0 => q4_0(b, &v, o),
            GgufType::Q5_0 => q5_0(b, &v, o),
            GgufType::Q4_1 => q4_1(b, &v, o),
            GgufType::Q5_1 => q5_1(b, &v, o),
            GgufType::Q8_0 => q8_0(&v, o),
            _ => mxfp4(&v, o),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn load(b: &[f32; 32]) -> [__m256; 4] {
    // SAFETY: `b` holds 32 f32, four unaligned loads of eight.
    unsafe {
        let p = b.as_ptr();
        [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ]
    }
}

#[inline]
#[target_feature(enable = "avx2")]
fn abs(v: __m256) -> __m256 {
    _mm256_andnot_ps(_mm256_set1_ps(-0.0), v)
}

/// Every lane of the block finite (no infinity, no NaN).
#[inline]
#[target_feature(enable = "avx2")]
fn finite(v: &[__m256; 4]) -> bool {
    let inf = _mm256_set1_ps(f32::INFINITY);
    let mut ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for &x in v {
        ok = _mm256_and_ps(ok, _mm256_cmp_ps::<_CMP_LT_OQ>(abs(x), inf));
    }
    _mm256_movemask_ps(ok) == 0xff
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmax(v: __m256) -> f32 {
    let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps::<1>(h, h)))
}

#[inline]
#[target_feature(enable = "avx2")]
fn hmin(v: __m256) -> f32 {
    let h = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_min_ps(h, _mm_movehl_ps(h, h));
    _mm_cvtss_f32(_mm_min_ss(h, _mm_shuffle_ps::<1>(h, h)))
}

/// The index of the first element whose lane `f(x)` equals `m` (one must).
#[inline]
#[target_feature(enable = "avx2")]
fn first_equal(v: &[__m256; 4], m: f32, f: impl Fn(__m256) -> __m256) -> usize {
    let m = _mm256_set1_ps(m);
    let mut bits = 0u32;
    for (i, &x) in v.iter().enumerate() {
        let eq = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(f(x), m)) as u32;
        bits |= eq << (8 * i);
    }
    bits.trailing_zeros() as usize
}

/// The block's value of largest magnitude, the first on ties (the reference's `signed_max`):
/// 0.0 where every element is ±0.
#[inline]
#[target_feature(enable = "avx2")]
fn signed_max(b: &[f32; 32], v: &[__m256; 4]) -> f32 {
    let m = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let amax = hmax(m);
    if amax == 0.0 {
        return 0.0;
    }
    b[first_equal(v, amax, |x| abs(x))]
}

/// The block's least and greatest values, each the first element equal to it (the reference's
/// `min_max`; which matters only for the sign of a zero).
#[inline]
#[target_feature(enable = "avx2")]
fn min_max(b: &[f32; 32], v: &[__m256; 4]) -> (f32, f32) {
    let lo = _mm256_min_ps(_mm256_min_ps(v[0], v[1]), _mm256_min_ps(v[2], v[3]));
    let hi = _mm256_max_ps(_mm256_max_ps(v[0], v[1]), _mm256_max_ps(v[2], v[3]));
    let (mut min, mut max) = (hmin(lo), hmax(hi));
    if min == 0.0 {
        min = b[first_equal(v, 0.0, |x| x)];
    }
    if max == 0.0 {
        max = b[first_equal(v, 0.0, |x| x)];
    }
    (min, max)
}

/// `d` as IEEE half, round to nearest even (F16C; `d` is not NaN).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn half(d: f32) -> [u8; 2] {
    let h = _mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_set_ss(d));
    (_mm_extract_epi16::<0>(h) as u16).to_le_bytes()
}

fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// `(t as i32).min(hi) as u8` per lane, as an i32 in `0..=255`: clamped above in f32 (NaN kept,
/// which `cvttps2dq` turns into `i32::MIN` as it does any value out of range, where Rust's
/// saturating cast gives `i32::MIN` for the negative ones and 0 for NaN — the same low byte).
#[inline]
#[target_feature(enable = "avx2")]
fn code_below(t: __m256, hi: f32) -> __m256i {
    let c = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_set1_ps(hi), t));
    _mm256_and_si256(c, _mm256_set1_epi32(0xff))
}

/// Sixteen bytes `lo[j] | hi[j] << 4` (as u8) from two pairs of code vectors (lanes 0..=255).
#[inline]
#[target_feature(enable = "avx2")]
fn nibbles(lo: [__m256i; 2], hi: [__m256i; 2], o: &mut [u8]) {
    let byte = |l: __m256i, h: __m256i| {
        let h = _mm256_and_si256(_mm256_slli_epi32::<4>(h), _mm256_set1_epi32(0xff));
        _mm256_or_si256(l, h)
    };
    bytes16(byte(lo[0], hi[0]), byte(lo[1], hi[1]), o);
}

/// Sixteen i32 lanes holding `0..=255` (or, `SIGNED`, `-128..=127`) as sixteen bytes, in order.
#[inline]
#[target_feature(enable = "avx2")]
fn bytes16_as<const SIGNED: bool>(a: __m256i, b: __m256i, o: &mut [u8]) {
    let (a0, a1) = (_mm256_castsi256_si128(a), _mm256_extracti128_si256::<1>(a));
    let (b0, b1) = (_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
    let r = if SIGNED {
        _mm_packs_epi16(_mm_packs_epi32(a0, a1), _mm_packs_epi32(b0, b1))
    } else {
        _mm_packus_epi16(_mm_packus_epi32(a0, a1), _mm_packus_epi32(b0, b1))
    };
    let o: &mut [u8; 16] = (&mut o[..16]).try_into().expect("sixteen bytes");
    // SAFETY: `o` is sixteen writable bytes.
    unsafe { _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, r) };
}

#[inline]
#[target_feature(enable = "avx2")]
fn bytes16(a: __m256i, b: __m256i, o: &mut [u8]) {
    bytes16_as::<false>(a, b, o)
}

/// The codes `t` of a symmetric type: `(v · id + offset)`, truncated, at most `hi`.
#[inline]
#[target_feature(enable = "avx2")]
fn sym_codes(v: &[__m256; 4], id: f32, offset: f32, hi: f32) -> [__m256i; 4] {
    let (id, off) = (_mm256_set1_ps(id), _mm256_set1_ps(offset));
    v.map(|x| code_below(_mm256_add_ps(_mm256_mul_ps(x, id), off), hi))
}

/// The codes of an asymmetric type: `((v − min) · id + 0.5)`, truncated, at most `hi`.
#[inline]
#[target_feature(enable = "avx2")]
fn asym_codes(v: &[__m256; 4], min: f32, id: f32, hi: f32) -> [__m256i; 4] {
    let (min, id, half) = (_mm256_set1_ps(min), _mm256_set1_ps(id), _mm256_set1_ps(0.5));
    v.map(|x| {
        let t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(x, min), id), half);
        code_below(t, hi)
    })
}

/// Q5's packing: the codes' low nibbles as [`nibbles`], their fifth bits as a 32-bit mask.
#[inline]
#[target_feature(enable = "avx2")]
fn pack5(c: [__m256i; 4], qh: &mut [u8], qs: &mut [u8]) {
    let f = _mm256_set1_epi32(0xf);
    let low = c.map(|c| _mm256_and_si256(c, f));
    nibbles([low[0], low[1]], [low[2], low[3]], qs);
    let mut h = 0u32;
    for (i, &c) in c.iter().enumerate() {
        let bit = _mm256_castsi256_ps(_mm256_slli_epi32::<27>(c));
        h |= (_mm256_movemask_ps(bit) as u32) << (8 * i);
    }
    qh.copy_from_slice(&h.to_le_bytes());
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q4_0(b: &[f32; 32], v: &[__m256; 4], o: &mut [u8]) {
    let d = signed_max(b, v) / -8.0;
    o[..2].copy_from_slice(&half(d));
    let c = sym_codes(v, inverse(d), 8.5, 15.0);
    nibbles([c[0], c[1]], [c[2], c[3]], &mut o[2..]);
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q5_0(b: &[f32; 32], v: &[__m256; 4], o: &mut [u8]) {
    let d = signed_max(b, v) / -16.0;
    o[..2].copy_from_slice(&half(d));
    let c = sym_codes(v, inverse(d), 16.5, 31.0);
    let (qh, qs) = o[2..].split_at_mut(4);
    pack5(c, qh, qs);
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q4_1(b: &[f32; 32], v: &[__m256; 4], o: &mut [u8]) {
    let (min, max) = min_max(b, v);
    let d = (max - min) / 15.0;
    o[..2].copy_from_slice(&half(d));
    o[2..4].copy_from_slice(&half(min));
    let c = asym_codes(v, min, inverse(d), 15.0);
    nibbles([c[0], c[1]], [c[2], c[3]], &mut o[4..]);
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q5_1(b: &[f32; 32], v: &[__m256; 4], o: &mut [u8]) {
    let (min, max) = min_max(b, v);
    let d = (max - min) / 31.0;
    o[..2].copy_from_slice(&half(d));
    o[2..4].copy_from_slice(&half(min));
    // The reference has no clamp: its `as u8` saturates at 255 (and 0, and NaN to 0), the same
    // low byte as this clamp at 255 and `code_below`'s conversion.
    let c = asym_codes(v, min, inverse(d), 255.0);
    let (qh, qs) = o[4..].split_at_mut(4);
    pack5(c, qh, qs);
}

/// Rounds half away from zero (`f32::round`): the truncation, plus one step away from zero
/// where the dropped fraction (exact: `a − trunc(a)` needs no rounding) is at least a half.
#[inline]
#[target_feature(enable = "avx2")]
fn round_away(a: __m256) -> __m256 {
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(a);
    let frac = abs(_mm256_sub_ps(a, t));
    let up = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, _mm256_set1_ps(0.5));
    let step = _mm256_or_ps(_mm256_and_ps(a, _mm256_set1_ps(-0.0)), _mm256_set1_ps(1.0));
    _mm256_add_ps(t, _mm256_and_ps(up, step))
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn q8_0(v: &[__m256; 4], o: &mut [u8]) {
    let m = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let d = hmax(m) / 127.0;
    o[..2].copy_from_slice(&half(d));
    let id = _mm256_set1_ps(inverse(d));
    // `(v · id).round() as i8`: saturating at ±127 / −128 and NaN (`0 · ∞`, where `d` is a
    // subnormal whose inverse overflows) to 0.
    let c = v.map(|x| {
        let r = round_away(_mm256_mul_ps(x, id));
        let r = _mm256_max_ps(
            _mm256_set1_ps(-128.0),
            _mm256_min_ps(_mm256_set1_ps(127.0), r),
        );
        let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        _mm256_cvttps_epi32(r)
    });
    bytes16_as::<true>(c[0], c[1], &mut o[2..18]);
    bytes16_as::<true>(c[2], c[3], &mut o[18..34]);
}

/// [`mxfp4_scale`] without its logarithm where the exponent bits give its floor: for a normal
/// `amax = m · 2^E` with `m < 1.99`, `E + log2(m)` (`0 ≤ log2(m) < 0.993`) rounds to an f32 whose
/// floor is `E` (the f32 spacing near `|E| ≤ 127` is at most 2^-16), so the reference's
/// `floor(log2_f32(amax))` is `E`; other values take the reference's path.
#[inline]
fn scale_mxfp4(amax: f32) -> (u8, f32) {
    let bits = amax.to_bits();
    let field = (bits >> 23) & 0xff;
    if amax > 0.0 && field != 0 && field != 0xff && (bits & 0x7f_ffff) < 0x7e_b851 {
        // `floor − 2 + 127` (`E − 2 + 127`, the field less 2) and the reference's `as u8`.
        let e = (field as i32 - 2) as u8;
        return (e, mxfp4_step(e));
    }
    mxfp4_scale(amax)
}

#[inline]
#[target_feature(enable = "avx2")]
fn mxfp4(v: &[__m256; 4], o: &mut [u8]) {
    let m = _mm256_max_ps(
        _mm256_max_ps(abs(v[0]), abs(v[1])),
        _mm256_max_ps(abs(v[2]), abs(v[3])),
    );
    let (e, d) = scale_mxfp4(hmax(m));
    o[0] = e;
    // The magnitudes' candidates k · d in the reference's order, code 0 first.
    let mut cand = [0f32; 8];
    for (c, &k) in cand.iter_mut().zip(&KVALUES_MXFP4[..8]) {
        *c = f32::from(k) * d;
    }
    // The four vectors advance together through the candidates (four independent chains of
    // compare-and-keep rather than one).
    let a = v.map(|x| abs(x));
    // Code 0's error, `|0 · d − a|`, is `a`.
    let (mut err, mut best) = (a, [_mm256_setzero_si256(); 4]);
    for (i, &k) in cand.iter().enumerate().skip(1) {
        let (k, code) = (_mm256_set1_ps(k), _mm256_set1_epi32(i as i32));
        for j in 0..4 {
            let e = abs(_mm256_sub_ps(k, a[j]));
            let less = _mm256_cmp_ps::<_CMP_LT_OQ>(e, err[j]);
            err[j] = _mm256_min_ps(e, err[j]);
            best[j] = _mm256_blendv_epi8(best[j], code, _mm256_castps_si256(less));
        }
    }
    // Negative values take the negative codes (8 + i), except code 0.
    let mut c = best;
    for j in 0..4 {
        let neg = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(v[j], _mm256_setzero_ps()));
        let nonzero = _mm256_cmpgt_epi32(best[j], _mm256_setzero_si256());
        let eight = _mm256_and_si256(_mm256_and_si256(neg, nonzero), _mm256_set1_epi32(8));
        c[j] = _mm256_or_si256(best[j], eight);
    }
    nibbles([c[0], c[1]], [c[2], c[3]], &mut o[1..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exponent shortcut equals the reference's logarithm for every exponent, on the
    /// mantissas up to the shortcut's bound and past it (and on zero, subnormals, infinity).
    #[test]
    fn mxfp4_scale_shortcut_equals_the_logarithm() {
        let mut values = vec![0.0, 1e-45, 1e-40, 1.1754942e-38, f32::INFINITY, f32::MAX];
        for field in 1..255u32 {
            for m in (0..0x80_0000u32).step_by(4099).chain(0x7e_b840..0x7e_b860) {
                values.push(f32::from_bits(field << 23 | m));
            }
            values.push(f32::from_bits(field << 23 | 0x7f_ffff));
        }
        for amax in values {
            let (e, d) = scale_mxfp4(amax);
            let (re, rd) = mxfp4_scale(amax);
            assert_eq!((e, d.to_bits()), (re, rd.to_bits()), "amax {amax:e}");
        }
    }
}
