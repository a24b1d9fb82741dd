//! The architecture registry: `config.json`'s `architectures[0]` → the family that builds
//! the module tree; a `fallback` entry takes names nobody claims.

use crate::architecture::Architecture;
use crate::registry::{EntryMeta, Registry, RegistryEntry, RegistryError, RegistryIssue};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

crate::registry::collect::collection!(
    /// Every `#[architecture]` entry linked into the program.
    ARCHITECTURES: ArchitectureEntry
);

/// One architecture registration.
#[derive(Clone)]
pub struct ArchitectureEntry {
    /// Identity, ordering and source location.
    pub meta: EntryMeta,
    /// The `config.json` architecture names this family builds (empty for a pure fallback).
    pub names: Cow<'static, [Cow<'static, str>]>,
    /// Makes the architecture.
    pub construct: fn() -> Box<dyn Architecture>,
}

impl fmt::Debug for ArchitectureEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ArchitectureEntry")
            .field("path", &self.meta.path)
            .field("names", &self.names)
            .field("tier", &self.meta.tier)
            .field("location", &self.meta.location)
            .finish()
    }
}

impl RegistryEntry for ArchitectureEntry {
    const KIND: &'static str = "architecture";
    type Registry = ArchitectureRegistry;

    fn meta(&self) -> &EntryMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut EntryMeta {
        &mut self.meta
    }
    fn collected() -> Vec<Self> {
        collected()
    }
    fn assemble(entries: Vec<Self>) -> Result<ArchitectureRegistry, Vec<RegistryIssue>> {
        let by_name = crate::registry::index_by_name(
            &entries,
            |e| e.names.iter().map(|n| n.to_string()).collect(),
            |name| format!("for '{name}'"),
            "mark one `replaces = <the other>`",
        )?;
        let fallback = entries
            .iter()
            .position(|e| e.meta.tier == crate::registry::Tier::Fallback);
        Ok(ArchitectureRegistry {
            core: Registry::from_sorted(entries),
            by_name,
            fallback,
        })
    }
}

/// How an architecture was chosen.
#[derive(Debug, Clone, Copy)]
pub enum ArchitectureMatch<'r> {
    /// An entry lists the name.
    Named(&'r ArchitectureEntry),
    /// No entry lists it; the first `fallback` entry takes it.
    Fallback(&'r ArchitectureEntry),
}

/// The sorted architectures.
#[derive(Debug)]
pub struct ArchitectureRegistry {
    core: Registry<ArchitectureEntry>,
    by_name: BTreeMap<String, usize>,
    fallback: Option<usize>,
}

impl ArchitectureRegistry {
    /// The architectures in registry order.
    pub fn entries(&self) -> &[ArchitectureEntry] {
        self.core.entries()
    }

    /// The link-time registry, validated and sorted on first use.
    pub fn try_global() -> Result<&'static ArchitectureRegistry, &'static RegistryError> {
        static GLOBAL: std::sync::LazyLock<Result<ArchitectureRegistry, RegistryError>> =
            std::sync::LazyLock::new(crate::registry::build_static::<ArchitectureEntry>);
        GLOBAL.as_ref()
    }

    /// The family for a `config.json` architecture name, or the fallback, or `None`.
    pub fn resolve(&self, name: &str) -> Option<ArchitectureMatch<'_>> {
        match self.by_name.get(name) {
            Some(&i) => Some(ArchitectureMatch::Named(&self.entries()[i])),
            None => self
                .fallback
                .map(|i| ArchitectureMatch::Fallback(&self.entries()[i])),
        }
    }
}
