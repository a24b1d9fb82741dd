//! `kiln export` and `kiln explain`.

use anyhow::{Context, Result, bail};
use clap::Args;
use kiln_runtime::checkpoint::Checkpoint;
use kiln_runtime::demo::{DemoConfig, write_demo_model};
use kiln_runtime::export::act_amax::ActAmax;
use kiln_runtime::export::recipe::{Format, KvCache, Recipe};
use kiln_runtime::export::run::{ExportOptions, ExportSummary, module_tree, run};
use kiln_runtime::export::{ModuleOutcome, plan};
use kiln_runtime::model::awq::AwqWeight;
use kiln_runtime::{ExporterRegistry, Linear};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// A flag set by Ctrl-C (SIGINT): the export stops between modules and removes its partial
/// output instead of dying with it in place.
fn cancel_flag() -> Arc<std::sync::atomic::AtomicBool> {
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

/// What both commands take to choose the model and the recipe.
#[derive(Debug, Args)]
pub struct RecipeArgs {
    /// The Hugging Face model folder (config.json + safetensors). Without it, kiln builds a small
    /// random Llama-family demo model and uses it.
    #[arg(long)]
    model: Option<PathBuf>,
    /// The quantization format.
    #[arg(long, default_value = "nvfp4")]
    format: Format,
    /// Leave modules matching this glob unquantized (repeatable).
    #[arg(long, value_name = "GLOB")]
    exclude: Vec<String>,
    /// Quantize modules matching this glob even if excluded by default (repeatable).
    #[arg(long, value_name = "GLOB")]
    include: Vec<String>,
    /// Quantize the KV cache too (`fp8` or `nvfp4`).
    #[arg(long, value_name = "FORMAT")]
    kv_cache: Option<KvCache>,
}

impl RecipeArgs {
    fn recipe(&self) -> Recipe {
        Recipe {
            format: self.format,
            exclude: self.exclude.clone(),
            include: self.include.clone(),
            kv_cache: self.kv_cache,
        }
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
    /// Where --calib runs the model: `cpu`, `cuda[:N]` (feature `candle-cuda`) or
    /// `metal[:N]` (feature `candle-metal`).
    #[arg(long, default_value = "cpu", requires = "calib")]
    device: String,
    /// The dtype --calib runs the model in: `f32` (default; the most exact) or `bf16`
    /// (ModelOpt calibrates in the checkpoint's dtype, usually bf16: its MoE routing and AWQ
    /// choices are reproduced more closely).
    #[arg(long, default_value = "f32", requires = "calib", value_parser = ["f32", "bf16"])]
    calib_dtype: String,
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

/// `--calib-dtype` as a candle dtype.
fn calib_dtype(args: &ExportArgs) -> kiln_runtime::model::candle::DType {
    match args.calib_dtype.as_str() {
        "bf16" => kiln_runtime::model::candle::DType::BF16,
        _ => kiln_runtime::model::candle::DType::F32,
    }
}

fn parse_alpha_step(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("`{s}` is not a step in (0, 1]")),
    }
}

/// Max calibration of the model at `model` on `calib` (`--calib`): the activation amax of
/// every Linear input and of the attention keys and values, under ModelOpt's quantizer names.
fn calibrate(
    model: &std::path::Path,
    calib: &std::path::Path,
    args: &ExportArgs,
    err: &mut dyn Write,
) -> Result<ActAmax> {
    use kiln_runtime::export::recipe::Format;
    use kiln_runtime::model::MaxCalibrator;
    use kiln_runtime::model::calib::{
        calibrate_by_layer, model_tokenizer, read_samples_with, smoothquant_scales,
    };
    let recipe = args.recipe.recipe();
    let smoothquant = recipe.format == Format::Int8Sq;
    let tokenizer = model_tokenizer(model)?;
    let samples = read_samples_with(
        calib,
        args.calib_size,
        args.calib_seq_len,
        tokenizer.as_ref(),
    )
    .with_context(|| format!("--calib {}", calib.display()))?;
    let checkpoint = kiln_runtime::checkpoint::Checkpoint::open(model)?;
    let tokens: usize = samples.iter().map(Vec::len).sum();
    writeln!(
        err,
        "calibrating on {} samples ({tokens} tokens) from {}",
        samples.len(),
        calib.display()
    )?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} layers calibrated (every sample through one layer at a time)",
        )
        .expect("a valid template"),
    );
    let started = std::time::Instant::now();
    let awq = match recipe.format {
        Format::Int4Awq | Format::W4a8Awq => Some(AwqWeight::Int4 { group: 128 }),
        Format::Nvfp4Awq => Some(AwqWeight::Nvfp4),
        _ => None,
    };
    if let Some(quant) = awq {
        return awq_calibrate(&checkpoint, &samples, &recipe, quant, args, &bar, err)
            .with_context(|| format!("calibrating {}", model.display()));
    }
    let calibrator = if smoothquant {
        MaxCalibrator::default().with_channels()
    } else {
        MaxCalibrator::default()
    };
    // One layer's weights at a time: memory is bounded by a layer plus the activations.
    let amax = calibrate_by_layer(
        &checkpoint,
        calib_dtype(args),
        &kiln_runtime::model::device(&args.device)?,
        &samples,
        calibrator,
        |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64)
        },
    )
    .with_context(|| format!("calibrating {}", model.display()))?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    writeln!(
        err,
        "calibrated {} quantizers in {secs:.2} s ({:.0} tokens/s)",
        amax.amax().len(),
        tokens as f64 / secs.max(1e-9)
    )?;
    let mut act = ActAmax::from_values(amax.amax().iter().map(|(k, v)| (k.clone(), *v)));
    if let Some(channels) = amax.channels().filter(|_| smoothquant) {
        // SmoothQuant (ModelOpt's α = 1 unless --sq-alpha): per-channel scales from the
        // statistics, and the smoothed inputs' amax.
        let linears: Vec<String> = channels
            .keys()
            .filter(|m| recipe.quantizes(m))
            .cloned()
            .collect();
        for (module, scale, input) in
            smoothquant_scales(&checkpoint, channels, &linears, args.sq_alpha)?
        {
            act.set_pre_quant_scale(&module, scale);
            act.set_input(&module, input);
        }
        writeln!(
            err,
            "SmoothQuant (alpha {}): scales for {} Linears",
            args.sq_alpha,
            linears.len()
        )?;
    }
    Ok(act)
}

