//! A trained Linear's `y = x · Wᵀ` on the CPU in f32 as one candle op with both gradients
//! (`dx = dy · W`, `dW = dyᵀ · x`, [`kiln_kernels::ops::packed_matmul::dense`]).
//!
//! candle's composition, `x.reshape(rows).matmul(&w.t()).reshape(..)`, puts four nodes in the
//! graph, and candle's backward gives each node's input a zeroed gradient and adds the node's
//! contribution into it (`GradStore::or_insert`, then `add`): a fresh allocation and a pass
//! over memory per node, three of them the size of the layer's input, output or weight for
//! nothing, and the weight's a strided add (the transpose's gradient). As one op only the
//! input and the weight receive gradients. On AVX-512 the three products run on the packed
//! GEMM (`kiln_kernels::cpu::gemm`, each operand read in its own layout, 1.2–2.1× candle's
//! GEMM on these shapes); elsewhere they are candle's own calls with the same operand layouts,
//! so the values are the composition's, bit for bit
//! (`dense_linear_equals_its_gemms_definition_bit_for_bit` checks both).

use super::ModelError;
use super::fused::slice;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use kiln_kernels::cpu::autocast;
use kiln_kernels::ops::packed_matmul::dense;

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Whether `x · wᵀ` runs as [`linear`]: both f32 on the CPU, the weight a contiguous
/// `[n, k]` matrix with `k > 0` (an empty input row leaves the row count unknowable from the
/// element count; candle's matmul takes that case).
pub fn runs(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && w.device().is_cpu()
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && w.rank() == 2
        && w.dims()[1] > 0
        && w.is_contiguous()
}

/// `x · wᵀ` for `x` of any rank (the last dimension the input), differentiable with respect to
/// both; see [`runs`] for what it takes.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
    Ok(x.contiguous()?
        .apply_op2(w, DenseLinear { autocast: false })?)
}

/// [`linear`] as PyTorch's CPU autocast to bf16 runs it (TRL's `bf16=True`): the input and
/// the weight rounded to bf16, f32 sums, the output rounded to bf16, and both gradients
/// computed so too ([`kiln_kernels::cpu::autocast`]); f32 tensors holding bf16 values.
pub fn linear_autocast(x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
    Ok(x.contiguous()?
        .apply_op2(w, DenseLinear { autocast: true })?)
}

/// `(m, n, k)` of `x [.., k] · w [n, k]ᵀ`, or an error naming the mismatch.
fn dims(x: &Shape, w: &Shape, op: &str) -> candle_core::Result<(usize, usize, usize)> {
    let (n, k) = w.dims2()?;
    match x.dims().last() {
        Some(&xk) if xk == k => Ok((x.elem_count() / k.max(1), n, k)),
        _ => Err(op_err(format!(
            "{op}: an input of shape {x:?} for a weight of shape {w:?}"
        ))),
    }
}

/// `x [.., k], w [n, k] → y [.., n]`; `autocast`: in bf16, as [`linear_autocast`].
struct DenseLinear {
    autocast: bool,
}

/// `dy [.., n], w [n, k] → dx [.., k]`.
struct InputGrad {
    autocast: bool,
}

/// `x [.., k], dy [.., n] → dW [n, k]`.
struct WeightGrad {
    autocast: bool,
}

fn with_last(shape: &Shape, last: usize) -> Shape {
    let mut d = shape.dims().to_vec();
    if let Some(l) = d.last_mut() {
        *l = last;
    }
    Shape::from(d)
}

impl CustomOp2 for DenseLinear {
    fn name(&self) -> &'static str {
        "dense-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, n, k) = dims(l1.shape(), l2.shape(), "dense-linear")?;
        let (x, w) = (
            slice(s1, l1, "dense-linear")?,
            slice(s2, l2, "dense-linear")?,
        );
        let mut y = vec![0f32; m * n];
        match self.autocast {
            false => dense::forward(x, w, (m, n, k), &mut y),
            true => autocast::forward(x, w, (m, n, k), &mut y),
        }
        .map_err(op_err)?;
        Ok((CpuStorage::F32(y), with_last(l1.shape(), n)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        // A gradient nobody reads (an input or weight outside autograd) is not computed.
        let dx = match x.track_op() {
            true => Some(dy.apply_op2_no_bwd(
                w,
                &InputGrad {
                    autocast: self.autocast,
                },
            )?),
            false => None,
        };
        let dw = match w.track_op() {
            true => Some(x.apply_op2_no_bwd(
                &dy,
                &WeightGrad {
                    autocast: self.autocast,
                },
            )?),
            false => None,
        };
        Ok((dx, dw))
    }
}

impl CustomOp2 for InputGrad {
    fn name(&self) -> &'static str {
        "dense-linear-input-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let m = dims(l1.shape(), &Shape::from((k, n)), "dense-linear-input-grad")?.0;
        let (dy, w) = (
            slice(s1, l1, "dense-linear-input-grad")?,
            slice(s2, l2, "dense-linear-input-grad")?,
        );
        let mut dx = vec![0f32; m * k];
        match self.autocast {
            false => dense::input_grad(dy, w, (m, n, k), &mut dx),
            true => autocast::input_grad(dy, w, (m, n, k), &mut dx),
        }
        .map_err(op_err)?;
        Ok((CpuStorage::F32(dx), with_last(l1.shape(), k)))
    }
}

