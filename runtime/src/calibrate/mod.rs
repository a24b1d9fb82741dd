//! Calibration for an export (`kiln export --calib`): runs the model on calibration samples,
//! one decoder layer at a time, and produces the statistics the recipe's format needs under
//! ModelOpt's quantizer names — max calibration of every Linear input and of K/V; for
//! `int8-sq` SmoothQuant's per-channel scales; for the AWQ formats AWQ's scale search (and
//! with `clip`, its clipping search).

pub mod awq;
pub mod gptq;
pub mod max;

use self::awq::{AwqCalibrator, AwqWeight};
use self::max::{calibrate_by_layer, model_tokenizer, read_samples_with, smoothquant_scales};
use crate::checkpoint::Checkpoint;
use crate::export::act_amax::ActAmax;
use crate::export::recipe::{Format, Recipe};
use crate::model::{MaxCalibrator, ModelError};
use candle_core::{DType, Device};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How to calibrate.
#[derive(Debug, Clone)]
pub struct CalibrationOptions {
    /// JSONL of `{"input_ids": [...]}` or `{"text": ...}` (tokenized with the model's
    /// `tokenizer.json`).
    pub data: PathBuf,
    /// Use the first N samples (all by default).
    pub samples: Option<usize>,
    /// Cut samples to this many tokens.
    pub seq_len: Option<usize>,
    /// The dtype the model runs in (f32, or bf16 as ModelOpt).
    pub dtype: DType,
    /// Where the model runs.
    pub device: Device,
    /// SmoothQuant's migration strength (ModelOpt's default 1).
    pub sq_alpha: f32,
    /// AWQ's α grid step (ModelOpt's `awq_lite` default 0.1).
    pub awq_alpha_step: f64,
    /// int4-awq: AWQ's clipping search after the scale search (ModelOpt's `awq_full`).
    pub awq_clip: bool,
    /// How statistics are gathered: the output writer's rules (ModelOpt's by default).
    pub rules: crate::export::writer::StatisticsRules,
}

impl CalibrationOptions {
    /// ModelOpt's defaults on the CPU in f32, for the samples in `data`.
    pub fn new(data: impl Into<PathBuf>) -> Self {
        CalibrationOptions {
            data: data.into(),
            samples: None,
            seq_len: None,
            dtype: DType::F32,
            device: Device::Cpu,
            sq_alpha: 1.0,
            awq_alpha_step: 0.1,
            awq_clip: false,
            rules: crate::export::writer::StatisticsRules {
                moe: crate::export::writer::MoeCalibration::RoutedShared,
                kv_moving_average: None,
            },
        }
    }
}

/// A calibration ready to run: the samples read and tokenized, the checkpoint open.
pub struct Calibration {
    checkpoint: Checkpoint,
    samples: Vec<Vec<u32>>,
    recipe: Recipe,
    options: CalibrationOptions,
}

/// What a calibration did, for the report.
#[derive(Debug, Clone, Default)]
pub struct CalibrationReport {
    /// Quantizers calibrated.
    pub quantizers: usize,
    /// Wall time, seconds.
    pub seconds: f64,
    /// One line per step that ran (SmoothQuant, AWQ's searches), in words.
    pub steps: Vec<String>,
    /// Defaults substituted (an expert no token reached keeps `pre_quant_scale = 1`).
    pub warnings: Vec<String>,
}

