//! kiln's candle trainers against TRL 0.29.1: from the same tiny model, initial adapter and
//! data, every logged step matches `tests/train/reference.json` (made by
//! `tests/train/trl_ref.py` with TRL, transformers, peft and torch on the CPU). Step 1's loss
//! within 1e-5 relative, all six steps within 1e-3; gradient norms, learning rates and the
//! task's figures too.

use kiln_runtime::train::{StepMetrics, TrainConfig, TrainObserver};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn here() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/train")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(here().join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("JSON")
}

#[derive(Default)]
struct Collect(
    Vec<StepMetrics>,
    Vec<(u64, std::collections::BTreeMap<String, f64>)>,
);

/// Completions recorded from TRL, handed out generation batch by generation batch.
struct Replay(Vec<Vec<Vec<u32>>>, usize);

impl kiln_runtime::train::candle::CompletionSource for Replay {
    fn complete(
        &mut self,
        _policy: &dyn kiln_runtime::train::candle::Sample,
        prompts: &[Vec<u32>],
        g: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, kiln_runtime::TrainError> {
        let batch = &self.0[self.1];
        self.1 += 1;
        assert_eq!(
            batch.len(),
            prompts.len() * g,
            "TRL generated for the same prompts"
        );
        Ok(batch.chunks(g).map(<[Vec<u32>]>::to_vec).collect())
    }
}

/// TRL's evaluation completions, found by prompt: TRL evaluates its batches in a shuffled
/// order, kiln in file order; each prompt's completions come in the order TRL made them.
struct ReplayByPrompt(
    std::collections::BTreeMap<Vec<u32>, std::collections::VecDeque<Vec<Vec<u32>>>>,
);

impl ReplayByPrompt {
    fn new(recorded: &Value) -> Self {
        let mut map = std::collections::BTreeMap::new();
        for batch in recorded.as_array().expect("eval_completions") {
            let prompts: Vec<Vec<u32>> = serde_json::from_value(batch["prompts"].clone()).unwrap();
            let completions: Vec<Vec<u32>> =
                serde_json::from_value(batch["completions"].clone()).unwrap();
            let mut k = 0;
            while k < prompts.len() {
                let same = prompts[k..]
                    .iter()
                    .take_while(|p| **p == prompts[k])
                    .count();
                map.entry(prompts[k].clone())
                    .or_insert_with(std::collections::VecDeque::new)
                    .push_back(completions[k..k + same].to_vec());
                k += same;
            }
        }
        ReplayByPrompt(map)
    }
}

impl kiln_runtime::train::candle::CompletionSource for ReplayByPrompt {
    fn complete(
        &mut self,
        _policy: &dyn kiln_runtime::train::candle::Sample,
        prompts: &[Vec<u32>],
        g: usize,
    ) -> Result<Vec<Vec<Vec<u32>>>, kiln_runtime::TrainError> {
        Ok(prompts
            .iter()
            .map(|p| {
                let c = self
                    .0
                    .get_mut(p)
                    .and_then(|q| q.pop_front())
                    .expect("TRL generated for this prompt");
                assert_eq!(c.len(), g);
                c
            })
            .collect())
    }
}

/// A reward registered from outside kiln, as a user's crate would: the number of digits in
/// the completion (the reference script defines the same function for TRL).
#[kiln::reward(name = "count_digits")]
fn count_digits(input: &kiln::RewardInput<'_>) -> Option<f64> {
    Some(
        input
            .completion
            .chars()
            .filter(char::is_ascii_digit)
            .count() as f64,
    )
}

impl TrainObserver for Collect {
    fn on_step(&mut self, m: &StepMetrics) {
        self.0.push(m.clone());
    }
    fn on_eval(&mut self, step: u64, m: &std::collections::BTreeMap<String, f64>) {
        self.1.push((step, m.clone()));
    }
}

/// The kiln configuration of reference run `name`: TRL's settings, spelled as kiln takes them.
fn config(name: &str, run: &Value, out: &Path) -> TrainConfig {
    let task = run["task"].as_str().unwrap();
    let model = run["model_dir"].as_str().unwrap_or("tiny/model");
    let mut c = TrainConfig::new(task, "candle", here().join(model), out);
    c.train_data = Some(here().join(run["data"].as_str().unwrap()));
    c.hyper.max_steps = Some(6);
    c.hyper.logging_steps = 1;
    c.hyper.per_device_train_batch_size = 2;
    c.hyper.train_sampling_strategy = "sequential".into();
    c.hyper.max_length = Some(1024);
    for (k, v) in run["settings"].as_object().unwrap() {
        match k.as_str() {
            "learning_rate" => c.hyper.learning_rate = v.as_f64().unwrap(),
            "gradient_accumulation_steps" => {
                c.hyper.gradient_accumulation_steps = v.as_u64().unwrap() as usize
            }
            "lr_scheduler_type" => c.hyper.lr_scheduler_type = v.as_str().unwrap().into(),
            "warmup_steps" => c.hyper.warmup_steps = v.as_u64().unwrap(),
            "weight_decay" => c.hyper.weight_decay = v.as_f64().unwrap(),
            // DPO's loss_type is a list in TRL (kiln takes a name or a list).
            "loss_type"
            | "loss_weights"
            | "f_divergence_type"
            | "f_alpha_divergence_coef"
            | "ld_alpha"
            | "use_weighting"
            | "discopop_tau" => {
                c.task_options.insert(k.clone(), v.clone());
            }
            "eval_data" => c.eval_data = Some(here().join(v.as_str().unwrap())),
            "eval_steps" => c.hyper.eval_steps = Some(v.as_u64().unwrap()),
            "per_device_eval_batch_size" => {
                c.hyper.per_device_eval_batch_size = v.as_u64().unwrap() as usize
            }
            "assistant_only_loss" | "bf16" => {
                c.task_options.insert(k.clone(), v.clone());
            }
            "per_device_train_batch_size" => {
                c.hyper.per_device_train_batch_size = v.as_u64().unwrap() as usize
            }
            "max_steps" => c.hyper.max_steps = Some(v.as_u64().unwrap()),
            "teacher_model_name_or_path" => {
                let path = here().join(v.as_str().unwrap()).display().to_string();
                c.task_options.insert(k.clone(), path.into());
            }
            // A reward model's folder is relative to tests/train.
            "reward_funcs" => {
                let funcs: Vec<Value> = v
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| match f.as_str().unwrap() {
                        n if n.contains('/') => here().join(n).display().to_string().into(),
                        _ => f.clone(),
                    })
                    .collect();
                c.task_options.insert(k.clone(), funcs.into());
            }
            "num_generations"
            | "max_completion_length"
            | "temperature"
            | "reward_weights"
            | "scale_rewards"
            | "num_iterations"
            | "epsilon"
            | "epsilon_high" => {
                c.task_options.insert(k.clone(), v.clone());
            }
            "shuffle_dataset" => {
                assert_eq!(v, &Value::Bool(false));
                c.hyper.train_sampling_strategy = "sequential".into();
            }
            "max_length" => c.hyper.max_length = Some(v.as_u64().unwrap() as usize),
            // PPO's settings; its reward model's folder is relative to tests/train.
            "reward_model_path" => {
                let path = here().join(v.as_str().unwrap()).display().to_string();
                c.task_options.insert(k.clone(), path.into());
            }
            "response_length" | "total_episodes" | "num_ppo_epochs" | "num_mini_batches"
            | "stop_token_id" | "kl_estimator" | "whiten_rewards" | "kl_coef" | "cliprange"
            | "cliprange_value" | "vf_coef" | "gamma" | "lam" => {
                c.task_options.insert(k.clone(), v.clone());
            }
            "beta"
            | "precompute_ref_log_probs"
            | "simpo_gamma"
            | "cpo_alpha"
            | "label_smoothing"
            | "desirable_weight"
            | "undesirable_weight"
            | "center_rewards_coefficient"
            | "normalize_advantages"
            | "reward_clip_range"
            | "packing"
            | "packing_strategy"
            | "eval_packing"
            | "dataset_text_field"
            | "lmbda"
            | "missing_eos_penalty"
            | "max_new_tokens"
            | "loss_type_online" => {
                c.task_options.insert(k.clone(), v.clone());
            }
            other => panic!("{name}: setting `{other}` is not mapped"),
        }
    }
    if run["adapter"].as_bool().unwrap() {
        let dir = run["adapter_dir"].as_str().unwrap_or("tiny/init-adapter");
        c.init_adapter = Some(here().join(dir));
    }
    c
}

fn close(got: f64, want: f64, rel: f64, abs: f64) -> bool {
    (got - want).abs() <= rel * want.abs() + abs
}

/// kiln's figure `k` equals TRL's `want`: within 1e-3 relative, with a 1e-4 floor for the
/// figures that start at zero (log-probabilities and rewards are sums over tokens).
fn same_figure(name: &str, step: u64, k: &str, got: Option<&f64>, want: &Value) {
    let g = *got.unwrap_or_else(|| panic!("{name} step {step}: kiln does not log `{k}`"));
    let v = want.as_f64().unwrap();
    assert!(
        close(g, v, 1e-3, 1e-4),
        "{name} step {step}: {k} {g} vs TRL {v}"
    );
}

