//! Loading bitsandbytes' 4-bit checkpoints (transformers' saved `load_in_4bit` models: PEFT
//! users' QLoRA bases; and kiln's `--output-format bnb`) for execution: each `Linear4bit`
//! weight (`weight` packed two codes a byte, `weight.absmax` — 8-bit with `nested_absmax`,
//! `nested_quant_map` and the quant state's `nested_offset` when double-quantized — and its
//! `quant_map`) decoded as bitsandbytes' `dequantize_4bit` does: `quant_map[q] · absmax` in
//! f32, rounded to the weight's dtype (the quant state's `dtype`). Or, for QLoRA, kept packed.

use crate::checkpoint::Checkpoint;
use crate::formats::check::VerifyReport;
use crate::model::{ModelError, Weights};
use candle_core::{DType, Device};
use half::{bf16, f16};
use serde_json::Value;
use std::collections::BTreeMap;

/// The tensors beside a 4-bit weight.
const STATE_SUFFIXES: [&str; 4] = [
    ".absmax",
    ".nested_absmax",
    ".quant_map",
    ".nested_quant_map",
];

/// A 4-bit weight: its codes, its blocks' absmax (decoded), the code table, and the dtype its
/// decoded values are rounded to.
#[derive(Debug)]
struct Bnb4 {
    rows: usize,
    cols: usize,
    packed: Vec<u8>,
    absmax: Vec<f32>,
    blocksize: usize,
    code: [f32; 16],
    dtype: &'static str,
}

impl Bnb4 {
    fn round(&self, v: f32) -> f32 {
        match self.dtype {
            "bfloat16" => bf16::from_f32(v).to_f32(),
            "float16" => f16::from_f32(v).to_f32(),
            _ => v,
        }
    }
}

impl kiln_kernels::ops::packed_matmul::PackedRows for Bnb4 {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        let base = start * self.cols;
        for (k, o) in out.iter_mut().enumerate() {
            let i = base + k;
            let b = self.packed[i / 2];
            let q = if i.is_multiple_of(2) { b >> 4 } else { b & 0xf };
            *o = self.round(self.code[q as usize] * self.absmax[i / self.blocksize]);
        }
        Ok(())
    }
    fn packed_bytes(&self) -> usize {
        self.packed.len() + self.absmax.len() * 4
    }
}

fn floats(checkpoint: &Checkpoint, name: &str) -> Result<Vec<f32>, ModelError> {
    crate::model::f32s(checkpoint, name)
}

fn bytes(checkpoint: &Checkpoint, name: &str) -> Result<Vec<u8>, ModelError> {
    let mut b = Vec::new();
    checkpoint.read(name, &mut b)?;
    Ok(b)
}

/// The 4-bit weight `weight` (its quant state at `state`), checked.
fn bnb4(checkpoint: &Checkpoint, weight: &str, state: &str) -> Result<Bnb4, ModelError> {
    let bad = |message: String| ModelError::Tensor {
        tensor: weight.to_string(),
        message,
    };
    let json: Value = serde_json::from_slice(&bytes(checkpoint, state)?)
        .map_err(|e| bad(format!("its quant state `{state}` is not JSON: {e}")))?;
    let shape: Vec<usize> = json
        .get("shape")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|v| v as usize)
                .collect()
        })
        .unwrap_or_default();
    let [rows, cols] = shape[..] else {
        return Err(bad(format!("quant state shape {shape:?}: not a Linear's")));
    };
    let blocksize = json.get("blocksize").and_then(Value::as_u64).unwrap_or(0) as usize;
    let dtype = match json.get("dtype").and_then(Value::as_str) {
        Some("bfloat16") => "bfloat16",
        Some("float16") => "float16",
        Some("float32") => "float32",
        other => return Err(bad(format!("quant state dtype {other:?}"))),
    };
    let n = rows * cols;
    if blocksize == 0 {
        return Err(bad("quant state blocksize 0".into()));
    }
    let blocks = n.div_ceil(blocksize);
    let packed = bytes(checkpoint, weight)?;
    if packed.len() != n.div_ceil(2) {
        return Err(bad(format!(
            "{} bytes for {rows}×{cols} 4-bit codes",
            packed.len()
        )));
    }
    let code: [f32; 16] = floats(checkpoint, &format!("{weight}.quant_map"))?
        .try_into()
        .map_err(|v: Vec<f32>| bad(format!("quant_map has {} values, not 16", v.len())))?;
    let absmax_name = format!("{weight}.absmax");
    let meta = checkpoint
        .tensor(&absmax_name)
        .ok_or_else(|| bad(format!("`{absmax_name}` is missing")))?;
    let absmax = if meta.dtype == safetensors::Dtype::U8 {
        // Double quantization: 8-bit codes around the offset.
        let nested_bs = json
            .get("nested_blocksize")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        let offset = json
            .get("nested_offset")
            .and_then(Value::as_f64)
            .ok_or_else(|| {
                bad("a double-quantized absmax, but the quant state has no nested_offset".into())
            })? as f32;
        let q = bytes(checkpoint, &absmax_name)?;
        let nested = floats(checkpoint, &format!("{weight}.nested_absmax"))?;
        let map: [f32; 256] = floats(checkpoint, &format!("{weight}.nested_quant_map"))?
            .try_into()
            .map_err(|v: Vec<f32>| {
                bad(format!("nested_quant_map has {} values, not 256", v.len()))
            })?;
        if nested_bs == 0 || q.len() != blocks || nested.len() != blocks.div_ceil(nested_bs) {
            return Err(bad(format!(
                "{} absmax codes and {} nested absmax for {blocks} blocks (nested blocks of {nested_bs})",
                q.len(),
                nested.len()
            )));
        }
        let mut out = vec![0f32; blocks];
        kiln_kernels::ops::bnb::dequantize_blockwise(&map, &q, &nested, nested_bs, &mut out)
            .map_err(|e| bad(e.to_string()))?;
        out.into_iter().map(|v| v + offset).collect()
    } else {
        let a = floats(checkpoint, &absmax_name)?;
        if a.len() != blocks {
            return Err(bad(format!("{} absmax for {blocks} blocks", a.len())));
        }
        a
    };
    Ok(Bnb4 {
        rows,
        cols,
        packed,
        absmax,
        blocksize,
        code,
        dtype,
    })
}

