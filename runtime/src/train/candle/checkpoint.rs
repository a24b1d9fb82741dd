//! Resumable checkpoints: `<output>/checkpoint-<step>/` holds what the run has made so far in
//! the form the user gets at the end (a PEFT adapter, or the full checkpoint) plus what a run
//! needs to continue exactly: every trainable parameter (`trainable.safetensors`), AdamW's
//! moments (`optimizer.safetensors`) and `trainer_state.json` (the step, tokens seen, the
//! random streams' positions). The data position follows from the step, since the order
//! depends only on the seed and the epoch. Written beside its final name and renamed.

use super::optim::AdamW;
use super::{Objective, Setup, backend_err, config_err};
use crate::train::TrainError;
use candle_core::{DType, Tensor};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a resumed run continues from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resumed {
    /// Steps already done.
    pub step: u64,
    /// Tokens seen so far.
    pub tokens: u64,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write_tensors(path: &Path, tensors: Vec<(String, Tensor)>) -> Result<(), TrainError> {
    let mut data = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let dims = t.dims().to_vec();
        let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        data.push((name, dims, bytemuck::cast_slice::<f32, u8>(&v).to_vec()));
    }
    let views = data
        .iter()
        .map(|(n, d, b)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, d.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(backend_err)
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(backend_err)
}

fn read_tensors(path: &Path, setup: &Setup) -> Result<BTreeMap<String, Tensor>, TrainError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| TrainError::Data {
        path: path.to_path_buf(),
        line: None,
        message: e.to_string(),
    })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(TrainError::Data {
                path: path.to_path_buf(),
                line: None,
                message: format!("tensor `{name}` is not F32"),
            });
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        out.insert(name, Tensor::from_vec(v, view.shape(), &setup.ops.device)?);
    }
    Ok(out)
}

/// Writes `<output>/checkpoint-<step>`.
pub fn save(
    setup: &Setup,
    adam: &AdamW,
    objective: &dyn Objective,
    step: u64,
    tokens: u64,
) -> Result<PathBuf, TrainError> {
    let root = &setup.config.output;
    std::fs::create_dir_all(root).map_err(io(root))?;
    let dir = root.join(format!("checkpoint-{step}"));
    let tmp = root.join(format!(".checkpoint-{step}.partial"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    match &setup.adapters {
        Some(a) => a.save_peft(
            &tmp,
            &setup.model,
            &setup.config.model.display().to_string(),
        )?,
        None => super::write_full(setup, &tmp, &BTreeMap::new())?,
    }
    let params = setup
        .trainable
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    write_tensors(&tmp.join("trainable.safetensors"), params)?;
    let mut moments = Vec::with_capacity(adam.slots.len() * 2);
    for s in &adam.slots {
        moments.push((format!("m/{}", s.name), s.m.clone()));
        moments.push((format!("v/{}", s.name), s.v.clone()));
    }
    write_tensors(&tmp.join("optimizer.safetensors"), moments)?;
    let state = json!({
        "task": objective.task(),
        "global_step": step,
        "optimizer_steps": adam.step,
        "tokens": tokens,
        "dropout_rng": setup.model.adapters().map(|a| a.dropout_state()),
        "objective": objective.state(),
        "kiln": env!("CARGO_PKG_VERSION"),
    });
    let path = tmp.join("trainer_state.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&state).expect("JSON") + "\n",
    )
    .map_err(io(&path))?;
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
    if let Some(limit) = setup.config.hyper.save_total_limit {
        rotate(root, limit)?;
    }
    Ok(dir)
}

/// Deletes the oldest `checkpoint-<step>` folders of `root` (by step) so that at most `limit`
/// remain, as transformers' `save_total_limit` rotates them.
pub fn rotate(root: &Path, limit: usize) -> Result<Vec<PathBuf>, TrainError> {
    let mut found: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .map_err(io(root))?
        .flatten()
        .filter_map(|e| {
            let step = e
                .file_name()
                .to_str()?
                .strip_prefix("checkpoint-")?
                .parse::<u64>()
                .ok()?;
            e.path().is_dir().then(|| (step, e.path()))
        })
        .collect();
    found.sort();
    let excess = found.len().saturating_sub(limit);
    let mut removed = Vec::with_capacity(excess);
    for (_, path) in found.into_iter().take(excess) {
        std::fs::remove_dir_all(&path).map_err(io(&path))?;
        removed.push(path);
    }
    Ok(removed)
}

/// Loads `dir` into the run: parameters, optimizer state, random streams.
pub fn load(
    dir: &Path,
    setup: &Setup,
    adam: &mut AdamW,
    objective: &mut dyn Objective,
) -> Result<Resumed, TrainError> {
    let state_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    let bad = |m: String| TrainError::Data {
        path: state_path.clone(),
        line: None,
        message: m,
    };
    let state: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    if state["task"] != objective.task() {
        return Err(config_err(
            "resume",
            format!(
                "{} is a checkpoint of task {}, not {}",
                dir.display(),
                state["task"],
                objective.task()
            ),
        ));
    }
    let step = state["global_step"]
        .as_u64()
        .ok_or_else(|| bad("`global_step` is missing".into()))?;
    let params = read_tensors(&dir.join("trainable.safetensors"), setup)?;
    for (name, var) in &setup.trainable {
        let t = params.get(name).ok_or_else(|| {
            config_err(
                "resume",
                format!(
                    "{} has no parameter `{name}`: it was saved by a run with other settings (LoRA targets, rank, model)",
                    dir.display()
                ),
            )
        })?;
        if t.dims() != var.as_tensor().dims() {
            return Err(config_err(
                "resume",
                format!(
                    "`{name}` has shape {:?} in {}, expected {:?}",
                    t.dims(),
                    dir.display(),
                    var.as_tensor().dims()
                ),
            ));
        }
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    let moments = read_tensors(&dir.join("optimizer.safetensors"), setup)?;
    for slot in &mut adam.slots {
        let (Some(m), Some(v)) = (
            moments.get(&format!("m/{}", slot.name)),
            moments.get(&format!("v/{}", slot.name)),
        ) else {
            return Err(config_err(
                "resume",
                format!(
                    "{} holds no optimizer state for `{}`",
                    dir.display(),
                    slot.name
                ),
            ));
        };
        slot.m = m.clone();
        slot.v = v.clone();
    }
    adam.step = state["optimizer_steps"].as_u64().unwrap_or(step);
    if let (Some(a), Some(r)) = (setup.model.adapters(), state["dropout_rng"].as_u64()) {
        a.set_dropout_state(r);
    }
    objective.restore(&state["objective"])?;
    Ok(Resumed {
        step,
        tokens: state["tokens"].as_u64().unwrap_or(0),
    })
}
