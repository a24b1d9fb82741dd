//! The exporter hooks, the per-call export context, and the module walk.
//!
//! An export call creates one [`ExportContext`], walks the module tree in pre-order, calls
//! `prepare_moe_inputs` for every MoE block whose experts container an exporter takes, then
//! `export` for every module with the first matching exporter (docs/DESIGN.md §4). Exporters are
//! constructed once per call, on first use; nothing about an export outlives the call.

pub mod act_amax;
mod context;
pub mod engines;
mod error;
pub mod experts;
pub mod exporter;
pub mod files;
pub mod format;
pub mod groups;
pub mod linear;
pub mod moe;
pub mod preflight;
pub mod quantize;
pub mod recipe;
pub mod registry;
mod report;
pub mod run;
pub mod scales;
pub mod smooth;
pub mod stats;
mod walk;
pub mod writer;
pub mod writers;

pub use context::{ExportContext, ProgressFn, full_name};
pub use error::ExportError;
pub use exporter::ModuleExporter;
pub use quantize::{quantize_linear, quantize_module, quantize_weight};
pub use report::{ExportReport, ModuleOutcome};
pub use walk::{is_moe, plan, walk};

#[cfg(test)]
mod tests;
