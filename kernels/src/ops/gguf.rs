//! llama.cpp's GGUF block quantizations, as `llama-quantize` computes them (`quantize_<type>`
//! in `ggml-quants.c`; without an importance matrix that is the reference code
//! `quantize_row_*_ref` for most types): the legacy Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, the
//! k-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K, the non-linear IQ4_NL / IQ4_XS and MXFP4 — each
//! also with importance weights ([`quantize_with`], `llama-quantize --imatrix`; the weighted
//! code and the types below four bits are in `gguf_imatrix.rs`). Readable scalar code in the C
//! code's f32 arithmetic and operation order, checked byte for byte against vectors the C code
//! produced (`tests/vectors/gguf_gen.py`).
//!
//! Input is f32 (llama.cpp widens F16 / BF16 to f32 before quantizing); output is ggml's block
//! structs as bytes, little-endian, f16 fields rounded to nearest even. Blocks run along the
//! row: every row's length must be a multiple of the type's block.
//!
//! Rounding helpers, as in the C code: `nearest_int` (round half to even through the
//! `x + 1.5·2^23` trick), `roundf` (half away from zero, Q8_0), and truncating casts of
//! `x + 0.5` (legacy types). No fused multiply-add anywhere: llama.cpp built with
//! `-ffp-contract=off` (or for a CPU without FMA) gives these bytes; a build that contracts
//! `a·b + c` into FMA may pick a different k-quant scale in rare blocks.

// The loops index as ggml-quants.c does, so that each line can be checked against the C.
#![allow(clippy::needless_range_loop)]

use crate::error::{KernelError, check_len};
use half::f16;

/// The GGUF tensor types kiln quantizes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufType {
    /// 32 elements: f16 scale `d = max / -8`, 4-bit codes.
    Q4_0,
    /// 32 elements: f16 scale and minimum, 4-bit codes.
    Q4_1,
    /// 32 elements: f16 scale `d = max / -16`, 5-bit codes.
    Q5_0,
    /// 32 elements: f16 scale and minimum, 5-bit codes.
    Q5_1,
    /// 32 elements: f16 scale `amax / 127`, 8-bit codes.
    Q8_0,
    /// 256 elements: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit codes.
    Q4K,
    /// 256 elements: as Q4_K with 5-bit codes.
    Q5K,
    /// 256 elements: 16 sub-blocks of 16 with 8-bit scales, 6-bit codes.
    Q6K,
    /// 32 elements: an E8M0 exponent, E2M1 codes.
    Mxfp4,
    /// 256 elements: 16 sub-blocks of 16 with 4-bit scales and minimums, 2-bit codes.
    Q2K,
    /// 256 elements: 16 sub-blocks of 16 with 6-bit signed scales, 3-bit codes.
    Q3K,
    /// 32 elements: f16 scale, 4-bit indices into llama.cpp's non-linear grid.
    Iq4Nl,
    /// 256 elements: 8 sub-blocks of 32 with 6-bit scales, IQ4_NL's grid.
    Iq4Xs,
    /// 256 elements: groups of 8 on a 256-point E8 lattice, 7 sign bits, 4-bit scales per 32
    /// (2.06 bits per weight; needs importance weights).
    Iq2Xxs,
    /// 256 elements: a 512-point lattice, 4-bit scales per 16 (2.31 bits; needs weights).
    Iq2Xs,
    /// 256 elements: a 1024-point lattice, 8 sign bits (2.56 bits).
    Iq2S,
    /// 256 elements: groups of 4 on a 256-point D4 lattice of 3-bit levels (3.06 bits).
    Iq3Xxs,
    /// 256 elements: a 512-point lattice, 8 sign bits (3.44 bits).
    Iq3S,
}

impl GgufType {
    /// Every type, in `ggml_type` order.
    pub const ALL: [GgufType; 18] = [
        GgufType::Q4_0,
        GgufType::Q4_1,
        GgufType::Q5_0,
        GgufType::Q5_1,
        GgufType::Q8_0,
        GgufType::Q2K,
        GgufType::Q3K,
        GgufType::Q4K,
        GgufType::Q5K,
        GgufType::Q6K,
        GgufType::Iq4Nl,
        GgufType::Iq4Xs,
        GgufType::Iq2Xxs,
        GgufType::Iq2Xs,
        GgufType::Iq2S,
        GgufType::Iq3Xxs,
        GgufType::Iq3S,
        GgufType::Mxfp4,
    ];

