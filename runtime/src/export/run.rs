//! One export, end to end (docs/DESIGN.md §4): open the checkpoint, build its module tree, check
//! the recipe's needs, walk the exporters into a temporary folder, write the JSON files, copy
//! the tokenizer, and move the folder into place. Any error leaves nothing at the target.

use super::act_amax::ActAmax;
use super::files;
use super::groups::input_group;
use super::recipe::Recipe;
use super::writer::{Encoding, OutputWriter};
use super::{ExportContext, ExportError, ExportReport, ModuleOutcome, walk};
use crate::checkpoint::Checkpoint;
use crate::export::registry::ExporterRegistry;
use crate::export::writers::WriterRegistry;
use crate::module_tree::{Embedding, Linear, ModuleTree};
use crate::sink::OutputDir;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to export, where.
#[derive(Clone)]
pub struct ExportOptions {
    /// The input model folder (never modified).
    pub model: PathBuf,
    /// The output folder.
    pub out: PathBuf,
    /// Format, exclusions and KV-cache settings.
    pub recipe: Recipe,
    /// Activation statistics, for formats that need them.
    pub act_amax: Option<ActAmax>,
    /// Tensor bytes per output shard (transformers' `max_shard_size`).
    pub max_shard_bytes: u64,
    /// Replace an existing `out`.
    pub force: bool,
    /// Called after each module.
    pub progress: Option<super::ProgressFn>,
    /// Set to stop the export (Ctrl-C); the partial output is removed.
    pub cancel: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Make warnings errors: statistics keys that name no quantizer, non-finite weights.
    pub strict: bool,
    /// The exporters to use; `None`: the registry the binary's `#[exporter]`s built.
    pub exporters: Option<Arc<ExporterRegistry>>,
    /// The writer (`--output-format`) and its format (`--format`); `None`: ModelOpt's, in
    /// the recipe's format.
    pub output: Option<OutputFormat>,
    /// Integer codes a calibration algorithm chose (GPTQ, `--algorithm gptq`); the writer
    /// stores them in place of its own rounding.
    pub codes: Option<Arc<dyn super::writer::ChosenCodes>>,
    /// Importance weights for the writer's own quantizer (`--imatrix`: llama.cpp's
    /// importance matrix, for the GGUF writer); refused by a writer that does not use them.
    pub importance: Option<Arc<super::writer::Importance>>,
}

/// A writer and one of its formats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutputFormat {
    /// The writer's registered name (`modelopt`, `gguf`, …).
    pub writer: String,
    /// One of its `--format` names.
    pub format: String,
}

impl ExportOptions {
    /// Exporting `model` to `out` with `recipe`: no activation statistics, 5 GB shards, no
    /// `--force`, not strict.
    pub fn new(model: impl Into<PathBuf>, out: impl Into<PathBuf>, recipe: Recipe) -> Self {
        ExportOptions {
            model: model.into(),
            out: out.into(),
            recipe,
            act_amax: None,
            max_shard_bytes: 5_000_000_000,
            force: false,
            progress: None,
            cancel: None,
            strict: false,
            exporters: None,
            output: None,
            codes: None,
            importance: None,
        }
    }
}

impl std::fmt::Debug for ExportOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportOptions")
            .field("model", &self.model)
            .field("out", &self.out)
            .field("recipe", &self.recipe)
            .field("max_shard_bytes", &self.max_shard_bytes)
            .field("force", &self.force)
            .finish_non_exhaustive()
    }
}

