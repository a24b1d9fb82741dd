//! What a training run writes, for every backend: a full checkpoint (f32 weights in shards,
//! `config.json` with `torch_dtype` float32, the model folder's tokenizer and generation files).

use super::TrainError;
use crate::sink::{OutputDir, ShardWriter};
use std::path::{Path, PathBuf};

pub(crate) fn sink_err(e: crate::sink::SinkError) -> TrainError {
    match e {
        crate::sink::SinkError::Io { path, source } => TrainError::Io { path, source },
        e => TrainError::Config {
            field: "output".into(),
            message: e.to_string(),
        },
    }
}

/// Writes the full checkpoint of the model in `model_dir` into `dir`, its weights taken one at
/// a time from `tensors` (name, shape, f32 values) so that only one is in memory.
pub fn write_full(
    model_dir: &Path,
    dir: &Path,
    tensors: impl IntoIterator<Item = Result<(String, Vec<usize>, Vec<f32>), TrainError>>,
) -> Result<(), TrainError> {
    let mut w = ShardWriter::new(dir, 5_000_000_000);
    for t in tensors {
        let (name, dims, data) = t?;
        w.write(
            &name,
            safetensors::Dtype::F32,
            &dims,
            bytemuck::cast_slice(&data),
        )
        .map_err(sink_err)?;
    }
    w.finish().map_err(sink_err)?;
    let src = model_dir.join("config.json");
    let text = std::fs::read_to_string(&src).map_err(|source| TrainError::Io {
        path: src.clone(),
        source,
    })?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| TrainError::Data {
        path: src.clone(),
        line: None,
        message: e.to_string(),
    })?;
    if let Some(o) = cfg.as_object_mut() {
        o.insert("torch_dtype".into(), "float32".into());
        o.remove("quantization_config");
    }
    let dest = dir.join("config.json");
    std::fs::write(
        &dest,
        serde_json::to_string_pretty(&cfg).expect("JSON") + "\n",
    )
    .map_err(|source| TrainError::Io { path: dest, source })?;
    for name in crate::export::files::COPIED_FILES {
        let src = model_dir.join(name);
        if src.is_file() {
            let dest = dir.join(name);
            std::fs::copy(&src, &dest).map_err(|source| TrainError::Io { path: dest, source })?;
        }
    }
    Ok(())
}

/// Rewrites `dir/config.json` (a full checkpoint's, as [`write_full`] wrote it) as the config
/// of transformers' sequence classifier with one label (TRL's reward model):
/// `architectures` `*ForSequenceClassification`, `id2label` / `label2id` of `LABEL_0`, and
/// `pad_token_id` (the classifier reads each sequence at its last non-pad token).
pub fn classifier_config(dir: &Path, pad_id: u32) -> Result<(), TrainError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|source| TrainError::Io {
        path: path.clone(),
        source,
    })?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| TrainError::Data {
        path: path.clone(),
        line: None,
        message: e.to_string(),
    })?;
    if let Some(o) = cfg.as_object_mut() {
        let archs: Vec<serde_json::Value> = o
            .get("architectures")
            .and_then(serde_json::Value::as_array)
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(serde_json::Value::as_str)
            .map(|a| {
                let stem = a
                    .strip_suffix("ForCausalLM")
                    .or_else(|| a.strip_suffix("ForSequenceClassification"))
                    .unwrap_or(a);
                format!("{stem}ForSequenceClassification").into()
            })
            .collect();
        o.insert("architectures".into(), archs.into());
        o.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
        o.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
        o.insert("pad_token_id".into(), pad_id.into());
    }
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&cfg).expect("JSON") + "\n",
    )
    .map_err(|source| TrainError::Io { path, source })
}

