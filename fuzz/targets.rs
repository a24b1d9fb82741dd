//! kiln's readers of outside data, each as a function of the bytes of one file: shared by the
//! libFuzzer targets (`fuzz/fuzz_targets/`, `cargo +nightly fuzz run NAME`) and the stable
//! smoke test (`tests/fuzz_smoke.rs`, in CI). A reader may refuse any input with an error; it
//! must not panic, hang, or allocate what the input's lengths claim before checking them.
//!
//! Each target writes its input where the reader looks for it (a folder per process and
//! target, beside fixed companions: a valid config.json for the safetensors target, a valid
//! safetensors file for the config target) and runs the reader as the CLI does.

#![allow(dead_code)]

use std::path::PathBuf;

/// A target: the reader's name and the function running it on one input.
pub type Target = (&'static str, fn(&[u8]));

/// The targets, by name.
pub const TARGETS: [Target; 7] = [
    ("safetensors", safetensors),
    ("safetensors_index", safetensors_index),
    ("config_json", config_json),
    ("gguf", gguf),
    ("calib_jsonl", calib_jsonl),
    ("act_amax", act_amax),
    ("chat_template", chat_template),
];

/// Removes the scratch folders of this process.
pub fn cleanup() {
    for (name, _) in TARGETS {
        let _ = std::fs::remove_dir_all(dir(name));
    }
}

fn dir(target: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-fuzz-{}-{target}", std::process::id()));
    std::fs::create_dir_all(&d).expect("a scratch folder");
    d
}

/// A valid safetensors file: one F32 tensor `model.embed_tokens.weight` [4, 2].
pub fn tiny_safetensors() -> Vec<u8> {
    let header =
        br#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[4,2],"data_offsets":[0,32]}}"#;
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.extend((0..8u32).flat_map(|i| (i as f32 * 0.25).to_le_bytes()));
    v
}

const CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2,"vocab_size":4,"num_hidden_layers":1,"num_attention_heads":1,"intermediate_size":4}"#;

/// Reads every tensor of a checkpoint folder and builds its module tree, as `kiln export`
/// starts.
fn open_checkpoint(d: &std::path::Path) {
    let Ok(ck) = kiln_runtime::checkpoint::Checkpoint::open(d) else {
        return;
    };
    let names: Vec<String> = ck.tensors().map(|t| t.name.clone()).collect();
    let mut buf = Vec::new();
    for n in &names {
        let _ = ck.read(n, &mut buf);
    }
    let _ = kiln_runtime::export::run::module_tree(&ck);
    let _ = kiln_runtime::model::DecoderConfig::from_json(ck.config().raw());
}

/// `model.safetensors`: the header (its length, JSON, dtypes, shapes, offsets) and the data.
pub fn safetensors(data: &[u8]) {
    let d = dir("safetensors");
    std::fs::write(d.join("config.json"), CONFIG).unwrap();
    std::fs::write(d.join("model.safetensors"), data).unwrap();
    open_checkpoint(&d);
}

/// `model.safetensors.index.json` over two valid shards.
pub fn safetensors_index(data: &[u8]) {
    let d = dir("safetensors_index");
    std::fs::write(d.join("config.json"), CONFIG).unwrap();
    let _ = std::fs::remove_file(d.join("model.safetensors"));
    std::fs::write(
        d.join("model-00001-of-00002.safetensors"),
        tiny_safetensors(),
    )
    .unwrap();
    std::fs::write(
        d.join("model-00002-of-00002.safetensors"),
        tiny_safetensors(),
    )
    .unwrap();
    std::fs::write(d.join("model.safetensors.index.json"), data).unwrap();
    open_checkpoint(&d);
}

/// `config.json` beside a valid checkpoint: the family's module tree and shape checks, and
/// the execution config.
pub fn config_json(data: &[u8]) {
    let d = dir("config_json");
    std::fs::write(d.join("model.safetensors"), tiny_safetensors()).unwrap();
    std::fs::write(d.join("config.json"), data).unwrap();
    open_checkpoint(&d);
}

/// A GGUF file (`kiln eval` / `kiln verify` read them): header, metadata, tensor infos, data.
pub fn gguf(data: &[u8]) {
    let d = dir("gguf");
    let path = d.join("model.gguf");
    std::fs::write(&path, data).unwrap();
    if let Ok(g) = kiln_runtime::gguf::GgufFile::open(&path) {
        for t in &g.tensors {
            let _ = g.read(t);
        }
    }
}

/// Calibration data (`--calib`): JSONL of token ids or texts.
pub fn calib_jsonl(data: &[u8]) {
    let d = dir("calib_jsonl");
    let path = d.join("calib.jsonl");
    std::fs::write(&path, data).unwrap();
    let _ = kiln_runtime::model::calib::read_samples(&path, None, None);
    let _ = kiln_runtime::model::calib::read_samples(&path, Some(3), Some(5));
}

/// An activation-statistics file (`--act-amax`).
pub fn act_amax(data: &[u8]) {
    let d = dir("act_amax");
    let path = d.join("amax.json");
    std::fs::write(&path, data).unwrap();
    let _ = kiln_runtime::export::act_amax::ActAmax::read(&path);
}

/// `tokenizer_config.json` with its chat template, rendered for a conversation (`kiln train`).
pub fn chat_template(data: &[u8]) {
    let d = dir("chat_template");
    std::fs::write(d.join("tokenizer_config.json"), data).unwrap();
    let Ok(Some(t)) = kiln_runtime::train::chat::ChatTemplate::from_model_dir(&d) else {
        return;
    };
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}
    ]);
    let _ = t.render(&messages, false);
    let _ = t.render_with(&messages, true, true);
}
