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
use kiln_kernels::ops::linalg::sub_matmul_f32;
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
    drop(hp);
    // llm-compressor's block-lazy update: within a block of columns, column by column and
    // row by row (rows in parallel); then every later column at once, `W[:, i2:] −=
    // Err · U[i1:i2, i2:]` (one GEMM).
    let mut w = wp;
    let mut codes = vec![0i8; rows * cols];
    let mut deq = vec![0f32; rows * cols];
    let mut losses = vec![0f64; rows];
    let mut err = Vec::new();
    for i1 in (0..cols).step_by(settings.block.max(1)) {
        let i2 = (i1 + settings.block.max(1)).min(cols);
        let bw = i2 - i1;
        err.clear();
        err.resize(rows * bw, 0f32);
        w.par_chunks_mut(cols)
            .zip(codes.par_chunks_mut(cols))
            .zip(deq.par_chunks_mut(cols))
            .zip(err.par_chunks_mut(bw))
            .zip(losses.par_iter_mut())
            .enumerate()
            .with_min_len(8)
            .for_each(|(r, ((((wr, cr), dr), er), loss))| {
                for i in i1..i2 {
                    let g = perm[i] / group;
                    let urow = &u[i * cols..i * cols + i2];
                    let (code, dq) = q(r, g, wr[i]);
                    cr[i] = code;
                    dr[i] = dq;
                    settle(wr, er, loss, urow, i - i1, i, dq);
                }
            });
        later_columns(&mut w, rows, cols, &err, &u, i1, i2);
    }
    let loss = losses.iter().sum::<f64>() / 2.0;
    let (mut out_codes, mut values) = (vec![0i8; rows * cols], vec![0f32; rows * cols]);
    out_codes
        .par_chunks_mut(cols)
        .zip(values.par_chunks_mut(cols))
        .zip(codes.par_chunks(cols).zip(deq.par_chunks(cols)))
        .for_each(|((oc, ov), (c, d))| {
            for (i, &pi) in perm.iter().enumerate() {
                oc[pi] = c[i];
                ov[pi] = d[i];
            }
        });
    Quantized {
        codes: out_codes,
        values,
        loss,
        rtn_fallback,
        params: None,
    }
}

/// Column `i` of a row `wr` quantized to the value `dq`: its error over `U[i,i]` (`urow` is
/// row `i` of `U` up to the block's end) added to the loss and kept as the block's `k`-th
/// error, and spread over the block's later columns, `w_j −= e · U[i,j]`.
#[inline]
fn settle(
    wr: &mut [f32],
    er: &mut [f32],
    loss: &mut f64,
    urow: &[f32],
    k: usize,
    i: usize,
    dq: f32,
) {
    let e = (wr[i] - dq) / urow[i];
    *loss += f64::from(e) * f64::from(e);
    er[k] = e;
    for j in i + 1..urow.len() {
        wr[j] -= e * urow[j];
    }
}

/// After the block `[i1, i2)`: every later column of `w` (`[rows, cols]`) takes the block's
/// errors `err` (`[rows, i2 − i1]`), `W[:, i2:] −= Err · U[i1:i2, i2:]`, one GEMM
/// (PyTorch's `W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])` up to the order of the sums).
fn later_columns(
    w: &mut [f32],
    rows: usize,
    cols: usize,
    err: &[f32],
    u: &[f32],
    i1: usize,
    i2: usize,
) {
    if i2 < cols {
        sub_matmul_f32(
            w,
            cols,
            i2,
            rows,
            cols - i2,
            err,
            i2 - i1,
            &u[i1 * cols..],
            cols,
            i2,
        );
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
    drop(hp);
    let groups = cols / group;
    let n_bins = ((1u32 << bits) - 1) as f32;
    let mut w = w.to_vec();
    let mut codes = vec![0i8; rows * cols];
    let mut values = vec![0f32; rows * cols];
    let mut params = vec![(0f32, 0f32); rows * groups];
    let mut losses = vec![0f64; rows];
    let mut err = vec![0f32; rows * group];
    for (g, i1) in (0..cols).step_by(group.max(1)).enumerate() {
        let i2 = i1 + group;
        w.par_chunks_mut(cols)
            .zip(codes.par_chunks_mut(cols))
            .zip(values.par_chunks_mut(cols))
            .zip(err.par_chunks_mut(group))
            .zip(params.par_chunks_mut(groups))
            .zip(losses.par_iter_mut())
            .with_min_len(8)
            .for_each(|(((((wr, cr), dr), er), pr), loss)| {
                let (lo, hi) = wr[i1..i2]
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                        (lo.min(x), hi.max(x))
                    });
                let (s, b) = affine_scale_bias(lo, hi, bits as usize);
                pr[g] = (s, b);
                for i in i1..i2 {
                    let urow = &u[i * cols..i * cols + i2];
                    let q = round_half_even((wr[i] - b) / s).clamp(0.0, n_bins);
                    let dq = s * q + b;
                    cr[i] = q as u8 as i8;
                    dr[i] = dq;
                    settle(wr, er, loss, urow, i - i1, i, dq);
                }
            });
        later_columns(&mut w, rows, cols, &err, &u, i1, i2);
    }
    Quantized {
        codes,
        values,
        loss: losses.iter().sum::<f64>() / 2.0,
        rtn_fallback,
        params: Some(params),
    }
}

