//! One [`Task`] per training task, implemented once against [`Runner`] and run by every backend;
//! [`build`] makes any task for any backend that implements [`Host`], with its evaluation set
//! prepared the same way ([`build_with_eval`]); [`for_each_task!`] is the task list the backends
//! register their trainers from. A new task is one file (its example builder and loss) plus an
//! arm in [`build`] and a line in [`TASKS`] / [`for_each_task!`]; a new backend implements
//! [`Runner`], [`Backend`] and [`Host`] and registers every task with one `for_each_task!(its_macro)`.

use super::data::TextTokenizer;
use super::driver::{StepPlan, Window};
use super::grpo::GrpoTask;
use super::runner::Runner;
use super::tasks::{
    DistillTask, DpoTask, KtoTask, MicroBatch, OnlineDpoTask, PpoTask, RewardTask, ScoredPairTask,
    SftTask, TensorOf,
};
use super::{TrainConfig, TrainError};
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Every task, in the order `kiln registry trainers` lists them.
pub const TASKS: [&str; 13] = [
    "sft",
    "dpo",
    "orpo",
    "simpo",
    "kto",
    "grpo",
    "reward",
    "rloo",
    "pretrain",
    "distill",
    "bco",
    "online_dpo",
    "ppo",
];

/// Calls `$m!(module, "task")` once per task of [`TASKS`]: how a backend registers a trainer
/// for every task in one line.
macro_rules! for_each_task {
    ($m:ident) => {
        $m!(sft, "sft");
        $m!(dpo, "dpo");
        $m!(orpo, "orpo");
        $m!(simpo, "simpo");
        $m!(kto, "kto");
        $m!(grpo, "grpo");
        $m!(reward, "reward");
        $m!(rloo, "rloo");
        $m!(pretrain, "pretrain");
        $m!(distill, "distill");
        $m!(bco, "bco");
        $m!(online_dpo, "online_dpo");
        $m!(ppo, "ppo");
    };
}
pub(crate) use for_each_task;

/// What the training loop asks of a task, whatever the backend.
pub trait TaskInfo: Send + StepPlan {
    /// The task's name (`sft`, `dpo`, …).
    fn name(&self) -> &'static str;
    /// Examples in the training set.
    fn examples(&self) -> usize;
    /// Whether the loop divides each micro-batch's loss by the step's micro-batch count
    /// (transformers does unless the loss is already normalised over the whole step).
    fn divide_by_accumulation(&self) -> bool {
        true
    }
    /// Whether the logged loss is the micro-batches' mean where the gradient is not divided
    /// (TRL's online DPO back-propagates each micro-batch's loss whole but logs it divided
    /// by `gradient_accumulation_steps`).
    fn divide_logged_loss(&self) -> bool {
        self.divide_by_accumulation()
    }
    /// Whether examples are always taken in file order (TRL's KTO trainer ignores shuffling:
    /// its KL pairs are built over consecutive examples).
    fn sequential(&self) -> bool {
        false
    }
    /// The logged figures of a window of micro-batches, from each figure's total and how many
    /// micro-batches reported it (default: the mean).
    fn window(&self, totals: &Window) -> BTreeMap<String, f64> {
        mean_window(totals)
    }
    /// What the task did to the data that the user did not ask for by name (examples left
    /// out by `max_length`), for [`super::TrainPlan::notes`].
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
    /// What a resumed run needs of the task's own state (random streams, counters).
    fn state(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
    /// Restores [`TaskInfo::state`].
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        let _ = state;
        Ok(())
    }
    /// Examples come in groups of this many consecutive indices that stay together when the
    /// data is shuffled (GRPO: the completions of one prompt).
    fn group(&self) -> usize {
        1
    }
    /// What the evaluation set's task shares with the training's (BCO's running reward
    /// shift, which evaluation reads), if anything.
    fn shared(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        None
    }
    /// Takes the training task's [`TaskInfo::shared`] state (the evaluation set's task).
    fn adopt(&mut self, shared: Arc<dyn Any + Send + Sync>) {
        let _ = shared;
    }
    /// Makes this task (built from the evaluation data) the evaluation's: what differs from
    /// training (GRPO: `num_generations_eval`, one step per generation).
    fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        let _ = config;
        Ok(())
    }
    /// How many consecutive optimisation steps run on each step's examples (GRPO's
    /// `num_iterations`: TRL's sampler repeats every generation batch that many times).
    fn repeats(&self) -> usize {
        1
    }
}

