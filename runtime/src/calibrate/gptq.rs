//! GPTQ (`kiln export --calib FILE --algorithm gptq`): llm-compressor 0.14's `GPTQModifier`.
//!
//! For each decoder layer in turn (llm-compressor's sequential pipeline): every sample goes
//! through the layer with its weights as they are, and each quantized Linear's inputs `X`
//! accumulate its Hessian `H = Σ 2 XᵀX / samples` (f32, `accumulate_hessian`); then every
//! Linear of the layer is quantized column by column, each column's rounding error spread over
//! the columns not yet quantized through the inverse Hessian (block size 128, dampening 0.01 of
//! the mean diagonal, `quantize_weight`); then the samples go through the layer again, now
//! with the quantized weights, to give the next layer its inputs. The scales and zero points
//! are the round-to-nearest ones of the original weight (llm-compressor's observer runs before
//! GPTQ), so GPTQ chooses only the integer codes: they are spilled to a temporary folder, one
//! file a Linear, and the writer reads them in place of its own rounding. Memory holds one
//! layer, its Hessians and the samples' hidden states.
//!
//! Activation ordering (`actorder`, llm-compressor's default `static`, i.e. `weight`): columns
//! are visited by decreasing Hessian diagonal, each keeping its own group's scale.
//!
//! The grids ([`GptqGrid`]): compressed-tensors' integers (`w4a16`, `w4a16-asym`, `w8a16`) and
//! NVFP4 (`nvfp4a16`: E2M1 codes on the observer's FP8 group scales under the global scale,
//! llm-compressor's `TENSOR_GROUP`), both as above; and MLX's affine `q2`/`q4`/`q8` as
//! mlx-lm's `mlx_lm.quant.gptq` runs it ([`GptqSettings::mlx_lm`]): every Hessian from the
//! original model in one pass (`H = Σ XᵀX`; its scale cancels), groups as blocks, and each
//! group's scale and bias chosen from its columns as GPTQ reaches them, so the writer stores
//! GPTQ's scales and biases as well as its codes.

use super::max::LayerCalibration;
use crate::checkpoint::Checkpoint;
use crate::model::{DecoderModel, ModelError, NoObserver, Observer};
use candle_core::{DType, Device, Tensor};
use kiln_kernels::ops::round_half_even;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

pub use crate::export::writer::{GptqGrid, IntGrid};

/// How GPTQ runs (llm-compressor's `GPTQModifier` fields and defaults; [`GptqSettings::mlx_lm`]
/// for mlx-lm's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptqSettings {
    /// Columns updated together (`block_size`, 128).
    pub block: usize,
    /// The dampening added to the Hessian's diagonal, as a fraction of its mean
    /// (`dampening_frac`, 0.01).
    pub dampening: f32,
    /// Visit columns by decreasing Hessian diagonal (`actorder="static"`, the default).
    pub actorder: bool,
    /// llm-compressor's sequential pipeline: layer L's Hessians from the outputs of the
    /// layers before it already quantized. `false`: every Hessian from the original model in
    /// one pass (mlx-lm's `gptq_quantize`).
    pub sequential: bool,
}

impl Default for GptqSettings {
    fn default() -> Self {
        GptqSettings {
            block: 128,
            dampening: 0.01,
            actorder: true,
            sequential: true,
        }
    }
}

impl GptqSettings {
    /// mlx-lm 0.32's `mlx_lm.quant.gptq`: one pass over the original model, blocks that are
    /// the groups, no activation ordering, dampening 0.01 of the mean diagonal.
    pub fn mlx_lm(group: usize) -> Self {
        GptqSettings {
            block: group,
            dampening: 0.01,
            actorder: false,
            sequential: false,
        }
    }
}

/// For the weight tensor `name`: its values (f32, from the checkpoint's dtype), the grid the
/// writer stores it on with the parameters the writer fixes (the writer's own function, so
/// both agree bit for bit).
pub type GroupParams<'a> = dyn Fn(&str) -> Result<Prepared, ModelError> + Sync + 'a;

/// A weight made ready for GPTQ ([`GroupParams`]).
pub struct Prepared {
    /// The weight's values, f32.
    pub values: Vec<f32>,
    /// The grid it is stored on, with what the writer fixes beforehand.
    pub grid: GptqGrid,
    /// Rounding of a dequantized value to the dtype the format dequantizes in
    /// (compressed-tensors' integers: `(q − zp).to(scale.dtype) * scale`).
    pub round: fn(f32) -> f32,
}

/// One Linear quantized by GPTQ.
#[derive(Debug, Clone)]
pub struct Quantized {
    /// The codes, `[rows, cols]` row-major, in the original column order (see
    /// [`crate::export::writer::ChosenCodes::codes`]).
    pub codes: Vec<i8>,
    /// The dequantized weight (f32).
    pub values: Vec<f32>,
    /// GPTQ's loss, `Σ err² / 2` (llm-compressor's logged figure).
    pub loss: f64,
    /// The Hessian could not be factorized: round to nearest was used (llm-compressor's
    /// fallback).
    pub rtn_fallback: bool,
    /// [`GptqGrid::Affine`]: the `(scale, bias)` chosen per group, `[rows, cols / group]`.
    pub params: Option<Vec<(f32, f32)>>,
}

