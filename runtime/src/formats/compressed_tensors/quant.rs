//! compressed-tensors 0.19's arithmetic, as llm-compressor 0.14 runs it on the CPU
//! (docs/FORMATS.md §9.3): scalar and readable, one function per encoding.
//!
//! PyTorch computes an operation on two tensors of the weight's dtype in f32 and rounds the
//! result to that dtype, so most intermediate values here are rounded to `T`
//! ([`Element::round_f32`]): `scale = T(amax / T(448))`, `x / scale` is `T(x / scale)` before it
//! is cast to FP8 or rounded to an integer. NVFP4's global scale is a `T` quotient stored as
//! f32, and its group scales are f32 products — each rule below names the PyTorch line it
//! reproduces.

use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::formats::Overflow;
use kiln_kernels::formats::fp4::{e2m1_to_f32, f32_to_e2m1_nvfp4};
use kiln_kernels::formats::fp8::{e4m3_to_f32, f32_to_e4m3};
use kiln_kernels::ops::round_half_even;

/// FP8 E4M3's largest value.
const FP8_MAX: f32 = 448.0;
/// FP4 E2M1's largest value.
const FP4_MAX: f32 = 6.0;

/// `torch.finfo(T).eps`, the scale compressed-tensors substitutes for a zero scale.
pub fn eps<T: Element>() -> f32 {
    match T::DTYPE {
        "BF16" => bf16::EPSILON.to_f32(),
        "F16" => f16::EPSILON.to_f32(),
        _ => f32::EPSILON,
    }
}

/// `torch.finfo(torch.float8_e4m3fn).eps`: NVFP4's zero group scale becomes this.
const FP8_EPS: f32 = 0.125;

/// Rounds to `T` (identity for f32).
fn r<T: Element>(x: f32) -> f32 {
    T::round_f32(x)
}

/// The largest magnitude of `x`, as the min/max observers see it (`max(|min|, |max|)`, with
/// `min ≤ 0 ≤ max`).
pub fn amax<T: Element>(x: &[T]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()))
}

/// A symmetric scale: `T(amax / T(range / 2))`, zero replaced by `eps(T)`
/// (`calculate_qparams`).
pub fn symmetric_scale<T: Element>(amax: f32, half_range: f32) -> f32 {
    let s = r::<T>(amax / r::<T>(half_range));
    if s == 0.0 { eps::<T>() } else { s }
}

/// The FP8 scale of a tensor, row or block.
pub fn fp8_scale<T: Element>(amax: f32) -> f32 {
    symmetric_scale::<T>(amax, FP8_MAX)
}

/// `round_to_quantized_type_args` for FP8: `clamp(T(x / s), ±448).to(float8_e4m3fn)`.
pub fn fp8<T: Element>(x: T, scale: f32) -> u8 {
    let v = r::<T>(x.to_f32() / scale).clamp(-FP8_MAX, FP8_MAX);
    f32_to_e4m3(v, Overflow::NonSaturating)
}

/// INT8, one scale per row: `scale = T(amax / 127.5)`.
pub fn int8_scale<T: Element>(amax: f32) -> f32 {
    symmetric_scale::<T>(amax, 127.5)
}

/// Symmetric INT4 group scale: `T(amax / 7.5)`.
pub fn int4_scale<T: Element>(amax: f32) -> f32 {
    symmetric_scale::<T>(amax, 7.5)
}

/// A symmetric integer: `round(clamp(T(x / s), lo, hi))`, ties to even (`torch.round`).
pub fn int<T: Element>(x: T, scale: f32, lo: f32, hi: f32) -> i8 {
    round_half_even(r::<T>(x.to_f32() / scale).clamp(lo, hi)) as i8
}

