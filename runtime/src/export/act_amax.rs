//! Activation statistics given on the command line (`--act-amax FILE`): a JSON object keyed by
//! ModelOpt's quantizer names, so a ModelOpt calibration can be reused —
//! `"<module>.input_quantizer": amax` for Linear inputs and
//! `"<attention>.k_bmm_quantizer"` / `"<attention>.v_bmm_quantizer"` for KV-cache scales — and,
//! for the AWQ and SmoothQuant formats, `"<module>.input_quantizer._pre_quant_scale": [...]`,
//! the per-input-channel scale the calibration chose (ModelOpt's state-dict name), and for
//! int4-awq after AWQ's clipping search, `"<module>.weight_quantizer": [...]`, the clipped
//! amax of every 128-block of the (smoothed) weight, row-major over `[out, in / 128]`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
            values,
            pre_quant_scales,
            weight_amax,
        })
    }

    /// From explicit values (tests, the demo model, calibration).
    pub fn from_values(values: impl IntoIterator<Item = (String, f32)>) -> Self {
        ActAmax {
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
