//! The state of one export call ([`ExportContext`]): the checkpoint it reads, the recipe,
//! activation statistics, the output sink, what each module declared, and the report.

use super::act_amax::ActAmax;
use super::recipe::{Format, Recipe};
use super::report::ExportReport;
use super::writer::{Encoding, LinearWeight, OutputWriter, Written};
use super::{ExportError, smooth, stats};
use crate::checkpoint::Checkpoint;
use crate::module_tree::ModuleRef;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Mutex;

/// The state of one export call. Shared by reference with every hook, so exporters may run
/// in parallel; created per call and dropped after it. A bare context ([`ExportContext::new`])
/// only records the walk; one made with [`ExportContext::for_export`] also reads the checkpoint
/// and writes the output through the export's one writer.
#[derive(Default)]
pub struct ExportContext {
    pub(super) report: Mutex<ExportReport>,
    job: Option<std::sync::Arc<Job>>,
    pub(super) progress: Option<ProgressFn>,
    cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    /// A module's context (see [`ExportContext::for_module`]) holds what the module emits
    /// until the walk writes it, in module order.
    capture: Option<Mutex<Captured>>,
}

/// What one module's export produced, held until it is written in module order.
#[derive(Default)]
struct Captured {
    errors: Vec<(Format, stats::ErrorStats)>,
    /// Modules this module's exporter declared quantized, with their formats.
    declared: Vec<(String, Format)>,
    /// What the writer made of the module's tensors, keyed by module or tensor, in the order
    /// they were emitted.
    written: Vec<(String, Written)>,
}

/// The export's writer, and what it reported.
struct Output {
    /// Its `--output-format` name.
    name: String,
    /// Its `--format` names.
    formats: Vec<String>,
    /// Who quantizes the selected Linears.
    encoding: Encoding,
    /// Read-locked by the parallel encoders, write-locked by the in-order writes.
    writer: std::sync::RwLock<Box<dyn OutputWriter>>,
    /// Module or tensor → what the writer wrote for it.
    written_as: Mutex<BTreeMap<String, String>>,
    /// Quantization error per written type.
    errors: Mutex<BTreeMap<String, stats::ErrorStats>>,
}

/// What the export's writer leaves when the walk ends.
pub struct WriterOutcome {
    /// The writer, to finish.
    pub writer: Box<dyn OutputWriter>,
    /// Module or tensor → what it was written as: the writer's own type names, and for
    /// modules the exporters declared ([`Encoding::Shared`]) their format's name.
    pub written_as: BTreeMap<String, String>,
    /// Quantization error per written type or declared format.
    pub errors: BTreeMap<String, stats::ErrorStats>,
    /// Every module declared quantized, with its format, in declaration (walk) order.
    pub declared: Vec<(String, Format)>,
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
    /// The export's writer.
    output: Output,
    /// Output tensors not written: aliases of tied weights (docs/FORMATS.md §4.1).
    dropped: BTreeSet<String>,
    /// AWQ / SmoothQuant smoothing, for formats with pre-quant scales.
    smooth: Option<smooth::SmoothPlan>,
    /// Module → format, for every module declared quantized.
    quantized: Mutex<BTreeMap<String, Format>>,
    /// The declared modules in declaration order — the walk's order, which ModelOpt's
    /// `quantized_layers` and `config_groups` follow.
    declared_order: Mutex<Vec<String>>,
    /// Weight amax by tensor name, computed once.
    weight_amax: Mutex<HashMap<String, f32>>,
    /// Quantization error per format.
    errors: Mutex<BTreeMap<Format, stats::ErrorStats>>,
    /// Input tensors holding NaN or ±Inf, with how many such values.
    nonfinite: Mutex<BTreeMap<String, usize>>,
    bytes_out: Mutex<u64>,
}

impl Job {
    /// Writes what the writer returned for `key` (a module or a tensor), in order.
    fn commit(&self, key: &str, written: Written) -> Result<(), ExportError> {
        let f = &self.output;
        let mut w = f.writer.write().unwrap_or_else(|p| p.into_inner());
        for t in written.tensors {
            *lock(&self.bytes_out) += t.data.len() as u64;
            w.write(t)?;
        }
        if let Some((label, e)) = written.quantized {
            // A copied `<module>.weight` the writer quantized is reported by its module, as
            // the Linears the exporters hand over are.
            let module = key.strip_suffix(".weight").unwrap_or(key);
            lock(&f.errors).entry(label.clone()).or_default().merge(&e);
            lock(&f.written_as).insert(module.to_string(), label);
        }
        Ok(())
    }

