//! The candle backend: the training loop (batching, gradient accumulation, clipping, AdamW,
//! schedules, logging, saving) shared by every task, and a `#[trainer(task, backend =
//! "candle")]` for every task (`candle::sft::Trainer`, …).
//!
//! A task is one of [`crate::train::task`]'s, written once for every backend: it turns a
//! micro-batch of example indices into a loss through the model's per-token log-probabilities
//! and the losses of [`crate::train::losses`]; the loop does the rest exactly as
//! transformers' `Trainer` does it (docs/TRAINING.md §3).

pub mod checkpoint;
pub mod ops;
pub mod optim;

use self::ops::CandleOps;
use self::optim::{AdamW, AdamWConfig, clip_grad_norm};
use super::config_err;
use super::data::TextTokenizer;
use super::ops::TensorOps;
use super::task::{Backend, Host, Task};
use super::{TrainConfig, TrainError, TrainObserver, TrainReport};
use crate::checkpoint::Checkpoint;
use crate::model::checkpoint::{GradSink, LayerBackward};
use crate::model::lora::{Adapters, LoraSpec};
use crate::model::{DecoderModel, ModelError};
use candle_core::{DType, Tensor, Var};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

const BACKEND: &str = "candle";

fn backend_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Backend {
        backend: BACKEND.into(),
        message: e.to_string(),
    }
}

impl From<ModelError> for TrainError {
    fn from(e: ModelError) -> Self {
        backend_err(e)
    }
}

impl From<candle_core::Error> for TrainError {
    fn from(e: candle_core::Error) -> Self {
        backend_err(e)
    }
}

/// The model, its trainable parameters and the tokenizer, ready to train.
#[derive(Clone)]
pub struct Setup {
    /// The run's configuration.
    pub config: TrainConfig,
    /// The policy: the model being trained (with its adapters under LoRA).
    pub model: DecoderModel,
    /// The adapters being trained (`None`: full fine-tuning).
    pub adapters: Option<Arc<Adapters>>,
    /// The trainable parameters, by name.
    pub trainable: Vec<(String, Var)>,
    /// The model's tokenizer.
    pub tokenizer: TextTokenizer,
    /// The loss operations on the model's device.
    pub ops: CandleOps,
    /// What the run substitutes for something the model lacks, by name (a reward model's new
    /// `score` head).
    pub notes: Vec<String>,
    /// PPO's value model (a sequence classifier with one output, trained in full beside the
    /// policy; its parameters are in `trainable` as `value_model.<name>`).
    pub value: Option<DecoderModel>,
}

