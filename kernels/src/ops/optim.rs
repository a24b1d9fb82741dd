//! The optimizer's update as one pass: AdamW on one parameter, element by element, in the
//! f32 operations and order of torch 2.9's single-tensor `AdamW` as kiln's trainers write it
//! with tensor operations (`runtime::train::optim::AdamW::update`: each `affine(a, mul, add)`
//! is `a · mul + add` with `mul` and `add` rounded to f32, `sqr(a)` is `a · a`), so the
//! parameter and both moments come out bit for bit as that composition's. No fused
//! multiply-add: every product is rounded before its sum, as the separate operations round.

use crate::error::{KernelError, check_len};
use rayon::prelude::*;

/// One step's scalars for one parameter, each as the composition rounds it to f32 (an
/// `affine`'s `mul` and `add` are rounded to the tensor's dtype).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `1 − lr · weight_decay` where the parameter decays (`None`: it does not, or the decay
    /// is zero).
    pub decay: Option<f32>,
    /// `1 − β1`.
    pub one_minus_beta1: f32,
    /// `β2`.
    pub beta2: f32,
    /// `1 − β2`.
    pub one_minus_beta2: f32,
    /// `1 / sqrt(1 − β2^t)`.
    pub inv_bias2_sqrt: f32,
    /// `ε`.
    pub eps: f32,
    /// `lr / (1 − β1^t)`.
    pub step_size: f32,
}

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// One AdamW step on the parameter `p` from its gradient `g`, with the moments `m`, `v`: the
/// parameter and both moments updated where they lie (all the same length). Per element:
///
/// ```text
/// p1 = p · decay + 0          (p where it does not decay)
/// m' = m + ((g − m) · (1 − β1) + 0)
/// v' = (v · β2 + 0) + ((g · g) · (1 − β2) + 0)
/// p' = p1 − ((m' / (sqrt(v') · inv_bias2_sqrt + ε)) · step_size + 0)
/// ```
///
/// The `+ 0` are the composition's: they turn a −0 into +0. Spread over rayon's threads in
/// chunks; every element's arithmetic is its own (its outputs depend on its inputs only), so
/// the bytes depend neither on the split nor on writing in place.
pub fn adamw_in_place(
    s: &AdamWScalars,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<(), KernelError> {
    let n = p.len();
    for (what, len) in [
        ("gradient", g.len()),
        ("first moment", m.len()),
        ("second moment", v.len()),
    ] {
        check_len("adamw", what, len, n, &[n])?;
    }
    p.par_chunks_mut(CHUNK)
        .zip(m.par_chunks_mut(CHUNK))
        .zip(v.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, ((p, m), v))| {
            let g = &g[c * CHUNK..c * CHUNK + p.len()];
            let (m, v) = (&mut m[..p.len()], &mut v[..p.len()]);
            for i in 0..p.len() {
                (p[i], m[i], v[i]) = element(s, p[i], g[i], m[i], v[i]);
            }
        });
    Ok(())
}

