//! The registry core shared by exporters, trainers and architectures.
//!
//! Entries come from two places: the attribute macros (collected at link time, see
//! [`collect`]) and [`RegistryBuilder`] at run time. Either way they end up in one immutable,
//! deterministically ordered list:
//! 1. tier: `prepend`, then ordinary, then `fallback`;
//! 2. higher `priority` first;
//! 3. the type's full path (static entries) or insertion order (builder entries).
//!
//! Validation collects every problem, each with the source locations involved, into a
//! [`RegistryError`].

pub mod collect;

use std::any::TypeId;
use std::borrow::Cow;
use std::cmp::Reverse;
use std::fmt;

/// Where an entry comes from: the `file!()`/`line!()` of the annotated type, or the caller of
/// the [`RegistryBuilder`] method that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceLocation {
    /// The source file.
    pub file: &'static str,
    /// The line in it.
    pub line: u32,
}

impl SourceLocation {
    /// The location of the caller (for entries made at run time).
    #[track_caller]
    pub fn caller() -> Self {
        let l = std::panic::Location::caller();
        SourceLocation {
            file: l.file(),
            line: l.line(),
        }
    }
}

impl fmt::Display for SourceLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// The ordering tier of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Ahead of everything else (`prepend`).
    Prepend,
    /// The default tier.
    Normal,
    /// Behind everything else (`fallback`): broad catch-alls.
    Fallback,
}

impl Tier {
    /// The lowercase name used in listings.
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Prepend => "prepend",
            Tier::Normal => "normal",
            Tier::Fallback => "fallback",
        }
    }
}

/// `replaces = path::Type`: the entry removes the entry registered for that type.
#[derive(Debug, Clone, Copy)]
pub struct Replaces {
    /// The `TypeId` of the replaced type.
    pub type_id: fn() -> TypeId,
    /// The path as the user wrote it, for messages.
    pub written: &'static str,
}

/// What every entry carries besides its kind-specific fields.
#[derive(Debug, Clone)]
pub struct EntryMeta {
    /// The identity: the type's full path (`module_path!()::Name`), unique in a registry.
    pub path: Cow<'static, str>,
    /// The annotated type, when the entry has one (used to resolve `replaces`).
    pub type_id: Option<fn() -> TypeId>,
    /// Built-in, user, or `prepend`.
    pub tier: Tier,
    /// Higher sorts first within a tier.
    pub priority: i32,
    /// The entry this one supersedes, if any.
    pub replaces: Option<Replaces>,
    /// Where the entry is declared.
    pub location: SourceLocation,
}

impl EntryMeta {
    /// Metadata for an entry created at run time, located at the caller.
    #[track_caller]
    pub fn new(path: impl Into<Cow<'static, str>>) -> Self {
        EntryMeta {
            path: path.into(),
            type_id: None,
            tier: Tier::Normal,
            priority: 0,
            replaces: None,
            location: SourceLocation::caller(),
        }
    }

    /// The path and location, as used in messages: `my_crate::Foo (src/lib.rs:12)`.
    pub fn describe(&self) -> String {
        format!("`{}` ({})", self.path, self.location)
    }
}

/// A kind of registry entry, declared beside the trait its entries construct (exporters in
/// `export`, writers in `export` and `formats`, trainers and rewards in `train`,
/// architectures in `architecture`); this core knows none of them.
pub trait RegistryEntry: Clone + Send + Sync + 'static {
    /// The kind's name in messages: "exporter", "trainer", "architecture".
    const KIND: &'static str;
    /// The finished registry built from sorted entries.
    type Registry;
    /// The entry's identity and ordering.
    fn meta(&self) -> &EntryMeta;
    /// The same, mutable (the builder sets tier and priority).
    fn meta_mut(&mut self) -> &mut EntryMeta;
    /// The entries collected at link time, in link order (arbitrary).
    fn collected() -> Vec<Self>;
    /// Builds the finished registry from validated, sorted entries; reports kind-specific
    /// conflicts (two trainers for one route, two families claiming one name).
    fn assemble(entries: Vec<Self>) -> Result<Self::Registry, Vec<RegistryIssue>>;
}

