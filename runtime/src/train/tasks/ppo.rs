//! PPO (TRL's `PPOTrainer`, `trl.experimental.ppo`), written once for every backend: each step
//! samples one response per prompt of the batch from the policy, scores it with the reward
//! model (or reward functions), takes the per-token KL to the frozen reference off the
//! rewards, runs the value model for generalised advantage estimation, then trains the policy
//! and the value model together for `num_ppo_epochs` passes of shuffled minibatches on the
//! clipped surrogate and the clipped value loss.
//!
//! TRL's loop, step for step (its quirks included, because the numbers follow them): the batch
//! is left-padded and every padding token is hidden and keeps its neighbour's position; a
//! response ends before its first padding token; the score sits one token past the response's
//! end; the optimizer steps where accelerate's gradient accumulation steps (every
//! `gradient_accumulation_steps` micro-batches, every micro-batch in the epoch's last batch),
//! each micro-batch's loss divided by `gradient_accumulation_steps`; no gradient clipping; the
//! figures averaged over a `[num_ppo_epochs, num_mini_batches, gradient_accumulation_steps]`
//! table whose unused cells stay 0.

use super::grpo::{Sample, Scorer, funcs_and_model};
use super::{MicroBatch, TensorOf, read_data};
use crate::model::generate::{Rng, SamplingConfig};
use crate::train::config_err;
use crate::train::data::{DataFormat, TextTokenizer};
use crate::train::driver::Window;
use crate::train::ops::TensorOps;
use crate::train::runner::{HeadQuery, OrTrain, Runner};
use crate::train::{TrainConfig, TrainError};
use std::collections::BTreeMap;

/// TRL's log-probability of a position past a response's end.
const INVALID_LOGPROB: f32 = 1.0;

/// Where PPO's responses and minibatch orders come from: sampled and drawn (training), or
/// given (to replay another run's, as the parity tests replay TRL's).
pub trait RolloutSource: Send {
    /// One response per prompt, each `cfg.max_new_tokens` long unless it stops at one of
    /// `cfg.eos` (kept); the loop pads them to the longest with the pad id.
    fn responses(
        &mut self,
        policy: &dyn Sample,
        prompts: &[Vec<u32>],
        cfg: &SamplingConfig,
    ) -> Result<Vec<Vec<u32>>, TrainError>;
    /// A permutation of the batch's `n` rows (TRL draws it with numpy for every PPO epoch).
    fn permutation(&mut self, n: usize) -> Vec<usize>;
    /// The data order of `epoch`, when the source fixes it (a replay).
    fn epoch_order(&mut self, epoch: u64) -> Option<Vec<usize>> {
        let _ = epoch;
        None
    }
    /// The source's random streams (saved with checkpoints).
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Restores [`RolloutSource::state`].
    fn restore(&mut self, state: &serde_json::Value) {
        let _ = state;
    }
}

/// Sampling from the policy, and seeded minibatch permutations.
pub struct SampledRollouts {
    /// The responses' draws.
    pub rng: Rng,
    /// The permutations' draws.
    pub shuffle: Rng,
}

impl RolloutSource for SampledRollouts {
    fn responses(
        &mut self,
        policy: &dyn Sample,
        prompts: &[Vec<u32>],
        cfg: &SamplingConfig,
    ) -> Result<Vec<Vec<u32>>, TrainError> {
        prompts
            .iter()
            .map(|p| Ok(policy.sample(p, 1, cfg, &mut self.rng)?.remove(0)))
            .collect()
    }
    fn permutation(&mut self, n: usize) -> Vec<usize> {
        crate::train::driver::permutation(n, self.shuffle.next_u64())
    }
    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "sampler_rng": self.rng.0, "shuffle_rng": self.shuffle.0 })
    }
    fn restore(&mut self, state: &serde_json::Value) {
        if let Some(r) = state["sampler_rng"].as_u64() {
            self.rng.0 = r;
        }
        if let Some(r) = state["shuffle_rng"].as_u64() {
            self.shuffle.0 = r;
        }
    }
}

/// PPO's settings: TRL's `PPOConfig` fields and defaults.
#[derive(Debug, Clone)]
struct Settings {
    num_ppo_epochs: usize,
    num_mini_batches: usize,
    whiten_rewards: bool,
    kl_coef: f64,
    k3: bool,
    cliprange: f64,
    vf_coef: f64,
    cliprange_value: f64,
    gamma: f64,
    lam: f64,
    /// TRL's `temperature + 1e-7`: what divides the logits (and what sampling uses).
    temperature: f64,
    response_length: usize,
    stop: Option<u32>,
    missing_eos_penalty: Option<f64>,
    /// per_device_train_batch_size, gradient_accumulation_steps.
    micro: usize,
    accumulation: usize,
    total_steps: u64,
}