impl CustomOp2 for WeightGrad {
    fn name(&self) -> &'static str {
        "dense-linear-weight-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let k = l1.shape().dims().last().copied().unwrap_or(0);
        let n = l2.shape().dims().last().copied().unwrap_or(0);
        let m = l1.shape().elem_count() / k.max(1);
        if l2.shape().elem_count() != m * n {
            return Err(op_err(format!(
                "dense-linear-weight-grad: an input of shape {:?} with a gradient of shape {:?}",
                l1.shape(),
                l2.shape()
            )));
        }
        let (x, dy) = (
            slice(s1, l1, "dense-linear-weight-grad")?,
            slice(s2, l2, "dense-linear-weight-grad")?,
        );
        let mut dw = vec![0f32; n * k];
        match self.autocast {
            false => dense::weight_grad(x, dy, (m, n, k), &mut dw),
            true => autocast::weight_grad(x, dy, (m, n, k), &mut dw),
        }
        .map_err(op_err)?;
        Ok((CpuStorage::F32(dw), Shape::from((n, k))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The old composition, as `decoder::linear` ran it.
    fn composition(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        let dims = x.dims().to_vec();
        let k = dims[dims.len() - 1];
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let y = x.reshape((rows, k))?.matmul(&w.t()?)?;
        let mut out = dims;
        let last = out.len() - 1;
        out[last] = w.dim(0)?;
        y.reshape(out)
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// `A · B` as the packed GEMM defines it (`kiln_kernels::cpu::gemm::reference`: each output
    /// a fused multiply-add chain along `k`), for row-major `a [m, k]` (`at`: given as
    /// `[k, m]`) and `b [k, n]` (`bt`: given as `[n, k]`).
    fn chain(
        a: &[f32],
        at: bool,
        b: &[f32],
        bt: bool,
        (m, k, n): (usize, usize, usize),
    ) -> Vec<u32> {
        use kiln_kernels::cpu::gemm::{Mat, reference};
        let a = if at {
            Mat::row_major(a, k, m).t()
        } else {
            Mat::row_major(a, m, k)
        };
        let b = if bt {
            Mat::row_major(b, n, k).t()
        } else {
            Mat::row_major(b, k, n)
        };
        reference::matmul(&a, &b)
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// The op's values and gradients are, bit for bit, candle's matmul composition where the
    /// products run on the `gemm` crate (candle's), and the packed GEMM's scalar definition
    /// where they run on it (AVX-512).
    #[test]
    fn dense_linear_equals_its_gemms_definition_bit_for_bit() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let packed = kiln_kernels::cpu::gemm::available();
        // Shapes across the blockings: tiny, odd, and wider than one panel in every
        // dimension; 2-D and 3-D inputs.
        for (lead, k, n) in [
            (vec![3usize], 5usize, 7usize),
            (vec![2, 9], 33, 17),
            (vec![4, 50], 130, 260),
            (vec![300], 257, 96),
        ] {
            let mut xs = lead.clone();
            xs.push(k);
            let x0 = Tensor::randn(0f32, 1.0, xs.as_slice(), &dev)?;
            let w0 = Tensor::randn(0f32, 0.5, (n, k), &dev)?;
            let mut ys = lead.clone();
            ys.push(n);
            // A weight on the output's gradient that is not uniform, so every entry of dy
            // differs (dy is `c` itself).
            let c = Tensor::randn(0f32, 1.0, ys.as_slice(), &dev)?;
            let run = |fused: bool| -> candle_core::Result<(Tensor, Tensor, Tensor)> {
                let (x, w) = (Var::from_tensor(&x0)?, Var::from_tensor(&w0)?);
                let y = if fused {
                    linear(x.as_tensor(), w.as_tensor()).map_err(op_err)?
                } else {
                    composition(x.as_tensor(), w.as_tensor())?
                };
                let grads = (&y * &c)?.sum_all()?.backward()?;
                let dx = grads.get(x.as_tensor()).expect("dx").clone();
                let dw = grads.get(w.as_tensor()).expect("dw").clone();
                Ok((y, dx, dw))
            };
            let (y1, dx1, dw1) = run(true)?;
            assert_eq!(y1.dims(), ys.as_slice(), "{lead:?} {k} {n}");
            assert_eq!(dx1.dims(), x0.dims());
            assert_eq!(dw1.dims(), w0.dims());
            let (y0, dx0, dw0) = if packed {
                let m: usize = lead.iter().product();
                let flat = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
                let (x, w, dy) = (flat(&x0)?, flat(&w0)?, flat(&c)?);
                (
                    chain(&x, false, &w, true, (m, k, n)),
                    chain(&dy, false, &w, false, (m, n, k)),
                    chain(&dy, true, &x, false, (n, m, k)),
                )
            } else {
                let (y0, dx0, dw0) = run(false)?;
                (bits(&y0), bits(&dx0), bits(&dw0))
            };
            assert_eq!(bits(&y1), y0, "y, {lead:?} k {k} n {n}");
            assert_eq!(bits(&dx1), dx0, "dx, {lead:?} k {k} n {n}");
            assert_eq!(bits(&dw1), dw0, "dW, {lead:?} k {k} n {n}");
        }
        Ok(())
    }

    #[test]
    fn the_autocast_linear_is_candles_bf16_composition_within_a_bf16_step()
    -> candle_core::Result<()> {
        // autocast's linear as candle's casts write it: x and W cast to bf16 (and back, the
        // casts' gradients rounding as torch's do), the product of the bf16 values in f32
        // (exact products), the output cast to bf16.
        let dev = Device::Cpu;
        let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
        let (x0, w0) = (
            Tensor::randn(0f32, 1.0, (2, 9, 70), &dev)?,
            Tensor::randn(0f32, 0.1, (33, 70), &dev)?,
        );
        let c = Tensor::randn(0f32, 1.0, (2, 9, 33), &dev)?;
        let run = |fused: bool| -> candle_core::Result<(Tensor, Tensor, Tensor)> {
            let (x, w) = (Var::from_tensor(&x0)?, Var::from_tensor(&w0)?);
            let y = if fused {
                linear_autocast(x.as_tensor(), w.as_tensor()).map_err(op_err)?
            } else {
                round(&composition(
                    &round(x.as_tensor())?,
                    &round(w.as_tensor())?,
                )?)?
            };
            let grads = (&y * &c)?.sum_all()?.backward()?;
            let dx = grads.get(x.as_tensor()).expect("dx").clone();
            let dw = grads.get(w.as_tensor()).expect("dw").clone();
            Ok((y, dx, dw))
        };
        let (y1, dx1, dw1) = run(true)?;
        let (y0, dx0, dw0) = run(false)?;
        for (what, a, b) in [("y", &y1, &y0), ("dx", &dx1, &dx0), ("dW", &dw1, &dw0)] {
            let (a, b) = (
                a.flatten_all()?.to_vec1::<f32>()?,
                b.flatten_all()?.to_vec1::<f32>()?,
            );
            for (p, q) in a.iter().zip(&b) {
                assert_eq!(
                    *p,
                    half::bf16::from_f32(*p).to_f32(),
                    "{what}: {p} is not bf16"
                );
                let step = p.abs().max(q.abs()) * 2f32.powi(-7);
                assert!((p - q).abs() <= step, "{what}: {p} against {q}");
            }
        }
        // Not f32's product: the roundings are there.
        let plain = linear(&x0, &w0).map_err(op_err)?;
        assert_ne!(bits(&y1), bits(&plain));
        Ok(())
    }

    #[test]
    fn dense_linear_computes_no_gradient_for_a_tensor_outside_autograd() -> candle_core::Result<()>
    {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (4, 6), &dev)?)?;
        let w = Tensor::randn(0f32, 1.0, (3, 6), &dev)?;
        let y = linear(x.as_tensor(), &w).map_err(op_err)?;
        let grads = y.sum_all()?.backward()?;
        assert!(grads.get(&w).is_none());
        // dx = 1 · W summed over the outputs, for every row.
        let want = w.sum(0)?.unsqueeze(0)?.broadcast_as((4, 6))?;
        let got = grads.get(x.as_tensor()).expect("dx");
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        Ok(())
    }

    #[test]
    fn an_empty_input_row_takes_candles_matmul() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 3, 0), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((4, 0), DType::F32, &dev).unwrap();
        assert!(!runs(&x, &w));
        let y = crate::model::decoder::linear(&x, &w, None).unwrap();
        assert_eq!(y.dims(), &[2, 3, 4]);
        // No rows at all is fine for the op.
        let x = Tensor::zeros((0, 5), DType::F32, &dev).unwrap();
        let w = Tensor::ones((4, 5), DType::F32, &dev).unwrap();
        assert!(runs(&x, &w));
        assert_eq!(linear(&x, &w).unwrap().dims(), &[0, 4]);
    }

    #[test]
    fn dense_linear_names_a_shape_mismatch() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
        let w = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
        let e = linear(&x, &w).unwrap_err().to_string();
        assert!(e.contains("dense-linear") && e.contains("[2, 5]"), "{e}");
    }
}