impl RegistryIssue {
    /// Two entries of kind `E` that claim one name: `claim` as the message says it.
    pub fn conflict<E: RegistryEntry>(
        claim: String,
        first: &EntryMeta,
        second: &EntryMeta,
        fix: &'static str,
    ) -> Self {
        RegistryIssue::NameConflict {
            kind: E::KIND,
            claim,
            first: first.path.to_string(),
            first_at: first.location,
            second: second.path.to_string(),
            second_at: second.location,
            fix,
        }
    }
}

/// Indexes `entries` by the names each must hold alone (several per entry, as an
/// architecture's): a name already taken becomes a [`RegistryIssue::NameConflict`] with the
/// claim `claim(name)` and the remedy `fix`.
pub fn index_by_name<E: RegistryEntry>(
    entries: &[E],
    names: impl Fn(&E) -> Vec<String>,
    claim: impl Fn(&str) -> String,
    fix: &'static str,
) -> Result<std::collections::BTreeMap<String, usize>, Vec<RegistryIssue>> {
    let mut by_name: std::collections::BTreeMap<String, usize> = std::collections::BTreeMap::new();
    let mut issues = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        for name in names(e) {
            let name = name.as_str();
            match by_name.get(name) {
                Some(&first) => issues.push(RegistryIssue::conflict::<E>(
                    claim(name),
                    entries[first].meta(),
                    e.meta(),
                    fix,
                )),
                None => {
                    by_name.insert(name.to_string(), i);
                }
            }
        }
    }
    if issues.is_empty() {
        Ok(by_name)
    } else {
        Err(issues)
    }
}

/// A registry whose entries each hold one name alone (writers, readers, rewards): the sorted
/// entries and their index by name.
#[derive(Debug, Clone)]
pub struct Named<E> {
    core: Registry<E>,
    by_name: std::collections::BTreeMap<String, usize>,
}

impl<E: RegistryEntry> Named<E> {
    /// The registry of sorted `entries`, each under `name(entry)`; two claiming one name are a
    /// [`RegistryIssue::NameConflict`] (the message says `claim(name)` and the remedy `fix`).
    pub fn assemble(
        entries: Vec<E>,
        name: impl Fn(&E) -> &str,
        claim: impl Fn(&str) -> String,
        fix: &'static str,
    ) -> Result<Self, Vec<RegistryIssue>> {
        let by_name = index_by_name(&entries, |e| vec![name(e).to_string()], claim, fix)?;
        Ok(Named {
            core: Registry::from_sorted(entries),
            by_name,
        })
    }

    /// Every entry, in registry order.
    pub fn entries(&self) -> &[E] {
        self.core.entries()
    }

    /// The entry named `name`.
    pub fn get(&self, name: &str) -> Option<&E> {
        self.by_name.get(name).map(|&i| &self.entries()[i])
    }

    /// Every name, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.by_name.keys().map(String::as_str).collect()
    }
}

/// An ordered, validated list of entries: the core of every registry.
#[derive(Debug, Clone)]
pub struct Registry<E> {
    entries: Box<[E]>,
}

impl<E: RegistryEntry> Registry<E> {
    /// Wraps entries that are already validated and sorted.
    pub(crate) fn from_sorted(entries: Vec<E>) -> Self {
        Registry {
            entries: entries.into_boxed_slice(),
        }
    }

