//! The decoder's fused CPU ops (`kiln_kernels::ops::fused`) as candle ops with their backward
//! passes: SwiGLU, RMSNorm, RoPE, attention (streamed; its masked softmax alone too) and the
//! per-token log-softmax.
//! Each keeps for its backward only what the formula needs (its inputs, or its output) where
//! the unfused composition keeps every intermediate, and runs one threaded pass where that runs
//! several. They run on the CPU in f32 ([`fusable`]); elsewhere the decoder runs the unfused
//! ops. Tested against the unfused composition, values and gradients (this file's tests) and by
//! TRL parity unchanged (`tests/it/train.rs`).

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
use kiln_kernels::cpu::autocast;
use kiln_kernels::cpu::gemm::{self, Mat};
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
pub(crate) fn slice<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        return Err(op_err(format!("{op}: f32 only")));
    };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => Err(op_err(format!("{op}: a contiguous input only"))),
    }
}

/// Runs `f` on the f32 values of the contiguous CPU tensor `t`, in place (an in-place op:
/// candle holds `t`'s storage locked for writing meanwhile, so nothing else reads it half
/// written). Every tensor sharing `t`'s storage sees the new values.
pub(crate) fn with_cpu_values_mut(
    t: &Tensor,
    op: &'static str,
    f: impl FnOnce(&mut [f32]) -> candle_core::Result<()>,
) -> candle_core::Result<()> {
    struct InPlace<F> {
        op: &'static str,
        f: Mutex<Option<F>>,
    }
    impl<F: FnOnce(&mut [f32]) -> candle_core::Result<()>> candle_core::InplaceOp1 for InPlace<F> {
        fn name(&self) -> &'static str {
            self.op
        }
        fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
            let CpuStorage::F32(data) = storage else {
                return Err(op_err(format!("{}: f32 only", self.op)));
            };
            let Some((a, b)) = layout.contiguous_offsets() else {
                return Err(op_err(format!("{}: a contiguous tensor only", self.op)));
            };
            let f = self.f.lock().unwrap_or_else(|e| e.into_inner()).take();
            let f = f.ok_or_else(|| op_err(format!("{}: run twice", self.op)))?;
            f(&mut data[a..b])
        }
    }
    t.inplace_op1(&InPlace {
        op,
        f: Mutex::new(Some(f)),
    })
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

// ---- Attention, streamed -------------------------------------------------------------------

struct Attention {
    scale: f32,
    causal: Vec<f32>,
    keys: Option<Vec<f32>>,
    /// Rounding as PyTorch's eager attention on bf16 tensors (forward only).
    bf16: bool,
    /// Each query row's log-sum-exp, from the forward, for the backward.
    lse: Mutex<Vec<f32>>,
}

impl Attention {
    fn heads<'a>(&'a self, q: &Layout, k: &Layout) -> candle_core::Result<k::Heads<'a>> {
        let (batch, heads, tq, dim) = q.shape().dims4()?;
        let (kb, kv_heads, tk, kd) = k.shape().dims4()?;
        if kb != batch || kd != dim {
            return Err(op_err(format!(
                "attention: queries {:?} against keys {:?}",
                q.shape(),
                k.shape()
            )));
        }
        Ok(k::Heads {
            batch,
            heads,
            kv_heads,
            tq,
            tk,
            dim,
            scale: self.scale,
            causal: &self.causal,
            keys: self.keys.as_deref(),
            bf16: self.bf16,
        })
    }
}

/// The f32 values of `t`, a contiguous CPU tensor, while `g` holds its storage.
pub(crate) fn cpu_values<'a>(
    g: &'a candle_core::StorageRef<'_>,
    layout: &Layout,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    match &**g {
        candle_core::Storage::Cpu(c) => slice(c, layout, op),
        _ => Err(op_err(format!("{op}: CPU tensors only"))),
    }
}

impl CustomOp3 for Attention {
    fn name(&self) -> &'static str {
        "fused-attention"
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
        let op = "attention";
        let (q, k, v) = (slice(s1, l1, op)?, slice(s2, l2, op)?, slice(s3, l3, op)?);
        if l2.shape() != l3.shape() {
            return Err(op_err(format!(
                "attention: keys {:?} against values {:?}",
                l2.shape(),
                l3.shape()
            )));
        }
        let heads = self.heads(l1, l2)?;
        let mut o = vec![0f32; q.len()];
        let mut lse = vec![0f32; heads.batch * heads.heads * heads.tq];
        k::attention(q, k, v, &heads, &mut o, &mut lse).map_err(op_err)?;
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = lse;
        Ok(out(o, l1.shape()))
    }
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        d_o: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = "attention backward";
        let d_o = d_o.contiguous()?;
        let (gq, lq) = q.storage_and_layout();
        let (gk, lk) = k.storage_and_layout();
        let (gv, lv) = v.storage_and_layout();
        let (go, lo) = o.storage_and_layout();
        let (gd, ld) = d_o.storage_and_layout();
        let heads = self.heads(lq, lk)?;
        let (qs, ks, vs) = (
            cpu_values(&gq, lq, op)?,
            cpu_values(&gk, lk, op)?,
            cpu_values(&gv, lv, op)?,
        );
        let (mut dq, mut dk, mut dv) = (
            vec![0f32; qs.len()],
            vec![0f32; ks.len()],
            vec![0f32; vs.len()],
        );
        let lse = self.lse.lock().unwrap_or_else(|p| p.into_inner());
        k::attention_backward(
            qs,
            ks,
            vs,
            cpu_values(&go, lo, op)?,
            &lse,
            cpu_values(&gd, ld, op)?,
            &heads,
            &mut dq,
            &mut dk,
            &mut dv,
        )
        .map_err(op_err)?;
        let dev = q.device();
        Ok((
            Some(Tensor::from_vec(dq, q.shape(), dev)?),
            Some(Tensor::from_vec(dk, k.shape(), dev)?),
            Some(Tensor::from_vec(dv, v.shape(), dev)?),
        ))
    }
}

