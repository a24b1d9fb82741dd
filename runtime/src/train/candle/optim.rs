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
        if self.fusable(grads) {
            return self.update_fused(lr, grads);
        }
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

impl AdamW {
    /// Whether every variable, gradient and moment is an f32 tensor on the CPU, the variables
    /// and moments contiguous: then the step runs as one pass per parameter, in place
    /// ([`AdamW::update_fused`]). (Each moment has a storage of its own: made by `zeros_like`
    /// or read from a checkpoint, never a view of another tensor.)
    fn fusable(&self, grads: &[Option<Tensor>]) -> bool {
        let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
        let in_place = |t: &Tensor| f32_cpu(t) && t.is_contiguous();
        self.vars.iter().all(|v| in_place(v.as_tensor()))
            && grads.iter().flatten().all(f32_cpu)
            && self
                .state
                .moments
                .iter()
                .all(|s| in_place(&s.m) && in_place(&s.v))
    }

    /// [`AdamW::update`] as `kiln_kernels::ops::optim::adamw_in_place`: per parameter one pass
    /// over the parameter, its gradient and moments on every core, writing the parameter and
    /// moments where they lie, where the composition of
    /// [`crate::train::optim::AdamW::update`] makes thirteen tensors (each a fresh allocation,
    /// the eight unary ones on one core). The same f32 operations in the same order: the same
    /// bits.
    fn update_fused(&mut self, lr: f64, grads: &[Option<Tensor>]) -> candle_core::Result<()> {
        use crate::model::fused::{cpu_values, with_cpu_values_mut};
        use kiln_kernels::ops::optim::{AdamWScalars, adamw_in_place};
        let k = self.state.next_step(lr);
        for ((slot, var), g) in self.state.moments.iter_mut().zip(&self.vars).zip(grads) {
            let Some(g) = g else {
                continue;
            };
            // Each scalar rounded to f32 as candle's `affine` rounds its `mul` and `add`.
            let s = AdamWScalars {
                decay: k.decay(slot.decay).map(|d| d as f32),
                one_minus_beta1: k.one_minus_beta1 as f32,
                beta2: k.beta2 as f32,
                one_minus_beta2: k.one_minus_beta2 as f32,
                inv_bias2_sqrt: k.inv_bias2_sqrt as f32,
                eps: k.eps as f32,
                step_size: k.step_size as f32,
            };
            // The parameter and both moments updated where they lie: no new buffers (a step
            // of the 254M model would otherwise allocate, fault in and fill 3 GB of fresh pages,
            // and hold three copies of its largest parameter at once).
            let g = g.contiguous()?;
            let (gg, lg) = g.storage_and_layout();
            let g = cpu_values(&gg, lg, "adamw")?;
            let name = &slot.name;
            let err =
                |e: kiln_kernels::KernelError| candle_core::Error::Msg(format!("{name}: {e}"));
            with_cpu_values_mut(&slot.m, "adamw", |m| {
                with_cpu_values_mut(&slot.v, "adamw", |v| {
                    with_cpu_values_mut(var.as_tensor(), "adamw", |p| {
                        adamw_in_place(&s, p, g, m, v).map_err(err)
                    })
                })
            })?;
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

    /// The fused step against the composition of tensor operations it replaces
    /// ([`crate::train::optim::AdamW::update`] on candle's ops), three steps on parameters
    /// that decay and that do not, gradients with zeros of both signs, tiny and huge values,
    /// and a step where one parameter has no gradient: the parameters and both moments the
    /// same bits.
    #[test]
    fn the_fused_step_equals_the_composition_bit_for_bit() -> candle_core::Result<()> {
        let ops = CandleOps {
            device: Device::Cpu,
        };
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let values = |n: usize, seed: f32| -> Vec<f32> {
            (0..n)
                .map(|i| match i % 97 {
                    0 => 0.0,
                    1 => -0.0,
                    2 => 1e-30,
                    3 => -3e4,
                    _ => ((i as f32 + seed) * 0.7549).sin() * 0.02,
                })
                .collect()
        };
        let shapes: [(&str, &[usize]); 3] = [
            ("model.layers.0.mlp.up_proj.weight", &[3, 40_000]),
            ("model.norm.weight", &[7]),
            ("lm_head.weight", &[5, 3]),
        ];
        let params: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(k, (_, s))| {
                Tensor::from_vec(values(s.iter().product(), k as f32), *s, &Device::Cpu)
            })
            .collect::<candle_core::Result<_>>()?;
        let vars = shapes
            .iter()
            .zip(&params)
            .map(|((n, _), p)| Ok((n.to_string(), Var::from_tensor(&p.copy()?)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut fused = AdamW::new(cfg, vars)?;
        let names: Vec<&str> = shapes.iter().map(|(n, _)| *n).collect();
        let mut plain =
            crate::train::optim::AdamW::new(&ops, cfg, names.iter().copied().zip(&params))?;
        let mut plain_params = params.clone();
        let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
            Ok(t.flatten_all()?
                .to_vec1::<f32>()?
                .into_iter()
                .map(f32::to_bits)
                .collect())
        };
        for (step, lr) in [(0, 1e-3), (1, 5e-4), (2, 2e-3)] {
            let grads: Vec<Option<Tensor>> = params
                .iter()
                .enumerate()
                .map(|(k, p)| {
                    (step != 1 || k != 1)
                        .then(|| {
                            let g = values(p.elem_count(), 10.0 * step as f32 + k as f32 + 0.5);
                            Tensor::from_vec(g, p.shape(), &Device::Cpu)
                        })
                        .transpose()
                })
                .collect::<candle_core::Result<_>>()?;
            assert!(fused.fusable(&grads));
            fused.update(lr, &grads)?;
            let refs: Vec<&Tensor> = plain_params.iter().collect();
            let new = plain.update(&ops, lr, &refs, &grads)?;
            for (p, n) in plain_params.iter_mut().zip(new) {
                if let Some(n) = n {
                    *p = n;
                }
            }
            for k in 0..params.len() {
                let (f, q) = (&fused.state.moments[k], &plain.moments[k]);
                let pairs = [
                    ("parameter", fused.vars[k].as_tensor(), &plain_params[k]),
                    ("first moment", &f.m, &q.m),
                    ("second moment", &f.v, &q.v),
                ];
                for (what, got, want) in pairs {
                    let (got, want) = (bits(got)?, bits(want)?);
                    let first = got.iter().zip(&want).position(|(a, b)| a != b);
                    assert!(
                        first.is_none(),
                        "step {step}, {} {what}: element {first:?} differs",
                        names[k]
                    );
                }
            }
        }
        Ok(())
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
