//! The candle backend: the training loop (batching, gradient accumulation, clipping, AdamW,
//! schedules, logging, saving) shared by every task, and the built-in trainers
//! `#[trainer(task = "sft" | "dpo", backend = "candle")]`.
//!
//! A task is an [`Objective`]: it turns a micro-batch of example indices into a loss through
//! the model's per-token log-probabilities and the losses of [`crate::train::losses`]; the
//! loop does the rest exactly as transformers' `Trainer` does it (docs/TRAINING.md §3).

pub mod checkpoint;
pub mod ops;
pub mod optim;

use self::ops::CandleOps;
use self::optim::{AdamW, AdamWConfig, clip_grad_norm};
use super::data::{DataFormat, TextTokenizer};
use super::losses::{self, GrpoInputs, GrpoLoss, GrpoSettings};
use super::ops::TensorOps;
use super::{TrainConfig, TrainError, TrainObserver, TrainReport};
use crate::checkpoint::Checkpoint;
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

fn config_err(field: &str, message: impl Into<String>) -> TrainError {
    TrainError::Config {
        field: field.into(),
        message: message.into(),
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
}

impl Setup {
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
        let checkpoint = Checkpoint::open(&config.model).map_err(backend_err)?;
        if checkpoint
            .config()
            .raw()
            .get("quantization_config")
            .is_some()
        {
            return Err(config_err(
                "model",
                format!(
                    "{} is a quantized export; train the original model",
                    config.model.display()
                ),
            ));
        }
        let mut model = DecoderModel::load(&checkpoint, DType::F32, &device)?;
        let tokenizer = TextTokenizer::from_model_dir(&config.model)?;
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
                    Some(dir) => Adapters::load_peft(dir, &model)?,
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
                let trainable = adapters.vars();
                (Some(Arc::new(adapters)), trainable)
            }
        };
        if let Some(a) = &adapters {
            model = model.with_adapters(Some(Arc::new(a.set_training(true))));
        }
        Ok(Setup {
            config: config.clone(),
            model,
            adapters,
            trainable,
            tokenizer,
            ops: CandleOps { device },
        })
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

/// A micro-batch's logits and labels on candle, shifted for next-token prediction.
pub type Shifted = super::runner::Shifted<Tensor>;

/// Right-pads `seqs` (ids, label mask) with `pad`, runs `model`, and shifts.
pub fn forward_shifted(
    model: &DecoderModel,
    ops: &CandleOps,
    seqs: &[(Vec<u32>, Vec<u8>)],
    pad: u32,
) -> Result<Shifted, TrainError> {
    let p = super::runner::pad(seqs, pad)?;
    let (b, len) = (seqs.len(), p.len);
    let dev = &ops.device;
    let flat_ids: Vec<u32> = p.ids.iter().flatten().copied().collect();
    let ids = Tensor::from_vec(flat_ids, (b, len), dev)?;
    let full_logits = model.forward_padded(&ids, &p.lengths)?;
    let logits = full_logits.narrow(1, 0, len - 1)?;
    let labels = ids.narrow(1, 1, len - 1)?.contiguous()?;
    let flat: Vec<f32> = p.mask_host.iter().flatten().copied().collect();
    let mask = Tensor::from_vec(flat, (b, len - 1), dev)?;
    let logps = ops.token_logps(&logits, &labels)?;
    Ok(Shifted {
        logits,
        full_logits,
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
    fn pad_id(&self) -> u32 {
        self.tokenizer.pad_id
    }
    fn forward_shifted(
        &self,
        model: &DecoderModel,
        seqs: &[(Vec<u32>, Vec<u8>)],
    ) -> Result<Shifted, TrainError> {
        forward_shifted(model, &self.ops, seqs, self.tokenizer.pad_id)
    }
}

/// One task's part of a training run.
pub trait Objective {
    /// The task's name (`sft`, `dpo`, …).
    fn task(&self) -> &'static str;
    /// Examples in the training set.
    fn examples(&self) -> usize;
    /// Whether the loop divides each micro-batch's loss by the step's micro-batch count
    /// (transformers does unless the loss is already normalised over the whole step).
    fn divide_by_accumulation(&self) -> bool {
        true
    }
    /// Whether examples are always taken in file order (TRL's KTO trainer ignores shuffling:
    /// its KL pairs are built over consecutive examples).
    fn sequential(&self) -> bool {
        false
    }
    /// The logged figures of a window of micro-batches, from each figure's total and how many
    /// micro-batches reported it (default: the mean).
    fn window(&self, totals: &BTreeMap<String, (f64, usize)>) -> BTreeMap<String, f64> {
        totals
            .iter()
            .map(|(k, (s, n))| (k.clone(), s / *n as f64))
            .collect()
    }
    /// What a resumed run needs of the objective's own state (random streams, counters).
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Restores [`Objective::state`].
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        let _ = state;
        Ok(())
    }
    /// Called with every micro-batch of the coming step before the first is run.
    fn begin_step(
        &mut self,
        setup: &Setup,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        let _ = (setup, micro_batches);
        Ok(())
    }
    /// Examples come in groups of this many consecutive indices that stay together when the
    /// data is shuffled (GRPO: the completions of one prompt).
    fn group(&self) -> usize {
        1
    }
    /// Makes this objective (built from the evaluation data) the evaluation's: what differs
    /// from training (GRPO: `num_generations_eval`, one step per generation).
    fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        let _ = config;
        Ok(())
    }
    /// How many consecutive optimisation steps run on each step's examples (GRPO's
    /// `num_iterations`: TRL's sampler repeats every generation batch that many times).
    fn repeats(&self) -> usize {
        1
    }
    /// The loss of one micro-batch, its figures and its token count.
    fn micro_batch(
        &mut self,
        setup: &Setup,
        indices: &[usize],
    ) -> Result<(Tensor, BTreeMap<String, f64>, u64), TrainError>;
}

