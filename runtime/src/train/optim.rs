//! AdamW and gradient clipping as torch 2.9 computes them (`torch.optim.AdamW`, single-tensor
//! path; `torch.nn.utils.clip_grad_norm_`), once, over any backend's [`TensorOps`]
//! (docs/TRAINING.md §3). Each scalar step is the op torch's kernel does: `lerp` and
//! `addcmul` on the moments, the bias corrections folded as torch folds them.

use super::TrainConfig;
use super::ops::TensorOps;

/// AdamW's hyper-parameters.
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

impl AdamWConfig {
    /// A run's (`adam_beta1`, `adam_beta2`, `adam_epsilon`, `weight_decay`).
    pub fn of(config: &TrainConfig) -> Self {
        let h = &config.hyper;
        AdamWConfig {
            beta1: h.adam_beta1,
            beta2: h.adam_beta2,
            eps: h.adam_epsilon,
            weight_decay: h.weight_decay,
        }
    }
}

/// Whether a parameter takes weight decay: not biases and norm weights (transformers'
/// `get_decay_parameter_names`).
pub fn decays(name: &str) -> bool {
    !(name.ends_with(".bias") || name.contains("norm."))
}

/// One parameter's moments.
#[derive(Debug, Clone)]
pub struct Moments<T> {
    /// The parameter's name (`m/<name>`, `v/<name>` in checkpoints).
    pub name: String,
    /// First moment (`exp_avg`), f32.
    pub m: T,
    /// Second moment (`exp_avg_sq`), f32.
    pub v: T,
    /// Whether it takes weight decay.
    pub decay: bool,
}

/// AdamW's state over a run's trainable parameters, in their order.
#[derive(Debug, Clone)]
pub struct AdamW<T> {
    /// The hyper-parameters.
    pub config: AdamWConfig,
    /// Each parameter's moments.
    pub moments: Vec<Moments<T>>,
    /// Steps taken.
    pub step: u64,
}

/// One AdamW step's scalars (f64, as the tensor operations take them), computed once per
/// step: every backend's update — the composition below and candle's fused CPU pass — uses
/// these.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// `1 − lr · weight_decay` (`None` where the weight decay is zero).
    pub decay_mul: Option<f64>,
    /// `1 − β1`.
    pub one_minus_beta1: f64,
    /// `β2`.
    pub beta2: f64,
    /// `1 − β2`.
    pub one_minus_beta2: f64,
    /// `1 / sqrt(1 − β2^t)`.
    pub inv_bias2_sqrt: f64,
    /// `ε`.
    pub eps: f64,
    /// `lr / (1 − β1^t)`.
    pub step_size: f64,
}

impl StepScalars {
    /// The decay multiplier of a parameter that `decays` (or not).
    pub fn decay(&self, decays: bool) -> Option<f64> {
        self.decay_mul.filter(|_| decays)
    }
}

impl<T> AdamW<T> {
    /// Counts a step at learning rate `lr` and returns its scalars.
    pub fn next_step(&mut self, lr: f64) -> StepScalars {
        self.step += 1;
        let c = self.config;
        let t = self.step as i32;
        let bc1 = 1.0 - c.beta1.powi(t);
        let bc2_sqrt = (1.0 - c.beta2.powi(t)).sqrt();
        StepScalars {
            decay_mul: (c.weight_decay != 0.0).then_some(1.0 - lr * c.weight_decay),
            one_minus_beta1: 1.0 - c.beta1,
            beta2: c.beta2,
            one_minus_beta2: 1.0 - c.beta2,
            inv_bias2_sqrt: 1.0 / bc2_sqrt,
            eps: c.eps,
            step_size: lr / bc1,
        }
    }
}

impl<T: Clone> AdamW<T> {
    /// Zero moments for `params` (name and value).
    pub fn new<'p, O: TensorOps<T = T>>(
        ops: &O,
        config: AdamWConfig,
        params: impl IntoIterator<Item = (&'p str, &'p T)>,
    ) -> Result<Self, O::Error>
    where
        T: 'p,
    {
        let moments = params
            .into_iter()
            .map(|(name, p)| {
                Ok(Moments {
                    name: name.to_string(),
                    m: ops.zeros_like(p)?,
                    v: ops.zeros_like(p)?,
                    decay: decays(name),
                })
            })
            .collect::<Result<_, O::Error>>()?;
        Ok(AdamW {
            config,
            moments,
            step: 0,
        })
    }

    /// One step at learning rate `lr`: each parameter's new value (f32), `None` where it has no
    /// gradient (its moments unchanged). `params` and `grads` (f32) are in the moments' order.
    pub fn update<O: TensorOps<T = T>>(
        &mut self,
        ops: &O,
        lr: f64,
        params: &[&T],
        grads: &[Option<T>],
    ) -> Result<Vec<Option<T>>, O::Error> {
        let k = self.next_step(lr);
        let mut out = Vec::with_capacity(params.len());
        for ((slot, p), g) in self.moments.iter_mut().zip(params).zip(grads) {
            let Some(g) = g else {
                out.push(None);
                continue;
            };
            let p = match k.decay(slot.decay) {
                Some(d) => ops.affine(p, d, 0.0)?,
                None => (*p).clone(),
            };
            // exp_avg.lerp_(grad, 1 − β₁); exp_avg_sq.mul_(β₂).addcmul_(grad, grad, 1 − β₂)
            slot.m = ops.add(
                &slot.m,
                &ops.affine(&ops.sub(g, &slot.m)?, k.one_minus_beta1, 0.0)?,
            )?;
            slot.v = ops.add(
                &ops.affine(&slot.v, k.beta2, 0.0)?,
                &ops.affine(&ops.sqr(g)?, k.one_minus_beta2, 0.0)?,
            )?;
            // denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
            let denom = ops.affine(&ops.sqrt(&slot.v)?, k.inv_bias2_sqrt, k.eps)?;
            let step = ops.affine(&ops.div(&slot.m, &denom)?, k.step_size, 0.0)?;
            out.push(Some(ops.sub(&p, &step)?));
        }
        Ok(out)
    }
}

/// torch's `clip_grad_norm_`: the global L2 norm of the per-gradient norms (returned, before
/// clipping); with `max_norm`, every gradient scaled by `min(max / (norm + 1e-6), 1)`.
pub fn clip_grad_norm<O: TensorOps>(
    ops: &O,
    grads: &mut [Option<O::T>],
    max_norm: Option<f64>,
) -> Result<f64, O::Error> {
    let mut total = 0f64;
    for g in grads.iter().flatten() {
        let n = ops.to_f64(&ops.sqrt(&ops.sum_all(&ops.sqr(g)?)?)?)?[0];
        total += n * n;
    }
    let norm = total.sqrt();
    if let Some(max) = max_norm {
        let coef = (max / (norm + 1e-6)).min(1.0);
        for g in grads.iter_mut().flatten() {
            *g = ops.affine(g, coef, 0.0)?;
        }
    }
    Ok(norm)
}
