//! Activation statistics given on the command line (`--act-amax FILE`): a JSON object keyed by
//! ModelOpt's quantizer names, so a ModelOpt calibration can be reused —
//! `"<module>.input_quantizer": amax` for Linear inputs and
//! `"<attention>.k_bmm_quantizer"` / `"<attention>.v_bmm_quantizer"` for KV-cache scales — and,
//! for the AWQ and SmoothQuant formats, `"<module>.input_quantizer._pre_quant_scale": [...]`,
//! the per-input-channel scale the calibration chose (ModelOpt's state-dict name), and for
//! int4-awq after AWQ's clipping search, `"<module>.weight_quantizer": [...]`, the clipped
//! amax of every 128-block of the (smoothed) weight, row-major over `[out, in / 128]`.

use crate::module_tree::{ModuleRef, ModuleTree};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// How a statistics file's keys applied to a model ([`ActAmax::bind`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Binding {
    /// Keys that name no quantizer of the model (a warning; an error with `--strict`).
    pub unknown: Vec<String>,
    /// Keys under transformers 5's in-memory names, with the checkpoint's quantizers each
    /// was applied to.
    pub mapped: Vec<(String, Vec<String>)>,
}

/// The quantizer-name suffixes a statistics key can end in, after its module path.
const SUFFIXES: [&str; 5] = [
    ".input_quantizer._pre_quant_scale",
    ".input_quantizer",
    ".weight_quantizer",
    ".k_bmm_quantizer",
    ".v_bmm_quantizer",
];

/// The module path `path` names in `tree`, directly or under transformers' hub names
/// (`mlp` → `block_sparse_moe`).
fn find_module<'t>(tree: &'t ModuleTree, path: &str) -> Option<ModuleRef<'t>> {
    tree.find(path).or_else(|| {
        let hub = path.replace(".mlp.", ".block_sparse_moe.");
        let hub = match hub.strip_suffix(".mlp") {
            Some(p) => format!("{p}.block_sparse_moe"),
            None => hub,
        };
        tree.find(&hub)
    })
}

/// The fused experts' input quantizer that the per-expert Linear `path`
/// (`<experts>.<e>.<gate_proj | up_proj | down_proj | w1 | w3 | w2>`, transformers 4's names)
/// feeds, when the checkpoint holds those experts fused (`<experts>.gate_up_proj`, …).
fn per_expert_to_fused(tree: &ModuleTree, path: &str) -> Option<String> {
    let (expert, local) = path.rsplit_once('.')?;
    let (experts, index) = expert.rsplit_once('.')?;
    index.parse::<usize>().ok()?;
    let experts = find_module(tree, experts)?;
    let is_3d = |p: &str| experts.tensor(p).is_some_and(|t| t.shape.len() == 3);
    let projection = match local {
        "gate_proj" | "w1" | "up_proj" | "w3" if is_3d("gate_up_proj") => "gate_up_proj",
        "up_proj" if is_3d("up_proj") => "up_proj",
        "down_proj" | "w2" if is_3d("down_proj") => "down_proj",
        _ => return None,
    };
    Some(format!("{}.{projection}_input_quantizer", experts.path()))
}

/// The keys of the checkpoint's quantizers that statistics key `key` applies to; `None` when
/// it names none.
fn bind_key(tree: &ModuleTree, key: &str) -> Option<Vec<String>> {
    for suffix in SUFFIXES {
        let Some(path) = key.strip_suffix(suffix) else {
            continue;
        };
        let Some(module) = find_module(tree, path) else {
            return (suffix == ".input_quantizer")
                .then(|| per_expert_to_fused(tree, path))
                .flatten()
                .map(|q| vec![q]);
        };
        let has_weight = module.tensor("weight").is_some();
        let is_attention = suffix.contains("_bmm_") && module.child("k_proj").is_some();
        return (has_weight || is_attention).then(|| vec![format!("{}{suffix}", module.path())]);
    }
    // 3-D experts' per-projection quantizers: `<experts>.<p>_input_quantizer[._pre_quant_scale]`.
    let (stem, tail) = match key.strip_suffix("._pre_quant_scale") {
        Some(stem) => (stem, "._pre_quant_scale"),
        None => (key, ""),
    };
    let (path, projection) = stem.strip_suffix("_input_quantizer")?.rsplit_once('.')?;
    let experts = find_module(tree, path)?;
    if experts.tensor(projection).is_some() {
        return Some(vec![format!(
            "{}.{projection}_input_quantizer{tail}",
            experts.path()
        )]);
    }
    // Fused in memory, per-expert Linears on disk.
    let locals: &[&[&str]] = match projection {
        "gate_up_proj" => &[&["gate_proj", "up_proj"], &["w1", "w3"]],
        "down_proj" => &[&["down_proj"], &["w2"]],
        "up_proj" => &[&["up_proj"]],
        _ => return None,
    };
    let mut targets = Vec::new();
    for expert in experts
        .children()
        .filter(|e| e.local_name().parse::<usize>().is_ok())
    {
        let linears = locals
            .iter()
            .find(|names| names.iter().all(|n| expert.child(n).is_some()))?;
        for n in *linears {
            targets.push(format!("{}.{n}.input_quantizer{tail}", expert.path()));
        }
    }
    (!targets.is_empty()).then_some(targets)
}

