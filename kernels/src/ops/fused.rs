//! Fused element-wise kernels of the decoder's training step, forward and backward: each is
//! one pass over its rows (threaded over rows with rayon, the inner loops plain slices the
//! compiler vectorises) where the unfused candle composition runs several ops, each
//! allocating an output the backward pass then keeps. `runtime/src/model/fused.rs` wraps
//! them as candle ops; they compute what the unfused ops compute, in the same order per
//! element, so only the order of a row's sums can differ.
//!
//! - [`swiglu`]: `y = silu(g) · u` (the MLP's gate) and its backward;
//! - [`rms_norm`]: transformers' RMSNorm `w · x / sqrt(mean(x²) + ε)` and its backward;
//! - [`rope`]: `x · cos + rotate_half(x) · sin` per position and its backward;
//! - [`attention`]: the whole of attention, `softmax(scale · q·kᵀ + masks) · v`, streamed four
//!   query rows at a time against sixteen keys at a time in vector registers, over the keys the
//!   causal mask leaves visible only (flash-attention style: only the rows' log-sum-exps are
//!   kept for the backward pass, never `[tq, tk]` probabilities), grouped-query heads reading
//!   their shared keys and values in place, and its backward (one query row at a time);
//! - [`token_logps`]: `log_softmax(logits)[label]` per row and its backward, which never holds
//!   a second `[rows, vocab]` array;
//! - [`token_entropy`]: the entropy of `softmax(logits)` per row (a logged figure, no
//!   backward), one pass where the unfused ops hold four `[rows, vocab]` arrays.

use crate::KernelError;
use crate::error::check_len;
use rayon::prelude::*;

pub(super) fn bad(op: &'static str, what: String) -> KernelError {
    KernelError::Parameter { op, what }
}

/// Rows handed to one rayon task: enough work per task (about 16k values).
pub(super) fn rows_per_task(cols: usize) -> usize {
    (16_384 / cols.max(1)).max(1)
}

/// The rows of `len` values of `cols` each, or an error naming `op`.
fn rows_of(op: &'static str, len: usize, cols: usize) -> Result<usize, KernelError> {
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(bad(op, format!("{len} values are not rows of {cols}")));
    }
    Ok(len / cols)
}

/// `1 / (1 + e^−g)`.
#[inline]
fn sigmoid(g: f32) -> f32 {
    1.0 / ((-g).exp() + 1.0)
}

/// `silu(g) = g / (1 + e^−g)`, as candle's `silu` computes it.
#[inline]
fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

/// `y = silu(g) · u` element-wise.
pub fn swiglu(g: &[f32], u: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
    let n = g.len();
    check_len("swiglu", "u", u.len(), n, &[n])?;
    check_len("swiglu", "y", y.len(), n, &[n])?;
    y.par_chunks_mut(16_384)
        .zip(g.par_chunks(16_384).zip(u.par_chunks(16_384)))
        .for_each(|(y, (g, u))| {
            for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
                *y = silu(g) * u;
            }
        });
    Ok(())
}

/// The backward of [`swiglu`]: `dg = dy · u · σ(g)(1 + g(1 − σ(g)))`, `du = dy · silu(g)`.
pub fn swiglu_backward(
    g: &[f32],
    u: &[f32],
    dy: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
) -> Result<(), KernelError> {
    let n = g.len();
    for (what, len) in [
        ("u", u.len()),
        ("dy", dy.len()),
        ("dg", dg.len()),
        ("du", du.len()),
    ] {
        check_len("swiglu_backward", what, len, n, &[n])?;
    }
    let c = 16_384;
    dg.par_chunks_mut(c)
        .zip(du.par_chunks_mut(c))
        .zip(g.par_chunks(c).zip(u.par_chunks(c)).zip(dy.par_chunks(c)))
        .for_each(|((dg, du), ((g, u), dy))| {
            for i in 0..g.len() {
                let s = sigmoid(g[i]);
                du[i] = dy[i] * silu(g[i]);
                dg[i] = dy[i] * u[i] * (s * (1.0 + g[i] * (1.0 - s)));
            }
        });
    Ok(())
}

/// transformers' RMSNorm of each row of `cols` values of `x`: `y = w · x / sqrt(mean(x²) +
/// eps)` (the mean as the row's sum times `1 / cols`); `rstd` gets each row's
/// `1 / sqrt(mean(x²) + eps)` (for the backward).
pub fn rms_norm(
    x: &[f32],
    w: &[f32],
    cols: usize,
    eps: f32,
    y: &mut [f32],
    rstd: &mut [f32],
) -> Result<(), KernelError> {
    let op = "rms_norm";
    let rows = rows_of(op, x.len(), cols)?;
    check_len(op, "w", w.len(), cols, &[cols])?;
    check_len(op, "y", y.len(), x.len(), &[rows, cols])?;
    check_len(op, "rstd", rstd.len(), rows, &[rows])?;
    let t = rows_per_task(cols);
    y.par_chunks_mut(t * cols)
        .zip(rstd.par_chunks_mut(t))
        .zip(x.par_chunks(t * cols))
        .for_each(|((y, rstd), x)| {
            for ((y, r), x) in y.chunks_mut(cols).zip(rstd.iter_mut()).zip(x.chunks(cols)) {
                let ss: f32 = x.iter().map(|v| v * v).sum();
                let var = ss * (1.0 / cols as f32);
                let d = (var + eps).sqrt();
                *r = 1.0 / d;
                for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
                    *y = x / d * w;
                }
            }
        });
    Ok(())
}

/// Each row's `1 / sqrt(mean(x²) + eps)`, as [`rms_norm`] computes it.
pub fn rms_rstd(x: &[f32], cols: usize, eps: f32, rstd: &mut [f32]) -> Result<(), KernelError> {
    let rows = rows_of("rms_rstd", x.len(), cols)?;
    check_len("rms_rstd", "rstd", rstd.len(), rows, &[rows])?;
    rstd.par_iter_mut()
        .zip(x.par_chunks(cols))
        .for_each(|(r, x)| {
            let ss: f32 = x.iter().map(|v| v * v).sum();
            *r = 1.0 / (ss * (1.0 / cols as f32) + eps).sqrt();
        });
    Ok(())
}

/// The backward of [`rms_norm`] given its `rstd`: `dx = rstd · (w·dy − x̂ · mean(w·dy·x̂))`
/// with `x̂ = x · rstd`, and `dw = Σ_rows dy · x̂`.
pub fn rms_norm_backward(
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dy: &[f32],
    cols: usize,
    dx: &mut [f32],
    dw: &mut [f32],
) -> Result<(), KernelError> {
    let op = "rms_norm_backward";
    let rows = rows_of(op, x.len(), cols)?;
    check_len(op, "w", w.len(), cols, &[cols])?;
    check_len(op, "rstd", rstd.len(), rows, &[rows])?;
    check_len(op, "dy", dy.len(), x.len(), &[rows, cols])?;
    check_len(op, "dx", dx.len(), x.len(), &[rows, cols])?;
    check_len(op, "dw", dw.len(), cols, &[cols])?;
    let t = rows_per_task(cols);
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(t * cols)
        .zip(x.par_chunks(t * cols))
        .zip(dy.par_chunks(t * cols).zip(rstd.par_chunks(t)))
        .map(|((dx, x), (dy, rstd))| {
            let mut dw = vec![0f32; cols];
            for (((dx, x), dy), &r) in dx
                .chunks_mut(cols)
                .zip(x.chunks(cols))
                .zip(dy.chunks(cols))
                .zip(rstd)
            {
                let mut dot = 0f32;
                for i in 0..cols {
                    let xh = x[i] * r;
                    dot += w[i] * dy[i] * xh;
                    dw[i] += dy[i] * xh;
                }
                let mean = dot / cols as f32;
                for i in 0..cols {
                    dx[i] = r * (w[i] * dy[i] - x[i] * r * mean);
                }
            }
            dw
        })
        .collect();
    dw.fill(0.0);
    for p in partial {
        for (d, v) in dw.iter_mut().zip(p) {
            *d += v;
        }
    }
    Ok(())
}

