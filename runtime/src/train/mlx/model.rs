//! The decoder on MLX: the dense families kiln runs on candle (Llama with its RoPE scalings,
//! Mistral's sliding window, Qwen2's q/k/v biases, Qwen3's q/k norms, tied embeddings), written
//! with the same arithmetic as `model/decoder.rs` — RMSNorm as `w · x / sqrt(mean(x²) + ε)` in
//! f32, RoPE from the same host-computed tables with `rotate_half`, softmax over scores with
//! the causal mask and transformers' key mask — so both backends give the same logits. Every op
//! is an MLX op, so `mlx_rs::transforms::value_and_grad` differentiates it.
//!
//! The weights are arrays by tensor name; a forward pass takes them as an argument, so training
//! hands in the arrays it differentiates (all of them, or LoRA's `A` and `B` beside frozen
//! base weights).

use crate::checkpoint::Checkpoint;
use crate::model::generate::{Rng, SamplingConfig, sample_with};
use crate::model::lora::DropoutRng;
use crate::model::{DecoderConfig, ModelError};
use mlx_rs::Array;
use mlx_rs::error::Exception;
use mlx_rs::ops;
use std::collections::BTreeMap;

/// Weights by tensor name.
pub type MlxWeights = BTreeMap<String, Array>;

/// An MLX error as a model error.
pub fn mlx_err(e: Exception) -> ModelError {
    ModelError::Device(format!("mlx: {e}"))
}

/// A LoRA adapter on one Linear: `A [r, in]`, `B [out, r]` and its scale.
#[derive(Debug, Clone)]
pub struct MlxLora {
    /// `lora_A.weight`.
    pub a: Array,
    /// `lora_B.weight`.
    pub b: Array,
    /// `α / r` (or `α / √r`).
    pub scale: f32,
    /// Dropout probability on the adapter's input (while training).
    pub dropout: f64,
}

/// What one forward pass runs with.
struct Ctx<'a> {
    w: &'a MlxWeights,
    adapters: &'a BTreeMap<String, MlxLora>,
    dropout: Option<&'a DropoutRng>,
    /// Adapter dropout's keep masks drawn before (a checkpointed layer's, per module), in
    /// place of drawing from `dropout`.
    masks: Option<&'a BTreeMap<String, Array>>,
    /// Each decoder layer under gradient checkpointing ([`kiln_kernels::mlx::checkpoint`]).
    checkpoint: bool,
}

impl<'a> Ctx<'a> {
    fn new(
        w: &'a MlxWeights,
        adapters: &'a BTreeMap<String, MlxLora>,
        dropout: Option<&'a DropoutRng>,
    ) -> Self {
        Ctx {
            w,
            adapters,
            dropout,
            masks: None,
            checkpoint: false,
        }
    }
}

/// Keys and values of the positions run so far, per layer (`[rows, kv_heads, len, head_dim]`,
/// after RoPE): sampling runs one new token per row per step against them.
pub struct MlxCache {
    layers: Vec<Option<(Array, Array)>>,
    len: usize,
}

impl MlxCache {
    /// The positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Repeats a one-row cache for `n` rows (one prompt, `n` completions).
    pub fn repeat_rows(&mut self, n: usize) -> Result<(), Exception> {
        for (k, v) in self.layers.iter_mut().flatten() {
            let grow = |a: &Array| -> Result<Array, Exception> {
                let mut shape = a.shape().to_vec();
                shape[0] = n as i32;
                ops::broadcast_to(a, &shape)?.contiguous()
            };
            (*k, *v) = (grow(k)?, grow(v)?);
        }
        Ok(())
    }
}

/// The names a layer's tensors go by, resolved once.
#[derive(Debug, Clone)]
struct LayerNames {
    input_norm: String,
    post_norm: String,
    q: String,
    k: String,
    v: String,
    o: String,
    q_norm: Option<String>,
    k_norm: Option<String>,
    gate: String,
    up: String,
    down: String,
    window: Option<usize>,
}

/// How a quantized module's packed weight is read: mlx-lm's affine mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Quantized {
    group: i32,
    bits: i32,
}

