//! Mixture-of-experts blocks whose experts are a list of modules (Qwen-MoE, Mixtral, DeepSeek
//! in transformers 4; docs/FORMATS.md §4.3a). The experts' Linears are exported one by one by
//! [`super::linear::QuantLinear`]; this exporter prepares their inputs first.

use super::{ExportContext, ExportError, ModuleExporter, is_moe};
use crate::module_tree::ModuleRef;

/// An `experts` list (numbered children) directly under an MoE block.
pub fn is_iterable_experts(m: &ModuleRef<'_>) -> bool {
    m.local_name() == "experts"
        && m.children().next().is_some()
        && m.children()
            .all(|c| c.local_name().parse::<usize>().is_ok())
        && m.parent().is_some_and(|p| is_moe(&p))
}

/// Whether `module` is a Linear of one expert in an iterable experts list.
pub fn in_iterable_expert(module: ModuleRef<'_>) -> bool {
    module
        .parent()
        .and_then(|expert| expert.parent())
        .is_some_and(|list| is_iterable_experts(&list))
}

/// The gate/up pair of the expert holding `module`, when `module` is one of them (ModelOpt's
/// `sync_moe_gate_up_amax`: their weight amax is synced, for every format).
pub fn expert_gate_up(module: ModuleRef<'_>) -> Option<[String; 2]> {
    if !in_iterable_expert(module) {
        return None;
    }
    let expert = module.parent()?;
    [["gate_proj", "up_proj"], ["w1", "w3"]]
        .into_iter()
        .find_map(|pair| {
            if !pair.contains(&module.local_name()) {
                return None;
            }
            let (a, b) = (expert.child(pair[0])?, expert.child(pair[1])?);
            Some([a.path().to_string(), b.path().to_string()])
        })
}

/// ModelOpt's `_prepare_iterable_experts`: every expert Linear gets an input amax — a missing or
/// zero one becomes the max over the other experts (0.5 when none has one), so experts that saw
/// no calibration tokens still export.
#[crate::exporter(predicate = is_iterable_experts, crate = crate)]
#[derive(Debug, Default)]
pub struct IterableExperts;

impl ModuleExporter for IterableExperts {
    fn prepare_moe_inputs(
        &self,
        _name: &str,
        block: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        if !ctx.is_exporting() {
            return Ok(());
        }
        let Some(experts) = block.child("experts") else {
            return Ok(());
        };
        let mut names: Vec<String> = Vec::new();
        for expert in experts.children() {
            for linear in expert.children().filter(|l| l.tensor("weight").is_some()) {
                if !names.iter().any(|n| n == linear.local_name()) {
                    names.push(linear.local_name().to_string());
                }
            }
        }
        for name in &names {
            let modules: Vec<String> = experts
                .children()
                .filter_map(|e| e.child(name))
                .map(|l| l.path().to_string())
                .collect();
            let mut known = Vec::new();
            for m in &modules {
                known.push(ctx.input_amax(m)?.filter(|&a| a > 0.0));
            }
            let fill = known
                .iter()
                .flatten()
                .copied()
                .fold(None, |acc: Option<f32>, a| {
                    Some(acc.map_or(a, |b| b.max(a)))
                });
            // Only experts that saw no calibration tokens are filled from their siblings; a
            // whole group without statistics is refused before the walk (formats with input
            // scales), and for the others the value is unused (ModelOpt's 0.5).
            let used = ctx.recipe()?.format.needs_input_scale();
            for (m, k) in modules.iter().zip(&known) {
                if k.is_none() {
                    let value = fill.unwrap_or(0.5);
                    ctx.set_input_amax(m, value)?;
                    if used {
                        ctx.warn(
                            m,
                            format!("no input amax (no calibration token reached this expert): filled with its siblings' max, {value}"),
                        );
                    }
                }
            }
        }
        Ok(())
    }
}
