//! OCP MX formats: 32-element blocks sharing an E8M0 power-of-two scale.
//!
//! MXFP4 (ModelOpt 0.47 `MXFP4QTensor`, in f32): `k = ceil(max(log2(bmax / 6), -127))`,
//! `x = w / 2^k`, code by the MX rule (ties toward zero, an exact zero → 0x8). A block containing NaN gets scale 0xFF (E8M0 NaN; ModelOpt's
//! value is undefined there).
//! MXFP8 (`MXFP8QTensor`, f32): `k = ceil(log2(bmax / 448))` (bmax = 0 or NaN → -127),
//! clamped to [-127, 127]; `q = e4m3(clamp(w · 2^-k, ±448))` with the product in f32.

use super::amax::amax;
use super::fp8::e4m3_out;
use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::formats::e8m0::{
    E8M0_NAN, e8m0_from_exponent, e8m0_to_f32, mxfp4_exponent, mxfp8_exponent,
};
use crate::formats::fp4::{e2m1_to_f32, f32_to_e2m1_mx};
use crate::formats::fp8::{E4M3_MAX, e4m3_to_f32};
use crate::layout;

/// Elements per MX block.
pub const MX_BLOCK: usize = 32;

/// `2^k` as f32 for k in [-127, 127] (exact: 2^-127 is an f32 subnormal).
fn pow2(k: i32) -> f32 {
    2f64.powi(k) as f32
}

/// MXFP4 of `w` (rows of `cols`, blocks along cols): `packed[n/2]`, `scales[n/32]` (E8M0).
pub fn quantize_mxfp4<T: Element>(
    w: &[T],
    cols: usize,
    packed: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    layout::mx_blocks(
        "quantize_mxfp4",
        w.len(),
        cols,
        packed.len(),
        16,
        scales.len(),
    )?;
    for ((block, out), scale) in w
        .chunks_exact(MX_BLOCK)
        .zip(packed.chunks_exact_mut(16))
        .zip(scales.iter_mut())
    {
        let k = mxfp4_exponent(amax(block));
        *scale = k.map_or(E8M0_NAN, e8m0_from_exponent);
        let divisor = k.map_or(f32::NAN, pow2);
        let code = |x: T| f32_to_e2m1_mx(x.to_f32() / divisor);
        for (byte, pair) in out.iter_mut().zip(block.chunks_exact(2)) {
            *byte = code(pair[0]) | code(pair[1]) << 4;
        }
    }
    Ok(())
}

/// MXFP8 of `w` (rows of `cols`, blocks along cols): `q[n]` (E4M3), `scales[n/32]` (E8M0).
pub fn quantize_mxfp8<T: Element>(
    w: &[T],
    cols: usize,
    q: &mut [u8],
    scales: &mut [u8],
) -> Result<(), KernelError> {
    layout::mx_blocks("quantize_mxfp8", w.len(), cols, q.len(), 32, scales.len())?;
    for ((block, out), scale) in w
        .chunks_exact(MX_BLOCK)
        .zip(q.chunks_exact_mut(MX_BLOCK))
        .zip(scales.iter_mut())
    {
        let k = mxfp8_exponent(amax(block));
        *scale = e8m0_from_exponent(k);
        let factor = pow2(-k);
        for (o, &x) in out.iter_mut().zip(block) {
            *o = e4m3_out((x.to_f32() * factor).clamp(-E4M3_MAX, E4M3_MAX));
        }
    }
    Ok(())
}

/// MXFP4 → f32: `e2m1(code) · 2^(scale - 127)`.
pub fn dequantize_mxfp4(packed: &[u8], scales: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let op = "dequantize_mxfp4";
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
        out.len() / MX_BLOCK,
        &[out.len()],
    )?;
    for (i, o) in out.iter_mut().enumerate() {
        let code = packed[i / 2] >> (4 * (i % 2)) & 0xf;
        *o = e2m1_to_f32(code) * e8m0_to_f32(scales[i / MX_BLOCK]);
    }
    Ok(())
}

/// MXFP8 → f32: `e4m3(q) · 2^(scale - 127)`.
pub fn dequantize_mxfp8(q: &[u8], scales: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    let op = "dequantize_mxfp8";
    check_len(op, "output", out.len(), q.len(), &[q.len()])?;
    check_len(op, "scales", scales.len(), q.len() / MX_BLOCK, &[q.len()])?;
    for (i, o) in out.iter_mut().enumerate() {
        *o = e4m3_to_f32(q[i]) * e8m0_to_f32(scales[i / MX_BLOCK]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_block_by_hand() {
        let mut w = [0f32; 32];
        w[0] = 6.0; // bmax 6 → k = 0, scale byte 127
        w[1] = 0.75; // tie → toward zero: 0.5
        w[2] = -5.0; // tie → 4, negative
        let (mut packed, mut scales) = ([0u8; 16], [0u8; 1]);
        quantize_mxfp4(&w, 32, &mut packed, &mut scales).unwrap();
        assert_eq!(scales, [127]);
        assert_eq!(packed[0], 0x17);
        assert_eq!(packed[1], 0x8e, "w[2] = -5 → 0xe; w[3] = 0 → 0x8");
        let mut back = [0f32; 32];
        dequantize_mxfp4(&packed, &scales, &mut back).unwrap();
        assert_eq!(back[..4], [6.0, 0.5, -4.0, -0.0]);
    }

    #[test]
    fn mxfp8_block_by_hand() {
        let mut w = [1.0f32; 32];
        w[0] = 896.0; // bmax 896 → k = 1, q = e4m3(448)
        let (mut q, mut scales) = ([0u8; 32], [0u8; 1]);
        quantize_mxfp8(&w, 32, &mut q, &mut scales).unwrap();
        assert_eq!(scales, [128]);
        assert_eq!(q[0], 0x7e);
        assert_eq!(q[1], 0x30, "0.5");
        let zeros = [0f32; 32];
        quantize_mxfp8(&zeros, 32, &mut q, &mut scales).unwrap();
        assert_eq!((scales[0], q[0]), (0, 0));
        assert_eq!(
            quantize_mxfp8(&zeros, 16, &mut q, &mut scales).unwrap_err(),
            KernelError::BlockMismatch {
                op: "quantize_mxfp8",
                cols: 16,
                block: 32
            }
        );
    }
}
