//! The training settings by TRL's field names: one table drives `kiln train`'s flags
//! (`--learning-rate`), the keys of its `--config` TOML file (`learning_rate`) and where each
//! lands in a [`TrainConfig`]. An unknown name is an error naming the nearest known one; a
//! task's own field given to another task is an error naming the tasks that take it.

use super::{LoraConfig, TrainConfig, TrainError};
use serde_json::Value;

/// A field's value type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A number.
    Float,
    /// A non-negative integer.
    Int,
    /// `true` / `false`.
    Bool,
    /// A string.
    Text,
    /// A list of strings (comma-separated on the command line).
    List,
    /// A list of numbers (comma-separated on the command line).
    Numbers,
    /// A name or a list of names (comma-separated on the command line).
    Names,
}

/// One setting.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// TRL's name (snake_case; the flag is the kebab-case form).
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// The tasks that take it (empty: every task).
    pub tasks: &'static [&'static str],
    /// One line of help, with TRL's default.
    pub help: &'static str,
}

const SFT: &[&str] = &["sft", "pretrain"];
const BETA: &[&str] = &[
    "dpo",
    "orpo",
    "simpo",
    "kto",
    "grpo",
    "rloo",
    "distill",
    "bco",
    "online_dpo",
];
const LOSS: &[&str] = &[
    "sft",
    "pretrain",
    "dpo",
    "simpo",
    "kto",
    "grpo",
    "online_dpo",
];
const DPO: &[&str] = &["dpo"];
const SMOOTH: &[&str] = &["dpo", "simpo"];
const DROPOUT: &[&str] = &[
    "dpo",
    "orpo",
    "simpo",
    "kto",
    "grpo",
    "reward",
    "rloo",
    "distill",
    "bco",
    "online_dpo",
];
const DISTILL: &[&str] = &["distill"];
/// The tasks that sample at a temperature.
const TEMPERATURE: &[&str] = &["grpo", "rloo", "distill", "online_dpo", "ppo"];
const NEW_TOKENS: &[&str] = &["distill", "online_dpo"];
const RLOO: &[&str] = &["rloo"];
const REWARD: &[&str] = &["reward"];
const REF: &[&str] = &["dpo", "kto", "bco"];
const KTO: &[&str] = &["kto"];
const GRPO: &[&str] = &["grpo"];
/// The tasks that sample completions and score them with rewards.
const SAMPLED: &[&str] = &["grpo", "rloo"];
/// The tasks that rank or score sampled completions by rewards.
const REWARDED: &[&str] = &["grpo", "rloo", "online_dpo", "ppo"];
/// The tasks that sample with the usual filters (top-p, top-k, min-p, repetition penalty).
const FILTERED: &[&str] = &["grpo", "rloo", "online_dpo"];
/// Online DPO and PPO: a reward model beside (or instead of) the functions, the missing-EOS
/// penalty.
const SCORED: &[&str] = &["online_dpo", "ppo"];
const PPO: &[&str] = &["ppo"];
const SIMPO: &[&str] = &["simpo"];

