//! The format-reader registry: the read side of each output format, registered by
//! `#[writer(name = "...", reader = R)]` under the writer's name and identity (so a writer
//! that `replaces` another replaces its reader too).

use super::FormatReader;
use crate::registry::{EntryMeta, Named, RegistryEntry, RegistryError, RegistryIssue};
use std::borrow::Cow;
use std::fmt;

crate::registry::collect::collection!(
    /// Every `#[writer(reader = ...)]` reader linked into the program.
    READERS: ReaderEntry
);

/// One registered reader.
#[derive(Clone)]
pub struct ReaderEntry {
    /// Identity and source location: the writer's.
    pub meta: EntryMeta,
    /// The writer's `--output-format` name.
    pub name: Cow<'static, str>,
    /// The constructor.
    pub construct: fn() -> Box<dyn FormatReader>,
}

impl fmt::Debug for ReaderEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReaderEntry")
            .field("path", &self.meta.path)
            .field("name", &self.name)
            .field("location", &self.meta.location)
            .finish()
    }
}

/// The registered readers, by their writers' names.
pub type ReaderRegistry = Named<ReaderEntry>;

impl RegistryEntry for ReaderEntry {
    const KIND: &'static str = "reader";
    type Registry = ReaderRegistry;

    fn meta(&self) -> &EntryMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut EntryMeta {
        &mut self.meta
    }
    fn collected() -> Vec<Self> {
        collected()
    }
    fn assemble(entries: Vec<Self>) -> Result<ReaderRegistry, Vec<RegistryIssue>> {
        Named::assemble(
            entries,
            |e| e.name.as_ref(),
            |name| format!("named '{name}'"),
            "mark one `replaces = <the other>`",
        )
    }
}

impl Named<ReaderEntry> {
    /// The link-time registry, validated on first use.
    pub fn try_global() -> Result<&'static ReaderRegistry, &'static RegistryError> {
        static GLOBAL: std::sync::LazyLock<Result<ReaderRegistry, RegistryError>> =
            std::sync::LazyLock::new(crate::registry::build_static::<ReaderEntry>);
        GLOBAL.as_ref()
    }
}
