//! Training on MLX under the shared loop (`train/driver.rs`): the model's arrays (or LoRA's `A`
//! and `B` beside the frozen base weights) are the arguments `value_and_grad` differentiates;
//! the data, tokenisation, LoRA plan (initialisation, dropout streams, PEFT files), losses,
//! schedules and logging are the candle backend's, so both backends train the same way.

use super::model::{MlxDecoder, MlxLora, MlxWeights, mlx_err};
use super::ops::MlxOps;
use crate::checkpoint::Checkpoint;
use crate::model::generate::{Rng, SamplingConfig};
use crate::model::lora::{Adapters, LoraSpec, linear_modules_of};
use crate::train::checkpoint::HostTensor;
use crate::train::config_err;
use crate::train::data::TextTokenizer;
use crate::train::driver::{Stepper, drive, eval_figures, evaluation};
use crate::train::grpo::GrpoTask;
use crate::train::ops::TensorOps;
use crate::train::runner::{Runner, Shifted};
use crate::train::task::{Backend, Host, Task};
use crate::train::{TrainConfig, TrainError, TrainObserver, TrainReport};
use mlx_rs::Array;
use mlx_rs::error::Exception;
use mlx_rs::ops;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const BACKEND: &str = "mlx";

fn backend_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Backend {
        backend: BACKEND.into(),
        message: e.to_string(),
    }
}

/// The model, its trainable arrays and the tokenizer, ready to train on MLX.
pub struct MlxSetup {
    /// The run's configuration.
    pub config: TrainConfig,
    decoder: MlxDecoder,
    /// Every weight; under LoRA these stay as loaded.
    base: MlxWeights,
    /// LoRA: the adapters' plan (targets, scale, dropout stream, PEFT files); candle holds
    /// their storage on the CPU for initialisation and saving only.
    adapters: Option<Adapters>,
    /// The Linear layers (module, inputs, outputs).
    modules: Vec<(String, usize, usize)>,
    /// The trainable arrays' names (PEFT's for adapters, the tensor names otherwise).
    names: Vec<String>,
    /// The model's tokenizer.
    pub tokenizer: TextTokenizer,
    /// A reward model under LoRA: the last trainable array is its `score` head, trained in
    /// full beside the adapters.
    head_param: bool,
    /// What the run substitutes for something the model lacks, by name.
    notes: Vec<String>,
    /// PPO's value model: its decoder and its weights' names; its arrays are the last
    /// `names.len()` trainable ones (named `value_model.<name>` in `names` above).
    value: Option<(MlxDecoder, Vec<String>)>,
    /// TRL's `gradient_checkpointing`: the policy's layers checkpointed while it trains.
    checkpointing: bool,
}