    /// The entries in registry order.
    pub fn entries(&self) -> &[E] {
        &self.entries
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the registry has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The position of the entry with this identity (full type path).
    pub fn position(&self, path: &str) -> Option<usize> {
        self.entries.iter().position(|e| e.meta().path == path)
    }
}

/// One validation problem. Every variant that involves two entries names both locations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistryIssue {
    /// Two entries share one identity (the same type registered twice).
    DuplicateIdentity {
        /// The registry kind: "exporter", "trainer" or "architecture".
        kind: &'static str,
        /// The registered type's path.
        path: String,
        /// The first entry's type path.
        first: SourceLocation,
        /// The second entry's type path.
        second: SourceLocation,
    },
    /// `replaces` names a type that has no entry of this kind.
    ReplacesUnknown {
        /// The registry kind: "exporter", "trainer" or "architecture".
        kind: &'static str,
        /// The registered type's path.
        path: String,
        /// Where the entry is declared.
        location: SourceLocation,
        /// The type path named in `replaces`.
        target: String,
    },
    /// An entry names itself in `replaces`.
    ReplacesItself {
        /// The registry kind: "exporter", "trainer" or "architecture".
        kind: &'static str,
        /// The registered type's path.
        path: String,
        /// Where the entry is declared.
        location: SourceLocation,
    },
    /// Two entries replace the same entry.
    ReplacedTwice {
        /// The registry kind: "exporter", "trainer" or "architecture".
        kind: &'static str,
        /// The type path named in `replaces`.
        target: String,
        /// The first entry's type path.
        first: String,
        /// Where the first entry is declared.
        first_at: SourceLocation,
        /// The second entry's type path.
        second: String,
        /// Where the second entry is declared.
        second_at: SourceLocation,
    },
    /// Two entries claim one name (a writer's `--output-format`, a trainer's `(task,
    /// backend)`, an architecture's `config.json` name, a reward's name), neither replacing
    /// the other.
    NameConflict {
        /// The registry kind ("writer", "trainer", …).
        kind: &'static str,
        /// What both claim, as the message says it: `named 'gguf'`, `for task 'sft' on
        /// backend 'candle'`.
        claim: String,
        /// The first entry's type path.
        first: String,
        /// Where the first entry is declared.
        first_at: SourceLocation,
        /// The second entry's type path.
        second: String,
        /// Where the second entry is declared.
        second_at: SourceLocation,
        /// How to resolve it: "mark one `replaces = <the other>`", "rename one".
        fix: &'static str,
    },
}

impl fmt::Display for RegistryIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryIssue::DuplicateIdentity {
                kind,
                path,
                first,
                second,
            } => write!(
                f,
                "{kind} `{path}` is registered twice: at {first} and at {second}"
            ),
            RegistryIssue::ReplacesUnknown {
                kind,
                path,
                location,
                target,
            } => write!(
                f,
                "{kind} `{path}` ({location}) replaces `{target}`, but no {kind} is registered for that type"
            ),
            RegistryIssue::ReplacesItself {
                kind,
                path,
                location,
            } => {
                write!(f, "{kind} `{path}` ({location}) replaces itself")
            }
            RegistryIssue::ReplacedTwice {
                kind,
                target,
                first,
                first_at,
                second,
                second_at,
            } => write!(
                f,
                "{kind} `{target}` is replaced twice: by `{first}` ({first_at}) and by `{second}` ({second_at})"
            ),
            RegistryIssue::NameConflict {
                kind,
                claim,
                first,
                first_at,
                second,
                second_at,
                fix,
            } => write!(
                f,
                "two {kind}s {claim}: `{first}` ({first_at}) and `{second}` ({second_at}); {fix}"
            ),
        }
    }
}

/// A registry that failed validation: every problem found, in a deterministic order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {kind} registry:{}", list(.issues))]
pub struct RegistryError {
    /// The registry kind: "exporter", "trainer" or "architecture".
    pub kind: &'static str,
    /// Every problem found.
    pub issues: Vec<RegistryIssue>,
}

fn list(issues: &[RegistryIssue]) -> String {
    issues.iter().map(|i| format!("\n  - {i}")).collect()
}

/// Validates and sorts the link-time entries of one kind (docs/DESIGN.md §2).
pub fn build_static<E: RegistryEntry>() -> Result<E::Registry, RegistryError> {
    build_from_collected(E::collected())
}

