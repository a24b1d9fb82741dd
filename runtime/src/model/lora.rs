//! LoRA adapters on a model's Linear layers, as PEFT defines them: a Linear `W` at module `m`
//! computes `x·Wᵀ + (dropout(x)·Aᵀ)·Bᵀ · s` with `A [r, in]`, `B [out, r]` and
//! `s = α / r` (`α / √r` with rsLoRA). `A` starts Kaiming-uniform (bound `1/√in`), `B` at zero,
//! so a new adapter leaves the model's output unchanged. On disk: PEFT's
//! `adapter_model.safetensors` (`base_model.model.<m>.lora_A.weight`, `…lora_B.weight`) and
//! `adapter_config.json` (docs/TRAINING.md §4).

use super::{DecoderModel, ModelError, linear};
use candle_core::{DType, Tensor, Var};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Which Linear layers get an adapter, and how it is scaled (PEFT's `LoraConfig` fields).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    /// Rank `r`.
    pub r: usize,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `lora_dropout` on the adapter's input (training only).
    pub dropout: f64,
    /// `use_rslora`: scale by `α/√r` instead of `α/r`.
    pub rslora: bool,
    /// Module names as PEFT takes them: a name matches a module whose path is it or ends in
    /// `.<name>`; `all-linear` takes every Linear but the output layer; a name with `*`
    /// is a glob over the whole module path (`model.layers.*.self_attn.q_proj`).
    pub target_modules: Vec<String>,
}

impl LoraSpec {
    /// PEFT's scaling factor `s`.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.r as f64).sqrt()
        } else {
            self.alpha / self.r as f64
        }
    }

    /// Whether the Linear at `module` gets an adapter.
    pub fn targets(&self, module: &str) -> bool {
        self.target_modules.iter().any(|t| {
            if t == "all-linear" {
                module != "lm_head"
            } else if crate::glob::is_pattern(t) {
                crate::glob::matches(t, module)
            } else {
                module == t || module.ends_with(&format!(".{t}"))
            }
        })
    }
}

/// The dropout masks' generator: one SplitMix64 stream shared by every adapter of a model,
/// seeded by the run's seed, so a CPU run is reproducible bit for bit (and resumable: the
/// position is saved with a checkpoint).
#[derive(Debug, Default)]
pub struct DropoutRng(std::sync::atomic::AtomicU64);

impl DropoutRng {
    /// A stream at position `state`.
    pub fn new(state: u64) -> Self {
        DropoutRng(std::sync::atomic::AtomicU64::new(state))
    }

    /// The current position.
    pub fn state(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `n` keep-masks (1 with probability `1 − p`, else 0).
    pub fn keep(&self, n: usize, p: f64) -> Vec<f32> {
        let start = self
            .0
            .fetch_add(n as u64, std::sync::atomic::Ordering::SeqCst);
        let mut g = SplitMix(start);
        (0..n)
            .map(|_| {
                let u = (g.next() >> 11) as f64 / (1u64 << 53) as f64;
                if u >= p { 1.0 } else { 0.0 }
            })
            .collect()
    }
}

/// One adapter: `A [r, in]`, `B [out, r]`, its scale and dropout.
#[derive(Debug, Clone)]
pub struct LoraLayer {
    /// `lora_A.weight`.
    pub a: Var,
    /// `lora_B.weight`.
    pub b: Var,
    /// `α / r` (or `α / √r`).
    pub scale: f64,
    /// Dropout probability on the input (applied only when the adapters are training).
    pub dropout: f64,
}

/// The adapters of a model, by Linear module path.
#[derive(Debug, Clone)]
pub struct Adapters {
    layers: BTreeMap<String, LoraLayer>,
    spec: LoraSpec,
    training: bool,
    rng: std::sync::Arc<DropoutRng>,
}

impl LoraLayer {
    /// An adapter of `spec`'s scale and dropout.
    fn of(a: Var, b: Var, spec: &LoraSpec) -> Self {
        LoraLayer {
            a,
            b,
            scale: spec.scale(),
            dropout: spec.dropout,
        }
    }

