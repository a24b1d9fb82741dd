//! Loading an MLX export (mlx-lm's layout: kiln's `--output-format mlx` or `mlx_lm.convert
//! -q`, docs/FORMATS.md §8) for execution: each quantized weight (`weight` as packed `uint32`
//! beside `scales` and, for affine, `biases`) decoded with MLX's arithmetic
//! (`kiln_kernels::ops::mlx`), stacked experts (`switch_mlp`) split back into the Hugging Face
//! per-expert names the decoder reads. mlx-lm quantizes only weights: the activations run
//! unquantized.

use crate::checkpoint::Checkpoint;
use crate::model::{ModelError, Weights};
use candle_core::{DType, Device};
use half::{bf16, f16};
use kiln_kernels::ops::mlx::{self as mq, FpMode};
use safetensors::Dtype;
use serde_json::Value;
use std::collections::BTreeMap;

/// How one module is quantized.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Affine { bits: usize, group: usize },
    Fp(FpMode),
}

impl Mode {
    fn bits(self) -> usize {
        match self {
            Mode::Affine { bits, .. } => bits,
            Mode::Fp(m) => m.bits(),
        }
    }

    fn parse(q: &Value, whose: &str) -> Result<Mode, ModelError> {
        let bad = |what: String| ModelError::Config(format!("quantization{whose}: {what}"));
        let n = |k: &str| q.get(k).and_then(Value::as_u64).map(|v| v as usize);
        match q.get("mode").and_then(Value::as_str).unwrap_or("affine") {
            "affine" => match (n("bits"), n("group_size")) {
                (Some(bits @ (2 | 3 | 4 | 5 | 6 | 8)), Some(group @ (32 | 64 | 128))) => {
                    Ok(Mode::Affine { bits, group })
                }
                (b, g) => Err(bad(format!(
                    "affine with bits {b:?} and group_size {g:?} (kiln decodes bits 2–8, groups of 32, 64, 128)"
                ))),
            },
            "mxfp4" => Ok(Mode::Fp(FpMode::Mxfp4)),
            "mxfp8" => Ok(Mode::Fp(FpMode::Mxfp8)),
            "nvfp4" => Ok(Mode::Fp(FpMode::Nvfp4)),
            other => Err(bad(format!("unknown mode `{other}`"))),
        }
    }
}

fn quantization(checkpoint: &Checkpoint) -> Option<&Value> {
    checkpoint
        .config()
        .raw()
        .get("quantization")
        .filter(|q| q.get("bits").is_some() && q.get("group_size").is_some())
}

/// Whether `checkpoint` is in mlx-lm's quantized layout (`config.json` `quantization` with
/// `bits` and `group_size`).
pub fn is_mlx(checkpoint: &Checkpoint) -> bool {
    quantization(checkpoint).is_some()
}

/// The modules whose weights are quantized (their `weight` packed beside `scales`).
pub(crate) fn quantized_modules(checkpoint: &Checkpoint) -> Vec<String> {
    checkpoint
        .tensors()
        .filter_map(|t| t.name.strip_suffix(".scales"))
        .filter(|m| checkpoint.tensor(&format!("{m}.weight")).is_some())
        .map(str::to_string)
        .collect()
}

/// [`quantized_modules`] under the Hugging Face names the decoder reads: a stacked
/// `…switch_mlp.<proj>` of `E` experts is `E` per-expert modules.
pub(crate) fn quantized_hf_modules(checkpoint: &Checkpoint) -> Vec<String> {
    let mut out = Vec::new();
    for m in quantized_modules(checkpoint) {
        let shape = checkpoint
            .tensor(&format!("{m}.weight"))
            .map(|t| t.shape.clone())
            .unwrap_or_default();
        match (m.contains(".switch_mlp."), shape.len()) {
            (true, 3) => out.extend((0..shape[0]).map(|e| unstacked(&m, e))),
            _ => out.push(m),
        }
    }
    out
}

/// The Hugging Face name of expert `e` of a stacked `…switch_mlp.<proj>` (Mixtral's
/// `block_sparse_moe` keeps `w1` / `w2` / `w3`).
fn unstacked(module: &str, e: usize) -> String {
    let (head, proj) = module.rsplit_once(".switch_mlp.").unwrap_or((module, ""));
    let proj = if head.ends_with("block_sparse_moe") {
        match proj {
            "gate_proj" => "w1",
            "down_proj" => "w2",
            "up_proj" => "w3",
            p => p,
        }
    } else {
        proj
    };
    format!("{head}.experts.{e}.{proj}")
}

