//! KTO (TRL's `KTOTrainer`): its unpaired examples and KL pairs, and its loss.

use super::{MicroBatch, TensorOf, read_data};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::{
    DataFormat, Dataset, LmExample, TextTokenizer, apply_chat_template, field, py_head, unpair,
};
use crate::train::losses::RunningMoments;
use crate::train::losses::{self, KtoLoss};
use crate::train::ops::TensorOps;
use crate::train::runner::{OrTrain, Runner};
use serde_json::Value;
use std::sync::{Arc, Mutex};

/// An unpaired example as TRL's KTO trainer tokenizes it (`_tokenize` + `_process_tokens`).
#[derive(Debug, Clone, PartialEq)]
pub struct UnpairedExample {
    /// `prompt + completion` with the completion's label mask.
    pub seq: LmExample,
    /// The same prompt with the previous example's completion (TRL's KL batch; empty when the
    /// KL term is not computed).
    pub kl_seq: LmExample,
    /// Desirable (`true`) or not.
    pub label: bool,
}

/// The prompt's and the answer's ids of `prompt + answer` without special tokens, split as
/// TRL splits them (one token earlier when the tokenizer merged across the boundary).
fn split_plain(
    tok: &TextTokenizer,
    prompt: &str,
    answer: &str,
) -> Result<(Vec<u32>, Vec<u32>), String> {
    let plain_prompt = tok.encode_plain(prompt)?;
    let full = tok.encode_plain(&format!("{prompt}{answer}"))?;
    let mut start = plain_prompt.len().min(full.len());
    if full[..start] != plain_prompt[..] {
        start = start.saturating_sub(1);
    }
    Ok((full[..start].to_vec(), full[start..].to_vec()))
}

/// KTO's `_process_tokens`: the completion is cut so that the sequence with its BOS and EOS
/// fits `max_length`; a BOS goes first and an EOS last when missing; the prompt is masked.
fn kto_sequence(
    tok: &TextTokenizer,
    prompt: &[u32],
    answer: &[u32],
    max_length: usize,
) -> LmExample {
    let mut max = max_length as i64;
    let bos_missing = !prompt.is_empty() && tok.bos_id != Some(prompt[0]);
    if bos_missing {
        max -= 1;
    }
    if answer.last().is_some_and(|&a| a != tok.eos_id) {
        max -= 1;
    }
    let mut answer = answer.to_vec();
    if (prompt.len() + answer.len()) as i64 > max {
        py_head(&mut answer, max - prompt.len() as i64);
    }
    let mut ids = Vec::with_capacity(prompt.len() + answer.len() + 2);
    if let Some(bos) = tok.bos_id
        && prompt.first() != Some(&bos)
    {
        ids.push(bos);
    }
    ids.extend(prompt);
    let prompt_len = ids.len();
    ids.extend(&answer);
    if answer.last() != Some(&tok.eos_id) {
        ids.push(tok.eos_id);
    }
    let mut mask = vec![0u8; prompt_len];
    mask.resize(ids.len(), 1);
    LmExample { ids, mask }
}

/// KTO preprocessing; with `kl_batch` (the KL term is computed) each example's KL sequence
/// pairs its prompt with the completion of the example before it within consecutive groups
/// of `kl_batch` (the first takes the group's last), as TRL builds its KL dataset.
pub fn unpaired_examples(
    data: &Dataset,
    tok: &TextTokenizer,
    max_length: usize,
    kl_batch: Option<usize>,
) -> Result<Vec<UnpairedExample>, TrainError> {
    let mut split = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let (p, a) = split_plain(tok, field(r, "prompt"), field(r, "completion")).map_err(|m| {
            TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: format!("tokenizing: {m}"),
            }
        })?;
        let label = r
            .fields
            .get("label")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        split.push((p, a, label));
    }
    let mut out = Vec::with_capacity(split.len());
    for (i, (p, a, label)) in split.iter().enumerate() {
        let kl_seq = match kl_batch {
            Some(b) => {
                let start = i / b * b;
                let end = (start + b).min(split.len());
                let from = if i == start { end - 1 } else { i - 1 };
                kto_sequence(tok, p, &split[from].1, max_length)
            }
            None => LmExample {
                ids: Vec::new(),
                mask: Vec::new(),
            },
        };
        out.push(UnpairedExample {
            seq: kto_sequence(tok, p, a, max_length),
            kl_seq,
            label: *label,
        });
    }
    Ok(out)
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
    /// BCO's running moments of the rewards (shared with the evaluation set's task, which
    /// reads the training's shift without updating it).
    running: Arc<Mutex<RunningMoments>>,
    /// Whether micro-batches update `running` (training, not evaluation).
    update_running: bool,
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
        let kind = if config.task == "bco" {
            KtoLoss::Bco
        } else {
            let name = config
                .option::<String>("loss_type")?
                .unwrap_or_else(|| "kto".into());
            KtoLoss::parse(&name).ok_or_else(|| {
                config_err(
                    "loss_type",
                    format!("`{name}` is not one of {}", KtoLoss::NAMES.join(", ")),
                )
            })?
        };
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
            running: Arc::new(Mutex::new(RunningMoments::default())),
            update_running: true,
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

    /// `kto`, or `bco`.
    pub fn name(&self) -> &'static str {
        if self.kind == KtoLoss::Bco {
            "bco"
        } else {
            "kto"
        }
    }

    /// BCO's running moments, to share with the evaluation set's task.
    pub fn running(&self) -> Arc<Mutex<RunningMoments>> {
        self.running.clone()
    }

    /// The evaluation set's task: BCO's shift is the training's, read and not updated.
    pub fn evaluate_with(&mut self, running: Arc<Mutex<RunningMoments>>) {
        self.running = running;
        self.update_running = false;
    }

    /// BCO's running moments, for a resumed run.
    pub fn state(&self) -> serde_json::Value {
        match self.kind {
            KtoLoss::Bco => serde_json::json!({
                "running": *self.running.lock().unwrap_or_else(|e| e.into_inner())
            }),
            _ => serde_json::Value::Null,
        }
    }

    /// Restores [`KtoTask::state`].
    pub fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        if let Some(r) = state.get("running") {
            let r: RunningMoments = serde_json::from_value(r.clone())
                .map_err(|e| config_err("resume", format!("trainer_state.json `running`: {e}")))?;
            *self.running.lock().unwrap_or_else(|e| e.into_inner()) = r;
        }
        Ok(())
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
        let s = r.forward_shifted(model, &seqs, false)?;
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
        let s = r.forward_shifted(r.policy(), &seqs, false)?;
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
        let out = match self.kind {
            KtoLoss::Bco => {
                let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
                losses::bco(
                    ops,
                    self.beta,
                    &logratios,
                    &logps,
                    &labels,
                    &mut running,
                    self.update_running,
                )
            }
            _ => losses::kto(
                ops,
                self.kind,
                self.beta,
                &logratios,
                &logps,
                &labels,
                kl,
                self.weights,
            ),
        }
        .tr()?;
        let mut m = out.metrics;
        // TRL: the sum of every logit of each side's rows (all positions, padding included).
        let width = s.attention.first().map_or(0, Vec::len).max(1);
        let per_row: Vec<f64> = s
            .logit_sums(ops, true)?
            .chunks(width)
            .map(|r| r.iter().sum())
            .collect();
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