/// Asymmetric integer group parameters for `bits`-bit codes in `[lo, hi] = [−2^(bits−1),
/// 2^(bits−1) − 1]` (`calculate_qparams`, `symmetric=False`): `scale = T(T(max − min) /
/// (2^bits − 1))` and `zp = round(clamp(T(lo − T(min / scale)), lo, hi))`, with `min ≤ 0 ≤ max`;
/// a zero scale becomes `eps(T)` *after* the zero point is computed. A group of zeros gives
/// PyTorch a NaN zero point (0 / 0), whose integer cast is undefined; kiln writes 0 there,
/// which dequantizes the group to zeros like any other zero point.
pub fn int_asym_params<T: Element>(x: &[T], bits: u32) -> (f32, i8) {
    let (lo, hi) = x.iter().fold((0.0f32, 0.0f32), |(lo, hi), v| {
        let v = v.to_f32();
        (lo.min(v), hi.max(v))
    });
    asym_params::<T>(lo, hi, bits)
}

/// [`int_asym_params`] from a group's `min ≤ 0 ≤ max`.
pub fn asym_params<T: Element>(lo: f32, hi: f32, bits: u32) -> (f32, i8) {
    let (qlo, qhi) = int_range(bits);
    let s = r::<T>(r::<T>(hi - lo) / (qhi - qlo));
    if s == 0.0 {
        return (eps::<T>(), 0);
    }
    let zp = round_half_even(r::<T>(qlo - r::<T>(lo / s)).clamp(qlo, qhi)) as i8;
    (s, zp)
}

/// Asymmetric INT4 group parameters: [`int_asym_params`] with 4 bits.
pub fn int4_asym_params<T: Element>(x: &[T]) -> (f32, i8) {
    int_asym_params(x, 4)
}

/// The signed range of `bits`-bit codes, `(−2^(bits−1), 2^(bits−1) − 1)`.
pub fn int_range(bits: u32) -> (f32, f32) {
    let half = (1u32 << (bits - 1)) as f32;
    (-half, half - 1.0)
}

/// An asymmetric integer: `round(clamp(T(T(x / s) + zp), lo, hi))` in `bits`' range.
pub fn int_asym<T: Element>(x: T, scale: f32, zp: i8, bits: u32) -> i8 {
    let (lo, hi) = int_range(bits);
    round_half_even(r::<T>(r::<T>(x.to_f32() / scale) + f32::from(zp)).clamp(lo, hi)) as i8
}

/// An asymmetric INT4 value: `round(clamp(T(T(x / s) + zp), −8, 7))`.
pub fn int4_asym<T: Element>(x: T, scale: f32, zp: i8) -> i8 {
    int_asym(x, scale, zp, 4)
}

/// NVFP4's global scale from the amax of a tensor (or of the Linears sharing it), as f32:
/// `generate_gparam`'s `448 * 6 / max(amax, tiny)` on a `T` tensor, which PyTorch evaluates
/// as `T(T(1 / amax) · 2688)` (a scalar divided by a tensor is the tensor's reciprocal times
/// the scalar); 1 where that is not finite.
pub fn nvfp4_global<T: Element>(amax: f32) -> f32 {
    let g = r::<T>(r::<T>(1.0 / amax.max(f32::MIN_POSITIVE)) * (FP8_MAX * FP4_MAX));
    if g.is_finite() { g } else { 1.0 }
}

/// An NVFP4 group scale as its FP8 code: `e4m3(clamp(global · T(bmax / 6), ±448))`, 0.125
/// when that is zero.
pub fn nvfp4_scale<T: Element>(bmax: f32, global: f32) -> u8 {
    let s = global * r::<T>(bmax / r::<T>(FP4_MAX));
    let code = f32_to_e4m3(s.clamp(-FP8_MAX, FP8_MAX), Overflow::NonSaturating);
    if e4m3_to_f32(code) == 0.0 {
        f32_to_e4m3(FP8_EPS, Overflow::NonSaturating)
    } else {
        code
    }
}

