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

/// SFT's DFT loss (TRL's `dft_loss`, `SFTConfig.loss_type="dft"`): each masked token's NLL
/// weighted by its own probability, outside the graph —
/// `−Σ stopgrad(p) · log p / num_items`, over the same token count as [`sft`].
pub fn sft_dft<O: TensorOps>(
    ops: &O,
    inputs: &TokenInputs<O::T>,
    num_items: f64,
) -> Result<O::T, O::Error> {
    let p = ops.exp(&ops.detach(&inputs.logps))?;
    let weighted = ops.mul(&ops.mul(&p, &inputs.logps)?, &inputs.mask)?;
    ops.affine(&ops.sum_all(&weighted)?, -1.0 / num_items.max(1.0), 0.0)
}

/// DPO's loss variants (TRL `DPOConfig.loss_type`, `DPOTrainer._compute_loss`); `Δ` is the
/// chosen minus the rejected score (the log-ratios under `f_divergence_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DpoLoss {
    /// `−log σ(β·Δ)` (the paper's loss; TRL's default).
    Sigmoid,
    /// `relu(1 − β·Δ)` (SLiC).
    Hinge,
    /// `(Δ̄ − 1/(2β))²` with per-token averaged log-ratios (IPO, as TRL normalises it).
    Ipo,
    /// EXO-pref: `σ(βΔ)(log σ(βΔ) − log(1−ε)) + σ(−βΔ)(log σ(−βΔ) − log ε)`, ε = label_smoothing.
    ExoPair,
    /// NCA: `−log σ(βc) − ½ log σ(−βc) − ½ log σ(−βr)` over the scores `c`, `r`.
    NcaPair,
    /// Robust DPO: `(−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε)`.
    Robust,
    /// BCO on pairs: `−log σ(βc) − log σ(−βr)`.
    BcoPair,
    /// SPPO (hard probabilities): `(c − 1/(2β))² + (r + 1/(2β))²`.
    SppoHard,
    /// AOT: the sorted policy log-ratios `π_c − π_r` against the sorted reference ones.
    Aot,
    /// AOT unpaired: the sorted chosen log-ratios against the sorted rejected ones.
    AotUnpaired,
    /// APO-zero: `1 − σ(β·chosen log-ratio) + σ(β·rejected log-ratio)`.
    ApoZero,
    /// APO-down: `σ(β·chosen log-ratio) + 1 − σ(βΔ)`.
    ApoDown,
    /// DiscoPOP: `−log σ(βΔ)(1 − m) + e^{−βΔ} m`, `m = σ(βΔ / τ)`.
    Discopop,
    /// The chosen completions' mean token cross-entropy (RPO's NLL term as a loss of its own).
    Sft,
}

impl DpoLoss {
    /// Every variant by TRL's name.
    pub const ALL: [(&'static str, DpoLoss); 14] = [
        ("sigmoid", DpoLoss::Sigmoid),
        ("hinge", DpoLoss::Hinge),
        ("ipo", DpoLoss::Ipo),
        ("exo_pair", DpoLoss::ExoPair),
        ("nca_pair", DpoLoss::NcaPair),
        ("robust", DpoLoss::Robust),
        ("bco_pair", DpoLoss::BcoPair),
        ("sppo_hard", DpoLoss::SppoHard),
        ("aot", DpoLoss::Aot),
        ("aot_unpaired", DpoLoss::AotUnpaired),
        ("apo_zero", DpoLoss::ApoZero),
        ("apo_down", DpoLoss::ApoDown),
        ("discopop", DpoLoss::Discopop),
        ("sft", DpoLoss::Sft),
    ];

    /// Every accepted name, comma-separated (for errors).
    pub fn names() -> String {
        Self::ALL.map(|(n, _)| n).join(", ")
    }

    /// The variant named `name` (TRL's spelling).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
    }
}

/// DPO's `f_divergence_type`: how a log-ratio `x` becomes a score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FDivergence {
    /// `x` (standard DPO; TRL's default).
    ReverseKl,
    /// `−e^{−x}`.
    ForwardKl,
    /// `log σ(x)`.
    JsDivergence,
    /// `e^{min((α−1)x, 80)} / (α − 1)`; `x` itself when α is 1.
    Alpha(f64),
}

impl FDivergence {
    /// The divergence named `name` (`alpha_divergence` with its coefficient).
    pub fn parse(name: &str, alpha: f64) -> Option<Self> {
        Some(match name {
            "reverse_kl" => FDivergence::ReverseKl,
            "forward_kl" => FDivergence::ForwardKl,
            "js_divergence" => FDivergence::JsDivergence,
            "alpha_divergence" => FDivergence::Alpha(alpha),
            _ => return None,
        })
    }
}

/// DPO's settings (TRL's `DPOConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct DpoSettings {
    /// `loss_type` with `loss_weights`: the loss is `Σ wᵢ · mean(lossᵢ)`.
    pub losses: Vec<(DpoLoss, f64)>,
    /// `beta` (0.1).
    pub beta: f64,
    /// `label_smoothing` (0): robust, exo_pair, aot.
    pub label_smoothing: f64,
    /// `f_divergence_type` (reverse_kl).
    pub divergence: FDivergence,
    /// `discopop_tau` (0.05).
    pub discopop_tau: f64,
}

impl DpoSettings {
    /// One loss variant with weight 1 and TRL's other defaults.
    pub fn single(kind: DpoLoss, beta: f64) -> Self {
        DpoSettings {
            losses: vec![(kind, 1.0)],
            beta,
            label_smoothing: 0.0,
            divergence: FDivergence::ReverseKl,
            discopop_tau: 0.05,
        }
    }
}

/// What some DPO variants need beyond the summed log-probabilities.
pub struct DpoExtras<T> {
    /// The chosen completions' mean token cross-entropy (the `sft` variant).
    pub chosen_nll: Option<T>,
    /// WPO's per-pair weights (`use_weighting`): each pair's loss is multiplied by it.
    pub pair_weights: Option<Vec<f64>>,
}

