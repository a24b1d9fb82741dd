//! kiln's runtime: the compile-time registries (exporters, trainers, architectures), the
//! module tree exporters match on, the export walk and the trainer interface.
//!
//! Registries are filled by the `#[exporter]`, `#[trainer]` and `#[architecture]` macros
//! (re-exported by the `kiln` facade) and sorted once, on first use:
//!
//! ```
//! use kiln_runtime::export::registry::ExporterRegistry;
//!
//! let exporters = ExporterRegistry::try_global().expect("valid registry");
//! for e in exporters.entries() {
//!     println!("{} ({})", e.meta.path, e.meta.location);
//! }
//! ```

#![warn(missing_docs)]

#[cfg(feature = "exec")]
pub mod adapters;
pub mod architecture;
#[cfg(feature = "exec")]
pub mod calibrate;
pub mod checkpoint;
pub mod demo;
pub mod export;
pub mod families;
pub mod formats;

pub mod glob;
#[cfg(feature = "exec")]
pub mod model;
pub mod module_tree;
pub mod registry;
pub mod rng;
pub mod sink;
pub mod train;

pub use architecture::registry::{ArchitectureEntry, ArchitectureRegistry};
pub use architecture::{Architecture, ArchitectureError};
pub use export::registry::{ExporterEntry, ExporterRegistry, Key, Match, Matcher, Predicate};
pub use export::writers::{WriterEntry, WriterRegistry};
pub use export::{ExportContext, ExportError, ExportReport, ModuleExporter, ModuleOutcome};
pub use formats::registry::{ReaderEntry, ReaderRegistry};
pub use kiln_macros::{architecture, exporter, reward, trainer, writer};
pub use module_tree::{
    Class, ClassChain, Embedding, Linear, Module, ModuleClass, ModuleRef, ModuleTree, TensorInfo,
};
pub use registry::{RegistryBuilder, RegistryError, SourceLocation, Tier};
pub use train::registry::{RouteError, TrainerEntry, TrainerRegistry, resolve_trainer};
pub use train::reward_registry::{RewardEntry, RewardInput, RewardRegistry};
pub use train::{TrainConfig, TrainError, TrainObserver, TrainReport, Trainer};

/// What the macros' generated code names. Not a stable API.
#[doc(hidden)]
pub mod __private {
    #[cfg(not(feature = "inventory"))]
    pub use crate::architecture::registry::ARCHITECTURES;
    pub use crate::architecture::registry::ArchitectureEntry;
    #[cfg(not(feature = "inventory"))]
    pub use crate::export::registry::EXPORTERS;
    pub use crate::export::registry::{ExporterEntry, Key, Predicate, PredicateFn};
    #[cfg(not(feature = "inventory"))]
    pub use crate::export::writers::WRITERS;
    pub use crate::export::writers::WriterEntry;
    #[cfg(not(feature = "inventory"))]
    pub use crate::formats::registry::READERS;
    pub use crate::formats::registry::ReaderEntry;
    pub use crate::registry::{EntryMeta, Replaces, SourceLocation, Tier};
    #[cfg(not(feature = "inventory"))]
    pub use crate::train::registry::TRAINERS;
    pub use crate::train::registry::TrainerEntry;
    #[cfg(not(feature = "inventory"))]
    pub use crate::train::reward_registry::REWARDS;
    pub use crate::train::reward_registry::{RewardEntry, RewardFn};
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

    /// Constructs and boxes a format reader named in `#[writer(reader = ...)]`.
    pub fn boxed_reader<T: crate::formats::FormatReader + Default + 'static>()
    -> std::boxed::Box<dyn crate::formats::FormatReader> {
        std::boxed::Box::new(T::default())
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
