//! The record of one export call: what happened to each module, and the notes left.

use std::collections::BTreeMap;

/// What happened to one module during the walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModuleOutcome {
    /// Exported by the exporter with this type path, matched for this reason.
    Exported {
        /// The exporter's type path.
        exporter: String,
        /// Why it matched.
        reason: String,
    },
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
    /// Defaults an exporter substituted for something missing (an expert's input amax filled
    /// from its siblings, ...), per module: printed as warnings.
    pub warnings: Vec<(String, String)>,
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