/// One step's rollout: the batch's rows (in the loop's order) and what PPO derived from them.
struct Rollout {
    /// Dataset index → row.
    rows: BTreeMap<usize, usize>,
    /// The left-padded prompt width (TRL's `context_length`).
    context: usize,
    /// The responses' width.
    width: usize,
    /// Prompt and response, every padding token replaced by 0 (TRL's forward).
    ids: Vec<Vec<u32>>,
    attention: Vec<Vec<bool>>,
    positions: Vec<Vec<usize>>,
    /// The responses as sampled `[rows][width]`.
    responses: Vec<Vec<u32>>,
    /// The last position of each response (−1: none), TRL's `sequence_lengths`.
    ends: Vec<i64>,
    logprobs: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    advantages: Vec<Vec<f32>>,
    returns: Vec<Vec<f32>>,
}

/// PPO (TRL's `PPOTrainer`); `M` is the backend's model type (the frozen reference).
pub struct PpoTask<M> {
    prompts: Vec<Vec<u32>>,
    texts: Vec<String>,
    records: Vec<serde_json::Map<String, serde_json::Value>>,
    options: serde_json::Map<String, serde_json::Value>,
    rewards: Vec<(String, Scorer)>,
    weights: Vec<f64>,
    s: Settings,
    source: Box<dyn RolloutSource>,
    reference: M,
    rollout: Option<Rollout>,
    /// accelerate's accumulation counter (`Accelerator.step`).
    accumulated: u64,
    /// Steps done (TRL's `episode` is this times the batch).
    updates: u64,
    /// The step's rollout figures (logged with its training figures).
    figures: BTreeMap<String, f64>,
}

fn opt<T: serde::de::DeserializeOwned>(
    config: &TrainConfig,
    name: &str,
    default: T,
) -> Result<T, TrainError> {
    Ok(config.option::<T>(name)?.unwrap_or(default))
}

impl<M> PpoTask<M> {
    /// PPO's run from `config`: prompts (`prompt` column, tokenized as `tokenizer(prompt)`),
    /// the reward (`reward_model_path`, and/or `reward_funcs` with `reward_weights`), TRL's
    /// settings; `reference` the frozen policy.
    pub fn new(
        config: &TrainConfig,
        tok: &TextTokenizer,
        reference: M,
    ) -> Result<Self, TrainError> {
        let seed = config.hyper.seed;
        let source = Box::new(SampledRollouts {
            rng: Rng(seed ^ 0x7070_6f73),
            shuffle: Rng(seed ^ 0x7070_6f70),
        });
        Self::with_source(config, tok, reference, source)
    }

