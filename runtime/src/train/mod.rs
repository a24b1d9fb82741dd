//! The trainer interface: configuration, the `Trainer` trait, progress callbacks, reports.
//!
//! A trainer is constructed from a [`TrainConfig`] only after routing has chosen it
//! ([`crate::resolve_trainer`]), then `train` runs to completion, reporting progress to a
//! [`TrainObserver`] that can also stop it early.

#[cfg(feature = "exec")]
pub mod candle;
#[cfg(feature = "exec")]
pub mod chat;
#[cfg(feature = "exec")]
pub mod checkpoint;
#[cfg(feature = "exec")]
pub mod data;
pub mod driver;
pub mod fields;
#[cfg(feature = "exec")]
pub use tasks::grpo;
pub mod losses;
#[cfg(feature = "mlx")]
pub mod mlx;
pub mod ops;
pub mod optim;
#[cfg(feature = "exec")]
pub mod output;
pub mod registry;
#[cfg(feature = "exec")]
pub mod reward_model;
pub mod reward_registry;
pub mod rewards;
#[cfg(feature = "exec")]
pub mod runner;
pub mod schedule;
#[cfg(feature = "exec")]
pub mod task;
#[cfg(feature = "exec")]
pub mod tasks;
pub mod trl_fields;

use serde::{Deserialize, Serialize};

/// A [`TrainError::Config`] naming `field`.
pub(crate) fn config_err(field: &str, message: impl Into<String>) -> TrainError {
    TrainError::Config {
        field: field.to_string(),
        message: message.into(),
    }
}

/// How PPO's value model's parameters are named among the trainable ones (and in
/// checkpoints): `value_model.<tensor>`.
pub const VALUE_PREFIX: &str = "value_model.";

/// PPO's value model folder (other tasks have none): `value_model_path`, else
/// `reward_model_path` (TRL's PPO example starts the value model from the reward model),
/// else the policy's own folder (a new `score` head, said by name when the run starts).
#[cfg(feature = "exec")]
pub(crate) fn value_model_dir(
    config: &TrainConfig,
) -> Result<Option<std::path::PathBuf>, TrainError> {
    if config.task != "ppo" {
        return Ok(None);
    }
    let dir = match config.option::<String>("value_model_path")? {
        Some(p) => std::path::PathBuf::from(p),
        None => match config.option::<String>("reward_model_path")? {
            Some(p) => std::path::PathBuf::from(p),
            None => config.model.clone(),
        },
    };
    if !dir.join("config.json").is_file() {
        return Err(config_err(
            "value_model_path",
            format!("{}: not a model folder (no config.json)", dir.display()),
        ));
    }
    Ok(Some(dir))
}

/// Whether `config.model` is a quantized export (any format a registered reader recognises),
/// the base QLoRA trains over; where it is, the run must train adapters and must not merge
/// them (both backends ask the same).
#[cfg(feature = "exec")]
pub(crate) fn quantized_base(config: &TrainConfig) -> Result<bool, TrainError> {
    let quantized = crate::formats::detect(&config.model)
        .map_err(TrainError::from)?
        .is_some();
    if quantized && config.merge {
        return Err(config_err(
            "merge",
            format!(
                "{} is a quantized export: merging an adapter into its packed weights \
                 would re-quantize them; save the adapter (without --merge) and apply it \
                 to the original model",
                config.model.display()
            ),
        ));
    }
    if quantized && config.lora.is_none() && config.init_adapter.is_none() {
        return Err(config_err(
            "model",
            format!(
                "{} is a quantized export: its weights cannot be trained themselves; train \
                 LoRA adapters on it (QLoRA: --use-peft / lora settings) or train the \
                 original model",
                config.model.display()
            ),
        ));
    }
    Ok(quantized)
}

