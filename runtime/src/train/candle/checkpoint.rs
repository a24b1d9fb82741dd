//! candle's side of the resumable checkpoints (`train/checkpoint.rs` has the format): its
//! variables and AdamW's moments to and from the host.

use super::Setup;
use super::optim::AdamW;
use crate::train::TrainError;
use crate::train::checkpoint::{self as format, HostTensor};
use crate::train::task::TaskInfo;
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

fn host(name: &str, t: &Tensor) -> Result<(String, HostTensor), TrainError> {
    Ok((
        name.to_string(),
        HostTensor {
            dims: t.dims().to_vec(),
            data: t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
        },
    ))
}

fn device_tensor(t: &HostTensor, setup: &Setup) -> Result<Tensor, TrainError> {
    Ok(Tensor::from_vec(
        t.data.clone(),
        t.dims.as_slice(),
        &setup.ops.device,
    )?)
}

/// Writes `<output>/checkpoint-<step>`.
pub fn save(
    setup: &Setup,
    adam: &AdamW,
    objective: &dyn TaskInfo,
    step: u64,
    tokens: u64,
) -> Result<PathBuf, TrainError> {
    let trainable = setup
        .trainable
        .iter()
        .map(|(n, v)| host(n, v.as_tensor()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut moments = Vec::with_capacity(adam.state.moments.len() * 2);
    for s in &adam.state.moments {
        moments.push(host(&format!("m/{}", s.name), &s.m)?);
        moments.push(host(&format!("v/{}", s.name), &s.v)?);
    }
    let state = json!({
        "task": objective.name(),
        "optimizer_steps": adam.state.step,
        "tokens": tokens,
        "dropout_rng": setup.model.adapters().map(|a| a.dropout_state()),
        "objective": objective.state(),
    });
    format::save(
        &setup.config.output,
        step,
        state,
        &trainable,
        &moments,
        |dir| match &setup.adapters {
            Some(a) => {
                let base = setup.config.model.display().to_string();
                let modules = crate::model::lora::linear_modules(&setup.model);
                match setup.score() {
                    Some(s) => a.save_peft_classifier(dir, &modules, &base, s)?,
                    None => a.save_peft_for(dir, &modules, &base)?,
                }
                Ok(())
            }
            None => super::write_full(setup, dir, &BTreeMap::new()),
        },
        setup.config.hyper.save_total_limit,
    )
}

/// Loads `dir` into the run: parameters, optimizer state, random streams.
pub fn load(
    dir: &Path,
    setup: &Setup,
    adam: &mut AdamW,
    objective: &mut dyn TaskInfo,
) -> Result<Resumed, TrainError> {
    let expected: Vec<(String, Vec<usize>)> = setup
        .trainable
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().dims().to_vec()))
        .collect();
    let c = format::load(dir, objective.name(), &expected)?;
    for (name, var) in &setup.trainable {
        let t = device_tensor(&c.trainable[name], setup)?;
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    for slot in &mut adam.state.moments {
        slot.m = device_tensor(&c.moments[&format!("m/{}", slot.name)], setup)?;
        slot.v = device_tensor(&c.moments[&format!("v/{}", slot.name)], setup)?;
    }
    adam.state.step = c.optimizer_steps;
    if let (Some(a), Some(r)) = (setup.model.adapters(), c.state["dropout_rng"].as_u64()) {
        a.set_dropout_state(r);
    }
    objective.restore(&c.state["objective"])?;
    Ok(Resumed {
        step: c.step,
        tokens: c.tokens,
    })
}
