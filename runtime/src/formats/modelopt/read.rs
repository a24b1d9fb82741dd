//! Reading ModelOpt's unified-HF layout (kiln's or ModelOpt's) for execution: weights decoded
//! on load — FP8 (per tensor, per
//! channel, 128×128 blocks), INT8, INT4 (AWQ), NVFP4, MXFP4, MXFP8, each Linear's
//! `pre_quant_scale` folded into its columns — and, for execution, the activation quantizers an
//! engine applies ([`crate::model::act_quant`]).

use crate::checkpoint::Checkpoint;
use crate::export::format::Format;
use crate::model::act_quant::{ActQuant, InputQuant, LinearInput};
use crate::model::{ModelError, Weights, f32s, load_plain};
use candle_core::{DType, Device};

use kiln_kernels::formats::{fp4::e2m1_to_f32, fp8::e4m3_to_f32};
use kiln_kernels::ops::{fp8, int, mx, nvfp4};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;

/// Tensors a quantized Linear carries beside its weight (read with it, not as weights).
pub(crate) const SCALE_SUFFIXES: [&str; 6] = [
    ".weight_scale",
    ".weight_scale_2",
    ".input_scale",
    ".pre_quant_scale",
    ".k_scale",
    ".v_scale",
];

/// The quantization format of each quantized module: `quant_algo` of `hf_quant_config.json`
/// (or `config.json`'s `quantization_config`), per layer for `MIXED_PRECISION`.
/// `None` for the whole-model format when it is `MIXED_PRECISION` (each layer then has its
/// own) or absent; an unknown `quant_algo` is an error naming it.
#[allow(clippy::type_complexity)]
fn formats(
    checkpoint: &Checkpoint,
) -> Result<(bool, Option<Format>, BTreeMap<String, Format>), ModelError> {
    let q = quant_config(checkpoint)?;
    let Some(q) = q else {
        return Ok((false, None, BTreeMap::new()));
    };
    let parse = |a: &str, whose: &str| {
        Format::from_quant_algo(a).ok_or_else(|| {
            ModelError::Config(format!(
                "{whose}: unknown quant_algo `{a}` (kiln decodes {})",
                Format::ALL.map(Format::quant_algo).join(", ")
            ))
        })
    };
    let algo = q.get("quant_algo").and_then(Value::as_str);
    let whole = match algo {
        None | Some("MIXED_PRECISION") => None,
        Some(a) => Some(parse(a, "quantization config")?),
    };
    let mut per_layer = BTreeMap::new();
    if let Some(layers) = q.get("quantized_layers").and_then(Value::as_object) {
        for (m, l) in layers {
            if let Some(a) = l.get("quant_algo").and_then(Value::as_str) {
                per_layer.insert(m.clone(), parse(a, m)?);
            }
        }
    }
    Ok((algo.is_some(), whole, per_layer))
}

fn bytes(checkpoint: &Checkpoint, name: &str) -> Result<Vec<u8>, ModelError> {
    let mut b = Vec::new();
    checkpoint.read(name, &mut b)?;
    Ok(b)
}

/// The decoded `[rows, cols]` f32 weight of the quantized Linear `module`.
fn decode(
    checkpoint: &Checkpoint,
    module: &str,
    format: Format,
    stored_shape: &[usize],
    fold_pre_quant_scale: bool,
) -> Result<(Vec<f32>, [usize; 2]), ModelError> {
    let w = stored(
        checkpoint,
        module,
        format,
        stored_shape,
        fold_pre_quant_scale,
    )?;
    let mut out = vec![0f32; w.rows * w.cols];
    w.rows_into(0, &mut out).map_err(|e| ModelError::Tensor {
        tensor: format!("{module}.weight"),
        message: e.to_string(),
    })?;
    Ok((out, [w.rows, w.cols]))
}

/// A quantized Linear's weight as ModelOpt stores it, decodable by rows (and kept so for
/// QLoRA): its codes, its scales (f32, or the FP8 / E8M0 bytes), the second-level scale, and
/// the `pre_quant_scale` folded into its columns where that applies.
#[derive(Debug)]
pub(crate) struct Stored {
    format: Format,
    rows: usize,
    cols: usize,
    q: Vec<u8>,
    scales: Vec<f32>,
    scale_bytes: Vec<u8>,
    scale_2: f32,
    /// INT4: columns per scale.
    group: usize,
    pre_quant_scale: Option<Vec<f32>>,
}