    /// The adapter's contribution for input `x` `[.., in]`.
    pub fn delta(&self, x: &Tensor, dropout: Option<&DropoutRng>) -> Result<Tensor, ModelError> {
        let x = if let Some(rng) = dropout.filter(|_| self.dropout > 0.0) {
            let keep = Tensor::from_vec(
                rng.keep(x.elem_count(), self.dropout),
                x.shape(),
                x.device(),
            )?
            .to_dtype(x.dtype())?;
            (x * keep)?.affine(1.0 / (1.0 - self.dropout), 0.0)?
        } else {
            x.clone()
        };
        let h = linear(&x, self.a.as_tensor(), None)?;
        Ok(linear(&h, self.b.as_tensor(), None)?.affine(self.scale, 0.0)?)
    }
}

/// The Linear layers of `model` (2-D `<module>.weight` tensors but the embeddings and norms),
/// in name order.
pub fn linear_modules(model: &DecoderModel) -> Vec<(String, usize, usize)> {
    linear_modules_of(
        model
            .weights()
            .vars()
            .iter()
            .map(|(name, v)| (name.as_str(), v.as_tensor().dims())),
    )
}

/// [`linear_modules`] of any backend's weights, given as (tensor name, shape) in name order.
pub fn linear_modules_of<'a>(
    shapes: impl IntoIterator<Item = (&'a str, &'a [usize])>,
) -> Vec<(String, usize, usize)> {
    shapes
        .into_iter()
        .filter_map(|(name, dims)| {
            let module = name.strip_suffix(".weight")?;
            (dims.len() == 2 && !module.ends_with("embed_tokens") && !module.ends_with("norm"))
                .then(|| (module.to_string(), dims[1], dims[0]))
        })
        .collect()
}

/// Little-endian F32 / BF16 / F16 bytes as f32 values.
fn decode_float(dtype: safetensors::Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    use safetensors::Dtype;
    match dtype {
        Dtype::F32 => Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        Dtype::BF16 => Some(
            bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        Dtype::F16 => Some(
            bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        ),
        _ => None,
    }
}

/// A small seeded generator for adapter initialisation (SplitMix64).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self, bound: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * bound
    }
}

/// The `A [r, in]`, `B [out, r]` pairs of the adapter file at `path`, by module: `split`
/// names each tensor's module and side (0: A, 1: B) or says why it is not an adapter tensor;
/// `transposed`: the file holds `Aᵀ [in, r]` and `Bᵀ [r, out]` (mlx-lm). Every module must be a
/// Linear of `modules` with both halves in the right shape.
#[allow(clippy::too_many_arguments)]
fn read_pairs(
    path: &Path,
    modules: &[(String, usize, usize)],
    r: usize,
    (a_name, b_name): (&str, &str),
    transposed: bool,
    device: &candle_core::Device,
    split: impl Fn(&str) -> Result<(String, usize), String>,
) -> Result<BTreeMap<String, (Var, Var)>, ModelError> {
    let st_err = |m: String| ModelError::file(path, m);
    let bytes = std::fs::read(path).map_err(|e| st_err(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| st_err(e.to_string()))?;
    let shapes: BTreeMap<&str, (usize, usize)> = modules
        .iter()
        .map(|(m, i, o)| (m.as_str(), (*i, *o)))
        .collect();
    let mut halves: BTreeMap<String, (Option<Var>, Option<Var>)> = BTreeMap::new();
    for (name, view) in st.tensors() {
        let (module, which) = split(&name).map_err(&st_err)?;
        let &(inputs, outputs) = shapes.get(module.as_str()).ok_or_else(|| {
            st_err(format!(
                "tensor `{name}`: the model has no Linear `{module}`"
            ))
        })?;
        let mut expect = if which == 0 {
            vec![r, inputs]
        } else {
            vec![outputs, r]
        };
        if transposed {
            expect.reverse();
        }
        if view.shape() != expect.as_slice() {
            return Err(st_err(format!(
                "tensor `{name}` has shape {:?}, expected {expect:?}",
                view.shape()
            )));
        }
        let data = decode_float(view.dtype(), view.data()).ok_or_else(|| {
            st_err(format!(
                "tensor `{name}` has dtype {:?} (expected F32, BF16 or F16)",
                view.dtype()
            ))
        })?;
        let mut t = Tensor::from_vec(data, expect.as_slice(), device)?;
        if transposed {
            t = t.t()?.contiguous()?;
        }
        let var = Var::from_tensor(&t)?;
        let e = halves.entry(module).or_default();
        if which == 0 {
            e.0 = Some(var);
        } else {
            e.1 = Some(var);
        }
    }
    let mut pairs = BTreeMap::new();
    for (module, (a, b)) in halves {
        let (Some(a), Some(b)) = (a, b) else {
            return Err(st_err(format!(
                "`{module}` has only one of {a_name} / {b_name}"
            )));
        };
        pairs.insert(module, (a, b));
    }
    if pairs.is_empty() {
        return Err(st_err("holds no LoRA tensors".into()));
    }
    Ok(pairs)
}

/// Writes f32 `tensors` (name, shape, values) to the safetensors file `path`.
fn write_f32(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    metadata: Option<std::collections::HashMap<String, String>>,
) -> Result<(), ModelError> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, v)| {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                d.clone(),
                bytemuck::cast_slice(v),
            )
            .map(|t| (n.clone(), t))
            .map_err(|e| ModelError::Tensor {
                tensor: n.clone(),
                message: e.to_string(),
            })
        })
        .collect::<Result<_, _>>()?;
    safetensors::serialize_to_file(views, metadata, path).map_err(|e| ModelError::file(path, e))
}