/// A dense decoder on MLX.
#[derive(Debug, Clone)]
pub struct MlxDecoder {
    config: DecoderConfig,
    layers: Vec<LayerNames>,
    tied: bool,
    /// The output layer's module: `lm_head`, or a sequence classifier's `score` (a reward
    /// model, transformers' `*ForSequenceClassification`).
    head: String,
    /// QLoRA: the modules kept packed (mlx-lm's layout: `weight` as `uint32` words beside
    /// `scales` and `biases`), run with MLX's `quantized_matmul` (Linears) and `dequantize`
    /// (embedding rows).
    quantized: BTreeMap<String, Quantized>,
    /// RoPE's inverse frequencies and attention factor (`DecoderConfig`).
    inv_freq: Vec<f32>,
    rope_scale: f32,
}

fn f32_array(values: &[f32], shape: &[usize]) -> Array {
    let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Array::from_slice(values, &shape)
}

impl MlxDecoder {
    /// The decoder of `checkpoint`'s `config.json` and its weights (BF16, F16 or F32, as f32).
    /// An mlx-lm quantized model (QLoRA) keeps its affine-quantized modules packed, their
    /// scales and biases in f32; other quantized layouts and mixture-of-experts families are
    /// named errors (not on MLX).
    pub fn load(checkpoint: &Checkpoint) -> Result<(Self, MlxWeights), ModelError> {
        let config = DecoderConfig::from_json(checkpoint.config().raw())?;
        if config.moe.is_some() {
            return Err(ModelError::Config(
                "mixture-of-experts models do not run on the MLX backend yet (use --backend candle)"
                    .into(),
            ));
        }
        let packed = if crate::formats::mlx::read::is_mlx(checkpoint) {
            crate::formats::mlx::read::affine_modules(checkpoint)?
        } else if let Some(key) = crate::model::quantization_marker(checkpoint) {
            return Err(ModelError::file(
                checkpoint.dir(),
                format!(
                    "has `{key}` but is not in mlx-lm's layout: QLoRA on the MLX backend runs \
                     mlx-lm's quantized models (--backend candle trains over the others)"
                ),
            ));
        } else {
            BTreeMap::new()
        };
        let part_of_packed = |name: &str| {
            [".weight", ".scales", ".biases"]
                .iter()
                .any(|s| name.strip_suffix(s).is_some_and(|m| packed.contains_key(m)))
        };
        let mut weights = MlxWeights::new();
        for t in checkpoint.tensors() {
            if part_of_packed(&t.name) {
                continue;
            }
            let data = crate::model::read_f32(checkpoint, t)?;
            weights.insert(t.name.clone(), f32_array(&data, &t.shape));
        }
        let mut quantized = BTreeMap::new();
        for (m, p) in packed {
            let (rows, words, groups) = (
                p.rows as i32,
                (p.cols * p.bits / 32) as i32,
                (p.cols / p.group) as i32,
            );
            weights.insert(
                format!("{m}.weight"),
                Array::from_slice(&p.words, &[rows, words]),
            );
            weights.insert(
                format!("{m}.scales"),
                Array::from_slice(&p.scales, &[rows, groups]),
            );
            weights.insert(
                format!("{m}.biases"),
                Array::from_slice(&p.biases, &[rows, groups]),
            );
            quantized.insert(
                m,
                Quantized {
                    group: p.group as i32,
                    bits: p.bits as i32,
                },
            );
        }
        let mut model = Self::new(config, &weights)?;
        model.quantized = quantized;
        Ok((model, weights))
    }

    /// Whether module `module`'s weight is kept packed (QLoRA).
    pub fn is_packed(&self, module: &str) -> bool {
        self.quantized.contains_key(module)
    }

    /// The shape of tensor `name` as the model uses it: a packed weight's `[out, in]`, not its
    /// words'.
    pub fn logical_shape(&self, name: &str, array: &Array) -> Vec<usize> {
        let mut shape: Vec<usize> = array.shape().iter().map(|&d| d as usize).collect();
        if let Some(q) = name
            .strip_suffix(".weight")
            .and_then(|m| self.quantized.get(m))
            && let Some(last) = shape.last_mut()
        {
            *last = *last * 32 / q.bits as usize;
        }
        shape
    }

