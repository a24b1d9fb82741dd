//! The backend-neutral AdamW and clipping ([`crate::train::optim`]) over candle variables: the
//! update computed on the tensors, then written back into each `Var`.

use super::ops::CandleOps;
pub use crate::train::optim::{AdamWConfig, decays};
use candle_core::{DType, Device, Tensor, Var};

/// The tensor operations on the device of `t` (the first parameter or gradient).
fn ops_on(t: Option<&Tensor>) -> CandleOps {
    CandleOps {
        device: t.map_or(Device::Cpu, |t| t.device().clone()),
    }
}

/// AdamW over a run's trainable candle variables.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// The moments and the step count.
    pub state: crate::train::optim::AdamW<Tensor>,
    /// The variables, in the moments' order.
    pub vars: Vec<Var>,
}

impl AdamW {
    /// Zero moments for `params`.
    pub fn new(config: AdamWConfig, params: Vec<(String, Var)>) -> candle_core::Result<Self> {
        let state = crate::train::optim::AdamW::new(
            &ops_on(params.first().map(|(_, v)| v.as_tensor())),
            config,
            params.iter().map(|(n, v)| (n.as_str(), v.as_tensor())),
        )?;
        Ok(AdamW {
            state,
            vars: params.into_iter().map(|(_, v)| v).collect(),
        })
    }

    /// One step at learning rate `lr` with `grads` (in the variables' order; `None`: no
    /// gradient, the variable unchanged).
    pub fn update(&mut self, lr: f64, grads: &[Option<Tensor>]) -> candle_core::Result<()> {
        let params = self
            .vars
            .iter()
            .map(|v| v.as_tensor().to_dtype(DType::F32))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let grads = grads
            .iter()
            .map(|g| g.as_ref().map(|g| g.to_dtype(DType::F32)).transpose())
            .collect::<candle_core::Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = params.iter().collect();
        let new = self
            .state
            .update(&ops_on(params.first()), lr, &refs, &grads)?;
        for (var, p) in self.vars.iter().zip(new) {
            if let Some(p) = p {
                var.set(&p.to_dtype(var.dtype())?)?;
            }
        }
        Ok(())
    }
}

/// [`crate::train::optim::clip_grad_norm`] of candle gradients.
pub fn clip_grad_norm(
    grads: &mut [Option<Tensor>],
    max_norm: Option<f64>,
) -> candle_core::Result<f64> {
    let ops = ops_on(grads.iter().flatten().next());
    crate::train::optim::clip_grad_norm(&ops, grads, max_norm)
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