/// Every setting `kiln train` takes.
pub const FIELDS: &[Field] = &[
    f(
        "num_generations",
        Kind::Int,
        SAMPLED,
        "Completions sampled per prompt [8; rloo: 2]",
    ),
    f(
        "max_completion_length",
        Kind::Int,
        SAMPLED,
        "Most tokens per completion [256]",
    ),
    f(
        "temperature",
        Kind::Float,
        TEMPERATURE,
        "Sampling temperature (also divides the logits in the loss) [1; online_dpo 0.9; ppo 0.7]",
    ),
    f("top_p", Kind::Float, FILTERED, "Nucleus sampling mass [1]"),
    f(
        "top_k",
        Kind::Int,
        FILTERED,
        "Sample among the k most likely tokens; 0 = all [0]",
    ),
    f(
        "min_p",
        Kind::Float,
        FILTERED,
        "Drop tokens less likely than this times the most likely [off]",
    ),
    f(
        "repetition_penalty",
        Kind::Float,
        FILTERED,
        "Penalty on tokens already present [1]",
    ),
    f(
        "epsilon",
        Kind::Float,
        SAMPLED,
        "Lower clip of the probability ratio [0.2]",
    ),
    f(
        "epsilon_high",
        Kind::Float,
        SAMPLED,
        "Upper clip of the ratio [= epsilon]",
    ),
    f(
        "delta",
        Kind::Float,
        GRPO,
        "Upper bound on the unclipped ratio (two-sided clipping) [off]",
    ),
    f(
        "scale_rewards",
        Kind::Text,
        GRPO,
        "Divide advantages by the group's std (group), the batch's (batch) or not (none) [group]",
    ),
    f(
        "reward_funcs",
        Kind::List,
        REWARDED,
        "Reward functions by name (`kiln registry rewards` lists them) or reward models by folder (`kiln train --task reward` output) [exact_match]",
    ),
    f(
        "reward_weights",
        Kind::Numbers,
        REWARDED,
        "One weight per reward function [1 each]",
    ),
    f(
        "num_generations_eval",
        Kind::Int,
        SAMPLED,
        "Completions per prompt when evaluating [= num_generations]",
    ),
    f(
        "num_iterations",
        Kind::Int,
        SAMPLED,
        "Optimisation steps on each generation batch (ratios move off 1 after the first) [1]",
    ),
    f(
        "mask_truncated_completions",
        Kind::Bool,
        SAMPLED,
        "Leave completions that hit the length limit out of the loss [false]",
    ),
    f(
        "answer_column",
        Kind::Text,
        SAMPLED,
        "The column exact_match compares with [answer]",
    ),
    f(
        "reward_regex",
        Kind::Text,
        SAMPLED,
        "The pattern of the `regex` reward",
    ),
    f(
        "reward_length_target",
        Kind::Int,
        SAMPLED,
        "Completion tokens the `length` reward allows before its penalty [128]",
    ),
    f(
        "learning_rate",
        Kind::Float,
        &[],
        "Peak learning rate (TRL: sft 2e-5, dpo 1e-6)",
    ),
    f(
        "num_train_epochs",
        Kind::Float,
        &[],
        "Passes over the data [3]",
    ),
    f(
        "max_steps",
        Kind::Int,
        &[],
        "Optimisation steps; overrides num_train_epochs",
    ),
    f(
        "per_device_train_batch_size",
        Kind::Int,
        &[],
        "Examples per micro-batch [8]",
    ),
    f(
        "gradient_accumulation_steps",
        Kind::Int,
        &[],
        "Micro-batches per optimisation step [1]",
    ),
    f("warmup_steps", Kind::Int, &[], "Linear warm-up steps [0]"),
    f(
        "weight_decay",
        Kind::Float,
        &[],
        "AdamW decoupled weight decay [0]",
    ),
    f("adam_beta1", Kind::Float, &[], "AdamW beta1 [0.9]"),
    f("adam_beta2", Kind::Float, &[], "AdamW beta2 [0.999]"),
    f("adam_epsilon", Kind::Float, &[], "AdamW epsilon [1e-8]"),
    f(
        "max_grad_norm",
        Kind::Float,
        &[],
        "Clip the global gradient norm to this; 0 = no clipping [1]",
    ),
    f(
        "max_length",
        Kind::Int,
        &[],
        "Truncate sequences to this many tokens, keeping the start; 0 = none [1024]",
    ),
    f(
        "lr_scheduler_type",
        Kind::Text,
        &[],
        "linear, cosine, constant or constant_with_warmup [linear]",
    ),
    f(
        "train_sampling_strategy",
        Kind::Text,
        &[],
        "random (shuffled, seeded) or sequential [random]",
    ),
    f(
        "seed",
        Kind::Int,
        &[],
        "Seed for shuffling, adapter initialisation and dropout [42]",
    ),
    f(
        "logging_steps",
        Kind::Int,
        &[],
        "Log (and write --metrics) every N steps [1]",
    ),
    f(
        "save_steps",
        Kind::Int,
        &[],
        "Save a resumable checkpoint (<out>/checkpoint-N) every N steps; 0 = none [0]",
    ),
    f(
        "save_total_limit",
        Kind::Int,
        &[],
        "Keep only the newest N checkpoints, deleting older ones; 0 = keep all [all]",
    ),
    f(
        "eval_steps",
        Kind::Int,
        &[],
        "Evaluate on --eval-data every N steps (and log eval_loss and the task's eval_ figures) [off]",
    ),
    f(
        "per_device_eval_batch_size",
        Kind::Int,
        &[],
        "Examples per evaluation batch [8]",
    ),
    f(
        "lora_r",
        Kind::Int,
        &[],
        "LoRA rank; 0 = full fine-tuning [16]",
    ),
    f(
        "lora_alpha",
        Kind::Float,
        &[],
        "LoRA alpha; the scale is alpha/r [32]",
    ),
    f(
        "lora_dropout",
        Kind::Float,
        &[],
        "Dropout on the LoRA input [0.05]",
    ),
    f(
        "lora_target_modules",
        Kind::List,
        &[],
        "Linear layers to adapt: names, globs or all-linear [all-linear]",
    ),
    f(
        "use_rslora",
        Kind::Bool,
        &[],
        "Scale by alpha/sqrt(r) (rsLoRA) [false]",
    ),
    f(
        "assistant_only_loss",
        Kind::Bool,
        SFT,
        "Train only on the tokens the chat template marks with {% generation %} [false]",
    ),
    f(
        "completion_only_loss",
        Kind::Bool,
        SFT,
        "Train only on completions of prompt+completion data [true]",
    ),
    f(
        "beta",
        Kind::Float,
        BETA,
        "The KL / preference strength beta [0.1; grpo: 0; rloo: 0.05]",
    ),
    f(
        "loss_type",
        Kind::Names,
        LOSS,
        "sft: nll or dft [nll]; dpo: one or a list of sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft [sigmoid]; simpo: simpo, sigmoid, hinge or ipo (CPO) [simpo]; kto: kto or apo_zero_unpaired [kto]; grpo: dapo, grpo, bnpo or dr_grpo [dapo]",
    ),
    f(
        "loss_weights",
        Kind::Numbers,
        DPO,
        "One weight per loss_type; the loss is their weighted sum [1 each]",
    ),
    f(
        "f_divergence_type",
        Kind::Text,
        DPO,
        "reverse_kl, forward_kl, js_divergence or alpha_divergence [reverse_kl]",
    ),
    f(
        "f_alpha_divergence_coef",
        Kind::Float,
        DPO,
        "alpha of alpha_divergence [0.5]",
    ),
    f(
        "ld_alpha",
        Kind::Float,
        DPO,
        "LD-DPO: weight of the longer completion's tokens past the shorter's length [off]",
    ),
    f(
        "use_weighting",
        Kind::Bool,
        DPO,
        "WPO: weight each pair by its completions' probabilities [false]",
    ),
    f(
        "discopop_tau",
        Kind::Float,
        DPO,
        "DiscoPOP's temperature [0.05]",
    ),
    f(
        "precompute_ref_batch_size",
        Kind::Int,
        DPO,
        "Batch size of the reference pass with precompute_ref_log_probs [per_device_train_batch_size]",
    ),
    f(
        "bf16",
        Kind::Bool,
        &[],
        "Mixed precision as PyTorch's CPU autocast runs it: every Linear in bf16 (f32 sums), everything else f32; candle on the CPU, full fine-tuning [false: f32; TRL's default resolves to true]",
    ),
    f(
        "gradient_checkpointing",
        Kind::Bool,
        &[],
        "Recompute each layer's activations in the backward pass instead of keeping them (less memory, one more forward of every layer, the same numbers) [true]",
    ),
    f(
        "disable_dropout",
        Kind::Bool,
        DROPOUT,
        "No dropout in the policy, LoRA's included [true; grpo: false]",
    ),
    f(
        "desirable_weight",
        Kind::Float,
        KTO,
        "Weight of desirable examples' losses [1]",
    ),
    f(
        "undesirable_weight",
        Kind::Float,
        KTO,
        "Weight of undesirable examples' losses [1]",
    ),
    f(
        "precompute_ref_log_probs",
        Kind::Bool,
        REF,
        "Compute the reference log-probs once, before training [false]",
    ),
    f(
        "simpo_gamma",
        Kind::Float,
        SIMPO,
        "SimPO's target reward margin [0.5]",
    ),
    f(
        "cpo_alpha",
        Kind::Float,
        SIMPO,
        "Weight of the chosen NLL term; 0 = pure SimPO [1]",
    ),
    f(
        "teacher_model_name_or_path",
        Kind::Text,
        DISTILL,
        "The teacher: any model kiln reads (a quantized export saves memory) [required]",
    ),
    f(
        "lmbda",
        Kind::Float,
        DISTILL,
        "Probability that a micro-batch's completions are the student's own samples (on-policy) [0.5]",
    ),
    f(
        "seq_kd",
        Kind::Bool,
        DISTILL,
        "Train on the teacher's sampled completions (sequence-level KD) [false]",
    ),
    f(
        "max_new_tokens",
        Kind::Int,
        NEW_TOKENS,
        "Most tokens sampled per completion [128; online_dpo: 64]",
    ),
    f(
        "missing_eos_penalty",
        Kind::Float,
        SCORED,
        "Subtracted from the reward of a completion that never ends (no EOS) [off]",
    ),
    f(
        "reward_model_path",
        Kind::Text,
        SCORED,
        "A reward model's folder, scored beside reward_funcs (ppo: also the value model's start) [off]",
    ),
    f(
        "value_model_path",
        Kind::Text,
        PPO,
        "PPO's value model, a sequence classifier trained beside the policy [reward_model_path; else the model with a new score head]",
    ),
    f(
        "num_ppo_epochs",
        Kind::Int,
        PPO,
        "Passes over each rollout [4]",
    ),
    f(
        "num_mini_batches",
        Kind::Int,
        PPO,
        "Minibatches each rollout is cut into per pass [1]",
    ),
    f(
        "total_episodes",
        Kind::Int,
        PPO,
        "Prompts to roll out over the run; steps = total_episodes / batch [num_train_epochs × examples]",
    ),
    f(
        "response_length",
        Kind::Int,
        PPO,
        "Tokens sampled per response [53]",
    ),
    f(
        "stop_token",
        Kind::Text,
        PPO,
        "`eos`: responses stop at the tokenizer's EOS [off]",
    ),
    f(
        "stop_token_id",
        Kind::Int,
        PPO,
        "Responses stop at this token id [off]",
    ),
    f(
        "whiten_rewards",
        Kind::Bool,
        PPO,
        "Whiten the per-token rewards over the batch [false]",
    ),
    f(
        "kl_coef",
        Kind::Float,
        PPO,
        "Weight of the per-token KL to the reference in the rewards [0.05]",
    ),
    f(
        "kl_estimator",
        Kind::Text,
        PPO,
        "k1 (log-ratio) or k3 (exp(r) − 1 − r) [k1]",
    ),
    f(
        "cliprange",
        Kind::Float,
        PPO,
        "Clip range of the policy ratio [0.2]",
    ),
    f(
        "cliprange_value",
        Kind::Float,
        PPO,
        "Clip range of the value predictions [0.2]",
    ),
    f(
        "vf_coef",
        Kind::Float,
        PPO,
        "Weight of the value loss [0.1]",
    ),
    f("gamma", Kind::Float, PPO, "Discount factor [1]"),
    f("lam", Kind::Float, PPO, "GAE's lambda [0.95]"),
    f(
        "packing",
        Kind::Bool,
        SFT,
        "Pack sequences into examples of max_length tokens, each sequence attending only to itself [false; pretrain: true]",
    ),
    f(
        "packing_strategy",
        Kind::Text,
        SFT,
        "bfd (best fit, overflow dropped), bfd-requeue (overflow packed too) or wrapped (one stream cut every max_length) [bfd]",
    ),
    f(
        "eval_packing",
        Kind::Bool,
        SFT,
        "Pack the evaluation set [= packing]",
    ),
    f(
        "padding_free",
        Kind::Bool,
        SFT,
        "TRL's padding-free batches: kiln always runs each sequence as its own row (the same numbers, true or false) [false]",
    ),
    f(
        "dataset_text_field",
        Kind::Text,
        SFT,
        "The column language-modelling text is read from [text]",
    ),
    f(
        "normalize_advantages",
        Kind::Bool,
        RLOO,
        "Normalise the leave-one-out advantages over the batch (mean 0, std 1) [false]",
    ),
    f(
        "reward_clip_range",
        Kind::Numbers,
        RLOO,
        "Clamp each completion's weighted reward to [low, high] before the KL penalty [off]",
    ),
    f(
        "center_rewards_coefficient",
        Kind::Float,
        REWARD,
        "Weight of mean((r_chosen + r_rejected)²) in the loss, pulling rewards toward zero mean (0.01 is recommended) [off]",
    ),
    f(
        "label_smoothing",
        Kind::Float,
        SMOOTH,
        "Label smoothing of the sigmoid losses [0]",
    ),
];