/// Why an activation-statistics file was rejected.
#[derive(Debug, thiserror::Error)]
#[error("{}: {message}", path.display())]
pub struct ActAmaxError {
    /// The statistics file.
    pub path: PathBuf,
    /// What is wrong.
    pub message: String,
}

/// Per-quantizer activation amax.
#[derive(Debug, Clone, Default)]
pub struct ActAmax {
    /// The file the values came from, if any (for messages).
    source: Option<PathBuf>,
    values: BTreeMap<String, f32>,
    /// `<module>.input_quantizer._pre_quant_scale` → one positive finite value per input channel.
    pre_quant_scales: BTreeMap<String, Vec<f32>>,
    /// `<module>.weight_quantizer` → the weight's block amax (AWQ's clipping search).
    weight_amax: BTreeMap<String, Vec<f32>>,
}

/// The key suffix of a weight quantizer's amax.
const WEIGHT: &str = ".weight_quantizer";

/// The key suffix of a pre-quant scale vector.
const PQS: &str = "._pre_quant_scale";

impl ActAmax {
    /// Reads `path`: an object of non-negative finite numbers (one-element lists are accepted,
    /// as ModelOpt dumps 1-element tensors).
    pub fn read(path: &Path) -> Result<Self, ActAmaxError> {
        let bad = |message: String| ActAmaxError {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let doc: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text)
            .map_err(|e| bad(format!("expected a JSON object of amax values: {e}")))?;
        let mut values = BTreeMap::new();
        let mut pre_quant_scales = BTreeMap::new();
        let mut weight_amax = BTreeMap::new();
        for (key, v) in doc {
            // Lists: a weight's block amax (non-negative) or a pre-quant scale (positive).
            let list = if key.ends_with(WEIGHT) {
                Some((
                    &mut weight_amax,
                    0.0,
                    "non-negative numbers (one per weight block)",
                ))
            } else if key.ends_with(PQS) {
                Some((
                    &mut pre_quant_scales,
                    f64::MIN_POSITIVE,
                    "positive numbers (one per input channel)",
                ))
            } else {
                None
            };
            if let Some((into, least, what)) = list {
                let values: Option<Vec<f32>> = v.as_array().and_then(|a| {
                    a.iter()
                        .map(|x| x.as_f64().filter(|x| x.is_finite() && *x >= least))
                        .map(|x| x.map(|x| x as f32))
                        .collect()
                });
                match values {
                    Some(list) if !list.is_empty() => {
                        into.insert(key, list);
                    }
                    _ => return Err(bad(format!("`{key}`: expected a list of {what}"))),
                }
                continue;
            }
            let n = match &v {
                serde_json::Value::Array(a) if a.len() == 1 => a[0].as_f64(),
                other => other.as_f64(),
            };
            match n {
                Some(x) if x.is_finite() && x >= 0.0 => {
                    values.insert(key, x as f32);
                }
                _ => {
                    return Err(bad(format!(
                        "`{key}`: expected a non-negative number, found {v}"
                    )));
                }
            }
        }
        Ok(ActAmax {
            source: Some(path.to_path_buf()),
            values,
            pre_quant_scales,
            weight_amax,
        })
    }

