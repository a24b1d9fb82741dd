//! Linears that receive the same input (q/k/v; gate/up; Mixtral's w1/w3) and so share scales
//! in some formats (docs/FORMATS.md §4.2). Used by the Linear exporter, the smoothing plan and the
//! export's up-front checks.

use crate::module_tree::ModuleRef;

/// Siblings that receive the same input and so share `input_scale` and `weight_scale_2` in the
/// NVFP4 family (docs/FORMATS.md §4.2): q/k/v; gate/up; Mixtral's w1/w3.
const SHARED_INPUT_GROUPS: [&[&str]; 3] = [
    &["q_proj", "k_proj", "v_proj"],
    &["gate_proj", "up_proj"],
    &["w1", "w3"],
];

/// The quantized siblings of `module` (itself included) that share its input.
pub fn input_group(module: ModuleRef<'_>, quantized: impl Fn(&str) -> bool) -> Vec<String> {
    let me = module.local_name();
    let Some(parent) = module.parent() else {
        return vec![module.path().to_string()];
    };
    match SHARED_INPUT_GROUPS.iter().find(|g| g.contains(&me)) {
        Some(group) => group
            .iter()
            .filter_map(|n| parent.child(n))
            .filter(|m| m.tensor("weight").is_some() && quantized(m.path()))
            .map(|m| m.path().to_string())
            .collect(),
        None => vec![module.path().to_string()],
    }
}
