//! What a task asks of a backend: per-token log-probabilities of sequences under a model (the
//! policy being trained, or a frozen reference), shifted for next-token prediction. The tasks
//! (`train/tasks/`) are written once against [`Runner`]; candle and MLX each implement it.

use super::TrainError;
use super::losses;
use super::ops::TensorOps;

/// A micro-batch's logits and labels, shifted for next-token prediction.
pub struct Shifted<T> {
    /// `[batch, len − 1, vocab]`: the logits at positions `0..len−1`.
    pub logits: T,
    /// The unshifted logits `[batch, len, vocab]` (entropy over every position, as TRL).
    pub full_logits: T,
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
    /// Right-pads `seqs`, runs `model` and shifts.
    fn forward_shifted(
        &self,
        model: &Self::Model,
        seqs: &[(Vec<u32>, Vec<u8>)],
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
    /// TRL's `mean_token_accuracy`: arg-max hits over the masked positions of `rows`.
    pub fn token_accuracy<O: TensorOps<T = T>>(
        &self,
        ops: &O,
        rows: std::ops::Range<usize>,
    ) -> Result<f64, TrainError> {
        let width = self.mask_host.first().map_or(0, Vec::len);
        let pred = ops.to_f64(&ops.argmax(&self.logits).tr()?).tr()?;
        let span = rows.start * width..rows.end * width;
        let labels: Vec<f64> = self.labels[span.clone()]
            .iter()
            .map(|&l| f64::from(l))
            .collect();
        let mask: Vec<f32> = self.mask_host[rows].iter().flatten().copied().collect();
        Ok(losses::token_accuracy(&pred[span], &labels, &mask))
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