fn check(name: &str) {
    check_on(name, "candle");
}

/// [`check`] on `backend`: TRL's figures from the same starting weights and data.
fn check_on(name: &str, backend: &str) {
    let all = reference();
    let run = &all[name];
    let out = tempfile::tempdir().unwrap();
    let mut cfg = config(name, run, &out.path().join("run"));
    cfg.backend = backend.to_string();
    let mut seen = Collect::default();
    #[cfg(feature = "mlx")]
    if backend == "mlx" && matches!(run["task"].as_str(), Some("grpo" | "rloo" | "online_dpo")) {
        use kiln_runtime::Trainer;
        let replay = Replay(
            serde_json::from_value(run["completions"].clone()).expect("completions"),
            0,
        );
        let eval = run.get("eval_completions").map(|r| {
            Box::new(ReplayByPrompt::new(r))
                as Box<dyn kiln_runtime::train::candle::CompletionSource>
        });
        let mut trainer =
            kiln_runtime::train::mlx::train::grpo_with_sources(&cfg, Box::new(replay), eval)
                .unwrap();
        let report = trainer.train(&mut seen).unwrap();
        return compare(name, run, backend, &seen, &report);
    }
    let report = if run["task"] == "online_dpo" {
        use kiln_runtime::train::candle::{Setup, online_dpo_with_source, run as train_run};
        let setup = Setup::load(&cfg).unwrap();
        let replay = Replay(
            serde_json::from_value(run["completions"].clone()).expect("completions"),
            0,
        );
        let mut objective = online_dpo_with_source(&cfg, &setup, Box::new(replay)).unwrap();
        train_run(&setup, &mut *objective, &mut seen).unwrap()
    } else if matches!(run["task"].as_str(), Some("grpo" | "rloo")) {
        // TRL's sampled completions, replayed: GRPO's numbers given the same completions.
        use kiln_runtime::train::candle::{Setup, grpo_with_source, run as train_run};
        let setup = Setup::load(&cfg).unwrap();
        let replay = Replay(
            serde_json::from_value(run["completions"].clone()).expect("completions"),
            0,
        );
        let mut objective = grpo_with_source(&cfg, &setup, Box::new(replay)).unwrap();
        match run.get("eval_completions") {
            Some(recorded) => {
                use kiln_runtime::train::candle::run_with_eval;
                let mut c = cfg.clone();
                c.train_data = c.eval_data.clone();
                let source = Box::new(ReplayByPrompt::new(recorded));
                let mut eval = grpo_with_source(&c, &setup, source).unwrap();
                eval.for_evaluation(&c).unwrap();
                run_with_eval(&setup, &mut *objective, Some(&mut *eval), &mut seen).unwrap()
            }
            None => train_run(&setup, &mut *objective, &mut seen).unwrap(),
        }
    } else {
        let entry = kiln_runtime::resolve_trainer(&cfg).unwrap();
        let mut trainer = entry.construct(&cfg).unwrap();
        trainer.train(&mut seen).unwrap()
    };
    compare(name, run, backend, &seen, &report);
}

/// TRL's PPO rollouts, replayed: each epoch's data order (the prompts of its updates, then the
/// examples its dataloader dropped), the responses TRL sampled and numpy's permutations.
struct PpoReplay {
    updates: Vec<Value>,
    next: usize,
    permutations: std::collections::VecDeque<Vec<usize>>,
    examples: usize,
}

impl kiln_runtime::train::tasks::RolloutSource for PpoReplay {
    fn responses(
        &mut self,
        _policy: &dyn kiln_runtime::train::candle::Sample,
        prompts: &[Vec<u32>],
        _cfg: &kiln_runtime::model::generate::SamplingConfig,
    ) -> Result<Vec<Vec<u32>>, kiln_runtime::TrainError> {
        let u = &self.updates[self.next];
        self.next += 1;
        self.permutations = serde_json::from_value(u["permutations"].clone()).unwrap();
        let responses: Vec<Vec<u32>> = serde_json::from_value(u["responses"].clone()).unwrap();
        assert_eq!(
            responses.len(),
            prompts.len(),
            "TRL sampled for the same prompts"
        );
        Ok(responses)
    }
    fn permutation(&mut self, n: usize) -> Vec<usize> {
        let p = self
            .permutations
            .pop_front()
            .expect("TRL drew this permutation");
        assert_eq!(p.len(), n);
        p
    }
    fn epoch_order(&mut self, epoch: u64) -> Option<Vec<usize>> {
        let batch = self.updates[0]["prompts"].as_array().unwrap().len();
        let per_epoch = self.examples / batch;
        let mut order: Vec<usize> = self
            .updates
            .iter()
            .skip(epoch as usize * per_epoch)
            .take(per_epoch)
            .flat_map(|u| serde_json::from_value::<Vec<usize>>(u["prompts"].clone()).unwrap())
            .collect();
        let rest: Vec<usize> = (0..self.examples).filter(|i| !order.contains(i)).collect();
        order.extend(rest);
        Some(order)
    }
}

/// PPO against TRL: every update's figures (TRL logs no loss or gradient norm; its `lr` is
/// kiln's learning rate, its `eps` a wall-clock rate).
fn check_ppo(name: &str, backend: &str) {
    #[cfg(feature = "mlx")]
    use kiln_runtime::Trainer;
    let all = reference();
    let run = &all[name];
    let out = tempfile::tempdir().unwrap();
    let mut cfg = config(name, run, &out.path().join("run"));
    cfg.hyper.max_steps = None;
    cfg.backend = backend.to_string();
    let examples = std::fs::read_to_string(cfg.train_data.as_ref().unwrap())
        .unwrap()
        .lines()
        .count();
    let replay = Box::new(PpoReplay {
        updates: run["completions"].as_array().unwrap().clone(),
        next: 0,
        permutations: Default::default(),
        examples,
    });
    let mut seen = Collect::default();
    let report = match backend {
        "candle" => {
            use kiln_runtime::train::candle::{Setup, ppo_with_source, run as train_run};
            let setup = Setup::load(&cfg).unwrap();
            let mut objective = ppo_with_source(&cfg, &setup, replay).unwrap();
            train_run(&setup, &mut *objective, &mut seen).unwrap()
        }
        #[cfg(feature = "mlx")]
        "mlx" => {
            let mut trainer =
                kiln_runtime::train::mlx::train::ppo_with_source(&cfg, replay).unwrap();
            trainer.train(&mut seen).unwrap()
        }
        other => panic!("no backend {other}"),
    };
    assert_eq!(report.backend, backend);
    let want = run["logs"].as_array().unwrap();
    assert_eq!(seen.0.len(), want.len(), "{name}: logged updates");
    for (got, want) in seen.0.iter().zip(want) {
        let step = got.step;
        assert_eq!(step, want["step"].as_u64().unwrap(), "{name}");
        assert!(
            got.grad_norm.is_none(),
            "{name}: TRL's PPO logs no gradient norm"
        );
        assert!(
            close(got.learning_rate, want["lr"].as_f64().unwrap(), 1e-9, 1e-15),
            "{name} step {step}: learning rate"
        );
        assert!(
            close(got.epoch, want["epoch"].as_f64().unwrap(), 1e-9, 0.0),
            "{name} step {step}: epoch"
        );
        for (k, v) in want.as_object().unwrap() {
            if matches!(k.as_str(), "step" | "eps" | "lr" | "epoch") {
                continue;
            }
            same_figure(name, step, k, got.extra.get(k), v);
        }
        for k in got.extra.keys() {
            assert!(
                want.get(k).is_some(),
                "{name} step {step}: kiln logs `{k}`, TRL does not"
            );
        }
    }
    let out_dir = report.output.clone().unwrap();
    if run["adapter"].as_bool().unwrap() {
        assert!(out_dir.join("adapter_model.safetensors").is_file());
    } else {
        // The policy alone, as TRL saves it: no value model beside it.
        let names: Vec<String> = kiln_runtime::checkpoint::Checkpoint::open(&out_dir)
            .unwrap()
            .tensors()
            .map(|t| t.name.clone())
            .collect();
        assert!(
            names.iter().any(|n| n == "lm_head.weight"),
            "{name}: {names:?}"
        );
        assert!(
            !names
                .iter()
                .any(|n| n.contains("value_model") || n.contains("score")),
            "{name}: {names:?}"
        );
    }
}

/// The PPO reference runs (`tests/train/trl_ref.py`).
const PPO_RUNS: [&str; 5] = [
    "ppo-rm",
    "ppo-stop-k3",
    "ppo-minibatches",
    "ppo-chat",
    "ppo-lora",
];

/// PPO (TRL's experimental PPOTrainer) on TRL's own rollouts: a reward model's folder as reward
/// and value model; a stop token with the k3 KL, whitened rewards and the missing-EOS penalty;
/// minibatches under accumulation across epochs' ends (accelerate's optimizer steps), clipped
/// values and a cosine schedule; conversational prompts through the chat template; LoRA on the
/// policy with the value model in full.
#[test]
fn ppo_matches_trl() {
    for name in PPO_RUNS {
        check_ppo(name, "candle");
    }
}