    /// From explicit values (tests, the demo model, calibration).
    pub fn from_values(values: impl IntoIterator<Item = (String, f32)>) -> Self {
        ActAmax {
            source: None,
            values: values.into_iter().collect(),
            pre_quant_scales: BTreeMap::new(),
            weight_amax: BTreeMap::new(),
        }
    }

    /// The input amax of the Linear at `module`.
    pub fn input(&self, module: &str) -> Option<f32> {
        self.values
            .get(&format!("{module}.input_quantizer"))
            .copied()
    }

    /// Sets the input amax of the Linear at `module` (MoE preparation fills missing experts).
    pub fn set_input(&mut self, module: &str, amax: f32) {
        self.values
            .insert(format!("{module}.input_quantizer"), amax);
    }

    /// Sets the AWQ / SmoothQuant pre-quant scale of the Linear at `module`.
    pub fn set_pre_quant_scale(&mut self, module: &str, scales: Vec<f32>) {
        self.pre_quant_scales
            .insert(format!("{module}.input_quantizer{PQS}"), scales);
    }

    /// The AWQ / SmoothQuant pre-quant scale of the Linear at `module` (one per input channel).
    pub fn pre_quant_scale(&self, module: &str) -> Option<&[f32]> {
        self.pre_quant_scales
            .get(&format!("{module}.input_quantizer{PQS}"))
            .map(Vec::as_slice)
    }

    /// Sets the block amax of the weight of the Linear at `module` (AWQ's clipping search).
    pub fn set_weight_amax(&mut self, module: &str, amax: Vec<f32>) {
        self.weight_amax.insert(format!("{module}{WEIGHT}"), amax);
    }

    /// The given block amax of the weight of the Linear at `module`, if any.
    pub fn weight_amax(&self, module: &str) -> Option<&[f32]> {
        self.weight_amax
            .get(&format!("{module}{WEIGHT}"))
            .map(Vec::as_slice)
    }

    /// Whether any weight amax is given.
    pub fn has_weight_amax(&self) -> bool {
        !self.weight_amax.is_empty()
    }

    /// The amax of the quantizer named `quantizer` (ModelOpt's module name, e.g.
    /// `<experts>.gate_up_proj_input_quantizer` for 3-D experts).
    pub fn quantizer(&self, quantizer: &str) -> Option<f32> {
        self.values.get(quantizer).copied()
    }

    /// The K or V amax of the attention module at `attention` (`which` is `k` or `v`).
    pub fn kv(&self, attention: &str, which: char) -> Option<f32> {
        self.values
            .get(&format!("{attention}.{which}_bmm_quantizer"))
            .copied()
    }