/// The decoded values of quantized module `module` and their shape (`[rows, cols]`, or
/// `[experts, rows, cols]` for a stacked tensor).
fn decode(
    checkpoint: &Checkpoint,
    module: &str,
    mode: Mode,
) -> Result<(Vec<f32>, Vec<usize>), ModelError> {
    let weight = format!("{module}.weight");
    let bad = |message: String| ModelError::Tensor {
        tensor: weight.clone(),
        message,
    };
    let meta = checkpoint
        .tensor(&weight)
        .ok_or_else(|| bad("missing".into()))?;
    if meta.dtype != Dtype::U32 {
        return Err(bad(format!(
            "{:?}: a quantized MLX weight is packed into uint32",
            meta.dtype
        )));
    }
    let Some((&words, outer)) = meta.shape.split_last() else {
        return Err(bad("a 0-D weight".into()));
    };
    let cols = words * 32 / mode.bits();
    let n = outer.iter().product::<usize>() * cols;
    let mut shape = outer.to_vec();
    shape.push(cols);
    let mut raw = Vec::new();
    checkpoint.read(&weight, &mut raw)?;
    let kernel = |e: kiln_kernels::KernelError| bad(e.to_string());
    let scales = format!("{module}.scales");
    let mut out = vec![0f32; n];
    match mode {
        Mode::Affine { bits, group } => {
            let packed: Vec<u32> = bytemuck::pod_collect_to_vec(&raw);
            let biases = format!("{module}.biases");
            let dtype = checkpoint
                .tensor(&scales)
                .ok_or_else(|| bad(format!("`{scales}` is missing")))?
                .dtype;
            match dtype {
                Dtype::BF16 => mq::dequantize_affine(
                    &packed,
                    &checkpoint.read_as::<bf16>(&scales)?,
                    &checkpoint.read_as::<bf16>(&biases)?,
                    group,
                    bits,
                    &mut out,
                ),
                Dtype::F16 => mq::dequantize_affine(
                    &packed,
                    &checkpoint.read_as::<f16>(&scales)?,
                    &checkpoint.read_as::<f16>(&biases)?,
                    group,
                    bits,
                    &mut out,
                ),
                Dtype::F32 => mq::dequantize_affine(
                    &packed,
                    &checkpoint.read_as::<f32>(&scales)?,
                    &checkpoint.read_as::<f32>(&biases)?,
                    group,
                    bits,
                    &mut out,
                ),
                other => return Err(bad(format!("`{scales}` is {other:?}"))),
            }
            .map_err(kernel)?;
        }
        Mode::Fp(m) => {
            let mut s = Vec::new();
            checkpoint.read(&scales, &mut s)?;
            mq::dequantize_fp(m, &raw, &s, None, &mut out).map_err(kernel)?;
        }
    }
    Ok((out, shape))
}

/// A quantized MLX Linear kept packed (QLoRA): its codes with their scales (and biases),
/// decoded a range of rows at a time with the same arithmetic as [`decode`].
#[derive(Debug)]
struct MlxRows {
    mode: Mode,
    rows: usize,
    cols: usize,
    /// The codes: `uint32` words (affine), or the packed bytes (FP modes).
    words: Vec<u32>,
    bytes: Vec<u8>,
    /// Affine: scales and biases, widened to f32 (exactly); FP modes: the scale bytes.
    scales: Vec<f32>,
    biases: Vec<f32>,
    scale_bytes: Vec<u8>,
}

impl kiln_kernels::ops::packed_matmul::PackedRows for MlxRows {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        let n = out.len() / self.cols.max(1);
        let (lo, hi) = (start, start + n);
        match self.mode {
            Mode::Affine { bits, group } => {
                let (w, g) = (self.cols * bits / 32, self.cols / group);
                mq::dequantize_affine(
                    &self.words[lo * w..hi * w],
                    &self.scales[lo * g..hi * g],
                    &self.biases[lo * g..hi * g],
                    group,
                    bits,
                    out,
                )
            }
            Mode::Fp(m) => {
                let (b, g) = (self.cols * m.bits() / 8, self.cols / m.group());
                mq::dequantize_fp(
                    m,
                    &self.bytes[lo * b..hi * b],
                    &self.scale_bytes[lo * g..hi * g],
                    None,
                    out,
                )
            }
        }
    }
    fn packed_bytes(&self) -> usize {
        (self.words.len() + self.scales.len() + self.biases.len()) * 4
            + self.bytes.len()
            + self.scale_bytes.len()
    }
}

