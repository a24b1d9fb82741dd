//! A trained reward model as a reward: GRPO's `reward_funcs` may name a sequence classifier's
//! folder (what `kiln train --task reward` writes, or any transformers
//! `*ForSequenceClassification` with one label), scored as TRL's `GRPOTrainer` scores a reward
//! model — `prompt + completion` tokenized without special tokens, right-padded with the
//! model's pad id, the score read at the last non-pad token.

use super::TrainError;
use super::config_err;
use super::data::TextTokenizer;
use crate::checkpoint::Checkpoint;
use crate::model::DecoderModel;
use candle_core::{DType, Device, Tensor};
use std::path::Path;

/// A reward model loaded for scoring (f32, on the CPU, no autograd graph).
pub struct RewardModel {
    /// The name TRL logs it under (`rewards/<name>/mean`): the folder's last component.
    pub name: String,
    model: DecoderModel,
    tokenizer: TextTokenizer,
}

impl std::fmt::Debug for RewardModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardModel")
            .field("name", &self.name)
            .finish()
    }
}

/// Sequences scored per forward pass.
const BATCH: usize = 16;

impl RewardModel {
    /// Whether `path` looks like a model folder (it has a `config.json`).
    pub fn is_model_dir(path: &Path) -> bool {
        path.join("config.json").is_file()
    }

    /// Loads the sequence classifier in `dir`; a model without a `score` head is refused (a
    /// new random head would score at random).
    pub fn load(dir: &Path) -> Result<Self, TrainError> {
        let err = |m: String| config_err("reward_funcs", format!("{}: {m}", dir.display()));
        let checkpoint = Checkpoint::open(dir).map_err(|e| err(e.to_string()))?;
        let mut model = DecoderModel::load(&checkpoint, DType::F32, &Device::Cpu)
            .map_err(|e| err(e.to_string()))?;
        model.freeze()?;
        if !model.is_classifier() {
            return Err(err(
                "not a reward model: it has no sequence-classification head (`score.weight`); \
                 train one with `kiln train --task reward`"
                    .into(),
            ));
        }
        let tokenizer = TextTokenizer::from_model_dir(dir)?;
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| dir.display().to_string());
        Ok(RewardModel {
            name,
            model,
            tokenizer,
        })
    }

    /// The model's tokenizer (conversations are rendered with its chat template).
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// The score of each token sequence, read at its last token: TRL's PPO scores the
    /// policy's own ids (`get_reward`; the reward model shares the policy's tokenizer).
    pub fn score_ids(&self, seqs: &[Vec<u32>]) -> Result<Vec<f64>, TrainError> {
        let pad = self.tokenizer.pad_id;
        let mut out = Vec::with_capacity(seqs.len());
        for chunk in seqs.chunks(BATCH) {
            let (ids, lengths) = super::runner::pad_ids(chunk, pad)?;
            let (b, len) = (ids.len(), ids[0].len());
            let flat: Vec<u32> = ids.iter().flatten().copied().collect();
            let t = Tensor::from_vec(flat, (b, len), &Device::Cpu)?;
            let logits = self
                .model
                .forward_padded(&t, &lengths)
                .map_err(|e| config_err("reward_model_path", format!("{}: {e}", self.name)))?
                .detach();
            let scores: Vec<Vec<f32>> = logits.squeeze(2)?.to_vec2()?;
            for (row, n) in scores.iter().zip(&lengths) {
                out.push(f64::from(row[n.saturating_sub(1)]));
            }
        }
        Ok(out)
    }

    /// The score of each text, as TRL scores them: tokenized without special tokens,
    /// right-padded with the pad id, read at the last non-pad token.
    pub fn score(&self, texts: &[String]) -> Result<Vec<f64>, TrainError> {
        let err = |m: String| config_err("reward_funcs", format!("{}: {m}", self.name));
        let pad = self.tokenizer.pad_id;
        let mut out = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(BATCH) {
            let seqs = chunk
                .iter()
                .map(|t| self.tokenizer.encode_plain(t))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|m| err(format!("tokenizing: {m}")))?;
            let (ids, lengths) = super::runner::pad_ids(&seqs, pad)?;
            let (b, len) = (ids.len(), ids[0].len());
            let flat: Vec<u32> = ids.iter().flatten().copied().collect();
            let t = Tensor::from_vec(flat, (b, len), &Device::Cpu)?;
            let attention: Vec<Vec<bool>> = lengths
                .iter()
                .map(|&n| (0..len).map(|j| j < n).collect())
                .collect();
            let logits = self.model.forward_masked(&t, &attention)?.detach();
            let scores: Vec<Vec<f32>> = logits.squeeze(2)?.to_vec2()?;
            for (row, at) in scores.iter().zip(super::runner::last_non_pad(&ids, pad)) {
                out.push(f64::from(row[at]));
            }
        }
        Ok(out)
    }
}