    /// ggml's name (`Q4_K`, …).
    pub fn name(self) -> &'static str {
        match self {
            GgufType::Q4_0 => "Q4_0",
            GgufType::Q4_1 => "Q4_1",
            GgufType::Q5_0 => "Q5_0",
            GgufType::Q5_1 => "Q5_1",
            GgufType::Q8_0 => "Q8_0",
            GgufType::Q4K => "Q4_K",
            GgufType::Q5K => "Q5_K",
            GgufType::Q6K => "Q6_K",
            GgufType::Mxfp4 => "MXFP4",
            GgufType::Q2K => "Q2_K",
            GgufType::Q3K => "Q3_K",
            GgufType::Iq4Nl => "IQ4_NL",
            GgufType::Iq4Xs => "IQ4_XS",
            GgufType::Iq2Xxs => "IQ2_XXS",
            GgufType::Iq2Xs => "IQ2_XS",
            GgufType::Iq2S => "IQ2_S",
            GgufType::Iq3Xxs => "IQ3_XXS",
            GgufType::Iq3S => "IQ3_S",
        }
    }

    /// ggml's `ggml_type` number, as GGUF files record it.
    pub fn ggml_type(self) -> u32 {
        match self {
            GgufType::Q4_0 => 2,
            GgufType::Q4_1 => 3,
            GgufType::Q5_0 => 6,
            GgufType::Q5_1 => 7,
            GgufType::Q8_0 => 8,
            GgufType::Q4K => 12,
            GgufType::Q5K => 13,
            GgufType::Q6K => 14,
            GgufType::Mxfp4 => 39,
            GgufType::Q2K => 10,
            GgufType::Q3K => 11,
            GgufType::Iq4Nl => 20,
            GgufType::Iq4Xs => 23,
            GgufType::Iq2Xxs => 16,
            GgufType::Iq2Xs => 17,
            GgufType::Iq2S => 22,
            GgufType::Iq3Xxs => 18,
            GgufType::Iq3S => 21,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgufType::Q2K
            | GgufType::Q3K
            | GgufType::Q4K
            | GgufType::Q5K
            | GgufType::Q6K
            | GgufType::Iq4Xs
            | GgufType::Iq2Xxs
            | GgufType::Iq2Xs
            | GgufType::Iq2S
            | GgufType::Iq3Xxs
            | GgufType::Iq3S => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgufType::Q4_0 => 18,
            GgufType::Q4_1 => 20,
            GgufType::Q5_0 => 22,
            GgufType::Q5_1 => 24,
            GgufType::Q8_0 => 34,
            GgufType::Q4K => 144,
            GgufType::Q5K => 176,
            GgufType::Q6K => 210,
            GgufType::Mxfp4 => 17,
            GgufType::Q2K => 84,
            GgufType::Q3K => 110,
            GgufType::Iq4Nl => 18,
            GgufType::Iq4Xs => 136,
            GgufType::Iq2Xxs => 66,
            GgufType::Iq2Xs => 74,
            GgufType::Iq2S => 82,
            GgufType::Iq3Xxs => 98,
            GgufType::Iq3S => 110,
        }
    }

    /// Bytes `n` elements take.
    pub fn bytes_for(self, n: usize) -> usize {
        n / self.block_elems() * self.block_bytes()
    }
}