/// RoPE's shapes (`lens`: x, cos, sin, y): `x` and `y` rows of `[t, d]` with an even `d`, the
/// tables `[t, d]`.
pub(super) fn check_rope(
    op: &'static str,
    [x, cos, sin, y]: [usize; 4],
    t: usize,
    d: usize,
) -> Result<(), KernelError> {
    let plane = t * d;
    if d == 0 || !d.is_multiple_of(2) || plane == 0 || !x.is_multiple_of(plane) {
        return Err(bad(
            op,
            format!("{x} values are not rows of [{t}, {d}] with an even d"),
        ));
    }
    check_len(op, "cos", cos, plane, &[t, d])?;
    check_len(op, "sin", sin, plane, &[t, d])?;
    check_len(op, "y", y, x, &[x / plane, t, d])
}

/// RoPE on `x` `[rows, t, d]` (every head of every sequence; `rows` = batch · heads) with the
/// tables `cos`, `sin` `[t, d]`: `y = x · cos + rotate_half(x) · sin`, `rotate_half([a, b]) =
/// [−b, a]` over the halves of `d`. With `transpose`, the backward: `dx = dy · cos +
/// rotate_halfᵀ(dy · sin)`, `rotate_halfᵀ([a, b]) = [b, −a]`.
pub fn rope(
    x: &[f32],
    cos: &[f32],
    sin: &[f32],
    t: usize,
    d: usize,
    transpose: bool,
    y: &mut [f32],
) -> Result<(), KernelError> {
    check_rope("rope", [x.len(), cos.len(), sin.len(), y.len()], t, d)?;
    let (plane, h) = (t * d, d / 2);
    y.par_chunks_mut(plane)
        .zip(x.par_chunks(plane))
        .for_each(|(y, x)| {
            for p in 0..t {
                let (x, y) = (&x[p * d..(p + 1) * d], &mut y[p * d..(p + 1) * d]);
                let (c, s) = (&cos[p * d..(p + 1) * d], &sin[p * d..(p + 1) * d]);
                for i in 0..h {
                    if transpose {
                        // dx_i = dy_i c_i + dy_{i+h} s_{i+h};  dx_{i+h} = dy_{i+h} c_{i+h} − dy_i s_i.
                        y[i] = x[i] * c[i] + x[i + h] * s[i + h];
                        y[i + h] = x[i + h] * c[i + h] + -(x[i] * s[i]);
                    } else {
                        y[i] = x[i] * c[i] + -x[i + h] * s[i];
                        y[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h];
                    }
                }
            }
        });
    Ok(())
}

// ---- Attention, streamed row by row ------------------------------------------------------

/// The shapes of [`attention`]: queries `[batch, heads, tq, dim]`, keys and values
/// `[batch, kv_heads, tk, dim]` (grouped-query attention: query head `h` reads key/value head
/// `h / (heads / kv_heads)`, transformers' `repeat_kv` order), the causal (and sliding-window)
/// mask `[tq, tk]` (0 or −∞) and optionally a key mask `[batch, tk]` (0 or a large negative
/// value), added after `scale`.
#[derive(Debug, Clone, Copy)]
pub struct Heads<'a> {
    /// Sequences.
    pub batch: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: usize,
    /// Queries.
    pub tq: usize,
    /// Keys.
    pub tk: usize,
    /// Values per head.
    pub dim: usize,
    /// The factor on `q·k` (`1 / √dim`).
    pub scale: f32,
    /// `[tq, tk]`, added to every head of every sequence.
    pub causal: &'a [f32],
    /// `[batch, tk]`, added to every query of every head of its sequence.
    pub keys: Option<&'a [f32]>,
    /// Round as PyTorch's eager attention on bf16 tensors rounds (the inputs bf16 values):
    /// `q·k` to bf16, then `· scale`, `+ causal`, `+ keys` each rounded to bf16, the
    /// probabilities (an f32 softmax) rounded to bf16 before they weigh the values; the caller
    /// rounds the output. Forward only ([`attention_backward`] refuses it).
    pub bf16: bool,
}

impl Heads<'_> {
    fn check(&self, op: &'static str, q: usize, k: usize, v: usize) -> Result<(), KernelError> {
        let Heads {
            batch,
            heads,
            kv_heads,
            tq,
            tk,
            dim,
            ..
        } = *self;
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(bad(
                op,
                format!("{heads} query heads are not groups of {kv_heads} key/value heads"),
            ));
        }
        let kv = [batch, kv_heads, tk, dim];
        for (name, len, dims) in [
            ("q", q, [batch, heads, tq, dim]),
            ("k", k, kv),
            ("v", v, kv),
        ] {
            check_len(op, name, len, dims.iter().product(), &dims)?;
        }
        check_len(op, "causal", self.causal.len(), tq * tk, &[tq, tk])?;
        if let Some(k) = self.keys {
            check_len(op, "keys", k.len(), batch * tk, &[batch, tk])?;
        }
        Ok(())
    }

    /// Query rows per key/value head (the group's heads, one after another).
    fn rows(&self) -> usize {
        self.heads / self.kv_heads * self.tq
    }
}

/// `Σ a·b` in eight partial sums (the compiler keeps them in one vector).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += a·x`.
#[inline(always)]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Row `i`'s scores `scale · q·k_j + causal + keys` into `s`; keys the causal mask hides
/// (−∞) are skipped and left −∞.
#[inline(always)]
fn scores_row(
    q: &[f32],
    k: &[f32],
    causal: &[f32],
    keys: Option<&[f32]>,
    scale: f32,
    s: &mut [f32],
) {
    let dim = q.len();
    for (j, s) in s.iter_mut().enumerate() {
        *s = if causal[j] == f32::NEG_INFINITY {
            f32::NEG_INFINITY
        } else {
            let v = dot(q, &k[j * dim..(j + 1) * dim]) * scale + causal[j];
            match keys {
                Some(m) => v + m[j],
                None => v,
            }
        };
    }
}

/// Whether this CPU runs the AVX2 + FMA build of the attention's per-task work.
#[derive(Clone, Copy)]
struct Isa {
    avx2_fma: bool,
}

impl Isa {
    fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        let avx2_fma = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        #[cfg(not(target_arch = "x86_64"))]
        let avx2_fma = false;
        Isa { avx2_fma }
    }

    /// Runs `w`, compiled for AVX2 and FMA where the CPU has them ([`Work::work`] is inlined
    /// into a function with those features). Called inside each rayon task: a closure handed
    /// to rayon is compiled apart from its caller's target features.
    #[inline(always)]
    fn run<W: Work>(self, w: W) -> W::Out {
        #[cfg(target_arch = "x86_64")]
        if self.avx2_fma {
            // SAFETY: `avx2_fma` is true only where `detect` found AVX2 and FMA.
            return unsafe { avx2_fma(w) };
        }
        w.work()
    }
}

impl Isa {
    /// [`RowExpSum`]: AVX2 + FMA in vector registers where the CPU has them, else the
    /// portable lanes (the same operations in the same order: the same bits).
    #[inline(always)]
    fn exp_sum(self, x: &[f32]) -> (f32, f32) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2_fma {
            // SAFETY: `avx2_fma` is true only where `detect` found AVX2 and FMA.
            return unsafe { rows_avx2::exp_sum(x) };
        }
        RowExpSum(x).work()
    }

    /// [`RowEntropy`], as [`Isa::exp_sum`] dispatches.
    #[inline(always)]
    fn entropy(self, x: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if self.avx2_fma {
            // SAFETY: as in `exp_sum`.
            return unsafe { rows_avx2::entropy(x) };
        }
        RowEntropy(x).work()
    }

    /// [`RowSoftmaxGrad`], as [`Isa::exp_sum`] dispatches.
    #[inline(always)]
    fn softmax_grad(self, x: &[f32], d: &mut [f32], lse: f32, g: f32) {
        #[cfg(target_arch = "x86_64")]
        if self.avx2_fma {
            // SAFETY: as in `exp_sum`.
            return unsafe { rows_avx2::softmax_grad(x, d, lse, g) };
        }
        RowSoftmaxGrad { x, d, lse, g }.work()
    }
}

/// A task's work, compiled once per instruction set ([`Isa::run`]).
trait Work {
    type Out;
    fn work(self) -> Self::Out;
}

/// `w.work()` compiled for AVX2 and FMA.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_fma<W: Work>(w: W) -> W::Out {
    w.work()
}

/// One (sequence, key/value head) of [`attention`]'s inputs: its group's query rows, keys,
/// values and key mask.
struct Task<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    keys: Option<&'a [f32]>,
}