/// [`build_static`] over an explicit list, so the rules can be tested without linking.
pub fn build_from_collected<E: RegistryEntry>(
    mut entries: Vec<E>,
) -> Result<E::Registry, RegistryError> {
    // Sort first so that every message comes out in the same order whatever the link order.
    entries.sort_by(|a, b| static_order(a.meta()).cmp(&static_order(b.meta())));
    let mut issues = Vec::new();
    check_identities(&entries, &mut issues);
    let entries = apply_replaces(entries, &mut issues);
    finish(entries, issues)
}

fn static_order(m: &EntryMeta) -> (Tier, Reverse<i32>, &str, SourceLocation) {
    (m.tier, Reverse(m.priority), &m.path, m.location)
}

fn finish<E: RegistryEntry>(
    entries: Vec<E>,
    mut issues: Vec<RegistryIssue>,
) -> Result<E::Registry, RegistryError> {
    match E::assemble(entries) {
        Ok(registry) if issues.is_empty() => Ok(registry),
        Ok(_) => Err(RegistryError {
            kind: E::KIND,
            issues,
        }),
        Err(more) => {
            issues.extend(more);
            Err(RegistryError {
                kind: E::KIND,
                issues,
            })
        }
    }
}

fn check_identities<E: RegistryEntry>(entries: &[E], issues: &mut Vec<RegistryIssue>) {
    let mut by_path: Vec<&EntryMeta> = entries.iter().map(|e| e.meta()).collect();
    by_path.sort_by(|a, b| (&a.path, a.location).cmp(&(&b.path, b.location)));
    for pair in by_path.windows(2) {
        if pair[0].path == pair[1].path {
            issues.push(RegistryIssue::DuplicateIdentity {
                kind: E::KIND,
                path: pair[0].path.to_string(),
                first: pair[0].location,
                second: pair[1].location,
            });
        }
    }
}

/// Removes every entry named by another entry's `replaces`.
fn apply_replaces<E: RegistryEntry>(entries: Vec<E>, issues: &mut Vec<RegistryIssue>) -> Vec<E> {
    let mut removed = vec![false; entries.len()];
    let mut replaced_by: Vec<Option<usize>> = vec![None; entries.len()];
    for (i, e) in entries.iter().enumerate() {
        let meta = e.meta();
        let Some(rep) = meta.replaces else { continue };
        let target_id = (rep.type_id)();
        if meta.type_id.is_some_and(|id| id() == target_id) {
            issues.push(RegistryIssue::ReplacesItself {
                kind: E::KIND,
                path: meta.path.to_string(),
                location: meta.location,
            });
            continue;
        }
        let targets: Vec<usize> = entries
            .iter()
            .enumerate()
            .filter(|(_, t)| t.meta().type_id.is_some_and(|id| id() == target_id))
            .map(|(j, _)| j)
            .collect();
        if targets.is_empty() {
            issues.push(RegistryIssue::ReplacesUnknown {
                kind: E::KIND,
                path: meta.path.to_string(),
                location: meta.location,
                target: rep.written.to_string(),
            });
        }
        for j in targets {
            if let Some(prev) = replaced_by[j] {
                let p = entries[prev].meta();
                issues.push(RegistryIssue::ReplacedTwice {
                    kind: E::KIND,
                    target: entries[j].meta().path.to_string(),
                    first: p.path.to_string(),
                    first_at: p.location,
                    second: meta.path.to_string(),
                    second_at: meta.location,
                });
            }
            replaced_by[j] = Some(i);
            removed[j] = true;
        }
    }
    entries
        .into_iter()
        .zip(removed)
        .filter(|(_, r)| !r)
        .map(|(e, _)| e)
        .collect()
}

fn identity_hash(path: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = rustc_hash::FxHasher::default();
    path.hash(&mut h);
    h.finish()
}

/// Builds a registry at run time, starting from the static entries or from none.
///
/// `register` appends, or — when an entry with the same identity is already present —
/// replaces it in place, keeping its position (the Python original's semantics). `prepend`
/// puts an entry first and in the `prepend` tier. `build` then orders by tier and priority,
/// keeping insertion order among equals.
#[derive(Debug, Clone)]
pub struct RegistryBuilder<E> {
    entries: Vec<E>,
    /// Hashes of the identities present: a miss proves an identity is new without a scan.
    identities: rustc_hash::FxHashSet<u64>,
}