/// The dampened Hessian with dead inputs handled, and its inverse factor `U` (`UᵀU = H⁻¹`;
/// the identity when `H` cannot be factorized).
fn inverse_factor(hp: &mut [f64], cols: usize, dampening: f32) -> (Vec<f32>, bool) {
    let mean = (0..cols).map(|i| hp[i * cols + i]).sum::<f64>() / cols as f64;
    let damp = f64::from(dampening) * mean;
    for i in 0..cols {
        hp[i * cols + i] += damp;
    }
    match inverse_upper_cholesky(hp, cols) {
        Some(u) => (u, false),
        None => {
            let mut eye = vec![0f32; cols * cols];
            for i in 0..cols {
                eye[i * cols + i] = 1.0;
            }
            (eye, true)
        }
    }
}

/// GPTQ of one weight `w` (`[rows, cols]` f32) against its Hessian `h` (`[cols, cols]`,
/// already divided by the number of samples) on `grid`; for fixed grids each dequantized
/// value is rounded by `round` (the scales' dtype).
pub fn quantize(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f32],
    grid: &GptqGrid,
    round: fn(f32) -> f32,
    settings: GptqSettings,
) -> Quantized {
    match *grid {
        GptqGrid::Int { grid, ref params } => {
            let (lo, hi) = grid.range();
            let groups = cols / grid.group;
            quantize_fixed(w, rows, cols, h, grid.group, settings, |r, g, x| {
                let (s, zp) = params[r * groups + g];
                let zp = f32::from(zp);
                let q = round_half_even((x / s + zp).clamp(lo, hi));
                (q as i8, round((q - zp) * s))
            })
        }
        GptqGrid::Fp4 { group, ref scales } => {
            use kiln_kernels::formats::fp4::{e2m1_to_f32, f32_to_e2m1_nvfp4};
            let groups = cols / group;
            quantize_fixed(w, rows, cols, h, group, settings, |r, g, x| {
                // compressed-tensors' `_quantize` / `_dequantize` with the effective scale.
                let s = scales[r * groups + g];
                let mut code = f32_to_e2m1_nvfp4((x / s).clamp(-6.0, 6.0));
                // A value GPTQ rounds to zero is stored as +0 (llm-compressor compresses the
                // dequantized weight, whose zeros have no sign bit in its packing).
                if code & 7 == 0 {
                    code = 0;
                }
                (code as i8, round(e2m1_to_f32(code) * s))
            })
        }
        GptqGrid::Affine { bits, group } => {
            quantize_affine(w, rows, cols, h, bits, group, settings)
        }
    }
}

/// GPTQ on parameters fixed beforehand (llm-compressor's): `q(row, group, value)` gives a
/// value's code and its dequantized value.
fn quantize_fixed(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f32],
    group: usize,
    settings: GptqSettings,
    q: impl Fn(usize, usize, f32) -> (i8, f32) + Sync,
) -> Quantized {
    // Column order: decreasing diagonal (a stable sort: ties keep their order).
    let mut perm: Vec<usize> = (0..cols).collect();
    if settings.actorder {
        perm.sort_by(|&a, &b| h[b * cols + b].total_cmp(&h[a * cols + a]));
    }
    let mut hp = vec![0f64; cols * cols];
    for (i, &pi) in perm.iter().enumerate() {
        for (j, &pj) in perm.iter().enumerate() {
            hp[i * cols + j] = f64::from(h[pi * cols + pj]);
        }
    }
    let mut wp = vec![0f32; rows * cols];
    for r in 0..rows {
        for (i, &pi) in perm.iter().enumerate() {
            wp[r * cols + i] = w[r * cols + pi];
        }
    }
    // Dead inputs (never non-zero): diagonal 1, weight column 0.
    for i in 0..cols {
        if hp[i * cols + i] == 0.0 {
            hp[i * cols + i] = 1.0;
            for r in 0..rows {
                wp[r * cols + i] = 0.0;
            }
        }
    }
    let (u, rtn_fallback) = inverse_factor(&mut hp, cols, settings.dampening);
    // Each row is independent given U: tiles of rows run in parallel, each column by column
    // with llm-compressor's block-lazy update (the same arithmetic row by row); a tile shares
    // each row of U it reads.
    const TILE: usize = 8;
    let tiles: Vec<(Vec<i8>, Vec<f32>, f64)> = wp
        .par_chunks(cols * TILE)
        .enumerate()
        .map(|(t, tile)| {
            let n = tile.len() / cols;
            let mut w = tile.to_vec();
            let mut codes = vec![0i8; tile.len()];
            let mut deq = vec![0f32; tile.len()];
            let mut loss = 0f64;
            let mut err = vec![0f32; settings.block * n];
            for i1 in (0..cols).step_by(settings.block) {
                let i2 = (i1 + settings.block).min(cols);
                for i in i1..i2 {
                    let g = perm[i] / group;
                    let urow = &u[i * cols..i * cols + i2];
                    for r in 0..n {
                        let wr = &mut w[r * cols..(r + 1) * cols];
                        let (code, dq) = q(t * TILE + r, g, wr[i]);
                        codes[r * cols + i] = code;
                        deq[r * cols + i] = dq;
                        let e = (wr[i] - dq) / urow[i];
                        loss += f64::from(e) * f64::from(e);
                        err[r * settings.block + i - i1] = e;
                        for j in i + 1..i2 {
                            wr[j] -= e * urow[j];
                        }
                    }
                }
                later_columns(&mut w, &err, &u, n, cols, settings.block, i1, i2);
            }
            (codes, deq, loss / 2.0)
        })
        .collect();
    let mut codes = vec![0i8; rows * cols];
    let mut values = vec![0f32; rows * cols];
    let mut loss = 0f64;
    for (t, (c, d, l)) in tiles.into_iter().enumerate() {
        for r in 0..c.len() / cols {
            let row = (t * TILE + r) * cols;
            for (i, &pi) in perm.iter().enumerate() {
                codes[row + pi] = c[r * cols + i];
                values[row + pi] = d[r * cols + i];
            }
        }
        loss += l;
    }
    Quantized {
        codes,
        values,
        loss,
        rtn_fallback,
        params: None,
    }
}