/// Rounds to the nearest integer, ties to even, as ggml's `nearest_int` does (valid for
/// `|x| ≤ 2^22`).
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn half(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

fn unhalf(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The value of largest magnitude (the first one, on ties) and that magnitude.
fn signed_max(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (max, amax)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// Checks that `n` elements in rows of `cols` are whole blocks of `ty` and `out` holds their
/// bytes (the reference's and the threaded driver's errors).
pub(crate) fn check_layout(
    ty: GgufType,
    n: usize,
    cols: usize,
    out: usize,
) -> Result<(), KernelError> {
    crate::layout::row_blocks("quantize_gguf", n, cols, ty.block_elems())?;
    check_len(
        "quantize_gguf",
        "output",
        out,
        ty.bytes_for(n),
        &[n / cols, cols],
    )
}

/// Quantizes `x` (rows of `cols`) to `ty` as `llama-quantize` does without an importance
/// matrix (`quantize_<type>(…, NULL)`), writing [`GgufType::bytes_for`] bytes.
pub fn quantize(ty: GgufType, x: &[f32], cols: usize, out: &mut [u8]) -> Result<(), KernelError> {
    quantize_with(ty, x, cols, None, out)
}

/// Quantizes `x` (rows of `cols`) to `ty` as `llama-quantize --imatrix` does: `imatrix` holds
/// one importance weight per column (the mean squared input activation, as llama.cpp loads it
/// from an imatrix file), and every row is quantized with the same weights
/// (`quantize_<type>(…, quant_weights)`). `None` is [`quantize`]. Q8_0 and MXFP4 ignore the
/// weights, as ggml does.
pub fn quantize_with(
    ty: GgufType,
    x: &[f32],
    cols: usize,
    imatrix: Option<&[f32]>,
    out: &mut [u8],
) -> Result<(), KernelError> {
    check_layout(ty, x.len(), cols, out.len())?;
    let Some(qw) = imatrix.filter(|_| weighted(ty)) else {
        return quantize_blocks(ty, x, out);
    };
    check_len(
        "quantize_gguf",
        "importance weights",
        qw.len(),
        cols,
        &[cols],
    )?;
    let row_bytes = ty.bytes_for(cols);
    for (row, o) in x.chunks_exact(cols).zip(out.chunks_exact_mut(row_bytes)) {
        imatrix::quantize_row(ty, row, qw, o);
    }
    Ok(())
}

/// Whether ggml's quantizer of `ty` reads importance weights.
pub fn weighted(ty: GgufType) -> bool {
    !matches!(ty, GgufType::Q8_0 | GgufType::Mxfp4)
}

/// Whether `ty` cannot be made without importance weights (ggml asserts them: IQ2_XXS,
/// IQ2_XS).
pub fn needs_weights(ty: GgufType) -> bool {
    matches!(ty, GgufType::Iq2Xxs | GgufType::Iq2Xs)
}

/// Whole blocks of `ty` without importance weights, each block on its own; an error for a type
/// that needs them.
pub(crate) fn quantize_blocks(ty: GgufType, x: &[f32], out: &mut [u8]) -> Result<(), KernelError> {
    if needs_weights(ty) {
        return Err(KernelError::Parameter {
            op: "quantize_gguf",
            what: format!(
                "{} needs importance weights (an importance matrix), as llama.cpp's does",
                ty.name()
            ),
        });
    }
    let block = ty.block_elems();
    for (b, o) in x
        .chunks_exact(block)
        .zip(out.chunks_exact_mut(ty.block_bytes()))
    {
        match ty {
            GgufType::Q4_0 => q4_0(b, o),
            GgufType::Q4_1 => q4_1(b, o),
            GgufType::Q5_0 => q5_0(b, o),
            GgufType::Q5_1 => q5_1(b, o),
            GgufType::Q8_0 => q8_0(b, o),
            GgufType::Q2K => imatrix::q2_k_ref(b, o),
            GgufType::Q3K => imatrix::q3_k_ref(b, o),
            GgufType::Q4K => qk_asym(b, o, 15),
            GgufType::Q5K => qk_asym(b, o, 31),
            GgufType::Q6K => q6_k(b, o),
            GgufType::Iq4Nl | GgufType::Iq4Xs => imatrix::iq4(b, o, None),
            GgufType::Iq2S | GgufType::Iq3Xxs | GgufType::Iq3S => {
                iq::quantize_block(ty, b, None, o, &iq::Scalar)
            }
            // Refused above.
            GgufType::Iq2Xxs | GgufType::Iq2Xs => {}
            GgufType::Mxfp4 => mxfp4(b, o),
        }
    }
    Ok(())
}

#[path = "gguf_imatrix.rs"]
mod imatrix;
pub(crate) use imatrix::{
    KVALUES_IQ4NL, iq4_finish, iq4_weights, k16_weights, legacy_blocks, legacy_pack_asym,
    legacy_pack_sym, legacy_sigma2, q2_k_finish, q2_k_impl_finish, q3_k_impl_scales, q3_k_pack,
    q3_k_ref_scales, q3_k_steps, qk_asym_impl_finish, qk_asym_weights,
};
#[path = "gguf_iq.rs"]
mod iq;
pub(crate) use iq::{Lattice, Neighbours, quantize_block as iq_block};

fn q4_0(x: &[f32], o: &mut [u8]) {
    let (max, _) = signed_max(x);
    let d = max / -8.0;
    let id = inverse(d);
    o[..2].copy_from_slice(&half(d));
    for j in 0..16 {
        let c = |v: f32| ((v * id + 8.5) as i32).min(15) as u8;
        o[2 + j] = c(x[j]) | c(x[16 + j]) << 4;
    }
}

fn q4_1(x: &[f32], o: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    o[..2].copy_from_slice(&half(d));
    o[2..4].copy_from_slice(&half(min));
    for j in 0..16 {
        let c = |v: f32| (((v - min) * id + 0.5) as i32).min(15) as u8;
        o[4 + j] = c(x[j]) | c(x[16 + j]) << 4;
    }
}

/// The 5-bit codes' low nibbles into `qs` and fifth bits into the 32-bit `qh`.
fn pack5(codes: impl Fn(usize) -> u8, qh: &mut [u8], qs: &mut [u8]) {
    let mut h = 0u32;
    for j in 0..16 {
        let (a, b) = (codes(j), codes(16 + j));
        qs[j] = (a & 0xf) | (b & 0xf) << 4;
        h |= u32::from(a >> 4 & 1) << j;
        h |= u32::from(b >> 4 & 1) << (j + 16);
    }
    qh.copy_from_slice(&h.to_le_bytes());
}

fn q5_0(x: &[f32], o: &mut [u8]) {
    let (max, _) = signed_max(x);
    let d = max / -16.0;
    let id = inverse(d);
    o[..2].copy_from_slice(&half(d));
    let (qh, qs) = o[2..].split_at_mut(4);
    pack5(|j| ((x[j] * id + 16.5) as i32).min(31) as u8, qh, qs);
}

fn q5_1(x: &[f32], o: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    o[..2].copy_from_slice(&half(d));
    o[2..4].copy_from_slice(&half(min));
    let (qh, qs) = o[4..].split_at_mut(4);
    // No clamp to 31 in ggml: `(x - min) · id ≤ 31` up to rounding, and the cast truncates.
    pack5(|j| ((x[j] - min) * id + 0.5) as u8, qh, qs);
}

fn q8_0(x: &[f32], o: &mut [u8]) {
    let amax = x
        .iter()
        .fold(0f32, |a, v| if a > v.abs() { a } else { v.abs() });
    let d = amax / 127.0;
    let id = inverse(d);
    o[..2].copy_from_slice(&half(d));
    for (q, &v) in o[2..].iter_mut().zip(x) {
        *q = ((v * id).round() as i8) as u8;
    }
}

/// E2M1 values times two (ggml's `kvalues_mxfp4`).
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// MXFP4's block exponent for the block's largest magnitude `amax` (ggml's
/// `floor(log2f(amax)) - 2 + 127`, log2 rounded to f32 once) and half its E8M0 scale,
/// `2^(e − 128)`, the step its codes multiply.
pub(crate) fn mxfp4_scale(amax: f32) -> (u8, f32) {
    let e = if amax > 0.0 {
        (crate::formats::e8m0::log2_f32(amax).floor() - 2.0 + 127.0) as i32 as u8
    } else {
        0
    };
    (e, mxfp4_step(e))
}

/// Half the E8M0 scale `e`: `2^(e − 128)`.
pub(crate) fn mxfp4_step(e: u8) -> f32 {
    f32::from_bits(if e < 2 {
        0x0020_0000 << e
    } else {
        u32::from(e - 1) << 23
    })
}

fn mxfp4(x: &[f32], o: &mut [u8]) {
    let amax = x
        .iter()
        .fold(0f32, |a, v| if a < v.abs() { v.abs() } else { a });
    let (e, d) = mxfp4_scale(amax);
    o[0] = e;
    let best = |v: f32| -> u8 {
        let mut best = 0;
        let mut err = (f32::from(KVALUES_MXFP4[0]) * d - v).abs();
        for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
            let e = (f32::from(k) * d - v).abs();
            if e < err {
                best = i as u8;
                err = e;
            }
        }
        best
    };
    for j in 0..16 {
        o[1 + j] = best(x[j]) | best(x[16 + j]) << 4;
    }
}

/// ggml's `make_qkx2_quants`: a scale and a minimum for `x` with codes in `0..=nmax`, the best
/// (weighted squared error) of a grid of `nstep + 1` candidate scales around `nmax / range`.
/// Returns `(scale, -min)` and writes the codes to `l`. `use_mad`: absolute rather than squared
/// errors (Q2_K).
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * f32::from(l[i]) + min - x[i];
        best_error += weights[i] * if use_mad { diff.abs() } else { diff * diff };
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, qf) = (weights[i], q as f32);
            sum_l += w * qf;
            sum_l2 += w * qf * qf;
            sum_xl += w * qf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(laux[i]) + this_min - x[i];
                cur_error += weights[i] * if use_mad { diff.abs() } else { diff * diff };
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Sub-block `j`'s 6-bit scale and minimum from Q4_K / Q5_K's 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4,
            (q[j + 4] >> 4) | (q[j] >> 6) << 4,
        )
    }
}

