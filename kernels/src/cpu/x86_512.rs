//! AVX-512 (F) kernels: amax (every reduction is built on it), FP8 of `w / scale` (per tensor,
//! per expert, per channel, 128×128 tiles), INT8 per channel, INT4 groups, NVFP4, MXFP4 and
//! MXFP8 — 16 lanes at a time (an NVFP4 block is one vector), lane-for-lane the steps of
//! `cpu::bits` and of the AVX2 kernels. Callers check `is_x86_feature_detected!`
//! first (see `cpu::isa`).

use crate::element::Element;
use half::{bf16, f16};
use std::any::TypeId;
use std::arch::x86_64::*;

/// Loads 16 elements of `T` (bf16, f16 or f32) as f32 lanes.
///
/// # Safety
/// AVX-512F must be available; `p` must point to 16 readable elements of `T`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<T: Element>(p: *const T) -> __m512 {
    let t = TypeId::of::<T>();
    // SAFETY: the caller guarantees 16 readable elements at `p` and the CPU feature; the
    // TypeId checks make each cast the element's real layout.
    unsafe {
        if t == TypeId::of::<bf16>() {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else if t == TypeId::of::<f16>() {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        } else {
            debug_assert!(t == TypeId::of::<f32>());
            _mm512_loadu_ps(p as *const f32)
        }
    }
}

/// Rounds f32 lanes to `T` and back (RNE); identity for f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn round_to<T: Element>(x: __m512) -> __m512 {
    let t = TypeId::of::<T>();
    if t == TypeId::of::<bf16>() {
        let b = _mm512_castps_si512(x);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        let r = _mm512_and_si512(r, _mm512_set1_epi32(0xffff_0000u32 as i32));
        // NaN: keep the sign, set the quiet bit, truncate (as `half`).
        let a = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f80_0000));
        let q = _mm512_and_si512(
            _mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000)),
            _mm512_set1_epi32(0xffff_0000u32 as i32),
        );
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, q))
    } else if t == TypeId::of::<f16>() {
        _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    } else {
        x
    }
}

/// `bits::e4m3_out` on 16 lanes; the codes in the low byte of each i32 lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn e4m3_lanes(x: __m512) -> __m512i {
    let set = _mm512_set1_epi32;
    let b = _mm512_castps_si512(x);
    let sign = _mm512_and_si512(_mm512_srli_epi32::<24>(b), set(0x80));
    let a = _mm512_and_si512(b, set(0x7fff_ffff));
    let nan = _mm512_cmpgt_epi32_mask(a, set(0x7f80_0000));
    let big = _mm512_cmpgt_epi32_mask(a, set(0x43e7_ffff));
    let tie = _mm512_cmpeq_epi32_mask(a, set(0x43e8_0000));
    let sub = _mm512_cmplt_epi32_mask(a, set(0x3c80_0000));
    // Subnormal: add 2^14 as a float so the ulp is 2^-9, then subtract its bits.
    let f = _mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(set(141 << 23)));
    let subcode = _mm512_sub_epi32(_mm512_castps_si512(f), set(141 << 23));
    // Normal: rebias and round the dropped 20 bits to nearest even.
    let odd = _mm512_and_si512(_mm512_srli_epi32::<20>(a), set(1));
    let bias = set(((7i32 - 127) << 23).wrapping_add(0x7_ffff));
    let normcode = _mm512_srli_epi32::<20>(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd));
    let code = _mm512_mask_blend_epi32(sub, normcode, subcode);
    let over = _mm512_mask_blend_epi32(tie, set(0x7f), set(0x7e));
    let code = _mm512_mask_blend_epi32(big, code, over);
    let nan_code = _mm512_cmpeq_epi32_mask(code, set(0x7f)) | nan;
    _mm512_mask_blend_epi32(nan_code, _mm512_or_si512(code, sign), set(0x7f))
}

