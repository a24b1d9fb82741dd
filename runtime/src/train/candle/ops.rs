//! [`TensorOps`] for candle tensors: every loss runs on candle through this.

use crate::train::ops::TensorOps;
use candle_core::{D, DType, Device, Tensor};

/// candle's implementation of the loss operations, on one device.
#[derive(Debug, Clone)]
pub struct CandleOps {
    /// Where new tensors are made.
    pub device: Device,
}

impl TensorOps for CandleOps {
    type T = Tensor;
    type Error = candle_core::Error;

    fn token_logps(&self, logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
        // Fused on the CPU in f32: no second [batch, t, vocab] array kept for the backward.
        if let Some(lp) = crate::model::fused::token_logps(logits, labels)? {
            return Ok(lp);
        }
        token_logps_unfused(logits, labels)
    }

    fn log_softmax(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        let logits = logits.to_dtype(DType::F32)?;
        let max = logits.max_keepdim(D::Minus1)?.detach();
        let shifted = logits.broadcast_sub(&max)?;
        let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
        shifted.broadcast_sub(&lse)
    }
    fn log(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.log()
    }
    fn token_entropy(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        // Fused on the CPU in f32: one pass per row, no [batch, t, vocab] temporaries.
        if let Some(h) = crate::model::fused::token_entropy(logits)? {
            return Ok(h);
        }
        token_entropy_unfused(logits)
    }

    fn argmax(&self, logits: &Tensor) -> candle_core::Result<Tensor> {
        logits.detach().argmax(D::Minus1)?.to_dtype(DType::F32)
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        a.broadcast_add(b)
    }
    fn sub(&self, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        a.broadcast_sub(b)
    }
    fn mul(&self, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        a.broadcast_mul(b)
    }
    fn div(&self, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        a.broadcast_div(b)
    }
    fn affine(&self, a: &Tensor, mul: f64, add: f64) -> candle_core::Result<Tensor> {
        a.affine(mul, add)
    }
    fn log_sigmoid(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        // log σ(x) = min(x, 0) − log(1 + e^−|x|): no overflow for any x. −|x| is written
        // min(x, −x): candle's `abs` has gradient 1 at 0, which would make the gradient at
        // x = 0 one instead of σ(0) = ½; a tied minimum splits it evenly, as it should.
        let tail = (a.minimum(&a.neg()?)?.exp()? + 1.0)?.log()?;
        a.minimum(0f64)? - tail
    }
    fn relu(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.maximum(0f64)
    }
    fn log1mexp(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        // In f64, `1 − eᵃ` keeps 1e-16 / |a| relative accuracy: enough for any f32 result
        // (TRL branches between log1p and expm1 for the same reason).
        let dtype = a.dtype();
        let x = a.to_dtype(DType::F64)?;
        x.exp()?.neg()?.affine(1.0, 1.0)?.log()?.to_dtype(dtype)
    }
    fn minimum(&self, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
        a.broadcast_minimum(b)
    }
    fn sqr(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.sqr()
    }
    fn exp(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.exp()
    }
    fn sqrt(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.sqrt()
    }
    fn zeros_like(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        if a.device().is_cpu() {
            // Zeros written, not `calloc`'s untouched pages: AdamW's moments are read before
            // they are first written, and a read maps the shared zero page, so each first
            // write would then fault again and flush the other cores' TLBs (an interrupt to
            // each; in a virtual machine, an exit) — at 254M, 500 000 such faults in the
            // first step. Written here on every core, each page is faulted in once.
            use rayon::prelude::*;
            let mut v = vec![0f32; a.elem_count()];
            // Through rayon's closures, so the compiler cannot drop the stores as redundant.
            v.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
            return Tensor::from_vec(v, a.shape(), a.device());
        }
        a.zeros_like()?.to_dtype(candle_core::DType::F32)
    }
    fn clamp(&self, a: &Tensor, lo: f64, hi: f64) -> candle_core::Result<Tensor> {
        a.maximum(lo)?.minimum(hi)
    }
    fn sum_last(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.sum(D::Minus1)
    }
    fn mean_last(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.detach().mean(D::Minus1)
    }
    fn sum_all(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.sum_all()
    }
    fn mean_all(&self, a: &Tensor) -> candle_core::Result<Tensor> {
        a.mean_all()
    }
    fn narrow(
        &self,
        a: &Tensor,
        dim: usize,
        start: usize,
        len: usize,
    ) -> candle_core::Result<Tensor> {
        a.narrow(dim, start, len)
    }
    fn ids(&self, values: &[u32], shape: &[usize]) -> candle_core::Result<Tensor> {
        Tensor::from_vec(values.to_vec(), shape, &self.device)
    }
    fn halves(&self, a: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let n = a.dim(0)? / 2;
        Ok((a.narrow(0, 0, n)?, a.narrow(0, n, n)?))
    }
    fn detach(&self, a: &Tensor) -> Tensor {
        a.detach()
    }
    fn tensor(&self, values: &[f64], shape: &[usize]) -> candle_core::Result<Tensor> {
        let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        Tensor::from_vec(v, shape, &self.device)
    }
    fn dims(&self, a: &Tensor) -> Vec<usize> {
        a.dims().to_vec()
    }
    fn tensor_f32(&self, values: &[f32], shape: &[usize]) -> candle_core::Result<Tensor> {
        Tensor::from_slice(values, shape, &self.device)
    }
    fn to_f64(&self, a: &Tensor) -> candle_core::Result<Vec<f64>> {
        let v: Vec<f32> = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        Ok(v.into_iter().map(f64::from).collect())
    }
}