/// The layout a LoRA adapter is written in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdapterFormat {
    /// PEFT's `adapter_model.safetensors` + `adapter_config.json` (what `peft` loads).
    #[default]
    Peft,
    /// mlx-lm's `adapters.safetensors` + `adapter_config.json` (what `mlx_lm` loads).
    MlxLm,
    /// llama.cpp's LoRA adapter `adapter.gguf` (what `llama-cli --lora` loads), beside PEFT's
    /// files.
    Gguf,
}
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Everything a training run needs. Task-specific settings (DPO's `beta`, GRPO's
/// `num_generations`, ...) live in `task_options`, read with [`TrainConfig::option`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    /// `sft`, `dpo`, `orpo`, `simpo`, `kto`, `grpo`, or a plugin's task.
    pub task: String,
    /// `candle` (default), `mlx`, or a plugin's backend.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// The model folder to start from.
    pub model: PathBuf,
    /// Where the trained checkpoint (or adapter) is written.
    pub output: PathBuf,
    /// Training data (JSONL).
    #[serde(default)]
    pub train_data: Option<PathBuf>,
    /// Evaluation data (JSONL).
    #[serde(default)]
    pub eval_data: Option<PathBuf>,
    /// `cpu`, `cuda:N`, `metal`.
    #[serde(default = "default_device")]
    pub device: String,
    #[serde(default)]
    /// Optimisation settings.
    pub hyper: Hyperparameters,
    /// LoRA adapters on Linear layers; `None` = full fine-tuning.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    /// Start from this PEFT adapter folder (trainable; implies LoRA with its settings).
    #[serde(default)]
    pub init_adapter: Option<PathBuf>,
    /// With LoRA, also write the merged full checkpoint (`<output>/merged`).
    #[serde(default)]
    pub merge: bool,
    /// The adapter's layout: `peft` (`adapter_model.safetensors`, default) or `mlx-lm`
    /// (`adapters.safetensors`, mlx-lm's `adapter_config.json`).
    #[serde(default)]
    pub adapter_format: AdapterFormat,
    /// Continue the run saved in this checkpoint folder (`<output>/checkpoint-<step>`):
    /// weights, optimizer state, step, data position and random streams.
    #[serde(default)]
    pub resume: Option<PathBuf>,
    /// Task-specific settings, by TRL's names.
    #[serde(default)]
    pub task_options: serde_json::Map<String, serde_json::Value>,
    /// transformers' `output_dir` from a `--config` file: the output folder when the command
    /// line names none.
    #[serde(default)]
    pub output_dir: Option<PathBuf>,
}

fn default_backend() -> String {
    "candle".to_string()
}

fn default_device() -> String {
    "cpu".to_string()
}

impl TrainConfig {
    /// A configuration with defaults for everything but the essentials.
    pub fn new(
        task: &str,
        backend: &str,
        model: impl Into<PathBuf>,
        output: impl Into<PathBuf>,
    ) -> Self {
        TrainConfig {
            task: task.to_string(),
            backend: backend.to_string(),
            model: model.into(),
            output: output.into(),
            train_data: None,
            eval_data: None,
            device: default_device(),
            hyper: Hyperparameters::default(),
            lora: None,
            init_adapter: None,
            merge: false,
            adapter_format: AdapterFormat::Peft,
            resume: None,
            task_options: serde_json::Map::new(),
            output_dir: None,
        }
    }

    /// TRL's `disable_dropout`: no dropout in the policy while training, LoRA's included
    /// (TRL sets every `nn.Dropout` to 0). TRL's default: on for dpo, online_dpo, orpo, simpo,
    /// kto, bco, reward and distill, off for grpo and rloo; SFT has no such field and keeps its dropout.
    pub fn disable_dropout(&self) -> Result<bool, TrainError> {
        let default = matches!(
            self.task.as_str(),
            "dpo" | "orpo" | "simpo" | "kto" | "reward" | "distill" | "bco" | "online_dpo" | "ppo"
        );
        Ok(self.option::<bool>("disable_dropout")?.unwrap_or(default))
    }

    /// TRL's `bf16`: mixed precision, the Linears run as PyTorch's CPU
    /// autocast to bf16 runs them ([`crate::model::DecoderModel::with_bf16_autocast`]).
    /// kiln's default is f32 (false); TRL's `None` resolves to true unless `fp16` is set, so a
    /// TRL run that leaves it out trains in mixed precision where kiln trains in f32.
    pub fn bf16(&self) -> Result<bool, TrainError> {
        Ok(self.option::<bool>("bf16")?.unwrap_or(false))
    }

    /// TRL's `gradient_checkpointing` (every TRL 0.29 config defaults it to true): each decoder
    /// layer keeps only its input for the backward pass and is recomputed there — less memory,
    /// one more forward pass of every layer, the same numbers.
    pub fn gradient_checkpointing(&self) -> Result<bool, TrainError> {
        Ok(self
            .option::<bool>("gradient_checkpointing")?
            .unwrap_or(true))
    }

