//! The output writers other than ModelOpt's (`--output-format`, docs/DESIGN.md §7).

pub mod compressed_tensors;
pub mod gguf;
pub mod mlx;

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
