//! Reward modelling (TRL's `RewardTrainer`): a sequence classifier scores the chosen and the
//! rejected sequence of each preference pair; the Bradley–Terry loss pushes the chosen above.

use super::{MicroBatch, TensorOf, read_data};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::data::{DataFormat, Dataset, TextTokenizer, field, with_eos};
use crate::train::losses;
use crate::train::runner::{OrTrain, Runner};
use serde_json::Value;

/// A tokenized preference pair as a reward model sees it: each side whole (prompt and
/// completion), and the pair's `margin` when the data gives one.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardPair {
    /// The chosen sequence's ids.
    pub chosen: Vec<u32>,
    /// The rejected sequence's ids.
    pub rejected: Vec<u32>,
    /// The data's `margin` column.
    pub margin: Option<f64>,
}

/// Preference pairs as TRL's `RewardTrainer` prepares them: text data gets the EOS appended to
/// each completion (unless it ends with one) and `prompt + completion` tokenized whole (the
/// prompt may be implicit, part of both sides); conversational data has `prompt + chosen`
/// (and `+ rejected`) rendered by the chat template. A `margin` column, when the first pair
/// has one, is every pair's.
pub fn reward_pairs(data: &Dataset, tok: &TextTokenizer) -> Result<Vec<RewardPair>, TrainError> {
    let with_margin = data
        .records
        .first()
        .is_some_and(|r| r.fields.contains_key("margin"));
    data.records
        .iter()
        .map(|r| {
            let err = |m: String| TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: m,
            };
            let margin =
                if with_margin {
                    Some(
                    r.fields
                        .get("margin")
                        .and_then(Value::as_f64)
                        .ok_or_else(|| {
                            err("`margin` must be a number on every line (the first line has one)"
                                .into())
                        })?,
                )
                } else {
                    None
                };
            let conversational = r.fields.get("chosen").is_some_and(Value::is_array);
            let side = |k: &str| -> Result<Vec<u32>, TrainError> {
                if conversational {
                    let mut all = match r.fields.get("prompt") {
                        Some(Value::Array(p)) => p.clone(),
                        Some(_) => {
                            return Err(err(
                                "`prompt` must be a conversation when `chosen` is one".into(),
                            ));
                        }
                        None => Vec::new(),
                    };
                    all.extend(r.fields[k].as_array().cloned().unwrap_or_default());
                    Ok(tok.encode_chat(&Value::Array(all), false).map_err(err)?.0)
                } else {
                    let prompt = r.fields.get("prompt").map_or("", |_| field(r, "prompt"));
                    let text = format!("{prompt}{}", with_eos(field(r, k), &tok.eos_token));
                    tok.encode(&text)
                        .map_err(|m| err(format!("tokenizing `{k}`: {m}")))
                }
            };
            Ok(RewardPair {
                chosen: side("chosen")?,
                rejected: side("rejected")?,
                margin,
            })
        })
        .collect()
}

/// Reward modelling (TRL's `RewardTrainer`): the Bradley–Terry loss over the scores of each
/// pair's chosen and rejected sequence ([`losses::reward`]).
pub struct RewardTask {
    pairs: Vec<RewardPair>,
    center: Option<f64>,
    notes: Vec<String>,
}

impl RewardTask {
    /// The pairs of `config.train_data` (preference data, explicit or implicit prompt, text or
    /// conversational, with an optional `margin`), those longer than `max_length` on either
    /// side left out as TRL filters them; `center_rewards_coefficient`.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let data = read_data(
            config,
            &[DataFormat::Preference, DataFormat::ImplicitPreference],
        )?;
        let all = reward_pairs(&data, tok)?;
        let total = all.len();
        let pairs: Vec<RewardPair> = match config.hyper.max_length {
            Some(n) => all
                .into_iter()
                .filter(|p| p.chosen.len() <= n && p.rejected.len() <= n)
                .collect(),
            None => all,
        };
        let mut notes = Vec::new();
        if pairs.len() < total {
            let n = config.hyper.max_length.unwrap_or(0);
            if pairs.is_empty() {
                return Err(TrainError::Data {
                    path: data.path.clone(),
                    line: None,
                    message: format!(
                        "every pair has a side longer than max_length {n} tokens (TRL's RewardTrainer leaves such pairs out); raise max_length"
                    ),
                });
            }
            notes.push(format!(
                "max_length: {} of {total} pairs in {} have a side longer than {n} tokens and are left out, as TRL's RewardTrainer filters them",
                total - pairs.len(),
                data.path.display()
            ));
        }
        Ok(RewardTask {
            pairs,
            center: config.option::<f64>("center_rewards_coefficient")?,
            notes,
        })
    }

    /// Pairs in the set.
    pub fn examples(&self) -> usize {
        self.pairs.len()
    }

    /// What was left out of the data.
    pub fn notes(&self) -> Vec<String> {
        self.notes.clone()
    }

    /// The loss of the pairs `indices` (their mean) and TRL's `min_reward`, `mean_reward`,
    /// `max_reward`, `accuracy`, `margin`; the token count is every real token of both sides
    /// (TRL's `num_tokens` sums the attention mask).
    pub fn loss<R: Runner>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let pairs: Vec<&RewardPair> = indices.iter().map(|&i| &self.pairs[i]).collect();
        let mut seqs: Vec<Vec<u32>> = pairs.iter().map(|p| p.chosen.clone()).collect();
        seqs.extend(pairs.iter().map(|p| p.rejected.clone()));
        let scores = r.forward_scores(r.policy(), &seqs)?;
        let margins: Option<Vec<f64>> = pairs.iter().map(|p| p.margin).collect();
        let out = losses::reward(r.ops(), &scores, margins.as_deref(), self.center).tr()?;
        let tokens = seqs.iter().map(|s| s.len() as u64).sum();
        let mut m = out.metrics;
        m.insert("num_tokens".into(), 0.0);
        Ok((out.loss, m, tokens))
    }
}