impl<T> Default for DpoExtras<T> {
    fn default() -> Self {
        DpoExtras {
            chosen_nll: None,
            pair_weights: None,
        }
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

/// DPO with one loss variant and TRL's other defaults ([`dpo_with`]).
pub fn dpo<O: TensorOps>(
    ops: &O,
    kind: DpoLoss,
    beta: f64,
    p: &PreferenceLogps<O::T>,
) -> Result<LossOutput<O::T>, O::Error> {
    dpo_with(
        ops,
        &DpoSettings::single(kind, beta),
        p,
        &DpoExtras::default(),
    )
}

/// `σ(a)` as `exp(log σ(a))`.
fn sigmoid<O: TensorOps>(ops: &O, a: &O::T) -> Result<O::T, O::Error> {
    ops.exp(&ops.log_sigmoid(a)?)
}

/// The values of `a` (`[n]`) in ascending order, keeping the graph: each element taken by
/// position from the order of its detached values (torch's sort; ties keep their order).
fn sorted<O: TensorOps>(ops: &O, a: &O::T) -> Result<Vec<O::T>, O::Error> {
    let v = ops.to_f64(&ops.detach(a))?;
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&i, &j| v[i].total_cmp(&v[j]));
    order.into_iter().map(|i| ops.narrow(a, 0, i, 1)).collect()
}

/// The mean over pairs of `f(Δᵢ)` for AOT's sorted differences `Δᵢ = aᵢ − bᵢ`, each `[1]`.
fn aot_mean<O: TensorOps>(
    ops: &O,
    a: &[O::T],
    b: &[O::T],
    beta: f64,
    eps: f64,
    weights: Option<&[f64]>,
) -> Result<O::T, O::Error> {
    let mut total: Option<O::T> = None;
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let z = ops.affine(&ops.sub(x, y)?, beta, 0.0)?;
        let pos = ops.affine(&ops.log_sigmoid(&z)?, -(1.0 - eps), 0.0)?;
        let neg = ops.affine(&ops.log_sigmoid(&ops.affine(&z, -1.0, 0.0)?)?, -eps, 0.0)?;
        let mut term = ops.add(&pos, &neg)?;
        if let Some(w) = weights {
            term = ops.affine(&term, w[i], 0.0)?;
        }
        total = Some(match total {
            Some(t) => ops.add(&t, &term)?,
            None => term,
        });
    }
    let n = a.len().max(1) as f64;
    match total {
        Some(t) => ops.affine(&ops.sum_all(&t)?, 1.0 / n, 0.0),
        None => ops.tensor(&[0.0], &[]),
    }
}

