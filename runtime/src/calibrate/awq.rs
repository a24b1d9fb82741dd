//! AWQ's per-channel scale search, as ModelOpt's `awq_lite` runs it (docs/FORMATS.md §4.2), and its
//! clipping search, as `awq_clip` runs it after the scale search (`awq_full`, [`clip_search`]).
//!
//! For a quantized Linear `y = x·Wᵀ + b` that sees calibration inputs `x₁ … x_n` (one per
//! forward call; each `[tokens, in]`):
//! - `act[c]` = the mean over calls of `mean_tokens |x[:, c]|` (each call's mean held in the
//!   weight's dtype, as ModelOpt computes it in the model's dtype);
//! - `wsc[c]` = the mean over output rows of `|W[r, c]| / (max |W[r, block(c)]| + tiny)`, where
//!   a block is the weight quantizer's group along the input (128 for INT4, 16 for NVFP4);
//! - for every α on the grid `0, step, 2·step, … 1` (f32, as `torch.arange` builds it):
//!   `s = clamp(act^α / (wsc^(1−α) + tiny_f32), 1e-4, 1e4)`, normalised by `√(max s · min s)`;
//!   the loss is `Σ_calls mean((x·(1/s))·Q(W·s)ᵀ − x·Wᵀ)²`, with `1/s` and `s` rounded to the
//!   weight's dtype and `Q` the format's weight fake quantization (dynamic block amax);
//! - the first α with the smallest loss wins; its `s` is the Linear's *best scale* and
//!   `pre_quant_scale = 1/s` (f32: the weight is smoothed by it exactly, and it is stored in
//!   the weight's dtype).
//!
//! Every Linear sees the unquantized model's activations (ModelOpt forwards the unquantized
//! output during the search), so the search runs layer by layer on the inputs one
//! calibration pass records.

use super::max::LayerCalibration;
use crate::model::{DecoderModel, MaxCalibrator, ModelError, Observer};
use candle_core::{DType, Tensor};
use rayon::prelude::*;
use std::collections::BTreeMap;

/// The weight quantization AWQ searches against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AwqWeight {
    /// Symmetric INT4 in groups of `group` input channels (int4-awq, w4a8-awq: 128).
    Int4 {
        /// Input channels per scale.
        group: usize,
    },
    /// NVFP4: 16-blocks with E4M3 scales under a per-tensor f32 scale (nvfp4-awq).
    Nvfp4,
}

impl AwqWeight {
    /// The block along the input dimension (`_get_awq_quantizer_block_size`).
    pub fn block(self) -> usize {
        match self {
            AwqWeight::Int4 { group } => group,
            AwqWeight::Nvfp4 => 16,
        }
    }

    /// Quantize-then-dequantize of `w` (`[rows, cols]`, row-major), each value rounded by
    /// `round` (the weight's dtype), with amax taken from `w` itself.
    pub fn fake_quant(
        self,
        w: &[f32],
        cols: usize,
        round: fn(f32) -> f32,
    ) -> Result<Vec<f32>, ModelError> {
        match self {
            AwqWeight::Int4 { group } => Ok(w
                .par_chunks(cols.max(1))
                .flat_map_iter(|row| row.chunks(group))
                .flat_map_iter(|block| {
                    // ModelOpt's fake INT4: x·(7/amax), rounded half to even, clamped to
                    // [−8, 7], divided back.
                    let amax = block.iter().fold(0f32, |m, &x| m.max(x.abs()));
                    let scale = 7.0 / amax;
                    block.iter().map(move |&x| {
                        if amax == 0.0 {
                            0.0
                        } else {
                            round(round_int4(x * scale) / scale)
                        }
                    })
                })
                .collect()),
            AwqWeight::Nvfp4 => {
                use kiln_kernels::ops::nvfp4::{dequantize_nvfp4, nvfp4_global_scale};
                let rows = w.len() / cols.max(1);
                let ws2 = nvfp4_global_scale(kiln_kernels::cpu::amax(w));
                let mut packed = vec![0u8; w.len() / 2];
                let mut scales = vec![0u8; w.len() / 16];
                let kernel = |e: kiln_kernels::KernelError| ModelError::Tensor {
                    tensor: "awq search".into(),
                    message: e.to_string(),
                };
                kiln_kernels::cpu::quantize_nvfp4(w, &[rows, cols], ws2, &mut packed, &mut scales)
                    .map_err(kernel)?;
                let mut out = vec![0f32; w.len()];
                // Whole 16-blocks per chunk, in parallel.
                const CHUNK: usize = 16 * 1024;
                out.par_chunks_mut(CHUNK)
                    .zip(packed.par_chunks(CHUNK / 2))
                    .zip(scales.par_chunks(CHUNK / 16))
                    .try_for_each(|((o, p), s)| dequantize_nvfp4(p, s, ws2, o))
                    .map_err(kernel)?;
                Ok(out.into_par_iter().map(round).collect())
            }
        }
    }
}

