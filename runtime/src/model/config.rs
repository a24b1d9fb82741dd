//! What the forward pass reads from `config.json`.

use super::ModelError;
use serde_json::{Map, Value};

/// RoPE frequency scaling (`rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Llama 3.1's: long wavelengths divided by `factor`, a smooth blend in between.
    Llama3 {
        /// `factor`.
        factor: f32,
        /// `low_freq_factor`.
        low_freq_factor: f32,
        /// `high_freq_factor`.
        high_freq_factor: f32,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f32,
    },
}

/// How an MoE block routes tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeRouting {
    /// Experts per block.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Whether the chosen experts' weights are renormalised to sum to 1 (Mixtral always;
    /// Qwen-MoE when `norm_topk_prob`).
    pub normalize_top_k: bool,
}

/// A decoder's shape and numerics.
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    /// `hidden_size`.
    pub hidden: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads` (default: `heads`).
    pub kv_heads: usize,
    /// `head_dim` (default: `hidden / heads`).
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub eps: f64,
    /// `rope_theta` (or transformers 5's `rope_parameters.rope_theta`).
    pub rope_theta: f64,
    /// `rope_scaling`.
    pub rope_scaling: RopeScaling,
    /// `tie_word_embeddings`.
    pub tie_word_embeddings: bool,
    /// Per layer: the sliding window, if that layer uses one.
    pub sliding_windows: Vec<Option<usize>>,
    /// MoE routing, for models with experts.
    pub moe: Option<MoeRouting>,
}

fn field<'a>(raw: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    raw.get(name).filter(|v| !v.is_null())
}

fn usize_of(raw: &Map<String, Value>, name: &str) -> Result<Option<usize>, ModelError> {
    match field(raw, name) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| Some(n as usize))
            .ok_or_else(|| {
                ModelError::Config(format!("`{name}` must be a positive integer, found {v}"))
            }),
    }
}

fn required(raw: &Map<String, Value>, name: &str) -> Result<usize, ModelError> {
    usize_of(raw, name)?.ok_or_else(|| ModelError::Config(format!("`{name}` is missing")))
}

fn f64_of(raw: &Map<String, Value>, name: &str) -> Result<Option<f64>, ModelError> {
    match field(raw, name) {
        None => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ModelError::Config(format!("`{name}` must be a number, found {v}"))),
    }
}

impl DecoderConfig {
    /// Reads the fields the forward pass needs; a missing or contradictory one is a named
    /// error.
    pub fn from_json(raw: &Map<String, Value>) -> Result<Self, ModelError> {
        let hidden = required(raw, "hidden_size")?;
        let layers = required(raw, "num_hidden_layers")?;
        let heads = required(raw, "num_attention_heads")?;
        let kv_heads = usize_of(raw, "num_key_value_heads")?.unwrap_or(heads);
        if heads % kv_heads != 0 {
            return Err(ModelError::Config(format!(
                "`num_attention_heads` ({heads}) is not a multiple of `num_key_value_heads` ({kv_heads})"
            )));
        }
        let head_dim = usize_of(raw, "head_dim")?.unwrap_or(hidden / heads);
        if head_dim % 2 != 0 {
            return Err(ModelError::Config(format!(
                "`head_dim` ({head_dim}) must be even for RoPE"
            )));
        }
        let params = field(raw, "rope_parameters").and_then(Value::as_object);
        let rope_theta = match f64_of(raw, "rope_theta")? {
            Some(t) => t,
            None => params
                .and_then(|p| p.get("rope_theta"))
                .and_then(Value::as_f64)
                .unwrap_or(10_000.0),
        };
        let scaling = field(raw, "rope_scaling")
            .and_then(Value::as_object)
            .or(params);
        let rope_scaling = match scaling {
            None => RopeScaling::None,
            Some(s) => {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                let num = |k: &str| -> Result<f32, ModelError> {
                    s.get(k)
                        .and_then(Value::as_f64)
                        .map(|v| v as f32)
                        .ok_or_else(|| ModelError::Config(format!("`rope_scaling.{k}` is missing")))
                };
                match kind {
                    "default" => RopeScaling::None,
                    "llama3" => RopeScaling::Llama3 {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_max_position_embeddings: num("original_max_position_embeddings")?,
                    },
                    other => {
                        return Err(ModelError::Config(format!(
                            "`rope_scaling` type `{other}` is not supported (supported: default, llama3)"
                        )));
                    }
                }
            }
        };
        let window = usize_of(raw, "sliding_window")?;
        let use_window = field(raw, "use_sliding_window")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        let sliding_windows = match field(raw, "layer_types").and_then(Value::as_array) {
            Some(types) => types
                .iter()
                .map(|t| {
                    (t.as_str() == Some("sliding_attention"))
                        .then_some(window)
                        .flatten()
                })
                .collect(),
            None => vec![window.filter(|_| use_window); layers],
        };
        let experts = match usize_of(raw, "num_local_experts")? {
            Some(e) => Some(e),
            None => usize_of(raw, "num_experts")?,
        };
        let moe = match experts {
            None => None,
            Some(experts) => {
                let mixtral = field(raw, "num_local_experts").is_some();
                Some(MoeRouting {
                    experts,
                    top_k: required(raw, "num_experts_per_tok")?,
                    normalize_top_k: mixtral
                        || field(raw, "norm_topk_prob")
                            .and_then(Value::as_bool)
                            .unwrap_or(false),
                })
            }
        };
        Ok(DecoderConfig {
            hidden,
            layers,
            heads,
            kv_heads,
            head_dim,
            eps: f64_of(raw, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: field(raw, "tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            sliding_windows,
            moe,
        })
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn sliding_window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_windows.get(layer).copied().flatten()
    }

    /// RoPE's inverse frequencies (`head_dim / 2`), computed as transformers does in f32.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base = self.rope_theta as f32;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32))
            .collect();
        match self.rope_scaling {
            RopeScaling::None => inv,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                inv.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        // transformers: ~(wavelen < high) & ~(wavelen > low); wavelengths are
                        // finite and positive, so this is the plain range test.
                        let medium = (high_wavelen..=low_wavelen).contains(&wavelen);
                        if medium {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<DecoderConfig, String> {
        DecoderConfig::from_json(v.as_object().unwrap()).map_err(|e| e.to_string())
    }

    #[test]
    fn bad_configs_are_named_errors() {
        let base = json!({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4});
        let c = parse(base.clone()).unwrap();
        assert_eq!((c.kv_heads, c.head_dim, c.rope_theta), (4, 16, 10_000.0));
        let mut v = base.clone();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert_eq!(
            parse(v).unwrap_err(),
            "config.json: `hidden_size` is missing"
        );
        let mut v = base.clone();
        v["num_key_value_heads"] = json!(3);
        assert!(
            parse(v)
                .unwrap_err()
                .contains("not a multiple of `num_key_value_heads` (3)")
        );
        let mut v = base.clone();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(
            parse(v)
                .unwrap_err()
                .contains("`rope_scaling` type `yarn` is not supported")
        );
        let mut v = base.clone();
        v["num_local_experts"] = json!(4);
        assert_eq!(
            parse(v).unwrap_err(),
            "config.json: `num_experts_per_tok` is missing"
        );
        let mut v = base;
        v["layer_types"] = json!(["sliding_attention", "full_attention"]);
        v["sliding_window"] = json!(8);
        assert_eq!(parse(v).unwrap().sliding_windows, [Some(8), None]);
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let v = json!({"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 1,
            "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}});
        let scaled = parse(v.clone()).unwrap().inv_freq();
        let mut plain = v;
        plain.as_object_mut().unwrap().remove("rope_scaling");
        let plain = parse(plain).unwrap().inv_freq();
        assert_eq!(scaled[0], plain[0], "the highest frequency is untouched");
        let last = plain.len() - 1;
        assert_eq!(
            scaled[last],
            plain[last] / 8.0,
            "the lowest is divided by the factor"
        );
    }
}
