//! Model execution (feature `exec`): one candle forward pass for the decoder families kiln
//! exports — Llama (with Llama 3 RoPE scaling), Mistral (sliding window), Qwen2 (q/k/v
//! biases), Qwen3 (q/k norms), Qwen3-MoE and Mixtral (top-k routing, normalised as each
//! family does) — built from the checkpoint's tensors and `config.json`.
//!
//! Every op is an ordinary candle op with a backward pass — RMSNorm written out, RoPE by
//! `rotate_half`, softmax as `exp / sum`, attention as two matmuls — so the trainers can run
//! the same forward under autograd (candle-nn 0.11's fused `rms_norm`, `softmax_last_dim`,
//! `rope*` and `sdpa` have no backward and would cut the graph). The logits of every position
//! are returned, as transformers does.

pub mod act_quant;
pub mod awq;
pub mod calib;
mod config;
pub mod eval;
pub mod for_export;
pub mod generate;
pub mod load;
pub mod lora;
pub mod verify;

pub use candle_core as candle;
pub use config::{DecoderConfig, MoeRouting, RopeScaling};

use crate::checkpoint::{Checkpoint, CheckpointError};
use candle_core::{D, DType, Device, Tensor, Var};
use half::{bf16, f16};
use safetensors::Dtype;
use std::collections::BTreeMap;

/// Why a model could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` lacks or contradicts what the forward pass needs.
    #[error("config.json: {0}")]
    Config(String),
    /// A tensor the forward pass needs is missing or malformed.
    #[error("tensor `{tensor}`: {message}")]
    Tensor {
        /// The tensor.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// Reading the checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A candle operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The requested device cannot be used.
    #[error("device {0}")]
    Device(String),
}

/// The candle device named `name`: `cpu`, `cuda` / `cuda:N`, or `metal` / `metal:N`. A GPU kiln
/// was built without (features `candle-cuda`, `candle-metal`) or that is not there is a named
/// error.
pub fn device(name: &str) -> Result<Device, ModelError> {
    let (kind, ordinal) = match name.split_once(':') {
        Some((k, n)) => (
            k,
            n.parse::<usize>().map_err(|_| {
                ModelError::Device(format!("`{name}`: `{n}` is not a device number"))
            })?,
        ),
        None => (name, 0),
    };
    let (built, feature) = match kind {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => (candle_core::utils::cuda_is_available(), "candle-cuda"),
        "metal" => (candle_core::utils::metal_is_available(), "candle-metal"),
        other => {
            return Err(ModelError::Device(format!(
                "`{name}`: unknown kind `{other}` (expected cpu, cuda[:N] or metal[:N])"
            )));
        }
    };
    if !built {
        return Err(ModelError::Device(format!(
            "`{name}`: kiln was built without feature `{feature}` (cargo build --release --features {feature}; it needs the {} toolkit)",
            if kind == "cuda" { "CUDA" } else { "Metal" }
        )));
    }
    let device = if kind == "cuda" {
        Device::new_cuda(ordinal)
    } else {
        Device::new_metal(ordinal)
    };
    device.map_err(|e| ModelError::Device(format!("`{name}`: {e}")))
}