impl MlxSetup {
    /// Loads the model named by `config` (f32) and makes or loads its adapters.
    pub fn load(config: &TrainConfig) -> Result<(Self, Vec<Array>), TrainError> {
        if config.merge && config.lora.is_none() && config.init_adapter.is_none() {
            return Err(config_err(
                "merge",
                "--merge needs LoRA (full fine-tuning already writes full weights)",
            ));
        }
        if config.bf16()? {
            return Err(config_err(
                "bf16",
                "bf16 mixed precision is built for the candle backend (--backend candle); the MLX backend trains in f32",
            ));
        }
        // QLoRA on MLX: mlx-lm's own layout, run with MLX's quantized_matmul; the other
        // quantized layouts kiln reads train on candle (their decode is kiln's, not MLX's).
        if crate::train::quantized_base(config)?
            && let Some(d) = crate::formats::detect(&config.model)?
            && d.writer != "mlx"
        {
            return Err(config_err(
                "model",
                format!(
                    "{} is a `{}` export: QLoRA on the MLX backend runs mlx-lm's quantized \
                     layout (quantized_matmul); --backend candle trains over every layout \
                     kiln reads",
                    config.model.display(),
                    d.writer
                ),
            ));
        }
        let checkpoint = Checkpoint::open(&config.model).map_err(crate::model::ModelError::from)?;
        let (mut decoder, mut base) = MlxDecoder::load(&checkpoint)?;
        let tokenizer = TextTokenizer::from_model_dir(&config.model)?;
        let mut notes = Vec::new();
        let reward = config.task == "reward";
        if reward {
            // A reward model: transformers' sequence classifier, its `score` head new unless
            // the checkpoint has one.
            let (d, note) = decoder.with_score_head(&mut base, config.hyper.seed)?;
            decoder = d;
            notes.extend(note);
            if let Some(dir) = &config.init_adapter
                && let Some((dims, values)) = crate::adapters::peft_classifier_head(dir)?
            {
                let want = [1, decoder.config().hidden];
                if dims != want {
                    return Err(config_err(
                        "init_adapter",
                        format!(
                            "{}: `base_model.model.score.weight` has shape {dims:?}, the model's head {want:?}",
                            dir.display()
                        ),
                    ));
                }
                base.insert(
                    crate::model::SCORE.into(),
                    Array::from_slice(&values, &[1, want[1] as i32]),
                );
                notes.retain(|n| !n.starts_with("score.weight: "));
            }
        }
        let shapes: Vec<(String, Vec<usize>)> = base
            .iter()
            .map(|(n, a)| (n.clone(), decoder.logical_shape(n, a)))
            .collect();
        let modules = linear_modules_of(shapes.iter().map(|(n, s)| (n.as_str(), s.as_slice())));
        let cpu = candle_core::Device::Cpu;
        let adapters = match (&config.lora, &config.init_adapter) {
            (None, None) => None,
            (_, Some(dir)) => Some(Adapters::load_any_for(dir, &modules, &cpu)?),
            (Some(l), None) => {
                let spec = LoraSpec {
                    r: l.r,
                    alpha: l.lora_alpha,
                    dropout: l.lora_dropout,
                    rslora: l.use_rslora,
                    target_modules: l.target_modules.clone(),
                };
                Some(Adapters::new_for(&modules, &spec, config.hyper.seed, &cpu)?)
            }
        };
        // The dropout stream seeded as the candle backend seeds it.
        // Dropout while training, unless the task disables it (TRL's disable_dropout).
        let dropout = !config.disable_dropout()?;
        let adapters = adapters.map(|a| {
            a.with_dropout_state(config.hyper.seed ^ 0x6472_6f70)
                .set_training(dropout)
        });
        let adapters_on = adapters.is_some();
        let (names, params) = match &adapters {
            Some(a) => {
                let mut names = Vec::new();
                let mut params = Vec::new();
                for (name, var) in a.vars() {
                    params.push(to_array(var.as_tensor())?);
                    names.push(name);
                }
                if reward {
                    params.push(base[crate::model::SCORE].clone());
                    names.push(crate::model::SCORE.into());
                }
                (names, params)
            }
            None => base.iter().map(|(n, a)| (n.clone(), a.clone())).unzip(),
        };
        let (mut names, mut params): (Vec<String>, Vec<Array>) = (names, params);
        let value = match crate::train::value_model_dir(config)? {
            Some(dir) => {
                let err =
                    |m: String| config_err("value_model_path", format!("{}: {m}", dir.display()));
                let c = Checkpoint::open(&dir).map_err(|e| err(e.to_string()))?;
                let (d, mut w) = MlxDecoder::load(&c).map_err(|e| err(e.to_string()))?;
                let (d, note) = d.with_score_head(&mut w, config.hyper.seed ^ 0x7661_6c75)?;
                notes.extend(note.map(|n| format!("value model: {n}")));
                let mut value_names = Vec::with_capacity(w.len());
                for (n, a) in w {
                    names.push(format!("{}{n}", crate::train::VALUE_PREFIX));
                    params.push(a);
                    value_names.push(n);
                }
                Some((d, value_names))
            }
            None => None,
        };
        Ok((
            MlxSetup {
                config: config.clone(),
                decoder,
                base,
                adapters,
                modules,
                names,
                tokenizer,
                head_param: reward && adapters_on,
                notes,
                value,
                checkpointing: config.gradient_checkpointing()?,
            },
            params,
        ))
    }

    /// How many trainable arrays are the policy's (the value model's follow them).
    fn policy_params(&self) -> usize {
        self.names.len() - self.value.as_ref().map_or(0, |(_, n)| n.len())
    }

    /// The value model's weights, given the trainable arrays.
    fn value_weights(&self, params: &[Array]) -> Option<MlxWeights> {
        let (_, names) = self.value.as_ref()?;
        let start = self.policy_params();
        Some(
            names
                .iter()
                .cloned()
                .zip(params[start..].iter().cloned())
                .collect(),
        )
    }

