//! The plugin's format end to end through its binary: `kiln export --output-format int8-rows`
//! writes it, and `kiln eval` and `kiln verify` — which name no format — read it back
//! through the reader the plugin registers.

use kiln_example_int8_rows as _;
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_kiln-int8-rows");

fn kiln(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .output()
        .expect("run the binary")
}

fn ok(args: &[&str]) -> String {
    let out = kiln(args);
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A demo model, its int8-rows export and evaluation data (token ids below the demo's
/// vocabulary).
fn exported(dir: &Path) -> (String, String, String) {
    let model = dir.join("model");
    let out = dir.join("q");
    let data = dir.join("data.jsonl");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    ok(&["demo-model", "--out", &s(&model)]);
    let report = ok(&[
        "export",
        "--model",
        &s(&model),
        "--output-format",
        "int8-rows",
        "--out",
        &s(&out),
    ]);
    assert!(report.contains("int8-row: "), "{report}");
    let lines: Vec<String> = (0..4)
        .map(|i| {
            let ids: Vec<u32> = (0..24).map(|j| (i * 31 + j * 7) % 250).collect();
            serde_json::json!({ "input_ids": ids }).to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    (s(&model), s(&out), s(&data))
}

fn perplexity(model: &str, data: &str) -> f64 {
    let out = ok(&["eval", "--model", model, "--data", data, "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["perplexity"].as_f64().unwrap()
}

#[test]
fn eval_and_verify_read_the_plugins_output() {
    let dir = tempfile::tempdir().unwrap();
    let (model, q, data) = exported(dir.path());
    // The export holds the plugin's tensors, not a kiln format's.
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(&q).join("config.json")).unwrap())
            .unwrap();
    let modules = config["int8_rows"]["modules"].as_array().unwrap();
    assert!(
        modules
            .iter()
            .any(|m| m == "model.layers.0.self_attn.q_proj")
    );

    // eval decodes it: int8 per row is close to the original, but not the same model.
    let (a, b) = (perplexity(&model, &data), perplexity(&q, &data));
    assert!(b.is_finite() && (b / a - 1.0).abs() < 0.05, "{a} vs {b}");
    assert_ne!(
        a, b,
        "the export must be decoded from int8, not the reference reread"
    );

    // verify checks it with the plugin's reader.
    let out = ok(&[
        "verify",
        "--reference",
        &model,
        "--quantized",
        &q,
        "--data",
        &data,
    ]);
    assert!(out.contains("ok: int8-rows int8"), "{out}");
    assert!(
        out.contains(&format!("{} quantized Linears", modules.len())),
        "{out}"
    );
    assert!(out.contains("config.json's int8_rows agree"), "{out}");
}

#[test]
fn verify_fails_an_export_whose_config_disagrees_with_its_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (model, q, _) = exported(dir.path());
    let path = Path::new(&q).join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["int8_rows"]["modules"]
        .as_array_mut()
        .unwrap()
        .retain(|m| m != "model.layers.0.mlp.down_proj");
    std::fs::write(&path, config.to_string()).unwrap();
    let out = kiln(&["verify", "--reference", &model, "--quantized", &q]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains(
            "FAIL `model.layers.0.mlp.down_proj` is stored quantized but not listed in \
             config.json's int8_rows.modules"
        ),
        "{text}"
    );
}

#[test]
fn the_registry_knows_the_plugins_reader() {
    let dir = tempfile::tempdir().unwrap();
    let (_, q, _) = exported(dir.path());
    let found = kiln::formats::detect(Path::new(&q)).unwrap().unwrap();
    assert_eq!(found.writer, "int8-rows");
    assert_eq!(found.path, Path::new(&q));
    let listed = ok(&["registry", "writers"]);
    assert!(listed.contains("int8-rows"), "{listed}");
}
