//! Loading a compressed-tensors checkpoint (vLLM's layout; llm-compressor's or kiln's
//! `--output-format compressed-tensors`, docs/FORMATS.md §9) for execution: every quantized
//! Linear decoded as compressed-tensors' `decompress` does, and the activation quantizers its
//! `input_activations` and `kv_cache_scheme` prescribe.
//!
//! Read: `float-quantized` and `int-quantized` (FP8 / INT8 weights, per tensor, channel,
//! group or block), `pack-quantized` (1–8-bit integers packed into int32, with or without zero
//! points), `nvfp4-pack-quantized`. Config groups are matched by their `targets`: `Linear`,
//! a module name, or a `re:` pattern kiln does not evaluate (an error naming it).

use crate::checkpoint::Checkpoint;
use crate::formats::compressed_tensors::quant;
use crate::model::act_quant::{ActQuant, InputQuant, LinearInput};
use crate::model::{ModelError, Weights};
use candle_core::{DType, Device};
use kiln_kernels::formats::fp8::e4m3_to_f32;
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;

/// Tensors a compressed Linear carries beside its weight.
pub(crate) const PARAM_SUFFIXES: [&str; 7] = [
    ".weight_scale",
    ".weight_zero_point",
    ".weight_shape",
    ".weight_global_scale",
    ".input_scale",
    ".input_global_scale",
    ".weight_packed",
];

/// Whether `checkpoint`'s `config.json` declares compressed-tensors quantization.
pub fn is_compressed_tensors(checkpoint: &Checkpoint) -> bool {
    quantization_config(checkpoint).is_some()
}

fn quantization_config(checkpoint: &Checkpoint) -> Option<&Value> {
    checkpoint
        .config()
        .raw()
        .get("quantization_config")
        .filter(|q| q.get("quant_method").and_then(Value::as_str) == Some("compressed-tensors"))
}

fn config_err(what: String) -> ModelError {
    ModelError::Config(format!("quantization_config: {what}"))
}

/// One config group's weight and input arguments (the fields kiln reads).
#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub num_bits: usize,
    pub float: bool,
    pub strategy: String,
    pub symmetric: bool,
    pub dynamic: bool,
    pub group_size: Option<usize>,
    pub block: Option<[usize; 2]>,
}

impl Args {
    fn parse(v: &Value, whose: &str) -> Result<Option<Args>, ModelError> {
        if v.is_null() {
            return Ok(None);
        }
        let field = |k: &str| v.get(k).filter(|x| !x.is_null());
        let num_bits = field("num_bits")
            .and_then(Value::as_u64)
            .ok_or_else(|| config_err(format!("{whose}.num_bits is missing")))?
            as usize;
        let ty = field("type").and_then(Value::as_str).unwrap_or("int");
        let block = match field("block_structure") {
            Some(Value::Array(a)) if a.len() == 2 => {
                let n = |i: usize| a[i].as_u64().map(|x| x as usize);
                match (n(0), n(1)) {
                    (Some(r), Some(c)) if r > 0 && c > 0 => Some([r, c]),
                    _ => return Err(config_err(format!("{whose}.block_structure {a:?}"))),
                }
            }
            Some(other) => return Err(config_err(format!("{whose}.block_structure {other}"))),
            None => None,
        };
        let group_size = field("group_size")
            .and_then(Value::as_i64)
            .filter(|&g| g > 0)
            .map(|g| g as usize);
        let strategy = match field("strategy").and_then(Value::as_str) {
            Some(s) => s.to_string(),
            None if group_size.is_some() => "group".into(),
            None => "tensor".into(),
        };
        Ok(Some(Args {
            num_bits,
            float: ty == "float",
            strategy,
            symmetric: field("symmetric").and_then(Value::as_bool).unwrap_or(true),
            dynamic: field("dynamic").is_some_and(|d| d != &Value::Bool(false)),
            group_size,
            block,
        }))
    }
}

