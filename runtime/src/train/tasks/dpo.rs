//! Direct preference optimisation (TRL's `DPOTrainer`): its pairs and its losses.

use super::{MicroBatch, TensorOf, read_data};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::{DataFormat, Dataset, TextTokenizer, field, split_ids, with_eos};
use crate::train::losses::{self, DpoExtras, DpoLoss, DpoSettings, FDivergence, PreferenceLogps};
use crate::train::ops::TensorOps;
use crate::train::runner::{OrTrain, Runner, Shifted};
use serde_json::Value;

/// A tokenized preference pair: the prompt's ids and each completion's ids after it.
#[derive(Debug, Clone, PartialEq)]
pub struct PairExample {
    /// The prompt.
    pub prompt: Vec<u32>,
    /// The chosen completion (after the prompt).
    pub chosen: Vec<u32>,
    /// The rejected completion.
    pub rejected: Vec<u32>,
}

/// Preference pairs (TRL's `DPOTrainer` preprocessing): the EOS is appended to both
/// completions; each is the ids of `prompt + completion` past the prompt's ids.
pub fn pair_examples(data: &Dataset, tok: &TextTokenizer) -> Result<Vec<PairExample>, TrainError> {
    data.records
        .iter()
        .map(|r| {
            if r.fields.get("prompt").is_some_and(Value::is_array) {
                // Conversational: the prompt with the assistant's header, then each side
                // rendered after it (TRL's DPOTrainer).
                let err = |m: String| TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: m,
                };
                let prompt = r.fields["prompt"].as_array().cloned().unwrap_or_default();
                let (p, _) = tok
                    .encode_chat(&Value::Array(prompt.clone()), true)
                    .map_err(&err)?;
                let side = |k: &str| -> Result<Vec<u32>, TrainError> {
                    let mut all = prompt.clone();
                    all.extend(r.fields[k].as_array().cloned().unwrap_or_default());
                    let (ids, _) = tok.encode_chat(&Value::Array(all), false).map_err(&err)?;
                    Ok(ids.get(p.len()..).unwrap_or_default().to_vec())
                };
                let chosen = side("chosen")?;
                let rejected = side("rejected")?;
                return Ok(PairExample {
                    prompt: p,
                    chosen,
                    rejected,
                });
            }
            let prompt = field(r, "prompt");
            let chosen = format!("{prompt}{}", with_eos(field(r, "chosen"), &tok.eos_token));
            let rejected = format!("{prompt}{}", with_eos(field(r, "rejected"), &tok.eos_token));
            let (p, c) = split_ids(tok, data, r, prompt, &chosen)?;
            let (_, rj) = split_ids(tok, data, r, prompt, &rejected)?;
            Ok(PairExample {
                prompt: p,
                chosen: c,
                rejected: rj,
            })
        })
        .collect()
}

/// DPO (TRL's `DPOTrainer`): the preference loss over summed completion log-probabilities,
/// against a frozen reference model `M` (or reference log-probs computed before training).
pub struct DpoTask<M> {
    pairs: Vec<PairExample>,
    settings: DpoSettings,
    /// LD-DPO's `ld_alpha`: the weight of the longer completion's tokens past the shorter's.
    ld_alpha: Option<f64>,
    /// WPO's weighting (`use_weighting`).
    use_weighting: bool,
    max_length: Option<usize>,
    reference: Option<M>,
    /// Reference log-probs computed before training (`precompute_ref_log_probs`).
    precomputed: Option<Vec<(f64, f64)>>,
}

