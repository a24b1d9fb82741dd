//! Module trees of each family from tensor names alone (shapes matter only where a family
//! checks them).

use crate::ArchitectureRegistry;
use crate::architecture::registry::ArchitectureMatch;
use crate::export::is_moe;
use crate::module_tree::{Linear, ModuleTree, TensorInfo};
use serde_json::json;

fn t(name: &str, shape: &[usize]) -> TensorInfo {
    TensorInfo {
        name: name.into(),
        shape: shape.to_vec(),
        dtype: "BF16".into(),
    }
}

fn tree(arch: &str, tensors: &[TensorInfo]) -> ModuleTree {
    let registry = ArchitectureRegistry::try_global().unwrap();
    let entry = match registry.resolve(arch).unwrap() {
        ArchitectureMatch::Named(e) | ArchitectureMatch::Fallback(e) => e,
    };
    (entry.construct)()
        .module_tree(&json!({ "architectures": [arch] }), tensors)
        .unwrap()
}

fn class(tree: &ModuleTree, path: &str) -> String {
    tree.find(path)
        .unwrap_or_else(|| panic!("no module `{path}`"))
        .class_name()
        .to_string()
}

fn dense_layer(prefix: &str, i: usize, qk_norm: bool) -> Vec<TensorInfo> {
    let mut v = vec![
        t(&format!("{prefix}.{i}.self_attn.q_proj.weight"), &[8, 8]),
        t(&format!("{prefix}.{i}.self_attn.k_proj.weight"), &[4, 8]),
        t(&format!("{prefix}.{i}.self_attn.v_proj.weight"), &[4, 8]),
        t(&format!("{prefix}.{i}.self_attn.o_proj.weight"), &[8, 8]),
        t(&format!("{prefix}.{i}.mlp.gate_proj.weight"), &[16, 8]),
        t(&format!("{prefix}.{i}.mlp.up_proj.weight"), &[16, 8]),
        t(&format!("{prefix}.{i}.mlp.down_proj.weight"), &[8, 16]),
        t(&format!("{prefix}.{i}.input_layernorm.weight"), &[8]),
        t(
            &format!("{prefix}.{i}.post_attention_layernorm.weight"),
            &[8],
        ),
    ];
    if qk_norm {
        v.push(t(&format!("{prefix}.{i}.self_attn.q_norm.weight"), &[4]));
        v.push(t(&format!("{prefix}.{i}.self_attn.k_norm.weight"), &[4]));
    }
    v
}

fn dense_model(layers: usize, qk_norm: bool) -> Vec<TensorInfo> {
    let mut v = vec![
        t("model.embed_tokens.weight", &[32, 8]),
        t("model.norm.weight", &[8]),
        t("lm_head.weight", &[32, 8]),
    ];
    for i in 0..layers {
        v.extend(dense_layer("model.layers", i, qk_norm));
    }
    v
}

#[test]
fn dense_families_use_transformers_class_names() {
    for (arch, prefix, qk) in [
        ("LlamaForCausalLM", "Llama", false),
        ("MistralForCausalLM", "Mistral", false),
        ("Qwen2ForCausalLM", "Qwen2", false),
        ("Qwen3ForCausalLM", "Qwen3", true),
    ] {
        let tr = tree(arch, &dense_model(2, qk));
        assert_eq!(class(&tr, ""), arch);
        assert_eq!(class(&tr, "model"), format!("{prefix}Model"));
        assert_eq!(class(&tr, "model.embed_tokens"), "Embedding");
        assert_eq!(class(&tr, "model.layers"), "ModuleList");
        assert_eq!(
            class(&tr, "model.layers.1"),
            format!("{prefix}DecoderLayer")
        );
        assert_eq!(
            class(&tr, "model.layers.1.self_attn"),
            format!("{prefix}Attention")
        );
        assert_eq!(class(&tr, "model.layers.1.mlp"), format!("{prefix}MLP"));
        assert_eq!(
            class(&tr, "model.layers.0.input_layernorm"),
            format!("{prefix}RMSNorm")
        );
        assert_eq!(class(&tr, "model.norm"), format!("{prefix}RMSNorm"));
        assert!(tr.find("lm_head").unwrap().class_chain().is::<Linear>());
        assert!(
            tr.find("model.layers.0.mlp.down_proj")
                .unwrap()
                .class_chain()
                .is::<Linear>()
        );
        if qk {
            assert_eq!(
                class(&tr, "model.layers.0.self_attn.q_norm"),
                "Qwen3RMSNorm"
            );
        }
        assert_eq!(
            tr.find("model.layers.0.self_attn.q_proj")
                .unwrap()
                .tensor("weight")
                .unwrap()
                .shape,
            [8, 8]
        );
    }
}