/// The scheme of the config group that targets `module`.
fn scheme_for(q: &Value, module: &str) -> Result<(Option<Args>, Option<Args>), ModelError> {
    let groups = q
        .get("config_groups")
        .and_then(Value::as_object)
        .ok_or_else(|| config_err("no config_groups".into()))?;
    for (name, g) in groups {
        let targets: Vec<&str> = g
            .get("targets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let hit = targets.iter().any(|t| *t == "Linear" || *t == module);
        if hit {
            let w = Args::parse(
                g.get("weights").unwrap_or(&Value::Null),
                &format!("{name}.weights"),
            )?;
            let a = Args::parse(
                g.get("input_activations").unwrap_or(&Value::Null),
                &format!("{name}.input_activations"),
            )?;
            return Ok((w, a));
        }
        if let Some(t) = targets.iter().find(|t| t.starts_with("re:")) {
            return Err(config_err(format!(
                "{name} targets `{t}`: kiln reads groups that target `Linear` or module names"
            )));
        }
    }
    Err(config_err(format!(
        "`{module}` is quantized but no config group targets it"
    )))
}

/// A tensor's values as f32, FP8 decoded.
fn floats(checkpoint: &Checkpoint, name: &str) -> Result<Vec<f32>, ModelError> {
    if checkpoint
        .tensor(name)
        .is_some_and(|t| t.dtype == Dtype::F8_E4M3)
    {
        let mut b = Vec::new();
        checkpoint.read(name, &mut b)?;
        return Ok(b.into_iter().map(e4m3_to_f32).collect());
    }
    crate::model::f32s(checkpoint, name)
}

/// A decoded weight: its values and `[rows, cols]`.
pub(crate) type Decoded = (Vec<f32>, [usize; 2]);

/// The decoded `[rows, cols]` weight of the compressed Linear `module`, or `None` when its
/// weight is stored unquantized.
pub(crate) fn decode(checkpoint: &Checkpoint, module: &str) -> Result<Option<Decoded>, ModelError> {
    let Some(w) = compressed(checkpoint, module)? else {
        return Ok(None);
    };
    let (rows, cols) = (w.rows, w.cols);
    let mut out = vec![0f32; rows * cols];
    w.rows_into(0, &mut out)
        .map_err(|message| ModelError::Tensor {
            tensor: format!("{module}.weight_packed"),
            message,
        })?;
    Ok(Some((out, [rows, cols])))
}

/// A compressed Linear's weight as stored, checked, decodable by rows (and kept so for QLoRA).
#[derive(Debug)]
pub(crate) struct Compressed {
    rows: usize,
    cols: usize,
    codes: Codes,
    /// Integer and FP8 codes: a scale per block of `block` (rows, cols), `[⌈rows/br⌉,
    /// ⌈cols/bc⌉]` row-major, with zero points where asymmetric.
    scales: Vec<f32>,
    zero_points: Option<Vec<i8>>,
    block: (usize, usize),
}

/// How the codes are stored.
#[derive(Debug)]
enum Codes {
    /// `pack-quantized`: `bits`-bit integers in int32 words, each row its own words.
    Packed { words: Vec<i32>, bits: usize },
    /// One int8 each.
    Int8(Vec<u8>),
    /// One FP8 (E4M3) each.
    Fp8(Vec<u8>),
    /// NVFP4: two E2M1 codes a byte, an FP8 scale per `group` columns under `global`.
    Nvfp4 {
        raw: Vec<u8>,
        scales: Vec<u8>,
        group: usize,
        global: f32,
    },
}

impl Compressed {
    /// Decodes rows `start ..` (as many as `out` holds) into `out`.
    fn rows_into(&self, start: usize, out: &mut [f32]) -> Result<(), String> {
        let cols = self.cols;
        let n = out.len() / cols.max(1);
        match &self.codes {
            Codes::Nvfp4 {
                raw,
                scales,
                group,
                global,
            } => {
                for (k, o) in out.iter_mut().enumerate() {
                    let i = start * cols + k;
                    let b = raw[i / 2];
                    let code = if i.is_multiple_of(2) { b & 0xf } else { b >> 4 };
                    *o = quant::nvfp4_value(code, scales[i / group], *global);
                }
            }
            codes => {
                let (br, bc) = self.block;
                let gc = cols.div_ceil(bc);
                let mut row = vec![0f32; cols];
                for i in 0..n {
                    let r = start + i;
                    match codes {
                        Codes::Packed { words, bits } => {
                            let per = (cols * bits).div_ceil(32);
                            let q = quant::unpack_int32(
                                &words[r * per..(r + 1) * per],
                                1,
                                cols,
                                *bits,
                            )?;
                            for (d, v) in row.iter_mut().zip(q) {
                                *d = f32::from(v);
                            }
                        }
                        Codes::Int8(b) => {
                            for (d, &v) in row.iter_mut().zip(&b[r * cols..(r + 1) * cols]) {
                                *d = f32::from(v as i8);
                            }
                        }
                        Codes::Fp8(b) => {
                            for (d, &v) in row.iter_mut().zip(&b[r * cols..(r + 1) * cols]) {
                                *d = e4m3_to_f32(v);
                            }
                        }
                        Codes::Nvfp4 { .. } => unreachable!("handled above"),
                    }
                    let o = &mut out[i * cols..(i + 1) * cols];
                    for c in 0..cols {
                        let k = (r / br) * gc + c / bc;
                        let zp = self.zero_points.as_ref().map_or(0.0, |z| f32::from(z[k]));
                        o[c] = (row[c] - zp) * self.scales[k];
                    }
                }
            }
        }
        Ok(())
    }
}

impl kiln_kernels::ops::packed_matmul::PackedRows for Compressed {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        self.rows_into(start, out)
            .map_err(|what| kiln_kernels::KernelError::Parameter {
                op: "compressed-tensors decode",
                what,
            })
    }
    fn packed_bytes(&self) -> usize {
        let codes = match &self.codes {
            Codes::Packed { words, .. } => words.len() * 4,
            Codes::Int8(b) | Codes::Fp8(b) => b.len(),
            Codes::Nvfp4 { raw, scales, .. } => raw.len() + scales.len(),
        };
        codes + self.scales.len() * 4 + self.zero_points.as_ref().map_or(0, Vec::len)
    }
}