/// DPO's settings from `config` (TRL's `DPOConfig` fields and its checks).
pub fn dpo_settings(config: &TrainConfig) -> Result<DpoSettings, TrainError> {
    let beta = config.option::<f64>("beta")?.unwrap_or(0.1);
    let names: Vec<String> = match config.task_options.get("loss_type") {
        None => vec!["sigmoid".into()],
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(_) => config
            .option::<Vec<String>>("loss_type")?
            .unwrap_or_default(),
    };
    if names.is_empty() {
        return Err(config_err(
            "loss_type",
            "an empty list: name at least one loss",
        ));
    }
    let weights = config
        .option::<Vec<f64>>("loss_weights")?
        .unwrap_or_else(|| vec![1.0; names.len()]);
    if weights.len() != names.len() {
        return Err(config_err(
            "loss_weights",
            format!(
                "{} weights for {} loss types (one weight per loss_type)",
                weights.len(),
                names.len()
            ),
        ));
    }
    let mut losses = Vec::with_capacity(names.len());
    for (name, w) in names.iter().zip(weights) {
        let kind = DpoLoss::parse(name).ok_or_else(|| {
            config_err(
                "loss_type",
                format!("`{name}` is not one of {}", DpoLoss::names()),
            )
        })?;
        losses.push((kind, w));
    }
    let label_smoothing = config.option::<f64>("label_smoothing")?.unwrap_or(0.0);
    let has = |k: DpoLoss| losses.iter().any(|(l, _)| *l == k);
    if has(DpoLoss::ExoPair) && label_smoothing <= 0.0 {
        return Err(config_err(
            "label_smoothing",
            "loss_type exo_pair needs label_smoothing > 0 (the EXO paper recommends 1e-3), as TRL requires",
        ));
    }
    if has(DpoLoss::Robust) && !(0.0..0.5).contains(&label_smoothing) {
        return Err(config_err(
            "label_smoothing",
            format!(
                "loss_type robust divides by 1 − 2·label_smoothing: {label_smoothing} is outside [0, 0.5)"
            ),
        ));
    }
    let name = config
        .option::<String>("f_divergence_type")?
        .unwrap_or_else(|| "reverse_kl".into());
    let alpha = config
        .option::<f64>("f_alpha_divergence_coef")?
        .unwrap_or(0.5);
    let divergence = FDivergence::parse(&name, alpha).ok_or_else(|| {
        config_err(
            "f_divergence_type",
            format!(
                "`{name}` is not one of reverse_kl, forward_kl, js_divergence, alpha_divergence"
            ),
        )
    })?;
    let discopop_tau = config.option::<f64>("discopop_tau")?.unwrap_or(0.05);
    Ok(DpoSettings {
        losses,
        beta,
        label_smoothing,
        divergence,
        discopop_tau,
    })
}