impl<'a> Heads<'a> {
    /// Task `task`'s part of `q`, `k`, `v` (tasks in (sequence, key/value head) order).
    fn task(&self, task: usize, q: &'a [f32], k: &'a [f32], v: &'a [f32]) -> Task<'a> {
        let (hq, hk) = (self.rows() * self.dim, self.tk * self.dim);
        let b = task / self.kv_heads;
        Task {
            q: &q[task * hq..(task + 1) * hq],
            k: &k[task * hk..(task + 1) * hk],
            v: &v[task * hk..(task + 1) * hk],
            keys: self.keys.map(|m| &m[b * self.tk..(b + 1) * self.tk]),
        }
    }

    /// Query row `r` of a task: its values, its causal row, and its scores into `s`.
    #[inline(always)]
    fn row<'t>(&self, t: &Task<'t>, r: usize, s: &mut [f32]) -> (&'t [f32], &'a [f32]) {
        let (i, dim, tk) = (r % self.tq, self.dim, self.tk);
        let q = &t.q[r * dim..(r + 1) * dim];
        let causal = &self.causal[i * tk..(i + 1) * tk];
        scores_row(q, t.k, causal, t.keys, self.scale, s);
        (q, causal)
    }
}

/// Query rows [`ForwardRows`] scores at once against each block of keys.
const QUERY_BLOCK: usize = 4;
/// Keys per block of scores (two AVX2 vectors).
const KEY_BLOCK: usize = 16;

/// `e^x` for `x ≤ 0` (a score less the row's maximum), to about 2 ulp: `x = n·ln 2 + r` with
/// `|r| ≤ ln 2 / 2`, `e^r` by its degree-6 Taylor polynomial, `2^n` from the exponent bits.
/// `x < −87` (the result below f32's normal range) and −∞ give 0, NaN gives NaN. Written
/// lane-wise so that a
/// loop over a slice of them runs in vector registers.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: `n · LN2_HI` is exact for the |n| ≤ 126 used here.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5·2²³ rounds to an integer (to nearest, ties to even) in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.max(-87.0);
    let n = xc.mul_add(LOG2E, ROUND) - ROUND;
    let r = n.mul_add(-LN2_LO, n.mul_add(-LN2_HI, xc));
    let mut p: f32 = 1.0 / 720.0;
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = p.mul_add(r, c);
    }
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < -87.0 {
        0.0
    } else if x.is_nan() {
        // A NaN score (a NaN or infinite query or key) stays NaN.
        x
    } else {
        p * two_n
    }
}

/// `x` rounded to bf16 (to nearest, ties to even), as f32.
#[inline(always)]
fn bf16_round(x: f32) -> f32 {
    super::fused_bf16::widen(super::fused_bf16::narrow(x))
}

