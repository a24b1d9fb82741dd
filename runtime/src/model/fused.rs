//! The decoder's fused CPU ops (`kiln_kernels::ops::fused`) as candle ops with their backward
//! passes: SwiGLU, RMSNorm, RoPE, attention's masked softmax and the per-token log-softmax.
//! Each keeps for its backward only what the formula needs (its inputs, or its output) where
//! the unfused composition keeps every intermediate, and runs one threaded pass where that runs
//! several. They run on the CPU in f32 ([`fusable`]); elsewhere the decoder runs the unfused
//! ops. Tested against the unfused composition, values and gradients (this file's tests) and by
//! TRL parity unchanged (`tests/it/train.rs`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use kiln_kernels::ops::fused as k;
use std::sync::Mutex;

fn op_err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Whether the fused ops can run on `t`: on the CPU, in f32.
pub fn fusable(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

/// `storage` under `layout` as a contiguous f32 slice.
fn slice<'a>(storage: &'a CpuStorage, layout: &Layout, op: &str) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        return Err(op_err(format!("{op}: f32 only")));
    };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => Err(op_err(format!("{op}: a contiguous input only"))),
    }
}

fn out(v: Vec<f32>, shape: &Shape) -> (CpuStorage, Shape) {
    (CpuStorage::F32(v), shape.clone())
}

// ---- SwiGLU -------------------------------------------------------------------------------

struct Swiglu;
struct SwigluGrad;

impl CustomOp2 for Swiglu {
    fn name(&self) -> &'static str {
        "fused-swiglu"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (g, u) = (slice(s1, l1, "swiglu")?, slice(s2, l2, "swiglu")?);
        let mut y = vec![0f32; g.len()];
        k::swiglu(g, u, &mut y).map_err(op_err)?;
        Ok(out(y, l1.shape()))
    }
    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = g.apply_op3_no_bwd(u, &dy.contiguous()?, &SwigluGrad)?;
        Ok((Some(both.get(0)?), Some(both.get(1)?)))
    }
}

impl CustomOp3 for SwigluGrad {
    fn name(&self) -> &'static str {
        "fused-swiglu-grad"
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
        let op = "swiglu backward";
        let (g, u, dy) = (slice(s1, l1, op)?, slice(s2, l2, op)?, slice(s3, l3, op)?);
        let n = g.len();
        let mut both = vec![0f32; 2 * n];
        let (dg, du) = both.split_at_mut(n);
        k::swiglu_backward(g, u, dy, dg, du).map_err(op_err)?;
        let mut dims = vec![2];
        dims.extend_from_slice(l1.shape().dims());
        Ok((CpuStorage::F32(both), Shape::from(dims)))
    }
}

/// `silu(g) · u`, fused (both f32 on the CPU, the same shape).
pub fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    g.contiguous()?.apply_op2(&u.contiguous()?, Swiglu)
}

// ---- RMSNorm ------------------------------------------------------------------------------

struct RmsNorm(f32);
struct RmsNormGrad(f32);

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "fused-rms-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (x, w) = (slice(s1, l1, "rms_norm")?, slice(s2, l2, "rms_norm")?);
        let cols = w.len();
        let mut y = vec![0f32; x.len()];
        let mut rstd = vec![0f32; x.len() / cols.max(1)];
        k::rms_norm(x, w, cols, self.0, &mut y, &mut rstd).map_err(op_err)?;
        Ok(out(y, l1.shape()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let flat = x.apply_op3_no_bwd(w, &dy.contiguous()?, &RmsNormGrad(self.0))?;
        let n = x.elem_count();
        let dx = flat.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = flat.narrow(0, n, w.elem_count())?.reshape(w.shape())?;
        Ok((Some(dx), Some(dw)))
    }
}

impl CustomOp3 for RmsNormGrad {
    fn name(&self) -> &'static str {
        "fused-rms-norm-grad"
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
        let op = "rms_norm backward";
        let (x, w, dy) = (slice(s1, l1, op)?, slice(s2, l2, op)?, slice(s3, l3, op)?);
        let cols = w.len();
        let mut rstd = vec![0f32; x.len() / cols.max(1)];
        k::rms_rstd(x, cols, self.0, &mut rstd).map_err(op_err)?;
        let mut flat = vec![0f32; x.len() + cols];
        let (dx, dw) = flat.split_at_mut(x.len());
        k::rms_norm_backward(x, w, &rstd, dy, cols, dx, dw).map_err(op_err)?;
        let len = flat.len();
        Ok((CpuStorage::F32(flat), Shape::from(len)))
    }
}

/// transformers' RMSNorm over the last dimension, fused (`x` f32 on the CPU, `w` its width).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2(&w.to_dtype(DType::F32)?.contiguous()?, RmsNorm(eps as f32))
}