/// DPO (TRL's `DPOTrainer._compute_loss`): `Σ wᵢ · mean over pairs of lossᵢ`, each variant of
/// the scores `c = f(π_c − ref_c)`, `r = f(π_r − ref_r)` and `Δ = c − r` (see [`DpoLoss`];
/// `f` is the `f_divergence_type`). Metrics (means over the pairs; rewards from the plain
/// log-ratios whatever the divergence): `rewards/chosen` `β(π_c − ref_c)`,
/// `rewards/rejected`, `rewards/accuracies` (chosen reward > rejected reward),
/// `rewards/margins`, `logps/chosen`, `logps/rejected`.
///
/// Long on purpose: TRL's `dpo_loss`, every loss type an arm in TRL's order, so each arm compares
/// with TRL's source.
pub fn dpo_with<O: TensorOps>(
    ops: &O,
    s: &DpoSettings,
    p: &PreferenceLogps<O::T>,
    extras: &DpoExtras<O::T>,
) -> Result<LossOutput<O::T>, O::Error> {
    let beta = s.beta;
    let eps = s.label_smoothing;
    let n = p.chosen_len.len();
    let chosen_ratio = ops.sub(&p.chosen, &p.ref_chosen)?;
    let rejected_ratio = ops.sub(&p.rejected, &p.ref_rejected)?;
    let score = |x: &O::T| -> Result<O::T, O::Error> {
        match s.divergence {
            FDivergence::ReverseKl => Ok(x.clone()),
            FDivergence::ForwardKl => ops.affine(&ops.exp(&ops.affine(x, -1.0, 0.0)?)?, -1.0, 0.0),
            FDivergence::JsDivergence => ops.log_sigmoid(x),
            FDivergence::Alpha(a) if (a - 1.0).abs() < 1e-6 => Ok(x.clone()),
            FDivergence::Alpha(a) => {
                let t = ops.clamp(&ops.affine(x, a - 1.0, 0.0)?, f64::NEG_INFINITY, 80.0)?;
                ops.affine(&ops.exp(&t)?, 1.0 / (a - 1.0), 0.0)
            }
        }
    };
    let c = score(&chosen_ratio)?;
    let r = score(&rejected_ratio)?;
    let delta = ops.sub(&c, &r)?;
    let bd = ops.affine(&delta, beta, 0.0)?;
    let neg = |t: &O::T| ops.affine(t, -1.0, 0.0);
    let weights = match &extras.pair_weights {
        Some(w) => Some(ops.tensor(w, &[n])?),
        None => None,
    };
    let mut loss: Option<O::T> = None;
    for &(kind, weight) in &s.losses {
        let per_pair = match kind {
            DpoLoss::Sigmoid => neg(&ops.log_sigmoid(&bd)?)?,
            DpoLoss::Hinge => ops.relu(&ops.affine(&delta, -beta, 1.0)?)?,
            DpoLoss::Ipo => {
                let len = |l: &[f64]| -> Vec<f64> { l.iter().map(|&x| x.max(1.0)).collect() };
                let ca = ops.div(&c, &ops.tensor(&len(&p.chosen_len), &[n])?)?;
                let ra = ops.div(&r, &ops.tensor(&len(&p.rejected_len), &[n])?)?;
                ops.sqr(&ops.affine(&ops.sub(&ca, &ra)?, 1.0, -1.0 / (2.0 * beta))?)?
            }
            DpoLoss::ExoPair => {
                let log_qw = ops.log_sigmoid(&bd)?;
                let log_ql = ops.log_sigmoid(&neg(&bd)?)?;
                let w = ops.mul(
                    &ops.exp(&log_qw)?,
                    &ops.affine(&log_qw, 1.0, -(-eps).ln_1p())?,
                )?;
                let l = ops.mul(&ops.exp(&log_ql)?, &ops.affine(&log_ql, 1.0, -eps.ln())?)?;
                ops.add(&w, &l)?
            }
            DpoLoss::NcaPair => {
                let bc = ops.affine(&c, beta, 0.0)?;
                let br = ops.affine(&r, beta, 0.0)?;
                let a = neg(&ops.log_sigmoid(&bc)?)?;
                let b = ops.affine(&ops.log_sigmoid(&neg(&bc)?)?, -0.5, 0.0)?;
                let d = ops.affine(&ops.log_sigmoid(&neg(&br)?)?, -0.5, 0.0)?;
                ops.add(&ops.add(&a, &b)?, &d)?
            }
            DpoLoss::Robust => {
                let clean = ops.affine(&ops.log_sigmoid(&bd)?, -(1.0 - eps), 0.0)?;
                let flipped = ops.affine(&ops.log_sigmoid(&neg(&bd)?)?, -eps, 0.0)?;
                ops.affine(&ops.sub(&clean, &flipped)?, 1.0 / (1.0 - 2.0 * eps), 0.0)?
            }
            DpoLoss::BcoPair => {
                let a = neg(&ops.log_sigmoid(&ops.affine(&c, beta, 0.0)?)?)?;
                let b = neg(&ops.log_sigmoid(&ops.affine(&r, -beta, 0.0)?)?)?;
                ops.add(&a, &b)?
            }
            DpoLoss::SppoHard => {
                let w = ops.sqr(&ops.affine(&c, 1.0, -0.5 / beta)?)?;
                let l = ops.sqr(&ops.affine(&r, 1.0, 0.5 / beta)?)?;
                ops.add(&w, &l)?
            }
            DpoLoss::Aot | DpoLoss::AotUnpaired => {
                let (a, b) = if kind == DpoLoss::Aot {
                    (
                        ops.sub(&p.chosen, &p.rejected)?,
                        ops.sub(&p.ref_chosen, &p.ref_rejected)?,
                    )
                } else {
                    (chosen_ratio.clone(), rejected_ratio.clone())
                };
                // Sorting pairs the i-th smallest of each: the mean is taken here, so the
                // weights (refused with AOT, as TRL refuses them) never apply.
                let term = aot_mean(ops, &sorted(ops, &a)?, &sorted(ops, &b)?, beta, eps, None)?;
                let weighted = ops.affine(&term, weight, 0.0)?;
                loss = Some(match loss {
                    Some(l) => ops.add(&l, &weighted)?,
                    None => weighted,
                });
                continue;
            }
            DpoLoss::ApoZero => {
                let w = ops.affine(
                    &sigmoid(ops, &ops.affine(&chosen_ratio, beta, 0.0)?)?,
                    -1.0,
                    1.0,
                )?;
                let l = sigmoid(ops, &ops.affine(&rejected_ratio, beta, 0.0)?)?;
                ops.add(&w, &l)?
            }
            DpoLoss::ApoDown => {
                let w = sigmoid(ops, &ops.affine(&chosen_ratio, beta, 0.0)?)?;
                let l = ops.affine(&sigmoid(ops, &bd)?, -1.0, 1.0)?;
                ops.add(&w, &l)?
            }
            DpoLoss::Discopop => {
                let m = sigmoid(ops, &ops.affine(&bd, 1.0 / s.discopop_tau, 0.0)?)?;
                let logistic = neg(&ops.log_sigmoid(&bd)?)?;
                let expo = ops.exp(&neg(&bd)?)?;
                let keep = ops.mul(&logistic, &ops.affine(&m, -1.0, 1.0)?)?;
                ops.add(&keep, &ops.mul(&expo, &m)?)?
            }
            DpoLoss::Sft => {
                let nll = extras
                    .chosen_nll
                    .clone()
                    .expect("the task computes the chosen NLL for loss_type sft");
                // TRL expands the scalar to every pair (its mean is itself unless the pairs
                // are weighted).
                ops.mul(&ops.tensor(&vec![1.0; n], &[n])?, &nll)?
            }
        };
        let per_pair = match &weights {
            Some(w) => ops.mul(&per_pair, w)?,
            None => per_pair,
        };
        let term = ops.affine(&ops.mean_all(&per_pair)?, weight, 0.0)?;
        loss = Some(match loss {
            Some(l) => ops.add(&l, &term)?,
            None => term,
        });
    }
    let loss = match loss {
        Some(l) => l,
        None => ops.tensor(&[0.0], &[])?,
    };
    let scaled = |t: &O::T| -> Result<Vec<f64>, O::Error> {
        Ok(ops
            .to_f64(&ops.detach(t))?
            .into_iter()
            .map(|v| v * beta)
            .collect())
    };
    let metrics = reward_metrics(
        &scaled(&chosen_ratio)?,
        &scaled(&rejected_ratio)?,
        &ops.to_f64(&p.chosen)?,
        &ops.to_f64(&p.rejected)?,
    );
    Ok(LossOutput { loss, metrics })
}

/// Per-pair figures every preference loss logs (TRL's names; means over the pairs):
/// `rewards/chosen`, `rewards/rejected` (the rewards given), `rewards/accuracies`,
/// `rewards/margins`, `logps/chosen`, `logps/rejected`.
fn reward_metrics(
    chosen_rewards: &[f64],
    rejected_rewards: &[f64],
    chosen_logps: &[f64],
    rejected_logps: &[f64],
) -> BTreeMap<String, f64> {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let acc: Vec<f64> = chosen_rewards
        .iter()
        .zip(rejected_rewards)
        .map(|(c, r)| f64::from(u8::from(c > r)))
        .collect();
    let margins: Vec<f64> = chosen_rewards
        .iter()
        .zip(rejected_rewards)
        .map(|(c, r)| c - r)
        .collect();
    BTreeMap::from([
        ("rewards/chosen".to_string(), mean(chosen_rewards)),
        ("rewards/rejected".to_string(), mean(rejected_rewards)),
        ("rewards/accuracies".to_string(), mean(&acc)),
        ("rewards/margins".to_string(), mean(&margins)),
        ("logps/chosen".to_string(), mean(chosen_logps)),
        ("logps/rejected".to_string(), mean(rejected_logps)),
    ])
}