/// `--calib` for the AWQ formats: max calibration and AWQ's scale search in one layer-by-layer
/// pass. Every searched Linear gets `pre_quant_scale = 1/s`; the input-quantized formats also
/// get the amax of the smoothed input.
fn awq_calibrate(
    checkpoint: &kiln_runtime::checkpoint::Checkpoint,
    samples: &[Vec<u32>],
    recipe: &kiln_runtime::export::recipe::Recipe,
    quant: AwqWeight,
    args: &ExportArgs,
    bar: &indicatif::ProgressBar,
    err: &mut dyn Write,
) -> Result<ActAmax> {
    use kiln_runtime::export::recipe::Format;
    use kiln_runtime::model::awq::AwqCalibrator;
    use kiln_runtime::model::calib::calibrate_by_layer;
    let started = std::time::Instant::now();
    let tokens: usize = samples.iter().map(Vec::len).sum();
    let searched = {
        let recipe = recipe.clone();
        move |m: &str| recipe.quantizes(m)
    };
    let mut calibrator = AwqCalibrator::new(quant, args.awq_alpha_step, searched);
    if args.awq_clip {
        if recipe.format != Format::Int4Awq {
            bail!(
                "--awq-clip: the clipping search runs for int4-awq only, not {}",
                recipe.format
            );
        }
        calibrator = calibrator.with_clip_search()?;
    }
    let calib = calibrate_by_layer(
        checkpoint,
        calib_dtype(args),
        &kiln_runtime::model::device(&args.device)?,
        samples,
        calibrator,
        |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64)
        },
    )?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let act = calib.act_amax(checkpoint, recipe.format != Format::Int4Awq)?;
    let mut alphas: BTreeMap<String, usize> = BTreeMap::new();
    for found in calib.results().values() {
        *alphas.entry(format!("{:.2}", found.alpha)).or_default() += 1;
    }
    for module in calib.unexercised() {
        // ModelOpt: an expert no token reached keeps `pre_quant_scale = 1`.
        writeln!(
            err,
            "warning: awq: no calibration token reached `{module}`; its pre_quant_scale is 1"
        )?;
    }
    writeln!(
        err,
        "AWQ (awq_lite, alpha step {}): searched {} Linears on {tokens} tokens in {secs:.2} s; chosen alpha: {}",
        args.awq_alpha_step,
        calib.results().len(),
        alphas
            .iter()
            .map(|(a, n)| format!("{a} ×{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    )?;
    if args.awq_clip {
        let ratios: Vec<f32> = calib
            .results()
            .values()
            .filter_map(|f| f.clip_ratio.as_ref())
            .flatten()
            .copied()
            .collect();
        let clipped = ratios.iter().filter(|&&r| r < 1.0).count();
        writeln!(
            err,
            "AWQ clipping search: {clipped} of {} blocks clipped (mean ratio {:.3}); the export keeps them where it does not rescale the weight, as ModelOpt's does",
            ratios.len(),
            ratios.iter().map(|&r| f64::from(r)).sum::<f64>() / ratios.len().max(1) as f64
        )?;
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
    let (model, _demo, demo_act) = model_dir(&args.recipe, err)?;
    let act = match (&args.act_amax, &args.calib) {
        (Some(path), _) => Some(ActAmax::read(path)?),
        (None, Some(calib)) => Some(calibrate(&model, calib, args, err)?),
        (None, None) => demo_act,
    };
    // The demo's output goes to a kiln-owned folder under the temporary directory, replaced on
    // every run; a real model's output needs --out.
    let (out_dir, force) = match (&args.out, &args.recipe.model) {
        (Some(o), _) => (o.clone(), args.force),
        (None, None) => (
            std::env::temp_dir().join(format!("kiln-demo-{}", args.recipe.format)),
            true,
        ),
        (None, Some(_)) => bail!("--out is required with --model"),
    };
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} modules {msg}")
            .expect("a valid template"),
    );
    let progress_bar = bar.clone();
    let options = ExportOptions {
        model,
        out: out_dir,
        recipe: args.recipe.recipe(),
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
    print_report(&summary, args.recipe.format, out)?;
    Ok(0)
}

fn print_report(s: &ExportSummary, format: Format, out: &mut dyn Write) -> Result<()> {
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
        format,
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
    let mut per_format: BTreeMap<Format, usize> = BTreeMap::new();
    for f in s.quantized.values() {
        *per_format.entry(*f).or_default() += 1;
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
    let recipe = args.recipe.recipe();
    let registry = ExporterRegistry::try_global().map_err(|e| anyhow::anyhow!("{e}"))?;
    // The plan only matches: no exporter runs, so any exporter can be explained.
    let report = plan(&tree, registry)?;
    writeln!(
        out,
        "{architecture}{}: {} modules, format {}",
        if fallback { " (generic tree)" } else { "" },
        tree.len(),
        recipe.format
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
                            format!(" → {}", recipe.format)
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
    /// `small` (17M parameters), `254m` (the export benchmark's Llama), `1b` (the calibration
    /// benchmark's) or `8gb` (3.8B parameters).
    #[arg(long, default_value = "small")]
    size: String,
    /// Replace an existing folder.
    #[arg(long)]
    force: bool,
}

/// `kiln demo-model`: a deterministic random Llama checkpoint plus `amax.json` (activation
/// statistics for `--act-amax`), for trying kiln and for the benchmarks.
pub fn demo_model(args: &DemoModelArgs, out: &mut dyn Write) -> Result<i32> {
    let config = DemoConfig::preset(&args.size).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown --size `{}` (expected small, 254m, 1b or 8gb)",
            args.size
        )
    })?;
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