/// max |x| with NaN winning (`ops::amax::amax`).
///
/// # Safety
/// AVX-512F must be available.
#[target_feature(enable = "avx512f")]
pub unsafe fn amax<T: Element>(x: &[T]) -> f32 {
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let (mut m0, mut m1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut nan: __mmask16 = 0;
    let chunks = x.chunks_exact(32);
    let tail = chunks.remainder();
    for c in chunks {
        // SAFETY: `c` has 32 elements: two loads of 16.
        let (v0, v1) = unsafe { (load16(c.as_ptr()), load16(c.as_ptr().add(16))) };
        let v0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), abs));
        let v1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs));
        nan |= _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v0, v1);
        m0 = _mm512_max_ps(m0, v0);
        m1 = _mm512_max_ps(m1, v1);
    }
    let head = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
    let tail = crate::ops::amax::amax(tail);
    if nan != 0 || tail.is_nan() {
        f32::NAN
    } else {
        head.max(tail)
    }
}

/// `portable::fp8_scaled`: FP8 of `w / scale`, the quotient rounded to `T` when `ROUND`.
///
/// # Safety
/// AVX-512F must be available; `out.len() == w.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn fp8_scaled<T: Element, const ROUND: bool>(w: &[T], scale: f32, out: &mut [u8]) {
    let s = _mm512_set1_ps(scale);
    let n64 = w.len() / 64 * 64;
    for (c, o) in w[..n64]
        .chunks_exact(64)
        .zip(out[..n64].chunks_exact_mut(64))
    {
        for i in (0..64).step_by(16) {
            // SAFETY: 16 readable elements at `c[i..]`, 16 writable bytes at `o[i..]`.
            unsafe {
                let x = _mm512_div_ps(load16(c.as_ptr().add(i)), s);
                let codes = e4m3_lanes(if ROUND { round_to::<T>(x) } else { x });
                _mm_storeu_si128(
                    o.as_mut_ptr().add(i) as *mut __m128i,
                    _mm512_cvtepi32_epi8(codes),
                );
            }
        }
    }
    super::portable::fp8_scaled::<T, ROUND>(&w[n64..], scale, &mut out[n64..]);
}

/// Rounds half to even and clamps to [lo, hi]; NaN becomes 0 (`ops::int`'s rule). Lanes as i32.
#[inline]
#[target_feature(enable = "avx512f")]
fn to_int_lanes(x: __m512, lo: f32, hi: f32) -> __m512i {
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    let r = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
    let r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
    _mm512_cvtps_epi32(_mm512_mask_blend_ps(nan, r, _mm512_setzero_ps()))
}

/// INT8 of one row with one scale (`ops::int::quantize_int8_per_channel` for a row).
///
/// # Safety
/// AVX-512F must be available; `out.len() == w.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn int8_row<T: Element>(w: &[T], scale: f32, out: &mut [i8]) {
    let s = _mm512_set1_ps(scale);
    let n16 = w.len() / 16 * 16;
    for (c, o) in w[..n16]
        .chunks_exact(16)
        .zip(out[..n16].chunks_exact_mut(16))
    {
        // SAFETY: 16 readable elements in `c`, 16 writable bytes in `o`.
        unsafe {
            let q = to_int_lanes(_mm512_div_ps(load16(c.as_ptr()), s), -128.0, 127.0);
            _mm_storeu_si128(o.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(q));
        }
    }
    super::portable::int8_tail(&w[n16..], scale, &mut out[n16..]);
}

/// INT4 of one pair of rows (`ops::int::quantize_int4_groups` with `rows = 2`): `out[c] =
/// q0[c] & 0xF | (q1[c] & 0xF) << 4`, scales `[2, cols / group]`.
///
/// # Safety
/// AVX-512F must be available; `w.len() == 2 * out.len()`, `group` divides `out.len()`.
#[target_feature(enable = "avx512f")]
pub unsafe fn int4_row_pair<T: Element>(w: &[T], group: usize, scales: &[f32], out: &mut [u8]) {
    let cols = out.len();
    let groups = cols / group;
    let (r0, r1) = w.split_at(cols);
    let mask = _mm512_set1_epi32(0xf);
    let mut c = 0;
    while c + 16 <= cols && (c % group) + 16 <= group {
        let (s0, s1) = (
            _mm512_set1_ps(scales[c / group]),
            _mm512_set1_ps(scales[groups + c / group]),
        );
        // SAFETY: c + 16 ≤ cols: 16 readable elements in each row, 16 writable bytes.
        unsafe {
            let a = to_int_lanes(_mm512_div_ps(load16(r0.as_ptr().add(c)), s0), -8.0, 7.0);
            let b = to_int_lanes(_mm512_div_ps(load16(r1.as_ptr().add(c)), s1), -8.0, 7.0);
            let v = _mm512_or_si512(
                _mm512_and_si512(a, mask),
                _mm512_slli_epi32::<4>(_mm512_and_si512(b, mask)),
            );
            _mm_storeu_si128(
                out.as_mut_ptr().add(c) as *mut __m128i,
                _mm512_cvtepi32_epi8(v),
            );
        }
        c += 16;
    }
    super::portable::int4_pair_tail(r0, r1, group, scales, out, c);
}