/// ORPO (TRL's `ORPOTrainer`): `nll − mean(β · log σ(log_odds))` with
/// `log_odds = (c − r) − (log(1 − eᶜ) − log(1 − eʳ))` over the average completion
/// log-probabilities `c`, `r`, and `nll` the chosen sequences' mean cross-entropy (prompt
/// included). Also logs `nll_loss`, `log_odds_ratio` (mean `log σ(log_odds)`) and
/// `log_odds_chosen` (mean `log_odds`); rewards are `β·c`, `β·r`.
pub fn orpo<O: TensorOps>(
    ops: &O,
    beta: f64,
    chosen_avg: &O::T,
    rejected_avg: &O::T,
    nll: &O::T,
) -> Result<LossOutput<O::T>, O::Error> {
    let log_odds = ops.sub(
        &ops.sub(chosen_avg, rejected_avg)?,
        &ops.sub(&ops.log1mexp(chosen_avg)?, &ops.log1mexp(rejected_avg)?)?,
    )?;
    let ratio = ops.log_sigmoid(&log_odds)?;
    let loss = ops.sub(nll, &ops.mean_all(&ops.affine(&ratio, beta, 0.0)?)?)?;
    let c = ops.to_f64(&ops.detach(chosen_avg))?;
    let r = ops.to_f64(&ops.detach(rejected_avg))?;
    let scaled = |v: &[f64]| -> Vec<f64> { v.iter().map(|x| x * beta).collect() };
    let mut metrics = reward_metrics(&scaled(&c), &scaled(&r), &c, &r);
    let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
    metrics.insert("nll_loss".into(), ops.to_f64(&ops.detach(nll))?[0]);
    metrics.insert(
        "log_odds_ratio".into(),
        mean(ops.to_f64(&ops.detach(&ratio))?),
    );
    metrics.insert(
        "log_odds_chosen".into(),
        mean(ops.to_f64(&ops.detach(&log_odds))?),
    );
    Ok(LossOutput { loss, metrics })
}

/// CPO's loss variants (TRL's `CPOConfig.loss_type`); `simpo` is kiln's `simpo` task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpoLoss {
    /// `−log σ(β·Δ)` with label smoothing.
    Sigmoid,
    /// `relu(1 − β·Δ)`.
    Hinge,
    /// `(Δ − 1/(2β))²` over average log-probabilities.
    Ipo,
    /// SimPO: the sigmoid loss of `Δ − γ/β` over average log-probabilities.
    Simpo,
}

impl CpoLoss {
    /// Every accepted name.
    pub const NAMES: &'static [&'static str] = &["sigmoid", "hinge", "ipo", "simpo"];

    /// The variant named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "sigmoid" => CpoLoss::Sigmoid,
            "hinge" => CpoLoss::Hinge,
            "ipo" => CpoLoss::Ipo,
            "simpo" => CpoLoss::Simpo,
            _ => return None,
        })
    }

    /// Whether the sequence log-probabilities are per-token averages (else sums).
    pub fn averages(self) -> bool {
        matches!(self, CpoLoss::Ipo | CpoLoss::Simpo)
    }
}

/// CPO's settings (TRL's `CPOConfig`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CpoSettings {
    /// The variant.
    pub kind: CpoLoss,
    /// β.
    pub beta: f64,
    /// SimPO's target margin γ.
    pub simpo_gamma: f64,
    /// The weight of the chosen NLL term.
    pub cpo_alpha: f64,
    /// Label smoothing of the sigmoid losses.
    pub label_smoothing: f64,
}

/// CPO / SimPO (TRL's `CPOTrainer.cpo_loss`, `alpha = 0`): `mean(loss(Δ)) + cpo_alpha · nll`
/// with `Δ = c − r` (minus `γ/β` for SimPO) over the policy's completion log-probabilities and
/// `nll` the chosen completions' mean cross-entropy. Also logs `nll_loss`; rewards `β·c`, `β·r`.
pub fn cpo<O: TensorOps>(
    ops: &O,
    s: CpoSettings,
    chosen: &O::T,
    rejected: &O::T,
    nll: &O::T,
) -> Result<LossOutput<O::T>, O::Error> {
    let mut delta = ops.sub(chosen, rejected)?;
    if s.kind == CpoLoss::Simpo {
        delta = ops.affine(&delta, 1.0, -s.simpo_gamma / s.beta)?;
    }
    let per_pair = match s.kind {
        CpoLoss::Sigmoid | CpoLoss::Simpo => {
            let pos = ops.log_sigmoid(&ops.affine(&delta, s.beta, 0.0)?)?;
            let neg = ops.log_sigmoid(&ops.affine(&delta, -s.beta, 0.0)?)?;
            ops.add(
                &ops.affine(&pos, -(1.0 - s.label_smoothing), 0.0)?,
                &ops.affine(&neg, -s.label_smoothing, 0.0)?,
            )?
        }
        CpoLoss::Hinge => ops.relu(&ops.affine(&delta, -s.beta, 1.0)?)?,
        CpoLoss::Ipo => ops.sqr(&ops.affine(&delta, 1.0, -1.0 / (2.0 * s.beta))?)?,
    };
    let loss = ops.add(
        &ops.mean_all(&per_pair)?,
        &ops.affine(nll, s.cpo_alpha, 0.0)?,
    )?;
    let c = ops.to_f64(&ops.detach(chosen))?;
    let r = ops.to_f64(&ops.detach(rejected))?;
    let scaled = |v: &[f64]| -> Vec<f64> { v.iter().map(|x| x * s.beta).collect() };
    let mut metrics = reward_metrics(&scaled(&c), &scaled(&r), &c, &r);
    metrics.insert("nll_loss".into(), ops.to_f64(&ops.detach(nll))?[0]);
    Ok(LossOutput { loss, metrics })
}

/// KTO's loss variants (TRL's `KTOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KtoLoss {
    /// The paper's loss, with the KL reference point.
    Kto,
    /// APO-zero, unpaired (no KL term).
    ApoZeroUnpaired,
    /// BCO (TRL's `BCOTrainer`, task `bco`): binary classification of the implicit rewards
    /// around their running mean ([`bco`]).
    Bco,
}

impl KtoLoss {
    /// Every accepted name.
    pub const NAMES: &'static [&'static str] = &["kto", "apo_zero_unpaired"];

    /// The variant named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "kto" => KtoLoss::Kto,
            "apo_zero_unpaired" => KtoLoss::ApoZeroUnpaired,
            _ => return None,
        })
    }
}

/// BCO's running moments of the implicit rewards (TRL's `RunningMoments`): the reward shift
/// `δ` is their mean over every training micro-batch so far.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunningMoments {
    /// The running mean (`δ`).
    pub mean: f64,
    /// The running (population) variance.
    pub var: f64,
    /// Values seen (starts at 1e-24, as TRL's).
    pub count: f64,
}