impl Setup {
    /// A head query's ids on the device and the positions the head scores.
    fn head_query<'q>(
        &self,
        q: &'q super::runner::HeadQuery<'_>,
    ) -> Result<(Tensor, crate::model::HeadPositions<'q>), TrainError> {
        let (b, t) = (q.ids.len(), q.ids.first().map_or(0, Vec::len));
        let flat: Vec<u32> = q.ids.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b, t), &self.ops.device)?;
        let scored = crate::model::HeadPositions {
            attention: q.attention,
            positions: q.positions,
            at: q.at.clone(),
            scale: q.scale as f32,
        };
        Ok((ids, scored))
    }

    /// Loads the model named by `config` in f32 on its device, freezes it and adds adapters
    /// under LoRA (new, or `init_adapter`'s), and reads the tokenizer.
    pub fn load(config: &TrainConfig) -> Result<Self, TrainError> {
        // The output replaces its folder at the end: never the model's own folder.
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        if canon(&config.output).starts_with(canon(&config.model)) {
            return Err(config_err(
                "output",
                format!(
                    "{} is (inside) the model folder {}; write the result elsewhere",
                    config.output.display(),
                    config.model.display()
                ),
            ));
        }
        let device = crate::model::device(&config.device)?;
        // A quantized export (any format a registered reader recognises: mlx, GGUF, …):
        // QLoRA — adapters over the packed base, as deployed.
        let quantized = crate::train::quantized_base(config)?;
        let mut model = if quantized {
            let loaded =
                crate::formats::load_packed(&config.model, &device).map_err(backend_err)?;
            DecoderModel::from_loaded(loaded, &device)?
        } else {
            let checkpoint = Checkpoint::open(&config.model).map_err(backend_err)?;
            let adapters_only = config.lora.is_some() || config.init_adapter.is_some();
            if adapters_only && device.is_cpu() && !config.merge {
                // LoRA: the frozen base's Linears stay in the checkpoint's dtype (bf16: half
                // the memory of f32), widened a tile at a time; the same values as f32.
                DecoderModel::load_frozen_base(&checkpoint, &device)?
            } else {
                DecoderModel::load(&checkpoint, DType::F32, &device)?
            }
        };
        // A GGUF base may be the file itself: its folder holds the tokenizer.
        let tokenizer_dir = if config.model.is_file() {
            config
                .model
                .parent()
                .unwrap_or(Path::new("."))
                .to_path_buf()
        } else {
            config.model.clone()
        };
        let tokenizer = TextTokenizer::from_model_dir(&tokenizer_dir)?;
        let mut notes = Vec::new();
        let reward = config.task == "reward";
        if reward {
            // A reward model: transformers' sequence classifier, its `score` head new unless
            // the checkpoint has one.
            let (m, note) = model.with_score_head(config.hyper.seed)?;
            model = m;
            notes.extend(note);
        }
        let (adapters, trainable) = match (&config.lora, &config.init_adapter) {
            (None, None) => {
                let trainable = model
                    .weights()
                    .vars()
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                (None, trainable)
            }
            (lora, init) => {
                model.freeze()?;
                let adapters = match init {
                    Some(dir) => Adapters::load_any_for(
                        dir,
                        &crate::model::lora::linear_modules(&model),
                        model.device(),
                    )?,
                    None => {
                        let l = lora.as_ref().expect("one of the two is set");
                        let spec = LoraSpec {
                            r: l.r,
                            alpha: l.lora_alpha,
                            dropout: l.lora_dropout,
                            rslora: l.use_rslora,
                            target_modules: l.target_modules.clone(),
                        };
                        Adapters::new(&model, &spec, config.hyper.seed)?
                    }
                };
                let adapters = adapters.with_dropout_state(config.hyper.seed ^ 0x6472_6f70);
                let mut trainable = adapters.vars();
                if reward {
                    // The head trains in full beside the adapters (PEFT's SEQ_CLS task puts
                    // `score` in `modules_to_save`); a continued adapter brings its own.
                    let mut w = model.weights().clone();
                    w.thaw(crate::model::SCORE);
                    model = model.with_weights(w)?;
                    let var = model.weights().vars()[crate::model::SCORE].clone();
                    if let Some(dir) = init
                        && let Some((dims, values)) = crate::adapters::peft_classifier_head(dir)?
                    {
                        let t = Tensor::from_vec(values, dims.as_slice(), model.device()).map_err(
                            |e| {
                                crate::model::ModelError::file(
                                    dir,
                                    format!("`base_model.model.score.weight`: {e}"),
                                )
                            },
                        )?;
                        if t.dims() != var.as_tensor().dims() {
                            return Err(config_err(
                                "init_adapter",
                                format!(
                                    "{}: `base_model.model.score.weight` has shape {:?}, the model's head {:?}",
                                    dir.display(),
                                    t.dims(),
                                    var.as_tensor().dims()
                                ),
                            ));
                        }
                        var.set(&t)?;
                        notes.retain(|n| !n.starts_with("score.weight: "));
                    }
                    trainable.push((crate::model::SCORE.to_string(), var));
                }
                (Some(Arc::new(adapters)), trainable)
            }
        };
        if let Some(a) = &adapters {
            // Dropout while training, unless the task disables it (TRL's disable_dropout).
            let dropout = !config.disable_dropout()?;
            model = model.with_adapters(Some(Arc::new(a.set_training(dropout))));
        }
        if config.bf16()? {
            model = model.with_bf16_autocast()?;
            notes.push(
                "bf16: every Linear (the output layer's included) runs in bf16 as PyTorch's CPU autocast runs it (inputs, weights, outputs and both gradients rounded to bf16, f32 sums); attention, the norms, the activations between the Linears, the loss and the optimizer in f32".into(),
            );
        }
        // Each decoder layer's backward pass runs by itself under gradient checkpointing
        // (recomputed from the layer's input) and under full fine-tuning without it (through
        // the layer's kept graph, which it then frees, so the activations of the layers already
        // gone through are not held beside the weights' gradients as they arrive, as candle's
        // one graph would hold them until its backward pass ends). Under LoRA the gradients
        // that arrive are the adapters' (small): the peak is the forward's end either way, and
        // one graph spares the layer ops' copies of their inputs and outputs.
        let mode = if config.gradient_checkpointing()? {
            Some(LayerBackward::Recompute)
        } else if adapters.is_none() {
            Some(LayerBackward::Kept)
        } else {
            None
        };
        if let Some(mode) = mode {
            let sink = GradSink::with_mode(trainable.iter().map(|(_, v)| v), mode);
            model = model.with_gradient_checkpointing(Some(Arc::new(sink)));
        }
        let mut trainable = trainable;
        let value = match crate::train::value_model_dir(config)? {
            Some(dir) => {
                let (value, note) = load_value_model(&dir, &device, config.hyper.seed)?;
                notes.extend(note);
                for (name, var) in value.weights().vars() {
                    trainable.push((format!("{}{name}", crate::train::VALUE_PREFIX), var.clone()));
                }
                Some(value)
            }
            None => None,
        };
        Ok(Setup {
            config: config.clone(),
            model,
            adapters,
            trainable,
            tokenizer,
            ops: CandleOps { device },
            notes,
            value,
        })
    }

    /// A reward model's `score` head under LoRA (trained in full beside the adapters).
    pub fn score(&self) -> Option<&Tensor> {
        self.adapters.as_ref()?;
        self.model
            .weights()
            .vars()
            .get(crate::model::SCORE)
            .map(Var::as_tensor)
    }

    /// The run as evaluation sees it: the same weights (shared, so it follows training), the
    /// adapters in evaluation mode (no dropout), as transformers evaluates after
    /// `model.eval()`.
    pub fn for_evaluation(&self) -> Setup {
        let mut s = self.clone();
        if let Some(a) = &self.adapters {
            s.model = self
                .model
                .with_adapters(Some(Arc::new(a.set_training(false))));
        }
        s
    }

    /// The frozen reference, as TRL makes it: under LoRA the base model without adapters
    /// (PEFT's `disable_adapter()`), or, when training continues an existing adapter, the
    /// model with a frozen copy of that adapter (TRL's "ref" adapter); in full fine-tuning a
    /// copy of the starting weights.
    pub fn reference(&self) -> Result<DecoderModel, TrainError> {
        match &self.adapters {
            Some(a) if self.config.init_adapter.is_some() => {
                Ok(self.model.with_adapters(Some(Arc::new(a.frozen_copy()?))))
            }
            Some(_) => Ok(self.model.with_adapters(None)),
            None => {
                let mut copy = self.model.weights().deep_copy()?;
                copy.freeze();
                Ok(self.model.with_weights(copy)?)
            }
        }
    }
}

