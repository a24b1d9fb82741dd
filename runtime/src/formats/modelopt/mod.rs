//! ModelOpt's layout (docs/FORMATS.md §2–4), the default writer: safetensors shards of what
//! the exporters compute with ModelOpt's cross-module scale rules ([`Encoding::Shared`]), and
//! `hf_quant_config.json` and `config.json`'s `quantization_config` built from their
//! declarations.

#[cfg(feature = "exec")]
pub mod read;
pub mod reader;

use crate::export::ExportError;
use crate::export::files;
use crate::export::recipe::Format;
use crate::export::writer::{
    Dtype, Encoded, EncodedType, Encoding, LinearWeight, OutputWriter, WriterEnd, WriterStart,
    WriterType, Written,
};
use crate::sink::ShardWriter;
use std::collections::BTreeSet;

/// ModelOpt's writer in one of its formats.
#[crate::writer(name = "modelopt", reader = reader::ModelOptReader, crate = crate)]
pub struct ModelOptWriter {
    format: Format,
    /// `--group-size` (AWQ's INT4 block size).
    group: Option<usize>,
    shards: Option<ShardWriter>,
}

impl std::fmt::Debug for ModelOptWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelOptWriter")
            .field("format", &self.format)
            .finish_non_exhaustive()
    }
}

impl ModelOptWriter {
    fn not_begun() -> ExportError {
        ExportError::Writer {
            writer: "modelopt".into(),
            what: "written to before `begin`".into(),
        }
    }
}

impl OutputWriter for ModelOptWriter {
    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        // Header room: about four output tensors per input tensor (weight and its scales), so
        // shards are written in place, not copied.
        self.shards = Some(super::shards(start, 4));
        Ok(())
    }

    fn encoding(&self) -> Encoding {
        Encoding::Shared(self.format)
    }

    fn linear(&self, weight: &LinearWeight<'_>) -> Result<Written, ExportError> {
        Err(ExportError::Writer {
            writer: "modelopt".into(),
            what: format!(
                "`{}`: ModelOpt's writer has no encoder of its own; its exporters quantize \
                 (Encoding::Shared)",
                weight.module
            ),
        })
    }

    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError> {
        Ok(Written::copied(name, dtype, shape, data))
    }

    fn write(&mut self, tensor: Encoded) -> Result<(), ExportError> {
        let EncodedType::Dtype(dtype) = tensor.ty else {
            return Err(ExportError::Writer {
                writer: "modelopt".into(),
                what: format!("`{}` is not a safetensors dtype", tensor.name),
            });
        };
        let shards = self.shards.as_mut().ok_or_else(Self::not_begun)?;
        Ok(shards.write(&tensor.name, dtype, &tensor.shape, &tensor.data)?)
    }

    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        let written = self.shards.take().ok_or_else(Self::not_begun)?.finish()?;
        let quantized: BTreeSet<String> = end.declared.iter().map(|(m, _)| m.clone()).collect();
        let excluded =
            crate::export::run::unquantized_summary(end.checkpoint, end.tree, &quantized);
        let hf = files::hf_quant_config(
            end.declared,
            &excluded,
            end.recipe.kv_cache,
            end.recipe.group_size,
        );
        crate::export::run::write_json(&end.out.join("hf_quant_config.json"), &hf, 4)?;
        let mut config = end.checkpoint.config().raw().clone();
        config.insert(
            "quantization_config".into(),
            files::quantization_config(&hf),
        );
        let mut out = written.files.clone();
        if written.files.len() > 1 {
            out.push("model.safetensors.index.json".into());
        }
        let mut rest = super::config_and_model_files(end, config, 2)?;
        // config.json, then hf_quant_config.json, then the copied files.
        rest.insert(1, "hf_quant_config.json".into());
        out.extend(rest);
        Ok(out)
    }

    fn uses_statistics(&self) -> bool {
        // Input scales (fp8, nvfp4, …) and AWQ / SmoothQuant smoothing; a format that stores
        // none takes them too, as ModelOpt's exporter does.
        true
    }

    fn group_sizes(&self) -> &'static [usize] {
        self.format.block_sizes()
    }

    /// `--group-size` for AWQ's INT4 blocks (ModelOpt's `block_sizes {-1: N}`).
    fn set_group_size(&mut self, size: usize) -> Result<(), ExportError> {
        self.group = Some(size);
        Ok(())
    }

    fn check_linear(&self, shape: &[usize]) -> Option<String> {
        let block = self.format.block(self.group)?;
        let cols = *shape.last()?;
        if cols.is_multiple_of(block) {
            return None;
        }
        let fit: Vec<String> = self
            .format
            .block_sizes()
            .iter()
            .filter(|&&g| cols.is_multiple_of(g))
            .map(|g| format!("--group-size {g}"))
            .collect();
        let hint = match fit.len() {
            0 => String::new(),
            _ => format!("; {} would fit", fit.join(" or ")),
        };
        Some(format!(
            "{cols} input features are not whole blocks of {block}{hint}"
        ))
    }

    fn engines(&self) -> Vec<crate::export::engines::EngineSupport> {
        crate::export::engines::modelopt(self.format.cli_name())
    }
}

impl WriterType for ModelOptWriter {
    fn formats() -> Vec<(&'static str, String)> {
        Format::ALL
            .iter()
            .map(|f| (f.cli_name(), format!("ModelOpt `{}`", f.quant_algo())))
            .collect()
    }

    fn new(format: &str) -> Result<Self, ExportError> {
        format
            .parse::<Format>()
            .map(|format| ModelOptWriter {
                format,
                group: None,
                shards: None,
            })
            .map_err(|what| ExportError::Writer {
                writer: "modelopt".into(),
                what,
            })
    }
}
