//! Linear layers whose weight stays packed (QLoRA's frozen, quantized base): `y = x · Wᵀ` with
//! `W` in its format's own layout, decoded a tile of rows at a time per use
//! ([`kiln_kernels::ops::packed_matmul`]), as a candle op with its backward with respect to
//! the input (`dx = dy · W`; the base is frozen, so no gradient reaches `W`). CPU only: on
//! another device the op names what it cannot do.

use super::ModelError;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
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

/// PEFT's LoRA Linear over a packed (or frozen) weight as one op
/// ([`packed_matmul::lora_forward`]): `x · Wᵀ (+ bias) + scale · (x_d · Aᵀ) · Bᵀ`, with the
/// gradients of `x`, `A` and `B`; nothing the size of the output kept beside it.
struct LoraLinear {
    w: Packed,
    bias: Option<Vec<f32>>,
    scale: f32,
    keep: Option<(Vec<f32>, f32)>,
}

/// The gradients of [`LoraLinear`] with respect to `x`, `A` and `B`, flat.
struct LoraLinearGrad<'a> {
    op: &'a LoraLinear,
    a: Vec<f32>,
    b: Vec<f32>,
}

impl LoraLinear {
    fn lora<'a>(&'a self, a: &'a [f32], b: &'a [f32]) -> packed_matmul::Lora<'a> {
        packed_matmul::Lora {
            a,
            b,
            r: a.len() / self.w.cols().max(1),
            scale: self.scale,
            keep: self.keep.as_ref().map(|(k, f)| (k.as_slice(), *f)),
        }
    }
}

impl candle_core::CustomOp3 for LoraLinear {
    fn name(&self) -> &'static str {
        "packed-lora-linear"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, _) = l1.shape().dims2()?;
        let x = f32_input(s1, l1, "input")?;
        let (a, b) = (f32_input(s2, l2, "lora_A")?, f32_input(s3, l3, "lora_B")?);
        let mut y = vec![0f32; m * self.w.rows()];
        packed_matmul::lora_forward(
            x,
            m,
            self.w.as_ref(),
            self.bias.as_deref(),
            &self.lora(a, b),
            &mut y,
        )
        .map_err(op_err)?;
        Ok((CpuStorage::F32(y), Shape::from((m, self.w.rows()))))
    }
    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let host = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
        let grad = LoraLinearGrad {
            op: self,
            a: host(a)?,
            b: host(b)?,
        };
        let flat = x.apply_op2_no_bwd(&dy.contiguous()?, &grad)?;
        let (nx, na, nb) = (x.elem_count(), a.elem_count(), b.elem_count());
        Ok((
            Some(flat.narrow(0, 0, nx)?.reshape(x.shape())?),
            Some(flat.narrow(0, nx, na)?.reshape(a.shape())?),
            Some(flat.narrow(0, nx + na, nb)?.reshape(b.shape())?),
        ))
    }
}

impl CustomOp2 for LoraLinearGrad<'_> {
    fn name(&self) -> &'static str {
        "packed-lora-linear-grad"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, _) = l1.shape().dims2()?;
        let x = f32_input(s1, l1, "input")?;
        let dy = f32_input(s2, l2, "output gradient")?;
        let (na, nb) = (self.a.len(), self.b.len());
        let mut flat = vec![0f32; x.len() + na + nb];
        let (dx, rest) = flat.split_at_mut(x.len());
        let (da, db) = rest.split_at_mut(na);
        let lora = self.op.lora(&self.a, &self.b);
        packed_matmul::lora_backward(x, m, self.op.w.as_ref(), &lora, dy, (dx, da, db))
            .map_err(op_err)?;
        let len = flat.len();
        Ok((CpuStorage::F32(flat), Shape::from(len)))
    }
}

/// `x · Wᵀ (+ bias) + scale · (x_d · Aᵀ) · Bᵀ` for `x` of any rank (f32 on the CPU), `W`
/// packed, `A [r, in]` and `B [out, r]` f32, `keep` the adapter's dropout mask (one value per
/// element of `x`) and `1 / (1 − p)`. Differentiable with respect to `x`, `A` and `B`.
pub fn lora_linear(
    x: &Tensor,
    w: &Packed,
    bias: Option<&Tensor>,
    (a, b): (&Tensor, &Tensor),
    scale: f64,
    keep: Option<(Vec<f32>, f32)>,
) -> Result<Tensor, ModelError> {
    let dims = x.dims().to_vec();
    let k = *dims.last().unwrap_or(&0);
    let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    let flat = x.reshape((rows, k))?.contiguous()?;
    let bias = match bias {
        Some(t) => Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let op = LoraLinear {
        w: w.clone(),
        bias,
        scale: scale as f32,
        keep,
    };
    let y = flat.apply_op3(&a.contiguous()?, &b.contiguous()?, op)?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = w.rows();
    }
    Ok(y.reshape(out)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use kiln_kernels::ops::packed_matmul::DenseRows;

    /// The fused LoRA Linear against the Linear plus PEFT's delta as candle ops (the decoder's
    /// unfused path), values and the gradients of `x`, `A` and `B`, with a bias, with and
    /// without dropout.
    #[test]
    fn the_lora_linear_op_equals_the_linear_plus_the_adapters_delta() {
        use crate::model::fused::tests::{agree, host, var};
        let (n, k, r) = (12, 10, 3);
        let w = var(&[n, k], 21, 1.0).as_tensor().clone();
        let packed: Packed = Arc::new(DenseRows::new(host(&w), n, k).unwrap());
        let bias = var(&[n], 22, 1.0).as_tensor().clone();
        let keep: Vec<f32> = (0..2 * 4 * k)
            .map(|i| if i % 4 == 1 { 0.0 } else { 1.0 })
            .collect();
        let keep_t = Tensor::from_vec(keep.clone(), (2, 4, k), &Device::Cpu).unwrap();
        for dropout in [false, true] {
            let (x, a, b) = (
                var(&[2, 4, k], 23, 2.0),
                var(&[r, k], 24, 0.5),
                var(&[n, r], 25, 0.5),
            );
            let mask = dropout.then(|| (keep.clone(), (1.0f64 / 0.75) as f32));
            agree(
                &[x, a, b],
                |t| {
                    lora_linear(
                        &t[0],
                        &packed,
                        Some(&bias),
                        (&t[1], &t[2]),
                        0.75,
                        mask.clone(),
                    )
                    .unwrap()
                },
                |t| {
                    let y = super::super::linear(&t[0], &w, Some(&bias)).unwrap();
                    let xd = if dropout {
                        (&t[0] * &keep_t).unwrap().affine(1.0 / 0.75, 0.0).unwrap()
                    } else {
                        t[0].clone()
                    };
                    let h = super::super::linear(&xd, &t[1], None).unwrap();
                    let d = super::super::linear(&h, &t[2], None)
                        .unwrap()
                        .affine(0.75, 0.0)
                        .unwrap();
                    (y + d).unwrap()
                },
                1e-5,
            );
        }
    }

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