    /// [`PpoTask::new`] with responses and permutations from `source`.
    pub fn with_source(
        config: &TrainConfig,
        tok: &TextTokenizer,
        reference: M,
        source: Box<dyn RolloutSource>,
    ) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Prompt])?;
        let h = &config.hyper;
        if h.max_steps.is_some_and(|m| m > 0) {
            return Err(config_err(
                "max_steps",
                "TRL's PPO runs total_episodes episodes (steps × batch) and ignores max_steps; set total_episodes",
            ));
        }
        if config.eval_data.is_some() {
            return Err(config_err(
                "eval_data",
                "TRL's PPO computes no evaluation figures (it prints sampled completions); kiln's ppo takes no evaluation set",
            ));
        }
        for name in ["model_adapter_name", "ref_adapter_name", "sft_model_path"] {
            if let Some(v) = config.option::<String>(name)? {
                return Err(config_err(
                    name,
                    format!(
                        "`{v}`: kiln trains the model given by --model, with one adapter (or none), against the frozen starting policy"
                    ),
                ));
            }
        }
        let (rewards, weights) = funcs_and_model(config, &data, "PPO scores each response")?;
        let k3 = match opt(config, "kl_estimator", "k1".to_string())?.as_str() {
            "k1" => false,
            "k3" => true,
            other => {
                return Err(config_err(
                    "kl_estimator",
                    format!("`{other}` is not one of k1, k3 (TRL's PPOConfig)"),
                ));
            }
        };
        let stop = match (
            config.option::<String>("stop_token")?,
            config.option::<u32>("stop_token_id")?,
        ) {
            (Some(_), Some(_)) => {
                return Err(config_err(
                    "stop_token",
                    "set stop_token or stop_token_id, not both",
                ));
            }
            (Some(t), None) if t == "eos" => Some(tok.eos_id),
            (Some(t), None) => {
                return Err(config_err(
                    "stop_token",
                    format!("`{t}`: the only stop token by name is `eos`"),
                ));
            }
            (None, id) => id,
        };
        let temperature = opt(config, "temperature", 0.7)?;
        if temperature <= 0.0 {
            return Err(config_err("temperature", "must be positive (PPO samples)"));
        }
        let (micro, accumulation) = (h.per_device_train_batch_size, h.gradient_accumulation_steps);
        let batch = micro * accumulation;
        let num_mini_batches = opt(config, "num_mini_batches", 1usize)?;
        if num_mini_batches == 0 || !batch.is_multiple_of(num_mini_batches) {
            return Err(config_err(
                "num_mini_batches",
                format!(
                    "the batch (per_device_train_batch_size × gradient_accumulation_steps = {batch}) must be a multiple of it"
                ),
            ));
        }
        let whiten_rewards = opt(config, "whiten_rewards", false)?;
        if whiten_rewards && batch / num_mini_batches < 8 {
            return Err(config_err(
                "whiten_rewards",
                format!(
                    "needs minibatches of at least 8 (TRL's rule); these hold {}",
                    batch / num_mini_batches
                ),
            ));
        }
        if let Some(p) = config.option::<f64>("missing_eos_penalty")?
            && p < 0.0
        {
            return Err(config_err("missing_eos_penalty", "must be positive"));
        }
        let n = data.records.len();
        let total_episodes = match config.option::<u64>("total_episodes")? {
            Some(t) => t,
            None => (h.num_train_epochs * n as f64) as u64,
        };
        // TRL's PPO example: `tokenizer(prompt)`, special tokens included; a conversation
        // through the chat template with the generation prompt.
        let (prompts, texts) = super::text_prompts(&data, tok, "ppo", true, true)?;
        Ok(PpoTask {
            prompts,
            texts,
            records: data.records.into_iter().map(|r| r.fields).collect(),
            options: config.task_options.clone(),
            rewards,
            weights,
            s: Settings {
                num_ppo_epochs: opt(config, "num_ppo_epochs", 4usize)?.max(1),
                num_mini_batches,
                whiten_rewards,
                kl_coef: opt(config, "kl_coef", 0.05)?,
                k3,
                cliprange: opt(config, "cliprange", 0.2)?,
                vf_coef: opt(config, "vf_coef", 0.1)?,
                cliprange_value: opt(config, "cliprange_value", 0.2)?,
                gamma: opt(config, "gamma", 1.0)?,
                lam: opt(config, "lam", 0.95)?,
                temperature: temperature + 1e-7,
                response_length: opt(config, "response_length", 53usize)?.max(1),
                stop,
                missing_eos_penalty: config.option::<f64>("missing_eos_penalty")?,
                micro,
                accumulation,
                total_steps: total_episodes.div_ceil(batch.max(1) as u64),
            },
            source,
            reference,
            rollout: None,
            accumulated: 0,
            updates: 0,
            figures: BTreeMap::new(),
        })
    }

    /// Prompts in the set.
    pub fn examples(&self) -> usize {
        self.prompts.len()
    }

    /// Steps of the run: `total_episodes / batch`, rounded up (TRL's `num_total_batches`).
    pub fn total_steps(&self) -> u64 {
        self.s.total_steps
    }

    /// The source's streams, accelerate's counter and the steps done.
    pub fn state(&self) -> serde_json::Value {
        serde_json::json!({
            "source": self.source.state(),
            "accumulated": self.accumulated,
            "updates": self.updates,
        })
    }

    /// Restores [`PpoTask::state`].
    pub fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        self.source.restore(&state["source"]);
        self.accumulated = state["accumulated"].as_u64().unwrap_or(0);
        self.updates = state["updates"].as_u64().unwrap_or(0);
        Ok(())
    }

    /// The data order of `epoch` when the source fixes it.
    pub fn epoch_order(&mut self, epoch: u64) -> Option<Vec<usize>> {
        self.source.epoch_order(epoch)
    }

    /// The step's optimizer steps: `num_ppo_epochs` permutations of the rollout's rows, cut
    /// into `num_mini_batches` minibatches of micro-batches, grouped as accelerate's
    /// accumulation steps them.
    pub fn plan(
        &mut self,
        micro_batches: &[Vec<usize>],
        last_of_epoch: bool,
    ) -> Vec<Vec<Vec<usize>>> {
        let order: Vec<usize> = micro_batches.iter().flatten().copied().collect();
        let b = order.len();
        let mini = (b / self.s.num_mini_batches).max(1);
        let mut micro = Vec::new();
        for _ in 0..self.s.num_ppo_epochs {
            let perm = self.source.permutation(b);
            for m in perm.chunks(mini) {
                for mb in m.chunks(self.s.micro.max(1)) {
                    micro.push(mb.iter().map(|&r| order[r]).collect::<Vec<_>>());
                }
            }
        }
        let ga = self.s.accumulation.max(1) as u64;
        accelerate_steps(micro, &mut self.accumulated, ga, last_of_epoch)
    }

    /// The logged figures: the rollout's, and each training figure's mean over TRL's table of
    /// `num_ppo_epochs × num_mini_batches × gradient_accumulation_steps` cells (unused ones
    /// 0), `val/ratio_var` its unbiased variance.
    pub fn window(&self, totals: &Window) -> BTreeMap<String, f64> {
        let cells =
            (self.s.num_ppo_epochs * self.s.num_mini_batches * self.s.accumulation.max(1)) as f64;
        let mut out = self.figures.clone();
        for (k, (sum, _)) in totals {
            if k.starts_with('_') {
                continue;
            }
            out.insert(k.clone(), sum / cells);
        }
        if let (Some((s, _)), Some((sq, _))) = (totals.get("val/ratio"), totals.get("_ratio_sq")) {
            let mean = s / cells;
            out.insert(
                "val/ratio_var".into(),
                (sq - cells * mean * mean) / (cells - 1.0).max(1.0),
            );
        }
        out
    }
}

