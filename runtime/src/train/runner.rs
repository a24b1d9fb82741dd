//! What a task asks of a backend: per-token log-probabilities of sequences under a model (the
//! policy being trained, or a frozen reference), shifted for next-token prediction. The tasks
//! (`train/tasks/`) are written once against [`Runner`]; candle and MLX each implement it.

use super::TrainError;
use super::losses;
use super::ops::TensorOps;

/// A micro-batch's log-probabilities and labels, shifted for next-token prediction, and the
/// logits — or, where the backend computed the log-probabilities without holding them (the
/// candle CPU head, [`crate::model::fused::head_logps`]), the per-position figures the losses'
/// logs read from them.
pub struct Shifted<T> {
    /// `[batch, len − 1, vocab]`: the logits at positions `0..len−1` (`None` with `stats`).
    pub logits: Option<T>,
    /// The unshifted logits `[batch, len, vocab]` (`None` with `stats`).
    pub full_logits: Option<T>,
    /// Per position of `[batch, len]`, the entropy, arg-max and sum of the logits, where the
    /// logits were never held.
    pub stats: Option<crate::model::fused::HeadStats>,
    /// The ids of tokens `1..len`, row-major `[batch, len − 1]`, on the host.
    pub labels: Vec<u32>,
    /// The per-token log-probabilities of the labels `[batch, len − 1]`.
    pub logps: T,
    /// The label mask (shifted), on the device.
    pub mask: T,
    /// The label mask (shifted), on the host.
    pub mask_host: Vec<Vec<f32>>,
    /// The attention mask (1 for real tokens) `[batch, len]`, on the host.
    pub attention: Vec<Vec<f32>>,
}

/// [`Runner::forward_masked_logps`]'s log-probabilities and each position's entropy.
pub type HeadLogps<T> = (T, Vec<f32>);

/// What [`Runner::forward_masked_logps`] scores: `ids` under the attention mask `attention`
/// (as [`Runner::forward_masked`]) numbered by `positions` (as
/// [`Runner::forward_positioned`]; `None`: `0..len`), the log-probabilities of `labels`
/// (`[batch · at.len()]`, row-major) at the positions `at`, the logits multiplied by `scale`
/// before the softmax (a sampling temperature's `1 / T`).
pub struct HeadQuery<'a> {
    /// The token ids, one row per sequence.
    pub ids: &'a [Vec<u32>],
    /// transformers' `attention_mask`.
    pub attention: &'a [Vec<bool>],
    /// transformers' `position_ids`, or `None`.
    pub positions: Option<&'a [Vec<usize>]>,
    /// The positions scored.
    pub at: std::ops::Range<usize>,
    /// The label of each scored position.
    pub labels: &'a [u32],
    /// The factor on the logits.
    pub scale: f64,
}

/// A right-padded batch on the host: ids `[batch, len]`, each row's length, the shifted label
/// mask and the attention mask.
pub struct Padded {
    /// The ids, each row padded to `len`.
    pub ids: Vec<Vec<u32>>,
    /// Real tokens per row.
    pub lengths: Vec<usize>,
    /// The label mask of tokens `1..len`.
    pub mask_host: Vec<Vec<f32>>,
    /// 1 for real tokens.
    pub attention: Vec<Vec<f32>>,
    /// The padded length.
    pub len: usize,
}

