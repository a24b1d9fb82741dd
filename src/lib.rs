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

#[cfg(feature = "cli")]
pub mod cli;

pub use kiln_kernels as kernels;
#[doc(hidden)]
pub use kiln_runtime::__private;

// The attribute macros.
pub use kiln_runtime::{architecture, exporter, reward, trainer, writer};
// The module tree exporters match on.
pub use kiln_runtime::{
    Class, ClassChain, Embedding, Linear, Module, ModuleClass, ModuleRef, ModuleTree, TensorInfo,
};
// Exporters: the trait, the context, the outcome, the formats.
pub use kiln_runtime::export::format::Format;
pub use kiln_runtime::{ExportContext, ExportError, ExportReport, ModuleExporter, ModuleOutcome};
// Trainers and architectures.
pub use kiln_runtime::{Architecture, ArchitectureError};
pub use kiln_runtime::{TrainConfig, TrainError, TrainObserver, TrainReport, Trainer};
// The registries.
pub use kiln_runtime::{
    ArchitectureEntry, ArchitectureRegistry, ExporterEntry, ExporterRegistry, Key, Match, Matcher,
    Predicate, RegistryBuilder, RegistryError, RouteError, SourceLocation, Tier, TrainerEntry,
    TrainerRegistry, resolve_trainer,
};
pub use kiln_runtime::{RewardEntry, RewardInput, RewardRegistry};
pub use kiln_runtime::{WriterEntry, WriterRegistry};

/// Exporting: what a plugin exporter calls, and what a program that runs exports needs.
pub mod export {
    pub use kiln_runtime::export::act_amax::{ActAmax, ActAmaxError, Binding};
    pub use kiln_runtime::export::format::{Format, TensorLayout};
    pub use kiln_runtime::export::recipe::{KvCache, Recipe};
    pub use kiln_runtime::export::run::{ExportOptions, ExportSummary, run};
    pub use kiln_runtime::export::stats::ErrorStats;
    pub use kiln_runtime::export::{
        ExportContext, ExportError, ExportReport, ModuleExporter, ModuleOutcome, ProgressFn,
        full_name, is_moe, plan, quantize_linear, quantize_module, quantize_weight, walk,
    };
    /// Output writers (`--output-format`): what a user crate implements to add a format.
    pub mod writer {
        pub use kiln_runtime::export::writer::*;
    }
}

/// Output formats' read side: what a plugin writer's reader implements, and the registry
/// dispatch `kiln eval` and `kiln verify` go through.
pub mod formats {
    #[cfg(feature = "exec")]
    pub use kiln_runtime::formats::{
        Detected, Loaded, check, detect, load, load_model, load_weights, verify,
    };
    pub use kiln_runtime::formats::{FormatReader, folder_config};
}

/// The input checkpoint: memory-mapped safetensors and `config.json`.
pub mod checkpoint {
    pub use kiln_runtime::checkpoint::*;
}

/// Where an export's output goes: the temporary folder and the safetensors shards.
pub mod sink {
    pub use kiln_runtime::sink::*;
}

/// Running a model (candle): the decoder, its weights, evaluation and verification — what a
/// format's reader returns and checks.
#[cfg(feature = "exec")]
pub mod model {
    pub use kiln_runtime::model::*;
}

/// Training: the trainer interface and what a trainer reports.
pub mod train {
    pub use kiln_runtime::train::*;
}
