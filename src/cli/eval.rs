//! `kiln eval`: perplexity and speed of a model — plain or quantized (weights decoded on load)
//! — on token-id samples.

use super::args::DeviceArgs;
use anyhow::{Context, Result};
use clap::Args;
use kiln_runtime::calibrate::max::{model_tokenizer, read_samples_with};
use kiln_runtime::model::candle;
use kiln_runtime::model::eval::perplexity;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The model: a Hugging Face checkpoint folder, or an export in any registered writer's
    /// format (its folder or file; `kiln registry writers` lists the formats kiln reads).
    #[arg(long)]
    model: PathBuf,
    /// Evaluation data: JSONL, one `{"input_ids": [...]}` or `{"text": ...}` per line.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Samples to use (the first N lines; all by default).
    #[arg(long, value_name = "N")]
    max_samples: Option<usize>,
    /// Tokens per sample (longer samples are cut).
    #[arg(long, value_name = "L")]
    seq_len: Option<usize>,
    /// Quantized exports: run the activations unquantized (only the weights decoded). By
    /// default they are fake-quantized as the format prescribes, as an engine runs them.
    #[arg(long)]
    weights_only: bool,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// The model at `path` in f32, read by the reader of whichever registered format it is in (a
/// plain checkpoint when none recognises it; its folder's own errors come unwrapped).
pub(super) fn open_model(
    path: &std::path::Path,
    device: &candle::Device,
    activations: bool,
) -> Result<kiln_runtime::model::DecoderModel> {
    if kiln_runtime::formats::detect(path)?.is_none() {
        kiln_runtime::checkpoint::Checkpoint::open(path)?;
    }
    kiln_runtime::formats::load_model(path, candle::DType::F32, device, activations)
        .with_context(|| format!("loading {}", path.display()))
}

pub fn eval(args: &EvalArgs, out: &mut dyn Write) -> Result<i32> {
    let tokenizer = model_tokenizer(&args.model)?;
    let samples = read_samples_with(
        &args.data,
        args.max_samples,
        args.seq_len,
        tokenizer.as_ref(),
    )
    .context("--data")?;
    let device = args.device.device()?;
    let model = open_model(&args.model, &device, !args.weights_only)?;
    let act = model.activation_quant();
    let quantized_activations = act.inputs.values().filter(|q| q.quant.is_some()).count();
    let p = perplexity(&model, &samples)?;
    if args.json {
        let v = serde_json::json!({
            "model": args.model,
            "perplexity": p.perplexity,
            "nll": p.nll,
            "predicted_tokens": p.predicted,
            "tokens": p.tokens,
            "seconds": p.seconds,
            "tokens_per_second": p.tokens as f64 / p.seconds.max(1e-9),
            "fake_quantized_linear_inputs": quantized_activations,
            "fake_quantized_kv_caches": act.kv.len(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        writeln!(
            out,
            "perplexity {:.4} (mean NLL {:.4} nats) over {} predicted tokens in {} samples; {:.0} tokens/s",
            p.perplexity,
            p.nll,
            p.predicted,
            samples.len(),
            p.tokens as f64 / p.seconds.max(1e-9)
        )?;
        if !act.is_empty() {
            writeln!(
                out,
                "activations fake-quantized as the format prescribes: {quantized_activations} Linear inputs, {} KV caches (--weights-only to leave them unquantized)",
                act.kv.len()
            )?;
        }
    }
    Ok(0)
}