/// One task's part of a training run, on the runner `R` of some backend.
pub trait Task<R: Runner>: TaskInfo {
    /// Called with every micro-batch of the coming step (or evaluation batch) before the
    /// first is run: SFT counts its label tokens, GRPO generates and scores.
    fn begin_step(&mut self, r: &R, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        let _ = (r, micro_batches);
        Ok(())
    }
    /// The loss of one micro-batch, its figures and its token count.
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError>;
}

/// Each figure's mean over the micro-batches that reported it.
pub fn mean_window(totals: &Window) -> BTreeMap<String, f64> {
    totals
        .iter()
        .map(|(k, (s, n))| (k.clone(), s / *n as f64))
        .collect()
}

/// A training backend as the tasks see it: its model type and its runner (a marker type per
/// backend, such as `candle::Candle`).
pub trait Backend {
    /// The model type its runners run.
    type Model: Clone + Send + 'static;
    /// Its runner, borrowing the run for one pass.
    type R<'a>: Runner<Model = Self::Model>;
}

/// What a backend's run gives the tasks when they are built.
pub trait Host<B: Backend> {
    /// The tokenizer.
    fn tokenizer(&self) -> &TextTokenizer;
    /// Runs `f` with a runner over the starting weights (building DPO and KTO runs their
    /// reference over the data).
    fn with_runner<T>(&self, f: impl FnOnce(&B::R<'_>) -> T) -> T;
    /// The frozen reference as TRL makes it (DPO, GRPO): under new LoRA adapters the base
    /// model alone, when training continues an adapter that adapter as it started, in full
    /// fine-tuning the starting weights.
    fn reference(&self) -> Result<B::Model, TrainError>;
    /// KTO's reference: with LoRA the base model alone (adapters off, even when training
    /// continues an existing adapter), else the starting weights.
    fn base_reference(&self) -> Result<B::Model, TrainError>;
}

/// A task as a backend holds it: runnable by any of its runners.
pub type BoxedTask<B> = Box<dyn for<'a> Task<<B as Backend>::R<'a>>>;

/// The task `task` of `config` (its training data) on the backend `host`.
pub fn build<B: Backend>(
    task: &str,
    config: &TrainConfig,
    host: &impl Host<B>,
) -> Result<BoxedTask<B>, TrainError> {
    let tok = host.tokenizer();
    Ok(match task {
        "sft" | "pretrain" => Box::new(SftTask::new(config, tok)?),
        "dpo" => {
            let reference = host.reference()?;
            Box::new(host.with_runner(|r| DpoTask::new(config, tok, r, reference))?)
        }
        "orpo" => Box::new(ScoredPairTask::orpo(config, tok)?),
        "simpo" => Box::new(ScoredPairTask::simpo(config, tok)?),
        "kto" | "bco" => {
            let reference = host.base_reference()?;
            Box::new(host.with_runner(|r| KtoTask::new(config, tok, r, reference))?)
        }
        "grpo" | "rloo" => Box::new(GrpoTask::new(config, tok, || host.reference())?),
        "reward" => Box::new(RewardTask::new(config, tok)?),
        "distill" => Box::new(DistillTask::new(config, tok)?),
        "online_dpo" => Box::new(OnlineDpoTask::new(config, tok, host.reference()?)?),
        // TRL's PPO reference: under LoRA the base without the adapter (PEFT's
        // `disable_adapter()`), else the starting weights.
        "ppo" => Box::new(PpoTask::new(config, tok, host.base_reference()?)?),
        other => {
            return Err(TrainError::Config {
                field: "task".into(),
                message: format!("no task `{other}` (kiln has {})", TASKS.join(", ")),
            });
        }
    })
}

/// [`build`], and with `config.eval_data` the same task over the evaluation data, prepared as
/// the training set is and then made the evaluation's ([`Task::for_evaluation`]).
#[allow(clippy::type_complexity)]
pub fn build_with_eval<B: Backend>(
    task: &str,
    config: &TrainConfig,
    host: &impl Host<B>,
) -> Result<(BoxedTask<B>, Option<BoxedTask<B>>), TrainError> {
    with_eval(config, |c| build(task, c, host))
}

/// `make(config)`, and with `config.eval_data` `make` of the evaluation data, made the
/// evaluation's: the one place an evaluation set is prepared.
#[allow(clippy::type_complexity)]
pub fn with_eval<T: TaskInfo + ?Sized>(
    config: &TrainConfig,
    mut make: impl FnMut(&TrainConfig) -> Result<Box<T>, TrainError>,
) -> Result<(Box<T>, Option<Box<T>>), TrainError> {
    let task = make(config)?;
    let eval = match &config.eval_data {
        Some(path) => {
            let mut c = config.clone();
            c.train_data = Some(path.clone());
            let mut e = make(&c)?;
            if let Some(shared) = task.shared() {
                e.adopt(shared);
            }
            e.for_evaluation(&c)?;
            Some(e)
        }
        None => None,
    };
    Ok((task, eval))
}

// ---------------------------------------------------------------- the tasks, once

impl StepPlan for SftTask {}

impl TaskInfo for SftTask {
    fn name(&self) -> &'static str {
        SftTask::name(self)
    }
    fn examples(&self) -> usize {
        SftTask::examples(self)
    }
    fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        SftTask::for_evaluation(self, config)
    }
    fn divide_by_accumulation(&self) -> bool {
        false
    }
}

