//! Products of bf16 matrices accumulated in f32 exactly as AVX-512 BF16's `VDPBF16PS`
//! computes them: the reference that `cpu::bf16_matmul` (the instruction itself) equals bit
//! for bit, and the definition of what a bf16 GEMM in kiln computes, whatever the CPU.
//!
//! `y [m, n] = x [m, k] · Wᵀ` with `x` and `W [n, k]` bf16 (their bits, row-major) and `y`
//! f32. Each output is one dot product over `k`, summed in 16 lanes: the row is cut into
//! chunks of 32 values (the last padded with zeros), and lane `l` adds the chunk's pair
//! `(2l, 2l + 1)` — the odd element's product first, then the even one's — each product
//! exact, each sum rounded once to f32 (nearest, ties to even), denormal inputs and sums
//! flushed to zero of the same sign (the instruction's DAZ / FTZ). The 16 lanes are then
//! added as a tree: lane `l` + lane `l + 8`, then `+ 4`, `+ 2`, `+ 1` (plain f32 adds).
//!
//! An output depends only on its row of `x` and its row of `W` — not on `m`, `n`, the
//! blocking or the thread count — so a batch of samples computes what each sample alone does.
//!
//! The order was read from Intel's pseudo-code and checked on an AMD EPYC (Zen 4) over
//! 3.2 million random pairs: odd-first sequential sums match every lane; the even-first order
//! and a single fused rounding do not. A denormal product is kept exact until the sum's
//! rounding (2⁻¹²⁰ + 2⁻¹³⁰ keeps its low bit), only the sum is flushed.

use crate::KernelError;
use crate::error::check_len;

/// Values a lane's pair consumes per chunk, and the lanes.
pub const CHUNK: usize = 32;
/// Accumulators per output.
pub const LANES: usize = 16;

/// A denormal as zero of its sign (the instruction's DAZ on inputs, FTZ on results).
#[inline]
fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// A bf16's value, a denormal read as zero.
#[inline]
pub fn widen(bits: u16) -> f32 {
    flush(f32::from_bits(u32::from(bits) << 16))
}

/// `acc + a · b`: the product exact (a bf16 product fits an f64), the sum rounded once to f32,
/// a denormal result flushed. f64 then f32 rounds as one rounding would: the exact sum's
/// significant bits fit f64's 53 whenever they can decide the f32 rounding.
#[inline]
fn step(acc: f32, a: u16, b: u16) -> f32 {
    let p = f64::from(widen(a)) * f64::from(widen(b));
    flush((f64::from(flush(acc)) + p) as f32)
}

/// One `VDPBF16PS` lane: `acc` plus the pair `a · b`, odd element first.
#[inline]
pub fn dot_pair(acc: f32, a: [u16; 2], b: [u16; 2]) -> f32 {
    step(step(acc, a[1], b[1]), a[0], b[0])
}

/// The 16 lanes' sum: `l + (l + 8)`, then `+ 4`, `+ 2`, `+ 1`.
#[inline]
pub fn reduce_lanes(lanes: [f32; LANES]) -> f32 {
    let mut v = lanes;
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            v[l] += v[l + width];
        }
        width /= 2;
    }
    v[0]
}

/// One output: the dot product of two rows of `k` bf16 values.
pub fn dot(a: &[u16], b: &[u16]) -> f32 {
    let at = |r: &[u16], i: usize| r.get(i).copied().unwrap_or(0);
    let mut lanes = [0f32; LANES];
    for c in (0..a.len().max(b.len())).step_by(CHUNK) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let i = c + 2 * l;
            *lane = dot_pair(*lane, [at(a, i), at(a, i + 1)], [at(b, i), at(b, i + 1)]);
        }
    }
    reduce_lanes(lanes)
}

/// Checks the buffers of a `[m, k] · [n, k]ᵀ → [m, n]` product.
pub fn check(
    op: &'static str,
    x: usize,
    w: usize,
    y: usize,
    (m, n, k): (usize, usize, usize),
) -> Result<(), KernelError> {
    check_len(op, "x", x, m * k, &[m, k])?;
    check_len(op, "w", w, n * k, &[n, k])?;
    check_len(op, "y", y, m * n, &[m, n])
}

