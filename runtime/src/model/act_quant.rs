//! Fake quantization of activations when a quantized export runs (`kiln eval`, `kiln verify`):
//! each quantized Linear's input is quantized and dequantized as its format prescribes
//! (ModelOpt's `input_quantizer`), and so are the attention keys and values when the export
//! carries KV-cache scales — so the perplexity of an export is the perplexity an engine would see.
//!
//! | format (`quant_algo`) | Linear input |
//! |---|---|
//! | `FP8`, `W4A8_AWQ` | FP8 E4M3 with the static `input_scale` |
//! | `NVFP4`, `NVFP4_AWQ` | NVFP4: dynamic 16-blocks under the static global `input_scale` |
//! | `W8A8_SQ_PER_CHANNEL` | INT8 with the static `input_scale` |
//! | `FP8_PER_CHANNEL_PER_TOKEN` | FP8 E4M3 with a dynamic scale per token |
//! | compressed-tensors `FP8_BLOCK` | FP8 E4M3 with a dynamic scale per 128 values of a token |
//! | compressed-tensors `W8A8` | INT8 with a dynamic scale per token (`amax / 127`) |
//! | `MXFP8`, `MXFP4` | dynamic 32-blocks with E8M0 scales |
//! | weight-only formats | unquantized |
//!
//! A `pre_quant_scale` multiplies the input before it is quantized. KV-cache: `k_scale` /
//! `v_scale` quantize the keys (after RoPE) and values to FP8.

use super::ModelError;
use candle_core::{DType, Tensor};
use kiln_kernels::ops::{fp8, mx, nvfp4};
use std::collections::BTreeMap;

/// How one Linear's input is quantized.
#[derive(Debug, Clone, PartialEq)]
pub enum InputQuant {
    /// FP8 E4M3 with a static scale.
    Fp8(f32),
    /// FP8 E4M3 with a dynamic scale per token (row): `amax / 448`.
    Fp8PerToken,
    /// FP8 E4M3 with a dynamic scale per group of this many values of a token (vLLM's
    /// per-token-group quantization for FP8 block weights).
    Fp8PerGroup(usize),
    /// Symmetric INT8 with a dynamic scale per token: `amax / 127`.
    Int8PerToken,
    /// NVFP4 with the static global scale (`input_scale`).
    Nvfp4(f32),
    /// Symmetric INT8 with a static scale: `round(x / s)` clamped to [−128, 127].
    Int8(f32),
    /// MXFP8 (dynamic 32-blocks).
    Mxfp8,
    /// MXFP4 (dynamic 32-blocks).
    Mxfp4,
}

/// A Linear's input quantizer: an optional per-channel `pre_quant_scale`, then the format.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearInput {
    /// Multiplies the input's channels first (AWQ / SmoothQuant).
    pub pre_quant_scale: Option<Vec<f32>>,
    /// The quantization, if the format quantizes activations.
    pub quant: Option<InputQuant>,
}

/// The activation quantizers of a model: per Linear module path, and per attention module the
/// FP8 scales of its keys and values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ActQuant {
    /// Linear module → its input quantizer.
    pub inputs: BTreeMap<String, LinearInput>,
    /// Attention module → (`k_scale`, `v_scale`).
    pub kv: BTreeMap<String, (Option<f32>, Option<f32>)>,
}

fn kernel(e: kiln_kernels::KernelError) -> ModelError {
    ModelError::Tensor {
        tensor: "activation".into(),
        message: e.to_string(),
    }
}

/// FP8 E4M3 quantize-dequantize of `x` with `scale`, saturating at ±448·scale as ModelOpt's
/// fake quantization clamps (the export's conversion would turn values past 464 into NaN).
fn fp8_round_trip(x: &[f32], scale: f32) -> Result<Vec<f32>, ModelError> {
    let limit = 448.0 * scale;
    let x: Vec<f32> = x.iter().map(|&v| v.clamp(-limit, limit)).collect();
    let mut q = vec![0u8; x.len()];
    kiln_kernels::cpu::quantize_fp8_per_tensor(&x, scale, &mut q).map_err(kernel)?;
    let mut out = vec![0f32; x.len()];
    fp8::dequantize_fp8(&q, scale, &mut out).map_err(kernel)?;
    Ok(out)
}