/// PPO on MLX, as on candle.
#[cfg(feature = "mlx")]
#[test]
fn mlx_ppo_matches_trl() {
    for name in PPO_RUNS {
        check_ppo(name, "mlx");
    }
}

/// Every figure the run logged against TRL's (see [`check`]).
fn compare(
    name: &str,
    run: &Value,
    backend: &str,
    seen: &Collect,
    report: &kiln_runtime::train::TrainReport,
) {
    assert_eq!(report.backend, backend, "{name}: the run's backend");
    let want = run["logs"].as_array().unwrap();
    assert_eq!(seen.0.len(), want.len(), "{name}: logged steps");
    for (got, want) in seen.0.iter().zip(want) {
        let step = got.step;
        let w = |k: &str| want[k].as_f64().unwrap_or_else(|| panic!("{name}: no {k}"));
        let loss_tol = if step == 1 { 1e-5 } else { 1e-3 };
        // GRPO's and RLOO's losses are sums of advantages that cancel within a group: near
        // zero, so an absolute floor (f32 rounding of that cancellation; RLOO's advantages are
        // raw reward differences, up to a few units, so its rounding is larger).
        let floor = match run["task"].as_str() {
            Some("grpo") => 1e-6,
            Some("rloo") => 1e-5,
            // TRL's online DPO logs its loss rounded to four decimals.
            Some("online_dpo") => 5e-5,
            _ => 0.0,
        };
        assert!(
            close(got.loss, w("loss"), loss_tol, floor),
            "{name} step {step}: loss {} vs TRL {}",
            got.loss,
            w("loss")
        );
        assert!(
            close(got.grad_norm.unwrap(), w("grad_norm"), 1e-3, 1e-6),
            "{name} step {step}: grad_norm {} vs TRL {}",
            got.grad_norm.unwrap(),
            w("grad_norm")
        );
        assert!(
            close(got.learning_rate, w("learning_rate"), 1e-9, 1e-15),
            "{name} step {step}: learning_rate {} vs {}",
            got.learning_rate,
            w("learning_rate")
        );
        assert!(
            close(got.epoch, w("epoch"), 1e-9, 0.0),
            "{name} step {step}: epoch"
        );
        for (k, v) in want.as_object().unwrap() {
            if matches!(
                k.as_str(),
                "step" | "loss" | "grad_norm" | "learning_rate" | "epoch" | "step_time"
            ) {
                continue;
            }
            same_figure(name, step, k, got.extra.get(k), v);
        }
        if matches!(run["task"].as_str(), Some("grpo" | "rloo")) {
            // Nor does kiln log what TRL does not (a step reusing a generation batch logs no
            // generation figures).
            for k in got.extra.keys() {
                assert!(
                    want.get(k).is_some(),
                    "{name} step {step}: kiln logs `{k}`, TRL does not"
                );
            }
        }
    }
    if let Some(want) = run["eval_logs"].as_array() {
        assert_eq!(seen.1.len(), want.len(), "{name}: evaluations");
        for ((step, got), want) in seen.1.iter().zip(want) {
            assert_eq!(*step, want["step"].as_u64().unwrap(), "{name}");
            for (k, v) in want.as_object().unwrap() {
                if matches!(
                    k.as_str(),
                    "step"
                        | "epoch"
                        | "eval_runtime"
                        | "eval_samples_per_second"
                        | "eval_steps_per_second"
                ) {
                    continue;
                }
                same_figure(name, *step, k, got.get(k), v);
            }
        }
    }
    let out_dir = report.output.clone().unwrap();
    if run["adapter"].as_bool().unwrap() {
        assert!(out_dir.join("adapter_model.safetensors").is_file());
        assert!(out_dir.join("adapter_config.json").is_file());
    } else {
        assert!(out_dir.join("model.safetensors").is_file());
    }
}

#[test]
fn sft_full_fine_tuning_with_gradient_accumulation_matches_trl() {
    check("sft-full");
}

#[test]
fn sft_on_text_with_cosine_warmup_and_weight_decay_matches_trl() {
    check("sft-text");
}

#[test]
fn sft_lora_from_a_shared_adapter_matches_trl() {
    check("sft-lora");
}

#[test]
fn dpo_full_fine_tuning_matches_trl() {
    check("dpo-full");
}

#[test]
fn dpo_continuing_an_adapter_takes_a_frozen_copy_as_reference_like_trl() {
    check("dpo-lora");
}

#[test]
fn dpo_ipo_matches_trl() {
    check("dpo-ipo");
}

#[test]
fn dpo_hinge_with_precomputed_reference_log_probs_matches_trl() {
    check("dpo-hinge-precompute");
}

/// TRL 0.29.1's DPO loss types beyond sigmoid, hinge and ipo (reference runs).
const DPO_LOSS_TYPES: [&str; 11] = [
    "dpo-robust",
    "dpo-exo-pair",
    "dpo-nca-pair",
    "dpo-bco-pair",
    "dpo-sppo-hard",
    "dpo-aot",
    "dpo-aot-unpaired",
    "dpo-apo-zero",
    "dpo-apo-down",
    "dpo-discopop",
    "dpo-sft",
];

/// The other DPO settings and SFT's DFT loss (reference runs).
const DPO_SETTINGS_AND_DFT: [&str; 8] = [
    "dpo-mix-weights",
    "dpo-forward-kl",
    "dpo-js",
    "dpo-alpha-div",
    "dpo-ld-alpha",
    "dpo-wpo",
    "dpo-lora-dropout",
    "sft-dft",
];

/// TRL 0.29.1's other DPO loss types, each from the same weights and data.
#[test]
fn dpo_loss_types_match_trl() {
    for name in DPO_LOSS_TYPES {
        check(name);
    }
}

/// A list of loss types with `loss_weights` (RPO's sigmoid + sft, on an adapter);
/// `f_divergence_type` forward KL, Jensen–Shannon (with hinge) and α-divergence; LD-DPO's
/// `ld_alpha`; WPO's `use_weighting` (over sigmoid + ipo); an adapter with `lora_dropout` 0.1,
/// which TRL's DPO turns off (`disable_dropout=True`) and kiln must too; SFT's
/// `loss_type = "dft"` with gradient accumulation.
#[test]
fn dpo_settings_and_sft_dft_match_trl() {
    for name in DPO_SETTINGS_AND_DFT {
        check(name);
    }
}

#[test]
fn orpo_full_fine_tuning_matches_trl() {
    check("orpo-full");
}

#[test]
fn orpo_lora_with_gradient_accumulation_matches_trl() {
    check("orpo-lora");
}

#[test]
fn simpo_full_fine_tuning_matches_trls_cpo_trainer() {
    check("simpo-full");
}

#[test]
fn simpo_lora_matches_trl() {
    check("simpo-lora");
}

#[test]
fn cpo_sigmoid_with_label_smoothing_matches_trl() {
    check("cpo-sigmoid");
}

#[test]
fn simpo_with_truncated_completions_and_no_nll_matches_trl() {
    check("simpo-short");
}

/// TRL's RewardTrainer from the same sequence classifier (tiny/reward-model): explicit prompts;
/// implicit prompts with margins, center_rewards_coefficient and gradient accumulation;
/// conversations; LoRA continuing a PEFT SEQ_CLS adapter (its head trained in full); pairs
/// left out by max_length; an evaluation set.
#[test]
fn reward_modelling_matches_trl() {
    for name in [
        "reward-full",
        "reward-margin-center",
        "reward-chat",
        "reward-lora",
        "reward-short",
        "reward-eval",
    ] {
        check(name);
    }
}

