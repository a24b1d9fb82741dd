//! `kiln generate`: sample from a base, trained or merged model (and a PEFT adapter) with the
//! KV cache and the sampler GRPO trains with.

use anyhow::{Context, Result};
use clap::Args;
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::model::candle::DType;
use kiln_runtime::model::generate::{Rng, SamplingConfig, sample};
use kiln_runtime::model::lora::Adapters;
use kiln_runtime::train::data::TextTokenizer;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The model folder (config.json, safetensors, tokenizer.json, tokenizer_config.json).
    #[arg(long)]
    model: PathBuf,
    /// A PEFT LoRA adapter folder to apply (what `kiln train` writes).
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// The prompt (tokenized as `tokenizer(text)`, special tokens added).
    #[arg(long, required_unless_present = "chat", conflicts_with = "chat")]
    prompt: Option<String>,
    /// Chat: read user turns from standard input, one per line, and answer each with the
    /// model's chat template (the conversation so far, `add_generation_prompt`).
    #[arg(long)]
    chat: bool,
    /// Completions to sample.
    #[arg(long, default_value_t = 1)]
    num_return_sequences: usize,
    /// The most new tokens per completion.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Sample among the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Drop tokens less likely than this times the most likely one.
    #[arg(long)]
    min_p: Option<f64>,
    /// Penalty on tokens already present (1 = none).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f64,
    /// Seed of the draws.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Where the model runs: cpu, cuda[:N] (feature candle-cuda), metal[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
}

pub fn generate(args: &GenerateArgs, out: &mut dyn Write) -> Result<i32> {
    generate_from(args, out, &mut std::io::stdin().lock())
}

/// [`generate`] reading chat turns from `input`.
pub fn generate_from(
    args: &GenerateArgs,
    out: &mut dyn Write,
    input: &mut dyn std::io::BufRead,
) -> Result<i32> {
    let device = kiln_runtime::model::device(&args.device)?;
    // A plain checkpoint, or an export in any registered format (decoded by its reader).
    if kiln_runtime::formats::detect(&args.model)?.is_none() {
        Checkpoint::open(&args.model)
            .with_context(|| format!("opening {}", args.model.display()))?;
    }
    let mut model = kiln_runtime::formats::load_model(&args.model, DType::F32, &device, true)?;
    if let Some(dir) = &args.adapter {
        let a = Adapters::load_peft(dir, &model)
            .with_context(|| format!("loading the adapter {}", dir.display()))?;
        model = model.with_adapters(Some(std::sync::Arc::new(a)));
    }
    let tok = TextTokenizer::from_model_dir(&args.model)?;
    let cfg = SamplingConfig {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        max_new_tokens: args.max_new_tokens,
        eos: vec![tok.eos_id],
    };
    let mut rng = Rng(args.seed);
    if args.chat {
        let mut messages: Vec<serde_json::Value> = Vec::new();
        let mut line = String::new();
        loop {
            line.clear();
            if input.read_line(&mut line)? == 0 {
                return Ok(0);
            }
            let turn = line.trim_end_matches(['\n', '\r']);
            if turn.is_empty() {
                continue;
            }
            messages.push(serde_json::json!({"role": "user", "content": turn}));
            let (ids, _) = tok
                .encode_chat(&serde_json::Value::Array(messages.clone()), true)
                .map_err(anyhow::Error::msg)?;
            let c = sample(&model, &ids, 1, &cfg, &mut rng)?;
            let text = tok.decode(&c[0]).map_err(anyhow::Error::msg)?;
            writeln!(out, "{text}")?;
            out.flush()?;
            messages.push(serde_json::json!({"role": "assistant", "content": text}));
        }
    }
    let prompt = args.prompt.as_deref().unwrap_or_default();
    let ids = tok.encode(prompt).map_err(anyhow::Error::msg)?;
    let n = args.num_return_sequences.max(1);
    let completions = sample(&model, &ids, n, &cfg, &mut rng)?;
    for (i, c) in completions.iter().enumerate() {
        let text = tok.decode(c).map_err(anyhow::Error::msg)?;
        if n > 1 {
            writeln!(out, "--- {}", i + 1)?;
        }
        writeln!(out, "{prompt}{text}")?;
    }
    Ok(0)
}