/// Runs `objective` to the end of the plan (or until the observer stops it) and saves the
/// result into the configured output folder.
pub fn run(
    setup: &Setup,
    objective: &mut dyn Objective,
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
    eval: &mut dyn Objective,
    tokens: u64,
) -> Result<BTreeMap<String, f64>, TrainError> {
    let n = eval.examples();
    let bs = setup.config.hyper.per_device_eval_batch_size.max(1);
    let idx: Vec<usize> = (0..n).collect();
    let (mut loss, mut count) = (0f64, 0usize);
    let mut totals: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for chunk in idx.chunks(bs) {
        eval.begin_step(setup, &[chunk.to_vec()])?;
        let (l, figures, _) = eval.micro_batch(setup, chunk)?;
        loss += l.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 * chunk.len() as f64;
        count += chunk.len();
        for (k, v) in figures {
            let e = totals.entry(k).or_insert((0.0, 0));
            e.0 += v;
            e.1 += 1;
        }
    }
    let mut out: BTreeMap<String, f64> = eval
        .window(&totals)
        .into_iter()
        .map(|(k, v)| (format!("eval_{k}"), v))
        .collect();
    if let Some(t) = out.get_mut("eval_num_tokens") {
        *t = tokens as f64;
    }
    out.insert("eval_loss".into(), loss / count.max(1) as f64);
    Ok(out)
}

/// [`run`] with an evaluation set, evaluated every `eval_steps` steps.
pub fn run_with_eval<'a>(
    setup: &'a Setup,
    objective: &'a mut dyn Objective,
    eval: Option<&'a mut dyn Objective>,
    observer: &mut dyn TrainObserver,
) -> Result<TrainReport, TrainError> {
    let adam = AdamW::new(
        AdamWConfig {
            beta1: setup.config.hyper.adam_beta1,
            beta2: setup.config.hyper.adam_beta2,
            eps: setup.config.hyper.adam_epsilon,
            weight_decay: setup.config.hyper.weight_decay,
        },
        setup.trainable.clone(),
    )?;
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
    objective: &'a mut dyn Objective,
    eval: Option<&'a mut dyn Objective>,
    /// The run as evaluation sees it (adapters without dropout).
    eval_setup: Option<Setup>,
    adam: AdamW,
    /// The step's gradients so far, one per trainable parameter.
    grads: Vec<Option<Tensor>>,
}