#[test]
fn modules_come_in_transformers_definition_order() {
    let tr = tree("Qwen3ForCausalLM", &dense_model(1, true));
    let order: Vec<&str> = tr.walk().map(|m| m.path()).collect();
    assert_eq!(
        order,
        [
            "",
            "model",
            "model.embed_tokens",
            "model.layers",
            "model.layers.0",
            "model.layers.0.self_attn",
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj",
            "model.layers.0.self_attn.o_proj",
            "model.layers.0.self_attn.q_norm",
            "model.layers.0.self_attn.k_norm",
            "model.layers.0.mlp",
            "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.up_proj",
            "model.layers.0.mlp.down_proj",
            "model.layers.0.input_layernorm",
            "model.layers.0.post_attention_layernorm",
            "model.norm",
            "lm_head",
        ]
    );
}

#[test]
fn layers_come_in_numeric_order() {
    let tr = tree("LlamaForCausalLM", &dense_model(12, false));
    let layers: Vec<&str> = tr
        .walk()
        .map(|m| m.path())
        .filter(|p| p.starts_with("model.layers.") && p.matches('.').count() == 2)
        .collect();
    let expected: Vec<String> = (0..12).map(|i| format!("model.layers.{i}")).collect();
    assert_eq!(layers, expected);
}

#[test]
fn qwen3_moe_per_expert_and_fused_layouts() {
    let mut v = dense_model(0, true);
    v.extend([t("model.layers.0.mlp.gate.weight", &[4, 8])]);
    for e in 0..4 {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            v.push(t(
                &format!("model.layers.0.mlp.experts.{e}.{p}.weight"),
                &[8, 8],
            ));
        }
    }
    // transformers 5: fused experts in layer 1.
    v.extend([
        t("model.layers.1.mlp.gate.weight", &[4, 8]),
        t("model.layers.1.mlp.experts.gate_up_proj", &[4, 16, 8]),
        t("model.layers.1.mlp.experts.down_proj", &[4, 8, 8]),
    ]);
    let tr = tree("Qwen3MoeForCausalLM", &v);
    for l in [0, 1] {
        let block = tr.find(&format!("model.layers.{l}.mlp")).unwrap();
        assert_eq!(block.class_name(), "Qwen3MoeSparseMoeBlock");
        assert!(is_moe(&block), "layer {l}: ModelOpt's is_moe must hold");
        assert!(
            tr.find(&format!("model.layers.{l}.mlp.gate"))
                .unwrap()
                .class_chain()
                .is::<Linear>()
        );
    }
    assert_eq!(class(&tr, "model.layers.0.mlp.experts"), "ModuleList");
    assert_eq!(class(&tr, "model.layers.0.mlp.experts.3"), "Qwen3MoeMLP");
    assert!(
        tr.find("model.layers.0.mlp.experts.3.up_proj")
            .unwrap()
            .class_chain()
            .is::<Linear>()
    );
    assert_eq!(class(&tr, "model.layers.1.mlp.experts"), "Qwen3MoeExperts");
}

#[test]
fn mixtral_and_gpt_oss_blocks() {
    let mut v = dense_model(0, false);
    v.push(t("model.layers.0.block_sparse_moe.gate.weight", &[2, 8]));
    for e in 0..2 {
        for w in ["w1", "w2", "w3"] {
            v.push(t(
                &format!("model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"),
                &[8, 8],
            ));
        }
    }
    let tr = tree("MixtralForCausalLM", &v);
    let block = tr.find("model.layers.0.block_sparse_moe").unwrap();
    assert_eq!(block.class_name(), "MixtralSparseMoeBlock");
    assert!(is_moe(&block));
    assert_eq!(
        class(&tr, "model.layers.0.block_sparse_moe.experts.1"),
        "MixtralBlockSparseTop2MLP"
    );
    assert!(
        tr.find("model.layers.0.block_sparse_moe.experts.1.w2")
            .unwrap()
            .class_chain()
            .is::<Linear>()
    );

    let v = vec![
        t("model.layers.0.self_attn.sinks", &[4]),
        t("model.layers.0.self_attn.q_proj.weight", &[8, 8]),
        t("model.layers.0.mlp.router.weight", &[4, 8]),
        t("model.layers.0.mlp.router.bias", &[4]),
        t("model.layers.0.mlp.experts.gate_up_proj", &[4, 8, 32]),
        t("model.layers.0.mlp.experts.gate_up_proj_bias", &[4, 32]),
        t("model.layers.0.mlp.experts.down_proj", &[4, 16, 8]),
        t("model.layers.0.mlp.experts.down_proj_bias", &[4, 8]),
    ];
    let tr = tree("GptOssForCausalLM", &v);
    let block = tr.find("model.layers.0.mlp").unwrap();
    assert_eq!(block.class_name(), "GptOssMLP");
    assert!(is_moe(&block), "router + experts");
    assert_eq!(class(&tr, "model.layers.0.mlp.router"), "GptOssTopKRouter");
    assert_eq!(class(&tr, "model.layers.0.mlp.experts"), "GptOssExperts");
    assert_eq!(
        tr.find("model.layers.0.self_attn")
            .unwrap()
            .tensor("sinks")
            .unwrap()
            .shape,
        [4]
    );
}

