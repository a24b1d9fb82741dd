//! `kiln verify`: reload a quantized export as an inference engine would and check it against
//! the model it came from — every tensor decodes; names, shapes and dtypes agree with the
//! reference and with the two JSON files; nothing is missing or extra — and measure each
//! quantized Linear's weight error.

use crate::checkpoint::Checkpoint;
use crate::formats::modelopt::read::{is_bmm_expert_scale, is_bmm_expert_weight, load_weights};
use crate::model::ModelError;
use candle_core::{DType, Device};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;
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
    /// What the format's reader checked agrees when there are no problems ("names, dtypes
    /// and both JSON files agree").
    pub agreement: String,
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

/// Where a reference tensor the export holds under per-expert names comes from: rows
/// `first_row..first_row + rows` of expert `expert` of the fused 3-D tensor `fused`.
#[derive(Debug, Clone)]
struct Slice {
    fused: String,
    expert: usize,
    first_row: usize,
    rows: usize,
}

/// One reference tensor, under the name the export should hold it by.
struct RefTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    slice: Option<Slice>,
}

/// The reference's tensors as an export names them: a fused experts tensor
/// (`<experts>.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, `up_proj [E, I, H]` without a
/// gate) that the export does not hold is split into `<experts>.<e>.{gate,up,down}_proj.weight`
/// (docs/FORMATS.md §4.3b); every other tensor is itself.
fn reference_tensors(r: &Checkpoint, q: &Checkpoint) -> Vec<RefTensor> {
    reference_tensors_by(r, |name| {
        q.tensor(name).is_some() || q.tensor(&format!("{name}_packed")).is_some()
    })
}

/// [`reference_tensors`], with `held(name)` saying whether the export holds a tensor.
fn reference_tensors_by(r: &Checkpoint, held: impl Fn(&str) -> bool) -> Vec<RefTensor> {
    let mut out = Vec::new();
    for t in r.tensors() {
        let split = match (t.name.rsplit_once('.'), &t.shape[..]) {
            (Some((experts, local)), &[e, rows, cols]) if !held(&t.name) => {
                let parts: &[&str] = match local {
                    "gate_up_proj" => &["gate_proj", "up_proj"],
                    "down_proj" => &["down_proj"],
                    "up_proj" => &["up_proj"],
                    _ => &[],
                };
                let first = format!("{experts}.0.{}.weight", parts.first().unwrap_or(&""));
                (!parts.is_empty() && held(&first) && rows % parts.len() == 0).then_some((
                    experts,
                    parts,
                    e,
                    rows / parts.len(),
                    cols,
                ))
            }
            _ => None,
        };
        let Some((experts, parts, experts_n, rows, cols)) = split else {
            out.push(RefTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                slice: None,
            });
            continue;
        };
        for expert in 0..experts_n {
            for (i, part) in parts.iter().enumerate() {
                out.push(RefTensor {
                    name: format!("{experts}.{expert}.{part}.weight"),
                    dtype: t.dtype,
                    shape: vec![rows, cols],
                    slice: Some(Slice {
                        fused: t.name.clone(),
                        expert,
                        first_row: i * rows,
                        rows,
                    }),
                });
            }
        }
    }
    out
}

