//! Integer quantization: INT8 per output channel, INT4 group-wise (nibble pairs along the
//! output dimension).
//!
//! `q = clamp(round_half_even(w / s), min, max)`, divided in f32. A NaN quotient (a zero
//! scale over a zero weight, or a NaN weight) becomes 0 — PyTorch's `NaN.to(int8)` on x86;
//! exporters avoid it by replacing a zero amax with the format's bound (scale 1).

use super::round_half_even;
use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::layout;

#[inline]
fn to_int(x: f32, lo: f32, hi: f32) -> i8 {
    if x.is_nan() {
        0
    } else {
        round_half_even(x).clamp(lo, hi) as i8
    }
}

/// The INT8 per-channel scale: `a_row / 127`.
pub fn int8_scale(amax: f32) -> f32 {
    amax / 127.0
}

/// The INT4 group scale: `a_block / 7`.
pub fn int4_scale(amax: f32) -> f32 {
    amax / 7.0
}

/// INT8 of `[rows, cols]` with `scales[rows]`.
pub fn quantize_int8_per_channel<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    scales: &[f32],
    out: &mut [i8],
) -> Result<(), KernelError> {
    layout::per_row(
        "quantize_int8_per_channel",
        rows,
        cols,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = to_int(w[r * cols + c].to_f32() / scales[r], -128.0, 127.0);
        }
    }
    Ok(())
}

/// INT4 of `[rows, cols]` in groups of `group` along the columns, `scales[rows, cols/group]`,
/// packed as `out[rows/2, cols]` with `byte[r, c] = q[2r, c] & 0xF | (q[2r+1, c] & 0xF) << 4`.
pub fn quantize_int4_groups<T: Element>(
    w: &[T],
    rows: usize,
    cols: usize,
    group: usize,
    scales: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    let groups = layout::int4_groups(
        "quantize_int4_groups",
        rows,
        cols,
        group,
        w.len(),
        scales.len(),
        out.len(),
    )?;
    let q = |r: usize, c: usize| {
        to_int(
            w[r * cols + c].to_f32() / scales[r * groups + c / group],
            -8.0,
            7.0,
        )
    };
    for r in 0..rows / 2 {
        for c in 0..cols {
            let (lo, hi) = (q(2 * r, c) as u8 & 0xf, q(2 * r + 1, c) as u8 & 0xf);
            out[r * cols + c] = lo | hi << 4;
        }
    }
    Ok(())
}

/// INT8 → f32: `q * scales[row]`.
pub fn dequantize_int8_per_channel(
    q: &[i8],
    rows: usize,
    cols: usize,
    scales: &[f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    layout::per_row(
        "dequantize_int8_per_channel",
        rows,
        cols,
        q.len(),
        scales.len(),
        out.len(),
    )?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = q[i] as f32 * scales[i / cols.max(1)];
    }
    Ok(())
}

/// Packed INT4 `[rows/2, cols]` → f32 `[rows, cols]`.
pub fn dequantize_int4_groups(
    packed: &[u8],
    rows: usize,
    cols: usize,
    group: usize,
    scales: &[f32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let op = "dequantize_int4_groups";
    if group == 0 || !cols.is_multiple_of(group) {
        return Err(KernelError::BlockMismatch {
            op,
            cols,
            block: group,
        });
    }
    if !rows.is_multiple_of(2) {
        return Err(KernelError::OddRows { op, rows });
    }
    let groups = cols / group;
    check_len(
        op,
        "input",
        packed.len(),
        rows / 2 * cols,
        &[rows / 2, cols],
    )?;
    check_len(op, "scales", scales.len(), rows * groups, &[rows, groups])?;
    check_len(op, "output", out.len(), rows * cols, &[rows, cols])?;
    for r in 0..rows {
        for c in 0..cols {
            let byte = packed[(r / 2) * cols + c];
            let nibble = if r % 2 == 0 { byte & 0xf } else { byte >> 4 };
            let q = ((nibble << 4) as i8) >> 4; // sign-extend the two's-complement nibble
            out[r * cols + c] = q as f32 * scales[r * groups + c / group];
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int4_packs_pairs_of_rows_and_round_trips() {
        let w: Vec<f32> = vec![7.0, -8.0, 3.5, -0.5, 2.5, 1.0, -1.0, 100.0];
        let scales = vec![1.0; 4];
        let mut packed = vec![0u8; 4];
        quantize_int4_groups(&w, 2, 4, 2, &scales, &mut packed).unwrap();
        // q row 0: [7, -8, 4 (3.5 ties to even), -0 → 0]; row 1: [2, 1, -1, 7 (clamped)]
        assert_eq!(packed, [0x27, 0x18, 0xf4, 0x70]);
        let mut back = vec![0.0; 8];
        dequantize_int4_groups(&packed, 2, 4, 2, &scales, &mut back).unwrap();
        assert_eq!(back, [7.0, -8.0, 4.0, 0.0, 2.0, 1.0, -1.0, 7.0]);
        assert_eq!(
            quantize_int4_groups(&w, 1, 8, 2, &scales, &mut packed).unwrap_err(),
            KernelError::OddRows {
                op: "quantize_int4_groups",
                rows: 1
            }
        );
    }

    #[test]
    fn int8_rounds_half_even_and_clamps() {
        let w = [0.5f32, 1.5, -2.5, 300.0, -300.0, f32::NAN];
        let mut q = [0i8; 6];
        quantize_int8_per_channel(&w, 1, 6, &[1.0], &mut q).unwrap();
        assert_eq!(q, [0, 2, -2, 127, -128, 0]);
    }
}
