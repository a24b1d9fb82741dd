//! A binary sees a plugin's entries only when it links the plugin crate.

use std::process::Command;

fn registry_json(bin: &str) -> serde_json::Value {
    let out = Command::new(bin)
        .args(["registry", "--json"])
        .output()
        .expect("run binary");
    assert!(
        out.status.success(),
        "{bin} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("registry --json prints JSON")
}

fn paths(doc: &serde_json::Value, kind: &str) -> Vec<String> {
    doc[kind]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["path"].as_str().unwrap().to_string())
        .collect()
}

/// The entries that are not kiln's own built-ins.
fn foreign(doc: &serde_json::Value, kind: &str) -> Vec<String> {
    paths(doc, kind)
        .into_iter()
        .filter(|p| !p.starts_with("kiln_runtime::"))
        .collect()
}

#[test]
fn binary_that_references_the_plugin_sees_its_entries_in_order() {
    let doc = registry_json(env!("CARGO_BIN_EXE_kiln-with-plugins"));
    assert_eq!(
        foreign(&doc, "exporters"),
        [
            "kiln_test_plugin::PluginExperts",
            "kiln_test_plugin::PluginLinear",
            "kiln_test_plugin::PluginRouter",
            "kiln_test_plugin::PluginCatchAll",
        ]
    );
    assert_eq!(foreign(&doc, "trainers"), ["kiln_test_plugin::PluginSft"]);
    assert_eq!(
        paths(&doc, "trainers").len(),
        14,
        "thirteen built-in trainers and the plugin's"
    );
    // The plugin's family sorts among kiln's built-ins by type path; the fallback comes last.
    assert_eq!(
        paths(&doc, "architectures"),
        [
            "kiln_runtime::families::decoder::GptOss",
            "kiln_runtime::families::decoder::Llama",
            "kiln_runtime::families::decoder::Mistral",
            "kiln_runtime::families::decoder::Mixtral",
            "kiln_runtime::families::decoder::Qwen2",
            "kiln_runtime::families::decoder::Qwen3",
            "kiln_runtime::families::decoder::Qwen3Moe",
            "kiln_test_plugin::PluginArch",
            "kiln_runtime::families::generic::GenericDecoder",
        ]
    );
    let first = &doc["exporters"][0];
    assert_eq!(first["tier"], "prepend");
    assert_eq!(first["path"], "kiln_test_plugin::PluginExperts");
    assert_eq!(first["keys"][0]["name"], "GptOssExperts");
    assert!(
        first["file"].as_str().unwrap().ends_with("src/lib.rs"),
        "{first}"
    );
    assert!(first["line"].as_u64().unwrap() > 0);
}

#[test]
fn binary_that_does_not_reference_the_plugin_sees_nothing() {
    let doc = registry_json(env!("CARGO_BIN_EXE_kiln-without-plugins"));
    // Only kiln's own built-ins remain.
    assert_eq!(foreign(&doc, "exporters"), Vec::<String>::new());
    assert!(!paths(&doc, "exporters").is_empty());
    // Only kiln's thirteen built-in trainers.
    assert_eq!(foreign(&doc, "trainers"), Vec::<String>::new());
    assert_eq!(
        paths(&doc, "trainers"),
        [
            "kiln_runtime::train::candle::bco::Trainer",
            "kiln_runtime::train::candle::distill::Trainer",
            "kiln_runtime::train::candle::dpo::Trainer",
            "kiln_runtime::train::candle::grpo::Trainer",
            "kiln_runtime::train::candle::kto::Trainer",
            "kiln_runtime::train::candle::online_dpo::Trainer",
            "kiln_runtime::train::candle::orpo::Trainer",
            "kiln_runtime::train::candle::ppo::Trainer",
            "kiln_runtime::train::candle::pretrain::Trainer",
            "kiln_runtime::train::candle::reward::Trainer",
            "kiln_runtime::train::candle::rloo::Trainer",
            "kiln_runtime::train::candle::sft::Trainer",
            "kiln_runtime::train::candle::simpo::Trainer",
        ]
    );
}
