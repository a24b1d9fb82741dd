//! kiln turns trained models into deployable ones and fine-tunes them.
//!
//! This facade re-exports the runtime (registries, module tree, export walk, trainer
//! interface), the attribute macros and the kernels, and holds the `kiln` command line.
//! A handler for a new module type is one annotated type in your own crate:
//!
//! ```
//! use kiln::{exporter, ExportContext, ExportError, Linear, ModuleExporter, ModuleRef};
//!
//! /// Takes every Linear ahead of kiln's built-in exporters.
//! #[exporter(keys = [Linear], prepend)]
//! struct MyLinear;
//!
//! impl ModuleExporter for MyLinear {
//!     fn export(&self, name: &str, _m: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
//!         ctx.note(name, "handled by MyLinear");
//!         Ok(())
//!     }
//! }
//!
//! let exporters = kiln::ExporterRegistry::try_global().unwrap();
//! assert!(exporters.entries().iter().any(|e| e.meta.path.ends_with("::MyLinear")));
//! ```
//!
//! Entries are collected at link time: a plugin crate that nothing references is not linked
//! and its entries vanish. Reference it from your binary with `use my_plugins as _;`.

#![warn(missing_docs)]

pub mod cli;

pub use kiln_kernels as kernels;
#[doc(hidden)]
pub use kiln_runtime::__private;
pub use kiln_runtime::*;
