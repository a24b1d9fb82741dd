//! The training objectives, each written once over [`TensorOps`] as TRL 0.29.1 defines it
//! (docs/TRAINING.md §2 gives the formulas and the TRL source they come from). A task hands
//! in per-token log-probabilities and masks; a loss returns the scalar to differentiate and
//! the figures TRL logs for it, by TRL's names.

use super::ops::TensorOps;
use std::collections::BTreeMap;

/// A loss and the figures logged with it.
pub struct LossOutput<T> {
    /// The scalar to differentiate.
    pub loss: T,
    /// Figures by TRL's names (`rewards/chosen`, `mean_token_accuracy`, …), summed over the
    /// examples where TRL averages per example; see each loss.
    pub metrics: BTreeMap<String, f64>,
}

/// The per-token inputs of a batch of sequences, shifted for next-token prediction:
/// position `t` holds the log-probability of token `t + 1`.
pub struct TokenInputs<T> {
    /// `log p(token)` `[batch, tokens]`.
    pub logps: T,
    /// 1 where the token counts (completion / assistant / every labelled token), else 0.
    pub mask: T,
    /// The mask's values on the host (lengths and counts without a device round trip).
    pub mask_host: Vec<Vec<f32>>,
}

/// Supervised fine-tuning: the summed negative log-likelihood of the masked tokens over
/// `num_items`, the masked-token count of the whole optimisation step (every micro-batch of a
/// gradient accumulation), which makes the step's loss TRL's token mean
/// (transformers' `ForCausalLMLoss` with `num_items_in_batch`).
pub fn sft<O: TensorOps>(
    ops: &O,
    inputs: &TokenInputs<O::T>,
    num_items: f64,
) -> Result<O::T, O::Error> {
    let nll = ops.sum_all(&ops.mul(&inputs.logps, &inputs.mask)?)?;
    ops.affine(&nll, -1.0 / num_items.max(1.0), 0.0)
}

/// DPO's loss variants (TRL `DPOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLoss {
    /// `−log σ(β·Δ)` (the paper's loss; TRL's default).
    Sigmoid,
    /// `relu(1 − β·Δ)` (SLiC).
    Hinge,
    /// `(Δ̄ − 1/(2β))²` with per-token averaged log-ratios (IPO, as TRL normalises it).
    Ipo,
}

impl DpoLoss {
    /// Every accepted name.
    pub const NAMES: &'static [&'static str] = &["sigmoid", "hinge", "ipo"];

    /// The variant named `name` (TRL's spelling).
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "sigmoid" => DpoLoss::Sigmoid,
            "hinge" => DpoLoss::Hinge,
            "ipo" => DpoLoss::Ipo,
            _ => return None,
        })
    }
}

/// Summed completion log-probabilities of the policy and the reference, chosen and rejected
/// (`[pairs]` each), and the completion lengths.
pub struct PreferenceLogps<T> {
    /// Policy, chosen completions.
    pub chosen: T,
    /// Policy, rejected completions.
    pub rejected: T,
    /// Reference, chosen.
    pub ref_chosen: T,
    /// Reference, rejected.
    pub ref_rejected: T,
    /// Completion tokens of each chosen completion (IPO's normalisation; TRL counts the
    /// unshifted completion mask).
    pub chosen_len: Vec<f64>,
    /// Completion tokens of each rejected completion.
    pub rejected_len: Vec<f64>,
}

/// DPO (TRL's `DPOTrainer._compute_loss`, `f_divergence_type="reverse_kl"`): the mean over
/// pairs of the chosen loss variant of `Δ = (π_c − ref_c) − (π_r − ref_r)`. Metrics (means
/// over the pairs): `rewards/chosen` `β(π_c − ref_c)`, `rewards/rejected`,
/// `rewards/accuracies` (chosen reward > rejected reward), `rewards/margins`,
/// `logps/chosen`, `logps/rejected`.
pub fn dpo<O: TensorOps>(
    ops: &O,
    kind: DpoLoss,
    beta: f64,
    p: &PreferenceLogps<O::T>,
) -> Result<LossOutput<O::T>, O::Error> {
    let chosen_ratio = ops.sub(&p.chosen, &p.ref_chosen)?;
    let rejected_ratio = ops.sub(&p.rejected, &p.ref_rejected)?;
    let delta = ops.sub(&chosen_ratio, &rejected_ratio)?;
    let per_pair = match kind {
        DpoLoss::Sigmoid => ops.affine(
            &ops.log_sigmoid(&ops.affine(&delta, beta, 0.0)?)?,
            -1.0,
            0.0,
        )?,
        DpoLoss::Hinge => ops.relu(&ops.affine(&delta, -beta, 1.0)?)?,
        DpoLoss::Ipo => {
            let n = p.chosen_len.len();
            let len = |l: &[f64]| -> Vec<f64> { l.iter().map(|&x| x.max(1.0)).collect() };
            let c = ops.div(&chosen_ratio, &ops.tensor(&len(&p.chosen_len), &[n])?)?;
            let r = ops.div(&rejected_ratio, &ops.tensor(&len(&p.rejected_len), &[n])?)?;
            ops.sqr(&ops.affine(&ops.sub(&c, &r)?, 1.0, -1.0 / (2.0 * beta))?)?
        }
    };
    let loss = ops.mean_all(&per_pair)?;
    let rc: Vec<f64> = ops
        .to_f64(&ops.detach(&chosen_ratio))?
        .into_iter()
        .map(|v| v * beta)
        .collect();
    let rr: Vec<f64> = ops
        .to_f64(&ops.detach(&rejected_ratio))?
        .into_iter()
        .map(|v| v * beta)
        .collect();
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut metrics = BTreeMap::new();
    metrics.insert("rewards/chosen".into(), mean(&rc));
    metrics.insert("rewards/rejected".into(), mean(&rr));
    let acc: Vec<f64> = rc
        .iter()
        .zip(&rr)
        .map(|(c, r)| f64::from(u8::from(c > r)))
        .collect();
    metrics.insert("rewards/accuracies".into(), mean(&acc));
    let margins: Vec<f64> = rc.iter().zip(&rr).map(|(c, r)| c - r).collect();
    metrics.insert("rewards/margins".into(), mean(&margins));
    metrics.insert("logps/chosen".into(), mean(&ops.to_f64(&p.chosen)?));
    metrics.insert("logps/rejected".into(), mean(&ops.to_f64(&p.rejected)?));
    Ok(LossOutput { loss, metrics })
}