/// The packed form of quantized module `module` (a 2-D Linear weight).
fn packed(checkpoint: &Checkpoint, module: &str, mode: Mode) -> Result<MlxRows, ModelError> {
    let weight = format!("{module}.weight");
    let bad = |message: String| ModelError::Tensor {
        tensor: weight.clone(),
        message,
    };
    let meta = checkpoint
        .tensor(&weight)
        .ok_or_else(|| bad("missing".into()))?;
    let [rows, words] = meta.shape[..] else {
        return Err(bad(format!("shape {:?}: not a Linear's", meta.shape)));
    };
    if meta.dtype != Dtype::U32 {
        return Err(bad(format!(
            "{:?}: a quantized MLX weight is packed into uint32",
            meta.dtype
        )));
    }
    let cols = words * 32 / mode.bits();
    let mut raw = Vec::new();
    checkpoint.read(&weight, &mut raw)?;
    let scales = format!("{module}.scales");
    let mut p = MlxRows {
        mode,
        rows,
        cols,
        words: Vec::new(),
        bytes: Vec::new(),
        scales: Vec::new(),
        biases: Vec::new(),
        scale_bytes: Vec::new(),
    };
    match mode {
        Mode::Affine { .. } => {
            p.words = bytemuck::pod_collect_to_vec(&raw);
            p.scales = crate::model::f32s(checkpoint, &scales)?;
            p.biases = crate::model::f32s(checkpoint, &format!("{module}.biases"))?;
        }
        Mode::Fp(_) => {
            p.bytes = raw;
            checkpoint.read(&scales, &mut p.scale_bytes)?;
        }
    }
    // The shapes the decode slices by, checked once here.
    let group = match mode {
        Mode::Affine { group, .. } => group,
        Mode::Fp(m) => m.group(),
    };
    let groups = rows * (cols / group);
    let have = match mode {
        Mode::Affine { .. } => (p.scales.len(), p.biases.len()),
        Mode::Fp(_) => (p.scale_bytes.len(), groups),
    };
    if have != (groups, groups) {
        return Err(bad(format!(
            "{} scales and {} biases for {rows} rows of {cols} in groups of {group}",
            have.0, have.1
        )));
    }
    Ok(p)
}

/// The mode of quantized module `module`: its own entry in `quantization` (`to_quantized`'s
/// keyword arguments: without a `mode` it is affine, whatever the default mode, as MLX's
/// `nn.quantize` reads it), else the default.
fn mode_of(q: &Value, default: Mode, module: &str) -> Result<Mode, ModelError> {
    match q.get(module) {
        Some(o) if o.is_object() => Mode::parse(o, &format!(".{module}")),
        _ => Ok(default),
    }
}

/// One affine-quantized module as MLX's `quantized_matmul` and `dequantize` take it (the MLX
/// backend's QLoRA): the `uint32` words `[rows, cols·bits/32]`, with scales and biases
/// `[rows, cols/group]` widened to f32 (exactly).
#[derive(Debug)]
pub struct AffineParts {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Bits per code.
    pub bits: usize,
    /// Codes per scale.
    pub group: usize,
    /// The packed codes.
    pub words: Vec<u32>,
    /// One scale per group.
    pub scales: Vec<f32>,
    /// One bias per group.
    pub biases: Vec<f32>,
}

