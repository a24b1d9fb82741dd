//! Linear layers whose weight stays packed (QLoRA's frozen, quantized base): `y = x · Wᵀ` with
//! `W` in its format's own layout, decoded a tile of rows at a time per use
//! ([`kiln_kernels::ops::packed_matmul`]), as a candle op with its backward with respect to
//! the input (`dx = dy · W`; the base is frozen, so no gradient reaches `W`). CPU only: on
//! another device the op names what it cannot do.

use super::ModelError;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use kiln_kernels::ops::packed_matmul::{self, PackedRows};
use std::sync::Arc;

/// A packed weight, shared by every model built on it (policy, reference, evaluation).
pub type Packed = Arc<dyn PackedRows>;

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// The input `[m, k]` of a product as an f32 slice (contiguous, offset applied).
fn f32_input<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        return Err(op_err(format!("a packed Linear's {what} must be f32")));
    };
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => Err(op_err(format!(
            "a packed Linear's {what} must be contiguous"
        ))),
    }
}

/// A frozen dense weight (LoRA's base) as [`PackedRows`]: the model's own f32 tensor, shared,
/// not copied. Through [`packed_linear`] its products run as one GEMM each and its backward
/// computes only the input's gradient, where candle's matmul would also compute (and keep) a
/// gradient for the frozen weight.
#[derive(Debug)]
pub struct FrozenRows {
    weight: Tensor,
    rows: usize,
    cols: usize,
}

impl FrozenRows {
    /// `weight` `[rows, cols]`, f32 and contiguous on the CPU; `None` for any other tensor
    /// (which then runs through candle's matmul).
    pub fn of(weight: &Tensor) -> Option<Self> {
        let (rows, cols) = weight.dims2().ok()?;
        (weight.device().is_cpu() && weight.dtype() == DType::F32 && weight.is_contiguous()).then(
            || FrozenRows {
                weight: weight.clone(),
                rows,
                cols,
            },
        )
    }
}

impl PackedRows for FrozenRows {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        let mut done = false;
        let cols = self.cols;
        self.with_dense(&mut |w| {
            if let Some(src) = w.get(start * cols..start * cols + out.len()) {
                out.copy_from_slice(src);
                done = true;
            }
        });
        if done {
            Ok(())
        } else {
            Err(kiln_kernels::KernelError::Parameter {
                op: "FrozenRows::decode_rows",
                what: format!("rows from {start} past {}", self.rows),
            })
        }
    }
    fn packed_bytes(&self) -> usize {
        self.rows * self.cols * 4
    }
    fn with_dense(&self, f: &mut dyn FnMut(&[f32])) -> bool {
        let (storage, layout) = self.weight.storage_and_layout();
        match (&*storage, layout.contiguous_offsets()) {
            (candle_core::Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) => {
                f(&data[start..end]);
                true
            }
            _ => false,
        }
    }
}

/// `x [m, k] → x · Wᵀ [m, n]`.
struct Forward(Packed);

/// `dy [m, n] → dy · W [m, k]`.
struct InputGrad(Packed);

impl CustomOp1 for Forward {
    fn name(&self) -> &'static str {
        "packed-linear"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = layout.shape().dims2()?;
        if k != self.0.cols() {
            return Err(op_err(format!(
                "a packed Linear of {} inputs given rows of {k}",
                self.0.cols()
            )));
        }
        let x = f32_input(storage, layout, "input")?;
        let mut y = vec![0f32; m * self.0.rows()];
        packed_matmul::matmul_wt(x, m, self.0.as_ref(), &mut y).map_err(op_err)?;
        Ok((CpuStorage::F32(y), Shape::from((m, self.0.rows()))))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = grad_res.to_dtype(DType::F32)?.contiguous()?;
        Ok(Some(g.apply_op1_no_bwd(&InputGrad(self.0.clone()))?))
    }
}

impl CustomOp1 for InputGrad {
    fn name(&self) -> &'static str {
        "packed-linear-input-grad"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, n) = layout.shape().dims2()?;
        if n != self.0.rows() {
            return Err(op_err(format!(
                "a packed Linear of {} outputs given gradients of {n}",
                self.0.rows()
            )));
        }
        let dy = f32_input(storage, layout, "output gradient")?;
        let mut dx = vec![0f32; m * self.0.cols()];
        packed_matmul::matmul_w(dy, m, self.0.as_ref(), &mut dx).map_err(op_err)?;
        Ok((CpuStorage::F32(dx), Shape::from((m, self.0.cols()))))
    }
}

/// `x · Wᵀ` for `x` of any rank (the last dimension the input), `W` packed; the result in
/// `x`'s dtype. Differentiable with respect to `x`.
pub fn packed_linear(x: &Tensor, w: &Packed) -> Result<Tensor, ModelError> {
    if !x.device().is_cpu() {
        return Err(ModelError::Config(format!(
            "a packed (quantized) Linear runs on the CPU; the input is on {:?} — decode the \
             weights instead (QLoRA on GPUs is not built yet)",
            x.device()
        )));
    }
    let dims = x.dims().to_vec();
    let k = *dims.last().unwrap_or(&0);
    let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    let flat = x.to_dtype(DType::F32)?.reshape((rows, k))?.contiguous()?;
    let y = flat.apply_op1(Forward(w.clone()))?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = w.rows();
    }
    Ok(y.reshape(out)?.to_dtype(x.dtype())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use kiln_kernels::ops::packed_matmul::DenseRows;

    #[test]
    fn the_packed_linear_and_its_gradient_equal_the_dense_ones() {
        let dev = Device::Cpu;
        let (n, k) = (70, 33);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 97.0)
            .collect();
        let packed: Packed = Arc::new(DenseRows::new(w.clone(), n, k).unwrap());
        let wt = Tensor::from_vec(w, (n, k), &dev).unwrap();
        let x0: Vec<f32> = (0..2 * 5 * k)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0)
            .collect();
        let x = Var::from_vec(x0, (2, 5, k), &dev).unwrap();
        // A loss that weights every output differently.
        let weights = Tensor::arange(0f32, (2 * 5 * n) as f32, &dev)
            .unwrap()
            .reshape((2, 5, n))
            .unwrap();
        let run = |y: Tensor| {
            let loss = (y * &weights).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            (
                loss.to_scalar::<f32>().unwrap(),
                grads.get(&x).unwrap().clone(),
            )
        };
        let (lp, gp) = run(packed_linear(x.as_tensor(), &packed).unwrap());
        let (ld, gd) = run(super::super::linear(x.as_tensor(), &wt, None).unwrap());
        assert!((lp - ld).abs() <= 1e-4 * ld.abs(), "{lp} vs {ld}");
        let max = |t: Tensor| {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let scale = max(gd.clone());
        let diff = max((gp - gd).unwrap());
        assert!(scale > 1.0, "a gradient worth comparing ({scale})");
        assert!(
            diff <= 1e-5 * scale,
            "gradients differ by {diff} (largest {scale})"
        );
    }
}
