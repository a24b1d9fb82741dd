//! The trainer registry: `(task, backend)` → trainer, resolved backend-first.

use crate::registry::{EntryMeta, Registry, RegistryEntry, RegistryError, RegistryIssue};
use crate::train::{TrainConfig, TrainError, Trainer};
use std::any::TypeId;
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

crate::registry::collect::collection!(
    /// Every `#[trainer]` entry linked into the program.
    TRAINERS: TrainerEntry
);

/// One trainer registration.
#[derive(Clone)]
pub struct TrainerEntry {
    /// Identity, ordering and source location.
    pub meta: EntryMeta,
    /// The task name (`sft`, `dpo`, ...).
    pub task: Cow<'static, str>,
    /// The backend name (`candle`, `mlx`, ...).
    pub backend: Cow<'static, str>,
    /// Makes the trainer from a configuration; runs only after resolution.
    pub construct: fn(&TrainConfig) -> Result<Box<dyn Trainer>, TrainError>,
}

impl TrainerEntry {
    /// An entry for `T` made at run time, identified by `T`'s type name.
    #[track_caller]
    pub fn of<T: Trainer + 'static>(task: &str, backend: &str) -> Self {
        let mut meta = EntryMeta::new(std::any::type_name::<T>());
        meta.type_id = Some(TypeId::of::<T>);
        TrainerEntry {
            meta,
            task: Cow::Owned(task.to_string()),
            backend: Cow::Owned(backend.to_string()),
            construct: crate::__private::boxed_trainer::<T>,
        }
    }

    /// Constructs the trainer for `config`.
    pub fn construct(&self, config: &TrainConfig) -> Result<Box<dyn Trainer>, TrainError> {
        (self.construct)(config)
    }
}

impl fmt::Debug for TrainerEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrainerEntry")
            .field("path", &self.meta.path)
            .field("task", &self.task)
            .field("backend", &self.backend)
            .field("location", &self.meta.location)
            .finish()
    }
}

/// A training backend this build knows of, whether or not it was compiled in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendInfo {
    /// The backend's name.
    pub name: &'static str,
    /// The cargo feature that enables it (`None`: always built).
    pub feature: Option<&'static str>,
    /// Whether this build includes it.
    pub enabled: bool,
}

/// kiln's own backends. Plugins may register trainers for other backend names; those are
/// known as soon as they have an entry.
pub const BUILTIN_BACKENDS: &[BackendInfo] = &[
    BackendInfo {
        name: "candle",
        feature: None,
        enabled: true,
    },
    BackendInfo {
        name: "mlx",
        feature: Some("mlx"),
        enabled: cfg!(feature = "mlx"),
    },
];

/// The backend that covers every task by convention when counts tie.
const CONVENTIONAL_FULL_BACKEND: &str = "candle";

impl RegistryEntry for TrainerEntry {
    const KIND: &'static str = "trainer";
    type Registry = TrainerRegistry;

    fn meta(&self) -> &EntryMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut EntryMeta {
        &mut self.meta
    }
    fn collected() -> Vec<Self> {
        collected()
    }
    fn assemble(entries: Vec<Self>) -> Result<TrainerRegistry, Vec<RegistryIssue>> {
        let mut routes: BTreeMap<(String, String), usize> = BTreeMap::new();
        let mut issues = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let key = (e.task.to_string(), e.backend.to_string());
            if let Some(&first) = routes.get(&key) {
                issues.push(RegistryIssue::conflict::<TrainerEntry>(
                    format!("for task '{}' on backend '{}'", key.0, key.1),
                    &entries[first].meta,
                    &e.meta,
                    "mark one `replaces = <the other>`",
                ));
            } else {
                routes.insert(key, i);
            }
        }
        if issues.is_empty() {
            Ok(TrainerRegistry {
                core: Registry::from_sorted(entries),
                routes,
            })
        } else {
            Err(issues)
        }
    }
}