/// `softmax(scale · q·kᵀ + causal + keys) · v` `[batch, heads, tq, head_dim]` for queries
/// `q` `[batch, heads, tq, head_dim]` and keys and values `[batch, kv_heads, tk, head_dim]`
/// (f32 on the CPU; grouped heads read their shared keys in place): `causal` `[tq, tk]` host
/// values (0 or −∞), `keys` the key mask `[batch, 1, 1, tk]`. Streamed four query rows at a time
/// (`kiln_kernels::ops::fused::attention`): neither the scores nor the probabilities
/// `[batch, heads, tq, tk]` are ever held, and the backward pass keeps only each row's
/// log-sum-exp beside the inputs and output.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: Vec<f32>,
    keys: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    q.contiguous()?.apply_op3(
        &k.contiguous()?,
        &v.contiguous()?,
        Attention::new(scale, causal, keys, false)?,
    )
}

impl Attention {
    /// The op, its key mask read to the host.
    fn new(
        scale: f64,
        causal: Vec<f32>,
        keys: Option<&Tensor>,
        bf16: bool,
    ) -> candle_core::Result<Attention> {
        let keys = match keys {
            Some(m) => Some(m.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Attention {
            scale: scale as f32,
            causal,
            keys,
            bf16,
            lse: Mutex::new(Vec::new()),
        })
    }
}

/// [`attention`] of bf16 `q`, `k`, `v` outside autograd, rounded where transformers' eager
/// attention on bf16 tensors rounds (`q·kᵀ`, `· scale`, each mask added, the f32 softmax's
/// probabilities, the output: each to bf16), streamed as [`attention`] is: what the decoder's
/// unfused bf16 composition computes without its `[batch, heads, tq, tk]` tensors. The sums
/// run in another order than candle's bf16 matmul, so a rounded value now and then lands an
/// ulp apart. A bf16 result.
pub(crate) fn attention_bf16_eager(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: Vec<f32>,
    keys: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    f32(q)?
        .apply_op3_no_bwd(
            &f32(k)?,
            &f32(v)?,
            &Attention::new(scale, causal, keys, true)?,
        )?
        .to_dtype(DType::BF16)
}

// ---- The output layer with the per-token log-softmax, a chunk of rows at a time ---------

/// Per position, what a loss's logged figures read from the logits (no gradient): the
/// entropy of the distribution, the arg-max and the sum of the logits.
#[derive(Debug, Clone, Default)]
pub struct HeadStats {
    /// The vocabulary's size.
    pub vocab: usize,
    /// `H(softmax(logits))` per position.
    pub entropy: Vec<f32>,
    /// The arg-max per position (the first on a tie).
    pub argmax: Vec<u32>,
    /// `Σ logits` per position.
    pub sum: Vec<f32>,
}

/// The output layer's weight `[vocab, hidden]` for [`head_logps`].
pub enum HeadWeight<'a> {
    /// A dense f32 weight (trained under full fine-tuning, or the tied embeddings): its
    /// gradient flows back to it.
    Dense(&'a Tensor),
    /// A frozen weight kept packed (LoRA's bf16 base, QLoRA's quantized one): no gradient.
    Packed(&'a super::packed::Packed),
    /// A dense f32 weight under bf16 autocast (TRL's `bf16=True`): the logits
    /// `bf16(bf16(h) · bf16(W)ᵀ)`, their gradient rounded to bf16 before `dh` and `dW` (each
    /// one product over every row, rounded once), as [`super::dense_linear::linear_autocast`]
    /// runs a Linear; the log-softmax in f32 on the bf16 logits, as transformers' loss
    /// upcasts them. [`head_logps`] only.
    DenseBf16(&'a Tensor),
}

/// Rows of logits computed at a time: about 8 MiB of f32.
fn head_chunk(vocab: usize) -> usize {
    ((2 << 20) / vocab.max(1)).max(1)
}

/// The rows `start..start + n` of a chunk's contiguous `[n, vocab]` logits.
fn chunk_rows(n: usize, vocab: usize) -> k::Rows {
    k::Rows {
        rows: n,
        vocab,
        per_group: n.max(1),
        group_stride: n * vocab,
        start: 0,
    }
}

/// What the head's backward pass needs: the weight as rows, the labels and each row's
/// log-sum-exp; and the forward's log-probabilities, which the op hands out.
struct Head {
    w: super::packed::Packed,
    /// Under autocast ([`HeadWeight::DenseBf16`]): the weight's bf16 bits `[vocab, hidden]`
    /// (empty where the packed GEMM runs the products from the f32 weight).
    bf16: Option<Vec<u16>>,
    labels: Vec<u32>,
    lse: Vec<f32>,
    logps: Vec<f32>,
    hidden: usize,
    /// Rows per chunk.
    step: usize,
    /// The factor on the logits before the softmax (a sampling temperature's `1 / T`).
    scale: f32,
}

impl Head {
    /// The forward pass over `h` `[rows, hidden]`: per chunk of rows the logits `h · Wᵀ`,
    /// then each row's log-probability of its label, log-sum-exp and figures.
    fn forward(
        h: &[f32],
        (w, bf16): (super::packed::Packed, Option<Vec<u16>>),
        labels: Vec<u32>,
        step: usize,
        scale: f32,
    ) -> candle_core::Result<(Head, HeadStats)> {
        let (vocab, hidden) = (w.rows(), w.cols());
        let rows = labels.len();
        let mut head = Head {
            w,
            bf16,
            labels,
            lse: vec![0f32; rows],
            logps: vec![0f32; rows],
            hidden,
            step,
            scale,
        };
        let mut stats = HeadStats {
            vocab,
            entropy: vec![0f32; rows],
            argmax: vec![0u32; rows],
            sum: vec![0f32; rows],
        };
        let mut logits = vec![0f32; step.min(rows) * vocab];
        for start in (0..rows).step_by(step) {
            let n = step.min(rows - start);
            let (r, x) = (start..start + n, &mut logits[..n * vocab]);
            head.logits(&h[start * hidden..(start + n) * hidden], n, x)?;
            let cr = chunk_rows(n, vocab);
            k::token_logps(
                x,
                &cr,
                &head.labels[r.clone()],
                &mut head.logps[r.clone()],
                &mut head.lse[r.clone()],
            )
            .map_err(op_err)?;
            k::token_entropy(x, &cr, &mut stats.entropy[r.clone()]).map_err(op_err)?;
            k::argmax_and_sum(x, &cr, &mut stats.argmax[r.clone()], &mut stats.sum[r])
                .map_err(op_err)?;
        }
        Ok((head, stats))
    }
}

/// A chunk's share of a fused head's gradients from its logits' gradient `dz` `[n, vocab]`:
/// `dh = dz · W` into `dh` (the chunk's `n` rows) and, with `dw`, `dW += dzᵀ · h` (`h` the
/// chunk's rows `[n, hidden]`) into `dw` `[vocab, hidden]` (empty until the first chunk): on
/// AVX-512 the packed GEMM continues each output's chain in place, elsewhere each chunk's
/// product is added.
fn chunk_grads(
    dz: &[f32],
    w: &dyn kiln_kernels::ops::packed_matmul::PackedRows,
    h: &[f32],
    dh: &mut [f32],
    dw: Option<&mut Vec<f32>>,
) -> candle_core::Result<()> {
    let (vocab, hidden) = (w.rows(), w.cols());
    let n = h.len() / hidden.max(1);
    kiln_kernels::ops::packed_matmul::matmul_w(dz, n, w, dh).map_err(op_err)?;
    if let Some(dw) = dw {
        let first = dw.is_empty();
        if first {
            dw.resize(vocab * hidden, 0.0);
        }
        if gemm::available() {
            let (a, b) = (
                Mat::row_major(dz, n, vocab).t(),
                Mat::row_major(h, n, hidden),
            );
            gemm::matmul_into(a, b, dw, hidden, !first).map_err(op_err)?;
        } else if first {
            kiln_kernels::ops::packed_matmul::dense::weight_grad(h, dz, (n, vocab, hidden), dw)
                .map_err(op_err)?;
        } else {
            let mut part = vec![0f32; vocab * hidden];
            kiln_kernels::ops::packed_matmul::dense::weight_grad(
                h,
                dz,
                (n, vocab, hidden),
                &mut part,
            )
            .map_err(op_err)?;
            for (d, p) in dw.iter_mut().zip(&part) {
                *d += p;
            }
        }
    }
    Ok(())
}

/// The weight's gradient a chunked backward collected (`None` when it computed none).
fn weight_grad_tensor(
    dw: Vec<f32>,
    weight_grad: bool,
    (vocab, hidden): (usize, usize),
    device: &candle_core::Device,
) -> candle_core::Result<Option<Tensor>> {
    if !weight_grad {
        return Ok(None);
    }
    let dw = if dw.is_empty() {
        vec![0f32; vocab * hidden]
    } else {
        dw
    };
    Ok(Some(Tensor::from_vec(dw, (vocab, hidden), device)?))
}

impl Head {
    /// The logits `scale · h · Wᵀ` `[n, vocab]` of the `n` rows `h` into `x` (the forward's,
    /// and the backward's again).
    fn logits(&self, h: &[f32], n: usize, x: &mut [f32]) -> candle_core::Result<()> {
        match &self.bf16 {
            Some(w) => {
                let (vocab, hidden) = (self.w.rows(), self.hidden);
                let hm = Mat::row_major(h, n, hidden);
                match self.packed_bf16(|wf| {
                    gemm::matmul_bf16_rounded(hm, Mat::row_major(wf, vocab, hidden).t(), x)
                }) {
                    Some(r) => r,
                    None => autocast::product_bits(&autocast::bits(h), w, (n, vocab, hidden), x),
                }
            }
            None => kiln_kernels::ops::packed_matmul::matmul_wt(h, n, self.w.as_ref(), x),
        }
        .map_err(op_err)?;
        scale_by(x, self.scale);
        Ok(())
    }
}

/// `x · scale`, element-wise (nothing for 1).
fn scale_by(x: &mut [f32], scale: f32) {
    if scale != 1.0 {
        x.iter_mut().for_each(|v| *v *= scale);
    }
}

/// An output layer fused with its loss's per-row figure ([`Head`], [`Jsd`]): its forward ran
/// before the op was built (it needed the chunks' logits, which nothing keeps), so the op hands
/// the values out and owns the backward pass.
trait FusedHead: Send + Sync {
    const NAME: &'static str;
    /// The forward's values, one per row.
    fn values(&self) -> &[f32];
    /// `dh` and, with `weight_grad`, `dW` from the values' gradient `g`.
    fn backward(
        &self,
        h: &Tensor,
        g: &Tensor,
        weight_grad: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)>;
}

impl FusedHead for Head {
    const NAME: &'static str = "fused-head-logps";
    fn values(&self) -> &[f32] {
        &self.logps
    }
    /// The backward pass from the log-probabilities' gradient `g`: `dh` `[rows, hidden]`
    /// and, for a dense weight `Some`, `dW` `[vocab, hidden]` — per chunk of rows the logits
    /// again, `dlogits = g · (onehot − softmax)`, `dh = dlogits · W`, `dW += dlogitsᵀ · h`.
    fn backward(
        &self,
        h: &Tensor,
        g: &Tensor,
        weight_grad: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let (vocab, hidden, rows) = (self.w.rows(), self.hidden, self.labels.len());
        let h = h.detach().contiguous()?;
        let g: Vec<f32> = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let (guard, layout) = h.storage_and_layout();
        let hv = cpu_values(&guard, layout, "head_logps backward")?;
        if self.bf16.is_some() {
            return self.backward_bf16(hv, &g, weight_grad, h.device());
        }
        let mut dh = vec![0f32; rows * hidden];
        let mut dw: Vec<f32> = Vec::new();
        let step = self.step;
        let mut x = vec![0f32; step.min(rows) * vocab];
        for start in (0..rows).step_by(step) {
            let n = step.min(rows - start);
            let hc = &hv[start * hidden..(start + n) * hidden];
            let mut d = vec![0f32; n * vocab];
            self.chunk_dz(hc, (start, n), &g, (&mut x[..n * vocab], &mut d))?;
            let dh = &mut dh[start * hidden..(start + n) * hidden];
            let w = weight_grad.then_some(&mut dw);
            chunk_grads(&d, self.w.as_ref(), hc, dh, w)?;
        }
        let dw = weight_grad_tensor(dw, weight_grad, (vocab, hidden), h.device())?;
        Ok((Tensor::from_vec(dh, (rows, hidden), h.device())?, dw))
    }
}

impl Head {
    /// [`FusedHead::backward`] under autocast: per chunk of rows the logits again, their
    /// gradient rounded to bf16 (kept for every row: `[rows, vocab]` bf16, half of f32's
    /// logits), `dh = bf16(dz · W)`; then `dW = bf16(dzᵀ · h)` as one product over all rows,
    /// rounded once, as autocast's single GEMM rounds it.
    /// The logits' gradient of rows `start..start + n` (`hc` their inputs) into `d`: the
    /// logits again into `x`, the log-softmax's backward at the labels from the rows' output
    /// gradients `g`, times the logits' scale.
    fn chunk_dz(
        &self,
        hc: &[f32],
        (start, n): (usize, usize),
        g: &[f32],
        (x, d): (&mut [f32], &mut [f32]),
    ) -> candle_core::Result<()> {
        let r = start..start + n;
        self.logits(hc, n, x)?;
        k::token_logps_backward(
            x,
            &chunk_rows(n, self.w.rows()),
            &self.labels[r.clone()],
            &self.lse[r.clone()],
            &g[r],
            d,
        )
        .map_err(op_err)?;
        scale_by(d, self.scale);
        Ok(())
    }

    /// `f` on the weight's f32 values where autocast's products run on the packed GEMM (AVX-512
    /// BF16, and a dense weight: the head's under full fine-tuning); `None` elsewhere.
    fn packed_bf16(
        &self,
        mut f: impl FnMut(&[f32]) -> Result<(), kiln_kernels::KernelError>,
    ) -> Option<Result<(), kiln_kernels::KernelError>> {
        if !gemm::bf16_available() {
            return None;
        }
        let mut r = None;
        self.w.with_dense(&mut |wf| r = Some(f(wf)));
        r
    }

    fn backward_bf16(
        &self,
        hv: &[f32],
        g: &[f32],
        weight_grad: bool,
        device: &candle_core::Device,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let (vocab, hidden, rows) = (self.w.rows(), self.hidden, self.labels.len());
        if gemm::bf16_available() && self.w.with_dense(&mut |_| {}) {
            return self.backward_bf16_packed(hv, g, weight_grad, device);
        }
        let w = self
            .bf16
            .as_deref()
            .expect("autocast's head keeps its weight's bits");
        // dh = dz · W = dz [n, vocab] · (Wᵀ [hidden, vocab])ᵀ.
        let wt = autocast::transpose_bits(w, vocab, hidden);
        let mut dz = vec![0u16; rows * vocab];
        let mut dh = vec![0f32; rows * hidden];
        let step = self.step;
        let mut x = vec![0f32; step.min(rows) * vocab];
        let mut d = vec![0f32; step.min(rows) * vocab];
        for start in (0..rows).step_by(step) {
            let n = step.min(rows - start);
            let (x, d) = (&mut x[..n * vocab], &mut d[..n * vocab]);
            let hc = &hv[start * hidden..(start + n) * hidden];
            self.chunk_dz(hc, (start, n), g, (x, d))?;
            let dzc = &mut dz[start * vocab..(start + n) * vocab];
            for (b, v) in dzc.iter_mut().zip(d.iter()) {
                *b = half::bf16::from_f32(*v).to_bits();
            }
            autocast::product_bits(
                dzc,
                &wt,
                (n, hidden, vocab),
                &mut dh[start * hidden..(start + n) * hidden],
            )
            .map_err(op_err)?;
        }
        drop(wt);
        let dw = match weight_grad {
            true => {
                // dW = dzᵀ · h = (dzᵀ [vocab, rows]) · (hᵀ [hidden, rows])ᵀ.
                let dzt = autocast::transpose_bits(&dz, rows, vocab);
                drop(dz);
                let ht = autocast::bits_t(hv, rows, hidden);
                let mut dw = vec![0f32; vocab * hidden];
                autocast::product_bits(&dzt, &ht, (vocab, hidden, rows), &mut dw)
                    .map_err(op_err)?;
                Some(Tensor::from_vec(dw, (vocab, hidden), device)?)
            }
            false => None,
        };
        Ok((Tensor::from_vec(dh, (rows, hidden), device)?, dw))
    }

    /// [`Head::backward_bf16`] on the packed GEMM, which rounds each operand as it packs it:
    /// per chunk, `dh = bf16(dz · W)` from the chunk's f32 gradient and `dW`'s chain carried
    /// on over the chunk's rows (`gemm::matmul_bf16_into`), rounded once after the last — one
    /// product over every row, as autocast's, without keeping `dz` for every row or
    /// transposing anything.
    fn backward_bf16_packed(
        &self,
        hv: &[f32],
        g: &[f32],
        weight_grad: bool,
        device: &candle_core::Device,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let (vocab, hidden, rows) = (self.w.rows(), self.hidden, self.labels.len());
        let mut dh = vec![0f32; rows * hidden];
        let mut dw = if weight_grad {
            vec![0f32; vocab * hidden]
        } else {
            Vec::new()
        };
        let step = self.step;
        let mut x = vec![0f32; step.min(rows) * vocab];
        let mut d = vec![0f32; step.min(rows) * vocab];
        for start in (0..rows).step_by(step) {
            let n = step.min(rows - start);
            let (x, d) = (&mut x[..n * vocab], &mut d[..n * vocab]);
            let hc = &hv[start * hidden..(start + n) * hidden];
            self.chunk_dz(hc, (start, n), g, (x, d))?;
            let dz = Mat::row_major(d, n, vocab);
            let dhc = &mut dh[start * hidden..(start + n) * hidden];
            let last = start + n == rows;
            self.packed_bf16(|wf| {
                gemm::matmul_bf16_rounded(dz, Mat::row_major(wf, vocab, hidden), dhc)?;
                if weight_grad {
                    let h = Mat::row_major(hc, n, hidden);
                    gemm::matmul_bf16_into(dz.t(), h, (&mut dw, hidden), start > 0, last)?;
                }
                Ok(())
            })
            .ok_or_else(|| op_err("the bf16 head's packed path lost its dense weight"))?
            .map_err(op_err)?;
        }
        let dw = weight_grad_tensor(dw, weight_grad, (vocab, hidden), device)?;
        Ok((Tensor::from_vec(dh, (rows, hidden), device)?, dw))
    }
}

/// A fused head over a frozen (packed) weight: the gradient of its input only.
struct Frozen<H>(H);

/// A fused head over a dense weight: the gradients of its input and of the weight.
struct Dense<H>(H);

impl<H: FusedHead> CustomOp1 for Frozen<H> {
    fn name(&self) -> &'static str {
        H::NAME
    }
    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = self.0.values();
        Ok(out(v.to_vec(), &Shape::from(v.len())))
    }
    fn bwd(&self, h: &Tensor, _res: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(self.0.backward(h, g, false)?.0))
    }
}

