//! Link-time collection of registry entries.
//!
//! With the default build the macros emit `linkme` distributed-slice elements; with feature
//! `inventory` they emit `inventory::submit!` (for targets without linker sections). Only a
//! crate that is linked contributes entries: a plugin crate that nothing references is
//! dropped by the linker, so applications write `use my_plugins as _;`.

use super::architectures::ArchitectureEntry;
use super::exporters::ExporterEntry;
use super::rewards::RewardEntry;
use super::trainers::TrainerEntry;
use super::writers::WriterEntry;

#[cfg(not(feature = "inventory"))]
mod imp {
    use super::*;

    /// Every `#[exporter]` entry linked into the program.
    #[linkme::distributed_slice]
    pub static EXPORTERS: [ExporterEntry];

    /// Every `#[trainer]` entry linked into the program.
    #[linkme::distributed_slice]
    pub static TRAINERS: [TrainerEntry];

    /// Every `#[architecture]` entry linked into the program.
    #[linkme::distributed_slice]
    pub static ARCHITECTURES: [ArchitectureEntry];

    /// Every `#[reward]` entry linked into the program.
    #[linkme::distributed_slice]
    pub static REWARDS: [RewardEntry];

    /// Every `#[writer]` entry linked into the program.
    #[linkme::distributed_slice]
    pub static WRITERS: [WriterEntry];

    pub(crate) fn writers() -> Vec<WriterEntry> {
        WRITERS.to_vec()
    }

    pub(crate) fn rewards() -> Vec<RewardEntry> {
        REWARDS.to_vec()
    }

    pub(crate) fn exporters() -> Vec<ExporterEntry> {
        EXPORTERS.to_vec()
    }
    pub(crate) fn trainers() -> Vec<TrainerEntry> {
        TRAINERS.to_vec()
    }
    pub(crate) fn architectures() -> Vec<ArchitectureEntry> {
        ARCHITECTURES.to_vec()
    }
}

#[cfg(feature = "inventory")]
mod imp {
    use super::*;

    inventory::collect!(ExporterEntry);
    inventory::collect!(TrainerEntry);
    inventory::collect!(ArchitectureEntry);
    inventory::collect!(RewardEntry);
    inventory::collect!(WriterEntry);

    pub(crate) fn writers() -> Vec<WriterEntry> {
        inventory::iter::<WriterEntry>
            .into_iter()
            .cloned()
            .collect()
    }

    pub(crate) fn rewards() -> Vec<RewardEntry> {
        inventory::iter::<RewardEntry>
            .into_iter()
            .cloned()
            .collect()
    }

    pub(crate) fn exporters() -> Vec<ExporterEntry> {
        inventory::iter::<ExporterEntry>
            .into_iter()
            .cloned()
            .collect()
    }
    pub(crate) fn trainers() -> Vec<TrainerEntry> {
        inventory::iter::<TrainerEntry>
            .into_iter()
            .cloned()
            .collect()
    }
    pub(crate) fn architectures() -> Vec<ArchitectureEntry> {
        inventory::iter::<ArchitectureEntry>
            .into_iter()
            .cloned()
            .collect()
    }
}

#[cfg(not(feature = "inventory"))]
pub use imp::{ARCHITECTURES, EXPORTERS, REWARDS, TRAINERS, WRITERS};
pub(crate) use imp::{architectures, exporters, rewards, trainers, writers};

/// The collection mechanism this build uses: "linkme" or "inventory".
pub const MECHANISM: &str = if cfg!(feature = "inventory") {
    "inventory"
} else {
    "linkme"
};