/// PPO's value model from `dir` in f32, trained in full: a sequence classifier's `score`
/// head kept, or a new one on a causal LM (and the note that says so).
fn load_value_model(
    dir: &Path,
    device: &candle_core::Device,
    seed: u64,
) -> Result<(DecoderModel, Option<String>), TrainError> {
    let err = |m: String| config_err("value_model_path", format!("{}: {m}", dir.display()));
    let checkpoint = Checkpoint::open(dir).map_err(|e| err(e.to_string()))?;
    let model =
        DecoderModel::load(&checkpoint, DType::F32, device).map_err(|e| err(e.to_string()))?;
    let (model, note) = model.with_score_head(seed ^ 0x7661_6c75)?;
    Ok((model, note.map(|n| format!("value model: {n}"))))
}

/// A micro-batch's logits and labels on candle, shifted for next-token prediction.
pub type Shifted = super::runner::Shifted<Tensor>;

/// Right-pads `seqs` (ids, label mask) with `pad`, runs `model`, and shifts. Unless
/// `keep_logits`, the output layer and the log-softmax run without holding the logits where
/// the model's head allows ([`DecoderModel::forward_padded_logps`]).
pub fn forward_shifted(
    model: &DecoderModel,
    ops: &CandleOps,
    seqs: &[(Vec<u32>, Vec<u8>)],
    pad: u32,
    keep_logits: bool,
) -> Result<Shifted, TrainError> {
    let p = super::runner::pad(seqs, pad)?;
    let (b, len) = (seqs.len(), p.len);
    let dev = &ops.device;
    let flat_ids: Vec<u32> = p.ids.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(flat_ids, (b, len), dev)?;
    let flat: Vec<f32> = p.mask_host.iter().flatten().copied().collect();
    let mask = Tensor::from_vec(flat, (b, len - 1), dev)?;
    if !keep_logits {
        // Each position's label is the next token; the last position has none (any id will
        // do: its log-probability is dropped below, so no gradient reaches it).
        let next: Vec<u32> = p
            .ids
            .iter()
            .flat_map(|r| r[1..].iter().copied().chain([0]))
            .collect();
        if let Some((logps, stats)) = model.forward_padded_logps(&ids, &p.lengths, next)? {
            return Ok(Shifted {
                logits: None,
                full_logits: None,
                stats: Some(stats),
                labels: p.labels(),
                logps: logps.narrow(1, 0, len - 1)?,
                mask,
                mask_host: p.mask_host,
                attention: p.attention,
            });
        }
    }
    let full_logits = model.forward_padded(&ids, &p.lengths)?;
    let logits = full_logits.narrow(1, 0, len - 1)?;
    let labels = ids.narrow(1, 1, len - 1)?.contiguous()?;
    let logps = ops.token_logps(&logits, &labels)?;
    Ok(Shifted {
        logits: Some(logits),
        full_logits: Some(full_logits),
        stats: None,
        labels: p.labels(),
        logps,
        mask,
        mask_host: p.mask_host,
        attention: p.attention,
    })
}

