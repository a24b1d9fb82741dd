//! The module walk (docs/DESIGN.md §4): MoE preparation, then one `export` per matched module in
//! pre-order, a window of modules at a time in parallel, written in module order.

use super::context::lock;
use super::report::{ExportReport, ModuleOutcome};
use super::{ExportContext, ExportError, ModuleExporter};
use crate::export::registry::ExporterRegistry;
use crate::module_tree::{ModuleRef, ModuleTree};
use rayon::prelude::*;

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

/// What [`walk`] would do, without constructing or running any exporter: which exporter
/// each module goes to and why, and which exporter prepares each MoE block (`kiln explain`).
/// Fails as the walk would on an MoE block whose experts no exporter takes.
pub fn plan(tree: &ModuleTree, registry: &ExporterRegistry) -> Result<ExportReport, ExportError> {
    let mut matcher = registry.matcher();
    let mut report = ExportReport::default();
    for block in tree.walk().filter(is_moe) {
        let Some(experts) = block.child("experts") else {
            continue;
        };
        let m = matcher
            .find(&experts)
            .ok_or_else(|| ExportError::UnsupportedMoe {
                block: block.path().to_string(),
                experts_class: experts.class_chain().to_string(),
            })?;
        report
            .moe_prepared
            .push((block.path().to_string(), m.entry.meta.path.to_string()));
    }
    for module in tree.walk() {
        let outcome = match matcher.find(&module) {
            Some(m) => ModuleOutcome::Exported {
                exporter: m.entry.meta.path.to_string(),
                reason: m.describe(),
            },
            None => ModuleOutcome::Unchanged,
        };
        report.modules.push((module.path().to_string(), outcome));
    }
    Ok(report)
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
        lock(&ctx.report)
            .moe_prepared
            .push((block.path().to_string(), m.entry.meta.path.to_string()));
    }

    // Modules are exported a window at a time, in parallel (reading, quantizing); each
    // module's output is held by its own context and written in module order, so the bytes
    // never depend on scheduling or the thread count. The window bounds memory.
    let total = tree.len();
    let matched: Vec<_> = tree
        .walk()
        .map(|module| {
            let m = matcher.find(&module);
            let found = m.map(|m| {
                instances.get(m.position);
                (m.position, m.entry.meta.path.to_string(), m.describe())
            });
            (module, found)
        })
        .collect();
    let instances = &instances;
    let exporting = ctx.is_exporting();
    let mut done = 0;
    for window in matched.chunks(WINDOW) {
        if ctx.cancelled() {
            return Err(ExportError::Cancelled);
        }
        let results: Vec<(ExportContext, Result<(), ExportError>)> = window
            .par_iter()
            .map(|(module, found)| {
                let module_ctx = ctx.for_module();
                let result = match found {
                    Some((position, _, _)) => {
                        instances
                            .made(*position)
                            .export(module.path(), *module, &module_ctx)
                    }
                    None if exporting => module_ctx.copy_module(*module),
                    None => Ok(()),
                };
                (module_ctx, result)
            })
            .collect();
        for ((module, found), (module_ctx, result)) in window.iter().zip(results) {
            result?;
            let exporter = found
                .as_ref()
                .map_or("the default copy", |(_, e, _)| e.as_str());
            ctx.write_captured(module_ctx, exporter)?;
            let outcome = match found {
                Some((_, exporter, reason)) => ModuleOutcome::Exported {
                    exporter: exporter.clone(),
                    reason: reason.clone(),
                },
                None => ModuleOutcome::Unchanged,
            };
            lock(&ctx.report)
                .modules
                .push((module.path().to_string(), outcome));
            done += 1;
            if let Some(f) = &ctx.progress {
                f(done, total, module.path());
            }
        }
    }
    Ok(())
}

/// Modules exported at once by [`walk`]: enough to overlap one module's reading with another's
/// quantizing on a few cores, few enough that memory stays a few tensors.
const WINDOW: usize = 4;

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

    /// An exporter already constructed by [`Instances::get`].
    fn made(&self, position: usize) -> &dyn ModuleExporter {
        self.made[position]
            .as_deref()
            .expect("every matched exporter is constructed before the parallel walk")
    }
}