/// MXFP8 of whole 32-element blocks (`portable::mxfp8`).
///
/// # Safety
/// AVX-512F must be available; `w.len()` a multiple of 32, `q.len() == w.len()`,
/// `scales.len() == w.len() / 32`.
#[target_feature(enable = "avx512f")]
pub unsafe fn mxfp8<T: Element>(w: &[T], q: &mut [u8], scales: &mut [u8]) {
    use crate::formats::e8m0::e8m0_from_exponent;
    let (lo, hi) = (_mm512_set1_ps(-448.0), _mm512_set1_ps(448.0));
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    for ((block, out), scale) in w
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .zip(scales.iter_mut())
    {
        let p = block.as_ptr();
        // SAFETY: 32 readable elements at `p`, 32 writable bytes in `out`.
        unsafe {
            let (v0, v1) = (load16(p), load16(p.add(16)));
            let a0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), abs));
            let a1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), abs));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a0, a1) != 0;
            let m = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
            let k = super::bits::mxfp8_exponent(if nan { f32::NAN } else { m });
            *scale = e8m0_from_exponent(k);
            let f = _mm512_set1_ps(2f64.powi(-k) as f32);
            let e = |v: __m512| {
                let x = _mm512_mul_ps(v, f);
                // clamp keeps NaN (as f32::clamp does): blend it back after min/max.
                let c = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
                let c = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x), c, x);
                _mm512_cvtepi32_epi8(e4m3_lanes(c))
            };
            _mm_storeu_si128(out.as_mut_ptr() as *mut __m128i, e(v0));
            _mm_storeu_si128(out.as_mut_ptr().add(16) as *mut __m128i, e(v1));
        }
    }
}

/// max |x| of 16 lanes, NaN if any lane is NaN.
#[inline]
#[target_feature(enable = "avx512f")]
fn block_amax(v: __m512) -> f32 {
    let a = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(v),
        _mm512_set1_epi32(0x7fff_ffff),
    ));
    if _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a) != 0 {
        f32::NAN
    } else {
        _mm512_reduce_max_ps(a)
    }
}

/// Packs 16 codes (i32 lanes, even element low) into 8 bytes.
#[inline]
#[target_feature(enable = "avx512f")]
fn nibbles8(c: __m512i) -> u64 {
    // Each 64-bit lane holds (even, odd): even | odd << 4 in its low byte.
    let pairs = _mm512_or_si512(c, _mm512_srli_epi64::<28>(c));
    _mm_cvtsi128_si64(_mm512_cvtepi64_epi8(pairs)) as u64
}

/// Adds 1 to the lanes of `idx` selected by `k`.
#[inline]
#[target_feature(enable = "avx512f")]
fn count(idx: __m512i, k: __mmask16) -> __m512i {
    _mm512_mask_add_epi32(idx, k, idx, _mm512_set1_epi32(1))
}

/// `bits::e2m1_nvfp4` on 16 lanes (codes in i32 lanes): half to even on the grid, NaN → 7,
/// the sign bit where `x < 0`.
#[inline]
#[target_feature(enable = "avx512f")]
fn e2m1_lanes(x: __m512) -> __m512i {
    let a = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(0x7fff_ffff),
    ));
    let gt = |b: f32| _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, _mm512_set1_ps(b));
    let ge = |b: f32| _mm512_cmp_ps_mask::<_CMP_GE_OQ>(a, _mm512_set1_ps(b));
    let mut idx = _mm512_setzero_si512();
    for k in [
        gt(0.25),
        ge(0.75),
        gt(1.25),
        ge(1.75),
        gt(2.5),
        ge(3.5),
        gt(5.0),
    ] {
        idx = count(idx, k);
    }
    let idx = _mm512_mask_blend_epi32(
        _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(a, a),
        idx,
        _mm512_set1_epi32(7),
    );
    let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_setzero_ps());
    _mm512_mask_or_epi32(idx, neg, idx, _mm512_set1_epi32(8))
}