/// The compressed Linear `module` as stored ([`Compressed`]), or `None` when its weight is
/// stored unquantized.
///
/// Long on purpose: one arm per compressed-tensors compressor, as its `decompress` has them.
pub(crate) fn compressed(
    checkpoint: &Checkpoint,
    module: &str,
) -> Result<Option<Compressed>, ModelError> {
    let q = quantization_config(checkpoint)
        .ok_or_else(|| config_err("not compressed-tensors".into()))?;
    let packed = format!("{module}.weight_packed");
    let plain = format!("{module}.weight");
    let (name, meta) = match (checkpoint.tensor(&packed), checkpoint.tensor(&plain)) {
        (Some(m), _) => (packed, m),
        (None, Some(m)) if matches!(m.dtype, Dtype::F8_E4M3 | Dtype::I8) => (plain, m),
        _ => return Ok(None),
    };
    let bad = |message: String| ModelError::Tensor {
        tensor: name.clone(),
        message,
    };
    let (Some(w), _) = scheme_for(q, module)? else {
        return Err(bad(
            "quantized, but its config group has no `weights`".into()
        ));
    };
    let mut raw = Vec::new();
    checkpoint.read(&name, &mut raw)?;
    let scale_name = format!("{module}.weight_scale");
    let scale_meta = checkpoint
        .tensor(&scale_name)
        .ok_or_else(|| ModelError::Tensor {
            tensor: scale_name.clone(),
            message: "missing (a compressed Linear needs it)".into(),
        })?;
    // NVFP4: E2M1 codes, FP8 group scales over the global scale.
    if w.float && w.num_bits == 4 {
        let [rows, half] = meta.shape[..] else {
            return Err(bad(format!("must be 2-D, found {:?}", meta.shape)));
        };
        let cols = 2 * half;
        let g = w.group_size.unwrap_or(16);
        if g == 0 || cols % g != 0 {
            return Err(bad(format!(
                "{cols} columns do not split into groups of {g} (the config's group_size)"
            )));
        }
        let mut scales = Vec::new();
        checkpoint.read(&scale_name, &mut scales)?;
        let global_name = format!("{module}.weight_global_scale");
        let global = floats(checkpoint, &global_name)?
            .first()
            .copied()
            .ok_or_else(|| ModelError::Tensor {
                tensor: global_name,
                message: "empty".into(),
            })?;
        if scales.len() != rows * cols / g || raw.len() != rows * half {
            return Err(bad(format!(
                "`{scale_name}` has {} values, {rows}×{cols} in groups of {g} needs {}",
                scales.len(),
                rows * cols / g
            )));
        }
        return Ok(Some(Compressed {
            rows,
            cols,
            codes: Codes::Nvfp4 {
                raw,
                scales,
                group: g,
                global,
            },
            scales: Vec::new(),
            zero_points: None,
            block: (1, g),
        }));
    }
    // Integers: packed in int32, or one int8 each; FP8 codes.
    let (rows, cols, codes) = if name.ends_with("_packed") {
        let shape: Vec<i64> = checkpoint.read_as::<i64>(&format!("{module}.weight_shape"))?;
        let [rows, cols] = shape[..] else {
            return Err(bad(format!("weight_shape {shape:?} is not 2-D")));
        };
        let (Ok(rows), Ok(cols)) = (usize::try_from(rows), usize::try_from(cols)) else {
            return Err(bad(format!(
                "weight_shape {shape:?} has a negative dimension"
            )));
        };
        if raw.len() % 4 != 0 {
            return Err(bad(format!("{} bytes are not int32 words", raw.len())));
        }
        let words: Vec<i32> = bytemuck::pod_collect_to_vec(&raw);
        // The whole matrix must unpack (the rows are then unpacked one at a time).
        quant::unpack_int32(&words, rows, cols, w.num_bits).map_err(&bad)?;
        let bits = w.num_bits;
        (rows, cols, Codes::Packed { words, bits })
    } else {
        let [rows, cols] = meta.shape[..] else {
            return Err(bad(format!("must be 2-D, found {:?}", meta.shape)));
        };
        if raw.len() != rows * cols {
            return Err(bad(format!("{} bytes for {rows}×{cols}", raw.len())));
        }
        let codes = match meta.dtype {
            Dtype::I8 => Codes::Int8(raw),
            _ => Codes::Fp8(raw),
        };
        (rows, cols, codes)
    };
    let scales = floats(checkpoint, &scale_name)?;
    // (rows, cols) of the block each scale covers.
    let (br, bc) = match (w.strategy.as_str(), w.block) {
        ("tensor", _) => (rows, cols),
        ("channel", _) => (1, cols),
        ("group" | "tensor_group", _) => (1, w.group_size.unwrap_or(cols)),
        ("block", Some([r, c])) => (r, c),
        (s, _) => return Err(bad(format!("weights strategy `{s}` cannot be decoded"))),
    };
    if br == 0 || bc == 0 {
        return Err(bad(format!(
            "blocks of {br}×{bc} (the config's group_size / block_structure)"
        )));
    }
    let (gr, gc) = (rows.div_ceil(br), cols.div_ceil(bc));
    if scales.len() != gr * gc || scale_meta.shape.iter().product::<usize>() != gr * gc {
        return Err(bad(format!(
            "`{scale_name}` {:?} does not cover {rows}×{cols} in {br}×{bc} blocks",
            scale_meta.shape
        )));
    }
    let zero_points: Option<Vec<i8>> =
        match checkpoint.tensor(&format!("{module}.weight_zero_point")) {
            Some(_) if !w.symmetric => {
                let zname = format!("{module}.weight_zero_point");
                let zp = if name.ends_with("_packed") {
                    let words: Vec<i32> = checkpoint.read_as::<i32>(&zname)?;
                    quant::unpack_int32_columns(&words, gr, gc, w.num_bits).map_err(&bad)?
                } else {
                    let mut b = Vec::new();
                    checkpoint.read(&zname, &mut b)?;
                    b.into_iter().map(|x| x as i8).collect()
                };
                if zp.len() != gr * gc {
                    return Err(ModelError::Tensor {
                        tensor: zname,
                        message: format!("{} values for {gr}×{gc} blocks", zp.len()),
                    });
                }
                Some(zp)
            }
            None if !w.symmetric => {
                return Err(bad("asymmetric weights, but no weight_zero_point".into()));
            }
            _ => None,
        };
    Ok(Some(Compressed {
        rows,
        cols,
        codes,
        scales,
        zero_points,
        block: (br, bc),
    }))
}