    /// The weights and adapters a forward pass runs with, given the trainable arrays.
    fn parts(&self, params: &[Array]) -> (MlxWeights, BTreeMap<String, MlxLora>) {
        let params = &params[..self.policy_params().min(params.len())];
        match &self.adapters {
            Some(a) => {
                let mut lora = BTreeMap::new();
                for ((m, l), pair) in a.layers().iter().zip(params.chunks(2)) {
                    lora.insert(
                        m.clone(),
                        MlxLora {
                            a: pair[0].clone(),
                            b: pair[1].clone(),
                            scale: l.scale as f32,
                            dropout: l.dropout,
                        },
                    );
                }
                let mut w = self.base.clone();
                if self.head_param
                    && let Some(score) = params.last()
                {
                    w.insert(crate::model::SCORE.into(), score.clone());
                }
                (w, lora)
            }
            None => {
                let w = self
                    .names
                    .iter()
                    .cloned()
                    .zip(params.iter().cloned())
                    .collect();
                (w, BTreeMap::new())
            }
        }
    }
}

fn to_array(t: &candle_core::Tensor) -> Result<Array, TrainError> {
    let v: Vec<f32> = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    let shape: Vec<i32> = t.dims().iter().map(|&d| d as i32).collect();
    Ok(Array::from_slice(&v, &shape))
}

fn host(a: &Array) -> Result<Vec<f32>, TrainError> {
    let a = a
        .as_type::<f32>()
        .map_err(mlx_err)?
        .contiguous()
        .map_err(mlx_err)?;
    a.eval().map_err(mlx_err)?;
    Ok(a.as_slice::<f32>().to_vec())
}

/// A model on MLX as the tasks see it: weights, adapters, and whether adapter dropout runs.
#[derive(Clone)]
pub struct MlxModel {
    weights: MlxWeights,
    adapters: BTreeMap<String, MlxLora>,
    dropout: bool,
    /// Its layers under gradient checkpointing (the policy being trained, with TRL's
    /// `gradient_checkpointing`).
    checkpoint: bool,
}

/// The MLX backend as the tasks see it, for one forward pass.
pub struct MlxRunner<'a> {
    setup: &'a MlxSetup,
    policy: MlxModel,
    /// PPO's value model's weights (from the arrays being differentiated).
    value: Option<MlxWeights>,
}

impl crate::train::grpo::Sample for MlxRunner<'_> {
    /// The candle sampler's draws over MLX logits, with MLX's KV cache (`MlxCache`), the
    /// policy without adapter dropout.
    fn sample(
        &self,
        prompt: &[u32],
        n: usize,
        cfg: &SamplingConfig,
        rng: &mut Rng,
    ) -> Result<Vec<Vec<u32>>, TrainError> {
        super::model::sample(
            &self.setup.decoder,
            &self.policy.weights,
            &self.policy.adapters,
            prompt,
            n,
            cfg,
            rng,
        )
        .map_err(TrainError::from)
    }
}

impl MlxRunner<'_> {
    /// The adapters' dropout stream when `model` runs with dropout.
    fn dropout(&self, model: &MlxModel) -> Option<&crate::model::lora::DropoutRng> {
        self.setup
            .adapters
            .as_ref()
            .filter(|_| model.dropout)
            .and_then(|a| a.dropout_rng())
    }
}

