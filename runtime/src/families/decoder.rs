//! The decoder-only families (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GPT-OSS): one
//! builder, parameterized by the class-name prefix and the MoE layout.

use crate::architecture::{Architecture, ArchitectureError};
use crate::module_tree::{Class, ClassChain, Embedding, Linear, Module, ModuleTree, TensorInfo};
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// How a family lays out its mixture-of-experts blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoeLayout {
    /// Dense MLPs only.
    Dense,
    /// `mlp` = `{P}SparseMoeBlock` with router `gate` and `experts` (per-expert `{P}MLP`s with
    /// gate/up/down_proj, or transformers 5's fused `{P}Experts`).
    SparseMoeBlock,
    /// Mixtral: `block_sparse_moe` with `gate` and experts `w1`/`w2`/`w3` (transformers 4), or
    /// `mlp` with fused experts (transformers 5).
    Mixtral,
    /// GPT-OSS: `mlp` = `GptOssMLP` with `router` and fused 3-D `experts`.
    GptOss,
}

/// A decoder family: its class-name prefix and MoE layout.
#[derive(Debug, Clone, Copy)]
pub struct DecoderFamily {
    /// The class-name prefix (`Llama`, `Qwen3Moe`, ...).
    pub prefix: &'static str,
    /// How the MoE block names its router and experts.
    pub moe: MoeLayout,
}

fn named(name: String) -> ClassChain {
    ClassChain::new([Class::named(name), Class::of::<Module>()])
}

fn linear() -> ClassChain {
    ClassChain::new([Class::of::<Linear>(), Class::of::<Module>()])
}

fn embedding() -> ClassChain {
    ClassChain::new([Class::of::<Embedding>(), Class::of::<Module>()])
}

/// What a module looks like from the tensor list: its own tensors and its children's names.
pub struct ModuleShape<'a> {
    pub tensors: &'a [TensorInfo],
    pub children: &'a [String],
}

impl ModuleShape<'_> {
    fn weight_rank(&self) -> Option<usize> {
        self.tensors
            .iter()
            .find(|t| t.name == "weight")
            .map(|t| t.shape.len())
    }
    fn has_child(&self, name: &str) -> bool {
        self.children.iter().any(|c| c == name)
    }
    fn numbered_children(&self) -> bool {
        !self.children.is_empty() && self.children.iter().all(|c| c.parse::<usize>().is_ok())
    }
}

impl DecoderFamily {
    /// The class chain of the module at `path` (dot-separated; `""` is the root).
    pub fn classify(&self, root: &str, path: &str, m: &ModuleShape<'_>) -> ClassChain {
        let p = self.prefix;
        let segs: Vec<&str> = if path.is_empty() {
            vec![]
        } else {
            path.split('.').collect()
        };
        let is_expert_index = |s: &str| s.parse::<usize>().is_ok();
        match segs.as_slice() {
            [] => named(root.to_string()),
            ["model"] => named(format!("{p}Model")),
            ["model", "embed_tokens"] => embedding(),
            ["model", "layers"] => named("ModuleList".into()),
            ["model", "layers", n] if is_expert_index(n) => named(format!("{p}DecoderLayer")),
            ["model", "norm"] | [.., "input_layernorm" | "post_attention_layernorm"] => {
                named(format!("{p}RMSNorm"))
            }
            ["model", "rotary_emb"] => named(format!("{p}RotaryEmbedding")),
            ["lm_head"] => linear(),
            [.., "self_attn"] => named(format!("{p}Attention")),
            [.., "self_attn", "q_proj" | "k_proj" | "v_proj" | "o_proj"] => linear(),
            [.., "self_attn", "q_norm" | "k_norm"] => named(format!("{p}RMSNorm")),
            _ => self
                .classify_mlp(&segs, m)
                .unwrap_or_else(|| generic_class(root, path, m)),
        }
    }

