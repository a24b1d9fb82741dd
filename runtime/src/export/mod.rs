//! The exporter hooks, the per-call export context, and the module walk.
//!
//! An export call creates one [`ExportContext`], walks the module tree in pre-order, calls
//! `prepare_moe_inputs` for every MoE block whose experts container an exporter takes, then
//! `export` for every module with the first matching exporter (DESIGN.md §4). Exporters are
//! constructed once per call, on first use; nothing about an export outlives the call.

pub mod act_amax;
pub mod experts;
pub mod files;
pub mod linear;
pub mod moe;
pub mod recipe;
pub mod run;
pub mod smooth;
pub mod stats;

use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::module_tree::{ModuleRef, ModuleTree};
use crate::registry::exporters::ExporterRegistry;
use crate::sink::{ShardWriter, SinkError};
use act_amax::ActAmax;
use rayon::prelude::*;
use recipe::{Format, Recipe};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

/// An error raised by an exporter or by the walk, naming the module involved.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// An MoE block whose experts container no exporter takes (ModelOpt:
    /// `NotImplementedError("MoE model with experts type … not supported")`).
    #[error(
        "MoE block `{block}`: no exporter takes its experts container (class {experts_class}); register one"
    )]
    UnsupportedMoe {
        /// The MoE block's path.
        block: String,
        /// The class of its experts container.
        experts_class: String,
    },
    /// An exporter failed on a module.
    #[error("module `{module}`: {message}")]
    Module {
        /// The module's path.
        module: String,
        /// What is wrong.
        message: String,
    },
    /// The exporter registry is invalid.
    #[error(transparent)]
    InvalidRegistry(#[from] crate::registry::RegistryError),
    /// Reading the input checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Writing the output failed.
    #[error(transparent)]
    Sink(#[from] SinkError),
    /// A kernel refused a tensor.
    #[error("tensor `{tensor}`: {source}")]
    Kernel {
        /// The tensor at fault.
        tensor: String,
        /// The underlying error.
        source: kiln_kernels::KernelError,
    },
    /// The format needs activation statistics that were not given.
    #[error("{format} needs activation scales, and none are given for {}{} (pass --act-amax FILE or --calib FILE)",
        quantizers.iter().take(3).map(|m| format!("`{m}`")).collect::<Vec<_>>().join(", "),
        if quantizers.len() > 3 { format!(" and {} more", quantizers.len() - 3) } else { String::new() })]
    MissingActAmax {
        /// The quantization format.
        format: Format,
        /// The input quantizers lacking statistics, by ModelOpt's names
        /// (`<linear>.input_quantizer`, `<experts>.gate_up_proj_input_quantizer`).
        quantizers: Vec<String>,
    },
    /// The export was cancelled (Ctrl-C); nothing was left at the target.
    #[error("cancelled; no output was written")]
    Cancelled,
    /// A tensor's dtype cannot be quantized.
    #[error("tensor `{tensor}`: dtype {dtype:?} cannot be quantized (expected BF16, F16 or F32)")]
    Dtype {
        /// The tensor at fault.
        tensor: String,
        /// The element type.
        dtype: safetensors::Dtype,
    },
    /// The architecture could not be built, or the request cannot be met.
    #[error("{0}")]
    Invalid(String),
}

/// The two hooks of an exporter. Both default to doing nothing.
pub trait ModuleExporter: Send + Sync {
    /// Called once per MoE block whose experts container this exporter matched, before any
    /// `export`: fill missing expert input statistics and the like.
    fn prepare_moe_inputs(
        &self,
        name: &str,
        moe_block: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, moe_block, ctx);
        Ok(())
    }

    /// Emits the module's output into `ctx`.
    fn export(
        &self,
        name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        let _ = (name, module, ctx);
        Ok(())
    }
}

/// What happened to one module during the walk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModuleOutcome {
    /// Exported by the exporter with this type path, matched for this reason.
    Exported {
        /// The exporter's type path.
        exporter: String,
        /// Why it matched.
        reason: String,
    },
    /// No exporter matched: the module is kept as it is.
    Unchanged,
}

/// The record of one export call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Every module visited, in walk order.
    pub modules: Vec<(String, ModuleOutcome)>,
    /// MoE blocks prepared, in walk order, with the exporter that prepared them.
    pub moe_prepared: Vec<(String, String)>,
    /// Free-form notes exporters left, per module.
    pub notes: Vec<(String, String)>,
}