/// A variable of `dtype` from f32 values, without an extra copy in f32.
fn to_var(
    data: Vec<f32>,
    shape: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Var, ModelError> {
    Ok(if dtype == DType::F32 {
        Var::from_vec(data, shape, device)?
    } else {
        Var::from_tensor(&Tensor::from_vec(data, shape, device)?.to_dtype(dtype)?)?
    })
}

/// The weights by tensor name, as candle variables (so gradients can flow to them), or
/// frozen ([`Weights::freeze`]: the same storage, outside autograd, as under LoRA).
#[derive(Debug, Clone)]
pub struct Weights {
    vars: BTreeMap<String, Var>,
    frozen: Option<BTreeMap<String, Tensor>>,
}

impl Weights {
    /// Reads every tensor of `checkpoint` (BF16, F16 or F32) into `dtype` on `device`.
    pub fn load(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::load_where(checkpoint, dtype, device, |_| true)
    }

    /// [`Weights::load`] of the tensors whose names `keep` accepts (one layer at a time).
    pub fn load_where(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Self, ModelError> {
        let mut vars = BTreeMap::new();
        for t in checkpoint.tensors().filter(|t| keep(&t.name)) {
            let data: Vec<f32> = match t.dtype {
                Dtype::BF16 => checkpoint
                    .read_as::<bf16>(&t.name)?
                    .into_iter()
                    .map(f32::from)
                    .collect(),
                Dtype::F16 => checkpoint
                    .read_as::<f16>(&t.name)?
                    .into_iter()
                    .map(f32::from)
                    .collect(),
                Dtype::F32 => checkpoint.read_as::<f32>(&t.name)?,
                other => {
                    return Err(ModelError::Tensor {
                        tensor: t.name.clone(),
                        message: format!(
                            "dtype {other:?} cannot be run (expected BF16, F16 or F32)"
                        ),
                    });
                }
            };
            vars.insert(t.name.clone(), to_var(data, &t.shape, dtype, device)?);
        }
        Ok(Weights { vars, frozen: None })
    }

    /// Puts `tensor` in place of the weight `name` (same shape), e.g. a merged LoRA weight.
    pub fn replace(&mut self, name: &str, tensor: Tensor) -> Result<(), ModelError> {
        let old = self.vars.get(name).ok_or_else(|| ModelError::Tensor {
            tensor: name.to_string(),
            message: "missing from the checkpoint".into(),
        })?;
        if old.as_tensor().dims() != tensor.dims() {
            return Err(ModelError::Tensor {
                tensor: name.to_string(),
                message: format!(
                    "replacement has shape {:?}, expected {:?}",
                    tensor.dims(),
                    old.as_tensor().dims()
                ),
            });
        }
        let var = Var::from_tensor(&tensor.to_dtype(old.dtype())?)?;
        if let Some(f) = &mut self.frozen {
            f.insert(name.to_string(), var.as_tensor().detach());
        }
        self.vars.insert(name.to_string(), var);
        Ok(())
    }

    /// Takes every weight out of autograd (LoRA training: only the adapters learn); the
    /// storage is shared, nothing is copied.
    pub fn freeze(&mut self) {
        self.frozen = Some(
            self.vars
                .iter()
                .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
                .collect(),
        );
    }

    /// A copy of every weight in new storage (a frozen reference model for full fine-tuning,
    /// whose own weights then change under it).
    pub fn deep_copy(&self) -> Result<Self, ModelError> {
        let mut vars = BTreeMap::new();
        for (k, v) in &self.vars {
            vars.insert(k.clone(), Var::from_tensor(&v.as_tensor().copy()?)?);
        }
        Ok(Weights { vars, frozen: None })
    }

    fn tensor(&self, name: &str) -> Option<&Tensor> {
        match &self.frozen {
            Some(f) => f.get(name),
            None => self.vars.get(name).map(|v| v.as_tensor()),
        }
    }

    /// The tensor `name`, or a named error.
    pub fn get(&self, name: &str) -> Result<&Tensor, ModelError> {
        self.tensor(name).ok_or_else(|| ModelError::Tensor {
            tensor: name.to_string(),
            message: "missing from the checkpoint".into(),
        })
    }

    /// The tensor `name`, if present.
    pub fn maybe(&self, name: &str) -> Option<&Tensor> {
        self.tensor(name)
    }

    /// Every variable, by name (for optimizers and gradient checks).
    pub fn vars(&self) -> &BTreeMap<String, Var> {
        &self.vars
    }
}

/// What a forward pass shows a calibration: the input of every Linear (by module path) and
/// the keys (after RoPE) and values of every attention module.
pub trait Observer {
    /// The input of the Linear at `module` (`[.., in_features]`).
    fn linear_input(&mut self, module: &str, x: &Tensor) -> Result<(), ModelError>;
    /// The keys and values `[batch, kv_heads, seq, head_dim]` of the attention at `attention`.
    fn key_value(&mut self, attention: &str, k: &Tensor, v: &Tensor) -> Result<(), ModelError>;
    /// The input of a quantizer that is not a Linear's `input_quantizer` (BMM experts:
    /// `<experts>.gate_up_proj_input_quantizer`, `<experts>.down_proj_input_quantizer`).
    fn quantizer_input(&mut self, quantizer: &str, x: &Tensor) -> Result<(), ModelError> {
        let _ = (quantizer, x);
        Ok(())
    }
    /// Whether every expert should also see every token (ModelOpt's optional
    /// `moe_calib_experts_ratio = 1`), besides the routed pass that gives the output.
    fn all_experts(&self) -> bool {
        false
    }
}

/// An observer that looks at nothing.
pub struct NoObserver;

/// One attention layer's cached keys and values `[batch, kv_heads, positions, head_dim]`.
#[derive(Debug, Clone, Default)]
pub struct LayerCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

/// The keys and values of every position run so far, per layer (generation).
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Keeps only the rows `rows` of the batch (sequences that are still generating).
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<(), ModelError> {
        for l in &mut self.layers {
            if let (Some(k), Some(v)) = (&l.k, &l.v) {
                l.k = Some(k.index_select(rows, 0)?);
                l.v = Some(v.index_select(rows, 0)?);
            }
        }
        Ok(())
    }

    /// Repeats every row `n` times (one prompt's cache for `n` samples).
    pub fn repeat_rows(&mut self, n: usize) -> Result<(), ModelError> {
        for l in &mut self.layers {
            if let (Some(k), Some(v)) = (&l.k, &l.v) {
                let idx: Vec<u32> = (0..k.dim(0)? as u32)
                    .flat_map(|r| std::iter::repeat_n(r, n))
                    .collect();
                let idx = Tensor::from_vec(idx, n * k.dim(0)?, k.device())?;
                l.k = Some(k.index_select(&idx, 0)?);
                l.v = Some(v.index_select(&idx, 0)?);
            }
        }
        Ok(())
    }
}

impl Observer for NoObserver {
    fn linear_input(&mut self, _module: &str, _x: &Tensor) -> Result<(), ModelError> {
        Ok(())
    }
    fn key_value(&mut self, _attention: &str, _k: &Tensor, _v: &Tensor) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Max calibration: per-tensor amax of every Linear input and of every attention's keys and
/// values, under ModelOpt's quantizer names (`<linear>.input_quantizer`,
/// `<attention>.k_bmm_quantizer`, `<attention>.v_bmm_quantizer`). A NaN input makes the amax
/// NaN.
#[derive(Debug, Clone)]
pub struct MaxCalibrator {
    amax: BTreeMap<String, f32>,
    all_experts: bool,
    /// Per-input-channel amax of every Linear input, when asked for (SmoothQuant).
    channels: Option<BTreeMap<String, Vec<f32>>>,
}

impl Default for MaxCalibrator {
    /// ModelOpt's default: each expert sees the tokens routed to it (its
    /// `moe_calib_experts_ratio` is unset), and the experts then share their maximum.
    fn default() -> Self {
        MaxCalibrator::new(false)
    }
}

fn tensor_amax(x: &Tensor) -> Result<f32, ModelError> {
    let v: Vec<f32> = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(v.iter().fold(0f32, |m, &a| {
        if m.is_nan() || a.is_nan() {
            f32::NAN
        } else {
            m.max(a.abs())
        }
    }))
}

impl MaxCalibrator {
    /// A calibrator; `all_experts`: every expert also sees every token (ModelOpt's
    /// `moe_calib_experts_ratio = 1`), else each expert sees only the tokens routed to it
    /// (ModelOpt's default).
    pub fn new(all_experts: bool) -> Self {
        MaxCalibrator {
            amax: BTreeMap::new(),
            all_experts,
            channels: None,
        }
    }

    /// Also records every Linear input's amax per input channel (SmoothQuant's statistics).
    pub fn with_channels(mut self) -> Self {
        self.channels = Some(BTreeMap::new());
        self
    }

    /// The per-channel input amax by Linear module path, when recorded.
    pub fn channels(&self) -> Option<&BTreeMap<String, Vec<f32>>> {
        self.channels.as_ref()
    }

    fn record(&mut self, key: String, a: f32) {
        let e = self.amax.entry(key).or_insert(0.0);
        *e = if e.is_nan() || a.is_nan() {
            f32::NAN
        } else {
            e.max(a)
        };
    }

    /// The amax seen so far, by quantizer name.
    pub fn amax(&self) -> &BTreeMap<String, f32> {
        &self.amax
    }

    /// Gives every expert of an MoE block the largest input amax among the experts, per
    /// Linear name (ModelOpt's `layer_sync_moe_local_experts_amax` after calibration),
    /// including experts no token reached. `linears` names every Linear module of the model
    /// (weight names without `.weight` are fine too: anything else is ignored).
    pub fn sync_experts<'a>(&mut self, linears: impl IntoIterator<Item = &'a str>) {
        // `<head>.experts.<i>.<rest>` → (head, rest).
        fn split(k: &str) -> Option<(String, String)> {
            let (head, tail) = k.split_once(".experts.")?;
            let (index, rest) = tail.split_once('.')?;
            index.parse::<usize>().ok()?;
            Some((head.to_string(), rest.to_string()))
        }
        fn nan_max(a: f32, b: f32) -> f32 {
            if a.is_nan() || b.is_nan() {
                f32::NAN
            } else {
                a.max(b)
            }
        }
        let mut max: BTreeMap<(String, String), f32> = BTreeMap::new();
        for (k, &v) in &self.amax {
            if let Some(g) = split(k).filter(|(_, r)| r.ends_with(".input_quantizer")) {
                let e = max.entry(g).or_insert(0.0);
                *e = nan_max(*e, v);
            }
        }
        let mut channel_max: BTreeMap<(String, String), Vec<f32>> = BTreeMap::new();
        for (k, v) in self.channels.iter().flatten() {
            if let Some(g) = split(k) {
                let e = channel_max.entry(g).or_insert_with(|| vec![0.0; v.len()]);
                for (a, &b) in e.iter_mut().zip(v) {
                    *a = nan_max(*a, b);
                }
            }
        }
        let mut modules: Vec<String> = self
            .amax
            .keys()
            .filter_map(|k| k.strip_suffix(".input_quantizer"))
            .map(str::to_string)
            .collect();
        modules.extend(
            linears
                .into_iter()
                .map(|m| m.strip_suffix(".weight").unwrap_or(m).to_string()),
        );
        for m in modules {
            let Some((head, rest)) = split(&m) else {
                continue;
            };
            if let Some(&v) = max.get(&(head.clone(), format!("{rest}.input_quantizer"))) {
                self.amax.insert(format!("{m}.input_quantizer"), v);
            }
            if let (Some(c), Some(v)) = (&mut self.channels, channel_max.get(&(head, rest))) {
                c.insert(m, v.clone());
            }
        }
    }
}

impl Observer for MaxCalibrator {
    fn linear_input(&mut self, module: &str, x: &Tensor) -> Result<(), ModelError> {
        if x.elem_count() == 0 {
            return Ok(());
        }
        self.record(format!("{module}.input_quantizer"), tensor_amax(x)?);
        if let Some(channels) = &mut self.channels {
            let k = x.dim(D::Minus1)?;
            let rows = x.elem_count() / k;
            let per: Vec<f32> = x
                .to_dtype(DType::F32)?
                .reshape((rows, k))?
                .abs()?
                .max(0)?
                .to_vec1()?;
            let e = channels
                .entry(module.to_string())
                .or_insert_with(|| vec![0.0; k]);
            for (a, b) in e.iter_mut().zip(per) {
                *a = a.max(b);
            }
        }
        Ok(())
    }
    fn quantizer_input(&mut self, quantizer: &str, x: &Tensor) -> Result<(), ModelError> {
        if x.elem_count() > 0 {
            self.record(quantizer.to_string(), tensor_amax(x)?);
        }
        Ok(())
    }
    fn key_value(&mut self, attention: &str, k: &Tensor, v: &Tensor) -> Result<(), ModelError> {
        self.record(format!("{attention}.k_bmm_quantizer"), tensor_amax(k)?);
        self.record(format!("{attention}.v_bmm_quantizer"), tensor_amax(v)?);
        Ok(())
    }
    fn all_experts(&self) -> bool {
        self.all_experts
    }
}

/// A decoder-only causal language model.
#[derive(Debug, Clone)]
pub struct DecoderModel {
    config: DecoderConfig,
    weights: Weights,
    device: Device,
    /// Fake quantization of activations (a quantized export); empty for a plain model.
    act: act_quant::ActQuant,
    /// LoRA adapters on Linear layers, by module path (training, or a PEFT adapter loaded).
    adapters: Option<std::sync::Arc<lora::Adapters>>,
}

/// `x · Wᵀ (+ b)` for `x` of any rank (the last dimension is the input).
fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor, ModelError> {
    let dims = x.dims().to_vec();
    let (inputs, outputs) = (dims[dims.len() - 1], w.dim(0)?);
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let y = x.reshape((rows, inputs))?.matmul(&w.t()?)?;
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    let last = out.len() - 1;
    out[last] = outputs;
    Ok(y.reshape(out)?)
}

/// transformers' RMSNorm over the last dimension: in f32, `w · x / sqrt(mean(x²) + eps)`.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, ModelError> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let var = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x32.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
    Ok(normed.broadcast_mul(w)?)
}