/// [`crate::formats::verify`] for ModelOpt's layout (docs/FORMATS.md §2–4): every reference tensor is there
/// with its name, dtype and shape, or quantized with its scales; nothing else is; the two JSON
/// files agree; the checks an engine makes on load; every tensor decodes, and the error per
/// quantized Linear.
///
/// Long on purpose: the checklist an engine runs loading ModelOpt's layout, in order.
pub(crate) fn verify_modelopt(
    r: &Checkpoint,
    quantized: &Path,
) -> Result<VerifyReport, ModelError> {
    let q = Checkpoint::open(quantized)?;
    let mut report = VerifyReport {
        agreement: "names, dtypes and both JSON files agree".into(),
        ..VerifyReport::default()
    };
    let algo = quant_algo(quantized, &q, &mut report.problems);
    report.quant_algo = algo.clone().unwrap_or_default();
    report.smoothed = q.tensors().any(|t| t.name.ends_with(".pre_quant_scale"))
        || report.quant_algo.contains("AWQ")
        || report.quant_algo.contains("SQ");
    let tied = ties_embeddings(r);
    // The reference's tensors as the export names them: fused 3-D experts (transformers 5's
    // layout) are written as per-expert Linears, so they are compared slice by slice.
    let tensors = reference_tensors(r, &q);
    let shapes: BTreeMap<String, (Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|t| (t.name.clone(), (t.dtype, t.shape.clone())))
        .collect();
    let quantized_dtype = |d: Dtype| matches!(d, Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3);
    for t in &tensors {
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
            Some(_) if t.slice.is_some() => {}
            Some(o) => {
                // An unquantized tensor: NaN/Inf the reference does not have.
                let (mut a, mut b) = (Vec::new(), Vec::new());
                q.read(&o.name, &mut a)?;
                r.read(&t.name, &mut b)?;
                let count = crate::export::stats::nonfinite_in_bytes;
                let (mine, theirs) = (count(o.dtype, &a), count(t.dtype, &b));
                if mine > theirs {
                    report.problems.push(format!(
                        "`{}` holds {mine} NaN/Inf value(s); the reference has {theirs}",
                        t.name
                    ));
                }
            }
        }
    }
    for o in q.tensors() {
        let known = shapes.contains_key(&o.name)
            || is_bmm_expert_scale(&o.name)
            || crate::formats::modelopt::read::SCALE_SUFFIXES
                .iter()
                .any(|s| o.name.ends_with(s));
        if !known {
            report.problems.push(format!(
                "`{}` is in the export but not in the reference",
                o.name
            ));
        }
    }
    if let Some(algo) = &algo {
        engine_checks(r, &shapes, &q, quantized, algo, &mut report.problems);
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
    let original = load_weights(r, DType::F32, &Device::Cpu)?;
    let slices: BTreeMap<&str, &Slice> = tensors
        .iter()
        .filter_map(|t| Some((t.name.as_str(), t.slice.as_ref()?)))
        .collect();
    for (name, var) in decoded.vars() {
        let Some(o) = q.tensor(name) else { continue };
        if !quantized_dtype(o.dtype) {
            continue;
        }
        let want = match slices.get(name.as_str()) {
            Some(s) => original
                .get(&s.fused)?
                .get(s.expert)?
                .narrow(0, s.first_row, s.rows)?,
            None => original.get(name)?.clone(),
        };
        // Non-finite values the reference does not have: an engine would run on NaN.
        let count = |t: &candle_core::Tensor| -> Result<usize, ModelError> {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.iter().filter(|x| !x.is_finite()).count())
        };
        let (mine, theirs) = (count(var.as_tensor())?, count(&want)?);
        if mine > theirs {
            report.problems.push(format!(
                "`{name}` decodes to {mine} NaN/Inf value(s); the reference has {theirs}"
            ));
        }
        let got = var.as_tensor();
        if got.dims() != want.dims() {
            report.problems.push(format!(
                "`{name}` decodes to {:?}, the reference is {:?}",
                got.dims(),
                want.dims()
            ));
            continue;
        }
        let diff = (got - &want)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        let norm = want.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        report.weight_errors.push((
            name.trim_end_matches(".weight").to_string(),
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt(),
        ));
    }
    Ok(report)
}

/// Whether the reference ties `lm_head` to the embeddings (an export may then omit it).
fn ties_embeddings(r: &Checkpoint) -> bool {
    r.config()
        .raw()
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false)
}

/// `config.json`'s entry `key` (null when absent).
fn config_entry(q: &Checkpoint, key: &str) -> Value {
    q.config().raw().get(key).cloned().unwrap_or(Value::Null)
}