/// A block's error on every later column of the `n` rows of `w`: `W[:, i2:] −= Err ·
/// U[i1:i2, i2:]` (`err` holds `block` values a row).
#[allow(clippy::too_many_arguments)]
fn later_columns(
    w: &mut [f32],
    err: &[f32],
    u: &[f32],
    n: usize,
    cols: usize,
    block: usize,
    i1: usize,
    i2: usize,
) {
    for k in 0..i2 - i1 {
        let urow = &u[(i1 + k) * cols + i2..(i1 + k + 1) * cols];
        for r in 0..n {
            let e = err[r * block + k];
            let wr = &mut w[r * cols + i2..(r + 1) * cols];
            for (wj, &uj) in wr.iter_mut().zip(urow) {
                *wj -= e * uj;
            }
        }
    }
}

/// mlx-lm's GPTQ on MLX's affine grid (`mlx_lm/quant/gptq.py`): group by group, each group's
/// scale and bias from `mx.quantize` of its columns as they stand after the earlier groups'
/// updates; within the group, column by column, `q = clip(round((w − b) / s), 0, 2^bits − 1)`,
/// `e = (w − (s·q + b)) / U[k,k]` and the group's later columns `−= e · U[k, k:j]`; after
/// the group every later column `−= Err · U[i:j, j:]`. All in f32; no activation ordering and
/// no dead-input rule (the dampening keeps `H` definite).
fn quantize_affine(
    w: &[f32],
    rows: usize,
    cols: usize,
    h: &[f32],
    bits: u32,
    group: usize,
    settings: GptqSettings,
) -> Quantized {
    use kiln_kernels::ops::mlx::affine_scale_bias;
    let mut hp: Vec<f64> = h.iter().map(|&v| f64::from(v)).collect();
    let (u, rtn_fallback) = inverse_factor(&mut hp, cols, settings.dampening);
    let groups = cols / group;
    let n_bins = ((1u32 << bits) - 1) as f32;
    const TILE: usize = 8;
    type Tile = (Vec<i8>, Vec<f32>, Vec<(f32, f32)>, f64);
    let tiles: Vec<Tile> = w
        .par_chunks(cols * TILE)
        .map(|tile| {
            let n = tile.len() / cols;
            let mut w = tile.to_vec();
            let mut codes = vec![0i8; tile.len()];
            let mut deq = vec![0f32; tile.len()];
            let mut params = vec![(0f32, 0f32); n * groups];
            let mut loss = 0f64;
            let mut err = vec![0f32; group * n];
            for (g, i1) in (0..cols).step_by(group).enumerate() {
                let i2 = i1 + group;
                for r in 0..n {
                    let (lo, hi) = w[r * cols + i1..r * cols + i2]
                        .iter()
                        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                            (lo.min(x), hi.max(x))
                        });
                    params[r * groups + g] = affine_scale_bias(lo, hi, bits as usize);
                }
                for i in i1..i2 {
                    let urow = &u[i * cols..i * cols + i2];
                    for r in 0..n {
                        let (s, b) = params[r * groups + g];
                        let wr = &mut w[r * cols..(r + 1) * cols];
                        let q = round_half_even((wr[i] - b) / s).clamp(0.0, n_bins);
                        let dq = s * q + b;
                        codes[r * cols + i] = q as u8 as i8;
                        deq[r * cols + i] = dq;
                        let e = (wr[i] - dq) / urow[i];
                        loss += f64::from(e) * f64::from(e);
                        err[r * group + i - i1] = e;
                        for j in i + 1..i2 {
                            wr[j] -= e * urow[j];
                        }
                    }
                }
                later_columns(&mut w, &err, &u, n, cols, group, i1, i2);
            }
            (codes, deq, params, loss / 2.0)
        })
        .collect();
    let mut codes = Vec::with_capacity(rows * cols);
    let mut values = Vec::with_capacity(rows * cols);
    let mut params = Vec::with_capacity(rows * groups);
    let mut loss = 0f64;
    for (c, d, p, l) in tiles {
        codes.extend(c);
        values.extend(d);
        params.extend(p);
        loss += l;
    }
    Quantized {
        codes,
        values,
        loss,
        rtn_fallback,
        params: Some(params),
    }
}