impl super::runner::Runner for Setup {
    type Ops = CandleOps;
    type Model = DecoderModel;
    fn ops(&self) -> &CandleOps {
        &self.ops
    }
    fn policy(&self) -> &DecoderModel {
        &self.model
    }
    fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }
    fn forward_masked(
        &self,
        model: &DecoderModel,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
    ) -> Result<Tensor, TrainError> {
        let (b, t) = (ids.len(), ids.first().map_or(0, Vec::len));
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b, t), &self.ops.device)?;
        Ok(model.forward_masked(&ids, attention)?)
    }
    fn forward_masked_logps(
        &self,
        model: &DecoderModel,
        q: &super::runner::HeadQuery<'_>,
    ) -> Result<Option<(Tensor, Vec<f32>)>, TrainError> {
        let (ids, scored) = self.head_query(q)?;
        Ok(model
            .forward_masked_logps(&ids, &scored, q.labels.to_vec())?
            .map(|(logps, stats)| (logps, stats.entropy)))
    }
    fn forward_masked_jsd(
        &self,
        model: &DecoderModel,
        q: &super::runner::HeadQuery<'_>,
        teacher: crate::model::fused::HeadRows,
        beta: f64,
    ) -> Result<Option<Tensor>, TrainError> {
        let (ids, scored) = self.head_query(q)?;
        Ok(model.forward_masked_jsd(&ids, &scored, teacher, beta)?)
    }
    fn forward_shifted(
        &self,
        model: &DecoderModel,
        seqs: &[(Vec<u32>, Vec<u8>)],
        keep_logits: bool,
    ) -> Result<Shifted, TrainError> {
        forward_shifted(model, &self.ops, seqs, self.tokenizer.pad_id, keep_logits)
    }
    fn forward_positioned(
        &self,
        model: &DecoderModel,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<Tensor, TrainError> {
        let (b, t) = (ids.len(), ids.first().map_or(0, Vec::len));
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let ids = Tensor::from_vec(flat, (b, t), &self.ops.device)?;
        Ok(model.forward_positioned(&ids, attention, positions)?)
    }
    fn values(
        &self,
        ids: &[Vec<u32>],
        attention: &[Vec<bool>],
        positions: &[Vec<usize>],
    ) -> Result<Tensor, TrainError> {
        let Some(value) = &self.value else {
            return Err(config_err(
                "task",
                "this run has no value model (only ppo trains one)",
            ));
        };
        Ok(self
            .forward_positioned(value, ids, attention, positions)?
            .squeeze(2)?)
    }
    fn forward_scores(
        &self,
        model: &DecoderModel,
        seqs: &[Vec<u32>],
    ) -> Result<Tensor, TrainError> {
        let pad = self.tokenizer.pad_id;
        let (ids, lengths) = super::runner::pad_ids(seqs, pad)?;
        let (b, len) = (ids.len(), lengths.iter().copied().max().unwrap_or(0));
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let t = Tensor::from_vec(flat, (b, len), &self.ops.device)?;
        let logits = model.forward_padded(&t, &lengths)?;
        let outputs = logits.dim(2)?;
        if outputs != 1 || !model.is_classifier() {
            return Err(config_err(
                "model",
                format!(
                    "scoring needs a sequence classifier with one output (`score` [1, hidden]); this model's head has {outputs}"
                ),
            ));
        }
        let at: Vec<u32> = super::runner::last_non_pad(&ids, pad)
            .into_iter()
            .map(|i| i as u32)
            .collect();
        let at = Tensor::from_vec(at, (b, 1), &self.ops.device)?;
        Ok(logits.squeeze(2)?.gather(&at, 1)?.squeeze(1)?)
    }
}

