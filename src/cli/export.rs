//! `kiln export` and `kiln explain`.

use super::args::{DemoSize, DeviceArgs, KvCacheArg, RunDtype};
use anyhow::{Context, Result, bail};
use clap::Args;
use kiln_runtime::calibrate::{Calibration, CalibrationOptions};
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::export::act_amax::ActAmax;
use kiln_runtime::export::recipe::{Format, Recipe};
use kiln_runtime::export::run::{ExportOptions, ExportSummary, OutputFormat, module_tree, run};
use kiln_runtime::export::writer::Encoding;
use kiln_runtime::export::{ModuleOutcome, plan};
use kiln_runtime::{ExporterRegistry, Linear, WriterRegistry};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// A flag set by Ctrl-C (SIGINT): the export stops between modules and removes its partial
/// output instead of dying with it in place.
pub(super) fn cancel_flag() -> Arc<std::sync::atomic::AtomicBool> {
    static FLAG: std::sync::OnceLock<Arc<std::sync::atomic::AtomicBool>> =
        std::sync::OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = flag.clone();
        // If a handler is already installed (a host program's), keep it; Ctrl-C then ends the
        // process as before and only errors clean up.
        let _ = ctrlc::set_handler(move || f.store(true, std::sync::atomic::Ordering::Relaxed));
        flag
    })
    .clone()
}

/// The `--output-format` used when none is given.
pub(super) const DEFAULT_WRITER: &str = "modelopt";

/// What both commands take to choose the model and the recipe.
#[derive(Debug, Args)]
pub struct RecipeArgs {
    /// The Hugging Face model folder (config.json + safetensors). Without it, kiln builds a small
    /// random Llama-family demo model and uses it.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The output layout, one registered writer (the help lists them from the registry).
    #[arg(long, value_name = "WRITER", default_value = DEFAULT_WRITER)]
    output_format: String,
    /// The quantization format, one of the writer's (the help lists the defaults from the
    /// registry).
    #[arg(long)]
    format: Option<String>,
    /// Leave modules matching this glob unquantized (repeatable).
    #[arg(long, value_name = "GLOB")]
    exclude: Vec<String>,
    /// Quantize modules matching this glob even if excluded by default (repeatable).
    #[arg(long, value_name = "GLOB")]
    include: Vec<String>,
    /// Quantize the KV cache too (`fp8` or `nvfp4`).
    #[arg(long, value_name = "FORMAT")]
    kv_cache: Option<KvCacheArg>,
    /// Weight group size where the format has groups of a size to choose (32, 64 or 128:
    /// compressed-tensors w4a16, w4a16-asym and w8a16, mlx's affine modes, ModelOpt's
    /// int4-awq and w4a8-awq INT4 blocks); the format's default otherwise (128 for these,
    /// mlx's 64).
    #[arg(long, value_name = "N")]
    group_size: Option<usize>,
}

impl RecipeArgs {
    /// The writer and its format (`--format`, or the writer's default).
    fn output(&self) -> Result<OutputFormat> {
        let registry = WriterRegistry::try_global().map_err(|e| anyhow::anyhow!("{e}"))?;
        let entry = registry.get(&self.output_format)?;
        let format = match &self.format {
            Some(f) => f.clone(),
            None => entry
                .default_format()
                .with_context(|| format!("the {} writer lists no format", entry.name))?
                .to_string(),
        };
        Ok(OutputFormat {
            writer: self.output_format.clone(),
            format,
        })
    }

    /// Whether the output is the default writer's (reports and the demo's folder then name
    /// the format alone).
    fn is_default_writer(&self) -> bool {
        self.output_format == DEFAULT_WRITER
    }

    /// The export's writer, made for its format.
    fn writer(&self) -> Result<Box<dyn kiln_runtime::export::writer::OutputWriter>> {
        let output = self.output()?;
        let mut writer = WriterRegistry::try_global()
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .get(&output.writer)?
            .make(&output.format)?;
        kiln_runtime::export::writer::configure(
            writer.as_mut(),
            &output.writer,
            &output.format,
            self.group_size,
        )?;
        Ok(writer)
    }

