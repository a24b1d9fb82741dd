//! `kiln eval`: perplexity and speed of a model — plain or quantized (weights decoded on load)
//! — on token-id samples.

use super::args::{DeviceArgs, RunDtype};
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
    /// Evaluation data: JSONL, one `{"input_ids": [...]}` or `{"text": ...}` per line; with
    /// --ctx, plain text.
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Plain text scored as llama-perplexity scores it: the whole text tokenized, cut into
    /// non-overlapping chunks of N tokens (each starting with BOS where the tokenizer adds
    /// one), the second half of each chunk scored.
    #[arg(long, value_name = "N")]
    ctx: Option<usize>,
    /// With --ctx: use the first N chunks only (llama-perplexity's `--chunks`).
    #[arg(long, value_name = "N", requires = "ctx")]
    chunks: Option<usize>,
    /// With --ctx: compare each token's distribution with this reference model's (any format
    /// kiln reads): KL divergence (mean, median, 99th percentile, max), top-1 agreement and
    /// Δppl, as llama-perplexity's `--kl-divergence` reports them.
    #[arg(long, value_name = "MODEL", requires = "ctx")]
    kl_divergence: Option<PathBuf>,
    /// The tokenizer.json for --ctx text (default: the model's folder's, else the reference's).
    #[arg(long, value_name = "FILE", requires = "ctx")]
    tokenizer: Option<PathBuf>,
    /// Samples to use (the first N lines; all by default).
    #[arg(long, value_name = "N")]
    max_samples: Option<usize>,
    /// Tokens per sample (longer samples are cut).
    #[arg(long, value_name = "L")]
    seq_len: Option<usize>,
    /// A PEFT LoRA adapter folder to apply to the model (what `kiln train` writes, over a plain
    /// or a quantized base: QLoRA's).
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Quantized exports: run the activations unquantized (only the weights decoded). By
    /// default they are fake-quantized as the format prescribes, as an engine runs them.
    #[arg(long)]
    weights_only: bool,
    /// The dtype the model runs in (and the --kl-divergence reference with it): f32, the most
    /// exact, or bf16, as transformers runs a bf16 checkpoint — on CPUs with AVX-512 BF16 its
    /// Linears run that instruction's GEMM, about twice as fast. The log-probabilities are
    /// taken in f32 (f64 sums) either way.
    #[arg(long, value_enum, default_value_t = RunDtype::F32)]
    dtype: RunDtype,
    #[command(flatten)]
    device: DeviceArgs,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

/// The model at `path` in `dtype`, read by the reader of whichever registered format it is in
/// (a plain checkpoint when none recognises it; its folder's own errors come unwrapped).
pub(super) fn open_model(
    path: &std::path::Path,
    dtype: candle::DType,
    device: &candle::Device,
    activations: bool,
) -> Result<kiln_runtime::model::DecoderModel> {
    if kiln_runtime::formats::detect(path)?.is_none() {
        kiln_runtime::checkpoint::Checkpoint::open(path)?;
    }
    let model = kiln_runtime::formats::load_model(path, dtype, device, activations)
        .with_context(|| format!("loading {}", path.display()))?;
    // A bf16 model's attention as transformers 5 runs it by default (SDPA: f32 scores, no
    // `[t, t]` tensor held); an f32 model's is the same either way.
    Ok(model.with_attn_implementation(kiln_runtime::model::AttnImplementation::Sdpa))
}

/// The model at `path` with the adapter `adapter` applied, if one is given.
fn open_adapted(
    path: &std::path::Path,
    adapter: Option<&std::path::Path>,
    dtype: candle::DType,
    device: &candle::Device,
    activations: bool,
) -> Result<kiln_runtime::model::DecoderModel> {
    let model = open_model(path, dtype, device, activations)?;
    let Some(dir) = adapter else {
        return Ok(model);
    };
    let a = kiln_runtime::model::lora::Adapters::load_peft(dir, &model)
        .with_context(|| format!("loading the adapter {}", dir.display()))?;
    Ok(model.with_adapters(Some(std::sync::Arc::new(a))))
}

