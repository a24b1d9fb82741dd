//! `kiln verify`: reload a quantized export as an inference engine would and check it against
//! the model it came from — every tensor decodes; names, shapes and dtypes agree with the
//! reference and with the two JSON files; nothing is missing or extra — and measure each
//! quantized Linear's weight error.

use super::ModelError;
use super::load::{is_bmm_expert_scale, is_bmm_expert_weight, load_weights};
use crate::checkpoint::Checkpoint;
use candle_core::{DType, Device};
use safetensors::Dtype;
use serde_json::Value;
use std::path::Path;

/// What `verify` found.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// The export's `quant_algo`.
    pub quant_algo: String,
    /// Problems found (empty: the export is consistent).
    pub problems: Vec<String>,
    /// Per quantized Linear: its name and the relative error ‖W_q − W‖ / ‖W‖ of the decoded
    /// weight against the reference's.
    pub weight_errors: Vec<(String, f64)>,
    /// Whether the weights were smoothed (AWQ / SmoothQuant): their error then also holds
    /// the smoothing, which the model undoes elsewhere (pre_quant_scale, norms).
    pub smoothed: bool,
}

fn quant_algo(dir: &Path, checkpoint: &Checkpoint, problems: &mut Vec<String>) -> Option<String> {
    let path = dir.join("hf_quant_config.json");
    let hf: Option<Value> = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let from_hf = hf
        .as_ref()
        .and_then(|h| h.pointer("/quantization/quant_algo"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let from_config = checkpoint
        .config()
        .raw()
        .get("quantization_config")
        .and_then(|q| q.get("quant_algo"))
        .and_then(Value::as_str)
        .map(str::to_string);
    match (&from_hf, &from_config) {
        (None, None) => problems.push(format!(
            "{}: no hf_quant_config.json and no quantization_config in config.json: not a quantized export",
            dir.display()
        )),
        (None, Some(_)) => problems.push(format!("{}: missing or unreadable", path.display())),
        (Some(_), None) => problems.push(format!(
            "{}: config.json has no quantization_config.quant_algo",
            dir.display()
        )),
        (Some(a), Some(b)) if a != b => problems.push(format!(
            "hf_quant_config.json says quant_algo {a}, config.json says {b}"
        )),
        _ => {}
    }
    from_hf.or(from_config)
}

/// Checks the export at `quantized` against the model at `reference`.
pub fn verify(reference: &Path, quantized: &Path) -> Result<VerifyReport, ModelError> {
    let r = Checkpoint::open(reference)?;
    let q = Checkpoint::open(quantized)?;
    let mut report = VerifyReport::default();
    let algo = quant_algo(quantized, &q, &mut report.problems);
    report.quant_algo = algo.clone().unwrap_or_default();
    report.smoothed = q.tensors().any(|t| t.name.ends_with(".pre_quant_scale"))
        || report.quant_algo.contains("AWQ")
        || report.quant_algo.contains("SQ");
    let tied = r
        .config()
        .raw()
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // Fused 3-D experts that the export split into per-expert Linears (transformers 5's
    // layout) are not compared yet; BMM experts (GPT-OSS) stay 3-D and are.
    if let Some(t) = r
        .tensors()
        .find(|t| t.shape.len() == 3 && q.tensor(&t.name).is_none())
    {
        report.problems.push(format!(
            "`{}` is a fused 3-D experts tensor the export split into per-expert Linears: kiln verify does not check that layout yet",
            t.name
        ));
        return Ok(report);
    }
    let quantized_dtype = |d: Dtype| matches!(d, Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3);
    for t in r.tensors() {
        match q.tensor(&t.name) {
            None if tied && t.name == "lm_head.weight" => {}
            None => report
                .problems
                .push(format!("`{}` is missing from the export", t.name)),
            Some(o) if quantized_dtype(o.dtype) && is_bmm_expert_weight(&t.name) => {
                if q.tensor(&format!("{}_weight_scale", t.name)).is_none() {
                    report.problems.push(format!(
                        "`{}` is quantized ({:?}) but `{}_weight_scale` is missing",
                        t.name, o.dtype, t.name
                    ));
                }
            }
            Some(o) if quantized_dtype(o.dtype) => {
                if !t.name.ends_with(".weight") {
                    report.problems.push(format!(
                        "`{}` is stored as {:?}, but only Linear weights are quantized",
                        t.name, o.dtype
                    ));
                } else if q.tensor(&format!("{}_scale", t.name)).is_none() {
                    report.problems.push(format!(
                        "`{}` is quantized ({:?}) but `{}_scale` is missing",
                        t.name, o.dtype, t.name
                    ));
                }
            }
            Some(o) if o.shape != t.shape || o.dtype != t.dtype => report.problems.push(format!(
                "`{}` is {:?} {:?} in the export, {:?} {:?} in the reference",
                t.name, o.dtype, o.shape, t.dtype, t.shape
            )),
            Some(_) => {}
        }
    }
    for o in q.tensors() {
        let known = r.tensor(&o.name).is_some()
            || is_bmm_expert_scale(&o.name)
            || super::load::SCALE_SUFFIXES
                .iter()
                .any(|s| o.name.ends_with(s));
        if !known {
            report.problems.push(format!(
                "`{}` is in the export but not in the reference",
                o.name
            ));
        }
    }
    if algo.is_none() || !report.problems.is_empty() {
        return Ok(report);
    }
    // Every tensor decodes, to the reference's shapes; the weight error per quantized Linear.
    let decoded = match load_weights(&q, DType::F32, &Device::Cpu) {
        Ok(w) => w,
        Err(e) => {
            report
                .problems
                .push(format!("the export does not decode: {e}"));
            return Ok(report);
        }
    };
    let original = load_weights(&r, DType::F32, &Device::Cpu)?;
    for (name, var) in decoded.vars() {
        let Some(o) = q.tensor(name) else { continue };
        if !quantized_dtype(o.dtype) {
            continue;
        }
        let want = original.get(name)?;
        let got = var.as_tensor();
        if got.dims() != want.dims() {
            report.problems.push(format!(
                "`{name}` decodes to {:?}, the reference is {:?}",
                got.dims(),
                want.dims()
            ));
            continue;
        }
        let diff = (got - want)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        let norm = want.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        report.weight_errors.push((
            name.trim_end_matches(".weight").to_string(),
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt(),
        ));
    }
    Ok(report)
}