    fn recipe(&self) -> Result<Recipe> {
        // A writer without an encoder of its own takes what the exporters compute in its
        // format; one with an encoder carries its own format (`ExportOptions::output`), and
        // the recipe's is then not used.
        let format = match self.writer()?.encoding() {
            Encoding::Shared(format) => format,
            Encoding::Own => Format::Nvfp4,
        };
        Ok(Recipe {
            format,
            exclude: self.exclude.clone(),
            include: self.include.clone(),
            kv_cache: self.kv_cache.map(Into::into),
            group_size: self.group_size,
        })
    }
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    recipe: RecipeArgs,
    /// The output folder (written beside itself and renamed into place at the end).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Activation statistics: a JSON object keyed by ModelOpt quantizer names
    /// (`<module>.input_quantizer`, `<attention>.k_bmm_quantizer`, ...).
    #[arg(long, value_name = "FILE")]
    act_amax: Option<PathBuf>,
    /// Calibration data: JSONL, one `{"input_ids": [...]}` or `{"text": ...}` (tokenized with
    /// the model's tokenizer.json) per line. kiln runs the model on it instead of reading
    /// --act-amax: max calibration of Linear inputs and KV, SmoothQuant's scales for
    /// `int8-sq`, and AWQ's scale search for `int4-awq`, `w4a8-awq` and `nvfp4-awq`.
    #[arg(long, value_name = "FILE", conflicts_with = "act_amax")]
    calib: Option<PathBuf>,
    /// Calibration samples to use (the first N lines; all by default).
    #[arg(long, value_name = "N", requires = "calib")]
    calib_size: Option<usize>,
    /// Tokens per calibration sample (longer samples are cut).
    #[arg(long, value_name = "L", requires = "calib")]
    calib_seq_len: Option<usize>,
    /// SmoothQuant's migration strength α for `int8-sq` with --calib (ModelOpt's default: 1).
    #[arg(long, value_name = "ALPHA", default_value_t = 1.0, requires = "calib")]
    sq_alpha: f32,
    /// AWQ's α grid step for the AWQ formats with --calib (ModelOpt's `awq_lite` default: 0.1).
    #[arg(long, value_name = "STEP", default_value_t = 0.1, requires = "calib", value_parser = parse_alpha_step)]
    awq_alpha_step: f64,
    /// int4-awq with --calib: after the scale search, AWQ's clipping search (ModelOpt's
    /// `awq_full`): each 128-block's amax may shrink to as little as half, where that lowers
    /// the Linear's output error.
    #[arg(long, requires = "calib")]
    awq_clip: bool,
    /// How the weights are rounded: `rtn` (round to nearest, the default) or `gptq` on the
    /// --calib samples: llm-compressor's (layer by layer) for compressed-tensors w4a16,
    /// w4a16-asym, w8a16 and nvfp4a16; mlx-lm's for mlx q2/q4/q8.
    #[arg(long, value_enum, default_value_t = Algorithm::Rtn)]
    algorithm: Algorithm,
    /// GPTQ's columns per block (llm-compressor's `block_size`, 128; mlx-lm's blocks are its
    /// groups).
    #[arg(long, value_name = "N", requires = "calib")]
    gptq_block_size: Option<usize>,
    /// GPTQ's dampening, a fraction of the Hessian's mean diagonal (`dampening_frac`).
    #[arg(long, value_name = "F", default_value_t = 0.01, requires = "calib")]
    gptq_dampening: f32,
    /// GPTQ's activation ordering: `static` (llm-compressor's default: columns by decreasing
    /// Hessian diagonal, each with its own group's scale) or `none` (mlx-lm has none).
    #[arg(long, value_enum, requires = "calib")]
    gptq_actorder: Option<ActOrder>,
    #[command(flatten)]
    device: DeviceArgs,
    /// The dtype --calib runs the model in (ModelOpt calibrates in the checkpoint's dtype,
    /// usually bf16: its MoE routing and AWQ choices are reproduced more closely).
    #[arg(long, value_enum, default_value_t = RunDtype::F32, requires = "calib")]
    calib_dtype: RunDtype,
    /// An importance matrix (`kiln imatrix` or `llama-imatrix`; GGUF or legacy `.dat`) that
    /// weights the GGUF writer's rounding, as `llama-quantize --imatrix` uses it.
    #[arg(long, value_name = "FILE")]
    imatrix: Option<PathBuf>,
    /// A PEFT LoRA adapter folder (what `kiln train` writes, QLoRA's included) to merge into the
    /// full-precision --model before quantizing (`W + s·B·A`, as PEFT's `merge_and_unload`).
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Largest shard, in bytes of tensor data: `5GB`, `500MB`, `10GiB`, or a number.
    #[arg(long, default_value = "5GB", value_parser = parse_size)]
    max_shard_size: u64,
    /// Replace an existing output folder.
    #[arg(long)]
    force: bool,
    /// Make warnings errors: `--act-amax` keys that name no quantizer of the model, NaN or
    /// infinite values in the weights.
    #[arg(long)]
    strict: bool,
}