impl super::driver::Stepper for CandleStepper<'_> {
    fn task(&self) -> &'static str {
        self.objective.task()
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
        let value = loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64;
        let store = loss.backward()?;
        for (g, (_, var)) in self.grads.iter_mut().zip(&self.setup.trainable) {
            if let Some(new) = store.get(var.as_tensor()) {
                *g = Some(match g.take() {
                    Some(old) => (old + new)?,
                    None => new.clone(),
                });
            }
        }
        Ok((value, figures, t))
    }
    fn update(&mut self, lr: f64) -> Result<f64, TrainError> {
        let norm = clip_grad_norm(&mut self.grads, self.setup.config.hyper.max_grad_norm)?;
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
    super::output::save_into(target, |dir| {
        let base = setup.config.model.display().to_string();
        match &setup.adapters {
            Some(a) => {
                a.save_peft(dir, &setup.model, &base)?;
                if setup.config.merge {
                    let merged_dir = super::output::merged_dir(dir)?;
                    let merged = a.merged(&setup.model)?;
                    write_full(setup, &merged_dir, &merged)?;
                }
                Ok(())
            }
            None => write_full(setup, dir, &BTreeMap::new()),
        }
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
    super::output::write_full(&setup.config.model, dir, tensors)
}

use super::tasks::read_data;

/// A built-in trainer: `#[trainer(task, backend = "candle")]` on a struct holding the
/// [`Setup`] and the task's [`Objective`], made by `$make(config, setup)`.
macro_rules! candle_trainer {
    ($(#[$doc:meta])* $name:ident, $task:literal, $objective:ty, $make:expr) => {
        $(#[$doc])*
        #[crate::trainer(task = $task, backend = "candle", crate = crate)]
        pub struct $name {
            setup: Setup,
            objective: $objective,
            eval: Option<$objective>,
        }

        impl crate::Trainer for $name {
            fn new(config: &TrainConfig) -> Result<Self, TrainError> {
                let setup = Setup::load(config)?;
                let make: fn(&TrainConfig, &Setup) -> Result<$objective, TrainError> = $make;
                let objective = make(config, &setup)?;
                // The evaluation set, prepared as the training set is.
                let eval = match &config.eval_data {
                    Some(path) => {
                        let mut c = config.clone();
                        c.train_data = Some(path.clone());
                        let mut e = make(&c, &setup)?;
                        Objective::for_evaluation(&mut e, &c)?;
                        Some(e)
                    }
                    None => None,
                };
                Ok($name { setup, objective, eval })
            }
            fn train(
                &mut self,
                observer: &mut dyn TrainObserver,
            ) -> Result<TrainReport, TrainError> {
                let eval = self.eval.as_mut().map(|e| e as &mut dyn Objective);
                run_with_eval(&self.setup, &mut self.objective, eval, observer)
            }
        }
    };
}

// ---------------------------------------------------------------- sft

/// Supervised fine-tuning (TRL's `SFTTrainer`): causal-LM cross-entropy over the label
/// tokens, the token mean over the whole optimisation step.
pub struct SftObjective(super::tasks::SftTask);

impl SftObjective {
    /// The examples of `config.train_data` (`text`, `prompt`+`completion` or `messages`),
    /// tokenized as TRL does.
    pub fn new(config: &TrainConfig, tok: &TextTokenizer) -> Result<Self, TrainError> {
        Ok(SftObjective(super::tasks::SftTask::new(config, tok)?))
    }
}

impl Objective for SftObjective {
    fn task(&self) -> &'static str {
        "sft"
    }
    fn examples(&self) -> usize {
        self.0.examples()
    }
    fn divide_by_accumulation(&self) -> bool {
        false
    }
    fn begin_step(
        &mut self,
        _setup: &Setup,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        self.0.begin_step(micro_batches);
        Ok(())
    }
    fn micro_batch(
        &mut self,
        setup: &Setup,
        indices: &[usize],
    ) -> Result<(Tensor, BTreeMap<String, f64>, u64), TrainError> {
        self.0.loss(setup, indices)
    }
}

candle_trainer! {
    /// `sft` on candle.
    CandleSft, "sft", SftObjective, |config, setup| SftObjective::new(config, &setup.tokenizer)
}

// ---------------------------------------------------------------- dpo

/// Direct preference optimisation (TRL's `DPOTrainer`).
pub struct DpoObjective(super::tasks::DpoTask<DecoderModel>);

impl DpoObjective {
    /// The pairs of `config.train_data` and DPO's options (`beta`, `loss_type`,
    /// `precompute_ref_log_probs`), against the frozen starting model.
    pub fn new(config: &TrainConfig, setup: &Setup) -> Result<Self, TrainError> {
        Ok(DpoObjective(super::tasks::DpoTask::new(
            config,
            &setup.tokenizer,
            setup,
            setup.reference()?,
        )?))
    }
}

impl Objective for DpoObjective {
    fn task(&self) -> &'static str {
        "dpo"
    }
    fn examples(&self) -> usize {
        self.0.examples()
    }
    fn micro_batch(
        &mut self,
        setup: &Setup,
        indices: &[usize],
    ) -> Result<(Tensor, BTreeMap<String, f64>, u64), TrainError> {
        self.0.loss(setup, indices)
    }
}

candle_trainer! {
    /// `dpo` on candle.
    CandleDpo, "dpo", DpoObjective, DpoObjective::new
}

// ---------------------------------------------------------------- orpo, simpo (cpo)

pub use super::tasks::ScoredLoss;

/// ORPO and CPO/SimPO on candle ([`super::tasks::ScoredPairTask`]).
pub struct ScoredPairObjective(super::tasks::ScoredPairTask);

impl ScoredPairObjective {
    /// ORPO's options: `beta` (0.1).
    pub fn orpo(config: &TrainConfig, setup: &Setup) -> Result<Self, TrainError> {
        Ok(ScoredPairObjective(super::tasks::ScoredPairTask::orpo(
            config,
            &setup.tokenizer,
        )?))
    }

    /// SimPO's options (TRL's `CPOConfig` defaults).
    pub fn simpo(config: &TrainConfig, setup: &Setup) -> Result<Self, TrainError> {
        Ok(ScoredPairObjective(super::tasks::ScoredPairTask::simpo(
            config,
            &setup.tokenizer,
        )?))
    }
}

impl Objective for ScoredPairObjective {
    fn task(&self) -> &'static str {
        self.0.name()
    }
    fn examples(&self) -> usize {
        self.0.examples()
    }
    fn micro_batch(
        &mut self,
        setup: &Setup,
        indices: &[usize],
    ) -> Result<(Tensor, BTreeMap<String, f64>, u64), TrainError> {
        self.0.loss(setup, indices)
    }
}

candle_trainer! {
    /// `orpo` on candle.
    CandleOrpo, "orpo", ScoredPairObjective, ScoredPairObjective::orpo
}

candle_trainer! {
    /// `simpo` on candle (TRL's CPO trainer; `loss_type` simpo by default).
    CandleSimpo, "simpo", ScoredPairObjective, ScoredPairObjective::simpo
}

// ---------------------------------------------------------------- kto

/// KTO on candle ([`super::tasks::KtoTask`]).
pub struct KtoObjective(super::tasks::KtoTask<DecoderModel>);

impl KtoObjective {
    /// KTO's options (TRL's `KTOConfig`); the reference as TRL makes it: with LoRA the base
    /// model (adapters off), even when training continues an existing adapter.
    pub fn new(config: &TrainConfig, setup: &Setup) -> Result<Self, TrainError> {
        let reference = match &setup.adapters {
            Some(_) => setup.model.with_adapters(None),
            None => setup.reference()?,
        };
        Ok(KtoObjective(super::tasks::KtoTask::new(
            config,
            &setup.tokenizer,
            setup,
            reference,
        )?))
    }
}

impl Objective for KtoObjective {
    fn task(&self) -> &'static str {
        "kto"
    }
    fn examples(&self) -> usize {
        self.0.examples()
    }
    fn sequential(&self) -> bool {
        true
    }
    fn window(&self, totals: &BTreeMap<String, (f64, usize)>) -> BTreeMap<String, f64> {
        losses::kto_window(totals)
    }
    fn micro_batch(
        &mut self,
        setup: &Setup,
        indices: &[usize],
    ) -> Result<(Tensor, BTreeMap<String, f64>, u64), TrainError> {
        self.0.loss(setup, indices)
    }
}