/// Writes a run's result into `target` through a temporary folder beside it (`write` fills
/// it), renamed at the end; the run's resumable checkpoints in `target` move along.
pub fn save_into(
    target: &Path,
    write: impl FnOnce(&Path) -> Result<(), TrainError>,
) -> Result<PathBuf, TrainError> {
    let out = OutputDir::create(target, true).map_err(sink_err)?;
    // The checkpoints are linked into the new folder, not moved: until the commit swaps the
    // folders, `target` keeps all of them (a run killed here loses nothing). Checkpoint files
    // are never rewritten in place, so sharing them is safe.
    if let Ok(entries) = std::fs::read_dir(target) {
        for e in entries.flatten() {
            let name = e.file_name();
            if name.to_string_lossy().starts_with("checkpoint-") && e.path().is_dir() {
                link_tree(&e.path(), &out.path().join(&name))?;
            }
        }
    }
    write(out.path())?;
    out.commit().map_err(sink_err)
}

/// Recreates the folder `src` at `dest` with hard links to its files (copies where the
/// filesystem has no hard links).
fn link_tree(src: &Path, dest: &Path) -> Result<(), TrainError> {
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| TrainError::Io { path, source }
    };
    std::fs::create_dir(dest).map_err(err(dest))?;
    for e in std::fs::read_dir(src).map_err(err(src))? {
        let e = e.map_err(err(src))?;
        let (from, to) = (e.path(), dest.join(e.file_name()));
        if e.file_type().map_err(err(&from))?.is_dir() {
            link_tree(&from, &to)?;
        } else if std::fs::hard_link(&from, &to).is_err() {
            std::fs::copy(&from, &to).map_err(err(&to))?;
        }
    }
    Ok(())
}

/// `dir/merged`, made (`--merge`: the adapter merged into a full checkpoint).
pub fn merged_dir(dir: &Path) -> Result<PathBuf, TrainError> {
    let merged = dir.join("merged");
    std::fs::create_dir(&merged).map_err(|source| TrainError::Io {
        path: merged.clone(),
        source,
    })?;
    Ok(merged)
}

/// Writes adapter `a` of a run of `config` into `dir` in the run's adapter format: PEFT's
/// files, mlx-lm's, or PEFT's with llama.cpp's `adapter.gguf` beside them (titled after the
/// output folder, as `convert_lora_to_gguf.py` titles the folder it converts). `fin`: the final
/// output (checkpoints keep PEFT's layout, which a resumed run reads). `modules`: the model's
/// Linears; `layers`: its decoder layers; `score`: a reward model's head, trained in full
/// beside the adapters (PEFT's `SEQ_CLS` layout, the only one that holds it).
pub(crate) fn save_adapter(
    a: &crate::model::lora::Adapters,
    config: &crate::train::TrainConfig,
    dir: &Path,
    modules: &[(String, usize, usize)],
    layers: usize,
    fin: bool,
    score: Option<&candle_core::Tensor>,
) -> Result<(), TrainError> {
    use crate::train::AdapterFormat;
    let base = config.model.display().to_string();
    if let Some(score) = score {
        if fin && config.adapter_format != AdapterFormat::Peft {
            return Err(super::config_err(
                "adapter_format",
                "a reward model's adapter carries its trained `score` head, which only PEFT's layout holds (--adapter-format peft)",
            ));
        }
        a.save_peft_classifier(dir, modules, &base, score)?;
        return Ok(());
    }
    match (config.adapter_format, fin) {
        (AdapterFormat::MlxLm, true) => a.save_mlx_lm(dir, layers)?,
        (AdapterFormat::Gguf, true) => {
            a.save_peft_for(dir, modules, &base)?;
            let name = config
                .output
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "adapter".into());
            let base_config = crate::adapters::gguf::base_config(&config.model)?;
            a.save_gguf(
                &dir.join("adapter.gguf"),
                &base_config,
                &crate::adapters::gguf::id_to_title(&name),
            )?;
        }
        _ => a.save_peft_for(dir, modules, &base)?,
    }
    Ok(())
}