/// A reward model's output is what transformers loads as `LlamaForSequenceClassification`:
/// a `score` head and no `lm_head`, the config naming the architecture, one label and the pad
/// id; started from a causal LM, the new head is said by name.
#[test]
fn reward_model_output_is_a_sequence_classifier() {
    let all = reference();
    let out = tempfile::tempdir().unwrap();
    for (model, new_head) in [("tiny/reward-model", false), ("tiny/model", true)] {
        let mut cfg = config("reward-full", &all["reward-full"], &out.path().join(model));
        cfg.model = here().join(model);
        cfg.hyper.max_steps = Some(1);
        let setup = kiln_runtime::train::candle::Setup::load(&cfg).unwrap();
        assert_eq!(
            setup.notes.iter().any(|n| n.starts_with("score.weight: ")),
            new_head,
            "{model}: {:?}",
            setup.notes
        );
        let entry = kiln_runtime::resolve_trainer(&cfg).unwrap();
        let mut trainer = entry.construct(&cfg).unwrap();
        let report = trainer.train(&mut Collect::default()).unwrap();
        let dir = report.output.unwrap();
        let ck = kiln_runtime::checkpoint::Checkpoint::open(&dir).unwrap();
        let score = ck.tensor("score.weight").expect("score.weight");
        assert_eq!(score.shape, vec![1, 32]);
        assert!(
            ck.tensor("lm_head.weight").is_none(),
            "{model}: lm_head kept"
        );
        let c: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(
            c["architectures"],
            serde_json::json!(["LlamaForSequenceClassification"])
        );
        assert_eq!(c["id2label"], serde_json::json!({"0": "LABEL_0"}));
        assert_eq!(c["pad_token_id"], 3);
    }
    // LoRA: PEFT's SEQ_CLS adapter, the head beside the adapters; merged, a classifier again.
    let mut cfg = config("reward-full", &all["reward-full"], &out.path().join("lora"));
    cfg.model = here().join("tiny/model");
    cfg.hyper.max_steps = Some(1);
    cfg.lora = Some(kiln_runtime::train::LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        lora_dropout: 0.0,
        target_modules: vec!["all-linear".into()],
        use_rslora: false,
    });
    cfg.merge = true;
    let entry = kiln_runtime::resolve_trainer(&cfg).unwrap();
    let report = entry
        .construct(&cfg)
        .unwrap()
        .train(&mut Collect::default())
        .unwrap();
    let dir = report.output.unwrap();
    let a: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(a["task_type"], "SEQ_CLS");
    assert_eq!(
        a["modules_to_save"],
        serde_json::json!(["classifier", "score"])
    );
    assert!(
        !a["target_modules"].to_string().contains("score"),
        "all-linear leaves the head out: {}",
        a["target_modules"]
    );
    let head = kiln_runtime::adapters::peft_classifier_head(&dir)
        .unwrap()
        .expect("the adapter holds the head");
    assert_eq!(head.0, vec![1, 32]);
    let merged = kiln_runtime::checkpoint::Checkpoint::open(dir.join("merged")).unwrap();
    assert!(merged.tensor("score.weight").is_some());
    assert!(merged.tensor("lm_head.weight").is_none());
    // Only PEFT's layout holds the head.
    cfg.adapter_format = kiln_runtime::train::AdapterFormat::MlxLm;
    cfg.merge = false;
    cfg.output = out.path().join("lora-mlx");
    let e = kiln_runtime::resolve_trainer(&cfg)
        .unwrap()
        .construct(&cfg)
        .unwrap()
        .train(&mut Collect::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--adapter-format peft"), "{e}");
}

#[test]
fn kto_full_fine_tuning_matches_trl() {
    check("kto-full");
}

#[test]
fn kto_lora_with_weights_matches_trl() {
    check("kto-lora");
}

#[test]
fn kto_apo_zero_with_precomputed_reference_matches_trl() {
    check("kto-apo-precompute");
}

#[test]
fn grpo_dapo_with_two_weighted_rewards_matches_trl_on_its_completions() {
    check("grpo-dapo");
}

#[test]
fn grpo_with_a_kl_to_the_reference_matches_trl() {
    check("grpo-beta");
}

#[test]
fn grpo_lora_bnpo_with_batch_scaled_rewards_matches_trl() {
    check("grpo-lora");
}

#[test]
fn dr_grpo_unscaled_matches_trl() {
    check("grpo-dr");
}

/// Packing as TRL packs (SFTConfig.packing): best-fit bins whose sequences attend only to
/// themselves with positions from 0; the overflow re-queued under completion-only labels;
/// kiln's pretrain (raw text, packed) cutting one stream, from another column and from a plain
/// text file under LoRA; an unpacked evaluation set.
#[test]
fn packing_and_pretraining_match_trl() {
    for name in [
        "sft-pack-bfd",
        "sft-pack-requeue",
        "pretrain-wrapped",
        "pretrain-txt",
        "sft-pack-eval",
    ] {
        check(name);
    }
}

/// BCO as TRL's BCOTrainer computes it: the running reward shift, LoRA, paired data unpaired
/// with an evaluation reading the training's shift, precomputed reference log-probs under
/// gradient accumulation.
#[test]
fn bco_matches_trl() {
    for name in ["bco-full", "bco-lora", "bco-paired-eval", "bco-precompute"] {
        check(name);
    }
}

/// Online DPO as TRL's OnlineDPOTrainer computes it, on TRL's own samples: a reward model
/// ranking each pair; a reward function with IPO, the missing-EOS penalty and gradient
/// accumulation (each micro-batch's loss back-propagated whole, logged divided); LoRA.
#[test]
fn online_dpo_matches_trl() {
    for name in ["online-dpo-rm", "online-dpo-ipo", "online-dpo-lora"] {
        check(name);
    }
}

/// Distillation as TRL's GKDTrainer computes it, from a wider teacher (offline: on-policy
/// samples come from each side's own random stream): the generalized JSD, forward KL under
/// gradient accumulation (TRL does not divide GKD's loss by the steps), reverse KL under LoRA,
/// evaluation.
#[test]
fn distillation_matches_trl() {
    for name in ["distill-jsd", "distill-kl", "distill-lora", "distill-eval"] {
        check(name);
    }
}

/// RLOO (TRL's RLOOTrainer) on TRL's own completions: its default β (the sequence KL taken off
/// the rewards) with two weighted rewards; normalised, clipped advantages over two iterations
/// (sequence-level ratios clipped); LoRA continuing an adapter; a reward model.
#[test]
fn rloo_matches_trl() {
    for name in [
        "rloo-kl",
        "rloo-normalize-clip",
        "rloo-lora",
        "rloo-reward-model",
    ] {
        check(name);
    }
}

/// GRPO rewarded by a trained reward model (TRL loads the folder as
/// AutoModelForSequenceClassification) beside a function: the model's scores, TRL's
/// `rewards/<folder>/mean` figures, the same steps.
#[test]
fn grpo_with_a_reward_model_matches_trl() {
    check("grpo-reward-model");
}

/// The f32 tensor `name` of a safetensors file.
fn f32_tensor(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (t.shape().to_vec(), v)
}

