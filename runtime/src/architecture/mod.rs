//! Model families: how a checkpoint's `config.json` and tensor list become a module tree.

pub mod registry;

use crate::module_tree::{ModuleTree, TensorInfo};

/// An error building a module tree from a checkpoint, naming the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum ArchitectureError {
    /// A `config.json` field is missing or has the wrong type or value.
    #[error("config.json field `{field}`: {message}")]
    Config {
        /// The field at fault.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A tensor is missing, unexpected, or has the wrong shape.
    #[error("tensor `{tensor}`: {message}")]
    Tensor {
        /// The tensor at fault.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// The tree itself could not be built.
    #[error(transparent)]
    Tree(#[from] crate::module_tree::ModuleTreeError),
}

/// A model family. Register it with `#[architecture(names = ["...ForCausalLM"])]`.
///
/// ```
/// use kiln_runtime::{Architecture, ArchitectureError, Class, ClassChain, Linear, ModuleTree, TensorInfo};
///
/// /// Every 2-D `*.weight` is a Linear; other tensors belong to plain modules.
/// #[kiln_runtime::architecture(names = ["TinyForCausalLM"], crate = kiln_runtime)]
/// struct Tiny;
///
/// impl Architecture for Tiny {
///     fn module_tree(&self, _config: &serde_json::Value, tensors: &[TensorInfo]) -> Result<ModuleTree, ArchitectureError> {
///         let mut tree = ModuleTree::default();
///         for t in tensors {
///             let (module, local) = t.name.rsplit_once('.').unwrap_or(("", &t.name));
///             let class = if local == "weight" && t.shape.len() == 2 {
///                 ClassChain::new([Class::of::<Linear>()])
///             } else {
///                 ClassChain::new([Class::named("Module")])
///             };
///             tree.add(module, class, vec![TensorInfo { name: local.into(), ..t.clone() }])?;
///         }
///         Ok(tree)
///     }
/// }
/// ```
pub trait Architecture: Send + Sync {
    /// Builds the module tree from `config.json` and the checkpoint's tensors (full names).
    fn module_tree(
        &self,
        config: &serde_json::Value,
        tensors: &[TensorInfo],
    ) -> Result<ModuleTree, ArchitectureError>;
}
