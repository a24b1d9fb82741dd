//! QLoRA: LoRA adapters trained over a quantized base whose Linear weights stay packed
//! (`kiln train --model <quantized export>`). Every task on the candle backend, on the tiny
//! training model exported as MLX q4 (groups of 32; and GGUF and compressed-tensors bases for
//! some tasks): each step's loss equals, to float
//! rounding, the loss of the same run on the *decoded* twin — a plain f32 checkpoint of the
//! very values the packed base decodes to — so the packed forward and its input gradient are
//! the dense ones; and a longer SFT run's loss falls. What QLoRA refuses is refused by name.

use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::export::recipe::{Format, Recipe};
use kiln_runtime::export::run::{ExportOptions, OutputFormat, run};
use kiln_runtime::model::candle::{DType, Device};
use kiln_runtime::train::{LoraConfig, StepMetrics, TrainConfig, TrainObserver};
use std::path::{Path, PathBuf};

fn here() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/train")
}

/// The tiny training model exported as MLX `format` with groups of `group`.
fn quantized(dir: &Path, format: &str, group: usize) -> PathBuf {
    let out = dir.join(format!("mlx-{format}-g{group}"));
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "mlx".into(),
            format: format.into(),
        }),
        force: true,
        ..ExportOptions::new(
            here().join("tiny/model"),
            &out,
            Recipe {
                group_size: Some(group),
                ..Recipe::new(Format::Fp8)
            },
        )
    };
    run(&options).unwrap_or_else(|e| panic!("{e}"));
    out
}

/// The tiny training model exported as GGUF `format` (its tokenizer beside the file, where
/// training reads it).
fn gguf(dir: &Path, format: &str) -> PathBuf {
    let out = dir.join(format!("gguf-{format}"));
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "gguf".into(),
            format: format.into(),
        }),
        force: true,
        ..ExportOptions::new(here().join("tiny/model"), &out, Recipe::new(Format::Fp8))
    };
    run(&options).unwrap_or_else(|e| panic!("{e}"));
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(here().join("tiny/model").join(f), out.join(f)).unwrap();
    }
    out
}

/// A plain f32 checkpoint of the values the export at `q` decodes to, with the original
/// config and tokenizer: what the packed base computes, held dense.
fn decoded_twin(q: &Path, dir: &Path) -> PathBuf {
    let out = dir.join(format!(
        "decoded-{}",
        q.file_name().unwrap().to_string_lossy()
    ));
    std::fs::create_dir_all(&out).unwrap();
    let w = kiln_runtime::formats::load_weights(q, DType::F32, &Device::Cpu).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = w
        .vars()
        .iter()
        .map(|(n, v)| {
            let t = v.as_tensor();
            let data: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            (
                n.clone(),
                t.dims().to_vec(),
                data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d);
            (n.clone(), v.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(here().join("tiny/model").join(f), out.join(f)).unwrap();
    }
    out
}

#[derive(Default)]
struct Collect(Vec<StepMetrics>);
impl TrainObserver for Collect {
    fn on_step(&mut self, m: &StepMetrics) {
        self.0.push(m.clone());
    }
}

fn train(config: &TrainConfig) -> Result<Vec<StepMetrics>, String> {
    let entry = kiln_runtime::resolve_trainer(config).map_err(|e| e.to_string())?;
    let mut seen = Collect::default();
    entry
        .construct(config)
        .map_err(|e| e.to_string())?
        .train(&mut seen)
        .map_err(|e| e.to_string())?;
    Ok(seen.0)
}

/// A LoRA run of `task` on `model` (every Linear, rank 8).
fn config(task: &str, model: &Path, out: &Path) -> TrainConfig {
    config_on(task, "candle", model, out)
}

/// [`config`] on `backend`.
fn config_on(task: &str, backend: &str, model: &Path, out: &Path) -> TrainConfig {
    let mut c = TrainConfig::new(task, backend, model, out);
    let data = match task {
        "sft" => "sft.jsonl",
        "kto" => "kto.jsonl",
        "grpo" => "grpo.jsonl",
        _ => "dpo.jsonl",
    };
    c.train_data = Some(here().join("data").join(data));
    c.hyper.max_steps = Some(4);
    c.hyper.logging_steps = 1;
    c.hyper.per_device_train_batch_size = 2;
    c.hyper.learning_rate = 1e-2;
    c.hyper.train_sampling_strategy = "sequential".into();
    c.lora = Some(LoraConfig {
        r: 8,
        lora_alpha: 16.0,
        lora_dropout: 0.0,
        target_modules: vec!["all-linear".into()],
        use_rslora: false,
    });
    if task == "grpo" {
        c.hyper.per_device_train_batch_size = 4;
        for (k, v) in [
            ("num_generations", serde_json::json!(4)),
            ("max_completion_length", serde_json::json!(6)),
            ("reward_funcs", serde_json::json!(["count_digits"])),
        ] {
            c.task_options.insert(k.into(), v);
        }
    }
    c
}

/// Each task's QLoRA run on the quantized base `q` against LoRA on its decoded twin.
fn parity(q: &Path, dir: &Path, tasks: &[&str]) {
    let twin = decoded_twin(q, dir);
    let tag = q.file_name().unwrap().to_string_lossy().to_string();
    for task in tasks {
        let a = train(&config(task, q, &dir.join(format!("q-{tag}-{task}")))).unwrap();
        let b = train(&config(task, &twin, &dir.join(format!("d-{tag}-{task}")))).unwrap();
        assert_eq!(a.len(), b.len(), "{tag} {task}");
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x.loss.is_finite(),
                "{tag} {task} step {}: {}",
                x.step,
                x.loss
            );
            assert!(
                (x.loss - y.loss).abs() <= 1e-4 * y.loss.abs() + 1e-6,
                "{tag} {task} step {}: QLoRA loss {} vs {} on the decoded base",
                x.step,
                x.loss,
                y.loss
            );
        }
        eprintln!(
            "{tag} {task}: QLoRA losses {:?}",
            a.iter().map(|m| m.loss).collect::<Vec<_>>()
        );
        // The adapter is saved as PEFT's files.
        assert!(
            dir.join(format!("q-{tag}-{task}"))
                .join("adapter_model.safetensors")
                .is_file(),
            "{tag} {task}"
        );
    }
}

