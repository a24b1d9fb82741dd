//! `kiln train` as a user runs it: every task on the tiny Llama with kiln's sample data, the
//! metrics file, the TOML config, and mistakes refused by name.

use std::path::{Path, PathBuf};
use std::process::Command;

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tiny() -> String {
    root().join("tests/train/tiny/model").display().to_string()
}

fn data(name: &str) -> String {
    root()
        .join("examples/data")
        .join(name)
        .display()
        .to_string()
}

fn metrics(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Trains `task` for three steps and returns the metrics lines and the output folder.
fn train(
    task: &str,
    file: &str,
    extra: &[&str],
) -> (Vec<serde_json::Value>, PathBuf, tempfile::TempDir) {
    train_model(&tiny(), task, file, extra)
}

/// Three steps of `task` with batches of 4: `--max-steps 3`, or PPO's `--total-episodes 12`
/// (TRL's PPO counts episodes and ignores max_steps).
fn three_steps(task: &str) -> [&'static str; 2] {
    if task == "ppo" {
        ["--total-episodes", "12"]
    } else {
        ["--max-steps", "3"]
    }
}

fn train_model(
    model: &str,
    task: &str,
    file: &str,
    extra: &[&str],
) -> (Vec<serde_json::Value>, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = dir.path().join("m.jsonl");
    let mut args = vec![
        "train",
        "--task",
        task,
        "--model",
        model,
        "--data",
        &*Box::leak(data(file).into_boxed_str()),
        "--out",
        out.to_str().unwrap(),
        "--metrics",
        m.to_str().unwrap(),
        three_steps(task)[0],
        three_steps(task)[1],
        "--per-device-train-batch-size",
        "4",
        "--learning-rate",
        "1e-3",
        "--quiet",
    ];
    args.extend_from_slice(extra);
    let o = kiln(&args);
    assert!(
        o.status.success(),
        "{task}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stdout = String::from_utf8(o.stdout).unwrap();
    assert!(
        stdout.starts_with(&format!("{task} on candle: 3 steps")),
        "{stdout}"
    );
    (metrics(&m), out, dir)
}

#[test]
fn every_task_trains_on_the_tiny_model_and_writes_its_figures() {
    let cases: &[(&str, &str, &[&str], &[&str])] = &[
        (
            "sft",
            "sft.jsonl",
            &[],
            &["mean_token_accuracy", "entropy", "num_tokens"],
        ),
        (
            "dpo",
            "dpo.jsonl",
            &[],
            &[
                "rewards/chosen",
                "rewards/rejected",
                "rewards/accuracies",
                "rewards/margins",
            ],
        ),
        (
            "orpo",
            "dpo.jsonl",
            &[],
            &["log_odds_ratio", "nll_loss", "rewards/margins"],
        ),
        (
            "simpo",
            "dpo.jsonl",
            &[],
            &["nll_loss", "rewards/accuracies"],
        ),
        (
            "kto",
            "kto.jsonl",
            &[],
            &["kl", "rewards/chosen", "rewards/rejected"],
        ),
        (
            "grpo",
            "grpo.jsonl",
            &["--num-generations", "4", "--max-completion-length", "6"],
            &[
                "reward",
                "reward_std",
                "completions/mean_length",
                "clip_ratio/region_mean",
            ],
        ),
    ];
    for (task, file, extra, keys) in cases {
        let (m, out, _dir) = train(task, file, extra);
        assert_eq!(m.len(), 3, "{task}: one line per step");
        for (i, line) in m.iter().enumerate() {
            assert_eq!(line["step"], i as u64 + 1);
            for k in ["loss", "learning_rate", "grad_norm", "epoch"] {
                assert!(line[k].is_number(), "{task}: {k} in {line}");
            }
            for k in *keys {
                assert!(line[*k].is_number(), "{task}: {k} in {line}");
            }
        }
        // LoRA by default: a PEFT adapter.
        assert!(out.join("adapter_model.safetensors").is_file(), "{task}");
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            (cfg["r"].as_u64(), cfg["lora_alpha"].as_f64()),
            (Some(16), Some(32.0))
        );
    }
}

#[test]
fn full_fine_tuning_and_merge_write_checkpoints_kiln_reads_back() {
    let (_, out, _d) = train("sft", "sft.jsonl", &["--lora-r", "0"]);
    assert!(out.join("model.safetensors").is_file());
    assert!(out.join("tokenizer.json").is_file());
    let (_, out, _d) = train("sft", "sft.jsonl", &["--merge"]);
    let merged = out.join("merged");
    assert!(merged.join("model.safetensors").is_file());
    // The merged checkpoint trains again (it is a plain model folder).
    let (m, _, _d) = train_model(
        merged.to_str().unwrap(),
        "sft",
        "sft.jsonl",
        &["--lora-r", "0"],
    );
    assert_eq!(m.len(), 3);
}

#[test]
fn toml_settings_apply_and_flags_override_them() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("run.toml");
    std::fs::write(
        &cfg,
        "learning_rate = 0.5\nlr_scheduler_type = \"constant\"\nbeta = 0.2\n",
    )
    .unwrap();
    let (m, _, _d) = train("dpo", "dpo.jsonl", &["--config", cfg.to_str().unwrap()]);
    // --learning-rate 1e-3 (given by `train`) overrides the file; the schedule comes from it.
    for line in &m {
        assert_eq!(line["learning_rate"].as_f64(), Some(1e-3));
    }
    std::fs::write(&cfg, "learnig_rate = 1e-4\n").unwrap();
    let o = kiln(&[
        "train",
        "--task",
        "sft",
        "--model",
        &tiny(),
        "--data",
        &data("sft.jsonl"),
        "--config",
        cfg.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8(o.stderr).unwrap();
    assert!(
        err.contains("config field `learnig_rate`: unknown setting; did you mean `learning_rate`?"),
        "{err}"
    );
}

#[test]
fn mistakes_are_refused_by_name() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["--task", "sft", "--beta", "0.1"],
            "task `sft` does not take it (it is for dpo, orpo, simpo, kto, grpo, rloo, distill, bco, online_dpo)",
        ),
        (
            &["--task", "prm"],
            "backend 'candle' does not support task 'prm'. Supported: bco, distill, dpo, grpo, kto, online_dpo, orpo, ppo, pretrain, reward, rloo, sft, simpo.",
        ),
        (&["--task", "sft", "--backend", "mlx"], "mlx"),
        (
            &["--task", "dpo", "--data", "SFT"],
            "this task takes prompt+chosen+rejected data, not prompt+completion",
        ),
        (
            &["--task", "sft", "--lr-scheduler-type", "wavy"],
            "`wavy` is not one of linear, cosine, constant, constant_with_warmup",
        ),
        (
            &["--task", "grpo", "--reward-funcs", "psychic"],
            "no reward function `psychic`",
        ),
        (
            &["--task", "kto", "--per-device-train-batch-size", "1"],
            "KTO needs at least 2 examples per micro-batch",
        ),
        (
            &["--task", "ppo", "--reward-funcs", "exact_match"],
            "TRL's PPO runs total_episodes episodes (steps × batch) and ignores max_steps",
        ),
    ];
    // PPO's own mistakes (its runs are sized by total_episodes, not max_steps).
    let ppo: &[(&[&str], &str)] = &[
        (
            &[],
            "PPO scores each response: name reward functions or reward models (reward_funcs, reward_model_path)",
        ),
        (
            &["--reward-funcs", "exact_match", "--stop-token", "bos"],
            "`bos`: the only stop token by name is `eos`",
        ),
        (
            &["--reward-funcs", "exact_match", "--num-mini-batches", "3"],
            "must be a multiple of it",
        ),
        (
            &["--reward-funcs", "exact_match", "--kl-estimator", "k2"],
            "`k2` is not one of k1, k3",
        ),
    ];
    for (args, want) in ppo {
        let mut all = vec!["train", "--model", &*Box::leak(tiny().into_boxed_str())];
        all.extend(["--quiet", "--task", "ppo", "--total-episodes", "8"]);
        all.extend_from_slice(args);
        let o = kiln(&all);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        assert!(err.contains(want), "{args:?}: {err}");
    }
    for (args, want) in cases {
        let mut all = vec![
            "train",
            "--model",
            &*Box::leak(tiny().into_boxed_str()),
            "--quiet",
            "--max-steps",
            "1",
        ];
        for a in *args {
            all.push(if *a == "SFT" {
                Box::leak(data("sft.jsonl").into_boxed_str())
            } else {
                a
            });
        }
        let o = kiln(&all);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        let err = String::from_utf8(o.stderr).unwrap();
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn generate_samples_from_a_model_and_an_adapter_repeatably() {
    let args = |extra: &[&str]| {
        let mut a = vec![
            "generate".to_string(),
            "--model".into(),
            tiny(),
            "--prompt".into(),
            "3+4=".into(),
            "--max-new-tokens".into(),
            "4".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |a: Vec<String>| {
        let refs: Vec<&str> = a.iter().map(String::as_str).collect();
        kiln(&refs)
    };
    let adapter = root()
        .join("tests/train/peft/adapter")
        .display()
        .to_string();
    let one = run(args(&[
        "--adapter",
        &adapter,
        "--seed",
        "7",
        "--num-return-sequences",
        "3",
    ]));
    assert!(
        one.status.success(),
        "{}",
        String::from_utf8_lossy(&one.stderr)
    );
    let text = String::from_utf8_lossy(&one.stdout).to_string();
    assert_eq!(text.matches("--- ").count(), 3, "{text}");
    assert!(
        text.lines().filter(|l| l.starts_with("3+4=")).count() == 3,
        "{text}"
    );
    let again = run(args(&[
        "--adapter",
        &adapter,
        "--seed",
        "7",
        "--num-return-sequences",
        "3",
    ]));
    assert_eq!(one.stdout, again.stdout, "same seed, same completions");
    let greedy = run(args(&["--temperature", "0"]));
    let with = run(args(&["--temperature", "0", "--adapter", &adapter]));
    assert!(greedy.status.success() && with.status.success());
    let bad = run(args(&["--adapter", "/nonexistent"]));
    assert_eq!(bad.status.code(), Some(1));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("/nonexistent/adapter_config.json"), "{err}");
}

#[test]
fn ctrl_c_saves_the_result_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = dir.path().join("m.jsonl");
    let child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--task",
            "sft",
            "--model",
            &tiny(),
            "--data",
            &data("sft.jsonl"),
            "--out",
            out.to_str().unwrap(),
            "--metrics",
            m.to_str().unwrap(),
            "--max-steps",
            "1000000",
            "--quiet",
        ])
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until it is training (a metrics line), then interrupt it.
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&m).map_or(true, |t| t.is_empty()) {
        assert!(start.elapsed().as_secs() < 60, "no step logged");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("interrupted: stopped after step"), "{err}");
    assert!(err.contains("continue with --resume"), "{err}");
    assert!(out.join("adapter_model.safetensors").is_file());
    let resumable = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("checkpoint-"));
    assert!(resumable, "a resumable checkpoint in {}", out.display());
}

