//! Every field of TRL 0.29.1's configuration classes, and what kiln does with the ones its
//! [`super::fields::FIELDS`] table does not implement.
//!
//! `trl_fields.json` is dumped from TRL itself by `tests/train/trl_fields.py`: for each kiln
//! task (sft → `SFTConfig`, dpo → `DPOConfig`, simpo → `CPOConfig`, orpo → `ORPOConfig`, kto →
//! `KTOConfig`, grpo → `GRPOConfig`), each field's dataclass default and the value
//! `Config().to_dict()` holds for it. A TRL field kiln does not implement is either
//! - [`Treat::AnyValue`]: it changes nothing kiln computes or writes (where the log goes, worker
//!   processes, distributed settings of a single-process run) — any value is taken;
//! - [`Treat::AtDefault`]: taken at TRL's default, which is what kiln does; any other value is
//!   refused with the reason and what kiln does instead;
//! - [`Treat::Only`]: taken at the listed values, for the same reason.
//!
//! A test (`every_trl_field_is_implemented_or_refused_by_name`) checks that each field of the
//! JSON file is in `FIELDS` or in [`DECISIONS`], so a field a new TRL adds cannot fall through.

use super::TrainError;
use serde_json::Value;
use std::sync::OnceLock;

/// How kiln takes a TRL field it does not implement.
#[derive(Debug, Clone, Copy)]
pub enum Treat {
    /// Any value: the field changes nothing kiln computes or writes.
    AnyValue,
    /// TRL's default only (kiln's behaviour is TRL's at that value).
    AtDefault,
    /// These values only (JSON), which describe what kiln does.
    Only(&'static str),
}

/// Fields sharing one treatment and one reason.
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    /// The fields, by TRL's names.
    pub names: &'static [&'static str],
    /// How a value is taken.
    pub treat: Treat,
    /// Why, and what kiln does instead.
    pub why: &'static str,
}

const fn d(names: &'static [&'static str], treat: Treat, why: &'static str) -> Decision {
    Decision { names, treat, why }
}

use Treat::{AnyValue, AtDefault, Only};

