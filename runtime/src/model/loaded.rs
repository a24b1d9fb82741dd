//! A model read back for execution by a format's reader.

use super::act_quant::ActQuant;
use super::{DecoderConfig, Weights};

/// A model read back for execution.
#[derive(Debug)]
pub struct Loaded {
    /// Its configuration (from `config.json`, or rebuilt from the format's metadata).
    pub config: DecoderConfig,
    /// Its weights, decoded, under Hugging Face names.
    pub weights: Weights,
    /// The activation quantizers an engine applies (none for weight-only formats).
    pub act: ActQuant,
}
