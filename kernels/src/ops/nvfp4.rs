//! NVFP4: E2M1 values in 16-element blocks, an E4M3 scale per block, an f32 global scale.
//!
//! All arithmetic in f32, in ModelOpt's order (docs/FORMATS.md "NVFP4"):
//! ```text
//! ws2 = amax / 2688                     (6 · 448)
//! s   = bmax / (6 · ws2); s == 0 → 1;   ws = e4m3(clamp(s, 2^-9, 448))
//! x   = w / (f32(ws) · ws2)             (product first)
//! code = e2m1_nvfp4(x); byte = even | odd << 4
//! ```
//! An all-zero weight has `ws2 = 0`: block scales become NaN and codes 7, as in ModelOpt. The
//! NaN is always written 0x7F, whatever sign the machine's 0/0 gives.

use super::amax::amax;
use super::fp8::e4m3_out;
use crate::element::Element;
use crate::error::{KernelError, check_len, matrix_dims};
use crate::formats::fp4::{e2m1_to_f32, f32_to_e2m1_nvfp4};
use crate::formats::fp8::e4m3_to_f32;
use crate::layout;

/// Elements per NVFP4 block.
pub const NVFP4_BLOCK: usize = 16;

/// The global scale (`weight_scale_2`) from the tensor's amax: `amax / 2688`.
pub fn nvfp4_global_scale(amax: f32) -> f32 {
    amax / (6.0 * 448.0)
}

/// The E4M3 block scale for a block whose largest magnitude is `bmax`.
#[inline]
pub fn nvfp4_block_scale(bmax: f32, ws2: f32) -> u8 {
    let s = bmax / (6.0 * ws2);
    let s = if s == 0.0 { 1.0 } else { s };
    // NaN (0/0 from an all-zero weight) is written 0x7F on every machine: see `fp8::e4m3_out`.
    e4m3_out(s.clamp(2f32.powi(-9), 448.0))
}

/// Quantizes one block (`w.len()` = 16) into 8 packed bytes; returns the block's scale byte.
#[inline]
pub fn nvfp4_block<T: Element>(w: &[T], ws2: f32, out: &mut [u8]) -> u8 {
    let scale = nvfp4_block_scale(amax(w), ws2);
    let divisor = e4m3_to_f32(scale) * ws2;
    for (byte, pair) in out.iter_mut().zip(w.chunks_exact(2)) {
        let lo = f32_to_e2m1_nvfp4(pair[0].to_f32() / divisor);
        let hi = f32_to_e2m1_nvfp4(pair[1].to_f32() / divisor);
        *byte = lo | hi << 4;
    }
    scale
}

/// NVFP4 of `[rows, cols]` (or `[experts, rows, cols]`, blocks along the last dimension) with
/// global scale `ws2`: `packed[.., cols/2]`, `scales[.., cols/16]` (E4M3 bytes).
pub fn quantize_nvfp4<T: Element>(
    w: &[T],
    shape: &[usize],
    ws2: f32,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    layout::blocks(
        "quantize_nvfp4",
        shape,
        NVFP4_BLOCK,
        w.len(),
        packed.len(),
        NVFP4_BLOCK / 2,
        scales.len(),
    )?;
    for ((block, out), scale) in w
        .chunks_exact(NVFP4_BLOCK)
        .zip(packed.chunks_exact_mut(8))
        .zip(scales.iter_mut())
    {
        *scale = nvfp4_block(block, ws2, out);
    }
    Ok(())
}

/// NVFP4 of BMM experts `[experts, rows, cols]` (GPT-OSS / Llama4 `gate_up_proj [E, H, 2I]`)
/// with blocks and nibble pairs along the *rows* (ModelOpt transposes to `[E, cols, rows]`,
/// quantizes and transposes back): `packed[E, rows/2, cols]`, `scales[E, rows/16, cols]`.
pub fn quantize_nvfp4_transposed<T: Element>(
    w: &[T],
    shape: &[usize],
    ws2: f32,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    let op = "quantize_nvfp4_transposed";
    let (e, r, c) = matrix_dims(op, shape)?;
    if !r.is_multiple_of(NVFP4_BLOCK) {
        return Err(KernelError::BlockMismatch {
            op,
            cols: r,
            block: NVFP4_BLOCK,
        });
    }
    let n = e * r * c;
    check_len(op, "input", w.len(), n, shape)?;
    check_len(op, "packed output", packed.len(), n / 2, shape)?;
    check_len(op, "scales", scales.len(), n / NVFP4_BLOCK, shape)?;
    let mut column = [T::from_f32_zero(); NVFP4_BLOCK];
    let mut bytes = [0u8; NVFP4_BLOCK / 2];
    for x in 0..e {
        for rb in 0..r / NVFP4_BLOCK {
            for col in 0..c {
                for (i, v) in column.iter_mut().enumerate() {
                    *v = w[(x * r + rb * NVFP4_BLOCK + i) * c + col];
                }
                scales[(x * (r / NVFP4_BLOCK) + rb) * c + col] =
                    nvfp4_block(&column, ws2, &mut bytes);
                for (i, b) in bytes.iter().enumerate() {
                    packed[(x * (r / 2) + rb * (NVFP4_BLOCK / 2) + i) * c + col] = *b;
                }
            }
        }
    }
    Ok(())
}