/// `Σ x` in eight partial sums (the compiler keeps them in one vector).
#[inline(always)]
fn sum8(x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let c = x.chunks_exact(8);
    let tail: f32 = c.remainder().iter().sum();
    for x in c {
        for l in 0..8 {
            acc[l] += x[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest of `x` (NaNs passed over; −∞ when empty), in eight partial maxima.
#[inline(always)]
fn max8(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let c = x.chunks_exact(8);
    let tail = c
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for x in c {
        for l in 0..8 {
            acc[l] = if x[l] > acc[l] { x[l] } else { acc[l] };
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

/// The first and one past the last key that causal row `c` lets a query see (`(0, 0)`: none).
fn visible(c: &[f32]) -> (usize, usize) {
    match c.iter().position(|&x| x != f32::NEG_INFINITY) {
        Some(lo) => (
            lo,
            c.iter().rposition(|&x| x != f32::NEG_INFINITY).unwrap() + 1,
        ),
        None => (0, 0),
    }
}

/// [`attention`]'s rows of one task: each query row's scores, softmax, output and
/// log-sum-exp, [`QUERY_BLOCK`] rows at a time against [`KEY_BLOCK`] keys at a time (the keys
/// transposed once per task, so that a block's scores are vector multiply-adds over the head's
/// dimensions), over the keys the causal rows leave visible only.
struct ForwardRows<'a, 'h> {
    h: &'a Heads<'h>,
    t: Task<'a>,
    o: &'a mut [f32],
    lse: &'a mut [f32],
}

impl Work for ForwardRows<'_, '_> {
    type Out = ();
    #[inline(always)]
    fn work(self) {
        const QB: usize = QUERY_BLOCK;
        const KB: usize = KEY_BLOCK;
        let (h, t, dim, tk) = (self.h, &self.t, self.h.dim, self.h.tk);
        // kt[d][j] = k[j][d], each row padded to whole key blocks with zeros.
        let stride = tk.next_multiple_of(KB);
        let mut kt = vec![0f32; dim * stride];
        for (j, kr) in t.k.chunks_exact(dim).enumerate() {
            for (d, &x) in kr.iter().enumerate() {
                kt[d * stride + j] = x;
            }
        }
        let rows = self.lse.len();
        // The block's scores, then probabilities: row r at s[r·stride..].
        let mut s = vec![0f32; QB * stride];
        // The block's queries transposed: qt[d][r] (rows past the last are zeros).
        let mut qt = vec![0f32; dim * QB];
        for r0 in (0..rows).step_by(QB) {
            let n = QB.min(rows - r0);
            let causal = |r: usize| {
                let i = (r0 + r) % h.tq;
                &h.causal[i * tk..(i + 1) * tk]
            };
            // The keys any row of the block sees; the rest have probability 0 in every row.
            let (mut lo, mut hi) = (tk, 0);
            for r in 0..n {
                let (a, b) = visible(causal(r));
                if a < b {
                    (lo, hi) = (lo.min(a), hi.max(b));
                }
            }
            if lo >= hi {
                // No row sees a key: a softmax over nothing.
                self.o[r0 * dim..(r0 + n) * dim].fill(f32::NAN);
                self.lse[r0..r0 + n].fill(f32::NAN);
                continue;
            }
            let lo = lo - lo % KB;
            qt.fill(0.0);
            for r in 0..n {
                for (d, &x) in t.q[(r0 + r) * dim..][..dim].iter().enumerate() {
                    qt[d * QB + r] = x;
                }
            }
            // Σ_d q[r][d]·k[j][d], the dimensions in order, a block of keys at a time.
            for jb in (lo..hi).step_by(KB) {
                let mut acc = [[0f32; KB]; QB];
                for (qd, kd) in qt.chunks_exact(QB).zip(kt.chunks_exact(stride)) {
                    let kr: &[f32; KB] = kd[jb..jb + KB].try_into().unwrap();
                    for (a, &q) in acc.iter_mut().zip(qd) {
                        for l in 0..KB {
                            a[l] = q.mul_add(kr[l], a[l]);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    s[r * stride + jb..][..KB].copy_from_slice(a);
                }
            }
            let hi_b = hi.next_multiple_of(KB).min(stride);
            // Rows that see no key: a softmax over nothing, NaN.
            let mut dead = [false; QB];
            for (r, sr) in s.chunks_exact_mut(stride).enumerate() {
                let sr = &mut sr[lo..hi_b];
                if r >= n {
                    sr.fill(0.0);
                    continue;
                }
                let c = &causal(r)[lo..hi];
                let keys = t.keys.map(|m| &m[lo..hi]);
                for (j, x) in sr.iter_mut().enumerate() {
                    *x = match c.get(j) {
                        None | Some(&f32::NEG_INFINITY) => f32::NEG_INFINITY,
                        Some(&cj) if h.bf16 => {
                            let v = bf16_round(bf16_round(bf16_round(*x) * h.scale) + cj);
                            keys.map_or(v, |m| bf16_round(v + m[j]))
                        }
                        Some(&cj) => {
                            let v = *x * h.scale + cj;
                            keys.map_or(v, |m| v + m[j])
                        }
                    };
                }
                let max = max8(sr);
                if max == f32::NEG_INFINITY {
                    sr.fill(0.0);
                    self.lse[r0 + r] = f32::NAN;
                    dead[r] = true;
                    continue;
                }
                for x in sr.iter_mut() {
                    *x = exp_nonpositive(*x - max);
                }
                // The probabilities normalised before they weigh the values, as PyTorch's
                // softmax-then-matmul rounds them (dividing the sums instead moves GPTQ's
                // codes away from llm-compressor's in f32).
                let sum = sum8(sr);
                for x in sr.iter_mut() {
                    *x /= sum;
                }
                if h.bf16 {
                    for x in sr.iter_mut() {
                        *x = bf16_round(*x);
                    }
                }
                self.lse[r0 + r] = max + sum.ln();
            }
            // o[r] = Σ_j p[r][j]·v[j], sixteen of the head's values at a time.
            let o = &mut self.o[r0 * dim..(r0 + n) * dim];
            let whole = dim - dim % KB;
            for c0 in (0..whole).step_by(KB) {
                let mut acc = [[0f32; KB]; QB];
                for j in lo..hi {
                    let vj: &[f32; KB] = t.v[j * dim + c0..][..KB].try_into().unwrap();
                    for (r, a) in acc.iter_mut().enumerate() {
                        let p = s[r * stride + j];
                        for l in 0..KB {
                            a[l] = p.mul_add(vj[l], a[l]);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate().take(n) {
                    o[r * dim + c0..][..KB].copy_from_slice(a);
                }
            }
            for r in 0..n {
                for c0 in whole..dim {
                    let mut x = 0f32;
                    for j in lo..hi {
                        x = s[r * stride + j].mul_add(t.v[j * dim + c0], x);
                    }
                    o[r * dim + c0] = x;
                }
            }
            for (r, _) in dead.iter().enumerate().take(n).filter(|(_, d)| **d) {
                o[r * dim..(r + 1) * dim].fill(f32::NAN);
            }
        }
    }
}

/// [`attention_backward`]'s rows of one task: each query row's probabilities again from its
/// log-sum-exp, and its share of `dq`, `dk`, `dv`.
struct BackwardRows<'a, 'h> {
    h: &'a Heads<'h>,
    t: Task<'a>,
    o: &'a [f32],
    d_o: &'a [f32],
    lse: &'a [f32],
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

impl Work for BackwardRows<'_, '_> {
    type Out = ();
    #[inline(always)]
    fn work(self) {
        let (h, t, dim) = (self.h, &self.t, self.h.dim);
        let mut s = vec![0f32; h.tk];
        for (r, &lse) in self.lse.iter().enumerate() {
            let (qr, causal) = h.row(t, r, &mut s);
            let row = r * dim..(r + 1) * dim;
            let dor = &self.d_o[row.clone()];
            let d = dot(dor, &self.o[row.clone()]);
            let dqr = &mut self.dq[row];
            for j in 0..h.tk {
                if causal[j] == f32::NEG_INFINITY {
                    continue;
                }
                let p = (s[j] - lse).exp();
                let kv = j * dim..(j + 1) * dim;
                let ds = h.scale * (p * (dot(dor, &t.v[kv.clone()]) - d));
                axpy(&mut self.dv[kv.clone()], p, dor);
                axpy(dqr, ds, &t.k[kv.clone()]);
                axpy(&mut self.dk[kv], ds, qr);
            }
        }
    }
}

/// Attention's output `o = softmax(scale · q·kᵀ + causal + keys) · v` `[batch, heads, tq,
/// dim]` and each row's log-sum-exp `lse` `[batch, heads, tq]` (what the backward pass needs
/// in place of the probabilities), a block of four query rows at a time: their `tk` scores are
/// the only scores ever held (one block per thread), never `[tq, tk]`; the keys a block's
/// causal rows hide are skipped. Each score is `Σ_d q_d·k_d` in order of `d` (fused
/// multiply-adds), the probabilities are normalised before they weigh the values (as PyTorch's
/// softmax then matmul), the exponential a degree-6 polynomial within 2 ulp. A row that sees no key
/// gets NaN. Threaded over (sequence, key/value head); each group of query heads reads its keys
/// and values where they are, never copied per head.
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    shape: &Heads<'_>,
    o: &mut [f32],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    let op = "attention";
    shape.check(op, q.len(), k.len(), v.len())?;
    let h = *shape;
    let dims = [h.batch, h.heads, h.tq, h.dim];
    check_len(op, "o", o.len(), q.len(), &dims)?;
    check_len(op, "lse", lse.len(), h.batch * h.heads * h.tq, &dims[..3])?;
    if o.is_empty() {
        return Ok(());
    }
    let (rows, isa) = (h.rows(), Isa::detect());
    o.par_chunks_mut(rows * h.dim)
        .zip(lse.par_chunks_mut(rows))
        .enumerate()
        .for_each(|(task, (o, lse))| {
            isa.run(ForwardRows {
                h: &h,
                t: h.task(task, q, k, v),
                o,
                lse,
            })
        });
    Ok(())
}

/// The backward of [`attention`] from its inputs, output `o`, log-sum-exps `lse` and the
/// output's gradient `d_o`: `dq`, `dk`, `dv` (overwritten). Each query row's probabilities
/// are recomputed from `lse` (`p = exp(s − lse)`), `ds = scale · p · (do·v − do·o)`, and
/// `dq += ds·k`, `dk += ds·q`, `dv += p·do` — one row of scores at a time, as the forward.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    d_o: &[f32],
    shape: &Heads<'_>,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
) -> Result<(), KernelError> {
    let op = "attention_backward";
    shape.check(op, q.len(), k.len(), v.len())?;
    if shape.bf16 {
        return Err(bad(
            op,
            "bf16 rounding is forward-only (inference and calibration)".into(),
        ));
    }
    let h = *shape;
    check_len(op, "o", o.len(), q.len(), &[q.len()])?;
    check_len(op, "d_o", d_o.len(), q.len(), &[q.len()])?;
    let rows = [h.batch, h.heads, h.tq];
    check_len(op, "lse", lse.len(), rows.iter().product(), &rows)?;
    check_len(op, "dq", dq.len(), q.len(), &[q.len()])?;
    check_len(op, "dk", dk.len(), k.len(), &[k.len()])?;
    check_len(op, "dv", dv.len(), v.len(), &[v.len()])?;
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    if q.is_empty() || k.is_empty() {
        return Ok(());
    }
    let (rows, dim, isa) = (h.rows(), h.dim, Isa::detect());
    let (hq, hk) = (rows * dim, h.tk * dim);
    dq.par_chunks_mut(hq)
        .zip(dk.par_chunks_mut(hk).zip(dv.par_chunks_mut(hk)))
        .enumerate()
        .for_each(|(task, (dq, (dk, dv)))| {
            isa.run(BackwardRows {
                h: &h,
                t: h.task(task, q, k, v),
                o: &o[task * hq..(task + 1) * hq],
                d_o: &d_o[task * hq..(task + 1) * hq],
                lse: &lse[task * rows..(task + 1) * rows],
                dq,
                dk,
                dv,
            })
        });
    Ok(())
}

/// Where each row of a `[rows, vocab]` array starts (rows may be strided: the first `t − 1`
/// positions of each of `batch` sequences of `t`).
#[derive(Debug, Clone, Copy)]
pub struct Rows {
    /// Rows.
    pub rows: usize,
    /// Values per row.
    pub vocab: usize,
    /// Rows per group (a sequence's positions).
    pub per_group: usize,
    /// The offset between groups.
    pub group_stride: usize,
    /// The offset of the first row.
    pub start: usize,
}

impl Rows {
    fn at(&self, r: usize) -> usize {
        self.start + (r / self.per_group) * self.group_stride + (r % self.per_group) * self.vocab
    }

    fn check(&self, op: &'static str, len: usize) -> Result<(), KernelError> {
        if self.rows == 0 {
            return Ok(());
        }
        if self.per_group == 0 || self.vocab == 0 {
            return Err(bad(op, "empty rows".into()));
        }
        let last = self.at(self.rows - 1) + self.vocab;
        if last > len {
            return Err(bad(op, format!("rows reach {last} of {len} values")));
        }
        Ok(())
    }
}

/// `out[r] = logits[r][labels[r]] − logsumexp(logits[r])`, the row's maximum subtracted first
/// (as the unfused ops compute it); `lse` gets each row's `logsumexp`.
pub fn token_logps(
    logits: &[f32],
    rows: &Rows,
    labels: &[u32],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    let op = "token_logps";
    rows.check(op, logits.len())?;
    check_len(op, "labels", labels.len(), rows.rows, &[rows.rows])?;
    check_len(op, "out", out.len(), rows.rows, &[rows.rows])?;
    check_len(op, "lse", lse.len(), rows.rows, &[rows.rows])?;
    if let Some(l) = labels.iter().find(|&&l| l as usize >= rows.vocab) {
        return Err(bad(
            op,
            format!("label {l} outside a vocabulary of {}", rows.vocab),
        ));
    }
    let isa = Isa::detect();
    out.par_iter_mut()
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(r, (o, lse))| {
            let x = &logits[rows.at(r)..rows.at(r) + rows.vocab];
            let (max, sum) = isa.exp_sum(x);
            let l = sum.ln();
            *lse = l + max;
            *o = (x[labels[r] as usize] - max) - l;
        });
    Ok(())
}

/// Lanes of the vocabulary's row passes: eight f32 (one AVX2 vector).
const ROW_LANES: usize = 8;

/// The largest of `x` (a NaN ignored, as `f32::max` ignores it), lane by lane then across the
/// lanes: the same value as a sequential fold (the maximum does not depend on the order).
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; ROW_LANES];
    let mut chunks = x.chunks_exact(ROW_LANES);
    for c in &mut chunks {
        for (m, &v) in m.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let tail = chunks.remainder().iter().copied();
    m.into_iter().chain(tail).fold(f32::NEG_INFINITY, f32::max)
}

/// A row's maximum and `Σ exp(x − max)` ([`exp_nonpositive`], to about 2 ulp), in
/// [`ROW_LANES`] partial sums.
struct RowExpSum<'a>(&'a [f32]);

impl Work for RowExpSum<'_> {
    type Out = (f32, f32);
    #[inline(always)]
    fn work(self) -> (f32, f32) {
        let max = row_max(self.0);
        let mut s = [0f32; ROW_LANES];
        let mut chunks = self.0.chunks_exact(ROW_LANES);
        for c in &mut chunks {
            for (s, &v) in s.iter_mut().zip(c) {
                *s += exp_nonpositive(v - max);
            }
        }
        let tail: f32 = chunks
            .remainder()
            .iter()
            .map(|&v| exp_nonpositive(v - max))
            .sum();
        (max, s.iter().sum::<f32>() + tail)
    }
}

/// `(Σ e, Σ e·(x − max))` with `e = exp(x − max)`, in order: a row's last values past its
/// whole lanes.
#[inline(always)]
fn entropy_sums(x: &[f32], max: f32) -> (f32, f32) {
    let (mut z, mut s) = (0f32, 0f32);
    for &v in x {
        let d = v - max;
        let e = exp_nonpositive(d);
        z += e;
        s += e * d;
    }
    (z, s)
}

/// A row's entropy `ln Z − Σ e·(x − max) / Z` (`e = exp(x − max)`, `Z = Σ e`), the sums in
/// [`ROW_LANES`] partial sums.
struct RowEntropy<'a>(&'a [f32]);

impl Work for RowEntropy<'_> {
    type Out = f32;
    #[inline(always)]
    fn work(self) -> f32 {
        let max = row_max(self.0);
        let (mut z, mut s) = ([0f32; ROW_LANES], [0f32; ROW_LANES]);
        let mut chunks = self.0.chunks_exact(ROW_LANES);
        for c in &mut chunks {
            for ((z, s), &v) in z.iter_mut().zip(s.iter_mut()).zip(c) {
                let d = v - max;
                let e = exp_nonpositive(d);
                *z += e;
                *s += e * d;
            }
        }
        let (zt, st) = entropy_sums(chunks.remainder(), max);
        let (z, s) = (z.iter().sum::<f32>() + zt, s.iter().sum::<f32>() + st);
        z.ln() - s / z
    }
}

/// `d = −g · exp(x − lse)` over a row (the softmax part of the log-softmax's backward).
struct RowSoftmaxGrad<'a> {
    x: &'a [f32],
    d: &'a mut [f32],
    lse: f32,
    g: f32,
}

impl Work for RowSoftmaxGrad<'_> {
    type Out = ();
    #[inline(always)]
    fn work(self) {
        for (d, &x) in self.d.iter_mut().zip(self.x) {
            *d = -self.g * exp_nonpositive(x - self.lse);
        }
    }
}

/// The vocabulary's row passes in AVX2 + FMA registers: [`RowExpSum`], [`RowEntropy`] and
/// [`RowSoftmaxGrad`] with [`exp_nonpositive`] eight lanes at a time, each operation the
/// portable lanes' own in the same order (the same bits:
/// `vocabulary_row_passes_match_f64_at_every_length`).
#[cfg(target_arch = "x86_64")]
mod rows_avx2 {
    use super::{ROW_LANES, entropy_sums, exp_nonpositive, row_max};
    use std::arch::x86_64::*;

    /// [`exp_nonpositive`] on eight lanes.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY (all intrinsics here): the caller runs with AVX2 and FMA.
        unsafe {
            let xc = _mm256_max_ps(x, _mm256_set1_ps(-87.0));
            let round = _mm256_set1_ps(12_582_912.0);
            let n = _mm256_sub_ps(
                _mm256_fmadd_ps(xc, _mm256_set1_ps(std::f32::consts::LOG2_E), round),
                round,
            );
            let r = _mm256_fmadd_ps(
                n,
                _mm256_set1_ps(-1.428_606_8e-6),
                _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_145_75), xc),
            );
            let mut p = _mm256_set1_ps(1.0 / 720.0);
            for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
            let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(e));
            let v = _mm256_mul_ps(p, two_n);
            let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
            let v = _mm256_blendv_ps(v, _mm256_setzero_ps(), low);
            _mm256_blendv_ps(v, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
        }
    }

    fn lanes(v: __m256) -> [f32; ROW_LANES] {
        let mut a = [0f32; ROW_LANES];
        // SAFETY: `a` holds eight f32 (an unaligned store).
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
        a
    }

    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_sum(x: &[f32]) -> (f32, f32) {
        let max = row_max(x);
        let mut chunks = x.chunks_exact(ROW_LANES);
        // SAFETY: each load reads one whole chunk of eight; AVX2 and FMA are available.
        let s = unsafe {
            let (m, mut s) = (_mm256_set1_ps(max), _mm256_setzero_ps());
            for c in &mut chunks {
                s = _mm256_add_ps(s, exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m)));
            }
            s
        };
        let tail: f32 = chunks
            .remainder()
            .iter()
            .map(|&v| exp_nonpositive(v - max))
            .sum();
        (max, lanes(s).iter().sum::<f32>() + tail)
    }

    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn entropy(x: &[f32]) -> f32 {
        let max = row_max(x);
        let mut chunks = x.chunks_exact(ROW_LANES);
        // SAFETY: as in `exp_sum`.
        let (z, s) = unsafe {
            let (m, mut z, mut s) = (
                _mm256_set1_ps(max),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
            );
            for c in &mut chunks {
                let d = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m);
                let e = exp8(d);
                z = _mm256_add_ps(z, e);
                s = _mm256_add_ps(s, _mm256_mul_ps(e, d));
            }
            (z, s)
        };
        let (zt, st) = entropy_sums(chunks.remainder(), max);
        let (z, s) = (
            lanes(z).iter().sum::<f32>() + zt,
            lanes(s).iter().sum::<f32>() + st,
        );
        z.ln() - s / z
    }

    /// # Safety
    /// AVX2 and FMA must be available.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_grad(x: &[f32], d: &mut [f32], lse: f32, g: f32) {
        let n = x.len().min(d.len());
        let whole = n / ROW_LANES * ROW_LANES;
        // SAFETY: each load and store touches eight values below `whole ≤ n`, within both
        // slices; AVX2 and FMA are available.
        unsafe {
            let (l, ng) = (_mm256_set1_ps(lse), _mm256_set1_ps(-g));
            for i in (0..whole).step_by(ROW_LANES) {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x.as_ptr().add(i)), l));
                _mm256_storeu_ps(d.as_mut_ptr().add(i), _mm256_mul_ps(ng, e));
            }
        }
        for i in whole..n {
            d[i] = -g * exp_nonpositive(x[i] - lse);
        }
    }
}