candle_trainer! {
    /// `kto` on candle.
    CandleKto, "kto", KtoObjective, KtoObjective::new
}

// ---------------------------------------------------------------- grpo

/// Where GRPO's completions come from: sampled from the policy (training), or given (to
/// replay another run's completions, as the parity tests replay TRL's).
pub trait CompletionSource: Send {
    /// `g` completions for each prompt, in prompt order (each ends at its EOS, kept, or at
    /// the length limit).
    fn complete(
        &mut self,
        model: &DecoderModel,
        prompts: &[Vec<u32>],
        g: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, TrainError>;
    /// The source's random stream position, if it has one (saved with checkpoints).
    fn rng_state(&self) -> Option<u64> {
        None
    }
    /// Restores [`CompletionSource::rng_state`].
    fn set_rng_state(&mut self, state: u64) {
        let _ = state;
    }
}

/// Sampling with the KV cache (TRL's `generate(do_sample=True)` settings).
pub struct Sampled {
    /// Temperature, top-p/k, min-p, repetition penalty, length, EOS.
    pub config: crate::model::generate::SamplingConfig,
    /// The draws' stream.
    pub rng: crate::model::generate::Rng,
}

impl CompletionSource for Sampled {
    fn rng_state(&self) -> Option<u64> {
        Some(self.rng.0)
    }
    fn set_rng_state(&mut self, state: u64) {
        self.rng.0 = state;
    }
    fn complete(
        &mut self,
        model: &DecoderModel,
        prompts: &[Vec<u32>],
        g: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, TrainError> {
        prompts
            .iter()
            .map(|p| {
                crate::model::generate::sample(model, p, g, &self.config, &mut self.rng)
                    .map_err(TrainError::from)
            })
            .collect()
    }
}

/// Per-token log-probs, the completion mask (device and host) and the entropies of a GRPO
/// micro-batch.
type CompletionLogps = (Tensor, Tensor, Vec<Vec<f32>>, Tensor);

/// One generated completion and what GRPO derived from it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Rollout {
    prompt: Vec<u32>,
    completion: Vec<u32>,
    advantage: f64,
    /// The completion's per-token log-probs under the policy that sampled it (kept when the
    /// generation batch serves more than one optimisation step).
    old_logps: Option<Vec<f32>>,
}

/// GRPO (TRL's `GRPOTrainer`): `num_generations` completions per prompt sampled from the
/// policy, scored by reward functions, group-normalised advantages, the clipped policy
/// objective with an optional k3 KL to the reference.
pub struct GrpoObjective {
    prompts: Vec<Vec<u32>>,
    texts: Vec<String>,
    records: Vec<serde_json::Map<String, serde_json::Value>>,
    options: serde_json::Map<String, serde_json::Value>,
    g: usize,
    rewards: Vec<(String, crate::registry::rewards::RewardFn)>,
    weights: Vec<f64>,
    scale_rewards: String,
    settings: GrpoSettings,
    temperature: f64,
    mask_truncated: bool,
    source: Box<dyn CompletionSource>,
    sampler: DecoderModel,
    reference: Option<DecoderModel>,
    /// This step's rollouts, by example index.
    rollouts: BTreeMap<usize, Rollout>,
    /// The generation batch's figures.
    pending: BTreeMap<String, f64>,
    tokens_seen: f64,
    /// `num_iterations`: optimisation steps per generation batch.
    iterations: usize,
    /// Steps run on the current generation batch.
    cycle: usize,
    /// Whether this step generated (its generation figures and tokens are reported).
    fresh: bool,
}

impl GrpoObjective {
    /// GRPO's options, TRL's `GRPOConfig` defaults: `num_generations` 8,
    /// `max_completion_length` 256, `temperature` 1, `top_p` 1, `top_k` 0 (off), `min_p`,
    /// `repetition_penalty` 1, `beta` 0, `epsilon` 0.2, `epsilon_high` (= epsilon), `delta`,
    /// `loss_type` dapo, `scale_rewards` group, `reward_funcs` (default `exact_match`),
    /// `reward_weights` (1 each), `mask_truncated_completions`; completions sampled from the
    /// policy with the KV cache.
    pub fn new(config: &TrainConfig, setup: &Setup) -> Result<Self, TrainError> {
        let o = |k: &str| config.option::<f64>(k);
        let temperature = o("temperature")?.unwrap_or(1.0);
        if temperature <= 0.0 {
            return Err(config_err("temperature", "must be positive (GRPO samples)"));
        }
        let sampling = crate::model::generate::SamplingConfig {
            temperature,
            top_p: o("top_p")?.unwrap_or(1.0),
            top_k: config.option::<usize>("top_k")?.unwrap_or(0),
            min_p: o("min_p")?,
            repetition_penalty: o("repetition_penalty")?.unwrap_or(1.0),
            max_new_tokens: config
                .option::<usize>("max_completion_length")?
                .unwrap_or(256),
            eos: vec![setup.tokenizer.eos_id],
        };
        let source = Box::new(Sampled {
            config: sampling,
            rng: crate::model::generate::Rng(config.hyper.seed ^ 0x6772_706f),
        });
        Self::with_source(config, setup, source)
    }

