//! Activation statistics given on the command line (`--act-amax FILE`): a JSON object keyed by
//! ModelOpt's quantizer names, so a ModelOpt calibration can be reused —
//! `"<module>.input_quantizer": amax` for Linear inputs and
//! `"<attention>.k_bmm_quantizer"` / `"<attention>.v_bmm_quantizer"` for KV-cache scales.

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
}

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
        for (key, v) in doc {
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
        Ok(ActAmax { values })
    }

    /// From explicit values (tests, the demo model, calibration).
    pub fn from_values(values: impl IntoIterator<Item = (String, f32)>) -> Self {
        ActAmax {
            values: values.into_iter().collect(),
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
        let text =
            serde_json::to_string_pretty(&self.values).expect("a map of floats serializes") + "\n";
        std::fs::write(path, text).map_err(|e| ActAmaxError {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
    }

    /// Whether no value is present.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
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
        std::fs::write(&p, "[1]").unwrap();
        assert!(
            ActAmax::read(&p)
                .unwrap_err()
                .to_string()
                .contains("expected a JSON object")
        );
    }
}