/// The backward of [`token_logps`]: `dlogits[r] = g[r] · (onehot(label) − softmax(row))`,
/// written contiguous `[rows, vocab]`.
pub fn token_logps_backward(
    logits: &[f32],
    rows: &Rows,
    labels: &[u32],
    lse: &[f32],
    g: &[f32],
    dlogits: &mut [f32],
) -> Result<(), KernelError> {
    let op = "token_logps_backward";
    rows.check(op, logits.len())?;
    for (what, len) in [("labels", labels.len()), ("lse", lse.len()), ("g", g.len())] {
        check_len(op, what, len, rows.rows, &[rows.rows])?;
    }
    let v = rows.vocab;
    check_len(op, "dlogits", dlogits.len(), rows.rows * v, &[rows.rows, v])?;
    let isa = Isa::detect();
    dlogits.par_chunks_mut(v).enumerate().for_each(|(r, d)| {
        let x = &logits[rows.at(r)..rows.at(r) + v];
        isa.softmax_grad(x, &mut *d, lse[r], g[r]);
        d[labels[r] as usize] += g[r];
    });
    Ok(())
}

/// `out[r]` = the entropy of `softmax(logits[r])`: with `e = exp(x − max)` and `Z = Σ e`,
/// `H = ln Z − Σ e·(x − max) / Z` (the unfused ops' `ln Z − Σ p·(x − max)`, the division
/// moved out of the sum).
pub fn token_entropy(logits: &[f32], rows: &Rows, out: &mut [f32]) -> Result<(), KernelError> {
    let op = "token_entropy";
    rows.check(op, logits.len())?;
    check_len(op, "out", out.len(), rows.rows, &[rows.rows])?;
    let isa = Isa::detect();
    out.par_iter_mut().enumerate().for_each(|(r, o)| {
        let x = &logits[rows.at(r)..rows.at(r) + rows.vocab];
        *o = isa.entropy(x);
    });
    Ok(())
}