impl Runner for MlxRunner<'_> {
    type Ops = MlxOps;
    type Model = MlxModel;
    fn ops(&self) -> &MlxOps {
        &MlxOps
    }
    fn policy(&self) -> &MlxModel {
        &self.policy
    }
    fn tokenizer(&self) -> &TextTokenizer {
        &self.setup.tokenizer
    }
    fn forward_masked(
        &self,
        model: &MlxModel,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
    ) -> Result<Array, TrainError> {
        let dropout = self.dropout(model);
        Ok(self
            .setup
            .decoder
            .forward_with(
                &model.weights,
                &model.adapters,
                dropout,
                ids,
                Some(attention),
                model.checkpoint,
            )
            .map_err(mlx_err)?)
    }
    fn forward_positioned(
        &self,
        model: &MlxModel,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<Array, TrainError> {
        let dropout = self.dropout(model);
        Ok(self
            .setup
            .decoder
            .forward_positioned(
                &model.weights,
                &model.adapters,
                dropout,
                ids,
                attention,
                positions,
                model.checkpoint,
            )
            .map_err(mlx_err)?)
    }
    fn values(
        &self,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<Array, TrainError> {
        let (Some((decoder, _)), Some(w)) = (&self.setup.value, &self.value) else {
            return Err(config_err(
                "task",
                "this run has no value model (only ppo trains one)",
            ));
        };
        let out = decoder
            .forward_positioned(
                w,
                &BTreeMap::new(),
                None,
                ids,
                attention,
                positions,
                self.policy.checkpoint,
            )
            .map_err(mlx_err)?;
        let (b, t) = (ids.len() as i32, ids.first().map_or(0, Vec::len) as i32);
        out.reshape(&[b, t]).map_err(|e| backend_err(e.to_string()))
    }
    fn forward_scores(&self, model: &MlxModel, seqs: &[Vec<u32>]) -> Result<Array, TrainError> {
        let pad = self.setup.tokenizer.pad_id;
        let (ids, lengths) = crate::train::runner::pad_ids(seqs, pad)?;
        if !self.setup.decoder.is_classifier() {
            return Err(config_err(
                "model",
                "scoring needs a sequence classifier with one output (`score` [1, hidden])",
            ));
        }
        let len = lengths.iter().copied().max().unwrap_or(0);
        let attention: Vec<Vec<bool>> = lengths
            .iter()
            .map(|&n| (0..len).map(|j| j < n).collect())
            .collect();
        let at: Vec<i32> = crate::train::runner::last_non_pad(&ids, pad)
            .into_iter()
            .map(|i| i as i32)
            .collect();
        let b = ids.len() as i32;
        let logits = self.forward_masked(model, &ids, &attention)?;
        let go = || -> Result<Array, Exception> {
            let scores = logits.reshape(&[b, len as i32])?;
            scores
                .take_along_axis(Array::from_slice(&at, &[b, 1]), 1)?
                .reshape(&[b])
        };
        go().map_err(|e| backend_err(e.to_string()))
    }
    fn forward_shifted(
        &self,
        model: &MlxModel,
        seqs: &[(Vec<u32>, Vec<u8>)],
        _keep_logits: bool,
    ) -> Result<Shifted<Array>, TrainError> {
        // MLX evaluates lazily: the logits are kept either way.
        let p = crate::train::runner::pad(seqs, self.setup.tokenizer.pad_id)?;
        let attention: Vec<Vec<bool>> = p
            .attention
            .iter()
            .map(|r| r.iter().map(|&a| a > 0.0).collect())
            .collect();
        let dropout = self.dropout(model);
        let go = || -> Result<Shifted<Array>, Exception> {
            let full_logits = self.setup.decoder.forward_with(
                &model.weights,
                &model.adapters,
                dropout,
                &p.ids,
                Some(&attention),
                model.checkpoint,
            )?;
            let (b, len) = (p.ids.len() as i32, p.len as i32);
            let logits = ops::split_at_indices(&full_logits, &[len - 1], 1)?.remove(0);
            let labels = p.labels();
            let labels_arr = Array::from_slice(&labels, &[b, len - 1]);
            let logps = MlxOps.token_logps(&logits, &labels_arr)?;
            let flat: Vec<f32> = p.mask_host.iter().flatten().copied().collect();
            Ok(Shifted {
                logits: Some(logits),
                full_logits: Some(full_logits),
                stats: None,
                labels,
                logps,
                mask: Array::from_slice(&flat, &[b, len - 1]),
                mask_host: p.mask_host.clone(),
                attention: p.attention.clone(),
            })
        };
        go().map_err(|e| backend_err(e.to_string()))
    }
}

/// A task as the MLX backend runs it: any of [`crate::train::task`]'s (the same code the candle
/// backend runs), on [`MlxRunner`].
type MlxTask = Box<dyn for<'a> Task<MlxRunner<'a>>>;

/// What the tasks are built from on MLX: the run and its starting weights.
struct MlxHost<'a> {
    setup: &'a MlxSetup,
    initial: &'a [Array],
}

/// The MLX backend, as the tasks see it.
struct Mlx;

impl Backend for Mlx {
    type Model = MlxModel;
    type R<'a> = MlxRunner<'a>;
}

