//! MLX's quantization modes, as MLX 0.32's CPU device computes them: the layouts mlx-lm
//! writes and loads. The readable reference the MLX backend (`crate::mlx`) is tested against,
//! bit for bit, and what kiln writes for MLX's own formats.
//!
//! Every mode quantizes groups of consecutive elements along the last dimension. Codes are
//! packed little-endian into `uint32` words from the low bits up (MLX's `w_q`); as bytes that
//! is the nibble order of kiln's other FP4 layouts (element 0 in the low nibble of byte 0).
//!
//! **affine** (`bits` 2, 4 or 8; `group` 32, 64 or 128), per group, in f32:
//! ```text
//! lo, hi  = min, max of the group (NaN skipped)
//! s       = max((hi - lo) / (2^bits - 1), 1e-7)
//! s, edge = |lo| > |hi| ? (s, lo) : (-s, hi)
//! q0      = round_half_even(edge / s)
//! q0 ≠ 0  → s = edge / q0, bias = edge;   else bias = 0
//! q       = clamp(round_half_even((w - bias) / s), 0, 2^bits - 1)
//! scale, bias stored in the weight's dtype (rounded from f32); w ≈ scale · q + bias
//! ```
//! The edge (the larger-magnitude extreme) is exactly representable after dequantization.
//!
//! MLX computes the FP modes in the weight's dtype: below, `r(·)` rounds an f32 result to that
//! dtype (nothing for f32 weights); the global scale is f32.
//!
//! **mxfp4** / **mxfp8** (group 32, E8M0 scale): `k = ceil(log2(r(bmax / m)))` (m = 6 or 448)
//! computed exactly (a value one ulp above `2^j` gives `j + 1`); an all-zero group gets `k = 0`.
//! The byte is `k + 127`, *not clamped*: below `2^-127` it wraps around (MLX's cast).
//! `x = r(w / 2^k)`.
//! MXFP8 codes are E4M3, round to nearest even; MXFP4 codes are E2M1 with **ties toward zero**
//! and a sign bit only on non-zero codes (a value that rounds to zero is `0x0`).
//!
//! **nvfp4** (group 16, E4M3 scale): without a global scale `s = e4m3(r(bmax / 6))` and
//! `x = r(w / f32(s))`; with one (`amax`, the tensor's largest magnitude) `enc = 2688 / amax`,
//! `s = e4m3(r(bmax / 6) · enc)` and `x = r(w / f32(s)) · enc`; a zero `s` gives `x = 0`.
//! Codes as MXFP4's.
//!
//! These differ from the ModelOpt formats in `super::mx` / `super::nvfp4` (docs/MLX.md
//! "Quantization on MLX" lists each difference); NaN weights have no defined MLX result.

use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::formats::fp4::E2M1_VALUES;
use crate::formats::fp8::{E4M3_MAX, e4m3_to_f32};
use crate::ops::fp8::e4m3_out;
use crate::ops::round_half_even;

/// One of MLX's floating-point modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FpMode {
    /// 32-element groups, E2M1 codes, E8M0 scales.
    Mxfp4,
    /// 32-element groups, E4M3 codes, E8M0 scales.
    Mxfp8,
    /// 16-element groups, E2M1 codes, E4M3 scales (optionally under a global scale).
    Nvfp4,
}

impl FpMode {
    /// MLX's name for the mode.
    pub fn name(self) -> &'static str {
        match self {
            FpMode::Mxfp4 => "mxfp4",
            FpMode::Mxfp8 => "mxfp8",
            FpMode::Nvfp4 => "nvfp4",
        }
    }
    /// Elements per group.
    pub fn group(self) -> usize {
        match self {
            FpMode::Nvfp4 => 16,
            _ => 32,
        }
    }
    /// Bits per code.
    pub fn bits(self) -> usize {
        match self {
            FpMode::Mxfp8 => 8,
            _ => 4,
        }
    }
    /// Bytes of packed codes for `n` elements.
    pub fn packed_len(self, n: usize) -> usize {
        n * self.bits() / 8
    }
}

/// E2M1 as MLX's CPU rounds it: nearest, ties toward zero, `0x8` only on a non-zero negative
/// code.
pub fn e2m1_mlx(x: f32) -> u8 {
    // Midpoints between neighbouring magnitudes; a tie stays below (toward zero).
    const BOUNDS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    let a = x.abs();
    let idx = BOUNDS.iter().filter(|&&b| b < a).count() as u8;
    if idx > 0 && x.is_sign_negative() {
        idx | 8
    } else {
        idx
    }
}

