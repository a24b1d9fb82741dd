//! [`TensorOps`] for MLX arrays (`mlx_rs::Array`): every loss of `losses.rs` runs on MLX
//! through this, as it runs on candle through `train/candle/ops.rs`.
//!
//! Where MLX's own gradient differs from candle's at a tie (its `minimum` / `maximum` give a
//! tie's whole gradient to one side; candle, like torch, splits it), the ops here split it
//! evenly, so both backends differentiate the losses the same way.

use crate::train::ops::TensorOps;
use mlx_rs::Array;
use mlx_rs::error::Exception;
use mlx_rs::ops;

/// MLX's implementation of the loss operations, on MLX's default device.
#[derive(Debug, Clone, Copy, Default)]
pub struct MlxOps;

fn stop(a: &Array) -> Result<Array, Exception> {
    mlx_rs::stop_gradient(a)
}

/// `min(a, b)` (or `max` with `max: true`) whose gradient is split evenly at a tie; the value
/// is exactly MLX's minimum (the gradient rides on a term that is exactly zero).
fn tie_split(a: &Array, b: &Array, max: bool) -> Result<Array, Exception> {
    let value = if max {
        ops::maximum(a, b)?
    } else {
        ops::minimum(a, b)?
    };
    let (wins_a, wins_b) = if max {
        (a.gt(b)?, b.gt(a)?)
    } else {
        (a.lt(b)?, b.lt(a)?)
    };
    let tie = a.eq(b)?.as_type::<f32>()?;
    let half = ops::multiply(&tie, Array::from_f32(0.5))?;
    let wa = stop(&ops::add(&wins_a.as_type::<f32>()?, &half)?)?;
    let wb = stop(&ops::add(&wins_b.as_type::<f32>()?, &half)?)?;
    let carrier = ops::add(&ops::multiply(&wa, a)?, &ops::multiply(&wb, b)?)?;
    ops::add(&stop(&value)?, &ops::subtract(&carrier, &stop(&carrier)?)?)
}

/// `max(a, c)` (or `min` with `max: false`) against a constant, the gradient halved where
/// `a == c`; `c` may be infinite.
fn tie_split_const(a: &Array, c: f32, max: bool) -> Result<Array, Exception> {
    let c_arr = Array::from_f32(c);
    let (value, wins) = if max {
        (ops::maximum(a, &c_arr)?, a.gt(&c_arr)?)
    } else {
        (ops::minimum(a, &c_arr)?, a.lt(&c_arr)?)
    };
    let half = ops::multiply(&a.eq(&c_arr)?.as_type::<f32>()?, Array::from_f32(0.5))?;
    let w = stop(&ops::add(&wins.as_type::<f32>()?, &half)?)?;
    let carrier = ops::multiply(&w, a)?;
    ops::add(&stop(&value)?, &ops::subtract(&carrier, &stop(&carrier)?)?)
}

impl TensorOps for MlxOps {
    type T = Array;
    type Error = Exception;

    fn token_logps(&self, logits: &Array, labels: &Array) -> Result<Array, Exception> {
        let logits = logits.as_type::<f32>()?;
        let max = stop(&logits.max_axis(-1, true)?)?;
        let shifted = ops::subtract(&logits, &max)?;
        let lse = ops::log(&ops::exp(&shifted)?.sum_axis(-1, true)?)?;
        let picked = shifted.take_along_axis(&labels.as_type::<i32>()?.expand_dims(-1)?, -1)?;
        ops::subtract(&picked, &lse)?.squeeze_axes(&[-1])
    }

    fn log_softmax(&self, logits: &Array) -> Result<Array, Exception> {
        let logits = logits.as_type::<f32>()?;
        let max = stop(&logits.max_axis(-1, true)?)?;
        let shifted = ops::subtract(&logits, &max)?;
        let lse = ops::log(&ops::exp(&shifted)?.sum_axis(-1, true)?)?;
        ops::subtract(&shifted, &lse)
    }
    fn log(&self, a: &Array) -> Result<Array, Exception> {
        ops::log(a)
    }
    fn token_entropy(&self, logits: &Array) -> Result<Array, Exception> {
        let x = stop(&logits.as_type::<f32>()?)?;
        let max = x.max_axis(-1, true)?;
        let shifted = ops::subtract(&x, &max)?;
        let e = ops::exp(&shifted)?;
        let z = e.sum_axis(-1, true)?;
        let p = ops::divide(&e, &z)?;
        ops::subtract(
            &ops::log(&z)?.squeeze_axes(&[-1])?,
            &ops::multiply(&p, &shifted)?.sum_axis(-1, false)?,
        )
    }