/// [`crate::formats::verify`] for a compressed-tensors export (docs/FORMATS.md §9): every reference tensor is
/// there under its name (a quantized Linear's weight as `weight` in FP8 / INT8 or as
/// `weight_packed`, with its parameters); nothing else is; `quantization_config` parses, names
/// a config group for every quantized Linear and `ignore`s exactly the Linears stored
/// unquantized; every quantized weight decodes to the reference's shape, without NaN / Inf the
/// reference lacks; the error per quantized Linear.
///
/// Long on purpose: the checklist of compressed-tensors' loader, in order.
pub(crate) fn verify_compressed(
    r: &Checkpoint,
    q: &Checkpoint,
) -> Result<VerifyReport, ModelError> {
    use crate::formats::compressed_tensors::read::PARAM_SUFFIXES;
    let mut report = VerifyReport {
        agreement: "names, dtypes and config.json's quantization_config agree".into(),
        ..VerifyReport::default()
    };
    let config = config_entry(q, "quantization_config");
    report.quant_algo = format!(
        "compressed-tensors {}",
        config
            .get("format")
            .and_then(Value::as_str)
            .unwrap_or("(no format)")
    );
    let problems = &mut report.problems;
    let tied = ties_embeddings(r);
    let tensors = reference_tensors(r, q);
    let known: BTreeMap<&str, &RefTensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let quantized_dtype = |d: Dtype| matches!(d, Dtype::I8 | Dtype::F8_E4M3);
    let mut quantized = Vec::new();
    for t in &tensors {
        let packed = format!("{}_packed", t.name);
        match (q.tensor(&t.name), q.tensor(&packed)) {
            (None, None) if tied && t.name == "lm_head.weight" => {}
            (None, None) => problems.push(format!("`{}` is missing from the export", t.name)),
            (Some(_), Some(_)) => problems.push(format!(
                "`{}` is in the export both as itself and as `{packed}`",
                t.name
            )),
            (Some(o), None) if quantized_dtype(o.dtype) => {
                if !t.name.ends_with(".weight") || o.shape != t.shape {
                    problems.push(format!(
                        "`{}` is {:?} {:?} in the export, {:?} {:?} in the reference",
                        t.name, o.dtype, o.shape, t.dtype, t.shape
                    ));
                } else {
                    quantized.push(t.name.trim_end_matches(".weight").to_string());
                }
            }
            (Some(o), None) if o.shape != t.shape || o.dtype != t.dtype => problems.push(format!(
                "`{}` is {:?} {:?} in the export, {:?} {:?} in the reference",
                t.name, o.dtype, o.shape, t.dtype, t.shape
            )),
            (Some(_), None) => {}
            (None, Some(_)) => quantized.push(t.name.trim_end_matches(".weight").to_string()),
        }
    }
    let kv = config.get("kv_cache_scheme").is_some_and(|k| !k.is_null());
    for o in q.tensors() {
        let param_of = PARAM_SUFFIXES
            .iter()
            .find_map(|s| o.name.strip_suffix(s))
            .map(|m| format!("{m}.weight"));
        let ok = known.contains_key(o.name.as_str())
            || param_of.as_deref().is_some_and(|w| known.contains_key(w))
            || (kv && (o.name.ends_with(".k_scale") || o.name.ends_with(".v_scale")));
        if !ok {
            problems.push(format!(
                "`{}` is in the export but not in the reference",
                o.name
            ));
        }
    }
    // `ignore` names Linears stored unquantized, and no quantized one.
    let ignore: Vec<String> = config
        .get("ignore")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    for m in &ignore {
        if quantized.contains(m) {
            problems.push(format!(
                "`{m}` is in quantization_config.ignore, but it is quantized"
            ));
        } else if !(m.starts_with("re:")
            || known.contains_key(format!("{m}.weight").as_str())
            // A tied lm_head is a module of the loaded model without a tensor of its own.
            || (m == "lm_head" && ties_embeddings(r)))
        {
            problems.push(format!(
                "quantization_config.ignore names `{m}`, which the model does not have"
            ));
        }
    }
    architecture_checks(r, q, problems);
    if report.problems.is_empty() {
        compare_decoded(
            r,
            q,
            &tensors,
            &quantized.into_iter().collect(),
            &mut report,
        )?;
    }
    Ok(report)
}