/// Q4_K (`nmax` 15) and Q5_K (`nmax` 31): `d`, `dmin`, 12 bytes of scales, then the codes.
fn qk_asym(x: &[f32], o: &mut [u8], nmax: i32) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (rmin, nstep) = qk_asym_grid(nmax);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0f32; 32];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(
            nmax,
            xs,
            &weights,
            &mut l[32 * j..32 * j + 32],
            rmin,
            0.1,
            nstep,
            false,
        );
    }
    qk_asym_finish(x, o, nmax, &scales, &mins, &mut l);
}

/// Q4_K's and Q5_K's search grid: `(rmin, nstep)` of `make_qkx2_quants` (`rdelta` is 0.1).
pub(crate) fn qk_asym_grid(nmax: i32) -> (f32, i32) {
    if nmax == 15 { (-1.0, 20) } else { (-0.5, 15) }
}

/// The rest of Q4_K / Q5_K once each sub-block's scale and minimum are found (`l` holds the
/// search's codes): 6-bit scales against the block's `d` and `dmin`, the codes recomputed
/// from them, packed. Shared by the reference and the SIMD search (`cpu::kquants`).
pub(crate) fn qk_asym_finish(
    x: &[f32],
    o: &mut [u8],
    nmax: i32,
    scales: &[f32; 8],
    mins: &[f32; 8],
    l: &mut [u8; 256],
) {
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut [0u8; 12];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xf) | (lm & 0xf) << 4;
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    o[..2].copy_from_slice(&half(max_scale / 63.0));
    o[2..4].copy_from_slice(&half(max_min / 63.0));
    o[4..16].copy_from_slice(sc);
    qk_asym_codes(x, o, nmax, l);
}