/// One element's step: the new parameter and moments.
#[inline(always)]
fn element(s: &AdamWScalars, p: f32, g: f32, m: f32, v: f32) -> (f32, f32, f32) {
    let p1 = match s.decay {
        Some(d) => p * d + 0.0,
        None => p,
    };
    let m1 = m + ((g - m) * s.one_minus_beta1 + 0.0);
    let v1 = (v * s.beta2 + 0.0) + ((g * g) * s.one_minus_beta2 + 0.0);
    let denom = v1.sqrt() * s.inv_bias2_sqrt + s.eps;
    (p1 - ((m1 / denom) * s.step_size + 0.0), m1, v1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_step_by_hand() {
        // Step 1 at lr 0.1, weight decay 0.5, β 0.9 / 0.999: p1 = 1 · 0.95; m' = 0.1 · 2;
        // v' = 0.001 · 4; p' = 0.95 − (0.2 / (sqrt(0.004) / sqrt(0.001) + ε)) · (0.1 / 0.1).
        let s = AdamWScalars {
            decay: Some(0.95),
            one_minus_beta1: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            inv_bias2_sqrt: (1.0 / 0.001f64.sqrt()) as f32,
            eps: 1e-8,
            step_size: 1.0,
        };
        let (mut p, mut m, mut v) = ([1f32], [0f32], [0f32]);
        adamw_in_place(&s, &mut p, &[2.0], &mut m, &mut v).unwrap();
        let want = 0.95 - 0.2 / ((0.004f64.sqrt() / 0.001f64.sqrt()) + 1e-8) * (0.1 / 0.1);
        assert!(
            (f64::from(p[0]) - want).abs() < 1e-6,
            "{} against {want}",
            p[0]
        );
        assert!((m[0] - 0.2).abs() < 1e-7 && (v[0] - 0.004).abs() < 1e-9);
    }

    /// Against the formula written out one rounded f32 operation at a time, bit for bit, over
    /// chunk boundaries, with and without decay, on values spread over many magnitudes (zeros
    /// of both signs among them).
    #[test]
    fn every_element_is_the_formulas_bits() {
        let n = 3 * CHUNK + 17;
        let val = |i: usize, k: u32| -> f32 {
            let x = ((i as u32)
                .wrapping_mul(2654435761)
                .wrapping_add(k.wrapping_mul(40503))
                >> 8) as f32
                / (1u32 << 24) as f32;
            match i % 11 {
                0 => 0.0,
                1 => -0.0,
                _ => (x - 0.5) * 10f32.powi((i % 7) as i32 - 4),
            }
        };
        for decay in [None, Some(0.999f32)] {
            let s = AdamWScalars {
                decay,
                one_minus_beta1: 0.1,
                beta2: 0.999,
                one_minus_beta2: 1.0 - 0.999f32,
                inv_bias2_sqrt: 1.0 / (1.0 - 0.999f32.powi(3)).sqrt(),
                eps: 1e-8,
                step_size: 1e-3 / (1.0 - 0.9f32.powi(3)),
            };
            let p0: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
            let g: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
            let m0: Vec<f32> = (0..n).map(|i| val(i, 3)).collect();
            let v0: Vec<f32> = (0..n).map(|i| val(i, 4).abs()).collect();
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            adamw_in_place(&s, &mut p, &g, &mut m, &mut v).unwrap();
            for i in 0..n {
                let mut p1 = p0[i];
                if let Some(d) = decay {
                    let scaled = p1 * d;
                    p1 = scaled + 0.0;
                }
                let diff = g[i] - m0[i];
                let step1 = diff * s.one_minus_beta1 + 0.0;
                let m1 = m0[i] + step1;
                let kept = v0[i] * s.beta2 + 0.0;
                let sq = g[i] * g[i];
                let added = sq * s.one_minus_beta2 + 0.0;
                let v1 = kept + added;
                let root = v1.sqrt();
                let denom = root * s.inv_bias2_sqrt + s.eps;
                let ratio = m1 / denom;
                let delta = ratio * s.step_size + 0.0;
                let p2 = p1 - delta;
                assert_eq!(
                    (p[i].to_bits(), m[i].to_bits(), v[i].to_bits()),
                    (p2.to_bits(), m1.to_bits(), v1.to_bits()),
                    "element {i}, decay {decay:?}"
                );
            }
        }
    }

    #[test]
    fn lengths_must_agree() {
        let s = AdamWScalars {
            decay: None,
            one_minus_beta1: 0.1,
            beta2: 0.999,
            one_minus_beta2: 0.001,
            inv_bias2_sqrt: 1.0,
            eps: 1e-8,
            step_size: 0.1,
        };
        let (mut p, mut m, mut v) = ([0f32; 2], [0f32; 2], [0f32; 1]);
        let e = adamw_in_place(&s, &mut p, &[1.0, 2.0], &mut m, &mut v);
        assert!(e.unwrap_err().to_string().contains("second moment"));
        assert!(adamw_in_place(&s, &mut p, &[1.0], &mut [0.0; 2], &mut [0.0; 2]).is_err());
    }
}
