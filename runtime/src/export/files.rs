//! The JSON files beside the weights: `hf_quant_config.json` and `config.json` with its
//! `quantization_config` (docs/FORMATS.md §3.2, §3.4), plus the tokenizer files copied as they are.

use super::recipe::{Format, KvCache};
use serde_json::{Map, Value, json};
use std::collections::BTreeSet;

/// Files copied from the model folder unchanged, when present.
pub const COPIED_FILES: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// ModelOpt's prefix-wildcard summary of the unquantized modules: for each, the shortest
/// candidate at a dot boundary — `prefix*`, then `prefix.*` — that matches no quantized
/// module, else the exact name; sorted and deduplicated.
pub fn exclude_summary(
    unquantized: &BTreeSet<String>,
    quantized: &BTreeSet<String>,
) -> Vec<String> {
    let covers_quantized = |prefix: &str| quantized.iter().any(|q| q.starts_with(prefix));
    let mut out = BTreeSet::new();
    for name in unquantized {
        let mut chosen = None;
        for (i, _) in name.match_indices('.') {
            let prefix = &name[..i];
            if !covers_quantized(prefix) {
                chosen = Some(format!("{prefix}*"));
                break;
            }
            if !quantized.contains(prefix) && !covers_quantized(&format!("{prefix}.")) {
                chosen = Some(format!("{prefix}.*"));
                break;
            }
        }
        out.insert(chosen.unwrap_or_else(|| name.clone()));
    }
    out.into_iter().collect()
}

/// The producer block: kiln and its version.
pub fn producer() -> Value {
    json!({"name": "kiln", "version": env!("CARGO_PKG_VERSION")})
}

/// `hf_quant_config.json` from the declarations, in declaration order. One format for every
/// quantized module gives a single merged dict with `exclude_modules`; several give
/// `MIXED_PRECISION` with `quantized_layers` in that order (docs/FORMATS.md §3.2).
pub fn hf_quant_config(
    declared: &[(String, Format)],
    exclude: &[String],
    kv: Option<KvCache>,
    group: Option<usize>,
) -> Value {
    let formats: BTreeSet<Format> = declared.iter().map(|(_, f)| *f).collect();
    let kv = kv.map_or(Value::Null, |k| json!(k.quant_algo()));
    let mut q = Map::new();
    if formats.len() <= 1 {
        let layer = formats.iter().next().map(|f| f.layer_config(group));
        q.insert(
            "quant_algo".into(),
            layer
                .as_ref()
                .map_or(Value::Null, |l| l["quant_algo"].clone()),
        );
        q.insert("kv_cache_quant_algo".into(), kv);
        if let Some(Value::Object(l)) = layer {
            for (k, v) in l.into_iter().filter(|(k, _)| k != "quant_algo") {
                q.insert(k, v);
            }
        }
        q.insert("exclude_modules".into(), json!(exclude));
    } else {
        q.insert("quant_algo".into(), json!("MIXED_PRECISION"));
        q.insert("kv_cache_quant_algo".into(), kv);
        let layers: Map<String, Value> = declared
            .iter()
            .map(|(m, f)| (m.clone(), f.layer_config(group)))
            .collect();
        q.insert("quantized_layers".into(), Value::Object(layers));
    }
    json!({"producer": producer(), "quantization": Value::Object(q)})
}

