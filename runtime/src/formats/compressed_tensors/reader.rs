//! Recognising compressed-tensors: a `config.json` `quantization_config` with
//! `quant_method: compressed-tensors`.

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

/// The reader of compressed-tensors (kiln's or llm-compressor's).
#[derive(Debug, Default)]
pub struct CompressedTensorsReader;

impl FormatReader for CompressedTensorsReader {
    fn detect(&self, path: &Path) -> Option<PathBuf> {
        let config = crate::formats::folder_config(path)?;
        let method = config.get("quantization_config")?.get("quant_method")?;
        (method.as_str() == Some("compressed-tensors")).then(|| path.to_path_buf())
    }

    #[cfg(feature = "exec")]
    fn load(
        &self,
        found: &Path,
        dtype: DType,
        device: &Device,
        activations: bool,
    ) -> Result<Loaded, ModelError> {
        let checkpoint = Checkpoint::open(found)?;
        let (weights, act) = super::read::load(&checkpoint, dtype, device, activations)?;
        Ok(Loaded {
            config: DecoderConfig::from_json(checkpoint.config().raw())?,
            weights,
            act,
        })
    }

    #[cfg(feature = "exec")]
    fn load_packed(&self, found: &Path, device: &Device) -> Option<Result<Loaded, ModelError>> {
        crate::formats::loaded_packed(found, device, super::read::load_packed)
    }

    #[cfg(feature = "exec")]
    fn verify(&self, reference: &Checkpoint, found: &Path) -> Result<VerifyReport, ModelError> {
        crate::formats::check::verify_compressed(reference, &Checkpoint::open(found)?)
    }
}