/// [`crate::formats::verify`] for an MLX export (docs/FORMATS.md §8): `quantization` parses; every reference
/// tensor decodes (stacked experts split back per expert) to its shape, nothing is extra; the
/// error per quantized module (`lm_head` and embeddings included, as mlx-lm quantizes them).
pub(crate) fn verify_mlx(r: &Checkpoint, q: &Checkpoint) -> Result<VerifyReport, ModelError> {
    let mut report = VerifyReport {
        agreement: "names, dtypes and config.json's quantization agree".into(),
        ..VerifyReport::default()
    };
    let qc = config_entry(q, "quantization");
    report.quant_algo = format!(
        "mlx {} {}-bit, groups of {}",
        qc.get("mode").and_then(Value::as_str).unwrap_or("affine"),
        qc.get("bits").and_then(Value::as_u64).unwrap_or(0),
        qc.get("group_size").and_then(Value::as_u64).unwrap_or(0),
    );
    let quantized = crate::formats::mlx::read::quantized_hf_modules(q);
    architecture_checks(r, q, &mut report.problems);
    if !report.problems.is_empty() {
        return Ok(report);
    }
    let decoded = crate::formats::mlx::read::load(q, DType::F32, &Device::Cpu);
    let quantized = quantized.into_iter().collect();
    compare_decoded_weights(r, decoded, &quantized, &mut report)?;
    Ok(report)
}

/// The checks a format's reader makes once it has decoded an export (or failed to: the error
/// becomes a problem): every reference tensor is among the decoded weights with its shape —
/// a fused 3-D experts tensor may be held per expert, a tied `lm_head` may be absent — and
/// nothing else is; each module in `quantized` (module names, without `.weight`) decodes
/// without NaN / Inf the reference lacks, and its relative error ‖Ŵ − W‖/‖W‖ goes into
/// `report.weight_errors`. What a plugin format's [`crate::formats::FormatReader::verify`]
/// calls after its own config checks.
pub fn compare_decoded_weights(
    reference: &Checkpoint,
    decoded: Result<crate::model::Weights, ModelError>,
    quantized: &std::collections::BTreeSet<String>,
    report: &mut VerifyReport,
) -> Result<(), ModelError> {
    // The names the decoded export holds: per expert where a format stacks experts.
    let held: std::collections::BTreeSet<String> = decoded
        .as_ref()
        .map(|w| w.vars().keys().cloned().collect())
        .unwrap_or_default();
    let tensors = reference_tensors_by(reference, |name| held.contains(name));
    compare_weights(reference, decoded, &tensors, quantized, report)
}

/// [`crate::formats::verify`] for a GGUF file kiln wrote (docs/FORMATS.md §7.2): the metadata gives the
/// reference's architecture and sizes; every reference tensor is read back (dequantized, Q/K
/// rows restored, experts unstacked) to its shape and nothing is left over; the error per
/// block-quantized weight (`lm_head` and the embeddings included, as llama.cpp quantizes them).
pub(crate) fn verify_gguf(r: &Checkpoint, path: &Path) -> Result<VerifyReport, ModelError> {
    let mut report = VerifyReport {
        agreement: "names and the GGUF metadata agree with the reference's config".into(),
        ..VerifyReport::default()
    };
    let g = match crate::formats::gguf::read::GgufModel::open(path) {
        Ok(g) => g,
        Err(e) => {
            report.problems.push(e.to_string());
            return Ok(report);
        }
    };
    report.quant_algo = format!("gguf {}", g.file_type());
    let reference = r.config().raw();
    for key in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ] {
        let (want, got) = (reference.get(key), g.config.get(key));
        if want.is_some() && want != got {
            report.problems.push(format!(
                "the GGUF metadata gives {key} {got:?}, the reference's config.json {want:?}"
            ));
        }
    }
    if !report.problems.is_empty() {
        return Ok(report);
    }
    let (decoded, quantized) = match g.weights(DType::F32, &Device::Cpu) {
        Ok((w, q)) => (Ok(w), q),
        Err(e) => (Err(e), Default::default()),
    };
    let held: std::collections::BTreeSet<String> = decoded
        .as_ref()
        .map(|w| w.vars().keys().cloned().collect())
        .unwrap_or_default();
    let tensors: Vec<RefTensor> = reference_tensors_by(r, |name| held.contains(name))
        .into_iter()
        // llama.cpp computes the rotary frequencies itself.
        .filter(|t| !t.name.ends_with("rotary_emb.inv_freq"))
        .collect();
    compare_weights(r, decoded, &tensors, &quantized, &mut report)?;
    Ok(report)
}