/// Why no trainer was resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// The backend exists but has no trainer for the task.
    #[error(
        "backend '{backend}' does not support task '{task}'. Supported: {}.{}",
        if supported.is_empty() { "none".to_string() } else { supported.join(", ") },
        full_coverage.as_ref().map(|b| format!(" Use backend={b} for full task coverage.")).unwrap_or_default()
    )]
    UnsupportedTask {
        /// The backend name (`candle`, `mlx`, ...).
        backend: String,
        /// The task name (`sft`, `dpo`, ...).
        task: String,
        /// The backend's tasks, sorted.
        supported: Vec<String>,
        /// The backend with the most tasks, when it is another one.
        full_coverage: Option<String>,
    },
    /// The backend is kiln's, but this build left it out.
    #[error(
        "backend '{backend}' is not available: kiln was built without the '{feature}' feature \
         (rebuild with `--features {feature}`)"
    )]
    BackendNotBuilt {
        /// The backend name (`candle`, `mlx`, ...).
        backend: String,
        /// The cargo feature to rebuild with.
        feature: String,
    },
    /// Nobody knows this backend.
    #[error("unknown backend '{backend}'. Known backends: {}.", known.join(", "))]
    UnknownBackend {
        /// The backend name (`candle`, `mlx`, ...).
        backend: String,
        /// The backends this build knows of.
        known: Vec<String>,
    },
    /// The trainer registry itself is invalid.
    #[error(transparent)]
    InvalidRegistry(#[from] RegistryError),
}

/// The sorted trainers and their routes.
#[derive(Debug)]
pub struct TrainerRegistry {
    core: Registry<TrainerEntry>,
    routes: BTreeMap<(String, String), usize>,
}

impl TrainerRegistry {
    /// The trainers in registry order.
    pub fn entries(&self) -> &[TrainerEntry] {
        self.core.entries()
    }

    /// The link-time registry, validated and sorted on first use.
    pub fn try_global() -> Result<&'static TrainerRegistry, &'static RegistryError> {
        static GLOBAL: std::sync::LazyLock<Result<TrainerRegistry, RegistryError>> =
            std::sync::LazyLock::new(crate::registry::build_static::<TrainerEntry>);
        GLOBAL.as_ref()
    }

    /// The tasks of `backend`, sorted.
    pub fn tasks(&self, backend: &str) -> Vec<String> {
        self.routes
            .keys()
            .filter(|(_, b)| b == backend)
            .map(|(t, _)| t.clone())
            .collect()
    }

    /// Every backend known to this build: kiln's own (built or not) and any a trainer names.
    pub fn backends(&self) -> Vec<String> {
        let mut all: BTreeSet<String> = BUILTIN_BACKENDS
            .iter()
            .map(|b| b.name.to_string())
            .collect();
        all.extend(self.routes.keys().map(|(_, b)| b.clone()));
        all.into_iter().collect()
    }

    /// The backend with the most tasks (`candle` when tied with it, else the first by name).
    pub fn full_coverage_backend(&self) -> Option<String> {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, b) in self.routes.keys() {
            *counts.entry(b).or_default() += 1;
        }
        let best = *counts.values().max()?;
        if counts.get(CONVENTIONAL_FULL_BACKEND) == Some(&best) {
            return Some(CONVENTIONAL_FULL_BACKEND.to_string());
        }
        counts
            .into_iter()
            .find(|&(_, n)| n == best)
            .map(|(b, _)| b.to_string())
    }

    /// The trainer for `(task, backend)`, backend first: an unknown or unbuilt backend is
    /// reported as such before the task is looked at.
    pub fn resolve(&self, task: &str, backend: &str) -> Result<&TrainerEntry, RouteError> {
        let has_entries = self.routes.keys().any(|(_, b)| b == backend);
        if !has_entries {
            match BUILTIN_BACKENDS.iter().find(|b| b.name == backend) {
                None => {
                    return Err(RouteError::UnknownBackend {
                        backend: backend.to_string(),
                        known: self.backends(),
                    });
                }
                Some(BackendInfo {
                    enabled: false,
                    feature: Some(feature),
                    ..
                }) => {
                    return Err(RouteError::BackendNotBuilt {
                        backend: backend.to_string(),
                        feature: feature.to_string(),
                    });
                }
                Some(_) => {}
            }
        }
        match self.routes.get(&(task.to_string(), backend.to_string())) {
            Some(&i) => Ok(&self.entries()[i]),
            None => Err(RouteError::UnsupportedTask {
                backend: backend.to_string(),
                task: task.to_string(),
                supported: self.tasks(backend),
                full_coverage: self.full_coverage_backend().filter(|b| b != backend),
            }),
        }
    }
}

/// Resolves the trainer for `config` in the link-time registry. Nothing backend-specific
/// is constructed: call [`TrainerEntry::construct`] on the result.
pub fn resolve_trainer(config: &TrainConfig) -> Result<&'static TrainerEntry, RouteError> {
    let registry =
        TrainerRegistry::try_global().map_err(|e| RouteError::InvalidRegistry(e.clone()))?;
    registry.resolve(&config.task, &config.backend)
}