/// Per row: the index of the largest logit (the first on a tie, as `torch.argmax`) and the
/// sum of the logits (TRL's logged `logits/*` figures), each row in one pass.
pub fn argmax_and_sum(
    logits: &[f32],
    rows: &Rows,
    argmax: &mut [u32],
    sum: &mut [f32],
) -> Result<(), KernelError> {
    let op = "argmax_and_sum";
    rows.check(op, logits.len())?;
    check_len(op, "argmax", argmax.len(), rows.rows, &[rows.rows])?;
    check_len(op, "sum", sum.len(), rows.rows, &[rows.rows])?;
    argmax
        .par_iter_mut()
        .zip(sum.par_iter_mut())
        .enumerate()
        .for_each(|(r, (a, s))| {
            let x = &logits[rows.at(r)..rows.at(r) + rows.vocab];
            let (mut best, mut at) = (f32::NEG_INFINITY, 0usize);
            for (j, &v) in x.iter().enumerate() {
                if v > best {
                    best = v;
                    at = j;
                }
            }
            *a = at as u32;
            *s = x.iter().sum();
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ops::test_values::lcg;

    fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n).map(|_| lcg(&mut s) * scale).collect()
    }

    fn close(a: f32, b: f64, tol: f64) -> bool {
        (f64::from(a) - b).abs() <= tol * (1.0 + b.abs())
    }

    /// Each kernel against a textbook f64 computation of the same formula, and each backward
    /// against central differences of that formula.
    #[test]
    fn swiglu_and_its_backward_match_f64() {
        let (g, u, dy) = (
            values(1000, 1, 6.0),
            values(1000, 2, 2.0),
            values(1000, 3, 1.0),
        );
        let mut y = vec![0.0; 1000];
        swiglu(&g, &u, &mut y).unwrap();
        let (mut dg, mut du) = (vec![0.0; 1000], vec![0.0; 1000]);
        swiglu_backward(&g, &u, &dy, &mut dg, &mut du).unwrap();
        let f = |g: f64, u: f64| g / (1.0 + (-g).exp()) * u;
        for i in 0..1000 {
            let (gi, ui, di) = (f64::from(g[i]), f64::from(u[i]), f64::from(dy[i]));
            assert!(close(y[i], f(gi, ui), 1e-6), "y[{i}]");
            let h = 1e-4;
            let dg_want = di * (f(gi + h, ui) - f(gi - h, ui)) / (2.0 * h);
            assert!(
                close(dg[i], dg_want, 1e-5),
                "dg[{i}]: {} vs {dg_want}",
                dg[i]
            );
            assert!(close(du[i], di * f(gi, 1.0), 1e-6), "du[{i}]");
        }
    }

    #[test]
    fn rms_norm_and_its_backward_match_f64() {
        let (rows, cols, eps) = (37, 96, 1e-5f32);
        let (x, w, dy) = (
            values(rows * cols, 4, 3.0),
            values(cols, 5, 1.0),
            values(rows * cols, 6, 1.0),
        );
        let (mut y, mut rstd) = (vec![0.0; rows * cols], vec![0.0; rows]);
        rms_norm(&x, &w, cols, eps, &mut y, &mut rstd).unwrap();
        let (mut dx, mut dw) = (vec![0.0; rows * cols], vec![0.0; cols]);
        rms_norm_backward(&x, &w, &rstd, &dy, cols, &mut dx, &mut dw).unwrap();
        // f(x) = Σ dy · w · x / sqrt(mean(x²) + eps): its gradient in x and w.
        let loss = |x: &[f64], w: &[f64]| -> f64 {
            x.chunks(cols)
                .zip(dy.chunks(cols))
                .map(|(x, dy)| {
                    let d = (x.iter().map(|v| v * v).sum::<f64>() / cols as f64 + f64::from(eps))
                        .sqrt();
                    (0..cols)
                        .map(|i| f64::from(dy[i]) * w[i] * x[i] / d)
                        .sum::<f64>()
                })
                .sum()
        };
        let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let w64: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
        for r in 0..rows {
            let row = &x64[r * cols..(r + 1) * cols];
            let d = (row.iter().map(|v| v * v).sum::<f64>() / cols as f64 + f64::from(eps)).sqrt();
            for i in 0..cols {
                assert!(
                    close(y[r * cols + i], w64[i] * row[i] / d, 1e-5),
                    "y[{r},{i}]"
                );
            }
        }
        let h = 1e-5;
        for idx in [0, 17, 95, 500, rows * cols - 1] {
            let (mut a, mut b) = (x64.clone(), x64.clone());
            a[idx] += h;
            b[idx] -= h;
            let want = (loss(&a, &w64) - loss(&b, &w64)) / (2.0 * h);
            assert!(
                close(dx[idx], want, 1e-4),
                "dx[{idx}]: {} vs {want}",
                dx[idx]
            );
        }
        for i in [0, 50, 95] {
            let (mut a, mut b) = (w64.clone(), w64.clone());
            a[i] += h;
            b[i] -= h;
            let want = (loss(&x64, &a) - loss(&x64, &b)) / (2.0 * h);
            assert!(close(dw[i], want, 1e-4), "dw[{i}]: {} vs {want}", dw[i]);
        }
    }

    #[test]
    fn rope_and_its_transpose_match_f64() {
        let (rows, t, d) = (3, 5, 8);
        let x = values(rows * t * d, 7, 1.0);
        let (cos, sin) = (values(t * d, 8, 1.0), values(t * d, 9, 1.0));
        let (mut y, mut back) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        rope(&x, &cos, &sin, t, d, false, &mut y).unwrap();
        let dy = values(x.len(), 10, 1.0);
        rope(&dy, &cos, &sin, t, d, true, &mut back).unwrap();
        let h = d / 2;
        // y = M x per position; the transpose gives <M x, dy> = <x, Mᵀ dy>.
        let (mut lhs, mut rhs) = (0f64, 0f64);
        for r in 0..rows {
            for p in 0..t {
                for i in 0..d {
                    let at = (r * t + p) * d;
                    let rot = if i < h { -x[at + i + h] } else { x[at + i - h] };
                    let want = f64::from(x[at + i]) * f64::from(cos[p * d + i])
                        + f64::from(rot) * f64::from(sin[p * d + i]);
                    assert!(close(y[at + i], want, 1e-6), "y[{r},{p},{i}]");
                    lhs += f64::from(y[at + i]) * f64::from(dy[at + i]);
                    rhs += f64::from(x[at + i]) * f64::from(back[at + i]);
                }
            }
        }
        assert!(
            (lhs - rhs).abs() < 1e-4 * (1.0 + lhs.abs()),
            "{lhs} vs {rhs}"
        );
    }

    #[test]
    fn token_logps_and_its_backward_match_f64_on_strided_rows() {
        // Two sequences of 4 positions over a vocabulary of 7; the rows are the first 3
        // positions of each (a narrowed view, as the shifted logits are).
        let (batch, t, v) = (2, 4, 7);
        let logits = values(batch * t * v, 13, 8.0);
        let rows = Rows {
            rows: batch * (t - 1),
            vocab: v,
            per_group: t - 1,
            group_stride: t * v,
            start: 0,
        };
        let labels = [0u32, 6, 3, 2, 2, 5];
        let (mut out, mut lse) = (vec![0.0; 6], vec![0.0; 6]);
        token_logps(&logits, &rows, &labels, &mut out, &mut lse).unwrap();
        let g = values(6, 14, 1.0);
        let mut d = vec![0.0; 6 * v];
        token_logps_backward(&logits, &rows, &labels, &lse, &g, &mut d).unwrap();
        for r in 0..6 {
            let at = (r / 3) * t * v + (r % 3) * v;
            let x: Vec<f64> = logits[at..at + v].iter().map(|&x| f64::from(x)).collect();
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z = m + x.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            let l = labels[r] as usize;
            assert!(close(out[r], x[l] - z, 1e-6), "out[{r}]");
            for j in 0..v {
                let want = f64::from(g[r]) * (f64::from(u8::from(j == l)) - (x[j] - z).exp());
                assert!(close(d[r * v + j], want, 1e-6), "d[{r},{j}]");
            }
        }
        let bad_label = [7u32, 0, 0, 0, 0, 0];
        assert!(token_logps(&logits, &rows, &bad_label, &mut out, &mut lse).is_err());
    }

    /// The vocabulary's row passes (eight lanes, a polynomial `exp`) against f64 on rows of
    /// every length around the lane width and long ones, logits spread wide enough that most
    /// `exp` underflow, one row with a masked (−∞) logit, on the dispatched build and the
    /// portable one.
    #[test]
    fn vocabulary_row_passes_match_f64_at_every_length() {
        for v in [1usize, 2, 7, 8, 9, 15, 16, 17, 63, 300, 4099] {
            for (seed, scale) in [(3u64, 1.0f32), (4, 40.0)] {
                let mut logits = values(3 * v, seed + v as u64, scale);
                if v > 1 {
                    // Not the row's only logit (a row all −∞ is NaN, in f64 too).
                    logits[v + v / 2] = f32::NEG_INFINITY;
                }
                let rows = Rows {
                    rows: 3,
                    vocab: v,
                    per_group: 3,
                    group_stride: 3 * v,
                    start: 0,
                };
                let labels = [0u32, (v / 3) as u32, (v - 1) as u32];
                let (mut out, mut lse, mut ent) = (vec![0.0; 3], vec![0.0; 3], vec![0.0; 3]);
                token_logps(&logits, &rows, &labels, &mut out, &mut lse).unwrap();
                token_entropy(&logits, &rows, &mut ent).unwrap();
                let g = [0.5f32, -1.25, 2.0];
                let mut d = vec![0.0; 3 * v];
                token_logps_backward(&logits, &rows, &labels, &lse, &g, &mut d).unwrap();
                for r in 0..3 {
                    let x: Vec<f64> = logits[r * v..(r + 1) * v]
                        .iter()
                        .map(|&x| f64::from(x))
                        .collect();
                    let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = x.iter().map(|x| (x - m).exp()).sum();
                    let lz = m + z.ln();
                    let h = z.ln()
                        - x.iter()
                            .map(|x| {
                                let e = (x - m).exp();
                                if e > 0.0 { e * (x - m) } else { 0.0 }
                            })
                            .sum::<f64>()
                            / z;
                    let l = labels[r] as usize;
                    let at = format!("vocab {v}, scale {scale}, row {r}");
                    assert!(
                        close(out[r], x[l] - lz, 1e-6),
                        "logp {at}: {} vs {}",
                        out[r],
                        x[l] - lz
                    );
                    assert!(close(lse[r], lz, 1e-6), "lse {at}");
                    if r == 1 && v > 1 {
                        // `e · (x − max)` is 0 · −∞ at a masked logit: NaN, as PyTorch's
                        // `Σ softmax · logits` (TRL's `entropy_from_logits`) gives.
                        assert!(ent[r].is_nan(), "entropy {at}: {}", ent[r]);
                    } else {
                        assert!(close(ent[r], h, 2e-6), "entropy {at}: {} vs {h}", ent[r]);
                    }
                    // `x − lse` carries the rounding of `lse` (an ulp of its magnitude), which
                    // `1 − softmax` at the label can magnify: the f32 formula's own error.
                    let slack = f64::from(g[r].abs() * 8.0 * f32::EPSILON * lse[r].abs().max(1.0));
                    for j in 0..v {
                        let want =
                            f64::from(g[r]) * (f64::from(u8::from(j == l)) - (x[j] - lz).exp());
                        assert!(
                            (f64::from(d[r * v + j]) - want).abs()
                                <= 1e-6 * (1.0 + want.abs()) + slack,
                            "d {at}, {j}: {} vs {want}",
                            d[r * v + j]
                        );
                    }
                    // The portable build (no AVX2 + FMA: `mul_add` in software, the same lanes
                    // in the same order) computes the same bits as the dispatched one.
                    let row = &logits[r * v..(r + 1) * v];
                    let isa = Isa::detect();
                    let (a, b) = (RowExpSum(row).work(), isa.exp_sum(row));
                    assert_eq!(
                        (a.0.to_bits(), a.1.to_bits()),
                        (b.0.to_bits(), b.1.to_bits()),
                        "{at}"
                    );
                    let (a, b) = (RowEntropy(row).work(), isa.entropy(row));
                    assert!(
                        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                        "{at}"
                    );
                    let (mut da, mut db) = (vec![0f32; v], vec![0f32; v]);
                    RowSoftmaxGrad {
                        x: row,
                        d: &mut da,
                        lse: lse[r],
                        g: g[r],
                    }
                    .work();
                    isa.softmax_grad(row, &mut db, lse[r], g[r]);
                    let bits = |d: &[f32]| d.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&da), bits(&db), "{at}");
                }
            }
        }
    }

    #[test]
    fn token_entropy_matches_f64_on_strided_rows() {
        // Two sequences of 5 positions over a vocabulary of 9, the first 4 of each; one row
        // nearly one-hot (entropy near 0), one flat (entropy ln 9).
        let (batch, t, v) = (2, 5, 9);
        let mut logits = values(batch * t * v, 15, 6.0);
        logits[..v].iter_mut().for_each(|x| *x = 0.0);
        logits[v] = 80.0;
        let rows = Rows {
            rows: batch * (t - 1),
            vocab: v,
            per_group: t - 1,
            group_stride: t * v,
            start: 0,
        };
        let mut out = vec![0.0; 8];
        token_entropy(&logits, &rows, &mut out).unwrap();
        for (r, &got) in out.iter().enumerate() {
            let at = (r / 4) * t * v + (r % 4) * v;
            let x: Vec<f64> = logits[at..at + v].iter().map(|&x| f64::from(x)).collect();
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = x.iter().map(|v| (v - m).exp()).sum();
            let h: f64 = -x
                .iter()
                .map(|v| {
                    let p = (v - m).exp() / z;
                    if p > 0.0 { p * p.ln() } else { 0.0 }
                })
                .sum::<f64>();
            assert!(close(got, h, 1e-5), "row {r}: {got} vs {h}");
        }
        assert!(close(out[0], 9f64.ln(), 1e-6), "the flat row");
        assert!(out[1].abs() < 1e-6, "the one-hot row: {}", out[1]);
        assert!(token_entropy(&logits, &rows, &mut [0.0; 7]).is_err());
    }

    /// Attention by the textbook in f64: `[batch, heads, tq, tk]` probabilities, the output,
    /// and the gradients from `do` (`ds = p·(dp − Σ dp·p)`).
    #[allow(clippy::type_complexity)]
    fn attention_f64(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        d_o: &[f32],
        h: &Heads<'_>,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (g, dim) = (h.heads / h.kv_heads, h.dim);
        let mut o = vec![0f64; q.len()];
        let (mut dq, mut dk, mut dv) = (
            vec![0f64; q.len()],
            vec![0f64; k.len()],
            vec![0f64; v.len()],
        );
        for b in 0..h.batch {
            for hh in 0..h.heads {
                let kvh = hh / g;
                let qa =
                    |i: usize, d: usize| f64::from(q[((b * h.heads + hh) * h.tq + i) * dim + d]);
                let ka = |j: usize, d: usize| ((b * h.kv_heads + kvh) * h.tk + j) * dim + d;
                for i in 0..h.tq {
                    let mut s = vec![0f64; h.tk];
                    for j in 0..h.tk {
                        let mut dotp = 0f64;
                        for d in 0..dim {
                            dotp += qa(i, d) * f64::from(k[ka(j, d)]);
                        }
                        s[j] = dotp * f64::from(h.scale)
                            + f64::from(h.causal[i * h.tk + j])
                            + h.keys.map_or(0.0, |m| f64::from(m[b * h.tk + j]));
                    }
                    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    let p: Vec<f64> = e.iter().map(|x| x / sum).collect();
                    let row = ((b * h.heads + hh) * h.tq + i) * dim;
                    for j in 0..h.tk {
                        for d in 0..dim {
                            o[row + d] += p[j] * f64::from(v[ka(j, d)]);
                        }
                    }
                    let dp: Vec<f64> = (0..h.tk)
                        .map(|j| {
                            (0..dim)
                                .map(|d| f64::from(d_o[row + d]) * f64::from(v[ka(j, d)]))
                                .sum()
                        })
                        .collect();
                    let c: f64 = (0..h.tk).map(|j| dp[j] * p[j]).sum();
                    for j in 0..h.tk {
                        let ds = p[j] * (dp[j] - c) * f64::from(h.scale);
                        for d in 0..dim {
                            dq[row + d] += ds * f64::from(k[ka(j, d)]);
                            dk[ka(j, d)] += ds * qa(i, d);
                            dv[ka(j, d)] += p[j] * f64::from(d_o[row + d]);
                        }
                    }
                }
            }
        }
        (o, dq, dk, dv)
    }

    /// The streamed attention and its backward against the textbook, with grouped heads, a
    /// sliding window, a key mask and queries after cached keys (`tq < tk`); a head size that
    /// is not a multiple of eight takes the dot products' tails.
    #[test]
    fn attention_and_its_backward_match_the_textbook_in_f64() {
        for (batch, heads, kv_heads, tq, tk, dim, window, keyed) in [
            (2, 4, 2, 7, 7, 16, None, true),
            (1, 6, 2, 5, 9, 12, Some(4usize), false),
            (3, 2, 2, 33, 33, 8, None, true),
            (1, 3, 1, 1, 20, 20, None, false),
            // Whole query and key blocks and their tails: 4·9 rows, 37 keys, a 64-wide head.
            (1, 4, 1, 37, 37, 64, None, true),
            (2, 2, 1, 19, 40, 24, Some(17), true),
        ] {
            let q = values(batch * heads * tq * dim, 11, 2.0);
            let k = values(batch * kv_heads * tk * dim, 12, 2.0);
            let v = values(batch * kv_heads * tk * dim, 13, 3.0);
            let d_o = values(q.len(), 14, 1.0);
            let start = tk - tq;
            let causal: Vec<f32> = (0..tq)
                .flat_map(|i| {
                    (0..tk).map(move |j| {
                        let i = start + i;
                        if j > i || window.is_some_and(|w| i - j >= w) {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            // The first key of every other sequence hidden (the value a padded batch adds).
            let keys: Vec<f32> = (0..batch * tk)
                .map(|x| {
                    if x % tk == 0 && (x / tk) % 2 == 1 {
                        -1e9
                    } else {
                        0.0
                    }
                })
                .collect();
            let h = Heads {
                batch,
                heads,
                kv_heads,
                tq,
                tk,
                dim,
                scale: 1.0 / (dim as f32).sqrt(),
                causal: &causal,
                keys: keyed.then_some(&keys[..]),
                bf16: false,
            };
            let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; batch * heads * tq]);
            attention(&q, &k, &v, &h, &mut o, &mut lse).unwrap();
            let (want, dq_w, dk_w, dv_w) = attention_f64(&q, &k, &v, &d_o, &h);
            let (mut dq, mut dk, mut dv) = (
                vec![9f32; q.len()],
                vec![9f32; k.len()],
                vec![9f32; v.len()],
            );
            attention_backward(&q, &k, &v, &o, &lse, &d_o, &h, &mut dq, &mut dk, &mut dv).unwrap();
            for (name, got, want) in [
                ("o", &o, &want),
                ("dq", &dq, &dq_w),
                ("dk", &dk, &dk_w),
                ("dv", &dv, &dv_w),
            ] {
                for (i, (&a, &b)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        close(a, b, 1e-4),
                        "{name}[{i}]: {a} against {b} (shape {batch}×{heads}/{kv_heads}×{tq}×{tk}×{dim})"
                    );
                }
            }
        }
    }

    /// A query row that sees no key (its causal row all −∞) has no softmax: its output and
    /// log-sum-exp are NaN; the rows of its block that see keys are unaffected.
    #[test]
    fn a_row_that_sees_no_key_is_nan() {
        let (tq, tk, dim) = (3, 4, 8);
        let q = values(tq * dim, 1, 1.0);
        let (k, v) = (values(tk * dim, 2, 1.0), values(tk * dim, 3, 1.0));
        let mut causal = vec![0f32; tq * tk];
        causal[tk..2 * tk].fill(f32::NEG_INFINITY);
        let h = Heads {
            batch: 1,
            heads: 1,
            kv_heads: 1,
            tq,
            tk,
            dim,
            scale: 0.5,
            causal: &causal,
            keys: None,
            bf16: false,
        };
        let (mut o, mut lse) = (vec![0f32; q.len()], vec![0f32; tq]);
        attention(&q, &k, &v, &h, &mut o, &mut lse).unwrap();
        assert!(lse[1].is_nan() && o[dim..2 * dim].iter().all(|x| x.is_nan()));
        let (want, ..) = attention_f64(&q, &k, &v, &q, &h);
        for i in (0..dim).chain(2 * dim..3 * dim) {
            assert!(
                close(o[i], want[i], 1e-5),
                "o[{i}] {} against {}",
                o[i],
                want[i]
            );
        }
    }

    /// The attention's `exp` against f64's on a sweep of `[−90, 0]`: within 2 ulp (relative
    /// 2.4e-7) where the result is a normal float, 0 below −87 and at −∞.
    #[test]
    fn exp_nonpositive_is_within_two_ulp() {
        let mut worst = 0f64;
        for i in 0..=900_000 {
            let x = -(i as f32) * 1e-4;
            let got = exp_nonpositive(x);
            if x < -87.0 {
                assert_eq!(got, 0.0, "exp({x})");
                continue;
            }
            let want = f64::from(x).exp();
            let rel = ((f64::from(got) - want) / want).abs();
            worst = worst.max(rel);
            assert!(
                rel < 2.4e-7,
                "exp({x}) = {got}, want {want} (relative {rel:e})"
            );
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
        assert!(worst > 0.0);
    }

    #[test]
    fn attention_refuses_heads_that_do_not_group() {
        let h = Heads {
            batch: 1,
            heads: 3,
            kv_heads: 2,
            tq: 1,
            tk: 1,
            dim: 1,
            scale: 1.0,
            causal: &[0.0],
            keys: None,
            bf16: false,
        };
        let e = attention(
            &[0.0; 3],
            &[0.0; 2],
            &[0.0; 2],
            &h,
            &mut [0.0; 3],
            &mut [0.0; 3],
        );
        assert!(e.unwrap_err().to_string().contains("groups of 2"));
    }

    #[test]
    fn argmax_and_sum_take_the_first_largest_and_the_row_sum() {
        let x = [1.0f32, 3.0, 3.0, -2.0, 0.5, -1.0, -1.0, -7.0];
        let rows = Rows {
            rows: 2,
            vocab: 4,
            per_group: 2,
            group_stride: 8,
            start: 0,
        };
        let (mut a, mut s) = ([9u32; 2], [9f32; 2]);
        argmax_and_sum(&x, &rows, &mut a, &mut s).unwrap();
        assert_eq!(a, [1, 0]);
        assert_eq!(s, [5.0, -8.5]);
    }
}