impl Adapters {
    /// New adapters on every Linear of `model` that `spec` targets: `A` Kaiming-uniform from
    /// `seed`, `B` zero (PEFT's default initialisation). No Linear targeted is an error
    /// naming the targets.
    pub fn new(model: &DecoderModel, spec: &LoraSpec, seed: u64) -> Result<Self, ModelError> {
        Self::new_for(&linear_modules(model), spec, seed, model.device())
    }

    /// [`Adapters::new`] for the Linear layers `modules` ([`linear_modules_of`]), on `device`.
    pub fn new_for(
        modules: &[(String, usize, usize)],
        spec: &LoraSpec,
        seed: u64,
        device: &candle_core::Device,
    ) -> Result<Self, ModelError> {
        if spec.r == 0 {
            return Err(ModelError::Config("LoRA rank r must be at least 1".into()));
        }
        let mut rng = SplitMix(seed);
        let mut layers = BTreeMap::new();
        for (module, inputs, outputs) in modules.iter().cloned() {
            if !spec.targets(&module) {
                continue;
            }
            let bound = 1.0 / (inputs as f32).sqrt();
            let a: Vec<f32> = (0..spec.r * inputs).map(|_| rng.uniform(bound)).collect();
            let a = Var::from_vec(a, (spec.r, inputs), device)?;
            let b = Var::zeros((outputs, spec.r), DType::F32, device)?;
            layers.insert(module, LoraLayer::of(a, b, spec));
        }
        if layers.is_empty() {
            return Err(ModelError::Config(format!(
                "LoRA target modules {:?} match no Linear layer of the model",
                spec.target_modules
            )));
        }
        Ok(Adapters {
            layers,
            spec: spec.clone(),
            training: false,
            rng: std::sync::Arc::new(DropoutRng::new(seed ^ 0x6472_6f70)),
        })
    }

    /// The adapter at `module`, if any.
    pub fn get(&self, module: &str) -> Option<&LoraLayer> {
        self.layers.get(module)
    }

    /// Every adapter, by module path.
    pub fn layers(&self) -> &BTreeMap<String, LoraLayer> {
        &self.layers
    }

    /// The settings the adapters were made with.
    pub fn spec(&self) -> &LoraSpec {
        &self.spec
    }

    /// Whether dropout is applied (training) or not (evaluation, reference passes).
    pub fn training(&self) -> bool {
        self.training
    }