/// The upper-triangular `U` with `UᵀU = H⁻¹` (f32), for `H` symmetric positive definite
/// (`n × n`, f64); `None` when it is not. llm-compressor computes it as
/// `cholesky(cholesky_inverse(cholesky(H)), upper=True)`; here, with `J` the reversal of
/// rows and columns, `JHJ = L Lᵀ` gives `H = V Vᵀ` with `V = J L J` upper, so `U = V⁻¹ =
/// J L⁻¹ J`: one factorization and one triangular inverse, both blocked so that their work is
/// matrix products (candle's GEMM).
pub fn inverse_upper_cholesky(h: &[f64], n: usize) -> Option<Vec<f32>> {
    let rev = |i: usize| n - 1 - i;
    let mut a = vec![0f64; n * n];
    for i in 0..n {
        for j in 0..n {
            a[i * n + j] = h[rev(i) * n + rev(j)];
        }
    }
    let a = Tensor::from_vec(a, (n, n), &Device::Cpu).ok()?;
    let l = blocked::cholesky(&a).ok()??;
    let linv: Vec<f64> = blocked::invert_lower(&l)
        .ok()?
        .flatten_all()
        .ok()?
        .to_vec1()
        .ok()?;
    let mut u = vec![0f32; n * n];
    for i in 0..n {
        for j in i..n {
            u[i * n + j] = linv[rev(i) * n + rev(j)] as f32;
        }
    }
    Some(u)
}

/// The lower-triangular Cholesky factor of `a` (`n × n`, row-major), column by column, the
/// rows below the diagonal in parallel; `None` if `a` is not positive definite. The base case
/// of [`blocked::cholesky`].
pub fn cholesky(a: &[f64], n: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; n * n];
    for j in 0..n {
        let rest = &mut l[j * n..];
        let row_j: Vec<f64> = rest[..j].to_vec();
        let d = a[j * n + j] - dot(&row_j, &row_j);
        if d.is_nan() || d <= 0.0 {
            return None;
        }
        let d = d.sqrt();
        rest[j] = d;
        rest[n..]
            .par_chunks_mut(n)
            .enumerate()
            .for_each(|(k, row)| {
                let i = j + 1 + k;
                row[j] = (a[i * n + j] - dot(&row[..j], &row_j)) / d;
            });
    }
    Some(l)
}

/// `Σ aᵢbᵢ` with four running sums (so it vectorizes).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut s = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            s[k] += x[k] * y[k];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

/// The inverse of the lower-triangular `l` (`n × n`), each column of the inverse solved on
/// its own (in parallel). The base case of [`blocked::invert_lower`].
pub fn invert_lower(l: &[f64], n: usize) -> Vec<f64> {
    let columns: Vec<Vec<f64>> = (0..n)
        .into_par_iter()
        .map(|c| {
            let mut x = vec![0f64; n];
            x[c] = 1.0 / l[c * n + c];
            for i in c + 1..n {
                let s = dot(&l[i * n + c..i * n + i], &x[c..i]);
                x[i] = -s / l[i * n + i];
            }
            x
        })
        .collect();
    let mut out = vec![0f64; n * n];
    for (c, x) in columns.iter().enumerate() {
        for i in c..n {
            out[i * n + c] = x[i];
        }
    }
    out
}

/// Cholesky factorization and triangular inversion by halves: the halves' products are GEMMs,
/// and below [`blocked::BASE`] rows the scalar routines above run.
mod blocked {
    use candle_core::{Result, Tensor};

    /// The size at which the recursion stops.
    pub const BASE: usize = 128;

    fn vec2(t: &Tensor) -> Result<(Vec<f64>, usize)> {
        Ok((t.flatten_all()?.to_vec1()?, t.dim(0)?))
    }

    fn tensor(v: Vec<f64>, n: usize, like: &Tensor) -> Result<Tensor> {
        Tensor::from_vec(v, (n, n), like.device())
    }

    /// `[[a, 0], [c, d]]`.
    fn lower(a: &Tensor, c: &Tensor, d: &Tensor) -> Result<Tensor> {
        let zeros = Tensor::zeros((a.dim(0)?, d.dim(1)?), a.dtype(), a.device())?;
        Tensor::cat(
            &[&Tensor::cat(&[a, &zeros], 1)?, &Tensor::cat(&[c, d], 1)?],
            0,
        )
    }

    /// `L` with `L Lᵀ = a` (`Ok(None)`: not positive definite). With `a = [[A, Bᵀ], [B, C]]`:
    /// `L₁₁ = chol(A)`, `L₂₁ = B L₁₁⁻ᵀ`, `L₂₂ = chol(C − L₂₁ L₂₁ᵀ)`.
    pub fn cholesky(a: &Tensor) -> Result<Option<Tensor>> {
        let n = a.dim(0)?;
        if n <= BASE {
            let (v, n) = vec2(a)?;
            return super::cholesky(&v, n).map(|l| tensor(l, n, a)).transpose();
        }
        let k = n / 2;
        let (a11, a21, a22) = (
            a.narrow(0, 0, k)?.narrow(1, 0, k)?,
            a.narrow(0, k, n - k)?.narrow(1, 0, k)?,
            a.narrow(0, k, n - k)?.narrow(1, k, n - k)?,
        );
        let Some(l11) = cholesky(&a11.contiguous()?)? else {
            return Ok(None);
        };
        let l21 = a21.contiguous()?.matmul(&invert_lower(&l11)?.t()?)?;
        let s = (a22 - l21.matmul(&l21.t()?)?)?;
        let Some(l22) = cholesky(&s.contiguous()?)? else {
            return Ok(None);
        };
        lower(&l11, &l21, &l22).map(Some)
    }

