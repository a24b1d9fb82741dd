//! Finding the reader of a path among the registered writers, and running it.

use super::FormatReader;
use super::check::VerifyReport;
use super::registry::ReaderRegistry;
use crate::checkpoint::Checkpoint;
pub use crate::model::Loaded;
use crate::model::act_quant::ActQuant;
use crate::model::candle::{DType, Device};
use crate::model::{DecoderConfig, DecoderModel, ModelError, Weights};
use std::path::{Path, PathBuf};

/// The format a path holds, as its reader found it.
pub struct Detected {
    /// The writer's name (`--output-format`).
    pub writer: String,
    /// The format's reader.
    pub reader: Box<dyn FormatReader>,
    /// What the reader opens (the folder, or the file in it).
    pub path: PathBuf,
}

/// The reader that claims `path`; `None` when no registered format recognises it (a plain
/// checkpoint), an error naming them when several do.
pub fn detect(path: &Path) -> Result<Option<Detected>, ModelError> {
    let mut found: Vec<Detected> = readers()?
        .entries()
        .iter()
        .filter_map(|e| {
            let reader = (e.construct?)();
            let at = reader.detect(path)?;
            Some(Detected {
                writer: e.name.to_string(),
                reader,
                path: at,
            })
        })
        .collect();
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => Err(ModelError::file(
            path,
            format!(
                "claimed by several registered formats: {} (each writer's reader must \
                 recognise only its own output)",
                found
                    .iter()
                    .map(|d| d.writer.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// Reads `path` for execution: an export in any registered writer's format (its reader
/// decodes it), or a plain Hugging Face checkpoint.
pub fn load(
    path: &Path,
    dtype: DType,
    device: &Device,
    activations: bool,
) -> Result<Loaded, ModelError> {
    match detect(path)? {
        Some(d) => d.reader.load(&d.path, dtype, device, activations),
        None => {
            let checkpoint = Checkpoint::open(path)?;
            if let Some(key) = crate::model::quantization_marker(&checkpoint) {
                return Err(ModelError::file(
                    path,
                    format!(
                        "has `{key}`, but no registered format recognises it ({}): kiln \
                         cannot decode it",
                        readers()?.readable().join(", ")
                    ),
                ));
            }
            Ok(Loaded {
                config: DecoderConfig::from_json(checkpoint.config().raw())?,
                weights: crate::model::load_plain(&checkpoint, dtype, device)?,
                act: ActQuant::default(),
            })
        }
    }
}

/// The quantized model at `path` for QLoRA: its quantized Linears kept packed
/// ([`FormatReader::load_packed`]), f32 on `device`. A plain checkpoint, or a format whose
/// reader keeps nothing packed, is an error naming it.
pub fn load_packed(path: &Path, device: &Device) -> Result<Loaded, ModelError> {
    let Some(d) = detect(path)? else {
        return Err(ModelError::file(
            path,
            "is not a quantized export: train it as it is (QLoRA is for a quantized base)",
        ));
    };
    d.reader.load_packed(&d.path, device).unwrap_or_else(|| {
        Err(ModelError::file(
            path,
            format!(
                "is a `{}` export, whose weights kiln cannot keep packed yet (QLoRA reads \
                 ModelOpt, compressed-tensors, mlx and GGUF exports)",
                d.writer
            ),
        ))
    })
}

/// The model at `path` ([`load`]), ready to run: its weights out of autograd (inference:
/// a forward pass builds no graph; the storage is not copied).
pub fn load_model(
    path: &Path,
    dtype: DType,
    device: &Device,
    activations: bool,
) -> Result<DecoderModel, ModelError> {
    let mut model = DecoderModel::from_loaded(load(path, dtype, device, activations)?, device)?;
    model.freeze()?;
    Ok(model)
}

/// The weights at `path`, decoded ([`load`] without activation quantizers).
pub fn load_weights(path: &Path, dtype: DType, device: &Device) -> Result<Weights, ModelError> {
    Ok(load(path, dtype, device, false)?.weights)
}

/// Checks the export at `quantized` against the model at `reference`, with the reader of the
/// export's format.
pub fn verify(reference: &Path, quantized: &Path) -> Result<VerifyReport, ModelError> {
    let r = Checkpoint::open(reference)?;
    match detect(quantized)? {
        Some(d) => d.reader.verify(&r, &d.path),
        None => {
            // Not an export: say why by the folder's own state (a missing config.json is an
            // error naming it).
            Checkpoint::open(quantized)?;
            let readers = readers()?.readable();
            Ok(VerifyReport {
                problems: vec![format!(
                    "{}: not a quantized export: no registered format recognises it ({})",
                    quantized.display(),
                    readers.join(", ")
                )],
                ..VerifyReport::default()
            })
        }
    }
}

/// The reader registry, or its validation error.
fn readers() -> Result<&'static ReaderRegistry, ModelError> {
    ReaderRegistry::try_global().map_err(|e| ModelError::Config(e.to_string()))
}