#[test]
fn qlora_on_a_packed_base_equals_lora_on_its_decoded_values_for_every_task() {
    let dir = tempfile::tempdir().unwrap();
    let q = quantized(dir.path(), "q4", 32);
    // The base is packed, not decoded: its Linears are kept as MLX words.
    let loaded = kiln_runtime::formats::load_packed(&q, &Device::Cpu).unwrap();
    assert_eq!(
        loaded.weights.packed().len(),
        2 * 7 + 1,
        "every Linear and lm_head"
    );
    parity(
        &q,
        dir.path(),
        &["sft", "dpo", "orpo", "simpo", "kto", "grpo"],
    );
}

#[test]
fn qlora_on_gguf_bases_equals_lora_on_their_decoded_values() {
    let dir = tempfile::tempdir().unwrap();
    // q8-0, and q4-k-m (on 32-wide rows llama.cpp's mix falls back to legacy blocks); the
    // llama architecture's Q/K rows are stored in llama.cpp's order.
    for format in ["q8-0", "q4-k-m"] {
        let q = gguf(dir.path(), format);
        let loaded = kiln_runtime::formats::load_packed(&q, &Device::Cpu).unwrap();
        assert_eq!(loaded.weights.packed().len(), 2 * 7 + 1, "{format}");
        parity(&q, dir.path(), &["sft", "dpo"]);
    }
}

/// The tiny training model exported as compressed-tensors `format` (groups of `group`).
fn compressed_tensors(dir: &Path, format: &str, group: Option<usize>) -> PathBuf {
    let out = dir.join(format!("ct-{format}"));
    let options = ExportOptions {
        output: Some(OutputFormat {
            writer: "compressed-tensors".into(),
            format: format.into(),
        }),
        force: true,
        ..ExportOptions::new(
            here().join("tiny/model"),
            &out,
            Recipe {
                group_size: group,
                ..Recipe::new(Format::Fp8)
            },
        )
    };
    run(&options).unwrap_or_else(|e| panic!("{e}"));
    out
}