/// NVFP4 of whole 16-element blocks (`ops::nvfp4::quantize_nvfp4` without shape checks): a
/// block is one vector; its scale from `bits::nvfp4_block_scale`.
///
/// # Safety
/// AVX-512F must be available; `w.len()` is a multiple of 16, `packed` half of it, `scales`
/// a sixteenth.
#[target_feature(enable = "avx512f")]
pub unsafe fn nvfp4<T: Element>(w: &[T], ws2: f32, packed: &mut [u8], scales: &mut [u8]) {
    use super::bits::{e4m3_to_f32, nvfp4_block_scale};
    for ((block, out), scale) in w
        .chunks_exact(16)
        .zip(packed.chunks_exact_mut(8))
        .zip(scales.iter_mut())
    {
        // SAFETY: 16 readable elements in `block`, 8 writable bytes in `out`.
        unsafe {
            let v = load16(block.as_ptr());
            let code = nvfp4_block_scale(block_amax(v), ws2);
            *scale = code;
            let d = _mm512_set1_ps(e4m3_to_f32(code) * ws2);
            let bytes = nibbles8(e2m1_lanes(_mm512_div_ps(v, d)));
            std::ptr::write_unaligned(out.as_mut_ptr() as *mut u64, bytes);
        }
    }
}

/// E2M1 under the MX rule on 16 lanes: `#(bounds < |x|)`, sign bit unless `x > 0`.
#[inline]
#[target_feature(enable = "avx512f")]
fn e2m1_mx_lanes(x: __m512) -> __m512i {
    let a = _mm512_castsi512_ps(_mm512_and_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(0x7fff_ffff),
    ));
    let mut idx = _mm512_setzero_si512();
    for b in [0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] {
        idx = count(idx, _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, _mm512_set1_ps(b)));
    }
    let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_setzero_ps());
    _mm512_mask_or_epi32(idx, !positive, idx, _mm512_set1_epi32(8))
}

/// MXFP4 of whole 32-element blocks (`ops::mx::quantize_mxfp4`).
///
/// # Safety
/// AVX-512F must be available; `w.len()` a multiple of 32, `packed.len() == w.len() / 2`,
/// `scales.len() == w.len() / 32`.
#[target_feature(enable = "avx512f")]
pub unsafe fn mxfp4<T: Element>(w: &[T], packed: &mut [u8], scales: &mut [u8]) {
    use crate::formats::e8m0::{E8M0_NAN, e8m0_from_exponent};
    for ((block, out), scale) in w
        .chunks_exact(32)
        .zip(packed.chunks_exact_mut(16))
        .zip(scales.iter_mut())
    {
        // SAFETY: 32 readable elements in `block`, 16 writable bytes in `out`.
        unsafe {
            let (v0, v1) = (load16(block.as_ptr()), load16(block.as_ptr().add(16)));
            let (m0, m1) = (block_amax(v0), block_amax(v1));
            let m = if m0.is_nan() || m1.is_nan() {
                f32::NAN
            } else {
                m0.max(m1)
            };
            let k = super::bits::mxfp4_exponent(m);
            *scale = k.map_or(E8M0_NAN, e8m0_from_exponent);
            // w / 2^k and w · 2^-k are the same exact value rounded once (2^-k is exact for
            // every k in [-127, 127]), so the multiply gives the reference's bits.
            let f = _mm512_set1_ps(k.map_or(f32::NAN, |k| 2f64.powi(-k) as f32));
            let lo = nibbles8(e2m1_mx_lanes(_mm512_mul_ps(v0, f)));
            let hi = nibbles8(e2m1_mx_lanes(_mm512_mul_ps(v1, f)));
            std::ptr::write_unaligned(out.as_mut_ptr() as *mut u64, lo);
            std::ptr::write_unaligned(out.as_mut_ptr().add(8) as *mut u64, hi);
        }
    }
}