/// The E8M0 exponent MLX gives a group whose `bmax / max` is `s`: the exact `ceil(log2 s)`
/// (`e + 1` for `s = m · 2^e` with `m > 1`; no f32 rounding of a logarithm), 0 for `s = 0`.
fn mx_exponent_mlx(s: f32) -> i32 {
    let bits = s.to_bits() & 0x7fff_ffff;
    let (exp_field, mant) = ((bits >> 23) as i32, bits & 0x7f_ffff);
    if bits == 0 {
        0
    } else if exp_field == 0 {
        // Subnormal: mant · 2^-149.
        (32 - (mant - 1).leading_zeros()) as i32 - 149
    } else {
        exp_field - 127 + i32::from(mant != 0)
    }
}

/// MLX's scale byte for exponent `k`: `k + 127` as a byte, wrapping below -127 as MLX's cast
/// does (a group whose `bmax / max` is below 2^-127 gets a wrong, huge scale from MLX).
fn mx_byte_mlx(k: i32) -> u8 {
    (k + 127).rem_euclid(256) as u8
}

fn bmax<T: Element>(g: &[T]) -> f32 {
    g.iter().fold(0f32, |m, x| m.max(x.to_f32().abs()))
}

/// One of MLX's FP modes over rows of `cols`: `packed` ([`FpMode::packed_len`] bytes) and one
/// scale byte per group. `global_amax` is NVFP4's optional global scale (ignored otherwise).
pub fn quantize_fp<T: Element>(
    mode: FpMode,
    w: &[T],
    cols: usize,
    global_amax: Option<f32>,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    let op = "quantize_fp_mlx";
    let group = mode.group();
    let groups = crate::layout::row_blocks(op, w.len(), cols, group)?;
    let shape = [w.len() / cols, cols];
    check_len(
        op,
        "packed output",
        packed.len(),
        mode.packed_len(w.len()),
        &shape,
    )?;
    check_len(op, "scales", scales.len(), groups, &shape)?;
    let per_group = mode.packed_len(group);
    for ((g, out), scale) in w
        .chunks_exact(group)
        .zip(packed.chunks_exact_mut(per_group))
        .zip(scales.iter_mut())
    {
        let m = bmax(g);
        // The factor each element is multiplied by after dividing by the decoded scale.
        let (divisor, enc) = match mode {
            FpMode::Mxfp4 | FpMode::Mxfp8 => {
                let top = if mode == FpMode::Mxfp4 { 6.0 } else { E4M3_MAX };
                let k = mx_exponent_mlx(T::round_f32(m / top));
                *scale = mx_byte_mlx(k);
                (2f64.powi(k) as f32, 1.0)
            }
            FpMode::Nvfp4 => {
                let enc = global_amax.map_or(1.0, |a| 2688.0 / a);
                let s = T::round_f32(m / 6.0);
                let s = if global_amax.is_some() { s * enc } else { s };
                *scale = e4m3_out(s.clamp(-E4M3_MAX, E4M3_MAX));
                (e4m3_to_f32(*scale), enc)
            }
        };
        let x = |v: T| {
            if divisor == 0.0 {
                0.0
            } else if enc == 1.0 {
                T::round_f32(v.to_f32() / divisor)
            } else {
                T::round_f32(v.to_f32() / divisor) * enc
            }
        };
        if mode == FpMode::Mxfp8 {
            for (o, &v) in out.iter_mut().zip(g) {
                *o = e4m3_out(x(v).clamp(-E4M3_MAX, E4M3_MAX));
            }
        } else {
            for (o, pair) in out.iter_mut().zip(g.chunks_exact(2)) {
                *o = e2m1_mlx(x(pair[0])) | e2m1_mlx(x(pair[1])) << 4;
            }
        }
    }
    Ok(())
}

/// The value of MXFP4 / NVFP4 code `c` (E2M1).
fn e2m1_value(c: u8) -> f32 {
    let v = E2M1_VALUES[(c & 7) as usize];
    if c & 8 != 0 { -v } else { v }
}

