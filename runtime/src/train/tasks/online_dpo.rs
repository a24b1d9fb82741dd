//! Online DPO (TRL's `OnlineDPOTrainer`, `trl.experimental.online_dpo`): two completions of
//! each prompt sampled from the policy, ranked by the rewards (reward functions or reward
//! models), and the DPO loss on the pair against the frozen reference.

use super::grpo::{CompletionSource, Sampled, Scorer, funcs_and_model, sampling, score};
use super::{MicroBatch, TensorOf, read_data};
use crate::model::generate::Rng;
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::{DataFormat, TextTokenizer};
use crate::train::ops::TensorOps;
use crate::train::runner::{HeadQuery, OrTrain, Runner};
use std::collections::BTreeMap;

/// A prompt's two completions, and their rewards (after the missing-EOS penalty).
#[derive(Debug, Clone)]
struct Pair {
    completions: [Vec<u32>; 2],
    rewards: [f64; 2],
}

/// Online DPO (TRL's `OnlineDPOTrainer`): per micro-batch, two samples per prompt, the better
/// by reward chosen, `−log σ(β·Δ)` (sigmoid) or `(Δ − 1/(2β))²` (ipo) on the pair's
/// policy-minus-reference log-ratio margin `Δ`.
pub struct OnlineDpoTask<M> {
    prompts: Vec<Vec<u32>>,
    texts: Vec<String>,
    records: Vec<serde_json::Map<String, serde_json::Value>>,
    options: serde_json::Map<String, serde_json::Value>,
    rewards: Vec<(String, Scorer)>,
    weights: Vec<f64>,
    beta: f64,
    ipo: bool,
    missing_eos_penalty: Option<f64>,
    max_length: usize,
    source: Box<dyn CompletionSource>,
    reference: M,
    /// This step's pairs, by prompt index.
    pairs: BTreeMap<usize, Pair>,
}

impl<M> OnlineDpoTask<M> {
    /// Online DPO's options, TRL's `OnlineDPOConfig` defaults: `beta` 0.1 (one value),
    /// `loss_type` sigmoid, `max_new_tokens` 64, `temperature` 0.9, `top_p` 1, `top_k` 0,
    /// `min_p`, `repetition_penalty` 1, `missing_eos_penalty`, `max_length` (prompt and
    /// completion; the prompt cut on the left), `reward_funcs` / `reward_model_path` and
    /// `reward_weights`; prompts tokenized without special tokens, as TRL's generation does.
    pub fn new(
        config: &TrainConfig,
        tok: &TextTokenizer,
        reference: M,
    ) -> Result<Self, TrainError> {
        let sampling = sampling(config, tok, 0.9, ("max_new_tokens", 64))?;
        let source = Box::new(Sampled {
            config: sampling,
            rng: Rng(config.hyper.seed ^ 0x6f64_706f),
        });
        Self::with_source(config, tok, reference, source)
    }

