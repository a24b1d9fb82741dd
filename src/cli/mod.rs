//! The `kiln` command line. [`run`] takes the arguments and the output streams, so plugin
//! binaries (`use my_plugins as _; kiln::cli::main()`) and tests drive the same code.

mod args;
mod eval;
mod export;
mod generate;
mod imatrix;
mod registry;
mod table;
mod train;
mod verify;

pub use train::apply_toml;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::io::Write;
use std::process::ExitCode;

/// Exit status for an invalid registry or invalid usage.
pub const EXIT_INVALID: i32 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "kiln",
    version,
    about = "Quantized export and fine-tuning of trained models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Quantize a model into a deployable checkpoint in a registered output format (`kiln
    /// registry writers`).
    Export(export::ExportArgs),
    /// Show which exporter takes each module of a model, and why.
    Explain(export::ExplainArgs),
    /// Write a random Llama-family checkpoint (to try kiln, and for the benchmarks).
    DemoModel(export::DemoModelArgs),
    /// Perplexity and tokens/s of a model (plain, or a quantized export decoded on load).
    Eval(eval::EvalArgs),
    /// llama.cpp's importance matrix of a model on plain text (llama-imatrix), for
    /// `kiln export --output-format gguf --imatrix FILE`.
    Imatrix(imatrix::ImatrixArgs),
    /// Check a quantized export against its reference model (structure, decoding, errors,
    /// perplexity).
    Verify(verify::VerifyArgs),
    /// Fine-tune a model: a task (sft, dpo, ...) on a backend (candle, mlx), TRL's settings.
    Train(Box<train::TrainArgs>),
    /// Sample from a model (and a PEFT adapter) with its KV cache.
    Generate(generate::GenerateArgs),
    /// List the registered exporters, trainers, architectures and rewards in registry order.
    Registry(registry::RegistryArgs),
}

/// `kiln export` / `kiln explain`'s help, from the writers registry: what `--output-format`
/// and `--format` take and their defaults (an invalid registry keeps the static text; every
/// command then reports it).
fn with_registry_help(cmd: clap::Command) -> clap::Command {
    let Ok(writers) = kiln_runtime::WriterRegistry::try_global() else {
        return cmd;
    };
    let entries = writers.entries();
    let names: Vec<String> = entries.iter().map(|e| e.name.to_string()).collect();
    let defaults: Vec<String> = entries
        .iter()
        .map(|e| format!("{} {}", e.name, e.default_format().unwrap_or("(none)")))
        .collect();
    let writer_help = format!(
        "The output layout, one registered writer: {} (default: modelopt). `kiln registry \
         writers` lists each one's formats and the engines that load them",
        names.join(", ")
    );
    let format_help = format!(
        "The quantization format, one of the writer's; without it, the writer's first: {}. \
         `kiln registry writers` lists them all",
        defaults.join(", ")
    );
    // `--output-format`'s default is modelopt; its default format is the registry's first.
    let first = writers
        .get("modelopt")
        .ok()
        .and_then(|e| e.default_format())
        .map(|f| format!("modelopt {f}"))
        .unwrap_or_default();
    let about = format!(
        "Quantize a model into a deployable checkpoint: {} (--output-format; by default {first})",
        names.join(", ")
    );
    let set = |c: clap::Command| {
        c.mut_arg("output_format", |a| a.help(writer_help.clone()))
            .mut_arg("format", |a| a.help(format_help.clone()))
    };
    cmd.mut_subcommand("export", |c| set(c).about(about.clone()))
        .mut_subcommand("explain", set)
}

/// Parses `std::env::args` and runs; the process's exit code.
pub fn main() -> ExitCode {
    // Buffers up to 32 MiB reused from the heap rather than faulted in afresh each time
    // (`kiln_kernels::cpu::alloc`); a user's own malloc settings are left as they are.
    let _ = kiln_kernels::cpu::alloc::keep_freed_memory();
    let code = run(
        std::env::args_os(),
        &mut std::io::stdout().lock(),
        &mut std::io::stderr().lock(),
    );
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Runs the command line `args` (program name first), writing to `out` and `err`;
/// returns the exit code.
pub fn run<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let parsed = with_registry_help(Cli::command())
        .try_get_matches_from(args)
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(cli) => cli,
        Err(e) => {
            let code = e.exit_code();
            let text = e.render().to_string();
            let _ = if code == 0 {
                write!(out, "{text}")
            } else {
                write!(err, "{text}")
            };
            return code;
        }
    };
    // Every command depends on the registries: an invalid one is reported the same way, with
    // exit code 2, whatever the command (`kiln registry` lists the problems itself).
    if !matches!(cli.command, Command::Registry(_))
        && let Err(e) = registry::validate_all()
    {
        let _ = writeln!(err, "error: {e}");
        return EXIT_INVALID;
    }
    let result = match cli.command {
        Command::Export(args) => export::export(&args, out, err),
        Command::Explain(args) => export::explain(&args, out, err),
        Command::DemoModel(args) => export::demo_model(&args, out),
        Command::Eval(args) => eval::eval(&args, out),
        Command::Imatrix(args) => imatrix::imatrix(&args, out, err),
        Command::Verify(args) => verify::verify(&args, out),
        Command::Train(args) => train::train(&args, out, err),
        Command::Generate(args) => generate::generate(&args, out),
        Command::Registry(args) => registry::run(&args, out),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            // The cause chain, skipping causes an error's own message already quotes.
            let mut msg = e.to_string();
            for cause in e.chain().skip(1) {
                let c = cause.to_string();
                if !msg.contains(&c) {
                    msg.push_str(": ");
                    msg.push_str(&c);
                }
            }
            let _ = writeln!(err, "error: {msg}");
            match e.downcast_ref::<registry::InvalidRegistries>() {
                Some(_) => EXIT_INVALID,
                None => 1,
            }
        }
    }
}