    /// A task option, deserialized; `Ok(None)` when absent, an error naming the option when
    /// it has the wrong type.
    pub fn option<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
    ) -> Result<Option<T>, TrainError> {
        match self.task_options.get(name) {
            None => Ok(None),
            Some(v) => {
                serde_json::from_value(v.clone())
                    .map(Some)
                    .map_err(|e| TrainError::Config {
                        field: format!("task_options.{name}"),
                        message: e.to_string(),
                    })
            }
        }
    }
}

/// Optimisation settings shared by every task (TRL's `TrainingArguments` names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Hyperparameters {
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Passes over the data.
    pub num_train_epochs: f64,
    /// Overrides `num_train_epochs` when set.
    pub max_steps: Option<u64>,
    /// Examples per micro-batch.
    pub per_device_train_batch_size: usize,
    /// Micro-batches per optimisation step.
    pub gradient_accumulation_steps: usize,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// AdamW weight decay (not on biases and norm weights, as transformers).
    pub weight_decay: f64,
    /// AdamW β₁.
    pub adam_beta1: f64,
    /// AdamW β₂.
    pub adam_beta2: f64,
    /// AdamW ε.
    pub adam_epsilon: f64,
    /// Gradient-norm clip (`None`: no clipping).
    pub max_grad_norm: Option<f64>,
    /// Truncate sequences to this many tokens.
    pub max_length: Option<usize>,
    /// `linear`, `cosine`, `constant`.
    pub lr_scheduler_type: String,
    /// `random` (shuffled each epoch, seeded) or `sequential` (file order), transformers'
    /// `train_sampling_strategy`.
    pub train_sampling_strategy: String,
    /// Seed for shuffling and initialisation.
    pub seed: u64,
    /// Report metrics every N steps.
    pub logging_steps: u64,
    /// Save a checkpoint every N steps (`None`: only at the end).
    pub save_steps: Option<u64>,
    /// Keep at most this many checkpoints, deleting the oldest (`None`: all), transformers'
    /// `save_total_limit`.
    pub save_total_limit: Option<usize>,
    /// Evaluate on the evaluation data every N steps (`None`: never).
    pub eval_steps: Option<u64>,
    /// Examples per evaluation batch.
    pub per_device_eval_batch_size: usize,
}

impl Default for Hyperparameters {
    fn default() -> Self {
        Hyperparameters {
            learning_rate: 2e-5,
            num_train_epochs: 1.0,
            max_steps: None,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            warmup_steps: 0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: Some(1.0),
            max_length: Some(1024),
            lr_scheduler_type: "linear".to_string(),
            train_sampling_strategy: "random".to_string(),
            seed: 42,
            logging_steps: 10,
            save_steps: None,
            save_total_limit: None,
            eval_steps: None,
            per_device_eval_batch_size: 8,
        }
    }
}

/// LoRA adapter settings (PEFT's names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    /// Adapter rank.
    pub r: usize,
    /// Scaling numerator (`alpha / r`).
    pub lora_alpha: f64,
    /// Dropout on the adapter input.
    pub lora_dropout: f64,
    /// Module names (`q_proj`, ...), globs over module paths, or `all-linear`.
    pub target_modules: Vec<String>,
    /// rsLoRA: scale by `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 16,
            lora_alpha: 32.0,
            lora_dropout: 0.0,
            target_modules: vec!["all-linear".into()],
            use_rslora: false,
        }
    }
}

/// What a run will do, announced before the first step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainPlan {
    /// Optimisation steps planned.
    pub total_steps: u64,
    /// Training examples.
    pub examples: u64,
    /// Parameters that receive gradients.
    pub trainable_parameters: u64,
    /// What this backend does differently from the settings asked for (a setting it does not
    /// build, and what it does instead), one sentence each naming the setting.
    pub notes: Vec<String>,
}

/// One optimisation step's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepMetrics {
    /// The step, from 1.
    pub step: u64,
    /// Fractional epoch.
    pub epoch: f64,
    /// The step's mean loss.
    pub loss: f64,
    /// The learning rate used for the step.
    pub learning_rate: f64,
    /// Gradient norm before clipping.
    pub grad_norm: Option<f64>,
    /// Tokens seen so far.
    pub tokens: u64,
    /// Task-specific figures by TRL's names (`rewards/chosen`, `kl`, ...).
    pub extra: BTreeMap<String, f64>,
}

