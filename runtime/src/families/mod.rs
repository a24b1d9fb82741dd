//! kiln's built-in model families, registered with the same `#[architecture]` users write.
//!
//! A family turns a checkpoint's tensor names into a module tree with the class names
//! transformers gives those modules (`LlamaDecoderLayer`, `Qwen3MoeSparseMoeBlock`,
//! `GptOssExperts`, …), which is what exporters key on. Paths a family does not know are
//! classified generically (a 2-D `weight` is a `Linear`), so a checkpoint with extra modules
//! still exports.

mod decoder;
mod generic;

pub use decoder::{DecoderFamily, MoeLayout};

use crate::architecture::ArchitectureError;
use crate::architecture::registry::{ArchitectureMatch, ArchitectureRegistry};
use crate::checkpoint::Checkpoint;
use crate::module_tree::{ModuleTree, TensorInfo};
use crate::registry::RegistryError;
use serde_json::Value;

/// A checkpoint's family, resolved: what every command that reads a model (export, eval,
/// calibration, training) learns of it from the architecture registry.
#[derive(Debug)]
pub struct Resolved {
    /// The module tree, with the class names transformers gives the modules.
    pub tree: ModuleTree,
    /// The `config.json` architecture (or its `model_type` when it names none).
    pub architecture: String,
    /// Set when no family claimed the architecture and the generic tree was built.
    pub generic_fallback: bool,
}

/// Why a checkpoint's family could not be resolved.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The architecture registry failed validation.
    #[error(transparent)]
    InvalidRegistry(#[from] RegistryError),
    /// No entry builds this architecture and none is a fallback.
    #[error("no architecture registered for `{name}` and no fallback")]
    NoArchitecture {
        /// The `config.json` architecture (or `model_type`).
        name: String,
    },
    /// The family refused the checkpoint (a tensor its config implies is missing, a shape).
    #[error("{}: {source}", dir.display())]
    ModuleTree {
        /// The model folder.
        dir: std::path::PathBuf,
        /// The family's error.
        source: ArchitectureError,
    },
}

/// The family of `checkpoint`, through the architecture registry: the entry named by
/// `config.json`'s architecture (else its `model_type`), or the fallback; the module tree it
/// builds from the config and the tensor list, with its shape checks.
pub fn resolve(checkpoint: &Checkpoint) -> Result<Resolved, ResolveError> {
    let registry = ArchitectureRegistry::try_global().map_err(|e| e.clone())?;
    let config = checkpoint.config();
    let name = config
        .architecture()
        .or_else(|| config.raw().get("model_type").and_then(Value::as_str))
        .unwrap_or("")
        .to_string();
    let (entry, generic_fallback) = match registry.resolve(&name) {
        Some(ArchitectureMatch::Named(e)) => (e, false),
        Some(ArchitectureMatch::Fallback(e)) => (e, true),
        None => return Err(ResolveError::NoArchitecture { name }),
    };
    let tensors: Vec<TensorInfo> = checkpoint
        .tensors()
        .map(|t| TensorInfo {
            name: t.name.clone(),
            shape: t.shape.clone(),
            dtype: format!("{:?}", t.dtype),
        })
        .collect();
    let tree = (entry.construct)()
        .module_tree(&Value::Object(config.raw().clone()), &tensors)
        .map_err(|source| ResolveError::ModuleTree {
            dir: checkpoint.dir().to_path_buf(),
            source,
        })?;
    Ok(Resolved {
        tree,
        architecture: name,
        generic_fallback,
    })
}

#[cfg(test)]
mod tests;