    /// [`GrpoObjective::new`] with completions from `source`.
    pub fn with_source(
        config: &TrainConfig,
        setup: &Setup,
        source: Box<dyn CompletionSource>,
    ) -> Result<Self, TrainError> {
        let data = read_data(config, &[DataFormat::Prompt])?;
        let temperature = config.option::<f64>("temperature")?.unwrap_or(1.0);
        let g = config.option::<usize>("num_generations")?.unwrap_or(8);
        if g < 2 {
            return Err(config_err(
                "num_generations",
                "must be at least 2 (advantages compare a prompt's completions)",
            ));
        }
        let h = &config.hyper;
        let generation_batch = h.per_device_train_batch_size * h.gradient_accumulation_steps;
        if !generation_batch.is_multiple_of(g) {
            return Err(config_err(
                "num_generations",
                format!(
                    "{g} does not divide the generation batch (per_device_train_batch_size × gradient_accumulation_steps = {generation_batch})"
                ),
            ));
        }
        let names: Vec<String> = config
            .option::<Vec<String>>("reward_funcs")?
            .unwrap_or_else(|| vec!["exact_match".into()]);
        let registry = crate::registry::rewards::RewardRegistry::try_global()
            .map_err(|e| config_err("reward_funcs", e.to_string()))?;
        let mut rewards = Vec::with_capacity(names.len());
        for n in &names {
            let e = registry.get(n).ok_or_else(|| {
                config_err(
                    "reward_funcs",
                    format!(
                        "no reward function `{n}` (registered: {})",
                        registry.names().join(", ")
                    ),
                )
            })?;
            rewards.push((n.clone(), e.func));
        }
        super::rewards::check_options(&names, &config.task_options)
            .map_err(|m| config_err("reward_funcs", m))?;
        if names.iter().any(|n| n == "exact_match") {
            let col = super::rewards::answer_column(&config.task_options);
            if let Some(r) = data.records.iter().find(|r| {
                !matches!(
                    r.fields.get(&col),
                    Some(serde_json::Value::String(_) | serde_json::Value::Number(_))
                )
            }) {
                return Err(TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: format!(
                        "reward `exact_match` needs the answer column `{col}` (a string or number)"
                    ),
                });
            }
        }
        let weights = config
            .option::<Vec<f64>>("reward_weights")?
            .unwrap_or_else(|| vec![1.0; names.len()]);
        if weights.len() != names.len() {
            return Err(config_err(
                "reward_weights",
                format!(
                    "{} weights for {} reward functions",
                    weights.len(),
                    names.len()
                ),
            ));
        }
        let scale_rewards = config
            .option::<String>("scale_rewards")?
            .unwrap_or_else(|| "group".into());
        if !matches!(scale_rewards.as_str(), "group" | "batch" | "none") {
            return Err(config_err(
                "scale_rewards",
                format!("`{scale_rewards}` is not one of group, batch, none"),
            ));
        }
        let loss_name = config
            .option::<String>("loss_type")?
            .unwrap_or_else(|| "dapo".into());
        let kind = GrpoLoss::parse(&loss_name).ok_or_else(|| {
            config_err(
                "loss_type",
                format!("`{loss_name}` is not one of {}", GrpoLoss::NAMES.join(", ")),
            )
        })?;
        let epsilon = config.option::<f64>("epsilon")?.unwrap_or(0.2);
        let settings = GrpoSettings {
            kind,
            epsilon,
            epsilon_high: config.option::<f64>("epsilon_high")?.unwrap_or(epsilon),
            delta: config.option::<f64>("delta")?,
            beta: config.option::<f64>("beta")?.unwrap_or(0.0),
            max_completion_length: config
                .option::<usize>("max_completion_length")?
                .unwrap_or(256),
            num_items: 0.0,
        };
        let mut prompts = Vec::with_capacity(data.records.len());
        let mut texts = Vec::with_capacity(data.records.len());
        for r in &data.records {
            let text = r
                .fields
                .get("prompt")
                .and_then(|v| v.as_str())
                .unwrap_or_default();
            prompts.push(setup.tokenizer.encode(text).map_err(|m| TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: format!("tokenizing: {m}"),
            })?);
            texts.push(text.to_string());
        }
        let sampler = match &setup.adapters {
            Some(a) => setup
                .model
                .with_adapters(Some(Arc::new(a.set_training(false)))),
            None => setup.model.clone(),
        };
        let reference = (settings.beta != 0.0)
            .then(|| setup.reference())
            .transpose()?;
        let iterations = config.option::<usize>("num_iterations")?.unwrap_or(1);
        if iterations == 0 {
            return Err(config_err("num_iterations", "must be at least 1"));
        }
        Ok(GrpoObjective {
            prompts,
            texts,
            records: data.records.into_iter().map(|r| r.fields).collect(),
            options: config.task_options.clone(),
            g,
            rewards,
            weights,
            scale_rewards,
            settings,
            temperature,
            mask_truncated: config
                .option::<bool>("mask_truncated_completions")?
                .unwrap_or(false),
            source,
            sampler,
            reference,
            rollouts: BTreeMap::new(),
            pending: BTreeMap::new(),
            tokens_seen: 0.0,
            iterations,
            cycle: 0,
            fresh: false,
        })
    }

    /// Per-token log-probs of the completions `[rows, completion]` under `model`, laid out as
    /// TRL lays them out (prompts padded on the left, completions on the right, the attention
    /// mask hiding the padding), logits divided by the sampling temperature; the completion
    /// mask; and the entropies.
    fn completion_logps(
        &self,
        setup: &Setup,
        model: &DecoderModel,
        rows: &[&Rollout],
    ) -> Result<CompletionLogps, TrainError> {
        let ops = &setup.ops;
        let pad = setup.tokenizer.pad_id;
        let p = rows.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
        let c = rows
            .iter()
            .map(|r| r.completion.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let mut ids = Vec::with_capacity(rows.len() * (p + c));
        let mut attention = Vec::with_capacity(rows.len());
        let mut mask_host = Vec::with_capacity(rows.len());
        let mut labels = Vec::with_capacity(rows.len() * c);
        for r in rows {
            let lp = p - r.prompt.len();
            let lc = c - r.completion.len();
            ids.extend(std::iter::repeat_n(pad, lp));
            ids.extend(&r.prompt);
            ids.extend(&r.completion);
            ids.extend(std::iter::repeat_n(pad, lc));
            let truncated = self.mask_truncated
                && r.completion
                    .last()
                    .is_none_or(|&t| t != setup.tokenizer.eos_id && t != pad);
            let keep = if truncated { 0f32 } else { 1f32 };
            let mut att = vec![false; lp];
            att.extend(std::iter::repeat_n(true, r.prompt.len()));
            att.extend(std::iter::repeat_n(keep > 0.0, r.completion.len()));
            att.extend(std::iter::repeat_n(false, lc));
            attention.push(att);
            let mut m = vec![keep; r.completion.len()];
            m.resize(c, 0.0);
            mask_host.push(m);
            labels.extend(&r.completion);
            labels.extend(std::iter::repeat_n(pad, lc));
        }
        let dev = &ops.device;
        let ids = Tensor::from_vec(ids, (rows.len(), p + c), dev)?;
        let logits = model.forward_masked(&ids, &attention)?;
        let logits = logits
            .narrow(1, p - 1, c)?
            .affine(1.0 / self.temperature, 0.0)?;
        let labels = Tensor::from_vec(labels, (rows.len(), c), dev)?;
        let logps = ops.token_logps(&logits, &labels)?;
        let flat: Vec<f32> = mask_host.iter().flatten().copied().collect();
        let mask = Tensor::from_vec(flat, (rows.len(), c), dev)?;
        let entropy = ops.token_entropy(&logits)?;
        Ok((logps, mask, mask_host, entropy))
    }
}

