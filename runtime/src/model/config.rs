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
    /// llama.cpp's `rope_freqs` (a GGUF file's llama3 scaling): each inverse frequency divided
    /// by its own factor.
    Factors(Vec<f32>),
    /// YaRN (GPT-OSS): frequencies blended between interpolated and extrapolated by a linear
    /// ramp over the correction range, cos/sin scaled by the attention factor.
    Yarn {
        /// `factor`.
        factor: f64,
        /// `beta_fast` (default 32).
        beta_fast: f64,
        /// `beta_slow` (default 1).
        beta_slow: f64,
        /// `original_max_position_embeddings` (default `max_position_embeddings`).
        original_max_position_embeddings: f64,
        /// `truncate` (default true): the correction range is rounded outwards.
        truncate: bool,
        /// The factor cos and sin are multiplied by (`attention_factor`, else
        /// `0.1 · ln(factor) + 1`, or from `mscale` / `mscale_all_dim`).
        attention_factor: f64,
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
    /// GPT-OSS: the top-k is taken on the router logits (which have a bias) and the weights
    /// are the softmax over the chosen logits.
    pub softmax_after_top_k: bool,
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
    /// `pad_token_id`: transformers' embedding `padding_idx` — that row of the table gets no
    /// gradient from the tokens that use it.
    pub padding_idx: Option<u32>,
    /// `initializer_range`: the standard deviation transformers draws new weights from (a
    /// reward model's new `score` head), when config.json gives it.
    pub initializer_range: Option<f64>,
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
    ///
    /// Long on purpose: every `config.json` field the decoder reads, with its default and check,
    /// one after another.
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
                let opt = |k: &str| s.get(k).and_then(Value::as_f64).filter(|v| *v != 0.0);
                match kind {
                    "default" => RopeScaling::None,
                    "llama3" => RopeScaling::Llama3 {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_max_position_embeddings: num("original_max_position_embeddings")?,
                    },
                    "yarn" => {
                        let factor = f64::from(num("factor")?);
                        let mscale = |scale: f64, m: f64| {
                            if scale <= 1.0 {
                                1.0
                            } else {
                                0.1 * m * scale.ln() + 1.0
                            }
                        };
                        let attention_factor = match (
                            opt("attention_factor"),
                            opt("mscale"),
                            opt("mscale_all_dim"),
                        ) {
                            (Some(a), _, _) => a,
                            (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                            _ => mscale(factor, 1.0),
                        };
                        let max_pos = f64_of(raw, "max_position_embeddings")?;
                        RopeScaling::Yarn {
                            factor,
                            beta_fast: opt("beta_fast").unwrap_or(32.0),
                            beta_slow: opt("beta_slow").unwrap_or(1.0),
                            original_max_position_embeddings: opt(
                                "original_max_position_embeddings",
                            )
                            .or(max_pos)
                            .ok_or_else(|| {
                                ModelError::Config(
                                    "yarn `rope_scaling` needs `original_max_position_embeddings` or `max_position_embeddings`".into(),
                                )
                            })?,
                            truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                            attention_factor,
                        }
                    }
                    other => {
                        return Err(ModelError::Config(format!(
                            "`rope_scaling` type `{other}` is not supported (supported: default, llama3, yarn)"
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
                let gpt_oss = field(raw, "model_type").and_then(Value::as_str) == Some("gpt_oss");
                Some(MoeRouting {
                    experts,
                    top_k: required(raw, "num_experts_per_tok")?,
                    normalize_top_k: mixtral
                        || field(raw, "norm_topk_prob")
                            .and_then(Value::as_bool)
                            .unwrap_or(false),
                    softmax_after_top_k: gpt_oss,
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
            initializer_range: f64_of(raw, "initializer_range")?,
            padding_idx: field(raw, "pad_token_id")
                .and_then(Value::as_u64)
                .and_then(|v| u32::try_from(v).ok()),
        })
    }

    /// The factor RoPE's cos and sin are multiplied by (YaRN's attention factor; else 1).
    pub fn rope_attention_factor(&self) -> f32 {
        match self.rope_scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            } => attention_factor as f32,
            _ => 1.0,
        }
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn sliding_window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_windows.get(layer).copied().flatten()
    }

    /// RoPE's inverse frequencies (`head_dim / 2`), computed as transformers does in f32.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base_f32 = self.rope_theta as f32;
        let inv: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / base_f32.powf((2 * i) as f32 / d as f32))
            .collect();
        match self.rope_scaling {
            RopeScaling::None => inv,
            RopeScaling::Factors(ref factors) => {
                inv.iter().zip(factors).map(|(f, s)| f / s).collect()
            }
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings: old,
                truncate,
                ..
            } => {
                // transformers' `_compute_yarn_parameters`: the correction range in f64, the
                // ramp and the blend in f32.
                let dim = d as f64;
                let base = self.rope_theta;
                let correction = |rotations: f64| {
                    dim * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let factor = factor as f32;
                (0..d / 2)
                    .map(|i| {
                        let pos = base_f32.powf((2 * i) as f32 / d as f32);
                        let (extrapolation, interpolation) = (1.0 / pos, 1.0 / (factor * pos));
                        let ramp =
                            ((i as f32 - low as f32) / ((high - low) as f32)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        interpolation * (1.0 - keep) + extrapolation * keep
                    })
                    .collect()
            }
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
        v["rope_scaling"] = json!({"rope_type": "longrope", "factor": 4.0});
        assert!(
            parse(v)
                .unwrap_err()
                .contains("`rope_scaling` type `longrope` is not supported")
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
