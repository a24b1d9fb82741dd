//! The exporter trait: the two hooks a registered exporter implements. A leaf module — the
//! registry and the walk depend on it, it depends on neither.

use super::{ExportContext, ExportError};
use crate::module_tree::ModuleRef;

/// The two hooks of an exporter. Both default to doing nothing.
pub trait ModuleExporter: Send + Sync {
    /// Called once per MoE block whose experts container this exporter matched, before any
    /// `export`: fill missing expert input statistics and the like. A default substituted for
    /// something missing is said by name with [`ExportContext::warn`].
    ///
    /// ```
    /// use kiln_runtime::export::{ExportContext, ExportError, ModuleExporter};
    /// use kiln_runtime::ModuleRef;
    ///
    /// /// Takes experts lists (numbered children named `experts`) and gives an expert without
    /// /// statistics its siblings' max.
    /// #[kiln_runtime::exporter(predicate = is_experts_list, crate = kiln_runtime)]
    /// struct MyExperts;
    ///
    /// fn is_experts_list(m: &ModuleRef<'_>) -> bool {
    ///     m.local_name() == "experts" && m.children().all(|c| c.local_name().parse::<u32>().is_ok())
    /// }
    ///
    /// impl ModuleExporter for MyExperts {
    ///     fn prepare_moe_inputs(&self, _: &str, block: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
    ///         let Some(experts) = block.child("experts") else { return Ok(()) };
    ///         let downs: Vec<String> = experts
    ///             .children()
    ///             .filter_map(|e| e.child("down_proj"))
    ///             .map(|l| l.path().to_string())
    ///             .collect();
    ///         let mut max = None::<f32>;
    ///         for m in &downs {
    ///             if let Some(a) = ctx.input_amax(m)? {
    ///                 max = Some(max.map_or(a, |b| b.max(a)));
    ///             }
    ///         }
    ///         for m in &downs {
    ///             if let (None, Some(fill)) = (ctx.input_amax(m)?, max) {
    ///                 ctx.set_input_amax(m, fill)?;
    ///                 ctx.warn(m, format!("input amax filled with {fill}"));
    ///             }
    ///         }
    ///         Ok(())
    ///     }
    /// }
    /// ```
    fn prepare_moe_inputs(
        &self,
        name: &str,
        moe_block: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, moe_block, ctx);
        Ok(())
    }

    /// Emits the module's output into `ctx`: tensors with [`ExportContext::emit`] or
    /// [`ExportContext::copy_module`], and for every module it quantizes a declaration
    /// ([`ExportContext::record_quantized`]; [`crate::export::quantize_linear`] and
    /// [`crate::export::quantize_weight`] declare for you).
    ///
    /// ```
    /// use kiln_runtime::export::recipe::Format;
    /// use kiln_runtime::export::{ExportContext, ExportError, ModuleExporter, quantize_linear};
    /// use kiln_runtime::{Linear, ModuleRef};
    ///
    /// /// Every `o_proj` in MXFP8, whatever the export's format; other Linears are left to the
    /// /// built-in exporter (this one is not asked about them).
    /// #[kiln_runtime::exporter(keys = [Linear], predicate = is_o_proj, prepend, crate = kiln_runtime)]
    /// struct Mxfp8OProj;
    ///
    /// fn is_o_proj(m: &ModuleRef<'_>) -> bool {
    ///     m.local_name() == "o_proj"
    /// }
    ///
    /// impl ModuleExporter for Mxfp8OProj {
    ///     fn export(&self, _: &str, module: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
    ///         quantize_linear(ctx, module, Format::Mxfp8)
    ///     }
    /// }
    /// ```
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
