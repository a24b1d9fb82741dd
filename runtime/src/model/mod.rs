//! Model execution (feature `exec`): the decoder families kiln exports, run with candle
//! ([`DecoderModel`], built once at load as per-layer structs in `decoder.rs`), their weights
//! as candle variables ([`Weights`]), and what a forward pass shows a calibration
//! ([`Observer`], [`MaxCalibrator`]).

pub mod act_quant;
mod bf16_linear;
pub mod checkpoint;
mod config;
mod decoder;
pub mod dense_linear;
pub mod eval;
pub mod fused;
mod fused_bf16;
pub mod generate;
mod loaded;
pub mod lora;
mod observe;
pub mod packed;

pub use candle_core as candle;
pub use config::{DecoderConfig, MoeRouting, RopeScaling};
pub(crate) use decoder::linear;
pub use decoder::{
    AttnImplementation, DecoderModel, HeadPositions, KvCache, LayerCache, SCORE, new_score_head,
};
pub use loaded::Loaded;
pub use observe::{MaxCalibrator, NoObserver, Observer};

use crate::checkpoint::{Checkpoint, CheckpointError};
use candle_core::{DType, Device, Tensor, Var};
use half::{bf16, f16};
use safetensors::Dtype;
use std::collections::BTreeMap;

/// Why a model could not be built or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `config.json` lacks or contradicts what the forward pass needs.
    #[error("config.json: {0}")]
    Config(String),
    /// A file other than `config.json` (calibration data, an adapter, a tokenizer file) is
    /// missing, unreadable or malformed.
    #[error("{}: {message}", path.display())]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The checkpoint is not what its family and `config.json` imply (a tensor missing, or of
    /// another shape): the message names the folder and the tensor.
    #[error("{0}")]
    Architecture(String),
    /// The model cannot run as asked (bf16 mixed precision over a quantized weight, …): the
    /// message names what and why.
    #[error("{0}")]
    Unsupported(String),
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

impl ModelError {
    /// [`ModelError::File`] for `path`.
    pub fn file(path: &std::path::Path, message: impl std::fmt::Display) -> Self {
        ModelError::File {
            path: path.to_path_buf(),
            message: message.to_string(),
        }
    }
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
pub(crate) fn to_var(
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

/// The values of tensor `t` (BF16, F16 or F32) as f32, or a named error for any other dtype.
pub fn read_f32(
    checkpoint: &Checkpoint,
    t: &crate::checkpoint::TensorMeta,
) -> Result<Vec<f32>, ModelError> {
    Ok(match t.dtype {
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
                message: format!("dtype {other:?} cannot be run (expected BF16, F16 or F32)"),
            });
        }
    })
}

/// The weights by tensor name, as candle variables (so gradients can flow to them), or
/// frozen ([`Weights::freeze`]: the same storage, outside autograd, as under LoRA).
#[derive(Debug, Clone)]
pub struct Weights {
    vars: BTreeMap<String, Var>,
    frozen: Option<BTreeMap<String, Tensor>>,
    /// Linear weights kept in their format's packed layout (QLoRA), by tensor name
    /// (`<module>.weight`): never trained, shared by every copy.
    packed: BTreeMap<String, packed::Packed>,
}

impl Weights {
    /// Weights from candle variables by Hugging Face name (a format reader's decoded tensors).
    pub fn from_vars(vars: BTreeMap<String, Var>) -> Self {
        Weights {
            vars,
            frozen: None,
            packed: BTreeMap::new(),
        }
    }

    /// These weights with the packed Linear weights `packed` (by `<module>.weight`) beside
    /// them.
    pub fn with_packed(mut self, packed: BTreeMap<String, packed::Packed>) -> Self {
        self.packed = packed;
        self
    }

    /// The packed Linear weights, by tensor name.
    pub fn packed(&self) -> &BTreeMap<String, packed::Packed> {
        &self.packed
    }

    /// Weights from f32 values by Hugging Face name, each `(name, values, shape)` stored in
    /// `dtype` on `device` (what a plugin format's reader decodes).
    pub fn from_f32(
        tensors: impl IntoIterator<Item = (String, Vec<f32>, Vec<usize>)>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let mut vars = BTreeMap::new();
        for (name, data, shape) in tensors {
            let var = to_var(data, &shape, dtype, device).map_err(|e| ModelError::Tensor {
                tensor: name.clone(),
                message: e.to_string(),
            })?;
            vars.insert(name, var);
        }
        Ok(Weights::from_vars(vars))
    }

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
        use rayon::prelude::*;
        let wanted: Vec<_> = checkpoint.tensors().filter(|t| keep(&t.name)).collect();
        // In parallel: each read is a copy out of the page cache into fresh memory, bound by
        // one core's page faults and copies.
        let read = |t: &crate::checkpoint::TensorMeta| -> Result<Var, ModelError> {
            // A 16-bit tensor run in its own dtype is read as it lies, not widened and
            // narrowed back (half the bytes allocated, no conversions).
            Ok(match (t.dtype, dtype) {
                (Dtype::BF16, DType::BF16) => {
                    Var::from_vec(checkpoint.read_as::<bf16>(&t.name)?, &*t.shape, device)?
                }
                (Dtype::F16, DType::F16) => {
                    Var::from_vec(checkpoint.read_as::<f16>(&t.name)?, &*t.shape, device)?
                }
                _ => to_var(read_f32(checkpoint, t)?, &t.shape, dtype, device)?,
            })
        };
        let vars = wanted
            .par_iter()
            .map(|t| Ok((t.name.clone(), read(t)?)))
            .collect::<Result<BTreeMap<_, _>, ModelError>>()?;
        Ok(Weights::from_vars(vars))
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

