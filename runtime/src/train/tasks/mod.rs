//! The tasks, written once for every backend: each prepares its examples from the data as TRL
//! does, and computes a micro-batch's loss and figures from the log-probabilities a
//! [`Runner`] gives (the losses themselves are `losses.rs`'s). Candle's objectives and the MLX
//! backend both run these.

use super::TrainConfig;
use super::TrainError;
use super::config_err;
use super::data::{DataFormat, Dataset};
use super::ops::TensorOps;
use super::runner::Runner;
use std::collections::BTreeMap;

mod distill;
mod dpo;
pub mod grpo;
mod kto;
mod online_dpo;
mod ppo;
mod reward;
mod scored;
mod sft;

pub use super::data::LmExample;
pub use distill::{Conversation, DistillTask, conversations};
pub use dpo::{DpoTask, PairExample, dpo_settings, pair_examples};
pub use kto::{KtoTask, UnpairedExample, unpaired_examples};
pub use online_dpo::OnlineDpoTask;
pub use ppo::{PpoTask, RolloutSource, SampledRollouts};
pub use reward::{RewardPair, RewardTask, reward_pairs};
pub use scored::{ScoredLoss, ScoredPair, ScoredPairTask, scored_pairs};
pub use sft::{SftTask, sft_examples, sft_examples_with};

/// The tensor type of runner `R`.
pub type TensorOf<R> = <<R as Runner>::Ops as TensorOps>::T;

/// A micro-batch's loss, its figures and its token count.
pub type MicroBatch<T> = (T, BTreeMap<String, f64>, u64);

/// The training data of `config`, in one of the `accepted` formats.
pub fn read_data(config: &TrainConfig, accepted: &[DataFormat]) -> Result<Dataset, TrainError> {
    let path = config
        .train_data
        .as_ref()
        .ok_or_else(|| config_err("train_data", "required (a JSONL file)"))?;
    let text_field = config
        .option::<String>("dataset_text_field")?
        .unwrap_or_else(|| "text".into());
    Dataset::read_with(path, accepted, &text_field)
}

/// The `prompt` column of `data` as prompts (text, for reward functions) and their ids:
/// `tok(prompt)` with the tokenizer's special tokens when `special` (TRL's PPO example),
/// without them otherwise (as TRL's generation tokenizes them). A conversational prompt (a
/// list of messages) is the chat template with the generation prompt when `chat` (TRL's PPO
/// example's chat datasets), else an error naming the line (`task` says whose), as an empty
/// prompt is.
pub(crate) fn text_prompts(
    data: &Dataset,
    tok: &super::data::TextTokenizer,
    task: &str,
    special: bool,
    chat: bool,
) -> Result<(Vec<Vec<u32>>, Vec<String>), TrainError> {
    let err = |line: usize, message: String| TrainError::Data {
        path: data.path.clone(),
        line: Some(line),
        message,
    };
    let mut prompts = Vec::with_capacity(data.records.len());
    let mut texts = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let (ids, text) = match r.fields.get("prompt") {
            Some(serde_json::Value::String(text)) => {
                let ids = if special {
                    tok.encode(text)
                } else {
                    tok.encode_plain(text)
                };
                (ids, text.clone())
            }
            Some(messages @ serde_json::Value::Array(_)) if chat => {
                let text = tok
                    .render_chat(messages, true, false)
                    .map_err(|m| err(r.line, format!("the chat template: {m}")))?;
                (tok.encode_chat(messages, true).map(|(ids, _)| ids), text)
            }
            _ => {
                return Err(err(
                    r.line,
                    format!("{task} takes text prompts; conversational prompts are not built yet"),
                ));
            }
        };
        let ids = ids.map_err(|m| err(r.line, format!("tokenizing: {m}")))?;
        if ids.is_empty() {
            return Err(err(
                r.line,
                "an empty prompt: nothing to generate from".into(),
            ));
        }
        prompts.push(ids);
        texts.push(text);
    }
    Ok((prompts, texts))
}
