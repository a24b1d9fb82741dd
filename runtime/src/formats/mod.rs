//! Every output format, one folder each (`modelopt/`, `compressed_tensors/`, `gguf/`, `mlx/`)
//! owning its writer (`--output-format`, docs/DESIGN.md §7), its reader and its checks.
//!
//! The read side: a registered writer also registers a
//! [`FormatReader`] ([`crate::export::writer::WriterType::reader`]) that recognises what it
//! wrote, loads it for execution and verifies it against the model it came from. `kiln eval`,
//! `kiln verify` and everything that runs a model go through [`load_model`] and [`verify`],
//! which ask every registered reader and name no format themselves; a `#[writer]` in a
//! plugin crate is read exactly as the built-in ones are.

pub mod bnb;
#[cfg(feature = "exec")]
pub mod check;
pub mod compressed_tensors;
pub mod gguf;
pub mod mlx;
pub mod modelopt;
pub mod registry;

use std::path::{Path, PathBuf};

#[cfg(feature = "exec")]
mod dispatch;
#[cfg(feature = "exec")]
pub use dispatch::{Detected, Loaded, detect, load, load_model, load_packed, load_weights, verify};

/// The read side of one output format.
///
/// `detect` needs nothing but the file system; `load` and `verify` run the model's weights
/// through candle and exist with the `exec` feature (a reader crate enables it).
pub trait FormatReader: Send + Sync {
    /// What to open when `path` (an export's folder, or a file in it) holds this format's
    /// output; `None` when it does not. Every registered reader is asked; two that claim
    /// one path are an error naming both, so a detection must be specific (a file only this
    /// format writes, a key only its config carries).
    fn detect(&self, path: &Path) -> Option<PathBuf>;

    /// Reads the output `detect` found for execution in `dtype` on `device`: the model's
    /// config, its weights decoded under Hugging Face names, and with `activations` the
    /// activation quantizers an engine applies.
    #[cfg(feature = "exec")]
    fn load(
        &self,
        found: &Path,
        dtype: crate::model::candle::DType,
        device: &crate::model::candle::Device,
        activations: bool,
    ) -> Result<Loaded, crate::model::ModelError>;

    /// Reads the output `detect` found for QLoRA, in f32 on `device`: as [`FormatReader::load`]
    /// without activation quantizers, but each quantized Linear's weight kept in its packed
    /// layout ([`crate::model::Weights::packed`]) and decoded a tile at a time per use.
    /// `None`: this format decodes its weights whole (QLoRA on it is not built).
    #[cfg(feature = "exec")]
    fn load_packed(
        &self,
        found: &Path,
        device: &crate::model::candle::Device,
    ) -> Option<Result<Loaded, crate::model::ModelError>> {
        let _ = (found, device);
        None
    }

    /// Checks the output `detect` found against the model it was exported from, as an engine
    /// loading it would: names, shapes, dtypes, config files; and each quantized Linear's
    /// weight error.
    #[cfg(feature = "exec")]
    fn verify(
        &self,
        reference: &crate::checkpoint::Checkpoint,
        found: &Path,
    ) -> Result<check::VerifyReport, crate::model::ModelError>;
}

/// [`FormatReader::load_packed`] of a safetensors export at `found` whose config is its
/// `config.json` and whose weights `weights` reads (f32, Linears kept packed).
#[cfg(feature = "exec")]
pub(crate) fn loaded_packed(
    found: &Path,
    device: &crate::model::candle::Device,
    weights: impl FnOnce(
        &crate::checkpoint::Checkpoint,
        &crate::model::candle::Device,
    ) -> Result<crate::model::Weights, crate::model::ModelError>,
) -> Option<Result<Loaded, crate::model::ModelError>> {
    Some((|| {
        let checkpoint = crate::checkpoint::Checkpoint::open(found)?;
        Ok(Loaded {
            config: crate::model::DecoderConfig::from_json(checkpoint.config().raw())?,
            weights: weights(&checkpoint, device)?,
            act: Default::default(),
        })
    })())
}

