//! `kiln train`: a task routed to its backend's trainer, every TRL setting a flag
//! (`--learning-rate`) and a `--config` TOML key (`learning_rate`), metrics as JSONL, a live
//! progress bar, Ctrl-C ends the run cleanly with the result saved (exit 130).

use anyhow::{Context, Result, bail};
use clap::{ArgMatches, Args, FromArgMatches};
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::train::fields::{self, FIELDS, Kind};
use kiln_runtime::train::{StepMetrics, TrainConfig, TrainObserver, TrainPlan, TrainReport};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Sample data for the built-in demo model, used when no --data is given.
const SAMPLE_DATA: &[(&str, &str, &str)] = &[
    (
        "sft",
        "sft.jsonl",
        include_str!("../../examples/data/sft.jsonl"),
    ),
    (
        "dpo",
        "dpo.jsonl",
        include_str!("../../examples/data/dpo.jsonl"),
    ),
    (
        "orpo",
        "dpo.jsonl",
        include_str!("../../examples/data/dpo.jsonl"),
    ),
    (
        "simpo",
        "dpo.jsonl",
        include_str!("../../examples/data/dpo.jsonl"),
    ),
    (
        "kto",
        "kto.jsonl",
        include_str!("../../examples/data/kto.jsonl"),
    ),
    (
        "grpo",
        "grpo.jsonl",
        include_str!("../../examples/data/grpo.jsonl"),
    ),
    (
        "pretrain",
        "pretrain.jsonl",
        include_str!("../../examples/data/pretrain.jsonl"),
    ),
    (
        "rloo",
        "grpo.jsonl",
        include_str!("../../examples/data/grpo.jsonl"),
    ),
    (
        "online_dpo",
        "grpo.jsonl",
        include_str!("../../examples/data/grpo.jsonl"),
    ),
    (
        "ppo",
        "grpo.jsonl",
        include_str!("../../examples/data/grpo.jsonl"),
    ),
    (
        "bco",
        "kto.jsonl",
        include_str!("../../examples/data/kto.jsonl"),
    ),
    (
        "distill",
        "chat.jsonl",
        include_str!("../../examples/data/chat.jsonl"),
    ),
    (
        "reward",
        "dpo.jsonl",
        include_str!("../../examples/data/dpo.jsonl"),
    ),
];

#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The task: sft, pretrain, dpo, online_dpo, orpo, simpo, kto, bco, grpo, rloo, reward,
    /// distill, ppo (and plugin tasks); `kiln registry
    /// trainers` lists them.
    #[arg(long)]
    task: String,
    /// The backend: candle (default) or mlx (feature `mlx`).
    #[arg(long, default_value = "candle")]
    backend: String,
    /// The model folder (config.json, safetensors, tokenizer.json, tokenizer_config.json).
    /// Without it, kiln writes its small random demo Llama and trains that.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Training data, JSONL (the task's format). Without it, the task's sample data shipped
    /// with kiln (examples/data/<task>.jsonl).
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Evaluation data (the task's format), evaluated every --eval-steps steps.
    #[arg(long, value_name = "FILE")]
    eval_data: Option<PathBuf>,
    /// The output folder: a PEFT adapter (LoRA) or a full checkpoint (`--lora-r 0`).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Settings by TRL's field names (`learning_rate = 1e-5`); flags override them.
    #[arg(long, value_name = "FILE.toml")]
    config: Option<PathBuf>,
    /// Write one JSON object per logged step (step, loss, learning_rate, grad_norm, the task's
    /// figures) to this file.
    #[arg(long, value_name = "FILE.jsonl")]
    metrics: Option<PathBuf>,
    /// Start from this PEFT adapter (trainable).
    #[arg(long, value_name = "DIR")]
    init_adapter: Option<PathBuf>,
    /// With LoRA, also write the merged full checkpoint to <out>/merged.
    #[arg(long)]
    merge: bool,
    /// The adapter's layout: peft (adapter_model.safetensors, what `peft` loads), mlx-lm
    /// (adapters.safetensors, what `mlx_lm` loads) or gguf (llama.cpp's adapter.gguf, what
    /// `llama-cli --lora` loads, beside PEFT's files). --init-adapter reads peft or mlx-lm.
    #[arg(long, value_name = "FORMAT", default_value = "peft", value_parser = ["peft", "mlx-lm", "gguf"])]
    adapter_format: String,
    /// Replace the output folder if it exists (without it, an existing folder is an error,
    /// unless the run resumes from a checkpoint inside it).
    #[arg(long)]
    force: bool,
    /// Continue the run saved in this checkpoint folder (<out>/checkpoint-N): weights,
    /// optimizer state, step, data position, random streams. Give the same settings.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Where the model runs: cpu, cuda[:N] (feature candle-cuda), metal[:N].
    #[arg(long, default_value = "cpu")]
    device: String,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    fields: FieldArgs,
}

