//! kiln's runtime: the compile-time registries (exporters, trainers, architectures), the
//! module tree exporters match on, the export walk and the trainer interface.
//!
//! Registries are filled by the `#[exporter]`, `#[trainer]` and `#[architecture]` macros
//! (re-exported by the `kiln` facade) and sorted once, on first use:
//!
//! ```
//! use kiln_runtime::registry::exporters::ExporterRegistry;
//!
//! let exporters = ExporterRegistry::try_global().expect("valid registry");
//! for e in exporters.entries() {
//!     println!("{} ({})", e.meta.path, e.meta.location);
//! }
//! ```

#![warn(missing_docs)]

pub mod architecture;
pub mod checkpoint;
pub mod demo;
pub mod export;
pub mod families;
pub mod gguf;
pub mod glob;
#[cfg(feature = "exec")]
pub mod model;
pub mod module_tree;
pub mod registry;
pub mod sink;
pub mod train;
pub mod writers;

pub use architecture::{Architecture, ArchitectureError};
pub use export::{ExportContext, ExportError, ExportReport, ModuleExporter, ModuleOutcome};
pub use kiln_macros::{architecture, exporter, reward, trainer, writer};
pub use module_tree::{
    Class, ClassChain, Embedding, Linear, Module, ModuleClass, ModuleRef, ModuleTree, TensorInfo,
};
pub use registry::architectures::{ArchitectureEntry, ArchitectureRegistry};
pub use registry::exporters::{ExporterEntry, ExporterRegistry, Key, Match, Matcher, Predicate};
pub use registry::rewards::{RewardEntry, RewardInput, RewardRegistry};
pub use registry::trainers::{RouteError, TrainerEntry, TrainerRegistry, resolve_trainer};
pub use registry::writers::{WriterEntry, WriterRegistry};
pub use registry::{RegistryBuilder, RegistryError, SourceLocation, Tier};
pub use train::{TrainConfig, TrainError, TrainObserver, TrainReport, Trainer};

/// What the macros' generated code names. Not a stable API.
#[doc(hidden)]
pub mod __private {
    pub use crate::registry::architectures::ArchitectureEntry;
    #[cfg(not(feature = "inventory"))]
    pub use crate::registry::collect::{ARCHITECTURES, EXPORTERS, REWARDS, TRAINERS, WRITERS};
    pub use crate::registry::exporters::{ExporterEntry, Key, Predicate, PredicateFn};
    pub use crate::registry::rewards::{RewardEntry, RewardFn};
    pub use crate::registry::trainers::TrainerEntry;
    pub use crate::registry::writers::WriterEntry;
    pub use crate::registry::{EntryMeta, Replaces, SourceLocation, Tier};
    #[cfg(feature = "inventory")]
    pub use inventory;
    pub use linkme;
    pub use std::borrow::Cow;

    use crate::{Architecture, ModuleExporter, TrainConfig, TrainError, Trainer};
    use std::any::TypeId;

    /// Boxes an exporter; spanned at the user's type so a missing impl is reported there.
    pub fn boxed_exporter<T: ModuleExporter + 'static>(value: T) -> Box<dyn ModuleExporter> {
        Box::new(value)
    }

    /// Constructs and boxes a trainer.
    pub fn boxed_trainer<T: Trainer + 'static>(
        config: &TrainConfig,
    ) -> Result<Box<dyn Trainer>, TrainError> {
        Ok(Box::new(T::new(config)?))
    }

    /// Constructs and boxes a writer; spanned at the user's type.
    pub fn boxed_writer<T: crate::export::writer::WriterType>(
        format: &str,
    ) -> Result<Box<dyn crate::export::writer::OutputWriter>, crate::ExportError> {
        Ok(Box::new(T::new(format)?))
    }

    /// A writer type's formats.
    pub fn writer_formats<T: crate::export::writer::WriterType>()
    -> Vec<(&'static str, std::string::String)> {
        T::formats()
    }

    /// The `TypeId` of a writer type named in `replaces`.
    pub fn writer_type_id<T: crate::export::writer::WriterType>() -> TypeId {
        TypeId::of::<T>()
    }

    /// Boxes an architecture.
    pub fn boxed_architecture<T: Architecture + 'static>(value: T) -> Box<dyn Architecture> {
        Box::new(value)
    }

    /// The `TypeId` of an exporter type named in `replaces` (checks that it is one).
    pub fn exporter_type_id<T: ModuleExporter + 'static>() -> TypeId {
        TypeId::of::<T>()
    }

    /// The `TypeId` of a trainer type named in `replaces`.
    pub fn trainer_type_id<T: Trainer + 'static>() -> TypeId {
        TypeId::of::<T>()
    }

    /// The `TypeId` of an architecture type named in `replaces`.
    pub fn architecture_type_id<T: Architecture + 'static>() -> TypeId {
        TypeId::of::<T>()
    }
}
