//! The format-reader registry: the read side of each output format, registered by
//! `#[writer(name = "...", reader = R)]` under the writer's name and identity. Every writer
//! has an entry (`construct: None` without a reader), so a writer that `replaces` another
//! replaces its reader too — never leaving the old reader to read the new writer's output.

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
    /// The reader's constructor; `None`: the writer's output is not read back.
    pub construct: Option<fn() -> Box<dyn FormatReader>>,
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
    /// The names of the writers whose output is read back, sorted.
    pub fn readable(&self) -> Vec<&str> {
        self.names()
            .into_iter()
            .filter(|n| self.get(n).is_some_and(|e| e.construct.is_some()))
            .collect()
    }

    /// The link-time registry, validated on first use.
    pub fn try_global() -> Result<&'static ReaderRegistry, &'static RegistryError> {
        static GLOBAL: std::sync::LazyLock<Result<ReaderRegistry, RegistryError>> =
            std::sync::LazyLock::new(crate::registry::build_static::<ReaderEntry>);
        GLOBAL.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{Replaces, SourceLocation, Tier, build_from_collected};
    use std::any::TypeId;

    struct Old;
    struct New;
    struct Any;
    impl FormatReader for Any {
        fn detect(&self, _: &std::path::Path) -> Option<std::path::PathBuf> {
            None
        }
        #[cfg(feature = "exec")]
        fn load(
            &self,
            _: &std::path::Path,
            _: crate::model::candle::DType,
            _: &crate::model::candle::Device,
            _: bool,
        ) -> Result<super::super::Loaded, crate::model::ModelError> {
            unreachable!("never loaded")
        }
        #[cfg(feature = "exec")]
        fn verify(
            &self,
            _: &crate::checkpoint::Checkpoint,
            _: &std::path::Path,
        ) -> Result<super::super::check::VerifyReport, crate::model::ModelError> {
            unreachable!("never verified")
        }
    }
    fn any() -> Box<dyn FormatReader> {
        Box::new(Any)
    }

    /// A writer's reader entry, as `#[writer]` emits it (`replaces`: the type it replaces).
    fn entry(
        path: &'static str,
        id: fn() -> TypeId,
        replaces: Option<fn() -> TypeId>,
        reader: bool,
    ) -> ReaderEntry {
        ReaderEntry {
            meta: EntryMeta {
                path: Cow::Borrowed(path),
                type_id: Some(id),
                tier: Tier::Normal,
                priority: 0,
                replaces: replaces.map(|type_id| Replaces {
                    type_id,
                    written: "Old",
                }),
                location: SourceLocation {
                    file: "src/test.rs",
                    line: 1,
                },
            },
            name: Cow::Borrowed("fmt"),
            construct: reader.then_some(any as fn() -> Box<dyn FormatReader>),
        }
    }

    #[test]
    fn a_writer_that_replaces_another_replaces_its_reader_whether_either_has_one() {
        // Without a reader of its own, the replacement leaves the format unread: the old
        // reader must not read the new writer's output.
        let r = build_from_collected(vec![
            entry("a::Old", TypeId::of::<Old>, None, true),
            entry("b::New", TypeId::of::<New>, Some(TypeId::of::<Old>), false),
        ])
        .unwrap();
        assert_eq!(r.names(), ["fmt"]);
        assert_eq!(r.get("fmt").unwrap().meta.path, "b::New");
        assert!(r.readable().is_empty());
        // With one, it replaces a writer that had none.
        let r = build_from_collected(vec![
            entry("a::Old", TypeId::of::<Old>, None, false),
            entry("b::New", TypeId::of::<New>, Some(TypeId::of::<Old>), true),
        ])
        .unwrap();
        assert_eq!(r.readable(), ["fmt"]);
    }
}