// ---- RoPE ---------------------------------------------------------------------------------

struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    transpose: bool,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "fused-rope"
    }
    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = slice(storage, layout, "rope")?;
        let dims = layout.shape().dims();
        let (t, d) = match dims {
            [.., t, d] => (*t, *d),
            _ => return Err(op_err("rope: an input of [.., t, d]")),
        };
        let mut y = vec![0f32; x.len()];
        k::rope(x, &self.cos, &self.sin, t, d, self.transpose, &mut y).map_err(op_err)?;
        Ok(out(y, layout.shape()))
    }
    fn bwd(&self, _x: &Tensor, _res: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let back = Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            transpose: !self.transpose,
        };
        Ok(Some(dy.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// `x · cos + rotate_half(x) · sin` for `x` `[.., t, d]` (f32 on the CPU) with the tables `[t,
/// d]`, fused.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let host = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    x.contiguous()?.apply_op1(Rope {
        cos: host(cos)?,
        sin: host(sin)?,
        transpose: false,
    })
}

// ---- Attention's masked softmax -----------------------------------------------------------

struct MaskedSoftmax {
    heads: usize,
    scale: f32,
    causal: Vec<f32>,
    keys: Option<Vec<f32>>,
}

struct SoftmaxGrad {
    scale: f32,
}

impl CustomOp1 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "fused-masked-softmax"
    }
    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let s = slice(storage, layout, "masked_softmax")?;
        let (b, h, tq, tk) = layout.shape().dims4()?;
        if h != self.heads {
            return Err(op_err(format!(
                "masked_softmax: {h} heads, expected {}",
                self.heads
            )));
        }
        let shape = k::Scores {
            batch: b,
            heads: h,
            tq,
            tk,
            scale: self.scale,
            causal: &self.causal,
            keys: self.keys.as_deref(),
        };
        let mut p = vec![0f32; s.len()];
        k::masked_softmax(s, &shape, &mut p).map_err(op_err)?;
        Ok(out(p, layout.shape()))
    }
    fn bwd(&self, _s: &Tensor, p: &Tensor, dp: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(p.apply_op2_no_bwd(
            &dp.contiguous()?,
            &SoftmaxGrad { scale: self.scale },
        )?))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "fused-masked-softmax-grad"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let op = "masked_softmax backward";
        let (p, dp) = (slice(s1, l1, op)?, slice(s2, l2, op)?);
        let tk = l1.shape().dims().last().copied().unwrap_or(1);
        let mut ds = vec![0f32; p.len()];
        k::masked_softmax_backward(p, dp, tk, self.scale, &mut ds).map_err(op_err)?;
        Ok(out(ds, l1.shape()))
    }
}

/// `softmax(scale · scores + causal + keys)` over the keys of `scores` `[batch, heads, tq, tk]`
/// (f32 on the CPU): `causal` `[tq, tk]` host values, `keys` the key mask `[batch, 1, 1, tk]`.
pub fn masked_softmax(
    scores: &Tensor,
    scale: f64,
    causal: Vec<f32>,
    keys: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let keys = match keys {
        Some(k) => Some(k.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let (_, heads, _, _) = scores.dims4()?;
    scores.contiguous()?.apply_op1(MaskedSoftmax {
        heads,
        scale: scale as f32,
        causal,
        keys,
    })
}

// ---- Per-token log-probabilities ----------------------------------------------------------

struct TokenLogps {
    labels: Vec<u32>,
    /// Each row's log-sum-exp, from the forward, for the backward.
    lse: Mutex<Vec<f32>>,
}

struct TokenLogpsGrad<'a>(&'a TokenLogps);

/// The rows of a `[batch, t, vocab]` layout whose last dimension is contiguous and whose
/// positions follow each other (a view narrowed along `t`).
fn rows_of(layout: &Layout) -> candle_core::Result<k::Rows> {
    let (b, t, v) = layout.shape().dims3()?;
    match layout.stride() {
        [s0, s1, 1] if *s1 == v => Ok(k::Rows {
            rows: b * t,
            vocab: v,
            per_group: t.max(1),
            group_stride: *s0,
            start: layout.start_offset(),
        }),
        s => Err(op_err(format!("token_logps: logits with strides {s:?}"))),
    }
}

fn f32_data(storage: &CpuStorage) -> candle_core::Result<&[f32]> {
    match storage {
        CpuStorage::F32(d) => Ok(d),
        _ => Err(op_err("token_logps: f32 logits only")),
    }
}

/// One value per position of `[batch, t, vocab]` logits: `f` fills them from the rows.
fn per_position(
    storage: &CpuStorage,
    layout: &Layout,
    f: impl FnOnce(&[f32], &k::Rows, &mut [f32]) -> Result<(), kiln_kernels::KernelError>,
) -> candle_core::Result<(CpuStorage, Shape)> {
    let rows = rows_of(layout)?;
    let mut o = vec![0f32; rows.rows];
    f(f32_data(storage)?, &rows, &mut o).map_err(op_err)?;
    let (b, t, _) = layout.shape().dims3()?;
    Ok((CpuStorage::F32(o), Shape::from((b, t))))
}

impl CustomOp1 for TokenLogps {
    fn name(&self) -> &'static str {
        "fused-token-logps"
    }
    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        per_position(storage, layout, |x, rows, o| {
            let mut lse = vec![0f32; rows.rows];
            k::token_logps(x, rows, &self.labels, o, &mut lse)?;
            *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = lse;
            Ok(())
        })
    }
    fn bwd(
        &self,
        logits: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(logits.apply_op2_no_bwd(
            &g.contiguous()?,
            &TokenLogpsGrad(self),
        )?))
    }
}

