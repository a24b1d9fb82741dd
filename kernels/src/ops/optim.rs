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

/// One AdamW step: from the parameter `p`, its gradient `g` and moments `m`, `v`, the new
/// parameter and moments into `p_out`, `m_out`, `v_out` (all the same length). Per element:
///
/// ```text
/// p1 = p · decay + 0          (p where it does not decay)
/// m' = m + ((g − m) · (1 − β1) + 0)
/// v' = (v · β2 + 0) + ((g · g) · (1 − β2) + 0)
/// p' = p1 − ((m' / (sqrt(v') · inv_bias2_sqrt + ε)) · step_size + 0)
/// ```
///
/// The `+ 0` are the composition's: they turn a −0 into +0. Spread over rayon's threads in
/// chunks; every element's arithmetic is its own, so the bytes do not depend on the split.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    s: &AdamWScalars,
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
    p_out: &mut [f32],
    m_out: &mut [f32],
    v_out: &mut [f32],
) -> Result<(), KernelError> {
    let n = p.len();
    for (what, len) in [
        ("gradient", g.len()),
        ("first moment", m.len()),
        ("second moment", v.len()),
        ("parameter out", p_out.len()),
        ("first moment out", m_out.len()),
        ("second moment out", v_out.len()),
    ] {
        check_len("adamw", what, len, n, &[n])?;
    }
    p_out
        .par_chunks_mut(CHUNK)
        .zip(m_out.par_chunks_mut(CHUNK))
        .zip(v_out.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(c, ((po, mo), vo))| {
            let at = c * CHUNK;
            let r = at..at + po.len();
            chunk(
                s,
                &p[r.clone()],
                &g[r.clone()],
                &m[r.clone()],
                &v[r],
                po,
                mo,
                vo,
            );
        });
    Ok(())
}

/// [`adamw`] on one chunk, element by element (written so that the compiler can put it in
/// vectors: every operation is lane-wise and IEEE-exact).
#[allow(clippy::too_many_arguments)]
#[inline]
fn chunk(
    s: &AdamWScalars,
    p: &[f32],
    g: &[f32],
    m: &[f32],
    v: &[f32],
    po: &mut [f32],
    mo: &mut [f32],
    vo: &mut [f32],
) {
    let n = po.len();
    let (p, g, m, v, mo, vo) = (
        &p[..n],
        &g[..n],
        &m[..n],
        &v[..n],
        &mut mo[..n],
        &mut vo[..n],
    );
    for i in 0..n {
        let p1 = match s.decay {
            Some(d) => p[i] * d + 0.0,
            None => p[i],
        };
        let m1 = m[i] + ((g[i] - m[i]) * s.one_minus_beta1 + 0.0);
        let v1 = (v[i] * s.beta2 + 0.0) + ((g[i] * g[i]) * s.one_minus_beta2 + 0.0);
        let denom = v1.sqrt() * s.inv_bias2_sqrt + s.eps;
        po[i] = p1 - ((m1 / denom) * s.step_size + 0.0);
        mo[i] = m1;
        vo[i] = v1;
    }
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
        let (mut p, mut m, mut v) = ([0f32], [0f32], [0f32]);
        adamw(&s, &[1.0], &[2.0], &[0.0], &[0.0], &mut p, &mut m, &mut v).unwrap();
        let want = 0.95 - 0.2 / ((0.004f64.sqrt() / 0.001f64.sqrt()) + 1e-8) * (0.1 / 0.1);
        assert!(
            (f64::from(p[0]) - want).abs() < 1e-6,
            "{} against {want}",
            p[0]
        );
        assert!((m[0] - 0.2).abs() < 1e-7 && (v[0] - 0.004).abs() < 1e-9);
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
        let mut o = [0f32; 2];
        let (mut m, mut v) = ([0f32; 2], [0f32; 2]);
        let e = adamw(
            &s,
            &[1.0, 2.0],
            &[1.0],
            &[0.0; 2],
            &[0.0; 2],
            &mut o,
            &mut m,
            &mut v,
        );
        assert!(e.is_err());
    }
}