/// NVFP4 → f32 for the layout of [`quantize_nvfp4`]: `e2m1(code) · e4m3(scale) · ws2`.
pub fn dequantize_nvfp4(
    packed: &[u8],
    scales: &[u8],
    ws2: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let op = "dequantize_nvfp4";
    check_len(
        op,
        "output",
        out.len(),
        packed.len() * 2,
        &[packed.len() * 2],
    )?;
    check_len(
        op,
        "scales",
        scales.len(),
        out.len() / NVFP4_BLOCK,
        &[out.len()],
    )?;
    for (i, o) in out.iter_mut().enumerate() {
        let byte = packed[i / 2];
        let code = if i % 2 == 0 { byte & 0xf } else { byte >> 4 };
        *o = e2m1_to_f32(code) * (e4m3_to_f32(scales[i / NVFP4_BLOCK]) * ws2);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_block_by_hand() {
        // amax 6 → ws2 = 6/2688; bmax 6 → s = 448 → scale 0x7e; divisor = 448 · ws2 = 1.
        let mut w = [0f32; 16];
        w[0] = 6.0;
        w[1] = -0.25; // tie → 0, negative → code 8
        w[2] = 2.5; // tie → 2
        w[3] = 5.5; // → 6
        let ws2 = nvfp4_global_scale(6.0);
        let (mut packed, mut scales) = ([0u8; 8], [0u8; 1]);
        quantize_nvfp4(&w, &[1, 16], ws2, &mut packed, &mut scales).unwrap();
        assert_eq!(scales, [0x7e]);
        assert_eq!(packed[..2], [0x87, 0x74]);
        let mut back = [0f32; 16];
        dequantize_nvfp4(&packed, &scales, ws2, &mut back).unwrap();
        assert_eq!(back[..4], [6.0, -0.0, 2.0, 6.0]);
    }

    #[test]
    fn an_all_zero_weight_gives_nan_scales_like_modelopt() {
        let w = [0f32; 16];
        let (mut packed, mut scales) = ([0u8; 8], [0u8; 1]);
        quantize_nvfp4(
            &w,
            &[1, 16],
            nvfp4_global_scale(0.0),
            &mut packed,
            &mut scales,
        )
        .unwrap();
        assert_eq!(scales, [0x7f]);
        assert_eq!(packed, [0x77; 8]);
    }

    #[test]
    fn the_transposed_layout_equals_quantizing_the_transpose() {
        let (e, r, c) = (2, 32, 3);
        let w: Vec<f32> = (0..e * r * c)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let ws2 = nvfp4_global_scale(amax(&w));
        let (mut packed, mut scales) = (vec![0u8; e * r * c / 2], vec![0u8; e * r * c / 16]);
        quantize_nvfp4_transposed(&w, &[e, r, c], ws2, &mut packed, &mut scales).unwrap();
        // Quantize the transpose [e, c, r] along r, then transpose the outputs back.
        let mut t = vec![0f32; w.len()];
        for x in 0..e {
            for i in 0..r {
                for j in 0..c {
                    t[(x * c + j) * r + i] = w[(x * r + i) * c + j];
                }
            }
        }
        let (mut tp, mut ts) = (vec![0u8; t.len() / 2], vec![0u8; t.len() / 16]);
        quantize_nvfp4(&t, &[e, c, r], ws2, &mut tp, &mut ts).unwrap();
        for x in 0..e {
            for j in 0..c {
                for b in 0..r / 16 {
                    assert_eq!(
                        scales[(x * (r / 16) + b) * c + j],
                        ts[(x * c + j) * (r / 16) + b]
                    );
                }
                for i in 0..r {
                    // nibble of element (x, i, j): transposed layout pairs along rows.
                    let a = packed[(x * (r / 2) + i / 2) * c + j] >> (4 * (i % 2)) & 0xf;
                    let b = tp[((x * c + j) * r + i) / 2] >> (4 * (i % 2)) & 0xf;
                    assert_eq!(a, b, "expert {x} row {i} col {j}");
                }
            }
        }
    }
}