/// Decodes [`quantize_fp`]'s output to f32 (`code · scale`, NVFP4's divided by `enc`).
pub fn dequantize_fp(
    mode: FpMode,
    packed: &[u8],
    scales: &[u8],
    global_amax: Option<f32>,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let op = "dequantize_fp_mlx";
    let n = out.len();
    check_len(op, "packed input", packed.len(), mode.packed_len(n), &[n])?;
    check_len(op, "scales", scales.len(), n / mode.group(), &[n])?;
    for (i, o) in out.iter_mut().enumerate() {
        let s = scales[i / mode.group()];
        let scale = match mode {
            FpMode::Nvfp4 => e4m3_to_f32(s) / global_amax.map_or(1.0, |a| 2688.0 / a),
            _ => 2f64.powi(i32::from(s) - 127) as f32,
        };
        let v = match mode {
            FpMode::Mxfp8 => e4m3_to_f32(packed[i]),
            _ => e2m1_value(packed[i / 2] >> (4 * (i % 2))),
        };
        *o = v * scale;
    }
    Ok(())
}

/// An affine-quantized matrix: packed codes, and per group a scale and a bias.
#[derive(Debug, Clone, PartialEq)]
pub struct Affine<T> {
    /// `uint32` words, element 0 in the low bits.
    pub packed: Vec<u32>,
    /// One scale per group, in the weight's dtype.
    pub scales: Vec<T>,
    /// One bias per group, in the weight's dtype.
    pub biases: Vec<T>,
}

/// The `uint32` words affine `bits` codes of `n` elements take.
pub fn affine_words(n: usize, bits: usize) -> usize {
    n * bits / 32
}

fn affine_params(op: &'static str, bits: usize, group: usize) -> Result<(), KernelError> {
    if !matches!(bits, 2 | 4 | 8) || !matches!(group, 32 | 64 | 128) {
        return Err(KernelError::Parameter {
            op,
            what: format!(
                "affine quantization takes bits 2, 4 or 8 and group size 32, 64 or 128, \
                 not bits {bits} with group size {group}"
            ),
        });
    }
    Ok(())
}

/// The f32 `(scale, bias)` MLX's affine mode gives a group whose least and greatest values
/// are `lo` and `hi` (the steps above, before rounding to the weight's dtype).
pub fn affine_scale_bias(lo: f32, hi: f32, bits: usize) -> (f32, f32) {
    let n_bins = ((1u32 << bits) - 1) as f32;
    let below = lo.abs() > hi.abs();
    // `max(x, eps)` as C++'s std::max writes it: a NaN range stays NaN.
    let range = (hi - lo) / n_bins;
    let s = if range < 1e-7 { 1e-7 } else { range };
    let (mut s, edge) = if below { (s, lo) } else { (-s, hi) };
    let q0 = round_half_even(edge / s);
    let mut b = 0.0;
    if q0 != 0.0 {
        s = edge / q0;
        b = edge;
    }
    (s, b)
}

/// MLX's affine quantization of rows of `cols` (module docs): `packed` words, and per group a
/// scale and a bias in the weight's dtype.
pub fn quantize_affine<T: Element>(
    w: &[T],
    cols: usize,
    group: usize,
    bits: usize,
    packed: &mut [u32],
    scales: &mut [T],
    biases: &mut [T],
) -> Result<(), KernelError> {
    let op = "quantize_affine";
    affine_params(op, bits, group)?;
    let groups = crate::layout::row_blocks(op, w.len(), cols, group)?;
    let shape = [w.len() / cols, cols];
    check_len(
        op,
        "packed output",
        packed.len(),
        affine_words(w.len(), bits),
        &shape,
    )?;
    check_len(op, "scales", scales.len(), groups, &shape)?;
    check_len(op, "biases", biases.len(), groups, &shape)?;
    let n_bins = ((1u32 << bits) - 1) as f32;
    let per_word = 32 / bits;
    for (((g, words), scale), bias) in w
        .chunks_exact(group)
        .zip(packed.chunks_exact_mut(group / per_word))
        .zip(scales.iter_mut())
        .zip(biases.iter_mut())
    {
        let (lo, hi) = g
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| {
                (lo.min(x.to_f32()), hi.max(x.to_f32()))
            });
        let (s, b) = affine_scale_bias(lo, hi, bits);
        for (word, vals) in words.iter_mut().zip(g.chunks_exact(per_word)) {
            *word = vals.iter().enumerate().fold(0u32, |acc, (k, v)| {
                let q = round_half_even((v.to_f32() - b) / s).max(0.0).min(n_bins);
                // A NaN weight (NaN quotient) writes 0; MLX's cast of NaN is undefined.
                let q = if q.is_nan() { 0 } else { q as u32 };
                acc | q << (k * bits)
            });
        }
        *scale = T::from_f32(s);
        *bias = T::from_f32(b);
    }
    Ok(())
}