/// Every TRL (and transformers `TrainingArguments`) field of the six configuration classes
/// that `FIELDS` does not implement, with its treatment.
pub const DECISIONS: &[Decision] = &[
    // What the run prints, reports or uploads: kiln logs to the terminal and --metrics.
    d(
        &[
            "logging_dir",
            "logging_first_step",
            "logging_nan_inf_filter",
            "log_on_each_node",
            "log_level",
            "log_level_replica",
            "disable_tqdm",
            "run_name",
            "project",
            "trackio_space_id",
            "trackio_bucket_id",
            "trackio_static_space_id",
            "include_num_input_tokens_seen",
            "skip_memory_metrics",
            "log_completions",
            "num_completions_to_print",
            "log_unique_prompts",
        ],
        AnyValue,
        "what is printed or reported; kiln logs each step to the terminal and to --metrics FILE",
    ),
    d(
        &["report_to"],
        Only(r#"[null, "none", [], ["none"]]"#),
        "kiln reports to no integration (wandb, tensorboard, trackio, …); it writes --metrics FILE (JSONL), one line per logged step",
    ),
    d(
        &[
            "push_to_hub",
            "hub_token",
            "hub_private_repo",
            "hub_model_id",
            "hub_strategy",
            "hub_always_push",
            "hub_revision",
            "log_completions_hub_repo",
        ],
        AtDefault,
        "kiln writes the model or adapter to the output folder only; upload it with the Hugging Face CLI",
    ),
    // Processes, devices and distribution: kiln is one process; the device is --device.
    d(
        &[
            "use_cpu",
            "local_rank",
            "ddp_find_unused_parameters",
            "ddp_bucket_cap_mb",
            "ddp_broadcast_buffers",
            "ddp_static_graph",
            "ddp_backend",
            "ddp_timeout",
            "dataloader_num_workers",
            "dataloader_pin_memory",
            "dataloader_persistent_workers",
            "dataloader_prefetch_factor",
            "dataloader_multiprocessing_context",
            "dataset_num_proc",
            "save_on_each_node",
            "accelerator_config",
            "average_tokens_across_devices",
            "ds3_gather_for_generation",
            "torch_empty_cache_steps",
            "debug",
            "do_train",
            "do_eval",
            "do_predict",
            "remove_unused_columns",
            "length_column_name",
            "eval_do_concat_batches",
            "eval_use_gather_object",
        ],
        AnyValue,
        "processes, devices and data-loader workers; kiln trains in one process on --device, which gives TRL's numbers on one device",
    ),
    d(
        &["fsdp", "fsdp_config", "deepspeed", "parallelism_config"],
        AtDefault,
        "kiln trains on one device; no FSDP, DeepSpeed or model parallelism",
    ),
    // Precision and memory: kiln trains in f32.
    d(
        &[
            "fp16",
            "bf16_full_eval",
            "fp16_full_eval",
            "tf32",
            "cast_lm_head_to_fp32",
        ],
        AtDefault,
        "kiln trains and evaluates in f32",
    ),
    d(
        &[
            "gradient_checkpointing_kwargs",
            "activation_checkpointing",
            "activation_checkpointing_kwargs",
            "activation_offloading",
        ],
        AnyValue,
        "memory only, the numbers are the same; kiln's gradient_checkpointing recomputes each decoder layer (PyTorch's non-reentrant checkpoint) and offloads nothing",
    ),
    d(
        &[
            "torch_compile",
            "torch_compile_backend",
            "torch_compile_mode",
            "use_liger_kernel",
            "liger_kernel_config",
            "use_cache",
        ],
        AtDefault,
        "PyTorch's compilers and kernels; kiln runs its own (candle or MLX)",
    ),
    d(
        &["auto_find_batch_size"],
        AtDefault,
        "kiln uses per_device_train_batch_size as given",
    ),
    // The optimizer: kiln's is AdamW with decoupled weight decay, no schedule arguments.
    d(
        &["optim"],
        Only(r#"["adamw_torch", "adamw_torch_fused"]"#),
        "kiln's optimizer is torch's AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay)",
    ),
    d(
        &["optim_args", "optim_target_modules", "lr_scheduler_kwargs"],
        AtDefault,
        "kiln's AdamW and schedules take no extra arguments (lr_scheduler_type, warmup_steps)",
    ),
    d(
        &["label_smoothing_factor"],
        AtDefault,
        "transformers' label smoothing of the causal-LM loss is not built; the preference losses' label_smoothing is",
    ),
    d(
        &["neftune_noise_alpha"],
        AtDefault,
        "NEFTune's embedding noise is not built",
    ),
    // When things happen: kiln's own settings say it.
    d(
        &["logging_strategy"],
        Only(r#"["steps"]"#),
        "kiln logs every logging_steps steps",
    ),
    d(
        &["save_strategy"],
        Only(r#"["steps"]"#),
        "kiln saves a checkpoint every save_steps steps (0 = never): set save_steps",
    ),
    d(
        &["eval_strategy"],
        Only(r#"["no", "steps"]"#),
        "kiln evaluates --eval-data every eval_steps steps",
    ),
    d(
        &[
            "eval_delay",
            "eval_on_start",
            "eval_accumulation_steps",
            "prediction_loss_only",
            "include_for_metrics",
            "batch_eval_metrics",
            "load_best_model_at_end",
            "metric_for_best_model",
            "greater_is_better",
            "generate_during_eval",
        ],
        AtDefault,
        "kiln evaluates every eval_steps steps and logs eval_loss and the task's eval_ figures; no best-model selection",
    ),
    d(
        &[
            "save_only_model",
            "enable_jit_checkpoint",
            "restore_callback_states_from_checkpoint",
            "ignore_data_skip",
            "resume_from_checkpoint",
        ],
        AtDefault,
        "kiln's checkpoints always hold the optimizer and data position; resume with --resume DIR",
    ),
    d(
        &["full_determinism", "data_seed"],
        AtDefault,
        "kiln's runs are deterministic from seed alone (the same bytes on any thread count)",
    ),
    d(
        &["dataloader_drop_last", "dataloader_in_order"],
        AtDefault,
        "kiln keeps the last short batch, as transformers does by default",
    ),
    d(
        &["label_names"],
        AtDefault,
        "kiln's tasks build their own labels",
    ),
    // Models and data.
    d(
        &["model_init_kwargs"],
        AtDefault,
        "kiln loads the model folder itself (f32); there are no from_pretrained arguments",
    ),
    d(
        &["chat_template_path"],
        AtDefault,
        "kiln takes the chat template from the model's tokenizer_config.json",
    ),
    d(
        &["dataset_kwargs"],
        AtDefault,
        "kiln prepares the data itself; no dataset arguments",
    ),
    d(
        &["eos_token", "pad_token", "padding_value"],
        AtDefault,
        "kiln takes the EOS and padding tokens from the tokenizer's files",
    ),
    d(
        &["shuffle_dataset"],
        AtDefault,
        "kiln does not shuffle the dataset before training (SFT's default); the sampler's order is train_sampling_strategy",
    ),
    d(
        &[
            "dataset_text_field",
            "packing",
            "packing_strategy",
            "eval_packing",
            "completion_only_loss",
            "assistant_only_loss",
            "loss_type",
            "teacher_model_init_kwargs",
        ],
        AtDefault,
        "distill reads `messages` conversations whole, unpacked, and learns every completion token by the generalized JSD to a teacher kiln loads itself (TRL's GKD collator and loss)",
    ),
    d(
        &[
            "prompt_sample_size",
            "min_density_ratio",
            "max_density_ratio",
        ],
        AtDefault,
        "BCO's underlying-distribution matching (a prompt classifier over embeddings) is not built; kiln's bco weighs every example alike",
    ),
    d(
        &[
            "world_size",
            "num_total_batches",
            "micro_batch_size",
            "local_batch_size",
            "batch_size",
            "local_mini_batch_size",
            "mini_batch_size",
        ],
        AtDefault,
        "PPO's derived sizes, which TRL computes itself: kiln derives them from per_device_train_batch_size, gradient_accumulation_steps, num_mini_batches and total_episodes on one process",
    ),
    d(
        &[
            "local_rollout_forward_batch_size",
            "ds3_gather_for_generation",
        ],
        AnyValue,
        "how TRL batches PPO's rollout forward passes and gathers DeepSpeed shards: no effect on the numbers; kiln samples each prompt's response with a KV cache",
    ),
    d(
        &["num_sample_generations"],
        AnyValue,
        "TRL prints tables of completions sampled from its evaluation set; kiln's ppo takes no evaluation set and prints none",
    ),
    d(
        &["sft_model_path", "model_adapter_name", "ref_adapter_name"],
        AtDefault,
        "kiln's ppo trains the model given by --model (with one adapter, or none) against its frozen start (under LoRA the base without the adapter, as PEFT's disable_adapter)",
    ),
    d(
        &["judge"],
        AtDefault,
        "judges (PairRM, API models) are not built; online_dpo ranks each pair by reward_funcs (functions or reward models)",
    ),
    d(
        &["padding_free"],
        AtDefault,
        "kiln runs each sequence of a batch as its own row, padded to the longest",
    ),
    d(
        &["pad_to_multiple_of"],
        AtDefault,
        "kiln pads to the longest sequence of the batch",
    ),
    d(
        &["truncation_mode"],
        AtDefault,
        "kiln truncates as TRL does by default (dpo keep_start; simpo and orpo keep_end)",
    ),
    d(
        &["is_encoder_decoder"],
        AtDefault,
        "kiln trains decoder-only models",
    ),
    d(
        &["max_completion_length"],
        AtDefault,
        "kiln truncates the whole sequence to max_length only (TRL's default)",
    ),
    // Reference models and their updates.
    d(
        &[
            "sync_ref_model",
            "ref_model_mixup_alpha",
            "ref_model_sync_steps",
        ],
        AtDefault,
        "the reference model stays frozen (TR-DPO's reference updates are not built)",
    ),
    // Objectives not built.
    d(
        &["alpha"],
        AtDefault,
        "CPO's AlphaPO reward shaping is not built (alpha 0 is CPO's and SimPO's reward)",
    ),
    // GRPO: generation.
    d(
        &[
            "use_vllm",
            "vllm_mode",
            "vllm_model_impl",
            "vllm_enable_sleep_mode",
            "vllm_structured_outputs_regex",
            "vllm_server_base_url",
            "vllm_server_host",
            "vllm_server_port",
            "vllm_server_timeout",
            "vllm_group_port",
            "vllm_gpu_memory_utilization",
            "vllm_max_model_length",
            "vllm_tensor_parallel_size",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_cap",
        ],
        AtDefault,
        "kiln samples completions itself, with a KV cache; no vLLM server",
    ),
    d(
        &[
            "use_transformers_paged",
            "cache_implementation",
            "generation_kwargs",
            "chat_template_kwargs",
            "max_tool_calling_iterations",
        ],
        AtDefault,
        "kiln's sampler takes temperature, top_p, top_k, min_p and repetition_penalty",
    ),
    d(
        &["generation_batch_size", "steps_per_generation"],
        Only("[null, 1, 8]"),
        "kiln generates once per optimisation step (num_iterations reuses it): steps_per_generation 1, generation_batch_size = per_device_train_batch_size",
    ),
    d(
        &[
            "sapo_temperature_neg",
            "sapo_temperature_pos",
            "importance_sampling_level",
            "multi_objective_aggregation",
            "top_entropy_quantile",
            "off_policy_mask_threshold",
            "use_bias_correction_kl",
        ],
        AtDefault,
        "kiln's GRPO has token-level ratios, the loss_type aggregations and summed rewards; SAPO, GSPO, entropy masking and off-policy masks are not built",
    ),
];

/// The decision for `name`, if it has one.
pub fn decision(name: &str) -> Option<&'static Decision> {
    DECISIONS.iter().find(|d| d.names.contains(&name))
}

fn fields() -> &'static Value {
    static FIELDS: OnceLock<Value> = OnceLock::new();
    FIELDS.get_or_init(|| {
        serde_json::from_str(include_str!("trl_fields.json")).expect("trl_fields.json is JSON")
    })
}

/// TRL's configuration class for kiln's `task`, if TRL has one.
pub fn trl_class(task: &str) -> Option<&'static str> {
    fields()[task]["class"].as_str()
}

/// Every field of `task`'s TRL class with its record (`trl`, `default`, `to_dict`).
pub fn trl_fields(task: &str) -> Vec<(&'static str, &'static Value)> {
    fields()[task]["fields"]
        .as_object()
        .map(|m| m.iter().map(|(k, v)| (k.as_str(), v)).collect())
        .unwrap_or_default()
}

/// The record of `name` in `task`'s TRL class.
pub fn trl_field(task: &str, name: &str) -> Option<&'static Value> {
    fields()[task]["fields"].get(name)
}

/// JSON values equal, numbers by value (TOML's `1` and TRL's `1.0`).
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        _ => a == b,
    }
}