/// A task as the candle backend runs it: any of [`super::task`]'s, on [`Setup`].
pub type CandleTask = dyn Task<Setup>;

/// Runs `objective` to the end of the plan (or until the observer stops it) and saves the
/// result into the configured output folder.
pub fn run(
    setup: &Setup,
    objective: &mut CandleTask,
    observer: &mut dyn TrainObserver,
) -> Result<TrainReport, TrainError> {
    run_with_eval(setup, objective, None, observer)
}

/// The evaluation figures of `eval` (the evaluation set, in order, in batches of
/// `per_device_eval_batch_size`), as transformers computes them: `eval_loss` is the mean of
/// the batch losses weighted by batch size, every other figure the mean over batches, each
/// named `eval_<name>`; `eval_num_tokens` is the training tokens seen so far, as TRL logs it.
pub fn evaluate(
    setup: &Setup,
    eval: &mut CandleTask,
    tokens: u64,
) -> Result<BTreeMap<String, f64>, TrainError> {
    let n = eval.examples();
    let bs = setup.config.hyper.per_device_eval_batch_size;
    let (loss, totals) = super::driver::evaluation(n, bs, |chunk| {
        eval.begin_step(setup, &[chunk.to_vec()])?;
        let (l, figures, _) = eval.micro_batch(setup, chunk)?;
        Ok((l.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64, figures))
    })?;
    Ok(super::driver::eval_figures(
        loss,
        eval.window(&totals),
        tokens,
    ))
}

/// [`run`] with an evaluation set, evaluated every `eval_steps` steps.
pub fn run_with_eval<'a>(
    setup: &'a Setup,
    objective: &'a mut CandleTask,
    eval: Option<&'a mut CandleTask>,
    observer: &mut dyn TrainObserver,
) -> Result<TrainReport, TrainError> {
    let adam = AdamW::new(AdamWConfig::of(&setup.config), setup.trainable.clone())?;
    let mut stepper = CandleStepper {
        eval_setup: eval.is_some().then(|| setup.for_evaluation()),
        setup,
        objective,
        eval,
        adam,
        grads: vec![None; setup.trainable.len()],
    };
    super::driver::drive(&setup.config, &mut stepper, observer)
}

/// The candle backend under the training loop (`train/driver.rs`).
struct CandleStepper<'a> {
    setup: &'a Setup,
    objective: &'a mut CandleTask,
    eval: Option<&'a mut CandleTask>,
    /// The run as evaluation sees it (adapters without dropout).
    eval_setup: Option<Setup>,
    adam: AdamW,
    /// The step's gradients so far, one per trainable parameter.
    grads: Vec<Option<Tensor>>,
}