/// One flag per [`FIELDS`] entry, by its kebab-case name.
#[derive(Debug, Default, Clone)]
pub struct FieldArgs {
    given: Vec<(&'static str, String)>,
}

fn flag(name: &str) -> String {
    name.replace('_', "-")
}

fn leaked(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

impl FromArgMatches for FieldArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut given = Vec::new();
        for f in FIELDS {
            if let Some(v) = m.get_one::<String>(f.name) {
                given.push((f.name, v.clone()));
            }
        }
        Ok(FieldArgs { given })
    }
    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for FieldArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let mut cmd = cmd.next_help_heading("Training settings (TRL's names; also TOML keys)");
        for f in FIELDS {
            let mut help = f.help.to_string();
            if !f.tasks.is_empty() {
                help.push_str(&format!(" ({} only)", f.tasks.join(", ")));
            }
            let value = match f.kind {
                Kind::Float => "X",
                Kind::Int => "N",
                Kind::Bool => "BOOL",
                Kind::Text => "NAME",
                Kind::List => "A,B",
                Kind::Numbers => "X,Y",
                Kind::Names => "NAME[,NAME]",
            };
            cmd = cmd.arg(
                clap::Arg::new(f.name)
                    .long(leaked(flag(f.name)))
                    .value_name(value)
                    .help(help),
            );
        }
        cmd
    }
    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// Applies a `--config` file's text (`path` names it in errors): every key a known field, by
/// TRL's names, its value checked as the flag's would be.
pub fn apply_toml(config: &mut TrainConfig, text: &str, path: &Path) -> Result<()> {
    let table: toml::Table =
        toml::from_str(text).with_context(|| format!("{}: not valid TOML", path.display()))?;
    for (k, v) in table {
        let v = serde_json::to_value(&v).context("TOML value")?;
        fields::apply(config, &k, &v).with_context(|| format!("{}", path.display()))?;
    }
    Ok(())
}

/// The run's configuration: TRL's defaults for the task, then the TOML file, then the flags.
fn build_config(
    args: &TrainArgs,
    model: PathBuf,
    data: PathBuf,
    out: PathBuf,
) -> Result<TrainConfig> {
    let mut c = TrainConfig::new(&args.task, &args.backend, model, out);
    c.train_data = Some(data);
    c.device = args.device.clone();
    fields::defaults_for(&mut c);
    if let Some(path) = &args.config {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        apply_toml(&mut c, &text, path)?;
    }
    for (name, text) in &args.fields.given {
        let f = fields::field(name).expect("flags come from FIELDS");
        let v = fields::parse_flag(f, text).with_context(|| format!("--{}", flag(name)))?;
        fields::apply(&mut c, name, &v).with_context(|| format!("--{}", flag(name)))?;
    }
    if let Some(dir) = &args.init_adapter {
        c.init_adapter = Some(dir.clone());
    }
    c.merge = args.merge;
    c.adapter_format = match args.adapter_format.as_str() {
        "mlx-lm" => kiln_runtime::train::AdapterFormat::MlxLm,
        "gguf" => kiln_runtime::train::AdapterFormat::Gguf,
        _ => kiln_runtime::train::AdapterFormat::Peft,
    };
    if c.adapter_format != kiln_runtime::train::AdapterFormat::Peft
        && c.lora.is_none()
        && c.init_adapter.is_none()
    {
        bail!(
            "--adapter-format {} needs LoRA (with --lora-r 0 the output is a full checkpoint)",
            args.adapter_format
        );
    }
    // A --config file's output_dir is the output folder unless --out names one.
    if let (None, Some(dir)) = (&args.out, &c.output_dir) {
        let resumes_inside = args.resume.as_ref().is_some_and(|r| r.starts_with(dir));
        if dir.exists() && !args.force && !resumes_inside {
            bail!(
                "{} (output_dir of {}) exists; pass --force to replace it (or --resume a checkpoint in it)",
                dir.display(),
                args.config
                    .as_deref()
                    .unwrap_or(Path::new("--config"))
                    .display()
            );
        }
        c.output = dir.clone();
    }
    c.eval_data = args.eval_data.clone();
    if c.eval_data.is_some() != c.hyper.eval_steps.is_some() {
        bail!("--eval-data and --eval-steps go together (evaluate this file every N steps)");
    }
    c.resume = args.resume.clone();
    if c.merge && c.lora.is_none() && c.init_adapter.is_none() {
        bail!(
            "--merge needs LoRA (it merges the adapter); with --lora-r 0 the output is already a full checkpoint"
        );
    }
    Ok(c)
}