    /// The decoder of `config` over `weights` (every tensor it needs must be there).
    pub fn new(config: DecoderConfig, weights: &MlxWeights) -> Result<Self, ModelError> {
        let need = |name: String| -> Result<String, ModelError> {
            if weights.contains_key(&name) {
                Ok(name)
            } else {
                Err(ModelError::Tensor {
                    tensor: name,
                    message: "missing from the checkpoint".into(),
                })
            }
        };
        let maybe = |name: String| weights.contains_key(&name).then_some(name);
        need("model.embed_tokens.weight".into())?;
        need("model.norm.weight".into())?;
        let classifier =
            !weights.contains_key("lm_head.weight") && weights.contains_key(crate::model::SCORE);
        let tied = !weights.contains_key("lm_head.weight") && !classifier;
        if tied && !config.tie_word_embeddings {
            return Err(ModelError::Tensor {
                tensor: "lm_head.weight".into(),
                message: "missing from the checkpoint (and config.json does not tie it to the embeddings)".into(),
            });
        }
        let mut layers = Vec::with_capacity(config.layers);
        for i in 0..config.layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let m = format!("{p}.mlp");
            layers.push(LayerNames {
                input_norm: need(format!("{p}.input_layernorm.weight"))?,
                post_norm: need(format!("{p}.post_attention_layernorm.weight"))?,
                q: need(format!("{a}.q_proj.weight")).map(|_| format!("{a}.q_proj"))?,
                k: need(format!("{a}.k_proj.weight")).map(|_| format!("{a}.k_proj"))?,
                v: need(format!("{a}.v_proj.weight")).map(|_| format!("{a}.v_proj"))?,
                o: need(format!("{a}.o_proj.weight")).map(|_| format!("{a}.o_proj"))?,
                q_norm: maybe(format!("{a}.q_norm.weight")),
                k_norm: maybe(format!("{a}.k_norm.weight")),
                gate: need(format!("{m}.gate_proj.weight")).map(|_| format!("{m}.gate_proj"))?,
                up: need(format!("{m}.up_proj.weight")).map(|_| format!("{m}.up_proj"))?,
                down: need(format!("{m}.down_proj.weight")).map(|_| format!("{m}.down_proj"))?,
                window: config.sliding_window_of(i),
            });
        }
        Ok(MlxDecoder {
            inv_freq: config.inv_freq(),
            rope_scale: config.rope_attention_factor(),
            config,
            layers,
            tied,
            head: if classifier { "score" } else { "lm_head" }.into(),
            quantized: BTreeMap::new(),
        })
    }

    /// Whether the output layer is a sequence classifier's `score` (a reward model).
    pub fn is_classifier(&self) -> bool {
        self.head == "score"
    }

    /// The decoder as transformers' `AutoModelForSequenceClassification(num_labels=1)` loads
    /// it: a `score` head `[1, hidden]` in place of `lm_head` in `weights` — kept when there,
    /// else new (the candle backend's draw, [`crate::model::new_score_head`]), with the note
    /// that says so.
    pub fn with_score_head(
        mut self,
        weights: &mut MlxWeights,
        seed: u64,
    ) -> Result<(Self, Option<String>), ModelError> {
        if self.is_classifier() {
            return Ok((self, None));
        }
        let (values, note) = crate::model::new_score_head(&self.config, seed);
        if self.quantized.contains_key("lm_head") {
            return Err(ModelError::Config(
                "a reward model's head over a quantized lm_head: train it with --backend candle"
                    .into(),
            ));
        }
        weights.remove("lm_head.weight");
        weights.remove("lm_head.bias");
        weights.insert(
            crate::model::SCORE.into(),
            f32_array(&values, &[1, self.config.hidden]),
        );
        self.head = "score".into();
        self.tied = false;
        Ok((self, Some(note)))
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    /// The Linear layers (module path, inputs, outputs) LoRA can adapt, in layer order.
    pub fn linear_modules(&self, weights: &MlxWeights) -> Vec<(String, usize, usize)> {
        let mut out = Vec::new();
        for l in &self.layers {
            for m in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                let name = format!("{m}.weight");
                if let Some(w) = weights.get(&name) {
                    let s = self.logical_shape(&name, w);
                    out.push((m.clone(), s[1], s[0]));
                }
            }
        }
        out
    }

    /// Logits `[batch, seq, vocab]` of `ids` (`[batch, seq]` token ids) with `weights` and
    /// LoRA `adapters` (by module path); `attention[i][j]` false hides token `j` of row `i`
    /// from every query (transformers' `attention_mask`). With `dropout`, adapters drop their
    /// inputs with masks from that stream (the candle backend's, so both draw the same).
    pub fn forward(
        &self,
        weights: &MlxWeights,
        adapters: &BTreeMap<String, MlxLora>,
        ids: &[Vec<u32>],
        attention: Option<&[Vec<bool>]>,
    ) -> Result<Array, ModelError> {
        self.forward_with(weights, adapters, None, ids, attention, false)
            .map_err(mlx_err)
    }

    /// [`MlxDecoder::forward`] with adapter dropout drawn from `dropout`, and with
    /// `checkpoint` each decoder layer under gradient checkpointing (TRL's
    /// `gradient_checkpointing`): a `value_and_grad` through the logits keeps each layer's
    /// input, not its intermediate arrays, and runs the layer again in its backward pass
    /// (adapter dropout's masks drawn once, before the layer) — the same values and gradients.
    pub fn forward_with(
        &self,
        w: &MlxWeights,
        adapters: &BTreeMap<String, MlxLora>,
        dropout: Option<&DropoutRng>,
        ids: &[Vec<u32>],
        attention: Option<&[Vec<bool>]>,
        checkpoint: bool,
    ) -> Result<Array, Exception> {
        let mut ctx = Ctx::new(w, adapters, dropout);
        ctx.checkpoint = checkpoint;
        self.run(&ctx, ids, attention, None, None)
    }

    /// [`MlxDecoder::forward_with`] with each token's position given (`positions[i][j]`,
    /// transformers' `position_ids`), as the candle decoder's `forward_positioned`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_positioned(
        &self,
        w: &MlxWeights,
        adapters: &BTreeMap<String, MlxLora>,
        dropout: Option<&DropoutRng>,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
        checkpoint: bool,
    ) -> Result<Array, Exception> {
        let mut ctx = Ctx::new(w, adapters, dropout);
        ctx.checkpoint = checkpoint;
        self.run(&ctx, ids, Some(attention), None, Some(positions))
    }

    /// An empty cache for [`MlxDecoder::forward_cached`].
    pub fn new_cache(&self) -> MlxCache {
        MlxCache {
            layers: vec![None; self.layers.len()],
            len: 0,
        }
    }

    /// Logits `[rows, t, vocab]` of `ids` (`t` new tokens per row, no padding) at the positions
    /// after those in `cache`, which takes their keys and values (no adapter dropout: for
    /// sampling).
    pub fn forward_cached(
        &self,
        w: &MlxWeights,
        adapters: &BTreeMap<String, MlxLora>,
        ids: &[Vec<u32>],
        cache: &mut MlxCache,
    ) -> Result<Array, Exception> {
        let ctx = Ctx::new(w, adapters, None);
        let logits = self.run(&ctx, ids, None, Some(&mut *cache), None)?;
        cache.len += ids.first().map_or(0, Vec::len);
        let held: Vec<&Array> = cache
            .layers
            .iter()
            .flatten()
            .flat_map(|(k, v)| [k, v])
            .collect();
        mlx_rs::transforms::eval(held)?;
        Ok(logits)
    }

    fn run(
        &self,
        ctx: &Ctx<'_>,
        ids: &[Vec<u32>],
        attention: Option<&[Vec<bool>]>,
        mut cache: Option<&mut MlxCache>,
        positions: Option<&[Vec<usize>]>,
    ) -> Result<Array, Exception> {
        let w = ctx.w;
        let c = &self.config;
        let b = ids.len();
        let t = ids.first().map_or(0, Vec::len);
        let start = cache.as_ref().map_or(0, |c| c.len);
        let flat: Vec<i32> = ids.iter().flatten().map(|&i| i as i32).collect();
        let idx = Array::from_slice(&flat, &[(b * t) as i32]);
        let embed = "model.embed_tokens";
        let table = &w["model.embed_tokens.weight"];
        let mut rows = table.take_axis(&idx, 0)?;
        // transformers' `nn.Embedding(padding_idx=pad_token_id)`: the pad row gets no gradient
        // from the positions holding it.
        if let Some(pad) = c.padding_idx
            && flat.contains(&(pad as i32))
            && !self.quantized.contains_key(embed)
        {
            let hits: Vec<bool> = flat.iter().map(|&i| i == pad as i32).collect();
            let mask = Array::from_slice(&hits, &[(b * t) as i32, 1]);
            rows = ops::select(&mask, &mlx_rs::stop_gradient(&rows)?, &rows)?;
        }
        let rows = match self.quantized.get(embed) {
            Some(q) => ops::dequantize(
                &rows,
                w["model.embed_tokens.scales"].take_axis(&idx, 0)?,
                &w["model.embed_tokens.biases"].take_axis(&idx, 0)?,
                q.group,
                q.bits,
            )?,
            None => rows,
        };
        let mut h = rows.reshape(&[b as i32, t as i32, c.hidden as i32])?;
        let (cos, sin) = match positions {
            Some(p) => self.rope_tables_at(p),
            None => self.rope_tables(start, t),
        };
        let key_mask = match attention {
            Some(a) => {
                let m: Vec<f32> = a
                    .iter()
                    .flat_map(|r| r.iter().map(|&keep| if keep { 0.0 } else { f32::MIN }))
                    .collect();
                Some(Array::from_slice(&m, &[b as i32, 1, 1, t as i32]))
            }
            None => None,
        };
        let shared = (ctx.checkpoint && cache.is_none()).then(|| std::sync::Arc::new(self.clone()));
        for (i, l) in self.layers.iter().enumerate() {
            h = match &shared {
                Some(me) => me.checkpointed_layer(ctx, i, &h, (&cos, &sin), key_mask.as_ref())?,
                None => {
                    let past = cache.as_deref_mut().map(|c| (&mut c.layers[i], start));
                    self.layer(ctx, l, &h, (&cos, &sin), key_mask.as_ref(), past)?
                }
            };
        }
        let h = self.rms_norm(&h, &w["model.norm.weight"])?;
        if self.tied {
            match self.quantized.get(embed) {
                // mlx-lm's `embed_tokens.as_linear`.
                Some(q) => ops::quantized_matmul(
                    &h,
                    table,
                    &w["model.embed_tokens.scales"],
                    &w["model.embed_tokens.biases"],
                    true,
                    q.group,
                    q.bits,
                ),
                None => ops::matmul(&h, table.t()),
            }
        } else {
            self.linear(ctx, &self.head, &h)
        }
    }

    /// One decoder layer on `h`.
    fn layer(
        &self,
        ctx: &Ctx<'_>,
        l: &LayerNames,
        h: &Array,
        rope: (&Array, &Array),
        key_mask: Option<&Array>,
        past: Option<(&mut Option<(Array, Array)>, usize)>,
    ) -> Result<Array, Exception> {
        let w = ctx.w;
        let x = self.rms_norm(h, &w[&l.input_norm])?;
        let a = self.attention(ctx, l, &x, rope, key_mask, past)?;
        let h = ops::add(h, &a)?;
        let x = self.rms_norm(&h, &w[&l.post_norm])?;
        let g = self.linear(ctx, &l.gate, &x)?;
        let g = ops::multiply(&g, &ops::sigmoid(&g)?)?;
        let u = self.linear(ctx, &l.up, &x)?;
        let m = self.linear(ctx, &l.down, &ops::multiply(&g, &u)?)?;
        ops::add(&h, &m)
    }

    /// Layer `i` on `h` under MLX's gradient checkpointing. The checkpointed function's inputs
    /// are `h` and the layer's trained arrays (the adapters' `A`, `B` under LoRA, else every
    /// weight of the layer), so that gradients reach them; the frozen weights, RoPE's tables,
    /// the key mask and adapter dropout's masks (drawn here, in the order the layer's Linears
    /// would draw them) are constants it holds.
    fn checkpointed_layer(
        self: &std::sync::Arc<Self>,
        ctx: &Ctx<'_>,
        i: usize,
        h: &Array,
        (cos, sin): (&Array, &Array),
        key_mask: Option<&Array>,
    ) -> Result<Array, Exception> {
        let l = &self.layers[i];
        let prefix = format!("model.layers.{i}.");
        let lora = !ctx.adapters.is_empty();
        let mut frozen = MlxWeights::new();
        let mut trained: Vec<(String, Array)> = Vec::new();
        for (name, a) in ctx.w.range(prefix.clone()..) {
            if !name.starts_with(&prefix) {
                break;
            }
            if lora {
                frozen.insert(name.clone(), a.clone());
            } else {
                trained.push((name.clone(), a.clone()));
            }
        }
        let adapters: Vec<(String, MlxLora)> = ctx
            .adapters
            .iter()
            .filter(|(m, _)| m.starts_with(&prefix))
            .map(|(m, a)| (m.clone(), a.clone()))
            .collect();
        let mut masks = BTreeMap::new();
        if let Some(rng) = ctx.dropout {
            let (b, t) = (h.shape()[0], h.shape()[1]);
            for m in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                if let Some(a) = ctx.adapters.get(m).filter(|a| a.dropout > 0.0) {
                    let cols = a.a.shape()[1];
                    let n = (b * t * cols) as usize;
                    let keep = Array::from_slice(&rng.keep(n, a.dropout), &[b, t, cols]);
                    masks.insert(m.clone(), keep);
                }
            }
        }
        let mut inputs = vec![h.clone()];
        inputs.extend(trained.iter().map(|(_, a)| a.clone()));
        for (_, a) in &adapters {
            inputs.extend([a.a.clone(), a.b.clone()]);
        }
        let me = self.clone();
        let (cos, sin, key_mask) = (cos.clone(), sin.clone(), key_mask.cloned());
        let f = move |x: &[Array]| -> Result<Vec<Array>, Exception> {
            let mut w = frozen.clone();
            let mut k = 1;
            for (name, _) in &trained {
                w.insert(name.clone(), x[k].clone());
                k += 1;
            }
            let mut lora = BTreeMap::new();
            for (m, a) in &adapters {
                let adapter = MlxLora {
                    a: x[k].clone(),
                    b: x[k + 1].clone(),
                    ..a.clone()
                };
                lora.insert(m.clone(), adapter);
                k += 2;
            }
            let mut ctx = Ctx::new(&w, &lora, None);
            ctx.masks = Some(&masks);
            let out = me.layer(
                &ctx,
                &me.layers[i],
                &x[0],
                (&cos, &sin),
                key_mask.as_ref(),
                None,
            )?;
            Ok(vec![out])
        };
        let mut out = kiln_kernels::mlx::checkpoint(Box::new(f), &inputs)
            .map_err(|e| Exception::custom(e.to_string()))?;
        Ok(out.remove(0))
    }

    /// `x · Wᵀ (+ b)`, plus `s · (x Aᵀ) Bᵀ` where `module` has an adapter.
    fn linear(&self, ctx: &Ctx<'_>, module: &str, x: &Array) -> Result<Array, Exception> {
        let weight = &ctx.w[&format!("{module}.weight")];
        let mut y = match self.quantized.get(module) {
            Some(q) => ops::quantized_matmul(
                x,
                weight,
                &ctx.w[&format!("{module}.scales")],
                &ctx.w[&format!("{module}.biases")],
                true,
                q.group,
                q.bits,
            )?,
            None => ops::matmul(x, weight.t())?,
        };
        if let Some(bias) = ctx.w.get(&format!("{module}.bias")) {
            y = ops::add(&y, bias)?;
        }
        if let Some(l) = ctx.adapters.get(module) {
            let drawn = ctx.masks.and_then(|m| m.get(module)).cloned();
            let keep = match (drawn, ctx.dropout.filter(|_| l.dropout > 0.0)) {
                (Some(keep), _) => Some(keep),
                (None, Some(rng)) => {
                    let n = x.shape().iter().product::<i32>() as usize;
                    Some(Array::from_slice(&rng.keep(n, l.dropout), x.shape()))
                }
                (None, None) => None,
            };
            let x = match keep {
                Some(keep) => {
                    let kept = ops::multiply(x, &keep)?;
                    ops::multiply(&kept, Array::from_f32((1.0 / (1.0 - l.dropout)) as f32))?
                }
                None => x.clone(),
            };
            let h = ops::matmul(&x, l.a.t())?;
            let d = ops::matmul(&h, l.b.t())?;
            y = ops::add(&y, &ops::multiply(&d, Array::from_f32(l.scale))?)?;
        }
        Ok(y)
    }

    /// transformers' RMSNorm: `w · x / sqrt(mean(x²) + ε)`.
    fn rms_norm(&self, x: &Array, w: &Array) -> Result<Array, Exception> {
        let var = ops::square(x)?.mean_axis(-1, true)?;
        let eps = Array::from_f32(self.config.eps as f32);
        let normed = ops::divide(x, &ops::sqrt(&ops::add(&var, &eps)?)?)?;
        ops::multiply(&normed, w)
    }

    /// `cos`, `sin` `[seq, head_dim]` for positions `start..start + t`, computed on the host
    /// as the candle decoder does.
    fn rope_tables(&self, start: usize, t: usize) -> (Array, Array) {
        let hd = self.config.head_dim;
        let mut cos = Vec::with_capacity(t * hd);
        let mut sin = Vec::with_capacity(t * hd);
        for pos in start..start + t {
            for _ in 0..2 {
                for &f in &self.inv_freq {
                    let a = pos as f32 * f;
                    cos.push(a.cos() * self.rope_scale);
                    sin.push(a.sin() * self.rope_scale);
                }
            }
        }
        (f32_array(&cos, &[t, hd]), f32_array(&sin, &[t, hd]))
    }

    /// `cos`, `sin` `[batch, 1, t, head_dim]` for each row's positions (broadcast over the
    /// heads).
    fn rope_tables_at(&self, positions: &[Vec<usize>]) -> (Array, Array) {
        let hd = self.config.head_dim;
        let (b, t) = (positions.len(), positions.first().map_or(0, Vec::len));
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &pos in positions.iter().flatten() {
            for _ in 0..2 {
                for &f in &self.inv_freq {
                    let a = pos as f32 * f;
                    cos.push(a.cos() * self.rope_scale);
                    sin.push(a.sin() * self.rope_scale);
                }
            }
        }
        (
            f32_array(&cos, &[b, 1, t, hd]),
            f32_array(&sin, &[b, 1, t, hd]),
        )
    }

    /// Self-attention of `x`'s `t` positions; with `past` (this layer's cache and the number of
    /// positions before `x`), against the cached keys and values too, which it extends.
    fn attention(
        &self,
        ctx: &Ctx<'_>,
        l: &LayerNames,
        x: &Array,
        (cos, sin): (&Array, &Array),
        key_mask: Option<&Array>,
        past: Option<(&mut Option<(Array, Array)>, usize)>,
    ) -> Result<Array, Exception> {
        let c = &self.config;
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let (nh, nkv, hd) = (c.heads as i32, c.kv_heads as i32, c.head_dim as i32);
        let proj = |m: &str, norm: Option<&String>, heads: i32| -> Result<Array, Exception> {
            let y = self.linear(ctx, m, x)?.reshape(&[b, t, heads, hd])?;
            let y = match norm {
                Some(n) => self.rms_norm(&y, &ctx.w[n])?,
                None => y,
            };
            y.transpose_axes(&[0, 2, 1, 3])
        };
        let rope = |x: Array| -> Result<Array, Exception> {
            let half = hd / 2;
            let parts = ops::split_at_indices(&x, &[half], -1)?;
            let rotated = ops::concatenate(&[ops::negative(&parts[1])?, parts[0].clone()], -1)?;
            ops::add(&ops::multiply(&x, cos)?, &ops::multiply(&rotated, sin)?)
        };
        let q = rope(proj(&l.q, l.q_norm.as_ref(), nh)?)?;
        let mut k = rope(proj(&l.k, l.k_norm.as_ref(), nkv)?)?;
        let mut v = proj(&l.v, None, nkv)?;
        let mut start = 0;
        if let Some((slot, before)) = past {
            if let Some((pk, pv)) = slot.as_ref() {
                k = ops::concatenate(&[pk.clone(), k], 2)?;
                v = ops::concatenate(&[pv.clone(), v], 2)?;
            }
            *slot = Some((k.clone(), v.clone()));
            start = before;
        }
        let keys = k.shape()[2];
        let repeat = |x: Array| -> Result<Array, Exception> {
            if nh == nkv {
                return Ok(x);
            }
            let x = x.expand_dims(2)?;
            let x = ops::broadcast_to(&x, &[b, nkv, nh / nkv, keys, hd])?;
            x.reshape(&[b, nh, keys, hd])
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scale = Array::from_f32(1.0 / (hd as f32).sqrt());
        let scores = ops::multiply(&ops::matmul(&q, &k.transpose_axes(&[0, 1, 3, 2])?)?, &scale)?;
        let (tu, ku) = (t as usize, keys as usize);
        let mask: Vec<f32> = (start..start + tu)
            .flat_map(|i| {
                (0..ku).map(move |j| {
                    let hidden = j > i || l.window.is_some_and(|w| i - j >= w);
                    if hidden { f32::NEG_INFINITY } else { 0.0 }
                })
            })
            .collect();
        let mut scores = ops::add(&scores, f32_array(&mask, &[tu, ku]))?;
        if let Some(k) = key_mask {
            scores = ops::add(&scores, k)?;
        }
        let max = mlx_rs::stop_gradient(&scores.max_axis(-1, true)?)?;
        let e = ops::exp(&ops::subtract(&scores, &max)?)?;
        let probs = ops::divide(&e, &e.sum_axis(-1, true)?)?;
        let o = ops::matmul(&probs, &v)?
            .transpose_axes(&[0, 2, 1, 3])?
            .reshape(&[b, t, nh * hd])?;
        self.linear(ctx, &l.o, &o)
    }
}