/// What an export did, for the report.
#[derive(Debug, Clone)]
pub struct ExportSummary {
    /// The output folder.
    pub out: PathBuf,
    /// The `config.json` architecture name.
    pub architecture: String,
    /// Set when no family claimed the architecture and the generic tree was used.
    pub generic_fallback: bool,
    /// What happened to each module.
    pub report: ExportReport,
    /// Modules per exporter type path (`None`: copied unchanged).
    pub modules_per_exporter: BTreeMap<Option<String>, usize>,
    /// Modules whose weights were quantized.
    pub quantized_modules: usize,
    /// Quantization error per written type or format (max / mean |w − dequant(w)|).
    pub errors: BTreeMap<String, super::stats::ErrorStats>,
    /// `exclude_modules`: the unquantized modules, summarised by prefix wildcards — derived
    /// from what the exporters declared, not from the recipe.
    pub excluded: Vec<String>,
    /// Each module (or tensor) written quantized, with what it was written as: the format the
    /// exporters declared (`fp8`, `nvfp4`, …) or the writer's own type (`Q6_K`,
    /// `affine4g64`, …).
    pub quantized: BTreeMap<String, String>,
    /// Input tensors holding NaN or ±Inf values, with their counts.
    pub nonfinite: BTreeMap<String, usize>,
    /// Everything kiln substituted or ignored, one line each (printed as warnings).
    pub warnings: Vec<String>,
    /// Tensor bytes read.
    pub bytes_in: u64,
    /// Tensor bytes written.
    pub bytes_out: u64,
    /// The files written, relative to `out`.
    pub files: Vec<String>,
    /// Wall time of the export.
    pub elapsed: Duration,
}

/// The module tree of `checkpoint`, its architecture name and whether the generic fallback
/// built it ([`crate::families::resolve`]).
pub fn module_tree(checkpoint: &Checkpoint) -> Result<(ModuleTree, String, bool), ExportError> {
    let r = crate::families::resolve(checkpoint)?;
    Ok((r.tree, r.architecture, r.generic_fallback))
}

/// Whether the model ties `lm_head` to the input embeddings: `tie_word_embeddings` is set,
/// or absent while the checkpoint has no `lm_head.weight` (transformers' default ties).
pub(crate) fn ties_lm_head(checkpoint: &Checkpoint) -> bool {
    match checkpoint
        .config()
        .raw()
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
    {
        Some(tied) => tied,
        None => checkpoint.tensor("lm_head.weight").is_none(),
    }
}

/// Tied-weight aliases to drop: `lm_head.weight` when `tie_word_embeddings` is set and it
/// equals `model.embed_tokens.weight` byte for byte (docs/FORMATS.md §4.1). A quantized `lm_head`
/// keeps both (its exporter writes it, not a copy).
fn tied_aliases(checkpoint: &Checkpoint) -> Result<BTreeSet<String>, ExportError> {
    let tied = checkpoint
        .config()
        .raw()
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (alias, canonical) = ("lm_head.weight", "model.embed_tokens.weight");
    let mut dropped = BTreeSet::new();
    if tied && checkpoint.tensor(alias).is_some() && checkpoint.tensor(canonical).is_some() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        checkpoint.read(alias, &mut a)?;
        checkpoint.read(canonical, &mut b)?;
        if a != b {
            return Err(ExportError::TiedWeightsDiffer {
                alias: alias.into(),
                canonical: canonical.into(),
            });
        }
        dropped.insert(alias.to_string());
    }
    Ok(dropped)
}

/// Checks, before writing anything, that every quantized Linear has the activation statistics
/// its format needs.
fn check_act_amax(tree: &ModuleTree, recipe: &Recipe, act: &ActAmax) -> Result<(), ExportError> {
    if !recipe.format.needs_input_scale() {
        return Ok(());
    }
    let missing: Vec<String> = tree
        .walk()
        .filter(|m| {
            m.class_chain().is::<Linear>()
                && m.tensor("weight").is_some()
                && recipe.quantizes(m.path())
        })
        .filter(|m| {
            // An expert that saw no calibration token is filled from its siblings by
            // `prepare_moe_inputs`; a projection no expert has statistics for is missing.
            if super::moe::in_iterable_expert(*m) {
                let list = m.parent().and_then(|e| e.parent());
                return list.is_some_and(|l| {
                    l.children()
                        .filter_map(|e| e.child(m.local_name()))
                        .all(|s| act.input(s.path()).is_none())
                });
            }
            // In shared-input groups one member's amax is enough (the max is taken).
            let group = if recipe.format.shares_input_amax() {
                input_group(*m, |p| recipe.quantizes(p))
            } else {
                vec![m.path().to_string()]
            };
            group.iter().all(|g| act.input(g).is_none())
        })
        .map(|m| format!("{}.input_quantizer", m.path()))
        .chain(super::experts::missing_input_amax(tree, recipe, act))
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(ExportError::MissingActAmax {
            format: recipe.format,
            quantizers: missing,
        })
    }
}