    /// Writes the values as `--act-amax` reads them (sorted keys).
    pub fn write(&self, path: &Path) -> Result<(), ActAmaxError> {
        let mut doc: BTreeMap<&str, serde_json::Value> = self
            .values
            .iter()
            .map(|(k, v)| (k.as_str(), serde_json::json!(v)))
            .collect();
        for (k, v) in self.pre_quant_scales.iter().chain(&self.weight_amax) {
            doc.insert(k, serde_json::json!(v));
        }
        let text = serde_json::to_string_pretty(&doc).expect("a map of numbers serializes") + "\n";
        std::fs::write(path, text).map_err(|e| ActAmaxError {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// The file the values were read from, if any.
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// Applies the keys to the module tree of the model being exported. Keys that name a
    /// quantizer of the tree are kept as they are. Keys under the names transformers 5 holds
    /// a model by in memory — what ModelOpt's dumps use there — are mapped onto the checkpoint
    /// on disk, as transformers' own checkpoint conversion maps them (`block_sparse_moe` ↔
    /// `mlp`; fused experts ↔ per-expert Linears):
    ///
    /// - `<experts>.gate_up_proj_input_quantizer` (one quantizer for every expert's gate and up
    ///   projections) → `<experts>.<e>.{gate_proj,up_proj | w1,w3}.input_quantizer` of every
    ///   expert `e`; `<experts>.down_proj_input_quantizer` → `<experts>.<e>.{down_proj | w2}`;
    ///   `<experts>.up_proj_input_quantizer` (no gate) → `<experts>.<e>.up_proj`; the same for
    ///   their `._pre_quant_scale`;
    /// - a Linear, attention or experts path with `mlp` where the checkpoint has
    ///   `block_sparse_moe` (Mixtral) → that path.
    ///
    /// - the other way, transformers 4's per-expert `<experts>.<e>.<linear>.input_quantizer`
    ///   onto experts the checkpoint holds fused: the projection's one quantizer takes the max
    ///   over the experts (it sees every expert's tokens).
    ///
    /// A value the file gives under the checkpoint's own name wins over a mapped one. Keys
    /// that name no quantizer of the tree are returned in [`Binding::unknown`].
    pub fn bind(mut self, tree: &ModuleTree) -> (ActAmax, Binding) {
        let mut binding = Binding::default();
        let keys: Vec<String> = self
            .values
            .keys()
            .chain(self.pre_quant_scales.keys())
            .chain(self.weight_amax.keys())
            .cloned()
            .collect();
        let given: std::collections::BTreeSet<String> = keys.iter().cloned().collect();
        for key in keys {
            let targets = bind_key(tree, &key);
            match targets {
                None => binding.unknown.push(key),
                Some(t) if t.len() == 1 && t[0] == key => {}
                Some(targets) => {
                    self.map_key(&key, &targets, &given);
                    binding.mapped.push((key, targets));
                }
            }
        }
        (self, binding)
    }

    /// Moves the value of `key` to each of `targets` the file did not give itself (`given`):
    /// an amax several keys map onto takes their max; a list the first one's.
    fn map_key(
        &mut self,
        key: &str,
        targets: &[String],
        given: &std::collections::BTreeSet<String>,
    ) {
        fn copy<V: Clone>(
            map: &mut BTreeMap<String, V>,
            key: &str,
            targets: &[String],
            given: &std::collections::BTreeSet<String>,
            merge: impl Fn(&mut V, &V),
        ) {
            if let Some(v) = map.remove(key) {
                for t in targets.iter().filter(|t| !given.contains(*t)) {
                    match map.get_mut(t) {
                        Some(old) => merge(old, &v),
                        None => {
                            map.insert(t.clone(), v.clone());
                        }
                    }
                }
            }
        }
        copy(&mut self.values, key, targets, given, |old, v| {
            *old = old.max(*v)
        });
        copy(&mut self.pre_quant_scales, key, targets, given, |_, _| {});
        copy(&mut self.weight_amax, key, targets, given, |_, _| {});
    }

    /// Whether no value is present.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty() && self.pre_quant_scales.is_empty() && self.weight_amax.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_modelopt_quantizer_keys_and_rejects_bad_values() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("amax.json");
        std::fs::write(
            &p,
            r#"{"model.layers.0.self_attn.q_proj.input_quantizer": 3.5,
            "model.layers.0.self_attn.k_bmm_quantizer": [12.0]}"#,
        )
        .unwrap();
        let a = ActAmax::read(&p).unwrap();
        assert_eq!(a.input("model.layers.0.self_attn.q_proj"), Some(3.5));
        assert_eq!(a.kv("model.layers.0.self_attn", 'k'), Some(12.0));
        assert_eq!(a.input("missing"), None);
        std::fs::write(&p, r#"{"x.input_quantizer": -1}"#).unwrap();
        let err = ActAmax::read(&p).unwrap_err().to_string();
        assert!(
            err.ends_with("`x.input_quantizer`: expected a non-negative number, found -1"),
            "{err}"
        );
        std::fs::write(
            &p,
            r#"{"m.input_quantizer._pre_quant_scale": [0.5, 2.0], "m.input_quantizer": 1}"#,
        )
        .unwrap();
        let a = ActAmax::read(&p).unwrap();
        assert_eq!(a.pre_quant_scale("m"), Some(&[0.5f32, 2.0][..]));
        assert_eq!(a.input("m"), Some(1.0));
        std::fs::write(&p, r#"{"m.input_quantizer._pre_quant_scale": [0.5, 0]}"#).unwrap();
        let err = ActAmax::read(&p).unwrap_err().to_string();
        assert!(err.contains("expected a list of positive numbers"), "{err}");
        std::fs::write(&p, "[1]").unwrap();
        assert!(
            ActAmax::read(&p)
                .unwrap_err()
                .to_string()
                .contains("expected a JSON object")
        );
    }
}