    /// The dropout generator while training, `None` otherwise.
    pub fn dropout_rng(&self) -> Option<&DropoutRng> {
        self.training.then_some(&*self.rng)
    }

    /// The dropout stream's position (saved with a resumable checkpoint).
    pub fn dropout_state(&self) -> u64 {
        self.rng.state()
    }

    /// Moves the dropout stream to `state` (a resumed run); shared by every copy.
    pub fn set_dropout_state(&self, state: u64) {
        self.rng.0.store(state, std::sync::atomic::Ordering::SeqCst);
    }

    /// The same adapters drawing dropout masks from a stream at `state` (a seed, or a saved
    /// position when a run resumes).
    pub fn with_dropout_state(&self, state: u64) -> Self {
        Adapters {
            rng: std::sync::Arc::new(DropoutRng::new(state)),
            ..self.clone()
        }
    }

    /// The same adapters (shared variables) with dropout on or off.
    pub fn set_training(&self, training: bool) -> Self {
        Adapters {
            training,
            ..self.clone()
        }
    }

    /// A copy of the adapters in new storage, which later training does not move (TRL's "ref"
    /// adapter when DPO continues an existing one).
    pub fn frozen_copy(&self) -> Result<Self, ModelError> {
        let mut layers = BTreeMap::new();
        for (m, l) in &self.layers {
            layers.insert(
                m.clone(),
                LoraLayer {
                    a: Var::from_tensor(&l.a.as_tensor().copy()?)?,
                    b: Var::from_tensor(&l.b.as_tensor().copy()?)?,
                    ..l.clone()
                },
            );
        }
        Ok(Adapters {
            layers,
            spec: self.spec.clone(),
            training: false,
            rng: self.rng.clone(),
        })
    }

    /// Every trainable variable, by PEFT's tensor name.
    pub fn vars(&self) -> Vec<(String, Var)> {
        let mut out = Vec::with_capacity(self.layers.len() * 2);
        for (m, l) in &self.layers {
            out.push((format!("base_model.model.{m}.lora_A.weight"), l.a.clone()));
            out.push((format!("base_model.model.{m}.lora_B.weight"), l.b.clone()));
        }
        out
    }

    /// The `target_modules` PEFT needs to adapt exactly these layers: the leaf names when
    /// they select nothing more, else the full module paths.
    pub fn peft_target_modules(&self, all: &[(String, usize, usize)]) -> Vec<String> {
        let leaves: BTreeSet<&str> = self
            .layers
            .keys()
            .map(|m| m.rsplit('.').next().unwrap_or(m))
            .collect();
        let by_leaf = all
            .iter()
            .filter(|(m, _, _)| leaves.contains(m.rsplit('.').next().unwrap_or(m)))
            .count();
        if by_leaf == self.layers.len() {
            leaves.into_iter().map(str::to_string).collect()
        } else {
            self.layers.keys().cloned().collect()
        }
    }

    /// Writes PEFT's `adapter_model.safetensors` and `adapter_config.json` into `dir`.
    pub fn save_peft(
        &self,
        dir: &Path,
        model: &DecoderModel,
        base_model: &str,
    ) -> Result<(), ModelError> {
        self.save_peft_for(dir, &linear_modules(model), base_model)
    }