impl<H: FusedHead> CustomOp2 for Dense<H> {
    fn name(&self) -> &'static str {
        H::NAME
    }
    fn cpu_fwd(
        &self,
        _s1: &CpuStorage,
        _l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let v = self.0.values();
        Ok(out(v.to_vec(), &Shape::from(v.len())))
    }
    fn bwd(
        &self,
        h: &Tensor,
        _w: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (dh, dw) = self.0.backward(h, g, true)?;
        Ok((Some(dh), dw))
    }
}

/// `log_softmax(scale · h · Wᵀ)[label]` per position of `h` `[batch, t, hidden]` (f32 on the CPU;
/// `scale` a sampling temperature's `1 / T`, else 1)
/// for `labels` `[batch · t]` (any id where a position has none: its value is unused and its
/// gradient zero), and per position the figures of [`HeadStats`] — without ever holding the
/// `[batch, t, vocab]` logits: they are computed a chunk of rows at a time (about 8 MiB), in
/// the forward pass and again in the backward pass, which keeps only each row's log-sum-exp
/// (Liger-kernel style). The gradient reaches `h` and a dense `weight`.
pub fn head_logps(
    h: &Tensor,
    weight: HeadWeight<'_>,
    labels: Vec<u32>,
    scale: f32,
) -> candle_core::Result<(Tensor, HeadStats)> {
    head_logps_in(h, weight, labels, None, scale)
}