/// The AWQ / SmoothQuant smoothing plan (formats with pre-quant scales), computed in the
/// dtype of the model's Linear weights.
fn smoothing(
    checkpoint: &Checkpoint,
    tree: &ModuleTree,
    recipe: &Recipe,
    act: &ActAmax,
) -> Result<Option<super::smooth::SmoothPlan>, ExportError> {
    use super::smooth::SmoothPlan;
    let in_features = |m: &str| {
        checkpoint
            .tensor(&format!("{m}.weight"))
            .and_then(|t| t.shape.get(1).copied())
    };
    let out_features = |m: &str| {
        checkpoint
            .tensor(&format!("{m}.weight"))
            .and_then(|t| t.shape.first().copied())
    };
    let dtype = tree
        .walk()
        .filter(|m| m.class_chain().is::<Linear>() && recipe.quantizes(m.path()))
        .find_map(|m| checkpoint.tensor(&format!("{}.weight", m.path())))
        .map(|t| t.dtype);
    match dtype {
        Some(safetensors::Dtype::F16) => {
            SmoothPlan::build::<half::f16>(tree, recipe, act, in_features, out_features)
        }
        Some(safetensors::Dtype::F32) => {
            SmoothPlan::build::<f32>(tree, recipe, act, in_features, out_features)
        }
        _ => SmoothPlan::build::<half::bf16>(tree, recipe, act, in_features, out_features),
    }
}

/// A writer chosen for an export: its name and format, its `--format` names, the writer.
pub(crate) type Chosen = (OutputFormat, Vec<String>, Box<dyn OutputWriter>);

/// The writer `options` export through, made from the registry (ModelOpt's in the recipe's
/// format when no output is named): its name, its `--format` names and the writer.
pub(crate) fn writer_of(options: &ExportOptions) -> Result<Chosen, ExportError> {
    let registry =
        WriterRegistry::try_global().map_err(|e| ExportError::InvalidRegistry(e.clone()))?;
    let output = options.output.clone().unwrap_or_else(|| OutputFormat {
        writer: "modelopt".into(),
        format: options.recipe.format.cli_name().into(),
    });
    let entry = registry.get(&output.writer)?;
    let mut writer = entry.make(&output.format)?;
    super::writer::configure(
        writer.as_mut(),
        &output.writer,
        &output.format,
        options.recipe.group_size,
    )?;
    let formats = (entry.formats)()
        .iter()
        .map(|(f, _)| f.to_string())
        .collect();
    Ok((output, formats, writer))
}