impl Stored {
    /// Decodes rows `start ..` (as many as `out` holds; for INT4, pairs of rows) into `out`.
    fn rows_into(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        let cols = self.cols;
        let n = out.len() / cols.max(1);
        let (lo, hi) = (start, start + n);
        match self.format {
            Format::Fp8 => fp8::dequantize_fp8(&self.q[lo * cols..hi * cols], self.scales[0], out)?,
            Format::Fp8PerChannel => {
                let s = &self.scales;
                fp8::dequantize_fp8_with(
                    &self.q[lo * cols..hi * cols],
                    n,
                    cols,
                    |i, _| s[lo + i],
                    out,
                )?
            }
            Format::Fp8Block => {
                let s = &self.scales;
                let tc = cols.div_ceil(128);
                fp8::dequantize_fp8_with(
                    &self.q[lo * cols..hi * cols],
                    n,
                    cols,
                    |i, j| {
                        if s.len() == 1 {
                            s[0]
                        } else {
                            s[((lo + i) / 128) * tc + j / 128]
                        }
                    },
                    out,
                )?
            }
            Format::Int8Wo | Format::Int8Sq => {
                let q: Vec<i8> = self.q[lo * cols..hi * cols]
                    .iter()
                    .map(|&b| b as i8)
                    .collect();
                int::dequantize_int8_per_channel(&q, n, cols, &self.scales[lo..hi], out)?
            }
            Format::Int4Awq | Format::W4a8Awq => {
                let g = cols / self.group;
                int::dequantize_int4_groups(
                    &self.q[lo / 2 * cols..hi.div_ceil(2) * cols],
                    n,
                    cols,
                    self.group,
                    &self.scales[lo * g..hi * g],
                    out,
                )?
            }
            Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq => nvfp4::dequantize_nvfp4(
                &self.q[lo * cols / 2..hi * cols / 2],
                &self.scale_bytes[lo * cols / 16..hi * cols / 16],
                self.scale_2,
                out,
            )?,
            Format::Mxfp4 => mx::dequantize_mxfp4(
                &self.q[lo * cols / 2..hi * cols / 2],
                &self.scale_bytes[lo * cols / 32..hi * cols / 32],
                out,
            )?,
            Format::Mxfp8 => mx::dequantize_mxfp8(
                &self.q[lo * cols..hi * cols],
                &self.scale_bytes[lo * cols / 32..hi * cols / 32],
                out,
            )?,
        }
        // y = W (x ⊙ pqs): the scale multiplies the weight's columns.
        if let Some(pqs) = &self.pre_quant_scale {
            for row in out.chunks_exact_mut(cols) {
                for (w, p) in row.iter_mut().zip(pqs) {
                    *w *= p;
                }
            }
        }
        Ok(())
    }
}

impl kiln_kernels::ops::packed_matmul::PackedRows for Stored {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn row_align(&self) -> usize {
        match self.format {
            Format::Int4Awq | Format::W4a8Awq => 2,
            _ => 1,
        }
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        self.rows_into(start, out)
    }
    fn packed_bytes(&self) -> usize {
        self.q.len()
            + self.scales.len() * 4
            + self.scale_bytes.len()
            + self.pre_quant_scale.as_ref().map_or(0, |p| p.len() * 4)
    }
}