/// Softmax over the last dimension, from differentiable ops, in f32.
fn softmax(x: &Tensor) -> Result<Tensor, ModelError> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?
        .to_dtype(dtype)?)
}

/// `1 / (1 + e^−x)` from differentiable ops.
fn sigmoid(x: &Tensor) -> Result<Tensor, ModelError> {
    Ok((x.neg()?.exp()? + 1.0)?.recip()?)
}

/// `[-x₂, x₁]` of the two halves of the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor, ModelError> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

impl DecoderModel {
    /// Builds the model of the checkpoint at `checkpoint` in `dtype` on `device`; a
    /// quantized checkpoint runs as an engine would run it: weights decoded, activations (and
    /// KV-cache entries) fake-quantized as its format prescribes ([`act_quant`]).
    pub fn load(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::load_with(checkpoint, dtype, device, true)
    }

    /// [`DecoderModel::load`]; `activations: false` leaves a quantized checkpoint's
    /// activations unquantized (its weights still decoded, `pre_quant_scale` folded in).
    pub fn load_with(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
        activations: bool,
    ) -> Result<Self, ModelError> {
        let config = DecoderConfig::from_json(checkpoint.config().raw())?;
        let (weights, act) = load::load_for_execution(checkpoint, dtype, device, activations)?;
        Ok(DecoderModel {
            config,
            weights,
            device: device.clone(),
            act,
            adapters: None,
        })
    }