/// `tests/train/peft/adapter` is what `kiln train` writes (re-trained here, tensor by tensor)
/// and what `peft` loads (`tests/train/peft_check.py` loaded it onto the tiny Llama and saved
/// its logits): kiln's logits with that adapter, and with it merged, are peft's.
#[test]
fn peft_loads_kilns_adapter_and_gives_kilns_logits() {
    use kiln_runtime::model::candle::{DType, Device, Tensor};
    use kiln_runtime::model::lora::Adapters;
    let peft = here().join("peft");
    // 1. The committed adapter is kiln's output for this run.
    let out = tempfile::tempdir().unwrap();
    let mut c = TrainConfig::new(
        "sft",
        "candle",
        here().join("tiny/model"),
        out.path().join("a"),
    );
    c.train_data = Some(here().join("data/sft.jsonl"));
    c.hyper.max_steps = Some(3);
    c.hyper.learning_rate = 1e-2;
    c.hyper.per_device_train_batch_size = 4;
    c.hyper.train_sampling_strategy = "sequential".into();
    kiln_runtime::train::fields::defaults_for(&mut c);
    c.hyper.learning_rate = 1e-2;
    let l = c.lora.as_mut().unwrap();
    (l.r, l.lora_alpha, l.lora_dropout) = (4, 8.0, 0.0);
    l.target_modules = vec!["q_proj".into(), "v_proj".into(), "gate_proj".into()];
    let entry = kiln_runtime::resolve_trainer(&c).unwrap();
    entry
        .construct(&c)
        .unwrap()
        .train(&mut kiln_runtime::train::NoopObserver)
        .unwrap();
    let fresh = out.path().join("a/adapter_model.safetensors");
    let committed = peft.join("adapter/adapter_model.safetensors");
    let bytes = std::fs::read(&committed).unwrap();
    let names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_string)
        .collect();
    assert_eq!(
        names.len(),
        2 * 3 * 2,
        "A and B of three Linears in two layers"
    );
    for n in &names {
        let (s1, a) = f32_tensor(&fresh, n);
        let (s2, b) = f32_tensor(&committed, n);
        assert_eq!(s1, s2, "{n}");
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-6 * y.abs().max(1.0), "{n}: {x} vs {y}");
        }
    }
    // 2. kiln's logits with the adapter loaded, and merged, against peft's.
    let ck = kiln_runtime::checkpoint::Checkpoint::open(here().join("tiny/model")).unwrap();
    let base = kiln_runtime::model::DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let adapters = Adapters::load_peft(&peft.join("adapter"), &base).unwrap();
    let with = base.with_adapters(Some(std::sync::Arc::new(adapters.clone())));
    let bytes = std::fs::read(peft.join("peft_logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids_view = st.tensor("ids").unwrap();
    let ids: Vec<u32> = ids_view
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let shape = ids_view.shape().to_vec();
    let ids = Tensor::from_vec(ids, (shape[0], shape[1]), &Device::Cpu).unwrap();
    let replaced = adapters.merged(&base).unwrap();
    let mut w = base.weights().clone();
    for (name, t) in replaced {
        w.replace(&name, t).unwrap();
    }
    let merged = base.with_weights(w).unwrap();
    for (model, key) in [(&with, "logits"), (&merged, "merged_logits")] {
        let got: Vec<f32> = model
            .forward(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (_, want) = f32_tensor(&peft.join("peft_logits.safetensors"), key);
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{key}: max |kiln − peft| = {worst}");
    }
}

#[test]
fn sft_on_messages_with_assistant_only_loss_matches_trl() {
    check("sft-messages");
}

#[test]
fn sft_on_conversational_prompt_completion_matches_trl() {
    check("sft-chat-pc");
}

#[test]
fn dpo_on_conversational_pairs_matches_trl() {
    check("dpo-chat");
}

/// Evaluation during GRPO: every evaluation prompt's completions generated and scored, the
/// figures averaged over the batches (TRL's completions, replayed by prompt).
#[test]
fn grpo_evaluation_matches_trl() {
    check("grpo-eval");
}

/// Two optimisation steps per generation batch: the second step's ratios move off 1 and are
/// clipped (TRL logs clip ratios near 0.9 there), and only generating steps log the
/// generation's figures.
#[test]
fn grpo_with_two_iterations_per_generation_matches_trl() {
    check("grpo-iterations");
}

#[test]
fn orpo_on_conversational_pairs_matches_trl() {
    check("orpo-chat");
}

/// The prompt ends with the assistant's words: rendered to continue them, as TRL does.
#[test]
fn simpo_on_a_conversation_continuing_the_assistant_matches_trl() {
    check("simpo-chat-continue");
}

#[test]
fn kto_on_conversational_examples_matches_trl() {
    check("kto-chat");
}

/// Preference pairs given to KTO are unpaired as TRL unpairs them: every chosen, then every
/// rejected.
#[test]
fn kto_on_paired_preferences_matches_trl() {
    check("kto-paired");
}

#[test]
fn sft_evaluation_matches_trl() {
    check("sft-eval");
}

#[test]
fn dpo_evaluation_matches_trl() {
    check("dpo-eval");
}

#[test]
fn kto_evaluation_matches_trl() {
    check("kto-eval");
}

/// Evaluation runs the adapters without dropout, as transformers evaluates after
/// `model.eval()`: with the weights held still (learning rate 0), every evaluation gives the
/// same figures, and the same as an adapter without dropout.
#[test]
fn evaluation_runs_without_lora_dropout() {
    let evals = |dropout: f64| {
        let dir = tempfile::tempdir().unwrap();
        let adapter = dir.path().join("adapter");
        std::fs::create_dir(&adapter).unwrap();
        let src = here().join("tiny/init-adapter");
        std::fs::copy(
            src.join("adapter_model.safetensors"),
            adapter.join("adapter_model.safetensors"),
        )
        .unwrap();
        let mut cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(src.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        cfg["lora_dropout"] = dropout.into();
        std::fs::write(adapter.join("adapter_config.json"), cfg.to_string()).unwrap();
        let mut c = TrainConfig::new(
            "dpo",
            "candle",
            here().join("tiny/model"),
            dir.path().join("out"),
        );
        c.train_data = Some(here().join("data/dpo.jsonl"));
        c.eval_data = Some(here().join("data/dpo-eval.jsonl"));
        c.init_adapter = Some(adapter);
        c.hyper.learning_rate = 0.0;
        c.hyper.max_steps = Some(2);
        c.hyper.eval_steps = Some(1);
        c.hyper.per_device_train_batch_size = 2;
        // TRL's DPO turns dropout off by default (disable_dropout); here it stays on in training.
        c.task_options
            .insert("disable_dropout".into(), false.into());
        let entry = kiln_runtime::resolve_trainer(&c).unwrap();
        let mut trainer = entry.construct(&c).unwrap();
        let mut seen = Collect::default();
        trainer.train(&mut seen).unwrap();
        // Training itself does see the dropout.
        let train_loss = seen.0[0].loss;
        let figures = seen
            .1
            .into_iter()
            .map(|(_, mut m)| {
                m.remove("eval_num_tokens"); // the training tokens so far
                m
            })
            .collect::<Vec<_>>();
        (figures, train_loss)
    };
    let (with, loss_with) = evals(0.5);
    let (without, loss_without) = evals(0.0);
    assert_eq!(with.len(), 2);
    assert_eq!(with[0], with[1]);
    assert_eq!(with, without);
    assert_ne!(loss_with, loss_without, "dropout is on in training");
}

/// The MLX backend (feature `mlx`) trains SFT as TRL does, from the same weights and data as
/// the candle runs: full fine-tuning with accumulation, text with a cosine schedule and weight
/// decay, a shared LoRA adapter, chat data with assistant-only loss, evaluation.
#[cfg(feature = "mlx")]
#[test]
fn mlx_sft_matches_trl() {
    for name in [
        "sft-full",
        "sft-text",
        "sft-lora",
        "sft-messages",
        "sft-chat-pc",
        "sft-eval",
    ] {
        check_on(name, "mlx");
    }
}

/// DPO on MLX as TRL trains it: full fine-tuning (the reference the starting weights), a
/// continued LoRA adapter (the reference a frozen copy of it), IPO, hinge with precomputed
/// reference log-probs, conversational pairs, evaluation.
#[cfg(feature = "mlx")]
#[test]
fn mlx_dpo_matches_trl() {
    for name in [
        "dpo-full",
        "dpo-lora",
        "dpo-ipo",
        "dpo-hinge-precompute",
        "dpo-chat",
        "dpo-eval",
    ] {
        check_on(name, "mlx");
    }
}

/// TRL's other DPO loss types, weighted mixtures, f-divergences, LD-DPO, WPO, dropout turned
/// off, and SFT's DFT loss on MLX: the same task code as candle, TRL's figures.
#[cfg(feature = "mlx")]
#[test]
fn mlx_dpo_loss_types_and_sft_dft_match_trl() {
    for name in DPO_LOSS_TYPES.iter().chain(&DPO_SETTINGS_AND_DFT) {
        check_on(name, "mlx");
    }
}

/// ORPO, SimPO / CPO and KTO on MLX as TRL trains them (the same runs as candle's).
#[cfg(feature = "mlx")]
#[test]
fn mlx_orpo_simpo_kto_match_trl() {
    for name in [
        "orpo-full",
        "orpo-lora",
        "orpo-chat",
        "simpo-full",
        "simpo-lora",
        "cpo-sigmoid",
        "simpo-short",
        "simpo-chat-continue",
        "kto-full",
        "kto-lora",
        "kto-apo-precompute",
        "kto-chat",
        "kto-paired",
        "kto-eval",
    ] {
        check_on(name, "mlx");
    }
}

/// GRPO and RLOO on MLX on TRL's own completions: every loss variant, KL to the reference,
/// LoRA, two iterations per generation (clipped ratios), evaluation, a reward model.
#[cfg(feature = "mlx")]
#[test]
fn mlx_grpo_matches_trl() {
    for name in [
        "grpo-dapo",
        "grpo-beta",
        "grpo-lora",
        "grpo-dr",
        "grpo-iterations",
        "grpo-eval",
        "grpo-reward-model",
        "rloo-kl",
        "rloo-normalize-clip",
        "rloo-lora",
        "rloo-reward-model",
    ] {
        check_on(name, "mlx");
    }
}

/// BCO on MLX, as on candle.
#[cfg(feature = "mlx")]
#[test]
fn mlx_bco_matches_trl() {
    for name in ["bco-full", "bco-lora", "bco-paired-eval", "bco-precompute"] {
        check_on(name, "mlx");
    }
}

/// Online DPO on MLX, as on candle.
#[cfg(feature = "mlx")]
#[test]
fn mlx_online_dpo_matches_trl() {
    for name in ["online-dpo-rm", "online-dpo-ipo", "online-dpo-lora"] {
        check_on(name, "mlx");
    }
}

/// Distillation on MLX (the teacher on candle), as on candle.
#[cfg(feature = "mlx")]
#[test]
fn mlx_distillation_matches_trl() {
    for name in ["distill-jsd", "distill-kl", "distill-lora", "distill-eval"] {
        check_on(name, "mlx");
    }
}

/// Packing and pretraining on MLX, as on candle.
#[cfg(feature = "mlx")]
#[test]
fn mlx_packing_and_pretraining_match_trl() {
    for name in [
        "sft-pack-bfd",
        "sft-pack-requeue",
        "pretrain-wrapped",
        "pretrain-txt",
        "sft-pack-eval",
    ] {
        check_on(name, "mlx");
    }
}

/// Reward modelling on MLX, TRL's RewardTrainer from the same sequence classifier: text and
/// conversational pairs, margins and centring, a PEFT SEQ_CLS adapter with its head, pairs
/// left out by max_length, evaluation.
#[cfg(feature = "mlx")]
#[test]
fn mlx_reward_modelling_matches_trl() {
    for name in [
        "reward-full",
        "reward-margin-center",
        "reward-chat",
        "reward-lora",
        "reward-short",
        "reward-eval",
    ] {
        check_on(name, "mlx");
    }
}

/// MLX runs resume exactly, as candle's do: a run saved at step 2 and resumed logs step 3 as
/// the straight run does (LoRA dropout and shuffling; full fine-tuning; GRPO mid-way through a
/// generation batch, sampling on MLX).
#[cfg(feature = "mlx")]
#[test]
fn mlx_runs_resume_exactly() {
    type Tweak = fn(&mut TrainConfig);
    let cases: [(&str, &str, Tweak); 3] = [
        ("sft", "data/sft.jsonl", |c| {
            c.lora.get_or_insert_with(Default::default).lora_dropout = 0.1;
            c.hyper.train_sampling_strategy = "random".into();
        }),
        ("dpo", "data/dpo.jsonl", |c| c.lora = None),
        ("grpo", "data/grpo.jsonl", |c| {
            for (k, v) in [
                ("num_generations", serde_json::json!(4)),
                ("max_completion_length", serde_json::json!(4)),
                ("num_iterations", serde_json::json!(3)),
            ] {
                c.task_options.insert(k.into(), v);
            }
        }),
    ];
    for (task, data, tweak) in cases {
        let run = |dir: &Path, save: bool, resume: Option<PathBuf>| {
            let mut c = TrainConfig::new(task, "mlx", here().join("tiny/model"), dir.join("out"));
            c.train_data = Some(here().join(data));
            c.hyper.max_steps = Some(3);
            c.hyper.logging_steps = 1;
            c.hyper.per_device_train_batch_size = 4;
            c.hyper.learning_rate = 1e-3;
            c.hyper.warmup_steps = 1;
            tweak(&mut c);
            if save {
                c.hyper.save_steps = Some(2);
            }
            c.resume = resume;
            let entry = kiln_runtime::resolve_trainer(&c).unwrap();
            let mut trainer = entry.construct(&c).unwrap();
            let mut seen = Collect::default();
            trainer.train(&mut seen).unwrap();
            seen.0
        };
        let straight = run(tempfile::tempdir().unwrap().path(), false, None);
        let saved = tempfile::tempdir().unwrap();
        run(saved.path(), true, None);
        let ck = saved.path().join("out/checkpoint-2");
        assert!(ck.join("trainer_state.json").is_file(), "{task}");
        let resumed = run(tempfile::tempdir().unwrap().path(), false, Some(ck));
        assert_eq!(resumed.len(), 1, "{task}: only step 3 is left");
        assert_eq!(
            resumed[0], straight[2],
            "{task}: step 3 resumed = step 3 straight"
        );
    }
}

/// mlx-lm's adapter layout (`--adapter-format mlx-lm`): written from a PEFT adapter and read
/// back (as `--init-adapter` reads it), it gives the PEFT adapter's logits; adapters mlx-lm
/// cannot express (not the same modules in every layer) are a named error.
#[test]
fn mlx_lm_adapters_round_trip_to_the_same_logits() {
    use kiln_runtime::model::DecoderModel;
    use kiln_runtime::model::candle::{DType, Device, Tensor};
    use kiln_runtime::model::lora::{Adapters, linear_modules};
    let ck = kiln_runtime::checkpoint::Checkpoint::open(here().join("tiny/model")).unwrap();
    let base = DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let modules = linear_modules(&base);
    let peft =
        Adapters::load_peft_for(&here().join("tiny/init-adapter"), &modules, &Device::Cpu).unwrap();
    let dir = tempfile::tempdir().unwrap();
    peft.save_mlx_lm(dir.path(), base.config().layers).unwrap();
    let cfg: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["fine_tune_type"], "lora");
    assert_eq!(cfg["num_layers"], base.config().layers);
    assert_eq!(cfg["lora_parameters"]["rank"], 4);
    assert_eq!(cfg["lora_parameters"]["scale"], 2.0);
    let back = Adapters::load_any_for(dir.path(), &modules, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[3u32, 17, 42, 99, 5]], &Device::Cpu).unwrap();
    let logits = |a: &Adapters| -> Vec<f32> {
        base.with_adapters(Some(std::sync::Arc::new(a.clone())))
            .forward(&ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (want, got) = (logits(&peft), logits(&back));
    assert!(
        want.iter()
            .zip(&got)
            .all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs().max(1.0))
    );
    // Adapters on one layer's q_proj only: mlx-lm's "last N layers" cannot say that.
    let spec = kiln_runtime::model::lora::LoraSpec {
        r: 2,
        alpha: 4.0,
        dropout: 0.0,
        rslora: false,
        target_modules: vec!["model.layers.0.self_attn.q_proj".into()],
    };
    let one = Adapters::new_for(&modules, &spec, 1, &Device::Cpu).unwrap();
    let err = one
        .save_mlx_lm(dir.path(), base.config().layers)
        .unwrap_err()
        .to_string();
    assert!(err.contains("last N layers"), "{err}");
}

/// `mlx_lm` loads the mlx-lm layout kiln writes and computes kiln's logits:
/// `tests/train/mlx-lm/adapter` is kiln's `--adapter-format mlx-lm` writing of
/// `tests/train/peft/adapter` (written again here and compared byte for byte), and
/// `tests/train/mlx_lm_check.py` loaded it onto the tiny Llama with `mlx_lm.load` and saved its
/// logits, which kiln reproduces from the same files.
#[test]
fn mlx_lm_loads_kilns_adapter_and_gives_kilns_logits() {
    use kiln_runtime::model::DecoderModel;
    use kiln_runtime::model::candle::{DType, Device, Tensor};
    use kiln_runtime::model::lora::{Adapters, linear_modules};
    let ck = kiln_runtime::checkpoint::Checkpoint::open(here().join("tiny/model")).unwrap();
    let base = DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let modules = linear_modules(&base);
    let peft =
        Adapters::load_peft_for(&here().join("peft/adapter"), &modules, &Device::Cpu).unwrap();
    let committed = here().join("mlx-lm/adapter");
    if std::env::var_os("KILN_BLESS_MLX_LM").is_some() {
        std::fs::create_dir_all(&committed).unwrap();
        peft.save_mlx_lm(&committed, base.config().layers).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    peft.save_mlx_lm(dir.path(), base.config().layers).unwrap();
    for f in ["adapters.safetensors", "adapter_config.json"] {
        assert_eq!(
            std::fs::read(dir.path().join(f)).unwrap(),
            std::fs::read(committed.join(f)).unwrap(),
            "{f}: kiln writes what mlx-lm was checked on"
        );
    }
    let bytes = std::fs::read(here().join("mlx-lm/mlx_lm_logits.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids_view = st.tensor("ids").unwrap();
    let ids: Vec<u32> = ids_view
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let shape = ids_view.shape().to_vec();
    let ids = Tensor::from_vec(ids, (shape[0], shape[1]), &Device::Cpu).unwrap();
    let adapters = Adapters::load_any_for(&committed, &modules, &Device::Cpu).unwrap();
    let got: Vec<f32> = base
        .with_adapters(Some(std::sync::Arc::new(adapters)))
        .forward(&ids)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let want: Vec<f32> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(got.len(), want.len());
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-4, "kiln vs mlx-lm logits differ by {worst}");
}

/// A broken adapter folder is a named error, in either layout: a module with only one half, a
/// tensor of the wrong shape, a Linear the model does not have.
#[test]
fn broken_adapters_are_named_errors() {
    use kiln_runtime::model::DecoderModel;
    use kiln_runtime::model::candle::{DType, Device};
    use kiln_runtime::model::lora::{Adapters, linear_modules};
    let ck = kiln_runtime::checkpoint::Checkpoint::open(here().join("tiny/model")).unwrap();
    let base = DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let modules = linear_modules(&base);
    let write = |dir: &Path, file: &str, config: &str, tensors: &[(&str, Vec<usize>)]| {
        std::fs::write(dir.join("adapter_config.json"), config).unwrap();
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, s)| {
                (
                    n.to_string(),
                    s.clone(),
                    vec![0u8; 4 * s.iter().product::<usize>()],
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
    };
    let (_, inputs, outputs) = modules
        .iter()
        .find(|(m, _, _)| m == "model.layers.0.self_attn.q_proj")
        .cloned()
        .unwrap();
    let peft_cfg = r#"{"peft_type":"LORA","r":2,"lora_alpha":4,"target_modules":["q_proj"]}"#;
    let mlx_cfg = r#"{"fine_tune_type":"lora","num_layers":2,"lora_parameters":{"rank":2,"scale":2.0,"dropout":0.0}}"#;
    let q = "model.layers.0.self_attn.q_proj";
    type Case<'a> = (&'a str, &'a str, Vec<(String, Vec<usize>)>, String);
    let cases: Vec<Case> = vec![
        (
            "adapter_model.safetensors",
            peft_cfg,
            vec![(
                format!("base_model.model.{q}.lora_A.weight"),
                vec![2, inputs],
            )],
            format!("`{q}` has only one of lora_A / lora_B"),
        ),
        (
            "adapters.safetensors",
            mlx_cfg,
            vec![
                (format!("{q}.lora_a"), vec![2, inputs]),
                (format!("{q}.lora_b"), vec![2, outputs]),
            ],
            format!("tensor `{q}.lora_a` has shape [2, {inputs}], expected [{inputs}, 2]"),
        ),
        (
            "adapters.safetensors",
            mlx_cfg,
            vec![(
                "model.layers.0.self_attn.nope.lora_a".into(),
                vec![inputs, 2],
            )],
            "the model has no Linear `model.layers.0.self_attn.nope`".into(),
        ),
    ];
    for (file, cfg, tensors, want) in cases {
        let dir = tempfile::tempdir().unwrap();
        let t: Vec<(&str, Vec<usize>)> = tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.clone()))
            .collect();
        write(dir.path(), file, cfg, &t);
        let err = Adapters::load_any_for(dir.path(), &modules, &Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&want), "{err}");
        assert!(err.contains(file), "names the file: {err}");
    }
}

/// The output layer and log-softmax without the logits (`forward_padded_logps`, what candle
/// trains SFT, DPO, KTO, ORPO and CPO with on the CPU) run — over a dense f32 head and over
/// LoRA's packed bf16 one — and give the padded forward's log-probabilities, entropies,
/// arg-maxes and logit sums; a head it cannot take (an adapter on `lm_head`) is left to the
/// logits.
#[test]
fn the_head_without_logits_equals_the_padded_forward() {
    use kiln_runtime::model::DecoderModel;
    use kiln_runtime::model::candle::{D, DType, Device, Tensor};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("demo");
    std::fs::create_dir_all(&model).unwrap();
    kiln_runtime::demo::write_demo_model(&model, kiln_runtime::demo::DemoConfig::default())
        .unwrap();
    let ck = kiln_runtime::checkpoint::Checkpoint::open(&model).unwrap();
    let (b, t) = (3usize, 9usize);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 37 % 500 + 3) as u32).collect();
    let lengths = [9usize, 5, 7];
    let labels: Vec<u32> = (0..b * t).map(|i| (i * 11 % 300) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
    for (name, m) in [
        (
            "dense",
            DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap(),
        ),
        (
            "packed",
            DecoderModel::load_frozen_base(&ck, &Device::Cpu).unwrap(),
        ),
    ] {
        let (logps, stats) = m
            .forward_padded_logps(&ids, &lengths, labels.clone())
            .unwrap()
            .unwrap_or_else(|| panic!("{name}: the head runs without the logits"));
        let logits = m.forward_padded(&ids, &lengths).unwrap();
        let lsm = candle_nn_free_log_softmax(&logits);
        let want = gathered(&lsm, &labels);
        let got: Vec<f32> = logps.flatten_all().unwrap().to_vec1().unwrap();
        let argmax: Vec<u32> = logits
            .argmax(D::Minus1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let sums: Vec<f32> = logits
            .sum(D::Minus1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let p = lsm.exp().unwrap();
        let entropy: Vec<f32> = (p * &lsm)
            .unwrap()
            .sum(D::Minus1)
            .unwrap()
            .neg()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (what, a, w) in [
            ("logps", &got, &want),
            ("entropy", &stats.entropy, &entropy),
            ("sum", &stats.sum, &sums),
        ] {
            for (i, (x, y)) in a.iter().zip(w.iter()).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "{name} {what}[{i}]: {x} vs {y}"
                );
            }
        }
        assert_eq!(stats.argmax, argmax, "{name}");
        // Left padding, the head at positions 3..8 only, a temperature (GRPO's completions);
        // then numbered as PPO numbers a left-padded batch (`cumsum(mask) − mask`).
        let attention: Vec<Vec<bool>> = (0..b).map(|i| (0..t).map(|j| j >= i).collect()).collect();
        let positions: Vec<Vec<usize>> = attention
            .iter()
            .map(|r| {
                let mut seen = 0usize;
                r.iter()
                    .map(|&a| {
                        seen += usize::from(a);
                        seen - usize::from(a)
                    })
                    .collect()
            })
            .collect();
        let at_labels: Vec<u32> = labels[..b * 5].to_vec();
        for numbered in [false, true] {
            let scored = kiln_runtime::model::HeadPositions {
                attention: &attention,
                positions: numbered.then_some(&positions[..]),
                at: 3..8,
                scale: 1.0 / 0.7,
            };
            let (logps, stats) = m
                .forward_masked_logps(&ids, &scored, at_labels.clone())
                .unwrap()
                .unwrap();
            let logits = if numbered {
                m.forward_positioned(&ids, &attention, &positions).unwrap()
            } else {
                m.forward_masked(&ids, &attention).unwrap()
            };
            let scaled = logits
                .narrow(1, 3, 5)
                .unwrap()
                .affine(1.0 / 0.7, 0.0)
                .unwrap();
            let want = gathered(&candle_nn_free_log_softmax(&scaled), &at_labels);
            let got: Vec<f32> = logps.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(got.len(), b * 5);
            assert_eq!(stats.entropy.len(), b * 5);
            for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                    "{name} masked (numbered {numbered}) logps[{i}]: {x} vs {y}"
                );
            }
        }
    }
    // An adapter on lm_head: the logits' path.
    let mut m = DecoderModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let spec = kiln_runtime::model::lora::LoraSpec {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        rslora: false,
        target_modules: vec!["lm_head".into()],
    };
    let adapters = kiln_runtime::model::lora::Adapters::new(&m, &spec, 1).unwrap();
    m = m.with_adapters(Some(std::sync::Arc::new(adapters)));
    assert!(
        m.forward_padded_logps(&ids, &lengths, labels)
            .unwrap()
            .is_none()
    );
}