#[test]
fn an_unknown_architecture_falls_back_to_a_generic_tree() {
    let registry = ArchitectureRegistry::try_global().unwrap();
    assert!(matches!(
        registry.resolve("BrandNewForCausalLM"),
        Some(ArchitectureMatch::Fallback(_))
    ));
    let v = vec![
        t("transformer.wte.weight", &[32, 8]),
        t("transformer.h.0.attn.c_attn.weight", &[24, 8]),
        t("transformer.h.0.ln_1.weight", &[8]),
        t("transformer.h.0.moe.experts.w_in", &[4, 16, 8]),
        t("head.weight", &[32, 8]),
    ];
    let tr = tree("BrandNewForCausalLM", &v);
    assert_eq!(class(&tr, ""), "BrandNewForCausalLM");
    assert_eq!(
        class(&tr, "transformer.wte"),
        "Linear",
        "no `embed` in the name: a 2-D weight is a Linear"
    );
    assert_eq!(class(&tr, "transformer.h"), "ModuleList");
    assert!(
        tr.find("transformer.h.0.attn.c_attn")
            .unwrap()
            .class_chain()
            .is::<Linear>()
    );
    assert_eq!(class(&tr, "transformer.h.0.ln_1"), "RMSNorm");
    assert_eq!(class(&tr, "transformer.h.0.moe.experts"), "FusedExperts");
}

#[test]
fn wrong_shapes_are_named_errors() {
    let registry = ArchitectureRegistry::try_global().unwrap();
    let build = |arch: &str, v: Vec<TensorInfo>| {
        let ArchitectureMatch::Named(e) = registry.resolve(arch).unwrap() else {
            panic!()
        };
        (e.construct)()
            .module_tree(&json!({}), &v)
            .unwrap_err()
            .to_string()
    };
    let err = build(
        "LlamaForCausalLM",
        vec![t("model.layers.0.self_attn.q_proj.weight", &[8, 8, 2])],
    );
    assert_eq!(
        err,
        "tensor `model.layers.0.self_attn.q_proj.weight`: a Linear module needs a 2-D weight, found Some([8, 8, 2])"
    );
    let err = build(
        "Qwen3MoeForCausalLM",
        vec![
            t("model.layers.0.mlp.gate.weight", &[2, 8]),
            t("model.layers.0.mlp.experts.gate_up_proj", &[16, 8]),
        ],
    );
    assert!(
        err.starts_with("tensor `model.layers.0.mlp.experts.gate_up_proj`: fused experts need 3-D"),
        "{err}"
    );
}

/// The tiny dense model's `config.json`: hidden 8, heads 2 × head_dim 4 (q 8), 1 KV head (k/v
/// 4), intermediate 16, vocab 32.
fn dense_config(layers: usize) -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32,
        "num_hidden_layers": layers,
    })
}

fn build_with(
    arch: &str,
    config: &serde_json::Value,
    v: &[TensorInfo],
) -> Result<ModuleTree, String> {
    let registry = ArchitectureRegistry::try_global().unwrap();
    let ArchitectureMatch::Named(e) = registry.resolve(arch).unwrap() else {
        panic!("{arch} is a named architecture")
    };
    (e.construct)()
        .module_tree(config, v)
        .map_err(|e| e.to_string())
}

