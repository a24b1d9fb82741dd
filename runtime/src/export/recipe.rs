//! What an export does: the format, which modules it quantizes, the KV-cache scheme.

use serde_json::{Value, json};

/// A quantization format (`--format`), with ModelOpt's names for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Format {
    /// FP8 E4M3 weights and inputs, per-tensor scales.
    Fp8,
    /// FP8 weights with per-output-channel scales; inputs quantized dynamically per token.
    Fp8PerChannel,
    /// FP8 weights in 128×128 blocks, weight-only.
    Fp8Block,
    /// INT8 weights, per-channel scales; 16-bit activations.
    Int8Wo,
    /// SmoothQuant INT8 weights and inputs.
    Int8Sq,
    /// AWQ INT4 weights in groups of 128.
    Int4Awq,
    /// AWQ INT4 weights with FP8 activations.
    W4a8Awq,
    /// NVFP4 weights and inputs.
    Nvfp4,
    /// NVFP4 with AWQ smoothing.
    Nvfp4Awq,
    /// NVFP4 weights, 16-bit activations.
    W4a16Nvfp4,
    /// MXFP4 weights.
    Mxfp4,
    /// MXFP8 weights.
    Mxfp8,
}

impl Format {
    /// Every format, in `--format` order.
    pub const ALL: [Format; 12] = [
        Format::Fp8,
        Format::Fp8PerChannel,
        Format::Fp8Block,
        Format::Int8Wo,
        Format::Int8Sq,
        Format::Int4Awq,
        Format::W4a8Awq,
        Format::Nvfp4,
        Format::Nvfp4Awq,
        Format::W4a16Nvfp4,
        Format::Mxfp4,
        Format::Mxfp8,
    ];

    /// The `--format` spelling.
    pub fn cli_name(self) -> &'static str {
        match self {
            Format::Fp8 => "fp8",
            Format::Fp8PerChannel => "fp8-per-channel",
            Format::Fp8Block => "fp8-block",
            Format::Int8Wo => "int8-wo",
            Format::Int8Sq => "int8-sq",
            Format::Int4Awq => "int4-awq",
            Format::W4a8Awq => "w4a8-awq",
            Format::Nvfp4 => "nvfp4",
            Format::Nvfp4Awq => "nvfp4-awq",
            Format::W4a16Nvfp4 => "w4a16-nvfp4",
            Format::Mxfp4 => "mxfp4",
            Format::Mxfp8 => "mxfp8",
        }
    }

    /// ModelOpt's `quant_algo` (FORMATS.md §2).
    pub fn quant_algo(self) -> &'static str {
        match self {
            Format::Fp8 => "FP8",
            Format::Fp8PerChannel => "FP8_PER_CHANNEL_PER_TOKEN",
            Format::Fp8Block => "fp8_pb_wo",
            Format::Int8Wo => "W8A16",
            Format::Int8Sq => "W8A8_SQ_PER_CHANNEL",
            Format::Int4Awq => "W4A16_AWQ",
            Format::W4a8Awq => "W4A8_AWQ",
            Format::Nvfp4 => "NVFP4",
            Format::Nvfp4Awq => "NVFP4_AWQ",
            Format::W4a16Nvfp4 => "W4A16_NVFP4",
            Format::Mxfp4 => "mxfp4",
            Format::Mxfp8 => "MXFP8",
        }
    }

    /// The block size written as `group_size`, where the format has one.
    pub fn group_size(self) -> Option<u32> {
        match self {
            Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq => Some(16),
            Format::Int4Awq | Format::W4a8Awq => Some(128),
            Format::Mxfp4 | Format::Mxfp8 => Some(32),
            _ => None,
        }
    }

    /// Whether the format writes a static `input_scale` (so it needs activation statistics).
    pub fn needs_input_scale(self) -> bool {
        matches!(
            self,
            Format::Fp8 | Format::Int8Sq | Format::W4a8Awq | Format::Nvfp4 | Format::Nvfp4Awq
        )
    }

    /// The input quantizer's `maxbound` (what a zero amax becomes, FORMATS.md "Where a comes
    /// from") and the divisor of the input scale.
    pub fn input_bound_and_divisor(self) -> (f32, f32) {
        match self {
            Format::Nvfp4 | Format::Nvfp4Awq => (6.0, 6.0 * 448.0),
            Format::Int8Sq => (127.0, 127.0),
            _ => (448.0, 448.0),
        }
    }

    /// Whether q/k/v and gate/up share `input_scale` and `weight_scale_2` (FORMATS.md §4.2).
    pub fn shares_group_scales(self) -> bool {
        matches!(
            self,
            Format::Nvfp4 | Format::Nvfp4Awq | Format::W4a16Nvfp4 | Format::W4a8Awq
        )
    }

    /// Whether Linears sharing an input (q/k/v, gate/up) share its amax, the max over them
    /// (`preprocess_linear_fusion`: every format with a static input scale but FP8).
    pub fn shares_input_amax(self) -> bool {
        self.shares_group_scales() || self == Format::Int8Sq
    }

    /// The per-layer dict of `hf_quant_config.json` (FORMATS.md §3.2).
    pub fn layer_config(self) -> Value {
        match self {
            // Unmapped formats (`mxfp4`, `fp8_pb_wo`) record the raw name only, like FP8/INT8.
            Format::Fp8
            | Format::Fp8PerChannel
            | Format::Int8Wo
            | Format::Int8Sq
            | Format::Fp8Block
            | Format::Mxfp4 => {
                json!({"quant_algo": self.quant_algo()})
            }
            Format::Int4Awq | Format::W4a8Awq | Format::Nvfp4Awq => {
                json!({"quant_algo": self.quant_algo(), "group_size": self.group_size(),
                "has_zero_point": false, "pre_quant_scale": true})
            }
            _ => json!({"quant_algo": self.quant_algo(), "group_size": self.group_size()}),
        }
    }

    /// `config_groups.group_0` of `config.json`'s `quantization_config`, for the formats
    /// ModelOpt writes one for (FORMATS.md §3.4); `None` for the others.
    pub fn config_group(self) -> Option<Value> {
        let gs = self.group_size();
        match self {
            Format::Fp8 => Some(json!({
                "input_activations": {"dynamic": false, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": false, "num_bits": 8, "type": "float"},
                "targets": ["Linear"],
            })),
            Format::Nvfp4 => Some(json!({
                "input_activations": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": gs},
                "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": gs},
                "targets": ["Linear"],
            })),
            Format::W4a16Nvfp4 => Some(json!({
                "weights": {"dynamic": false, "num_bits": 4, "type": "float", "group_size": gs},
                "targets": ["Linear"],
            })),
            _ => None,
        }
    }
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Format::ALL
            .into_iter()
            .find(|f| f.cli_name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Format::ALL.iter().map(|f| f.cli_name()).collect();
                format!(
                    "unknown format `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.cli_name())
    }
}