/// Q4_K / Q5_K's codes once `d`, `dmin` and the 12 scale bytes are in `o[..16]`: each code
/// recomputed from the stored scale and minimum (sub-blocks whose scale is zero keep `l`'s),
/// packed.
pub(crate) fn qk_asym_codes(x: &[f32], o: &mut [u8], nmax: i32, l: &mut [u8; 256]) {
    let (d_all, dmin_all) = (unhalf(&o[..2]), unhalf(&o[2..4]));
    let sc: [u8; 12] = o[4..16].try_into().expect("12 scale bytes");
    let sc = &sc;
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, sc);
        let d = d_all * f32::from(s);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * f32::from(m);
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
    if nmax == 15 {
        let qs = &mut o[16..144];
        for (chunk, q) in l.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
            for i in 0..32 {
                q[i] = chunk[i] | chunk[i + 32] << 4;
            }
        }
    } else {
        let (qh, ql) = o[16..176].split_at_mut(32);
        qh.fill(0);
        let (mut m1, mut m2) = (1u8, 2u8);
        for (chunk, q) in l.chunks_exact(64).zip(ql.chunks_exact_mut(32)) {
            for i in 0..32 {
                let (mut l1, mut l2) = (chunk[i], chunk[i + 32]);
                if l1 > 15 {
                    l1 -= 16;
                    qh[i] |= m1;
                }
                if l2 > 15 {
                    l2 -= 16;
                    qh[i] |= m2;
                }
                q[i] = l1 | l2 << 4;
            }
            m1 <<= 2;
            m2 <<= 2;
        }
    }
}