impl<M> DpoTask<M> {
    /// The pairs of `config.train_data` and DPO's options (`beta`, `loss_type`,
    /// `loss_weights`, `label_smoothing`, `f_divergence_type`, `ld_alpha`, `use_weighting`,
    /// `precompute_ref_log_probs`), against `reference`.
    pub fn new<R: Runner<Model = M>>(
        config: &TrainConfig,
        tok: &TextTokenizer,
        runner: &R,
        reference: M,
    ) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Preference])?;
        let pairs = pair_examples(&data, tok)?;
        let settings = dpo_settings(config)?;
        let use_weighting = config.option::<bool>("use_weighting")?.unwrap_or(false);
        if use_weighting
            && settings
                .losses
                .iter()
                .any(|(l, _)| matches!(l, DpoLoss::Aot | DpoLoss::AotUnpaired))
        {
            return Err(config_err(
                "use_weighting",
                "WPO's weighting does not go with loss_type aot or aot_unpaired (they sort the pairs), as in TRL",
            ));
        }
        let mut me = DpoTask {
            pairs,
            settings,
            ld_alpha: config.option::<f64>("ld_alpha")?,
            use_weighting,
            max_length: config.hyper.max_length,
            reference: Some(reference),
            precomputed: None,
        };
        if config
            .option::<bool>("precompute_ref_log_probs")?
            .unwrap_or(false)
        {
            let bs = config
                .option::<u64>("precompute_ref_batch_size")?
                .map(|b| b as usize)
                .unwrap_or(config.hyper.per_device_train_batch_size)
                .max(1);
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

    /// The per-token weights of the summed log-probabilities: the completion mask, with
    /// LD-DPO's `ld_alpha` on the tokens of the longer completion past the shorter one's
    /// length (TRL's `shared_mask + ld_alpha · tail_mask`).
    fn token_weights<O: TensorOps>(
        &self,
        ops: &O,
        mask: &O::T,
        mask_host: &[Vec<f32>],
    ) -> Result<O::T, TrainError> {
        let Some(alpha) = self.ld_alpha else {
            return Ok(mask.clone());
        };
        let n = mask_host.len() / 2;
        let len = |row: &[f32]| row.iter().map(|&m| f64::from(m)).sum::<f64>();
        let width = mask_host.first().map_or(0, Vec::len);
        let mut w = Vec::with_capacity(mask_host.len() * width);
        for (i, row) in mask_host.iter().enumerate() {
            let pair = i % n.max(1);
            let shared = len(&mask_host[pair]).min(len(&mask_host[pair + n]));
            let mut pos = 0.0;
            for &m in row {
                pos += f64::from(m);
                w.push(if m == 0.0 {
                    0.0
                } else if pos <= shared {
                    1.0
                } else {
                    alpha
                });
            }
        }
        ops.tensor(&w, &[mask_host.len(), width]).tr()
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
        let s = r.forward_shifted(reference, &self.sequences(indices), false)?;
        let weights = self.token_weights(ops, &s.mask, &s.mask_host)?;
        let sums = ops.sum_last(&ops.mul(&s.logps, &weights).tr()?).tr()?;
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
        // WPO's weights read the whole logits.
        let s = r.forward_shifted(r.policy(), &seqs, self.use_weighting)?;
        let weights = self.token_weights(ops, &s.mask, &s.mask_host)?;
        let sums = ops.sum_last(&ops.mul(&s.logps, &weights).tr()?).tr()?;
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
        let extras = DpoExtras {
            chosen_nll: if self.settings.losses.iter().any(|(l, _)| *l == DpoLoss::Sft) {
                Some(self.chosen_nll(ops, &s)?)
            } else {
                None
            },
            pair_weights: if self.use_weighting {
                Some(Self::wpo_weights(ops, &s)?)
            } else {
                None
            },
        };
        let out = losses::dpo_with(ops, &self.settings, &p, &extras).tr()?;
        let mut m = out.metrics;
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        m.insert("entropy".into(), s.entropy_over(ops, &s.mask_host, false)?);
        m.insert("mean_token_accuracy".into(), s.token_accuracy(ops, 0..n)?);
        // TRL: the mean over vocabulary of the logits, averaged over completion tokens.
        let vocab = s.vocab(ops)? as f64;
        let mean_logits: Vec<f64> = s
            .logit_sums(ops, false)?
            .iter()
            .map(|v| v / vocab)
            .collect();
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

impl<M> DpoTask<M> {
    /// The chosen completions' mean token cross-entropy (TRL's `sft` loss type:
    /// `cross_entropy` over the chosen rows' completion tokens).
    fn chosen_nll<O: TensorOps>(&self, ops: &O, s: &Shifted<O::T>) -> Result<O::T, TrainError> {
        let (logps, _) = ops.halves(&s.logps).tr()?;
        let (mask, _) = ops.halves(&s.mask).tr()?;
        let n = s.mask_host.len() / 2;
        let count: f64 = s.mask_host[..n]
            .iter()
            .flatten()
            .map(|&m| f64::from(m))
            .sum();
        let total = ops.sum_all(&ops.mul(&logps, &mask).tr()?).tr()?;
        ops.affine(&total, -1.0 / count.max(1.0), 0.0).tr()
    }

    /// WPO's weights (TRL's `use_weighting`): per sequence `exp(mean over completion tokens of
    /// log p − log Σ p²)`, the pair's weight the product of its chosen and rejected ones; no
    /// gradient. `log p − log Σ p²` is `log softmax(2·logits)[label] − log p`.
    fn wpo_weights<O: TensorOps>(ops: &O, s: &Shifted<O::T>) -> Result<Vec<f64>, TrainError> {
        let rows = s.mask_host.len();
        let width = s.mask_host.first().map_or(0, Vec::len);
        let labels = ops.ids(&s.labels, &[rows, width]).tr()?;
        let logits = s.logits.as_ref().ok_or_else(|| TrainError::Backend {
            backend: "tensor operations".into(),
            message: "use_weighting needs the logits (forward_shifted keeps them)".into(),
        })?;
        let doubled = ops
            .token_logps(&ops.detach(&ops.affine(logits, 2.0, 0.0).tr()?), &labels)
            .tr()?;
        let aligned = ops
            .to_f64(&ops.sub(&doubled, &ops.detach(&s.logps)).tr()?)
            .tr()?;
        let per_seq: Vec<f64> = (0..rows)
            .map(|i| {
                let (mut sum, mut count) = (0.0, 0.0);
                for (t, &m) in s.mask_host[i].iter().enumerate() {
                    sum += aligned[i * width + t] * f64::from(m);
                    count += f64::from(m);
                }
                (sum / count.max(1.0)).exp()
            })
            .collect();
        let n = rows / 2;
        Ok((0..n).map(|i| per_seq[i] * per_seq[i + n]).collect())
    }
}