/// `y = x · Wᵀ`, one dot product at a time.
pub fn matmul_wt(
    x: &[u16],
    w: &[u16],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
) -> Result<(), KernelError> {
    check("bf16 matmul_wt", x.len(), w.len(), y.len(), (m, n, k))?;
    for (i, row) in y.chunks_mut(n.max(1)).take(m).enumerate() {
        for (j, out) in row.iter_mut().enumerate() {
            *out = dot(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(x: f32) -> u16 {
        half::bf16::from_f32(x).to_bits()
    }

    #[test]
    fn a_dot_product_of_exact_values_is_exact() {
        // Small integers: every product and sum is exact, whatever the order.
        let a: Vec<u16> = (0..70).map(|i| bf((i % 7) as f32 - 3.0)).collect();
        let b: Vec<u16> = (0..70).map(|i| bf((i % 5) as f32)).collect();
        let want: f32 = (0..70)
            .map(|i| ((i % 7) as f32 - 3.0) * (i % 5) as f32)
            .sum();
        assert_eq!(dot(&a, &b), want);
    }

    #[test]
    fn the_odd_element_is_added_first_and_each_sum_rounds() {
        // 1 + 2⁻²⁴ rounds back to 1 (a tie, to even), twice; 2⁻²⁴ + 2⁻²⁴ first would not.
        let tiny = bf(2f32.powi(-12));
        let one = bf(1.0);
        // lane 0: odd pair 1·1 first, then 2⁻¹²·2⁻¹² = 2⁻²⁴.
        let got = dot_pair(0.0, [tiny, one], [tiny, one]);
        assert_eq!(got, 1.0);
        // Starting from 2⁻²⁴, the odd product 1 then 2⁻²⁴: 2⁻²⁴ + 1 = 1, + 2⁻²⁴ = 1.
        assert_eq!(dot_pair(2f32.powi(-24), [tiny, one], [tiny, one]), 1.0);
        // Even first would have given 2⁻²³ + 1 = 1 + 2⁻²³ (representable): not what runs.
        assert_ne!(
            (2f32.powi(-24) + 2f32.powi(-24)) + 1.0,
            dot_pair(2f32.powi(-24), [tiny, one], [tiny, one])
        );
    }

    #[test]
    fn denormals_are_flushed_but_a_denormal_product_is_kept_until_the_sum() {
        assert_eq!(widen(0x0001), 0.0);
        assert_eq!(dot_pair(2f32.powi(-130), [0, 0], [0, 0]).to_bits(), 0);
        let p = bf(2f32.powi(-65));
        let kept = dot_pair(2f32.powi(-120), [0, p], [0, p]);
        assert_eq!(kept, 2f32.powi(-120) + 2f32.powi(-130));
        // 2⁻¹²⁶ − 2⁻¹²⁷ is denormal: flushed.
        let r = dot_pair(
            2f32.powi(-126),
            [0, bf(-(2f32.powi(-70)))],
            [0, bf(2f32.powi(-57))],
        );
        assert_eq!(r, 0.0);
    }

    #[test]
    fn lanes_add_as_a_tree() {
        // Lane 0 holds 1, lane 8 holds 2⁻²⁴, lane 4 holds 2⁻²⁴: (1 + 2⁻²⁴) + 2⁻²⁴ = 1 by
        // the tree, where 2⁻²⁴ + 2⁻²⁴ + 1 would be 1 + 2⁻²³.
        let mut l = [0f32; LANES];
        l[0] = 1.0;
        l[8] = 2f32.powi(-24);
        l[4] = 2f32.powi(-24);
        assert_eq!(reduce_lanes(l), 1.0);
        l[8] = 0.0;
        l[12] = 2f32.powi(-24);
        // (l4 + l12) first, then onto lane 0: 1 + 2⁻²³.
        assert_eq!(reduce_lanes(l), 1.0 + 2f32.powi(-23));
    }

    #[test]
    fn shapes_are_checked() {
        let mut y = [0f32; 4];
        assert!(matmul_wt(&[0; 6], &[0; 6], &mut y, (2, 2, 3)).is_ok());
        assert!(matmul_wt(&[0; 5], &[0; 6], &mut y, (2, 2, 3)).is_err());
    }
}