    /// These weights with the head `name` (a new trainable variable, tracked even when the
    /// rest is frozen) in place of `lm_head.weight` (a reward model's `score`).
    pub fn with_head(&self, name: &str, var: Var) -> Self {
        let mut w = self.clone();
        w.vars.remove("lm_head.weight");
        w.packed.remove("lm_head.weight");
        if let Some(f) = &mut w.frozen {
            f.remove("lm_head.weight");
            f.insert(name.to_string(), var.as_tensor().clone());
        }
        w.vars.insert(name.to_string(), var);
        w
    }

    /// Puts the weight `name` back into autograd after [`Weights::freeze`] (a reward model's
    /// `score` head, trained beside LoRA adapters as PEFT's `modules_to_save`).
    pub fn thaw(&mut self, name: &str) {
        if let (Some(f), Some(v)) = (&mut self.frozen, self.vars.get(name)) {
            f.insert(name.to_string(), v.as_tensor().clone());
        }
    }

    /// Whether [`Weights::freeze`] took the weights out of autograd.
    pub fn is_frozen(&self) -> bool {
        self.frozen.is_some()
    }

    /// A copy of every weight in new storage (a frozen reference model for full fine-tuning,
    /// whose own weights then change under it).
    pub fn deep_copy(&self) -> Result<Self, ModelError> {
        let mut vars = BTreeMap::new();
        for (k, v) in &self.vars {
            vars.insert(k.clone(), Var::from_tensor(&v.as_tensor().copy()?)?);
        }
        Ok(Weights::from_vars(vars).with_packed(self.packed.clone()))
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

/// A tensor's values as f32: floats widened; FP8 and U8 as their raw byte values (scales
/// ModelOpt stores as codes).
pub(crate) fn f32s(checkpoint: &Checkpoint, name: &str) -> Result<Vec<f32>, ModelError> {
    let t = checkpoint.tensor(name).ok_or_else(|| ModelError::Tensor {
        tensor: name.to_string(),
        message: "missing (a quantized weight needs it)".into(),
    })?;
    Ok(match t.dtype {
        Dtype::F32 => checkpoint.read_as::<f32>(name)?,
        Dtype::BF16 => checkpoint
            .read_as::<bf16>(name)?
            .into_iter()
            .map(f32::from)
            .collect(),
        Dtype::F16 => checkpoint
            .read_as::<f16>(name)?
            .into_iter()
            .map(f32::from)
            .collect(),
        Dtype::F8_E4M3 | Dtype::U8 => {
            let mut b = Vec::new();
            checkpoint.read(name, &mut b)?;
            return Ok(b.into_iter().map(|x| x as f32).collect());
        }
        other => {
            return Err(ModelError::Tensor {
                tensor: name.to_string(),
                message: format!("a scale of dtype {other:?} is not readable"),
            });
        }
    })
}

/// A plain (unquantized) checkpoint's weights, after the family's own checks, as an export
/// makes them: every tensor config.json implies is there with its shape (a model of no
/// registered family goes on to the loader's checks).
pub fn load_plain(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
) -> Result<Weights, ModelError> {
    load_plain_where(checkpoint, dtype, device, |_| true)
}

/// [`load_plain`] of the tensors whose names `keep` accepts.
pub(crate) fn load_plain_where(
    checkpoint: &Checkpoint,
    dtype: DType,
    device: &Device,
    keep: impl Fn(&str) -> bool,
) -> Result<Weights, ModelError> {
    if let Err(e @ crate::families::ResolveError::ModuleTree { .. }) =
        crate::families::resolve(checkpoint)
    {
        return Err(ModelError::Architecture(e.to_string()));
    }
    Weights::load_where(checkpoint, dtype, device, keep)
}

/// What marks `checkpoint` as a quantized export (`quantization_config`, `quantization`,
/// `hf_quant_config.json`), if anything does.
pub fn quantization_marker(checkpoint: &Checkpoint) -> Option<&'static str> {
    let config = checkpoint.config().raw();
    ["quantization_config", "quantization"]
        .into_iter()
        .find(|k| config.contains_key(*k))
        .or_else(|| {
            checkpoint
                .dir()
                .join("hf_quant_config.json")
                .is_file()
                .then_some("hf_quant_config.json")
        })
}