/// `config.json`'s `quantization_config`, converted from `hf_quant_config` as ModelOpt's
/// `convert_hf_quant_config_format` does, keys in its order (docs/FORMATS.md §3.4).
pub fn quantization_config(hf: &Value) -> Value {
    let q = &hf["quantization"];
    let algo = q.get("quant_algo").and_then(Value::as_str);
    let mut out = Map::new();
    if algo == Some("MIXED_PRECISION") {
        // One group per distinct per-layer dict, in order of first appearance; targets sorted.
        let mut groups: Vec<(&Value, Vec<String>)> = Vec::new();
        if let Some(Value::Object(layers)) = q.get("quantized_layers") {
            for (m, cfg) in layers {
                match groups.iter_mut().find(|(c, _)| *c == cfg) {
                    Some((_, targets)) => targets.push(m.clone()),
                    None => groups.push((cfg, vec![m.clone()])),
                }
            }
        }
        let mut config_groups = Map::new();
        for (i, (cfg, mut targets)) in groups.into_iter().enumerate() {
            targets.sort();
            let format = cfg
                .get("quant_algo")
                .and_then(Value::as_str)
                .and_then(Format::from_quant_algo);
            let group_size = cfg
                .get("group_size")
                .and_then(Value::as_u64)
                .and_then(|g| u32::try_from(g).ok());
            let mut g = format
                .map(|f| f.mixed_group(group_size))
                .unwrap_or_default();
            g.insert("targets".into(), json!(targets));
            config_groups.insert(format!("group_{i}"), Value::Object(g));
        }
        out.insert("config_groups".into(), Value::Object(config_groups));
        out.insert("quantized_layers".into(), q["quantized_layers"].clone());
    } else if let Some(group) = algo
        .and_then(Format::from_quant_algo)
        .and_then(Format::config_group)
    {
        out.insert("config_groups".into(), json!({"group_0": group}));
    }
    out.insert(
        "ignore".into(),
        q.get("exclude_modules")
            .cloned()
            .unwrap_or_else(|| json!([])),
    );
    if let Some(algo) = q.get("quant_algo").filter(|a| !a.is_null()) {
        out.insert("quant_algo".into(), algo.clone());
    }
    match q.get("kv_cache_quant_algo").and_then(Value::as_str) {
        Some("FP8") => {
            out.insert(
                "kv_cache_scheme".into(),
                json!({"dynamic": false, "num_bits": 8, "type": "float"}),
            );
        }
        Some(other) => {
            out.insert("kv_cache_scheme".into(), json!(other));
        }
        None => {}
    }
    out.insert("producer".into(), hf["producer"].clone());
    out.insert("quant_method".into(), json!("modelopt"));
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn exclude_summary_follows_the_prefix_wildcard_rule() {
        let quantized = set(&[
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.mlp.experts.0.up_proj",
            "model.layers.10.mlp.up_proj",
        ]);
        let unquantized = set(&[
            "lm_head",
            "model.embed_tokens",
            "model.layers.0.mlp.gate",
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.mlp.up_proj",
        ]);
        assert_eq!(
            exclude_summary(&unquantized, &quantized),
            // Routers and embeddings by name; a whole layer by wildcard — but `model.layers.1*`
            // would also cover layer 10, so layer 1 becomes `model.layers.1.*`.
            [
                "lm_head",
                "model.embed_tokens",
                "model.layers.0.mlp.gate",
                "model.layers.1.*"
            ]
        );
        let none: BTreeSet<String> = BTreeSet::new();
        assert_eq!(exclude_summary(&set(&["lm_head"]), &none), ["lm_head"]);
        assert_eq!(exclude_summary(&set(&["a.b.c"]), &none), ["a*"]);
    }

    #[test]
    fn single_format_configs_match_modelopt_shapes() {
        let quantized = [("m.q".to_string(), Format::Nvfp4)];
        let hf = hf_quant_config(&quantized, &["lm_head".into()], Some(KvCache::Fp8), None);
        assert_eq!(
            serde_json::to_string(&hf["quantization"]).unwrap(),
            r#"{"quant_algo":"NVFP4","kv_cache_quant_algo":"FP8","group_size":16,"exclude_modules":["lm_head"]}"#
        );
        let qc = quantization_config(&hf);
        let keys: Vec<&String> = qc.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "config_groups",
                "ignore",
                "quant_algo",
                "kv_cache_scheme",
                "producer",
                "quant_method"
            ]
        );
        assert_eq!(qc["config_groups"]["group_0"]["weights"]["group_size"], 16);
        assert_eq!(
            qc["kv_cache_scheme"],
            json!({"dynamic": false, "num_bits": 8, "type": "float"})
        );

        let fp8 = [("m.q".to_string(), Format::Fp8)];
        let hf = hf_quant_config(&fp8, &[], None, None);
        assert_eq!(
            serde_json::to_string(&hf["quantization"]).unwrap(),
            r#"{"quant_algo":"FP8","kv_cache_quant_algo":null,"exclude_modules":[]}"#
        );
        let qc = quantization_config(&hf);
        assert!(qc.get("kv_cache_scheme").is_none());
        // Formats without a config group (W8A16) get none.
        let int8 = [("m.q".to_string(), Format::Int8Wo)];
        let qc = quantization_config(&hf_quant_config(&int8, &[], None, None));
        assert!(qc.get("config_groups").is_none());
        assert_eq!(qc["quant_algo"], "W8A16");
    }

    #[test]
    fn mixed_formats_group_layers_as_modelopt_does() {
        // In declaration order; groups numbered by first appearance, targets sorted, each
        // group the compressed-tensors entry of its format (not the per-layer dict).
        let q = [
            ("z".to_string(), Format::Nvfp4),
            ("a".to_string(), Format::Fp8),
            ("c".to_string(), Format::Nvfp4),
        ];
        let hf = hf_quant_config(&q, &["lm_head".into()], None, None);
        assert_eq!(hf["quantization"]["quant_algo"], "MIXED_PRECISION");
        assert!(hf["quantization"].get("exclude_modules").is_none());
        let layers: Vec<&String> = hf["quantization"]["quantized_layers"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(layers, ["z", "a", "c"]);
        let qc = quantization_config(&hf);
        assert_eq!(
            qc["config_groups"],
            json!({
                "group_0": {
                    "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                    "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": 16},
                    "targets": ["c", "z"],
                },
                "group_1": {
                    "input_activations": {"dynamic": false, "num_bits": 8, "type": "float"},
                    "weights": {"dynamic": false, "num_bits": 8, "type": "float"},
                    "targets": ["a"],
                },
            })
        );
        assert_eq!(qc["ignore"], json!([]));
    }
}
