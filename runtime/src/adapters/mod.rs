//! LoRA adapters' files: PEFT's (`adapter_model.safetensors` with
//! `base_model.model.<m>.lora_A.weight`, `…lora_B.weight`, and `adapter_config.json`) and
//! mlx-lm's (`adapters.safetensors`, `adapter_config.json`), read and written for
//! [`Adapters`] (docs/TRAINING.md §4).

pub mod gguf;

use crate::model::lora::{Adapters, LoraSpec, linear_modules};
use crate::model::{DecoderModel, ModelError};
use candle_core::{DType, Tensor, Var};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

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
    split: impl Fn(&str) -> Result<Option<(String, usize)>, String>,
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
        let Some((module, which)) = split(&name).map_err(&st_err)? else {
            continue;
        };
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
        let data =
            crate::checkpoint::floats::to_f32(view.dtype(), view.data()).ok_or_else(|| {
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

    /// [`Adapters::save_peft_for`] of a sequence classifier (a reward model): the `score` head
    /// trained in full beside the adapters, written as PEFT's `SEQ_CLS` task writes it
    /// (`base_model.model.score.weight`, `modules_to_save` `["classifier", "score"]`).
    pub fn save_peft_classifier(
        &self,
        dir: &Path,
        modules: &[(String, usize, usize)],
        base_model: &str,
        score: &Tensor,
    ) -> Result<(), ModelError> {
        self.save_peft_with(dir, modules, base_model, Some(score))
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
        self.save_peft_with(dir, modules, base_model, None)
    }

    fn save_peft_with(
        &self,
        dir: &Path,
        modules: &[(String, usize, usize)],
        base_model: &str,
        score: Option<&Tensor>,
    ) -> Result<(), ModelError> {
        let mut tensors = Vec::new();
        for (name, var) in self.vars() {
            let t = var.as_tensor().to_dtype(DType::F32)?;
            tensors.push((name, t.dims().to_vec(), t.flatten_all()?.to_vec1()?));
        }
        if let Some(t) = score {
            let t = t.to_dtype(DType::F32)?;
            tensors.push((
                format!("base_model.model.{}", crate::model::SCORE),
                t.dims().to_vec(),
                t.flatten_all()?.to_vec1()?,
            ));
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
            "modules_to_save": score.map(|_| json!(["classifier", "score"])),
            "peft_type": "LORA",
            "r": s.r,
            "rank_pattern": {},
            "revision": null,
            "target_modules": self.peft_target_modules(modules),
            "task_type": if score.is_some() { "SEQ_CLS" } else { "CAUSAL_LM" },
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
                    Ok(Some((m.to_string(), 0)))
                } else if let Some(m) = name.strip_suffix(".lora_b") {
                    Ok(Some((m.to_string(), 1)))
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
        let classifier = cfg.get("task_type").and_then(Value::as_str) == Some("SEQ_CLS");
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
                    Ok(Some((m.to_string(), 0)))
                } else if let Some(m) = rest.strip_suffix(".lora_B.weight") {
                    Ok(Some((m.to_string(), 1)))
                } else if rest == crate::model::SCORE && classifier {
                    // A sequence classifier's head, trained in full (`modules_to_save`):
                    // read by `peft_classifier_head`.
                    Ok(None)
                } else {
                    Err(format!(
                        "tensor `{name}` is not a LoRA A/B weight (only LoRA on Linear layers is supported)"
                    ))
                }
            },
        )?;
        Ok(Adapters::of_pairs(pairs, spec))
    }
}

/// A tensor on the host: its shape and f32 values.
pub type HostHead = (Vec<usize>, Vec<f32>);