impl Default for RunningMoments {
    fn default() -> Self {
        RunningMoments {
            mean: 0.0,
            var: 1.0,
            count: 1e-24,
        }
    }
}

impl RunningMoments {
    /// Folds the batch `xs` in (Chan et al.'s parallel update, as TRL's `update`).
    pub fn update(&mut self, xs: &[f64]) {
        let n = xs.len() as f64;
        if xs.is_empty() {
            return;
        }
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        let delta = mean - self.mean;
        let total = self.count + n;
        let old_sum = self.var * self.count + delta * delta * self.count * n / total;
        self.mean += delta * n / total;
        self.var = (old_sum + var * n) / total;
        self.count = total;
    }
}

/// BCO (TRL's `BCOTrainer.bco_loss`, without the underlying-distribution matching): rewards
/// `r = β·logratio`; `running` folds in this micro-batch's rewards first (training only), then
/// `δ` = its mean; per example `−log σ(r − δ)` for desirable and `−log σ(−(r − δ))` for
/// undesirable completions, averaged. Logs `delta` and the per-side sums TRL averages at
/// logging time (as [`kto`]).
pub fn bco<O: TensorOps>(
    ops: &O,
    beta: f64,
    logratios: &O::T,
    logps: &O::T,
    labels: &[bool],
    running: &mut RunningMoments,
    train: bool,
) -> Result<LossOutput<O::T>, O::Error> {
    let n = labels.len();
    let rho = ops.to_f64(&ops.detach(logratios))?;
    let rewards: Vec<f64> = rho.iter().map(|r| beta * r).collect();
    if train {
        // TRL concatenates the chosen rewards, then the rejected: the same moments.
        running.update(&rewards);
    }
    let delta = running.mean;
    let sign: Vec<f64> = labels.iter().map(|&l| if l { 1.0 } else { -1.0 }).collect();
    let shifted = ops.affine(logratios, beta, -delta)?;
    let signed = ops.mul(&shifted, &ops.tensor(&sign, &[n])?)?;
    let loss = ops.affine(&ops.mean_all(&ops.log_sigmoid(&signed)?)?, -1.0, 0.0)?;
    let lp = ops.to_f64(&ops.detach(logps))?;
    let mut metrics = BTreeMap::from([("delta".to_string(), delta)]);
    for (side, want) in [("chosen", true), ("rejected", false)] {
        let rows: Vec<usize> = (0..n).filter(|&i| labels[i] == want).collect();
        if rows.is_empty() {
            continue;
        }
        metrics.insert(
            format!("rewards/{side}_sum"),
            rows.iter().map(|&i| rewards[i]).sum(),
        );
        metrics.insert(
            format!("logps/{side}_sum"),
            rows.iter().map(|&i| lp[i]).sum(),
        );
        metrics.insert(format!("count/{side}"), rows.len() as f64);
    }
    Ok(LossOutput { loss, metrics })
}

/// GKD's generalized Jensen–Shannon divergence (TRL's `GKDTrainer.generalized_jsd_loss`, as
/// its `compute_loss` calls it: temperature 1) between the student's and the teacher's
/// next-token distributions, summed over the vocabulary and averaged over the `count` masked
/// positions: with `M = log((1 − β)·p_s + β·p_t)`, `β·KL(p_t ‖ M) + (1 − β)·KL(p_s ‖ M)`;
/// β = 0 is `KL(p_t ‖ p_s)` and β = 1 `KL(p_s ‖ p_t)`. `student` and `teacher` are logits
/// `[batch, tokens, vocab]` (the teacher's outside the graph), `mask` `[batch, tokens]`.
pub fn generalized_jsd<O: TensorOps>(
    ops: &O,
    student: &O::T,
    teacher: &O::T,
    mask: &O::T,
    count: f64,
    beta: f64,
) -> Result<O::T, O::Error> {
    let s = ops.log_softmax(student)?;
    let t = ops.detach(&ops.log_softmax(teacher)?);
    // `F.kl_div(input, target, log_target=True)`: e^target · (target − input).
    let kl = |target: &O::T, input: &O::T| -> Result<O::T, O::Error> {
        ops.mul(&ops.exp(target)?, &ops.sub(target, input)?)
    };
    let per_vocab = if beta == 0.0 {
        kl(&t, &s)?
    } else if beta == 1.0 {
        kl(&s, &t)?
    } else {
        // The mixture's log, as torch.logsumexp computes it (shifted by the larger, which is
        // outside the graph: the value and gradient do not depend on the shift).
        let a = ops.affine(&s, 1.0, (1.0 - beta).ln())?;
        let b = ops.affine(&t, 1.0, beta.ln())?;
        let neg_max = ops.minimum(&ops.affine(&a, -1.0, 0.0)?, &ops.affine(&b, -1.0, 0.0)?)?;
        let max = ops.detach(&ops.affine(&neg_max, -1.0, 0.0)?);
        let sum = ops.add(
            &ops.exp(&ops.sub(&a, &max)?)?,
            &ops.exp(&ops.sub(&b, &max)?)?,
        )?;
        let m = ops.add(&max, &ops.log(&sum)?)?;
        ops.add(
            &ops.affine(&kl(&t, &m)?, beta, 0.0)?,
            &ops.affine(&kl(&s, &m)?, 1.0 - beta, 0.0)?,
        )?
    };
    let per_token = ops.sum_last(&per_vocab)?;
    ops.affine(
        &ops.sum_all(&ops.mul(&per_token, mask)?)?,
        1.0 / count.max(1.0),
        0.0,
    )
}