/// Right-pads `seqs` (ids, label mask) with `pad`; fewer than two tokens in every row is an
/// error (nothing to predict).
pub fn pad(seqs: &[(Vec<u32>, Vec<u8>)], pad: u32) -> Result<Padded, TrainError> {
    let len = seqs.iter().map(|(i, _)| i.len()).max().unwrap_or(0);
    if len < 2 {
        return Err(TrainError::Config {
            field: "max_length".into(),
            message: "every sequence of a batch is shorter than two tokens: nothing to predict"
                .into(),
        });
    }
    let mut p = Padded {
        ids: Vec::with_capacity(seqs.len()),
        lengths: Vec::with_capacity(seqs.len()),
        mask_host: Vec::with_capacity(seqs.len()),
        attention: Vec::with_capacity(seqs.len()),
        len,
    };
    for (s, m) in seqs {
        let mut ids = s.clone();
        ids.resize(len, pad);
        p.ids.push(ids);
        p.lengths.push(s.len());
        let mut row: Vec<f32> = m.iter().map(|&x| f32::from(x)).collect();
        row.resize(len, 0.0);
        p.mask_host.push(row[1..].to_vec());
        let mut att = vec![1f32; s.len()];
        att.resize(len, 0.0);
        p.attention.push(att);
    }
    Ok(p)
}

impl Padded {
    /// The ids of tokens `1..len`, row-major.
    pub fn labels(&self) -> Vec<u32> {
        self.ids.iter().flat_map(|r| r[1..].to_vec()).collect()
    }
}

/// Sampling from the policy, as a backend does it (the sampler of `model/generate.rs` over
/// that backend's forward pass).
pub trait Sample {
    /// `n` completions of `prompt` under the policy (adapters without dropout).
    fn sample(
        &self,
        prompt: &[u32],
        n: usize,
        cfg: &crate::model::generate::SamplingConfig,
        rng: &mut crate::model::generate::Rng,
    ) -> Result<Vec<Vec<u32>>, TrainError>;
}

