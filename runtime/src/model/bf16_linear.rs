//! bf16 Linears on CPUs with AVX-512 BF16: `y = x · Wᵀ` for a bf16 input and a frozen bf16
//! weight on the packed GEMM's bf16 arithmetic ([`kiln_kernels::cpu::gemm::matmul_bf16_bits_wt`])
//! — the input's and weight's bf16 pairs read in their own 2-byte values (the weight packed by
//! register transposes, nothing rounded or widened), 32 multiply-adds an instruction
//! (`VDPBF16PS`), each output's f32 chain in order along `k`, rounded once to bf16 at the end
//! (as candle's bf16 matmul and oneDNN's round them). A model run in bf16 (`--calib-dtype bf16`, ModelOpt's
//! precision) takes this path where the CPU has the instruction, and candle's matmul (the
//! weight widened to f32 per product) elsewhere or under `KILN_CPU=avx2|scalar`: the two
//! differ only in the order of the f32 sums.

use super::ModelError;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use half::vec::HalfBitsVecExt;
use kiln_kernels::cpu::gemm;

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Whether `x · wᵀ` runs here: both bf16 on the CPU, the weight outside autograd (its
/// gradient is never asked for), and the CPU has AVX-512 BF16.
pub(crate) fn runs(x: &Tensor, w: &Tensor) -> bool {
    x.dtype() == DType::BF16
        && x.device().is_cpu()
        && w.dtype() == DType::BF16
        && w.device().is_cpu()
        && !w.track_op()
        && w.rank() == 2
        && gemm::bf16_available()
}

/// `x [m, k]` · `w [n, k]`ᵀ → `[m, n]` bf16 (both contiguous).
struct Bf16Linear;

impl CustomOp2 for Bf16Linear {
    fn name(&self) -> &'static str {
        "bf16-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, wk) = wl.shape().dims2()?;
        if wk != k {
            return Err(op_err(format!(
                "a bf16 Linear of {wk} inputs given rows of {k}"
            )));
        }
        let x = super::fused_bf16::bits(xs, xl, "a bf16 Linear's input")?;
        let w = super::fused_bf16::bits(ws, wl, "a bf16 Linear's weight")?;
        let mut y = vec![0u16; m * n];
        gemm::matmul_bf16_bits_wt(x, w, &mut y, (m, n, k)).map_err(op_err)?;
        Ok((CpuStorage::BF16(y.reinterpret_into()), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // The weight is frozen (see `runs`): only the input's gradient, `dy · W`.
        Ok((Some(dy.matmul(w)?), None))
    }
}

/// `x [rows, k] · wᵀ` (`w [n, k]`) when [`runs`] says so.
pub(crate) fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
    Ok(x.contiguous()?.apply_op2(&w.contiguous()?, Bf16Linear)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use half::bf16;
    use half::slice::HalfFloatSliceExt;
    use kiln_kernels::cpu::gemm::{Mat, reference};

    fn values(n: usize, seed: u64, scale: f32) -> Vec<bf16> {
        super::super::fused::tests::values(n, seed, scale)
            .into_iter()
            .map(bf16::from_f32)
            .collect()
    }

    #[test]
    fn a_bf16_linear_is_the_packed_gemms_bf16_chains_rounded() -> Result<(), ModelError> {
        let (m, n, k) = (7, 13, 70);
        let dev = Device::Cpu;
        let (xv, wv) = (values(m * k, 1, 2.0), values(n * k, 2, 0.1));
        let x = Tensor::from_vec(xv.clone(), (m, k), &dev)?;
        let w = Tensor::from_vec(wv.clone(), (n, k), &dev)?;
        if !runs(&x, &w) {
            println!(
                "no AVX-512 BF16 here (or KILN_CPU narrows it): bf16 Linears run candle's matmul; skipped"
            );
            return Ok(());
        }
        let got: Vec<u16> = super::super::decoder::linear(&x, &w, None)?
            .flatten_all()?
            .to_vec1::<bf16>()?
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let (xf, wf): (Vec<f32>, Vec<f32>) = (xv.to_f32_vec(), wv.to_f32_vec());
        let y = reference::matmul_bf16_rounded(
            &Mat::row_major(&xf, m, k),
            &Mat::row_major(&wf, n, k).t(),
        );
        let want: Vec<u16> = y.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        assert_eq!(got, want);
        // Candle's matmul (f32 sums in another order) agrees to bf16 rounding.
        let candle = x
            .matmul(&w.t()?)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (g, c) in got.iter().zip(&candle) {
            let g = f32::from(bf16::from_bits(*g));
            assert!((g - c).abs() <= 1e-2 * c.abs().max(1e-2), "{g} vs {c}");
        }
        Ok(())
    }

    #[test]
    fn its_input_gradient_is_dy_times_w_and_a_trained_weight_is_not_taken() -> Result<(), ModelError>
    {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::from_vec(values(3 * 40, 3, 1.0), (3, 40), &dev)?)?;
        let w = Tensor::from_vec(values(5 * 40, 4, 0.2), (5, 40), &dev)?;
        if !runs(x.as_tensor(), &w) {
            println!("no AVX-512 BF16 here (or KILN_CPU narrows it): skipped");
            return Ok(());
        }
        let y = super::super::decoder::linear(x.as_tensor(), &w, None)?;
        let grads = y.sum_all()?.backward()?;
        let dx = grads.get(x.as_tensor()).expect("a gradient for x");
        let want = Tensor::ones((3, 5), DType::BF16, &dev)?.matmul(&w)?;
        assert_eq!(
            dx.flatten_all()?.to_vec1::<bf16>()?,
            want.flatten_all()?.to_vec1::<bf16>()?
        );
        // A weight in autograd keeps candle's matmul, which differentiates it.
        let trained = Var::from_tensor(&w)?;
        assert!(!runs(x.as_tensor(), trained.as_tensor()));
        Ok(())
    }
}