/// A reward model's Bradley–Terry loss (TRL's `RewardTrainer.compute_loss`):
/// `mean(−log σ(r_c − r_r − margin))`, plus `center · mean((r_c + r_r)²)` with
/// `center_rewards_coefficient`. `rewards` are `[2n]`: the `n` chosen sequences' scores, then
/// the `n` rejected ones'. Logs `min_reward`, `mean_reward`, `max_reward` (over all `2n`),
/// `accuracy` (the fraction with `r_c > r_r`) and `margin` (the mean `r_c − r_r`, without the
/// data's margins), as TRL does.
pub fn reward<O: TensorOps>(
    ops: &O,
    rewards: &O::T,
    margins: Option<&[f64]>,
    center: Option<f64>,
) -> Result<LossOutput<O::T>, O::Error> {
    let (chosen, rejected) = ops.halves(rewards)?;
    let mut diff = ops.sub(&chosen, &rejected)?;
    if let Some(m) = margins {
        diff = ops.sub(&diff, &ops.tensor(m, &[m.len()])?)?;
    }
    let mut loss = ops.affine(&ops.mean_all(&ops.log_sigmoid(&diff)?)?, -1.0, 0.0)?;
    if let Some(c) = center {
        let sum = ops.sqr(&ops.add(&chosen, &rejected)?)?;
        loss = ops.add(&loss, &ops.affine(&ops.mean_all(&sum)?, c, 0.0)?)?;
    }
    let all = ops.to_f64(&ops.detach(rewards))?;
    let n = all.len() / 2;
    let (c, r) = all.split_at(n);
    let total = all.len().max(1) as f64;
    let pairs = n.max(1) as f64;
    let metrics = BTreeMap::from([
        (
            "min_reward".to_string(),
            all.iter().copied().fold(f64::INFINITY, f64::min),
        ),
        ("mean_reward".to_string(), all.iter().sum::<f64>() / total),
        (
            "max_reward".to_string(),
            all.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ),
        (
            "accuracy".to_string(),
            c.iter().zip(r).filter(|(a, b)| a > b).count() as f64 / pairs,
        ),
        (
            "margin".to_string(),
            c.iter().zip(r).map(|(a, b)| a - b).sum::<f64>() / pairs,
        ),
    ]);
    Ok(LossOutput { loss, metrics })
}

/// KTO (TRL's `KTOTrainer.kto_loss`): per example `w · (1 − σ(β(ρ − z)))` for desirable
/// completions and `w · (1 − σ(β(z − ρ)))` for undesirable ones, with `ρ` the policy/reference
/// log-ratio and `z = max(0, kl)` the detached KL estimate (APO-zero: `z = 0` and
/// `σ(βρ)` for undesirable ones), averaged over the batch. `weights` are
/// `desirable_weight` / `undesirable_weight`. Logs `kl` and, per side present, the sums TRL
/// averages at logging time (`rewards/chosen_sum`, `count/chosen`, …; `logps/*_sum` from
/// `logps`).
#[allow(clippy::too_many_arguments)]
pub fn kto<O: TensorOps>(
    ops: &O,
    kind: KtoLoss,
    beta: f64,
    logratios: &O::T,
    logps: &O::T,
    labels: &[bool],
    kl: f64,
    weights: (f64, f64),
) -> Result<LossOutput<O::T>, O::Error> {
    let n = labels.len();
    let z = match kind {
        KtoLoss::Kto => kl.max(0.0),
        KtoLoss::ApoZeroUnpaired | KtoLoss::Bco => 0.0,
    };
    // 1 − σ(β(ρ − z)) = σ(−β(ρ − z)); 1 − σ(β(z − ρ)) = σ(β(ρ − z)): one sign per row.
    let sign: Vec<f64> = labels.iter().map(|&l| if l { -1.0 } else { 1.0 }).collect();
    let w: Vec<f64> = labels
        .iter()
        .map(|&l| if l { weights.0 } else { weights.1 })
        .collect();
    let shifted = ops.affine(logratios, beta, -beta * z)?;
    let signed = ops.mul(&shifted, &ops.tensor(&sign, &[n])?)?;
    let per = ops.mul(
        &ops.exp(&ops.log_sigmoid(&signed)?)?,
        &ops.tensor(&w, &[n])?,
    )?;
    let loss = ops.mean_all(&per)?;
    let rho = ops.to_f64(&ops.detach(logratios))?;
    let lp = ops.to_f64(&ops.detach(logps))?;
    let mut metrics = BTreeMap::from([("kl".to_string(), kl.max(0.0))]);
    for (side, want) in [("chosen", true), ("rejected", false)] {
        let rows: Vec<usize> = (0..n).filter(|&i| labels[i] == want).collect();
        if rows.is_empty() {
            continue;
        }
        metrics.insert(
            format!("rewards/{side}_sum"),
            rows.iter().map(|&i| beta * rho[i]).sum(),
        );
        metrics.insert(
            format!("logps/{side}_sum"),
            rows.iter().map(|&i| lp[i]).sum(),
        );
        metrics.insert(format!("count/{side}"), rows.len() as f64);
    }
    Ok(LossOutput { loss, metrics })
}

/// TRL's KTO logging: `rewards/*`, `logps/*`, `logits/*` as the window's sums over its counts,
/// `rewards/margins` when both sides were seen, and every other figure averaged. `window`
/// holds each figure's total and how many micro-batches reported it.
pub fn kto_window(window: &BTreeMap<String, (f64, usize)>) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    let mut consumed = std::collections::BTreeSet::new();
    for side in ["chosen", "rejected"] {
        let Some(&(count, _)) = window.get(&format!("count/{side}")) else {
            continue;
        };
        consumed.insert(format!("count/{side}"));
        for metric in ["rewards", "logps", "logits"] {
            let key = format!("{metric}/{side}_sum");
            if let Some(&(sum, _)) = window.get(&key) {
                out.insert(format!("{metric}/{side}"), sum / count);
                consumed.insert(key);
            }
        }
    }
    if let (Some(c), Some(r)) = (out.get("rewards/chosen"), out.get("rewards/rejected")) {
        out.insert("rewards/margins".into(), c - r);
    }
    for (k, (sum, n)) in window {
        if !consumed.contains(k) {
            out.insert(k.clone(), sum / *n as f64);
        }
    }
    out
}

/// How GRPO's per-token losses become one loss (TRL's `GRPOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpoLoss {
    /// The sum over every completion token of the whole generation batch, over its count.
    Dapo,
    /// Each sequence's token mean, averaged over sequences.
    Grpo,
    /// The micro-batch's token mean.
    Bnpo,
    /// The sum over `batch × max_completion_length`.
    DrGrpo,
}

impl GrpoLoss {
    /// Every accepted name.
    pub const NAMES: &'static [&'static str] = &["dapo", "grpo", "bnpo", "dr_grpo"];

    /// The variant named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "dapo" => GrpoLoss::Dapo,
            "grpo" => GrpoLoss::Grpo,
            "bnpo" => GrpoLoss::Bnpo,
            "dr_grpo" => GrpoLoss::DrGrpo,
            _ => return None,
        })
    }
}