/// Every quantized module of mlx-lm `checkpoint` (its name without `.weight`) in the parts MLX
/// runs it from, shapes checked. A module in one of MLX's floating-point modes (mxfp4, mxfp8,
/// nvfp4) or a stacked expert tensor is a named error: the MLX backend runs the affine modes.
pub fn affine_modules(
    checkpoint: &Checkpoint,
) -> Result<BTreeMap<String, AffineParts>, ModelError> {
    let q = quantization(checkpoint).ok_or_else(|| ModelError::Config("no quantization".into()))?;
    let default = Mode::parse(q, "")?;
    let mut out = BTreeMap::new();
    for m in quantized_modules(checkpoint) {
        let refuse = |what: String| ModelError::Tensor {
            tensor: format!("{m}.weight"),
            message: format!(
                "{what}: training on the MLX backend runs mlx-lm's affine modes \
                 (quantized_matmul); --backend candle trains over this model"
            ),
        };
        if m.contains(".switch_mlp.") {
            return Err(refuse("stacked experts".into()));
        }
        match mode_of(q, default, &m)? {
            Mode::Fp(f) => return Err(refuse(format!("mode {}", f.name()))),
            mode @ Mode::Affine { bits, group } => {
                let p = packed(checkpoint, &m, mode)?;
                out.insert(
                    m,
                    AffineParts {
                        rows: p.rows,
                        cols: p.cols,
                        bits,
                        group,
                        words: p.words,
                        scales: p.scales,
                        biases: p.biases,
                    },
                );
            }
        }
    }
    Ok(out)
}

/// Reads an MLX `checkpoint` for execution in `dtype` on `device`, weights decoded and
/// experts unstacked.
pub(crate) fn load(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
) -> Result<Weights, ModelError> {
    load_with(checkpoint, dtype, device, false)
}

/// [`load`] with every quantized Linear (2-D, not an embedding) kept packed (QLoRA).
pub(crate) fn load_packed(checkpoint: &Checkpoint, device: &Device) -> Result<Weights, ModelError> {
    load_with(checkpoint, DType::F32, device, true)
}

fn load_with(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    pack: bool,
) -> Result<Weights, ModelError> {
    let q = quantization(checkpoint).ok_or_else(|| ModelError::Config("no quantization".into()))?;
    let default = Mode::parse(q, "")?;
    let quantized: std::collections::BTreeSet<String> =
        quantized_modules(checkpoint).into_iter().collect();
    let mut vars = BTreeMap::new();
    let mut packed_weights: BTreeMap<String, crate::model::packed::Packed> = BTreeMap::new();
    for t in checkpoint.tensors() {
        let module = t
            .name
            .strip_suffix(".weight")
            .filter(|m| quantized.contains(*m));
        let param_of_quantized = [".scales", ".biases"].iter().any(|s| {
            t.name
                .strip_suffix(s)
                .is_some_and(|m| quantized.contains(m))
        });
        if param_of_quantized {
            continue;
        }
        let (data, shape) = match module {
            Some(m) => {
                let mode = mode_of(q, default, m)?;
                // QLoRA: a Linear stays packed (embeddings are looked up, so decoded).
                if pack
                    && t.shape.len() == 2
                    && !m.ends_with("embed_tokens")
                    && !m.contains(".switch_mlp.")
                {
                    packed_weights.insert(
                        t.name.clone(),
                        std::sync::Arc::new(packed(checkpoint, m, mode)?),
                    );
                    continue;
                }
                decode(checkpoint, m, mode)?
            }
            None => (crate::model::f32s(checkpoint, &t.name)?, t.shape.clone()),
        };
        let (base, local) = t.name.rsplit_once('.').unwrap_or((&t.name, ""));
        if base.contains(".switch_mlp.") && shape.len() == 3 {
            let per = shape[1] * shape[2];
            for (e, chunk) in data.chunks_exact(per).enumerate() {
                let name = format!("{}.{local}", unstacked(base, e));
                vars.insert(
                    name,
                    crate::model::to_var(chunk.to_vec(), &shape[1..], dtype, device)?,
                );
            }
        } else if base.contains(".switch_mlp.") && shape.len() == 2 {
            // A stacked bias `[E, rows]`.
            for (e, chunk) in data.chunks_exact(shape[1]).enumerate() {
                let name = format!("{}.{local}", unstacked(base, e));
                vars.insert(
                    name,
                    crate::model::to_var(chunk.to_vec(), &shape[1..], dtype, device)?,
                );
            }
        } else {
            vars.insert(
                t.name.clone(),
                crate::model::to_var(data, &shape, dtype, device)?,
            );
        }
    }
    Ok(Weights::from_vars(vars).with_packed(packed_weights))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn experts_unstack_to_their_hugging_face_names() {
        assert_eq!(
            unstacked("model.layers.1.mlp.switch_mlp.up_proj", 3),
            "model.layers.1.mlp.experts.3.up_proj"
        );
        assert_eq!(
            unstacked("model.layers.0.block_sparse_moe.switch_mlp.gate_proj", 0),
            "model.layers.0.block_sparse_moe.experts.0.w1"
        );
    }
}
