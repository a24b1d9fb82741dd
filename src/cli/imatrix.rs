//! `kiln imatrix`: llama.cpp's importance matrix (`llama-imatrix`) of a model on plain text,
//! for `kiln export --output-format gguf --imatrix FILE` (and `llama-quantize --imatrix`).

use super::args::DeviceArgs;
use anyhow::{Context, Result, bail};
use clap::Args;
use kiln_runtime::formats::gguf::imatrix::Collector;
use kiln_runtime::model::candle;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct ImatrixArgs {
    /// The model: a Hugging Face checkpoint folder, or an export in any format kiln reads.
    #[arg(long, short = 'm')]
    model: PathBuf,
    /// Plain text (llama-imatrix's `-f`): tokenized whole, cut into chunks of --ctx tokens,
    /// each starting with BOS where the tokenizer adds one.
    #[arg(long, short = 'f', value_name = "FILE")]
    data: PathBuf,
    /// The importance matrix to write (`.gguf`; `.dat` with --output-format dat).
    #[arg(long, short = 'o', value_name = "FILE")]
    out: PathBuf,
    /// Tokens per chunk (llama-imatrix's `-c`, default 512). The text must hold at least two.
    #[arg(long, short = 'c', value_name = "N", default_value_t = 512)]
    ctx: usize,
    /// Use the first N chunks only (llama-imatrix's `--chunks`).
    #[arg(long, value_name = "N")]
    chunks: Option<usize>,
    /// Also collect `output.weight`'s input (llama-imatrix's `--process-output`).
    #[arg(long)]
    process_output: bool,
    /// The file layout: `gguf` (llama.cpp's current default) or `dat` (the legacy format).
    #[arg(long, value_enum, default_value_t = ImatrixFormat::Gguf)]
    output_format: ImatrixFormat,
    /// The tokenizer.json (default: the model folder's).
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    #[command(flatten)]
    device: DeviceArgs,
}

/// `--output-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ImatrixFormat {
    /// GGUF (`imatrix.*` metadata, `*.in_sum2` and `*.counts` tensors).
    Gguf,
    /// The legacy `.dat` file.
    Dat,
}

/// `kiln imatrix`.
pub fn imatrix(args: &ImatrixArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    use kiln_runtime::model::eval::{chunks, tokenize_text};
    if args.ctx < 16 {
        bail!(
            "--ctx {}: llama-imatrix collects no matrix input of fewer than 16 tokens",
            args.ctx
        );
    }
    let dir = if args.model.is_dir() {
        args.model.clone()
    } else {
        args.model.parent().map(PathBuf::from).unwrap_or_default()
    };
    let tokenizer = match &args.tokenizer {
        Some(t) => t.clone(),
        None => Some(dir.join("tokenizer.json"))
            .filter(|p| p.is_file())
            .context("the model's folder has no tokenizer.json (--tokenizer FILE)")?,
    };
    let text = std::fs::read_to_string(&args.data)
        .with_context(|| format!("--data {}", args.data.display()))?;
    let (ids, bos) = tokenize_text(&tokenizer, &text)?;
    if ids.len() < 2 * args.ctx {
        bail!(
            "--data {}: {} tokens; llama-imatrix needs at least {} (two chunks of --ctx {})",
            args.data.display(),
            ids.len(),
            2 * args.ctx,
            args.ctx
        );
    }
    let mut all = chunks(&ids, args.ctx, bos);
    if let Some(n) = args.chunks {
        all.truncate(n);
    }
    let device = args.device.device()?;
    // A Hugging Face checkpoint runs one decoder layer at a time (as calibration does): one
    // layer's weights in memory with every chunk's hidden states, whatever the model's size. An
    // export (GGUF, compressed-tensors, ...) is decoded whole.
    enum Source {
        Layers(kiln_runtime::checkpoint::Checkpoint),
        Whole(kiln_runtime::model::DecoderModel),
    }
    let source = if kiln_runtime::formats::detect(&args.model)?.is_none() {
        Source::Layers(kiln_runtime::checkpoint::Checkpoint::open(&args.model)?)
    } else {
        Source::Whole(super::eval::open_model(
            &args.model,
            candle::DType::F32,
            &device,
            false,
        )?)
    };
    let config = match &source {
        Source::Layers(c) => kiln_runtime::model::DecoderConfig::from_json(c.config().raw())
            .with_context(|| format!("{}: config.json", args.model.display()))?,
        Source::Whole(m) => m.config().clone(),
    };
    let experts = config.moe.as_ref().map_or(0, |m| m.experts);
    let tied = config.tie_word_embeddings;
    if args.process_output && tied {
        writeln!(
            err,
            "warning: --process-output: {} ties its output to token_embd, whose input \
             llama-imatrix does not collect; no output.weight entry",
            args.model.display()
        )?;
    }
    let collector = Collector::new(experts, args.process_output, tied);
    let started = std::time::Instant::now();
    let collector = match &source {
        Source::Layers(checkpoint) => {
            let bar = indicatif::ProgressBar::new(config.layers as u64 + 1).with_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} layers and the head")
                    .expect("a valid template"),
            );
            let c = kiln_runtime::calibrate::max::calibrate_by_layer(
                checkpoint,
                candle::DType::F32,
                &device,
                &all,
                collector,
                |done, _| bar.set_position(done as u64),
            )?;
            bar.finish_and_clear();
            c
        }
        Source::Whole(model) => {
            let mut collector = collector;
            let bar = indicatif::ProgressBar::new(all.len() as u64).with_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} chunks")
                    .expect("a valid template"),
            );
            for chunk in &all {
                let ids = candle::Tensor::from_vec(chunk.clone(), (1, chunk.len()), &device)?;
                model.forward_observed(&ids, &mut collector)?;
                bar.inc(1);
            }
            bar.finish_and_clear();
            collector
        }
    };
    let m = collector.finish(
        vec![args.data.display().to_string()],
        all.len() as u32,
        args.ctx as u32,
    );
    if m.entries.is_empty() {
        bail!(
            "{}: no weight matrix of the model was seen",
            args.model.display()
        );
    }
    if args.output_format == ImatrixFormat::Gguf && args.out.extension().is_none_or(|e| e != "gguf")
    {
        writeln!(
            err,
            "warning: writing a GGUF imatrix to {} (not .gguf); --output-format dat writes the \
             legacy file",
            args.out.display()
        )?;
    }
    // Written beside the target and renamed into place: never half a file.
    let tmp = args.out.with_file_name(format!(
        ".{}.kiln-tmp",
        args.out
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    match args.output_format {
        ImatrixFormat::Gguf => m.write_gguf(&tmp),
        ImatrixFormat::Dat => m.write_dat(&tmp),
    }
    .inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    std::fs::rename(&tmp, &args.out).with_context(|| format!("{}", args.out.display()))?;
    writeln!(
        out,
        "importance matrix of {} weight matrices over {} chunks of {} tokens → {} ({:.1} s)",
        m.entries.len(),
        all.len(),
        args.ctx,
        args.out.display(),
        started.elapsed().as_secs_f64()
    )?;
    Ok(0)
}
