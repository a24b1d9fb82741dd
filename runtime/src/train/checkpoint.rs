//! Resumable checkpoints, for every backend: `<output>/checkpoint-<step>/` holds what the run
//! has made so far in the form the user gets at the end (a PEFT adapter, or the full
//! checkpoint) plus what a run needs to continue exactly: every trainable parameter
//! (`trainable.safetensors`), AdamW's moments (`optimizer.safetensors`, `m/<name>` and
//! `v/<name>`) and `trainer_state.json` (the task, the step, optimizer steps, tokens seen, the
//! random streams' positions, the task's own state). The data position follows from the step,
//! since the order depends only on the seed and the epoch. Written beside its final name and
//! renamed; `save_total_limit` rotates old ones out.

use super::TrainError;
use super::config_err;
use super::output::sink_err;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor's shape and f32 values, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// The shape.
    pub dims: Vec<usize>,
    /// The values, row-major.
    pub data: Vec<f32>,
}

/// A checkpoint read back.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// `trainer_state.json`.
    pub state: serde_json::Value,
    /// Steps done.
    pub step: u64,
    /// Optimizer steps done.
    pub optimizer_steps: u64,
    /// Tokens seen.
    pub tokens: u64,
    /// Every trainable parameter, by name.
    pub trainable: BTreeMap<String, HostTensor>,
    /// AdamW's moments, `m/<name>` and `v/<name>`.
    pub moments: BTreeMap<String, HostTensor>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn write_tensors(path: &Path, tensors: &[(String, HostTensor)]) -> Result<(), TrainError> {
    let views = tensors
        .iter()
        .map(|(n, t)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                t.dims.clone(),
                bytemuck::cast_slice(&t.data),
            )
            .map(|v| (n.clone(), v))
            .map_err(|e| config_err("save_steps", format!("tensor `{n}`: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| config_err("save_steps", format!("{}: {e}", path.display())))
}

fn read_tensors(path: &Path) -> Result<BTreeMap<String, HostTensor>, TrainError> {
    let bad = |message: String| TrainError::Data {
        path: path.to_path_buf(),
        line: None,
        message,
    };
    let bytes = std::fs::read(path).map_err(io(path))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(bad(format!("tensor `{name}` is not F32")));
        }
        let data = crate::checkpoint::floats::decode::<f32>(view.data());
        out.insert(
            name,
            HostTensor {
                dims: view.shape().to_vec(),
                data,
            },
        );
    }
    Ok(out)
}

/// Writes `<root>/checkpoint-<step>`: `output` writes the user's form of the result into the
/// folder it is given, then the parameters, moments and `state` (to which `global_step` is
/// added); `limit` keeps only the newest checkpoints.
pub fn save(
    root: &Path,
    step: u64,
    mut state: serde_json::Value,
    trainable: &[(String, HostTensor)],
    moments: &[(String, HostTensor)],
    output: impl FnOnce(&Path) -> Result<(), TrainError>,
    limit: Option<usize>,
) -> Result<PathBuf, TrainError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let dir = root.join(format!("checkpoint-{step}"));
    let tmp = root.join(format!(".checkpoint-{step}.partial"));
    // What a save interrupted earlier (a killed run) left: one run writes to a root at a time.
    for e in std::fs::read_dir(root).map_err(io(root))?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".checkpoint-") && name.ends_with(".partial") {
            std::fs::remove_dir_all(e.path()).map_err(io(&e.path()))?;
        }
    }
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    let written = (|| {
        output(&tmp)?;
        write_tensors(&tmp.join("trainable.safetensors"), trainable)?;
        write_tensors(&tmp.join("optimizer.safetensors"), moments)?;
        state["global_step"] = step.into();
        state["kiln"] = env!("CARGO_PKG_VERSION").into();
        let path = tmp.join("trainer_state.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&state).expect("JSON") + "\n",
        )
        .map_err(io(&path))?;
        // Complete on the disk before it takes the checkpoint's name; a checkpoint of the same
        // step is replaced in one exchange (crate::sink::install), never deleted first.
        crate::sink::sync_files(&tmp).map_err(sink_err)?;
        crate::sink::install(&tmp, &dir, &crate::sink::RealFs).map_err(sink_err)?;
        Ok(())
    })();
    if let Err(e) = written {
        // A failed save (a full disk) leaves the checkpoints as they were.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if let Some(limit) = limit {
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
    for (step, path) in found.into_iter().take(excess) {
        // Renamed out of sight first: a run killed while deleting leaves no half checkpoint
        // under a checkpoint's name (the next save clears the `.partial` folder).
        let doomed = root.join(format!(".checkpoint-{step}.removed.partial"));
        std::fs::rename(&path, &doomed).map_err(io(&path))?;
        std::fs::remove_dir_all(&doomed).map_err(io(&doomed))?;
        removed.push(path);
    }
    Ok(removed)
}

/// Reads the checkpoint `dir` of a `task` run whose trainable parameters are `expected`
/// (name → shape): a checkpoint of another task, or with other parameters (LoRA targets,
/// rank, model) or without their optimizer state, is an error naming what differs.
pub fn load(
    dir: &Path,
    task: &str,
    expected: &[(String, Vec<usize>)],
) -> Result<Loaded, TrainError> {
    let state_path = dir.join("trainer_state.json");
    let text = std::fs::read_to_string(&state_path).map_err(io(&state_path))?;
    let bad = |m: String| TrainError::Data {
        path: state_path.clone(),
        line: None,
        message: m,
    };
    let state: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    if state["task"] != task {
        return Err(config_err(
            "resume",
            format!(
                "{} is a checkpoint of task {}, not {task}",
                dir.display(),
                state["task"],
            ),
        ));
    }
    let step = state["global_step"]
        .as_u64()
        .ok_or_else(|| bad("`global_step` is missing".into()))?;
    let trainable = read_tensors(&dir.join("trainable.safetensors"))?;
    let moments = read_tensors(&dir.join("optimizer.safetensors"))?;
    for (name, dims) in expected {
        let t = trainable.get(name).ok_or_else(|| {
            config_err(
                "resume",
                format!(
                    "{} has no parameter `{name}`: it was saved by a run with other settings (LoRA targets, rank, model)",
                    dir.display()
                ),
            )
        })?;
        if &t.dims != dims {
            return Err(config_err(
                "resume",
                format!(
                    "`{name}` has shape {:?} in {}, expected {dims:?}",
                    t.dims,
                    dir.display(),
                ),
            ));
        }
        if !moments.contains_key(&format!("m/{name}"))
            || !moments.contains_key(&format!("v/{name}"))
        {
            return Err(config_err(
                "resume",
                format!("{} holds no optimizer state for `{name}`", dir.display()),
            ));
        }
    }
    Ok(Loaded {
        optimizer_steps: state["optimizer_steps"].as_u64().unwrap_or(step),
        tokens: state["tokens"].as_u64().unwrap_or(0),
        step,
        state,
        trainable,
        moments,
    })
}