/// `round_half_even(x)` clamped to INT4's [−8, 7], without a libm call: clamping first is
/// the same (the clamp bounds are integers), and for |x| ≤ 8 adding and subtracting 1.5·2²³
/// rounds to the nearest integer, ties to even, in IEEE arithmetic.
#[inline]
fn round_int4(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if x.is_nan() {
        return x;
    }
    (x.clamp(-8.0, 7.0) + MAGIC) - MAGIC
}

/// The weight's dtype, as the search's roundings see it.
#[derive(Debug, Clone, Copy)]
pub struct Precision {
    /// Rounds an f32 to the dtype (identity for f32).
    pub round: fn(f32) -> f32,
    /// `torch.finfo(dtype).tiny`.
    pub tiny: f32,
}

impl Precision {
    /// The precision of a checkpoint dtype (BF16, F16, F32).
    pub fn of(dtype: safetensors::Dtype) -> Option<Self> {
        use half::{bf16, f16};
        match dtype {
            safetensors::Dtype::BF16 => Some(Precision {
                round: |x| bf16::from_f32(x).to_f32(),
                tiny: f32::MIN_POSITIVE,
            }),
            safetensors::Dtype::F16 => Some(Precision {
                round: |x| f16::from_f32(x).to_f32(),
                tiny: f16::MIN_POSITIVE.to_f32(),
            }),
            safetensors::Dtype::F32 => Some(Precision {
                round: |x| x,
                tiny: f32::MIN_POSITIVE,
            }),
            _ => None,
        }
    }
}

/// The α grid of `torch.arange(0, 1 + step, step)` for a float32 tensor: the count and the
/// points computed in f64 (`step` is a Python float), each point rounded to f32.
pub fn alpha_grid(step: f64) -> Vec<f32> {
    let n = ((1.0 + step) / step).ceil() as usize;
    (0..n).map(|i| (i as f64 * step) as f32).collect()
}

/// `awq_lite`'s `get_scale`: `clamp(act^α / (wsc^(1−α) + tiny), 1e-4, 1e4)` normalised by
/// `√(max · min)`.
pub fn awq_scale(act: &[f32], wsc: &[f32], alpha: f32) -> Vec<f32> {
    let beta = (1.0f64 - f64::from(alpha)) as f32;
    let s: Vec<f32> = act
        .iter()
        .zip(wsc)
        .map(|(&a, &w)| (a.powf(alpha) / (w.powf(beta) + f32::MIN_POSITIVE)).clamp(1e-4, 1e4))
        .collect();
    let (max, min) = s
        .iter()
        .fold((f32::NEG_INFINITY, f32::INFINITY), |(mx, mn), &x| {
            (mx.max(x), mn.min(x))
        });
    let norm = (max * min).sqrt();
    s.into_iter().map(|x| x / norm).collect()
}

/// `awq_lite`'s weight statistic: per input channel, the mean over rows of `|W| / (block
/// amax + tiny)`, each step rounded to the weight's dtype.
pub fn weight_scale(w: &[f32], cols: usize, block: usize, p: Precision) -> Vec<f32> {
    let rows = w.len() / cols.max(1);
    let mut sum = vec![0f32; cols];
    for row in w.chunks_exact(cols) {
        for (b, chunk) in row.chunks(block).enumerate() {
            let amax = chunk.iter().fold(0f32, |m, &x| m.max(x.abs()));
            let denom = (p.round)(amax + p.tiny);
            for (i, &x) in chunk.iter().enumerate() {
                sum[b * block + i] += (p.round)(x.abs() / denom);
            }
        }
    }
    sum.into_iter()
        .map(|s| (p.round)(s / rows as f32))
        .collect()
}

