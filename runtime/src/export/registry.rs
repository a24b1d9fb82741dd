//! The exporter registry: which exporter takes a module.
//!
//! Matching (docs/DESIGN.md §2): a type key matches when its `TypeId` is in the module's class
//! chain, a string key when its name is; keys are OR-ed; with keys *and* a predicate both must
//! hold; the first entry in registry order that matches wins.
//!
//! Matching never scans every entry. Entries are indexed by key; for a class chain the
//! candidates (key hits merged with predicate-only entries, in registry order) form a *plan*
//! that ends at the first candidate without a predicate — nothing after it can win. Plans
//! are cached per class chain: [`ExporterRegistry::find`] shares one cache behind a lock,
//! [`Matcher`] owns one (no locking, for one export's hot loop).

use crate::export::exporter::ModuleExporter;
use crate::module_tree::{ClassChain, ModuleClass, ModuleRef};
use crate::registry::{EntryMeta, Registry, RegistryEntry, RegistryIssue};
use rustc_hash::FxHashMap;
use std::any::TypeId;
use std::borrow::Cow;
use std::fmt;
use std::sync::{Arc, RwLock};

crate::registry::collect::collection!(
    /// Every `#[exporter]` entry linked into the program.
    EXPORTERS: ExporterEntry
);

/// The signature of an exporter predicate.
pub type PredicateFn = fn(&ModuleRef<'_>) -> bool;

/// A match key.
#[derive(Debug, Clone)]
pub enum Key {
    /// Matches a module whose chain contains this Rust type.
    Type {
        /// The type's `TypeId`.
        id: fn() -> TypeId,
        /// The type's name, for listings.
        name: Cow<'static, str>,
    },
    /// Matches a module whose chain contains a class of this name.
    Name(Cow<'static, str>),
}

impl Key {
    /// A type key for the module class `T`.
    pub const fn of_class<T: ModuleClass>() -> Self {
        Key::Type {
            id: TypeId::of::<T>,
            name: Cow::Borrowed(T::NAME),
        }
    }

    /// A class-name key.
    pub const fn name(name: &'static str) -> Self {
        Key::Name(Cow::Borrowed(name))
    }

    /// `Linear` for a type key, `"Linear"` for a name key.
    pub fn describe(&self) -> String {
        match self {
            Key::Type { name, .. } => name.to_string(),
            Key::Name(n) => format!("{n:?}"),
        }
    }
}

/// A predicate and its path as written, for listings.
#[derive(Debug, Clone)]
pub struct Predicate {
    /// The predicate.
    pub func: PredicateFn,
    /// The predicate's path as written.
    pub name: Cow<'static, str>,
}

/// One exporter registration.
#[derive(Clone)]
pub struct ExporterEntry {
    /// Identity, ordering and source location.
    pub meta: EntryMeta,
    /// The match keys (any one matches).
    pub keys: Cow<'static, [Key]>,
    /// A predicate the module must also satisfy.
    pub predicate: Option<Predicate>,
    /// Makes the exporter; called once per export call that uses it.
    pub construct: fn() -> Box<dyn ModuleExporter>,
}

impl ExporterEntry {
    /// An entry for `T` made at run time (for [`crate::registry::RegistryBuilder`]), identified by
    /// `T`'s type name and located at the caller.
    #[track_caller]
    pub fn of<T: ModuleExporter + Default + 'static>(
        keys: Vec<Key>,
        predicate: Option<Predicate>,
    ) -> Self {
        let mut meta = EntryMeta::new(std::any::type_name::<T>());
        meta.type_id = Some(TypeId::of::<T>);
        ExporterEntry {
            meta,
            keys: Cow::Owned(keys),
            predicate,
            construct: || Box::new(T::default()),
        }
    }

    /// Sets the priority (builder style).
    pub fn with_priority(mut self, priority: i32) -> Self {
        self.meta.priority = priority;
        self
    }

    /// Sets the tier (builder style).
    pub fn with_tier(mut self, tier: crate::registry::Tier) -> Self {
        self.meta.tier = tier;
        self
    }

    /// Whether this entry matches `module`, by the rules alone (no index): the reference
    /// the indexed matcher is tested against.
    pub fn matches(&self, module: &ModuleRef<'_>) -> Option<MatchReason> {
        let chain = module.class_chain();
        let key = if self.keys.is_empty() {
            None
        } else {
            Some(self.keys.iter().position(|k| key_in_chain(k, chain))?)
        };
        if let Some(p) = &self.predicate
            && !(p.func)(module)
        {
            return None;
        }
        Some(MatchReason {
            key,
            predicate: self.predicate.is_some(),
        })
    }
}

fn key_in_chain(key: &Key, chain: &ClassChain) -> bool {
    match key {
        Key::Type { id, .. } => {
            let id = id();
            chain.classes().iter().any(|c| c.type_id() == Some(id))
        }
        Key::Name(n) => chain.has_name(n),
    }
}

impl fmt::Debug for ExporterEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExporterEntry")
            .field("path", &self.meta.path)
            .field("tier", &self.meta.tier)
            .field("priority", &self.meta.priority)
            .field("keys", &self.keys)
            .field("predicate", &self.predicate.as_ref().map(|p| &p.name))
            .field("location", &self.meta.location)
            .finish()
    }
}

