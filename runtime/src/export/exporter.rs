//! The exporter trait: the two hooks a registered exporter implements. A leaf module — the
//! registry and the walk depend on it, it depends on neither.

use super::{ExportContext, ExportError};
use crate::module_tree::ModuleRef;

/// The two hooks of an exporter. Both default to doing nothing.
pub trait ModuleExporter: Send + Sync {
    /// Called once per MoE block whose experts container this exporter matched, before any
    /// `export`: fill missing expert input statistics and the like.
    fn prepare_moe_inputs(
        &self,
        name: &str,
        moe_block: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, moe_block, ctx);
        Ok(())
    }

    /// Emits the module's output into `ctx`.
    fn export(
        &self,
        name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, module, ctx);
        Ok(())
    }
}