impl Host<Mlx> for MlxHost<'_> {
    fn tokenizer(&self) -> &TextTokenizer {
        &self.setup.tokenizer
    }
    fn with_runner<T>(&self, f: impl FnOnce(&MlxRunner<'_>) -> T) -> T {
        f(&MlxRunner {
            setup: self.setup,
            policy: reference(self.setup, self.initial),
            value: self.setup.value_weights(self.initial),
        })
    }
    fn reference(&self) -> Result<MlxModel, TrainError> {
        Ok(reference(self.setup, self.initial))
    }
    fn base_reference(&self) -> Result<MlxModel, TrainError> {
        let mut r = reference(self.setup, self.initial);
        if self.setup.adapters.is_some() {
            r.adapters.clear();
        }
        Ok(r)
    }
}

/// The MLX backend under the training loop.
struct MlxStepper {
    setup: MlxSetup,
    task: MlxTask,
    eval: Option<MlxTask>,
    params: Vec<Array>,
    grads: Vec<Option<Array>>,
    adam: crate::train::optim::AdamW<Array>,
}

impl MlxStepper {
    /// transformers' evaluation: the set in order, in batches, without dropout; `eval_loss`
    /// weighted by batch size, every other figure the mean over batches.
    fn evaluate_with(
        &self,
        eval: &mut MlxTask,
        tokens: u64,
    ) -> Result<BTreeMap<String, f64>, TrainError> {
        let bs = self.setup.config.hyper.per_device_eval_batch_size;
        let r = self.runner(&self.params, false);
        let (loss, totals) = evaluation(eval.examples(), bs, |chunk| {
            eval.begin_step(&r, &[chunk.to_vec()])?;
            let (l, figures, _) = eval.micro_batch(&r, chunk)?;
            Ok((f64::from(host(&l)?[0]), figures))
        })?;
        Ok(eval_figures(loss, eval.window(&totals), tokens))
    }

    fn runner(&self, params: &[Array], training: bool) -> MlxRunner<'_> {
        let (weights, adapters) = self.setup.parts(params);
        MlxRunner {
            setup: &self.setup,
            policy: MlxModel {
                weights,
                adapters,
                dropout: training,
                checkpoint: training && self.setup.checkpointing,
            },
            value: self.setup.value_weights(params),
        }
    }
}