/// The `score` head a PEFT adapter of a sequence classifier (`task_type` `SEQ_CLS`) holds
/// beside its LoRA tensors (`base_model.model.score.weight`, PEFT's `modules_to_save`), as
/// `(shape, values)`; `None` when the folder has no such head.
pub fn peft_classifier_head(dir: &Path) -> Result<Option<HostHead>, ModelError> {
    let path = dir.join("adapter_model.safetensors");
    if !path.is_file() {
        return Ok(None);
    }
    let err = |m: String| ModelError::file(&path, m);
    let bytes = std::fs::read(&path).map_err(|e| err(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| err(e.to_string()))?;
    let name = format!("base_model.model.{}", crate::model::SCORE);
    let Ok(view) = st.tensor(&name) else {
        return Ok(None);
    };
    let data = crate::checkpoint::floats::to_f32(view.dtype(), view.data()).ok_or_else(|| {
        err(format!(
            "tensor `{name}` has dtype {:?} (expected F32, BF16 or F16)",
            view.dtype()
        ))
    })?;
    Ok(Some((view.shape().to_vec(), data)))
}

/// The full-precision checkpoint `base` with the PEFT adapter at `adapter` merged into its
/// weights — `W + s·B·A` as PEFT's `merge_and_unload` computes it (the delta in f32, rounded to
/// the weight's dtype, then added in that dtype) — written tensor by tensor into the new folder
/// `out` with the base's config, tokenizer and generation files: what `kiln export --adapter`
/// quantizes. Memory holds one tensor at a time. A quantized base is refused (merging into its
/// codes would quantize twice).
pub fn merge_checkpoint(
    base: &crate::checkpoint::Checkpoint,
    adapter: &Path,
    out: &Path,
) -> Result<Vec<String>, ModelError> {
    if let Some(key) = crate::model::quantization_marker(base) {
        return Err(ModelError::file(
            base.dir(),
            format!(
                "is a quantized export (`{key}`): merge the adapter into the original \
                 full-precision model, then quantize"
            ),
        ));
    }
    let modules = crate::model::lora::linear_modules_of(
        base.tensors()
            .map(|t| (t.name.as_str(), t.shape.as_slice())),
    );
    let a = Adapters::load_peft_for(adapter, &modules, &candle_core::Device::Cpu)?;
    std::fs::create_dir_all(out).map_err(|e| ModelError::file(out, e.to_string()))?;
    let mut shards = crate::sink::ShardWriter::new(out, 5_000_000_000);
    let sink = |e: crate::sink::SinkError| ModelError::file(out, e.to_string());
    for t in base.tensors() {
        let layer = t.name.strip_suffix(".weight").and_then(|m| a.get(m));
        let (dtype, data) = match layer {
            Some(l) => {
                let dt = match t.dtype {
                    safetensors::Dtype::BF16 => DType::BF16,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::F32 => DType::F32,
                    other => {
                        return Err(ModelError::Tensor {
                            tensor: t.name.clone(),
                            message: format!("{other:?}: an adapter merges into float weights"),
                        });
                    }
                };
                let w = Tensor::from_vec(
                    crate::model::f32s(base, &t.name)?,
                    t.shape.as_slice(),
                    &candle_core::Device::Cpu,
                )?
                .to_dtype(dt)?;
                let delta =
                    l.b.as_tensor()
                        .matmul(l.a.as_tensor())?
                        .affine(l.scale, 0.0)?
                        .to_dtype(dt)?;
                let merged = (w + delta)?.flatten_all()?;
                let bytes: Vec<u8> = match dt {
                    DType::BF16 => merged
                        .to_vec1::<half::bf16>()?
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect(),
                    DType::F16 => merged
                        .to_vec1::<half::f16>()?
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect(),
                    _ => merged
                        .to_vec1::<f32>()?
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect(),
                };
                (t.dtype, bytes)
            }
            None => {
                let mut b = Vec::new();
                base.read(&t.name, &mut b)?;
                (t.dtype, b)
            }
        };
        shards
            .write(&t.name, dtype, &t.shape, &data)
            .map_err(sink)?;
    }
    let written = shards.finish().map_err(sink)?;
    let mut files = written.files;
    for name in
        std::iter::once("config.json").chain(crate::export::files::COPIED_FILES.iter().copied())
    {
        let src = base.dir().join(name);
        if src.is_file() {
            std::fs::copy(&src, out.join(name))
                .map_err(|e| ModelError::file(&src, e.to_string()))?;
            files.push(name.to_string());
        }
    }
    Ok(files)
}
