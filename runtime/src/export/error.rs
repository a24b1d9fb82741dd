//! The export's errors: one enum whose variants name the module, tensor or file at fault.

use super::recipe::Format;
use crate::checkpoint::CheckpointError;
use crate::sink::SinkError;

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
    /// A tensor the export needs is not in the input checkpoint.
    #[error("no tensor `{tensor}` in the checkpoint")]
    MissingTensor {
        /// The tensor's name.
        tensor: String,
    },
    /// A module the export needs is not in the module tree.
    #[error("no module `{module}` in the module tree")]
    MissingModule {
        /// The module's path.
        module: String,
    },
    /// A tensor's shape is not what its module needs.
    #[error("tensor `{tensor}`: expected {expected}, found {found:?}")]
    Shape {
        /// The tensor at fault.
        tensor: String,
        /// What was expected, in words (`a 2-D Linear weight`, `[E, 2I, H] and [E, H, I]`).
        expected: String,
        /// The shape found.
        found: Vec<usize>,
    },
    /// The format cannot quantize this module or tensor (ModelOpt cannot either, or kiln not yet).
    #[error("`{target}`: {format} {reason}")]
    Unsupported {
        /// The module or tensor.
        target: String,
        /// The format asked for.
        format: Format,
        /// Why, and what to do instead.
        reason: String,
    },
    /// A statistic from `--act-amax` / `--calib` has the wrong number of values.
    #[error("`{quantizer}` has {found} values; {expected}")]
    StatisticLength {
        /// The quantizer key (ModelOpt's name).
        quantizer: String,
        /// How many values it has.
        found: usize,
        /// What the module needs, in words.
        expected: String,
    },
    /// The context has no checkpoint or output: `kiln explain` and other dry runs match
    /// exporters without running them, and a bare [`super::ExportContext::new`] only records.
    #[error(
        "this export context is a dry run: it reads no checkpoint and writes no output ({what})"
    )]
    DryRun {
        /// What was asked of it.
        what: &'static str,
    },
    /// No architecture entry builds this model's module tree.
    #[error("no architecture registered for `{name}` and no fallback")]
    NoArchitecture {
        /// The `config.json` architecture (or `model_type`).
        name: String,
    },
    /// The architecture entry could not build the module tree.
    #[error("{}: {source}", dir.display())]
    ModuleTree {
        /// The model folder.
        dir: std::path::PathBuf,
        /// The architecture's error.
        source: crate::architecture::ArchitectureError,
    },
    /// `tie_word_embeddings` is set but the tied tensors differ.
    #[error("config.json says tie_word_embeddings, but `{alias}` and `{canonical}` differ")]
    TiedWeightsDiffer {
        /// The alias (`lm_head.weight`).
        alias: String,
        /// The tensor it should equal (`model.embed_tokens.weight`).
        canonical: String,
    },
    /// An exporter wrote quantized tensors for a module without declaring its format, so the
    /// configs could not say what was done.
    #[error("module `{module}`: {exporter} wrote quantized tensors ({}) but declared no format; call `ExportContext::record_quantized(\"{module}\", format)` (or use `kiln::export::quantize_linear`)", tensors.join(", "))]
    UndeclaredQuantization {
        /// The module.
        module: String,
        /// The exporter's type path.
        exporter: String,
        /// The quantized tensors it wrote.
        tensors: Vec<String>,
    },
    /// A module's tensors do not have the layout of the format it declared (docs/FORMATS.md §2).
    #[error("module `{module}` declared {format}, but {problem}")]
    Layout {
        /// The module.
        module: String,
        /// The declared format.
        format: Format,
        /// What does not match.
        problem: String,
    },
    /// `--strict`: the activation-statistics file has keys that name no quantizer of the model.
    #[error("{}: {} key(s) name no quantizer of this model: {}{} (--strict)", file.display(), keys.len(),
        keys.iter().take(5).map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", "),
        if keys.len() > 5 { format!(" and {} more", keys.len() - 5) } else { String::new() })]
    UnknownStatistics {
        /// The statistics file (or `--calib`).
        file: std::path::PathBuf,
        /// The keys.
        keys: Vec<String>,
    },
    /// `--strict`: input tensors hold NaN or infinite values.
    #[error("non-finite values (NaN/Inf) in {} (--strict)", tensors.iter().map(|(t, n)| format!("`{t}` ({n})")).collect::<Vec<_>>().join(", "))]
    NonFinite {
        /// Each tensor and how many of its values are not finite.
        tensors: Vec<(String, usize)>,
    },
    /// `--output-format` names no registered writer.
    #[error("unknown output format `{name}` (this build writes: {})", known.join(", "))]
    UnknownWriter {
        /// The name given.
        name: String,
        /// The registered writers' names.
        known: Vec<String>,
    },
    /// `--format` names nothing the chosen writer writes.
    #[error("the {writer} writer has no format `{format}` (it writes: {})", known.join(", "))]
    UnknownWriterFormat {
        /// The writer.
        writer: String,
        /// The format given.
        format: String,
        /// The writer's formats.
        known: Vec<String>,
    },
    /// An exporter asked for something the chosen writer cannot express (a ModelOpt format
    /// named explicitly, an option such as `--kv-cache`, a family or MoE layout).
    #[error("the {writer} writer cannot express {what} (it writes: {})", supported.join(", "))]
    WriterCannot {
        /// The writer.
        writer: String,
        /// What was asked, naming the module, format or option.
        what: String,
        /// What the writer can write instead.
        supported: Vec<String>,
    },
    /// The plan checked before the export: modules the format cannot take.
    #[error(
        "{format} cannot quantize {modules} module(s): {}. Leave them unquantized with {}{}",
        problems.join("; "),
        exclude.iter().map(|g| format!("--exclude '{g}'")).collect::<Vec<_>>().join(" "),
        if fits.is_empty() {
            String::new()
        } else {
            format!(", or choose a format that takes them: {}", fits.join(", "))
        }
    )]
    Plan {
        /// `writer format`.
        format: String,
        /// How many modules.
        modules: usize,
        /// The modules sharing each reason, and the reason.
        problems: Vec<String>,
        /// `--exclude` globs that leave them unquantized.
        exclude: Vec<String>,
        /// The writer's formats that take every one of them.
        fits: Vec<String>,
    },
    /// A writer refused a tensor or a file, naming it.
    #[error("{writer} writer: {what}")]
    Writer {
        /// The writer.
        writer: String,
        /// What is wrong, naming the tensor, field or file.
        what: String,
    },
}

impl From<crate::families::ResolveError> for ExportError {
    fn from(e: crate::families::ResolveError) -> Self {
        use crate::families::ResolveError;
        match e {
            ResolveError::InvalidRegistry(e) => ExportError::InvalidRegistry(e),
            ResolveError::NoArchitecture { name } => ExportError::NoArchitecture { name },
            ResolveError::ModuleTree { dir, source } => ExportError::ModuleTree { dir, source },
        }
    }
}
