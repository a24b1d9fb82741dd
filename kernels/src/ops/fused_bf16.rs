//! The decoder's element-wise steps for a model run in bf16 without gradients (calibration in
//! ModelOpt's and llm-compressor's precision, `kiln eval --dtype bf16`), one pass over the rows
//! each where candle's composition runs five to eight ops, each allocating its output.
//!
//! Each rounds where transformers' bf16 modules (and kiln's unfused candle composition) round:
//! every step computed in f32 from bf16 operands and rounded to bf16 (to nearest, ties to
//! even) where PyTorch would hold a bf16 tensor. Values are bf16 bit patterns (`u16`).
//!
//! - [`rms_norm`]: `LlamaRMSNorm` — `w · bf16(x / sqrt(mean(x²) + ε))`, the mean in f32;
//! - [`swiglu`]: `bf16(silu(g)) · u`, SiLU evaluated in f32 (`g / (1 + e^−g)`) and rounded once;
//! - [`rope`]: `bf16(x · cos) + bf16(rotate_half(x) · sin)`.

use super::fused::{bad, check_rope, rows_per_task};
use crate::KernelError;
use crate::error::check_len;
use rayon::prelude::*;

/// A bf16 bit pattern as f32 (exact).
#[inline(always)]
pub fn widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// f32 to bf16, to nearest with ties to even (`half::bf16::from_f32`'s rounding; a NaN stays a
/// quiet NaN of the same sign). Branch-free, so that loops of it run in vector registers.
#[inline(always)]
pub fn narrow(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() {
        ((b >> 16) as u16) | 0x0040
    } else {
        rounded
    }
}

/// `Σ x²` of a row in f32: eight interleaved partial sums (element `i` into sum `i mod 8`)
/// added first to last, then the tail (the `len mod 8` last elements) in order.
#[inline(always)]
fn sum_sq(x: &[u16]) -> f32 {
    let mut acc = [0f32; 8];
    let c = x.chunks_exact(8);
    let tail = c.remainder();
    for x in c {
        for l in 0..8 {
            let v = widen(x[l]);
            acc[l] += v * v;
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for &t in tail {
        let v = widen(t);
        s += v * v;
    }
    s
}

/// transformers' `LlamaRMSNorm` on bf16 rows of `w.len()`: `var = Σ x² / n` in f32 (eight
/// interleaved partial sums added first to last, then the tail in order), `y = bf16(w ·
/// bf16(x / sqrt(var + ε)))`.
pub fn rms_norm(x: &[u16], w: &[u16], eps: f32, y: &mut [u16]) -> Result<(), KernelError> {
    let op = "rms_norm_bf16";
    let n = w.len();
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(bad(op, format!("{} values are not rows of {n}", x.len())));
    }
    check_len(op, "y", y.len(), x.len(), &[x.len() / n, n])?;
    let per = rows_per_task(n) * n;
    y.par_chunks_mut(per)
        .zip(x.par_chunks(per))
        .for_each(|(y, x)| {
            for (y, x) in y.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
                let var = sum_sq(x) / n as f32;
                let d = (var + eps).sqrt();
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = narrow(widen(w) * widen(narrow(widen(x) / d)));
                }
            }
        });
    Ok(())
}

/// `y = bf16(bf16(silu(g)) · u)`, `silu(g) = g / (1 + e^−g)` in f32.
pub fn swiglu(g: &[u16], u: &[u16], y: &mut [u16]) -> Result<(), KernelError> {
    let op = "swiglu_bf16";
    check_len(op, "u", u.len(), g.len(), &[g.len()])?;
    check_len(op, "y", y.len(), g.len(), &[g.len()])?;
    y.par_chunks_mut(16_384)
        .zip(g.par_chunks(16_384).zip(u.par_chunks(16_384)))
        .for_each(|(y, (g, u))| {
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                let g = widen(g);
                let s = narrow(g / (1.0 + (-g).exp()));
                *y = narrow(widen(s) * widen(u));
            }
        });
    Ok(())
}