/// `config.json` of a folder, when it has one that parses as a JSON object.
pub fn folder_config(path: &Path) -> Option<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(path.join("config.json")).ok()?;
    match serde_json::from_str(&text).ok()? {
        serde_json::Value::Object(m) => Some(m),
        _ => None,
    }
}

use crate::export::ExportError;
use crate::export::writer::WriterEnd;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The output's safetensors shards, with header room for up to `per_input` output tensors per
/// input tensor (a quantized Linear becomes a weight and its scales).
pub(crate) fn shards(
    start: &crate::export::writer::WriterStart<'_>,
    per_input: u64,
) -> crate::sink::ShardWriter {
    let room: u64 = start
        .checkpoint
        .tensors()
        .map(|t| per_input * (t.name.len() as u64 + 120))
        .sum();
    crate::sink::ShardWriter::new(start.out, start.max_shard_bytes)
        .with_header_room(room.clamp(4096, 8 << 20))
}

/// Writes `config` as the output's `config.json` (`indent` spaces, as the format's own tool
/// writes it) and copies the model's tokenizer and generation files
/// ([`crate::export::files::COPIED_FILES`]); returns the files written.
pub(crate) fn config_and_model_files(
    end: &WriterEnd<'_>,
    config: Map<String, Value>,
    indent: usize,
) -> Result<Vec<String>, ExportError> {
    crate::export::run::write_json(&end.out.join("config.json"), &Value::Object(config), indent)?;
    let mut files = vec!["config.json".to_string()];
    for name in crate::export::files::COPIED_FILES {
        let src = end.model.join(name);
        if src.is_file() {
            let dest = end.out.join(name);
            std::fs::copy(&src, &dest)
                .map_err(|source| crate::sink::SinkError::Io { path: dest, source })?;
            files.push(name.to_string());
        }
    }
    Ok(files)
}

/// Per-expert tensors gathered into one stacked tensor `[experts, …]` (GGUF's `*_exps`,
/// mlx-lm's `switch_mlp`), written once every expert has arrived. Memory: one stacked tensor
/// per projection of the layer being written.
pub(crate) struct Stacks<K> {
    experts: usize,
    pending: BTreeMap<String, Pending<K>>,
}

struct Pending<K> {
    kind: K,
    shape: Vec<usize>,
    parts: Vec<Option<Vec<u8>>>,
}

/// A stacked tensor, complete: its kind (dtype or ggml type), shape `[experts, …]`, bytes.
pub(crate) type Stacked<K> = (K, Vec<usize>, Vec<u8>);

impl<K: Copy + PartialEq> Stacks<K> {
    pub(crate) fn new(experts: usize) -> Self {
        Stacks {
            experts,
            pending: BTreeMap::new(),
        }
    }

    /// Splits a writer's `name#expert` into the stacked name and the expert.
    pub(crate) fn parse(name: &str) -> Option<Result<(&str, usize), String>> {
        let (base, e) = name.split_once('#')?;
        Some(
            e.parse()
                .map(|e| (base, e))
                .map_err(|_| format!("`{name}`: no expert number")),
        )
    }