/// A backend as the tasks see it (and, for GRPO, how its policy samples).
pub trait Runner: Sample {
    /// Its loss operations.
    type Ops: TensorOps;
    /// A model: the policy, or a frozen reference.
    type Model;
    /// The loss operations.
    fn ops(&self) -> &Self::Ops;
    /// The policy (with its adapters, dropout on while training).
    fn policy(&self) -> &Self::Model;
    /// The padding id.
    fn pad_id(&self) -> u32 {
        self.tokenizer().pad_id
    }
    /// The model's tokenizer.
    fn tokenizer(&self) -> &super::data::TextTokenizer;
    /// The logits `[batch, seq, vocab]` of `ids` under `model`, `attention[i][j]` false hiding
    /// token `j` of row `i` (transformers' `attention_mask`).
    fn forward_masked(
        &self,
        model: &Self::Model,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
    ) -> Result<<Self::Ops as TensorOps>::T, TrainError>;
    /// The log-probabilities `[batch, at.len()]` of `q.labels` at the positions `q.at` of
    /// `q.ids` under `model` ([`HeadQuery`]), and each of those positions' entropy (host, no
    /// gradient) — computed without holding the logits where the backend can; `None` where it
    /// cannot (the caller takes the logits).
    fn forward_masked_logps(
        &self,
        model: &Self::Model,
        q: &HeadQuery<'_>,
    ) -> Result<Option<HeadLogps<<Self::Ops as TensorOps>::T>>, TrainError> {
        let _ = (model, q);
        Ok(None)
    }
    /// GKD's generalized JSD per position `[batch, q.at.len()]` (TRL's `generalized_jsd_loss`
    /// before its mask and mean) between `model`'s distributions at the positions `q.at` of
    /// `q.ids` (`q.labels` unused, `q.scale` 1) and a teacher's, given as the rows entering its
    /// output layer at the same positions — computed without holding either's logits where the
    /// backend can; `None` where it cannot (the caller takes the logits).
    fn forward_masked_jsd(
        &self,
        model: &Self::Model,
        q: &HeadQuery<'_>,
        teacher: crate::model::fused::HeadRows,
        beta: f64,
    ) -> Result<Option<<Self::Ops as TensorOps>::T>, TrainError> {
        let _ = (model, q, teacher, beta);
        Ok(None)
    }
    /// [`Runner::forward_masked`] with each token's position given (`positions[i][j]`,
    /// transformers' `position_ids`; TRL's PPO numbers a left-padded batch this way).
    fn forward_positioned(
        &self,
        model: &Self::Model,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<<Self::Ops as TensorOps>::T, TrainError>;
    /// The value model's outputs `[batch, seq]` (PPO's critic, trained beside the policy: its
    /// `score` head on every position's last hidden state), ids, mask and positions as in
    /// [`Runner::forward_positioned`]. A run without a value model has none to give.
    fn values(
        &self,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<<Self::Ops as TensorOps>::T, TrainError> {
        let _ = (ids, attention, positions);
        Err(TrainError::Config {
            field: "task".into(),
            message: "this run has no value model (only ppo trains one)".into(),
        })
    }
    /// The scores `[batch]` of the sequences `seqs` under a sequence classifier `model` (a
    /// reward model: its `score` head has one output), right-padded with the pad id, each read
    /// at its last non-pad token ([`last_non_pad`]) as transformers does.
    fn forward_scores(
        &self,
        model: &Self::Model,
        seqs: &[Vec<u32>],
    ) -> Result<<Self::Ops as TensorOps>::T, TrainError>;
    /// Right-pads `seqs`, runs `model` and shifts; with `keep_logits` the logits are kept
    /// (a figure that needs more of them than [`Shifted`]'s methods read), else a backend may
    /// compute the log-probabilities without holding them.
    fn forward_shifted(
        &self,
        model: &Self::Model,
        seqs: &[(Vec<u32>, Vec<u8>)],
        keep_logits: bool,
    ) -> Result<Shifted<<Self::Ops as TensorOps>::T>, TrainError>;
}

/// `seqs` right-padded with `pad` to the longest, and each row's length (an empty batch, or
/// one whose sequences are all empty, is an error).
pub fn pad_ids(seqs: &[Vec<u32>], pad: u32) -> Result<(Vec<Vec<u32>>, Vec<usize>), TrainError> {
    let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if len == 0 {
        return Err(TrainError::Config {
            field: "max_length".into(),
            message: "a batch of empty sequences: nothing to score".into(),
        });
    }
    let ids = seqs
        .iter()
        .map(|s| {
            let mut r = s.clone();
            r.resize(len, pad);
            r
        })
        .collect();
    Ok((ids, seqs.iter().map(Vec::len).collect()))
}

/// The position of each row's last token that is not `pad` (0 when every token is): where
/// transformers' `*ForSequenceClassification` reads a sequence's score
/// (`(arange(len) * (ids != pad)).argmax(-1)`).
pub fn last_non_pad(ids: &[Vec<u32>], pad: u32) -> Vec<usize> {
    ids.iter()
        .map(|r| r.iter().rposition(|&t| t != pad).unwrap_or(0))
        .collect()
}

/// A backend's error as a training error (`?` in code written for every backend).
pub trait OrTrain<T> {
    /// The result with a [`TrainError`].
    fn tr(self) -> Result<T, TrainError>;
}

impl<T, E: std::fmt::Display> OrTrain<T> for Result<T, E> {
    fn tr(self) -> Result<T, TrainError> {
        self.map_err(|e| TrainError::Backend {
            backend: "tensor operations".into(),
            message: e.to_string(),
        })
    }
}

impl<T> Shifted<T> {
    /// Positions per row of the shifted batch (`len − 1`).
    fn width(&self) -> usize {
        self.mask_host.first().map_or(0, Vec::len)
    }

    /// `values` of every full position `[batch, len]` kept at the shifted ones
    /// `[batch, len − 1]` (each row's last dropped).
    fn shift<V: Copy>(&self, values: &[V]) -> Vec<V> {
        let w = self.width();
        values
            .chunks(w + 1)
            .flat_map(|r| r[..w].iter().copied())
            .collect()
    }

    fn no_logits() -> TrainError {
        TrainError::Backend {
            backend: "tensor operations".into(),
            message: "a shifted batch holds neither its logits nor their figures".into(),
        }
    }

    /// TRL's `mean_token_accuracy`: arg-max hits over the masked positions of `rows`.
    pub fn token_accuracy<O: TensorOps<T = T>>(
        &self,
        ops: &O,
        rows: std::ops::Range<usize>,
    ) -> Result<f64, TrainError> {
        let width = self.width();
        let pred: Vec<f64> = match (&self.stats, &self.logits) {
            (Some(st), _) => self
                .shift(&st.argmax)
                .iter()
                .map(|&a| f64::from(a))
                .collect(),
            (None, Some(l)) => ops.to_f64(&ops.argmax(l).tr()?).tr()?,
            (None, None) => return Err(Self::no_logits()),
        };
        let span = rows.start * width..rows.end * width;
        let labels: Vec<f64> = self.labels[span.clone()]
            .iter()
            .map(|&l| f64::from(l))
            .collect();
        let mask: Vec<f32> = self.mask_host[rows].iter().flatten().copied().collect();
        Ok(losses::token_accuracy(&pred[span], &labels, &mask))
    }

    /// The mean entropy over `weights` — `[batch, len]` over every position with `full`,
    /// else `[batch, len − 1]` over the shifted ones.
    pub fn entropy_over<O: TensorOps<T = T>>(
        &self,
        ops: &O,
        weights: &[Vec<f32>],
        full: bool,
    ) -> Result<f64, TrainError> {
        let w: Vec<f32> = weights.iter().flatten().copied().collect();
        if let Some(st) = &self.stats {
            let h: Vec<f64> = if full {
                st.entropy.iter().map(|&e| f64::from(e)).collect()
            } else {
                self.shift(&st.entropy)
                    .iter()
                    .map(|&e| f64::from(e))
                    .collect()
            };
            return Ok(losses::masked_mean(&h, &w));
        }
        let logits = if full {
            &self.full_logits
        } else {
            &self.logits
        };
        Self::entropy(ops, logits.as_ref().ok_or_else(Self::no_logits)?, weights)
    }

    /// The sum of the logits at each position, row-major: every position `[batch, len]` with
    /// `full`, else the shifted ones `[batch, len − 1]`.
    pub fn logit_sums<O: TensorOps<T = T>>(
        &self,
        ops: &O,
        full: bool,
    ) -> Result<Vec<f64>, TrainError> {
        if let Some(st) = &self.stats {
            let sums: Vec<f64> = st.sum.iter().map(|&v| f64::from(v)).collect();
            return Ok(if full { sums } else { self.shift(&sums) });
        }
        let logits = if full {
            &self.full_logits
        } else {
            &self.logits
        };
        let logits = logits.as_ref().ok_or_else(Self::no_logits)?;
        let vocab = ops.dims(logits).last().copied().unwrap_or(0) as f64;
        let means = ops.to_f64(&ops.mean_last(logits).tr()?).tr()?;
        Ok(means.iter().map(|m| m * vocab).collect())
    }

    /// The vocabulary's size.
    pub fn vocab<O: TensorOps<T = T>>(&self, ops: &O) -> Result<usize, TrainError> {
        match (&self.stats, &self.logits) {
            (Some(st), _) => Ok(st.vocab),
            (None, Some(l)) => Ok(ops.dims(l).last().copied().unwrap_or(0)),
            (None, None) => Err(Self::no_logits()),
        }
    }

    /// The mean entropy over `weights` `[batch, positions]` of the per-position entropies of
    /// `logits`.
    pub fn entropy<O: TensorOps<T = T>>(
        ops: &O,
        logits: &T,
        weights: &[Vec<f32>],
    ) -> Result<f64, TrainError> {
        let h = ops.to_f64(&ops.token_entropy(logits).tr()?).tr()?;
        let w: Vec<f32> = weights.iter().flatten().copied().collect();
        Ok(losses::masked_mean(&h, &w))
    }
}