impl<R: Runner> Task<R> for SftTask {
    fn begin_step(&mut self, _: &R, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        SftTask::begin_step(self, micro_batches);
        Ok(())
    }
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl<M> StepPlan for DpoTask<M> {}

impl<M: Send> TaskInfo for DpoTask<M> {
    fn name(&self) -> &'static str {
        "dpo"
    }
    fn examples(&self) -> usize {
        DpoTask::examples(self)
    }
}

impl<M: Send, R: Runner<Model = M>> Task<R> for DpoTask<M> {
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl StepPlan for ScoredPairTask {}

impl TaskInfo for ScoredPairTask {
    fn name(&self) -> &'static str {
        ScoredPairTask::name(self)
    }
    fn examples(&self) -> usize {
        ScoredPairTask::examples(self)
    }
}

impl<R: Runner> Task<R> for ScoredPairTask {
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl<M> StepPlan for KtoTask<M> {}

impl<M: Send> TaskInfo for KtoTask<M> {
    fn name(&self) -> &'static str {
        KtoTask::name(self)
    }
    fn state(&self) -> serde_json::Value {
        KtoTask::state(self)
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        KtoTask::restore(self, state)
    }
    fn shared(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        Some(self.running())
    }
    fn adopt(&mut self, shared: Arc<dyn Any + Send + Sync>) {
        if let Ok(r) = shared.downcast::<std::sync::Mutex<super::losses::RunningMoments>>() {
            self.evaluate_with(r);
        }
    }
    fn examples(&self) -> usize {
        KtoTask::examples(self)
    }
    fn sequential(&self) -> bool {
        true
    }
    fn window(&self, totals: &Window) -> BTreeMap<String, f64> {
        super::losses::kto_window(totals)
    }
}

impl<M: Send, R: Runner<Model = M>> Task<R> for KtoTask<M> {
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl<M> StepPlan for GrpoTask<M> {}

impl<M: Send> TaskInfo for GrpoTask<M> {
    fn name(&self) -> &'static str {
        GrpoTask::name(self)
    }
    fn examples(&self) -> usize {
        GrpoTask::examples(self)
    }
    fn divide_by_accumulation(&self) -> bool {
        GrpoTask::divide_by_accumulation(self)
    }
    fn state(&self) -> serde_json::Value {
        GrpoTask::state(self)
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        GrpoTask::restore(self, state)
    }
    fn group(&self) -> usize {
        GrpoTask::group(self)
    }
    fn for_evaluation(&mut self, config: &TrainConfig) -> Result<(), TrainError> {
        GrpoTask::for_evaluation(self, config)
    }
    fn repeats(&self) -> usize {
        GrpoTask::repeats(self)
    }
}