impl Objective for GrpoObjective {
    fn task(&self) -> &'static str {
        "grpo"
    }
    fn examples(&self) -> usize {
        self.prompts.len() * self.g
    }
    fn group(&self) -> usize {
        self.g
    }
    fn repeats(&self) -> usize {
        self.iterations
    }
    fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        // TRL: each evaluation batch is generated for and scored once, with
        // `num_generations_eval` completions per prompt (default `num_generations`).
        self.iterations = 1;
        self.g = config
            .option::<usize>("num_generations_eval")?
            .unwrap_or(self.g);
        if self.g == 0 {
            return Err(config_err("num_generations_eval", "must be at least 1"));
        }
        let bs = config.hyper.per_device_eval_batch_size;
        if !bs.is_multiple_of(self.g) {
            return Err(config_err(
                "per_device_eval_batch_size",
                format!(
                    "{bs} is not a multiple of the completions per prompt in evaluation ({})",
                    self.g
                ),
            ));
        }
        // Its own sampling stream, apart from training's.
        if let Some(r) = self.source.rng_state() {
            self.source.set_rng_state(r ^ 0x6576_616c);
        }
        Ok(())
    }
    fn state(&self) -> serde_json::Value {
        let mut state = serde_json::json!({
            "tokens_seen": self.tokens_seen,
            "sampler_rng": self.source.rng_state(),
        });
        // Mid-way through a generation batch: its rollouts serve the steps still to come.
        if self.cycle < self.iterations {
            state["cycle"] = self.cycle.into();
            state["rollouts"] = serde_json::to_value(&self.rollouts).expect("JSON");
        }
        state
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        self.tokens_seen = state["tokens_seen"].as_f64().unwrap_or(0.0);
        if let Some(r) = state["sampler_rng"].as_u64() {
            self.source.set_rng_state(r);
        }
        if let Some(cycle) = state["cycle"].as_u64() {
            self.cycle = cycle as usize;
            self.rollouts = serde_json::from_value(state["rollouts"].clone())
                .map_err(|e| config_err("resume", format!("trainer_state.json `rollouts`: {e}")))?;
            // DAPO's normaliser: the generation batch's completion tokens.
            self.settings.num_items = self
                .rollouts
                .values()
                .map(|r| r.completion.len() as f64)
                .sum();
        }
        Ok(())
    }
    fn divide_by_accumulation(&self) -> bool {
        self.settings.kind != GrpoLoss::Dapo
    }
    fn begin_step(
        &mut self,
        _setup: &Setup,
        micro_batches: &[Vec<usize>],
    ) -> Result<(), TrainError> {
        let all: Vec<usize> = micro_batches.iter().flatten().copied().collect();
        // num_iterations > 1: the generation batch serves the next steps too (the loop repeats
        // its examples).
        if self.cycle > 0
            && self.cycle < self.iterations
            && all.iter().all(|i| self.rollouts.contains_key(i))
        {
            self.cycle += 1;
            self.fresh = false;
            return Ok(());
        }
        self.cycle = 1;
        self.fresh = true;
        // The step's prompts, each once, in order (its g completions are consecutive).
        let mut prompt_idx: Vec<usize> = Vec::new();
        for &i in &all {
            let p = i / self.g;
            if prompt_idx.last() != Some(&p) {
                prompt_idx.push(p);
            }
        }
        let prompts: Vec<Vec<u32>> = prompt_idx
            .iter()
            .map(|&p| self.prompts[p].clone())
            .collect();
        let completions = self.source.complete(&self.sampler, &prompts, self.g)?;
        if completions.len() != prompts.len() || completions.iter().any(|c| c.len() != self.g) {
            return Err(backend_err(
                "the completion source returned the wrong number of completions",
            ));
        }
        let tok = &_setup.tokenizer;
        let mut per_func: Vec<Vec<f64>> = Vec::with_capacity(all.len());
        let mut rows = Vec::with_capacity(all.len());
        for (k, &p) in prompt_idx.iter().enumerate() {
            for c in &completions[k] {
                let text = tok.decode(c).map_err(backend_err)?;
                let input = crate::registry::rewards::RewardInput {
                    prompt: &self.texts[p],
                    completion: &text,
                    completion_ids: c,
                    example: &self.records[p],
                    options: &self.options,
                };
                per_func.push(
                    self.rewards
                        .iter()
                        .map(|(_, f)| f(&input).unwrap_or(f64::NAN))
                        .collect(),
                );
                rows.push((p, c.clone()));
            }
        }
        let (adv, stds) =
            losses::grpo_advantages(&per_func, &self.weights, self.g, &self.scale_rewards);
        self.rollouts.clear();
        for ((&i, (p, c)), a) in all.iter().zip(rows).zip(&adv) {
            self.rollouts.insert(
                i,
                Rollout {
                    prompt: self.prompts[p].clone(),
                    completion: c,
                    advantage: *a,
                    old_logps: None,
                },
            );
        }
        if self.iterations > 1 {
            // The sampling policy's log-probs, for the ratios of the later steps (TRL computes
            // them with the training model, in micro-batches, before any update).
            for indices in micro_batches {
                let rows: Vec<&Rollout> = indices.iter().map(|i| &self.rollouts[i]).collect();
                let (logps, _, _, _) = self.completion_logps(_setup, &_setup.model, &rows)?;
                let logps: Vec<Vec<f32>> = logps.detach().to_dtype(DType::F32)?.to_vec2()?;
                for (i, l) in indices.iter().zip(logps) {
                    let r = self.rollouts.get_mut(i).expect("just made");
                    r.old_logps = Some(l[..r.completion.len()].to_vec());
                }
            }
        }
        // TRL's figures for the generation batch.
        let n = per_func.len() as f64;
        let lengths: Vec<f64> = self
            .rollouts
            .values()
            .map(|r| r.completion.len() as f64)
            .collect();
        let prompt_tokens: f64 = self.rollouts.values().map(|r| r.prompt.len() as f64).sum();
        let completion_tokens: f64 = lengths.iter().sum();
        self.settings.num_items = completion_tokens;
        self.tokens_seen += prompt_tokens + completion_tokens;
        let stat = |v: &[f64]| -> (f64, f64) {
            let v: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
            let m = v.iter().sum::<f64>() / v.len().max(1) as f64;
            let sd = if v.len() > 1 {
                (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
            } else {
                f64::NAN
            };
            (m, sd)
        };
        let mut m = BTreeMap::new();
        for (f, (name, _)) in self.rewards.iter().enumerate() {
            let col: Vec<f64> = per_func.iter().map(|r| r[f]).collect();
            let (mean, sd) = stat(&col);
            m.insert(format!("rewards/{name}/mean"), mean);
            m.insert(format!("rewards/{name}/std"), sd);
        }
        let sums: Vec<f64> = per_func
            .iter()
            .map(|r| r.iter().filter(|v| !v.is_nan()).sum())
            .collect();
        let (mean, sd) = stat(&sums);
        m.insert("reward".into(), mean);
        m.insert("reward_std".into(), sd);
        m.insert(
            "frac_reward_zero_std".into(),
            stds.iter().filter(|s| s.abs() < 1e-8).count() as f64 / n,
        );
        let eos = _setup.tokenizer.eos_id;
        let pad = _setup.tokenizer.pad_id;
        let truncated: Vec<bool> = self
            .rollouts
            .values()
            .map(|r| r.completion.last().is_none_or(|&t| t != eos && t != pad))
            .collect();
        let term: Vec<f64> = lengths
            .iter()
            .zip(&truncated)
            .filter(|(_, t)| !**t)
            .map(|(l, _)| *l)
            .collect();
        let term = if term.is_empty() { vec![0.0] } else { term };
        let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = |v: &[f64]| v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        m.insert("completions/mean_length".into(), completion_tokens / n);
        m.insert("completions/min_length".into(), min(&lengths));
        m.insert("completions/max_length".into(), max(&lengths));
        m.insert(
            "completions/clipped_ratio".into(),
            truncated.iter().filter(|&&t| t).count() as f64 / n,
        );
        m.insert(
            "completions/mean_terminated_length".into(),
            term.iter().sum::<f64>() / term.len() as f64,
        );
        m.insert("completions/min_terminated_length".into(), min(&term));
        m.insert("completions/max_terminated_length".into(), max(&term));
        self.pending = m;
        Ok(())
    }
    fn micro_batch(
        &mut self,
        setup: &Setup,
        indices: &[usize],
    ) -> Result<(Tensor, BTreeMap<String, f64>, u64), TrainError> {
        let ops = &setup.ops;
        let rows: Vec<&Rollout> = indices
            .iter()
            .map(|i| {
                self.rollouts
                    .get(i)
                    .ok_or_else(|| backend_err("a micro-batch outside its step"))
            })
            .collect::<Result<_, _>>()?;
        let (logps, mask, mask_host, entropy) =
            self.completion_logps(setup, &setup.model, &rows)?;
        let ref_logps = match &self.reference {
            Some(r) => Some(self.completion_logps(setup, r, &rows)?.0.detach()),
            None => None,
        };
        let advantages: Vec<f64> = rows.iter().map(|r| r.advantage).collect();
        let old_logps = match rows
            .iter()
            .map(|r| r.old_logps.as_ref())
            .collect::<Option<Vec<_>>>()
        {
            Some(old) => {
                let c = logps.dim(1)?;
                let mut flat = Vec::with_capacity(rows.len() * c);
                for o in old {
                    flat.extend(o);
                    flat.extend(std::iter::repeat_n(0f32, c - o.len()));
                }
                Some(
                    Tensor::from_vec(flat, (rows.len(), c), &ops.device)?
                        .to_dtype(logps.dtype())?,
                )
            }
            None => None,
        };
        let out = losses::grpo(
            ops,
            self.settings,
            &GrpoInputs {
                logps: &logps,
                old_logps: old_logps.as_ref(),
                ref_logps: ref_logps.as_ref(),
                mask: &mask,
                mask_host: &mask_host,
                advantages: &advantages,
            },
        )?;
        let mut m = out.metrics;
        let h = ops.to_f64(&entropy)?;
        let (mut sum, mut count) = (0f64, 0f64);
        for (hv, mv) in h.iter().zip(mask_host.iter().flatten()) {
            sum += hv * f64::from(*mv);
            count += f64::from(*mv);
        }
        m.insert("entropy".into(), sum / count.max(1.0));
        // The generation batch's figures are TRL's once per generation; every micro-batch of
        // a generating step reports them so the window's mean is theirs. Steps that reuse a
        // generation batch report neither them nor tokens, as TRL counts tokens when it
        // generates.
        if !self.fresh {
            return Ok((out.loss, m, 0));
        }
        m.extend(self.pending.clone());
        m.insert("num_tokens".into(), self.tokens_seen);
        let tokens: u64 = rows
            .iter()
            .map(|r| (r.prompt.len() + r.completion.len()) as u64)
            .sum();
        Ok((out.loss, m, tokens))
    }
}

candle_trainer! {
    /// `grpo` on candle.
    CandleGrpo, "grpo", GrpoObjective, GrpoObjective::new
}
