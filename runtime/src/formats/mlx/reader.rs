//! Recognising mlx-lm's layout: a `config.json` `quantization` with `bits` and `group_size`.

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

/// The reader of mlx-lm's layout (kiln's or `mlx_lm.convert`'s); mlx-lm quantizes weights only.
#[derive(Debug, Default)]
pub struct MlxReader;

impl FormatReader for MlxReader {
    fn detect(&self, path: &Path) -> Option<PathBuf> {
        let config = crate::formats::folder_config(path)?;
        let q = config.get("quantization")?;
        (q.get("bits").is_some() && q.get("group_size").is_some()).then(|| path.to_path_buf())
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
            weights: super::read::load(&checkpoint, dtype, device)?,
            act: Default::default(),
        })
    }

    #[cfg(feature = "exec")]
    fn load_packed(&self, found: &Path, device: &Device) -> Option<Result<Loaded, ModelError>> {
        crate::formats::loaded_packed(found, device, super::read::load_packed)
    }

    #[cfg(feature = "exec")]
    fn verify(&self, reference: &Checkpoint, found: &Path) -> Result<VerifyReport, ModelError> {
        crate::formats::check::verify_mlx(reference, &Checkpoint::open(found)?)
    }
}
