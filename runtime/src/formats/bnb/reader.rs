//! Recognising bitsandbytes' layout: `config.json`'s `quantization_config` with
//! `quant_method` `bitsandbytes` (transformers' saved `load_in_4bit` models, and kiln's).

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

/// The reader of bitsandbytes' 4-bit checkpoints; it quantizes weights only.
#[derive(Debug, Default)]
pub struct BnbReader;

impl FormatReader for BnbReader {
    fn detect(&self, path: &Path) -> Option<PathBuf> {
        let config = crate::formats::folder_config(path)?;
        let method = config.get("quantization_config")?.get("quant_method")?;
        (method.as_str() == Some("bitsandbytes")).then(|| path.to_path_buf())
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
        let checkpoint = Checkpoint::open(found)?;
        Ok(Loaded {
            config: DecoderConfig::from_json(checkpoint.config().raw())?,
            weights: super::read::load(&checkpoint, dtype, device, false)?,
            act: Default::default(),
        })
    }

    #[cfg(feature = "exec")]
    fn load_packed(&self, found: &Path, device: &Device) -> Option<Result<Loaded, ModelError>> {
        crate::formats::loaded_packed(found, device, |c, d| {
            super::read::load(c, DType::F32, d, true)
        })
    }

    #[cfg(feature = "exec")]
    fn verify(&self, reference: &Checkpoint, found: &Path) -> Result<VerifyReport, ModelError> {
        super::read::verify(reference, &Checkpoint::open(found)?)
    }
}
