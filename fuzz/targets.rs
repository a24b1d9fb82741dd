//! kiln's readers of outside data, each as a function of the bytes of one file: shared by the
//! libFuzzer targets (`fuzz/fuzz_targets/`, `cargo +nightly fuzz run NAME`) and the stable
//! smoke test (`tests/it/fuzz_smoke.rs`, in CI). A reader may refuse any input with an error; it
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
pub const TARGETS: [Target; 17] = [
    ("safetensors", safetensors),
    ("safetensors_index", safetensors_index),
    ("config_json", config_json),
    ("gguf", gguf),
    ("calib_jsonl", calib_jsonl),
    ("act_amax", act_amax),
    ("chat_template", chat_template),
    ("train_jsonl", train_jsonl),
    ("train_toml", train_toml),
    ("peft_config", peft_config),
    ("peft_weights", peft_weights),
    ("ct_config", ct_config),
    ("ct_weights", ct_weights),
    ("mlx_config", mlx_config),
    ("mlx_weights", mlx_weights),
    ("bnb_config", bnb_config),
    ("bnb_weights", bnb_weights),
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
    if let Ok(g) = kiln_runtime::formats::gguf::container::GgufFile::open(&path) {
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
    let _ = kiln_runtime::calibrate::max::read_samples(&path, None, None);
    let _ = kiln_runtime::calibrate::max::read_samples(&path, Some(3), Some(5));
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

/// Training data (`kiln train --data`): JSONL in any task's format, read as each task reads it.
pub fn train_jsonl(data: &[u8]) {
    use kiln_runtime::train::data::{DataFormat, Dataset};
    let d = dir("train_jsonl");
    let path = d.join("train.jsonl");
    std::fs::write(&path, data).unwrap();
    for accepted in [
        &[
            DataFormat::Text,
            DataFormat::PromptCompletion,
            DataFormat::Messages,
        ][..],
        &[DataFormat::Preference],
        &[DataFormat::Unpaired],
        &[DataFormat::Prompt, DataFormat::Messages],
    ] {
        let _ = Dataset::read(&path, accepted);
    }
}

/// A `kiln train --config` file: TOML, every key a TRL field, applied over each task's
/// defaults as the CLI applies it.
pub fn train_toml(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for task in ["sft", "dpo", "kto", "grpo"] {
        let mut c = kiln_runtime::TrainConfig::new(task, "candle", "model", "out");
        kiln_runtime::train::fields::defaults_for(&mut c);
        let _ = kiln::cli::apply_toml(&mut c, text, std::path::Path::new("train.toml"));
    }
}

/// The modules of the adapter targets: one Linear, 4 → 4.
fn adapter_modules() -> Vec<(String, usize, usize)> {
    vec![("model.layers.0.self_attn.q_proj".to_string(), 4, 4)]
}

/// A valid rank-2 PEFT `adapter_model.safetensors` for [`adapter_modules`].
pub fn tiny_adapter_weights() -> Vec<u8> {
    let a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    let b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    let header = format!(
        r#"{{"{a}":{{"dtype":"F32","shape":[2,4],"data_offsets":[0,32]}},"{b}":{{"dtype":"F32","shape":[4,2],"data_offsets":[32,64]}}}}"#
    );
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend((0..16u32).flat_map(|i| (i as f32 * 0.125 - 1.0).to_le_bytes()));
    v
}

/// A valid `adapter_config.json` for [`tiny_adapter_weights`].
pub const ADAPTER_CONFIG: &str =
    r#"{"peft_type":"LORA","r":2,"lora_alpha":4,"target_modules":["q_proj"],"bias":"none"}"#;

fn load_adapter(d: &std::path::Path) {
    let cpu = kiln_runtime::model::candle::Device::Cpu;
    let _ = kiln_runtime::model::lora::Adapters::load_any_for(d, &adapter_modules(), &cpu);
    let _ = kiln_runtime::model::lora::Adapters::load_mlx_lm_for(d, &adapter_modules(), &cpu);
}

/// `--init-adapter DIR`: its `adapter_config.json` (PEFT's, or mlx-lm's), beside valid
/// weights.
pub fn peft_config(data: &[u8]) {
    let d = dir("peft_config");
    std::fs::write(d.join("adapter_model.safetensors"), tiny_adapter_weights()).unwrap();
    std::fs::write(d.join("adapters.safetensors"), tiny_adapter_weights()).unwrap();
    std::fs::write(d.join("adapter_config.json"), data).unwrap();
    load_adapter(&d);
}

/// `--init-adapter DIR`: its `adapter_model.safetensors`, beside a valid config.
pub fn peft_weights(data: &[u8]) {
    let d = dir("peft_weights");
    std::fs::write(d.join("adapter_config.json"), ADAPTER_CONFIG).unwrap();
    std::fs::write(d.join("adapter_model.safetensors"), data).unwrap();
    load_adapter(&d);
}

/// A compressed-tensors export and an mlx-lm one of a one-layer Llama (fuzz/fixtures, written
/// by `python3 fuzz/seeds.py` through kiln's writers): the companions of the quantized
/// readers' targets.
pub const CT_CONFIG: &[u8] = include_bytes!("fixtures/ct/config.json");
/// See [`CT_CONFIG`].
pub const CT_WEIGHTS: &[u8] = include_bytes!("fixtures/ct/model.safetensors");
/// See [`CT_CONFIG`].
pub const MLX_CONFIG: &[u8] = include_bytes!("fixtures/mlx/config.json");
/// See [`CT_CONFIG`].
pub const MLX_WEIGHTS: &[u8] = include_bytes!("fixtures/mlx/model.safetensors");
/// See [`CT_CONFIG`] (a bitsandbytes NF4 export).
pub const BNB_CONFIG: &[u8] = include_bytes!("fixtures/bnb/config.json");
/// See [`CT_CONFIG`].
pub const BNB_WEIGHTS: &[u8] = include_bytes!("fixtures/bnb/model.safetensors");

/// Decodes a quantized export as `kiln eval` / `kiln verify` load it (the layout detected from
/// its files, every weight decoded), and as QLoRA loads it (its Linears kept packed, then one
/// forward pass through the packed weights).
fn load_quantized(target: &str, config: &[u8], weights: &[u8]) {
    let d = dir(target);
    std::fs::write(d.join("config.json"), config).unwrap();
    std::fs::write(d.join("model.safetensors"), weights).unwrap();
    let cpu = kiln_runtime::model::candle::Device::Cpu;
    let f32 = kiln_runtime::model::candle::DType::F32;
    let _ = kiln_runtime::formats::load(&d, f32, &cpu, true);
    if let Ok(l) = kiln_runtime::formats::load_packed(&d, &cpu)
        && let Ok(m) = kiln_runtime::model::DecoderModel::from_loaded(l, &cpu)
        && let Ok(ids) = kiln_runtime::model::candle::Tensor::new(&[[0u32, 1]], &cpu)
    {
        let _ = m.forward(&ids);
    }
}

/// A compressed-tensors export's `config.json` (its `quantization_config`), beside its weights.
pub fn ct_config(data: &[u8]) {
    load_quantized("ct_config", data, CT_WEIGHTS);
}

/// A compressed-tensors export's weights (packed, scales, zero points, shapes), beside its
/// config.
pub fn ct_weights(data: &[u8]) {
    load_quantized("ct_weights", CT_CONFIG, data);
}

/// An mlx-lm export's `config.json` (its `quantization`), beside its weights.
pub fn mlx_config(data: &[u8]) {
    load_quantized("mlx_config", data, MLX_WEIGHTS);
}

/// An mlx-lm export's weights (packed, scales, biases), beside its config.
pub fn mlx_weights(data: &[u8]) {
    load_quantized("mlx_weights", MLX_CONFIG, data);
}

/// A bitsandbytes export's `config.json` (its `quantization_config`), beside its weights.
pub fn bnb_config(data: &[u8]) {
    load_quantized("bnb_config", data, BNB_WEIGHTS);
}

/// A bitsandbytes export's weights (4-bit codes, absmax, quant maps, quant states), beside its
/// config.
pub fn bnb_weights(data: &[u8]) {
    load_quantized("bnb_weights", BNB_CONFIG, data);
}