impl ExportReport {
    /// Modules per exporter type path (`None` = unchanged), sorted.
    pub fn counts(&self) -> BTreeMap<Option<&str>, usize> {
        let mut counts = BTreeMap::new();
        for (_, o) in &self.modules {
            let k = match o {
                ModuleOutcome::Exported { exporter, .. } => Some(exporter.as_str()),
                ModuleOutcome::Unchanged => None,
            };
            *counts.entry(k).or_default() += 1;
        }
        counts
    }
}

/// The state of one export call. Shared by reference with every hook, so exporters may run
/// in parallel; created per call and dropped after it. A bare context ([`ExportContext::new`])
/// only records the walk; one made with [`ExportContext::for_export`] also reads the checkpoint
/// and writes the output.
#[derive(Default)]
pub struct ExportContext {
    report: Mutex<ExportReport>,
    job: Option<std::sync::Arc<Job>>,
    progress: Option<ProgressFn>,
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// A module's context (see [`ExportContext::for_module`]) holds what the module emits
    /// until the walk writes it, in module order.
    capture: Option<Mutex<Captured>>,
}

/// What one module's export produced, held until it is written in module order.
#[derive(Default)]
struct Captured {
    tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>,
    errors: Vec<(Format, stats::ErrorStats)>,
}

/// Called after each module of the walk with (modules done, modules in total, module path).
pub type ProgressFn = std::sync::Arc<dyn Fn(usize, usize, &str) + Send + Sync>;

impl std::fmt::Debug for ExportContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportContext")
            .field("report", &self.report)
            .field("exporting", &self.job.is_some())
            .finish()
    }
}

struct Job {
    checkpoint: std::sync::Arc<Checkpoint>,
    recipe: Recipe,
    act: Mutex<ActAmax>,
    writer: Mutex<ShardWriter>,
    /// Output tensors not written: aliases of tied weights (FORMATS.md §4.1).
    dropped: BTreeSet<String>,
    /// AWQ / SmoothQuant smoothing, for formats with pre-quant scales.
    smooth: Option<smooth::SmoothPlan>,
    /// Module → format, for every module quantized.
    quantized: Mutex<BTreeMap<String, Format>>,
    /// Weight amax by tensor name, computed once.
    weight_amax: Mutex<HashMap<String, f32>>,
    /// Quantization error per format.
    errors: Mutex<BTreeMap<Format, stats::ErrorStats>>,
    bytes_out: Mutex<u64>,
}

impl ExportContext {
    /// A fresh context for one walk that records what happens and writes nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// A context for exporting `checkpoint` with `recipe` into `writer`; `dropped` names
    /// output tensors to leave out (tied-weight aliases).
    pub fn for_export(
        checkpoint: std::sync::Arc<Checkpoint>,
        recipe: Recipe,
        act: ActAmax,
        writer: ShardWriter,
        dropped: BTreeSet<String>,
    ) -> Self {
        ExportContext {
            report: Mutex::default(),
            progress: None,
            cancel: None,
            capture: None,
            job: Some(std::sync::Arc::new(Job {
                checkpoint,
                recipe,
                act: Mutex::new(act),
                writer: Mutex::new(writer),
                dropped,
                smooth: None,
                quantized: Mutex::default(),
                weight_amax: Mutex::default(),
                errors: Mutex::default(),
                bytes_out: Mutex::default(),
            })),
        }
    }

    /// Smooths Linears and folds norms by `plan` (AWQ / SmoothQuant formats).
    pub fn with_smoothing(mut self, plan: Option<smooth::SmoothPlan>) -> Self {
        if let Some(job) = self.job.as_mut().and_then(std::sync::Arc::get_mut) {
            job.smooth = plan;
        }
        self
    }

    /// A context for exporting one module alongside others: it shares this export's state
    /// but holds the module's output, which [`ExportContext::write_captured`] writes later.
    fn for_module(&self) -> ExportContext {
        ExportContext {
            report: Mutex::default(),
            job: self.job.clone(),
            progress: None,
            cancel: None,
            capture: Some(Mutex::default()),
        }
    }

