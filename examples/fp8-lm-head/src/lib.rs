//! An example plugin crate — copy it to start your own.
//!
//! kiln leaves `lm_head` unquantized, as ModelOpt does. Some deployments want it in FP8
//! anyway. This crate registers one exporter, ahead of kiln's built-ins (`prepend`), that takes
//! the module named `lm_head` and quantizes it with kiln's own FP8 rules through
//! [`kiln::export::quantize_linear`]: the tensors are ModelOpt's (`weight` F8_E4M3,
//! `weight_scale`, `input_scale`), and the declaration it makes is what the exported
//! `hf_quant_config.json` and `config.json` report — `lm_head` is no longer listed as excluded,
//! and an export in another format becomes ModelOpt's `MIXED_PRECISION`.
//!
//! `src/main.rs` is the other half: a `kiln` binary that links this crate (`use ... as _;`),
//! without which the exporter would silently not be registered.

use kiln::export::{ExportContext, ExportError, ModuleExporter, quantize_linear};
use kiln::{Format, ModuleRef, exporter};

/// Quantizes `lm_head` to FP8 with per-tensor scales, whatever the export's `--format`.
/// The FP8 input scale needs `lm_head.input_quantizer` in `--act-amax` (or `--calib`).
#[exporter(predicate = is_lm_head, prepend)]
#[derive(Debug, Default)]
pub struct Fp8LmHead;

/// Whether `m` is the output projection.
pub fn is_lm_head(m: &ModuleRef<'_>) -> bool {
    m.path() == "lm_head"
}

impl ModuleExporter for Fp8LmHead {
    fn export(
        &self,
        _name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        quantize_linear(ctx, module, Format::Fp8)
    }
}