/// [`head_logps`] with `step` rows a chunk (by default about 8 MiB of logits).
fn head_logps_in(
    h: &Tensor,
    weight: HeadWeight<'_>,
    labels: Vec<u32>,
    step: Option<usize>,
    scale: f32,
) -> candle_core::Result<(Tensor, HeadStats)> {
    let (b, t, hidden) = h.dims3()?;
    if labels.len() != b * t {
        return Err(op_err(format!(
            "head_logps: {} labels for {b} × {t} positions",
            labels.len()
        )));
    }
    let flat = h.reshape((b * t, hidden))?.contiguous()?;
    let rows: super::packed::Packed = match weight {
        HeadWeight::Dense(w) | HeadWeight::DenseBf16(w) => std::sync::Arc::new(
            super::packed::FrozenRows::of(&w.detach())
                .ok_or_else(|| op_err("head_logps: the weight must be f32 and contiguous"))?,
        ),
        HeadWeight::Packed(p) => p.clone(),
    };
    let bf16 = match weight {
        // The packed GEMM rounds the f32 weight as it packs it: no bits kept.
        HeadWeight::DenseBf16(_) if gemm::bf16_available() => Some(Vec::new()),
        HeadWeight::DenseBf16(w) => {
            let w = w.detach().contiguous()?;
            let (g, l) = w.storage_and_layout();
            Some(autocast::bits(cpu_values(&g, l, "head_logps")?))
        }
        _ => None,
    };
    if rows.cols() != hidden {
        return Err(op_err(format!(
            "head_logps: a head of {} inputs given rows of {hidden}",
            rows.cols()
        )));
    }
    let (head, stats) = {
        let (g, l) = flat.storage_and_layout();
        let step = step.unwrap_or_else(|| head_chunk(rows.rows())).max(1);
        Head::forward(
            cpu_values(&g, l, "head_logps")?,
            (rows, bf16),
            labels,
            step,
            scale,
        )?
    };
    let logps = match weight {
        HeadWeight::Dense(w) | HeadWeight::DenseBf16(w) => flat.apply_op2(w, Dense(head))?,
        HeadWeight::Packed(_) => flat.apply_op1(Frozen(head))?,
    };
    Ok((logps.reshape((b, t))?, stats))
}