/// GRPO's settings (TRL's `GRPOConfig`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoSettings {
    /// The aggregation.
    pub kind: GrpoLoss,
    /// Lower clip: the ratio is kept above `1 − epsilon`.
    pub epsilon: f64,
    /// Upper clip: below `1 + epsilon_high`.
    pub epsilon_high: f64,
    /// Two-sided clipping's upper bound on the unclipped ratio, when set.
    pub delta: Option<f64>,
    /// The weight of the k3 KL to the reference (0: none, TRL's default).
    pub beta: f64,
    /// `max_completion_length` (`dr_grpo`'s normaliser).
    pub max_completion_length: usize,
    /// Completion tokens in the whole generation batch (`dapo`'s normaliser).
    pub num_items: f64,
}

/// The inputs of one GRPO micro-batch: per-token log-probabilities of the completions under
/// the policy (and, when β > 0, the reference), the completion mask and each row's
/// advantage.
pub struct GrpoInputs<'a, T> {
    /// `log π(token)` `[rows, tokens]` (temperature-scaled logits, as TRL).
    pub logps: &'a T,
    /// The log-probs the completions were sampled with (`None`: the policy's own, detached —
    /// one optimisation pass per generation).
    pub old_logps: Option<&'a T>,
    /// The reference's log-probs, needed when β > 0.
    pub ref_logps: Option<&'a T>,
    /// Completion mask `[rows, tokens]`.
    pub mask: &'a T,
    /// The mask on the host.
    pub mask_host: &'a [Vec<f32>],
    /// Each row's advantage.
    pub advantages: &'a [f64],
}

/// GRPO (TRL's `GRPOTrainer._compute_loss`, token-level importance sampling): per token
/// `−min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A) + β·(e^{r−p} − (r − p) − 1)` with
/// `ρ = e^{p − p_old}`, aggregated as `settings.kind` says (the division by the number of
/// micro-batches, for every kind but `dapo`, is the training loop's). Logs `kl` (β > 0),
/// `clip_ratio/low_mean`, `clip_ratio/low_min`, `clip_ratio/high_mean`,
/// `clip_ratio/high_max`, `clip_ratio/region_mean`.
pub fn grpo<O: TensorOps>(
    ops: &O,
    s: GrpoSettings,
    x: &GrpoInputs<'_, O::T>,
) -> Result<LossOutput<O::T>, O::Error> {
    let rows = x.advantages.len();
    let old = match x.old_logps {
        Some(o) => o.clone(),
        None => ops.detach(x.logps),
    };
    let coef1 = ops.exp(&ops.sub(x.logps, &old)?)?;
    let coef2 = ops.clamp(&coef1, 1.0 - s.epsilon, 1.0 + s.epsilon_high)?;
    let coef1_used = match s.delta {
        Some(d) => ops.clamp(&coef1, f64::MIN, d)?,
        None => coef1.clone(),
    };
    let adv = ops.tensor(x.advantages, &[rows, 1])?;
    let l1 = ops.mul(&coef1_used, &adv)?;
    let l2 = ops.mul(&coef2, &adv)?;
    let mut per_token = ops.affine(&ops.minimum(&l1, &l2)?, -1.0, 0.0)?;
    let mut kl_tokens = None;
    if s.beta != 0.0 {
        let r = x.ref_logps.expect("reference log-probs when beta > 0");
        let d = ops.sub(r, x.logps)?;
        let kl = ops.affine(&ops.sub(&ops.exp(&d)?, &d)?, 1.0, -1.0)?;
        per_token = ops.add(&per_token, &ops.affine(&kl, s.beta, 0.0)?)?;
        kl_tokens = Some(kl);
    }
    let masked = ops.mul(&per_token, x.mask)?;
    let counts: Vec<f64> = x
        .mask_host
        .iter()
        .map(|r| r.iter().map(|&m| f64::from(m)).sum())
        .collect();
    let total: f64 = counts.iter().sum();
    let loss = match s.kind {
        GrpoLoss::Grpo => {
            let per_row = ops.div(
                &ops.sum_last(&masked)?,
                &ops.tensor(
                    &counts.iter().map(|c| c.max(1.0)).collect::<Vec<_>>(),
                    &[rows],
                )?,
            )?;
            ops.mean_all(&per_row)?
        }
        GrpoLoss::Bnpo => ops.affine(&ops.sum_all(&masked)?, 1.0 / total.max(1.0), 0.0)?,
        GrpoLoss::DrGrpo => ops.affine(
            &ops.sum_all(&masked)?,
            1.0 / (rows * s.max_completion_length) as f64,
            0.0,
        )?,
        GrpoLoss::Dapo => ops.affine(&ops.sum_all(&masked)?, 1.0 / s.num_items, 0.0)?,
    };
    // Clipping figures, as TRL computes them (masked token means over the micro-batch).
    let c1 = ops.to_f64(&ops.detach(&coef1))?;
    let width = x.mask_host.first().map_or(0, Vec::len);
    let (mut low, mut high, mut region) = (0f64, 0f64, 0f64);
    for r in 0..rows {
        let a = x.advantages[r];
        for t in 0..width {
            let m = f64::from(x.mask_host[r][t]);
            let c = c1[r * width + t];
            let is_low = c < 1.0 - s.epsilon && a < 0.0;
            let is_high = c > 1.0 + s.epsilon_high && a > 0.0;
            low += m * f64::from(u8::from(is_low));
            high += m * f64::from(u8::from(is_high));
            region += m * f64::from(u8::from(is_low || is_high));
        }
    }
    let n = total.max(1.0);
    let mut metrics = BTreeMap::from([
        ("clip_ratio/low_mean".to_string(), low / n),
        ("clip_ratio/low_min".to_string(), low / n),
        ("clip_ratio/high_mean".to_string(), high / n),
        ("clip_ratio/high_max".to_string(), high / n),
        ("clip_ratio/region_mean".to_string(), region / n),
    ]);
    if let Some(kl) = kl_tokens {
        let v = ops.to_f64(&ops.detach(&kl))?;
        let sum: f64 = x
            .mask_host
            .iter()
            .flatten()
            .zip(&v)
            .map(|(m, k)| f64::from(*m) * k)
            .sum();
        metrics.insert("kl".into(), sum / n);
    }
    Ok(LossOutput { loss, metrics })
}