    /// The activation quantizers the model runs with (empty for a plain model).
    pub fn activation_quant(&self) -> &act_quant::ActQuant {
        &self.act
    }

    /// The model of `checkpoint` with only the weights `keep` accepts loaded (plain
    /// checkpoints): enough to run [`DecoderModel::embed`], one [`DecoderModel::layer`] or
    /// [`DecoderModel::head`] with bounded memory.
    pub fn load_part(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
        keep: impl Fn(&str) -> bool,
    ) -> Result<Self, ModelError> {
        Ok(DecoderModel {
            config: DecoderConfig::from_json(checkpoint.config().raw())?,
            weights: Weights::load_where(checkpoint, dtype, device, keep)?,
            device: device.clone(),
            act: act_quant::ActQuant::default(),
            adapters: None,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The device it runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Its weights (candle variables).
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Its weights, to freeze or update in place (training).
    pub fn weights_mut(&mut self) -> &mut Weights {
        &mut self.weights
    }

    /// The model with `adapters` on its Linear layers (`None`: the base model alone, as PEFT's
    /// `disable_adapter()`). The weights are shared, not copied.
    pub fn with_adapters(&self, adapters: Option<std::sync::Arc<lora::Adapters>>) -> Self {
        DecoderModel {
            adapters,
            ..self.clone()
        }
    }

    /// The LoRA adapters the model runs with, if any.
    pub fn adapters(&self) -> Option<&lora::Adapters> {
        self.adapters.as_deref()
    }

    /// The Linear at `module` on `x` — the one seam every Linear goes through: its weight
    /// (plain or decoded from a quantized export) and bias, the input's fake quantization
    /// when the export prescribes one (`quantized_input`), and a LoRA adapter when the model
    /// has one there.
    fn linear_at(
        &self,
        module: &str,
        x: &Tensor,
        quantized_input: bool,
    ) -> Result<Tensor, ModelError> {
        let w = &self.weights;
        let input = if quantized_input {
            self.act.input(module, x)?
        } else {
            x.clone()
        };
        let y = linear(
            &input,
            w.get(&format!("{module}.weight"))?,
            w.maybe(&format!("{module}.bias")),
        )?;
        match &self.adapters {
            Some(a) => match a.get(module) {
                Some(adapter) => Ok((y + adapter.delta(x, a.dropout_rng())?)?),
                None => Ok(y),
            },
            None => Ok(y),
        }
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (u32).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        self.forward_observed(ids, &mut NoObserver)
    }

    /// [`DecoderModel::forward`], showing `observer` every Linear's input and every
    /// attention's keys and values (calibration).
    pub fn forward_observed(
        &self,
        ids: &Tensor,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        self.forward_inner(ids, None, observer)
    }

    /// [`DecoderModel::forward`] of a right-padded batch: row `i` holds `lengths[i]` real
    /// tokens, and no position attends to the padding after them (transformers'
    /// `attention_mask`). The logits of real tokens equal an unpadded run's; those of padding
    /// positions are what transformers computes there.
    pub fn forward_padded(&self, ids: &Tensor, lengths: &[usize]) -> Result<Tensor, ModelError> {
        let t = ids.dim(1)?;
        let attention: Vec<Vec<bool>> = lengths
            .iter()
            .map(|&len| (0..t).map(|j| j < len).collect())
            .collect();
        self.forward_masked(ids, &attention)
    }

    /// [`DecoderModel::forward`] with transformers' `attention_mask`: `attention[i][j]` false
    /// hides token `j` of row `i` from every query (padding on either side; positions are
    /// `0..seq` whatever the padding, as transformers numbers them without `position_ids`).
    /// Hidden keys get the most negative finite score, as transformers masks, so a query
    /// that sees only padding stays finite.
    pub fn forward_masked(
        &self,
        ids: &Tensor,
        attention: &[Vec<bool>],
    ) -> Result<Tensor, ModelError> {
        let (b, t) = ids.dims2()?;
        if attention.len() != b || attention.iter().any(|r| r.len() != t) {
            return Err(ModelError::Config(format!(
                "an attention mask of {} rows for a batch of {b} × {t}",
                attention.len()
            )));
        }
        let m: Vec<f32> = attention
            .iter()
            .flat_map(|r| r.iter().map(|&keep| if keep { 0f32 } else { f32::MIN }))
            .collect();
        let mask = Tensor::from_vec(m, (b, 1, 1, t), &self.device)?.to_dtype(self.dtype())?;
        self.forward_inner(ids, Some(&mask), &mut NoObserver)
    }

    /// An empty key/value cache for [`DecoderModel::forward_cached`].
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: (0..self.config.layers)
                .map(|_| LayerCache::default())
                .collect(),
            len: 0,
        }
    }

    /// The logits `[batch, new, vocab]` of `ids` `[batch, new]` placed after the positions
    /// `cache` holds, whose keys and values it then also holds: generation one token at a
    /// time after one pass over the prompt. Equal to the matching rows of a full forward.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor, ModelError> {
        let mut h = self.embed(ids)?;
        let t = h.dim(1)?;
        let rope = self.rope_tables_from(cache.len, t, h.dtype())?;
        for (layer, lc) in cache.layers.iter_mut().enumerate() {
            h = self.layer_masked(&h, layer, &rope, None, Some(lc), &mut NoObserver)?;
        }
        cache.len += t;
        self.head(&h, &mut NoObserver)
    }