/// The quantized Linear `module` in `format` as stored ([`Stored`]; its weight stored
/// `stored_shape`), with its `pre_quant_scale` folded when `fold_pre_quant_scale`.
///
/// Long on purpose: one arm per ModelOpt format's scales.
fn stored(
    checkpoint: &Checkpoint,
    module: &str,
    format: Format,
    stored_shape: &[usize],
    fold_pre_quant_scale: bool,
) -> Result<Stored, ModelError> {
    let weight = format!("{module}.weight");
    let bad = |message: String| ModelError::Tensor {
        tensor: weight.clone(),
        message,
    };
    let scale = |suffix: &str| f32s(checkpoint, &format!("{module}.{suffix}"));
    let scale_shape = |suffix: &str| {
        checkpoint
            .tensor(&format!("{module}.{suffix}"))
            .map(|t| t.shape.clone())
            .unwrap_or_default()
    };
    let &[r, c] = stored_shape else {
        return Err(bad(format!(
            "a quantized weight must be 2-D, found {stored_shape:?}"
        )));
    };
    let q = bytes(checkpoint, &weight)?;
    let (rows, cols) = match format {
        Format::Int4Awq | Format::W4a8Awq => (2 * r, c),
        Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq | Format::Mxfp4 => (r, 2 * c),
        _ => (r, c),
    };
    let mut w = Stored {
        format,
        rows,
        cols,
        q,
        scales: Vec::new(),
        scale_bytes: Vec::new(),
        scale_2: 1.0,
        group: cols.max(1),
        pre_quant_scale: None,
    };
    // What the decode slices, checked here once.
    let need = |what: &str, have: usize, want: usize| {
        if have == want {
            Ok(())
        } else {
            Err(bad(format!(
                "{what} has {have} values, {rows}×{cols} needs {want}"
            )))
        }
    };
    match format {
        Format::Fp8 => {
            w.scales = scale("weight_scale")?;
            need("weight_scale", w.scales.len().min(1), 1)?;
        }
        Format::Fp8PerChannel | Format::Int8Wo | Format::Int8Sq => {
            w.scales = scale("weight_scale")?;
            need("weight_scale", w.scales.len(), rows)?;
        }
        Format::Fp8Block => {
            w.scales = scale("weight_scale")?;
            if w.scales.len() != 1 {
                need(
                    "weight_scale",
                    w.scales.len(),
                    rows.div_ceil(128) * cols.div_ceil(128),
                )?;
            }
        }
        Format::Int4Awq | Format::W4a8Awq => {
            let groups = scale_shape("weight_scale")
                .get(1)
                .copied()
                .unwrap_or(1)
                .max(1);
            w.group = cols / groups;
            w.scales = scale("weight_scale")?;
            if w.group == 0 || !cols.is_multiple_of(groups) {
                return Err(bad(format!("{cols} columns in {groups} scale groups")));
            }
            need("weight_scale", w.scales.len(), rows * groups)?;
        }
        Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq => {
            w.scale_bytes = bytes(checkpoint, &format!("{module}.weight_scale"))?;
            w.scale_2 = scale("weight_scale_2")?[0];
            need("weight_scale", w.scale_bytes.len(), rows * cols / 16)?;
        }
        Format::Mxfp4 | Format::Mxfp8 => {
            w.scale_bytes = bytes(checkpoint, &format!("{module}.weight_scale"))?;
            need("weight_scale", w.scale_bytes.len(), rows * cols / 32)?;
        }
    }
    let packed_len = match format {
        Format::Int4Awq | Format::W4a8Awq => rows / 2 * cols,
        Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq | Format::Mxfp4 => rows * cols / 2,
        _ => rows * cols,
    };
    need("weight", w.q.len(), packed_len)?;
    // y = W (x ⊙ pqs): the scale multiplies the weight's columns (unless the input quantizer
    // applies it to the input).
    if fold_pre_quant_scale
        && checkpoint
            .tensor(&format!("{module}.pre_quant_scale"))
            .is_some()
    {
        let pqs = scale("pre_quant_scale")?;
        if pqs.len() != cols {
            return Err(bad(format!(
                "pre_quant_scale has {} values for {cols} input channels",
                pqs.len()
            )));
        }
        w.pre_quant_scale = Some(pqs);
    }
    Ok(w)
}

/// The quantization config: `quantization` of `hf_quant_config.json`, or `config.json`'s
/// `quantization_config`.
fn quant_config(checkpoint: &Checkpoint) -> Result<Option<Value>, ModelError> {
    let path = checkpoint.dir().join("hf_quant_config.json");
    if !path.is_file() {
        return Ok(checkpoint
            .config()
            .raw()
            .get("quantization_config")
            .cloned());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::file(&path, e))?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| ModelError::file(&path, e))?;
    Ok(doc.get("quantization").cloned())
}