    fn argmax(&self, logits: &Array) -> Result<Array, Exception> {
        ops::indexing::argmax_axis(stop(logits)?, -1, false)?.as_type::<f32>()
    }

    fn add(&self, a: &Array, b: &Array) -> Result<Array, Exception> {
        ops::add(a, b)
    }
    fn sub(&self, a: &Array, b: &Array) -> Result<Array, Exception> {
        ops::subtract(a, b)
    }
    fn mul(&self, a: &Array, b: &Array) -> Result<Array, Exception> {
        ops::multiply(a, b)
    }
    fn div(&self, a: &Array, b: &Array) -> Result<Array, Exception> {
        ops::divide(a, b)
    }
    fn affine(&self, a: &Array, mul: f64, add: f64) -> Result<Array, Exception> {
        ops::add(
            &ops::multiply(a, Array::from_f32(mul as f32))?,
            Array::from_f32(add as f32),
        )
    }
    fn log_sigmoid(&self, a: &Array) -> Result<Array, Exception> {
        // log σ(x) = −log(1 + e^−x) = −logaddexp(0, −x): stable, gradient σ(−x) everywhere.
        ops::negative(&ops::logaddexp(Array::from_f32(0.0), &ops::negative(a)?)?)
    }
    fn relu(&self, a: &Array) -> Result<Array, Exception> {
        tie_split_const(a, 0.0, true)
    }
    fn log1mexp(&self, a: &Array) -> Result<Array, Exception> {
        // In f64, as candle computes it (1e-16 / |a| relative accuracy for 1 − eᵃ).
        let x = a.as_type::<f64>()?;
        let one = Array::from_slice_f64(&[1.0], &[]);
        ops::log(&ops::subtract(&one, &ops::exp(&x)?)?)?.as_type::<f32>()
    }
    fn minimum(&self, a: &Array, b: &Array) -> Result<Array, Exception> {
        tie_split(a, b, false)
    }
    fn sqr(&self, a: &Array) -> Result<Array, Exception> {
        ops::square(a)
    }
    fn exp(&self, a: &Array) -> Result<Array, Exception> {
        ops::exp(a)
    }
    fn sqrt(&self, a: &Array) -> Result<Array, Exception> {
        ops::sqrt(a)
    }
    fn zeros_like(&self, a: &Array) -> Result<Array, Exception> {
        ops::zeros_like(a)?.as_type::<f32>()
    }
    fn clamp(&self, a: &Array, lo: f64, hi: f64) -> Result<Array, Exception> {
        let lo = tie_split_const(a, lo as f32, true)?;
        tie_split_const(&lo, hi as f32, false)
    }
    fn sum_last(&self, a: &Array) -> Result<Array, Exception> {
        a.sum_axis(-1, false)
    }
    fn mean_last(&self, a: &Array) -> Result<Array, Exception> {
        stop(a)?.mean_axis(-1, false)
    }
    fn sum_all(&self, a: &Array) -> Result<Array, Exception> {
        a.sum(None)
    }
    fn mean_all(&self, a: &Array) -> Result<Array, Exception> {
        a.mean(None)
    }
    fn narrow(&self, a: &Array, dim: usize, start: usize, len: usize) -> Result<Array, Exception> {
        let idx: Vec<i32> = (start as i32..(start + len) as i32).collect();
        a.take_axis(Array::from_slice(&idx, &[len as i32]), dim as i32)
    }
    fn ids(&self, values: &[u32], shape: &[usize]) -> Result<Array, Exception> {
        let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        Ok(Array::from_slice(values, &shape))
    }
    fn halves(&self, a: &Array) -> Result<(Array, Array), Exception> {
        let mut parts = a.split_equal(2, 0)?;
        let second = parts.pop().expect("two parts");
        let first = parts.pop().expect("two parts");
        Ok((first, second))
    }
    fn detach(&self, a: &Array) -> Array {
        mlx_rs::stop_gradient(a).expect("stop_gradient of a valid array")
    }
    fn tensor(&self, values: &[f64], shape: &[usize]) -> Result<Array, Exception> {
        let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        Ok(Array::from_slice(&v, &shape))
    }
    fn dims(&self, a: &Array) -> Vec<usize> {
        a.shape().iter().map(|&d| d as usize).collect()
    }
    fn tensor_f32(&self, values: &[f32], shape: &[usize]) -> Result<Array, Exception> {
        let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        Ok(Array::from_slice(values, &shape))
    }
    fn to_f64(&self, a: &Array) -> Result<Vec<f64>, Exception> {
        let a = a.as_type::<f32>()?.contiguous()?;
        a.eval()?;
        Ok(a.as_slice::<f32>().iter().map(|&x| f64::from(x)).collect())
    }
}