/// Each position's value at its label, of `[batch, t, vocab]` log-probabilities.
fn gathered(lsm: &kiln_runtime::model::candle::Tensor, labels: &[u32]) -> Vec<f32> {
    lsm.flatten_to(1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
        .iter()
        .zip(labels)
        .map(|(row, &l)| row[l as usize])
        .collect()
}

/// `log_softmax` over the last dimension by the textbook (max-shifted), in candle ops.
fn candle_nn_free_log_softmax(
    x: &kiln_runtime::model::candle::Tensor,
) -> kiln_runtime::model::candle::Tensor {
    use kiln_runtime::model::candle::D;
    let max = x.max_keepdim(D::Minus1).unwrap();
    let shifted = x.broadcast_sub(&max).unwrap();
    let lse = shifted
        .exp()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .log()
        .unwrap();
    shifted.broadcast_sub(&lse).unwrap()
}

/// LoRA keeps a bf16 checkpoint's frozen Linears in bf16 (`DecoderModel::load_frozen_base`,
/// widened a tile at a time): every step's loss and gradient norm equal those of the same run
/// over the weights loaded in f32 (what `--merge` loads, as it needs them dense).
#[test]
fn lora_over_a_bf16_base_kept_in_bf16_trains_as_over_its_f32_load() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("demo");
    std::fs::create_dir_all(&model).unwrap();
    kiln_runtime::demo::write_demo_model(&model, kiln_runtime::demo::DemoConfig::default())
        .unwrap();
    let ck = kiln_runtime::checkpoint::Checkpoint::open(&model).unwrap();
    assert!(
        ck.tensors().any(|t| t.dtype == safetensors::Dtype::BF16),
        "a bf16 checkpoint"
    );
    let run = |merge: bool| {
        let mut c = TrainConfig::new(
            "sft",
            "candle",
            &model,
            dir.path().join(format!("out-{merge}")),
        );
        c.train_data = Some(here().join("data/sft.jsonl"));
        c.hyper.max_steps = Some(3);
        c.hyper.logging_steps = 1;
        c.hyper.per_device_train_batch_size = 4;
        c.hyper.learning_rate = 1e-3;
        c.merge = merge;
        let entry = kiln_runtime::resolve_trainer(&c).unwrap();
        let mut seen = Collect::default();
        entry.construct(&c).unwrap().train(&mut seen).unwrap();
        seen.0
    };
    let (kept, f32_load) = (run(false), run(true));
    assert_eq!(kept.len(), 3);
    for (a, b) in kept.iter().zip(&f32_load) {
        assert!(
            (a.loss - b.loss).abs() <= 1e-5 * b.loss.abs(),
            "{} vs {}",
            a.loss,
            b.loss
        );
        let (ga, gb) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
        assert!((ga - gb).abs() <= 1e-4 * gb.abs(), "grad norm {ga} vs {gb}");
    }
}

