//! bitsandbytes' 4-bit quantization (NF4, FP4) and its double quantization, as bitsandbytes
//! 0.50.2 computes them on the CPU — what `transformers` saves for a `load_in_4bit` model
//! (QLoRA's base in PEFT):
//!
//! ```text
//! quantize_4bit (blocks of `blocksize` over the flattened weight, f32):
//!   absmax = max |x|                         (stored as it is)
//!   s      = clamp(x · (1 / max(absmax, 1e-38)), −1, 1)   (the last, partial block: x / its absmax)
//!   q      = #{ midpoints of the sorted code < s }          (torch.bucketize, ties down; FP4 maps
//!                                                            the sorted index back to its code)
//!   packed = q[2i] << 4 | q[2i + 1]
//! dequantize: x = code[q] · absmax
//! double quantization (`compress_statistics`): offset = mean(absmax); the absmax − offset
//!   quantized blockwise (blocks of 256) on the signed dynamic map by bitsandbytes' CPU kernel:
//!   a = max |v|; idx = LUT[⌊(clamp(v · (1/a), −1, 1) + 1) · 0.5 · 65535 + 0.5⌋], the LUT
//!   holding, for each of 65 536 points −1 + 2i/65535, the first code whose upper midpoint is
//!   not below it; a zero block writes code 0. Decoded: code[idx] · a + offset.
//! ```

use crate::KernelError;
use crate::error::check_len;

pub use super::bnb_tables::{DYNAMIC, FP4, NF4};

/// The 4-bit code tables bitsandbytes has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantType {
    /// NormalFloat 4 (QLoRA's).
    Nf4,
    /// bitsandbytes' FP4.
    Fp4,
}

impl QuantType {
    /// The name in bitsandbytes' quant state (`nf4`, `fp4`).
    pub fn name(self) -> &'static str {
        match self {
            QuantType::Nf4 => "nf4",
            QuantType::Fp4 => "fp4",
        }
    }

    /// The 16 levels, in code order.
    pub fn code(self) -> &'static [f32; 16] {
        match self {
            QuantType::Nf4 => &NF4,
            QuantType::Fp4 => &FP4,
        }
    }
}

/// `quantize_4bit` of `x` (flattened) in blocks of `blocksize`: `packed` (two codes a byte,
/// ⌈n/2⌉) and each block's `absmax` (⌈n/blocksize⌉).
pub fn quantize_4bit(
    ty: QuantType,
    x: &[f32],
    blocksize: usize,
    packed: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), KernelError> {
    let op = "quantize_4bit";
    if blocksize == 0 {
        return Err(KernelError::Parameter {
            op,
            what: "a block size of 0".into(),
        });
    }
    let n = x.len();
    check_len(op, "packed output", packed.len(), n.div_ceil(2), &[n])?;
    check_len(op, "absmax", absmax.len(), n.div_ceil(blocksize), &[n])?;
    let code = ty.code();
    // The sorted levels' midpoints, and the code of each sorted position.
    let mut order: Vec<usize> = (0..16).collect();
    order.sort_by(|&a, &b| code[a].total_cmp(&code[b]));
    let bounds: Vec<f32> = order
        .windows(2)
        .map(|w| (code[w[0]] + code[w[1]]) / 2.0)
        .collect();
    let bucket = |s: f32| order[bounds.iter().filter(|&&b| b < s).count()] as u8;
    let full = n - n % blocksize;
    let mut q = vec![0u8; n + n % 2];
    for (b, block) in x.chunks(blocksize).enumerate() {
        let am = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax[b] = am;
        let start = b * blocksize;
        let partial = start >= full;
        let inv = 1.0 / am.max(1e-38);
        let am_c = am.max(1e-38);
        for (i, &v) in block.iter().enumerate() {
            let s = if partial { v / am_c } else { v * inv };
            q[start + i] = bucket(s.clamp(-1.0, 1.0));
        }
    }
    if n % 2 == 1 {
        // torch pads the scaled values with one 0.
        q[n] = bucket(0.0);
    }
    for (p, pair) in packed.iter_mut().zip(q.chunks_exact(2)) {
        *p = (pair[0] << 4) | pair[1];
    }
    Ok(())
}

/// `dequantize_4bit`: `out[i] = code[q_i] · absmax[i / blocksize]` (f32).
pub fn dequantize_4bit(
    ty: QuantType,
    packed: &[u8],
    absmax: &[f32],
    blocksize: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let op = "dequantize_4bit";
    let n = out.len();
    check_len(op, "packed input", packed.len(), n.div_ceil(2), &[n])?;
    if blocksize == 0 {
        return Err(KernelError::Parameter {
            op,
            what: "a block size of 0".into(),
        });
    }
    check_len(op, "absmax", absmax.len(), n.div_ceil(blocksize), &[n])?;
    let code = ty.code();
    for (i, o) in out.iter_mut().enumerate() {
        let b = packed[i / 2];
        let q = if i.is_multiple_of(2) { b >> 4 } else { b & 0xf };
        *o = code[q as usize] * absmax[i / blocksize];
    }
    Ok(())
}

