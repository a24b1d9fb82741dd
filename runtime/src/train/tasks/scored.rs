//! ORPO and CPO / SimPO (TRL's `ORPOTrainer`, `CPOTrainer`): their pairs and losses.

use super::{MicroBatch, TensorOf, read_data};
use crate::train::TrainConfig;
use crate::train::TrainError;
use crate::train::config_err;
use crate::train::data::{
    DataFormat, Dataset, LmExample, TextTokenizer, apply_chat_template, field, py_head,
};
use crate::train::losses::{self, CpoLoss, CpoSettings, TokenInputs};
use crate::train::ops::TensorOps;
use crate::train::runner::{OrTrain, Runner};

/// Which reference-free preference loss a [`ScoredPairTask`] runs.
#[derive(Debug, Clone, Copy)]
pub enum ScoredLoss {
    /// ORPO with its β.
    Orpo(f64),
    /// CPO / SimPO.
    Cpo(CpoSettings),
}

/// A preference pair as TRL's ORPO and CPO trainers tokenize it: each side is the prompt's
/// ids (a BOS put first when missing) and the completion's (the EOS put last when missing),
/// with a label mask over the completion.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredPair {
    /// `prompt + chosen` and its label mask.
    pub chosen: LmExample,
    /// `prompt + rejected` and its label mask.
    pub rejected: LmExample,
}

/// ORPO / CPO preprocessing (`build_tokenized_answer` + `tokenize_row` of TRL's experimental
/// trainers): the completion is `enc(prompt + answer)[len(enc(prompt)):]` without special
/// tokens (one token earlier when the tokenizer merged across the boundary); a BOS is put
/// before each prompt and an EOS after each completion when missing; when the prompt plus the
/// longer completion exceeds `max_length`, both completions are cut to
/// `max_length − longer` tokens (Python slicing: a negative count cuts from the end).
pub fn scored_pairs(
    data: &Dataset,
    tok: &TextTokenizer,
    max_length: usize,
) -> Result<Vec<ScoredPair>, TrainError> {
    let mut out = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let err = |m: String| TrainError::Data {
            path: data.path.clone(),
            line: Some(r.line),
            message: m,
        };
        let prompt = field(r, "prompt");
        let plain_prompt = tok.encode_plain(prompt).map_err(&err)?;
        let mut sides = Vec::with_capacity(2);
        for answer in [field(r, "chosen"), field(r, "rejected")] {
            let full = tok
                .encode_plain(&format!("{prompt}{answer}"))
                .map_err(&err)?;
            let mut start = plain_prompt.len().min(full.len());
            if full[..start] != plain_prompt[..] {
                start = start.saturating_sub(1);
            }
            let (mut p, mut a) = (full[..start].to_vec(), full[start..].to_vec());
            if let Some(bos) = tok.bos_id
                && p.first() != Some(&bos)
            {
                p.insert(0, bos);
            }
            if a.last() != Some(&tok.eos_id) {
                a.push(tok.eos_id);
            }
            sides.push((p, a));
        }
        let longer = sides.iter().map(|(_, a)| a.len()).max().unwrap_or(0);
        let make = |(p, mut a): (Vec<u32>, Vec<u32>)| {
            if p.len() + longer > max_length {
                py_head(&mut a, max_length as i64 - longer as i64);
            }
            let mut mask = vec![0u8; p.len()];
            mask.extend(std::iter::repeat_n(1, a.len()));
            let mut ids = p;
            ids.extend(a);
            LmExample { ids, mask }
        };
        let rejected = sides.pop().expect("two sides");
        let chosen = sides.pop().expect("two sides");
        out.push(ScoredPair {
            chosen: make(chosen),
            rejected: make(rejected),
        });
    }
    Ok(out)
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
        let s = r.forward_shifted(r.policy(), &seqs, false)?;
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
        // ORPO's logged logits are the shifted positions', CPO's every position's.
        let (out, full) = match self.loss {
            ScoredLoss::Orpo(beta) => (
                losses::orpo(ops, beta, &chosen, &rejected, &nll).tr()?,
                false,
            ),
            ScoredLoss::Cpo(c) => {
                let nll = if c.cpo_alpha == 0.0 {
                    ops.tensor(&[0.0], &[]).tr()?
                } else {
                    nll
                };
                (losses::cpo(ops, c, &chosen, &rejected, &nll).tr()?, true)
            }
        };
        let mut m = out.metrics;
        // TRL: the mean of every logit of the chosen (rejected) rows, padding included.
        let sums = s.logit_sums(ops, full)?;
        let per_side = sums.len() / 2;
        let count = (per_side * s.vocab(ops)?).max(1) as f64;
        for (name, half) in [
            ("logits/chosen", &sums[..per_side]),
            ("logits/rejected", &sums[per_side..]),
        ] {
            m.insert(name.into(), half.iter().sum::<f64>() / count);
        }
        let tokens: u64 = seqs.iter().map(|(i, _)| i.len() as u64).sum();
        Ok((out.loss, m, tokens))
    }
}