    fn classify_mlp(&self, segs: &[&str], m: &ModuleShape<'_>) -> Option<ClassChain> {
        let p = self.prefix;
        let experts = |m: &ModuleShape<'_>| {
            if m.numbered_children() {
                named("ModuleList".into())
            } else {
                named(format!("{p}Experts"))
            }
        };
        let chain = match (self.moe, segs) {
            (_, [.., "mlp", "gate_proj" | "up_proj" | "down_proj"]) => linear(),
            (MoeLayout::Dense, [.., "mlp"]) => named(format!("{p}MLP")),
            (MoeLayout::SparseMoeBlock, [.., "mlp"]) if m.has_child("experts") => {
                named(format!("{p}SparseMoeBlock"))
            }
            (MoeLayout::SparseMoeBlock, [.., "mlp"]) => named(format!("{p}MLP")),
            (MoeLayout::SparseMoeBlock, [.., "mlp", "gate"]) => linear(),
            (MoeLayout::SparseMoeBlock, [.., "mlp", "experts"]) => experts(m),
            (MoeLayout::SparseMoeBlock, [.., "mlp", "experts", _]) => named(format!("{p}MLP")),
            (
                MoeLayout::SparseMoeBlock,
                [.., "experts", _, "gate_proj" | "up_proj" | "down_proj"],
            ) => linear(),
            (MoeLayout::Mixtral, [.., "block_sparse_moe" | "mlp"]) => {
                named("MixtralSparseMoeBlock".into())
            }
            (MoeLayout::Mixtral, [.., "block_sparse_moe" | "mlp", "gate"]) => linear(),
            (MoeLayout::Mixtral, [.., "block_sparse_moe" | "mlp", "experts"]) => experts(m),
            (MoeLayout::Mixtral, [.., "experts", _]) => named("MixtralBlockSparseTop2MLP".into()),
            (MoeLayout::Mixtral, [.., "experts", _, "w1" | "w2" | "w3"]) => linear(),
            (MoeLayout::GptOss, [.., "mlp"]) => named("GptOssMLP".into()),
            (MoeLayout::GptOss, [.., "mlp", "router"]) => named("GptOssTopKRouter".into()),
            (MoeLayout::GptOss, [.., "mlp", "experts"]) => named("GptOssExperts".into()),
            _ => return None,
        };
        Some(chain)
    }
}

/// The class of a module no family pattern claims: a 2-D `weight` is a `Linear` (`Embedding`
/// when the path says `embed`), 3-D tensors under `experts` a fused-experts module, numbered
/// children a `ModuleList`, a 1-D `weight` alone a norm.
pub fn generic_class(root: &str, path: &str, m: &ModuleShape<'_>) -> ClassChain {
    if path.is_empty() {
        return named(root.to_string());
    }
    let last = path.rsplit('.').next().unwrap_or(path);
    match m.weight_rank() {
        Some(2) if last.contains("embed") => return embedding(),
        Some(2) => return linear(),
        Some(1) if m.tensors.len() == 1 => return named("RMSNorm".into()),
        _ => {}
    }
    if m.has_child("experts") && (m.has_child("gate") || m.has_child("router")) {
        // A router and experts: an MoE block by ModelOpt's `is_moe` rule (class name).
        return named("SparseMoeBlock".into());
    }
    if last == "experts" && m.tensors.iter().any(|t| t.shape.len() == 3) {
        return named("FusedExperts".into());
    }
    if m.numbered_children() {
        return named("ModuleList".into());
    }
    named("Module".into())
}

/// Module names in the order transformers defines them (and so `named_modules()` and state
/// dicts list them): embeddings, layers, norm; attention before MLP; q, k, v, o; gate, up, down.
const DEFINITION_ORDER: &[&str] = &[
    "model",
    "lm_head",
    "embed_tokens",
    "layers",
    "norm",
    "rotary_emb",
    "self_attn",
    "mlp",
    "block_sparse_moe",
    "input_layernorm",
    "post_attention_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_norm",
    "k_norm",
    "gate",
    "router",
    "experts",
    "shared_expert",
    "shared_expert_gate",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",
    "w2",
    "w3",
];