/// One Linear's search.
#[derive(Debug, Clone)]
pub struct AwqSearch {
    /// The chosen α.
    pub alpha: f32,
    /// The best scale `s` (the weight is multiplied by it, the input divided).
    pub scale: Vec<f32>,
    /// The loss of every α on the grid, in order.
    pub losses: Vec<(f32, f64)>,
    /// The loss of plain rounding (no smoothing), for comparison.
    pub rounding_loss: f64,
    /// The per-channel mean |x| the scales were built from.
    pub act_scale: Vec<f32>,
    /// The per-channel weight statistic the scales were built from.
    pub weight_scale: Vec<f32>,
    /// With the clipping search: the clipped amax of every block of the smoothed weight.
    pub clip_amax: Option<Vec<f32>>,
    /// With the clipping search: the ratio each block's amax was multiplied by.
    pub clip_ratio: Option<Vec<f32>>,
}

impl AwqSearch {
    /// The loss of the chosen α.
    pub fn loss(&self) -> f64 {
        self.losses
            .iter()
            .find(|(a, _)| *a == self.alpha)
            .map_or(f64::NAN, |(_, l)| *l)
    }

    /// `pre_quant_scale = 1/s` in f32 (ModelOpt smooths by it and stores it in the dtype).
    pub fn pre_quant_scale(&self) -> Vec<f32> {
        self.scale.iter().map(|&s| 1.0 / s).collect()
    }
}