    /// `l⁻¹` for `l` lower triangular: `[[L₁₁, 0], [L₂₁, L₂₂]]⁻¹ = [[X₁₁, 0], [−X₂₂ L₂₁ X₁₁,
    /// X₂₂]]`.
    pub fn invert_lower(l: &Tensor) -> Result<Tensor> {
        let n = l.dim(0)?;
        if n <= BASE {
            let (v, n) = vec2(l)?;
            return tensor(super::invert_lower(&v, n), n, l);
        }
        let k = n / 2;
        let (l11, l21, l22) = (
            l.narrow(0, 0, k)?.narrow(1, 0, k)?.contiguous()?,
            l.narrow(0, k, n - k)?.narrow(1, 0, k)?.contiguous()?,
            l.narrow(0, k, n - k)?.narrow(1, k, n - k)?.contiguous()?,
        );
        let (x11, x22) = (invert_lower(&l11)?, invert_lower(&l22)?);
        let x21 = x22.matmul(&l21)?.matmul(&x11)?.neg()?;
        lower(&x11, &x21, &x22)
    }
}

/// Every quantized Linear's input Hessian over one layer's samples.
struct Hessians<'f> {
    keep: &'f (dyn Fn(&str) -> bool + Sync),
    /// Module → (`Σ 2 XᵀX`, samples).
    sums: BTreeMap<String, (Tensor, usize)>,
    /// The last input seen and its `XᵀX`: q/k/v (and gate/up) share one input.
    last: Option<(candle_core::TensorId, Tensor)>,
}

/// `sum += 2·xtx` where the sum lies, on the CPU in f32: each value `sum + (xtx·2 + 0)`, the
/// bits of candle's `sum + (xtx * 2.0)` (its `affine` adds the zero) without the two
/// `[cols, cols]` tensors that composition allocates per sample and module (at 8960 inputs,
/// 321 MB each, every one faulted in fresh). Elsewhere, that composition.
fn add_twice(sum: &mut Tensor, xtx: &Tensor) -> Result<(), ModelError> {
    use crate::model::fused::{cpu_values, fusable, with_cpu_values_mut};
    if !(fusable(sum) && fusable(xtx) && sum.is_contiguous() && sum.dims() == xtx.dims()) {
        *sum = (&*sum + (xtx * 2.0)?)?;
        return Ok(());
    }
    let x = xtx.contiguous()?;
    let (xs, xl) = x.storage_and_layout();
    let x = cpu_values(&xs, xl, "hessian")?;
    with_cpu_values_mut(sum, "hessian", |s| {
        s.par_chunks_mut(1 << 16)
            .zip(x.par_chunks(1 << 16))
            .for_each(|(s, x)| {
                for (s, x) in s.iter_mut().zip(x) {
                    *s += *x * 2.0 + 0.0;
                }
            });
        Ok(())
    })?;
    Ok(())
}

impl Observer for Hessians<'_> {
    fn linear_input(&mut self, module: &str, x: &Tensor) -> Result<(), ModelError> {
        if !(self.keep)(module) {
            return Ok(());
        }
        let cols = x.dim(x.rank() - 1)?;
        let batch = if x.rank() == 3 { x.dim(0)? } else { 1 };
        let xtx = match &self.last {
            Some((id, xtx)) if *id == x.id() => xtx.clone(),
            _ => {
                // Detached: the input carries the layer's graph, and a kept graph keeps every
                // sample's activations.
                let x32 = x.detach().to_dtype(DType::F32)?.reshape(((), cols))?;
                let xtx = x32.t()?.matmul(&x32)?;
                self.last = Some((x.id(), xtx.clone()));
                xtx
            }
        };
        match self.sums.get_mut(module) {
            Some((sum, n)) => {
                add_twice(sum, &xtx)?;
                *n += batch;
            }
            None => {
                // A tensor of its own (not `xtx`'s storage, which later modules read).
                self.sums.insert(module.to_string(), ((xtx * 2.0)?, batch));
            }
        }
        Ok(())
    }
    fn key_value(&mut self, _: &str, _: &Tensor, _: &Tensor) -> Result<(), ModelError> {
        Ok(())
    }
}

impl LayerCalibration for Hessians<'_> {}

/// GPTQ's codes, one file a Linear in a temporary folder (removed when dropped).
#[derive(Debug)]
pub struct GptqCodes {
    dir: tempfile::TempDir,
    /// Module → `[rows, cols]`.
    shapes: BTreeMap<String, (usize, usize)>,
    /// How GPTQ ran.
    pub settings: GptqSettings,
    /// Modules that fell back to round to nearest (a Hessian that could not be factorized).
    pub rtn_fallback: Vec<String>,
    /// Module → GPTQ's loss.
    pub losses: BTreeMap<String, f64>,
}

impl GptqCodes {
    fn path(&self, module: &str) -> PathBuf {
        self.dir.path().join(format!("{module}.codes"))
    }

