//! The exporter hooks, the per-call export context, and the module walk.
//!
//! An export call creates one [`ExportContext`], walks the module tree in pre-order, calls
//! `prepare_moe_inputs` for every MoE block whose experts container an exporter takes, then
//! `export` for every module with the first matching exporter (DESIGN.md §4). Exporters are
//! constructed once per call, on first use; nothing about an export outlives the call.

use crate::module_tree::{ModuleRef, ModuleTree};
use crate::registry::exporters::ExporterRegistry;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// An error raised by an exporter or by the walk, naming the module involved.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// An MoE block whose experts container no exporter takes (ModelOpt:
    /// `NotImplementedError("MoE model with experts type … not supported")`).
    #[error(
        "MoE block `{block}`: no exporter takes its experts container (class {experts_class}); register one"
    )]
    UnsupportedMoe {
        block: String,
        experts_class: String,
    },
    /// An exporter failed on a module.
    #[error("module `{module}`: {message}")]
    Module { module: String, message: String },
    /// The exporter registry is invalid.
    #[error(transparent)]
    InvalidRegistry(#[from] crate::registry::RegistryError),
}

/// The two hooks of an exporter. Both default to doing nothing.
pub trait ModuleExporter: Send + Sync {
    /// Called once per MoE block whose experts container this exporter matched, before any
    /// `export`: fill missing expert input statistics and the like.
    fn prepare_moe_inputs(
        &self,
        name: &str,
        moe_block: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, moe_block, ctx);
        Ok(())
    }

    /// Emits the module's output into `ctx`.
    fn export(
        &self,
        name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, module, ctx);
        Ok(())
    }
}

/// What happened to one module during the walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModuleOutcome {
    /// Exported by the exporter with this type path, matched for this reason.
    Exported { exporter: String, reason: String },
    /// No exporter matched: the module is kept as it is.
    Unchanged,
}

/// The record of one export call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Every module visited, in walk order.
    pub modules: Vec<(String, ModuleOutcome)>,
    /// MoE blocks prepared, in walk order, with the exporter that prepared them.
    pub moe_prepared: Vec<(String, String)>,
    /// Free-form notes exporters left, per module.
    pub notes: Vec<(String, String)>,
}

impl ExportReport {
    /// Modules per exporter type path (`None` = unchanged), sorted.
    pub fn counts(&self) -> BTreeMap<Option<&str>, usize> {
        let mut counts = BTreeMap::new();
        for (_, o) in &self.modules {
            let k = match o {
                ModuleOutcome::Exported { exporter, .. } => Some(exporter.as_str()),
                ModuleOutcome::Unchanged => None,
            };
            *counts.entry(k).or_default() += 1;
        }
        counts
    }
}

/// The state of one export call. Shared by reference with every hook, so exporters may run
/// in parallel; created per call and dropped after it.
#[derive(Debug, Default)]
pub struct ExportContext {
    report: Mutex<ExportReport>,
}

impl ExportContext {
    /// A fresh context for one export call.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leaves a note about `module` in the report.
    pub fn note(&self, module: &str, message: impl Into<String>) {
        self.lock().notes.push((module.to_string(), message.into()));
    }

    /// A copy of the report so far.
    pub fn report(&self) -> ExportReport {
        self.lock().clone()
    }

    /// Ends the call, returning its report.
    pub fn into_report(self) -> ExportReport {
        self.report.into_inner().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ExportReport> {
        // A panicking exporter must not hide the rest of the report.
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Whether a module is an MoE block, by ModelOpt's rule (`is_moe`): the class name ends in
/// `sparsemoeblock` or contains `moelayer`, `arcticmoe`, `deepseekmoe`, `dbrxffn` or
/// `nemotronhmoe` (case-insensitive), or the module has both a `router` and `experts`.
pub fn is_moe(module: &ModuleRef<'_>) -> bool {
    let name = module.class_name().to_ascii_lowercase();
    name.ends_with("sparsemoeblock")
        || [
            "moelayer",
            "arcticmoe",
            "deepseekmoe",
            "dbrxffn",
            "nemotronhmoe",
        ]
        .iter()
        .any(|s| name.contains(s))
        || (module.child("router").is_some() && module.child("experts").is_some())
}

/// Walks `tree` with `registry` into `ctx`: MoE preparation first, then one `export` per
/// matched module, in pre-order. Each exporter is constructed once, on first use.
pub fn walk(
    tree: &ModuleTree,
    registry: &ExporterRegistry,
    ctx: &ExportContext,
) -> Result<(), ExportError> {
    let mut matcher = registry.matcher();
    let mut instances = Instances::new(registry);

    for block in tree.walk().filter(is_moe) {
        let Some(experts) = block.child("experts") else {
            continue;
        };
        let Some(m) = matcher.find(&experts) else {
            return Err(ExportError::UnsupportedMoe {
                block: block.path().to_string(),
                experts_class: experts.class_chain().to_string(),
            });
        };
        instances
            .get(m.position)
            .prepare_moe_inputs(block.path(), block, ctx)?;
        ctx.lock()
            .moe_prepared
            .push((block.path().to_string(), m.entry.meta.path.to_string()));
    }

    for module in tree.walk() {
        let outcome = match matcher.find(&module) {
            Some(m) => {
                instances
                    .get(m.position)
                    .export(module.path(), module, ctx)?;
                ModuleOutcome::Exported {
                    exporter: m.entry.meta.path.to_string(),
                    reason: m.describe(),
                }
            }
            None => ModuleOutcome::Unchanged,
        };
        ctx.lock()
            .modules
            .push((module.path().to_string(), outcome));
    }
    Ok(())
}

/// The exporters of one call, each constructed on first use.
struct Instances<'r> {
    registry: &'r ExporterRegistry,
    made: Vec<Option<Box<dyn ModuleExporter>>>,
}

impl<'r> Instances<'r> {
    fn new(registry: &'r ExporterRegistry) -> Self {
        let mut made = Vec::new();
        made.resize_with(registry.len(), || None);
        Instances { registry, made }
    }

    fn get(&mut self, position: usize) -> &dyn ModuleExporter {
        let construct = self.registry.entries()[position].construct;
        &**self.made[position].get_or_insert_with(construct)
    }
}