    /// Records a declaration; a module declared again keeps its place and takes the new format.
    fn declare(&self, module: &str, format: Format) {
        if lock(&self.quantized)
            .insert(module.to_string(), format)
            .is_none()
        {
            lock(&self.declared_order).push(module.to_string());
        }
    }
}

impl ExportContext {
    /// A fresh context for one walk that records what happens and writes nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// A context for exporting `checkpoint` with `recipe` through `writer` (registered as
    /// `name`, its `--output-format`, with its `--format` names); `dropped` names output
    /// tensors to leave out (tied-weight aliases).
    pub fn for_export(
        checkpoint: std::sync::Arc<Checkpoint>,
        recipe: Recipe,
        act: ActAmax,
        (name, formats): (&str, Vec<String>),
        writer: Box<dyn OutputWriter>,
        dropped: BTreeSet<String>,
    ) -> Self {
        let output = Output {
            name: name.to_string(),
            formats,
            encoding: writer.encoding(),
            writer: std::sync::RwLock::new(writer),
            written_as: Mutex::default(),
            errors: Mutex::default(),
        };
        ExportContext {
            report: Mutex::default(),
            progress: None,
            cancel: None,
            capture: None,
            job: Some(std::sync::Arc::new(Job {
                checkpoint,
                recipe,
                act: Mutex::new(act),
                output,
                dropped,
                smooth: None,
                quantized: Mutex::default(),
                declared_order: Mutex::default(),
                weight_amax: Mutex::default(),
                errors: Mutex::default(),
                nonfinite: Mutex::default(),
                bytes_out: Mutex::default(),
            })),
        }
    }

    /// The `--output-format` name of the export's writer.
    pub fn writer_name(&self) -> Result<&str, ExportError> {
        Ok(&self.job()?.output.name)
    }

    /// The `--format` names of the export's writer.
    pub fn writer_formats(&self) -> Vec<String> {
        self.job
            .as_ref()
            .map(|j| j.output.formats.clone())
            .unwrap_or_default()
    }

    /// Who quantizes the Linears the exporters select: the writer ([`Encoding::Own`]: hand it
    /// the values, [`crate::export::quantize_module`]), or the exporters with ModelOpt's
    /// cross-module scale rules in the writer's format ([`Encoding::Shared`]).
    pub fn encoding(&self) -> Result<Encoding, ExportError> {
        Ok(self.job()?.output.encoding)
    }

    /// Hands one Linear to the export's writer ([`Encoding::Own`]): it quantizes, and what it
    /// returns is written in module order.
    pub(crate) fn write_linear(&self, weight: &LinearWeight<'_>) -> Result<(), ExportError> {
        let written = self
            .job()?
            .output
            .writer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .linear(weight)?;
        self.take_written(weight.module, written)
    }