#[test]
fn qlora_on_compressed_tensors_bases_equals_lora_on_their_decoded_values() {
    let dir = tempfile::tempdir().unwrap();
    // INT4 in int32 words (symmetric, and with packed zero points), NVFP4, FP8 per channel.
    for (format, group) in [
        ("w4a16", Some(32)),
        ("w4a16-asym", Some(32)),
        ("nvfp4a16", None),
        ("fp8-dynamic", None),
    ] {
        let q = compressed_tensors(dir.path(), format, group);
        let loaded = kiln_runtime::formats::load_packed(&q, &Device::Cpu).unwrap();
        // lm_head stays unquantized in llm-compressor's schemes.
        assert_eq!(loaded.weights.packed().len(), 2 * 7, "{format}");
        parity(&q, dir.path(), &["sft", "kto"]);
    }
}

#[test]
fn qlora_on_modelopt_bases_equals_lora_on_their_decoded_values() {
    let dir = tempfile::tempdir().unwrap();
    // Weight-only formats from the library; int4-awq (nibble pairs along the rows, AWQ's
    // pre_quant_scale folded into the columns) calibrated by the CLI.
    for format in [Format::Int8Wo, Format::W4a16Nvfp4] {
        let q = dir.path().join(format!("modelopt-{format}"));
        run(&ExportOptions::new(
            here().join("tiny/model"),
            &q,
            Recipe::new(format),
        ))
        .unwrap();
        let loaded = kiln_runtime::formats::load_packed(&q, &Device::Cpu).unwrap();
        assert_eq!(loaded.weights.packed().len(), 2 * 7, "{format}");
        parity(&q, dir.path(), &["sft", "dpo"]);
    }
    let q = dir.path().join("modelopt-int4-awq");
    let calib = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/compat/llama-tiny/calib.jsonl");
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["export", "--model"])
        .arg(here().join("tiny/model"))
        .args(["--format", "int4-awq", "--group-size", "32", "--calib"])
        .arg(&calib)
        .arg("--out")
        .arg(&q)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    parity(&q, dir.path(), &["sft", "dpo"]);
}

#[test]
fn qlora_on_bitsandbytes_bases_equals_lora_on_their_decoded_values() {
    // PEFT's QLoRA base: bitsandbytes NF4 with double quantization (kiln's writer, which
    // writes what transformers saves), blocks of 64 that span rows of 32.
    let dir = tempfile::tempdir().unwrap();
    let q = dir.path().join("bnb-nf4");
    run(&ExportOptions {
        output: Some(OutputFormat {
            writer: "bnb".into(),
            format: "nf4".into(),
        }),
        ..ExportOptions::new(here().join("tiny/model"), &q, Recipe::new(Format::Fp8))
    })
    .unwrap();
    let loaded = kiln_runtime::formats::load_packed(&q, &Device::Cpu).unwrap();
    assert_eq!(
        loaded.weights.packed().len(),
        2 * 7,
        "every Linear but lm_head"
    );
    parity(&q, dir.path(), &["sft", "dpo", "kto"]);
}

#[test]
fn qlora_sft_learns() {
    let dir = tempfile::tempdir().unwrap();
    let q = quantized(dir.path(), "q4", 32);
    let mut c = config("sft", &q, &dir.path().join("out"));
    c.hyper.max_steps = Some(30);
    let m = train(&c).unwrap();
    let first: f64 = m[..3].iter().map(|s| s.loss).sum::<f64>() / 3.0;
    let last: f64 = m[m.len() - 3..].iter().map(|s| s.loss).sum::<f64>() / 3.0;
    eprintln!("QLoRA sft: loss {first:.3} → {last:.3}");
    assert!(last < 0.7 * first, "loss {first} → {last}");
}

#[test]
fn qlora_refuses_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let q = quantized(dir.path(), "q4", 32);
    // Full fine-tuning of packed weights.
    let mut c = config("sft", &q, &dir.path().join("full"));
    c.lora = None;
    let e = train(&c).unwrap_err();
    assert!(
        e.contains("its weights cannot be trained themselves"),
        "{e}"
    );
    // Merging into packed weights.
    let mut c = config("sft", &q, &dir.path().join("merge"));
    c.merge = true;
    let e = train(&c).unwrap_err();
    assert!(
        e.contains("merging an adapter into its packed weights"),
        "{e}"
    );
    // A plain checkpoint is not a quantized base.
    let e = kiln_runtime::formats::load_packed(&here().join("tiny/model"), &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("is not a quantized export"), "{e}");
    assert!(Checkpoint::open(&q).is_ok());
}