/// The quant state of 4-bit weight `weight`, if it is one.
fn state_of(checkpoint: &Checkpoint, weight: &str) -> Option<String> {
    ["nf4", "fp4"]
        .iter()
        .map(|t| format!("{weight}.quant_state.bitsandbytes__{t}"))
        .find(|s| checkpoint.tensor(s).is_some())
}

/// Reads `checkpoint` in `dtype` on `device`, 4-bit weights decoded — or, with `pack`, kept as
/// they are stored (QLoRA; f32).
pub(crate) fn load(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    pack: bool,
) -> Result<Weights, ModelError> {
    let q = checkpoint.config().raw().get("quantization_config");
    if q.and_then(|q| q.get("load_in_8bit"))
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(ModelError::file(
            checkpoint.dir(),
            "is an 8-bit bitsandbytes checkpoint (LLM.int8): kiln reads bitsandbytes' 4-bit \
             layout (load_in_4bit)",
        ));
    }
    let mut vars = BTreeMap::new();
    let mut packed: BTreeMap<String, crate::model::packed::Packed> = BTreeMap::new();
    for t in checkpoint.tensors() {
        if STATE_SUFFIXES.iter().any(|s| t.name.ends_with(s)) || t.name.contains(".quant_state.") {
            continue;
        }
        let (data, shape) = match state_of(checkpoint, &t.name) {
            Some(state) => {
                let w = bnb4(checkpoint, &t.name, &state)?;
                if pack && !t.name.ends_with("embed_tokens.weight") {
                    packed.insert(t.name.clone(), std::sync::Arc::new(w));
                    continue;
                }
                let mut out = vec![0f32; w.rows * w.cols];
                kiln_kernels::ops::packed_matmul::PackedRows::decode_rows(&w, 0, &mut out)
                    .map_err(|e| ModelError::Tensor {
                        tensor: t.name.clone(),
                        message: e.to_string(),
                    })?;
                (out, vec![w.rows, w.cols])
            }
            None => (floats(checkpoint, &t.name)?, t.shape.clone()),
        };
        vars.insert(
            t.name.clone(),
            crate::model::to_var(data, &shape, dtype, device)?,
        );
    }
    Ok(Weights::from_vars(vars).with_packed(packed))
}

/// The 4-bit modules of `checkpoint` (module names).
fn quantized_modules(checkpoint: &Checkpoint) -> std::collections::BTreeSet<String> {
    checkpoint
        .tensors()
        .filter_map(|t| {
            t.name
                .strip_suffix(".weight")
                .filter(|_| state_of(checkpoint, &t.name).is_some())
        })
        .map(str::to_string)
        .collect()
}

/// [`crate::formats::verify`] for a bitsandbytes checkpoint against the model it came from:
/// every reference tensor decodes to its shape, and each 4-bit weight's error.
pub(crate) fn verify(reference: &Checkpoint, q: &Checkpoint) -> Result<VerifyReport, ModelError> {
    let qc = q
        .config()
        .raw()
        .get("quantization_config")
        .cloned()
        .unwrap_or(Value::Null);
    let mut report = VerifyReport {
        quant_algo: format!(
            "bitsandbytes {} (double quantization: {})",
            qc.get("bnb_4bit_quant_type")
                .and_then(Value::as_str)
                .unwrap_or("?"),
            qc.get("bnb_4bit_use_double_quant")
                .and_then(Value::as_bool)
                .unwrap_or(false)
        ),
        agreement: "names, shapes and the quant states agree".into(),
        ..VerifyReport::default()
    };
    let decoded = load(q, DType::F32, &Device::Cpu, false);
    crate::formats::check::compare_decoded_weights(
        reference,
        decoded,
        &quantized_modules(q),
        &mut report,
    )?;
    Ok(report)
}