impl Stepper for MlxStepper {
    fn task(&self) -> &'static str {
        self.task.name()
    }
    fn sequential(&self) -> bool {
        self.task.sequential()
    }
    fn window(&self, totals: &crate::train::driver::Window) -> BTreeMap<String, f64> {
        self.task.window(totals)
    }
    fn backend(&self) -> &'static str {
        BACKEND
    }
    fn examples(&self) -> usize {
        self.task.examples()
    }
    fn notes(&self) -> Vec<String> {
        let mut notes = self.setup.notes.clone();
        notes.extend(self.task.notes());
        notes
    }
    fn info(&mut self) -> &mut dyn crate::train::driver::StepPlan {
        &mut *self.task
    }
    fn trainable_parameters(&self) -> u64 {
        self.params
            .iter()
            .map(|p| p.shape().iter().product::<i32>() as u64)
            .sum()
    }
    fn group(&self) -> usize {
        self.task.group()
    }
    fn repeats(&self) -> usize {
        self.task.repeats()
    }
    fn begin_step(&mut self, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        let (weights, adapters) = self.setup.parts(&self.params);
        let r = MlxRunner {
            setup: &self.setup,
            policy: MlxModel {
                weights,
                adapters,
                dropout: true,
                checkpoint: false,
            },
            value: self.setup.value_weights(&self.params),
        };
        self.task.begin_step(&r, micro_batches)
    }
    fn micro_batch(
        &mut self,
        indices: &[usize],
        count: usize,
    ) -> Result<(f64, BTreeMap<String, f64>, u64), TrainError> {
        let side = std::cell::RefCell::new(None);
        let divide = self.task.divide_by_accumulation().then_some(count as f32);
        let f = |p: &[Array]| -> Result<Vec<Array>, Exception> {
            let r = self.runner(p, true);
            let (loss, figures, tokens) = self
                .task
                .micro_batch(&r, indices)
                .map_err(|e| Exception::custom(e.to_string()))?;
            let loss = match divide {
                Some(c) => ops::divide(&loss, Array::from_f32(c))?,
                None => loss,
            };
            *side.borrow_mut() = Some((figures, tokens));
            Ok(vec![loss])
        };
        let argnums: Vec<i32> = (0..self.params.len() as i32).collect();
        let (value, grads) =
            mlx_rs::transforms::value_and_grad_with_argnums(f, &argnums[..])(&self.params)
                .map_err(mlx_err)?;
        for (acc, g) in self.grads.iter_mut().zip(grads) {
            *acc = Some(match acc.take() {
                Some(old) => ops::add(&old, &g).map_err(mlx_err)?,
                None => g,
            });
        }
        let mut loss = f64::from(host(&value[0])?[0]);
        if self.task.divide_logged_loss() && !self.task.divide_by_accumulation() {
            // TRL's online DPO logs `loss / gradient_accumulation_steps` (the setting).
            loss /= self.setup.config.hyper.gradient_accumulation_steps.max(1) as f64;
        }
        let (figures, tokens) = side
            .into_inner()
            .ok_or_else(|| backend_err("the loss did not run"))?;
        Ok((loss, figures, tokens))
    }
    fn update(&mut self, lr: f64, clip: bool) -> Result<f64, TrainError> {
        // torch's clip_grad_norm_ and AdamW, as every backend computes them.
        let max = self.setup.config.hyper.max_grad_norm.filter(|_| clip);
        let norm =
            crate::train::optim::clip_grad_norm(&MlxOps, &mut self.grads, max).map_err(mlx_err)?;
        let params: Vec<&Array> = self.params.iter().collect();
        let new = self
            .adam
            .update(&MlxOps, lr, &params, &self.grads)
            .map_err(mlx_err)?;
        for (i, p) in new.into_iter().enumerate() {
            let Some(p) = p else { continue };
            let slot = &self.adam.moments[i];
            mlx_rs::transforms::eval([&p, &slot.m, &slot.v]).map_err(mlx_err)?;
            self.params[i] = p;
        }
        self.grads.iter_mut().for_each(|g| *g = None);
        Ok(norm)
    }
    fn evaluate(&mut self, tokens: u64) -> Result<Option<BTreeMap<String, f64>>, TrainError> {
        let Some(mut eval) = self.eval.take() else {
            return Ok(None);
        };
        let figures = self.evaluate_with(&mut eval, tokens);
        self.eval = Some(eval);
        figures.map(Some)
    }
    fn save_checkpoint(&self, step: u64, tokens: u64) -> Result<PathBuf, TrainError> {
        let host_of = |name: String, a: &Array| -> Result<(String, HostTensor), TrainError> {
            Ok((
                name,
                HostTensor {
                    dims: a.shape().iter().map(|&d| d as usize).collect(),
                    data: host(a)?,
                },
            ))
        };
        let names = &self.setup.names;
        let trainable = names
            .iter()
            .zip(&self.params)
            .map(|(n, p)| host_of(n.clone(), p))
            .collect::<Result<Vec<_>, _>>()?;
        let mut moments = Vec::with_capacity(2 * names.len());
        for (n, slot) in names.iter().zip(&self.adam.moments) {
            let (m, v) = (&slot.m, &slot.v);
            moments.push(host_of(format!("m/{n}"), m)?);
            moments.push(host_of(format!("v/{n}"), v)?);
        }
        let state = serde_json::json!({
            "task": self.task.name(),
            "backend": BACKEND,
            "optimizer_steps": self.adam.step,
            "tokens": tokens,
            "dropout_rng": self.setup.adapters.as_ref().map(|a| a.dropout_state()),
            "objective": self.task.state(),
        });
        crate::train::checkpoint::save(
            &self.setup.config.output,
            step,
            state,
            &trainable,
            &moments,
            |dir| self.write_result(dir, false),
            self.setup.config.hyper.save_total_limit,
        )
    }
    fn resume(&mut self, dir: &Path) -> Result<(u64, u64), TrainError> {
        let expected: Vec<(String, Vec<usize>)> = self
            .setup
            .names
            .iter()
            .zip(&self.params)
            .map(|(n, p)| (n.clone(), p.shape().iter().map(|&d| d as usize).collect()))
            .collect();
        let c = crate::train::checkpoint::load(dir, self.task.name(), &expected)?;
        let array = |t: &HostTensor| {
            let shape: Vec<i32> = t.dims.iter().map(|&d| d as i32).collect();
            Array::from_slice(&t.data, &shape)
        };
        for (i, n) in self.setup.names.iter().enumerate() {
            self.params[i] = array(&c.trainable[n]);
            self.adam.moments[i].m = array(&c.moments[&format!("m/{n}")]);
            self.adam.moments[i].v = array(&c.moments[&format!("v/{n}")]);
        }
        self.adam.step = c.optimizer_steps;
        if let (Some(a), Some(r)) = (&self.setup.adapters, c.state["dropout_rng"].as_u64()) {
            a.set_dropout_state(r);
        }
        self.task.restore(&c.state["objective"])?;
        Ok((c.step, c.tokens))
    }
    fn save_output(&self) -> Result<PathBuf, TrainError> {
        crate::train::output::save_into(&self.setup.config.output, |dir| {
            self.write_result(dir, true)
        })
    }
}

