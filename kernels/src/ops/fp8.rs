//! FP8 E4M3 quantization: per tensor, per output channel, per 128×128 tile; and dequantization.
//!
//! Scales are f32 `amax / 448`. Casts are PyTorch's: round to nearest even, non-saturating
//! (the scales keep every value within ±448 before rounding, so no NaN appears from finite
//! input with a true amax).
//!
//! Every quantizer that emits E4M3 writes NaN as 0x7F. The sign of a NaN is an accident of
//! the machine — x86 makes 0/0 negative and aarch64 positive, PyTorch's vectorized CPU cast
//! to bf16 writes 0xFFFF, CUDA writes 0x7FFF — and kiln's output bytes must not depend on it.

use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::formats::Overflow;
use crate::formats::fp8::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};
use crate::layout;

/// The per-tensor scale ModelOpt writes: `f32(amax / 448)`.
pub fn fp8_scale(amax: f32) -> f32 {
    amax / E4M3_MAX
}

/// E4M3 of an f32 as the quantizers write it: round to nearest even, non-saturating, NaN
/// always 0x7F (the only other NaN code, 0xFF, is folded onto it).
#[inline]
pub fn e4m3_out(x: f32) -> u8 {
    let c = f32_to_e4m3(x, Overflow::NonSaturating);
    if c == 0xff { 0x7f } else { c }
}

/// One element, per-tensor, as ModelOpt computes it for a 2-D weight: the quotient is
/// computed in f32 and rounded to the weight's dtype before the FP8 cast (a bf16 tensor
/// divided by a 0-d f32 tensor stays bf16 in PyTorch).
#[inline]
pub fn fp8_per_tensor_one<T: Element>(w: T, scale: f32) -> u8 {
    e4m3_out(T::round_f32(w.to_f32() / scale))
}

/// One element divided in f32 (dimensioned scales: per channel, per tile, per expert).
#[inline]
pub fn fp8_f32_one(w: f32, scale: f32) -> u8 {
    e4m3_out(w / scale)
}

/// Per-tensor FP8 of a 2-D weight: `out[i] = e4m3(round_T(w[i] / scale))`.
pub fn quantize_fp8_per_tensor<T: Element>(
    w: &[T],
    scale: f32,
    out: &mut [u8],
) -> Result<(), KernelError> {
    check_len(
        "quantize_fp8_per_tensor",
        "output",
        out.len(),
        w.len(),
        &[w.len()],
    )?;
    for (o, &x) in out.iter_mut().zip(w) {
        *o = fp8_per_tensor_one(x, scale);
    }
    Ok(())
}

/// Per-expert FP8 of stacked `[experts, rows, cols]` weights with `scales[experts]`. The
/// divisor is 1-D here (`s.unsqueeze(-1)`), so the division happens in f32 with no rounding
/// to the weight's dtype.
pub fn quantize_fp8_stacked<T: Element>(
    w: &[T],
    shape: &[usize],
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let per = layout::stacked(
        "quantize_fp8_stacked",
        shape,
        w.len(),
        scales.len(),
        out.len(),
    )?
    .max(1);
    for ((we, oe), &s) in w
        .chunks_exact(per)
        .zip(out.chunks_exact_mut(per))
        .zip(scales)
    {
        for (o, &x) in oe.iter_mut().zip(we) {
            *o = fp8_f32_one(x.to_f32(), s);
        }
    }
    Ok(())
}

/// Per-output-channel FP8 of `[rows, cols]` with `scales[rows]` (`a_row / 448`).
pub fn quantize_fp8_per_channel<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    layout::per_row(
        "quantize_fp8_per_channel",
        rows,
        cols,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = fp8_f32_one(w[r * cols + c].to_f32(), scales[r]);
        }
    }
    Ok(())
}

/// 128×128-tile FP8 of `[rows, cols]` with `scales[ceil(rows/tile), ceil(cols/tile)]`
/// (`a_tile / 448`); edge tiles are partial (PyTorch pads, divides and crops: the same values).
pub fn quantize_fp8_tiles<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    tile: usize,
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let tc = layout::tiles(
        "quantize_fp8_tiles",
        rows,
        cols,
        tile,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] =
                fp8_f32_one(w[r * cols + c].to_f32(), scales[(r / tile) * tc + c / tile]);
        }
    }
    Ok(())
}

/// FP8 → f32 with one scale for every element: `e4m3(q) * scale`.
pub fn dequantize_fp8(q: &[u8], scale: f32, out: &mut [f32]) -> Result<(), KernelError> {
    check_len("dequantize_fp8", "output", out.len(), q.len(), &[q.len()])?;
    for (o, &b) in out.iter_mut().zip(q) {
        *o = e4m3_to_f32(b) * scale;
    }
    Ok(())
}

/// FP8 → f32 of `[rows, cols]` where `scale_of(r, c)` gives each element's scale (per channel
/// and per tile layouts).
pub fn dequantize_fp8_with(
    q: &[u8],
    rows: usize,
    cols: usize,
    scale_of: impl Fn(usize, usize) -> f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_len(
        "dequantize_fp8_with",
        "input",
        q.len(),
        rows * cols,
        &[rows, cols],
    )?;
    check_len(
        "dequantize_fp8_with",
        "output",
        out.len(),
        rows * cols,
        &[rows, cols],
    )?;
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = e4m3_to_f32(q[r * cols + c]) * scale_of(r, c);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn per_tensor_rounds_the_quotient_to_bf16_first() {
        // A bf16 weight whose f32 quotient sits just above an E4M3 tie, but whose bf16
        // rounding lands on the tie: ModelOpt's order gives the even code.
        let scale = 1.0f32;
        let w = bf16::from_f32(1.0625); // tie between 1.0 (0x38) and 1.125 (0x39)
        assert_eq!(fp8_per_tensor_one(w, scale), 0x38);
        // Divided in f32 with a scale that makes the quotient 1.0625 + tiny → rounds up...
        let s = 0.999_999_9f32;
        assert_eq!(fp8_f32_one(1.0625, s), 0x39);
        // ...but rounded to bf16 first it is the tie again → even.
        assert_eq!(fp8_per_tensor_one(w, s), 0x38);
    }

    #[test]
    fn shapes_are_checked() {
        let w = [0f32; 6];
        let mut out = [0u8; 6];
        assert!(matches!(
            quantize_fp8_stacked(&w, &[2, 3], &[1.0, 2.0], &mut out),
            Err(KernelError::Length { what: "scales", .. })
        ));
        assert!(matches!(
            quantize_fp8_stacked(&w, &[6], &[1.0], &mut out),
            Err(KernelError::Rank { .. })
        ));
        assert!(quantize_fp8_stacked(&w, &[2, 1, 3], &[1.0, 2.0], &mut out).is_ok());
    }
}