impl RegistryEntry for ExporterEntry {
    const KIND: &'static str = "exporter";
    type Registry = ExporterRegistry;

    fn meta(&self) -> &EntryMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut EntryMeta {
        &mut self.meta
    }
    fn collected() -> Vec<Self> {
        collected()
    }
    fn assemble(entries: Vec<Self>) -> Result<ExporterRegistry, Vec<RegistryIssue>> {
        Ok(ExporterRegistry::new(Registry::from_sorted(entries)))
    }
}

/// Why an entry matched: which of its keys (index into `keys`) and whether a predicate held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatchReason {
    /// The key that matched, if any.
    pub key: Option<usize>,
    /// Whether a predicate held.
    pub predicate: bool,
}

/// The exporter chosen for a module.
#[derive(Debug, Clone, Copy)]
pub struct Match<'r> {
    /// The position in registry order.
    pub position: usize,
    /// The matching entry.
    pub entry: &'r ExporterEntry,
    /// Why it matched.
    pub reason: MatchReason,
}

impl Match<'_> {
    /// `key Linear`, `predicate is_moe`, `key "Experts" + predicate has_router`.
    pub fn describe(&self) -> String {
        let key = self
            .reason
            .key
            .map(|k| format!("key {}", self.entry.keys[k].describe()));
        let pred = self
            .entry
            .predicate
            .as_ref()
            .filter(|_| self.reason.predicate)
            .map(|p| format!("predicate {}", p.name));
        match (key, pred) {
            (Some(k), Some(p)) => format!("{k} + {p}"),
            (Some(k), None) => k,
            (None, Some(p)) => p,
            (None, None) => String::from("(nothing)"),
        }
    }
}

/// One step of a plan: a candidate entry, the key that put it there, and whether its
/// predicate still has to be tested.
#[derive(Debug, Clone, Copy)]
struct Step {
    position: u32,
    key: Option<u32>,
    test_predicate: bool,
}

/// The candidates for one class chain, in registry order, ending at the first candidate
/// that needs no predicate.
#[derive(Debug, Default)]
struct Plan {
    steps: Box<[Step]>,
}

/// The sorted exporters plus their key index and plan cache.
pub struct ExporterRegistry {
    core: Registry<ExporterEntry>,
    /// Type keys as (type, position, key index), sorted: one array, no per-key allocation.
    by_type: Box<[(TypeId, u32, u32)]>,
    /// Name keys as (hash of the name, position, key index), sorted. A hash hit is
    /// confirmed against the name when a plan is made, so collisions cannot mis-match.
    by_name: Box<[(u64, u32, u32)]>,
    /// Entries without keys (predicate only), positions ascending.
    predicate_only: Vec<u32>,
    cache: RwLock<FxHashMap<ClassChain, Arc<Plan>>>,
}

impl fmt::Debug for ExporterRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.core.entries()).finish()
    }
}

impl ExporterRegistry {
    fn new(core: Registry<ExporterEntry>) -> Self {
        let mut by_type = Vec::new();
        let mut by_name = Vec::new();
        let mut predicate_only = Vec::new();
        for (pos, e) in core.entries().iter().enumerate() {
            let pos = pos as u32;
            if e.keys.is_empty() {
                predicate_only.push(pos);
            }
            for (k, key) in e.keys.iter().enumerate() {
                match key {
                    Key::Type { id, .. } => by_type.push((id(), pos, k as u32)),
                    Key::Name(n) => by_name.push((name_hash(n), pos, k as u32)),
                }
            }
        }
        by_type.sort_unstable();
        by_name.sort_unstable();
        ExporterRegistry {
            core,
            by_type: by_type.into(),
            by_name: by_name.into(),
            predicate_only,
            cache: RwLock::default(),
        }
    }

    /// The exporters in registry order.
    pub fn entries(&self) -> &[ExporterEntry] {
        self.core.entries()
    }

    /// The number of exporters.
    pub fn len(&self) -> usize {
        self.core.len()
    }

    /// Whether there are no exporters.
    pub fn is_empty(&self) -> bool {
        self.core.is_empty()
    }

    /// The link-time registry, validated and sorted on first use.
    pub fn try_global() -> Result<&'static ExporterRegistry, &'static crate::registry::RegistryError>
    {
        static GLOBAL: std::sync::LazyLock<
            Result<ExporterRegistry, crate::registry::RegistryError>,
        > = std::sync::LazyLock::new(crate::registry::build_static::<ExporterEntry>);
        GLOBAL.as_ref()
    }