// ---- The output layer with GKD's generalized JSD, a chunk of rows at a time -------------

/// A frozen model's output layer at some positions, for [`head_jsd`]: the rows entering its
/// head (after the final norm) `[rows, hidden]`, row-major, and the head's weight.
pub struct HeadRows {
    /// The rows, `rows × w.cols()` values.
    pub h: Vec<f32>,
    /// The head's weight `[vocab, hidden]`.
    pub w: super::packed::Packed,
}

impl HeadRows {
    /// The number of rows.
    pub fn rows(&self) -> usize {
        self.h.len() / self.w.cols().max(1)
    }
    /// The head's vocabulary.
    pub fn vocab(&self) -> usize {
        self.w.rows()
    }
}

/// `log Σ exp(z)` of a row, in f64.
fn lse_f64(z: &[f32]) -> f64 {
    let max = z.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let m = f64::from(max);
    m + z
        .iter()
        .map(|&v| (f64::from(v) - m).exp())
        .sum::<f64>()
        .ln()
}

/// GKD's generalized JSD between the distributions of one row's student logits `zs` and
/// teacher logits `zt` (TRL's `generalized_jsd_loss` before its mask and mean: β = 0 the
/// forward KL of the student from the teacher, β = 1 the reverse one, else the β-mixture's two
/// KLs weighted); with `grad`, also `∂/∂zs`, written over `zs` (and `zt` overwritten with the
/// term's derivatives on the way). Element-wise in f32 as PyTorch's composition is, the sums
/// over the vocabulary in f64.
fn jsd_row(zs: &mut [f32], zt: &mut [f32], beta: f64, grad: Option<f32>) -> f32 {
    let (ls, lt) = (lse_f64(zs) as f32, lse_f64(zt) as f32);
    let (la, lb) = ((1.0 - beta).ln() as f32, beta.ln() as f32);
    let bf = beta as f32;
    let want = grad.is_some();
    // Per vocabulary entry: the loss's term and (`want`) its derivative in the student's
    // log-prob.
    let term = |s: f32, t: f32| -> (f32, f32) {
        let (ps, pt) = (s.exp(), t.exp());
        if beta == 0.0 {
            (pt * (t - s), -pt)
        } else if beta == 1.0 {
            (ps * (s - t), ps * (s - t + 1.0))
        } else {
            // The mixture's log as torch.logsumexp computes it (shifted by the larger).
            let (a, b) = (s + la, t + lb);
            let mx = a.max(b);
            let m = mx + ((a - mx).exp() + (b - mx).exp()).ln();
            let value = bf * pt * (t - m) + (1.0 - bf) * ps * (s - m);
            if !want {
                return (value, 0.0);
            }
            let r = (a - m).exp();
            let d = -bf * pt * r + (1.0 - bf) * (ps * (s - m) + ps * (1.0 - r));
            (value, d)
        }
    };
    let (mut value, mut dsum) = (0f64, 0f64);
    for (&z, y) in zs.iter().zip(zt.iter_mut()) {
        let (v, d) = term(z - ls, *y - lt);
        value += f64::from(v);
        dsum += f64::from(d);
        // The teacher's logit is not needed again: keep the derivative in its place.
        *y = d;
    }
    if let Some(g) = grad {
        // ∂/∂z_j = G_j − p_j Σ_v G_v (the log-softmax's Jacobian), times the row's gradient.
        let dsum = dsum as f32;
        for (z, &d) in zs.iter_mut().zip(zt.iter()) {
            *z = g * (d - (*z - ls).exp() * dsum);
        }
    }
    value as f32
}