#[test]
fn shapes_are_checked_against_config_json() {
    let good = dense_model(2, true);
    for arch in ["LlamaForCausalLM", "Qwen3ForCausalLM"] {
        build_with(arch, &dense_config(2), &good).unwrap();
    }
    // Each row: the tensor, its wrong shape, the error's expected shape.
    let cases: [(&str, &[usize], &str); 9] = [
        // The same bytes, dimensions swapped in the header.
        ("model.layers.0.mlp.gate_proj.weight", &[8, 16], "[16, 8]"),
        ("model.layers.1.mlp.down_proj.weight", &[16, 8], "[8, 16]"),
        ("model.layers.0.self_attn.k_proj.weight", &[8, 8], "[4, 8]"),
        ("model.layers.0.self_attn.q_proj.weight", &[4, 8], "[8, 8]"),
        ("model.layers.1.self_attn.o_proj.weight", &[8, 4], "[8, 8]"),
        ("model.layers.0.self_attn.q_norm.weight", &[8], "[4]"),
        ("model.embed_tokens.weight", &[31, 8], "[32, 8]"),
        ("lm_head.weight", &[32, 8, 1], "[32, 8]"),
        ("model.layers.0.input_layernorm.weight", &[16], "[8]"),
    ];
    for (name, shape, expected) in cases {
        let v: Vec<TensorInfo> = good
            .iter()
            .map(|x| {
                if x.name == name {
                    t(name, shape)
                } else {
                    x.clone()
                }
            })
            .collect();
        let err = build_with("Qwen3ForCausalLM", &dense_config(2), &v).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "tensor `{name}`: shape {shape:?}, but config.json implies {expected}"
            )),
            "{name}: {err}"
        );
        assert!(err.contains("hidden_size 8"), "{err}");
    }
    // A layer past num_hidden_layers.
    let err = build_with("LlamaForCausalLM", &dense_config(1), &dense_model(2, false)).unwrap_err();
    assert!(
        err.starts_with("tensor `model.layers.1.") && err.contains("num_hidden_layers 1"),
        "{err}"
    );
    // A field of the wrong type is named.
    let mut bad = dense_config(2);
    bad["hidden_size"] = json!("8");
    let err = build_with("LlamaForCausalLM", &bad, &good).unwrap_err();
    assert_eq!(
        err,
        "config.json field `hidden_size`: expected a non-negative integer, found \"8\""
    );
    // A field config.json lacks leaves the dimensions it gives unchecked (the others still are).
    let mut partial = dense_config(2);
    partial.as_object_mut().unwrap().remove("intermediate_size");
    let resized: Vec<TensorInfo> = good
        .iter()
        .map(|x| match x.name.rsplit('.').nth(1) {
            Some("gate_proj" | "up_proj") => t(&x.name, &[20, 8]),
            Some("down_proj") => t(&x.name, &[8, 20]),
            _ => x.clone(),
        })
        .collect();
    build_with("LlamaForCausalLM", &partial, &resized).unwrap();
    let err = build_with("LlamaForCausalLM", &dense_config(2), &resized).unwrap_err();
    assert!(err.contains("implies [16, 8]"), "{err}");
}

#[test]
fn expert_and_router_shapes_are_checked() {
    // Qwen3-MoE: experts use moe_intermediate_size, the router [num_experts, hidden].
    let config = json!({
        "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "intermediate_size": 16, "moe_intermediate_size": 6, "num_experts": 4, "vocab_size": 32,
        "num_hidden_layers": 1,
    });
    let mut v = dense_model(0, true);
    v.extend(dense_layer("model.layers", 0, true));
    v.retain(|x| !x.name.contains(".mlp."));
    v.push(t("model.layers.0.mlp.gate.weight", &[4, 8]));
    for e in 0..4 {
        v.push(t(
            &format!("model.layers.0.mlp.experts.{e}.gate_proj.weight"),
            &[6, 8],
        ));
        v.push(t(
            &format!("model.layers.0.mlp.experts.{e}.up_proj.weight"),
            &[6, 8],
        ));
        v.push(t(
            &format!("model.layers.0.mlp.experts.{e}.down_proj.weight"),
            &[8, 6],
        ));
    }
    build_with("Qwen3MoeForCausalLM", &config, &v).unwrap();
    for (name, shape, expected) in [
        (
            "model.layers.0.mlp.experts.2.down_proj.weight",
            [6usize, 8],
            "[8, 6]",
        ),
        ("model.layers.0.mlp.gate.weight", [3, 8], "[4, 8]"),
    ] {
        let w: Vec<TensorInfo> = v
            .iter()
            .map(|x| {
                if x.name == name {
                    t(name, &shape)
                } else {
                    x.clone()
                }
            })
            .collect();
        let err = build_with("Qwen3MoeForCausalLM", &config, &w).unwrap_err();
        assert!(
            err.starts_with(&format!(
                "tensor `{name}`: shape {shape:?}, but config.json implies {expected}"
            )),
            "{err}"
        );
    }
}