/// Takes or refuses `value` for the TRL field `name` of `task` that kiln does not implement
/// (`record` is its entry in the JSON file).
pub fn take(task: &str, name: &str, value: &Value, record: &Value) -> Result<(), TrainError> {
    let class = trl_class(task).unwrap_or("TrainingArguments");
    let owner = if record["trl"].as_bool().unwrap_or(false) {
        format!("TRL's `{class}.{name}`")
    } else {
        format!("transformers' `TrainingArguments.{name}` (in TRL's `{class}`)")
    };
    let Some(dec) = decision(name) else {
        return Err(TrainError::Config {
            field: name.to_string(),
            message: format!("{owner} is not supported by kiln"),
        });
    };
    let ok = match dec.treat {
        AnyValue => true,
        AtDefault => same(value, &record["default"]) || same(value, &record["to_dict"]),
        Only(list) => serde_json::from_str::<Vec<Value>>(list)
            .expect("Only lists are JSON")
            .iter()
            .any(|v| same(value, v)),
    };
    if ok {
        return Ok(());
    }
    let accepted = match dec.treat {
        Only(list) => format!("kiln takes {list}"),
        _ => format!("kiln takes only TRL's default, {}", record["default"]),
    };
    Err(TrainError::Config {
        field: name.to_string(),
        message: format!("{owner} = {value}: {}; {accepted}", dec.why),
    })
}
