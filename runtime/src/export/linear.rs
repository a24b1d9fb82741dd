//! The built-in exporter for `Linear` modules (ModelOpt's `_export_quant_linear`): quantizes
//! `weight` with the recipe's format and writes ModelOpt's tensors (docs/FORMATS.md §2); excluded
//! Linears (`lm_head`, routers, `--exclude`) are copied unchanged. Any other tensor the module
//! owns (`bias`) is copied unchanged.

use super::quantize::{quantize_module, scalar};
use super::{ExportContext, ExportError, ModuleExporter, full_name};
use crate::module_tree::{Linear, ModuleRef};
use safetensors::Dtype;

/// Quantizes every `Linear` the recipe selects.
#[crate::exporter(keys = [Linear], crate = crate)]
#[derive(Debug, Default)]
pub struct QuantLinear;
impl ModuleExporter for QuantLinear {
    fn export(
        &self,
        name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        if !ctx.is_exporting() {
            return Ok(());
        }
        let recipe = ctx.recipe()?;
        kv_cache_scale(name, module, ctx)?;
        if !recipe.quantizes(name) || module.tensor("weight").is_none() {
            return ctx.copy_module(module);
        }
        quantize_module(ctx, module)
    }
}

/// With `--kv-cache`, an attention's `k_proj` / `v_proj` carry the KV-cache scale:
/// `<attention>.k_proj.k_scale = k_bmm amax / 448` (likewise `v`), the same formula for FP8 and
/// NVFP4 KV (docs/FORMATS.md "KV cache"), under ModelOpt's writer. Without a calibrated amax no scale is written — ModelOpt's
/// constant-amax default — while `kv_cache_quant_algo` still names the format.
fn kv_cache_scale(
    name: &str,
    module: ModuleRef<'_>,
    ctx: &ExportContext,
) -> Result<(), ExportError> {
    // A writer with an encoder of its own names and computes its own KV scales (from
    // `WriterStart::statistics`).
    if ctx.recipe()?.kv_cache.is_none() || ctx.encoding()? == crate::export::writer::Encoding::Own {
        return Ok(());
    }
    let which = match module.local_name() {
        "k_proj" => 'k',
        "v_proj" => 'v',
        _ => return Ok(()),
    };
    let Some(attention) = module
        .parent()
        .filter(|p| p.class_name().ends_with("Attention"))
    else {
        return Ok(());
    };
    if let Some(amax) = ctx.kv_amax(attention.path(), which)? {
        ctx.emit(
            &full_name(name, &format!("{which}_scale")),
            Dtype::F32,
            &[],
            &scalar(amax / 448.0),
        )?;
    }
    Ok(())
}