/// `n` completions of `prompt` on MLX, drawn as the candle sampler draws
/// (`generate::sample_with`): the prompt runs once, its keys and values are shared by the `n`
/// rows, then each step runs every row's newest token against the cache.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    decoder: &MlxDecoder,
    weights: &MlxWeights,
    adapters: &BTreeMap<String, MlxLora>,
    prompt: &[u32],
    n: usize,
    cfg: &SamplingConfig,
    rng: &mut Rng,
) -> Result<Vec<Vec<u32>>, ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::Config(
            "cannot sample after an empty prompt".into(),
        ));
    }
    // The last position's logits of each row, as host rows.
    let last_rows = |logits: Array| -> Result<Vec<Vec<f32>>, Exception> {
        let (rows, t) = (logits.shape()[0] as usize, logits.shape()[1]);
        let last = ops::split_at_indices(&logits, &[t - 1], 1)?.remove(1);
        let last = last.as_type::<f32>()?.contiguous()?;
        last.eval()?;
        let flat = last.as_slice::<f32>();
        let v = flat.len() / rows;
        Ok(flat.chunks(v).map(<[f32]>::to_vec).collect())
    };
    let mut cache = decoder.new_cache();
    let logits = decoder
        .forward_cached(weights, adapters, &[prompt.to_vec()], &mut cache)
        .map_err(mlx_err)?;
    let first = last_rows(logits).map_err(mlx_err)?.remove(0);
    cache.repeat_rows(n).map_err(mlx_err)?;
    sample_with(prompt, n, cfg, rng, first, |next, _| {
        let ids: Vec<Vec<u32>> = next.iter().map(|&t| vec![t]).collect();
        decoder
            .forward_cached(weights, adapters, &ids, &mut cache)
            .and_then(last_rows)
            .map_err(mlx_err)
    })
}
