//! `kiln verify`: reload a quantized export as a consumer would, check it against its
//! reference model, and (with data) compare their perplexity.

use super::args::DeviceArgs;
use anyhow::{Context, Result};
use clap::Args;
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::model::calib::{model_tokenizer, read_samples_with};
use kiln_runtime::model::eval::perplexity;
use kiln_runtime::model::verify::verify as check;
use kiln_runtime::model::{DecoderModel, candle};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// The model the export was made from.
    #[arg(long)]
    reference: PathBuf,
    /// The quantized export: ModelOpt's layout (kiln's or ModelOpt's), compressed-tensors
    /// (kiln's or llm-compressor's), mlx-lm's layout (kiln's or `mlx_lm.convert`'s), or a
    /// GGUF file kiln wrote (its folder or the `.gguf` file).
    #[arg(long)]
    quantized: PathBuf,
    /// Evaluation data (JSONL of `{"input_ids": [...]}` or `{"text": ...}`): compare the
    /// perplexities.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Fail when the quantized perplexity is more than this many percent above the
    /// reference's (with --data).
    #[arg(long, value_name = "PERCENT", requires = "data")]
    max_ppl_increase: Option<f64>,
    /// Fail when a quantized Linear's decoded weight is further than this from the
    /// reference's, relatively (‖Ŵ − W‖/‖W‖; 4-bit formats sit near 0.1).
    #[arg(long, value_name = "X", default_value_t = 0.5)]
    max_weight_error: f64,
    #[command(flatten)]
    device: DeviceArgs,
}

fn ppl(dir: &Path, samples: &[Vec<u32>], device: &candle::Device) -> Result<f64> {
    let m = match kiln_runtime::model::gguf_layout::gguf_file(dir) {
        Some(g) => DecoderModel::load_gguf(&g, candle::DType::F32, device),
        None => DecoderModel::load(&Checkpoint::open(dir)?, candle::DType::F32, device),
    }
    .with_context(|| format!("loading {}", dir.display()))?;
    Ok(perplexity(&m, samples)?.perplexity)
}

pub fn verify(args: &VerifyArgs, out: &mut dyn Write) -> Result<i32> {
    let report = check(&args.reference, &args.quantized)?;
    let mut failed = !report.problems.is_empty();
    for p in &report.problems {
        writeln!(out, "FAIL {p}")?;
    }
    if !failed {
        // ModelOpt's layout has hf_quant_config.json beside config.json; compressed-tensors
        // has config.json's quantization_config alone.
        let configs = match report.quant_algo.split(' ').next() {
            Some("compressed-tensors") => "config.json's quantization_config agrees",
            Some("mlx") => "config.json's quantization agrees",
            Some("gguf") => "the GGUF metadata agrees with the reference's config",
            _ => "both JSON files agree",
        };
        writeln!(
            out,
            "ok: {} — {} quantized Linears decode to the reference's shapes; names, dtypes and {configs}",
            report.quant_algo,
            report.weight_errors.len()
        )?;
        let mut worst = report.weight_errors.clone();
        worst.sort_by(|a, b| b.1.total_cmp(&a.1));
        writeln!(
            out,
            "relative weight error ‖Ŵ − W‖/‖W‖{}:",
            if report.smoothed {
                " (smoothed weights: includes the AWQ/SmoothQuant scaling, undone at run time)"
            } else {
                ""
            }
        )?;
        for (m, e) in worst.iter().take(5) {
            writeln!(out, "  {e:.4e}  {m}")?;
        }
        for (m, e) in worst.iter().filter(|(_, e)| *e > args.max_weight_error) {
            writeln!(
                out,
                "FAIL `{m}` decodes to a weight {e:.3e} away from the reference's (relative), more than --max-weight-error {}",
                args.max_weight_error
            )?;
            failed = true;
        }
    }
    if let (Some(data), false) = (&args.data, failed) {
        let tokenizer = model_tokenizer(&args.reference)?;
        let samples = read_samples_with(data, None, None, tokenizer.as_ref()).context("--data")?;
        let device = args.device.device()?;
        let (a, b) = (
            ppl(&args.reference, &samples, &device)?,
            ppl(&args.quantized, &samples, &device)?,
        );
        let delta = (b / a - 1.0) * 100.0;
        writeln!(
            out,
            "perplexity: reference {a:.4}, quantized {b:.4} ({delta:+.2} %)"
        )?;
        if let Some(max) = args.max_ppl_increase
            && delta > max
        {
            writeln!(
                out,
                "FAIL perplexity rose {delta:.2} %, more than --max-ppl-increase {max} %"
            )?;
            failed = true;
        }
    }
    Ok(if failed { 1 } else { 0 })
}
