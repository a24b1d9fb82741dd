//! The tasks, written once for every backend: each prepares its examples from the data as TRL
//! does, and computes a micro-batch's loss and figures from the log-probabilities a
//! [`Runner`] gives (the losses themselves are `losses.rs`'s). Candle's objectives and the MLX
//! backend both run these.

use super::TrainConfig;
use super::TrainError;
use super::data::{DataFormat, Dataset, LmExample, PairExample, TextTokenizer, pair_examples};
use super::losses::{self, DpoLoss, PreferenceLogps, TokenInputs};
use super::ops::TensorOps;
use super::runner::{OrTrain, Runner, Shifted};
use std::collections::BTreeMap;

/// The tensor type of runner `R`.
pub type TensorOf<R> = <<R as Runner>::Ops as TensorOps>::T;

/// A micro-batch's loss, its figures and its token count.
pub type MicroBatch<T> = (T, BTreeMap<String, f64>, u64);

fn config_err(field: &str, message: impl Into<String>) -> TrainError {
    TrainError::Config {
        field: field.into(),
        message: message.into(),
    }
}

/// The training data of `config`, in one of the `accepted` formats.
pub fn read_data(config: &TrainConfig, accepted: &[DataFormat]) -> Result<Dataset, TrainError> {
    let path = config
        .train_data
        .as_ref()
        .ok_or_else(|| config_err("train_data", "required (a JSONL file)"))?;
    Dataset::read(path, accepted)
}

/// Supervised fine-tuning (TRL's `SFTTrainer`): causal-LM cross-entropy over the label
/// tokens, the token mean over the whole optimisation step.
pub struct SftTask {
    examples: Vec<LmExample>,
    num_items: f64,
}

impl SftTask {
    /// The examples of `config.train_data` (`text`, `prompt`+`completion` or `messages`),
    /// tokenized as TRL does; `completion_only_loss` (default on), `assistant_only_loss`.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let data = read_data(
            config,
            &[
                DataFormat::Text,
                DataFormat::PromptCompletion,
                DataFormat::Messages,
            ],
        )?;
        let completion_only = config
            .option::<bool>("completion_only_loss")?
            .unwrap_or(true);
        let assistant_only = config
            .option::<bool>("assistant_only_loss")?
            .unwrap_or(false);
        let examples = super::data::sft_examples_with(
            &data,
            tok,
            completion_only,
            assistant_only,
            config.hyper.max_length,
        )?;
        Ok(SftTask {
            examples,
            num_items: 0.0,
        })
    }

    /// Examples in the set.
    pub fn examples(&self) -> usize {
        self.examples.len()
    }

    /// Counts the step's label tokens (transformers' `num_items_in_batch`: `labels[..., 1:]`
    /// over every micro-batch of the step).
    pub fn begin_step(&mut self, micro_batches: &[Vec<usize>]) {
        self.num_items = micro_batches
            .iter()
            .flatten()
            .map(|&i| {
                self.examples[i]
                    .mask
                    .iter()
                    .skip(1)
                    .map(|&m| f64::from(m))
                    .sum::<f64>()
            })
            .sum();
    }

    /// The loss of the examples `indices` (the token mean over the step), TRL's `entropy`
    /// (over the attention mask), `mean_token_accuracy` and `num_tokens`.
    pub fn loss<R: Runner>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let seqs: Vec<(Vec<u32>, Vec<u8>)> = indices
            .iter()
            .map(|&i| (self.examples[i].ids.clone(), self.examples[i].mask.clone()))
            .collect();
        let s = r.forward_shifted(r.policy(), &seqs)?;
        let inputs = TokenInputs {
            logps: s.logps.clone(),
            mask: s.mask.clone(),
            mask_host: s.mask_host.clone(),
        };
        let loss = losses::sft(ops, &inputs, self.num_items).tr()?;
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        let mut m = BTreeMap::new();
        m.insert(
            "entropy".into(),
            Shifted::entropy(ops, &s.full_logits, &s.attention)?,
        );
        m.insert(
            "mean_token_accuracy".into(),
            s.token_accuracy(ops, 0..seqs.len())?,
        );
        m.insert("num_tokens".into(), 0.0);
        Ok((loss, m, tokens))
    }
}

/// DPO (TRL's `DPOTrainer`): the preference loss over summed completion log-probabilities,
/// against a frozen reference model `M` (or reference log-probs computed before training).
pub struct DpoTask<M> {
    pairs: Vec<PairExample>,
    beta: f64,
    loss: DpoLoss,
    max_length: Option<usize>,
    reference: Option<M>,
    /// Reference log-probs computed before training (`precompute_ref_log_probs`).
    precomputed: Option<Vec<(f64, f64)>>,
}