const fn f(
    name: &'static str,
    kind: Kind,
    tasks: &'static [&'static str],
    help: &'static str,
) -> Field {
    Field {
        name,
        kind,
        tasks,
        help,
    }
}

/// The field named `name`.
pub fn field(name: &str) -> Option<&'static Field> {
    FIELDS.iter().find(|f| f.name == name)
}

/// The known name nearest to `name` (edit distance), for "did you mean".
pub fn nearest(name: &str) -> Option<&'static str> {
    FIELDS
        .iter()
        .map(|f| (strsim::levenshtein(name, f.name), f.name))
        .filter(|(d, _)| *d <= name.len().max(3) / 2 + 1)
        .min()
        .map(|(_, n)| n)
}

/// The settings TRL starts `task` from, before any field is applied: its learning rate and
/// transformers' `TrainingArguments` defaults, LoRA as TRL's `ModelConfig` sets it up
/// (r 16, alpha 32, dropout 0.05) on every Linear, metrics logged every step.
pub fn defaults_for(config: &mut TrainConfig) {
    let h = &mut config.hyper;
    h.learning_rate = match config.task.as_str() {
        "sft" | "pretrain" | "distill" => 2e-5,
        "reward" => 1e-4,
        "bco" | "online_dpo" => 5e-7,
        "ppo" => 3e-6,
        _ => 1e-6,
    };
    h.num_train_epochs = 3.0;
    h.logging_steps = 1;
    config.lora = Some(LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        lora_dropout: 0.05,
        target_modules: vec!["all-linear".into()],
        use_rslora: false,
    });
}

