//! The tensor operations every loss is written over. A backend (candle now, MLX in its own
//! module) implements [`TensorOps`] for its tensor type; the objectives in
//! [`super::losses`] are written once against it and never see a model.
//!
//! Shapes are the losses' own: per-token values `[batch, tokens]`, per-sequence values
//! `[batch]`, scalars `[]`. Element-wise operations broadcast a scalar or a `[batch]` against
//! `[batch]`; every operation keeps the autograd graph unless it says otherwise.

/// A backend's tensor operations, as the losses need them.
pub trait TensorOps {
    /// The backend's tensor.
    type T: Clone;
    /// The backend's error.
    type Error: std::fmt::Display;

    /// `log softmax(logits)[label]` per position: logits `[batch, tokens, vocab]`, labels
    /// `[batch, tokens]` (integer ids) → `[batch, tokens]`, in f32.
    fn token_logps(&self, logits: &Self::T, labels: &Self::T) -> Result<Self::T, Self::Error>;
    /// `log softmax(logits)` over the last dimension, in f32 (`[batch, tokens, vocab]`; GKD's
    /// divergences between whole distributions).
    fn log_softmax(&self, logits: &Self::T) -> Result<Self::T, Self::Error>;
    /// `ln a`.
    fn log(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// The entropy of `softmax(logits)` per position, `[batch, tokens]` (no gradient).
    fn token_entropy(&self, logits: &Self::T) -> Result<Self::T, Self::Error>;
    /// The arg-max over the last dimension (`[batch, tokens]`, as f32 ids; no gradient).
    fn argmax(&self, logits: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a + b`.
    fn add(&self, a: &Self::T, b: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a − b`.
    fn sub(&self, a: &Self::T, b: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a · b`.
    fn mul(&self, a: &Self::T, b: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a / b`.
    fn div(&self, a: &Self::T, b: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a · mul + add`.
    fn affine(&self, a: &Self::T, mul: f64, add: f64) -> Result<Self::T, Self::Error>;
    /// `log σ(a)`, computed stably.
    fn log_sigmoid(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// `max(a, 0)`.
    fn relu(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// `log(1 − eᵃ)` for `a < 0`, accurate near 0 too (ORPO's odds).
    fn log1mexp(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// The element-wise minimum of `a` and `b` (a tie splits the gradient evenly).
    fn minimum(&self, a: &Self::T, b: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a²`.
    fn sqr(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// `eᵃ`.
    fn exp(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// `√a`.
    fn sqrt(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// Zeros of `a`'s shape, in f32 (optimizer moments).
    fn zeros_like(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// `a` clamped to `[lo, hi]`.
    fn clamp(&self, a: &Self::T, lo: f64, hi: f64) -> Result<Self::T, Self::Error>;
    /// The sum over the last dimension (`[batch, tokens]` → `[batch]`).
    fn sum_last(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// The mean over the last dimension, outside the autograd graph (`[b, t, v]` → `[b, t]`;
    /// DPO's logged mean logits).
    fn mean_last(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// The sum of every element (→ scalar).
    fn sum_all(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// The mean of every element (→ scalar).
    fn mean_all(&self, a: &Self::T) -> Result<Self::T, Self::Error>;
    /// Positions `start..start + len` of dimension `dim`.
    fn narrow(
        &self,
        a: &Self::T,
        dim: usize,
        start: usize,
        len: usize,
    ) -> Result<Self::T, Self::Error>;
    /// A tensor of token ids with `shape` (the labels of [`TensorOps::token_logps`]).
    fn ids(&self, values: &[u32], shape: &[usize]) -> Result<Self::T, Self::Error>;
    /// The first and second halves along the first dimension (chosen rows, rejected rows).
    fn halves(&self, a: &Self::T) -> Result<(Self::T, Self::T), Self::Error>;
    /// The same values outside the autograd graph.
    fn detach(&self, a: &Self::T) -> Self::T;
    /// A tensor of `values` with `shape`, f32, on the backend's device.
    fn tensor(&self, values: &[f64], shape: &[usize]) -> Result<Self::T, Self::Error>;
    /// A tensor of f32 `values` with `shape` on the backend's device (a teacher's logits).
    fn tensor_f32(&self, values: &[f32], shape: &[usize]) -> Result<Self::T, Self::Error> {
        let v: Vec<f64> = values.iter().map(|&x| f64::from(x)).collect();
        self.tensor(&v, shape)
    }
    /// The shape of `a`.
    fn dims(&self, a: &Self::T) -> Vec<usize>;
    /// Every element, in row-major order, as f64.
    fn to_f64(&self, a: &Self::T) -> Result<Vec<f64>, Self::Error>;
}