/// The outcome of a run. Start from [`TrainReport::new`] and set what the run measured:
///
/// ```
/// let mut report = kiln_runtime::TrainReport::new("sft", "candle");
/// report.steps = 10;
/// report.final_loss = Some(0.25);
/// assert!(!report.stopped_early);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainReport {
    /// The task name (`sft`, `dpo`, ...).
    pub task: String,
    /// The backend name (`candle`, `mlx`, ...).
    pub backend: String,
    /// Steps run.
    pub steps: u64,
    /// The last step's loss.
    pub final_loss: Option<f64>,
    /// Final figures by name (`eval_loss`, `rewards/accuracies`, ...).
    pub metrics: BTreeMap<String, f64>,
    /// The written checkpoint or adapter.
    pub output: Option<PathBuf>,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Whether the observer stopped the run before its planned end.
    pub stopped_early: bool,
}

impl TrainReport {
    /// A report of a run of `task` on `backend` that has done nothing yet: no steps, no loss,
    /// no metrics, no output.
    pub fn new(task: &str, backend: &str) -> Self {
        TrainReport {
            task: task.to_string(),
            backend: backend.to_string(),
            ..TrainReport::default()
        }
    }
}

/// Progress callbacks. Every method has a default, so an observer implements what it needs.
pub trait TrainObserver {
    /// Called once, before the first step.
    fn on_start(&mut self, plan: &TrainPlan) {
        let _ = plan;
    }
    /// Called after each optimisation step.
    fn on_step(&mut self, metrics: &StepMetrics) {
        let _ = metrics;
    }
    /// Called after each evaluation.
    fn on_eval(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        let _ = (step, metrics);
    }
    /// Called after each checkpoint is written.
    fn on_checkpoint(&mut self, step: u64, path: &std::path::Path) {
        let _ = (step, path);
    }
    /// Called once, at the end.
    fn on_end(&mut self, report: &TrainReport) {
        let _ = report;
    }
    /// Polled between steps: `true` ends the run cleanly (the report says so).
    fn should_stop(&mut self) -> bool {
        false
    }
}

/// An observer that ignores everything.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopObserver;
impl TrainObserver for NoopObserver {}

/// A training error, naming the field, file or backend involved.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A configuration field is missing or invalid.
    #[error("config field `{field}`: {message}")]
    Config {
        /// The field at fault.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// Training data is unreadable or malformed.
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Data {
        /// The file involved.
        path: PathBuf,
        /// The 1-based line, when known.
        line: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// The backend failed (device, kernel, runtime).
    #[error("backend '{backend}': {message}")]
    Backend {
        /// The backend name (`candle`, `mlx`, ...).
        backend: String,
        /// What is wrong.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A trainer for one `(task, backend)`. Register it with `#[trainer(task = ..., backend = ...)]`.
///
/// ```
/// use kiln_runtime::{TrainConfig, TrainError, TrainObserver, TrainReport, Trainer};
///
/// #[kiln_runtime::trainer(task = "count", backend = "candle", crate = kiln_runtime)]
/// struct Count {
///     steps: u64,
/// }
///
/// impl Trainer for Count {
///     fn new(config: &TrainConfig) -> Result<Self, TrainError> {
///         let steps = config.hyper.max_steps.ok_or_else(|| TrainError::Config {
///             field: "max_steps".into(),
///             message: "required".into(),
///         })?;
///         Ok(Count { steps })
///     }
///
///     fn train(&mut self, observer: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
///         let mut report = TrainReport::new("count", "candle");
///         while report.steps < self.steps && !observer.should_stop() {
///             report.steps += 1;
///         }
///         report.stopped_early = report.steps < self.steps;
///         Ok(report)
///     }
/// }
///
/// let mut config = TrainConfig::new("count", "candle", "model", "out");
/// config.hyper.max_steps = Some(3);
/// let entry = kiln_runtime::resolve_trainer(&config).unwrap();
/// let report = entry.construct(&config).unwrap().train(&mut kiln_runtime::train::NoopObserver).unwrap();
/// assert_eq!(report.steps, 3);
/// ```
pub trait Trainer: Send {
    /// Builds the trainer from a configuration (validate it here: fail before any work).
    fn new(config: &TrainConfig) -> Result<Self, TrainError>
    where
        Self: Sized;

    /// Runs training to completion (or until `observer.should_stop()`).
    fn train(&mut self, observer: &mut dyn TrainObserver) -> Result<TrainReport, TrainError>;
}