/// Runs one export: the same walk and exporters for every writer (docs/DESIGN.md §7). A writer
/// without an encoder of its own ([`Encoding::Shared`]) gets ModelOpt's scale rules: the
/// recipe's statistics checks and its AWQ / SmoothQuant smoothing; a writer with one refuses
/// in `begin` what it cannot express.
pub fn run(options: &ExportOptions) -> Result<ExportSummary, ExportError> {
    // Every quantized module against the format, before any work.
    super::preflight::preflight(options)?;
    let (output, formats, mut writer) = writer_of(options)?;
    let shared = match writer.encoding() {
        Encoding::Shared(format) => Some(format),
        Encoding::Own => None,
    };
    if let Some(format) = shared
        && format != options.recipe.format
    {
        return Err(ExportError::Writer {
            writer: output.writer.clone(),
            what: format!(
                "--format `{}` disagrees with the recipe's `{}`",
                output.format, options.recipe.format
            ),
        });
    }
    let started = Instant::now();
    let recipe = &options.recipe;
    let checkpoint = Arc::new(Checkpoint::open(&options.model)?);
    let (tree, architecture, generic_fallback) = module_tree(&checkpoint)?;
    let (act, mut warnings) = bind_statistics(options, &tree)?;
    if options.act_amax.is_some() && !writer.uses_statistics() && recipe.kv_cache.is_none() {
        return Err(ExportError::WriterCannot {
            writer: output.writer.clone(),
            what: format!(
                "activation statistics (--act-amax, --calib): `{}` stores no activation or \
                 KV-cache scale",
                output.format
            ),
            supported: formats,
        });
    }
    if let Some(i) = &options.importance
        && !writer.uses_importance()
    {
        return Err(ExportError::WriterCannot {
            writer: output.writer.clone(),
            what: format!(
                "an importance matrix (--imatrix {}): `{}` does not weight its rounding by one",
                i.source.display(),
                output.format
            ),
            supported: vec!["--output-format gguf".into()],
        });
    }
    let smoothing = match shared {
        Some(_) => {
            check_act_amax(&tree, recipe, &act)?;
            smoothing(&checkpoint, &tree, recipe, &act)?
        }
        None => None,
    };
    let dropped = tied_aliases(&checkpoint)?;
    let out = OutputDir::create(&options.out, options.force)?;
    writer.begin(&super::writer::WriterStart {
        out: out.path(),
        model: &options.model,
        checkpoint: &checkpoint,
        tree: &tree,
        architecture: &architecture,
        recipe,
        max_shard_bytes: options.max_shard_bytes,
        statistics: &act,
        codes: options.codes.as_ref(),
        importance: options.importance.as_ref(),
    })?;
    let ctx = ExportContext::for_export(
        checkpoint.clone(),
        recipe.clone(),
        act,
        (&output.writer, formats),
        writer,
        dropped,
    )
    .with_smoothing(smoothing);
    let ctx = with_hooks(ctx, options);
    let nonfinite = walk_all(options, &tree, &ctx, &mut warnings)?;
    let bytes_out = ctx.bytes_out();
    let (mut done, report) = ctx.finish()?;
    warnings.extend(report.warnings.iter().map(|(m, w)| format!("`{m}`: {w}")));
    let files = done.writer.finish(&super::writer::WriterEnd {
        out: out.path(),
        model: &options.model,
        checkpoint: &checkpoint,
        written: &done.written_as,
        declared: &done.declared,
        tree: &tree,
        recipe,
    })?;
    warnings.extend(done.writer.warnings());
    let out_path = out.commit()?;
    let written: BTreeSet<String> = done.written_as.keys().cloned().collect();
    let excluded = unquantized_summary(&checkpoint, &tree, &written);
    Ok(ExportSummary {
        out: out_path,
        architecture,
        generic_fallback,
        modules_per_exporter: count_per_exporter(&tree, &report),
        report,
        quantized_modules: done.written_as.len(),
        quantized: done.written_as,
        errors: done.errors,
        nonfinite,
        warnings,
        excluded,
        bytes_in: checkpoint.data_bytes(),
        bytes_out,
        files,
        elapsed: started.elapsed(),
    })
}

/// What an export left unquantized, as ModelOpt's `exclude_modules` summarises it: every
/// module ModelOpt gives a quantizer (Linears, Embeddings, routers with a weight, a tied
/// `lm_head`, which has no tensor on disk but is a module in memory, and modules a plugin
/// declared) that was not written quantized, by prefix wildcards (docs/FORMATS.md §4.1).
/// Copied tensors a writer quantized itself (`model.embed_tokens` as GGUF's `Q4_K`) count as
/// quantized.
pub(crate) fn unquantized_summary(
    checkpoint: &Checkpoint,
    tree: &ModuleTree,
    quantized: &BTreeSet<String>,
) -> Vec<String> {
    let mut recorded = quantizable_modules(tree);
    if ties_lm_head(checkpoint) && tree.find("lm_head").is_none() {
        recorded.insert("lm_head".into());
    }
    recorded.extend(quantized.iter().cloned());
    let unquantized: BTreeSet<String> = recorded.difference(quantized).cloned().collect();
    files::exclude_summary(&unquantized, quantized)
}

