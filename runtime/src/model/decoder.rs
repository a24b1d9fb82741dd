//! The decoder, built once at load as per-layer structs: each [`Linear`] holds its module path,
//! weight and bias; each layer its norms, attention (with Qwen3's q/k norms, GPT-OSS's sinks,
//! its sliding window) and MLP (dense, routed experts, or GPT-OSS's BMM experts), decided when
//! the model is built and never probed again. A forward pass formats no tensor name and looks
//! nothing up by name but the optional per-module state a run carries (LoRA adapters,
//! activation quantizers).
//!
//! Every op is an ordinary candle op with a backward pass — RMSNorm written out, RoPE by
//! `rotate_half`, softmax as `exp / sum`, attention as two matmuls — so the trainers run the
//! same forward under autograd (candle-nn 0.11's fused `rms_norm`, `softmax_last_dim`, `rope*`
//! and `sdpa` have no backward and would cut the graph). The logits of every position are
//! returned, as transformers does.

use super::observe::{NoObserver, Observer};
use super::{DecoderConfig, ModelError, MoeRouting, Weights, act_quant, lora};
use crate::checkpoint::Checkpoint;
use candle_core::{D, DType, Device, Tensor, Var};
use std::sync::Arc;

/// One Linear layer, resolved at load: `y = x · Wᵀ (+ b)`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    /// Its module path (`model.layers.3.self_attn.q_proj`): the key of its adapter, its
    /// activation quantizer and what an observer is told.
    name: String,
    weight: LinearWeight,
    bias: Option<Tensor>,
}

/// What [`DecoderModel::forward_masked_logps`] scores: a batch under transformers'
/// `attention_mask` and, optionally, `position_ids`; the positions `at` whose
/// log-probabilities it gives; the factor on the logits before the softmax.
pub struct HeadPositions<'a> {
    /// `attention[i][j]` false hides token `j` of row `i`.
    pub attention: &'a [Vec<bool>],
    /// Each token's position (`None`: `0..len`).
    pub positions: Option<&'a [Vec<usize>]>,
    /// The scored positions.
    pub at: std::ops::Range<usize>,
    /// The factor on the logits (a sampling temperature's `1 / T`; else 1).
    pub scale: f32,
}

/// A Linear's weight: a tensor, or kept packed in its format's layout (QLoRA).
#[derive(Debug, Clone)]
enum LinearWeight {
    Dense(Tensor),
    Packed(super::packed::Packed),
}

/// One self-attention module.
#[derive(Debug, Clone)]
struct Attention {
    /// Its module path (`…self_attn`): the key of its KV-cache quantizer and observer.
    name: String,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3: RMSNorm weights over each head of q and k, before RoPE.
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// GPT-OSS: a learned logit per head that joins every row's softmax.
    sinks: Option<Tensor>,
    /// Mistral / GPT-OSS: keys this many positions back or more are hidden.
    window: Option<usize>,
}

/// SwiGLU: `down(silu(gate(x)) · up(x))`.
#[derive(Debug, Clone)]
struct DenseMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// GPT-OSS's experts: `gate_up_proj [E, H, 2I]` (gate and up interleaved), `down_proj
/// [E, I, H]`, both with biases, behind a router with a bias.
#[derive(Debug, Clone)]
struct BmmExperts {
    router: Linear,
    gate_up: Tensor,
    gate_up_bias: Tensor,
    down: Tensor,
    down_bias: Tensor,
    /// `<experts>.gate_up_proj` / `.down_proj`: their activation quantizers' modules.
    gate_up_name: String,
    down_name: String,
    /// `<experts>.gate_up_proj_input_quantizer` / `.down_proj_input_quantizer`.
    gate_up_quantizer: String,
    down_quantizer: String,
}

/// A layer's feed-forward block, as its checkpoint lays it out.
#[derive(Debug, Clone)]
enum Mlp {
    Dense(DenseMlp),
    /// Mixtral (`block_sparse_moe.gate`, experts `w1 w3 w2`) and Qwen3-MoE (`mlp.gate`,
    /// experts `gate_proj up_proj down_proj`): a router and one dense MLP per expert.
    Experts {
        router: Linear,
        experts: Vec<DenseMlp>,
    },
    Bmm(Box<BmmExperts>),
}

/// One decoder layer.
#[derive(Debug, Clone)]
struct Layer {
    input_norm: Tensor,
    attention: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

/// The final norm and the output projection.
#[derive(Debug, Clone)]
struct Head {
    norm: Tensor,
    lm_head: Linear,
    /// `lm_head` is the embedding table (`tie_word_embeddings`): not a module of its own, so
    /// no observer sees its input.
    tied: bool,
}

/// The resolved model. A model loaded in part ([`DecoderModel::load_part`]) holds only the
/// parts whose weights were loaded.
#[derive(Debug, Clone)]
struct Net {
    embed: Option<Tensor>,
    layers: Vec<Option<Layer>>,
    head: Option<Head>,
}

/// The weight of a sequence classifier's head (transformers' `*ForSequenceClassification`).
pub const SCORE: &str = "score.weight";

/// Resolves tensors of `weights` by name (once, at load).
struct Resolver<'a> {
    weights: &'a Weights,
}