/// Order of dotted paths: segment by segment, known names in definition order, numbers by
/// value (`layers.2` < `layers.10`), anything else by name.
fn module_order(a: &str, b: &str) -> Ordering {
    let key = |s: &str| {
        let rank = DEFINITION_ORDER
            .iter()
            .position(|n| *n == s)
            .unwrap_or(DEFINITION_ORDER.len());
        (rank, s.parse::<u64>().ok())
    };
    let mut x = a.split('.').filter(|s| !s.is_empty());
    let mut y = b.split('.').filter(|s| !s.is_empty());
    loop {
        match (x.next(), y.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(s), Some(t)) => {
                let o = key(s).cmp(&key(t)).then_with(|| s.cmp(t));
                if o != Ordering::Equal {
                    return o;
                }
            }
        }
    }
}

/// Builds the tree: every module that owns a tensor, and every ancestor, in definition order,
/// each classified by `classify(path, shape)`. Linear weights must be 2-D and fused experts 3-D.
pub fn build(
    tensors: &[TensorInfo],
    classify: impl Fn(&str, &ModuleShape<'_>) -> ClassChain,
) -> Result<ModuleTree, ArchitectureError> {
    let mut own: BTreeMap<String, Vec<TensorInfo>> = BTreeMap::new();
    for t in tensors {
        let (module, local) = t.name.rsplit_once('.').unwrap_or(("", &t.name));
        own.entry(module.to_string()).or_default().push(TensorInfo {
            name: local.to_string(),
            ..t.clone()
        });
    }
    let mut children: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut paths: Vec<String> = vec![String::new()];
    for module in own.keys() {
        let mut prefix = String::new();
        for seg in module.split('.').filter(|s| !s.is_empty()) {
            let parent = prefix.clone();
            if !prefix.is_empty() {
                prefix.push('.');
            }
            prefix.push_str(seg);
            let list = children.entry(parent).or_default();
            if !list.iter().any(|c| c == seg) {
                list.push(seg.to_string());
                paths.push(prefix.clone());
            }
        }
    }
    paths.sort_by(|a, b| module_order(a, b));
    paths.dedup();
    let mut tree = ModuleTree::default();
    let empty: Vec<TensorInfo> = Vec::new();
    let none: Vec<String> = Vec::new();
    for path in &paths {
        let mine = own.get(path).unwrap_or(&empty);
        let shape = ModuleShape {
            tensors: mine,
            children: children.get(path).unwrap_or(&none),
        };
        let chain = classify(path, &shape);
        if chain.is::<Linear>() && shape.weight_rank() != Some(2) {
            return Err(ArchitectureError::Tensor {
                tensor: format!("{path}.weight"),
                message: format!(
                    "a {} module needs a 2-D weight, found {:?}",
                    chain.name(),
                    mine.iter().find(|t| t.name == "weight").map(|t| &t.shape)
                ),
            });
        }
        if chain.name().ends_with("Experts")
            && let Some(t) = mine
                .iter()
                .find(|t| t.name.ends_with("proj") && t.shape.len() != 3)
        {
            return Err(ArchitectureError::Tensor {
                tensor: format!("{path}.{}", t.name),
                message: format!(
                    "fused experts need 3-D [experts, out, in] tensors, found {:?}",
                    t.shape
                ),
            });
        }
        tree.add(path, chain, mine.clone())?;
    }
    Ok(tree)
}

/// Root class name from `config.architectures[0]`, else the given default.
fn root_name(config: &serde_json::Value, default: &str) -> String {
    config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str())
        .unwrap_or(default)
        .to_string()
}