/// A run stopped at a checkpoint and resumed logs exactly what the uninterrupted run logs:
/// weights, AdamW's moments, the data order (shuffled), LoRA dropout and the schedule all
/// continue where they were.
#[test]
fn a_resumed_run_continues_exactly() {
    for (task, file, extra) in [
        ("sft", "sft.jsonl", &["--lora-dropout", "0.1"][..]),
        ("dpo", "dpo.jsonl", &["--lora-r", "0"][..]),
        (
            "grpo",
            "grpo.jsonl",
            &["--num-generations", "4", "--max-completion-length", "5"][..],
        ),
        // Saved mid-way through a generation batch (three steps on each): the resumed step
        // reuses the saved completions and their sampling log-probs.
        (
            "grpo",
            "grpo.jsonl",
            &[
                "--num-generations",
                "4",
                "--max-completion-length",
                "5",
                "--num-iterations",
                "3",
            ][..],
        ),
        // PPO: the value model and its AdamW moments, the sampler's and the permutations'
        // streams, two minibatches a pass.
        (
            "ppo",
            "grpo.jsonl",
            &[
                "--reward-funcs",
                "exact_match",
                "--response-length",
                "5",
                "--num-mini-batches",
                "2",
            ][..],
        ),
    ] {
        let mut base: Vec<&str> = vec!["--warmup-steps", "1"];
        base.extend_from_slice(extra);
        let (straight, _, _d1) = train(task, file, &base);
        let mut first = base.clone();
        first.extend_from_slice(&["--save-steps", "2"]);
        let (_, out, _d2) = train(task, file, &first);
        let ck = out.join("checkpoint-2");
        assert!(ck.join("trainer_state.json").is_file(), "{task}");
        assert!(ck.join("optimizer.safetensors").is_file(), "{task}");
        let mut again = base.clone();
        let ck_s = ck.display().to_string();
        again.extend_from_slice(&["--resume", &ck_s]);
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("m.jsonl");
        let mut args: Vec<String> = [
            "train",
            "--task",
            task,
            "--model",
            &tiny(),
            "--data",
            &data(file),
            "--out",
            dir.path().join("out").to_str().unwrap(),
            "--metrics",
            m.to_str().unwrap(),
            "--per-device-train-batch-size",
            "4",
            "--learning-rate",
            "1e-3",
            "--quiet",
            three_steps(task)[0],
            three_steps(task)[1],
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(again.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = kiln(&refs);
        assert!(
            o.status.success(),
            "{task}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let resumed = metrics(&m);
        assert_eq!(resumed.len(), 1, "{task}: only step 3 is left");
        assert_eq!(
            resumed[0], straight[2],
            "{task}: step 3 resumed = step 3 straight"
        );
    }
}

#[test]
fn generate_chats_with_the_models_template() {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "generate",
            "--model",
            &tiny(),
            "--chat",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"1+2=\n\n3+4=\n")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // One answer per non-empty turn.
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 2);
}

#[test]
fn eval_data_writes_eval_lines_and_needs_eval_steps() {
    let eval = data("dpo.jsonl");
    let (m, _, _d) = train(
        "dpo",
        "dpo.jsonl",
        &["--eval-data", &eval, "--eval-steps", "2"],
    );
    let evals: Vec<_> = m.iter().filter(|l| l.get("eval_loss").is_some()).collect();
    assert_eq!(evals.len(), 1, "step 2 of 3");
    assert_eq!(evals[0]["step"], 2);
    assert!(
        evals[0]["eval_rewards/accuracies"].is_number(),
        "{}",
        evals[0]
    );
    // GRPO evaluates by generating for every evaluation prompt.
    let prompts = data("grpo.jsonl");
    let (m, _, _d) = train(
        "grpo",
        "grpo.jsonl",
        &[
            "--eval-data",
            &prompts,
            "--eval-steps",
            "3",
            "--num-generations",
            "4",
            "--max-completion-length",
            "4",
            "--per-device-eval-batch-size",
            "8",
        ],
    );
    let evals: Vec<_> = m.iter().filter(|l| l.get("eval_loss").is_some()).collect();
    assert_eq!(evals.len(), 1);
    for k in [
        "eval_reward",
        "eval_completions/mean_length",
        "eval_entropy",
    ] {
        assert!(evals[0][k].is_number(), "{k}: {}", evals[0]);
    }
    let (code, err) = {
        let dir = tempfile::tempdir().unwrap();
        let o = kiln(&[
            "train",
            "--task",
            "grpo",
            "--model",
            &tiny(),
            "--data",
            &prompts,
            "--out",
            dir.path().join("o").to_str().unwrap(),
            "--eval-data",
            &prompts,
            "--eval-steps",
            "1",
            "--num-generations",
            "4",
            "--per-device-train-batch-size",
            "4",
            "--per-device-eval-batch-size",
            "6",
            "--quiet",
        ]);
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("per_device_eval_batch_size") && err.contains("6 is not a multiple"),
        "{err}"
    );
    let o = kiln(&[
        "train",
        "--task",
        "sft",
        "--model",
        &tiny(),
        "--eval-data",
        &data("sft.jsonl"),
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--eval-data and --eval-steps go together")
    );
}

/// `--save-total-limit N` keeps the newest N checkpoints, as transformers rotates them.
#[test]
fn save_total_limit_keeps_the_newest_checkpoints() {
    let checkpoints = |extra: &[&str]| {
        let mut args = vec!["--save-steps", "1"];
        args.extend_from_slice(extra);
        let (_, out, dir) = train("sft", "sft.jsonl", &args);
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("checkpoint-"))
            .collect();
        names.sort();
        drop(dir);
        names
    };
    // Three steps: checkpoints after steps 1 and 2 (the last step is the output itself).
    assert_eq!(checkpoints(&[]), ["checkpoint-1", "checkpoint-2"]);
    assert_eq!(checkpoints(&["--save-total-limit", "1"]), ["checkpoint-2"]);
}

/// `--adapter-format mlx-lm` writes mlx-lm's layout, and `--init-adapter` continues from it.
#[test]
fn adapters_in_mlx_lms_layout_are_written_and_read() {
    let (_, out, _d) = train("sft", "sft.jsonl", &["--adapter-format", "mlx-lm"]);
    assert!(out.join("adapters.safetensors").is_file());
    assert!(!out.join("adapter_model.safetensors").exists());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["fine_tune_type"], "lora");
    assert_eq!(cfg["lora_parameters"]["scale"], 2.0);
    let dir = out.display().to_string();
    let (m, again, _d2) = train("sft", "sft.jsonl", &["--init-adapter", &dir]);
    assert_eq!(m.len(), 3);
    assert!(again.join("adapter_model.safetensors").is_file());
    let o = kiln(&[
        "train",
        "--task",
        "sft",
        "--model",
        &tiny(),
        "--lora-r",
        "0",
        "--adapter-format",
        "mlx-lm",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--adapter-format mlx-lm needs LoRA"));
}

#[test]
fn a_seeded_run_reproduces_its_figures_exactly_whatever_the_thread_count() {
    // The metrics file (every logged figure at full precision) of a seeded run is the same
    // bytes on one thread and on three; another seed changes it (the seed reaches the LoRA
    // initialisation, the data order and GRPO's sampling).
    let run = |task: &str, file: &str, seed: &str, threads: &str| {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("m.jsonl");
        let mut args = vec!["train", "--task", task, "--model"];
        let (model, data) = (tiny(), data(file));
        args.extend([model.as_str(), "--data", data.as_str(), "--seed", seed]);
        args.extend(["--max-steps", "3", "--per-device-train-batch-size", "4"]);
        args.extend(["--learning-rate", "1e-3", "--quiet", "--metrics"]);
        args.push(m.to_str().unwrap());
        let out = dir.path().join("out");
        args.extend(["--out", out.to_str().unwrap()]);
        if task == "grpo" {
            args.extend(["--max-completion-length", "8", "--num-generations", "4"]);
        }
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .env("RAYON_NUM_THREADS", threads)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{task}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        std::fs::read(&m).unwrap()
    };
    for (task, file) in [
        ("sft", "sft.jsonl"),
        ("dpo", "dpo.jsonl"),
        ("kto", "kto.jsonl"),
        ("grpo", "grpo.jsonl"),
    ] {
        let one = run(task, file, "7", "1");
        assert!(!one.is_empty(), "{task}");
        assert!(run(task, file, "7", "3") == one, "{task}: 3 threads differ");
        assert!(
            run(task, file, "8", "1") != one,
            "{task}: the seed changes nothing"
        );
    }
}

/// A TRL user's config: every field TRL's own config class declares, at the value
/// `Config().to_dict()` gives (dumped from TRL into runtime/src/train/trl_fields.json), as a
/// `--config` file, trains — but `bf16 = true` (TRL's resolved default on a CPU with bf16),
/// which kiln refuses by name since it trains in f32.
#[test]
fn a_config_dumped_from_trl_trains() {
    let fields: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("runtime/src/train/trl_fields.json")).unwrap(),
    )
    .unwrap();
    for (task, file) in [
        ("sft", "sft.jsonl"),
        ("dpo", "dpo.jsonl"),
        ("simpo", "dpo.jsonl"),
        ("orpo", "dpo.jsonl"),
        ("kto", "kto.jsonl"),
    ] {
        let mut table = toml::Table::new();
        for (name, record) in fields[task]["fields"].as_object().unwrap() {
            let v = &record["to_dict"];
            if record["trl"] != true || v.is_null() || name == "bf16" {
                continue;
            }
            table.insert(name.clone(), toml::Value::try_from(v).unwrap());
        }
        assert!(table.len() > 8, "{task}: {} fields", table.len());
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("trl.toml");
        std::fs::write(&cfg, toml::to_string(&table).unwrap()).unwrap();
        // TRL logs every 10 steps; the flag overrides the file for the three steps here.
        let args = ["--config", cfg.to_str().unwrap(), "--logging-steps", "1"];
        let (m, _, _d) = train(task, file, &args);
        assert_eq!(m.len(), 3, "{task}: {m:?}");
        // With TRL's resolved bf16 = true: mixed precision, which kiln builds for full
        // fine-tuning; under the default LoRA it is refused by name.
        table.insert("bf16".into(), toml::Value::Boolean(true));
        std::fs::write(&cfg, toml::to_string(&table).unwrap()).unwrap();
        let o = kiln(&[
            "train",
            "--task",
            task,
            "--model",
            &tiny(),
            "--data",
            &data(file),
            "--config",
            cfg.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(o.status.code(), Some(1), "{task}");
        let err = String::from_utf8(o.stderr).unwrap();
        assert!(
            err.contains("`bf16`") && err.contains("LoRA adapters"),
            "{task}: {err}"
        );
        let args = [
            "--config",
            cfg.to_str().unwrap(),
            "--logging-steps",
            "1",
            "--lora-r",
            "0",
        ];
        let (m, _, _d) = train(task, file, &args);
        assert_eq!(m.len(), 3, "{task} in bf16: {m:?}");
    }
}
