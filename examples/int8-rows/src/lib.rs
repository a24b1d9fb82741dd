//! An example plugin crate with an output format of its own — copy it to add a format.
//!
//! `int8-rows` stores each quantized Linear's weight as symmetric int8 with one f32 scale per
//! output row (`<module>.qweight` I8 `[out, in]`, `<module>.row_scale` F32 `[out]`); every
//! other tensor is copied as it is, and `config.json` gains
//! `"int8_rows": {"bits": 8, "modules": [...]}` naming the quantized modules.
//!
//! One `#[writer]` attribute registers the whole format:
//! - [`Int8Rows`] writes it (`kiln export --output-format int8-rows`). It has an encoder of
//!   its own ([`Encoding::Own`]), so kiln hands it each quantized Linear's values.
//! - [`Int8RowsReader`], named in the same attribute (`reader = ...`), recognises the output,
//!   decodes it for `kiln eval` (and anything that runs a model) and checks it for
//!   `kiln verify`.
//!
//! `src/main.rs` is a `kiln` binary that links this crate (`use ... as _;`).

use kiln::checkpoint::Checkpoint;
use kiln::export::writer::{
    Dtype, Encoded, Encoding, LinearWeight, OutputWriter, WriterEnd, WriterStart, WriterType,
    Written,
};
use kiln::export::{ErrorStats, ExportError};
use kiln::formats::check::{VerifyReport, compare_decoded_weights};
use kiln::formats::{FormatReader, Loaded, folder_config};
use kiln::model::candle::{DType, Device};
use kiln::model::{DecoderConfig, ModelError, Weights, read_f32};
use kiln::sink::ShardWriter;
use kiln::writer;
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The `config.json` key that marks the format.
pub const CONFIG_KEY: &str = "int8_rows";

/// The writer's name (`--output-format`).
const NAME: &str = "int8-rows";

/// Symmetric int8, one scale per output row.
#[writer(name = "int8-rows", reader = Int8RowsReader)]
#[derive(Default)]
pub struct Int8Rows {
    shards: Option<ShardWriter>,
}

/// Per-row symmetric int8 of `rows × cols` values: the codes and each row's scale
/// (`max |w| / 127`; 1 for an all-zero row).
pub fn quantize_rows(values: &[f32], rows: usize, cols: usize) -> (Vec<i8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(rows * cols);
    let mut scales = Vec::with_capacity(rows);
    for row in values.chunks_exact(cols).take(rows) {
        let amax = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
        codes.extend(
            row.iter()
                .map(|x| (x / scale).round().clamp(-127.0, 127.0) as i8),
        );
        scales.push(scale);
    }
    (codes, scales)
}

fn writer_error(what: String) -> ExportError {
    ExportError::Writer {
        writer: NAME.into(),
        what,
    }
}