/// Decodes the export `q` as it runs ([`load_weights`]) and compares it with the reference:
/// every reference tensor is there with its shape (`lm_head` may be tied), nothing else is;
/// each module in `quantized`: no NaN / Inf the reference lacks, and its relative error.
fn compare_decoded(
    r: &Checkpoint,
    q: &Checkpoint,
    tensors: &[RefTensor],
    quantized: &std::collections::BTreeSet<String>,
    report: &mut VerifyReport,
) -> Result<(), ModelError> {
    compare_weights(
        r,
        crate::formats::compressed_tensors::read::load(q, DType::F32, &Device::Cpu, false)
            .map(|(w, _)| w),
        tensors,
        quantized,
        report,
    )
}

/// [`compare_decoded`] with the export already decoded (or the error decoding gave).
fn compare_weights(
    r: &Checkpoint,
    decoded: Result<crate::model::Weights, ModelError>,
    tensors: &[RefTensor],
    quantized: &std::collections::BTreeSet<String>,
    report: &mut VerifyReport,
) -> Result<(), ModelError> {
    let decoded = match decoded {
        Ok(w) => w,
        Err(e) => {
            report
                .problems
                .push(format!("the export does not decode: {e}"));
            return Ok(());
        }
    };
    let original = load_weights(r, DType::F32, &Device::Cpu)?;
    let tied = ties_embeddings(r);
    for t in tensors {
        let Some(got) = decoded.maybe(&t.name) else {
            if !(tied && t.name == "lm_head.weight") {
                report
                    .problems
                    .push(format!("`{}` is missing from the decoded export", t.name));
            }
            continue;
        };
        let want = match &t.slice {
            Some(s) => original
                .get(&s.fused)?
                .get(s.expert)?
                .narrow(0, s.first_row, s.rows)?,
            None => original.get(&t.name)?.clone(),
        };
        if got.dims() != want.dims() {
            report.problems.push(format!(
                "`{}` decodes to {:?}, the reference is {:?}",
                t.name,
                got.dims(),
                want.dims()
            ));
            continue;
        }
        let Some(module) = t
            .name
            .strip_suffix(".weight")
            .filter(|m| quantized.contains(*m))
        else {
            continue;
        };
        let got: Vec<f32> = got.flatten_all()?.to_vec1()?;
        let want: Vec<f32> = want.flatten_all()?.to_vec1()?;
        let bad = |v: &[f32]| v.iter().filter(|x| !x.is_finite()).count();
        let (mine, theirs) = (bad(&got), bad(&want));
        if mine > theirs {
            report.problems.push(format!(
                "`{}` decodes to {mine} NaN/Inf value(s); the reference has {theirs}",
                t.name
            ));
        }
        let (diff, norm) = got.iter().zip(&want).fold((0f64, 0f64), |(d, n), (a, b)| {
            (d + f64::from(a - b).powi(2), n + f64::from(*b).powi(2))
        });
        report.weight_errors.push((
            module.to_string(),
            (diff / norm.max(f64::MIN_POSITIVE)).sqrt(),
        ));
    }
    let names: std::collections::BTreeSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    for name in decoded.vars().keys() {
        if !names.contains(name.as_str()) {
            report.problems.push(format!(
                "`{name}` is in the decoded export but not in the reference"
            ));
        }
    }
    Ok(())
}

