//! The fast scalar path, for every CPU: the bit-level conversions of `bits` in plain loops.
//! Also the tail handler of the SIMD kernels.

use super::bits;
use crate::element::Element;
use crate::formats::e8m0::e8m0_from_exponent;
use crate::formats::fp8::E4M3_MAX;

/// max |x|, NaN winning.
pub fn amax<T: Element>(x: &[T]) -> f32 {
    crate::ops::amax::amax(x)
}

/// `out[i] = e4m3(round?(w[i] / scale))`: with `ROUND`, the quotient is rounded to `T` first
/// (per-tensor FP8 of a 2-D weight); without, it stays f32 (dimensioned scales).
pub fn fp8_scaled<T: Element, const ROUND: bool>(w: &[T], scale: f32, out: &mut [u8]) {
    for (o, &x) in out.iter_mut().zip(w) {
        let q = x.to_f32() / scale;
        *o = bits::e4m3_out(if ROUND { T::round_f32(q) } else { q });
    }
}

/// NVFP4 of whole 16-element blocks.
pub fn nvfp4<T: Element>(w: &[T], ws2: f32, packed: &mut [u8], scales: &mut [u8]) {
    for ((block, out), scale) in w
        .chunks_exact(16)
        .zip(packed.chunks_exact_mut(8))
        .zip(scales.iter_mut())
    {
        *scale = bits::nvfp4_block_scale(amax(block), ws2);
        let d = bits::e4m3_to_f32(*scale) * ws2;
        for (b, pair) in out.iter_mut().zip(block.chunks_exact(2)) {
            *b = bits::e2m1_nvfp4(pair[0].to_f32() / d)
                | bits::e2m1_nvfp4(pair[1].to_f32() / d) << 4;
        }
    }
}

/// MXFP8 of whole 32-element blocks.
pub fn mxfp8<T: Element>(w: &[T], q: &mut [u8], scales: &mut [u8]) {
    for ((block, out), scale) in w
        .chunks_exact(32)
        .zip(q.chunks_exact_mut(32))
        .zip(scales.iter_mut())
    {
        let k = bits::mxfp8_exponent(amax(block));
        *scale = e8m0_from_exponent(k);
        let factor = 2f64.powi(-k) as f32;
        for (o, &x) in out.iter_mut().zip(block) {
            *o = bits::e4m3_out((x.to_f32() * factor).clamp(-E4M3_MAX, E4M3_MAX));
        }
    }
}

/// INT8 of `w` (one row's tail) with one scale, by the reference.
pub(crate) fn int8_tail<T: Element>(w: &[T], scale: f32, out: &mut [i8]) {
    if !w.is_empty() {
        // Lengths are equal by construction: the reference cannot fail here.
        let _ = crate::ops::int::quantize_int8_per_channel(w, 1, w.len(), &[scale], out);
    }
}

/// INT4 of a row pair from column `c` on (the SIMD kernels' tail: groups narrower than a
/// vector, or a ragged end), by the reference on whole groups from the group holding `c`.
pub(crate) fn int4_pair_tail<T: Element>(
    r0: &[T],
    r1: &[T],
    group: usize,
    scales: &[f32],
    out: &mut [u8],
    c: usize,
) {
    let cols = out.len();
    if c >= cols {
        return;
    }
    let groups = cols / group;
    let start = c / group * group;
    let tail_scales: Vec<f32> = scales[start / group..groups]
        .iter()
        .chain(&scales[groups + start / group..])
        .copied()
        .collect();
    let mut pair = Vec::with_capacity(2 * (cols - start));
    pair.extend_from_slice(&r0[start..]);
    pair.extend_from_slice(&r1[start..]);
    // Shapes are whole groups by construction: the reference cannot fail here.
    let _ = crate::ops::int::quantize_int4_groups(
        &pair,
        2,
        cols - start,
        group,
        &tail_scales,
        &mut out[start..],
    );
}

/// Rows of `cols` of `ty` under importance weights `qw` (one per column): the legacy types,
/// the k-quants and IQ4 by the lane searches of `cpu::kquants`, the i-quants by the reference's
/// code with the lanes of `cpu::iquants`.
pub fn quantize_gguf_with(
    ty: crate::ops::gguf::GgufType,
    x: &[f32],
    cols: usize,
    qw: &[f32],
    out: &mut [u8],
) -> Result<(), crate::KernelError> {
    super::kquants::quantize_rows_with::<super::kquants::Portable>(ty, x, cols, qw, out)
}

/// Whole GGUF blocks of `ty` from `x` into `out`: the k-quants by the lane searches of
/// `cpu::kquants` (built without target features), the other types by the reference.
pub fn quantize_gguf(
    ty: crate::ops::gguf::GgufType,
    x: &[f32],
    out: &mut [u8],
) -> Result<(), crate::KernelError> {
    super::kquants::quantize_blocks::<super::kquants::Portable>(ty, x, out)
}