/// `log_softmax(logits)[label]` per position as candle ops (other devices and dtypes; the
/// fused op's reference).
/// The entropy of `softmax(logits)` over the last dimension, as separate candle ops (any
/// device or dtype; the fused op's reference).
pub(crate) fn token_entropy_unfused(logits: &Tensor) -> candle_core::Result<Tensor> {
    let x = logits.detach().to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?;
    let shifted = x.broadcast_sub(&max)?;
    let e = shifted.exp()?;
    let z = e.sum_keepdim(D::Minus1)?;
    let p = e.broadcast_div(&z)?;
    // H = log Z − Σ p·(x − max).
    z.log()?.squeeze(D::Minus1)? - (p * shifted)?.sum(D::Minus1)?
}

pub(crate) fn token_logps_unfused(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Tensor> {
    let logits = logits.to_dtype(DType::F32)?;
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&labels.contiguous()?.unsqueeze(D::Minus1)?, D::Minus1)?;
    (picked - lse)?.squeeze(D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gradient of `log σ` is `σ(−x)`, at 0 too (½: DPO's first step, where policy and
    /// reference agree, depends on it).
    #[test]
    fn log_sigmoid_gradient_is_sigmoid_of_minus_x_even_at_zero() {
        let ops = CandleOps {
            device: Device::Cpu,
        };
        let xs = [-30f32, -2.0, 0.0, 0.5, 30.0];
        let x = candle_core::Var::new(&xs, &Device::Cpu).unwrap();
        let y = ops.log_sigmoid(x.as_tensor()).unwrap().sum_all().unwrap();
        let g = y.backward().unwrap();
        let got: Vec<f32> = g.get(x.as_tensor()).unwrap().to_vec1().unwrap();
        for (g, x) in got.iter().zip(xs) {
            let want = 1.0 / (1.0 + (x as f64).exp());
            assert!((*g as f64 - want).abs() < 1e-6, "{x}: {g} vs {want}");
        }
    }

    /// Against scalar references written out here: log-softmax picked per row, and
    /// `log σ` at values where the naive formula overflows.
    #[test]
    fn token_logps_and_log_sigmoid_match_scalar_references() {
        let ops = CandleOps {
            device: Device::Cpu,
        };
        let rows = [[1.0f32, 2.0, 3.0], [-5.0, 0.5, 100.0]];
        let logits = Tensor::new(&[rows], &Device::Cpu).unwrap();
        let labels = Tensor::new(&[[2u32, 0]], &Device::Cpu).unwrap();
        let got = ops
            .to_f64(&ops.token_logps(&logits, &labels).unwrap())
            .unwrap();
        for (i, (row, l)) in rows.iter().zip([2usize, 0]).enumerate() {
            let m = row.iter().fold(f64::MIN, |a, &b| a.max(b as f64));
            let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            let want = row[l] as f64 - lse;
            assert!(
                (got[i] - want).abs() < 1e-5 * want.abs().max(1.0),
                "{i}: {} vs {want}",
                got[i]
            );
        }
        let x = Tensor::new(&[-200f32, -1.0, 0.0, 3.0, 200.0], &Device::Cpu).unwrap();
        let got = ops.to_f64(&ops.log_sigmoid(&x).unwrap()).unwrap();
        for (g, x) in got.iter().zip([-200f64, -1.0, 0.0, 3.0, 200.0]) {
            let want = if x < 0.0 {
                x - (1.0 + x.exp()).ln()
            } else {
                -(1.0 + (-x).exp()).ln()
            };
            assert!(
                (g - want).abs() < 1e-6 * want.abs().max(1.0),
                "{x}: {g} vs {want}"
            );
        }
    }
}
