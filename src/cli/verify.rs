//! `kiln verify`: reload a quantized export as a consumer would, check it against its
//! reference model, and (with data) compare their perplexity.

use super::args::DeviceArgs;
use anyhow::{Context, Result};
use clap::Args;
use kiln_runtime::calibrate::max::{model_tokenizer, read_samples_with};
use kiln_runtime::formats::verify as check;
use kiln_runtime::model::candle;
use kiln_runtime::model::eval::perplexity;
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// The model the export was made from.
    #[arg(long)]
    reference: PathBuf,
    /// The quantized export, in any registered writer's format (its folder or file; `kiln
    /// registry writers` lists the formats kiln reads), written by kiln or by the format's
    /// own tool.
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
    let m = super::eval::open_model(dir, candle::DType::F32, device, true)?;
    Ok(perplexity(&m, samples)?.perplexity)
}

pub fn verify(args: &VerifyArgs, out: &mut dyn Write) -> Result<i32> {
    let report = check(&args.reference, &args.quantized)?;
    let mut failed = !report.problems.is_empty();
    for p in &report.problems {
        writeln!(out, "FAIL {p}")?;
    }
    if !failed {
        writeln!(
            out,
            "ok: {} — {} quantized Linears decode to the reference's shapes; {}",
            report.quant_algo,
            report.weight_errors.len(),
            report.agreement
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
