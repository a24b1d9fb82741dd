//! Reading a Hugging Face model folder: `config.json` and safetensors weights, one file or
//! shards with `model.safetensors.index.json`.
//!
//! Nothing is read eagerly but the headers: a tensor's bytes are read when asked for, with a
//! positioned read into the caller's buffer, so memory stays bounded by the tensors in flight
//! (and no `unsafe` is needed, as a memory map would be). Every malformed input is a named
//! error that says which file, tensor or field is wrong; nothing here panics on user input,
//! and nothing writes to the model folder.

mod config;
pub mod floats;
mod shard;

pub use config::ModelConfig;
pub use safetensors::Dtype;
pub use shard::{Shard, TensorMeta};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The single-file weights name.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index name.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Why a checkpoint could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A file could not be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The folder has neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors or model.safetensors.index.json", dir.display())]
    NoWeights {
        /// The folder searched.
        dir: PathBuf,
    },
    /// A safetensors header is malformed (too short, length past the end, not JSON).
    #[error("{}: {message}", file.display())]
    Header {
        /// The file involved.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A tensor's entry is malformed (dtype, shape, byte length).
    #[error("{}: tensor `{tensor}`: {message}", file.display())]
    Tensor {
        /// The file involved.
        file: PathBuf,
        /// The tensor at fault.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The index file is malformed or contradicts the shards.
    #[error("{}: {message}", file.display())]
    Index {
        /// The file involved.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// `config.json` is missing, malformed, or has a missing or contradictory field.
    #[error("{}: {message}", file.display())]
    Config {
        /// The file involved.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Tensor name → (shard, index in that shard), sorted by name.
type TensorMap = BTreeMap<String, (usize, usize)>;

/// An opened model folder: its config, its shards' headers and where each tensor lives.
#[derive(Debug)]
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    tensors: TensorMap,
}

impl Checkpoint {
    /// Opens `dir`: parses `config.json` and every safetensors header, checks the index
    /// against the shards. Reads no tensor data.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self, CheckpointError> {
        let dir = dir.as_ref().to_path_buf();
        let config = ModelConfig::read(&dir.join("config.json"))?;
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let (shards, tensors) = if index_path.exists() {
            Self::open_sharded(&dir, &index_path)?
        } else if single.exists() {
            let shard = Shard::open(&single)?;
            let tensors = shard
                .tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), (0, i)))
                .collect();
            (vec![shard], tensors)
        } else {
            return Err(CheckpointError::NoWeights { dir });
        };
        Ok(Checkpoint {
            dir,
            config,
            shards,
            tensors,
        })
    }

    fn open_sharded(
        dir: &Path,
        index_path: &Path,
    ) -> Result<(Vec<Shard>, TensorMap), CheckpointError> {
        let bad = |message: String| CheckpointError::Index {
            file: index_path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(index_path).map_err(io(index_path))?;
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let map = doc
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("missing object field `weight_map`".into()))?;
        // Shard files in order of first appearance in a sorted listing (deterministic).
        let mut files: Vec<String> = Vec::new();
        let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[`{tensor}`] is not a file name")))?;
            if file.is_empty() || file.contains(['/', '\\']) || file == "." || file == ".." {
                return Err(bad(format!(
                    "weight_map[`{tensor}`] = {file:?} is not a plain file name in the model folder"
                )));
            }
            if !files.iter().any(|f| f == file) {
                files.push(file.to_string());
            }
            wanted.insert(tensor, file);
        }
        files.sort();
        let mut shards = Vec::with_capacity(files.len());
        for f in &files {
            let path = dir.join(f);
            if !path.exists() {
                return Err(bad(format!("names shard `{f}`, which does not exist")));
            }
            shards.push(Shard::open(&path)?);
        }
        let mut tensors = BTreeMap::new();
        for (s, (file, shard)) in files.iter().zip(&shards).enumerate() {
            for (i, t) in shard.tensors().iter().enumerate() {
                match wanted.get(t.name.as_str()) {
                    Some(f) if f == file => {
                        tensors.insert(t.name.clone(), (s, i));
                    }
                    Some(f) => {
                        return Err(bad(format!(
                            "lists tensor `{}` in `{f}`, but it is in `{file}`",
                            t.name
                        )));
                    }
                    None => {
                        return Err(bad(format!(
                            "does not list tensor `{}` of shard `{file}`",
                            t.name
                        )));
                    }
                }
            }
        }
        if let Some((tensor, file)) = wanted.iter().find(|(t, _)| !tensors.contains_key(**t)) {
            return Err(bad(format!(
                "lists tensor `{tensor}` in `{file}`, which does not contain it"
            )));
        }
        Ok((shards, tensors))
    }

    /// The model folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Every tensor's metadata, sorted by name.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorMeta> + '_ {
        self.tensors
            .values()
            .map(|&(s, i)| &self.shards[s].tensors()[i])
    }

    /// One tensor's metadata.
    pub fn tensor(&self, name: &str) -> Option<&TensorMeta> {
        self.tensors
            .get(name)
            .map(|&(s, i)| &self.shards[s].tensors()[i])
    }

    /// The number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint has no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The shard and index of tensor `name`, or a named error.
    fn locate(&self, name: &str) -> Result<(usize, usize), CheckpointError> {
        self.tensors
            .get(name)
            .copied()
            .ok_or_else(|| CheckpointError::Tensor {
                file: self.dir.clone(),
                tensor: name.to_string(),
                message: "no such tensor in the checkpoint".into(),
            })
    }

    /// Reads tensor `name`'s bytes into `buf` (resized to fit).
    pub fn read(&self, name: &str, buf: &mut Vec<u8>) -> Result<(), CheckpointError> {
        let (s, i) = self.locate(name)?;
        self.shards[s].read(i, buf)
    }

    /// Reads tensor `name` as elements of `T` (its dtype must have `T`'s size), straight into
    /// a vector of `T` — no intermediate byte buffer.
    pub fn read_as<T: bytemuck::Pod>(&self, name: &str) -> Result<Vec<T>, CheckpointError> {
        let (s, i) = self.locate(name)?;
        self.shards[s].read_as(i)
    }

    /// Reads elements `start..start + len` (flat, row-major) of tensor `name` as `T`.
    pub fn read_range_as<T: bytemuck::Pod>(
        &self,
        name: &str,
        start: usize,
        len: usize,
    ) -> Result<Vec<T>, CheckpointError> {
        let (s, i) = self.locate(name)?;
        self.shards[s].read_range_as(i, start, len)
    }

    /// Total bytes of tensor data.
    pub fn data_bytes(&self) -> u64 {
        self.tensors().map(|t| t.byte_len()).sum()
    }
}

#[cfg(test)]
mod tests;