#[derive(Debug, Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    recipe: RecipeArgs,
}

/// `--algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Algorithm {
    /// Round to nearest.
    Rtn,
    /// GPTQ (needs --calib).
    Gptq,
}

/// `--gptq-actorder`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ActOrder {
    /// Columns by decreasing Hessian diagonal (llm-compressor's `static`, alias `weight`).
    Static,
    /// Columns in order.
    None,
}

/// `--imatrix FILE`: the weights llama-quantize would load from it.
fn importance(path: &std::path::Path) -> Result<Arc<kiln_runtime::export::writer::Importance>> {
    let m = kiln_runtime::formats::gguf::imatrix::Imatrix::read(path)
        .with_context(|| format!("--imatrix {}", path.display()))?;
    let weights = m
        .entries
        .keys()
        .filter_map(|n| m.weights(n).map(|w| (n.clone(), w)))
        .collect();
    Ok(Arc::new(kiln_runtime::export::writer::Importance {
        source: path.to_path_buf(),
        weights,
        datasets: m.datasets.clone(),
        chunks: m.chunk_count,
    }))
}

/// `--algorithm gptq`: GPTQ on the --calib samples, with a progress bar.
fn gptq(
    model: &std::path::Path,
    calib: &std::path::Path,
    args: &ExportArgs,
    writer: &dyn kiln_runtime::export::writer::OutputWriter,
    err: &mut dyn Write,
) -> Result<Arc<dyn kiln_runtime::export::writer::ChosenCodes>> {
    use kiln_runtime::calibrate::gptq::GptqSettings;
    use kiln_runtime::export::writer::GptqStyle;
    if args.gptq_block_size == Some(0) {
        bail!("--gptq-block-size must be at least 1");
    }
    let settings = match writer.gptq_style() {
        Some(GptqStyle::MlxLm { group }) => {
            if args.gptq_block_size.is_some_and(|b| b != group) {
                bail!(
                    "--gptq-block-size: mlx-lm's GPTQ updates group by group (blocks of \
                     {group} here, the group size)"
                );
            }
            if args.gptq_actorder == Some(ActOrder::Static) {
                bail!("--gptq-actorder static: mlx-lm's GPTQ has no activation ordering");
            }
            GptqSettings {
                dampening: args.gptq_dampening,
                ..GptqSettings::mlx_lm(group)
            }
        }
        _ => GptqSettings {
            block: args.gptq_block_size.unwrap_or(128),
            dampening: args.gptq_dampening,
            actorder: args.gptq_actorder.unwrap_or(ActOrder::Static) == ActOrder::Static,
            sequential: true,
        },
    };
    if !(args.gptq_dampening >= 0.0 && args.gptq_dampening.is_finite()) {
        bail!("--gptq-dampening must be a finite fraction ≥ 0");
    }
    let options = CalibrationOptions {
        samples: args.calib_size,
        seq_len: args.calib_seq_len,
        dtype: args.calib_dtype.into(),
        device: args.device.device()?,
        ..CalibrationOptions::new(calib)
    };
    let calibration =
        Calibration::prepare(model, &args.recipe.recipe()?, options).context("--calib")?;
    writeln!(
        err,
        "GPTQ on {} samples ({} tokens) from {}",
        calibration.samples().len(),
        calibration.tokens(),
        calib.display()
    )?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} layers quantized by GPTQ")
            .expect("a valid template"),
    );
    let (codes, report) = calibration
        .gptq(writer, settings, |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64)
        })
        .with_context(|| format!("GPTQ of {}", model.display()))?;
    bar.finish_and_clear();
    for w in &report.warnings {
        writeln!(err, "warning: {w}")?;
    }
    for step in &report.steps {
        writeln!(err, "{step} in {:.2} s", report.seconds)?;
    }
    Ok(codes)
}