impl CustomOp2 for TokenLogpsGrad<'_> {
    fn name(&self) -> &'static str {
        "fused-token-logps-grad"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let rows = rows_of(l1)?;
        let g = slice(s2, l2, "token_logps backward")?;
        let lse = self.0.lse.lock().unwrap_or_else(|p| p.into_inner());
        let mut d = vec![0f32; rows.rows * rows.vocab];
        k::token_logps_backward(f32_data(s1)?, &rows, &self.0.labels, &lse, g, &mut d)
            .map_err(op_err)?;
        let (b, t, v) = l1.shape().dims3()?;
        Ok((CpuStorage::F32(d), Shape::from((b, t, v))))
    }
}

struct TokenEntropy;

impl CustomOp1 for TokenEntropy {
    fn name(&self) -> &'static str {
        "fused-token-entropy"
    }
    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        per_position(storage, layout, k::token_entropy)
    }
}

/// The entropy of `softmax(logits)` per position of `logits` `[batch, t, vocab]` (f32 on the
/// CPU, the last dimension contiguous; detached: a logged figure), without the unfused ops'
/// four `[batch, t, vocab]` temporaries; `None` for a layout it does not take.
pub fn token_entropy(logits: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !fusable(logits) || logits.rank() != 3 || rows_of(logits.layout()).is_err() {
        return Ok(None);
    }
    Ok(Some(logits.detach().apply_op1_no_bwd(&TokenEntropy)?))
}