/// The MLX backend trains over mlx-lm's layout with MLX's `quantized_matmul` (the candle
/// backend decodes the same words with kiln's kernels): every task's QLoRA losses on MLX
/// equal candle's on the same q4 base to 1e-4 relative, and the adapter is saved.
#[cfg(feature = "mlx")]
#[test]
fn mlx_qlora_matches_candle_qlora_for_every_task() {
    let dir = tempfile::tempdir().unwrap();
    let q = quantized(dir.path(), "q4", 32);
    for task in ["sft", "dpo", "orpo", "simpo", "kto", "grpo"] {
        let out = dir.path().join(format!("mlx-{task}"));
        let a = train(&config_on(task, "mlx", &q, &out)).unwrap();
        let b = train(&config(
            task,
            &q,
            &dir.path().join(format!("candle-{task}")),
        ))
        .unwrap();
        assert_eq!(a.len(), b.len(), "{task}");
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x.loss.is_finite() && (x.loss - y.loss).abs() <= 1e-4 * y.loss.abs() + 1e-6,
                "{task} step {}: MLX QLoRA loss {} vs candle's {}",
                x.step,
                x.loss,
                y.loss
            );
        }
        eprintln!(
            "mlx {task}: QLoRA losses {:?}",
            a.iter().map(|m| m.loss).collect::<Vec<_>>()
        );
        assert!(out.join("adapter_model.safetensors").is_file(), "{task}");
    }
}

/// What QLoRA on MLX refuses, by name: full fine-tuning and merging (as on candle), and the
/// quantized layouts other than mlx-lm's (they train on candle).
#[cfg(feature = "mlx")]
#[test]
fn mlx_qlora_refuses_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let q = quantized(dir.path(), "q4", 32);
    let mut c = config_on("sft", "mlx", &q, &dir.path().join("full"));
    c.lora = None;
    let e = train(&c).unwrap_err();
    assert!(
        e.contains("its weights cannot be trained themselves"),
        "{e}"
    );
    let mut c = config_on("sft", "mlx", &q, &dir.path().join("merge"));
    c.merge = true;
    let e = train(&c).unwrap_err();
    assert!(
        e.contains("merging an adapter into its packed weights"),
        "{e}"
    );
    let g = gguf(dir.path(), "q8-0");
    let e = train(&config_on("sft", "mlx", &g, &dir.path().join("gguf"))).unwrap_err();
    assert!(
        e.contains("is a `gguf` export") && e.contains("--backend candle"),
        "{e}"
    );
}

