//! The tasks, written once for every backend: each prepares its examples from the data as TRL
//! does, and computes a micro-batch's loss and figures from the log-probabilities a
//! [`Runner`] gives (the losses themselves are `losses.rs`'s). Candle's objectives and the MLX
//! backend both run these.

use super::TrainConfig;
use super::TrainError;
use super::config_err;
use super::data::{
    DataFormat, Dataset, LmExample, PairExample, ScoredPair, TextTokenizer, UnpairedExample,
    apply_chat_template, pair_examples, scored_pairs, unpair, unpaired_examples,
};
use super::losses::{
    self, CpoLoss, CpoSettings, DpoExtras, DpoLoss, DpoSettings, FDivergence, KtoLoss,
    PreferenceLogps, TokenInputs,
};
use super::ops::TensorOps;
use super::runner::{OrTrain, Runner, Shifted};
use std::collections::BTreeMap;

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
    Dataset::read(path, accepted)
}

/// Supervised fine-tuning (TRL's `SFTTrainer`): causal-LM cross-entropy over the label
/// tokens, the token mean over the whole optimisation step.
pub struct SftTask {
    examples: Vec<LmExample>,
    num_items: f64,
    /// `loss_type` dft (TRL's DFT loss) rather than nll.
    dft: bool,
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
        let dft = match config.option::<String>("loss_type")?.as_deref() {
            None | Some("nll") => false,
            Some("dft") => true,
            Some(other) => {
                return Err(config_err(
                    "loss_type",
                    format!("`{other}` is not one of nll, dft (TRL's SFTConfig)"),
                ));
            }
        };
        Ok(SftTask {
            examples,
            num_items: 0.0,
            dft,
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
        let loss = if self.dft {
            losses::sft_dft(ops, &inputs, self.num_items).tr()?
        } else {
            losses::sft(ops, &inputs, self.num_items).tr()?
        };
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
        let s = r.forward_shifted(reference, &self.sequences(indices))?;
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
        let s = r.forward_shifted(r.policy(), &seqs)?;
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

impl<M> DpoTask<M> {
    /// The chosen completions' mean token cross-entropy (TRL's `sft` loss type:
    /// `cross_entropy` over the chosen rows' completion tokens).
    fn chosen_nll<O: TensorOps>(
        &self,
        ops: &O,
        s: &super::runner::Shifted<O::T>,
    ) -> Result<O::T, TrainError> {
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
    fn wpo_weights<O: TensorOps>(
        ops: &O,
        s: &super::runner::Shifted<O::T>,
    ) -> Result<Vec<f64>, TrainError> {
        let rows = s.mask_host.len();
        let width = s.mask_host.first().map_or(0, Vec::len);
        let labels = ops.ids(&s.labels, &[rows, width]).tr()?;
        let doubled = ops
            .token_logps(&ops.detach(&ops.affine(&s.logits, 2.0, 0.0).tr()?), &labels)
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

/// Which reference-free preference loss a [`ScoredPairTask`] runs.
#[derive(Debug, Clone, Copy)]
pub enum ScoredLoss {
    /// ORPO with its β.
    Orpo(f64),
    /// CPO / SimPO.
    Cpo(CpoSettings),
}

/// ORPO and CPO/SimPO (TRL's experimental `ORPOTrainer`, `CPOTrainer`): no reference model;
/// both tokenize pairs the same way ([`scored_pairs`]).
pub struct ScoredPairTask {
    pairs: Vec<ScoredPair>,
    loss: ScoredLoss,
}

impl ScoredPairTask {
    /// ORPO's options: `beta` (0.1).
    pub fn orpo(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let beta = config.option::<f64>("beta")?.unwrap_or(0.1);
        Self::new(config, tok, ScoredLoss::Orpo(beta))
    }

    /// SimPO's options, TRL's `CPOConfig` defaults: `loss_type` simpo (or sigmoid, hinge, ipo:
    /// plain CPO), `beta` 0.1, `simpo_gamma` 0.5, `cpo_alpha` 1, `label_smoothing` 0.
    pub fn simpo(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        let name = config
            .option::<String>("loss_type")?
            .unwrap_or_else(|| "simpo".into());
        let kind = CpoLoss::parse(&name).ok_or_else(|| {
            config_err(
                "loss_type",
                format!("`{name}` is not one of {}", CpoLoss::NAMES.join(", ")),
            )
        })?;
        let s = CpoSettings {
            kind,
            beta: config.option::<f64>("beta")?.unwrap_or(0.1),
            simpo_gamma: config.option::<f64>("simpo_gamma")?.unwrap_or(0.5),
            cpo_alpha: config.option::<f64>("cpo_alpha")?.unwrap_or(1.0),
            label_smoothing: config.option::<f64>("label_smoothing")?.unwrap_or(0.0),
        };
        Self::new(config, tok, ScoredLoss::Cpo(s))
    }

    fn new(
        config: &TrainConfig,
        tok: &TextTokenizer,
        loss: ScoredLoss,
    ) -> Result<Self, TrainError> {
        // TRL's ORPO and CPO trainers render conversations into text first.
        let data = apply_chat_template(&read_data(config, &[DataFormat::Preference])?, tok)?;
        let max_length = config.hyper.max_length.unwrap_or(usize::MAX);
        let pairs = scored_pairs(&data, tok, max_length)?;
        Ok(ScoredPairTask { pairs, loss })
    }

    /// `orpo` or `simpo`.
    pub fn name(&self) -> &'static str {
        match self.loss {
            ScoredLoss::Orpo(_) => "orpo",
            ScoredLoss::Cpo(_) => "simpo",
        }
    }

    /// Pairs in the set.
    pub fn examples(&self) -> usize {
        self.pairs.len()
    }

    /// The loss of the pairs `indices` and TRL's figures.
    pub fn loss<R: Runner>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let n = indices.len();
        let mut seqs = Vec::with_capacity(2 * n);
        for pick in [0, 1] {
            for &i in indices {
                let p = &self.pairs[i];
                let side = if pick == 0 { &p.chosen } else { &p.rejected };
                seqs.push((side.ids.clone(), side.mask.clone()));
            }
        }
        let s = r.forward_shifted(r.policy(), &seqs)?;
        let sums = ops.sum_last(&ops.mul(&s.logps, &s.mask).tr()?).tr()?;
        let counts: Vec<f64> = s
            .mask_host
            .iter()
            .map(|r| r.iter().map(|&m| f64::from(m)).sum())
            .collect();
        let averaged = match self.loss {
            ScoredLoss::Orpo(_) => true,
            ScoredLoss::Cpo(c) => c.kind.averages(),
        };
        let seq = if averaged {
            ops.div(&sums, &ops.tensor(&counts, &[2 * n]).tr()?).tr()?
        } else {
            sums
        };
        let (chosen, rejected) = ops.halves(&seq).tr()?;
        let (chosen_logps, _) = ops.halves(&s.logps).tr()?;
        // The chosen rows' mean cross-entropy: over every real token for ORPO, over the
        // completion for CPO.
        let nll_mask: Vec<Vec<f32>> = match self.loss {
            ScoredLoss::Orpo(_) => s.attention[..n].iter().map(|r| r[1..].to_vec()).collect(),
            ScoredLoss::Cpo(_) => s.mask_host[..n].to_vec(),
        };
        let width = nll_mask[0].len();
        let count: f64 = nll_mask.iter().flatten().map(|&m| f64::from(m)).sum();
        let flat: Vec<f64> = nll_mask.iter().flatten().map(|&m| f64::from(m)).collect();
        let mask_t = ops.tensor(&flat, &[n, width]).tr()?;
        let nll = losses::sft(
            ops,
            &TokenInputs {
                logps: chosen_logps,
                mask: mask_t,
                mask_host: nll_mask,
            },
            count,
        )
        .tr()?;
        let (out, logits) = match self.loss {
            ScoredLoss::Orpo(beta) => (
                losses::orpo(ops, beta, &chosen, &rejected, &nll).tr()?,
                &s.logits,
            ),
            ScoredLoss::Cpo(c) => {
                let nll = if c.cpo_alpha == 0.0 {
                    ops.tensor(&[0.0], &[]).tr()?
                } else {
                    nll
                };
                (
                    losses::cpo(ops, c, &chosen, &rejected, &nll).tr()?,
                    &s.full_logits,
                )
            }
        };
        let mut m = out.metrics;
        // TRL: the mean of every logit of the chosen (rejected) rows, padding included.
        let (lc, lr) = ops.halves(&ops.detach(logits)).tr()?;
        m.insert(
            "logits/chosen".into(),
            ops.to_f64(&ops.mean_all(&lc).tr()?).tr()?[0],
        );
        m.insert(
            "logits/rejected".into(),
            ops.to_f64(&ops.mean_all(&lr).tr()?).tr()?[0],
        );
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        Ok((out.loss, m, tokens))
    }
}

/// KTO (TRL's `KTOTrainer`): unpaired desirable / undesirable completions against a frozen
/// reference `M`, with the KL reference point estimated on mismatched prompt/completion pairs.
pub struct KtoTask<M> {
    examples: Vec<UnpairedExample>,
    kind: KtoLoss,
    beta: f64,
    weights: (f64, f64),
    reference: Option<M>,
    /// Reference log-probs of each completion and KL sequence, computed before training.
    precomputed: Option<Vec<(f64, f64)>>,
}

impl<M> KtoTask<M> {
    /// KTO's options (TRL's `KTOConfig`): `beta` 0.1, `loss_type` kto (or
    /// apo_zero_unpaired), `desirable_weight` 1, `undesirable_weight` 1,
    /// `precompute_ref_log_probs`; `reference` as TRL makes it (with LoRA the base model with
    /// its adapters off, even when training continues an adapter; else the starting weights).
    pub fn new<R: Runner<Model = M>>(
        config: &TrainConfig,
        tok: &TextTokenizer,
        runner: &R,
        reference: M,
    ) -> Result<Self, TrainError> {
        let name = config
            .option::<String>("loss_type")?
            .unwrap_or_else(|| "kto".into());
        let kind = KtoLoss::parse(&name).ok_or_else(|| {
            config_err(
                "loss_type",
                format!("`{name}` is not one of {}", KtoLoss::NAMES.join(", ")),
            )
        })?;
        let bs = config.hyper.per_device_train_batch_size;
        if kind == KtoLoss::Kto && bs <= 1 {
            return Err(config_err(
                "per_device_train_batch_size",
                "KTO needs at least 2 examples per micro-batch: its KL term pairs each prompt with another example's completion",
            ));
        }
        // TRL's KTO trainer unpairs preference data, then renders conversations into text.
        let data = read_data(config, &[DataFormat::Unpaired, DataFormat::Preference])?;
        let data = apply_chat_template(&unpair(&data), tok)?;
        let max_length = config.hyper.max_length.unwrap_or(512);
        let kl = (kind == KtoLoss::Kto).then_some(bs);
        let examples = unpaired_examples(&data, tok, max_length, kl)?;
        let mut me = KtoTask {
            examples,
            kind,
            beta: config.option::<f64>("beta")?.unwrap_or(0.1),
            weights: (
                config.option::<f64>("desirable_weight")?.unwrap_or(1.0),
                config.option::<f64>("undesirable_weight")?.unwrap_or(1.0),
            ),
            reference: Some(reference),
            precomputed: None,
        };
        if config
            .option::<bool>("precompute_ref_log_probs")?
            .unwrap_or(false)
        {
            let ops = runner.ops();
            let idx: Vec<usize> = (0..me.examples.len()).collect();
            let mut all = Vec::with_capacity(idx.len());
            for chunk in idx.chunks(bs.max(1)) {
                let model = me.reference.as_ref().expect("kept until now");
                let c = me.sums(runner, model, chunk, false)?;
                let k = match kl {
                    Some(_) => ops.to_f64(&me.sums(runner, model, chunk, true)?).tr()?,
                    None => vec![0.0; chunk.len()],
                };
                all.extend(ops.to_f64(&c).tr()?.into_iter().zip(k));
            }
            me.precomputed = Some(all);
            me.reference = None;
        }
        Ok(me)
    }

    /// Examples in the set.
    pub fn examples(&self) -> usize {
        self.examples.len()
    }

    /// Summed completion log-probs of `model` over the completions (or the KL sequences).
    fn sums<R: Runner<Model = M>>(
        &self,
        r: &R,
        model: &M,
        indices: &[usize],
        kl: bool,
    ) -> Result<TensorOf<R>, TrainError> {
        let seqs: Vec<(Vec<u32>, Vec<u8>)> = indices
            .iter()
            .map(|&i| {
                let e = if kl {
                    &self.examples[i].kl_seq
                } else {
                    &self.examples[i].seq
                };
                (e.ids.clone(), e.mask.clone())
            })
            .collect();
        let ops = r.ops();
        let s = r.forward_shifted(model, &seqs)?;
        ops.sum_last(&ops.mul(&s.logps, &s.mask).tr()?).tr()
    }

    /// The loss of the examples `indices` and TRL's figures (per-side sums, divided at
    /// logging time by [`losses::kto_window`]).
    pub fn loss<R: Runner<Model = M>>(
        &self,
        r: &R,
        indices: &[usize],
    ) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        let ops = r.ops();
        let n = indices.len();
        let with_kl = self.kind == KtoLoss::Kto;
        let seqs: Vec<(Vec<u32>, Vec<u8>)> = indices
            .iter()
            .map(|&i| {
                (
                    self.examples[i].seq.ids.clone(),
                    self.examples[i].seq.mask.clone(),
                )
            })
            .collect();
        let s = r.forward_shifted(r.policy(), &seqs)?;
        let logps = ops.sum_last(&ops.mul(&s.logps, &s.mask).tr()?).tr()?;
        let (ref_logps, ref_kl): (Vec<f64>, Vec<f64>) = match &self.precomputed {
            Some(all) => indices.iter().map(|&i| all[i]).unzip(),
            None => {
                let model = self.reference.as_ref().expect("reference kept");
                let c = ops.to_f64(&self.sums(r, model, indices, false)?).tr()?;
                let k = if with_kl {
                    ops.to_f64(&self.sums(r, model, indices, true)?).tr()?
                } else {
                    vec![0.0; n]
                };
                (c, k)
            }
        };
        let kl = if with_kl {
            // The policy's KL log-probs, without gradient, as TRL computes them.
            let p = ops
                .to_f64(&ops.detach(&self.sums(r, r.policy(), indices, true)?))
                .tr()?;
            p.iter().zip(&ref_kl).map(|(a, b)| a - b).sum::<f64>() / n as f64
        } else {
            0.0
        };
        let logratios = ops.sub(&logps, &ops.tensor(&ref_logps, &[n]).tr()?).tr()?;
        let labels: Vec<bool> = indices.iter().map(|&i| self.examples[i].label).collect();
        let out = losses::kto(
            ops,
            self.kind,
            self.beta,
            &logratios,
            &logps,
            &labels,
            kl,
            self.weights,
        )
        .tr()?;
        let mut m = out.metrics;
        // TRL: the sum of every logit of each side's rows (all positions, padding included).
        let per_row: Vec<f64> = ops
            .to_f64(
                &ops.sum_last(&ops.sum_last(&ops.detach(&s.full_logits)).tr()?)
                    .tr()?,
            )
            .tr()?;
        for (side, want) in [("chosen", true), ("rejected", false)] {
            if labels.contains(&want) {
                let sum: f64 = (0..n)
                    .filter(|&i| labels[i] == want)
                    .map(|i| per_row[i])
                    .sum();
                m.insert(format!("logits/{side}_sum"), sum);
            }
        }
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        Ok((out.loss, m, tokens))
    }
}