/// accelerate's gradient accumulation over `micro` (the micro-batches in the order they run):
/// the optimizer steps, each the micro-batches whose gradients it sums. `Accelerator._do_sync`:
/// at the dataloader's last batch every micro-batch steps and the count restarts at 0, else
/// the count goes up by one and a step is taken when it reaches a multiple of `ga`. A tail
/// that never reaches a step is stepped at the end.
fn accelerate_steps(
    micro: Vec<Vec<usize>>,
    count: &mut u64,
    ga: u64,
    end_of_dataloader: bool,
) -> Vec<Vec<Vec<usize>>> {
    let (mut steps, mut current) = (Vec::new(), Vec::new());
    for mb in micro {
        current.push(mb);
        let sync = if end_of_dataloader {
            *count = 0;
            true
        } else {
            *count += 1;
            count.is_multiple_of(ga)
        };
        if sync {
            steps.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        steps.push(current);
    }
    steps
}

/// `values` whitened over `mask` (TRL's `masked_whiten`: the unbiased variance, `+1e-8`),
/// the mean added back without `shift_mean`.
fn masked_whiten(values: &[Vec<f32>], mask: &[Vec<bool>], shift_mean: bool) -> Vec<Vec<f32>> {
    let (mut sum, mut count) = (0f64, 0f64);
    for (v, m) in values.iter().zip(mask) {
        for (x, &k) in v.iter().zip(m) {
            if k {
                sum += f64::from(*x);
                count += 1.0;
            }
        }
    }
    let mean = sum / count;
    let mut sq = 0f64;
    for (v, m) in values.iter().zip(mask) {
        for (x, &k) in v.iter().zip(m) {
            if k {
                sq += (f64::from(*x) - mean).powi(2);
            }
        }
    }
    let var = sq / count * (count / (count - 1.0));
    let r = 1.0 / (var + 1e-8).sqrt();
    values
        .iter()
        .map(|v| {
            v.iter()
                .map(|&x| {
                    let w = (f64::from(x) - mean) * r;
                    (if shift_mean { w } else { w + mean }) as f32
                })
                .collect()
        })
        .collect()
}

/// The rows of `t` `[rows, cols]` on the host.
fn rows_of<O: TensorOps>(ops: &O, t: &O::T, cols: usize) -> Result<Vec<Vec<f32>>, TrainError> {
    Ok(ops
        .to_f64(t)
        .tr()?
        .chunks(cols.max(1))
        .map(|r| r.iter().map(|&x| x as f32).collect())
        .collect())
}

impl<M> PpoTask<M> {
    /// TRL's rollout of the step's prompts: responses, their log-probs under the policy and
    /// the reference, the values, the scores, the KL-penalised rewards, GAE's advantages and
    /// returns, and the rollout's figures.
    pub fn begin_step<R: Runner<Model = M>>(
        &mut self,
        r: &R,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        let s = self.s.clone();
        let ops = r.ops();
        let tok = r.tokenizer();
        let pad = tok.pad_id;
        let order: Vec<usize> = micro_batches.iter().flatten().copied().collect();
        let b = order.len();
        let prompts: Vec<Vec<u32>> = order.iter().map(|&i| self.prompts[i].clone()).collect();
        let cfg = SamplingConfig {
            temperature: s.temperature,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            max_new_tokens: s.response_length,
            eos: s.stop.into_iter().collect(),
        };
        let mut responses = self.source.responses(r, &prompts, &cfg)?;
        if responses.len() != b {
            return Err(config_err(
                "ppo",
                "the rollout source returned the wrong number of responses",
            ));
        }
        let width = responses.iter().map(Vec::len).max().unwrap_or(0).max(1);
        for resp in &mut responses {
            resp.resize(width, pad);
        }
        let context = prompts.iter().map(Vec::len).max().unwrap_or(0);
        // TRL's forward: left-padded prompts, every padding token hidden, replaced by 0 and
        // numbered as the token before it.
        let (mut ids, mut attention, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        for (p, resp) in prompts.iter().zip(&responses) {
            let mut row = vec![pad; context - p.len()];
            row.extend(p);
            row.extend(resp);
            let att: Vec<bool> = row.iter().map(|&t| t != pad).collect();
            // TRL's `cumsum(mask) − mask`: the real tokens before each one.
            let pos: Vec<usize> = {
                let mut c = 0usize;
                att.iter()
                    .map(|&a| {
                        c += usize::from(a);
                        c - usize::from(a)
                    })
                    .collect()
            };
            ids.push(
                row.iter()
                    .zip(&att)
                    .map(|(&t, &a)| if a { t } else { 0 })
                    .collect::<Vec<u32>>(),
            );
            attention.push(att);
            positions.push(pos);
        }
        let labels: Vec<u32> = responses.iter().flatten().copied().collect();
        let labels_t = ops.ids(&labels, &[b, width]).tr()?;
        let logps = |model: &M| -> Result<Vec<Vec<f32>>, TrainError> {
            // The head at the responses' positions alone, without the logits where the
            // backend can.
            let q = HeadQuery {
                ids: &ids,
                attention: &attention,
                positions: Some(&positions),
                at: context - 1..context - 1 + width,
                labels: &labels,
                scale: 1.0 / s.temperature,
            };
            if let Some((lp, _)) = r.forward_masked_logps(model, &q)? {
                return rows_of(ops, &ops.detach(&lp), width);
            }
            let logits = r.forward_positioned(model, &ids, &attention, &positions)?;
            let logits = ops.narrow(&logits, 1, context - 1, width).tr()?;
            let logits = ops.affine(&logits, 1.0 / s.temperature, 0.0).tr()?;
            let lp = ops.detach(&ops.token_logps(&logits, &labels_t).tr()?);
            rows_of(ops, &lp, width)
        };
        let mut logprobs = logps(r.policy())?;
        let mut ref_logprobs = logps(&self.reference)?;
        let values_full = ops.detach(&r.values(&ids, &attention, &positions)?);
        let mut values: Vec<Vec<f32>> = rows_of(ops, &values_full, context + width)?
            .into_iter()
            .map(|row| row[context - 1..context - 1 + width].to_vec())
            .collect();
        // The response as scored: cut after the stop token, then ending before its first
        // padding token.
        let processed: Vec<Vec<u32>> = responses
            .iter()
            .map(|resp| match s.stop {
                Some(stop) => match resp.iter().position(|&t| t == stop) {
                    Some(at) => resp
                        .iter()
                        .enumerate()
                        .map(|(j, &t)| if j > at { pad } else { t })
                        .collect(),
                    None => resp.clone(),
                },
                None => resp.clone(),
            })
            .collect();
        let ends: Vec<i64> = processed
            .iter()
            .map(|p| p.iter().position(|&t| t == pad).unwrap_or(width) as i64 - 1)
            .collect();
        let kept = |k: usize| -> Vec<u32> {
            let end = (ends[k] + 1) as usize;
            processed[k][..end].to_vec()
        };
        let mut scores =
            self.score(tok, &order, &prompts, &(0..b).map(kept).collect::<Vec<_>>())?;
        let eos = tok.eos_id;
        for (k, p) in processed.iter().enumerate() {
            if let Some(penalty) = s.missing_eos_penalty
                && !p.contains(&eos)
            {
                scores[k] -= penalty;
            }
        }
        // Masks past each response's end (values keep one more position), KL-penalised
        // rewards with the score one past the end, GAE, whitened advantages.
        let keep: Vec<Vec<bool>> = ends
            .iter()
            .map(|&e| (0..width).map(|t| (t as i64) <= e).collect())
            .collect();
        let keep_p1: Vec<Vec<bool>> = ends
            .iter()
            .map(|&e| (0..width).map(|t| (t as i64) <= e + 1).collect())
            .collect();
        for k in 0..b {
            for t in 0..width {
                if !keep[k][t] {
                    logprobs[k][t] = INVALID_LOGPROB;
                    ref_logprobs[k][t] = INVALID_LOGPROB;
                }
                if !keep_p1[k][t] {
                    values[k][t] = 0.0;
                }
            }
        }
        let kl: Vec<Vec<f32>> = logprobs
            .iter()
            .zip(&ref_logprobs)
            .map(|(lp, rf)| {
                lp.iter()
                    .zip(rf)
                    .map(|(&l, &r)| {
                        let logr = r - l;
                        if s.k3 {
                            (logr.exp() - 1.0) - logr
                        } else {
                            -logr
                        }
                    })
                    .collect()
            })
            .collect();
        let non_score: Vec<Vec<f32>> = kl
            .iter()
            .map(|row| row.iter().map(|&x| -(s.kl_coef as f32) * x).collect())
            .collect();
        let mut rewards = non_score.clone();
        for k in 0..b {
            let p1 = (ends[k] + 1) as usize;
            let at = if p1 < width {
                p1
            } else {
                ends[k].max(0) as usize
            };
            rewards[k][at] += scores[k] as f32;
        }
        if s.whiten_rewards {
            rewards = masked_whiten(&rewards, &keep_p1, false);
            for k in 0..b {
                for t in 0..width {
                    if !keep_p1[k][t] {
                        rewards[k][t] = 0.0;
                    }
                }
            }
        }
        let (gamma, lam) = (s.gamma as f32, s.lam as f32);
        let mut advantages = vec![vec![0f32; width]; b];
        for k in 0..b {
            let mut last = 0f32;
            for t in (0..width).rev() {
                let next = if t + 1 < width { values[k][t + 1] } else { 0.0 };
                let delta = rewards[k][t] + gamma * next - values[k][t];
                last = delta + gamma * lam * last;
                advantages[k][t] = last;
            }
        }
        let returns: Vec<Vec<f32>> = advantages
            .iter()
            .zip(&values)
            .map(|(a, v)| a.iter().zip(v).map(|(x, y)| x + y).collect())
            .collect();
        let mut advantages = masked_whiten(&advantages, &keep, true);
        for k in 0..b {
            for t in 0..width {
                if !keep[k][t] {
                    advantages[k][t] = 0.0;
                }
            }
        }
        // TRL's rollout figures.
        let mean_rows = |m: &[Vec<f32>]| -> f64 {
            m.iter()
                .map(|r| r.iter().map(|&x| f64::from(x)).sum::<f64>())
                .sum::<f64>()
                / b as f64
        };
        let mean_kl = mean_rows(&kl);
        let mean_entropy = -mean_rows(&logprobs);
        let mean_non_score = mean_rows(&non_score);
        let mean_score = scores.iter().sum::<f64>() / b as f64;
        self.updates += 1;
        let batch = (s.micro * s.accumulation) as f64;
        self.figures = BTreeMap::from([
            ("objective/kl".to_string(), mean_kl),
            ("objective/entropy".to_string(), mean_entropy),
            ("objective/non_score_reward".to_string(), mean_non_score),
            (
                "objective/rlhf_reward".to_string(),
                mean_non_score + mean_score,
            ),
            ("objective/scores".to_string(), mean_score),
            (
                "val/num_eos_tokens".to_string(),
                responses.iter().flatten().filter(|&&t| t == eos).count() as f64,
            ),
            ("episode".to_string(), self.updates as f64 * batch),
        ]);
        self.rollout = Some(Rollout {
            rows: order.iter().enumerate().map(|(k, &i)| (i, k)).collect(),
            context,
            width,
            ids,
            attention,
            positions,
            responses,
            ends,
            logprobs,
            values,
            advantages,
            returns,
        });
        Ok(())
    }

    /// Each response's score: the weighted sum of the rewards (a reward model reads the
    /// prompt's and the response's ids, as TRL's `get_reward` does; a function the decoded
    /// response).
    fn score(
        &self,
        tok: &TextTokenizer,
        order: &[usize],
        prompts: &[Vec<u32>],
        kept: &[Vec<u32>],
    ) -> Result<Vec<f64>, TrainError> {
        let mut total = vec![0f64; order.len()];
        let decoded = kept
            .iter()
            .map(|c| tok.decode(c))
            .collect::<Result<Vec<String>, String>>()
            .map_err(|m| config_err("ppo", format!("decoding: {m}")))?;
        for ((_, scorer), w) in self.rewards.iter().zip(&self.weights) {
            let values: Vec<f64> = match scorer {
                Scorer::Model(m) => {
                    let seqs: Vec<Vec<u32>> = prompts
                        .iter()
                        .zip(kept)
                        .map(|(p, c)| [p.as_slice(), c.as_slice()].concat())
                        .collect();
                    m.score_ids(&seqs)?
                }
                Scorer::Func(f) => order
                    .iter()
                    .zip(&decoded)
                    .zip(kept)
                    .map(|((&i, text), ids)| {
                        f(&crate::train::reward_registry::RewardInput {
                            prompt: &self.texts[i],
                            completion: text,
                            completion_ids: ids,
                            example: &self.records[i],
                            options: &self.options,
                        })
                        .unwrap_or(f64::NAN)
                    })
                    .collect(),
            };
            for (t, v) in total.iter_mut().zip(values) {
                if !v.is_nan() {
                    *t += v * w;
                }
            }
        }
        Ok(total)
    }

    /// One micro-batch of a PPO epoch: the clipped surrogate and the clipped value loss
    /// (divided by `gradient_accumulation_steps`, as accelerate divides it) and its figures.
    pub fn loss<R: Runner<Model = M>>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let s = &self.s;
        let ro = self
            .rollout
            .as_ref()
            .ok_or_else(|| config_err("ppo", "a micro-batch before its rollout"))?;
        let rows: Vec<usize> = indices
            .iter()
            .map(|i| {
                ro.rows
                    .get(i)
                    .copied()
                    .ok_or_else(|| config_err("ppo", "a micro-batch outside the step's rollout"))
            })
            .collect::<Result<_, _>>()?;
        let (b, w, c) = (rows.len(), ro.width, ro.context);
        let pick = |m: &[Vec<f32>]| -> Vec<f64> {
            rows.iter()
                .flat_map(|&k| m[k].iter().map(|&x| f64::from(x)))
                .collect()
        };
        let ids: Vec<Vec<u32>> = rows.iter().map(|&k| ro.ids[k].clone()).collect();
        let attention: Vec<Vec<bool>> = rows.iter().map(|&k| ro.attention[k].clone()).collect();
        let positions: Vec<Vec<usize>> = rows.iter().map(|&k| ro.positions[k].clone()).collect();
        let keep: Vec<f64> = rows
            .iter()
            .flat_map(|&k| (0..w).map(move |t| f64::from((t as i64) <= ro.ends[k])))
            .collect();
        let keep_p1: Vec<f64> = rows
            .iter()
            .flat_map(|&k| (0..w).map(move |t| f64::from((t as i64) <= ro.ends[k] + 1)))
            .collect();
        let shape = [b, w];
        let t = |v: &[f64]| ops.tensor(v, &shape).tr();
        let labels: Vec<u32> = rows
            .iter()
            .flat_map(|&k| ro.responses[k].iter().copied())
            .collect();
        let q = HeadQuery {
            ids: &ids,
            attention: &attention,
            positions: Some(&positions),
            at: c - 1..c - 1 + w,
            labels: &labels,
            scale: 1.0 / s.temperature,
        };
        // The head at the responses' positions alone, without the logits where the backend
        // can (its entropies with it); else the logits.
        let (new_lp, entropy) = match r.forward_masked_logps(r.policy(), &q)? {
            Some((lp, h)) => (lp, h.iter().map(|&e| f64::from(e)).collect()),
            None => {
                let logits = r.forward_positioned(r.policy(), &ids, &attention, &positions)?;
                let logits = ops.narrow(&logits, 1, c - 1, w).tr()?;
                let logits = ops.affine(&logits, 1.0 / s.temperature, 0.0).tr()?;
                let lp = ops
                    .token_logps(&logits, &ops.ids(&labels, &shape).tr()?)
                    .tr()?;
                let h = ops
                    .to_f64(&ops.token_entropy(&ops.detach(&logits)).tr()?)
                    .tr()?;
                (lp, h)
            }
        };
        // Past the end: TRL's INVALID_LOGPROB, a constant.
        let invalid: Vec<f64> = keep
            .iter()
            .map(|&k| (1.0 - k) * f64::from(INVALID_LOGPROB))
            .collect();
        let new_lp = ops
            .add(&ops.mul(&new_lp, &t(&keep)?).tr()?, &t(&invalid)?)
            .tr()?;
        let vpred = r.values(&ids, &attention, &positions)?;
        let vpred = ops.narrow(&vpred, 1, c - 1, w).tr()?;
        let vpred = ops.mul(&vpred, &t(&keep_p1)?).tr()?;
        let old_values = pick(&ro.values);
        let returns = pick(&ro.returns);
        let adv = pick(&ro.advantages);
        let old_lp = pick(&ro.logprobs);
        let (values_t, returns_t) = (t(&old_values)?, t(&returns)?);
        // max(a, b) = −min(−a, −b).
        let max = |a: &TensorOf<R>, x: &TensorOf<R>| -> Result<TensorOf<R>, TrainError> {
            let m = ops
                .minimum(
                    &ops.affine(a, -1.0, 0.0).tr()?,
                    &ops.affine(x, -1.0, 0.0).tr()?,
                )
                .tr()?;
            ops.affine(&m, -1.0, 0.0).tr()
        };
        let clipped = ops
            .add(
                &values_t,
                &ops.clamp(
                    &ops.sub(&vpred, &values_t).tr()?,
                    -s.cliprange_value,
                    s.cliprange_value,
                )
                .tr()?,
            )
            .tr()?;
        let vf1 = ops.sqr(&ops.sub(&vpred, &returns_t).tr()?).tr()?;
        let vf2 = ops.sqr(&ops.sub(&clipped, &returns_t).tr()?).tr()?;
        let n_p1: f64 = keep_p1.iter().sum();
        let n_keep: f64 = keep.iter().sum();
        let vf_loss = ops
            .affine(
                &ops.sum_all(&ops.mul(&max(&vf1, &vf2)?, &t(&keep_p1)?).tr()?)
                    .tr()?,
                0.5 / n_p1,
                0.0,
            )
            .tr()?;
        let ratio = ops.exp(&ops.sub(&new_lp, &t(&old_lp)?).tr()?).tr()?;
        let neg_adv = t(&adv.iter().map(|a| -a).collect::<Vec<_>>())?;
        let pg1 = ops.mul(&neg_adv, &ratio).tr()?;
        let pg2 = ops
            .mul(
                &neg_adv,
                &ops.clamp(&ratio, 1.0 - s.cliprange, 1.0 + s.cliprange)
                    .tr()?,
            )
            .tr()?;
        let pg_loss = ops
            .affine(
                &ops.sum_all(&ops.mul(&max(&pg1, &pg2)?, &t(&keep)?).tr()?)
                    .tr()?,
                1.0 / n_keep,
                0.0,
            )
            .tr()?;
        let loss = ops
            .add(&pg_loss, &ops.affine(&vf_loss, s.vf_coef, 0.0).tr()?)
            .tr()?;
        let loss = ops
            .affine(&loss, 1.0 / s.accumulation.max(1) as f64, 0.0)
            .tr()?;
        // TRL's figures, from the host values in f32 as torch compares them.
        let f32s = |x: &TensorOf<R>| -> Result<Vec<f32>, TrainError> {
            Ok(ops
                .to_f64(&ops.detach(x))
                .tr()?
                .into_iter()
                .map(|v| v as f32)
                .collect())
        };
        let (lp_h, vp_h) = (f32s(&new_lp)?, f32s(&vpred)?);
        let n = (b * w) as f64;
        let (mut pg_clip, mut vf_clip, mut approx, mut ratio_sum) = (0f64, 0f64, 0f64, 0f64);
        let cr = s.cliprange as f32;
        let cv = s.cliprange_value as f32;
        for j in 0..b * w {
            let diff = lp_h[j] - old_lp[j] as f32;
            let ratio = diff.exp();
            let a = -(adv[j] as f32);
            let (l1, l2) = (a * ratio, a * ratio.clamp(1.0 - cr, 1.0 + cr));
            if keep[j] > 0.0 && l2 > l1 {
                pg_clip += 1.0;
            }
            let v = old_values[j] as f32;
            let vc = vp_h[j].max(v - cv).min(v + cv);
            let ret = returns[j] as f32;
            if keep_p1[j] > 0.0 && (vc - ret).powi(2) > (vp_h[j] - ret).powi(2) {
                vf_clip += 1.0;
            }
            approx += f64::from(diff) * f64::from(diff);
            ratio_sum += f64::from(ratio);
        }
        let ratio_mean = ratio_sum / n;
        let scalar = |x: &TensorOf<R>| -> Result<f64, TrainError> {
            Ok(ops.to_f64(&ops.detach(x)).tr()?[0])
        };
        let figures = BTreeMap::from([
            ("policy/approxkl_avg".to_string(), 0.5 * approx / n),
            ("policy/clipfrac_avg".to_string(), pg_clip / n_keep),
            ("loss/policy_avg".to_string(), scalar(&pg_loss)?),
            ("loss/value_avg".to_string(), scalar(&vf_loss)?),
            ("val/clipfrac_avg".to_string(), vf_clip / n_p1),
            (
                "policy/entropy_avg".to_string(),
                entropy.iter().sum::<f64>() / entropy.len().max(1) as f64,
            ),
            ("val/ratio".to_string(), ratio_mean),
            ("_ratio_sq".to_string(), ratio_mean * ratio_mean),
        ]);
        let tokens = attention.iter().flatten().filter(|&&a| a).count() as u64;
        Ok((loss, figures, tokens))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// accelerate's stepping, written out by hand: two micro-batches a step; at the
    /// dataloader's end one a step, and the count starts again from there.
    #[test]
    fn optimizer_steps_follow_accelerates_accumulation() {
        let mb = |n: usize| (0..n).map(|i| vec![i]).collect::<Vec<_>>();
        let mut count = 0;
        assert_eq!(
            accelerate_steps(mb(4), &mut count, 2, false),
            vec![vec![vec![0], vec![1]], vec![vec![2], vec![3]]]
        );
        assert_eq!(count, 4);
        assert_eq!(
            accelerate_steps(mb(3), &mut count, 2, true),
            vec![vec![vec![0]], vec![vec![1]], vec![vec![2]]]
        );
        assert_eq!(count, 0);
        // A count left mid-way carries over: the first micro-batch here completes a step.
        let mut count = 3;
        assert_eq!(
            accelerate_steps(mb(3), &mut count, 2, false),
            vec![vec![vec![0]], vec![vec![1], vec![2]]]
        );
        // Four micro-batches a step but three run: stepped at the end.
        let mut count = 0;
        assert_eq!(
            accelerate_steps(mb(3), &mut count, 4, false),
            vec![vec![vec![0], vec![1], vec![2]]]
        );
    }

    /// TRL's `masked_whiten`, against its formula in f64: the masked mean, the unbiased masked
    /// variance, `(x − mean) / sqrt(var + 1e-8)`, the mean added back without `shift_mean`.
    #[test]
    fn whitening_is_trls() {
        let v = vec![vec![1.0f32, 2.0, 4.0], vec![-3.0, 0.5, 9.0]];
        let m = vec![vec![true, true, false], vec![true, true, true]];
        let kept = [1.0f64, 2.0, -3.0, 0.5, 9.0];
        let mean = kept.iter().sum::<f64>() / 5.0;
        let var = kept.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / 4.0;
        for shift in [true, false] {
            let w = masked_whiten(&v, &m, shift);
            for (row, wrow) in v.iter().zip(&w) {
                for (x, y) in row.iter().zip(wrow) {
                    let mut want = (f64::from(*x) - mean) / (var + 1e-8).sqrt();
                    if !shift {
                        want += mean;
                    }
                    assert!((f64::from(*y) - want).abs() < 1e-5, "{y} vs {want}");
                }
            }
        }
    }
}