/// Against mlx-lm's own QLoRA (`tests/train/mlx_qlora_reference.json`, made by
/// `tests/train/mlx_qlora_ref.py`): from mlx-lm's 4-bit quantization of the 64-wide tiny
/// model (`tests/train/qtiny/mlx-q4`, f32) and mlx-lm's initial adapter (read in mlx-lm's
/// layout), six SFT steps on one batch of six texts with AdamW (bias-corrected, as TRL's),
/// no clipping, a constant rate. kiln's MLX backend (MLX's `quantized_matmul`, as mlx-lm)
/// within 1e-4 relative; candle (kiln's exact decode) within 1e-3.
#[test]
fn qlora_matches_mlx_lm() {
    let text = std::fs::read_to_string(here().join("mlx_qlora_reference.json")).unwrap();
    let refs: serde_json::Value = serde_json::from_str(&text).unwrap();
    let want: Vec<f64> = refs["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut backends = vec![("candle", 1e-3)];
    if cfg!(feature = "mlx") {
        backends.push(("mlx", 1e-4));
    } else {
        eprintln!("mlx-lm parity on the MLX backend skipped: built without feature `mlx`");
    }
    let mut bad = Vec::new();
    for (backend, tol) in backends {
        let mut c = TrainConfig::new(
            "sft",
            backend,
            here().join("qtiny/mlx-q4"),
            dir.path().join(backend),
        );
        c.train_data = Some(here().join("data/sft-text.jsonl"));
        c.init_adapter = Some(here().join("qtiny/mlx-init-adapter"));
        c.hyper.max_steps = Some(want.len() as u64);
        c.hyper.logging_steps = 1;
        c.hyper.per_device_train_batch_size = 6;
        c.hyper.learning_rate = refs["settings"]["learning_rate"].as_f64().unwrap();
        c.hyper.lr_scheduler_type = "constant".into();
        c.hyper.weight_decay = 0.0;
        c.hyper.max_grad_norm = None;
        let got = train(&c).unwrap();
        assert_eq!(got.len(), want.len(), "{backend}");
        for (g, w) in got.iter().zip(&want) {
            let line = format!(
                "{backend} step {}: loss {:.6} vs mlx-lm {w:.6}",
                g.step, g.loss
            );
            eprintln!("{line}");
            if (g.loss - w).abs() > tol * w.abs() {
                bad.push(line);
            }
        }
    }
    assert!(bad.is_empty(), "against mlx-lm:\n{}", bad.join("\n"));
}

fn kiln(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln")
}

/// The CLI end to end: export a quantized base, train QLoRA on it, then evaluate and generate
/// with the quantized base and the adapter.
#[test]
fn qlora_from_the_cli_trains_evaluates_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let (tiny, data) = (
        here().join("tiny/model").to_str().unwrap().to_string(),
        here().join("data/sft.jsonl").to_str().unwrap().to_string(),
    );
    let ok = |r: std::process::Output| {
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        String::from_utf8_lossy(&r.stdout).to_string()
    };
    ok(kiln(&[
        "export",
        "--model",
        &tiny,
        "--output-format",
        "mlx",
        "--format",
        "q4",
        "--group-size",
        "32",
        "--out",
        &p("q4"),
    ]));
    ok(kiln(&[
        "train",
        "--task",
        "sft",
        "--model",
        &p("q4"),
        "--data",
        &data,
        "--out",
        &p("adapter"),
        "--max-steps",
        "30",
        "--learning-rate",
        "1e-2",
        "--lora-r",
        "8",
        "--quiet",
    ]));
    assert!(
        dir.path()
            .join("adapter/adapter_model.safetensors")
            .is_file()
    );
    // The training examples as text, for kiln eval.
    let text: String = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let t = format!(
                "{}{}",
                v["prompt"].as_str().unwrap(),
                v["completion"].as_str().unwrap()
            );
            format!("{}\n", serde_json::json!({ "text": t }))
        })
        .collect();
    std::fs::write(dir.path().join("eval.jsonl"), text).unwrap();
    let eval_data = p("eval.jsonl");
    let ppl = |extra: &[&str]| -> f64 {
        let mut a = vec!["eval", "--model", &p("q4"), "--data", &eval_data, "--json"]
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>();
        a.extend(extra.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        let v: serde_json::Value = serde_json::from_str(&ok(kiln(&a))).unwrap();
        v["perplexity"].as_f64().unwrap()
    };
    let (base, tuned) = (ppl(&[]), ppl(&["--adapter", &p("adapter")]));
    eprintln!("perplexity on the training data: base {base:.2}, with the QLoRA adapter {tuned:.2}");
    // The whole text is scored (SFT trained on the completions only): lower, not low.
    assert!(tuned < 0.97 * base, "{base} → {tuned}");
    let out = ok(kiln(&[
        "generate",
        "--model",
        &p("q4"),
        "--adapter",
        &p("adapter"),
        "--prompt",
        "1+2=",
        "--max-new-tokens",
        "2",
        "--temperature",
        "0",
    ]));
    assert!(!out.trim().is_empty());
    // To deployment: the adapter merged into the full-precision model, quantized again.
    ok(kiln(&[
        "export",
        "--model",
        &tiny,
        "--adapter",
        &p("adapter"),
        "--output-format",
        "mlx",
        "--format",
        "q4",
        "--group-size",
        "32",
        "--out",
        &p("merged-q4"),
    ]));
    let v: serde_json::Value = serde_json::from_str(&ok(kiln(&[
        "eval",
        "--model",
        &p("merged-q4"),
        "--data",
        &eval_data,
        "--json",
    ])))
    .unwrap();
    let merged = v["perplexity"].as_f64().unwrap();
    eprintln!("merged into the full-precision model and quantized again: {merged:.2}");
    assert!(merged < 0.98 * base, "{base} → {merged}");
}