/// `5GB` (decimal, as transformers), `10GiB` (binary), `512MB`, `1024`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 5GB, 500MB or 10GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "KIB" => 1024.0,
        "MIB" => 1024.0 * 1024.0,
        "GIB" => 1024.0 * 1024.0 * 1024.0,
        _ => {
            return Err(format!(
                "`{s}`: unknown unit `{unit}` (B, KB, MB, GB, TB, KiB, MiB, GiB)"
            ));
        }
    };
    let bytes = n * mult;
    if bytes < 1.0 {
        return Err(format!("`{s}` is smaller than one byte"));
    }
    Ok(bytes as u64)
}

fn parse_alpha_step(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("`{s}` is not a step in (0, 1]")),
    }
}

/// `--calib`: the runtime's calibration for this recipe, with a progress bar.
fn calibrate(
    model: &std::path::Path,
    calib: &std::path::Path,
    args: &ExportArgs,
    rules: kiln_runtime::export::writer::StatisticsRules,
    err: &mut dyn Write,
) -> Result<ActAmax> {
    let options = CalibrationOptions {
        rules,
        samples: args.calib_size,
        seq_len: args.calib_seq_len,
        dtype: args.calib_dtype.into(),
        device: args.device.device()?,
        sq_alpha: args.sq_alpha,
        awq_alpha_step: args.awq_alpha_step,
        awq_clip: args.awq_clip,
        ..CalibrationOptions::new(calib)
    };
    let calibration =
        Calibration::prepare(model, &args.recipe.recipe()?, options).context("--calib")?;
    writeln!(
        err,
        "calibrating on {} samples ({} tokens) from {}",
        calibration.samples().len(),
        calibration.tokens(),
        calib.display()
    )?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} layers calibrated (every sample through one layer at a time)",
        )
        .expect("a valid template"),
    );
    let (act, report) = calibration
        .run(|done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64)
        })
        .with_context(|| format!("calibrating {}", model.display()))?;
    bar.finish_and_clear();
    for w in &report.warnings {
        writeln!(err, "warning: {w}")?;
    }
    writeln!(
        err,
        "calibrated {} quantizers in {:.2} s ({:.0} tokens/s)",
        report.quantizers,
        report.seconds,
        calibration.tokens() as f64 / report.seconds.max(1e-9)
    )?;
    for step in &report.steps {
        writeln!(err, "{step}")?;
    }
    Ok(act)
}

/// The model folder to use: the given one, or a freshly written demo (kept alive by the
/// returned guard) with its activation statistics.
fn model_dir(
    args: &RecipeArgs,
    err: &mut dyn Write,
) -> Result<(PathBuf, Option<tempfile::TempDir>, Option<ActAmax>)> {
    match &args.model {
        Some(m) => Ok((m.clone(), None, None)),
        None => {
            let dir =
                tempfile::tempdir().context("creating a temporary folder for the demo model")?;
            let act = write_demo_model(dir.path(), DemoConfig::default())
                .context("writing the demo model")?;
            writeln!(
                err,
                "no --model given: using kiln's built-in demo model (a random Llama, {})",
                dir.path().display()
            )?;
            Ok((dir.path().to_path_buf(), Some(dir), Some(act)))
        }
    }
}