/// Three steps without and with gradient checkpointing: the same losses and gradient norms.
fn same_steps(name: &str, off: &[StepMetrics], on: &[StepMetrics]) {
    assert_eq!(off.len(), 3, "{name}");
    for (a, b) in off.iter().zip(on) {
        assert!(
            close(b.loss, a.loss, 1e-5, 1e-7),
            "{name} step {}: loss {} checkpointed vs {}",
            a.step,
            b.loss,
            a.loss
        );
        let (ga, gb) = (a.grad_norm.unwrap(), b.grad_norm.unwrap());
        assert!(
            close(gb, ga, 1e-5, 1e-9),
            "{name} step {}: grad_norm {gb} checkpointed vs {ga}",
            a.step
        );
    }
}

/// A reference case for the gradient checkpointing tests: 3 steps on `backend`, under new LoRA
/// adapters with `dropout` where given, checkpointing `on` or off.
fn checkpointing_case(
    name: &str,
    run: &Value,
    out: &Path,
    dropout: Option<f64>,
    on: bool,
    backend: &str,
) -> TrainConfig {
    let mut cfg = config(name, run, out);
    cfg.backend = backend.into();
    cfg.hyper.max_steps = Some(3);
    if let Some(p) = dropout {
        cfg.init_adapter = None;
        cfg.lora = Some(kiln_runtime::train::LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            lora_dropout: p,
            target_modules: vec!["all-linear".into()],
            use_rslora: false,
        });
        cfg.task_options
            .insert("disable_dropout".into(), Value::Bool(false));
    }
    if cfg.task == "sft" {
        cfg.task_options.remove("disable_dropout");
    }
    cfg.task_options
        .insert("gradient_checkpointing".into(), Value::Bool(on));
    cfg
}