impl<M: Send, R: Runner<Model = M>> Task<R> for GrpoTask<M> {
    fn begin_step(&mut self, r: &R, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        GrpoTask::begin_step(self, r, micro_batches)
    }
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl StepPlan for RewardTask {}

impl TaskInfo for RewardTask {
    fn name(&self) -> &'static str {
        "reward"
    }
    fn examples(&self) -> usize {
        RewardTask::examples(self)
    }
    fn notes(&self) -> Vec<String> {
        RewardTask::notes(self)
    }
}

impl<R: Runner> Task<R> for RewardTask {
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl StepPlan for DistillTask {}

impl TaskInfo for DistillTask {
    fn name(&self) -> &'static str {
        "distill"
    }
    fn examples(&self) -> usize {
        DistillTask::examples(self)
    }
    // TRL's GKD loss is each micro-batch's mean, and transformers does not divide it by the
    // accumulation steps (the model takes loss kwargs and the batch has labels).
    fn divide_by_accumulation(&self) -> bool {
        false
    }
    fn state(&self) -> serde_json::Value {
        DistillTask::state(self)
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        DistillTask::restore(self, state)
    }
    fn for_evaluation(&mut self, _: &TrainConfig) -> Result<(), TrainError> {
        DistillTask::for_evaluation(self);
        Ok(())
    }
}

impl<R: Runner> Task<R> for DistillTask {
    fn begin_step(&mut self, r: &R, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        DistillTask::begin_step(self, r, micro_batches)
    }
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl<M> StepPlan for OnlineDpoTask<M> {}

impl<M: Send> TaskInfo for OnlineDpoTask<M> {
    fn name(&self) -> &'static str {
        "online_dpo"
    }
    fn examples(&self) -> usize {
        OnlineDpoTask::examples(self)
    }
    fn divide_by_accumulation(&self) -> bool {
        false
    }
    fn divide_logged_loss(&self) -> bool {
        true
    }
    fn state(&self) -> serde_json::Value {
        OnlineDpoTask::state(self)
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        OnlineDpoTask::restore(self, state)
    }
}

impl<M: Send, R: Runner<Model = M>> Task<R> for OnlineDpoTask<M> {
    fn begin_step(&mut self, r: &R, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        OnlineDpoTask::begin_step(self, r, micro_batches)
    }
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}

impl<M> StepPlan for PpoTask<M> {
    fn plan(&mut self, micro_batches: &[Vec<usize>], last_of_epoch: bool) -> Vec<Vec<Vec<usize>>> {
        PpoTask::plan(self, micro_batches, last_of_epoch)
    }
    fn clips_gradients(&self) -> bool {
        false
    }
    fn logs_every_step(&self) -> bool {
        true
    }
    fn drop_last(&self) -> bool {
        true
    }
    fn total_steps(&self) -> Option<u64> {
        Some(PpoTask::total_steps(self))
    }
    fn epoch_order(&mut self, epoch: u64) -> Option<Vec<usize>> {
        PpoTask::epoch_order(self, epoch)
    }
}

impl<M: Send> TaskInfo for PpoTask<M> {
    fn name(&self) -> &'static str {
        "ppo"
    }
    fn examples(&self) -> usize {
        PpoTask::examples(self)
    }
    // The loss is already divided by gradient_accumulation_steps, as accelerate divides it.
    fn divide_by_accumulation(&self) -> bool {
        false
    }
    fn divide_logged_loss(&self) -> bool {
        false
    }
    fn window(&self, totals: &Window) -> BTreeMap<String, f64> {
        PpoTask::window(self, totals)
    }
    fn state(&self) -> serde_json::Value {
        PpoTask::state(self)
    }
    fn restore(&mut self, state: &serde_json::Value) -> Result<(), TrainError> {
        PpoTask::restore(self, state)
    }
}

impl<M: Send, R: Runner<Model = M>> Task<R> for PpoTask<M> {
    fn begin_step(&mut self, r: &R, micro_batches: &[Vec<usize>]) -> Result<(), TrainError> {
        PpoTask::begin_step(self, r, micro_batches)
    }
    fn micro_batch(&self, r: &R, indices: &[usize]) -> Result<MicroBatch<TensorOf<R>>, TrainError> {
        self.loss(r, indices)
    }
}