/// The checks an inference engine makes when it loads a quantized checkpoint: what the
/// configs declare matches the tensors (docs/FORMATS.md §2, §3), and the architecture fields it
/// sizes its buffers by agree with the weights.
///
/// Long on purpose: the checks vLLM and TensorRT-LLM make on load, one after another, each citing
/// its engine.
fn engine_checks(
    reference: &Checkpoint,
    shapes: &BTreeMap<String, (Dtype, Vec<usize>)>,
    export: &Checkpoint,
    dir: &Path,
    algo: &str,
    problems: &mut Vec<String>,
) {
    use crate::export::format::Format;
    use crate::export::recipe::glob_match;
    let hf: Value = std::fs::read_to_string(dir.join("hf_quant_config.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Value::Null);
    let names = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    };
    let excluded = names(hf.pointer("/quantization/exclude_modules"));
    let ignore = names(
        export
            .config()
            .raw()
            .get("quantization_config")
            .and_then(|q| q.get("ignore")),
    );
    if excluded != ignore && algo != "MIXED_PRECISION" {
        problems.push(format!(
            "hf_quant_config.json excludes {excluded:?}, config.json's quantization_config.ignore lists {ignore:?}"
        ));
    }
    let layers = hf.pointer("/quantization/quantized_layers");
    // Every module with a quantized weight: its declared format, and that format's layout.
    let quantized_dtype = |d: Dtype| matches!(d, Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3);
    for t in export.tensors() {
        if is_bmm_expert_weight(&t.name) && quantized_dtype(t.dtype) {
            bmm_checks(t, shapes, export, &excluded, layers, algo, problems);
            continue;
        }
        let Some(module) = t.name.strip_suffix(".weight") else {
            continue;
        };
        let Some((original_dtype, original_shape)) = shapes.get(&t.name) else {
            continue;
        };
        if !quantized_dtype(t.dtype) || quantized_dtype(*original_dtype) {
            continue;
        }
        if let Some(pattern) = excluded.iter().find(|p| glob_match(p, module)) {
            problems.push(format!(
                "`{module}` is listed as excluded (`{pattern}`), but `{}` is {:?}: an engine would load it as an unquantized weight",
                t.name, t.dtype
            ));
            continue;
        }
        let declared = match layers {
            Some(l) => l
                .get(module)
                .and_then(|c| c.get("quant_algo"))
                .and_then(Value::as_str),
            None => Some(algo),
        };
        let Some(declared) = declared else {
            problems.push(format!(
                "`{module}` is quantized ({:?}) but not listed in quantized_layers",
                t.dtype
            ));
            continue;
        };
        let Some(format) = Format::from_quant_algo(declared) else {
            problems.push(format!("`{module}`: unknown quant_algo `{declared}`"));
            continue;
        };
        let [rows, cols] = original_shape[..] else {
            continue;
        };
        let written = |local: &str| {
            export
                .tensor(&format!("{module}.{local}"))
                .map(|t| (t.dtype, t.shape.as_slice()))
        };
        // The block size it declares (AWQ's INT4 blocks may be 32, 64 or 128).
        let group = match layers {
            Some(l) => l.get(module).and_then(|c| c.get("group_size")),
            None => hf.pointer("/quantization/group_size"),
        }
        .and_then(Value::as_u64)
        .map(|g| g as usize);
        if let Some(p) = format.layout_problem(rows, cols, group, written) {
            problems.push(format!("`{module}` is declared {declared}, but {p}"));
        }
    }
    if let Some(Value::Object(l)) = layers {
        for module in l.keys() {
            let weight = format!("{module}.weight");
            if export
                .tensor(&weight)
                .is_some_and(|t| !quantized_dtype(t.dtype))
            {
                problems.push(format!(
                    "`{module}` is listed in quantized_layers, but `{weight}` is not quantized"
                ));
            }
        }
    }
    architecture_checks(reference, export, problems);
}

/// [`engine_checks`] for a quantized BMM experts projection (`<experts>.gate_up_proj`,
/// `[E, in, out]`): not excluded, and the declared format's 3-D layout.
fn bmm_checks(
    t: &crate::checkpoint::TensorMeta,
    shapes: &BTreeMap<String, (Dtype, Vec<usize>)>,
    export: &Checkpoint,
    excluded: &[String],
    layers: Option<&Value>,
    algo: &str,
    problems: &mut Vec<String>,
) {
    use crate::export::format::Format;
    use crate::export::recipe::glob_match;
    let experts = t.name.rsplit_once('.').map_or("", |(e, _)| e);
    if let Some(pattern) = excluded.iter().find(|p| glob_match(p, experts)) {
        problems.push(format!(
            "`{experts}` is listed as excluded (`{pattern}`), but `{}` is {:?}",
            t.name, t.dtype
        ));
        return;
    }
    let declared = match layers {
        Some(l) => l
            .get(&t.name)
            .or_else(|| l.get(experts))
            .and_then(|c| c.get("quant_algo"))
            .and_then(Value::as_str),
        None => Some(algo),
    };
    let Some(format) = declared.and_then(Format::from_quant_algo) else {
        problems.push(format!(
            "`{}` is quantized ({:?}) but no known format is declared for it",
            t.name, t.dtype
        ));
        return;
    };
    let Some((_, &[e, rows, cols])) = shapes.get(&t.name).map(|(d, s)| (d, s.as_slice())) else {
        return;
    };
    let written = |local: &str| {
        let name = if local == "weight" {
            t.name.clone()
        } else {
            format!("{}_{local}", t.name)
        };
        export.tensor(&name).map(|x| (x.dtype, x.shape.as_slice()))
    };
    if let Some(p) = format.bmm_layout_problem(e, rows, cols, written) {
        problems.push(format!(
            "`{}` is declared {}, but {p}",
            t.name,
            format.quant_algo()
        ));
    }
}

/// `hidden_size`, `num_attention_heads`, `num_hidden_layers` and `vocab_size` are present in
/// the export's config.json and agree with the reference's tensor shapes.
fn architecture_checks(reference: &Checkpoint, export: &Checkpoint, problems: &mut Vec<String>) {
    let config = export.config().raw();
    let field = |name: &str| -> Option<usize> {
        let v = config.get(name)?.as_u64()?;
        usize::try_from(v).ok()
    };
    let mut get = |name: &str| {
        let v = field(name);
        if v.is_none() {
            problems.push(format!(
                "config.json has no `{name}` (a positive integer): an engine cannot size the model"
            ));
        }
        v
    };
    let (hidden, heads, layers, vocab) = (
        get("hidden_size"),
        get("num_attention_heads"),
        get("num_hidden_layers"),
        get("vocab_size"),
    );
    let shape = |name: &str| reference.tensor(name).map(|t| t.shape.clone());
    let mut disagree = |what: String| problems.push(format!("config.json {what}"));
    if let Some(s) = shape("model.embed_tokens.weight") {
        if vocab.is_some_and(|v| s.first() != Some(&v)) {
            disagree(format!(
                "says vocab_size {}, `model.embed_tokens.weight` is {s:?}",
                vocab.unwrap_or(0)
            ));
        }
        if hidden.is_some_and(|h| s.get(1) != Some(&h)) {
            disagree(format!(
                "says hidden_size {}, `model.embed_tokens.weight` is {s:?}",
                hidden.unwrap_or(0)
            ));
        }
    }
    let found_layers = reference
        .tensors()
        .filter_map(|t| t.name.strip_prefix("model.layers."))
        .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
        .max()
        .map(|n| n + 1);
    if let (Some(want), Some(found)) = (layers, found_layers)
        && want != found
    {
        disagree(format!(
            "says num_hidden_layers {want}, the checkpoint has {found} layers"
        ));
    }
    if let (Some(h), Some(n)) = (hidden, heads) {
        let head_dim = field("head_dim").unwrap_or(h.checked_div(n).unwrap_or(0));
        if let Some(s) = shape("model.layers.0.self_attn.q_proj.weight")
            && s.first() != Some(&(n * head_dim))
        {
            disagree(format!(
                "says {n} attention heads of {head_dim}, `model.layers.0.self_attn.q_proj.weight` is {s:?}"
            ));
        }
    }
}
