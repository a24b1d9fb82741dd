//! The bf16 element-wise steps of a model run without gradients (`kiln_kernels::ops::fused_bf16`)
//! as candle ops: RMSNorm, SwiGLU and RoPE, each one threaded pass rounding where transformers'
//! bf16 modules round, in place of five to eight candle ops each allocating its output. Used on
//! the CPU for bf16 tensors no gradient flows through ([`runs`]): calibration in bf16 and
//! `kiln eval --dtype bf16`. They have no backward pass: a tensor that tracks its graph takes
//! the unfused ops.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use half::vec::{HalfBitsVecExt, HalfFloatVecExt};
use kiln_kernels::ops::fused_bf16 as k;

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Whether the bf16 ops run on `ts`: all bf16 on the CPU, none in an autograd graph.
pub(crate) fn runs(ts: &[&Tensor]) -> bool {
    ts.iter()
        .all(|t| t.dtype() == DType::BF16 && t.device().is_cpu() && !t.track_op())
}

/// `storage` under `layout` as contiguous bf16 bits.
pub(crate) fn bits<'a>(s: &'a CpuStorage, l: &Layout, op: &str) -> candle_core::Result<&'a [u16]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::BF16(v), Some((a, b))) => Ok(v[a..b].reinterpret_cast()),
        _ => Err(op_err(format!("{op}: must be bf16 and contiguous"))),
    }
}

fn out(y: Vec<u16>, shape: &Shape) -> (CpuStorage, Shape) {
    (CpuStorage::BF16(y.reinterpret_into()), shape.clone())
}

struct RmsNorm(f32);

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm-bf16"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w) = (bits(s1, l1, "rms_norm")?, bits(s2, l2, "rms_norm")?);
        let mut y = vec![0u16; x.len()];
        k::rms_norm(x, w, self.0, &mut y).map_err(op_err)?;
        Ok(out(y, l1.shape()))
    }
}

/// transformers' RMSNorm of bf16 `x` over its last dimension with the bf16 weight `w`.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&w.contiguous()?, &RmsNorm(eps as f32))
}

struct Swiglu;

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu-bf16"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (g, u) = (bits(s1, l1, "swiglu")?, bits(s2, l2, "swiglu")?);
        let mut y = vec![0u16; g.len()];
        k::swiglu(g, u, &mut y).map_err(op_err)?;
        Ok(out(y, l1.shape()))
    }
}

/// `silu(g) · u` of bf16 tensors of one shape.
pub(crate) fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    if g.shape() != u.shape() {
        return Err(op_err(format!(
            "swiglu: gate {:?} against up {:?}",
            g.shape(),
            u.shape()
        )));
    }
    g.contiguous()?.apply_op2_no_bwd(&u.contiguous()?, &Swiglu)
}

struct Rope {
    cos: Vec<u16>,
    sin: Vec<u16>,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "rope-bf16"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = bits(s, l, "rope")?;
        let dims = l.shape().dims();
        let (t, d) = match dims {
            [.., t, d] => (*t, *d),
            _ => return Err(op_err(format!("rope: input {dims:?}"))),
        };
        let mut y = vec![0u16; x.len()];
        k::rope(x, &self.cos, &self.sin, t, d, &mut y).map_err(op_err)?;
        Ok(out(y, l.shape()))
    }
}

/// RoPE on bf16 `x` `[.., t, d]` with the tables `cos`, `sin` `[t, d]` (rounded to bf16 as the
/// model's tables are).
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let host = |t: &Tensor| -> candle_core::Result<Vec<u16>> {
        let v: Vec<half::bf16> = t.to_dtype(DType::BF16)?.flatten_all()?.to_vec1()?;
        Ok(v.reinterpret_into())
    };
    x.contiguous()?.apply_op1_no_bwd(&Rope {
        cos: host(cos)?,
        sin: host(sin)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn tensor(shape: &[usize], seed: u64, scale: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    }

    fn bits_of(t: &Tensor) -> Vec<u16> {
        let v: Vec<half::bf16> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.reinterpret_into()
    }

    /// The ops against the decoder's unfused candle composition in bf16: SwiGLU and RoPE the
    /// same bits (both round every step to nearest even); RMSNorm's f32 sum of squares runs in
    /// another order (candle's reduction against eight partial sums), so an output may move by
    /// an ulp where the two sums straddle a rounding point — none or nearly none do.
    #[test]
    fn bf16_ops_equal_the_unfused_composition() {
        use super::super::decoder::{rms_norm_unfused, rope_unfused};
        let g = tensor(&[6, 40, 96], 1, 8.0);
        let u = tensor(&[6, 40, 96], 2, 2.0);
        let unfused = (g
            .to_dtype(DType::F32)
            .unwrap()
            .silu()
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
            * &u)
            .unwrap();
        assert_eq!(bits_of(&swiglu(&g, &u).unwrap()), bits_of(&unfused));

        let x = tensor(&[2, 3, 7, 16], 3, 4.0);
        let (cos, sin) = (tensor(&[7, 16], 4, 1.0), tensor(&[7, 16], 5, 1.0));
        let unfused = rope_unfused(&x, &cos, &sin).unwrap();
        assert_eq!(bits_of(&rope(&x, &cos, &sin).unwrap()), bits_of(&unfused));

        let x = tensor(&[4, 50, 576], 6, 3.0);
        let w = tensor(&[576], 7, 1.5);
        let (got, want) = (
            bits_of(&rms_norm(&x, &w, 1e-5).unwrap()),
            bits_of(&rms_norm_unfused(&x, &w, 1e-5).unwrap()),
        );
        let mut moved = 0;
        for (&a, &b) in got.iter().zip(&want) {
            let ulps = (i32::from(a as i16) - i32::from(b as i16)).abs();
            assert!(ulps <= 1, "rms_norm: {a:#06x} against {b:#06x}");
            moved += usize::from(ulps == 1);
        }
        assert!(
            moved * 1000 <= got.len(),
            "{moved} of {} moved by an ulp",
            got.len()
        );
    }

    #[test]
    fn tensors_in_a_graph_or_not_bf16_take_the_unfused_ops() {
        let x = tensor(&[2, 4], 1, 1.0);
        assert!(runs(&[&x]));
        assert!(!runs(&[&x.to_dtype(DType::F32).unwrap()]));
        let v = candle_core::Var::from_tensor(&x).unwrap();
        assert!(!runs(&[v.as_tensor()]));
    }
}