fn host(x: &Tensor) -> Result<Vec<f32>, ModelError> {
    Ok(x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// The search for one Linear with weight `w` (`[out, in]`, values of `p`'s dtype), bias `b`,
/// and the inputs of its calls (`[tokens, in]` each, f32). `None` when no call had tokens.
pub fn search_linear(
    inputs: &[Tensor],
    w: &[f32],
    cols: usize,
    bias: Option<&Tensor>,
    quant: AwqWeight,
    p: Precision,
    alpha_step: f64,
) -> Result<Option<AwqSearch>, ModelError> {
    if inputs.is_empty() || cols == 0 {
        return Ok(None);
    }
    let device = inputs[0].device().clone();
    let rows = w.len() / cols;
    // The per-channel mean |x| of each call, in the dtype, averaged over calls in f32.
    let mut act = vec![0f32; cols];
    for x in inputs {
        for (a, m) in act.iter_mut().zip(host(&x.abs()?.mean(0)?)?) {
            *a += (p.round)(m);
        }
    }
    let calls = inputs.len() as f32;
    act.iter_mut().for_each(|a| *a /= calls);
    let wsc = weight_scale(w, cols, quant.block(), p);
    if act.iter().chain(&wsc).any(|x| x.is_nan()) {
        return Ok(None);
    }
    let linear = |x: &Tensor, w: &Tensor| -> Result<Tensor, ModelError> {
        let y = x.matmul(&w.t()?)?;
        Ok(match bias {
            Some(b) => y.broadcast_add(&b.to_dtype(DType::F32)?)?,
            None => y,
        })
    };
    let weight = Tensor::from_slice(w, (rows, cols), &device)?;
    // Every call's tokens in one matrix (one matmul per scale), each call's loss a mean over
    // its own rows.
    let lens: Vec<usize> = inputs.iter().map(|x| x.dim(0)).collect::<Result<_, _>>()?;
    let x = Tensor::cat(inputs, 0)?;
    let actual = linear(&x, &weight)?;
    // Σ_calls mean((x·(1/s))·Q(W·s)ᵀ − x·Wᵀ)² for the scale `s`.
    let loss_of = |s: &[f32]| -> Result<f64, ModelError> {
        let inv: Vec<f32> = s.iter().map(|&s| (p.round)(1.0 / s)).collect();
        let s_dtype: Vec<f32> = s.iter().map(|&s| (p.round)(s)).collect();
        let scaled: Vec<f32> = w
            .par_chunks_exact(cols)
            .flat_map_iter(|row| row.iter().zip(&s_dtype).map(|(&x, &s)| (p.round)(x * s)))
            .collect();
        let q = Tensor::from_vec(
            quant.fake_quant(&scaled, cols, p.round)?,
            (rows, cols),
            &device,
        )?;
        let inv = Tensor::from_vec(inv, cols, &device)?;
        let out = linear(&x.broadcast_mul(&inv)?, &q)?;
        let per_row: Vec<f32> = (out - &actual)?.sqr()?.sum(1)?.to_vec1()?;
        let mut loss = 0f64;
        let mut start = 0;
        for &n in &lens {
            let sum: f64 = per_row[start..start + n]
                .iter()
                .map(|&e| f64::from(e))
                .sum();
            loss += sum / (n * rows) as f64;
            start += n;
        }
        Ok(loss)
    };
    let mut losses = Vec::new();
    for alpha in alpha_grid(alpha_step) {
        losses.push((alpha, loss_of(&awq_scale(&act, &wsc, alpha))?));
    }
    let rounding_loss = loss_of(&vec![1.0; cols])?;
    // The first α with the smallest loss (Python's `min` over the dict in order).
    let (alpha, _) = losses
        .iter()
        .copied()
        .fold(None, |best: Option<(f32, f64)>, (a, l)| match best {
            Some((_, bl)) if bl <= l => best,
            _ => Some((a, l)),
        })
        .unwrap_or((0.0, 0.0));
    Ok(Some(AwqSearch {
        alpha,
        scale: awq_scale(&act, &wsc, alpha),
        losses,
        rounding_loss,
        act_scale: act,
        weight_scale: wsc,
        clip_amax: None,
        clip_ratio: None,
    }))
}

/// The clip ratios of ModelOpt's `awq_clip`: `0.5, 0.55, … 0.95` (`torch.arange(0.5, 1.0,
/// 0.05)` rounded to two decimals) and `1.0`.
pub fn clip_ratios() -> Vec<f32> {
    let mut r: Vec<f32> = (0..10)
        .map(|i| ((0.5 + 0.05 * f64::from(i)) * 100.0).round() as f32 / 100.0)
        .collect();
    r.push(1.0);
    r
}

/// ModelOpt's `awq_clip` on an INT4 weight in blocks of `group` (after the scale search):
/// for every block of every output row, the ratio of its amax that minimises
/// `Σ_calls mean_t (x_t[block] · (Q(W)[row, block] − W[row, block]))²`, where `x` is each
/// call's input multiplied by the stored `pre_quant_scale` and cut to about 64 evenly spaced
/// tokens (`x[::max(1, n / 64)]`), `W` is the smoothed weight (values of `p`'s dtype) and `Q`
/// quantizes to INT4 with the block amax times the ratio (values past it clamp). The first
/// ratio with the smallest loss wins. Returns the clipped amax and the chosen ratios, each
/// row-major over `[rows, cols / group]`.
pub fn clip_search(
    inputs: &[Tensor],
    pre_quant_scale: &[f32],
    w: &[f32],
    cols: usize,
    group: usize,
    p: Precision,
) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let rows = w.len() / cols.max(1);
    let blocks = cols / group;
    if blocks == 0 || !cols.is_multiple_of(group) || inputs.is_empty() {
        return Err(ModelError::Tensor {
            tensor: "awq clip search".into(),
            message: format!("{cols} input channels are not whole blocks of {group}"),
        });
    }
    let device = inputs[0].device().clone();
    let block_amax: Vec<f32> = w
        .chunks(group)
        .map(|b| b.iter().fold(0f32, |m, &x| m.max(x.abs())))
        .collect();
    // Every call's sampled tokens in one matrix; each row weighs 1 / (its call's count), so
    // the sum over rows is the sum over calls of per-call means.
    let pqs = Tensor::from_slice(pre_quant_scale, cols, &device)?;
    let (mut xs, mut weights) = (Vec::new(), Vec::new());
    for x in inputs {
        let n = x.dim(0)?;
        let stride = (n / 64).max(1);
        let idx: Vec<u32> = (0..n).step_by(stride).map(|i| i as u32).collect();
        let t = idx.len();
        let picked = x.index_select(&Tensor::from_vec(idx, t, &device)?, 0)?;
        xs.push(picked.broadcast_mul(&pqs)?);
        weights.extend(std::iter::repeat_n(1.0 / t as f32, t));
    }
    let x = Tensor::cat(&xs, 0)?;
    let tokens = x.dim(0)?;
    // Σ_t w_t (x_t[b] · d)² = dᵀ G_b d with the weighted Gram matrix G_b = X_bᵀ diag(w) X_b of
    // each block's inputs ([blocks, group, group]): computed once, so each ratio costs a
    // `[rows, group] × [group, group]` product per block instead of one over every token.
    let x = x
        .reshape((tokens, blocks, group))?
        .transpose(0, 1)?
        .contiguous()?;
    let row_weight = Tensor::from_vec(weights, (1, tokens, 1), &device)?;
    let gram = x
        .broadcast_mul(&row_weight)?
        .transpose(1, 2)?
        .contiguous()?
        .matmul(&x)?;
    let mut best_loss = vec![f32::INFINITY; rows * blocks];
    let mut best = vec![0f32; rows * blocks];
    let mut chosen = vec![1f32; rows * blocks];
    for ratio in clip_ratios() {
        let diff: Vec<f32> = w
            .par_chunks(group)
            .zip(block_amax.par_iter())
            .flat_map_iter(|(b, &amax)| {
                let clip = amax * ratio;
                let scale = 7.0 / clip;
                b.iter().map(move |&v| {
                    let q = if clip == 0.0 {
                        0.0
                    } else {
                        (p.round)(round_int4(v * scale) / scale)
                    };
                    q - v
                })
            })
            .collect();
        // [blocks, rows, group]
        let d = Tensor::from_vec(diff, (rows, blocks, group), &device)?
            .transpose(0, 1)?
            .contiguous()?;
        // dᵀ G d per block and row: [blocks, rows].
        let loss: Vec<Vec<f32>> = (d.matmul(&gram)? * &d)?.sum(2)?.to_vec2()?;
        for (b, per_row) in loss.iter().enumerate() {
            for (r, &l) in per_row.iter().enumerate() {
                let i = r * blocks + b;
                if l < best_loss[i] {
                    best_loss[i] = l;
                    best[i] = block_amax[i] * ratio;
                    chosen[i] = ratio;
                }
            }
        }
    }
    Ok((best, chosen))
}

/// A calibration that runs the AWQ search on every Linear `searched` accepts, layer by layer
/// (see [`super::max::calibrate_by_layer`]), besides max calibration (which also keeps the
/// per-channel input amax the input-quantized AWQ formats need).
pub struct AwqCalibrator {
    max: MaxCalibrator,
    searched: Box<dyn Fn(&str) -> bool + Send>,
    quant: AwqWeight,
    alpha_step: f64,
    /// Also run the clipping search (ModelOpt's `awq_full`; INT4 only).
    clip: bool,
    /// The current layer's Linear inputs, per call.
    inputs: BTreeMap<String, Vec<Tensor>>,
    results: BTreeMap<String, AwqSearch>,
    /// Linears that were never called with tokens (ModelOpt gives them `pre_quant_scale = 1`).
    unexercised: Vec<String>,
}

impl AwqCalibrator {
    /// A calibrator searching the Linears `searched` accepts against `quant`, on the α grid
    /// of `alpha_step` (ModelOpt: 0.1).
    pub fn new(
        quant: AwqWeight,
        alpha_step: f64,
        searched: impl Fn(&str) -> bool + Send + 'static,
    ) -> Self {
        AwqCalibrator {
            max: MaxCalibrator::default().with_channels(),
            searched: Box::new(searched),
            quant,
            alpha_step,
            clip: false,
            inputs: BTreeMap::new(),
            results: BTreeMap::new(),
            unexercised: Vec::new(),
        }
    }

    /// Also runs the clipping search after the scale search (ModelOpt's `awq_full`): each
    /// INT4 block's amax may shrink to as little as half. A named error for NVFP4.
    pub fn with_clip_search(mut self) -> Result<Self, ModelError> {
        if !matches!(self.quant, AwqWeight::Int4 { .. }) {
            return Err(ModelError::Config(
                "AWQ's clipping search runs on INT4 weights only (int4-awq)".into(),
            ));
        }
        self.clip = true;
        Ok(self)
    }

    /// The max calibration that ran alongside.
    pub fn max(&self) -> &MaxCalibrator {
        &self.max
    }

    /// The search of every Linear, by module path.
    pub fn results(&self) -> &BTreeMap<String, AwqSearch> {
        &self.results
    }

    /// Linears searched but never reached by a token.
    pub fn unexercised(&self) -> &[String] {
        &self.unexercised
    }

    /// The statistics as an export takes them: every amax of the max calibration; for each
    /// searched Linear `pre_quant_scale = 1/s` and, when `input_quantized` (w4a8-awq,
    /// nvfp4-awq), the amax of its smoothed input; `pre_quant_scale = 1` for Linears no token
    /// reached (ModelOpt's choice for idle experts).
    pub fn act_amax(
        &self,
        checkpoint: &crate::checkpoint::Checkpoint,
        input_quantized: bool,
    ) -> Result<crate::export::act_amax::ActAmax, ModelError> {
        let max = &self.max;
        let mut act = crate::export::act_amax::ActAmax::from_values(
            max.amax().iter().map(|(k, v)| (k.clone(), *v)),
        );
        let weight = |module: &str| {
            let name = format!("{module}.weight");
            checkpoint.tensor(&name).cloned().ok_or(ModelError::Tensor {
                tensor: name,
                message: "missing".into(),
            })
        };
        for (module, found) in &self.results {
            let pqs = found.pre_quant_scale();
            if input_quantized {
                let meta = weight(module)?;
                let p = Precision::of(meta.dtype).ok_or_else(|| ModelError::Tensor {
                    tensor: meta.name.clone(),
                    message: format!("dtype {:?} cannot be smoothed", meta.dtype),
                })?;
                let channels = max.channels().and_then(|c| c.get(module)).ok_or_else(|| {
                    ModelError::Tensor {
                        tensor: meta.name.clone(),
                        message: "no per-channel input statistics".into(),
                    }
                })?;
                act.set_input(module, super::max::smoothed_amax(channels, &pqs, p.round));
            }
            act.set_pre_quant_scale(module, pqs);
            if let Some(clip) = &found.clip_amax {
                act.set_weight_amax(module, clip.clone());
            }
        }
        for module in &self.unexercised {
            let width = weight(module)?.shape.get(1).copied().unwrap_or(0);
            act.set_pre_quant_scale(module, vec![1.0; width]);
        }
        Ok(act)
    }

    fn search_layer(
        &mut self,
        checkpoint: &crate::checkpoint::Checkpoint,
        model: &DecoderModel,
    ) -> Result<(), ModelError> {
        let inputs = std::mem::take(&mut self.inputs);
        // The stage's searched Linears that no token reached (MoE experts).
        for name in model.weights().vars().keys() {
            if let Some(m) = name.strip_suffix(".weight")
                && (self.searched)(m)
                && !inputs.contains_key(m)
                && model.weights().get(name)?.rank() == 2
            {
                self.unexercised.push(m.to_string());
            }
        }
        for (module, xs) in inputs {
            let name = format!("{module}.weight");
            let meta = checkpoint.tensor(&name).ok_or_else(|| ModelError::Tensor {
                tensor: name.clone(),
                message: "missing".into(),
            })?;
            let p = Precision::of(meta.dtype).ok_or_else(|| ModelError::Tensor {
                tensor: name.clone(),
                message: format!("dtype {:?} cannot be smoothed", meta.dtype),
            })?;
            let weight = model.weights().get(&name)?;
            let cols = weight.dim(1)?;
            let w = host(weight)?;
            let bias = model.weights().maybe(&format!("{module}.bias"));
            match search_linear(&xs, &w, cols, bias, self.quant, p, self.alpha_step)? {
                Some(mut found) => {
                    if let (true, AwqWeight::Int4 { group }) = (self.clip, self.quant) {
                        // On the smoothed weight, `round(W · (1/pqs))` with the f32 scale, and
                        // inputs times the stored (rounded) one — as ModelOpt holds them.
                        let pqs = found.pre_quant_scale();
                        let smoothed: Vec<f32> = w
                            .par_chunks(cols)
                            .flat_map_iter(|row| {
                                row.iter()
                                    .zip(&pqs)
                                    .map(|(&x, &s)| (p.round)(x * (1.0 / s)))
                            })
                            .collect();
                        let stored: Vec<f32> = pqs.iter().map(|&s| (p.round)(s)).collect();
                        let (amax, ratio) = clip_search(&xs, &stored, &smoothed, cols, group, p)?;
                        (found.clip_amax, found.clip_ratio) = (Some(amax), Some(ratio));
                    }
                    self.results.insert(module, found);
                }
                None => self.unexercised.push(module),
            }
        }
        Ok(())
    }
}

impl Observer for AwqCalibrator {
    fn linear_input(&mut self, module: &str, x: &Tensor) -> Result<(), ModelError> {
        self.max.linear_input(module, x)?;
        if x.elem_count() > 0 && (self.searched)(module) {
            let k = x.dim(candle_core::D::Minus1)?;
            let x = x
                .detach()
                .to_dtype(DType::F32)?
                .reshape((x.elem_count() / k, k))?;
            self.inputs.entry(module.to_string()).or_default().push(x);
        }
        Ok(())
    }
    fn key_value(&mut self, attention: &str, k: &Tensor, v: &Tensor) -> Result<(), ModelError> {
        self.max.key_value(attention, k, v)
    }
    fn all_experts(&self) -> bool {
        self.max.all_experts()
    }
}

impl LayerCalibration for AwqCalibrator {
    fn stage_done(
        &mut self,
        checkpoint: &crate::checkpoint::Checkpoint,
        model: &DecoderModel,
    ) -> Result<(), ModelError> {
        self.search_layer(checkpoint, model)
    }
    fn finish(&mut self, checkpoint: &crate::checkpoint::Checkpoint) {
        self.max.finish(checkpoint);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::excessive_precision)] // the f32 values torch printed
    fn the_alpha_grid_is_torch_arange_in_f32() {
        // torch.arange(0, 1.0 + 0.1, 0.1).tolist() (torch 2.9): 11 points.
        let want = [
            0.0,
            0.10000000149011612,
            0.20000000298023224,
            0.30000001192092896,
            0.4000000059604645,
            0.5,
            0.6000000238418579,
            0.699999988079071,
            0.800000011920929,
            0.8999999761581421,
            1.0,
        ];
        let got: Vec<f64> = alpha_grid(0.1).into_iter().map(f64::from).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn scales_follow_the_formula_and_are_normalised() {
        // α = 0.5: s = √act / √w, then divided by √(max · min).
        let s = awq_scale(&[4.0, 1.0], &[1.0, 4.0], 0.5);
        // raw: [2, 0.5]; √(2 · 0.5) = 1.
        assert_eq!(s, [2.0, 0.5]);
        // α = 0: 1/w; a zero weight statistic hits the 1e4 clamp.
        let s = awq_scale(&[1.0, 1.0], &[0.5, 0.0], 0.0);
        let norm = (2.0f32 * 1e4).sqrt();
        assert_eq!(s, [2.0 / norm, 1e4 / norm]);
    }

    #[test]
    fn the_weight_statistic_is_relative_to_the_block_amax() {
        let p = Precision::of(safetensors::Dtype::F32).unwrap();
        // Two rows, blocks of 2: |w| / block amax, averaged over the rows.
        let w = [1.0, -2.0, 4.0, 4.0, /* row 2 */ 3.0, 3.0, 0.0, 0.0];
        let s = weight_scale(&w, 4, 2, p);
        // row 1: [0.5, 1, 1, 1]; row 2: [1, 1, 0, 0] (a zero block divides by tiny).
        assert_eq!(s, [0.75, 1.0, 0.5, 0.5]);
    }

    #[test]
    fn int4_rounding_is_half_to_even_then_clamped() {
        for i in -2000..=2000 {
            let x = i as f32 / 100.0;
            assert_eq!(round_int4(x), x.round_ties_even().clamp(-8.0, 7.0), "{x}");
        }
        for x in [
            0.5f32,
            1.5,
            2.5,
            -0.5,
            -2.5,
            7.5,
            -8.5,
            1e30,
            -1e30,
            f32::MIN_POSITIVE,
        ] {
            assert_eq!(round_int4(x), x.round_ties_even().clamp(-8.0, 7.0), "{x}");
        }
    }

    #[test]
    fn int4_fake_quantization_rounds_to_the_block_grid() {
        let q = AwqWeight::Int4 { group: 4 }
            .fake_quant(&[7.0, 3.4, -3.5, 0.0, 0.0, 0.0, 0.0, 0.0], 8, |x| x)
            .unwrap();
        // amax 7: the grid is the integers; −3.5 rounds half to even; a zero block stays 0.
        assert_eq!(q, [7.0, 3.0, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
    }
}