    fn dtype(&self) -> DType {
        self.weights
            .maybe("model.embed_tokens.weight")
            .map(|t| t.dtype())
            .unwrap_or(DType::F32)
    }

    fn forward_inner(
        &self,
        ids: &Tensor,
        key_mask: Option<&Tensor>,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let mut h = self.embed(ids)?;
        let rope = self.rope_tables(h.dim(1)?, h.dtype())?;
        for layer in 0..self.config.layers {
            h = self.layer_masked(&h, layer, &rope, key_mask, None, observer)?;
        }
        self.head(&h, observer)
    }

    /// The embeddings `[batch, seq, hidden]` of token ids `[batch, seq]`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        let (b, t) = ids.dims2()?;
        let table = self.weights.get("model.embed_tokens.weight")?;
        let vocab = table.dim(0)?;
        let biggest = ids.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
        if biggest >= vocab {
            return Err(ModelError::Config(format!(
                "token id {biggest} is outside the vocabulary ({vocab} tokens)"
            )));
        }
        Ok(table
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, self.config.hidden))?)
    }

    /// Decoder layer `layer` on hidden states `h` (needs only that layer's weights), with the
    /// RoPE tables of `h`'s length ([`DecoderModel::rope_tables`]).
    pub fn layer(
        &self,
        h: &Tensor,
        layer: usize,
        rope: &(Tensor, Tensor),
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        self.layer_masked(h, layer, rope, None, None, observer)
    }

    fn layer_masked(
        &self,
        h: &Tensor,
        layer: usize,
        (cos, sin): &(Tensor, Tensor),
        key_mask: Option<&Tensor>,
        cache: Option<&mut LayerCache>,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let (c, w) = (&self.config, &self.weights);
        let p = format!("model.layers.{layer}");
        let x = rms_norm(h, w.get(&format!("{p}.input_layernorm.weight"))?, c.eps)?;
        let h = (h + self.attention(&x, &p, layer, cos, sin, key_mask, cache, observer)?)?;
        let x = rms_norm(
            &h,
            w.get(&format!("{p}.post_attention_layernorm.weight"))?,
            c.eps,
        )?;
        Ok((h + self.mlp(&x, &p, observer)?)?)
    }

    /// Shows `observer` the input of `lm_head` (the final norm of `h`) without computing the
    /// logits (calibration).
    pub fn observe_head(&self, h: &Tensor, observer: &mut dyn Observer) -> Result<(), ModelError> {
        let (c, w) = (&self.config, &self.weights);
        if w.maybe("lm_head.weight").is_some() {
            let h = rms_norm(h, w.get("model.norm.weight")?, c.eps)?;
            observer.linear_input("lm_head", &h)?;
        }
        Ok(())
    }

    /// The final norm and the logits of hidden states `h`.
    pub fn head(&self, h: &Tensor, observer: &mut dyn Observer) -> Result<Tensor, ModelError> {
        let (c, w) = (&self.config, &self.weights);
        let h = rms_norm(h, w.get("model.norm.weight")?, c.eps)?;
        if w.maybe("lm_head.weight").is_some() {
            observer.linear_input("lm_head", &h)?;
        }
        match w.maybe("lm_head.weight") {
            Some(_) => self.linear_at("lm_head", &h, true),
            None if c.tie_word_embeddings => linear(
                &self.act.input("lm_head", &h)?,
                w.get("model.embed_tokens.weight")?,
                None,
            ),
            None => Err(ModelError::Tensor {
                tensor: "lm_head.weight".into(),
                message: "missing from the checkpoint (and config.json does not tie it to the embeddings)".into(),
            }),
        }
    }

    /// `cos`, `sin` `[seq, head_dim]` for positions `0..seq`.
    pub fn rope_tables(&self, t: usize, dtype: DType) -> Result<(Tensor, Tensor), ModelError> {
        self.rope_tables_from(0, t, dtype)
    }

    /// `cos`, `sin` `[t, head_dim]` for positions `start..start + t`.
    pub fn rope_tables_from(
        &self,
        start: usize,
        t: usize,
        dtype: DType,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let inv = self.config.inv_freq();
        let scale = self.config.rope_attention_factor();
        let hd = self.config.head_dim;
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        for pos in start..start + t {
            // transformers: freqs = pos · inv_freq in f32, emb = cat(freqs, freqs).
            for _ in 0..2 {
                for &f in &inv {
                    let a = pos as f32 * f;
                    // YaRN scales both by its attention factor (1 otherwise: exact).
                    cos.push(a.cos() * scale);
                    sin.push(a.sin() * scale);
                }
            }
        }
        let shape = (t, hd);
        Ok((
            Tensor::from_vec(cos, shape, &self.device)?.to_dtype(dtype)?,
            Tensor::from_vec(sin, shape, &self.device)?.to_dtype(dtype)?,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        x: &Tensor,
        p: &str,
        layer: usize,
        cos: &Tensor,
        sin: &Tensor,
        key_mask: Option<&Tensor>,
        cache: Option<&mut LayerCache>,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let w = &self.weights;
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (c.heads, c.kv_heads, c.head_dim);
        let a = format!("{p}.self_attn");
        let proj = |name: &str, heads: usize| -> Result<Tensor, ModelError> {
            let y = self
                .linear_at(&format!("{a}.{name}"), x, true)?
                .reshape((b, t, heads, hd))?;
            // Qwen3: RMSNorm over each head before RoPE.
            let norm = format!("{a}.{}_norm.weight", &name[..1]);
            let y = match w.maybe(&norm) {
                Some(nw) => rms_norm(&y, nw, c.eps)?,
                None => y,
            };
            Ok(y.transpose(1, 2)?.contiguous()?)
        };
        let rope = |x: Tensor| -> Result<Tensor, ModelError> {
            Ok((x.broadcast_mul(cos)? + rotate_half(&x)?.broadcast_mul(sin)?)?)
        };
        for name in ["q_proj", "k_proj", "v_proj"] {
            observer.linear_input(&format!("{a}.{name}"), x)?;
        }
        let q = rope(proj("q_proj", nh)?)?;
        let k = rope(proj("k_proj", nkv)?)?;
        let v = proj("v_proj", nkv)?;
        observer.key_value(&a, &k, &v)?;
        let (k, v) = self.act.key_value(&a, k, v)?;
        // With a cache, the new keys and values join those of the earlier positions.
        let (k, v) = match cache {
            Some(cache) => {
                let (k, v) = match (&cache.k, &cache.v) {
                    (Some(pk), Some(pv)) => {
                        (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?)
                    }
                    _ => (k, v),
                };
                cache.k = Some(k.clone());
                cache.v = Some(v.clone());
                (k, v)
            }
            None => (k, v),
        };
        let tk = k.dim(2)?;
        let repeat = |x: Tensor| -> Result<Tensor, ModelError> {
            if nh == nkv {
                return Ok(x);
            }
            Ok(x.unsqueeze(2)?
                .expand((b, nkv, nh / nkv, tk, hd))?
                .reshape((b, nh, tk, hd))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scores = (q.contiguous()?.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let mask = self.mask(t, tk, c.sliding_window_of(layer), scores.dtype())?;
        let scores = scores.broadcast_add(&mask)?;
        let scores = match key_mask {
            Some(k) => scores.broadcast_add(k)?,
            None => scores,
        };
        let probs = match w.maybe(&format!("{a}.sinks")) {
            // GPT-OSS: a learned logit per head joins every row's softmax, then is dropped.
            Some(sinks) => {
                let sink = sinks
                    .to_dtype(scores.dtype())?
                    .reshape((1, nh, 1, 1))?
                    .expand((b, nh, t, 1))?;
                softmax(&Tensor::cat(&[&scores, &sink], D::Minus1)?)?.narrow(D::Minus1, 0, tk)?
            }
            None => softmax(&scores)?,
        };
        let o = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?;
        observer.linear_input(&format!("{a}.o_proj"), &o)?;
        self.linear_at(&format!("{a}.o_proj"), &o, true)
    }

    /// The causal mask `[tq, tk]` of `tq` new queries after `tk − tq` cached positions (−∞
    /// where a key is later than the query and, with a sliding window, `window` or more
    /// positions back).
    fn mask(
        &self,
        tq: usize,
        tk: usize,
        window: Option<usize>,
        dtype: DType,
    ) -> Result<Tensor, ModelError> {
        let start = tk - tq;
        let m: Vec<f32> = (0..tq)
            .flat_map(|i| {
                let i = start + i;
                (0..tk).map(move |j| {
                    let hidden = j > i || window.is_some_and(|w| i - j >= w);
                    if hidden { f32::NEG_INFINITY } else { 0.0 }
                })
            })
            .collect();
        Ok(Tensor::from_vec(m, (tq, tk), &self.device)?.to_dtype(dtype)?)
    }

    fn dense_mlp(
        &self,
        x: &Tensor,
        p: &str,
        names: [&str; 3],
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let [gate, up, down] = names.map(|n| format!("{p}.{n}"));
        observer.linear_input(&gate, x)?;
        observer.linear_input(&up, x)?;
        let g = self.linear_at(&gate, x, true)?.silu()?;
        let u = self.linear_at(&up, x, true)?;
        let gu = (g * u)?;
        observer.linear_input(&down, &gu)?;
        self.linear_at(&down, &gu, true)
    }

    fn mlp(&self, x: &Tensor, p: &str, observer: &mut dyn Observer) -> Result<Tensor, ModelError> {
        let w = &self.weights;
        if w.maybe(&format!("{p}.mlp.experts.gate_up_proj")).is_some() {
            return self.bmm_experts(x, p, observer);
        }
        let (block, router, names) = if w
            .maybe(&format!("{p}.block_sparse_moe.gate.weight"))
            .is_some()
        {
            ("block_sparse_moe", "gate", ["w1", "w3", "w2"])
        } else if w.maybe(&format!("{p}.mlp.gate.weight")).is_some()
            && w.maybe(&format!("{p}.mlp.experts.0.up_proj.weight"))
                .is_some()
        {
            ("mlp", "gate", ["gate_proj", "up_proj", "down_proj"])
        } else {
            return self.dense_mlp(
                x,
                &format!("{p}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
                observer,
            );
        };
        let moe = self.config.moe.as_ref().ok_or_else(|| {
            ModelError::Config(format!(
                "`{p}.{block}` has experts but config.json names no experts per token"
            ))
        })?;
        let (b, t, hidden) = x.dims3()?;
        let x2 = x.reshape((b * t, hidden))?;
        observer.linear_input(&format!("{p}.{block}.{router}"), &x2)?;
        let logits = self.linear_at(&format!("{p}.{block}.{router}"), &x2, false)?;
        let probs = softmax(&logits)?;
        let (chosen, idx) = self.top_k(&probs, moe.top_k)?;
        let mut weights = probs.gather(&idx, 1)?;
        if moe.normalize_top_k {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?;
        if observer.all_experts() {
            // Calibration pass: every expert on every token, outputs unused.
            for e in 0..moe.experts {
                self.dense_mlp(&x2, &format!("{p}.{block}.experts.{e}"), names, observer)?;
            }
        }
        let out = self.dispatch(&x2, &chosen, moe, &weights, |e, xe| {
            self.dense_mlp(xe, &format!("{p}.{block}.experts.{e}"), names, observer)
        })?;
        Ok(out.reshape((b, t, hidden))?)
    }

    /// GPT-OSS's MoE block: a router with a bias whose top-k logits are softmaxed, and BMM
    /// experts (`gate_up_proj [E, H, 2I]` with gate and up interleaved, `down_proj [E, I, H]`,
    /// both with biases) with the clamped SwiGLU `(up + 1) · gate · σ(1.702 · gate)`.
    fn bmm_experts(
        &self,
        x: &Tensor,
        p: &str,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        const ALPHA: f64 = 1.702;
        const LIMIT: f64 = 7.0;
        let w = &self.weights;
        let moe = self.config.moe.as_ref().ok_or_else(|| {
            ModelError::Config(format!(
                "`{p}.mlp.experts` has experts but config.json names no experts per token"
            ))
        })?;
        let (b, t, hidden) = x.dims3()?;
        let x2 = x.reshape((b * t, hidden))?;
        let router = format!("{p}.mlp.router");
        observer.linear_input(&router, &x2)?;
        let logits = self.linear_at(&router, &x2, false)?;
        let (chosen, idx) = self.top_k(&logits, moe.top_k)?;
        let weights = softmax(&logits.gather(&idx, 1)?)?.to_dtype(x.dtype())?;
        let experts = format!("{p}.mlp.experts");
        let gate_up = w.get(&format!("{experts}.gate_up_proj"))?;
        let gate_up_bias = w.get(&format!("{experts}.gate_up_proj_bias"))?;
        let down = w.get(&format!("{experts}.down_proj"))?;
        let down_bias = w.get(&format!("{experts}.down_proj_bias"))?;
        let inter = gate_up.dim(2)? / 2;
        observer.quantizer_input(&format!("{experts}.gate_up_proj_input_quantizer"), &x2)?;
        let out = self.dispatch(&x2, &chosen, moe, &weights, |e, xe| {
            let gu = self
                .act
                .input(&format!("{experts}.gate_up_proj"), xe)?
                .matmul(&gate_up.get(e)?)?
                .broadcast_add(&gate_up_bias.get(e)?)?
                .reshape((xe.dim(0)?, inter, 2))?;
            let gate = gu.narrow(2, 0, 1)?.squeeze(2)?.minimum(LIMIT)?;
            let up = gu.narrow(2, 1, 1)?.squeeze(2)?.clamp(-LIMIT, LIMIT)?;
            let glu = (&gate * sigmoid(&(&gate * ALPHA)?)?)?;
            let h = ((up + 1.0)? * glu)?;
            observer.quantizer_input(&format!("{experts}.down_proj_input_quantizer"), &h)?;
            Ok(self
                .act
                .input(&format!("{experts}.down_proj"), &h)?
                .matmul(&down.get(e)?)?
                .broadcast_add(&down_bias.get(e)?)?)
        })?;
        Ok(out.reshape((b, t, hidden))?)
    }

    /// The top `k` entries of every row of `scores` `[tokens, experts]`, chosen on the host
    /// (indices carry no gradient): the flat indices and the `[tokens, k]` index tensor.
    /// Stable: ties keep the lower expert first, as torch.topk does on the CPU.
    fn top_k(&self, scores: &Tensor, k: usize) -> Result<(Vec<u32>, Tensor), ModelError> {
        let rows: Vec<Vec<f32>> = scores.to_dtype(DType::F32)?.to_vec2()?;
        let mut chosen = Vec::with_capacity(rows.len() * k);
        for row in &rows {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]));
            chosen.extend(order[..k].iter().map(|&e| e as u32));
        }
        let idx = Tensor::from_vec(chosen.clone(), (rows.len(), k), &self.device)?;
        Ok((chosen, idx))
    }

    /// Routes the tokens `x2` `[tokens, hidden]` to the experts `chosen` picked (`top_k` per
    /// token), runs `expert(e, tokens)` on each expert's tokens and sums the outputs weighted
    /// by `weights` `[tokens, top_k]`; experts with no tokens are not run.
    fn dispatch(
        &self,
        x2: &Tensor,
        chosen: &[u32],
        moe: &MoeRouting,
        weights: &Tensor,
        mut expert: impl FnMut(usize, &Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let mut out = x2.zeros_like()?;
        let weights = weights.flatten_all()?;
        for e in 0..moe.experts {
            let (mut tokens, mut slots) = (Vec::new(), Vec::new());
            for (tok, picks) in chosen.chunks(moe.top_k).enumerate() {
                if let Some(s) = picks.iter().position(|&c| c as usize == e) {
                    tokens.push(tok as u32);
                    slots.push((tok * moe.top_k + s) as u32);
                }
            }
            if tokens.is_empty() {
                continue;
            }
            let (n, m) = (tokens.len(), slots.len());
            let rows = Tensor::from_vec(tokens, n, &self.device)?;
            let slot = Tensor::from_vec(slots, m, &self.device)?;
            let ye = expert(e, &x2.index_select(&rows, 0)?)?;
            let we = weights.index_select(&slot, 0)?.unsqueeze(1)?;
            out = out.index_add(&rows, &ye.broadcast_mul(&we)?, 0)?;
        }
        Ok(out)
    }
}