    /// [`Adapters::save_peft`] for a model whose Linear layers are `modules`.
    pub fn save_peft_for(
        &self,
        dir: &Path,
        modules: &[(String, usize, usize)],
        base_model: &str,
    ) -> Result<(), ModelError> {
        let mut tensors = Vec::new();
        for (name, var) in self.vars() {
            let t = var.as_tensor().to_dtype(DType::F32)?;
            tensors.push((name, t.dims().to_vec(), t.flatten_all()?.to_vec1()?));
        }
        let metadata = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        write_f32(
            &dir.join("adapter_model.safetensors"),
            &tensors,
            Some(metadata),
        )?;
        let io = |path: &Path, e: String| ModelError::file(path, e);
        let s = &self.spec;
        let config = json!({
            "alpha_pattern": {},
            "auto_mapping": null,
            "base_model_name_or_path": base_model,
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "layers_pattern": null,
            "layers_to_transform": null,
            "lora_alpha": s.alpha,
            "lora_dropout": s.dropout,
            "modules_to_save": null,
            "peft_type": "LORA",
            "r": s.r,
            "rank_pattern": {},
            "revision": null,
            "target_modules": self.peft_target_modules(modules),
            "task_type": "CAUSAL_LM",
            "use_dora": false,
            "use_rslora": s.rslora,
        });
        let path = dir.join("adapter_config.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&config).expect("JSON") + "\n",
        )
        .map_err(|e| io(&path, e.to_string()))
    }

    /// Writes mlx-lm's adapter layout into `dir`: `adapters.safetensors` (per adapted Linear
    /// `<module>.lora_a` `[in, r]` = `Aᵀ` and `<module>.lora_b` `[r, out]` = `Bᵀ`) and
    /// `adapter_config.json` (`fine_tune_type` lora, `num_layers`, `lora_parameters` with
    /// `rank`, `scale` = kiln's α/r or α/√r, `dropout` and the layer-relative `keys`).
    /// mlx-lm adapts the same keys in the last `num_layers` layers of `layers` (every layer's
    /// `model.layers.<i>.` paths): adapters it cannot express that way are an error.
    pub fn save_mlx_lm(&self, dir: &Path, layers: usize) -> Result<(), ModelError> {
        let mut keys: BTreeSet<String> = BTreeSet::new();
        let mut by_layer: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
        for m in self.layers.keys() {
            let rest = m.strip_prefix("model.layers.").and_then(|r| {
                let (i, key) = r.split_once('.')?;
                Some((i.parse::<usize>().ok()?, key.to_string()))
            });
            let Some((i, key)) = rest else {
                return Err(ModelError::Config(format!(
                    "mlx-lm adapters live in decoder layers; `{m}` is not in one (use --adapter-format peft)"
                )));
            };
            keys.insert(key.clone());
            by_layer.entry(i).or_default().insert(key);
        }
        let first = by_layer.keys().next().copied().unwrap_or(layers);
        let uniform = (first..layers).all(|i| by_layer.get(&i) == Some(&keys));
        if !uniform {
            return Err(ModelError::Config(
                "mlx-lm adapts the same modules in the last N layers; these adapters cover another set (use --adapter-format peft)".into(),
            ));
        }
        let mut tensors = Vec::new();
        for (m, l) in &self.layers {
            for (suffix, v) in [("lora_a", &l.a), ("lora_b", &l.b)] {
                let t = v.as_tensor().t()?.contiguous()?.to_dtype(DType::F32)?;
                let dims = t.dims().to_vec();
                tensors.push((format!("{m}.{suffix}"), dims, t.flatten_all()?.to_vec1()?));
            }
        }
        write_f32(&dir.join("adapters.safetensors"), &tensors, None)?;
        let io = |path: &Path, e: String| ModelError::file(path, e);
        let s = &self.spec;
        let config = json!({
            "fine_tune_type": "lora",
            "num_layers": layers - first,
            "lora_parameters": {
                "rank": s.r,
                "scale": s.scale(),
                "dropout": s.dropout,
                "keys": keys,
            },
        });
        let path = dir.join("adapter_config.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&config).expect("JSON") + "\n",
        )
        .map_err(|e| io(&path, e.to_string()))
    }

    /// Reads an adapter folder in PEFT's layout or mlx-lm's (`adapters.safetensors`), for a
    /// model whose Linear layers are `modules`.
    pub fn load_any_for(
        dir: &Path,
        modules: &[(String, usize, usize)],
        device: &candle_core::Device,
    ) -> Result<Self, ModelError> {
        if dir.join("adapters.safetensors").is_file()
            && !dir.join("adapter_model.safetensors").is_file()
        {
            Self::load_mlx_lm_for(dir, modules, device)
        } else {
            Self::load_peft_for(dir, modules, device)
        }
    }

