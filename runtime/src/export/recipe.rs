//! What an export does: the format ([`Format`], from the catalogue in `format.rs`), which
//! modules it quantizes, the KV-cache scheme.

pub use super::format::Format;

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

/// Whether module `name` matches the glob `pattern` ([`crate::glob::matches`]).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    crate::glob::matches(pattern, name)
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
    /// The weight groups' size where the format lets it be chosen (`--group-size`; the
    /// format's own default when `None`).
    pub group_size: Option<usize>,
}

impl Recipe {
    /// A recipe with ModelOpt's defaults for `format`.
    pub fn new(format: Format) -> Self {
        Recipe {
            format,
            exclude: Vec::new(),
            include: Vec::new(),
            kv_cache: None,
            group_size: None,
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