impl MlxStepper {
    /// The result as the user gets it, into `dir`: the adapter files (and with `--merge` the
    /// merged full checkpoint in `dir/merged`), or the full checkpoint; `fin`: the final
    /// output (a checkpoint writes PEFT's layout and no merge).
    fn write_result(&self, dir: &Path, fin: bool) -> Result<(), TrainError> {
        let setup = &self.setup;
        match &setup.adapters {
            Some(a) => {
                // The trained arrays back into the adapters' storage, then PEFT's files.
                for ((_, var), p) in a.vars().iter().zip(&self.params) {
                    let data = host(p)?;
                    let t = candle_core::Tensor::from_vec(
                        data,
                        var.as_tensor().dims(),
                        &candle_core::Device::Cpu,
                    )?;
                    var.set(&t)?;
                }
                let score = match (
                    setup.head_param,
                    self.params[..setup.policy_params()].last(),
                ) {
                    (true, Some(p)) => Some(candle_core::Tensor::from_vec(
                        host(p)?,
                        (1, setup.decoder.config().hidden),
                        &candle_core::Device::Cpu,
                    )?),
                    _ => None,
                };
                // Checkpoints keep PEFT's layout (a resumed run reads its own arrays).
                crate::train::output::save_adapter(
                    a,
                    &setup.config,
                    dir,
                    &setup.modules,
                    setup.decoder.config().layers,
                    fin,
                    score.as_ref(),
                )?;
                if fin && setup.config.merge {
                    let merged_dir = crate::train::output::merged_dir(dir)?;
                    let (w, lora) = setup.parts(&self.params);
                    let tensors = w.iter().map(|(name, arr)| {
                        let module = name.strip_suffix(".weight").unwrap_or(name);
                        let arr = match lora.get(module) {
                            Some(l) => ops::matmul(&l.b, &l.a)
                                .and_then(|d| ops::multiply(&d, Array::from_f32(l.scale)))
                                .and_then(|d| ops::add(arr, &d))
                                .map_err(mlx_err)?,
                            None => arr.clone(),
                        };
                        let dims = arr.shape().iter().map(|&d| d as usize).collect();
                        Ok((name.clone(), dims, host(&arr)?))
                    });
                    crate::train::output::write_full(&setup.config.model, &merged_dir, tensors)?;
                    if setup.decoder.is_classifier() {
                        crate::train::output::classifier_config(
                            &merged_dir,
                            setup.tokenizer.pad_id,
                        )?;
                    }
                }
                Ok(())
            }
            None => {
                let policy = setup.policy_params();
                let tensors = setup.names[..policy]
                    .iter()
                    .zip(&self.params)
                    .map(|(name, p)| {
                        let dims = p.shape().iter().map(|&d| d as usize).collect();
                        Ok((name.clone(), dims, host(p)?))
                    });
                crate::train::output::write_full(&setup.config.model, dir, tensors)?;
                if setup.decoder.is_classifier() {
                    crate::train::output::classifier_config(dir, setup.tokenizer.pad_id)?;
                }
                Ok(())
            }
        }
    }
}

/// Builds the MLX run of `config` for `task`, with its evaluation set.
fn build(config: &TrainConfig, task: &str) -> Result<MlxStepper, TrainError> {
    let (setup, params) = MlxSetup::load(config)?;
    let host = MlxHost {
        setup: &setup,
        initial: &params,
    };
    let (task, eval) = crate::train::task::build_with_eval::<Mlx>(task, config, &host)?;
    assemble(setup, params, task, eval)
}