    /// Reads mlx-lm's adapter layout (see [`Adapters::save_mlx_lm`]): α is taken as
    /// `scale · r`, so the adapters compute what mlx-lm computes.
    pub fn load_mlx_lm_for(
        dir: &Path,
        modules: &[(String, usize, usize)],
        device: &candle_core::Device,
    ) -> Result<Self, ModelError> {
        let cfg_path = dir.join("adapter_config.json");
        let err = |m: String| ModelError::file(&cfg_path, m);
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| err(e.to_string()))?;
        let cfg: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        if cfg
            .get("fine_tune_type")
            .and_then(Value::as_str)
            .unwrap_or("lora")
            != "lora"
        {
            return Err(err(format!(
                "`fine_tune_type` {} is not lora",
                cfg["fine_tune_type"]
            )));
        }
        let p = cfg
            .get("lora_parameters")
            .ok_or_else(|| err("`lora_parameters` is missing".into()))?;
        let r = p
            .get("rank")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| err("`lora_parameters.rank` must be a positive integer".into()))?
            as usize;
        let scale = p
            .get("scale")
            .and_then(Value::as_f64)
            .ok_or_else(|| err("`lora_parameters.scale` must be a number".into()))?;
        let pairs = read_pairs(
            &dir.join("adapters.safetensors"),
            modules,
            r,
            ("lora_a", "lora_b"),
            true,
            device,
            |name| {
                if let Some(m) = name.strip_suffix(".lora_a") {
                    Ok((m.to_string(), 0))
                } else if let Some(m) = name.strip_suffix(".lora_b") {
                    Ok((m.to_string(), 1))
                } else {
                    Err(format!(
                        "tensor `{name}` is not an mlx-lm LoRA tensor (lora_a / lora_b)"
                    ))
                }
            },
        )?;
        let spec = LoraSpec {
            r,
            alpha: scale * r as f64,
            dropout: p.get("dropout").and_then(Value::as_f64).unwrap_or(0.0),
            rslora: false,
            target_modules: pairs
                .keys()
                .map(|m| m.rsplit('.').next().unwrap_or(m).to_string())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
        };
        Ok(Adapters::of_pairs(pairs, spec))
    }

    /// Reads a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) for
    /// `model`: every tensor must name a Linear of the model with the right shape.
    pub fn load_peft(dir: &Path, model: &DecoderModel) -> Result<Self, ModelError> {
        Self::load_peft_for(dir, &linear_modules(model), model.device())
    }

    /// [`Adapters::load_peft`] for a model whose Linear layers are `modules`, onto `device`.
    pub fn load_peft_for(
        dir: &Path,
        modules: &[(String, usize, usize)],
        device: &candle_core::Device,
    ) -> Result<Self, ModelError> {
        let cfg_path = dir.join("adapter_config.json");
        let err = |m: String| ModelError::file(&cfg_path, m);
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| err(e.to_string()))?;
        let cfg: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        if cfg.get("peft_type").and_then(Value::as_str) != Some("LORA") {
            return Err(err("`peft_type` is not \"LORA\"".into()));
        }
        let r = cfg
            .get("r")
            .and_then(Value::as_u64)
            .filter(|&r| r > 0)
            .ok_or_else(|| err("`r` must be a positive integer".into()))? as usize;
        let alpha = cfg
            .get("lora_alpha")
            .and_then(Value::as_f64)
            .ok_or_else(|| err("`lora_alpha` must be a number".into()))?;
        for (key, ok) in [
            ("use_dora", Value::Bool(false)),
            ("fan_in_fan_out", Value::Bool(false)),
        ] {
            if cfg.get(key).is_some_and(|v| !v.is_null() && *v != ok) {
                return Err(err(format!("`{key}` = {} is not supported", cfg[key])));
            }
        }
        if cfg
            .get("bias")
            .and_then(Value::as_str)
            .is_some_and(|b| b != "none")
        {
            return Err(err("only `bias: \"none\"` adapters are supported".into()));
        }
        let targets = match cfg.get("target_modules") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| err("`target_modules` must be a list of names".into()))?,
            Some(Value::String(s)) => vec![s.clone()],
            _ => return Err(err("`target_modules` is missing".into())),
        };
        let spec = LoraSpec {
            r,
            alpha,
            dropout: cfg
                .get("lora_dropout")
                .and_then(Value::as_f64)
                .unwrap_or(0.0),
            rslora: cfg
                .get("use_rslora")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            target_modules: targets,
        };
        let pairs = read_pairs(
            &dir.join("adapter_model.safetensors"),
            modules,
            r,
            ("lora_A", "lora_B"),
            false,
            device,
            |name| {
                let rest = name
                    .strip_prefix("base_model.model.")
                    .ok_or_else(|| format!("tensor `{name}` is not a PEFT LoRA tensor"))?;
                if let Some(m) = rest.strip_suffix(".lora_A.weight") {
                    Ok((m.to_string(), 0))
                } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
                    Ok((m.to_string(), 1))
                } else {
                    Err(format!(
                        "tensor `{name}` is not a LoRA A/B weight (only LoRA on Linear layers is supported)"
                    ))
                }
            },
        )?;
        Ok(Adapters::of_pairs(pairs, spec))
    }

    /// Adapters of `spec` from their `A`, `B` pairs by module.
    fn of_pairs(pairs: BTreeMap<String, (Var, Var)>, spec: LoraSpec) -> Self {
        let layers = pairs
            .into_iter()
            .map(|(m, (a, b))| (m, LoraLayer::of(a, b, &spec)))
            .collect();
        Adapters {
            layers,
            spec,
            training: false,
            rng: std::sync::Arc::new(DropoutRng::new(0x6472_6f70)),
        }
    }

    /// `W + s·B·A` for every adapted Linear: the merged weights by tensor name (`--merge`).
    pub fn merged(&self, model: &DecoderModel) -> Result<BTreeMap<String, Tensor>, ModelError> {
        let mut out = BTreeMap::new();
        for (m, l) in &self.layers {
            let name = format!("{m}.weight");
            let w = model.weights().get(&name)?;
            let delta =
                l.b.as_tensor()
                    .matmul(l.a.as_tensor())?
                    .affine(l.scale, 0.0)?
                    .to_dtype(w.dtype())?;
            out.insert(name, (w + delta)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peft_target_names_match_by_suffix_and_globs_match_paths() {
        let spec = LoraSpec {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            rslora: false,
            target_modules: vec!["q_proj".into(), "model.layers.*.mlp.down_proj".into()],
        };
        assert!(spec.targets("model.layers.0.self_attn.q_proj"));
        assert!(!spec.targets("model.layers.0.self_attn.qq_proj"));
        assert!(spec.targets("model.layers.11.mlp.down_proj"));
        assert!(!spec.targets("model.layers.1.mlp.up_proj"));
        assert_eq!(spec.scale(), 2.0);
        let all = LoraSpec {
            target_modules: vec!["all-linear".into()],
            rslora: true,
            ..spec
        };
        assert!(all.targets("model.layers.0.mlp.up_proj") && !all.targets("lm_head"));
        assert_eq!(all.scale(), 4.0);
    }

    /// Target globs mean what `--exclude` globs mean (one matcher): `?` and classes too.
    #[test]
    fn target_globs_read_as_exclude_globs() {
        let spec = LoraSpec {
            r: 4,
            alpha: 8.0,
            dropout: 0.0,
            rslora: false,
            target_modules: vec!["*.[qv]_proj".into(), "model.layers.?.mlp.down_proj".into()],
        };
        assert!(spec.targets("model.layers.0.self_attn.q_proj"));
        assert!(spec.targets("model.layers.0.self_attn.v_proj"));
        assert!(!spec.targets("model.layers.0.self_attn.k_proj"));
        assert!(spec.targets("model.layers.3.mlp.down_proj"));
        assert!(!spec.targets("model.layers.13.mlp.down_proj"));
    }
}
