//! Recognising ModelOpt's layout: `hf_quant_config.json`, or a `quantization_config` with
//! `quant_method: modelopt` (or ModelOpt's `quant_algo` and no `quant_method`).

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

/// The reader of ModelOpt's layout (kiln's or ModelOpt's).
#[derive(Debug, Default)]
pub struct ModelOptReader;

impl FormatReader for ModelOptReader {
    fn detect(&self, path: &Path) -> Option<PathBuf> {
        if !path.is_dir() {
            return None;
        }
        if path.join("hf_quant_config.json").is_file() {
            return Some(path.to_path_buf());
        }
        let config = crate::formats::folder_config(path)?;
        let q = config.get("quantization_config")?;
        let method = q.get("quant_method").and_then(|m| m.as_str());
        let modelopt =
            method == Some("modelopt") || (method.is_none() && q.get("quant_algo").is_some());
        modelopt.then(|| path.to_path_buf())
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
        let (weights, act) =
            super::read::load_for_execution(&checkpoint, dtype, device, activations)?;
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
        crate::formats::check::verify_modelopt(reference, found)
    }
}