impl Resolver<'_> {
    fn get(&self, name: &str) -> Result<Tensor, ModelError> {
        self.weights.get(name).cloned()
    }

    fn maybe(&self, name: &str) -> Option<Tensor> {
        self.weights.maybe(name).cloned()
    }

    fn has(&self, name: &str) -> bool {
        self.weights.maybe(name).is_some() || self.weights.packed().contains_key(name)
    }

    fn linear(&self, module: String) -> Result<Linear, ModelError> {
        let name = format!("{module}.weight");
        let weight = match self.weights.packed().get(&name) {
            Some(p) => LinearWeight::Packed(p.clone()),
            None => frozen_or_dense(self.weights, self.get(&name)?),
        };
        Ok(Linear {
            weight,
            bias: self.maybe(&format!("{module}.bias")),
            name: module,
        })
    }

    fn dense(&self, prefix: &str, [gate, up, down]: [&str; 3]) -> Result<DenseMlp, ModelError> {
        Ok(DenseMlp {
            gate: self.linear(format!("{prefix}.{gate}"))?,
            up: self.linear(format!("{prefix}.{up}"))?,
            down: self.linear(format!("{prefix}.{down}"))?,
        })
    }

    fn layer(&self, config: &DecoderConfig, index: usize) -> Result<Layer, ModelError> {
        let p = format!("model.layers.{index}");
        let a = format!("{p}.self_attn");
        let attention = Attention {
            q: self.linear(format!("{a}.q_proj"))?,
            k: self.linear(format!("{a}.k_proj"))?,
            v: self.linear(format!("{a}.v_proj"))?,
            o: self.linear(format!("{a}.o_proj"))?,
            q_norm: self.maybe(&format!("{a}.q_norm.weight")),
            k_norm: self.maybe(&format!("{a}.k_norm.weight")),
            sinks: self.maybe(&format!("{a}.sinks")),
            window: config.sliding_window_of(index),
            name: a,
        };
        let routing = |block: &str| {
            config.moe.as_ref().ok_or_else(|| {
                ModelError::Config(format!(
                    "`{p}.{block}` has experts but config.json names no experts per token"
                ))
            })
        };
        let experts = |block: &str, names: [&str; 3]| -> Result<Vec<DenseMlp>, ModelError> {
            (0..routing(block)?.experts)
                .map(|e| self.dense(&format!("{p}.{block}.experts.{e}"), names))
                .collect()
        };
        let mlp = if self.has(&format!("{p}.mlp.experts.gate_up_proj")) {
            routing("mlp.experts")?;
            let x = format!("{p}.mlp.experts");
            Mlp::Bmm(Box::new(BmmExperts {
                router: self.linear(format!("{p}.mlp.router"))?,
                gate_up: self.get(&format!("{x}.gate_up_proj"))?,
                gate_up_bias: self.get(&format!("{x}.gate_up_proj_bias"))?,
                down: self.get(&format!("{x}.down_proj"))?,
                down_bias: self.get(&format!("{x}.down_proj_bias"))?,
                gate_up_name: format!("{x}.gate_up_proj"),
                down_name: format!("{x}.down_proj"),
                gate_up_quantizer: format!("{x}.gate_up_proj_input_quantizer"),
                down_quantizer: format!("{x}.down_proj_input_quantizer"),
            }))
        } else if self.has(&format!("{p}.block_sparse_moe.gate.weight")) {
            Mlp::Experts {
                router: self.linear(format!("{p}.block_sparse_moe.gate"))?,
                experts: experts("block_sparse_moe", ["w1", "w3", "w2"])?,
            }
        } else if self.has(&format!("{p}.mlp.gate.weight"))
            && self.has(&format!("{p}.mlp.experts.0.up_proj.weight"))
        {
            Mlp::Experts {
                router: self.linear(format!("{p}.mlp.gate"))?,
                experts: experts("mlp", ["gate_proj", "up_proj", "down_proj"])?,
            }
        } else {
            Mlp::Dense(self.dense(&format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"])?)
        };
        Ok(Layer {
            input_norm: self.get(&format!("{p}.input_layernorm.weight"))?,
            attention,
            post_norm: self.get(&format!("{p}.post_attention_layernorm.weight"))?,
            mlp,
        })
    }

    /// The model's parts; `whole`: every part must be there, else only the parts whose
    /// weights were loaded are built (a layer is there when its input norm is).
    fn net(&self, config: &DecoderConfig, whole: bool) -> Result<Net, ModelError> {
        const EMBED: &str = "model.embed_tokens.weight";
        let embed = if whole {
            Some(self.get(EMBED)?)
        } else {
            self.maybe(EMBED)
        };
        let layers = (0..config.layers)
            .map(|i| {
                let there = whole || self.has(&format!("model.layers.{i}.input_layernorm.weight"));
                there.then(|| self.layer(config, i)).transpose()
            })
            .collect::<Result<_, _>>()?;
        let head = if whole || self.has("model.norm.weight") {
            let norm = self.get("model.norm.weight")?;
            let (lm_head, tied) = if self.has("lm_head.weight") {
                (self.linear("lm_head".into())?, false)
            } else if self.has(SCORE) {
                // A sequence classifier (transformers' `*ForSequenceClassification`, a
                // reward model): its `score` head in place of the vocabulary's.
                (self.linear("score".into())?, false)
            } else if config.tie_word_embeddings {
                let weight = self.get(EMBED)?;
                let name = "lm_head".into();
                (
                    Linear {
                        name,
                        weight: frozen_or_dense(self.weights, weight),
                        bias: None,
                    },
                    true,
                )
            } else {
                return Err(ModelError::Tensor {
                    tensor: "lm_head.weight".into(),
                    message: "missing from the checkpoint (and config.json does not tie it to the embeddings)".into(),
                });
            };
            Some(Head {
                norm,
                lm_head,
                tied,
            })
        } else {
            None
        };
        Ok(Net {
            embed,
            layers,
            head,
        })
    }
}

/// How attention runs in a bf16 or f16 model, named after transformers' `attn_implementation`
/// (an f32 model on the CPU runs the streamed kernel either way: the two agree to f32
/// rounding).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnImplementation {
    /// As transformers' `eager`: the scores and the probabilities rounded to the model's dtype
    /// (bf16 outside autograd on the CPU: streamed, no `[t, t]` tensor; otherwise candle's ops,
    /// which hold `[batch, heads, t, t]` tensors). Calibration's default: llm-compressor's GPTQ
    /// codes agree with kiln's most often this way.
    #[default]
    Eager,
    /// As PyTorch's `scaled_dot_product_attention` (transformers 5's default): on the CPU the
    /// streamed kernel with its f32 scores and sums (the queries, keys and values widened, the
    /// output rounded to the model's dtype once), no `[t, t]` tensor held. Evaluation's choice.
    Sdpa,
}

/// A decoder-only causal language model: Llama (with Llama 3 RoPE scaling), Mistral (sliding
/// window), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Qwen3-MoE and Mixtral (top-k routing,
/// normalised as each family does) and GPT-OSS (sinks, BMM experts), built from the
/// checkpoint's tensors and `config.json`.
#[derive(Debug, Clone)]
pub struct DecoderModel {
    config: DecoderConfig,
    weights: Weights,
    /// The layers, resolved from `weights` (sharing their storage).
    net: Arc<Net>,
    device: Device,
    /// Fake quantization of activations (a quantized export); empty for a plain model.
    act: act_quant::ActQuant,
    /// LoRA adapters on Linear layers, by module path (training, or a PEFT adapter loaded).
    adapters: Option<Arc<lora::Adapters>>,
    /// Gradient checkpointing: where the layers' parameter gradients go (`None`: every
    /// activation is kept for the backward pass).
    checkpoint: Option<Arc<super::checkpoint::GradSink>>,
    /// How a bf16 or f16 model's attention runs.
    attn: AttnImplementation,
    /// The Linears run as PyTorch's CPU autocast to bf16 runs them (TRL's `bf16=True`):
    /// [`super::dense_linear::linear_autocast`].
    autocast: bool,
}

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
    /// Whether any cached key or value carries an autograd graph (it never should).
    #[cfg(test)]
    pub(crate) fn holds_graph(&self) -> bool {
        self.layers
            .iter()
            .flat_map(|l| [&l.k, &l.v])
            .flatten()
            .any(Tensor::track_op)
    }

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

/// `x · Wᵀ (+ b)` for `x` of any rank (the last dimension is the input).
/// A Linear's plain weight as the decoder runs it: a frozen one (LoRA's base, on the CPU)
/// through the packed-Linear op, whose backward computes only the input's gradient (candle's
/// matmul would also compute, and keep until the step ends, one for the frozen weight); a
/// trained one through candle's matmul.
fn frozen_or_dense(weights: &Weights, w: Tensor) -> LinearWeight {
    // A weight thawed after freezing (a classifier's head under LoRA) stays in autograd.
    match (weights.is_frozen() && !w.is_variable())
        .then(|| super::packed::FrozenRows::of(&w))
        .flatten()
    {
        Some(rows) => LinearWeight::Packed(Arc::new(rows)),
        None => LinearWeight::Dense(w),
    }
}

pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor, ModelError> {
    if super::dense_linear::runs(x, w) {
        let y = super::dense_linear::linear(x, w)?;
        return Ok(match b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        });
    }
    let dims = x.dims().to_vec();
    let (inputs, outputs) = (dims[dims.len() - 1], w.dim(0)?);
    let rows: usize = dims[..dims.len() - 1].iter().product();
    let x = x.reshape((rows, inputs))?;
    let y = if super::bf16_linear::runs(&x, w) {
        super::bf16_linear::linear(&x, w)?
    } else {
        x.matmul(&w.t()?)?
    };
    let y = match b {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    let mut out = dims;
    let last = out.len() - 1;
    out[last] = outputs;
    Ok(y.reshape(out)?)
}

/// transformers' RMSNorm over the last dimension: in f32, `w · x / sqrt(mean(x²) + eps)` (fused
/// on the CPU in f32, [`super::fused::rms_norm`]).
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, ModelError> {
    if super::fused::fusable(x) && w.dtype() == DType::F32 {
        return Ok(super::fused::rms_norm(x, w, eps)?);
    }
    if super::fused_bf16::runs(&[x, w]) {
        return Ok(super::fused_bf16::rms_norm(x, w, eps)?);
    }
    rms_norm_unfused(x, w, eps)
}