impl Calibration {
    /// GPTQ (`--algorithm gptq`) of every Linear the recipe quantizes, on the grid `writer`
    /// stores it on, layer by layer: the codes GPTQ chose, for the export to store.
    pub fn gptq(
        &self,
        writer: &dyn crate::export::writer::OutputWriter,
        settings: gptq::GptqSettings,
        progress: impl FnMut(usize, usize),
    ) -> Result<(std::sync::Arc<gptq::GptqCodes>, CalibrationReport), ModelError> {
        use crate::export::writer::WeightValues;
        use safetensors::Dtype;
        let started = Instant::now();
        let o = &self.options;
        let ck = &self.checkpoint;
        if let Some(t) = ck.tensors().find(|t| t.name.contains(".experts.")) {
            return Err(ModelError::Config(format!(
                "--algorithm gptq: MoE experts (`{}`) are not supported yet; dense models are",
                t.name
            )));
        }
        let keep = |m: &str| writer.gptq_covers(m, &self.recipe);
        let params = |name: &str| {
            let meta = ck.tensor(name).ok_or_else(|| ModelError::Tensor {
                tensor: name.into(),
                message: "missing from the checkpoint".into(),
            })?;
            let cols = meta.shape.get(1).copied().unwrap_or(0);
            let target = crate::export::writer::GptqTarget {
                module: name.strip_suffix(".weight").unwrap_or(name),
                checkpoint: ck,
                recipe: &self.recipe,
            };
            let none = || ModelError::Tensor {
                tensor: name.into(),
                message: "the output format has no GPTQ for this weight".into(),
            };
            let (w, grid, round): (Vec<f32>, _, fn(f32) -> f32) = match meta.dtype {
                Dtype::BF16 => {
                    let x = ck.read_as::<half::bf16>(name)?;
                    let g = writer
                        .gptq_grid(&target, &WeightValues::Bf16(&x), cols)
                        .ok_or_else(none)?;
                    let r = |v| half::bf16::from_f32(v).to_f32();
                    (x.iter().map(|v| v.to_f32()).collect(), g, r)
                }
                Dtype::F16 => {
                    let x = ck.read_as::<half::f16>(name)?;
                    let g = writer
                        .gptq_grid(&target, &WeightValues::F16(&x), cols)
                        .ok_or_else(none)?;
                    let r = |v| half::f16::from_f32(v).to_f32();
                    (x.iter().map(|v| v.to_f32()).collect(), g, r)
                }
                Dtype::F32 => {
                    let x = ck.read_as::<f32>(name)?;
                    let g = writer
                        .gptq_grid(&target, &WeightValues::F32(&x), cols)
                        .ok_or_else(none)?;
                    (x, g, |v| v)
                }
                other => {
                    return Err(ModelError::Tensor {
                        tensor: name.into(),
                        message: format!("dtype {other:?} cannot be quantized by GPTQ"),
                    });
                }
            };
            // Only compressed-tensors' integers dequantize in the scales' dtype; NVFP4's
            // effective scale and MLX's GPTQ are f32.
            let round = match grid {
                gptq::GptqGrid::Int { .. } => round,
                gptq::GptqGrid::Fp4 { .. } | gptq::GptqGrid::Affine { .. } => |v| v,
            };
            Ok(gptq::Prepared {
                values: w,
                grid,
                round,
            })
        };
        let codes = gptq::run(
            ck,
            o.dtype,
            &o.device,
            &self.samples,
            &keep,
            &params,
            settings,
            progress,
        )?;
        let mut report = CalibrationReport {
            quantizers: codes.modules().count(),
            ..CalibrationReport::default()
        };
        report.steps.push(format!(
            "GPTQ (block {}, dampening {}, actorder {}, {}): {} Linears on {} tokens, loss {:.4}",
            settings.block,
            settings.dampening,
            if settings.actorder { "static" } else { "none" },
            if settings.sequential {
                "sequential"
            } else {
                "one pass"
            },
            codes.modules().count(),
            self.tokens(),
            codes.losses.values().sum::<f64>()
        ));
        for m in &codes.rtn_fallback {
            report.warnings.push(format!(
                "gptq: `{m}`'s Hessian could not be factorized; it is rounded to nearest \
                 (llm-compressor's fallback)"
            ));
        }
        report.seconds = started.elapsed().as_secs_f64();
        Ok((codes, report))
    }

    /// Reads and tokenizes the samples for calibrating the model at `model` for `recipe`.
    pub fn prepare(
        model: &Path,
        recipe: &Recipe,
        options: CalibrationOptions,
    ) -> Result<Self, ModelError> {
        if options.awq_clip && recipe.format != Format::Int4Awq {
            return Err(ModelError::Config(format!(
                "--awq-clip: the clipping search runs for int4-awq only, not {}",
                recipe.format
            )));
        }
        let tokenizer = model_tokenizer(model)?;
        let samples = read_samples_with(
            &options.data,
            options.samples,
            options.seq_len,
            tokenizer.as_ref(),
        )?;
        Ok(Calibration {
            checkpoint: Checkpoint::open(model)?,
            samples,
            recipe: recipe.clone(),
            options,
        })
    }

    /// The samples, tokenized.
    pub fn samples(&self) -> &[Vec<u32>] {
        &self.samples
    }

    /// Tokens over all samples.
    pub fn tokens(&self) -> usize {
        self.samples.iter().map(Vec::len).sum()
    }

    /// Runs it, one decoder layer at a time (`progress(layers done, layers)`): memory is
    /// bounded by a layer plus the activations.
    pub fn run(
        &self,
        progress: impl FnMut(usize, usize),
    ) -> Result<(ActAmax, CalibrationReport), ModelError> {
        let started = Instant::now();
        let awq = match self.recipe.format {
            Format::Int4Awq | Format::W4a8Awq => Some(AwqWeight::Int4 {
                group: self
                    .recipe
                    .format
                    .block(self.recipe.group_size)
                    .unwrap_or(128),
            }),
            Format::Nvfp4Awq => Some(AwqWeight::Nvfp4),
            _ => None,
        };
        let (act, mut report) = match awq {
            Some(quant) => self.awq(quant, progress)?,
            None => self.max(progress)?,
        };
        report.seconds = started.elapsed().as_secs_f64();
        Ok((act, report))
    }