/// `kv_cache_quant_algo` of the quantization config, if any.
fn kv_cache_algo(checkpoint: &Checkpoint) -> Result<Option<String>, ModelError> {
    Ok(quant_config(checkpoint)?
        .as_ref()
        .and_then(|q| q.get("kv_cache_quant_algo"))
        .and_then(Value::as_str)
        .map(str::to_string))
}

/// The input quantization of a Linear in format `algo` (`None`: weight-only), from its
/// `input_scale` where the format has a static one.
fn input_quant(
    checkpoint: &Checkpoint,
    module: &str,
    format: Format,
) -> Result<Option<InputQuant>, ModelError> {
    input_quant_named(checkpoint, &format!("{module}.input_scale"), format)
}

/// [`input_quant`] with the input scale's tensor name given (BMM experts:
/// `<experts>.gate_up_proj_input_scale`).
fn input_quant_named(
    checkpoint: &Checkpoint,
    input_scale_name: &str,
    format: Format,
) -> Result<Option<InputQuant>, ModelError> {
    let input_scale = || -> Result<f32, ModelError> {
        let name = input_scale_name.to_string();
        if checkpoint.tensor(&name).is_none() {
            return Err(ModelError::Tensor {
                tensor: name,
                message: format!(
                    "missing: a {} Linear quantizes its input with it",
                    format.quant_algo()
                ),
            });
        }
        Ok(f32s(checkpoint, &name)?[0])
    };
    Ok(match format {
        Format::Fp8 | Format::W4a8Awq => Some(InputQuant::Fp8(input_scale()?)),
        Format::Nvfp4 | Format::Nvfp4Awq => Some(InputQuant::Nvfp4(input_scale()?)),
        Format::Int8Sq => Some(InputQuant::Int8(input_scale()?)),
        Format::Fp8PerChannel => Some(InputQuant::Fp8PerToken),
        Format::Mxfp8 => Some(InputQuant::Mxfp8),
        Format::Mxfp4 => Some(InputQuant::Mxfp4),
        Format::Int8Wo | Format::Int4Awq | Format::W4a16Nvfp4 | Format::Fp8Block => None,
    })
}

/// A BMM experts tensor (GPT-OSS, Llama4): `<experts>.gate_up_proj` or `<experts>.down_proj`.
pub(crate) fn is_bmm_expert_weight(name: &str) -> bool {
    name.ends_with(".experts.gate_up_proj") || name.ends_with(".experts.down_proj")
}

/// A BMM experts tensor's scale (`<experts>.gate_up_proj_weight_scale`, `_weight_scale_2`,
/// `_input_scale`; likewise for `down_proj`).
pub(crate) fn is_bmm_expert_scale(name: &str) -> bool {
    ["_weight_scale", "_weight_scale_2", "_input_scale"]
        .iter()
        .any(|s| name.strip_suffix(s).is_some_and(is_bmm_expert_weight))
}