impl<E: RegistryEntry> Default for RegistryBuilder<E> {
    fn default() -> Self {
        Self::empty()
    }
}

impl<E: RegistryEntry> RegistryBuilder<E> {
    /// A builder with no entries.
    pub fn empty() -> Self {
        Self::with_capacity(0)
    }

    /// A builder holding the link-time entries, validated and in registry order.
    pub fn from_static() -> Result<Self, RegistryError> {
        let mut entries = E::collected();
        entries.sort_by(|a, b| static_order(a.meta()).cmp(&static_order(b.meta())));
        let mut issues = Vec::new();
        check_identities(&entries, &mut issues);
        let entries = apply_replaces(entries, &mut issues);
        if issues.is_empty() {
            let identities = entries
                .iter()
                .map(|e| identity_hash(&e.meta().path))
                .collect();
            Ok(RegistryBuilder {
                entries,
                identities,
            })
        } else {
            Err(RegistryError {
                kind: E::KIND,
                issues,
            })
        }
    }

    /// An empty builder with room for `n` entries.
    pub fn with_capacity(n: usize) -> Self {
        let mut identities = rustc_hash::FxHashSet::default();
        identities.reserve(n);
        RegistryBuilder {
            entries: Vec::with_capacity(n),
            identities,
        }
    }

    /// Appends `entry`, or replaces the entry with the same identity in place.
    pub fn register(&mut self, entry: E) -> &mut Self {
        match self.find(&entry.meta().path) {
            Some(i) => self.entries[i] = entry,
            None => {
                self.identities.insert(identity_hash(&entry.meta().path));
                self.entries.push(entry);
            }
        }
        self
    }

    /// Puts `entry` first, in the `prepend` tier (removing any entry with its identity).
    pub fn prepend(&mut self, mut entry: E) -> &mut Self {
        if let Some(i) = self.find(&entry.meta().path) {
            self.entries.remove(i);
        }
        entry.meta_mut().tier = Tier::Prepend;
        self.identities.insert(identity_hash(&entry.meta().path));
        self.entries.insert(0, entry);
        self
    }

    /// Puts `entry` where the entry with identity `target` is. Errors when there is none.
    pub fn replace(&mut self, target: &str, entry: E) -> Result<&mut Self, RegistryError> {
        let Some(i) = self.find(target) else {
            return Err(RegistryError {
                kind: E::KIND,
                issues: vec![RegistryIssue::ReplacesUnknown {
                    kind: E::KIND,
                    path: entry.meta().path.to_string(),
                    location: entry.meta().location,
                    target: target.to_string(),
                }],
            });
        };
        self.identities.insert(identity_hash(&entry.meta().path));
        if let Some(j) = self.find(&entry.meta().path).filter(|&j| j != i) {
            self.entries.remove(j);
            let i = if j < i { i - 1 } else { i };
            self.entries[i] = entry;
        } else {
            self.entries[i] = entry;
        }
        Ok(self)
    }

    /// Removes the entry with identity `path`; returns whether one was there.
    pub fn remove(&mut self, path: &str) -> bool {
        match self.find(path) {
            Some(i) => {
                self.entries.remove(i);
                true
            }
            None => false,
        }
    }

    /// The entries in their current (unsorted) order.
    pub fn entries(&self) -> &[E] {
        &self.entries
    }

    fn find(&self, path: &str) -> Option<usize> {
        // Removed identities stay in the set; a stale hit only costs the scan.
        if !self.identities.contains(&identity_hash(path)) {
            return None;
        }
        self.entries.iter().position(|e| e.meta().path == path)
    }

    /// Orders the entries (tier, then priority, stable) and builds the registry.
    pub fn build(mut self) -> Result<E::Registry, RegistryError> {
        self.entries
            .sort_by_key(|e| (e.meta().tier, Reverse(e.meta().priority)));
        finish(self.entries, Vec::new())
    }
}

#[cfg(test)]
mod tests;