/// A KV-cache format (`--kv-cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCache {
    /// FP8 E4M3 keys and values.
    Fp8,
    /// NVFP4 keys and values.
    Nvfp4,
}

impl KvCache {
    /// `kv_cache_quant_algo`.
    pub fn quant_algo(self) -> &'static str {
        match self {
            KvCache::Fp8 => "FP8",
            KvCache::Nvfp4 => "NVFP4",
        }
    }
}

impl std::str::FromStr for KvCache {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp8" => Ok(KvCache::Fp8),
            "nvfp4" => Ok(KvCache::Nvfp4),
            _ => Err(format!(
                "unknown KV-cache format `{s}` (expected fp8 or nvfp4)"
            )),
        }
    }
}

/// Shell-style glob: `*` any run, `?` one character (module paths have no `/`).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The modules ModelOpt leaves unquantized by default: `lm_head` and MoE routers.
pub fn excluded_by_default(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path);
    path == "lm_head"
        || last == "router"
        || last == "shared_expert_gate"
        || (last == "gate"
            && (path.ends_with(".mlp.gate") || path.ends_with(".block_sparse_moe.gate")))
}

/// The export's settings.
#[derive(Debug, Clone)]
pub struct Recipe {
    /// The weight format.
    pub format: Format,
    /// Extra modules to leave unquantized (globs).
    pub exclude: Vec<String>,
    /// Modules to quantize even if excluded by default (globs; they win over `exclude`).
    pub include: Vec<String>,
    /// The KV-cache format, if any (`--kv-cache`).
    pub kv_cache: Option<KvCache>,
}

impl Recipe {
    /// A recipe with ModelOpt's defaults for `format`.
    pub fn new(format: Format) -> Self {
        Recipe {
            format,
            exclude: Vec::new(),
            include: Vec::new(),
            kv_cache: None,
        }
    }

    /// Whether the Linear at `path` is quantized.
    pub fn quantizes(&self, path: &str) -> bool {
        if self.include.iter().any(|g| glob_match(g, path)) {
            return true;
        }
        !(excluded_by_default(path) || self.exclude.iter().any(|g| glob_match(g, path)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_and_default_exclusions() {
        assert!(glob_match("*lm_head*", "lm_head"));
        assert!(glob_match(
            "model.layers.1?.*",
            "model.layers.12.mlp.up_proj"
        ));
        assert!(!glob_match("model.layers.1?.*", "model.layers.1.mlp"));
        assert!(glob_match("*", ""));
        let r = Recipe::new(Format::Nvfp4);
        assert!(!r.quantizes("lm_head"));
        assert!(!r.quantizes("model.layers.0.mlp.gate"));
        assert!(!r.quantizes("model.layers.0.mlp.router"));
        assert!(!r.quantizes("model.layers.0.block_sparse_moe.gate"));
        assert!(r.quantizes("model.layers.0.mlp.gate_proj"));
        let r = Recipe {
            include: vec!["lm_head".into()],
            exclude: vec!["*.self_attn.*".into()],
            ..Recipe::new(Format::Fp8)
        };
        assert!(r.quantizes("lm_head"));
        assert!(!r.quantizes("model.layers.3.self_attn.q_proj"));
        assert_eq!("nvfp4".parse::<Format>(), Ok(Format::Nvfp4));
        assert!(
            "int3"
                .parse::<Format>()
                .unwrap_err()
                .starts_with("unknown format `int3` (expected one of: fp8, ")
        );
    }
}
