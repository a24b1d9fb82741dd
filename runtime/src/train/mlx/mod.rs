//! The MLX training backend (feature `mlx`): MLX arrays through mlx-rs — Metal on Apple
//! silicon, MLX's CPU device on Linux (built with `scripts/mlx/setup.sh`). It implements the
//! seams the candle backend defines ([`crate::train::ops::TensorOps`] for the losses) and reuses
//! the rest: data, tokenisation, losses, schedules, metrics.

pub mod model;
pub mod ops;
pub mod train;

pub use ops::MlxOps;

#[cfg(test)]
mod tests;