    /// Keeps what a writer returned for the module's turn, or writes it now.
    fn take_written(&self, key: &str, written: Written) -> Result<(), ExportError> {
        match &self.capture {
            Some(c) => lock(c).written.push((key.to_string(), written)),
            None => self.job()?.commit(key, written)?,
        }
        Ok(())
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
    pub(super) fn for_module(&self) -> ExportContext {
        ExportContext {
            report: Mutex::default(),
            job: self.job.clone(),
            progress: None,
            cancel: None,
            capture: Some(Mutex::default()),
        }
    }

    /// Writes what a module context captured (its tensors, error statistics, declared formats
    /// and notes), after checking that every module it wrote quantized tensors for declared a
    /// format, and that the tensors have that format's layout (`exporter` names the exporter
    /// in the error).
    pub(super) fn write_captured(
        &self,
        module: ExportContext,
        exporter: &str,
    ) -> Result<(), ExportError> {
        let captured = module
            .capture
            .map(|c| c.into_inner().unwrap_or_else(|p| p.into_inner()))
            .unwrap_or_default();
        if let Some(job) = &self.job {
            if let Encoding::Shared(_) = job.output.encoding {
                check_declared(job, &captured, exporter)?;
            }
            for (m, f) in &captured.declared {
                job.declare(m, *f);
            }
        }
        for (format, e) in captured.errors {
            self.record_error(format, &e)?;
        }
        for (key, written) in captured.written {
            self.job()?.commit(&key, written)?;
        }
        let report = module
            .report
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        let mut mine = lock(&self.report);
        mine.notes.extend(report.notes);
        mine.warnings.extend(report.warnings);
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

    pub(super) fn cancelled(&self) -> bool {
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
        self.job.as_deref().ok_or(ExportError::DryRun {
            what: "a checkpoint or an output",
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
        if self.job()?.dropped.contains(name) {
            return Ok(());
        }
        self.emit_owned(name, dtype, shape, data.to_vec())
    }

    /// [`ExportContext::emit`] of a buffer the caller gives up: a module context keeps it
    /// without copying it (embeddings and other copied tensors are the largest outputs).
    pub(super) fn emit_owned(
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
        let written = job
            .output
            .writer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .tensor(name, dtype, shape, data)?;
        self.take_written(name, written)
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
            .ok_or_else(|| ExportError::MissingTensor {
                tensor: name.to_string(),
            })?;
        if let Some(factor) = job.smooth.as_ref().and_then(|p| p.norm_factor(name)) {
            // A norm absorbing its Linears' AWQ scale (docs/FORMATS.md §4.2).
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
                return Err(ExportError::Shape {
                    tensor: name.to_string(),
                    expected: format!(
                        "a norm of {} channels (its Linears' AWQ scale)",
                        factor.len()
                    ),
                    found: shape,
                });
            }
            return self.emit_owned(name, meta.dtype, &shape, folded);
        }
        let mut buf = Vec::new();
        job.checkpoint.read(name, &mut buf)?;
        let n = stats::nonfinite_in_bytes(meta.dtype, &buf);
        if n > 0 {
            *lock(&job.nonfinite).entry(name.to_string()).or_default() += n;
        }
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
        let meta = c.tensor(name).ok_or_else(|| ExportError::MissingTensor {
            tensor: name.to_string(),
        })?;
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
        let meta = c.tensor(&name).ok_or_else(|| ExportError::MissingTensor {
            tensor: name.to_string(),
        })?;
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

    /// Declares that `module` was quantized to `format`: every exporter that writes quantized
    /// tensors for a module declares it, and `hf_quant_config.json`, `config.json`'s
    /// `quantization_config` and the report are built from these declarations alone. The walk
    /// refuses a module whose quantized tensors (a `weight_scale`, an FP8 / INT / packed
    /// `weight`) were written without one, or whose tensors lack the declared format's layout
    /// (docs/FORMATS.md §2). A module declared in another format than the others makes the
    /// checkpoint ModelOpt's `MIXED_PRECISION`.
    ///
    /// ```
    /// # use kiln_runtime::export::{ExportContext, recipe::Format};
    /// let ctx = ExportContext::new(); // a dry run: declarations need an export
    /// assert!(ctx.record_quantized("lm_head", Format::Fp8).is_err());
    /// ```
    pub fn record_quantized(&self, module: &str, format: Format) -> Result<(), ExportError> {
        let job = self.job()?;
        match &self.capture {
            Some(c) => lock(c).declared.push((module.to_string(), format)),
            None => job.declare(module, format),
        }
        Ok(())
    }

    /// Counts the NaN and ±Inf values of input tensor `tensor` (reported, and an error with
    /// `--strict`); returns how many there are.
    pub fn count_nonfinite<T: kiln_kernels::Element>(
        &self,
        tensor: &str,
        values: &[T],
    ) -> Result<usize, ExportError> {
        let n = values.iter().filter(|v| !v.to_f32().is_finite()).count();
        if n > 0 {
            *lock(&self.job()?.nonfinite)
                .entry(tensor.to_string())
                .or_default() += n;
        }
        Ok(n)
    }

    /// Input tensors holding NaN or ±Inf values so far, with their counts.
    pub fn nonfinite(&self) -> BTreeMap<String, usize> {
        self.job
            .as_ref()
            .map(|j| lock(&j.nonfinite).clone())
            .unwrap_or_default()
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

    /// Every module declared quantized so far, with its format, in declaration (walk) order.
    pub fn declarations(&self) -> Vec<(String, Format)> {
        let Some(job) = &self.job else {
            return Vec::new();
        };
        let quantized = lock(&job.quantized);
        lock(&job.declared_order)
            .iter()
            .map(|m| (m.clone(), quantized[m]))
            .collect()
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

    /// Takes the writer out to finish it, with what it wrote (ends the export's writing).
    pub fn finish(self) -> Result<(WriterOutcome, ExportReport), ExportError> {
        let declared = self.declarations();
        let report = self.report.into_inner().unwrap_or_else(|p| p.into_inner());
        let job = self
            .job
            .and_then(|j| std::sync::Arc::try_unwrap(j).ok())
            .ok_or(ExportError::DryRun {
                what: "an output to finish",
            })?;
        let out = job.output;
        let mut written_as = out
            .written_as
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        let mut errors = out.errors.into_inner().unwrap_or_else(|p| p.into_inner());
        for (module, format) in &declared {
            written_as.insert(module.clone(), format.to_string());
        }
        for (format, e) in job.errors.into_inner().unwrap_or_else(|p| p.into_inner()) {
            errors.entry(format.to_string()).or_default().merge(&e);
        }
        Ok((
            WriterOutcome {
                writer: out.writer.into_inner().unwrap_or_else(|p| p.into_inner()),
                written_as,
                errors,
                declared,
            },
            report,
        ))
    }

    /// Leaves a note about `module` in the report.
    pub fn note(&self, module: &str, message: impl Into<String>) {
        lock(&self.report)
            .notes
            .push((module.to_string(), message.into()));
    }

    /// Reports that `module` got a default for something missing (printed as a warning).
    pub fn warn(&self, module: &str, message: impl Into<String>) {
        lock(&self.report)
            .warnings
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
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
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

/// The module a tensor belongs to, when the tensor is a quantization output: a scale
/// (`<m>.weight_scale`, `<m>.weight_scale_2`, `<m>.input_scale`, a 3-D experts tensor's
/// `<m>.<p>_weight_scale`), or a `<m>.weight` / 3-D `<m>.<p>` stored in a quantized dtype
/// where the input held another dtype. Tensors copied unchanged are not outputs.
fn quantized_owner(
    checkpoint: &Checkpoint,
    name: &str,
    dtype: safetensors::Dtype,
) -> Option<String> {
    use safetensors::Dtype;
    if checkpoint.tensor(name).is_some_and(|t| t.dtype == dtype) {
        return None;
    }
    let (module, local) = name.rsplit_once('.')?;
    let scale = ["weight_scale", "weight_scale_2", "input_scale"].contains(&local)
        || local.ends_with("_weight_scale")
        || local.ends_with("_weight_scale_2");
    let packed = matches!(
        dtype,
        Dtype::F8_E4M3 | Dtype::F8_E5M2 | Dtype::I8 | Dtype::U8
    ) && (local == "weight" || checkpoint.tensor(name).is_some());
    (scale || packed).then(|| module.to_string())
}

/// The walk's check of one module's output: every module with quantized tensors among them
/// was declared (by this exporter or earlier), and each declared Linear has its format's
/// layout.
fn check_declared(job: &Job, captured: &Captured, exporter: &str) -> Result<(), ExportError> {
    let tensors: Vec<(&str, safetensors::Dtype, &[usize])> = captured
        .written
        .iter()
        .flat_map(|(_, w)| &w.tensors)
        .filter_map(|t| match t.ty {
            super::writer::EncodedType::Dtype(d) => Some((t.name.as_str(), d, t.shape.as_slice())),
            super::writer::EncodedType::Ggml(_) => None,
        })
        .collect();
    let mut owners: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for &(name, dtype, _) in &tensors {
        if let Some(m) = quantized_owner(&job.checkpoint, name, dtype) {
            owners
                .entry(m)
                .or_default()
                .push(format!("{name} {dtype:?}"));
        }
    }
    let declared: BTreeMap<&str, Format> = captured
        .declared
        .iter()
        .map(|(m, f)| (m.as_str(), *f))
        .collect();
    let earlier = lock(&job.quantized);
    for (module, tensors) in owners {
        if !declared.contains_key(module.as_str()) && !earlier.contains_key(&module) {
            return Err(ExportError::UndeclaredQuantization {
                module,
                exporter: exporter.to_string(),
                tensors,
            });
        }
    }
    drop(earlier);
    for (module, format) in declared {
        let weight = full_name(module, "weight");
        let Some(input) = job.checkpoint.tensor(&weight) else {
            continue; // 3-D experts and plugin modules: checked by `kiln verify`.
        };
        let [rows, cols] = input.shape[..] else {
            continue;
        };
        let written: BTreeMap<&str, (safetensors::Dtype, &[usize])> = tensors
            .iter()
            .filter_map(|&(n, d, s)| {
                let local = n.strip_prefix(module)?.strip_prefix('.')?;
                Some((local, (d, s)))
            })
            .collect();
        if !written.contains_key("weight") && input.dtype == safetensors::Dtype::F8_E4M3 {
            continue; // an FP8 weight passed through unchanged
        }
        if let Some(problem) = format.layout_problem(rows, cols, job.recipe.group_size, |local| {
            written.get(local).copied()
        }) {
            return Err(ExportError::Layout {
                module: module.to_string(),
                format,
                problem,
            });
        }
    }
    Ok(())
}