    /// Max calibration, and SmoothQuant's scales for `int8-sq`.
    fn max(
        &self,
        progress: impl FnMut(usize, usize),
    ) -> Result<(ActAmax, CalibrationReport), ModelError> {
        let (recipe, o) = (&self.recipe, &self.options);
        let smoothquant = recipe.format == Format::Int8Sq;
        // A moving average is kept in the checkpoint's dtype, as llm-compressor keeps it.
        let bf16 = self
            .checkpoint
            .tensors()
            .any(|t| t.dtype == crate::checkpoint::Dtype::BF16);
        let calibrator = MaxCalibrator::for_rules(o.rules, bf16);
        let calibrator = if smoothquant {
            calibrator.with_channels()
        } else {
            calibrator
        };
        let amax = calibrate_by_layer(
            &self.checkpoint,
            o.dtype,
            &o.device,
            &self.samples,
            calibrator,
            progress,
        )?;
        let mut report = CalibrationReport {
            quantizers: amax.amax().len(),
            ..CalibrationReport::default()
        };
        let mut act = ActAmax::from_values(amax.amax().iter().map(|(k, v)| (k.clone(), *v)));
        if let Some(channels) = amax.channels().filter(|_| smoothquant) {
            let linears: Vec<String> = channels
                .keys()
                .filter(|m| recipe.quantizes(m))
                .cloned()
                .collect();
            for (module, scale, input) in
                smoothquant_scales(&self.checkpoint, channels, &linears, o.sq_alpha)?
            {
                act.set_pre_quant_scale(&module, scale);
                act.set_input(&module, input);
            }
            report.steps.push(format!(
                "SmoothQuant (alpha {}): scales for {} Linears",
                o.sq_alpha,
                linears.len()
            ));
        }
        Ok((act, report))
    }

    /// Max calibration and AWQ's scale search (and clipping search) in one pass. Every
    /// searched Linear gets `pre_quant_scale = 1/s`; formats with input scales also get the
    /// amax of the smoothed input.
    fn awq(
        &self,
        quant: AwqWeight,
        progress: impl FnMut(usize, usize),
    ) -> Result<(ActAmax, CalibrationReport), ModelError> {
        let (recipe, o) = (&self.recipe, &self.options);
        let searched = {
            let recipe = recipe.clone();
            move |m: &str| recipe.quantizes(m)
        };
        let mut calibrator = AwqCalibrator::new(quant, o.awq_alpha_step, searched);
        if o.awq_clip {
            calibrator = calibrator.with_clip_search()?;
        }
        let calib = calibrate_by_layer(
            &self.checkpoint,
            o.dtype,
            &o.device,
            &self.samples,
            calibrator,
            progress,
        )?;
        let act = calib.act_amax(&self.checkpoint, recipe.format != Format::Int4Awq)?;
        let mut report = CalibrationReport::default();
        for module in calib.unexercised() {
            // ModelOpt: an expert no token reached keeps `pre_quant_scale = 1`.
            report.warnings.push(format!(
                "awq: no calibration token reached `{module}`; its pre_quant_scale is 1"
            ));
        }
        let mut alphas: BTreeMap<String, usize> = BTreeMap::new();
        for found in calib.results().values() {
            *alphas.entry(format!("{:.2}", found.alpha)).or_default() += 1;
        }
        report.quantizers = calib.results().len();
        report.steps.push(format!(
            "AWQ (awq_lite, alpha step {}): searched {} Linears on {} tokens; chosen alpha: {}",
            o.awq_alpha_step,
            calib.results().len(),
            self.tokens(),
            alphas
                .iter()
                .map(|(a, n)| format!("{a} ×{n}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        if o.awq_clip {
            let ratios: Vec<f32> = calib
                .results()
                .values()
                .filter_map(|f| f.clip_ratio.as_ref())
                .flatten()
                .copied()
                .collect();
            let clipped = ratios.iter().filter(|&&r| r < 1.0).count();
            report.steps.push(format!(
                "AWQ clipping search: {clipped} of {} blocks clipped (mean ratio {:.3}); the export keeps them where it does not rescale the weight, as ModelOpt's does",
                ratios.len(),
                ratios.iter().map(|&r| f64::from(r)).sum::<f64>() / ratios.len().max(1) as f64
            ));
        }
        Ok((act, report))
    }
}