    fn params_path(&self, module: &str) -> PathBuf {
        self.dir.path().join(format!("{module}.params"))
    }

    /// The `(scale, bias)` per group GPTQ chose for `module`, on a grid where it chooses them
    /// ([`GptqGrid::Affine`]).
    pub fn read_params(&self, module: &str) -> Option<Result<Vec<(f32, f32)>, String>> {
        self.shapes.get(module)?;
        let path = self.params_path(module);
        if !path.exists() {
            return None;
        }
        Some(
            std::fs::read(&path)
                .map_err(|e| format!("{}: {e}", path.display()))
                .and_then(|b| {
                    if b.len() % 8 != 0 {
                        return Err(format!("{}: truncated", path.display()));
                    }
                    Ok(b.chunks_exact(8)
                        .map(|c| {
                            let f =
                                |k: usize| f32::from_le_bytes([c[k], c[k + 1], c[k + 2], c[k + 3]]);
                            (f(0), f(4))
                        })
                        .collect())
                }),
        )
    }

    /// The codes GPTQ chose for `module` (`[rows, cols]`, row-major), if it quantized it.
    pub fn read(&self, module: &str) -> Option<Result<Vec<i8>, String>> {
        let &(rows, cols) = self.shapes.get(module)?;
        let path = self.path(module);
        Some(
            std::fs::read(&path)
                .map_err(|e| format!("{}: {e}", path.display()))
                .and_then(|b| {
                    if b.len() == rows * cols {
                        Ok(bytemuck::cast_slice(&b).to_vec())
                    } else {
                        Err(format!("{}: truncated", path.display()))
                    }
                }),
        )
    }

    /// The Linears GPTQ quantized, in module order.
    pub fn modules(&self) -> impl Iterator<Item = &str> {
        self.shapes.keys().map(String::as_str)
    }
}

impl crate::export::writer::ChosenCodes for GptqCodes {
    fn algorithm(&self) -> &str {
        "GPTQ"
    }
    fn actorder(&self) -> bool {
        self.settings.actorder
    }
    fn codes(&self, module: &str) -> Option<Result<Vec<i8>, String>> {
        self.read(module)
    }
    fn params(&self, module: &str) -> Option<Result<Vec<(f32, f32)>, String>> {
        self.read_params(module)
    }
}

/// Runs GPTQ over `checkpoint` layer by layer on `samples`, for the Linears `keep` accepts,
/// each on the grid and per-group parameters `params` gives (the writer's own, from the
/// checkpoint's weight). The model runs in `dtype` on `device`; `progress(done, total)`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    samples: &[Vec<u32>],
    keep: &(dyn Fn(&str) -> bool + Sync),
    params: &GroupParams<'_>,
    settings: GptqSettings,
    mut progress: impl FnMut(usize, usize),
) -> Result<Arc<GptqCodes>, ModelError> {
    let dir = tempfile::Builder::new()
        .prefix("kiln-gptq-")
        .tempdir()
        .map_err(|e| ModelError::Config(format!("a temporary folder for GPTQ's codes: {e}")))?;
    let mut out = GptqCodes {
        dir,
        shapes: BTreeMap::new(),
        settings,
        rtn_fallback: Vec::new(),
        losses: BTreeMap::new(),
    };
    let super::max::Stages {
        layers,
        mut hidden,
        load,
    } = super::max::stages(checkpoint, dtype, device, samples)?;
    for stage in 0..=layers {
        let model = load(stage)?;
        let mut hessians = Hessians {
            keep,
            sums: BTreeMap::new(),
            last: None,
        };
        for (h, rope) in hidden.iter_mut() {
            if stage < layers {
                let next = model.layer(h, stage, rope, &mut hessians)?;
                // One pass (mlx-lm): the next layer sees this one's original outputs.
                if !settings.sequential {
                    *h = next.detach();
                }
            } else {
                model.observe_head(h, &mut hessians)?;
            }
        }
        for (module, (sum, n)) in std::mem::take(&mut hessians.sums) {
            let q = quantize_module(&model, &module, &sum, n, params, settings)?;
            let name = format!("{module}.weight");
            let var = weight_var(&model, &name)?;
            let (rows, cols) = var.dims2()?;
            // The quantized weight for the layers after this one, as llm-compressor stores it
            // back into the module: already in the checkpoint's dtype (`Prepared::round`).
            let values = q.values.clone();
            let t = Tensor::from_vec(values, (rows, cols), device)?.to_dtype(var.dtype())?;
            var.set(&t)?;
            let spill =
                |e: std::io::Error| ModelError::Config(format!("writing GPTQ's codes: {e}"));
            std::fs::write(out.path(&module), bytemuck::cast_slice::<i8, u8>(&q.codes))
                .map_err(spill)?;
            if let Some(p) = &q.params {
                let bytes: Vec<u8> = p
                    .iter()
                    .flat_map(|(s, b)| s.to_le_bytes().into_iter().chain(b.to_le_bytes()))
                    .collect();
                std::fs::write(out.params_path(&module), bytes).map_err(spill)?;
            }
            if q.rtn_fallback {
                out.rtn_fallback.push(module.clone());
            }
            out.losses.insert(module.clone(), q.loss);
            out.shapes.insert(module, (rows, cols));
        }
        if stage < layers && settings.sequential {
            for (h, rope) in hidden.iter_mut() {
                *h = model.layer(h, stage, rope, &mut NoObserver)?.detach();
            }
        }
        progress(stage + 1, layers + 1);
    }
    Ok(Arc::new(out))
}