/// Progress bar, metrics file and Ctrl-C.
struct CliObserver {
    bar: Option<indicatif::ProgressBar>,
    metrics: Option<(PathBuf, std::io::BufWriter<std::fs::File>)>,
    error: Option<anyhow::Error>,
    start: Instant,
    key: &'static [&'static str],
    checkpoint: Option<PathBuf>,
}

impl TrainObserver for CliObserver {
    fn on_start(&mut self, plan: &TrainPlan) {
        // What the backend does differently from the settings: said even under --quiet.
        // (On standard error, around the bar: a hidden bar's `println` prints nothing.)
        for note in &plan.notes {
            match &self.bar {
                Some(bar) => bar.suspend(|| eprintln!("note: {note}")),
                None => eprintln!("note: {note}"),
            }
        }
        if let Some(bar) = &self.bar {
            bar.set_length(plan.total_steps);
            bar.println(format!(
                "training: {} steps, {} examples, {} trainable parameters",
                plan.total_steps, plan.examples, plan.trainable_parameters
            ));
        }
    }
    fn on_step(&mut self, m: &StepMetrics) {
        if let Some((path, w)) = &mut self.metrics {
            let mut o = serde_json::Map::new();
            o.insert("step".into(), m.step.into());
            o.insert("epoch".into(), m.epoch.into());
            o.insert("loss".into(), m.loss.into());
            o.insert("learning_rate".into(), m.learning_rate.into());
            if let Some(g) = m.grad_norm {
                o.insert("grad_norm".into(), g.into());
            }
            for (k, v) in &m.extra {
                o.insert(k.clone(), (*v).into());
            }
            if let Err(e) = writeln!(w, "{}", Value::Object(o)).and_then(|_| w.flush()) {
                self.error.get_or_insert(
                    anyhow::Error::new(e).context(format!("writing {}", path.display())),
                );
            }
        }
        if let Some(bar) = &self.bar {
            let secs = self.start.elapsed().as_secs_f64().max(1e-9);
            let mut msg = format!(
                "loss {:.4}  lr {:.2e}  {:.0} tok/s",
                m.loss,
                m.learning_rate,
                m.tokens as f64 / secs
            );
            for k in self.key {
                if let Some(v) = m.extra.get(*k) {
                    msg.push_str(&format!("  {k} {v:.3}"));
                }
            }
            bar.set_position(m.step);
            bar.set_message(msg);
        }
    }
    fn on_eval(&mut self, step: u64, figures: &std::collections::BTreeMap<String, f64>) {
        if let Some((path, w)) = &mut self.metrics {
            let mut o = serde_json::Map::new();
            o.insert("step".into(), step.into());
            for (k, v) in figures {
                o.insert(k.clone(), (*v).into());
            }
            if let Err(e) = writeln!(w, "{}", Value::Object(o)).and_then(|_| w.flush()) {
                self.error.get_or_insert(
                    anyhow::Error::new(e).context(format!("writing {}", path.display())),
                );
            }
        }
        if let (Some(bar), Some(l)) = (&self.bar, figures.get("eval_loss")) {
            bar.println(format!("step {step}: eval_loss {l:.4}"));
        }
    }
    fn on_checkpoint(&mut self, step: u64, path: &Path) {
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("checkpoint-"))
        {
            self.checkpoint = Some(path.to_path_buf());
            if let Some(bar) = &self.bar {
                bar.println(format!("step {step}: saved {}", path.display()));
            }
        }
    }
    fn should_stop(&mut self) -> bool {
        self.error.is_some() || super::export::cancel_flag().load(Ordering::Relaxed)
    }
    fn on_end(&mut self, _report: &TrainReport) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Long on purpose: the command's steps in order: config, routing, observers, the run and its
