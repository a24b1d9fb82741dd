//! The trainer interface: configuration, the `Trainer` trait, progress callbacks, reports.
//!
//! A trainer is constructed from a [`TrainConfig`] only after routing has chosen it
//! ([`crate::resolve_trainer`]), then `train` runs to completion, reporting progress to a
//! [`TrainObserver`] that can also stop it early.

use serde::{Deserialize, Serialize};
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
    pub hyper: Hyperparameters,
    /// LoRA adapters on Linear layers; `None` = full fine-tuning.
    #[serde(default)]
    pub lora: Option<LoraConfig>,
    /// Task-specific settings, by TRL's names.
    #[serde(default)]
    pub task_options: serde_json::Map<String, serde_json::Value>,
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
            task_options: serde_json::Map::new(),
        }
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
    pub learning_rate: f64,
    pub num_train_epochs: f64,
    /// Overrides `num_train_epochs` when set.
    pub max_steps: Option<u64>,
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub max_grad_norm: Option<f64>,
    pub max_length: Option<usize>,
    /// `linear`, `cosine`, `constant`.
    pub lr_scheduler_type: String,
    pub seed: u64,
    pub logging_steps: u64,
    /// Save a checkpoint every N steps (`None`: only at the end).
    pub save_steps: Option<u64>,
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
            max_grad_norm: Some(1.0),
            max_length: Some(1024),
            lr_scheduler_type: "linear".to_string(),
            seed: 42,
            logging_steps: 10,
            save_steps: None,
        }
    }
}

/// LoRA adapter settings (PEFT's names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraConfig {
    pub r: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    /// Module names (`q_proj`, ...) or `all-linear`.
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 16,
            lora_alpha: 32.0,
            lora_dropout: 0.0,
            target_modules: vec!["all-linear".into()],
        }
    }
}

/// What a run will do, announced before the first step.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainPlan {
    pub total_steps: u64,
    pub examples: u64,
    pub trainable_parameters: u64,
}

/// One optimisation step's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMetrics {
    pub step: u64,
    pub epoch: f64,
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: Option<f64>,
    pub tokens: u64,
    /// Task-specific figures by TRL's names (`rewards/chosen`, `kl`, ...).
    pub extra: BTreeMap<String, f64>,
}

/// The outcome of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainReport {
    pub task: String,
    pub backend: String,
    pub steps: u64,
    pub final_loss: Option<f64>,
    /// Final figures by name (`eval_loss`, `rewards/accuracies`, ...).
    pub metrics: BTreeMap<String, f64>,
    /// The written checkpoint or adapter.
    pub output: Option<PathBuf>,
    pub elapsed: Duration,
    /// Whether the observer stopped the run before its planned end.
    pub stopped_early: bool,
}

/// Progress callbacks. Every method has a default, so an observer implements what it needs.
pub trait TrainObserver {
    fn on_start(&mut self, plan: &TrainPlan) {
        let _ = plan;
    }
    fn on_step(&mut self, metrics: &StepMetrics) {
        let _ = metrics;
    }
    fn on_eval(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        let _ = (step, metrics);
    }
    fn on_checkpoint(&mut self, step: u64, path: &std::path::Path) {
        let _ = (step, path);
    }
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
    Config { field: String, message: String },
    /// Training data is unreadable or malformed.
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Data {
        path: PathBuf,
        line: Option<usize>,
        message: String,
    },
    /// The backend failed (device, kernel, runtime).
    #[error("backend '{backend}': {message}")]
    Backend { backend: String, message: String },
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A trainer for one `(task, backend)`. Register it with `#[trainer(task = ..., backend = ...)]`.
pub trait Trainer: Send {
    /// Builds the trainer from a configuration (validate it here: fail before any work).
    fn new(config: &TrainConfig) -> Result<Self, TrainError>
    where
        Self: Sized;

    /// Runs training to completion (or until `observer.should_stop()`).
    fn train(&mut self, observer: &mut dyn TrainObserver) -> Result<TrainReport, TrainError>;
}