/// `kiln eval --ctx`: llama-perplexity's protocol on plain text.
fn eval_text(args: &EvalArgs, ctx: usize, out: &mut dyn Write) -> Result<i32> {
    use kiln_runtime::model::eval::{chunked, chunks};

    let dir_of = |p: &std::path::Path| {
        if p.is_dir() {
            p.to_path_buf()
        } else {
            p.parent().map(PathBuf::from).unwrap_or_default()
        }
    };
    let tokenizer_path = match &args.tokenizer {
        Some(t) => t.clone(),
        None => [Some(&args.model), args.kl_divergence.as_ref()]
            .into_iter()
            .flatten()
            .map(|m| dir_of(m).join("tokenizer.json"))
            .find(|p| p.is_file())
            .context("--ctx needs a tokenizer: neither model's folder has tokenizer.json (--tokenizer FILE)")?,
    };
    let text = std::fs::read_to_string(&args.data)
        .with_context(|| format!("--data {}", args.data.display()))?;
    let (ids, bos) = kiln_runtime::model::eval::tokenize_text(&tokenizer_path, &text)?;
    let mut all = chunks(&ids, ctx, bos);
    if let Some(n) = args.chunks {
        all.truncate(n);
    }
    if all.is_empty() {
        anyhow::bail!(
            "--data {}: {} tokens, fewer than one chunk of --ctx {ctx}",
            args.data.display(),
            ids.len()
        );
    }
    let device = args.device.device()?;
    let model = open_adapted(
        &args.model,
        args.adapter.as_deref(),
        args.dtype.into(),
        &device,
        !args.weights_only,
    )?;
    let reference = args
        .kl_divergence
        .as_ref()
        .map(|r| open_model(r, args.dtype.into(), &device, false))
        .transpose()?;
    let e = chunked(&model, reference.as_ref(), &all, |_, _| {})?;
    if args.json {
        let mut v = serde_json::json!({
            "model": args.model,
            "ctx": ctx,
            "chunks": e.chunks,
            "scored_tokens": e.scored,
            "perplexity": e.perplexity,
            "perplexity_stderr": e.perplexity_stderr,
            "seconds": e.seconds,
        });
        if let Some(kl) = &e.kl {
            v["kl_divergence"] = serde_json::json!({
                "reference": args.kl_divergence,
                "reference_perplexity": kl.reference_perplexity,
                "delta_perplexity": e.perplexity - kl.reference_perplexity,
                "mean": kl.mean,
                "median": kl.median,
                "p99": kl.p99,
                "max": kl.max,
                "same_top1": kl.top1,
            });
        }
        writeln!(out, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(0);
    }
    writeln!(
        out,
        "perplexity {:.4} ± {:.4} over {} chunks of {ctx} tokens ({} scored, the second half of each); {:.1} s",
        e.perplexity, e.perplexity_stderr, e.chunks, e.scored, e.seconds
    )?;
    if let Some(kl) = &e.kl {
        writeln!(
            out,
            "against {}: reference perplexity {:.4}, Δppl {:+.4}; KL divergence mean {:.6}, median {:.6}, 99 % {:.6}, max {:.6}; same top token {:.3} %",
            args.kl_divergence
                .as_deref()
                .unwrap_or_else(|| std::path::Path::new(""))
                .display(),
            kl.reference_perplexity,
            e.perplexity - kl.reference_perplexity,
            kl.mean,
            kl.median,
            kl.p99,
            kl.max,
            100.0 * kl.top1
        )?;
    }
    Ok(0)
}

pub fn eval(args: &EvalArgs, out: &mut dyn Write) -> Result<i32> {
    if let Some(ctx) = args.ctx {
        return eval_text(args, ctx, out);
    }
    let tokenizer = model_tokenizer(&args.model)?;
    let samples = read_samples_with(
        &args.data,
        args.max_samples,
        args.seq_len,
        tokenizer.as_ref(),
    )
    .context("--data")?;
    let device = args.device.device()?;
    let model = open_adapted(
        &args.model,
        args.adapter.as_deref(),
        args.dtype.into(),
        &device,
        !args.weights_only,
    )?;
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