/// [`rms_norm`] as candle ops (other devices and dtypes; the fused op's reference).
pub(crate) fn rms_norm_unfused(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor, ModelError> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?;
    let var = x32.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x32.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
    Ok(normed.broadcast_mul(w)?)
}

/// Softmax over the last dimension, from differentiable ops, in f32.
pub(crate) fn softmax(x: &Tensor) -> Result<Tensor, ModelError> {
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

/// The causal mask's values `[tq, tk]` for `tq` new queries after `tk − tq` cached positions
/// (−∞ where a key is later than the query and, with a sliding window, `window` or more
/// positions back; 0 elsewhere).
fn mask_values(tq: usize, tk: usize, window: Option<usize>) -> Vec<f32> {
    let start = tk - tq;
    (0..tq)
        .flat_map(|i| {
            let i = start + i;
            (0..tk).map(move |j| {
                let hidden = j > i || window.is_some_and(|w| i - j >= w);
                if hidden { f32::NEG_INFINITY } else { 0.0 }
            })
        })
        .collect()
}

/// RoPE as candle ops: `x · cos + rotate_half(x) · sin` (the fused op's reference).
pub(crate) fn rope_unfused(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor, ModelError> {
    Ok((x.broadcast_mul(cos)? + rotate_half(x)?.broadcast_mul(sin)?)?)
}

/// A new `score` head `[1, hidden]` for a model without one (every backend draws the same
/// values from `seed`): N(0, `initializer_range`²) as transformers initialises the head
/// `AutoModelForSequenceClassification` adds, and the note that says so by name.
pub fn new_score_head(config: &DecoderConfig, seed: u64) -> (Vec<f32>, String) {
    let (std, from) = match config.initializer_range {
        Some(r) => (r, "config.json's initializer_range"),
        None => (
            0.02,
            "transformers' default initializer_range 0.02; config.json has none",
        ),
    };
    let hidden = config.hidden;
    let mut rng = crate::rng::SplitMix64(seed ^ 0x0073_636f_7265);
    let values = (0..hidden)
        .map(|_| (std * normal(&mut rng)) as f32)
        .collect();
    let note = format!(
        "score.weight: the model has no sequence-classification head; a new one [1, {hidden}] is drawn from N(0, {std}²) ({from}), as AutoModelForSequenceClassification adds one"
    );
    (values, note)
}

/// A standard normal draw (Box–Muller over two uniforms).
fn normal(rng: &mut crate::rng::SplitMix64) -> f64 {
    let u1 = 1.0 - rng.uniform();
    let u2 = rng.uniform();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// `[-x₂, x₁]` of the two halves of the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor, ModelError> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

impl DecoderModel {
    /// Builds the model of the plain (unquantized) checkpoint `checkpoint` in `dtype` on
    /// `device`. A quantized export is read through its format's reader
    /// ([`crate::formats::load_model`]), which runs it as an engine would: weights decoded,
    /// activations (and KV-cache entries) fake-quantized as its format prescribes.
    pub fn load(
        checkpoint: &Checkpoint,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if let Some(key) = super::quantization_marker(checkpoint) {
            return Err(ModelError::file(
                checkpoint.dir(),
                format!(
                    "a quantized export (it has `{key}`): read it through its format's reader \
                     (kiln_runtime::formats::load_model, as `kiln eval` does)"
                ),
            ));
        }
        let config = DecoderConfig::from_json(checkpoint.config().raw())?;
        let weights = super::load_plain(checkpoint, dtype, device)?;
        Self::build(
            config,
            weights,
            device,
            act_quant::ActQuant::default(),
            true,
        )
    }

    /// The model a format's reader read back ([`crate::formats::FormatReader::load`]).
    pub fn from_loaded(loaded: super::Loaded, device: &Device) -> Result<Self, ModelError> {
        Self::build(loaded.config, loaded.weights, device, loaded.act, true)
    }

    /// LoRA's frozen base on the CPU: the plain checkpoint `checkpoint` with every Linear
    /// weight (`lm_head` included) kept in its stored dtype as a packed weight (bf16 and f16
    /// widened to f32 a tile at a time, exactly, by [`kiln_kernels::ops::packed_matmul::HalfRows`];
    /// f32 as it is) and the other tensors in f32, frozen: the values are those of an f32
    /// load, the memory of the Linears half of it for a bf16 checkpoint.
    pub fn load_frozen_base(checkpoint: &Checkpoint, device: &Device) -> Result<Self, ModelError> {
        use kiln_kernels::ops::packed_matmul::{DenseRows, HalfRows};
        use safetensors::Dtype;
        let shapes: Vec<(String, Vec<usize>)> = checkpoint
            .tensors()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        let linear: std::collections::BTreeSet<String> =
            lora::linear_modules_of(shapes.iter().map(|(n, s)| (n.as_str(), s.as_slice())))
                .into_iter()
                .map(|(m, _, _)| format!("{m}.weight"))
                // A classifier's head trains in full beside the adapters: a variable.
                .filter(|n| n != SCORE)
                .collect();
        let mut weights =
            super::load_plain_where(checkpoint, DType::F32, device, |n| !linear.contains(n))?;
        let mut packed: std::collections::BTreeMap<String, super::packed::Packed> =
            std::collections::BTreeMap::new();
        for name in &linear {
            let t = checkpoint.tensor(name).ok_or_else(|| ModelError::Tensor {
                tensor: name.clone(),
                message: "missing from the checkpoint".into(),
            })?;
            let [rows, cols] = t.shape[..] else {
                continue;
            };
            let kernel = |e: kiln_kernels::KernelError| ModelError::Tensor {
                tensor: name.clone(),
                message: e.to_string(),
            };
            let rows_of: super::packed::Packed = match t.dtype {
                Dtype::BF16 | Dtype::F16 => {
                    let mut raw = Vec::new();
                    checkpoint.read(name, &mut raw)?;
                    let bits: Vec<u16> = raw
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]))
                        .collect();
                    Arc::new(
                        HalfRows::new(bits, t.dtype == Dtype::BF16, rows, cols).map_err(kernel)?,
                    )
                }
                _ => Arc::new(
                    DenseRows::new(super::read_f32(checkpoint, t)?, rows, cols).map_err(kernel)?,
                ),
            };
            packed.insert(name.clone(), rows_of);
        }
        weights = weights.with_packed(packed);
        weights.freeze();
        Self::build(
            DecoderConfig::from_json(checkpoint.config().raw())?,
            weights,
            device,
            act_quant::ActQuant::default(),
            true,
        )
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
        Self::build(
            DecoderConfig::from_json(checkpoint.config().raw())?,
            Weights::load_where(checkpoint, dtype, device, keep)?,
            device,
            act_quant::ActQuant::default(),
            false,
        )
    }

    fn build(
        config: DecoderConfig,
        weights: Weights,
        device: &Device,
        act: act_quant::ActQuant,
        whole: bool,
    ) -> Result<Self, ModelError> {
        let net = Resolver { weights: &weights }.net(&config, whole)?;
        Ok(DecoderModel {
            config,
            weights,
            net: Arc::new(net),
            device: device.clone(),
            act,
            adapters: None,
            checkpoint: None,
            attn: AttnImplementation::default(),
            autocast: false,
        })
    }

    /// The same model running `weights` (same names and shapes: merged LoRA weights, a frozen
    /// copy), with its adapters and activation quantizers.
    pub fn with_weights(&self, weights: Weights) -> Result<Self, ModelError> {
        for (name, var) in self.weights.vars() {
            let shape = weights.get(name)?.dims();
            if shape != var.as_tensor().dims() {
                return Err(ModelError::Tensor {
                    tensor: name.clone(),
                    message: format!(
                        "replacement has shape {shape:?}, expected {:?}",
                        var.as_tensor().dims()
                    ),
                });
            }
        }
        let whole = self.net.embed.is_some()
            && self.net.head.is_some()
            && self.net.layers.iter().all(Option::is_some);
        let mut m = Self::build(
            self.config.clone(),
            weights,
            &self.device,
            self.act.clone(),
            whole,
        )?;
        m.adapters = self.adapters.clone();
        m.checkpoint = self.checkpoint.clone();
        m.autocast = self.autocast;
        Ok(m)
    }

    /// Whether the head is a sequence classifier's `score` (a reward model) rather than the
    /// vocabulary's `lm_head`.
    pub fn is_classifier(&self) -> bool {
        self.net
            .head
            .as_ref()
            .is_some_and(|h| h.lm_head.name == "score")
    }

    /// The model as transformers' `AutoModelForSequenceClassification(num_labels=1)` loads it
    /// (TRL's reward model): the decoder and final norm with a `score` head `[1, hidden]`, no
    /// bias, in place of `lm_head`. A model that has one keeps it; otherwise the head is new,
    /// drawn from N(0, `initializer_range`²) as transformers initialises it (`initializer_range`
    /// from config.json), and the second value says so by name.
    pub fn with_score_head(&self, seed: u64) -> Result<(Self, Option<String>), ModelError> {
        if self.is_classifier() {
            return Ok((self.clone(), None));
        }
        let hidden = self.config.hidden;
        let (values, note) = new_score_head(&self.config, seed);
        let var = Var::from_tensor(&Tensor::from_vec(values, (1, hidden), &self.device)?)?;
        let weights = self.weights.with_head(SCORE, var);
        let mut m = Self::build(
            self.config.clone(),
            weights,
            &self.device,
            self.act.clone(),
            true,
        )?;
        m.adapters = self.adapters.clone();
        m.checkpoint = self.checkpoint.clone();
        m.autocast = self.autocast;
        Ok((m, Some(note)))
    }

    /// Takes every weight out of autograd (LoRA training: only the adapters learn); the
    /// storage is shared, nothing is copied.
    pub fn freeze(&mut self) -> Result<(), ModelError> {
        let mut weights = self.weights.clone();
        weights.freeze();
        *self = self.with_weights(weights)?;
        Ok(())
    }

    /// The activation quantizers the model runs with (empty for a plain model).
    pub fn activation_quant(&self) -> &act_quant::ActQuant {
        &self.act
    }

    /// The model's configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The device it runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Its weights (candle variables) by tensor name.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The model with `adapters` on its Linear layers (`None`: the base model alone, as PEFT's
    /// `disable_adapter()`). The weights are shared, not copied.
    pub fn with_adapters(&self, adapters: Option<Arc<lora::Adapters>>) -> Self {
        DecoderModel {
            adapters,
            ..self.clone()
        }
    }

    /// The same model with its decoder layers' backward passes run by layer (`Some`: each
    /// decoder layer of a forward pass that builds a graph is an op of its own, its parameters'
    /// gradients left in `sink`; the layer run again in the backward pass from its input —
    /// gradient checkpointing — or its graph kept and freed by the backward pass, as the
    /// sink's [`super::checkpoint::LayerBackward`] says; `None`: one graph for the whole
    /// model). See [`super::checkpoint`].
    pub fn with_gradient_checkpointing(
        &self,
        sink: Option<Arc<super::checkpoint::GradSink>>,
    ) -> Self {
        DecoderModel {
            checkpoint: sink,
            ..self.clone()
        }
    }

    /// The same model with its Linears run as PyTorch's CPU autocast to bf16 runs them (TRL's
    /// `bf16=True`, mixed precision): each product's input and weight rounded to bf16, f32
    /// sums, the output and both gradients rounded to bf16
    /// ([`super::dense_linear::linear_autocast`]) — the decoder layers' and the output
    /// layer's (the head without logits in its bf16 form, [`super::fused::HeadWeight::DenseBf16`]:
    /// bf16 logits, their log-softmax in f32, as transformers' loss upcasts them). The parameters, the optimizer, attention, the norms, the
    /// activations between the products and the loss stay f32. Only where every such Linear
    /// can run so: an f32 model on the CPU, dense weights without bias, no adapter; anything
    /// else is an error naming what is not built.
    pub fn with_bf16_autocast(&self) -> Result<Self, ModelError> {
        let refuse = |what: String| -> Result<(), ModelError> {
            Err(ModelError::Unsupported(format!(
                "bf16 mixed precision (TRL's `bf16`): {what}; kiln's bf16 Linears are built for dense f32 weights without bias on the CPU (set `bf16` false to train in f32)"
            )))
        };
        if !self.device.is_cpu() {
            refuse(format!("the model is on {:?}", self.device))?;
        }
        if self.dtype() != DType::F32 {
            refuse(format!("the model runs in {:?}", self.dtype()))?;
        }
        if self.adapters.is_some() {
            refuse("the model has LoRA adapters".into())?;
        }
        let check = |l: &Linear| match (&l.weight, &l.bias) {
            (LinearWeight::Packed(_), _) => refuse(format!(
                "`{}` is a frozen or quantized weight (LoRA's base, QLoRA)",
                l.name
            )),
            (_, Some(_)) => refuse(format!("`{}` has a bias", l.name)),
            _ => Ok(()),
        };
        for layer in self.net.layers.iter().flatten() {
            let a = &layer.attention;
            for l in [&a.q, &a.k, &a.v, &a.o] {
                check(l)?;
            }
            match &layer.mlp {
                Mlp::Dense(d) => {
                    for l in [&d.gate, &d.up, &d.down] {
                        check(l)?;
                    }
                }
                _ => refuse(format!("the layer of `{}` has experts", a.name))?,
            }
        }
        Ok(DecoderModel {
            autocast: true,
            ..self.clone()
        })
    }

    /// Whether the Linears run in bf16 ([`DecoderModel::with_bf16_autocast`]).
    pub fn bf16_autocast(&self) -> bool {
        self.autocast
    }

    /// The same model with a bf16 or f16 model's attention run as `attn` says.
    pub fn with_attn_implementation(&self, attn: AttnImplementation) -> Self {
        DecoderModel {
            attn,
            ..self.clone()
        }
    }

    /// Where the layers' ops leave their parameters' gradients (gradient checkpointing, or
    /// layers whose graphs the backward pass frees).
    pub fn grad_sink(&self) -> Option<&Arc<super::checkpoint::GradSink>> {
        self.checkpoint.as_ref()
    }

    /// The LoRA adapters the model runs with, if any.
    pub fn adapters(&self) -> Option<&lora::Adapters> {
        self.adapters.as_deref()
    }

    /// The Linear `l` on `x` — the one seam every Linear goes through: its weight (plain or
    /// decoded from a quantized export) and bias, the input's fake quantization when the
    /// export prescribes one (`quantized_input`), and a LoRA adapter when the model has one
    /// there.
    fn linear(&self, l: &Linear, x: &Tensor, quantized_input: bool) -> Result<Tensor, ModelError> {
        let adapter = self
            .adapters
            .as_deref()
            .and_then(|a| Some((a, a.get(&l.name)?)));
        // LoRA over a packed or frozen weight, on the CPU in f32: one op for the Linear and its
        // adapter (`packed::lora_linear`), which keeps nothing the size of the output beside it.
        if let (LinearWeight::Packed(w), Some((a, adapter))) = (&l.weight, adapter)
            && self.act.is_empty()
            && super::fused::fusable(x)
            && super::fused::fusable(adapter.a.as_tensor())
            && super::fused::fusable(adapter.b.as_tensor())
        {
            let keep = a
                .dropout_rng()
                .filter(|_| adapter.dropout > 0.0)
                .map(|rng| {
                    let factor = (1.0 / (1.0 - adapter.dropout)) as f32;
                    (rng.keep(x.elem_count(), adapter.dropout), factor)
                });
            return super::packed::lora_linear(
                x,
                w,
                l.bias.as_ref(),
                (adapter.a.as_tensor(), adapter.b.as_tensor()),
                adapter.scale,
                keep,
            );
        }
        let input = if quantized_input {
            self.act.input(&l.name, x)?
        } else {
            x.clone()
        };
        let y = match &l.weight {
            LinearWeight::Dense(w) if self.autocast && l.bias.is_none() => {
                if !super::dense_linear::runs(&input, w) {
                    return Err(ModelError::Unsupported(format!(
                        "bf16 mixed precision: `{}` cannot run as a bf16 Linear (input {:?} {:?}, weight {:?} {:?})",
                        l.name,
                        input.dtype(),
                        input.dims(),
                        w.dtype(),
                        w.dims()
                    )));
                }
                super::dense_linear::linear_autocast(&input, w)?
            }
            LinearWeight::Dense(w) => linear(&input, w, l.bias.as_ref())?,
            LinearWeight::Packed(w) => {
                let y = super::packed::packed_linear(&input, w)?;
                match &l.bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                }
            }
        };
        match adapter {
            Some((a, adapter)) => Ok((y + adapter.delta(x, a.dropout_rng())?)?),
            None => Ok(y),
        }
    }

    /// Logits `[batch, seq, vocab]` for token ids `[batch, seq]` (u32).
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        self.forward_observed(ids, &mut NoObserver)
    }

    /// [`DecoderModel::forward`] for inference (evaluation): the same logits, but no graph is
    /// kept — each layer's output is detached, so a model whose weights or adapters are
    /// variables holds one layer's intermediates at a time instead of every layer's until the
    /// logits are dropped.
    pub fn forward_inference(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        self.forward_inference_from(ids, 0)
    }

    /// [`DecoderModel::forward_inference`]'s logits of the positions from `first` on only
    /// (`[batch, t − first, vocab]`): the output layer runs on those rows alone (evaluation
    /// scores the second half of each chunk).
    pub fn forward_inference_from(&self, ids: &Tensor, first: usize) -> Result<Tensor, ModelError> {
        let mut h = self.embed(ids)?.detach();
        let rope = self.rope_tables(h.dim(1)?, h.dtype())?;
        for layer in 0..self.config.layers {
            h = self
                .run_layer(
                    &h,
                    self.layer_at(layer)?,
                    &rope,
                    None,
                    None,
                    &mut NoObserver,
                )?
                .detach();
        }
        let t = h.dim(1)?;
        if first > t {
            return Err(ModelError::Config(format!(
                "the logits from position {first} of a sequence of {t}"
            )));
        }
        let h = if first == 0 {
            h
        } else {
            h.narrow(1, first, t - first)?
        };
        Ok(self.head(&h, &mut NoObserver)?.detach())
    }

    /// [`DecoderModel::forward`], showing `observer` every Linear's input and every
    /// attention's keys and values (calibration).
    pub fn forward_observed(
        &self,
        ids: &Tensor,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        self.forward_inner(ids, None, None, observer, false)
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
        let mask = self.key_mask(attention, b, t)?;
        self.forward_inner(ids, Some(&mask), None, &mut NoObserver, true)
    }

    /// transformers' additive key mask `[batch, 1, 1, t]` of `attention` (0 where a token is
    /// seen, the most negative finite value where it is hidden).
    fn key_mask(&self, attention: &[Vec<bool>], b: usize, t: usize) -> Result<Tensor, ModelError> {
        let m: Vec<f32> = attention
            .iter()
            .flat_map(|r| r.iter().map(|&keep| if keep { 0f32 } else { f32::MIN }))
            .collect();
        Ok(Tensor::from_vec(m, (b, 1, 1, t), &self.device)?.to_dtype(self.dtype())?)
    }

    /// The output layer as [`super::fused::head_logps`] takes it, where it can run there: on
    /// the CPU in f32, a plain `lm_head` (or the tied embeddings) without bias, adapter or
    /// activation quantizer, dense f32 or packed. `None` otherwise.
    ///
    /// Under bf16 autocast a dense head runs as [`super::fused::HeadWeight::DenseBf16`] where
    /// `autocast_ok` (the log-probabilities' head; GKD's JSD head is f32-only and takes the
    /// logits, through the autocast Linear, instead).
    fn fused_head(&self, autocast_ok: bool) -> Option<(&Tensor, super::fused::HeadWeight<'_>)> {
        let head = self.net.head.as_ref()?;
        let l = &head.lm_head;
        let adapted = self
            .adapters
            .as_deref()
            .is_some_and(|a| a.get(&l.name).is_some());
        if l.name != "lm_head"
            || (self.autocast && !autocast_ok)
            || l.bias.is_some()
            || adapted
            || !self.act.is_empty()
            || !self.device.is_cpu()
            || self.dtype() != DType::F32
        {
            return None;
        }
        let weight = match &l.weight {
            LinearWeight::Dense(w) => {
                super::packed::FrozenRows::of(w)?;
                match self.autocast {
                    true => super::fused::HeadWeight::DenseBf16(w),
                    false => super::fused::HeadWeight::Dense(w),
                }
            }
            // with_bf16_autocast admits no packed weight.
            LinearWeight::Packed(p) => super::fused::HeadWeight::Packed(p),
        };
        Some((&head.norm, weight))
    }

    /// The log-probabilities `[batch, seq]` of `labels` (`[batch · seq]`, row-major; any id
    /// where a position has none) under a right-padded batch (as
    /// [`DecoderModel::forward_padded`]), with each position's [`super::fused::HeadStats`],
    /// without the logits: the output layer and the log-softmax run a chunk of rows at a time
    /// ([`super::fused::head_logps`]). `None` where the head cannot run so
    /// ([`DecoderModel::fused_head`]): the caller takes the logits.
    pub fn forward_padded_logps(
        &self,
        ids: &Tensor,
        lengths: &[usize],
        labels: Vec<u32>,
    ) -> Result<Option<(Tensor, super::fused::HeadStats)>, ModelError> {
        let (b, t) = ids.dims2()?;
        if lengths.len() != b {
            return Err(ModelError::Config(format!(
                "{} lengths for a batch of {b} × {t}",
                lengths.len()
            )));
        }
        let attention: Vec<Vec<bool>> = lengths
            .iter()
            .map(|&len| (0..t).map(|j| j < len).collect())
            .collect();
        let scored = HeadPositions {
            attention: &attention,
            positions: None,
            at: 0..t,
            scale: 1.0,
        };
        self.forward_masked_logps(ids, &scored, labels)
    }

    /// [`DecoderModel::forward_padded_logps`] as [`HeadPositions`] says: under transformers'
    /// `attention_mask` (and `position_ids`, as [`DecoderModel::forward_positioned`]), the
    /// head run at the scored positions alone (`labels` `[batch · at.len()]`), the logits
    /// scaled before the softmax.
    pub fn forward_masked_logps(
        &self,
        ids: &Tensor,
        scored: &HeadPositions<'_>,
        labels: Vec<u32>,
    ) -> Result<Option<(Tensor, super::fused::HeadStats)>, ModelError> {
        let Some((h, weight)) = self.head_input(ids, scored, true)? else {
            return Ok(None);
        };
        Ok(Some(super::fused::head_logps(
            &h,
            weight,
            labels,
            scored.scale,
        )?))
    }

    /// GKD's generalized JSD per scored position (`[batch, at.len()]`, before its mask and
    /// mean; [`super::fused::head_jsd`]) between this model's distributions and the teacher's
    /// ([`DecoderModel::head_rows`] at the same positions), without either's logits. `None`
    /// where the head cannot run so ([`DecoderModel::fused_head`]), or for a teacher of another
    /// vocabulary: the caller takes the logits.
    pub fn forward_masked_jsd(
        &self,
        ids: &Tensor,
        scored: &HeadPositions<'_>,
        teacher: super::fused::HeadRows,
        beta: f64,
    ) -> Result<Option<Tensor>, ModelError> {
        let Some((h, weight)) = self.head_input(ids, scored, false)? else {
            return Ok(None);
        };
        let vocab = match &weight {
            super::fused::HeadWeight::Dense(w) | super::fused::HeadWeight::DenseBf16(w) => {
                w.dim(0)?
            }
            super::fused::HeadWeight::Packed(p) => p.rows(),
        };
        if teacher.vocab() != vocab {
            return Ok(None);
        }
        Ok(Some(super::fused::head_jsd(&h, weight, teacher, beta)?))
    }

    /// The rows entering the output layer at the scored positions (after the final norm; no
    /// graph: a frozen model's, a teacher's) and the layer's weight, for
    /// [`DecoderModel::forward_masked_jsd`]. `None` where the head cannot run so.
    pub fn head_rows(
        &self,
        ids: &Tensor,
        scored: &HeadPositions<'_>,
    ) -> Result<Option<super::fused::HeadRows>, ModelError> {
        let Some((h, weight)) = self.head_input(ids, scored, false)? else {
            return Ok(None);
        };
        let w: super::packed::Packed = match weight {
            super::fused::HeadWeight::Dense(w) | super::fused::HeadWeight::DenseBf16(w) => {
                match super::packed::FrozenRows::of(&w.detach()) {
                    Some(rows) => Arc::new(rows),
                    None => return Ok(None),
                }
            }
            super::fused::HeadWeight::Packed(p) => p.clone(),
        };
        let h: Vec<f32> = h.detach().flatten_all()?.to_vec1()?;
        Ok(Some(super::fused::HeadRows { h, w }))
    }

    /// The output layer's input at the scored positions (the last layer's states there after
    /// the final norm, `[batch, at.len(), hidden]`) and its weight, where the fused head can
    /// run ([`DecoderModel::fused_head`]).
    fn head_input(
        &self,
        ids: &Tensor,
        scored: &HeadPositions<'_>,
        autocast_ok: bool,
    ) -> Result<Option<(Tensor, super::fused::HeadWeight<'_>)>, ModelError> {
        let Some((norm, weight)) = self.fused_head(autocast_ok) else {
            return Ok(None);
        };
        let (b, t) = ids.dims2()?;
        let HeadPositions {
            attention,
            positions,
            at,
            ..
        } = scored;
        let fits = |lens: Vec<usize>| lens.len() == b && lens.iter().all(|&l| l == t);
        if !fits(attention.iter().map(Vec::len).collect())
            || positions.is_some_and(|p| !fits(p.iter().map(Vec::len).collect()))
            || at.end > t
        {
            return Err(ModelError::Config(format!(
                "an attention mask of {} rows, positions {at:?} for a batch of {b} × {t}",
                attention.len()
            )));
        }
        let mask = self.key_mask(attention, b, t)?;
        let rope = match positions {
            Some(p) => Some(self.rope_tables_at(p, self.dtype())?),
            None => None,
        };
        let h = self.hidden_inner(ids, Some(&mask), rope, &mut NoObserver, true)?;
        let h = h.narrow(1, at.start, at.len())?;
        Ok(Some((rms_norm(&h, norm, self.config.eps)?, weight)))
    }

    /// [`DecoderModel::forward_masked`] with each token's position given (`positions[i][j]`
    /// of token `j` of row `i`, transformers' `position_ids`): how TRL's PPO numbers a
    /// left-padded batch (padding keeps the position of the token before it).
    pub fn forward_positioned(
        &self,
        ids: &Tensor,
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<Tensor, ModelError> {
        let (b, t) = ids.dims2()?;
        if attention.len() != b
            || attention.iter().any(|r| r.len() != t)
            || positions.len() != b
            || positions.iter().any(|r| r.len() != t)
        {
            return Err(ModelError::Config(format!(
                "an attention mask of {} rows and positions of {} rows for a batch of {b} × {t}",
                attention.len(),
                positions.len()
            )));
        }
        let mask = self.key_mask(attention, b, t)?;
        let rope = self.rope_tables_at(positions, self.dtype())?;
        self.forward_inner(ids, Some(&mask), Some(rope), &mut NoObserver, true)
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
            h = self.run_layer(
                &h,
                self.layer_at(layer)?,
                &rope,
                None,
                Some(lc),
                &mut NoObserver,
            )?;
        }
        cache.len += t;
        self.head(&h, &mut NoObserver)
    }

    fn dtype(&self) -> DType {
        self.net.embed.as_ref().map_or(DType::F32, Tensor::dtype)
    }

    /// The logits of `ids`; with `checkpoint` and checkpointing on, each layer of a pass that
    /// builds a graph (a tracked input, or adapters) is checkpointed.
    fn forward_inner(
        &self,
        ids: &Tensor,
        key_mask: Option<&Tensor>,
        rope: Option<(Tensor, Tensor)>,
        observer: &mut dyn Observer,
        checkpoint: bool,
    ) -> Result<Tensor, ModelError> {
        let h = self.hidden_inner(ids, key_mask, rope, observer, checkpoint)?;
        self.head(&h, observer)
    }

    /// The last layer's hidden states of `ids` (before the final norm), as
    /// [`DecoderModel::forward_inner`] computes them.
    fn hidden_inner(
        &self,
        ids: &Tensor,
        key_mask: Option<&Tensor>,
        rope: Option<(Tensor, Tensor)>,
        observer: &mut dyn Observer,
        checkpoint: bool,
    ) -> Result<Tensor, ModelError> {
        let mut h = self.embed(ids)?;
        let rope = match rope {
            Some(r) => r,
            None => self.rope_tables(h.dim(1)?, h.dtype())?,
        };
        let sink = self.checkpoint.as_ref().filter(|sink| {
            let trained = |a: &lora::Adapters| a.layers.values().any(|l| sink.wants(&l.a));
            checkpoint && (h.track_op() || self.adapters.as_deref().is_some_and(trained))
        });
        let Some(sink) = sink else {
            for layer in 0..self.config.layers {
                h = self.run_layer(&h, self.layer_at(layer)?, &rope, key_mask, None, observer)?;
            }
            return Ok(h);
        };
        if sink.mode() == super::checkpoint::LayerBackward::Kept {
            // Each layer's graph in an op of its own, freed as the backward pass leaves it.
            for layer in 0..self.config.layers {
                let forward = |x: &Tensor| {
                    self.run_layer(x, self.layer_at(layer)?, &rope, key_mask, None, observer)
                };
                h = super::checkpoint::kept_layer(&h, forward, sink)?;
            }
            return Ok(h);
        }
        // The model each recomputation runs (its adapters set per layer, below).
        let base = Arc::new(self.with_gradient_checkpointing(None));
        for layer in 0..self.config.layers {
            // The recomputation draws LoRA's dropout masks from where this layer's forward
            // starts drawing them, on a stream of its own.
            let recompute: super::checkpoint::Recompute = {
                let (base, rope, key_mask) = (base.clone(), rope.clone(), key_mask.cloned());
                let adapters = self
                    .adapters
                    .as_ref()
                    .map(|a| (a.clone(), a.dropout_rng().map(|r| r.state())));
                Box::new(move |x: &Tensor| {
                    let model = match &adapters {
                        Some((a, Some(state))) => {
                            base.with_adapters(Some(Arc::new(a.with_dropout_state(*state))))
                        }
                        Some((a, None)) => base.with_adapters(Some(a.clone())),
                        None => base.with_adapters(None),
                    };
                    let l = model.layer_at(layer)?;
                    model.run_layer(x, l, &rope, key_mask.as_ref(), None, &mut NoObserver)
                })
            };
            let forward = |x: &Tensor| {
                self.run_layer(x, self.layer_at(layer)?, &rope, key_mask, None, observer)
            };
            h = super::checkpoint::layer(&h, forward, recompute, sink)?;
        }
        Ok(h)
    }

    fn layer_at(&self, index: usize) -> Result<&Layer, ModelError> {
        self.net
            .layers
            .get(index)
            .and_then(Option::as_ref)
            .ok_or_else(|| ModelError::Tensor {
                tensor: format!("model.layers.{index}"),
                message: "not loaded".into(),
            })
    }

    fn head_part(&self) -> Result<&Head, ModelError> {
        self.net.head.as_ref().ok_or_else(|| ModelError::Tensor {
            tensor: "model.norm.weight".into(),
            message: "not loaded".into(),
        })
    }

    /// The embeddings `[batch, seq, hidden]` of token ids `[batch, seq]`.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        let (b, t) = ids.dims2()?;
        let table = self.net.embed.as_ref().ok_or_else(|| ModelError::Tensor {
            tensor: "model.embed_tokens.weight".into(),
            message: "not loaded".into(),
        })?;
        let vocab = table.dim(0)?;
        let biggest = ids.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
        if biggest >= vocab {
            return Err(ModelError::Config(format!(
                "token id {biggest} is outside the vocabulary ({vocab} tokens)"
            )));
        }
        let flat = ids.flatten_all()?;
        let mut rows = table.index_select(&flat, 0)?;
        // transformers' `nn.Embedding(padding_idx=pad_token_id)`: the pad row's value is used
        // but gets no gradient from the positions holding it (a sampled completion may).
        if let Some(pad) = self.config.padding_idx
            && table.is_variable()
        {
            let hits: Vec<u8> = flat
                .to_vec1::<u32>()?
                .iter()
                .map(|&i| u8::from(i == pad))
                .collect();
            if hits.contains(&1) {
                let n = hits.len();
                let mask =
                    Tensor::from_vec(hits, (n, 1), table.device())?.broadcast_as(rows.shape())?;
                rows = mask.where_cond(&rows.detach(), &rows)?;
            }
        }
        Ok(rows.reshape((b, t, self.config.hidden))?)
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
        self.run_layer(h, self.layer_at(layer)?, rope, None, None, observer)
    }

    fn run_layer(
        &self,
        h: &Tensor,
        layer: &Layer,
        rope: &(Tensor, Tensor),
        key_mask: Option<&Tensor>,
        cache: Option<&mut LayerCache>,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let eps = self.config.eps;
        let x = rms_norm(h, &layer.input_norm, eps)?;
        let h = (h + self.attention(&x, &layer.attention, rope, key_mask, cache, observer)?)?;
        let x = rms_norm(&h, &layer.post_norm, eps)?;
        Ok((h + self.mlp(&x, &layer.mlp, observer)?)?)
    }

    /// Shows `observer` the input of `lm_head` (the final norm of `h`) without computing the
    /// logits (calibration).
    pub fn observe_head(&self, h: &Tensor, observer: &mut dyn Observer) -> Result<(), ModelError> {
        let head = self.head_part()?;
        if !head.tied {
            let h = rms_norm(h, &head.norm, self.config.eps)?;
            observer.linear_input(&head.lm_head.name, &h)?;
        }
        Ok(())
    }

    /// The final norm and the logits of hidden states `h`.
    pub fn head(&self, h: &Tensor, observer: &mut dyn Observer) -> Result<Tensor, ModelError> {
        let head = self.head_part()?;
        let h = rms_norm(h, &head.norm, self.config.eps)?;
        if !head.tied {
            observer.linear_input(&head.lm_head.name, &h)?;
        }
        self.linear(&head.lm_head, &h, true)
    }

    /// `cos`, `sin` `[seq, head_dim]` for positions `0..seq`.
    pub fn rope_tables(&self, t: usize, dtype: DType) -> Result<(Tensor, Tensor), ModelError> {
        self.rope_tables_from(0, t, dtype)
    }

    /// `cos`, `sin` `[batch, 1, t, head_dim]` for the positions of each row (broadcast over
    /// the heads).
    pub fn rope_tables_at(
        &self,
        positions: &[Vec<usize>],
        dtype: DType,
    ) -> Result<(Tensor, Tensor), ModelError> {
        let (b, t) = (positions.len(), positions.first().map_or(0, Vec::len));
        let inv = self.config.inv_freq();
        let scale = self.config.rope_attention_factor();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &pos in positions.iter().flatten() {
            // As rope_tables_from: freqs = pos · inv_freq in f32, emb = cat(freqs, freqs).
            for _ in 0..2 {
                for &f in &inv {
                    let a = pos as f32 * f;
                    cos.push(a.cos() * scale);
                    sin.push(a.sin() * scale);
                }
            }
        }
        let shape = (b, 1, t, self.config.head_dim);
        Ok((
            Tensor::from_vec(cos, shape, &self.device)?.to_dtype(dtype)?,
            Tensor::from_vec(sin, shape, &self.device)?.to_dtype(dtype)?,
        ))
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

    fn attention(
        &self,
        x: &Tensor,
        a: &Attention,
        (cos, sin): &(Tensor, Tensor),
        key_mask: Option<&Tensor>,
        cache: Option<&mut LayerCache>,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = (c.heads, c.kv_heads, c.head_dim);
        let proj =
            |l: &Linear, norm: Option<&Tensor>, heads: usize| -> Result<Tensor, ModelError> {
                let y = self.linear(l, x, true)?.reshape((b, t, heads, hd))?;
                let y = match norm {
                    Some(nw) => rms_norm(&y, nw, c.eps)?,
                    None => y,
                };
                Ok(y.transpose(1, 2)?.contiguous()?)
            };
        let rope = |x: Tensor| -> Result<Tensor, ModelError> {
            // Tables per row (given positions) broadcast; the fused op takes one table.
            if cos.rank() == 2 && super::fused::fusable(&x) {
                return Ok(super::fused::rope(&x, cos, sin)?);
            }
            if cos.rank() == 2 && super::fused_bf16::runs(&[&x, cos, sin]) {
                return Ok(super::fused_bf16::rope(&x, cos, sin)?);
            }
            rope_unfused(&x, cos, sin)
        };
        for l in [&a.q, &a.k, &a.v] {
            observer.linear_input(&l.name, x)?;
        }
        let q = rope(proj(&a.q, a.q_norm.as_ref(), nh)?)?;
        let k = rope(proj(&a.k, a.k_norm.as_ref(), nkv)?)?;
        let v = proj(&a.v, None, nkv)?;
        observer.key_value(&a.name, &k, &v)?;
        let (k, v) = self.act.key_value(&a.name, k, v)?;
        // With a cache, the new keys and values join those of the earlier positions.
        let (k, v) = match cache {
            Some(cache) => {
                let (k, v) = match (&cache.k, &cache.v) {
                    (Some(pk), Some(pv)) => {
                        (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?)
                    }
                    _ => (k, v),
                };
                // Generation never differentiates through the cache: kept detached, the cached
                // keys and values hold no graph (which would keep every earlier step's
                // intermediates alive when the weights or adapters are variables).
                cache.k = Some(k.detach());
                cache.v = Some(v.detach());
                (k, v)
            }
            None => (k, v),
        };
        let tk = k.dim(2)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let streamed = super::fused::fusable(&q)
            || (self.attn == AttnImplementation::Sdpa
                && q.device().is_cpu()
                && matches!(q.dtype(), DType::BF16 | DType::F16));
        if a.sinks.is_none() && !streamed && super::fused_bf16::runs(&[&q, &k, &v]) {
            // Eager bf16 attention outside autograd (calibration): the same rounding points
            // as the unfused ops below, streamed.
            let causal = mask_values(t, tk, a.window);
            let o = super::fused::attention_bf16_eager(&q, &k, &v, scale, causal, key_mask)?
                .transpose(1, 2)?
                .reshape((b, t, nh * hd))?;
            observer.linear_input(&a.o.name, &o)?;
            return self.linear(&a.o, &o, true);
        }
        if a.sinks.is_none() && streamed {
            // Scores, masks, softmax and the values' sum in one streamed op that never holds
            // the [t, tk] scores or probabilities (the backward pass recomputes them from each
            // row's log-sum-exp), the grouped heads reading their shared keys in place.
            // (A bf16 model under eager attention takes `attention_bf16_eager` above, or the
            // unfused ops below inside autograd: they round the scores and the probabilities to
            // bf16 as PyTorch's eager bf16 attention does — llm-compressor's GPTQ codes agree
            // with kiln's less often when they are kept in f32.)
            let causal = mask_values(t, tk, a.window);
            let dtype = q.dtype();
            let f32 = |x: &Tensor| x.to_dtype(DType::F32);
            let o =
                super::fused::attention(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale, causal, key_mask)?
                    .to_dtype(dtype)?
                    .transpose(1, 2)?
                    .reshape((b, t, nh * hd))?;
            observer.linear_input(&a.o.name, &o)?;
            return self.linear(&a.o, &o, true);
        }
        // GQA without copying keys and values per head: the `group` query heads that share a
        // key/value head (transformers' `repeat_kv` order: head h reads kv head h / group)
        // are one matrix of group·t rows against that head's keys, and their probabilities one
        // matrix against its values.
        let group = nh / nkv;
        let raw = q
            .contiguous()?
            .reshape((b, nkv, group * t, hd))?
            .matmul(&k.t()?)?
            .reshape((b, nh, t, tk))?;
        let attend = |probs: &Tensor| -> Result<Tensor, ModelError> {
            Ok(probs
                .contiguous()?
                .reshape((b, nkv, group * t, tk))?
                .matmul(&v)?
                .reshape((b, nh, t, hd))?
                .transpose(1, 2)?
                .reshape((b, t, nh * hd))?)
        };
        let scores = (raw * scale)?;
        let mask = self.mask(t, tk, a.window, scores.dtype())?;
        let scores = scores.broadcast_add(&mask)?;
        let scores = match key_mask {
            Some(k) => scores.broadcast_add(k)?,
            None => scores,
        };
        let probs = match &a.sinks {
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
        let o = attend(&probs)?;
        observer.linear_input(&a.o.name, &o)?;
        self.linear(&a.o, &o, true)
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
        let m = mask_values(tq, tk, window);
        Ok(Tensor::from_vec(m, (tq, tk), &self.device)?.to_dtype(dtype)?)
    }

    fn dense_mlp(
        &self,
        x: &Tensor,
        m: &DenseMlp,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        observer.linear_input(&m.gate.name, x)?;
        observer.linear_input(&m.up.name, x)?;
        let g = self.linear(&m.gate, x, true)?;
        let u = self.linear(&m.up, x, true)?;
        let gu = if super::fused::fusable(&g) && super::fused::fusable(&u) {
            super::fused::swiglu(&g, &u)?
        } else if super::fused_bf16::runs(&[&g, &u]) {
            super::fused_bf16::swiglu(&g, &u)?
        } else {
            (silu(&g)? * u)?
        };
        observer.linear_input(&m.down.name, &gu)?;
        self.linear(&m.down, &gu, true)
    }

    fn mlp(
        &self,
        x: &Tensor,
        mlp: &Mlp,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        let (router, experts) = match mlp {
            Mlp::Dense(m) => return self.dense_mlp(x, m, observer),
            Mlp::Bmm(e) => return self.bmm_experts(x, e, observer),
            Mlp::Experts { router, experts } => (router, experts),
        };
        let moe = self.routing()?;
        let (b, t, hidden) = x.dims3()?;
        let x2 = x.reshape((b * t, hidden))?;
        observer.linear_input(&router.name, &x2)?;
        let logits = self.linear(router, &x2, false)?;
        let probs = softmax(&logits)?;
        let (chosen, idx) = self.top_k(&probs, moe.top_k)?;
        let mut weights = probs.gather(&idx, 1)?;
        if moe.normalize_top_k {
            weights = weights.broadcast_div(&weights.sum_keepdim(1)?)?;
        }
        let weights = weights.to_dtype(x.dtype())?;
        if observer.all_experts() {
            // Calibration pass: every expert on every token, outputs unused.
            for e in experts {
                self.dense_mlp(&x2, e, observer)?;
            }
        }
        let out = self.dispatch(&x2, &chosen, moe, &weights, |e, xe| {
            self.dense_mlp(xe, &experts[e], observer)
        })?;
        Ok(out.reshape((b, t, hidden))?)
    }

    /// The routing of the MoE layers (checked at load to be there when a layer has experts).
    fn routing(&self) -> Result<&MoeRouting, ModelError> {
        self.config
            .moe
            .as_ref()
            .ok_or_else(|| ModelError::Config("no experts per token for an MoE layer".into()))
    }

    /// GPT-OSS's MoE block: a router with a bias whose top-k logits are softmaxed, and BMM
    /// experts with the clamped SwiGLU `(up + 1) · gate · σ(1.702 · gate)`.
    fn bmm_experts(
        &self,
        x: &Tensor,
        e: &BmmExperts,
        observer: &mut dyn Observer,
    ) -> Result<Tensor, ModelError> {
        const ALPHA: f64 = 1.702;
        const LIMIT: f64 = 7.0;
        let moe = self.routing()?;
        let (b, t, hidden) = x.dims3()?;
        let x2 = x.reshape((b * t, hidden))?;
        observer.linear_input(&e.router.name, &x2)?;
        let logits = self.linear(&e.router, &x2, false)?;
        let (chosen, idx) = self.top_k(&logits, moe.top_k)?;
        let weights = softmax(&logits.gather(&idx, 1)?)?.to_dtype(x.dtype())?;
        let inter = e.gate_up.dim(2)? / 2;
        observer.quantizer_input(&e.gate_up_quantizer, &x2)?;
        let out = self.dispatch(&x2, &chosen, moe, &weights, |i, xe| {
            let gu = self
                .act
                .input(&e.gate_up_name, xe)?
                .matmul(&e.gate_up.get(i)?)?
                .broadcast_add(&e.gate_up_bias.get(i)?)?
                .reshape((xe.dim(0)?, inter, 2))?;
            let gate = gu.narrow(2, 0, 1)?.squeeze(2)?.minimum(LIMIT)?;
            let up = gu.narrow(2, 1, 1)?.squeeze(2)?.clamp(-LIMIT, LIMIT)?;
            let glu = (&gate * sigmoid(&(&gate * ALPHA)?)?)?;
            let h = ((up + 1.0)? * glu)?;
            observer.quantizer_input(&e.down_quantizer, &h)?;
            Ok(self
                .act
                .input(&e.down_name, &h)?
                .matmul(&e.down.get(i)?)?
                .broadcast_add(&e.down_bias.get(i)?)?)
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

/// SiLU as PyTorch computes it on the CPU: a 16-bit input is widened to f32, `x / (1 +
/// exp(−x))` evaluated there and rounded once (candle's 16-bit SiLU rounds every step, which
/// moves ~1 % of bf16 activations by an ulp — enough to change what GPTQ and AWQ choose).
fn silu(x: &Tensor) -> Result<Tensor, candle_core::Error> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32)?.silu()?.to_dtype(x.dtype()),
        _ => x.silu(),
    }
}
