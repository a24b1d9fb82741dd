//! LoRA adapters on a model's Linear layers, as PEFT defines them: a Linear `W` at module `m`
//! computes `x·Wᵀ + (dropout(x)·Aᵀ)·Bᵀ · s` with `A [r, in]`, `B [out, r]` and
//! `s = α / r` (`α / √r` with rsLoRA). `A` starts Kaiming-uniform (bound `1/√in`), `B` at zero,
//! so a new adapter leaves the model's output unchanged. Their files (PEFT's, mlx-lm's) are
//! read and written by [`crate::adapters`].

use super::{DecoderModel, ModelError, linear};
use candle_core::{DType, Tensor, Var};

use std::collections::BTreeMap;

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
    /// `.<name>`; `all-linear` takes every Linear but the output layer (`lm_head`, a classifier's `score`); a name with `*`
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
                // PEFT leaves out the output layer (and a classifier's head, trained in full).
                module != "lm_head" && module != "score"
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
        let mut g = crate::rng::SplitMix64(start);
        (0..n)
            .map(|_| if g.uniform() >= p { 1.0 } else { 0.0 })
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
    pub(crate) layers: BTreeMap<String, LoraLayer>,
    pub(crate) spec: LoraSpec,
    pub(crate) training: bool,
    pub(crate) rng: std::sync::Arc<DropoutRng>,
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
    let packed: Vec<(String, [usize; 2])> = model
        .weights()
        .packed()
        .iter()
        .map(|(name, p)| (name.clone(), [p.rows(), p.cols()]))
        .collect();
    let mut all: Vec<(&str, &[usize])> = model
        .weights()
        .vars()
        .iter()
        .map(|(name, v)| (name.as_str(), v.as_tensor().dims()))
        .chain(packed.iter().map(|(n, d)| (n.as_str(), &d[..])))
        .collect();
    all.sort_by(|a, b| a.0.cmp(b.0));
    linear_modules_of(all)
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

/// A uniform value in `[−bound, bound)` (adapter initialisation).
fn symmetric(rng: &mut crate::rng::SplitMix64, bound: f32) -> f32 {
    (2.0 * rng.uniform_f32() - 1.0) * bound
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
        let mut rng = crate::rng::SplitMix64(seed);
        let mut layers = BTreeMap::new();
        for (module, inputs, outputs) in modules.iter().cloned() {
            if !spec.targets(&module) {
                continue;
            }
            let bound = 1.0 / (inputs as f32).sqrt();
            let a: Vec<f32> = (0..spec.r * inputs)
                .map(|_| symmetric(&mut rng, bound))
                .collect();
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

    /// Adapters of `spec` from their `A`, `B` pairs by module.
    pub(crate) fn of_pairs(pairs: BTreeMap<String, (Var, Var)>, spec: LoraSpec) -> Self {
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