/// Writes `value` as JSON with `indent` spaces, as transformers and ModelOpt do.
pub(crate) fn write_json(path: &Path, value: &Value, indent: usize) -> Result<(), ExportError> {
    let mut buf = Vec::new();
    let pad = vec![b' '; indent];
    let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, fmt);
    serde::Serialize::serialize(value, &mut ser).map_err(|e| crate::sink::SinkError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })?;
    buf.push(b'\n');
    std::fs::write(path, buf).map_err(|source| {
        crate::sink::SinkError::Io {
            path: path.to_path_buf(),
            source,
        }
        .into()
    })
}

/// Every Linear and Embedding, and routers with a weight (GPT-OSS's `GptOssTopKRouter`): the
/// modules ModelOpt gives a quantizer, whose unquantized ones the report and the configs list.
pub(crate) fn quantizable_modules(tree: &ModuleTree) -> BTreeSet<String> {
    tree.walk()
        .filter(|m| {
            m.class_chain().is::<Linear>()
                || m.class_chain().is::<Embedding>()
                || (m.class_name().ends_with("Router") && m.tensor("weight").is_some())
        })
        .map(|m| m.path().to_string())
        .collect()
}

/// Modules per exporter type path (`None`: copied unchanged), counting only modules with data.
fn count_per_exporter(tree: &ModuleTree, report: &ExportReport) -> BTreeMap<Option<String>, usize> {
    let mut per = BTreeMap::new();
    for (path, outcome) in &report.modules {
        let key = match outcome {
            ModuleOutcome::Exported { exporter, .. } => Some(exporter.clone()),
            ModuleOutcome::Unchanged if tree.find(path).is_some_and(|m| m.tensors().is_empty()) => {
                continue;
            }
            ModuleOutcome::Unchanged => None,
        };
        *per.entry(key).or_insert(0) += 1;
    }
    per
}

/// The export's activation statistics bound to the tree, and the warning for keys that name
/// no quantizer (an error with `--strict`).
fn bind_statistics(
    options: &ExportOptions,
    tree: &ModuleTree,
) -> Result<(super::act_amax::ActAmax, Vec<String>), ExportError> {
    let (act, binding) = options.act_amax.clone().unwrap_or_default().bind(tree);
    let mut warnings = Vec::new();
    if !binding.unknown.is_empty() {
        let source = act.source().map_or_else(
            || PathBuf::from("the activation statistics"),
            Path::to_path_buf,
        );
        if options.strict {
            return Err(ExportError::UnknownStatistics {
                file: source,
                keys: binding.unknown,
            });
        }
        warnings.push(format!(
            "{}: {} key(s) name no quantizer of this model and were ignored: {}",
            source.display(),
            binding.unknown.len(),
            binding.unknown.join(", ")
        ));
    }
    Ok((act, warnings))
}

/// The progress callback and Ctrl-C flag of `options` on `ctx`.
fn with_hooks(mut ctx: ExportContext, options: &ExportOptions) -> ExportContext {
    if let Some(p) = &options.progress {
        ctx = ctx.with_progress(p.clone());
    }
    if let Some(c) = &options.cancel {
        ctx = ctx.with_cancel(c.clone());
    }
    ctx
}

/// Walks the tree with the export's exporters; returns the input tensors holding NaN / Inf
/// (an error with `--strict`, else one warning each).
fn walk_all(
    options: &ExportOptions,
    tree: &ModuleTree,
    ctx: &ExportContext,
    warnings: &mut Vec<String>,
) -> Result<BTreeMap<String, usize>, ExportError> {
    let registry = match &options.exporters {
        Some(r) => r.as_ref(),
        None => {
            ExporterRegistry::try_global().map_err(|e| ExportError::InvalidRegistry(e.clone()))?
        }
    };
    walk(tree, registry, ctx)?;
    let nonfinite = ctx.nonfinite();
    if options.strict && !nonfinite.is_empty() {
        return Err(ExportError::NonFinite {
            tensors: nonfinite.into_iter().collect(),
        });
    }
    for (tensor, n) in &nonfinite {
        warnings.push(format!(
            "`{tensor}` holds {n} NaN/Inf value(s); they are exported as the format encodes them (--strict refuses)"
        ));
    }
    Ok(nonfinite)
}