/// An NVFP4 value as its E2M1 code: `x / (scale / global)` in f32, clamped to ±6 and rounded
/// half to even on the E2M1 grid; the sign bit is set for a negative value that rounds to zero
/// (`torch.sign` then `signbit` in `pack_fp4_to_uint8`).
pub fn nvfp4<T: Element>(x: T, scale_code: u8, global: f32) -> u8 {
    let s = e4m3_to_f32(scale_code) / global;
    f32_to_e2m1_nvfp4((x.to_f32() / s).clamp(-FP4_MAX, FP4_MAX))
}

/// Decodes an NVFP4 value (`dequantize`: `q · (scale / global)`).
pub fn nvfp4_value(code: u8, scale_code: u8, global: f32) -> f32 {
    e2m1_to_f32(code) * (e4m3_to_f32(scale_code) / global)
}

/// Packs signed `bits`-bit integers densely into little-endian `i32` words, element `i` of a
/// row at bit `i · bits` of the row's bit string, each stored as `q + 2^(bits−1)`
/// (`pack_to_int32`); each row of `cols` values fills `⌈cols · bits / 32⌉` words.
pub fn pack_int32(q: &[i8], cols: usize, bits: usize) -> Vec<i32> {
    let words = (cols * bits).div_ceil(32);
    let offset = 1i64 << (bits - 1);
    let mut out = vec![0i32; q.len() / cols * words];
    for (row, dst) in q.chunks_exact(cols).zip(out.chunks_exact_mut(words)) {
        let mut acc = vec![0u64; words + 1];
        for (i, &v) in row.iter().enumerate() {
            let u = (i64::from(v) + offset) as u64 & ((1 << bits) - 1);
            let bit = i * bits;
            acc[bit / 32] |= u << (bit % 32);
        }
        // Bits that ran past a word's end belong to the next word.
        for w in 0..words {
            let spill = acc[w] >> 32;
            acc[w + 1] |= spill;
            dst[w] = acc[w] as u32 as i32;
        }
    }
    out
}

/// Packs `rows × cols` signed integers along the rows (`pack_to_int32(…, packed_dim=0)`): the
/// result has `⌈rows · bits / 32⌉` rows of `cols` words.
pub fn pack_int32_columns(q: &[i8], rows: usize, cols: usize, bits: usize) -> Vec<i32> {
    let mut t = vec![0i8; q.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = q[r * cols + c];
        }
    }
    let packed = pack_int32(&t, rows, bits);
    let words = (rows * bits).div_ceil(32);
    let mut out = vec![0i32; packed.len()];
    for c in 0..cols {
        for w in 0..words {
            out[w * cols + c] = packed[c * words + w];
        }
    }
    out
}

/// The inverse of [`pack_int32`]: `rows × cols` signed integers from `⌈cols · bits / 32⌉`
/// words per row (`unpack_from_int32`).
pub fn unpack_int32(
    words: &[i32],
    rows: usize,
    cols: usize,
    bits: usize,
) -> Result<Vec<i8>, String> {
    if !(1..=8).contains(&bits) {
        return Err(format!("{bits}-bit integers cannot be unpacked (1 to 8)"));
    }
    let needed = cols
        .checked_mul(bits)
        .map(|b| b.div_ceil(32))
        .and_then(|per_row| Some((per_row, rows.checked_mul(per_row)?)));
    let Some((per_row, total)) = needed.filter(|&(_, total)| total == words.len()) else {
        return Err(format!(
            "{} int32 words do not hold {rows}×{cols} {bits}-bit values",
            words.len()
        ));
    };
    debug_assert_eq!(total, words.len());
    if per_row == 0 {
        return Ok(Vec::new());
    }
    let offset = 1i16 << (bits - 1);
    let mask = (1u64 << bits) - 1;
    let mut out = Vec::with_capacity(rows * cols);
    for row in words.chunks_exact(per_row) {
        for i in 0..cols {
            let bit = i * bits;
            let lo = u64::from(row[bit / 32] as u32);
            let hi = row.get(bit / 32 + 1).map_or(0, |&w| u64::from(w as u32));
            let u = ((lo | hi << 32) >> (bit % 32)) & mask;
            out.push((u as i16 - offset) as i8);
        }
    }
    Ok(out)
}

