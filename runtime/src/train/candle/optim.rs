//! AdamW and gradient clipping as torch 2.9 computes them (`torch.optim.AdamW`, single-tensor
//! path; `torch.nn.utils.clip_grad_norm_`), over candle variables (docs/TRAINING.md §3).

use candle_core::{DType, Tensor, Var};

/// AdamW's settings (transformers' `adam_beta1`, `adam_beta2`, `adam_epsilon`,
/// `weight_decay`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// One parameter's optimizer state.
#[derive(Debug, Clone)]
pub struct Slot {
    /// The parameter's name (checkpoints, weight-decay exclusions).
    pub name: String,
    /// The parameter.
    pub var: Var,
    /// First moment.
    pub m: Tensor,
    /// Second moment.
    pub v: Tensor,
    /// Whether weight decay applies (transformers excludes biases and norm weights).
    pub decay: bool,
}

/// AdamW over a fixed list of parameters.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Settings.
    pub config: AdamWConfig,
    /// Per-parameter state, in a fixed order.
    pub slots: Vec<Slot>,
    /// Updates done.
    pub step: u64,
}

/// Whether transformers' Trainer decays a parameter: not biases, not norm weights
/// (`get_decay_parameter_names`).
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("norm."))
}

impl AdamW {
    /// AdamW over `params` (name, variable), moments at zero.
    pub fn new(config: AdamWConfig, params: Vec<(String, Var)>) -> candle_core::Result<Self> {
        let slots = params
            .into_iter()
            .map(|(name, var)| {
                let z = var.as_tensor().zeros_like()?.to_dtype(DType::F32)?;
                Ok(Slot {
                    decay: decays(&name),
                    name,
                    var,
                    m: z.clone(),
                    v: z,
                })
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(AdamW {
            config,
            slots,
            step: 0,
        })
    }

    /// One update with learning rate `lr` and the gradients `grads` (one per slot, in order;
    /// `None`: the parameter got no gradient and is left alone, as torch skips it).
    pub fn update(&mut self, lr: f64, grads: &[Option<Tensor>]) -> candle_core::Result<()> {
        self.step += 1;
        let c = self.config;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        for (slot, g) in self.slots.iter_mut().zip(grads) {
            let Some(g) = g else { continue };
            let g = g.to_dtype(DType::F32)?;
            let mut p = slot.var.as_tensor().to_dtype(DType::F32)?;
            if slot.decay && c.weight_decay != 0.0 {
                p = p.affine(1.0 - lr * c.weight_decay, 0.0)?;
            }
            // exp_avg.lerp_(grad, 1 − β₁); exp_avg_sq.mul_(β₂).addcmul_(grad, grad, 1 − β₂)
            slot.m = (&slot.m + ((&g - &slot.m)? * (1.0 - c.beta1))?)?;
            slot.v = ((&slot.v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let denom = ((slot.v.sqrt()? / bc2_sqrt)? + c.eps)?;
            let p = (p - (slot.m.div(&denom)? * (lr / bc1))?)?;
            slot.var.set(&p.to_dtype(slot.var.dtype())?)?;
        }
        Ok(())
    }
}

/// `clip_grad_norm_`: the global 2-norm of `grads` (before clipping), and every gradient
/// scaled by `min(1, max_norm / (norm + 1e-6))` when `max_norm` is given.
pub fn clip_grad_norm(
    grads: &mut [Option<Tensor>],
    max_norm: Option<f64>,
) -> candle_core::Result<f64> {
    let mut total = 0f64;
    for g in grads.iter().flatten() {
        let n = g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .sqrt()?
            .to_scalar::<f32>()? as f64;
        total += n * n;
    }
    let norm = total.sqrt();
    if let Some(max) = max_norm {
        let coef = (max / (norm + 1e-6)).min(1.0);
        for g in grads.iter_mut().flatten() {
            *g = (&*g * coef)?;
        }
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Two AdamW steps on one scalar, against the update written out in f64 from torch's
    /// formulas (bias-corrected moments, decoupled decay).
    #[test]
    fn adamw_matches_torchs_update_rule() {
        let var = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(cfg, vec![("w".into(), var.clone())]).unwrap();
        let (mut p, mut m, mut v) = (1.0f64, 0.0f64, 0.0f64);
        for (t, grad) in [(1, 0.5f64), (2, -0.25)] {
            let g = Tensor::new(&[grad as f32], &Device::Cpu).unwrap();
            opt.update(1e-2, &[Some(g)]).unwrap();
            p *= 1.0 - 1e-2 * 0.1;
            m = 0.9 * m + 0.1 * grad;
            v = 0.999 * v + 0.001 * grad * grad;
            let denom = v.sqrt() / (1.0 - 0.999f64.powi(t)).sqrt() + 1e-8;
            p -= 1e-2 / (1.0 - 0.9f64.powi(t)) * m / denom;
            let got = var.as_tensor().to_vec1::<f32>().unwrap()[0] as f64;
            assert!((got - p).abs() < 1e-6, "step {t}: {got} vs {p}");
        }
        assert!(!decays("model.norm.weight") && decays("model.layers.0.mlp.up_proj.weight"));
    }

    #[test]
    fn clipping_scales_to_the_max_norm_and_reports_the_norm_before() {
        let mut g = vec![
            Some(Tensor::new(&[3.0f32], &Device::Cpu).unwrap()),
            None,
            Some(Tensor::new(&[4.0f32], &Device::Cpu).unwrap()),
        ];
        let n = clip_grad_norm(&mut g, Some(1.0)).unwrap();
        assert_eq!(n, 5.0);
        let a = g[0].as_ref().unwrap().to_vec1::<f32>().unwrap()[0] as f64;
        assert!((a - 3.0 / (5.0 + 1e-6)).abs() < 1e-7);
    }
}