    /// Adds expert `e` of `name`; returns the stacked tensor once every expert is in.
    pub(crate) fn add(
        &mut self,
        name: &str,
        e: usize,
        kind: K,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Option<Stacked<K>>, String> {
        if e >= self.experts {
            return Err(format!(
                "`{name}`: expert {e} of {} (config.json's expert count)",
                self.experts
            ));
        }
        let experts = self.experts;
        let slot = self
            .pending
            .entry(name.to_string())
            .or_insert_with(|| Pending {
                kind,
                shape: shape.to_vec(),
                parts: vec![None; experts],
            });
        if slot.kind != kind || slot.shape != shape || slot.parts[e].is_some() {
            return Err(format!(
                "`{name}`: expert {e} differs in type or shape from its siblings, or came twice"
            ));
        }
        slot.parts[e] = Some(data);
        if slot.parts.iter().any(Option::is_none) {
            return Ok(None);
        }
        let Some(done) = self.pending.remove(name) else {
            return Ok(None);
        };
        let mut full = vec![experts];
        full.extend(done.shape);
        Ok(Some((
            done.kind,
            full,
            done.parts.into_iter().flatten().flatten().collect(),
        )))
    }

    /// An error naming the first stacked tensor with experts never written.
    pub(crate) fn check_complete(&self) -> Result<(), String> {
        match self.pending.iter().next() {
            None => Ok(()),
            Some((name, p)) => {
                let missing: Vec<usize> = (0..p.parts.len())
                    .filter(|&i| p.parts[i].is_none())
                    .collect();
                Err(format!("`{name}`: experts {missing:?} were never written"))
            }
        }
    }
}

#[cfg(all(test, feature = "exec"))]
mod tests {
    use super::*;
    use crate::export::writers::WriterRegistry;
    use registry::ReaderRegistry;

    fn folder(config: &str, extra: &[&str]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), config).unwrap();
        for f in extra {
            std::fs::write(d.path().join(f), "{}").unwrap();
        }
        d
    }

    #[test]
    fn every_built_in_writer_reads_its_output_back() {
        let writers = WriterRegistry::try_global().unwrap();
        let readers = ReaderRegistry::try_global().unwrap();
        for name in ["modelopt", "compressed-tensors", "gguf", "mlx"] {
            writers.get(name).unwrap();
            assert!(
                readers.get(name).is_some_and(|e| e.construct.is_some()),
                "{name} has no reader"
            );
        }
    }

    #[test]
    fn each_reader_claims_only_its_own_output() {
        let cases = [
            (
                r#"{"quantization_config": {"quant_method": "compressed-tensors"}}"#,
                &[][..],
                Some("compressed-tensors"),
            ),
            (
                r#"{"quantization": {"bits": 4, "group_size": 64}}"#,
                &[],
                Some("mlx"),
            ),
            (
                r#"{"model_type": "llama"}"#,
                &["hf_quant_config.json"],
                Some("modelopt"),
            ),
            (
                r#"{"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}"#,
                &[],
                Some("modelopt"),
            ),
            (r#"{"model_type": "llama"}"#, &["model.gguf"], Some("gguf")),
            // A plain checkpoint, and a quantization no registered format writes.
            (r#"{"model_type": "llama"}"#, &[], None),
            (
                r#"{"quantization_config": {"quant_method": "awq"}}"#,
                &[],
                None,
            ),
            (
                r#"{"quantization_config": {"quant_method": "bitsandbytes"}}"#,
                &[],
                Some("bnb"),
            ),
        ];
        for (config, files, want) in cases {
            let d = folder(config, files);
            let got = detect(d.path()).unwrap().map(|d| d.writer);
            assert_eq!(got.as_deref(), want, "{config} {files:?}");
        }
    }

    #[test]
    fn a_folder_two_formats_claim_is_an_error_naming_both() {
        let d = folder(
            r#"{"quantization_config": {"quant_method": "compressed-tensors"}}"#,
            &["hf_quant_config.json"],
        );
        let Err(e) = detect(d.path()) else {
            panic!("two readers claim it");
        };
        let e = e.to_string();
        assert!(
            e.contains("compressed-tensors, modelopt")
                || e.contains("modelopt, compressed-tensors"),
            "{e}"
        );
    }

    #[test]
    fn a_quantization_no_reader_knows_is_refused_not_loaded_as_plain() {
        let d = folder(
            r#"{"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "awq"}}"#,
            &[],
        );
        std::fs::write(
            d.path().join("model.safetensors"),
            b"\x08\0\0\0\0\0\0\0{}      ",
        )
        .unwrap();
        let cpu = crate::model::candle::Device::Cpu;
        let e = load(d.path(), crate::model::candle::DType::F32, &cpu, false)
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains("quantization_config") && e.contains("no registered format recognises it"),
            "{e}"
        );
    }
}
