//! The fallback family: a module tree inferred from tensor names alone, for architectures no
//! family claims. The export prints a warning when it is used.

use crate::architecture::{Architecture, ArchitectureError};
use crate::module_tree::{ModuleTree, TensorInfo};

/// Infers the tree from tensor names: a 2-D `weight` makes a `Linear` (an `Embedding` when the
/// path says `embed`), 3-D expert stacks make a fused-experts module, numbered children make a
/// `ModuleList`.
#[crate::architecture(fallback, crate = crate)]
#[derive(Debug, Default)]
pub struct GenericDecoder;

impl Architecture for GenericDecoder {
    fn module_tree(
        &self,
        config: &serde_json::Value,
        tensors: &[TensorInfo],
    ) -> Result<ModuleTree, ArchitectureError> {
        let root = config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .unwrap_or("GenericForCausalLM")
            .to_string();
        super::decoder::build(tensors, |path, own| {
            super::decoder::generic_class(&root, path, own)
        })
    }
}