pub fn export(args: &ExportArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    if args.calib.is_none() && !args.device.is_cpu() {
        bail!("--device runs calibration: it needs --calib");
    }
    let output = args.recipe.output()?;
    let recipe = args.recipe.recipe()?;
    let probe = args.recipe.writer()?;
    // Whether the writer stores scales from activation statistics.
    let statistics = recipe.kv_cache.is_some() || probe.uses_statistics();
    let engines = probe.engines();
    let gptq_run = args.algorithm == Algorithm::Gptq;
    if gptq_run {
        if args.calib.is_none() {
            bail!("--algorithm gptq quantizes against calibration data: it needs --calib FILE");
        }
        if probe.gptq_style().is_none() {
            bail!(
                "--algorithm gptq: the {} writer's `{}` has no GPTQ in kiln (compressed-tensors \
                 w4a16, w4a16-asym, w8a16 and nvfp4a16, and mlx q2, q4 and q8 have it)",
                output.writer,
                output.format
            );
        }
    }
    if !statistics && !gptq_run && (args.act_amax.is_some() || args.calib.is_some()) {
        bail!(
            "--act-amax and --calib give activation statistics, which the {} writer's `{}` \
             does not use",
            output.writer,
            output.format
        );
    }
    let (model, _demo, demo_act) = model_dir(&args.recipe, err)?;
    // --adapter: the base with the adapter merged, written once to a temporary folder (one
    // tensor in memory at a time), is what the export reads.
    let _merged;
    let model = match &args.adapter {
        Some(adapter) => {
            let base = kiln_runtime::checkpoint::Checkpoint::open(&model)
                .with_context(|| format!("opening {}", model.display()))?;
            let dir = tempfile::Builder::new()
                .prefix("kiln-merged-")
                .tempdir()
                .context("a temporary folder for the merged model")?;
            kiln_runtime::adapters::merge_checkpoint(&base, adapter, dir.path())
                .with_context(|| format!("merging the adapter {}", adapter.display()))?;
            writeln!(
                err,
                "merged the adapter {} into {}",
                adapter.display(),
                model.display()
            )?;
            let path = dir.path().to_path_buf();
            _merged = dir;
            path
        }
        None => model,
    };
    if args.calib.is_some() {
        // The whole plan against the format before calibration spends any time (the export
        // checks it again).
        let check = ExportOptions {
            output: Some(output.clone()),
            ..ExportOptions::new(&model, "", recipe.clone())
        };
        kiln_runtime::export::preflight::preflight(&check)?;
    }
    let codes = match (&args.calib, gptq_run) {
        (Some(calib), true) => Some(gptq(&model, calib, args, probe.as_ref(), err)?),
        _ => None,
    };
    let act = match (&args.act_amax, &args.calib) {
        (Some(path), _) => Some(ActAmax::read(path)?),
        (None, Some(_)) if gptq_run && !statistics => None,
        (None, Some(calib)) => Some(calibrate(
            &model,
            calib,
            args,
            probe.statistics_rules(),
            err,
        )?),
        (None, None) if statistics => demo_act,
        (None, None) => None,
    };
    // The demo's output goes to a kiln-owned folder under the temporary directory, replaced on
    // every run; a real model's output needs --out.
    let (out_dir, force) = match (&args.out, &args.recipe.model) {
        (Some(o), _) => (o.clone(), args.force),
        (None, None) => (
            std::env::temp_dir().join(if args.recipe.is_default_writer() {
                format!("kiln-demo-{}", output.format)
            } else {
                format!("kiln-demo-{}-{}", output.writer, output.format)
            }),
            true,
        ),
        (None, Some(_)) => bail!("--out is required with --model"),
    };
    let importance = args.imatrix.as_ref().map(|p| importance(p)).transpose()?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} modules {msg}")
            .expect("a valid template"),
    );
    let progress_bar = bar.clone();
    let options = ExportOptions {
        model,
        out: out_dir,
        recipe,
        act_amax: act,
        max_shard_bytes: args.max_shard_size,
        force,
        progress: Some(Arc::new(move |done, total, _path: &str| {
            progress_bar.set_length(total as u64);
            progress_bar.set_position(done as u64);
        })),
        cancel: Some(cancel_flag()),
        strict: args.strict,
        exporters: None,
        output: Some(output.clone()),
        codes,
        importance,
    };
    let result = run(&options);
    if matches!(result, Err(kiln_runtime::ExportError::Cancelled)) {
        bar.finish_and_clear();
        writeln!(
            err,
            "cancelled: nothing was written to {}",
            options.out.display()
        )?;
        return Ok(130);
    }
    bar.finish_and_clear();
    let summary = result?;
    for w in &summary.warnings {
        writeln!(err, "warning: {w}")?;
    }
    print_report(&summary, &output, out)?;
    writeln!(
        out,
        "engines: {}",
        kiln_runtime::export::engines::Line(&engines)
    )?;
    Ok(0)
}