/// The decoded f32 `[E, in, out]` of the quantized BMM experts tensor `name` (stored as
/// ModelOpt writes it: FP8 `[E, in, out]` with one scale, one per expert or 128×128 tiles;
/// NVFP4 packed along `in` — `[E, in/2, out]`, scales `[E, in/16, out]`; MXFP8 / MXFP4 in
/// 32-blocks along `out`).
fn decode_bmm(
    checkpoint: &Checkpoint,
    name: &str,
    format: Format,
    stored: &[usize],
) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
    let bad = |message: String| ModelError::Tensor {
        tensor: name.to_string(),
        message,
    };
    let kernel = |e: kiln_kernels::KernelError| bad(e.to_string());
    let &[e, r, c] = stored else {
        return Err(bad(format!("BMM experts must be 3-D, found {stored:?}")));
    };
    let scale_name = format!("{name}_weight_scale");
    let q = bytes(checkpoint, name)?;
    let (rows, cols) = match format {
        Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq => (2 * r, c),
        Format::Mxfp4 => (r, 2 * c),
        _ => (r, c),
    };
    let mut out = vec![0f32; e * rows * cols];
    match format {
        Format::Fp8 | Format::Fp8PerChannel | Format::Fp8Block => {
            let s = f32s(checkpoint, &scale_name)?;
            let (tr, tc) = (rows.div_ceil(128), cols.div_ceil(128));
            let scale_of = |x: usize, i: usize, j: usize| match format {
                Format::Fp8 => s[0],
                Format::Fp8PerChannel => s[x],
                _ => s[(x * tr + i / 128) * tc + j / 128],
            };
            let want = match format {
                Format::Fp8 => 1,
                Format::Fp8PerChannel => e,
                _ => e * tr * tc,
            };
            if s.len() != want {
                return Err(bad(format!(
                    "`{scale_name}` has {} values, {} needs {want}",
                    s.len(),
                    format.quant_algo()
                )));
            }
            for (x, expert) in out.chunks_mut(rows * cols).enumerate() {
                let q = &q[x * rows * cols..(x + 1) * rows * cols];
                fp8::dequantize_fp8_with(q, rows, cols, |i, j| scale_of(x, i, j), expert)
                    .map_err(kernel)?;
            }
        }
        Format::Nvfp4 | Format::W4a16Nvfp4 | Format::Nvfp4Awq => {
            let s = bytes(checkpoint, &scale_name)?;
            let ws2 = f32s(checkpoint, &format!("{name}_weight_scale_2"))?[0];
            if s.len() != e * (rows / 16) * cols {
                return Err(bad(format!(
                    "`{scale_name}` has {} values, NVFP4 needs {}",
                    s.len(),
                    e * (rows / 16) * cols
                )));
            }
            // Byte (x, p, j) holds rows 2p (low nibble) and 2p + 1 (high) of column j.
            for x in 0..e {
                for i in 0..rows {
                    for j in 0..cols {
                        let byte = q[(x * r + i / 2) * c + j];
                        let code = if i % 2 == 0 { byte & 0xf } else { byte >> 4 };
                        let scale = s[(x * (rows / 16) + i / 16) * cols + j];
                        out[(x * rows + i) * cols + j] =
                            e2m1_to_f32(code) * (e4m3_to_f32(scale) * ws2);
                    }
                }
            }
        }
        Format::Mxfp8 => {
            let s = bytes(checkpoint, &scale_name)?;
            mx::dequantize_mxfp8(&q, &s, &mut out).map_err(kernel)?
        }
        Format::Mxfp4 => {
            let s = bytes(checkpoint, &scale_name)?;
            mx::dequantize_mxfp4(&q, &s, &mut out).map_err(kernel)?
        }
        other => {
            return Err(bad(format!(
                "{other} BMM experts cannot be decoded (ModelOpt 0.47 cannot write them)"
            )));
        }
    }
    Ok((out, vec![e, rows, cols]))
}

/// Reads `checkpoint` (plain, or in ModelOpt's layout) for execution in `dtype` on `device`,
/// decoding quantized weights (each `pre_quant_scale` folded into its weight's columns).
pub fn load_weights(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
) -> Result<Weights, ModelError> {
    Ok(load_for_execution(checkpoint, dtype, device, false)?.0)
}

/// [`load_weights`] of ModelOpt's layout, and with `activations` the activation quantizers an engine applies
/// ([`ActQuant`]): a Linear that quantizes its input keeps its `pre_quant_scale` on the input
/// side (it is applied before the quantization), and `k_scale` / `v_scale` quantize the
/// KV cache.
///
/// Long on purpose: one arm per stored dtype (floats, quantized Linears, BMM experts) with their
/// activation quantizers.
pub fn load_for_execution(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    activations: bool,
) -> Result<(Weights, ActQuant), ModelError> {
    load_with(checkpoint, dtype, device, activations, false)
}

/// [`load_weights`] in f32 with every quantized Linear (not BMM experts) kept as stored, its
/// `pre_quant_scale` folded (QLoRA).
pub(crate) fn load_packed(checkpoint: &Checkpoint, device: &Device) -> Result<Weights, ModelError> {
    Ok(load_with(checkpoint, DType::F32, device, false, true)?.0)
}

