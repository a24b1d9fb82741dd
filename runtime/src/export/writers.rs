//! The writer registry: output formats (`--output-format`), registered with
//! `#[writer(name = "...")]` on a type in any crate (docs/DESIGN.md §7).

use crate::export::ExportError;
use crate::export::writer::OutputWriter;
use crate::registry::{EntryMeta, Named, RegistryEntry, RegistryError, RegistryIssue};
use std::borrow::Cow;
use std::fmt;

crate::registry::collect::collection!(
    /// Every `#[writer]` entry linked into the program.
    WRITERS: WriterEntry
);

/// Constructs a writer for one export in the given `--format`.
pub type WriterConstructor = fn(&str) -> Result<Box<dyn OutputWriter>, ExportError>;

/// One registered writer.
#[derive(Clone)]
pub struct WriterEntry {
    /// Identity and source location.
    pub meta: EntryMeta,
    /// The `--output-format` name.
    pub name: Cow<'static, str>,
    /// The `--format` names it accepts, with a line each; the first is the default.
    pub formats: fn() -> Vec<(&'static str, String)>,
    /// The constructor.
    pub construct: WriterConstructor,
}

impl fmt::Debug for WriterEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WriterEntry")
            .field("path", &self.meta.path)
            .field("name", &self.name)
            .field("location", &self.meta.location)
            .finish()
    }
}

impl WriterEntry {
    /// A writer for `format`, after checking the writer offers it.
    pub fn make(&self, format: &str) -> Result<Box<dyn OutputWriter>, ExportError> {
        let formats = (self.formats)();
        if !formats.iter().any(|(f, _)| *f == format) {
            return Err(ExportError::UnknownWriterFormat {
                writer: self.name.to_string(),
                format: format.to_string(),
                known: formats.iter().map(|(f, _)| f.to_string()).collect(),
            });
        }
        (self.construct)(format)
    }

    /// The format used when none is given: the first listed.
    pub fn default_format(&self) -> Option<&'static str> {
        (self.formats)().first().map(|(f, _)| *f)
    }
}

/// The registered writers, by name.
#[derive(Debug, Clone)]
pub struct WriterRegistry(Named<WriterEntry>);

impl RegistryEntry for WriterEntry {
    const KIND: &'static str = "writer";
    type Registry = WriterRegistry;

    fn meta(&self) -> &EntryMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut EntryMeta {
        &mut self.meta
    }
    fn collected() -> Vec<Self> {
        collected()
    }
    fn assemble(entries: Vec<Self>) -> Result<WriterRegistry, Vec<RegistryIssue>> {
        Named::assemble(
            entries,
            |e| e.name.as_ref(),
            |name| format!("named '{name}'"),
            "mark one `replaces = <the other>`",
        )
        .map(WriterRegistry)
    }
}

impl WriterRegistry {
    /// The link-time registry, validated on first use.
    pub fn try_global() -> Result<&'static WriterRegistry, &'static RegistryError> {
        static GLOBAL: std::sync::LazyLock<Result<WriterRegistry, RegistryError>> =
            std::sync::LazyLock::new(crate::registry::build_static::<WriterEntry>);
        GLOBAL.as_ref()
    }

    /// Every entry, in registry order.
    pub fn entries(&self) -> &[WriterEntry] {
        self.0.entries()
    }

    /// The writer named `name`, or an error listing the names there are.
    pub fn get(&self, name: &str) -> Result<&WriterEntry, ExportError> {
        self.0.get(name).ok_or_else(|| ExportError::UnknownWriter {
            name: name.to_string(),
            known: self.names().iter().map(|n| n.to_string()).collect(),
        })
    }

    /// Every name, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.0.names()
    }
}