/// RLOO's loss (TRL's `RLOOTrainer._compute_loss`): sequence-level importance sampling —
/// per completion `ρ = e^{Σ log π − Σ log π_old}` over its masked tokens, the loss
/// `−min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A)` averaged over the completions (the KL is in the
/// rewards, not here). Logs the clipping fractions over completions as TRL does.
pub fn rloo<O: TensorOps>(
    ops: &O,
    (epsilon, epsilon_high): (f64, f64),
    x: &GrpoInputs<'_, O::T>,
) -> Result<LossOutput<O::T>, O::Error> {
    let rows = x.advantages.len();
    let seq = ops.sum_last(&ops.mul(x.logps, x.mask)?)?;
    let old = match x.old_logps {
        Some(o) => ops.sum_last(&ops.mul(o, x.mask)?)?,
        None => ops.detach(&seq),
    };
    let coef1 = ops.exp(&ops.sub(&seq, &old)?)?;
    let coef2 = ops.clamp(&coef1, 1.0 - epsilon, 1.0 + epsilon_high)?;
    let adv = ops.tensor(x.advantages, &[rows])?;
    let per = ops.minimum(&ops.mul(&coef1, &adv)?, &ops.mul(&coef2, &adv)?)?;
    let loss = ops.affine(&ops.mean_all(&per)?, -1.0, 0.0)?;
    let c1 = ops.to_f64(&ops.detach(&coef1))?;
    let (mut low, mut high, mut region) = (0f64, 0f64, 0f64);
    for (c, a) in c1.iter().zip(x.advantages) {
        let is_low = *c < 1.0 - epsilon && *a < 0.0;
        let is_high = *c > 1.0 + epsilon_high && *a > 0.0;
        low += f64::from(u8::from(is_low));
        high += f64::from(u8::from(is_high));
        region += f64::from(u8::from(is_low || is_high));
    }
    let n = rows.max(1) as f64;
    let metrics = BTreeMap::from([
        ("clip_ratio/low_mean".to_string(), low / n),
        ("clip_ratio/low_min".to_string(), low / n),
        ("clip_ratio/high_mean".to_string(), high / n),
        ("clip_ratio/high_max".to_string(), high / n),
        ("clip_ratio/region_mean".to_string(), region / n),
    ]);
    Ok(LossOutput { loss, metrics })
}

/// RLOO's advantages (TRL's `RLOOTrainer._generate_and_score_completions`): each completion's
/// reward (already weighted, clipped and KL-penalised) minus the mean of the other completions
/// of its prompt, optionally normalised over the batch (`(A − mean) / (std + 1e-4)`); and each
/// group's standard deviation of the rewards (for `frac_reward_zero_std`).
pub fn rloo_advantages(rewards: &[f64], group: usize, normalize: bool) -> (Vec<f64>, Vec<f64>) {
    let std = |v: &[f64]| -> f64 {
        if v.len() < 2 {
            return 0.0;
        }
        let n = v.len() as f64;
        let m = v.iter().sum::<f64>() / n;
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0)).sqrt()
    };
    let mut adv = Vec::with_capacity(rewards.len());
    let mut stds = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group.max(1)) {
        let sum: f64 = g.iter().sum();
        let sd = std(g);
        for &r in g {
            adv.push(if g.len() > 1 {
                r - (sum - r) / (g.len() - 1) as f64
            } else {
                0.0
            });
            stds.push(sd);
        }
    }
    if normalize {
        let n = adv.len() as f64;
        let m = adv.iter().sum::<f64>() / n;
        let sd = std(&adv);
        adv.iter_mut().for_each(|a| *a = (*a - m) / (sd + 1e-4));
    }
    (adv, stds)
}

/// GRPO's advantages (TRL's `sum_then_normalize`): each completion's weighted reward sum
/// minus its group's mean, over the group's standard deviation (unbiased) + 1e-4 with
/// `scale_rewards = "group"`, over the whole batch's with `"batch"`, not divided with
/// `"none"`. `rewards[i][f]` is function `f`'s reward of completion `i` (NaN: not
/// applicable); groups are `group` consecutive completions. Also returns each group's
/// standard deviation (for `frac_reward_zero_std`).
pub fn grpo_advantages(
    rewards: &[Vec<f64>],
    weights: &[f64],
    group: usize,
    scale: &str,
) -> (Vec<f64>, Vec<f64>) {
    let total: Vec<f64> = rewards
        .iter()
        .map(|r| {
            r.iter()
                .zip(weights)
                .map(|(v, w)| v * w)
                .filter(|v| !v.is_nan())
                .sum()
        })
        .collect();
    let std = |v: &[f64]| -> f64 {
        let n = v.len() as f64;
        if v.len() < 2 {
            return 0.0;
        }
        let m = v.iter().sum::<f64>() / n;
        (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0)).sqrt()
    };
    let batch_std = std(&total);
    let mut adv = Vec::with_capacity(total.len());
    let mut stds = Vec::with_capacity(total.len());
    for g in total.chunks(group.max(1)) {
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let sd = if scale == "batch" { batch_std } else { std(g) };
        for &r in g {
            let a = r - mean;
            adv.push(if scale == "none" { a } else { a / (sd + 1e-4) });
            stds.push(sd);
        }
    }
    (adv, stds)
}

/// The mean of `values` weighted by `weights` (0 when they sum to 0): TRL's masked means
/// (`entropy` over the attention mask).
pub fn masked_mean(values: &[f64], weights: &[f32]) -> f64 {
    let total: f64 = weights.iter().map(|&x| f64::from(x)).sum();
    let sum: f64 = values
        .iter()
        .zip(weights)
        .map(|(v, &w)| v * f64::from(w))
        .sum();
    if total > 0.0 { sum / total } else { 0.0 }
}

/// TRL's `mean_token_accuracy`: the share of masked positions whose arg-max `pred` is the
/// label.
pub fn token_accuracy(pred: &[f64], labels: &[f64], mask: &[f32]) -> f64 {
    let hits: Vec<f64> = pred
        .iter()
        .zip(labels)
        .map(|(p, l)| f64::from(u8::from(p == l)))
        .collect();
    masked_mean(&hits, mask)
}