fn load_with(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    activations: bool,
    pack: bool,
) -> Result<(Weights, ActQuant), ModelError> {
    let (quantized, algo, per_layer) = formats(checkpoint)?;
    if !quantized {
        return Ok((load_plain(checkpoint, dtype, device)?, ActQuant::default()));
    }
    let mut act = ActQuant::default();
    // FP8 KV-cache scales only (NVFP4 KV caches run unquantized here).
    if activations && kv_cache_algo(checkpoint)?.as_deref() == Some("FP8") {
        for t in checkpoint.tensors() {
            for (suffix, key) in [(".k_proj.k_scale", 'k'), (".v_proj.v_scale", 'v')] {
                if let Some(attention) = t.name.strip_suffix(suffix) {
                    let s = f32s(checkpoint, &t.name)?[0];
                    let e = act.kv.entry(attention.to_string()).or_default();
                    if key == 'k' {
                        e.0 = Some(s);
                    } else {
                        e.1 = Some(s);
                    }
                }
            }
        }
    }
    let mut vars = BTreeMap::new();
    let mut packed: BTreeMap<String, crate::model::packed::Packed> = BTreeMap::new();
    for t in checkpoint.tensors() {
        if SCALE_SUFFIXES.iter().any(|s| t.name.ends_with(s)) || is_bmm_expert_scale(&t.name) {
            continue;
        }
        let (data, shape): (Vec<f32>, Vec<usize>) = match t.dtype {
            Dtype::BF16 | Dtype::F16 | Dtype::F32 => (f32s(checkpoint, &t.name)?, t.shape.clone()),
            Dtype::U8 | Dtype::I8 | Dtype::F8_E4M3 if t.name.ends_with(".weight") => {
                let module = t.name.trim_end_matches(".weight");
                let a =
                    *per_layer
                        .get(module)
                        .or(algo.as_ref())
                        .ok_or_else(|| ModelError::Tensor {
                            tensor: t.name.clone(),
                            message: "quantized, but no format is recorded for it".into(),
                        })?;
                if pack {
                    let w = stored(checkpoint, module, a, &t.shape, true)?;
                    packed.insert(t.name.clone(), std::sync::Arc::new(w));
                    continue;
                }
                let quant = if activations {
                    input_quant(checkpoint, module, a)?
                } else {
                    None
                };
                let (data, shape) = decode(checkpoint, module, a, &t.shape, quant.is_none())?;
                if let Some(quant) = quant {
                    let pqs = format!("{module}.pre_quant_scale");
                    let pre_quant_scale = match checkpoint.tensor(&pqs) {
                        Some(_) => Some(f32s(checkpoint, &pqs)?),
                        None => None,
                    };
                    act.inputs.insert(
                        module.to_string(),
                        LinearInput {
                            pre_quant_scale,
                            quant: Some(quant),
                        },
                    );
                }
                (data, shape.to_vec())
            }
            Dtype::U8 | Dtype::F8_E4M3 if is_bmm_expert_weight(&t.name) => {
                let experts = t.name.rsplit_once('.').map_or("", |(e, _)| e);
                let a = *per_layer
                    .get(&t.name)
                    .or_else(|| per_layer.get(experts))
                    .or(algo.as_ref())
                    .ok_or_else(|| ModelError::Tensor {
                        tensor: t.name.clone(),
                        message: "quantized, but no format is recorded for it".into(),
                    })?;
                if activations
                    && let Some(quant) =
                        input_quant_named(checkpoint, &format!("{}_input_scale", t.name), a)?
                {
                    act.inputs.insert(
                        t.name.clone(),
                        LinearInput {
                            pre_quant_scale: None,
                            quant: Some(quant),
                        },
                    );
                }
                decode_bmm(checkpoint, &t.name, a, &t.shape)?
            }
            other => {
                return Err(ModelError::Tensor {
                    tensor: t.name.clone(),
                    message: format!("dtype {other:?} cannot be run"),
                });
            }
        };
        vars.insert(
            t.name.clone(),
            crate::model::to_var(data, &shape, dtype, device)?,
        );
    }
    Ok((Weights::from_vars(vars).with_packed(packed), act))
}