/// The variable of weight `name` in `model`.
fn weight_var<'m>(model: &'m DecoderModel, name: &str) -> Result<&'m candle_core::Var, ModelError> {
    model
        .weights()
        .vars()
        .get(name)
        .ok_or_else(|| ModelError::Tensor {
            tensor: name.to_string(),
            message: "not loaded".into(),
        })
}

/// GPTQ of the Linear `module` of `model` with its Hessian sum over `n` samples.
fn quantize_module(
    model: &DecoderModel,
    module: &str,
    sum: &Tensor,
    n: usize,
    params: &GroupParams<'_>,
    settings: GptqSettings,
) -> Result<Quantized, ModelError> {
    let name = format!("{module}.weight");
    let Prepared {
        values: w,
        grid,
        round,
    } = params(&name)?;
    let (rows, cols) = weight_var(model, &name)?.dims2()?;
    let group = grid.group();
    let fixed = match &grid {
        GptqGrid::Int { params, .. } => Some(params.len()),
        GptqGrid::Fp4 { scales, .. } => Some(scales.len()),
        GptqGrid::Affine { .. } => None,
    };
    if w.len() != rows * cols
        || group == 0
        || !cols.is_multiple_of(group)
        || fixed.is_some_and(|p| p * group != rows * cols)
    {
        return Err(ModelError::Tensor {
            tensor: name,
            message: format!(
                "GPTQ: {} values and {:?} groups of {group} for a [{rows}, {cols}] weight",
                w.len(),
                fixed
            ),
        });
    }
    let h: Vec<f32> = (sum / n.max(1) as f64)?.flatten_all()?.to_vec1()?;
    Ok(quantize(&w, rows, cols, &h, &grid, round, settings))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPTQ written out as the paper's Algorithm 1 without blocks or ordering: every column
    /// quantized in turn, then all later columns updated by the explicit inverse Hessian of
    /// the remaining columns (`H⁻¹` shrunk by one Gaussian elimination step each time).
    fn reference(
        w: &[f32],
        rows: usize,
        cols: usize,
        h: &[f64],
        grid: IntGrid,
        params: &[(f32, i8)],
    ) -> Vec<i8> {
        // H⁻¹ by Gauss–Jordan.
        let n = cols;
        let mut a = h.to_vec();
        let mut inv = vec![0f64; n * n];
        for i in 0..n {
            inv[i * n + i] = 1.0;
        }
        for c in 0..n {
            let p = a[c * n + c];
            for j in 0..n {
                a[c * n + j] /= p;
                inv[c * n + j] /= p;
            }
            for r in 0..n {
                if r != c {
                    let f = a[r * n + c];
                    for j in 0..n {
                        a[r * n + j] -= f * a[c * n + j];
                        inv[r * n + j] -= f * inv[c * n + j];
                    }
                }
            }
        }
        let (lo, hi) = grid.range();
        let groups = cols / grid.group;
        let mut codes = vec![0i8; rows * cols];
        for r in 0..rows {
            let mut hinv = inv.clone();
            let mut wr: Vec<f64> = w[r * cols..(r + 1) * cols]
                .iter()
                .map(|&x| f64::from(x))
                .collect();
            for i in 0..cols {
                let (s, zp) = params[r * groups + i / grid.group];
                let (s, zp) = (f64::from(s), f64::from(zp));
                let q = (wr[i] / s + zp)
                    .clamp(f64::from(lo), f64::from(hi))
                    .round_ties_even();
                codes[r * cols + i] = q as i8;
                let e = (wr[i] - (q - zp) * s) / hinv[i * n + i];
                for j in i + 1..cols {
                    wr[j] -= e * hinv[i * n + j];
                }
                // Remove column i from the inverse: H⁻¹ ← H⁻¹ − H⁻¹[:, i] H⁻¹[i, :] / H⁻¹[i, i].
                let d = hinv[i * n + i];
                let col: Vec<f64> = (0..n).map(|k| hinv[k * n + i]).collect();
                let row: Vec<f64> = (0..n).map(|k| hinv[i * n + k]).collect();
                for a in 0..n {
                    for b in 0..n {
                        hinv[a * n + b] -= col[a] * row[b] / d;
                    }
                }
            }
        }
        codes
    }

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn blocked_gptq_equals_the_unblocked_algorithm() {
        let (rows, cols, tokens) = (6, 40, 64);
        let mut seed = 7;
        let x: Vec<f32> = (0..tokens * cols).map(|_| lcg(&mut seed)).collect();
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed) * 0.1).collect();
        let mut h = vec![0f32; cols * cols];
        for t in 0..tokens {
            for i in 0..cols {
                for j in 0..cols {
                    h[i * cols + j] += 2.0 * x[t * cols + i] * x[t * cols + j] / tokens as f32;
                }
            }
        }
        let grid = IntGrid {
            bits: 4,
            symmetric: true,
            group: 8,
        };
        let params: Vec<(f32, i8)> = w
            .chunks(grid.group)
            .map(|g| (g.iter().fold(0f32, |m, v| m.max(v.abs())) / 7.5, 0))
            .collect();
        let settings = GptqSettings {
            block: 16,
            dampening: 0.01,
            actorder: false,
            sequential: true,
        };
        let fixed = GptqGrid::Int {
            grid,
            params: params.clone(),
        };
        let got = quantize(&w, rows, cols, &h, &fixed, |x| x, settings);
        // The reference gets the dampened Hessian.
        let mean = (0..cols).map(|i| f64::from(h[i * cols + i])).sum::<f64>() / cols as f64;
        let mut hd: Vec<f64> = h.iter().map(|&v| f64::from(v)).collect();
        for i in 0..cols {
            hd[i * cols + i] += 0.01 * mean;
        }
        let want = reference(&w, rows, cols, &hd, grid, &params);
        let same = got.codes.iter().zip(&want).filter(|(a, b)| a == b).count();
        assert!(
            same * 100 >= want.len() * 99,
            "{same} of {} codes agree",
            want.len()
        );
        // GPTQ lowers the layer's output error against round to nearest.
        let rtn: Vec<f32> = w
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let (s, _) = params[i / grid.group];
                (v / s).clamp(-8.0, 7.0).round_ties_even() * s
            })
            .collect();
        let out_err = |q: &[f32]| -> f64 {
            (0..tokens)
                .map(|t| {
                    (0..rows)
                        .map(|r| {
                            let d: f64 = (0..cols)
                                .map(|c| {
                                    f64::from((w[r * cols + c] - q[r * cols + c]) * x[t * cols + c])
                                })
                                .sum();
                            d * d
                        })
                        .sum::<f64>()
                })
                .sum()
        };
        assert!(
            out_err(&got.values) < out_err(&rtn),
            "GPTQ no better than RTN"
        );
        // Activation ordering is a permutation of the same problem: codes stay codes.
        let ordered = quantize(
            &w,
            rows,
            cols,
            &h,
            &fixed,
            |x| x,
            GptqSettings {
                actorder: true,
                ..settings
            },
        );
        assert!(out_err(&ordered.values) < out_err(&rtn));
    }

    #[test]
    fn hessian_sums_in_place_equal_candles_composition() {
        let dev = Device::Cpu;
        let mut seed = 11;
        let inputs: Vec<Tensor> = (0..4)
            .map(|_| {
                let v: Vec<f32> = (0..50 * 24).map(|_| lcg(&mut seed)).collect();
                Tensor::from_vec(v, (50, 24), &dev).unwrap()
            })
            .collect();
        let xtx = |x: &Tensor| x.t().unwrap().matmul(x).unwrap();
        let mut want = (xtx(&inputs[0]) * 2.0).unwrap();
        let mut got = (xtx(&inputs[0]) * 2.0).unwrap();
        for x in &inputs[1..] {
            want = (&want + (xtx(x) * 2.0).unwrap()).unwrap();
            add_twice(&mut got, &xtx(x)).unwrap();
        }
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn the_inverse_factor_inverts() {
        let n = 12;
        let mut seed = 3;
        let m: Vec<f64> = (0..n * n).map(|_| f64::from(lcg(&mut seed))).collect();
        let mut h = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = (0..n).map(|k| m[i * n + k] * m[j * n + k]).sum::<f64>();
            }
            h[i * n + i] += 0.5;
        }
        let u = inverse_upper_cholesky(&h, n).unwrap();
        // U upper, and H · (UᵀU) = I.
        for i in 0..n {
            for j in 0..i {
                assert_eq!(u[i * n + j], 0.0);
            }
        }
        for i in 0..n {
            for j in 0..n {
                let v: f64 = (0..n)
                    .map(|k| {
                        let hinv_kj: f64 = (0..n)
                            .map(|t| f64::from(u[t * n + k]) * f64::from(u[t * n + j]))
                            .sum();
                        h[i * n + k] * hinv_kj
                    })
                    .sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-4, "({i}, {j}): {v}");
            }
        }
        let mut bad = h.clone();
        bad[0] = -1.0;
        assert!(inverse_upper_cholesky(&bad, n).is_none());
    }

    #[test]
    fn the_blocked_factorization_equals_the_scalar_one() {
        // 300 > 2 · BASE: two levels of halves.
        let n = 300;
        let mut seed = 5;
        let m: Vec<f64> = (0..n * n).map(|_| f64::from(lcg(&mut seed))).collect();
        let mut h = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..n {
                h[i * n + j] = dot(&m[i * n..(i + 1) * n], &m[j * n..(j + 1) * n]);
            }
            h[i * n + i] += 1.0;
        }
        let t = Tensor::from_vec(h.clone(), (n, n), &Device::Cpu).unwrap();
        let l: Vec<f64> = blocked::cholesky(&t)
            .unwrap()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want = cholesky(&h, n).unwrap();
        for (a, b) in l.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-9 * (1.0 + b.abs()), "{a} vs {b}");
        }
        let lt = Tensor::from_vec(want.clone(), (n, n), &Device::Cpu).unwrap();
        let x: Vec<f64> = blocked::invert_lower(&lt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want = invert_lower(&want, n);
        for (a, b) in x.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-9 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