    /// [`OnlineDpoTask::new`] with completions from `source` (two per prompt).
    pub fn with_source(
        config: &TrainConfig,
        tok: &TextTokenizer,
        reference: M,
        source: Box<dyn CompletionSource>,
    ) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Prompt])?;
        let (rewards, weights) =
            funcs_and_model(config, &data, "online DPO ranks each pair by rewards")?;
        let beta = match config.task_options.get("beta") {
            None => 0.1,
            Some(serde_json::Value::Array(a)) if a.len() == 1 && a[0].is_number() => {
                a[0].as_f64().unwrap_or(0.1)
            }
            Some(v) => v.as_f64().ok_or_else(|| {
                config_err(
                    "beta",
                    format!("{v}: kiln takes one beta (TRL's per-epoch list is not built)"),
                )
            })?,
        };
        let ipo = match config.option::<String>("loss_type")?.as_deref() {
            None | Some("sigmoid") => false,
            Some("ipo") => true,
            Some(other) => {
                return Err(config_err(
                    "loss_type",
                    format!("`{other}` is not one of sigmoid, ipo (TRL's OnlineDPOConfig)"),
                ));
            }
        };
        let (prompts, texts) = super::text_prompts(&data, tok, "online_dpo", false, false)?;
        Ok(OnlineDpoTask {
            prompts,
            texts,
            records: data.records.into_iter().map(|r| r.fields).collect(),
            options: config.task_options.clone(),
            rewards,
            weights,
            beta,
            ipo,
            missing_eos_penalty: config.option::<f64>("missing_eos_penalty")?,
            max_length: config.hyper.max_length.unwrap_or(512),
            source,
            reference,
            pairs: BTreeMap::new(),
        })
    }

    /// Prompts in the set.
    pub fn examples(&self) -> usize {
        self.prompts.len()
    }

    /// The sampler's stream (saved with checkpoints).
    pub fn state(&self) -> serde_json::Value {
        serde_json::json!({ "sampler_rng": self.source.rng_state() })
    }

    /// Restores [`OnlineDpoTask::state`].
    pub fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        if let Some(r) = state["sampler_rng"].as_u64() {
            self.source.set_rng_state(r);
        }
        Ok(())
    }

    /// Samples and scores the pairs of the step's prompts (TRL samples per micro-batch, with
    /// the weights every micro-batch of the step shares).
    pub fn begin_step<R: Runner<Model = M>>(
        &mut self,
        r: &R,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        self.pairs.clear();
        let tok = r.tokenizer();
        for mb in micro_batches {
            let prompts: Vec<Vec<u32>> = mb.iter().map(|&i| self.prompts[i].clone()).collect();
            let completions = self.source.complete(r, &prompts, 2)?;
            if completions.len() != mb.len() || completions.iter().any(|c| c.len() != 2) {
                return Err(config_err(
                    "online_dpo",
                    "the completion source returned the wrong number of completions",
                ));
            }
            let decoded = completions
                .iter()
                .map(|cs| {
                    cs.iter()
                        .map(|c| tok.decode(c))
                        .collect::<Result<Vec<String>, String>>()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|m| config_err("online_dpo", format!("decoding: {m}")))?;
            let inputs: Vec<crate::train::reward_registry::RewardInput<'_>> = mb
                .iter()
                .enumerate()
                .flat_map(|(k, &i)| (0..2).map(move |j| (k, i, j)))
                .map(|(k, i, j)| crate::train::reward_registry::RewardInput {
                    prompt: &self.texts[i],
                    completion: &decoded[k][j],
                    completion_ids: &completions[k][j],
                    example: &self.records[i],
                    options: &self.options,
                })
                .collect();
            let per_func = score(&self.rewards, &inputs)?;
            drop(inputs);
            for (k, &i) in mb.iter().enumerate() {
                let mut rewards = [0f64; 2];
                for (j, reward) in rewards.iter_mut().enumerate() {
                    let row = &per_func[2 * k + j];
                    *reward = row
                        .iter()
                        .zip(&self.weights)
                        .map(|(v, w)| v * w)
                        .filter(|v| !v.is_nan())
                        .sum();
                    if let Some(p) = self.missing_eos_penalty
                        && !completions[k][j].contains(&tok.eos_id)
                    {
                        *reward -= p;
                    }
                }
                let [a, b] = [completions[k][0].clone(), completions[k][1].clone()];
                self.pairs.insert(
                    i,
                    Pair {
                        completions: [a, b],
                        rewards,
                    },
                );
            }
        }
        Ok(())
    }

    /// Per-token log-probs `[2n, c]` of the micro-batch's completions under `model` (rows:
    /// every prompt's first sample, then every second), as TRL lays them out: prompts
    /// left-padded, completions right-padded, the prompt columns cut on the left past
    /// `max_length`; and the completion mask on the host.
    fn logps<R: Runner<Model = M>>(
        &self,
        r: &R,
        model: &M,
        indices: &[usize],
    ) -> Result<(TensorOf<R>, Vec<Vec<f32>>), TrainError> {
        let ops = r.ops();
        let pad = r.pad_id();
        let rows: Vec<(&[u32], &[u32])> = (0..2)
            .flat_map(|j| {
                indices.iter().map(move |i| {
                    (
                        self.prompts[*i].as_slice(),
                        self.pairs[i].completions[j].as_slice(),
                    )
                })
            })
            .collect();
        let p = rows.iter().map(|(p, _)| p.len()).max().unwrap_or(0);
        let c = rows.iter().map(|(_, c)| c.len()).max().unwrap_or(0).max(1);
        let cut = (p + c)
            .saturating_sub(self.max_length)
            .min(p.saturating_sub(1));
        let mut ids = Vec::with_capacity(rows.len());
        let mut attention = Vec::with_capacity(rows.len());
        let mut mask = Vec::with_capacity(rows.len());
        let mut labels = Vec::with_capacity(rows.len() * c);
        for (pr, co) in &rows {
            let lp = p - pr.len();
            let mut row = vec![pad; lp];
            row.extend(*pr);
            row.extend(*co);
            row.extend(std::iter::repeat_n(pad, c - co.len()));
            let mut att = vec![false; lp];
            att.extend(std::iter::repeat_n(true, pr.len() + co.len()));
            att.extend(std::iter::repeat_n(false, c - co.len()));
            ids.push(row[cut..].to_vec());
            attention.push(att[cut..].to_vec());
            let mut m = vec![1f32; co.len()];
            m.resize(c, 0.0);
            mask.push(m);
            labels.extend(*co);
            labels.extend(std::iter::repeat_n(pad, c - co.len()));
        }
        // The head at the completion's positions only, without the logits where the backend
        // can.
        let q = HeadQuery {
            ids: &ids,
            attention: &attention,
            positions: None,
            at: p - cut - 1..p - cut - 1 + c,
            labels: &labels,
            scale: 1.0,
        };
        if let Some((logps, _)) = r.forward_masked_logps(model, &q)? {
            return Ok((logps, mask));
        }
        let logits = r.forward_masked(model, &ids, &attention)?;
        let logits = ops.narrow(&logits, 1, q.at.start, c).tr()?;
        let labels = ops.ids(&labels, &[rows.len(), c]).tr()?;
        Ok((ops.token_logps(&logits, &labels).tr()?, mask))
    }

    /// The loss of the prompts `indices` and TRL's figures.
    pub fn loss<R: Runner<Model = M>>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let n = indices.len();
        let (logps, mask_host) = self.logps(r, r.policy(), indices)?;
        let (ref_logps, _) = self.logps(r, &self.reference, indices)?;
        let ref_logps = ops.detach(&ref_logps);
        let c = mask_host.first().map_or(0, Vec::len);
        let flat: Vec<f64> = mask_host.iter().flatten().map(|&m| f64::from(m)).collect();
        let mask = ops.tensor(&flat, &[2 * n, c]).tr()?;
        let sums = ops.sum_last(&ops.mul(&logps, &mask).tr()?).tr()?;
        let ref_sums = ops
            .to_f64(&ops.sum_last(&ops.mul(&ref_logps, &mask).tr()?).tr()?)
            .tr()?;
        // Chosen: the first sample when its reward is at least the second's.
        let first_wins: Vec<bool> = indices
            .iter()
            .map(|i| self.pairs[i].rewards[0] >= self.pairs[i].rewards[1])
            .collect();
        let sign: Vec<f64> = first_wins
            .iter()
            .map(|&w| if w { 1.0 } else { -1.0 })
            .collect();
        // Δ = (π_c − π_r) − (ref_c − ref_r), with (c, r) the first and second sample or the
        // reverse: sign · ((π_1 − π_2) − (ref_1 − ref_2)).
        let (first, second) = ops.halves(&sums).tr()?;
        let ref_diff: Vec<f64> = (0..n).map(|k| ref_sums[k] - ref_sums[n + k]).collect();
        let diff = ops
            .sub(
                &ops.sub(&first, &second).tr()?,
                &ops.tensor(&ref_diff, &[n]).tr()?,
            )
            .tr()?;
        let delta = ops.mul(&diff, &ops.tensor(&sign, &[n]).tr()?).tr()?;
        let per = if self.ipo {
            ops.sqr(&ops.affine(&delta, 1.0, -1.0 / (2.0 * self.beta)).tr()?)
                .tr()?
        } else {
            ops.affine(
                &ops.log_sigmoid(&ops.affine(&delta, self.beta, 0.0).tr()?)
                    .tr()?,
                -1.0,
                0.0,
            )
            .tr()?
        };
        let loss = ops.mean_all(&per).tr()?;
        // TRL's figures.
        let s = ops.to_f64(&ops.detach(&sums)).tr()?;
        let lp_all = ops.to_f64(&ops.detach(&logps)).tr()?;
        let rf_all = ops.to_f64(&ref_logps).tr()?;
        let (mut chosen, mut rejected) = (Vec::new(), Vec::new());
        let (mut scores, mut margins_scores) = (Vec::new(), Vec::new());
        for (k, i) in indices.iter().enumerate() {
            let (cw, rw) = if first_wins[k] {
                (k, n + k)
            } else {
                (n + k, k)
            };
            chosen.push((s[cw], ref_sums[cw]));
            rejected.push((s[rw], ref_sums[rw]));
            let pr = self.pairs[i].rewards;
            let (rc, rr) = if first_wins[k] {
                (pr[0], pr[1])
            } else {
                (pr[1], pr[0])
            };
            margins_scores.push(rc - rr);
            scores.extend(pr);
        }
        // Row order of the rewards as TRL holds them: every first sample, then every second.
        let rewards_rows: Vec<f64> = (0..2)
            .flat_map(|j| indices.iter().map(move |i| self.pairs[i].rewards[j]))
            .collect();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        // KL and entropy over every completion position, padding included, as TRL sums them.
        let kl_rows: Vec<f64> = (0..2 * n)
            .map(|row| {
                (0..c)
                    .map(|t| lp_all[row * c + t] - rf_all[row * c + t])
                    .sum()
            })
            .collect();
        let entropy_rows: Vec<f64> = (0..2 * n)
            .map(|row| -(0..c).map(|t| lp_all[row * c + t]).sum::<f64>())
            .collect();
        let non_score: Vec<f64> = kl_rows.iter().map(|k| -self.beta * k).collect();
        let eos = r.tokenizer().eos_id;
        let with_eos = (0..2)
            .flat_map(|j| indices.iter().map(move |i| (i, j)))
            .filter(|(i, j)| self.pairs[i].completions[*j].contains(&eos))
            .count();
        let cr: Vec<f64> = chosen.iter().map(|(p, r)| self.beta * (p - r)).collect();
        let rr: Vec<f64> = rejected.iter().map(|(p, r)| self.beta * (p - r)).collect();
        let margins: Vec<f64> = cr.iter().zip(&rr).map(|(a, b)| a - b).collect();
        let m = BTreeMap::from([
            ("objective/scores_margin".to_string(), mean(&margins_scores)),
            ("objective/scores".to_string(), mean(&scores)),
            (
                "val/contain_eos_token".to_string(),
                with_eos as f64 / (2 * n) as f64,
            ),
            (
                "logps/chosen".to_string(),
                mean(&chosen.iter().map(|c| c.0).collect::<Vec<_>>()),
            ),
            (
                "logps/rejected".to_string(),
                mean(&rejected.iter().map(|c| c.0).collect::<Vec<_>>()),
            ),
            ("objective/kl".to_string(), mean(&kl_rows)),
            ("objective/non_score_reward".to_string(), mean(&non_score)),
            (
                "objective/rlhf_reward".to_string(),
                mean(
                    &rewards_rows
                        .iter()
                        .zip(&non_score)
                        .map(|(a, b)| a + b)
                        .collect::<Vec<_>>(),
                ),
            ),
            ("objective/entropy".to_string(), mean(&entropy_rows)),
            ("rewards/chosen".to_string(), mean(&cr)),
            ("rewards/rejected".to_string(), mean(&rr)),
            ("rewards/margins".to_string(), mean(&margins)),
            (
                "rewards/accuracies".to_string(),
                margins.iter().filter(|&&x| x > 0.0).count() as f64 / n.max(1) as f64,
            ),
            ("beta".to_string(), self.beta),
        ]);
        let tokens = indices
            .iter()
            .map(|i| {
                let p = &self.pairs[i];
                (2 * self.prompts[*i].len() + p.completions[0].len() + p.completions[1].len())
                    as u64
            })
            .sum();
        Ok((loss, m, tokens))
    }
}