/// The upper-triangular `U` with `UᵀU = H⁻¹` (f32), for `H` symmetric positive definite
/// (`n × n`, f64); `None` when it is not. llm-compressor computes it as
/// `cholesky(cholesky_inverse(cholesky(H)), upper=True)`; here, with `J` the reversal of
/// rows and columns, `JHJ = L Lᵀ` gives `H = V Vᵀ` with `V = J L J` upper, so `U = V⁻¹ =
/// J L⁻¹ J`: one factorization and one triangular inverse, both blocked GEMMs on the lower
/// triangle (`kiln_kernels::ops::linalg`, `n³/3` multiply-adds in all).
pub fn inverse_upper_cholesky(h: &[f64], n: usize) -> Option<Vec<f32>> {
    use kiln_kernels::ops::linalg;
    let rev = |i: usize| n - 1 - i;
    let mut a = vec![0f64; n * n];
    a.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        for (j, v) in row.iter_mut().enumerate() {
            *v = h[rev(i) * n + rev(j)];
        }
    });
    if !linalg::cholesky_in_place(&mut a, n) {
        return None;
    }
    let linv = linalg::invert_lower(&a, n);
    drop(a);
    let mut u = vec![0f32; n * n];
    u.par_chunks_mut(n.max(1)).enumerate().for_each(|(i, row)| {
        for (j, v) in row.iter_mut().enumerate().skip(i) {
            *v = linv[rev(i) * n + rev(j)] as f32;
        }
    });
    Some(u)
}

/// Every quantized Linear's input Hessian over one layer's samples.
struct Hessians<'f> {
    keep: &'f (dyn Fn(&str) -> bool + Sync),
    /// Module → (`Σ 2 XᵀX`, samples).
    sums: BTreeMap<String, (Tensor, usize)>,
    /// The input whose `XᵀX` is held: q/k/v (and gate/up) share one input.
    last: Option<candle_core::TensorId>,
    /// That `XᵀX`'s lower triangle on the CPU (f32, `[cols, cols]`; above it, whatever the
    /// buffer held), in a buffer reused from sample to sample.
    xtx: Vec<f32>,
    /// That `XᵀX` on another device.
    xtx_device: Option<Tensor>,
}

impl<'f> Hessians<'f> {
    fn new(keep: &'f (dyn Fn(&str) -> bool + Sync)) -> Self {
        Hessians {
            keep,
            sums: BTreeMap::new(),
            last: None,
            xtx: Vec::new(),
            xtx_device: None,
        }
    }
}