fn assemble(
    setup: MlxSetup,
    params: Vec<Array>,
    task: MlxTask,
    eval: Option<MlxTask>,
) -> Result<MlxStepper, TrainError> {
    let adam = crate::train::optim::AdamW::new(
        &MlxOps,
        crate::train::optim::AdamWConfig::of(&setup.config),
        setup.names.iter().map(String::as_str).zip(&params),
    )
    .map_err(mlx_err)?;
    Ok(MlxStepper {
        grads: vec![None; params.len()],
        setup,
        task,
        eval,
        params,
        adam,
    })
}

/// GRPO, RLOO and online DPO on MLX with completions from `train` (and, with evaluation data, `eval`) instead of
/// sampling: another run's completions replayed, as the parity tests replay TRL's.
pub fn grpo_with_sources(
    config: &TrainConfig,
    train: Box<dyn crate::train::grpo::CompletionSource>,
    eval: Option<Box<dyn crate::train::grpo::CompletionSource>>,
) -> Result<grpo::Trainer, TrainError> {
    let (setup, params) = MlxSetup::load(config)?;
    let reference_of = || Ok(reference(&setup, &params));
    let mut sources = [Some(train), eval].into_iter();
    let (task, eval) = crate::train::task::with_eval(config, |c| -> Result<MlxTask, TrainError> {
        let source = sources.next().flatten().ok_or_else(|| {
            config_err(
                "eval_data",
                "replaying completions needs an evaluation source too",
            )
        })?;
        if c.task == "online_dpo" {
            let host = MlxHost {
                setup: &setup,
                initial: &params,
            };
            return Ok(Box::new(crate::train::tasks::OnlineDpoTask::with_source(
                c,
                &setup.tokenizer,
                Host::<Mlx>::reference(&host)?,
                source,
            )?));
        }
        Ok(Box::new(GrpoTask::with_source(
            c,
            &setup.tokenizer,
            reference_of,
            source,
        )?))
    })?;
    Ok(grpo::Trainer {
        stepper: assemble(setup, params, task, eval)?,
    })
}

/// PPO on MLX with responses and minibatch orders from `source` instead of sampling (another
/// run's rollouts replayed, as the parity tests replay TRL's).
pub fn ppo_with_source(
    config: &TrainConfig,
    source: Box<dyn crate::train::tasks::RolloutSource>,
) -> Result<ppo::Trainer, TrainError> {
    let (setup, params) = MlxSetup::load(config)?;
    let host = MlxHost {
        setup: &setup,
        initial: &params,
    };
    let task: MlxTask = Box::new(crate::train::tasks::PpoTask::with_source(
        config,
        &setup.tokenizer,
        Host::<Mlx>::base_reference(&host)?,
        source,
    )?);
    Ok(ppo::Trainer {
        stepper: assemble(setup, params, task, None)?,
    })
}

/// The frozen reference, as TRL makes it (and as the candle backend does): under new LoRA
/// adapters the base model alone, when training continues an adapter that adapter as it
/// started, in full fine-tuning the starting weights (MLX arrays never change in place).
fn reference(setup: &MlxSetup, initial: &[Array]) -> MlxModel {
    let (weights, adapters) = setup.parts(initial);
    let adapters = if setup.adapters.is_some() && setup.config.init_adapter.is_none() {
        BTreeMap::new()
    } else {
        adapters
    };
    MlxModel {
        weights,
        adapters,
        dropout: false,
        checkpoint: false,
    }
}

/// `#[trainer(task, backend = "mlx")]` for one task of [`crate::train::task::TASKS`].
macro_rules! mlx_trainer {
    ($module:ident, $task:literal) => {
        #[doc = concat!("`", $task, "` on MLX.")]
        pub mod $module {
            use super::*;

            #[doc = concat!("`", $task, "` on MLX.")]
            #[crate::trainer(task = $task, backend = "mlx", crate = crate)]
            pub struct Trainer {
                pub(super) stepper: MlxStepper,
            }

            impl crate::Trainer for Trainer {
                fn new(config: &TrainConfig) -> Result<Self, TrainError> {
                    Ok(Trainer {
                        stepper: build(config, $task)?,
                    })
                }

                fn train(
                    &mut self,
                    observer: &mut dyn TrainObserver,
                ) -> Result<TrainReport, TrainError> {
                    let config = self.stepper.setup.config.clone();
                    drive(&config, &mut self.stepper, observer)
                }
            }
        }
    };
}

crate::train::task::for_each_task!(mlx_trainer);