impl<M> DpoTask<M> {
    /// The pairs of `config.train_data` and DPO's options (`beta`, `loss_type`,
    /// `precompute_ref_log_probs`), against `reference`.
    pub fn new<R: Runner<Model = M>>(
        config: &TrainConfig,
        tok: &TextTokenizer,
        runner: &R,
        reference: M,
    ) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Preference])?;
        let pairs = pair_examples(&data, tok)?;
        let beta = config.option::<f64>("beta")?.unwrap_or(0.1);
        let loss_name = config
            .option::<String>("loss_type")?
            .unwrap_or_else(|| "sigmoid".into());
        let loss = DpoLoss::parse(&loss_name).ok_or_else(|| {
            config_err(
                "loss_type",
                format!("`{loss_name}` is not one of {}", DpoLoss::NAMES.join(", ")),
            )
        })?;
        let mut me = DpoTask {
            pairs,
            beta,
            loss,
            max_length: config.hyper.max_length,
            reference: Some(reference),
            precomputed: None,
        };
        if config
            .option::<bool>("precompute_ref_log_probs")?
            .unwrap_or(false)
        {
            let bs = config.hyper.per_device_train_batch_size.max(1);
            let mut all = Vec::with_capacity(me.pairs.len());
            let idx: Vec<usize> = (0..me.pairs.len()).collect();
            for chunk in idx.chunks(bs) {
                let (c, r) = me.ref_logps(runner, chunk)?;
                all.extend(c.into_iter().zip(r));
            }
            me.precomputed = Some(all);
            me.reference = None;
        }
        Ok(me)
    }

    /// Pairs in the set.
    pub fn examples(&self) -> usize {
        self.pairs.len()
    }

    /// `[chosen…, rejected…]` sequences with completion masks, truncated as TRL truncates
    /// (`keep_start` to `max_length`).
    fn sequences(&self, indices: &[usize]) -> Vec<(Vec<u32>, Vec<u8>)> {
        let mut out = Vec::with_capacity(indices.len() * 2);
        for pick in [0, 1] {
            for &i in indices {
                let p = &self.pairs[i];
                let completion = if pick == 0 { &p.chosen } else { &p.rejected };
                let mut ids = p.prompt.clone();
                ids.extend(completion);
                let mut mask = vec![0u8; p.prompt.len()];
                mask.extend(std::iter::repeat_n(1, completion.len()));
                if let Some(n) = self.max_length {
                    ids.truncate(n);
                    mask.truncate(n);
                }
                out.push((ids, mask));
            }
        }
        out
    }

    fn ref_logps<R: Runner<Model = M>>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<(Vec<f64>, Vec<f64>), TrainError> {
        let reference = self.reference.as_ref().expect("reference model kept");
        let ops = r.ops();
        let s = r.forward_shifted(reference, &self.sequences(indices))?;
        let sums = ops.sum_last(&ops.mul(&s.logps, &s.mask).tr()?).tr()?;
        let v = ops.to_f64(&ops.detach(&sums)).tr()?;
        let n = indices.len();
        Ok((v[..n].to_vec(), v[n..].to_vec()))
    }

    /// The loss of the pairs `indices` and TRL's figures (`rewards/*`, `logps/*`,
    /// `logits/*`, `entropy`, `mean_token_accuracy`).
    pub fn loss<R: Runner<Model = M>>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let n = indices.len();
        let seqs = self.sequences(indices);
        let s = r.forward_shifted(r.policy(), &seqs)?;
        let sums = ops.sum_last(&ops.mul(&s.logps, &s.mask).tr()?).tr()?;
        let (chosen, rejected) = ops.halves(&sums).tr()?;
        let (rc, rr) = match &self.precomputed {
            Some(all) => indices.iter().map(|&i| all[i]).unzip(),
            None => self.ref_logps(r, indices)?,
        };
        let lens: Vec<f64> = seqs
            .iter()
            .map(|(_, m)| m.iter().map(|&x| f64::from(x)).sum())
            .collect();
        let p = PreferenceLogps {
            chosen,
            rejected,
            ref_chosen: ops.tensor(&rc, &[n]).tr()?,
            ref_rejected: ops.tensor(&rr, &[n]).tr()?,
            chosen_len: lens[..n].to_vec(),
            rejected_len: lens[n..].to_vec(),
        };
        let out = losses::dpo(ops, self.loss, self.beta, &p).tr()?;
        let mut m = out.metrics;
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        m.insert(
            "entropy".into(),
            Shifted::entropy(ops, &s.logits, &s.mask_host)?,
        );
        m.insert("mean_token_accuracy".into(), s.token_accuracy(ops, 0..n)?);
        // TRL: the mean over vocabulary of the logits, averaged over completion tokens.
        let mean_logits = ops.to_f64(&ops.mean_last(&s.logits).tr()?).tr()?;
        let width = s.mask_host[0].len();
        for (name, rows) in [("logits/chosen", 0..n), ("logits/rejected", n..2 * n)] {
            let (mut sum, mut count) = (0f64, 0f64);
            for row in rows {
                for (t, &mk) in s.mask_host[row].iter().enumerate() {
                    sum += mean_logits[row * width + t] * f64::from(mk);
                    count += f64::from(mk);
                }
            }
            m.insert(name.into(), if count > 0.0 { sum / count } else { 0.0 });
        }
        m.insert("num_tokens".into(), 0.0);
        Ok((out.loss, m, tokens))
    }
}