/// The input quantizer of a Linear under `args` (`None`: 16-bit activations).
fn input_quant(
    checkpoint: &Checkpoint,
    module: &str,
    args: &Args,
) -> Result<InputQuant, ModelError> {
    let scalar = |local: &str| -> Result<f32, ModelError> {
        floats(checkpoint, &format!("{module}.{local}"))?
            .first()
            .copied()
            .ok_or_else(|| ModelError::Tensor {
                tensor: format!("{module}.{local}"),
                message: "empty".into(),
            })
    };
    Ok(
        match (
            args.float,
            args.num_bits,
            args.strategy.as_str(),
            args.dynamic,
        ) {
            (true, 8, "tensor", false) => InputQuant::Fp8(scalar("input_scale")?),
            (true, 8, "token", true) => InputQuant::Fp8PerToken,
            (true, 8, "group", true) => InputQuant::Fp8PerGroup(args.group_size.unwrap_or(128)),
            (false, 8, "tensor", false) => InputQuant::Int8(scalar("input_scale")?),
            (false, 8, "token", true) => InputQuant::Int8PerToken,
            (true, 4, "tensor_group", _) => InputQuant::Nvfp4(1.0 / scalar("input_global_scale")?),
            (f, b, s, d) => {
                return Err(ModelError::Tensor {
                    tensor: module.to_string(),
                    message: format!(
                        "input activations {} {b}-bit, strategy `{s}`, dynamic {d}: kiln cannot run them",
                        if f { "float" } else { "int" }
                    ),
                });
            }
        },
    )
}