impl super::driver::Stepper for CandleStepper<'_> {
    fn task(&self) -> &'static str {
        self.objective.name()
    }
    fn backend(&self) -> &'static str {
        BACKEND
    }
    fn examples(&self) -> usize {
        self.objective.examples()
    }
    fn group(&self) -> usize {
        self.objective.group()
    }
    fn repeats(&self) -> usize {
        self.objective.repeats()
    }
    fn sequential(&self) -> bool {
        self.objective.sequential()
    }
    fn notes(&self) -> Vec<String> {
        let mut n = self.setup.notes.clone();
        n.extend(self.objective.notes());
        n
    }
    fn info(&mut self) -> &mut dyn super::driver::StepPlan {
        &mut *self.objective
    }
    fn trainable_parameters(&self) -> u64 {
        self.setup
            .trainable
            .iter()
            .map(|(_, v)| v.as_tensor().elem_count() as u64)
            .sum()
    }
    fn begin_step(&mut self, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        self.objective.begin_step(self.setup, micro_batches)
    }
    fn micro_batch(
        &mut self,
        indices: &[usize],
        count: usize,
    ) -> Result<(f64, BTreeMap<String, f64>, u64), TrainError> {
        let (loss, figures, t) = self.objective.micro_batch(self.setup, indices)?;
        let loss = if self.objective.divide_by_accumulation() {
            (loss / count as f64)?
        } else {
            loss
        };
        let mut value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        if self.objective.divide_logged_loss() && !self.objective.divide_by_accumulation() {
            // TRL's online DPO logs `loss / gradient_accumulation_steps` (the setting, also
            // on an epoch's short last step).
            value /= self.setup.config.hyper.gradient_accumulation_steps.max(1) as f64;
        }
        // With gradient checkpointing, the layers' parameter gradients arrive in the model's
        // sink during the backward pass, the rest (embeddings, head) in candle's store.
        let sink = self.setup.model.grad_sink();
        let store = match loss.backward() {
            Ok(store) => store,
            Err(e) => {
                // A failed backward pass leaves no half-collected gradients behind.
                if let Some(s) = sink {
                    s.clear();
                }
                return Err(e.into());
            }
        };
        for (g, (_, var)) in self.grads.iter_mut().zip(&self.setup.trainable) {
            let parts = [
                store.get(var.as_tensor()).cloned(),
                sink.and_then(|s| s.take(var)),
            ];
            for new in parts.into_iter().flatten() {
                *g = Some(match g.take() {
                    Some(old) => (old + new)?,
                    None => new,
                });
            }
        }
        Ok((value, figures, t))
    }
    fn update(&mut self, lr: f64, clip: bool) -> Result<f64, TrainError> {
        let max = self.setup.config.hyper.max_grad_norm.filter(|_| clip);
        let norm = clip_grad_norm(&mut self.grads, max)?;
        self.adam.update(lr, &self.grads)?;
        self.grads.iter_mut().for_each(|g| *g = None);
        Ok(norm)
    }
    fn window(&self, totals: &super::driver::Window) -> BTreeMap<String, f64> {
        self.objective.window(totals)
    }
    fn evaluate(&mut self, tokens: u64) -> Result<Option<BTreeMap<String, f64>>, TrainError> {
        match self.eval.as_deref_mut() {
            Some(e) => Ok(Some(evaluate(
                self.eval_setup.as_ref().unwrap_or(self.setup),
                e,
                tokens,
            )?)),
            None => Ok(None),
        }
    }
    fn save_checkpoint(&self, step: u64, tokens: u64) -> Result<std::path::PathBuf, TrainError> {
        checkpoint::save(self.setup, &self.adam, &*self.objective, step, tokens)
    }
    fn resume(&mut self, dir: &Path) -> Result<(u64, u64), TrainError> {
        let r = checkpoint::load(dir, self.setup, &mut self.adam, &mut *self.objective)?;
        Ok((r.step, r.tokens))
    }
    fn save_output(&self) -> Result<std::path::PathBuf, TrainError> {
        save(self.setup, &self.setup.config.output)
    }
}

/// Writes the trained result into `target` through a temporary folder beside it: a PEFT
/// adapter under LoRA (and with `merge` the merged full checkpoint in `target/merged`), else
/// the full checkpoint (f32) with the model's config and tokenizer files.
pub fn save(setup: &Setup, target: &Path) -> Result<std::path::PathBuf, TrainError> {
    super::output::save_into(target, |dir| match &setup.adapters {
        Some(a) => {
            super::output::save_adapter(
                a,
                &setup.config,
                dir,
                &crate::model::lora::linear_modules(&setup.model),
                setup.model.config().layers,
                true,
                setup.score(),
            )?;
            if setup.config.merge {
                let merged_dir = super::output::merged_dir(dir)?;
                let merged = a.merged(&setup.model)?;
                write_full(setup, &merged_dir, &merged)?;
            }
            Ok(())
        }
        None => write_full(setup, dir, &BTreeMap::new()),
    })
}

/// The full checkpoint: every weight in f32 (those in `replaced` taken from there), config.json
/// with `torch_dtype` float32, and the model folder's tokenizer and generation files.
pub(crate) fn write_full(
    setup: &Setup,
    dir: &Path,
    replaced: &BTreeMap<String, Tensor>,
) -> Result<(), TrainError> {
    let tensors = setup.model.weights().vars().iter().map(|(name, var)| {
        let t = replaced.get(name).unwrap_or(var.as_tensor());
        let data: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        Ok((name.clone(), t.dims().to_vec(), data))
    });
    super::output::write_full(&setup.config.model, dir, tensors)?;
    if setup.model.is_classifier() {
        super::output::classifier_config(dir, setup.tokenizer.pad_id)?;
    }
    Ok(())
}