/// `kiln export --adapter`'s merge is PEFT's: `W + (α/r)·B·A` on the adapted weights, every
/// other tensor unchanged (checked against the sum written out by hand).
#[test]
fn merging_an_adapter_adds_its_delta_to_the_adapted_weights_only() {
    let dir = tempfile::tempdir().unwrap();
    let base = Checkpoint::open(here().join("tiny/model")).unwrap();
    let adapter = here().join("tiny/init-adapter");
    kiln_runtime::adapters::merge_checkpoint(&base, &adapter, &dir.path().join("m")).unwrap();
    let merged = Checkpoint::open(dir.path().join("m")).unwrap();
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    let s = cfg["lora_alpha"].as_f64().unwrap() / cfg["r"].as_f64().unwrap();
    let a_file = std::fs::read(adapter.join("adapter_model.safetensors")).unwrap();
    let ad = safetensors::SafeTensors::deserialize(&a_file).unwrap();
    let f32s = |v: safetensors::tensor::TensorView<'_>| -> Vec<f32> {
        v.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let mut adapted = 0;
    for t in base.tensors() {
        let w: Vec<f32> = base.read_as(&t.name).unwrap();
        let m: Vec<f32> = merged.read_as(&t.name).unwrap();
        let module = t.name.trim_end_matches(".weight");
        let a = ad.tensor(&format!("base_model.model.{module}.lora_A.weight"));
        let b = ad.tensor(&format!("base_model.model.{module}.lora_B.weight"));
        match (a, b) {
            (Ok(a), Ok(b)) => {
                adapted += 1;
                let (r, cols) = (a.shape()[0], a.shape()[1]);
                let (a, b) = (f32s(a), f32s(b));
                for i in 0..t.shape[0] {
                    for j in 0..cols {
                        let d: f64 = (0..r)
                            .map(|k| f64::from(b[i * r + k]) * f64::from(a[k * cols + j]))
                            .sum();
                        let want = f64::from(w[i * cols + j]) + s * d;
                        let got = f64::from(m[i * cols + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{}",
                            t.name
                        );
                    }
                }
            }
            _ => assert_eq!(w, m, "{} changed", t.name),
        }
    }
    assert_eq!(adapted, 6, "q_proj, v_proj and down_proj in two layers");
}

/// Against PEFT + bitsandbytes + TRL (`tests/train/qlora_reference.json`, made by
/// `tests/train/qlora_ref.py`): from transformers' own NF4 save of the tiny model
/// (`tests/train/qtiny/bnb-nf4`, 64 wide) and its initial adapter, SFT and DPO for six steps; every
/// step's loss and gradient norm within 1e-3 relative. TRL casts a 4-bit model's adapter to
/// bf16 for SFT, DPO and GRPO; kiln trains it in f32, so the references undo that cast.
#[test]
fn qlora_matches_peft_and_bitsandbytes() {
    let text = std::fs::read_to_string(here().join("qlora_reference.json")).unwrap();
    let refs: serde_json::Value = serde_json::from_str(&text).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    let mut compared = 0;
    for (name, run) in refs.as_object().unwrap() {
        if run["f32_adapter"] != serde_json::Value::Bool(true) {
            continue;
        }
        compared += 1;
        let task = run["task"].as_str().unwrap();
        let mut c = TrainConfig::new(
            task,
            "candle",
            here().join("qtiny/bnb-nf4"),
            dir.path().join(name),
        );
        c.train_data = Some(here().join(run["data"].as_str().unwrap()));
        c.hyper.max_steps = Some(6);
        c.hyper.logging_steps = 1;
        c.hyper.per_device_train_batch_size = 2;
        c.hyper.train_sampling_strategy = "sequential".into();
        c.hyper.max_length = Some(1024);
        c.hyper.learning_rate = run["settings"]["learning_rate"].as_f64().unwrap();
        c.init_adapter = Some(here().join("qtiny/init-adapter"));
        let got = train(&c).unwrap();
        let want = run["logs"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        for (g, w) in got.iter().zip(want) {
            let (wl, wg) = (
                w["loss"].as_f64().unwrap(),
                w["grad_norm"].as_f64().unwrap(),
            );
            let gg = g.grad_norm.unwrap_or(f64::NAN);
            let line = format!(
                "{name} step {}: loss {:.6} vs {wl:.6}, grad norm {gg:.4} vs {wg:.4}",
                g.step, g.loss
            );
            eprintln!("{line}");
            if (g.loss - wl).abs() > 1e-3 * wl.abs() || (gg - wg).abs() > 1e-3 * wg.abs() {
                bad.push(line);
            }
        }
    }
    assert_eq!(compared, 2, "QLoRA references");
    assert!(
        bad.is_empty(),
        "against PEFT + bitsandbytes:\n{}",
        bad.join("\n")
    );
}

/// PEFT deploys kiln's QLoRA adapter: `tests/train/qtiny/kiln-adapter` (what `kiln train` wrote
/// over the NF4 base) loaded by PEFT onto that base in transformers + bitsandbytes, and onto
/// the full-precision model (`tests/train/qlora_peft_check.py`), gives the logits kiln gives
/// with the same adapter over the same bases.
#[test]
fn peft_loads_kilns_qlora_adapter_and_gives_kilns_logits() {
    let q = here().join("qtiny");
    let (ids, want) = peer_logits(&q.join("peft_logits.safetensors"));
    for (base, key) in [("bnb-nf4", "nf4_logits"), ("model", "full_logits")] {
        let got = kiln_logits(&q.join(base), &q.join("kiln-adapter"), &ids);
        let worst = max_diff(&got, &want[key]);
        eprintln!("{base}: kiln vs PEFT logits, max |Δ| {worst:.2e}");
        assert!(worst < 1e-4, "{base}: logits differ from PEFT's by {worst}");
    }
}

/// mlx-lm deploys kiln's QLoRA adapter: `tests/train/qtiny/kiln-mlx-adapter` (what `kiln train
/// --backend mlx --adapter-format mlx-lm` wrote over mlx-lm's 4-bit model) loaded by
/// `mlx_lm.load(..., adapter_path=...)` onto that quantized model (`tests/train/mlx_lm_check.py`)
/// gives the logits kiln gives with the same adapter over the same packed base.
#[test]
fn mlx_lm_loads_kilns_qlora_adapter_and_gives_kilns_logits() {
    let q = here().join("qtiny");
    let (ids, want) = peer_logits(&q.join("mlx_lm_logits.safetensors"));
    let got = kiln_logits(&q.join("mlx-q4"), &q.join("kiln-mlx-adapter"), &ids);
    let worst = max_diff(&got, &want["logits"]);
    eprintln!("kiln vs mlx-lm logits over the q4 base, max |Δ| {worst:.2e}");
    assert!(worst < 1e-4, "logits differ from mlx-lm's by {worst}");
}

/// A peer's logits file: the token ids (`ids`, i64 `[2, n]`) and every f32 tensor by name.
fn peer_logits(path: &Path) -> (Vec<u32>, std::collections::BTreeMap<String, Vec<f32>>) {
    let file = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&file).unwrap();
    let mut ids = Vec::new();
    let mut f32s = std::collections::BTreeMap::new();
    for (name, t) in st.tensors() {
        if name == "ids" {
            ids = t
                .data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect();
        } else {
            let v = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            f32s.insert(name, v);
        }
    }
    (ids, f32s)
}

/// kiln's logits (candle) of two rows of `ids` over `base` (any layout kiln reads) with the
/// adapter in `adapter` (PEFT's layout or mlx-lm's).
fn kiln_logits(base: &Path, adapter: &Path, ids: &[u32]) -> Vec<f32> {
    use kiln_runtime::model::candle::Tensor;
    use kiln_runtime::model::lora::{Adapters, linear_modules};
    let model = kiln_runtime::formats::load_model(base, DType::F32, &Device::Cpu, false).unwrap();
    let a = Adapters::load_any_for(adapter, &linear_modules(&model), &Device::Cpu).unwrap();
    let model = model.with_adapters(Some(std::sync::Arc::new(a)));
    let x = Tensor::from_vec(ids.to_vec(), (2, ids.len() / 2), &Device::Cpu).unwrap();
    model
        .forward(&x)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// llama.cpp's LoRA adapter: kiln's `adapter.gguf` for `tests/train/qtiny/kiln-adapter` (Q —
/// rows in llama.cpp's order —, V and gate projections of the tiny Llama) is, byte for byte,
/// what llama.cpp's `convert_lora_to_gguf.py` makes of that PEFT folder
/// (`scripts/gguf/lora_adapter_ref.py` → `tests/train/qtiny/kiln-adapter.gguf`); and
/// `kiln train --adapter-format gguf` writes one beside PEFT's files.
#[test]
fn gguf_lora_adapters_are_what_llama_cpps_converter_writes() {
    use kiln_runtime::adapters::gguf::{base_config, id_to_title};
    use kiln_runtime::model::lora::Adapters;
    let q = here().join("qtiny");
    let model =
        kiln_runtime::formats::load_model(&q.join("model"), DType::F32, &Device::Cpu, false)
            .unwrap();
    let a = Adapters::load_peft(&q.join("kiln-adapter"), &model).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("adapter.gguf");
    a.save_gguf(
        &out,
        &base_config(&q.join("model")).unwrap(),
        &id_to_title("kiln-adapter"),
    )
    .unwrap();
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(q.join("kiln-adapter.gguf")).unwrap(),
        "kiln's adapter.gguf differs from convert_lora_to_gguf.py's"
    );
    // From training, over a quantized base (the config a GGUF base's metadata rebuilds).
    let base = gguf(dir.path(), "q8-0");
    let trained = dir.path().join("lora-gguf");
    let mut c = config("sft", &base, &trained);
    c.adapter_format = kiln_runtime::train::AdapterFormat::Gguf;
    train(&c).unwrap();
    assert!(trained.join("adapter_model.safetensors").is_file());
    let f = kiln_runtime::formats::gguf::container::GgufFile::open(&trained.join("adapter.gguf"))
        .unwrap();
    assert_eq!(
        f.metadata.get("general.type").and_then(|v| v.as_str()),
        Some("adapter")
    );
    assert_eq!(f.tensors.len(), 2 * 2 * 7, "A and B of every Linear");
}

/// llama.cpp applies kiln's GGUF adapter as kiln does: `llama-perplexity --lora adapter.gguf`
/// on the demo model's F32 GGUF (`scripts/gguf/lora_adapter_ref.py` →
/// `tests/gguf/lora/llama-perplexity.json`, the adapter kiln trained in `tests/gguf/lora/adapter`)
/// gives the perplexity `kiln eval --adapter` gives, to float rounding, with and without it.
#[test]
fn kiln_eval_with_an_adapter_matches_llama_perplexity_with_its_gguf_adapter() {
    let refs_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf");
    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(refs_dir.join("lora/llama-perplexity.json")).unwrap(),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir_all(&model).unwrap();
    kiln_runtime::demo::write_demo_model(&model, kiln_runtime::demo::DemoConfig::default())
        .unwrap();
    let eval = |adapter: Option<&Path>| -> f64 {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"));
        cmd.args(["eval", "--model"])
            .arg(&model)
            .arg("--data")
            .arg(refs_dir.join("imatrix/text.txt"))
            .args(["--ctx", &refs["ctx"].to_string()])
            .args(["--chunks", &refs["chunks"].to_string()])
            .arg("--json");
        if let Some(a) = adapter {
            cmd.arg("--adapter").arg(a);
        }
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["perplexity"].as_f64().unwrap()
    };
    let (base, lora) = (eval(None), eval(Some(&refs_dir.join("lora/adapter"))));
    let (want_base, want_lora) = (
        refs["base_ppl"].as_f64().unwrap(),
        refs["lora_ppl"].as_f64().unwrap(),
    );
    eprintln!(
        "kiln {base} / {lora}, llama-perplexity {want_base} / {want_lora} (base / with the adapter)"
    );
    assert!(
        (base - want_base).abs() < 1e-5 * want_base,
        "{base} vs {want_base}"
    );
    assert!(
        (lora - want_lora).abs() < 1e-5 * want_lora,
        "{lora} vs {want_lora}"
    );
    assert!(
        (lora - base).abs() > 1e-3 * base,
        "the adapter changes the model"
    );
}