/// Reads a compressed-tensors `checkpoint` for execution in `dtype` on `device`: quantized
/// weights decoded; with `activations`, the input and KV-cache quantizers.
pub(crate) fn load(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    activations: bool,
) -> Result<(Weights, ActQuant), ModelError> {
    load_with(checkpoint, dtype, device, activations, false)
}

/// [`load`] in f32 without activation quantizers, every compressed Linear (not an embedding)
/// kept as stored (QLoRA).
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
    let q = quantization_config(checkpoint)
        .ok_or_else(|| config_err("not compressed-tensors".into()))?;
    let mut act = ActQuant::default();
    let kv = q.get("kv_cache_scheme").filter(|k| !k.is_null());
    if let Some(kv) = kv {
        let args = Args::parse(kv, "kv_cache_scheme")?;
        if !args
            .as_ref()
            .is_some_and(|a| a.float && a.num_bits == 8 && !a.dynamic)
        {
            return Err(config_err(format!(
                "kv_cache_scheme {kv}: kiln runs static FP8 KV caches"
            )));
        }
    }
    let mut vars = BTreeMap::new();
    let mut packed_weights: BTreeMap<String, crate::model::packed::Packed> = BTreeMap::new();
    for t in checkpoint.tensors() {
        if activations && kv.is_some() {
            for (suffix, key) in [(".k_scale", 'k'), (".v_scale", 'v')] {
                if let Some(attention) = t.name.strip_suffix(suffix) {
                    let s = floats(checkpoint, &t.name)?[0];
                    let e = act.kv.entry(attention.to_string()).or_default();
                    if key == 'k' {
                        e.0 = Some(s);
                    } else {
                        e.1 = Some(s);
                    }
                }
            }
        }
        if t.name.ends_with(".k_scale") || t.name.ends_with(".v_scale") {
            continue;
        }
        let module = PARAM_SUFFIXES
            .iter()
            .find_map(|s| t.name.strip_suffix(s))
            .or_else(|| t.name.strip_suffix(".weight"));
        let packed = t.name.ends_with(".weight_packed");
        let quantized_plain =
            t.name.ends_with(".weight") && matches!(t.dtype, Dtype::F8_E4M3 | Dtype::I8);
        if PARAM_SUFFIXES.iter().any(|s| t.name.ends_with(s)) && !packed {
            continue;
        }
        let (data, shape) = match module {
            Some(m) if pack && (packed || quantized_plain) && !m.ends_with("embed_tokens") => {
                if let Some(c) = compressed(checkpoint, m)? {
                    packed_weights.insert(format!("{m}.weight"), std::sync::Arc::new(c));
                }
                continue;
            }
            Some(m) if packed || quantized_plain => {
                let Some((data, [rows, cols])) = decode(checkpoint, m)? else {
                    continue;
                };
                if activations && let (_, Some(a)) = scheme_for(q, m)? {
                    act.inputs.insert(
                        m.to_string(),
                        LinearInput {
                            pre_quant_scale: None,
                            quant: Some(input_quant(checkpoint, m, &a)?),
                        },
                    );
                }
                (data, vec![rows, cols])
            }
            _ => match t.dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => {
                    (floats(checkpoint, &t.name)?, t.shape.clone())
                }
                other => {
                    return Err(ModelError::Tensor {
                        tensor: t.name.clone(),
                        message: format!("dtype {other:?} cannot be run"),
                    });
                }
            },
        };
        let name = if packed {
            format!("{}.weight", t.name.trim_end_matches(".weight_packed"))
        } else {
            t.name.clone()
        };
        vars.insert(name, crate::model::to_var(data, &shape, dtype, device)?);
    }
    Ok((Weights::from_vars(vars).with_packed(packed_weights), act))
}