/// `log_softmax(logits)[label]` per position of `logits` `[batch, t, vocab]` (f32 on the CPU;
/// the last dimension contiguous, as the shifted logits are) for `labels` `[batch, t]`; `None`
/// for a layout it does not take (the caller runs the unfused ops).
pub fn token_logps(logits: &Tensor, labels: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !fusable(logits) || logits.rank() != 3 || rows_of(logits.layout()).is_err() {
        return Ok(None);
    }
    let labels = labels
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_vec1::<u32>()?;
    Ok(Some(logits.apply_op1(TokenLogps {
        labels,
        lse: Mutex::new(Vec::new()),
    })?))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect()
    }

    pub(crate) fn var(dims: &[usize], seed: u64, scale: f32) -> Var {
        let n = dims.iter().product();
        Var::from_tensor(&Tensor::from_vec(values(n, seed, scale), dims, &Device::Cpu).unwrap())
            .unwrap()
    }

    pub(crate) fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// `f` (fused) and `g` (the unfused composition) on the same inputs: the outputs, and the
    /// gradients of `Σ out · r` for a random `r`, agree to `tol` relative.
    pub(crate) fn agree(
        inputs: &[Var],
        f: impl Fn(&[Tensor]) -> Tensor,
        g: impl Fn(&[Tensor]) -> Tensor,
        tol: f32,
    ) {
        let xs: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let (a, b) = (f(&xs), g(&xs));
        assert_eq!(a.dims(), b.dims());
        let r = Tensor::from_vec(values(a.elem_count(), 99, 1.0), a.dims(), &Device::Cpu).unwrap();
        let close = |x: &[f32], y: &[f32], what: &str| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            for (i, (p, q)) in x.iter().zip(y).enumerate() {
                assert!(
                    (p - q).abs() <= tol * scale,
                    "{what}[{i}]: fused {p} vs {q}"
                );
            }
        };
        close(&host(&a), &host(&b), "value");
        let (ga, gb) = (
            (a * &r).unwrap().sum_all().unwrap().backward().unwrap(),
            (b * &r).unwrap().sum_all().unwrap().backward().unwrap(),
        );
        for (i, v) in inputs.iter().enumerate() {
            let (x, y) = (ga.get(v).unwrap(), gb.get(v).unwrap());
            close(&host(x), &host(y), &format!("grad {i}"));
        }
    }

    #[test]
    fn swiglu_equals_silu_times_up() {
        let (g, u) = (var(&[3, 5, 64], 1, 5.0), var(&[3, 5, 64], 2, 2.0));
        agree(
            &[g, u],
            |x| swiglu(&x[0], &x[1]).unwrap(),
            |x| (x[0].silu().unwrap() * &x[1]).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn rms_norm_equals_the_decoders_composition() {
        let (x, w) = (var(&[2, 7, 48], 3, 3.0), var(&[48], 4, 1.0));
        agree(
            &[x, w],
            |x| rms_norm(&x[0], &x[1], 1e-5).unwrap(),
            |x| super::super::decoder::rms_norm_unfused(&x[0], &x[1], 1e-5).unwrap(),
            1e-5,
        );
    }

    #[test]
    fn rope_equals_rotate_half() {
        let x = var(&[2, 3, 5, 8], 5, 1.0);
        let cos = Tensor::from_vec(values(40, 6, 1.0), (5, 8), &Device::Cpu).unwrap();
        let sin = Tensor::from_vec(values(40, 7, 1.0), (5, 8), &Device::Cpu).unwrap();
        agree(
            &[x],
            |x| rope(&x[0], &cos, &sin).unwrap(),
            |x| super::super::decoder::rope_unfused(&x[0], &cos, &sin).unwrap(),
            1e-6,
        );
    }

    #[test]
    fn masked_softmax_equals_scale_masks_and_softmax() {
        let (b, h, tq, tk) = (2, 3, 4, 6);
        let s = var(&[b, h, tq, tk], 8, 4.0);
        // A cache of two positions before the four queries, a window of 3, a hidden key.
        let causal: Vec<f32> = (0..tq * tk)
            .map(|i| {
                let (q, j) = (i / tk + 2, i % tk);
                if j > q || q - j >= 3 {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mut keys = vec![0f32; b * tk];
        keys[tk + 4] = f32::MIN;
        let keys = Tensor::from_vec(keys, (b, 1, 1, tk), &Device::Cpu).unwrap();
        let mask = Tensor::from_vec(causal.clone(), (tq, tk), &Device::Cpu).unwrap();
        agree(
            &[s],
            |x| masked_softmax(&x[0], 0.25, causal.clone(), Some(&keys)).unwrap(),
            |x| {
                let v = (&x[0] * 0.25).unwrap().broadcast_add(&mask).unwrap();
                let v = v.broadcast_add(&keys).unwrap();
                super::super::decoder::softmax(&v).unwrap()
            },
            1e-6,
        );
    }

    #[test]
    fn token_logps_equals_log_softmax_and_gather_on_shifted_logits() {
        let logits = var(&[2, 5, 11], 9, 6.0);
        let labels =
            Tensor::from_vec(vec![1u32, 0, 10, 4, 4, 7, 3, 9], (2, 4), &Device::Cpu).unwrap();
        agree(
            &[logits],
            |x| {
                let shifted = x[0].narrow(1, 0, 4).unwrap();
                token_logps(&shifted, &labels)
                    .unwrap()
                    .expect("a fusable layout")
            },
            |x| {
                let shifted = x[0].narrow(1, 0, 4).unwrap();
                crate::train::candle::ops::token_logps_unfused(&shifted, &labels).unwrap()
            },
            1e-6,
        );
        // A layout it does not take is left to the unfused ops.
        let t = Tensor::zeros((11, 2, 5), DType::F32, &Device::Cpu)
            .unwrap()
            .transpose(0, 2)
            .unwrap();
        let l = Tensor::zeros((5, 2), DType::U32, &Device::Cpu).unwrap();
        assert!(token_logps(&t, &l).unwrap().is_none());
    }

    #[test]
    fn token_entropy_equals_the_unfused_ops_on_shifted_logits() {
        let logits = var(&[2, 5, 11], 10, 6.0);
        let shifted = logits.as_tensor().narrow(1, 0, 4).unwrap();
        let fused = token_entropy(&shifted).unwrap().expect("a fusable layout");
        let unfused = crate::train::candle::ops::token_entropy_unfused(&shifted).unwrap();
        assert_eq!(fused.dims(), &[2, 4]);
        let (a, b): (Vec<f32>, Vec<f32>) = (
            fused.flatten_all().unwrap().to_vec1().unwrap(),
            unfused.flatten_all().unwrap().to_vec1().unwrap(),
        );
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{i}: {x} vs {y}");
        }
        assert!(!fused.track_op(), "a logged figure: no gradient");
        let t = Tensor::zeros((11, 2, 5), DType::F32, &Device::Cpu)
            .unwrap()
            .transpose(0, 2)
            .unwrap();
        assert!(token_entropy(&t).unwrap().is_none());
    }
}