/// ggml's `make_qx_quants` with `rmse_type` 1: a symmetric scale for codes in
/// `-nmax..nmax`, the best of 19 candidates by the weighted error; codes (offset by `nmax`) into
/// `l`. Weights `qw`, or `x²` without them.
fn make_qx_quants(nmax: i32, x: &[f32], l: &mut [i8], qw: Option<&[f32]>) -> f32 {
    let (max, amax) = signed_max(x);
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for (i, &v) in x.iter().enumerate() {
            let q = code(iscale, v) as f32;
            let w = qw.map_or(v * v, |w| w[i]);
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let mut iscale = -nmax_f / max;
    for (o, &v) in l.iter_mut().zip(x) {
        *o = (code(iscale, v) + nmax) as i8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax_f + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l.iter_mut().zip(x) {
                *o = (code(iscale, v) + nmax) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K: `ql` (128), `qh` (64), 16 signed scales, `d`.
fn q6_k(x: &[f32], o: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    for ib in 0..16 {
        scales[ib] = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut l[16 * ib..16 * ib + 16],
            None,
        );
    }
    q6_k_finish(x, o, &scales, &mut l);
}

/// The rest of Q6_K once each sub-block's scale is found (`l` holds the search's codes): 8-bit
/// scales against the block's `d`, the codes recomputed, packed. Shared by the reference and
/// the SIMD search (`cpu::kquants`).
pub(crate) fn q6_k_finish(x: &[f32], o: &mut [u8], scales: &[f32; 16], l: &mut [i8; 256]) {
    let (mut max_scale, mut max_abs_scale) = (0f32, 0f32);
    for &s in scales {
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < 1e-15 {
        o.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    o[208..210].copy_from_slice(&half(1.0 / iscale));
    let d_all = unhalf(&o[208..210]);
    for ib in 0..16 {
        o[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    for j in 0..16 {
        let d = d_all * f32::from(o[192 + j] as i8);
        if d == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as i8;
        }
    }
    let (ql, qh) = o[..192].split_at_mut(128);
    for ((chunk, ql), qh) in l
        .chunks_exact(128)
        .zip(ql.chunks_exact_mut(64))
        .zip(qh.chunks_exact_mut(32))
    {
        let c = |i: usize| chunk[i] as u8;
        for i in 0..32 {
            ql[i] = (c(i) & 0xf) | (c(i + 64) & 0xf) << 4;
            ql[i + 32] = (c(i + 32) & 0xf) | (c(i + 96) & 0xf) << 4;
            qh[i] =
                c(i) >> 4 | (c(i + 32) >> 4) << 2 | (c(i + 64) >> 4) << 4 | (c(i + 96) >> 4) << 6;
        }
    }
}

/// Decodes `data` of type `ty` to f32, as ggml's `dequantize_row_*` do.
///
/// Long on purpose: one arm per ggml block type, each ggml's `dequantize_row_*`.
pub fn dequantize(ty: GgufType, data: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let n = out.len();
    if !n.is_multiple_of(ty.block_elems()) {
        return Err(KernelError::BlockMismatch {
            op: "dequantize_gguf",
            cols: n,
            block: ty.block_elems(),
        });
    }
    check_len(
        "dequantize_gguf",
        "input",
        data.len(),
        ty.bytes_for(n),
        &[n],
    )?;
    for (b, y) in data
        .chunks_exact(ty.block_bytes())
        .zip(out.chunks_exact_mut(ty.block_elems()))
    {
        match ty {
            GgufType::Q4_0 | GgufType::Q5_0 => {
                let d = unhalf(b);
                let five = ty == GgufType::Q5_0;
                let (qh, qs) = if five {
                    (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22])
                } else {
                    (0, &b[2..18])
                };
                for j in 0..16 {
                    let hi = |k: usize| if five { ((qh >> k & 1) << 4) as i32 } else { 0 };
                    let off = if five { 16 } else { 8 };
                    y[j] = ((i32::from(qs[j] & 0xf) | hi(j)) - off) as f32 * d;
                    y[j + 16] = ((i32::from(qs[j] >> 4) | hi(j + 16)) - off) as f32 * d;
                }
            }
            GgufType::Q4_1 | GgufType::Q5_1 => {
                let (d, m) = (unhalf(b), unhalf(&b[2..]));
                let five = ty == GgufType::Q5_1;
                let (qh, qs) = if five {
                    (u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24])
                } else {
                    (0, &b[4..20])
                };
                for j in 0..16 {
                    let hi = |k: usize| if five { ((qh >> k & 1) << 4) as u8 } else { 0 };
                    y[j] = f32::from((qs[j] & 0xf) | hi(j)) * d + m;
                    y[j + 16] = f32::from((qs[j] >> 4) | hi(j + 16)) * d + m;
                }
            }
            GgufType::Q8_0 => {
                let d = unhalf(b);
                for (v, &q) in y.iter_mut().zip(&b[2..34]) {
                    *v = f32::from(q as i8) * d;
                }
            }
            GgufType::Mxfp4 => {
                let e = b[0];
                let d = f32::from_bits(if e < 2 {
                    0x0020_0000 << e
                } else {
                    u32::from(e - 1) << 23
                });
                for j in 0..16 {
                    y[j] = f32::from(KVALUES_MXFP4[usize::from(b[1 + j] & 0xf)]) * d;
                    y[j + 16] = f32::from(KVALUES_MXFP4[usize::from(b[1 + j] >> 4)]) * d;
                }
            }
            GgufType::Q4K | GgufType::Q5K => {
                let (d, min) = (unhalf(b), unhalf(&b[2..]));
                let sc = &b[4..16];
                let five = ty == GgufType::Q5K;
                let (qh, ql) = if five {
                    (&b[16..48], &b[48..176])
                } else {
                    (&b[..0], &b[16..144])
                };
                for (c, (q, ys)) in ql.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
                    let (s1, m1) = scale_min_k4(2 * c, sc);
                    let (s2, m2) = scale_min_k4(2 * c + 1, sc);
                    let (d1, mm1) = (d * f32::from(s1), min * f32::from(m1));
                    let (d2, mm2) = (d * f32::from(s2), min * f32::from(m2));
                    for i in 0..32 {
                        let h = |bit: usize| if five { (qh[i] >> bit & 1) << 4 } else { 0 };
                        ys[i] = d1 * f32::from((q[i] & 0xf) | h(2 * c)) - mm1;
                        ys[i + 32] = d2 * f32::from((q[i] >> 4) | h(2 * c + 1)) - mm2;
                    }
                }
            }
            GgufType::Q2K => {
                let (d, min) = (unhalf(&b[80..]), unhalf(&b[82..]));
                let (sc, qs) = (&b[..16], &b[16..80]);
                for (n, (q, ys)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(128)).enumerate() {
                    for j in 0..4 {
                        for half_ in 0..2 {
                            let s = sc[8 * n + 2 * j + half_];
                            let (dl, ml) = (d * f32::from(s & 0xf), min * f32::from(s >> 4));
                            for l in 0..16 {
                                let c = (q[16 * half_ + l] >> (2 * j)) & 3;
                                ys[32 * j + 16 * half_ + l] = dl * f32::from(c) - ml;
                            }
                        }
                    }
                }
            }
            GgufType::Q3K => {
                let d_all = unhalf(&b[108..]);
                let (hm, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
                for (k, v) in y.iter_mut().enumerate() {
                    // Element k: sub-block k / 16; its low bits in plane (k % 128) / 32 of
                    // byte k / 128 · 32 + k % 32; its high bit in hmask[k % 32], bit k / 32.
                    let j = k / 16;
                    let low = if j < 8 { sc[j] & 0xf } else { sc[j - 8] >> 4 };
                    let s = i32::from(low | ((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32;
                    let q = i32::from((qs[k / 128 * 32 + k % 32] >> (2 * ((k % 128) / 32))) & 3);
                    let high = if hm[k % 32] >> (k / 32) & 1 == 1 {
                        0
                    } else {
                        4
                    };
                    *v = d_all * s as f32 * (q - high) as f32;
                }
            }
            GgufType::Iq4Nl => {
                let d = unhalf(b);
                for j in 0..16 {
                    y[j] = d * f32::from(imatrix::KVALUES_IQ4NL[usize::from(b[2 + j] & 0xf)]);
                    y[j + 16] = d * f32::from(imatrix::KVALUES_IQ4NL[usize::from(b[2 + j] >> 4)]);
                }
            }
            GgufType::Iq4Xs => {
                let d = unhalf(b);
                let scales_h = u16::from_le_bytes([b[2], b[3]]);
                for ib in 0..8 {
                    let ls = i32::from((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf)
                        | i32::from((scales_h >> (2 * ib)) & 3) << 4;
                    let dl = d * (ls - 32) as f32;
                    let qs = &b[8 + 16 * ib..8 + 16 * ib + 16];
                    for j in 0..16 {
                        y[32 * ib + j] =
                            dl * f32::from(imatrix::KVALUES_IQ4NL[usize::from(qs[j] & 0xf)]);
                        y[32 * ib + 16 + j] =
                            dl * f32::from(imatrix::KVALUES_IQ4NL[usize::from(qs[j] >> 4)]);
                    }
                }
            }
            GgufType::Iq2Xxs
            | GgufType::Iq2Xs
            | GgufType::Iq2S
            | GgufType::Iq3Xxs
            | GgufType::Iq3S => iq::dequantize_block(ty, b, y),
            GgufType::Q6K => {
                let d = unhalf(&b[208..]);
                let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                for n in 0..2 {
                    let (ql, qh, ys) = (&ql[64 * n..], &qh[32 * n..], &mut y[128 * n..]);
                    let s = |k: usize| f32::from(sc[8 * n + k] as i8);
                    for i in 0..32 {
                        let is = i / 16;
                        let q = |low: u8, shift: u32| {
                            f32::from(((low | ((qh[i] >> shift) & 3) << 4) as i8) - 32)
                        };
                        ys[i] = d * s(is) * q(ql[i] & 0xf, 0);
                        ys[i + 32] = d * s(is + 2) * q(ql[i + 32] & 0xf, 2);
                        ys[i + 64] = d * s(is + 4) * q(ql[i] >> 4, 4);
                        ys[i + 96] = d * s(is + 6) * q(ql[i + 32] >> 4, 6);
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(
            [0.5f32, 1.5, 2.5, -0.5, -1.5, 2.4999998, 7.0].map(nearest_int),
            [0, 2, 2, 0, -2, 2, 7]
        );
    }

    #[test]
    fn q8_0_by_hand() {
        let mut x = [0f32; 32];
        x[0] = 1.27;
        x[1] = -0.005; // -0.5 → roundf: away from zero → -1
        let mut o = [0u8; 34];
        quantize(GgufType::Q8_0, &x, 32, &mut o).unwrap();
        assert_eq!(unhalf(&o), f16::from_f32(0.01).to_f32());
        assert_eq!(o[2] as i8, 127);
        assert_eq!(o[3] as i8, -1);
    }

    #[test]
    fn every_type_round_trips_close_to_the_input() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1)
            .collect();
        let w = vec![1f32; 256];
        for ty in GgufType::ALL {
            let mut q = vec![0u8; ty.bytes_for(x.len())];
            quantize_with(ty, &x, 256, Some(&w), &mut q).unwrap();
            let mut y = vec![0f32; x.len()];
            dequantize(ty, &q, &mut y).unwrap();
            let err = x
                .iter()
                .zip(&y)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Half a step, or a whole one for the symmetric types whose range lacks +max
            // (Q4_0 / Q5_0 codes run from -8 / -16 to 7 / 15).
            let bound = match ty {
                GgufType::Q8_0 => 0.001,
                GgufType::Q6K => 0.003,
                GgufType::Q5_0 => 0.0065,
                GgufType::Q5_1 | GgufType::Q5K => 0.005,
                // E2M1's widest gap (8 to 12 times 2^-7 here) halved.
                GgufType::Mxfp4 => 0.016,
                // Four levels over a sub-block's range of 0.2: half a step is 0.2 / 6.
                GgufType::Q2K => 0.0334,
                // Codes -4..3 of `max / 4`: a whole step where +max lies outside.
                GgufType::Q3K => 0.025,
                // The non-linear grid's widest gap (89 to 113 of 127) halved, of 0.1.
                GgufType::Iq4Nl => 0.0095,
                // The same, plus the 6-bit sub-block scale's rounding (up to 1/64 of it).
                GgufType::Iq4Xs => 0.0095 * (1.0 + 1.0 / 32.0),
                // The lattices: three (IQ2) or eight (IQ3) magnitudes per sign, groups forced
                // onto allowed points, and one sign per 8 implied by parity (IQ2_XXS, IQ2_XS,
                // IQ3_XXS): a step of max / 5 (IQ2) or max / 15 (IQ3) and then some.
                GgufType::Iq2Xxs | GgufType::Iq2Xs | GgufType::Iq2S => 0.06,
                GgufType::Iq3Xxs | GgufType::Iq3S => 0.045,
                _ => 0.0126,
            };
            assert!(err <= bound, "{}: {err}", ty.name());
        }
    }

    #[test]
    fn rows_must_hold_whole_blocks() {
        let x = [0f32; 64];
        let e = quantize(GgufType::Q4K, &x, 64, &mut [0u8; 36]).unwrap_err();
        assert!(
            e.to_string().contains("multiple of the block size 256"),
            "{e}"
        );
    }
}