impl DecoderFamily {
    /// Builds the module tree of a checkpoint of this family, after checking each tensor's shape
    /// against what `config.json` implies ([`Self::check_shapes`]).
    pub fn module_tree(
        &self,
        config: &serde_json::Value,
        tensors: &[TensorInfo],
    ) -> Result<ModuleTree, ArchitectureError> {
        self.check_shapes(config, tensors)?;
        let root = root_name(config, &format!("{}ForCausalLM", self.prefix));
        build(tensors, |path, m| self.classify(&root, path, m))
    }

    /// Every tensor whose shape `config.json` determines has that shape: embeddings and head
    /// `[vocab, hidden]`, norms `[hidden]` (Qwen3's q/k norms `[head_dim]`), q `[heads ·
    /// head_dim, hidden]`, k / v `[kv_heads · head_dim, hidden]`, o `[hidden, heads ·
    /// head_dim]` (biases their first dimension), dense MLPs `[intermediate, hidden]` /
    /// `[hidden, intermediate]`, per-expert MLPs the same with the expert intermediate size,
    /// routers `[experts, hidden]`, and no layer at or past `num_hidden_layers`. A field
    /// `config.json` lacks leaves the shapes that need it unchecked; GPT-OSS's and transformers
    /// 5's fused 3-D experts are checked by their own exporters. A mismatch is an error naming
    /// the tensor, the shape expected and the one found — a header whose dimensions were
    /// rearranged (the same bytes) included.
    ///
    /// Long on purpose: every tensor `config.json` implies, with its expected shape, in checkpoint
    /// order.
    pub fn check_shapes(
        &self,
        config: &serde_json::Value,
        tensors: &[TensorInfo],
    ) -> Result<(), ArchitectureError> {
        let field =
            |name: &str| -> Result<Option<usize>, ArchitectureError> {
                match config.get(name) {
                    None | Some(serde_json::Value::Null) => Ok(None),
                    Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                        ArchitectureError::Config {
                            field: name.into(),
                            message: format!("expected a non-negative integer, found {v}"),
                        }
                    }),
                }
            };
        let hidden = field("hidden_size")?;
        let heads = field("num_attention_heads")?;
        let kv_heads = field("num_key_value_heads")?.or(heads);
        let head_dim = match field("head_dim")? {
            Some(d) => Some(d),
            None => match (hidden, heads) {
                (Some(h), Some(n)) if n > 0 => Some(h / n),
                _ => None,
            },
        };
        let vocab = field("vocab_size")?;
        let inter = field("intermediate_size")?;
        let expert_inter = field("moe_intermediate_size")?.or(inter);
        let experts = match field("num_local_experts")? {
            Some(n) => Some(n),
            None => field("num_experts")?,
        };
        let layers = field("num_hidden_layers")?;
        let mul = |a: Option<usize>, b: Option<usize>| Some(a? * b?);
        let (q, kv) = (mul(heads, head_dim), mul(kv_heads, head_dim));
        for t in tensors {
            let segs: Vec<&str> = t.name.split('.').collect();
            if let (["model", "layers", n, ..], Some(layers)) = (segs.as_slice(), layers)
                && n.parse::<usize>().is_ok_and(|n| n >= layers)
            {
                return Err(ArchitectureError::Tensor {
                    tensor: t.name.clone(),
                    message: format!(
                        "layer {n} of a model whose config.json has num_hidden_layers {layers}"
                    ),
                });
            }
            let expected: Option<Vec<Option<usize>>> = match segs.as_slice() {
                ["model", "embed_tokens", "weight"] | ["lm_head", "weight"] => {
                    Some(vec![vocab, hidden])
                }
                ["model", "norm", "weight"]
                | [.., "input_layernorm" | "post_attention_layernorm", "weight"] => {
                    Some(vec![hidden])
                }
                [.., "self_attn", "q_norm" | "k_norm", "weight"] => Some(vec![head_dim]),
                [.., "self_attn", "q_proj", "weight"] => Some(vec![q, hidden]),
                [.., "self_attn", "k_proj" | "v_proj", "weight"] => Some(vec![kv, hidden]),
                [.., "self_attn", "o_proj", "weight"] => Some(vec![hidden, q]),
                [.., "self_attn", "q_proj", "bias"] => Some(vec![q]),
                [.., "self_attn", "k_proj" | "v_proj", "bias"] => Some(vec![kv]),
                [.., "self_attn", "o_proj", "bias"] => Some(vec![hidden]),
                [
                    ..,
                    "experts",
                    e,
                    "gate_proj" | "up_proj" | "w1" | "w3",
                    "weight",
                ] if e.parse::<usize>().is_ok() => Some(vec![expert_inter, hidden]),
                [.., "experts", e, "down_proj" | "w2", "weight"] if e.parse::<usize>().is_ok() => {
                    Some(vec![hidden, expert_inter])
                }
                [.., "mlp", "gate_proj" | "up_proj", "weight"] => Some(vec![inter, hidden]),
                [.., "mlp", "down_proj", "weight"] => Some(vec![hidden, inter]),
                [.., "mlp" | "block_sparse_moe", "gate", "weight"]
                    if self.moe != MoeLayout::Dense =>
                {
                    Some(vec![experts, hidden])
                }
                _ => None,
            };
            // Nothing config.json says about it: the tree's own checks (ranks) apply.
            let Some(expected) = expected.filter(|e| e.iter().any(Option::is_some)) else {
                continue;
            };
            let fits = expected.len() == t.shape.len()
                && expected
                    .iter()
                    .zip(&t.shape)
                    .all(|(e, &f)| e.is_none_or(|e| e == f));
            if !fits {
                let shown: Vec<String> = expected
                    .iter()
                    .map(|e| e.map_or("?".into(), |e| e.to_string()))
                    .collect();
                return Err(ArchitectureError::Tensor {
                    tensor: t.name.clone(),
                    message: format!(
                        "shape {:?}, but config.json implies [{}] (hidden_size {}, \
                         intermediate_size {}, heads {} / kv {} × head_dim {}, vocab_size {}{})",
                        t.shape,
                        shown.join(", "),
                        show(hidden),
                        show(if segs.contains(&"experts") {
                            expert_inter
                        } else {
                            inter
                        }),
                        show(heads),
                        show(kv_heads),
                        show(head_dim),
                        show(vocab),
                        experts.map_or(String::new(), |e| format!(", experts {e}")),
                    ),
                });
            }
        }
        if let Some(layers) = layers {
            Self::check_complete(tensors, layers, experts)?;
        }
        Ok(())
    }

    /// Every tensor the layers config.json counts must have: the embedding and final norm;
    /// in each layer its norms, the four attention projections and an MLP whose projections
    /// are all there (every expert's, for experts stored one by one). A checkpoint missing one
    /// would otherwise export without it.
    fn check_complete(
        tensors: &[TensorInfo],
        layers: usize,
        experts: Option<usize>,
    ) -> Result<(), ArchitectureError> {
        use std::collections::{BTreeMap, BTreeSet};
        let names: BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let missing = |tensor: String, why: String| ArchitectureError::Tensor {
            tensor,
            message: format!("missing from the checkpoint ({why})"),
        };
        for n in ["model.embed_tokens.weight", "model.norm.weight"] {
            if !names.contains(n) {
                return Err(missing(n.into(), "every decoder has it".into()));
            }
        }
        let why = format!("config.json has num_hidden_layers {layers}");
        for i in 0..layers {
            let l = format!("model.layers.{i}");
            for part in [
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
            ] {
                let n = format!("{l}.{part}.weight");
                if !names.contains(n.as_str()) {
                    return Err(missing(n, why.clone()));
                }
            }
            let dense =
                ["gate_proj", "up_proj", "down_proj"].map(|p| format!("{l}.mlp.{p}.weight"));
            if dense.iter().any(|n| names.contains(n.as_str())) {
                if let Some(n) = dense.iter().find(|n| !names.contains(n.as_str())) {
                    return Err(missing(
                        n.clone(),
                        "its MLP's other projections are there".into(),
                    ));
                }
                continue;
            }
            let (mlp, moe) = (format!("{l}.mlp."), format!("{l}.block_sparse_moe."));
            let in_layer: Vec<&str> = names
                .range(l.as_str()..)
                .take_while(|n| n.starts_with(&l))
                .filter(|n| n.starts_with(&mlp) || n.starts_with(&moe))
                .copied()
                .collect();
            if in_layer.is_empty() {
                return Err(missing(
                    format!("{l}.mlp.gate_proj.weight"),
                    format!("layer {i} has no MLP or experts"),
                ));
            }
            // Experts one by one: `<block>.experts.<e>.<proj>.weight`.
            let mut by_expert: BTreeMap<(&str, usize), BTreeSet<&str>> = BTreeMap::new();
            for n in &in_layer {
                let segs: Vec<&str> = n.split('.').collect();
                if let [.., "experts", e, proj, "weight"] = segs.as_slice()
                    && let Ok(e) = e.parse::<usize>()
                {
                    let block = &n[..n.find(".experts.").unwrap_or(0)];
                    by_expert.entry((block, e)).or_default().insert(proj);
                }
            }
            let projections: BTreeSet<&str> = by_expert.values().flatten().copied().collect();
            let blocks: BTreeSet<&str> = by_expert.keys().map(|(b, _)| *b).collect();
            for block in blocks {
                let count = experts
                    .unwrap_or_else(|| by_expert.keys().filter(|(b, _)| *b == block).count());
                for e in 0..count {
                    for proj in &projections {
                        let have = by_expert.get(&(block, e)).is_some_and(|p| p.contains(proj));
                        if !have {
                            return Err(missing(
                                format!("{block}.experts.{e}.{proj}.weight"),
                                format!("config.json has {count} experts"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// A config value for a message: the number, or `?` where config.json does not say.
fn show(v: Option<usize>) -> String {
    v.map_or("?".into(), |v| v.to_string())
}

macro_rules! families {
    ($($(#[$doc:meta])* $ty:ident => $name:literal | $model_type:literal, $prefix:literal, $moe:ident;)*) => {$(
        $(#[$doc])*
        // The class name, and `config.json`'s `model_type` for checkpoints without
        // `architectures`.
        #[crate::architecture(names = [$name, $model_type], crate = crate)]
        #[derive(Debug, Default)]
        pub struct $ty;

        impl Architecture for $ty {
            fn module_tree(&self, config: &serde_json::Value, tensors: &[TensorInfo]) -> Result<ModuleTree, ArchitectureError> {
                DecoderFamily { prefix: $prefix, moe: MoeLayout::$moe }.module_tree(config, tensors)
            }
        }
    )*};
}

families! {
    /// Llama (1–3.x).
    Llama => "LlamaForCausalLM" | "llama", "Llama", Dense;
    /// Mistral.
    Mistral => "MistralForCausalLM" | "mistral", "Mistral", Dense;
    /// Qwen2 and Qwen2.5.
    Qwen2 => "Qwen2ForCausalLM" | "qwen2", "Qwen2", Dense;
    /// Qwen3 (q/k norms).
    Qwen3 => "Qwen3ForCausalLM" | "qwen3", "Qwen3", Dense;
    /// Qwen3-MoE.
    Qwen3Moe => "Qwen3MoeForCausalLM" | "qwen3_moe", "Qwen3Moe", SparseMoeBlock;
    /// Mixtral.
    Mixtral => "MixtralForCausalLM" | "mixtral", "Mixtral", Mixtral;
    /// GPT-OSS.
    GptOss => "GptOssForCausalLM" | "gpt_oss", "GptOss", GptOss;
}