/// Packs affine codes (`0 ..= 2^bits − 1`, one a byte) into MLX's `uint32` words, element
/// `k` of a word at bit `k · bits` (what [`quantize_affine`] writes for the codes it chooses).
pub fn pack_affine(codes: &[u8], bits: usize, packed: &mut [u32]) -> Result<(), KernelError> {
    let op = "pack_affine";
    affine_params(op, bits, 32)?;
    let n = codes.len();
    check_len(
        op,
        "packed output",
        packed.len(),
        affine_words(n, bits),
        &[n],
    )?;
    let mask = (1u32 << bits) - 1;
    if let Some(&bad) = codes.iter().find(|&&q| u32::from(q) > mask) {
        return Err(KernelError::Parameter {
            op,
            what: format!("code {bad} does not fit {bits} bits"),
        });
    }
    for (word, vals) in packed.iter_mut().zip(codes.chunks_exact(32 / bits)) {
        *word = vals
            .iter()
            .enumerate()
            .fold(0u32, |acc, (k, &q)| acc | u32::from(q) << (k * bits));
    }
    Ok(())
}

/// Decodes [`quantize_affine`]'s output: `scale · q + bias`, in f32 from the stored scale and
/// bias.
pub fn dequantize_affine<T: Element>(
    packed: &[u32],
    scales: &[T],
    biases: &[T],
    group: usize,
    bits: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let op = "dequantize_affine";
    affine_params(op, bits, group)?;
    let n = out.len();
    check_len(
        op,
        "packed input",
        packed.len(),
        affine_words(n, bits),
        &[n],
    )?;
    check_len(op, "scales", scales.len(), n / group, &[n])?;
    check_len(op, "biases", biases.len(), n / group, &[n])?;
    let per_word = 32 / bits;
    let mask = (1u32 << bits) - 1;
    for (i, o) in out.iter_mut().enumerate() {
        let q = (packed[i / per_word] >> ((i % per_word) * bits)) & mask;
        *o = scales[i / group].to_f32() * q as f32 + biases[i / group].to_f32();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_ties_go_toward_zero_and_zero_codes_have_no_sign() {
        let ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
        let below = [0u8, 1, 2, 3, 4, 5, 6];
        for (t, c) in ties.iter().zip(below) {
            assert_eq!(e2m1_mlx(*t), c, "{t}");
            assert_eq!(e2m1_mlx(-*t), if c == 0 { 0 } else { c | 8 }, "-{t}");
        }
        assert_eq!(e2m1_mlx(-0.0), 0);
        assert_eq!(e2m1_mlx(-0.1), 0);
        assert_eq!(e2m1_mlx(0.26), 1);
        assert_eq!(e2m1_mlx(-7.0), 0xf);
    }

    #[test]
    fn one_mxfp4_group_by_hand() {
        // bmax 6 → k = 0 (byte 127); 3.5 is a tie between 3 and 4 → 3 (code 5).
        let mut w = [0f32; 32];
        w[0] = 6.0;
        w[1] = 3.5;
        w[2] = -0.2;
        let (mut p, mut s) = ([0u8; 16], [0u8; 1]);
        quantize_fp(FpMode::Mxfp4, &w, 32, None, &mut p, &mut s).unwrap();
        assert_eq!(s[0], 127);
        assert_eq!(p[0], 0x7 | 0x5 << 4);
        assert_eq!(p[1], 0, "-0.2 rounds to zero: no sign bit");
        // One ulp above a power of two: the exact ceiling is the next power.
        w[0] = f32::from_bits(6f32.to_bits() + 1);
        quantize_fp(FpMode::Mxfp4, &w, 32, None, &mut p, &mut s).unwrap();
        assert_eq!(s[0], 128);
        // Below 2^-127 the byte wraps (MLX's cast): 6e-39 / 6 → k = -129 → 254.
        let mut tiny = [0f32; 32];
        tiny[0] = 6e-39;
        quantize_fp(FpMode::Mxfp4, &tiny, 32, None, &mut p, &mut s).unwrap();
        assert_eq!(s[0], 254);
        // An all-zero group: exponent 0, not -127.
        quantize_fp(FpMode::Mxfp4, &[0f32; 32], 32, None, &mut p, &mut s).unwrap();
        assert_eq!(s[0], 127);
    }

    #[test]
    fn nvfp4_with_a_global_scale_by_hand() {
        // amax 6 → enc = 448; bmax 6 → s = 1 · 448 = 448 (0x7e); x = w / 448 · 448 = w.
        let mut w = [0f32; 16];
        w[0] = 6.0;
        w[1] = -1.75;
        let (mut p, mut s) = ([0u8; 8], [0u8; 1]);
        quantize_fp(FpMode::Nvfp4, &w, 16, Some(6.0), &mut p, &mut s).unwrap();
        assert_eq!(s[0], 0x7e);
        assert_eq!(p[0], 0x7 | 0xb << 4, "-1.75 ties toward zero: -1.5");
        let mut back = [0f32; 16];
        dequantize_fp(FpMode::Nvfp4, &p, &s, Some(6.0), &mut back).unwrap();
        assert_eq!(&back[..2], &[6.0, -1.5]);
    }

    #[test]
    fn one_affine_group_by_hand() {
        // 4 bits over [-1, 2]: |lo| < |hi| → s = -(3/15), edge = hi = 2; q0 = round(2 / -0.2)
        // = -10 → s = 2 / -10 = -0.2, bias = 2. The edge decodes exactly.
        let mut w = vec![0f32; 32];
        w[0] = -1.0;
        w[1] = 2.0;
        w[2] = 0.5;
        let (mut p, mut s, mut b) = (vec![0u32; 4], vec![0f32; 1], vec![0f32; 1]);
        quantize_affine(&w, 32, 32, 4, &mut p, &mut s, &mut b).unwrap();
        assert_eq!(s[0], 2.0f32 / -10.0);
        assert_eq!(b[0], 2.0);
        let mut back = vec![0f32; 32];
        dequantize_affine(&p, &s, &b, 32, 4, &mut back).unwrap();
        assert_eq!(back[1], 2.0);
        assert_eq!(p[0] & 0xf, 15, "-1 → (−1 − 2) / −0.2 = 15");
        assert_eq!((p[0] >> 4) & 0xf, 0);
        assert!((back[0] + 1.0).abs() < 1e-6, "{}", back[0]);
        assert!((back[2] - 0.5).abs() <= 0.1 + 1e-6, "{}", back[2]);
    }

    #[test]
    fn affine_refuses_what_mlx_cannot_pack() {
        let w = [0f32; 64];
        let (mut p, mut s, mut b) = (vec![0u32; 24], vec![0f32; 1], vec![0f32; 1]);
        let e = quantize_affine(&w, 64, 64, 3, &mut p, &mut s, &mut b).unwrap_err();
        assert!(e.to_string().contains("bits 2, 4 or 8"), "{e}");
        let e = quantize_affine(&w, 48, 32, 4, &mut p, &mut s, &mut b).unwrap_err();
        assert!(
            e.to_string().contains("multiple of the block size 32"),
            "{e}"
        );
    }

    #[test]
    fn packing_chosen_codes_is_what_quantize_affine_packs() {
        let w: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        for bits in [2usize, 4, 8] {
            let mut packed = vec![0u32; affine_words(w.len(), bits)];
            let (mut s, mut b) = (vec![0f32; 2], vec![0f32; 2]);
            quantize_affine(&w, 128, 64, bits, &mut packed, &mut s, &mut b).unwrap();
            let n_bins = ((1u32 << bits) - 1) as f32;
            let codes: Vec<u8> = w
                .iter()
                .enumerate()
                .map(|(i, &x)| {
                    let g = i / 64;
                    round_half_even((x - b[g]) / s[g]).clamp(0.0, n_bins) as u8
                })
                .collect();
            let mut again = vec![0u32; packed.len()];
            pack_affine(&codes, bits, &mut again).unwrap();
            assert_eq!(again, packed, "{bits} bits");
        }
        let mut out = vec![0u32; 1];
        assert!(pack_affine(&[16, 0, 0, 0, 0, 0, 0, 0], 4, &mut out).is_err());
    }
}
