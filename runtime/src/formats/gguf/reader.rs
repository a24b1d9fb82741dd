//! Recognising GGUF: a `.gguf` file, or a folder holding kiln's `model.gguf`.

use crate::formats::FormatReader;
use std::path::{Path, PathBuf};
#[cfg(feature = "exec")]
use {
    crate::checkpoint::Checkpoint,
    crate::formats::Loaded,
    crate::formats::check::VerifyReport,
    crate::model::candle::{DType, Device},
    crate::model::{DecoderConfig, ModelError},
};

/// The reader of GGUF files kiln wrote: the config rebuilt from the metadata; activations
/// run unquantized, as llama.cpp runs them.
#[derive(Debug, Default)]
pub struct GgufReader;

impl FormatReader for GgufReader {
    fn detect(&self, path: &Path) -> Option<PathBuf> {
        super::gguf_file(path)
    }

    #[cfg(feature = "exec")]
    fn load(
        &self,
        found: &Path,
        dtype: DType,
        device: &Device,
        activations: bool,
    ) -> Result<Loaded, ModelError> {
        let _ = activations;
        let g = super::read::GgufModel::open(found)?;
        let config = config_of(&g)?;
        let (weights, _) = g.weights(dtype, device)?;
        Ok(Loaded {
            config,
            weights,
            act: Default::default(),
        })
    }

    #[cfg(feature = "exec")]
    fn load_packed(&self, found: &Path, device: &Device) -> Option<Result<Loaded, ModelError>> {
        Some((|| {
            let g = super::read::GgufModel::open(found)?;
            Ok(Loaded {
                config: config_of(&g)?,
                weights: g.packed_weights(device)?,
                act: Default::default(),
            })
        })())
    }

    #[cfg(feature = "exec")]
    fn verify(&self, reference: &Checkpoint, found: &Path) -> Result<VerifyReport, ModelError> {
        crate::formats::check::verify_gguf(reference, found)
    }
}

/// The model's configuration from the GGUF metadata, with llama3's RoPE factors.
#[cfg(feature = "exec")]
fn config_of(g: &super::read::GgufModel) -> Result<DecoderConfig, ModelError> {
    let mut config = DecoderConfig::from_json(&g.config)?;
    if let Some(f) = &g.rope_freqs {
        if f.len() != config.head_dim / 2 {
            return Err(ModelError::Tensor {
                tensor: "rope_freqs.weight".into(),
                message: format!("{} factors for a head of {}", f.len(), config.head_dim),
            });
        }
        config.rope_scaling = crate::model::RopeScaling::Factors(f.clone());
    }
    Ok(config)
}