/// report.
pub fn train(args: &TrainArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    // Route first: an unknown task or backend is reported before any work.
    kiln_runtime::resolve_trainer(&TrainConfig::new(&args.task, &args.backend, "", ""))?;
    let _demo;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => {
            let dir =
                tempfile::tempdir().context("creating a temporary folder for the demo model")?;
            write_demo_model(dir.path(), DemoConfig::default())
                .context("writing the demo model")?;
            writeln!(
                err,
                "no --model given: training kiln's built-in demo model (a random Llama, {} parameters)",
                DemoConfig::default().parameters()
            )?;
            let p = dir.path().to_path_buf();
            _demo = dir;
            p
        }
    };
    let _data_file;
    let data = match &args.data {
        Some(d) => d.clone(),
        None => {
            let Some((_, file, text)) = SAMPLE_DATA.iter().find(|(t, _, _)| *t == args.task) else {
                bail!(
                    "--data is required for task `{}` (kiln ships sample data for: {})",
                    args.task,
                    SAMPLE_DATA
                        .iter()
                        .map(|(t, _, _)| *t)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            let f = tempfile::NamedTempFile::new().context("writing the sample data")?;
            std::fs::write(f.path(), text).context("writing the sample data")?;
            writeln!(
                err,
                "no --data given: using kiln's sample {} data (examples/data/{file})",
                args.task
            )?;
            let p = f.path().to_path_buf();
            _data_file = f;
            p
        }
    };
    let target = match &args.out {
        Some(o) => {
            let resumes_inside = args.resume.as_ref().is_some_and(|r| r.starts_with(o));
            if o.exists() && !args.force && !resumes_inside {
                bail!(
                    "{} exists; pass --force to replace it (or --resume a checkpoint in it)",
                    o.display()
                );
            }
            o.clone()
        }
        // A kiln-owned folder under the temporary directory, replaced on every run.
        None => std::env::temp_dir().join(format!("kiln-train-{}", args.task)),
    };
    let config = build_config(args, model, data, target)?;
    let entry = kiln_runtime::resolve_trainer(&config)?;
    let mut trainer = entry.construct(&config)?;
    let metrics = match &args.metrics {
        Some(p) => Some((
            p.clone(),
            std::io::BufWriter::new(
                std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
            ),
        )),
        None => None,
    };
    let bar = (!args.quiet).then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed_precise} {msg}")
                .expect("template"),
        );
        bar
    });
    let mut observer = CliObserver {
        bar,
        metrics,
        error: None,
        start: Instant::now(),
        checkpoint: None,
        key: match args.task.as_str() {
            "dpo" | "orpo" | "simpo" | "kto" => &["rewards/accuracies", "rewards/margins"],
            "bco" => &["rewards/margins", "delta"],
            "online_dpo" => &["objective/scores", "rewards/margins"],
            "ppo" => &["objective/scores", "objective/kl", "loss/value_avg"],
            "sft" | "pretrain" => &["mean_token_accuracy"],
            "grpo" | "rloo" => &["reward", "reward_std", "completions/mean_length"],
            "reward" => &["accuracy", "margin"],
            _ => &[],
        },
    };
    let _ = super::export::cancel_flag();
    let report = trainer.train(&mut observer)?;
    if let Some(e) = observer.error.take() {
        return Err(e);
    }
    let loss = report
        .final_loss
        .map(|l| format!("{l:.4}"))
        .unwrap_or_else(|| "-".into());
    writeln!(
        out,
        "{} on {}: {} steps in {:.1}s, final loss {loss}",
        report.task,
        report.backend,
        report.steps,
        report.elapsed.as_secs_f64()
    )?;
    if let Some(o) = &report.output {
        writeln!(out, "wrote {}", o.display())?;
    }
    if report.stopped_early {
        writeln!(
            err,
            "interrupted: stopped after step {} and saved the result",
            report.steps
        )?;
        if let Some(c) = &observer.checkpoint {
            writeln!(err, "continue with --resume {}", c.display())?;
        }
        return Ok(130);
    }
    Ok(0)
}