/// The inverse of [`pack_int32_columns`].
pub fn unpack_int32_columns(
    words: &[i32],
    rows: usize,
    cols: usize,
    bits: usize,
) -> Result<Vec<i8>, String> {
    if !(1..=8).contains(&bits) {
        return Err(format!("{bits}-bit integers cannot be unpacked (1 to 8)"));
    }
    let per_col = rows.saturating_mul(bits).div_ceil(32);
    if per_col.checked_mul(cols) != Some(words.len()) {
        return Err(format!(
            "{} int32 words do not hold {rows}×{cols} {bits}-bit values packed by column",
            words.len()
        ));
    }
    let mut t = vec![0i32; words.len()];
    for w in 0..per_col {
        for c in 0..cols {
            t[c * per_col + w] = words[w * cols + c];
        }
    }
    let q = unpack_int32(&t, cols, rows, bits)?;
    let mut out = vec![0i8; rows * cols];
    for c in 0..cols {
        for r in 0..rows {
            out[r * cols + c] = q[c * rows + r];
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_packing_is_little_endian_and_offset() {
        // 8 four-bit values per word, the first in the lowest nibble, each stored as q + 8.
        let q: Vec<i8> = vec![-8, -7, 0, 1, 2, 3, 7, -1];
        let w = pack_int32(&q, 8, 4);
        assert_eq!(w, vec![0x7fba_9810u32 as i32]);
        // Along the rows: 8 rows of 1 column pack into one word.
        assert_eq!(pack_int32_columns(&q, 8, 1, 4), w);
        assert_eq!(unpack_int32(&w, 1, 8, 4).unwrap(), q);
        assert_eq!(unpack_int32_columns(&w, 8, 1, 4).unwrap(), q);
    }

    #[test]
    fn hostile_shapes_are_errors_not_overflows() {
        // A `weight_shape` read from a file (found by the ct_weights fuzz target): sizes whose
        // products overflow, and empty rows, are refused or give nothing — never a panic.
        let w = [0i32; 4];
        for (rows, cols) in [(1, usize::MAX / 2), (usize::MAX / 2, 8), (4, 0), (0, 8)] {
            for bits in [4, 8] {
                let _ = unpack_int32(&w, rows, cols, bits);
                let _ = unpack_int32_columns(&w, rows, cols, bits);
            }
        }
        assert!(unpack_int32(&w, 1, usize::MAX / 2, 4).is_err());
        assert_eq!(unpack_int32(&[], 4, 0, 4).unwrap(), Vec::<i8>::new());
    }

    #[test]
    fn odd_widths_spill_into_the_next_word() {
        // Three-bit values: element 10 straddles words 0 and 1.
        let q: Vec<i8> = (0..32).map(|i| (i % 8) as i8 - 4).collect();
        let w = pack_int32(&q, 32, 3);
        assert_eq!(w.len(), 3);
        let bits: Vec<u8> = (0..96)
            .map(|b| ((w[b / 32] as u32 >> (b % 32)) & 1) as u8)
            .collect();
        for (i, v) in q.iter().enumerate() {
            let u = (0..3).fold(0u8, |a, k| a | bits[i * 3 + k] << k);
            assert_eq!(i16::from(u), i16::from(*v) + 4, "element {i}");
        }
        assert_eq!(unpack_int32(&w, 1, 32, 3).unwrap(), q);
    }

    proptest::proptest! {
        #[test]
        fn packing_round_trips(
            bits in 1usize..=8,
            rows in 1usize..5,
            cols in 1usize..70,
            seed in proptest::prelude::any::<u64>(),
        ) {
            let lo = -(1i16 << (bits - 1));
            let span = 1u64 << bits;
            let mut x = seed | 1;
            let q: Vec<i8> = (0..rows * cols)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (lo + (x % span) as i16) as i8
                })
                .collect();
            let w = pack_int32(&q, cols, bits);
            proptest::prop_assert_eq!(w.len(), rows * (cols * bits).div_ceil(32));
            proptest::prop_assert_eq!(unpack_int32(&w, rows, cols, bits).unwrap(), q.clone());
            let c = pack_int32_columns(&q, rows, cols, bits);
            proptest::prop_assert_eq!(unpack_int32_columns(&c, rows, cols, bits).unwrap(), q);
        }
    }

    proptest::proptest! {
        /// The writer casts runs of FP8 with the kernels' SIMD quantizer; it must equal
        /// `fp8` (`T(x / s)`, then E4M3), including quotients just past ±448 that the scale's
        /// rounding allows.
        #[test]
        fn simd_fp8_is_the_scalar_rule(
            bits in proptest::collection::vec(proptest::prelude::any::<u16>(), 1..300),
            amax_bits in proptest::prelude::any::<u16>(),
        ) {
            let x: Vec<bf16> = bits
                .iter()
                .map(|&b| bf16::from_bits(b))
                .filter(|v| v.is_finite())
                .collect();
            let a = bf16::from_bits(amax_bits & 0x7f7f).to_f32().abs();
            let amax = amax(&x).max(a);
            let s = fp8_scale::<bf16>(amax);
            let mut simd = vec![0u8; x.len()];
            kiln_kernels::cpu::quantize_fp8_per_tensor(&x, s, &mut simd).unwrap();
            let scalar: Vec<u8> = x.iter().map(|&v| fp8(v, s)).collect();
            proptest::prop_assert_eq!(simd, scalar);
        }
    }

    #[test]
    fn scales_round_in_the_weights_dtype() {
        // 1/448 is not a bf16 value: the scale is the bf16 quotient.
        let s = fp8_scale::<bf16>(1.0);
        assert_eq!(s, bf16::from_f32(1.0 / 448.0).to_f32());
        assert_ne!(s, 1.0 / 448.0);
        assert_eq!(fp8_scale::<f32>(1.0), 1.0 / 448.0);
        assert_eq!(fp8_scale::<bf16>(0.0), 0.0078125);
        assert_eq!(int8_scale::<bf16>(127.5), 1.0);
        assert_eq!(int4_scale::<bf16>(7.5), 1.0);
        assert_eq!(nvfp4_global::<bf16>(0.0), 1.0);
        assert_eq!(nvfp4_global::<bf16>(2688.0), 1.0);
    }

    #[test]
    fn asymmetric_zero_points() {
        let x: Vec<bf16> = [-1.0f32, 0.5, 2.0].map(bf16::from_f32).to_vec();
        let (s, zp) = int4_asym_params(&x);
        assert_eq!(s, bf16::from_f32(0.2).to_f32());
        // −8 − (−1 / 0.2) = −3
        assert_eq!(zp, -3);
        assert_eq!(int4_asym(x[0], s, zp), -8);
        assert_eq!(int4_asym(x[2], s, zp), 7);
        assert_eq!(int4_asym_params::<bf16>(&[bf16::ZERO; 4]), (0.0078125, 0));
    }

    #[test]
    fn nvfp4_zero_scale_and_sign() {
        let g = nvfp4_global::<f32>(6.0);
        assert_eq!(g, 448.0);
        assert_eq!(e4m3_to_f32(nvfp4_scale::<f32>(0.0, g)), 0.125);
        let s = nvfp4_scale::<f32>(6.0, g);
        assert_eq!(e4m3_to_f32(s), 448.0);
        assert_eq!(nvfp4(-0.1f32, s, g), 8);
        assert_eq!(nvfp4(0.0f32, s, g), 0);
        assert_eq!(nvfp4(6.0f32, s, g), 7);
        assert_eq!(nvfp4_value(7, s, g), 6.0);
    }
}