    /// Writes what a module context captured (its tensors, error statistics and notes).
    fn write_captured(&self, module: ExportContext) -> Result<(), ExportError> {
        let captured = module
            .capture
            .map(|c| c.into_inner().unwrap_or_else(|p| p.into_inner()))
            .unwrap_or_default();
        for (name, dtype, shape, data) in captured.tensors {
            self.emit(&name, dtype, &shape, &data)?;
        }
        for (format, e) in captured.errors {
            self.record_error(format, &e)?;
        }
        let notes = module
            .report
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .notes;
        lock(&self.report).notes.extend(notes);
        Ok(())
    }

    /// How the Linear at `module` is smoothed, for formats with pre-quant scales.
    pub fn smoothing(&self, module: &str) -> Option<&smooth::LinearSmoothing> {
        self.job
            .as_ref()
            .and_then(|j| j.smooth.as_ref())
            .and_then(|p| p.linear(module))
    }

    /// Stops the walk with [`ExportError::Cancelled`] once `flag` is set (checked between modules).
    pub fn with_cancel(mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) -> Self {
        self.cancel = Some(flag);
        self
    }

    fn cancelled(&self) -> bool {
        self.cancel
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Reports progress through `f` after each module of the walk.
    pub fn with_progress(mut self, f: ProgressFn) -> Self {
        self.progress = Some(f);
        self
    }

    fn job(&self) -> Result<&Job, ExportError> {
        self.job.as_deref().ok_or_else(|| {
            ExportError::Invalid("this export context has no checkpoint or output".into())
        })
    }

    /// Whether this context reads a checkpoint and writes an output.
    pub fn is_exporting(&self) -> bool {
        self.job.is_some()
    }

    /// The input checkpoint.
    pub fn checkpoint(&self) -> Result<&Checkpoint, ExportError> {
        Ok(&self.job()?.checkpoint)
    }

    /// The export's recipe.
    pub fn recipe(&self) -> Result<&Recipe, ExportError> {
        Ok(&self.job()?.recipe)
    }

    /// The input amax of the Linear at `module`, if known.
    pub fn input_amax(&self, module: &str) -> Result<Option<f32>, ExportError> {
        Ok(lock(&self.job()?.act).input(module))
    }

    /// Sets the input amax of the Linear at `module` (MoE preparation).
    pub fn set_input_amax(&self, module: &str, amax: f32) -> Result<(), ExportError> {
        lock(&self.job()?.act).set_input(module, amax);
        Ok(())
    }

    /// The given block amax of the weight of the Linear at `module` (AWQ's clipping search).
    pub fn given_weight_amax(&self, module: &str) -> Result<Option<Vec<f32>>, ExportError> {
        Ok(lock(&self.job()?.act)
            .weight_amax(module)
            .map(<[f32]>::to_vec))
    }

    /// The amax of the quantizer with ModelOpt's module name `quantizer`, if known.
    pub fn quantizer_amax(&self, quantizer: &str) -> Result<Option<f32>, ExportError> {
        Ok(lock(&self.job()?.act).quantizer(quantizer))
    }

    /// The K or V amax of an attention module.
    pub fn kv_amax(&self, attention: &str, which: char) -> Result<Option<f32>, ExportError> {
        Ok(lock(&self.job()?.act).kv(attention, which))
    }

    /// Writes one output tensor (skipped when it is a dropped alias).
    pub fn emit(
        &self,
        name: &str,
        dtype: safetensors::Dtype,
        shape: &[usize],
        data: &[u8],
    ) -> Result<(), ExportError> {
        let job = self.job()?;
        if job.dropped.contains(name) {
            return Ok(());
        }
        if self.capture.is_some() {
            return self.emit_owned(name, dtype, shape, data.to_vec());
        }
        lock(&job.writer).write(name, dtype, shape, data)?;
        *lock(&job.bytes_out) += data.len() as u64;
        Ok(())
    }

    /// [`ExportContext::emit`] of a buffer the caller gives up: a module context keeps it
    /// without copying it (embeddings and other copied tensors are the largest outputs).
    fn emit_owned(
        &self,
        name: &str,
        dtype: safetensors::Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<(), ExportError> {
        let job = self.job()?;
        if job.dropped.contains(name) {
            return Ok(());
        }
        match &self.capture {
            Some(c) => lock(c)
                .tensors
                .push((name.to_string(), dtype, shape.to_vec(), data)),
            None => {
                lock(&job.writer).write(name, dtype, shape, &data)?;
                *lock(&job.bytes_out) += data.len() as u64;
            }
        }
        Ok(())
    }

    /// Copies input tensor `name` to the output unchanged.
    pub fn copy_tensor(&self, name: &str) -> Result<(), ExportError> {
        let job = self.job()?;
        if job.dropped.contains(name) {
            return Ok(());
        }
        let meta = job
            .checkpoint
            .tensor(name)
            .ok_or_else(|| ExportError::Invalid(format!("no tensor `{name}` in the checkpoint")))?;
        if let Some(factor) = job.smooth.as_ref().and_then(|p| p.norm_factor(name)) {
            // A norm absorbing its Linears' AWQ scale (FORMATS.md §4.2).
            let shape = meta.shape.clone();
            let folded: Vec<u8> = match meta.dtype {
                safetensors::Dtype::BF16 => bytemuck::cast_slice(&smooth::fold_norm(
                    &job.checkpoint.read_as::<half::bf16>(name)?,
                    factor,
                ))
                .to_vec(),
                safetensors::Dtype::F16 => bytemuck::cast_slice(&smooth::fold_norm(
                    &job.checkpoint.read_as::<half::f16>(name)?,
                    factor,
                ))
                .to_vec(),
                safetensors::Dtype::F32 => bytemuck::cast_slice(&smooth::fold_norm(
                    &job.checkpoint.read_as::<f32>(name)?,
                    factor,
                ))
                .to_vec(),
                dtype => {
                    return Err(ExportError::Dtype {
                        tensor: name.to_string(),
                        dtype,
                    });
                }
            };
            if shape.iter().product::<usize>() != factor.len() {
                return Err(ExportError::Invalid(format!(
                    "norm `{name}` {shape:?} cannot absorb a scale of {} channels",
                    factor.len()
                )));
            }
            return self.emit_owned(name, meta.dtype, &shape, folded);
        }
        let mut buf = Vec::new();
        job.checkpoint.read(name, &mut buf)?;
        self.emit_owned(name, meta.dtype, &meta.shape.clone(), buf)
    }

    /// Copies every tensor `module` owns unchanged.
    pub fn copy_module(&self, module: ModuleRef<'_>) -> Result<(), ExportError> {
        for t in module.tensors() {
            self.copy_tensor(&full_name(module.path(), &t.name))?;
        }
        Ok(())
    }

    /// Records max |w| of input tensor `name`, computed by a caller that holds its values (so
    /// [`ExportContext::weight_amax`] need not read it again).
    pub fn remember_weight_amax(&self, name: &str, amax: f32) -> Result<(), ExportError> {
        lock(&self.job()?.weight_amax).insert(name.to_string(), amax);
        Ok(())
    }

    /// max |w| of input tensor `name`, computed once per export.
    pub fn weight_amax(&self, name: &str) -> Result<f32, ExportError> {
        let job = self.job()?;
        if let Some(&a) = lock(&job.weight_amax).get(name) {
            return Ok(a);
        }
        let c = &job.checkpoint;
        let meta = c
            .tensor(name)
            .ok_or_else(|| ExportError::Invalid(format!("no tensor `{name}` in the checkpoint")))?;
        let amax = match meta.dtype {
            safetensors::Dtype::BF16 => kiln_kernels::cpu::amax(&c.read_as::<half::bf16>(name)?),
            safetensors::Dtype::F16 => kiln_kernels::cpu::amax(&c.read_as::<half::f16>(name)?),
            safetensors::Dtype::F32 => kiln_kernels::cpu::amax(&c.read_as::<f32>(name)?),
            dtype => {
                return Err(ExportError::Dtype {
                    tensor: name.to_string(),
                    dtype,
                });
            }
        };
        lock(&job.weight_amax).insert(name.to_string(), amax);
        Ok(amax)
    }

    /// max |W| of the Linear at `module` after its AWQ / SmoothQuant smoothing (its raw max
    /// when it is not smoothed), computed once per export.
    pub fn smoothed_weight_amax(&self, module: &str) -> Result<f32, ExportError> {
        let name = full_name(module, "weight");
        let Some(s) = self.smoothing(module) else {
            return self.weight_amax(&name);
        };
        let job = self.job()?;
        let key = format!("{name}#smoothed");
        if let Some(&a) = lock(&job.weight_amax).get(&key) {
            return Ok(a);
        }
        let c = &job.checkpoint;
        let meta = c
            .tensor(&name)
            .ok_or_else(|| ExportError::Invalid(format!("no tensor `{name}` in the checkpoint")))?;
        let cols = meta.shape.get(1).copied().unwrap_or(1).max(1);
        let amax = match meta.dtype {
            safetensors::Dtype::BF16 => {
                kiln_kernels::cpu::amax(&s.apply(&c.read_as::<half::bf16>(&name)?, cols))
            }
            safetensors::Dtype::F16 => {
                kiln_kernels::cpu::amax(&s.apply(&c.read_as::<half::f16>(&name)?, cols))
            }
            safetensors::Dtype::F32 => {
                kiln_kernels::cpu::amax(&s.apply(&c.read_as::<f32>(&name)?, cols))
            }
            dtype => {
                return Err(ExportError::Dtype {
                    tensor: name,
                    dtype,
                });
            }
        };
        lock(&job.weight_amax).insert(key, amax);
        Ok(amax)
    }

    /// Records that `module` was quantized to `format` (for `hf_quant_config.json`).
    pub fn record_quantized(&self, module: &str, format: Format) -> Result<(), ExportError> {
        lock(&self.job()?.quantized).insert(module.to_string(), format);
        Ok(())
    }

    /// Adds one module's quantization error to its format's statistics.
    pub fn record_error(
        &self,
        format: Format,
        stats: &stats::ErrorStats,
    ) -> Result<(), ExportError> {
        if let Some(c) = &self.capture {
            lock(c).errors.push((format, *stats));
            return Ok(());
        }
        lock(&self.job()?.errors)
            .entry(format)
            .or_default()
            .merge(stats);
        Ok(())
    }

    /// Quantization error per format so far.
    pub fn errors(&self) -> BTreeMap<Format, stats::ErrorStats> {
        self.job
            .as_ref()
            .map(|j| lock(&j.errors).clone())
            .unwrap_or_default()
    }

    /// Every module quantized so far, with its format.
    pub fn quantized(&self) -> BTreeMap<String, Format> {
        self.job
            .as_ref()
            .map(|j| lock(&j.quantized).clone())
            .unwrap_or_default()
    }

    /// Bytes written so far.
    pub fn bytes_out(&self) -> u64 {
        self.job.as_ref().map_or(0, |j| *lock(&j.bytes_out))
    }

    /// Takes the shard writer out to finish it (ends the export's writing).
    pub fn finish_writer(self) -> Result<(ShardWriter, ExportReport), ExportError> {
        let report = self.report.into_inner().unwrap_or_else(|p| p.into_inner());
        let job = self
            .job
            .and_then(|j| std::sync::Arc::try_unwrap(j).ok())
            .ok_or_else(|| ExportError::Invalid("no output to finish".into()))?;
        Ok((
            job.writer.into_inner().unwrap_or_else(|p| p.into_inner()),
            report,
        ))
    }

    /// Leaves a note about `module` in the report.
    pub fn note(&self, module: &str, message: impl Into<String>) {
        lock(&self.report)
            .notes
            .push((module.to_string(), message.into()));
    }

    /// A copy of the report so far.
    pub fn report(&self) -> ExportReport {
        lock(&self.report).clone()
    }

    /// Ends the call, returning its report.
    pub fn into_report(self) -> ExportReport {
        self.report.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// A poisoned lock still holds usable state: a panicking exporter must not hide the rest.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `module.tensor`, or `tensor` at the root.
pub fn full_name(module: &str, tensor: &str) -> String {
    if module.is_empty() {
        tensor.to_string()
    } else {
        format!("{module}.{tensor}")
    }
}

/// Whether a module is an MoE block, by ModelOpt's rule (`is_moe`): the class name ends in
/// `sparsemoeblock` or contains `moelayer`, `arcticmoe`, `deepseekmoe`, `dbrxffn` or
/// `nemotronhmoe` (case-insensitive), or the module has both a `router` and `experts`.
pub fn is_moe(module: &ModuleRef<'_>) -> bool {
    let name = module.class_name().to_ascii_lowercase();
    name.ends_with("sparsemoeblock")
        || [
            "moelayer",
            "arcticmoe",
            "deepseekmoe",
            "dbrxffn",
            "nemotronhmoe",
        ]
        .iter()
        .any(|s| name.contains(s))
        || (module.child("router").is_some() && module.child("experts").is_some())
}

/// Walks `tree` with `registry` into `ctx`: MoE preparation first, then one `export` per
/// matched module, in pre-order. Each exporter is constructed once, on first use.
pub fn walk(
    tree: &ModuleTree,
    registry: &ExporterRegistry,
    ctx: &ExportContext,
) -> Result<(), ExportError> {
    let mut matcher = registry.matcher();
    let mut instances = Instances::new(registry);

    for block in tree.walk().filter(is_moe) {
        let Some(experts) = block.child("experts") else {
            continue;
        };
        let Some(m) = matcher.find(&experts) else {
            return Err(ExportError::UnsupportedMoe {
                block: block.path().to_string(),
                experts_class: experts.class_chain().to_string(),
            });
        };
        instances
            .get(m.position)
            .prepare_moe_inputs(block.path(), block, ctx)?;
        lock(&ctx.report)
            .moe_prepared
            .push((block.path().to_string(), m.entry.meta.path.to_string()));
    }

    // Modules are exported a window at a time, in parallel (reading, quantizing); each
    // module's output is held by its own context and written in module order, so the bytes
    // never depend on scheduling or the thread count. The window bounds memory.
    let total = tree.len();
    let matched: Vec<_> = tree
        .walk()
        .map(|module| {
            let m = matcher.find(&module);
            let found = m.map(|m| {
                instances.get(m.position);
                (m.position, m.entry.meta.path.to_string(), m.describe())
            });
            (module, found)
        })
        .collect();
    let instances = &instances;
    let exporting = ctx.is_exporting();
    let mut done = 0;
    for window in matched.chunks(WINDOW) {
        if ctx.cancelled() {
            return Err(ExportError::Cancelled);
        }
        let results: Vec<(ExportContext, Result<(), ExportError>)> = window
            .par_iter()
            .map(|(module, found)| {
                let module_ctx = ctx.for_module();
                let result = match found {
                    Some((position, _, _)) => {
                        instances
                            .made(*position)
                            .export(module.path(), *module, &module_ctx)
                    }
                    None if exporting => module_ctx.copy_module(*module),
                    None => Ok(()),
                };
                (module_ctx, result)
            })
            .collect();
        for ((module, found), (module_ctx, result)) in window.iter().zip(results) {
            result?;
            ctx.write_captured(module_ctx)?;
            let outcome = match found {
                Some((_, exporter, reason)) => ModuleOutcome::Exported {
                    exporter: exporter.clone(),
                    reason: reason.clone(),
                },
                None => ModuleOutcome::Unchanged,
            };
            lock(&ctx.report)
                .modules
                .push((module.path().to_string(), outcome));
            done += 1;
            if let Some(f) = &ctx.progress {
                f(done, total, module.path());
            }
        }
    }
    Ok(())
}

/// Modules exported at once by [`walk`]: enough to overlap one module's reading with another's
/// quantizing on a few cores, few enough that memory stays a few tensors.
const WINDOW: usize = 4;

/// The exporters of one call, each constructed on first use.
struct Instances<'r> {
    registry: &'r ExporterRegistry,
    made: Vec<Option<Box<dyn ModuleExporter>>>,
}

impl<'r> Instances<'r> {
    fn new(registry: &'r ExporterRegistry) -> Self {
        let mut made = Vec::new();
        made.resize_with(registry.len(), || None);
        Instances { registry, made }
    }

    fn get(&mut self, position: usize) -> &dyn ModuleExporter {
        let construct = self.registry.entries()[position].construct;
        &**self.made[position].get_or_insert_with(construct)
    }

    /// An exporter already constructed by [`Instances::get`].
    fn made(&self, position: usize) -> &dyn ModuleExporter {
        self.made[position]
            .as_deref()
            .expect("every matched exporter is constructed before the parallel walk")
    }
}

#[cfg(test)]
mod tests;