impl OutputWriter for Int8Rows {
    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        if start.recipe.kv_cache.is_some() {
            return Err(writer_error(
                "--kv-cache: int8-rows stores no KV-cache scale".into(),
            ));
        }
        self.shards = Some(ShardWriter::new(start.out, start.max_shard_bytes));
        Ok(())
    }

    fn encoding(&self) -> Encoding {
        Encoding::Own
    }

    fn linear(&self, w: &LinearWeight<'_>) -> Result<Written, ExportError> {
        let values = w.values.to_f32();
        let (codes, scales) = quantize_rows(&values, w.rows, w.cols);
        let error = ErrorStats::measure(&values, |i| codes[i] as f32 * scales[i / w.cols]);
        let tensors = vec![
            Encoded {
                name: format!("{}.qweight", w.module),
                ty: kiln::export::writer::EncodedType::Dtype(Dtype::I8),
                shape: vec![w.rows, w.cols],
                data: codes.iter().map(|&c| c as u8).collect(),
            },
            Encoded {
                name: format!("{}.row_scale", w.module),
                ty: kiln::export::writer::EncodedType::Dtype(Dtype::F32),
                shape: vec![w.rows],
                data: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            },
        ];
        Ok(Written {
            tensors,
            quantized: Some(("int8-row".into(), error)),
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

    fn write(&mut self, t: Encoded) -> Result<(), ExportError> {
        let kiln::export::writer::EncodedType::Dtype(dtype) = t.ty else {
            return Err(writer_error(format!(
                "`{}` is not a safetensors dtype",
                t.name
            )));
        };
        let shards = self
            .shards
            .as_mut()
            .ok_or_else(|| writer_error("written to before begin".into()))?;
        Ok(shards.write(&t.name, dtype, &t.shape, &t.data)?)
    }

    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        let shards = self
            .shards
            .take()
            .ok_or_else(|| writer_error("finished before begin".into()))?
            .finish()?;
        let mut files = shards.files;
        let mut config = end.checkpoint.config().raw().clone();
        let modules: Vec<&String> = end.written.keys().collect();
        config.insert(CONFIG_KEY.into(), json!({"bits": 8, "modules": modules}));
        let path = end.out.join("config.json");
        let text = serde_json::to_string_pretty(&Value::Object(config))
            .map_err(|e| writer_error(format!("config.json: {e}")))?;
        std::fs::write(&path, text + "\n")
            .map_err(|e| writer_error(format!("{}: {e}", path.display())))?;
        files.push("config.json".into());
        for name in ["tokenizer.json", "tokenizer_config.json"] {
            let src = end.model.join(name);
            if src.is_file() {
                std::fs::copy(&src, end.out.join(name))
                    .map_err(|e| writer_error(format!("{}: {e}", src.display())))?;
                files.push(name.into());
            }
        }
        Ok(files)
    }
}

impl WriterType for Int8Rows {
    fn formats() -> Vec<(&'static str, String)> {
        vec![(
            "int8",
            "symmetric int8 weights, one f32 scale per output row".into(),
        )]
    }

    fn new(format: &str) -> Result<Self, ExportError> {
        match format {
            "int8" => Ok(Int8Rows::default()),
            other => Err(writer_error(format!("no format `{other}`"))),
        }
    }
}

/// Reads `int8-rows` output back.
#[derive(Debug, Default)]
pub struct Int8RowsReader;

impl Int8RowsReader {
    /// The modules `config.json` names as quantized.
    fn listed(checkpoint: &Checkpoint) -> Result<BTreeSet<String>, ModelError> {
        let list = checkpoint
            .config()
            .raw()
            .get(CONFIG_KEY)
            .and_then(|q| q.get("modules"))
            .and_then(Value::as_array)
            .ok_or_else(|| ModelError::Config(format!("{CONFIG_KEY}.modules: missing")))?;
        list.iter()
            .map(|m| {
                m.as_str().map(str::to_string).ok_or_else(|| {
                    ModelError::Config(format!("{CONFIG_KEY}.modules: {m} is not a name"))
                })
            })
            .collect()
    }
}

impl FormatReader for Int8RowsReader {
    fn detect(&self, path: &Path) -> Option<PathBuf> {
        folder_config(path)?
            .contains_key(CONFIG_KEY)
            .then(|| path.to_path_buf())
    }

    fn load(
        &self,
        found: &Path,
        dtype: DType,
        device: &Device,
        _activations: bool,
    ) -> Result<Loaded, ModelError> {
        let c = Checkpoint::open(found)?;
        let mut tensors = Vec::new();
        for t in c.tensors() {
            if t.name.ends_with(".row_scale") {
                continue;
            }
            let Some(module) = t.name.strip_suffix(".qweight") else {
                tensors.push((t.name.clone(), read_f32(&c, t)?, t.shape.clone()));
                continue;
            };
            let scale_name = format!("{module}.row_scale");
            let scale = c
                .tensor(&scale_name)
                .ok_or_else(|| ModelError::Tensor {
                    tensor: scale_name.clone(),
                    message: format!("missing beside `{}`", t.name),
                })
                .and_then(|s| read_f32(&c, s))?;
            let (&[rows, cols], Dtype::I8) = (&t.shape[..], t.dtype) else {
                return Err(ModelError::Tensor {
                    tensor: t.name.clone(),
                    message: format!("{:?} {:?}, not I8 [out, in]", t.dtype, t.shape),
                });
            };
            if scale.len() != rows {
                return Err(ModelError::Tensor {
                    tensor: scale_name,
                    message: format!("{} scales for {rows} rows", scale.len()),
                });
            }
            let mut codes = Vec::new();
            c.read(&t.name, &mut codes)?;
            let values = codes
                .iter()
                .enumerate()
                .map(|(i, &b)| b as i8 as f32 * scale[i / cols])
                .collect();
            tensors.push((format!("{module}.weight"), values, t.shape.clone()));
        }
        Ok(Loaded {
            config: DecoderConfig::from_json(c.config().raw())?,
            weights: Weights::from_f32(tensors, dtype, device)?,
            act: Default::default(),
        })
    }

    fn verify(&self, reference: &Checkpoint, found: &Path) -> Result<VerifyReport, ModelError> {
        let c = Checkpoint::open(found)?;
        let mut report = VerifyReport {
            quant_algo: format!("{NAME} int8"),
            agreement: format!("names, dtypes and config.json's {CONFIG_KEY} agree"),
            ..VerifyReport::default()
        };
        let stored: BTreeSet<String> = c
            .tensors()
            .filter_map(|t| t.name.strip_suffix(".qweight").map(str::to_string))
            .collect();
        let listed = Self::listed(&c)?;
        for m in stored.symmetric_difference(&listed) {
            report.problems.push(format!(
                "`{m}` is {} but {} in config.json's {CONFIG_KEY}.modules",
                if stored.contains(m) {
                    "stored quantized"
                } else {
                    "not stored quantized"
                },
                if listed.contains(m) {
                    "listed"
                } else {
                    "not listed"
                },
            ));
        }
        let decoded = self
            .load(found, DType::F32, &Device::Cpu, false)
            .map(|l| l.weights);
        compare_decoded_weights(reference, decoded, &stored, &mut report)?;
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A readable reference: each value's code is the nearest integer to value / scale.
    #[test]
    fn rows_round_to_the_nearest_code_of_their_own_scale() {
        let values = [0.3, -1.0, 0.25, 0.0, 0.0, 0.0, 2.0, 1.5, -0.01];
        let (codes, scales) = quantize_rows(&values, 3, 3);
        assert_eq!(scales, [1.0 / 127.0, 1.0, 2.0 / 127.0]);
        assert_eq!(codes, [38, -127, 32, 0, 0, 0, 127, 95, -1]);
    }
}