fn bad(name: &str, message: String) -> TrainError {
    TrainError::Config {
        field: name.to_string(),
        message,
    }
}

/// Parses a command-line value of `field` into JSON.
pub fn parse_flag(field: &Field, text: &str) -> Result<Value, TrainError> {
    let err = |what: &str| bad(field.name, format!("`{text}` is not {what}"));
    Ok(match field.kind {
        Kind::Float => Value::from(text.parse::<f64>().map_err(|_| err("a number"))?),
        Kind::Int => Value::from(
            text.parse::<u64>()
                .map_err(|_| err("a non-negative integer"))?,
        ),
        Kind::Bool => Value::Bool(text.parse::<bool>().map_err(|_| err("true or false"))?),
        Kind::Text => Value::String(text.to_string()),
        Kind::Names if !text.contains(',') => Value::String(text.trim().to_string()),
        Kind::List | Kind::Names => Value::Array(
            text.split(',')
                .map(|s| Value::String(s.trim().to_string()))
                .collect(),
        ),
        Kind::Numbers => Value::Array(
            text.split(',')
                .map(|s| {
                    s.trim()
                        .parse::<f64>()
                        .map(Value::from)
                        .map_err(|_| err("a list of numbers"))
                })
                .collect::<Result<_, _>>()?,
        ),
    })
}