/// `sum += 2·xtx` where the sum lies (a CPU f32 tensor of `xtx.len()` values): each value
/// `sum + (xtx·2 + 0)`, the bits of candle's `sum + (xtx * 2.0)` (its `affine` adds the zero)
/// without the two `[cols, cols]` tensors that composition allocates per sample and module
/// (at 8960 inputs, 321 MB each, every one faulted in fresh).
fn add_twice(sum: &mut Tensor, xtx: &[f32]) -> Result<(), ModelError> {
    use crate::model::fused::{fusable, with_cpu_values_mut};
    if !(fusable(sum) && sum.is_contiguous() && sum.elem_count() == xtx.len()) {
        return Err(ModelError::Config(format!(
            "GPTQ: a Hessian sum of shape {:?} ({:?}) cannot take {} values in place",
            sum.dims(),
            sum.dtype(),
            xtx.len()
        )));
    }
    with_cpu_values_mut(sum, "hessian", |s| {
        s.par_chunks_mut(1 << 16)
            .zip(xtx.par_chunks(1 << 16))
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
        if self.last != Some(x.id()) {
            // Detached: the input carries the layer's graph, and a kept graph keeps every
            // sample's activations.
            let x32 = x.detach().to_dtype(DType::F32)?.reshape(((), cols))?;
            if x32.device().is_cpu() {
                use crate::model::fused::cpu_values;
                let x32 = x32.contiguous()?;
                let (xs, xl) = x32.storage_and_layout();
                let xs = cpu_values(&xs, xl, "hessian")?;
                self.xtx.resize(cols * cols, 0.0);
                // Its lower triangle (what lies above it is never read: `quantize_module`
                // mirrors the sum's lower triangle).
                kiln_kernels::ops::linalg::gram_lower_f32(
                    xs,
                    xs.len() / cols.max(1),
                    cols,
                    &mut self.xtx,
                );
                self.xtx_device = None;
            } else {
                self.xtx_device = Some(x32.t()?.matmul(&x32)?);
            }
            self.last = Some(x.id());
        }
        match (self.sums.get_mut(module), &self.xtx_device) {
            (Some((sum, n)), Some(xtx)) => {
                *sum = (&*sum + (xtx * 2.0)?)?;
                *n += batch;
            }
            (Some((sum, n)), None) => {
                add_twice(sum, &self.xtx)?;
                *n += batch;
            }
            // A tensor of its own (not the held `XᵀX`, which later modules read).
            (None, Some(xtx)) => {
                self.sums.insert(module.to_string(), ((xtx * 2.0)?, batch));
            }
            (None, None) => {
                let twice: Vec<f32> = self.xtx.par_iter().map(|&v| v * 2.0 + 0.0).collect();
                let sum = Tensor::from_vec(twice, (cols, cols), &Device::Cpu)?;
                self.sums.insert(module.to_string(), (sum, batch));
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
        let mut hessians = Hessians::new(keep);
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
        // The sums alone through quantization (the held `XᵀX` freed).
        let sums = std::mem::take(&mut hessians.sums);
        drop(hessians);
        for (module, (sum, n)) in sums {
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
        || rows == 0
        || cols == 0
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
    let mut h: Vec<f32> = (sum / n.max(1) as f64)?.flatten_all()?.to_vec1()?;
    // On the CPU the sums hold the lower triangle only (`gram_lower_f32`).
    kiln_kernels::ops::linalg::mirror_lower(&mut h, cols);
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
        // Small inputs, and ones large enough for the GEMM's blocking and threads.
        for (t, cols) in [(50, 24), (700, 200)] {
            let inputs: Vec<Tensor> = (0..4)
                .map(|_| {
                    let v: Vec<f32> = (0..t * cols).map(|_| lcg(&mut seed)).collect();
                    Tensor::from_vec(v, (t, cols), &dev).unwrap()
                })
                .collect();
            let xtx = |x: &Tensor| x.t().unwrap().matmul(x).unwrap();
            let mut want = (xtx(&inputs[0]) * 2.0).unwrap();
            let keep = |_: &str| true;
            let mut h = Hessians::new(&keep);
            for x in &inputs {
                h.linear_input("m", x).unwrap();
                // A second module on the same input takes the held `XᵀX`.
                h.linear_input("n", x).unwrap();
            }
            for x in &inputs[1..] {
                want = (&want + (xtx(x) * 2.0).unwrap()).unwrap();
            }
            let bits = |t: &Tensor| -> Vec<u32> {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            };
            let lower = |v: Vec<u32>| -> Vec<u32> {
                (0..cols)
                    .flat_map(|i| v[i * cols..i * cols + i + 1].to_vec())
                    .collect()
            };
            for m in ["m", "n"] {
                let (sum, n) = &h.sums[m];
                assert_eq!(*n, 4);
                assert_eq!(lower(bits(sum)), lower(bits(&want)), "{t} x {cols}, {m}");
            }
        }
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
}