impl InputQuant {
    /// Quantize-then-dequantize of rows of `cols` values.
    pub fn round_trip(&self, x: &[f32], cols: usize) -> Result<Vec<f32>, ModelError> {
        match *self {
            InputQuant::Fp8(s) => fp8_round_trip(x, s),
            InputQuant::Fp8PerToken => {
                let mut out = Vec::with_capacity(x.len());
                for row in x.chunks(cols) {
                    let amax = kiln_kernels::cpu::amax(row);
                    let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                    out.extend(fp8_round_trip(row, s)?);
                }
                Ok(out)
            }
            InputQuant::Fp8PerGroup(g) => {
                let mut out = Vec::with_capacity(x.len());
                for group in x.chunks(cols).flat_map(|row| row.chunks(g.max(1))) {
                    let amax = kiln_kernels::cpu::amax(group);
                    let s = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                    out.extend(fp8_round_trip(group, s)?);
                }
                Ok(out)
            }
            InputQuant::Int8PerToken => {
                let mut out = Vec::with_capacity(x.len());
                for row in x.chunks(cols) {
                    let amax = kiln_kernels::cpu::amax(row);
                    let s = if amax > 0.0 { amax / 127.0 } else { 1.0 };
                    out.extend(
                        row.iter()
                            .map(|&v| (v / s).round_ties_even().clamp(-128.0, 127.0) * s),
                    );
                }
                Ok(out)
            }
            InputQuant::Nvfp4(ws2) => {
                let rows = x.len() / cols.max(1);
                let mut packed = vec![0u8; x.len() / 2];
                let mut scales = vec![0u8; x.len() / 16];
                kiln_kernels::cpu::quantize_nvfp4(x, &[rows, cols], ws2, &mut packed, &mut scales)
                    .map_err(kernel)?;
                let mut out = vec![0f32; x.len()];
                nvfp4::dequantize_nvfp4(&packed, &scales, ws2, &mut out).map_err(kernel)?;
                Ok(out)
            }
            InputQuant::Int8(s) => Ok(x
                .iter()
                .map(|&v| (v / s).round_ties_even().clamp(-128.0, 127.0) * s)
                .collect()),
            InputQuant::Mxfp8 => {
                let mut q = vec![0u8; x.len()];
                let mut scales = vec![0u8; x.len() / 32];
                kiln_kernels::cpu::quantize_mxfp8(x, cols, &mut q, &mut scales).map_err(kernel)?;
                let mut out = vec![0f32; x.len()];
                mx::dequantize_mxfp8(&q, &scales, &mut out).map_err(kernel)?;
                Ok(out)
            }
            InputQuant::Mxfp4 => {
                let mut q = vec![0u8; x.len() / 2];
                let mut scales = vec![0u8; x.len() / 32];
                kiln_kernels::cpu::quantize_mxfp4(x, cols, &mut q, &mut scales).map_err(kernel)?;
                let mut out = vec![0f32; x.len()];
                mx::dequantize_mxfp4(&q, &scales, &mut out).map_err(kernel)?;
                Ok(out)
            }
        }
    }
}

/// `x` (any shape, last dimension the channels) through `f` on the host, in x's dtype.
fn on_host(
    x: &Tensor,
    f: impl FnOnce(Vec<f32>, usize) -> Result<Vec<f32>, ModelError>,
) -> Result<Tensor, ModelError> {
    let cols = x.dim(candle_core::D::Minus1)?;
    let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let y = f(v, cols)?;
    Ok(Tensor::from_vec(y, x.shape(), x.device())?.to_dtype(x.dtype())?)
}

impl LinearInput {
    /// The input as the quantized Linear sees it.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let x = match &self.pre_quant_scale {
            Some(p) => {
                x.broadcast_mul(&Tensor::from_slice(p, p.len(), x.device())?.to_dtype(x.dtype())?)?
            }
            None => x.clone(),
        };
        match &self.quant {
            Some(q) => on_host(&x, |v, cols| q.round_trip(&v, cols)),
            None => Ok(x),
        }
    }
}

impl ActQuant {
    /// Whether nothing is quantized.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty() && self.kv.is_empty()
    }

    /// The input of the Linear at `module` as it runs.
    pub fn input(&self, module: &str, x: &Tensor) -> Result<Tensor, ModelError> {
        match self.inputs.get(module) {
            Some(q) => q.apply(x),
            None => Ok(x.clone()),
        }
    }

    /// The keys and values of the attention at `attention` as the KV cache holds them.
    pub fn key_value(
        &self,
        attention: &str,
        k: Tensor,
        v: Tensor,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let Some(&(ks, vs)) = self.kv.get(attention) else {
            return Ok((k, v));
        };
        let fake = |x: Tensor, s: Option<f32>| match s {
            Some(s) => on_host(&x, |v, _| fp8_round_trip(&v, s)),
            None => Ok(x),
        };
        Ok((fake(k, ks)?, fake(v, vs)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_formats_round_to_their_grids() {
        // FP8 with scale 0.5: 1.3/0.5 = 2.6 → E4M3 2.5 → 1.25; past 448·0.5 saturates.
        let y = InputQuant::Fp8(0.5).round_trip(&[1.3, 1000.0], 2).unwrap();
        assert_eq!(y, [1.25, 224.0]);
        // INT8 with scale 0.5: 1.5 rounds to even; clamps at 127 and −128 steps.
        let y = InputQuant::Int8(0.5)
            .round_trip(&[0.75, 100.0, -100.0], 3)
            .unwrap();
        assert_eq!(y, [1.0, 63.5, -64.0]);
    }

    #[test]
    fn per_token_fp8_scales_each_row_by_its_own_amax() {
        let y = InputQuant::Fp8PerToken
            .round_trip(&[448.0, 1.0, 0.0, 0.0], 2)
            .unwrap();
        // Row 1: amax 448 → scale 1, exact. Row 2: all zero stays zero.
        assert_eq!(y, [448.0, 1.0, 0.0, 0.0]);
        // Groups of 2 within a row of 4: each group has its own scale.
        let y = InputQuant::Fp8PerGroup(2)
            .round_trip(&[448.0, 1.0, 224.0, 0.1], 4)
            .unwrap();
        // Second group: scale 0.5, and 0.1 / 0.5 = 0.2 rounds to E4M3 0.203125.
        assert_eq!(y, [448.0, 1.0, 224.0, 0.1015625]);
        // INT8 per token: amax 127 → scale 1; 2.5 rounds to even.
        let y = InputQuant::Int8PerToken
            .round_trip(&[127.0, 2.5, -127.0, 0.4], 2)
            .unwrap();
        assert_eq!(y, [127.0, 2.0, -127.0, 0.0]);
    }
}