/// The 65 536-entry lookup table of bitsandbytes' CPU blockwise quantizer for `code` (sorted).
fn lut(code: &[f32; 256]) -> Vec<u8> {
    const SIZE: usize = 65536;
    let mid: Vec<f32> = code.windows(2).map(|w| 0.5 * (w[0] + w[1])).collect();
    let mut out = vec![0u8; SIZE];
    let mut k = 0usize;
    for (i, o) in out.iter_mut().enumerate() {
        let val = -1.0f32 + (2.0f32 * i as f32) / (SIZE - 1) as f32;
        while k < 255 && mid[k] < val {
            k += 1;
        }
        *o = k as u8;
    }
    out
}

/// `quantize_blockwise` on the CPU (double quantization of the absmax): codes of `x` on
/// `code` in blocks of `blocksize`, and each block's absmax.
pub fn quantize_blockwise(
    code: &[f32; 256],
    x: &[f32],
    blocksize: usize,
    out: &mut [u8],
    absmax: &mut [f32],
) -> Result<(), KernelError> {
    let op = "quantize_blockwise";
    if blocksize == 0 {
        return Err(KernelError::Parameter {
            op,
            what: "a block size of 0".into(),
        });
    }
    check_len(op, "output", out.len(), x.len(), &[x.len()])?;
    check_len(
        op,
        "absmax",
        absmax.len(),
        x.len().div_ceil(blocksize),
        &[x.len()],
    )?;
    let table = lut(code);
    for ((block, o), a) in x
        .chunks(blocksize)
        .zip(out.chunks_mut(blocksize))
        .zip(absmax.iter_mut())
    {
        let am = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        *a = am;
        if am == 0.0 {
            o.fill(0);
            continue;
        }
        let inv = 1.0f32 / am;
        for (q, &v) in o.iter_mut().zip(block) {
            let s = (v * inv).clamp(-1.0, 1.0);
            let idx = ((s + 1.0) * 0.5 * 65535.0 + 0.5) as u16;
            *q = table[idx as usize];
        }
    }
    Ok(())
}

/// `dequantize_blockwise`: `code[q] · absmax[i / blocksize]`.
pub fn dequantize_blockwise(
    code: &[f32; 256],
    q: &[u8],
    absmax: &[f32],
    blocksize: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let op = "dequantize_blockwise";
    check_len(op, "output", out.len(), q.len(), &[q.len()])?;
    if blocksize == 0 {
        return Err(KernelError::Parameter {
            op,
            what: "a block size of 0".into(),
        });
    }
    check_len(
        op,
        "absmax",
        absmax.len(),
        q.len().div_ceil(blocksize),
        &[q.len()],
    )?;
    for (i, (o, &c)) in out.iter_mut().zip(q).enumerate() {
        *o = code[c as usize] * absmax[i / blocksize];
    }
    Ok(())
}

/// bitsandbytes' double-quantization offset: the mean of the absmax. torch sums f32 in an
/// order that depends on the CPU's vector width; this is the correctly rounded mean (f64 sum),
/// which equals torch's or is one unit in the last place from it.
pub fn mean(absmax: &[f32]) -> f32 {
    if absmax.is_empty() {
        return 0.0;
    }
    (absmax.iter().map(|&v| f64::from(v)).sum::<f64>() / absmax.len() as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_sorted_where_they_must_be() {
        assert!(NF4.windows(2).all(|w| w[0] < w[1]));
        assert!(DYNAMIC.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!((NF4[0], NF4[7], NF4[15]), (-1.0, 0.0, 1.0));
    }

    #[test]
    fn a_round_trip_stays_within_half_a_step() {
        let x: Vec<f32> = (0..200)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 400.0)
            .collect();
        let mut p = vec![0u8; 100];
        let mut a = vec![0f32; 4];
        quantize_4bit(QuantType::Nf4, &x, 64, &mut p, &mut a).unwrap();
        let mut y = vec![0f32; 200];
        dequantize_4bit(QuantType::Nf4, &p, &a, 64, &mut y).unwrap();
        for (i, (u, v)) in x.iter().zip(&y).enumerate() {
            // NF4's widest gap, −1 to −0.696, is 0.304 of the absmax.
            assert!((u - v).abs() <= 0.153 * a[i / 64] + 1e-7, "{i}: {u} vs {v}");
        }
        assert!(quantize_4bit(QuantType::Nf4, &x, 0, &mut p, &mut a).is_err());
    }
}