/// Applies `value` to the field `name` of `config` (whose `task` is set).
///
/// Long on purpose: one arm per kind of TRL field, a table dispatch that reads as the table.
pub fn apply(config: &mut TrainConfig, name: &str, value: &Value) -> Result<(), TrainError> {
    let task = config.task.clone();
    let known = field(name).filter(|f| f.tasks.is_empty() || f.tasks.contains(&task.as_str()));
    match (name, task.as_str()) {
        // transformers' output folder: the run's, unless the command line names one.
        ("output_dir", _) => {
            if let Some(dir) = value.as_str() {
                config.output_dir = Some(dir.into());
                return Ok(());
            }
            if value.is_null() {
                return Ok(());
            }
            return Err(bad(name, format!("expected a folder, found {value}")));
        }
        // Online DPO's beta is a list in TRL (one value per epoch): kiln takes one value.
        ("beta", "online_dpo") if value.is_array() => {
            let one = value
                .as_array()
                .filter(|a| a.len() == 1)
                .and_then(|a| a[0].as_f64())
                .ok_or_else(|| {
                    bad(
                        name,
                        format!("{value}: kiln takes one beta (TRL's per-epoch list is not built)"),
                    )
                })?;
            config.task_options.insert(name.into(), Value::from(one));
            return Ok(());
        }
        // GRPO's sampler shuffles the prompts (TRL's RepeatSampler) unless this is false.
        ("shuffle_dataset", "grpo" | "rloo") => {
            let on = value
                .as_bool()
                .ok_or_else(|| bad(name, format!("expected true or false, found {value}")))?;
            config.hyper.train_sampling_strategy = if on { "random" } else { "sequential" }.into();
            return Ok(());
        }
        _ => {}
    }
    if known.is_none() {
        // A field of TRL's configuration class for this task that kiln does not implement:
        // taken where kiln does what TRL does, refused by name otherwise.
        if let Some(record) = super::trl_fields::trl_field(&task, name) {
            return super::trl_fields::take(&task, name, value, record);
        }
    }
    let Some(fld) = field(name) else {
        let hint = nearest(name)
            .map(|n| format!("; did you mean `{n}`?"))
            .unwrap_or_default();
        return Err(bad(name, format!("unknown setting{hint}")));
    };
    if !fld.tasks.is_empty() && !fld.tasks.contains(&config.task.as_str()) {
        return Err(bad(
            name,
            format!(
                "task `{}` does not take it (it is for {})",
                config.task,
                fld.tasks.join(", ")
            ),
        ));
    }
    // TRL's `None` (a JSON dump's null): the field keeps kiln's default, which is TRL's
    // behaviour for None (unset, off or derived).
    if value.is_null() {
        config.task_options.remove(name);
        return Ok(());
    }
    // transformers' max_steps -1: train for num_train_epochs.
    if name == "max_steps" && value.as_i64() == Some(-1) {
        config.hyper.max_steps = None;
        return Ok(());
    }
    let want = |what: &str| bad(name, format!("expected {what}, found {value}"));
    let float = || value.as_f64().ok_or_else(|| want("a number"));
    // TOML and TRL's dumps may write a whole number as a float (`logging_steps = 10.0`).
    let whole = |v: &Value| {
        v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|x| *x >= 0.0 && x.fract() == 0.0 && *x < 2f64.powi(53))
                .map(|x| x as u64)
        })
    };
    let int = || whole(value).ok_or_else(|| want("a non-negative integer"));
    let text = || {
        value
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| want("a string"))
    };
    let boolean = || value.as_bool().ok_or_else(|| want("true or false"));
    let h = &mut config.hyper;
    match name {
        "learning_rate" => h.learning_rate = float()?,
        "num_train_epochs" => h.num_train_epochs = float()?,
        "max_steps" => h.max_steps = Some(int()?).filter(|&s| s > 0),
        "per_device_train_batch_size" => h.per_device_train_batch_size = int()? as usize,
        "gradient_accumulation_steps" => h.gradient_accumulation_steps = int()? as usize,
        "warmup_steps" => h.warmup_steps = int()?,
        "weight_decay" => h.weight_decay = float()?,
        "adam_beta1" => h.adam_beta1 = float()?,
        "adam_beta2" => h.adam_beta2 = float()?,
        "adam_epsilon" => h.adam_epsilon = float()?,
        "max_grad_norm" => h.max_grad_norm = Some(float()?).filter(|&n| n > 0.0),
        "max_length" => h.max_length = Some(int()? as usize).filter(|&n| n > 0),
        "lr_scheduler_type" => h.lr_scheduler_type = text()?,
        "train_sampling_strategy" => h.train_sampling_strategy = text()?,
        "seed" => h.seed = int()?,
        "logging_steps" => h.logging_steps = int()?.max(1),
        "save_steps" => h.save_steps = Some(int()?).filter(|&s| s > 0),
        "save_total_limit" => h.save_total_limit = Some(int()? as usize).filter(|&n| n > 0),
        "eval_steps" => h.eval_steps = Some(int()?).filter(|&s| s > 0),
        "per_device_eval_batch_size" => h.per_device_eval_batch_size = (int()? as usize).max(1),
        "lora_r" => {
            let r = int()? as usize;
            if r == 0 {
                config.lora = None;
            } else {
                config.lora.get_or_insert_with(LoraConfig::default).r = r;
            }
        }
        "lora_alpha" | "lora_dropout" | "lora_target_modules" | "use_rslora" => {
            // Settings of an adapter that `lora_r = 0` turned off are ignored.
            if let Some(l) = config.lora.as_mut() {
                match name {
                    "lora_alpha" => l.lora_alpha = float()?,
                    "lora_dropout" => l.lora_dropout = float()?,
                    "use_rslora" => l.use_rslora = boolean()?,
                    _ => {
                        l.target_modules = match value {
                            Value::Array(a) => a
                                .iter()
                                .map(|v| v.as_str().map(str::to_string))
                                .collect::<Option<Vec<_>>>()
                                .ok_or_else(|| want("a list of strings"))?,
                            Value::String(s) => vec![s.clone()],
                            _ => return Err(want("a list of strings")),
                        }
                    }
                }
            }
        }
        _ => {
            // A task's own field: checked by kind here, read by the trainer.
            let ok = match fld.kind {
                Kind::Float => value.is_number(),
                Kind::Int => whole(value).is_some(),
                Kind::Bool => value.is_boolean(),
                Kind::Text => value.is_string(),
                Kind::List => value
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_string)),
                Kind::Names => {
                    value.is_string()
                        || value
                            .as_array()
                            .is_some_and(|a| a.iter().all(Value::is_string))
                }
                Kind::Numbers => value
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_number)),
            };
            if !ok {
                return Err(want(match fld.kind {
                    Kind::Float => "a number",
                    Kind::Int => "a non-negative integer",
                    Kind::Bool => "true or false",
                    Kind::Text => "a string",
                    Kind::List => "a list of strings",
                    Kind::Numbers => "a list of numbers",
                    Kind::Names => "a name or a list of names",
                }));
            }
            config.task_options.insert(name.to_string(), value.clone());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::trl_fields::{self, Treat};

    /// Every field of TRL 0.29.1's six configuration classes (dumped from TRL by
    /// tests/train/trl_fields.py) is implemented or has a stated decision; its TRL default and
    /// its `to_dict()` value are taken; a value kiln cannot honour is refused naming TRL's (or
    /// transformers') field and the reason — never "task does not take it".
    #[test]
    fn every_trl_field_is_implemented_or_refused_by_name() {
        let mut checked = 0;
        let mut failures = Vec::new();
        // Every task kiln trains has its TRL class in the file.
        for task in crate::train::task::TASKS {
            let all = trl_fields::trl_fields(task);
            assert!(
                all.len() > 100,
                "{task}: {} fields in trl_fields.json",
                all.len()
            );
            for (name, record) in all {
                let implemented = field(name)
                    .is_some_and(|f| f.tasks.is_empty() || f.tasks.contains(&task))
                    || name == "output_dir"
                    || (name, task) == ("shuffle_dataset", "grpo")
                    || (name, task) == ("shuffle_dataset", "rloo");
                let decided = trl_fields::decision(name);
                assert!(
                    implemented || decided.is_some(),
                    "{task}: TRL's field `{name}` is neither implemented nor decided"
                );
                // The post-init value (bf16's resolved `true`, say) may be what a decision
                // lists against on purpose.
                let only = matches!(decided.map(|d| d.treat), Some(Treat::Only(_)));
                for key in ["default", "to_dict"] {
                    let v = &record[key];
                    if name == "output_dir" || (key == "to_dict" && only && !implemented) {
                        continue;
                    }
                    let mut c = TrainConfig::new(task, "candle", "m", "o");
                    defaults_for(&mut c);
                    if let Err(e) = apply(&mut c, name, v) {
                        failures.push(format!("{task}: `{name}` = {v} ({key}) refused: {e}"));
                    }
                }
                if !implemented && !matches!(decided.unwrap().treat, Treat::AnyValue) {
                    // A value no field has: a string nobody uses.
                    let odd = Value::from("kiln-test-odd-value");
                    let mut c = TrainConfig::new(task, "candle", "m", "o");
                    let e = apply(&mut c, name, &odd)
                        .expect_err(&format!("{task}: `{name}` took an odd value"))
                        .to_string();
                    assert!(
                        e.contains("TRL's `") || e.contains("transformers' `"),
                        "{task}: `{name}`: {e}"
                    );
                    assert!(e.contains(decided.unwrap().why), "{task}: `{name}`: {e}");
                }
                checked += 1;
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
        assert!(checked > 700, "{checked} fields checked");
    }

    /// A TRL user's SFT config: `loss_type` is SFT's own (nll, dft), not another task's.
    #[test]
    fn sft_takes_trls_loss_type_and_refuses_what_it_cannot_honour() {
        let mut c = TrainConfig::new("sft", "candle", "m", "o");
        apply(&mut c, "loss_type", &Value::from("dft")).unwrap();
        assert_eq!(
            c.option::<String>("loss_type").unwrap().as_deref(),
            Some("dft")
        );
        apply(&mut c, "packing", &Value::from(true)).unwrap();
        assert_eq!(c.option::<bool>("packing").unwrap(), Some(true));
        let e = apply(&mut c, "pad_to_multiple_of", &Value::from(8)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config field `pad_to_multiple_of`: TRL's `SFTConfig.pad_to_multiple_of` = 8: kiln \
             pads to the longest sequence of the batch; kiln takes only TRL's default, null"
        );
        apply(&mut c, "bf16", &Value::from(true)).unwrap();
        assert!(c.bf16().unwrap());
        let e = apply(&mut c, "fp16", &Value::from(true)).unwrap_err();
        assert!(
            e.to_string().contains("kiln trains and evaluates in f32"),
            "{e}"
        );
        // TRL's max_steps -1 and None values leave kiln's defaults.
        apply(&mut c, "max_steps", &Value::from(-1)).unwrap();
        assert_eq!(c.hyper.max_steps, None);
        apply(&mut c, "logging_steps", &Value::from(10.0)).unwrap();
        assert_eq!(c.hyper.logging_steps, 10);
        // A field TRL does not have for SFT is still another task's.
        let e = apply(&mut c, "beta", &Value::from(0.1)).unwrap_err();
        assert!(e.to_string().contains("does not take it"), "{e}");
    }

    #[test]
    fn fields_land_where_trainers_read_them_and_mistakes_are_named() {
        let mut c = TrainConfig::new("dpo", "candle", "m", "o");
        defaults_for(&mut c);
        assert_eq!(c.hyper.learning_rate, 1e-6);
        apply(&mut c, "learning_rate", &Value::from(5e-4)).unwrap();
        apply(
            &mut c,
            "beta",
            &parse_flag(field("beta").unwrap(), "0.5").unwrap(),
        )
        .unwrap();
        apply(
            &mut c,
            "lora_target_modules",
            &parse_flag(field("lora_target_modules").unwrap(), "q_proj, v_proj").unwrap(),
        )
        .unwrap();
        assert_eq!(c.hyper.learning_rate, 5e-4);
        assert_eq!(c.option::<f64>("beta").unwrap(), Some(0.5));
        assert_eq!(
            c.lora.as_ref().unwrap().target_modules,
            ["q_proj", "v_proj"]
        );
        apply(&mut c, "lora_r", &Value::from(0)).unwrap();
        assert!(c.lora.is_none());
        let e = apply(&mut c, "learnin_rate", &Value::from(1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config field `learnin_rate`: unknown setting; did you mean `learning_rate`?"
        );
        let mut s = TrainConfig::new("sft", "candle", "m", "o");
        let e = apply(&mut s, "beta", &Value::from(0.1)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config field `beta`: task `sft` does not take it (it is for dpo, orpo, simpo, kto, grpo, rloo, distill, bco, online_dpo)"
        );
        let e = apply(&mut s, "max_steps", &Value::from("ten")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "config field `max_steps`: expected a non-negative integer, found \"ten\""
        );
        let e = parse_flag(field("seed").unwrap(), "-1").unwrap_err();
        assert_eq!(
            e.to_string(),
            "config field `seed`: `-1` is not a non-negative integer"
        );
    }
}