/// What the JSD head's backward pass needs: the student's weight, the teacher's rows and the
/// forward's values, which the op hands out.
struct Jsd {
    w: super::packed::Packed,
    teacher: HeadRows,
    beta: f64,
    rows: usize,
    hidden: usize,
    step: usize,
    values: Vec<f32>,
}

impl Jsd {
    /// The student's and the teacher's logits of the rows `start..start + n` into `zs`, `zt`.
    fn logits(
        &self,
        h: &[f32],
        start: usize,
        n: usize,
        zs: &mut [f32],
        zt: &mut [f32],
    ) -> candle_core::Result<()> {
        let (hs, ht) = (self.hidden, self.teacher.w.cols());
        kiln_kernels::ops::packed_matmul::matmul_wt(
            &h[start * hs..(start + n) * hs],
            n,
            self.w.as_ref(),
            zs,
        )
        .map_err(op_err)?;
        kiln_kernels::ops::packed_matmul::matmul_wt(
            &self.teacher.h[start * ht..(start + n) * ht],
            n,
            self.teacher.w.as_ref(),
            zt,
        )
        .map_err(op_err)
    }

    /// Each row's JSD, a chunk of rows at a time.
    fn forward(&mut self, h: &[f32]) -> candle_core::Result<()> {
        use rayon::prelude::*;
        let vocab = self.w.rows();
        let step = self.step.min(self.rows).max(1);
        let (mut zs, mut zt) = (vec![0f32; step * vocab], vec![0f32; step * vocab]);
        let mut values = vec![0f32; self.rows];
        for start in (0..self.rows).step_by(step) {
            let n = step.min(self.rows - start);
            let (zs, zt) = (&mut zs[..n * vocab], &mut zt[..n * vocab]);
            self.logits(h, start, n, zs, zt)?;
            values[start..start + n]
                .par_iter_mut()
                .zip(zs.par_chunks_mut(vocab).zip(zt.par_chunks_mut(vocab)))
                .for_each(|(o, (zs, zt))| *o = jsd_row(zs, zt, self.beta, None));
        }
        self.values = values;
        Ok(())
    }
}

impl FusedHead for Jsd {
    const NAME: &'static str = "fused-head-jsd";
    fn values(&self) -> &[f32] {
        &self.values
    }
    /// From the values' gradient `g`: `dh` `[rows, hidden]` and, for a dense weight, `dW` —
    /// per chunk the logits again, their gradient, `dh = dz · W`, `dW += dzᵀ · h`.
    fn backward(
        &self,
        h: &Tensor,
        g: &Tensor,
        weight_grad: bool,
    ) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        use rayon::prelude::*;
        let (vocab, hidden, rows) = (self.w.rows(), self.hidden, self.rows);
        let h = h.detach().contiguous()?;
        let g: Vec<f32> = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let (guard, layout) = h.storage_and_layout();
        let hv = cpu_values(&guard, layout, "head_jsd backward")?;
        let mut dh = vec![0f32; rows * hidden];
        let mut dw: Vec<f32> = Vec::new();
        let step = self.step.min(rows).max(1);
        let (mut zs, mut zt) = (vec![0f32; step * vocab], vec![0f32; step * vocab]);
        for start in (0..rows).step_by(step) {
            let n = step.min(rows - start);
            let (zs, zt) = (&mut zs[..n * vocab], &mut zt[..n * vocab]);
            self.logits(hv, start, n, zs, zt)?;
            zs.par_chunks_mut(vocab)
                .zip(zt.par_chunks_mut(vocab))
                .zip(&g[start..start + n])
                .for_each(|((zs, zt), &g)| {
                    jsd_row(zs, zt, self.beta, Some(g));
                });
            let dh = &mut dh[start * hidden..(start + n) * hidden];
            let w = weight_grad.then_some(&mut dw);
            let hc = &hv[start * hidden..(start + n) * hidden];
            chunk_grads(zs, self.w.as_ref(), hc, dh, w)?;
        }
        let dw = weight_grad_tensor(dw, weight_grad, (vocab, hidden), h.device())?;
        Ok((Tensor::from_vec(dh, (rows, hidden), h.device())?, dw))
    }
}

/// GKD's generalized JSD (TRL's `generalized_jsd_loss` per position, before its mask and
/// mean) between the student's distribution `softmax(h · Wᵀ)` at each position of `h`
/// `[batch, t, hidden]` (f32 on the CPU) and the teacher's, `softmax` of `teacher`'s rows
/// through its head (one row per position, in the same order) — without ever holding either
/// `[batch, t, vocab]` logits: both are computed a chunk of rows at a time (about 8 MiB each),
/// in the forward pass and again in the backward pass (Liger-kernel style, as its fused linear
/// JSD). The gradient reaches `h` and a dense `weight`; the teacher is a constant.
pub fn head_jsd(
    h: &Tensor,
    weight: HeadWeight<'_>,
    teacher: HeadRows,
    beta: f64,
) -> candle_core::Result<Tensor> {
    head_jsd_in(h, weight, teacher, beta, None)
}