/// Gradient checkpointing (on by default, as in TRL) takes the same steps as keeping every
/// activation — full fine-tuning, LoRA with dropout (the recomputation must draw the same
/// masks), a preference task with a reference pass, a padded batch — and it is in effect:
/// every decoder layer of every forward pass that trains is recomputed once per step.
/// Without it, each layer's graph is kept by an op of its own and freed by the backward pass:
/// the steps are bit for bit those of one graph for the whole model, and no layer's graph
/// outlives its step.
#[test]
fn gradient_checkpointing_takes_the_same_steps_as_keeping_every_activation() {
    use kiln_runtime::model::checkpoint::{GradSink, LayerBackward};
    use kiln_runtime::train::candle::{Candle, Setup, run as train_run};
    use kiln_runtime::train::task::build;
    use std::sync::Arc;
    let all = reference();
    for (name, dropout) in [
        ("sft-full", None),
        ("sft-lora", Some(0.3)),
        ("dpo-full", None),
        ("kto-lora", Some(0.2)),
    ] {
        let out = tempfile::tempdir().unwrap();
        let mut runs = Vec::new();
        // Checkpointing off with each layer's graph kept by its op, off with one graph for the
        // whole model, on.
        for (run, on) in [("kept", false), ("one-graph", false), ("recompute", true)] {
            let dir = out.path().join(run);
            let cfg = checkpointing_case(name, &all[name], &dir, dropout, on, "candle");
            let mut setup = Setup::load(&cfg).unwrap();
            // What the setup chose: recomputation when on; off, kept graphs under full
            // fine-tuning and one graph under LoRA.
            let chosen = setup.model.grad_sink().map(|s| s.mode());
            let want = match (on, setup.adapters.is_none()) {
                (true, _) => Some(LayerBackward::Recompute),
                (false, true) => Some(LayerBackward::Kept),
                (false, false) => None,
            };
            assert_eq!(chosen, want, "{name} {run}");
            // Each run as its name says, whatever the setup chose.
            let sink = match run {
                "kept" => {
                    let vars = setup.trainable.iter().map(|(_, v)| v);
                    Some(Arc::new(GradSink::with_mode(vars, LayerBackward::Kept)))
                }
                "one-graph" => None,
                _ => setup.model.grad_sink().cloned(),
            };
            setup.model = setup.model.with_gradient_checkpointing(sink.clone());
            let mut task = build::<Candle>(&cfg.task, &cfg, &setup).unwrap();
            let mut seen = Collect::default();
            train_run(&setup, &mut *task, &mut seen).unwrap();
            let layers = setup.model.config().layers;
            if let Some(sink) = &sink {
                if on {
                    assert!(
                        sink.recomputed() >= 3 * layers,
                        "{name}: {} layers recomputed in 3 steps of {layers} layers",
                        sink.recomputed()
                    );
                } else {
                    assert_eq!(sink.recomputed(), 0, "{name} {run}: nothing recomputed");
                }
                assert_eq!(
                    sink.held(),
                    0,
                    "{name} {run}: a layer's graph outlived its step"
                );
            }
            runs.push(seen.0);
        }
        for (a, b) in runs[0].iter().zip(&runs[1]) {
            assert_eq!(
                (a.loss.to_bits(), a.grad_norm.map(f64::to_bits)),
                (b.loss.to_bits(), b.grad_norm.map(f64::to_bits)),
                "{name} step {}: kept layer graphs vs one graph",
                a.step
            );
        }
        same_steps(name, &runs[1], &runs[2]);
    }
}

/// On MLX, gradient checkpointing (`kiln_kernels::mlx::checkpoint` around each decoder layer)
/// takes the same steps as keeping every activation — full fine-tuning, LoRA with dropout (the
/// masks drawn once, before the layer), a preference task with a reference pass — and it is in
/// effect: MLX runs every checkpointed layer again in the backward pass.
#[cfg(feature = "mlx")]
#[test]
fn mlx_gradient_checkpointing_takes_the_same_steps_as_keeping_every_activation() {
    let all = reference();
    for (name, dropout) in [
        ("sft-full", None),
        ("sft-lora", Some(0.3)),
        ("dpo-full", None),
        ("kto-lora", Some(0.2)),
    ] {
        let out = tempfile::tempdir().unwrap();
        let mut runs = Vec::new();
        for on in [false, true] {
            let dir = out.path().join(format!("run-{on}"));
            let cfg = checkpointing_case(name, &all[name], &dir, dropout, on, "mlx");
            let calls = kiln_kernels::mlx::checkpoint_calls();
            let mut trainer = kiln_runtime::resolve_trainer(&cfg)
                .unwrap()
                .construct(&cfg)
                .unwrap();
            let mut seen = Collect::default();
            trainer.train(&mut seen).unwrap();
            if on {
                // Each layer of each step's forward, and once more in its backward (other
                // tests running beside this one only add to the count).
                let json = std::fs::read_to_string(cfg.model.join("config.json")).unwrap();
                let json: Value = serde_json::from_str(&json).unwrap();
                let layers = json["num_hidden_layers"].as_u64().unwrap();
                let made = kiln_kernels::mlx::checkpoint_calls() - calls;
                assert!(
                    made >= 2 * 3 * layers,
                    "{name}: {made} checkpointed layer runs in 3 steps of {layers} layers"
                );
            }
            runs.push(seen.0);
        }
        same_steps(name, &runs[0], &runs[1]);
    }
}

/// kiln's figures for the reference run `name` (candle), step by step: loss and gradient norm.
fn kiln_losses(name: &str) -> Vec<(f64, f64)> {
    let all = reference();
    let run = &all[name];
    let out = tempfile::tempdir().unwrap();
    let cfg = config(name, run, &out.path().join("run"));
    let mut seen = Collect::default();
    let entry = kiln_runtime::resolve_trainer(&cfg).unwrap();
    entry.construct(&cfg).unwrap().train(&mut seen).unwrap();
    seen.0
        .iter()
        .map(|m| (m.loss, m.grad_norm.unwrap()))
        .collect()
}

fn trl_losses(name: &str) -> Vec<(f64, f64)> {
    reference()[name]["logs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["loss"].as_f64().unwrap(),
                l["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// TRL's `bf16=True` (torch's CPU autocast to bf16) against kiln's `bf16`: the two runs cannot
/// agree to f32's digits (oneDNN's sums and kiln's run in other orders, and autocast also runs
/// attention and the activations in bf16 where kiln keeps f32), so the test asks that kiln's
/// bf16 run be near TRL's (every loss within 5e-3 relative, every gradient norm within 2e-2)
/// and nearer to it than TRL's own f32 run is (the summed loss distance under 0.8 of it; kiln's
/// f32 run is TRL's f32 run to 1e-5, so kiln's f32 arithmetic would not pass). Measured: SFT
/// 0.0122 against 0.0235, DPO 0.0115 against 0.0166; the rest is autocast's bf16 RoPE,
/// attention and SiLU, which kiln runs in f32 between its bf16 Linears.
#[test]
fn bf16_mixed_precision_tracks_trl_autocast() {
    for (bf16, f32_run) in [("sft-bf16", "sft-full"), ("dpo-bf16", "dpo-full")] {
        let got = kiln_losses(bf16);
        let want = trl_losses(bf16);
        let f32_ref = trl_losses(f32_run);
        assert_eq!(got.len(), want.len(), "{bf16}: steps");
        for (s, ((gl, gn), (wl, wn))) in got.iter().zip(&want).enumerate() {
            assert!(
                close(*gl, *wl, 5e-3, 0.0),
                "{bf16} step {}: loss {gl} vs TRL {wl}",
                s + 1
            );
            assert!(
                close(*gn, *wn, 2e-2, 0.0),
                "{bf16} step {}: grad_norm {gn} vs TRL {wn}",
                s + 1
            );
        }
        let dist = |a: &[(f64, f64)]| -> f64 {
            a.iter()
                .zip(&want)
                .map(|((x, _), (y, _))| (x - y).abs())
                .sum()
        };
        let (kiln, f32_trl) = (dist(&got), dist(&f32_ref));
        eprintln!("{bf16}: Σ|loss − TRL bf16|: kiln bf16 {kiln:.6}, TRL f32 {f32_trl:.6}");
        assert!(
            kiln < 0.8 * f32_trl,
            "{bf16}: kiln's bf16 losses are {kiln:.6} from TRL's bf16 ones, TRL's f32 run {f32_trl:.6}"
        );
    }
}

/// What kiln's bf16 does not run is refused by name, not trained in f32: here LoRA (its
/// frozen base), before anything is written.
#[test]
fn bf16_mixed_precision_refuses_what_it_does_not_run() {
    let all = reference();
    let out = tempfile::tempdir().unwrap();
    let mut cfg = config("sft-lora", &all["sft-lora"], &out.path().join("run"));
    cfg.task_options.insert("bf16".into(), true.into());
    let entry = kiln_runtime::resolve_trainer(&cfg).unwrap();
    let e = match entry.construct(&cfg) {
        Ok(mut t) => t.train(&mut Collect::default()).unwrap_err().to_string(),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("bf16") && e.contains("LoRA adapters"), "{e}");
    assert!(
        !out.path().join("run").exists(),
        "a refused run wrote {:?}",
        out.path()
    );
}