/// The candle backend, as the tasks see it.
#[derive(Debug)]
pub struct Candle;

impl Backend for Candle {
    type Model = DecoderModel;
    type R<'a> = Setup;
}

impl Host<Candle> for Setup {
    fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }
    fn with_runner<T>(&self, f: impl FnOnce(&Setup) -> T) -> T {
        f(self)
    }
    fn reference(&self) -> Result<DecoderModel, TrainError> {
        Setup::reference(self)
    }
    fn base_reference(&self) -> Result<DecoderModel, TrainError> {
        match &self.adapters {
            Some(_) => Ok(self.model.with_adapters(None)),
            None => Setup::reference(self),
        }
    }
}

/// `#[trainer(task, backend = "candle")]` for one task of [`super::task::TASKS`]: the
/// [`Setup`], the task and its evaluation set ([`super::task::build_with_eval`]).
macro_rules! candle_trainer {
    ($module:ident, $task:literal) => {
        #[doc = concat!("`", $task, "` on candle.")]
        pub mod $module {
            use super::*;

            #[doc = concat!("`", $task, "` on candle.")]
            #[crate::trainer(task = $task, backend = "candle", crate = crate)]
            pub struct Trainer {
                setup: Setup,
                task: Box<CandleTask>,
                eval: Option<Box<CandleTask>>,
            }

            impl crate::Trainer for Trainer {
                fn new(config: &TrainConfig) -> Result<Self, TrainError> {
                    let setup = Setup::load(config)?;
                    let (task, eval) =
                        super::super::task::build_with_eval::<Candle>($task, config, &setup)?;
                    Ok(Trainer { setup, task, eval })
                }
                fn train(
                    &mut self,
                    observer: &mut dyn TrainObserver,
                ) -> Result<TrainReport, TrainError> {
                    let eval = self.eval.as_deref_mut();
                    run_with_eval(&self.setup, &mut *self.task, eval, observer)
                }
            }
        }
    };
}

super::task::for_each_task!(candle_trainer);

// ---------------------------------------------------------------- grpo

pub use super::grpo::{CompletionSource, Sample, Sampled};

impl Sample for Setup {
    fn sample(
        &self,
        prompt: &[u32],
        n: usize,
        cfg: &crate::model::generate::SamplingConfig,
        rng: &mut crate::model::generate::Rng,
    ) -> Result<Vec<Vec<u32>>, TrainError> {
        // The policy without adapter dropout, with the KV cache.
        let sampler = match &self.adapters {
            Some(a) => self
                .model
                .with_adapters(Some(Arc::new(a.set_training(false)))),
            None => self.model.clone(),
        };
        Ok(crate::model::generate::sample(
            &sampler, prompt, n, cfg, rng,
        )?)
    }
}

/// GRPO on candle with completions from `source` instead of sampling (another run's
/// completions replayed, as the parity tests replay TRL's).
pub fn grpo_with_source(
    config: &TrainConfig,
    setup: &Setup,
    source: Box<dyn CompletionSource>,
) -> Result<Box<CandleTask>, TrainError> {
    Ok(Box::new(super::grpo::GrpoTask::with_source(
        config,
        &setup.tokenizer,
        || setup.reference(),
        source,
    )?))
}

/// Online DPO on candle with completions from `source` instead of sampling (another run's
/// completions replayed, as the parity tests replay TRL's).
pub fn online_dpo_with_source(
    config: &TrainConfig,
    setup: &Setup,
    source: Box<dyn CompletionSource>,
) -> Result<Box<CandleTask>, TrainError> {
    Ok(Box::new(super::tasks::OnlineDpoTask::with_source(
        config,
        &setup.tokenizer,
        Host::<Candle>::reference(setup)?,
        source,
    )?))
}

/// PPO on candle with responses and minibatch orders from `source` instead of sampling
/// (another run's rollouts replayed, as the parity tests replay TRL's).
pub fn ppo_with_source(
    config: &TrainConfig,
    setup: &Setup,
    source: Box<dyn super::tasks::RolloutSource>,
) -> Result<Box<CandleTask>, TrainError> {
    Ok(Box::new(super::tasks::PpoTask::with_source(
        config,
        &setup.tokenizer,
        Host::<Candle>::base_reference(setup)?,
        source,
    )?))
}