/// [`head_jsd`] with `step` rows a chunk (by default about 8 MiB of logits).
fn head_jsd_in(
    h: &Tensor,
    weight: HeadWeight<'_>,
    teacher: HeadRows,
    beta: f64,
    step: Option<usize>,
) -> candle_core::Result<Tensor> {
    let (b, t, hidden) = h.dims3()?;
    let flat = h.reshape((b * t, hidden))?.contiguous()?;
    let w: super::packed::Packed = match weight {
        HeadWeight::Dense(w) => std::sync::Arc::new(
            super::packed::FrozenRows::of(&w.detach())
                .ok_or_else(|| op_err("head_jsd: the weight must be f32 and contiguous"))?,
        ),
        HeadWeight::Packed(p) => p.clone(),
        HeadWeight::DenseBf16(_) => {
            return Err(op_err(
                "head_jsd: a bf16 autocast head is not built (the logits path runs it)",
            ));
        }
    };
    if w.cols() != hidden {
        return Err(op_err(format!(
            "head_jsd: a head of {} inputs given rows of {hidden}",
            w.cols()
        )));
    }
    if teacher.vocab() != w.rows() || teacher.h.len() != b * t * teacher.w.cols() {
        return Err(op_err(format!(
            "head_jsd: the teacher's {} rows of vocabulary {} for {b} × {t} positions of vocabulary {}",
            teacher.rows(),
            teacher.vocab(),
            w.rows()
        )));
    }
    let mut jsd = Jsd {
        step: step.unwrap_or_else(|| head_chunk(w.rows())).max(1),
        w,
        teacher,
        beta,
        rows: b * t,
        hidden,
        values: Vec::new(),
    };
    {
        let (g, l) = flat.storage_and_layout();
        jsd.forward(cpu_values(&g, l, "head_jsd")?)?;
    }
    let values = match weight {
        HeadWeight::Dense(w) | HeadWeight::DenseBf16(w) => flat.apply_op2(w, Dense(jsd))?,
        HeadWeight::Packed(_) => flat.apply_op1(Frozen(jsd))?,
    };
    values.reshape((b, t))
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

    /// `n` deterministic values in `[-scale, scale)` (a 64-bit LCG).
    pub(crate) fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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
    fn attention_equals_grouped_scores_masks_softmax_and_values() {
        // Four query heads on two key/value heads; a cache of two positions before the four
        // queries, a window of 3, a hidden key in the second sequence.
        let (b, h, kvh, tq, tk, hd) = (2, 4, 2, 4, 6, 8);
        let (q, k, v) = (
            var(&[b, h, tq, hd], 8, 2.0),
            var(&[b, kvh, tk, hd], 9, 2.0),
            var(&[b, kvh, tk, hd], 10, 2.0),
        );
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
        let scale = 1.0 / (hd as f64).sqrt();
        agree(
            &[q, k, v],
            |x| attention(&x[0], &x[1], &x[2], scale, causal.clone(), Some(&keys)).unwrap(),
            |x| {
                // transformers' repeat_kv: query head i reads key/value head i / 2.
                let rep = |t: &Tensor| {
                    t.unsqueeze(2)
                        .unwrap()
                        .expand((b, kvh, h / kvh, tk, hd))
                        .unwrap()
                        .reshape((b, h, tk, hd))
                        .unwrap()
                };
                let (k, v) = (rep(&x[1]), rep(&x[2]));
                let s = (x[0].matmul(&k.t().unwrap()).unwrap() * scale).unwrap();
                let s = s
                    .broadcast_add(&mask)
                    .unwrap()
                    .broadcast_add(&keys)
                    .unwrap();
                super::super::decoder::softmax(&s)
                    .unwrap()
                    .matmul(&v)
                    .unwrap()
            },
            1e-5,
        );
    }

    #[test]
    fn head_jsd_equals_the_logits_then_the_losses_generalized_jsd() {
        // 3 × 5 positions, student hidden 6, teacher hidden 4, vocabulary 13, in chunks of 4
        // rows (the last short) and in one; β at both ends and between; values and gradients
        // of `Σ mask · jsd` against `losses::generalized_jsd` over the full logits.
        let (b, t, d, dt, v) = (3, 5, 6, 4, 13);
        let ops = crate::train::candle::ops::CandleOps {
            device: Device::Cpu,
        };
        let mask: Vec<f64> = (0..b * t)
            .map(|i| f64::from(u8::from(i % 4 != 1)))
            .collect();
        let mask_t = Tensor::from_vec(
            mask.iter().map(|&m| m as f32).collect::<Vec<f32>>(),
            (b, t),
            &Device::Cpu,
        )
        .unwrap();
        let th = values(b * t * dt, 31, 2.0);
        let tw = Tensor::from_vec(values(v * dt, 32, 1.5), (v, dt), &Device::Cpu).unwrap();
        let teacher = || HeadRows {
            h: th.clone(),
            w: std::sync::Arc::new(super::super::packed::FrozenRows::of(&tw).unwrap()),
        };
        let teacher_logits = {
            let h = Tensor::from_vec(th.clone(), (b, t, dt), &Device::Cpu).unwrap();
            crate::model::decoder::linear(&h, &tw, None).unwrap()
        };
        let unfused = |x: &[Tensor], w: &Tensor, beta: f64| {
            let student = crate::model::decoder::linear(&x[0], w, None).unwrap();
            crate::train::losses::generalized_jsd(
                &ops,
                &student,
                &teacher_logits,
                &mask_t,
                1.0,
                beta,
            )
            .unwrap()
        };
        for beta in [0.0, 0.5, 0.1, 1.0] {
            for step in [Some(4), None] {
                // A dense weight: the gradients of both.
                agree(
                    &[var(&[b, t, d], 33, 2.0), var(&[v, d], 34, 1.0)],
                    |x| {
                        let jsd =
                            head_jsd_in(&x[0], HeadWeight::Dense(&x[1]), teacher(), beta, step)
                                .unwrap();
                        (jsd * &mask_t).unwrap().sum_all().unwrap()
                    },
                    |x| unfused(x, &x[1], beta),
                    2e-5,
                );
            }
            // A frozen (packed) weight: the input's gradient.
            let w = var(&[v, d], 34, 1.0).as_tensor().detach();
            let packed: super::super::packed::Packed =
                std::sync::Arc::new(super::super::packed::FrozenRows::of(&w).unwrap());
            agree(
                &[var(&[b, t, d], 33, 2.0)],
                |x| {
                    let jsd =
                        head_jsd_in(&x[0], HeadWeight::Packed(&packed), teacher(), beta, Some(4))
                            .unwrap();
                    (jsd * &mask_t).unwrap().sum_all().unwrap()
                },
                |x| unfused(x, &w, beta),
                2e-5,
            );
        }
        // A teacher of another vocabulary is refused by name.
        let other = HeadRows {
            h: vec![0.0; b * t * dt],
            w: std::sync::Arc::new(
                super::super::packed::FrozenRows::of(
                    &Tensor::zeros((v + 1, dt), DType::F32, &Device::Cpu).unwrap(),
                )
                .unwrap(),
            ),
        };
        let h = var(&[b, t, d], 33, 2.0);
        let w = var(&[v, d], 34, 1.0);
        let e = head_jsd(h.as_tensor(), HeadWeight::Dense(w.as_tensor()), other, 0.5).unwrap_err();
        assert!(e.to_string().contains("vocabulary 14"), "{e}");
    }

    #[test]
    fn the_bf16_autocast_head_equals_the_autocast_linear_then_log_softmax() {
        // 3 × 5 positions, hidden 40, vocabulary 70, in chunks of 4 rows (the last short).
        let (b, t, d, v) = (3, 5, 40, 70);
        let labels: Vec<u32> = (0..b * t).map(|i| (i * 7 % v) as u32).collect();
        let ids = Tensor::from_vec(labels.clone(), (b, t), &Device::Cpu).unwrap();
        let unfused = |x: &[Tensor]| {
            let logits = crate::model::dense_linear::linear_autocast(&x[0], &x[1]).unwrap();
            crate::train::candle::ops::token_logps_unfused(&logits, &ids).unwrap()
        };
        let fused = |x: &[Tensor], step| {
            head_logps_in(
                &x[0],
                HeadWeight::DenseBf16(&x[1]),
                labels.clone(),
                step,
                1.0,
            )
            .unwrap()
            .0
        };
        let inputs = || [var(&[b, t, d], 41, 2.0), var(&[v, d], 42, 0.3)];
        for step in [Some(4), None] {
            // The gradients within a bf16 step (1 % of the largest): the log-softmax's f32
            // gradients, summed in another order, may round to neighbouring bf16 values.
            agree(&inputs(), |x| fused(x, step), unfused, 1e-2);
            // The values to f32's rounding: the same bf16 logits on both sides.
            let x: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
            let (a, u) = (host(&fused(&x, step)), host(&unfused(&x)));
            for (p, q) in a.iter().zip(&u) {
                assert!((p - q).abs() <= 1e-5 * q.abs().max(1.0), "{p} vs {q}");
            }
            // …and not the f32 head's: the logits were rounded.
            let f32_head = host(
                &head_logps_in(&x[0], HeadWeight::Dense(&x[1]), labels.clone(), step, 1.0)
                    .unwrap()
                    .0,
            );
            let most = a
                .iter()
                .zip(&f32_head)
                .fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            assert!(
                most > 1e-4,
                "the bf16 head's values are the f32 head's ({most})"
            );
        }
    }

    #[test]
    fn head_logps_equal_the_logits_then_log_softmax_and_gather() {
        // 3 × 5 positions, hidden 6, vocabulary 11, in chunks of 4 rows (the last short).
        let (b, t, d, v) = (3, 5, 6, 11);
        let labels: Vec<u32> = (0..b * t).map(|i| (i * 7 % v) as u32).collect();
        let ids = Tensor::from_vec(labels.clone(), (b, t), &Device::Cpu).unwrap();
        let unfused = |x: &[Tensor]| {
            let logits = crate::model::decoder::linear(&x[0], &x[1], None).unwrap();
            crate::train::candle::ops::token_logps_unfused(&logits, &ids).unwrap()
        };
        for step in [Some(4), None] {
            // A dense weight: the gradients of both.
            agree(
                &[var(&[b, t, d], 21, 2.0), var(&[v, d], 22, 1.0)],
                |x| {
                    head_logps_in(&x[0], HeadWeight::Dense(&x[1]), labels.clone(), step, 1.0)
                        .unwrap()
                        .0
                },
                unfused,
                1e-5,
            );
        }
        // A frozen (packed) weight: the input's gradient.
        let w = var(&[v, d], 22, 1.0).as_tensor().detach();
        let packed: super::super::packed::Packed =
            std::sync::Arc::new(super::super::packed::FrozenRows::of(&w).unwrap());
        agree(
            &[var(&[b, t, d], 21, 2.0)],
            |x| {
                head_logps_in(
                    &x[0],
                    HeadWeight::Packed(&packed),
                    labels.clone(),
                    Some(4),
                    1.0,
                )
                .unwrap()
                .0
            },
            |x| unfused(&[x[0].clone(), w.clone()]),
            1e-5,
        );
        // The figures, against the logits' own.
        let h = var(&[b, t, d], 23, 2.0).as_tensor().clone();
        let (_, stats) =
            head_logps_in(&h, HeadWeight::Dense(&w), labels.clone(), Some(4), 1.0).unwrap();
        let logits = crate::model::decoder::linear(&h, &w, None).unwrap();
        let entropy = host(&crate::train::candle::ops::token_entropy_unfused(&logits).unwrap());
        let argmax: Vec<u32> = logits
            .argmax(2)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let sum = host(&logits.sum(2).unwrap());
        // A sampling temperature: the logits scaled before the softmax.
        let scale = 1.0 / 0.7;
        agree(
            &[var(&[b, t, d], 24, 2.0), var(&[v, d], 25, 1.0)],
            |x| {
                head_logps_in(
                    &x[0],
                    HeadWeight::Dense(&x[1]),
                    labels.clone(),
                    Some(4),
                    scale,
                )
                .unwrap()
                .0
            },
            |x| {
                let logits = crate::model::decoder::linear(&x[0], &x[1], None).unwrap();
                let logits = logits.affine(f64::from(scale), 0.0).unwrap();
                crate::train::candle::ops::token_logps_unfused(&logits, &ids).unwrap()
            },
            1e-5,
        );
        assert_eq!(stats.vocab, v);
        assert_eq!(stats.argmax, argmax);
        for (what, got, want) in [
            ("entropy", &stats.entropy, &entropy),
            ("sum", &stats.sum, &sum),
        ] {
            for (i, (a, b)) in got.iter().zip(want.iter()).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{what}[{i}]: {a} vs {b}"
                );
            }
        }
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
