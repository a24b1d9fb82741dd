//! The plugin, end to end through its binary: the export writes an FP8 `lm_head` and both
//! JSON files say so; `kiln explain` shows the plugin taking `lm_head`.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_kiln-fp8-lm-head");

fn run(args: &[&str]) -> std::process::Output {
    let out = Command::new(BIN)
        .args(args)
        .output()
        .expect("run the binary");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A demo model and its activation statistics.
fn demo(dir: &Path) -> (String, String) {
    let model = dir.join("model");
    run(&["demo-model", "--out", model.to_str().unwrap()]);
    let amax = model.join("amax.json");
    (
        model.to_str().unwrap().into(),
        amax.to_str().unwrap().into(),
    )
}

#[test]
fn fp8_export_quantizes_lm_head_and_both_configs_say_so() {
    let dir = tempfile::tempdir().unwrap();
    let (model, amax) = demo(dir.path());
    let out = dir.path().join("out");
    let o = out.to_str().unwrap();
    run(&[
        "export",
        "--model",
        &model,
        "--format",
        "fp8",
        "--act-amax",
        &amax,
        "--out",
        o,
    ]);
    let hf = json(&out.join("hf_quant_config.json"));
    assert_eq!(hf["quantization"]["quant_algo"], "FP8");
    assert_eq!(
        hf["quantization"]["exclude_modules"],
        serde_json::json!(["model.embed_tokens"])
    );
    let config = json(&out.join("config.json"));
    assert_eq!(
        config["quantization_config"]["ignore"],
        serde_json::json!(["model.embed_tokens"])
    );
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor("lm_head.weight").unwrap().dtype(),
        safetensors::Dtype::F8_E4M3
    );
    for scale in ["lm_head.weight_scale", "lm_head.input_scale"] {
        assert_eq!(st.tensor(scale).unwrap().shape(), [0usize; 0], "{scale}");
    }
}

#[test]
fn nvfp4_export_with_an_fp8_lm_head_is_mixed_precision() {
    let dir = tempfile::tempdir().unwrap();
    let (model, amax) = demo(dir.path());
    let out = dir.path().join("out");
    let o = out.to_str().unwrap();
    let done = run(&[
        "export",
        "--model",
        &model,
        "--format",
        "nvfp4",
        "--act-amax",
        &amax,
        "--out",
        o,
    ]);
    let report = String::from_utf8(done.stdout).unwrap();
    assert!(report.contains("(fp8: 1, nvfp4: "), "{report}");
    let hf = json(&out.join("hf_quant_config.json"));
    let q = &hf["quantization"];
    assert_eq!(q["quant_algo"], "MIXED_PRECISION");
    assert_eq!(q["quantized_layers"]["lm_head"]["quant_algo"], "FP8");
    assert_eq!(
        q["quantized_layers"]["model.layers.0.mlp.down_proj"]["quant_algo"],
        "NVFP4"
    );
    let qc = &json(&out.join("config.json"))["quantization_config"];
    assert_eq!(qc["quant_algo"], "MIXED_PRECISION");
    assert_eq!(qc["quantized_layers"], q["quantized_layers"]);
    // Reloaded as an engine would: every module's tensors have its declared format's layout.
    let checked = run(&["verify", "--reference", &model, "--quantized", o]);
    let text = String::from_utf8(checked.stdout).unwrap();
    assert!(
        text.starts_with("ok: MIXED_PRECISION — 29 quantized Linears"),
        "{text}"
    );
}

#[test]
fn explain_shows_the_plugin_taking_lm_head() {
    // Explain matches exporters without running them, so an exporter that reads the
    // checkpoint (this one does) explains like any other.
    let out = run(&["explain", "--format", "nvfp4"]);
    let text = String::from_utf8(out.stdout).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("lm_head "))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("kiln_example_fp8_lm_head::Fp8LmHead (predicate is_lm_head)"),
        "{line}"
    );
}