/// RoPE on bf16 `x` `[rows, t, d]` with bf16 tables `cos`, `sin` `[t, d]`: `y = bf16(bf16(x ·
/// cos) + bf16(rotate_half(x) · sin))`, `rotate_half([a, b]) = [−b, a]` over the halves of `d`.
pub fn rope(
    x: &[u16],
    cos: &[u16],
    sin: &[u16],
    t: usize,
    d: usize,
    y: &mut [u16],
) -> Result<(), KernelError> {
    check_rope("rope_bf16", [x.len(), cos.len(), sin.len(), y.len()], t, d)?;
    let (plane, h) = (t * d, d / 2);
    y.par_chunks_mut(plane)
        .zip(x.par_chunks(plane))
        .for_each(|(y, x)| {
            for ((y, x), (c, s)) in y
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(cos.chunks_exact(d).zip(sin.chunks_exact(d)))
            {
                for i in 0..d {
                    // rotate_half: −x[i + h] in the first half, x[i − h] in the second.
                    let r = if i < h {
                        -widen(x[i + h])
                    } else {
                        widen(x[i - h])
                    };
                    let a = narrow(widen(x[i]) * widen(c[i]));
                    let b = narrow(r * widen(s[i]));
                    y[i] = narrow(widen(a) + widen(b));
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn values(n: usize, seed: u64, scale: f32) -> Vec<u16> {
        let mut s = seed;
        (0..n)
            .map(|_| bf16::from_f32(crate::ops::test_values::lcg(&mut s) * scale).to_bits())
            .collect()
    }

    fn h(b: u16) -> bf16 {
        bf16::from_bits(b)
    }

    /// `narrow` is `half`'s rounding for every f32 whose top half is a sample of each bf16
    /// pattern (so every exponent, both signs, NaNs and infinities) with the low bits at, just
    /// below and just above the halfway point and at the ends.
    #[test]
    fn narrow_is_halfs_rounding() {
        for hi in 0..=u16::MAX {
            for lo in [0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                let x = f32::from_bits((u32::from(hi) << 16) | lo);
                assert_eq!(
                    narrow(x),
                    bf16::from_f32(x).to_bits(),
                    "{:#010x}",
                    x.to_bits()
                );
            }
        }
    }

    /// Each op against a scalar reference written with `half`'s bf16 arithmetic (every `bf16 ·
    /// bf16` an f32 product rounded, as PyTorch's bf16 tensors compute).
    #[test]
    fn ops_equal_their_bf16_compositions() {
        // RMSNorm, rows of 37 (a tail of 5 after four chunks of 8) and of 64.
        for n in [37usize, 64] {
            let x = values(9 * n, 1, 3.0);
            let w = values(n, 2, 1.5);
            let mut y = vec![0u16; x.len()];
            rms_norm(&x, &w, 1e-5, &mut y).unwrap();
            for (r, row) in x.chunks(n).enumerate() {
                let mut acc = [0f32; 8];
                for (i, &v) in row.iter().enumerate().take(n - n % 8) {
                    acc[i % 8] += h(v).to_f32() * h(v).to_f32();
                }
                let mut s = acc.iter().sum::<f32>();
                for &v in &row[n - n % 8..] {
                    s += h(v).to_f32() * h(v).to_f32();
                }
                let d = (s / n as f32 + 1e-5).sqrt();
                for i in 0..n {
                    let normed = bf16::from_f32(h(row[i]).to_f32() / d);
                    let want = h(w[i]) * normed;
                    assert_eq!(y[r * n + i], want.to_bits(), "rms_norm row {r} col {i}");
                }
            }
        }
        // SwiGLU over gates far into both tails of the sigmoid.
        let (g, u) = (values(1000, 3, 12.0), values(1000, 4, 2.0));
        let mut y = vec![0u16; g.len()];
        swiglu(&g, &u, &mut y).unwrap();
        for i in 0..g.len() {
            let gf = h(g[i]).to_f32();
            let silu = bf16::from_f32(gf / (1.0 + (-gf).exp()));
            assert_eq!(y[i], (silu * h(u[i])).to_bits(), "swiglu {i}");
        }
        // RoPE on 3 rows of [5, 8].
        let (t, d) = (5, 8);
        let (x, cos, sin) = (
            values(3 * t * d, 5, 4.0),
            values(t * d, 6, 1.0),
            values(t * d, 7, 1.0),
        );
        let mut y = vec![0u16; x.len()];
        rope(&x, &cos, &sin, t, d, &mut y).unwrap();
        for (r, row) in x.chunks(t * d).enumerate() {
            for p in 0..t {
                for i in 0..d {
                    let xi = h(row[p * d + i]);
                    let rot = if i < d / 2 {
                        -h(row[p * d + i + d / 2])
                    } else {
                        h(row[p * d + i - d / 2])
                    };
                    let want = xi * h(cos[p * d + i]) + rot * h(sin[p * d + i]);
                    assert_eq!(y[r * t * d + p * d + i], want.to_bits(), "rope {r} {p} {i}");
                }
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let mut y = vec![0u16; 10];
        assert!(rms_norm(&[0; 10], &[0; 3], 1e-5, &mut y).is_err());
        assert!(swiglu(&[0; 10], &[0; 9], &mut y).is_err());
        assert!(rope(&[0; 10], &[0; 10], &[0; 10], 2, 5, &mut y).is_err());
    }
}