    /// The first exporter that matches `module`, or `None`. Uses the shared plan cache.
    pub fn find(&self, module: &ModuleRef<'_>) -> Option<Match<'_>> {
        let chain = module.class_chain();
        let cached = self.cache.read().ok().and_then(|c| c.get(chain).cloned());
        let plan = match cached {
            Some(plan) => plan,
            None => {
                let plan = Arc::new(self.plan(chain));
                if let Ok(mut c) = self.cache.write() {
                    c.insert(chain.clone(), plan.clone());
                }
                plan
            }
        };
        self.run(&plan, module)
    }

    /// The first match found by testing every entry in order: the specification that the
    /// indexed matcher must agree with (and the baseline the benchmarks compare against).
    pub fn find_linear(&self, module: &ModuleRef<'_>) -> Option<Match<'_>> {
        self.entries()
            .iter()
            .enumerate()
            .find_map(|(position, entry)| {
                entry.matches(module).map(|reason| Match {
                    position,
                    entry,
                    reason,
                })
            })
    }

    /// A matcher with its own plan cache, for one export call.
    pub fn matcher(&self) -> Matcher<'_> {
        Matcher {
            registry: self,
            plans: FxHashMap::default(),
        }
    }

    fn plan(&self, chain: &ClassChain) -> Plan {
        // Key hits from every class of the chain, lowest position first; an entry hit by
        // several classes keeps the key of its earliest listing.
        let mut hits: Vec<(u32, u32)> = Vec::new();
        for class in chain.classes() {
            if let Some(id) = class.type_id() {
                hits.extend(
                    equal_range(&self.by_type, id)
                        .iter()
                        .map(|&(_, p, k)| (p, k)),
                );
            }
            let name = class.name();
            let same_name = |&&(_, p, k): &&(u64, u32, u32)| matches!(&self.entries()[p as usize].keys[k as usize], Key::Name(n) if n == name);
            let named = equal_range(&self.by_name, name_hash(name));
            hits.extend(named.iter().filter(same_name).map(|&(_, p, k)| (p, k)));
        }
        hits.sort_unstable();
        hits.dedup_by_key(|h| h.0);

        let mut steps = Vec::new();
        let mut preds = self.predicate_only.iter().peekable();
        for (pos, key) in hits {
            while let Some(&&p) = preds.peek().filter(|&&&p| p < pos) {
                steps.push(Step {
                    position: p,
                    key: None,
                    test_predicate: true,
                });
                preds.next();
            }
            let needs = self.entries()[pos as usize].predicate.is_some();
            steps.push(Step {
                position: pos,
                key: Some(key),
                test_predicate: needs,
            });
            if !needs {
                return Plan {
                    steps: steps.into(),
                };
            }
        }
        steps.extend(preds.map(|&p| Step {
            position: p,
            key: None,
            test_predicate: true,
        }));
        Plan {
            steps: steps.into(),
        }
    }

    #[inline]
    fn run(&self, plan: &Plan, module: &ModuleRef<'_>) -> Option<Match<'_>> {
        for step in plan.steps.iter() {
            let entry = &self.entries()[step.position as usize];
            if step.test_predicate {
                let p = entry
                    .predicate
                    .as_ref()
                    .expect("planned predicate step has a predicate");
                if !(p.func)(module) {
                    continue;
                }
            }
            return Some(Match {
                position: step.position as usize,
                entry,
                reason: MatchReason {
                    key: step.key.map(|k| k as usize),
                    predicate: step.test_predicate,
                },
            });
        }
        None
    }
}

fn name_hash(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = rustc_hash::FxHasher::default();
    name.hash(&mut h);
    h.finish()
}

/// The run of `sorted` whose first field equals `key`.
fn equal_range<K: Ord + Copy>(sorted: &[(K, u32, u32)], key: K) -> &[(K, u32, u32)] {
    let start = sorted.partition_point(|e| e.0 < key);
    let len = sorted[start..].partition_point(|e| e.0 == key);
    &sorted[start..start + len]
}

/// Matches modules against one registry with a private plan cache (no locking).
pub struct Matcher<'r> {
    registry: &'r ExporterRegistry,
    plans: FxHashMap<ClassChain, Plan>,
}

impl<'r> Matcher<'r> {
    /// The first exporter that matches `module`, or `None`.
    #[inline]
    pub fn find(&mut self, module: &ModuleRef<'_>) -> Option<Match<'r>> {
        let registry = self.registry;
        let chain = module.class_chain();
        if let Some(plan) = self.plans.get(chain) {
            return registry.run(plan, module);
        }
        let plan = self
            .plans
            .entry(chain.clone())
            .or_insert_with(|| registry.plan(chain));
        registry.run(plan, module)
    }
}