fn print_report(s: &ExportSummary, output: &OutputFormat, out: &mut dyn Write) -> Result<()> {
    let secs = s.elapsed.as_secs_f64();
    writeln!(
        out,
        "exported {} ({}) as {} to {}",
        s.architecture,
        if s.generic_fallback {
            "generic tree"
        } else {
            "known family"
        },
        if output.writer == DEFAULT_WRITER {
            output.format.clone()
        } else {
            format!("{} {}", output.writer, output.format)
        },
        s.out.display()
    )?;
    if s.generic_fallback {
        writeln!(
            out,
            "warning: no family is registered for {}; the module tree was inferred from tensor names",
            s.architecture
        )?;
    }
    writeln!(out, "modules per exporter:")?;
    for (exporter, n) in &s.modules_per_exporter {
        writeln!(
            out,
            "  {:>5}  {}",
            n,
            exporter.as_deref().unwrap_or("(copied unchanged)")
        )?;
    }
    let mut per_format: BTreeMap<String, usize> = BTreeMap::new();
    for t in s.quantized.values() {
        *per_format.entry(t.clone()).or_default() += 1;
    }
    writeln!(
        out,
        "quantized modules: {} ({}); left unquantized: {}",
        s.quantized_modules,
        per_format
            .iter()
            .map(|(f, n)| format!("{f}: {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        if s.excluded.is_empty() {
            "none".to_string()
        } else {
            s.excluded.join(", ")
        }
    )?;
    for (format, e) in &s.errors {
        writeln!(
            out,
            "{format} error vs the original weights: max |Δ| {:.3e}, mean |Δ| {:.3e} over {} weights in {} modules",
            e.max_abs,
            e.mean_abs(),
            e.count,
            e.modules
        )?;
    }
    writeln!(
        out,
        "bytes in: {:.1} MB, out: {:.1} MB ({:.2}×); {:.2} s; {:.2} GB/s of input",
        s.bytes_in as f64 / 1e6,
        s.bytes_out as f64 / 1e6,
        s.bytes_out as f64 / s.bytes_in.max(1) as f64,
        secs,
        s.bytes_in as f64 / secs.max(1e-9) / 1e9
    )?;
    writeln!(out, "files: {}", s.files.join(", "))?;
    Ok(())
}

pub fn explain(args: &ExplainArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let (model, _demo, _) = model_dir(&args.recipe, err)?;
    let checkpoint = Checkpoint::open(&model)?;
    let (tree, architecture, fallback) = module_tree(&checkpoint)?;
    let recipe = args.recipe.recipe()?;
    let output = args.recipe.output()?;
    // What a quantized Linear becomes: the ModelOpt format, or another writer's format (whose
    // own rules choose each tensor's type).
    let target = if args.recipe.is_default_writer() {
        recipe.format.to_string()
    } else {
        format!("{} {}", output.writer, output.format)
    };
    let registry = ExporterRegistry::try_global().map_err(|e| anyhow::anyhow!("{e}"))?;
    // The plan only matches: no exporter runs, so any exporter can be explained.
    let report = plan(&tree, registry)?;
    writeln!(
        out,
        "{architecture}{}: {} modules, format {}",
        if fallback { " (generic tree)" } else { "" },
        tree.len(),
        target
    )?;
    for (path, outcome) in report.modules {
        let module = tree.find(&path).expect("walked modules exist");
        let name = if path.is_empty() {
            "(root)"
        } else {
            path.as_str()
        };
        let what = match outcome {
            ModuleOutcome::Exported { exporter, reason } => {
                let detail =
                    if module.class_chain().is::<Linear>() && exporter.ends_with("::QuantLinear") {
                        if recipe.quantizes(&path) {
                            format!(" → {target}")
                        } else {
                            " → excluded, copied unchanged".into()
                        }
                    } else {
                        String::new()
                    };
                format!("{exporter} ({reason}){detail}")
            }
            ModuleOutcome::Unchanged if module.tensors().is_empty() => continue,
            ModuleOutcome::Unchanged => "unchanged (no exporter matches)".into(),
        };
        writeln!(out, "{name} [{}]: {what}", module.class_name())?;
    }
    Ok(0)
}

#[derive(Debug, Args)]
pub struct DemoModelArgs {
    /// Where to write the model folder.
    #[arg(long)]
    out: PathBuf,
    /// The model's size.
    #[arg(long, value_enum, default_value_t = DemoSize::Small)]
    size: DemoSize,
    /// Replace an existing folder.
    #[arg(long)]
    force: bool,
}

/// `kiln demo-model`: a deterministic random Llama checkpoint plus `amax.json` (activation
/// statistics for `--act-amax`), for trying kiln and for the benchmarks.
pub fn demo_model(args: &DemoModelArgs, out: &mut dyn Write) -> Result<i32> {
    let config = DemoConfig::preset(args.size.preset()).expect("every --size is a preset");
    let dir = kiln_runtime::sink::OutputDir::create(&args.out, args.force)?;
    let act = write_demo_model(dir.path(), config)?;
    act.write(&dir.path().join("amax.json"))?;
    dir.commit()?;
    writeln!(
        out,
        "wrote a random LlamaForCausalLM with {} parameters to {} (activation amax for --act-amax in amax.json)",
        config.parameters(),
        args.out.display()
    )?;
    Ok(0)
}
