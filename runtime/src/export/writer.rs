//! Output writers (docs/DESIGN.md §7): the exporters decide *which* modules are quantized and
//! with which statistics; a writer decides *how* — the consumer's own arithmetic, tensor names,
//! dtypes, packing, scale encodings and config files. `kiln export --output-format NAME`
//! picks the writer registered under `NAME` with `#[writer(name = "...")]`, in kiln or in a
//! user's crate.
//!
//! Every writer is one of these, ModelOpt's (the default) included. A writer with an encoder of
//! its own ([`Encoding::Own`]) receives each quantized Linear's values, one at a time, from
//! several threads at once ([`OutputWriter::linear`]); a writer without one
//! ([`Encoding::Shared`], ModelOpt's) gets ModelOpt's cross-module scale rules, computed by the
//! exporters. Either way every output tensor passes through [`OutputWriter::tensor`], and what
//! it returns is written in module order ([`OutputWriter::write`]), so the output never depends
//! on the thread count.

use super::ExportError;
use super::act_amax::ActAmax;
use super::recipe::Recipe;
use super::stats::ErrorStats;
use crate::checkpoint::Checkpoint;
use crate::module_tree::ModuleTree;
use half::{bf16, f16};
pub use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// What a writer knows when the export starts.
pub struct WriterStart<'a> {
    /// The temporary output folder (renamed into place when the export succeeds).
    pub out: &'a Path,
    /// The input model folder (tokenizer, chat template); never modified.
    pub model: &'a Path,
    /// The input checkpoint (shared: a writer may keep it to read tensors while it encodes).
    pub checkpoint: &'a Arc<Checkpoint>,
    /// The model's module tree.
    pub tree: &'a ModuleTree,
    /// The `config.json` architecture (`LlamaForCausalLM`, …).
    pub architecture: &'a str,
    /// The export's recipe (exclusions, KV cache).
    pub recipe: &'a Recipe,
    /// Tensor bytes per output shard, for writers that shard.
    pub max_shard_bytes: u64,
    /// The export's activation statistics (`--act-amax`, `--calib`; empty when none were
    /// given): KV-cache amax, for a writer that stores KV scales. Each Linear's input amax
    /// also arrives with it ([`LinearWeight::input_amax`]).
    pub statistics: &'a ActAmax,
    /// Integer codes a calibration algorithm chose for the Linears' weights (GPTQ), which
    /// the writer stores in place of its own rounding; `None`: round to nearest.
    pub codes: Option<&'a Arc<dyn ChosenCodes>>,
    /// Per-column importance weights of weight matrices (`--imatrix`), for a writer whose
    /// rounding takes them ([`OutputWriter::uses_importance`]).
    pub importance: Option<&'a Arc<Importance>>,
}

/// Importance weights for a writer's rounding (llama.cpp's importance matrix, as
/// `llama-quantize --imatrix` loads it): per weight matrix, keyed by the writer's tensor
/// names, one weight per input column (experts one after another).
#[derive(Debug, Clone, Default)]
pub struct Importance {
    /// The file the weights came from (for messages).
    pub source: std::path::PathBuf,
    /// The weights, by tensor name.
    pub weights: std::collections::BTreeMap<String, Vec<f32>>,
    /// The text files the matrix was computed on, as its file names them.
    pub datasets: Vec<String>,
    /// The chunks it was computed on (0: unknown).
    pub chunks: u32,
}

/// The integer grid a writer stores a Linear's weight on, for an algorithm that chooses the
/// codes itself (GPTQ): `bits`-bit codes in `[−2^(bits−1), 2^(bits−1) − 1]`, one scale (and
/// zero point unless symmetric) per `group` columns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntGrid {
    /// Bits per code (4 or 8).
    pub bits: u32,
    /// Symmetric (no zero point) or with zero points.
    pub symmetric: bool,
    /// Columns sharing one scale.
    pub group: usize,
}

impl IntGrid {
    /// The codes' range.
    pub fn range(self) -> (f32, f32) {
        let half = (1u32 << (self.bits - 1)) as f32;
        (-half, half - 1.0)
    }
}

/// How a writer's format stores a Linear's weight, for an algorithm that chooses the codes
/// itself (GPTQ), with what the writer fixes beforehand.
#[derive(Debug, Clone, PartialEq)]
pub enum GptqGrid {
    /// Integer codes (compressed-tensors `w4a16`, `w4a16-asym`, `w8a16`) with the per-group
    /// `(scale, zero point)` the writer's round to nearest gives the original weight,
    /// row-major `[rows, cols / group]` (llm-compressor's observer runs before GPTQ).
    Int {
        /// The grid.
        grid: IntGrid,
        /// Per group `(scale, zero point)`.
        params: Vec<(f32, i8)>,
    },
    /// FP4 E2M1 codes (compressed-tensors `nvfp4a16`): per group of `group` columns its
    /// effective scale `e4m3 scale / global scale` (f32), as the writer computes them from the
    /// original weight. A code is the E2M1 nibble, its sign in bit 3.
    Fp4 {
        /// Columns per scale (16).
        group: usize,
        /// Per group, row-major `[rows, cols / group]`.
        scales: Vec<f32>,
    },
    /// MLX affine codes `0 ..= 2^bits − 1` with a scale and a bias per group, both chosen by
    /// the algorithm from the weight as it stands when it reaches the group (mlx-lm's GPTQ,
    /// `mx.quantize` of the updated columns).
    Affine {
        /// Bits per code (2, 4 or 8).
        bits: u32,
        /// Columns per group.
        group: usize,
    },
}

/// Whose GPTQ a format follows: the peer that makes such checkpoints with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GptqStyle {
    /// llm-compressor's `GPTQModifier`: sequential, blocks of 128, activation ordering.
    LlmCompressor,
    /// mlx-lm's `mlx_lm.quant.gptq`: one pass, the groups (of `group` columns) as blocks, no
    /// activation ordering.
    MlxLm {
        /// Columns per group.
        group: usize,
    },
}

/// The Linear a writer gives its GPTQ grid for ([`OutputWriter::gptq_grid`]).
pub struct GptqTarget<'a> {
    /// The module (`model.layers.0.self_attn.q_proj`).
    pub module: &'a str,
    /// The input checkpoint (a writer whose scales depend on other modules reads them here).
    pub checkpoint: &'a Checkpoint,
    /// The export's recipe.
    pub recipe: &'a Recipe,
}

impl GptqGrid {
    /// Columns sharing one scale.
    pub fn group(&self) -> usize {
        match self {
            GptqGrid::Int { grid, .. } => grid.group,
            GptqGrid::Fp4 { group, .. } | GptqGrid::Affine { group, .. } => *group,
        }
    }
}

/// Integer codes chosen before the writer runs, by Linear (GPTQ's).
pub trait ChosenCodes: Send + Sync + std::fmt::Debug {
    /// The algorithm (`GPTQ`), for reports and errors.
    fn algorithm(&self) -> &str;
    /// Whether columns were visited by activation order (`actorder`, as the config states).
    fn actorder(&self) -> bool;
    /// The codes of `module`'s weight, `[rows, cols]` row-major, if the algorithm chose them
    /// (`Err`: they could not be read back). Signed integers for [`GptqGrid::Int`]; for
    /// [`GptqGrid::Fp4`] and [`GptqGrid::Affine`] the unsigned code in the byte (`as u8`).
    fn codes(&self, module: &str) -> Option<Result<Vec<i8>, String>>;
    /// For [`GptqGrid::Affine`]: the `(scale, bias)` per group the algorithm chose for
    /// `module` (f32, row-major `[rows, cols / group]`); `None` where the writer's own
    /// parameters hold.
    fn params(&self, module: &str) -> Option<Result<Vec<(f32, f32)>, String>> {
        let _ = module;
        None
    }
}

/// What a writer knows when the export ends.
pub struct WriterEnd<'a> {
    /// The temporary output folder.
    pub out: &'a Path,
    /// The input model folder.
    pub model: &'a Path,
    /// The input checkpoint.
    pub checkpoint: &'a Checkpoint,
    /// Each module or tensor the writer quantized, with what it wrote (its own type names).
    pub written: &'a BTreeMap<String, String>,
    /// Every module the exporters declared quantized, with its format, in declaration (walk)
    /// order: what a writer with [`Encoding::Shared`] records in its config files.
    pub declared: &'a [(String, super::recipe::Format)],
    /// The model's module tree.
    pub tree: &'a ModuleTree,
    /// The export's recipe.
    pub recipe: &'a Recipe,
}

/// A Linear weight's values, in the checkpoint's dtype.
#[derive(Debug, Clone, Copy)]
pub enum WeightValues<'a> {
    /// bfloat16.
    Bf16(&'a [bf16]),
    /// float16.
    F16(&'a [f16]),
    /// float32.
    F32(&'a [f32]),
}

impl WeightValues<'_> {
    /// The number of values.
    pub fn len(&self) -> usize {
        match self {
            WeightValues::Bf16(v) => v.len(),
            WeightValues::F16(v) => v.len(),
            WeightValues::F32(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The safetensors dtype.
    pub fn dtype(&self) -> Dtype {
        match self {
            WeightValues::Bf16(_) => Dtype::BF16,
            WeightValues::F16(_) => Dtype::F16,
            WeightValues::F32(_) => Dtype::F32,
        }
    }

    /// The values widened to f32 (exact for every dtype here).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            WeightValues::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
            WeightValues::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            WeightValues::F32(v) => v.to_vec(),
        }
    }

    /// The raw little-endian bytes.
    pub fn bytes(&self) -> &[u8] {
        match self {
            WeightValues::Bf16(v) => bytemuck::cast_slice(v),
            WeightValues::F16(v) => bytemuck::cast_slice(v),
            WeightValues::F32(v) => bytemuck::cast_slice(v),
        }
    }

    /// Reads a float tensor's bytes as values of its dtype, or `None` for other dtypes.
    pub fn from_bytes(dtype: Dtype, data: &[u8]) -> Option<WeightValues<'_>> {
        match dtype {
            Dtype::BF16 => bytemuck::try_cast_slice(data).ok().map(WeightValues::Bf16),
            Dtype::F16 => bytemuck::try_cast_slice(data).ok().map(WeightValues::F16),
            Dtype::F32 => bytemuck::try_cast_slice(data).ok().map(WeightValues::F32),
            _ => None,
        }
    }
}

/// Float values owned in their dtype: a tensor's little-endian bytes decoded into aligned
/// values, for a writer that receives bytes ([`OutputWriter::tensor`]).
#[derive(Debug, Clone, PartialEq)]
pub enum FloatValues {
    /// bfloat16.
    Bf16(Vec<bf16>),
    /// float16.
    F16(Vec<f16>),
    /// float32.
    F32(Vec<f32>),
}

impl FloatValues {
    /// Decodes BF16, F16 or F32 bytes; `None` for other dtypes.
    pub fn decode(dtype: Dtype, data: &[u8]) -> Option<Self> {
        use crate::checkpoint::floats::decode;
        match dtype {
            Dtype::BF16 => Some(FloatValues::Bf16(decode(data))),
            Dtype::F16 => Some(FloatValues::F16(decode(data))),
            Dtype::F32 => Some(FloatValues::F32(decode(data))),
            _ => None,
        }
    }

    /// A view of the values.
    pub fn view(&self) -> WeightValues<'_> {
        match self {
            FloatValues::Bf16(v) => WeightValues::Bf16(v),
            FloatValues::F16(v) => WeightValues::F16(v),
            FloatValues::F32(v) => WeightValues::F32(v),
        }
    }
}

/// A Linear the exporters decided to quantize.
#[derive(Debug, Clone, Copy)]
pub struct LinearWeight<'a> {
    /// The output module path, in the input's (Hugging Face) naming; a fused expert tensor's
    /// slices are named per expert (`…experts.3.gate_proj`).
    pub module: &'a str,
    /// The input tensor the values come from, for messages.
    pub source: &'a str,
    /// `rows × cols` values, row-major (`[out, in]`).
    pub values: WeightValues<'a>,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// The input's calibrated amax, when the export has activation statistics.
    pub input_amax: Option<f32>,
}

/// A tensor's type in a writer's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncodedType {
    /// A safetensors dtype.
    Dtype(Dtype),
    /// A ggml type number (GGUF).
    Ggml(u32),
}

/// One output tensor, as the writer names and encodes it.
#[derive(Debug, Clone)]
pub struct Encoded {
    /// The output name.
    pub name: String,
    /// The output type.
    pub ty: EncodedType,
    /// The shape, outermost first.
    pub shape: Vec<usize>,
    /// The bytes.
    pub data: Vec<u8>,
}

/// What a writer made of one Linear or one copied tensor.
#[derive(Debug, Clone, Default)]
pub struct Written {
    /// The output tensors (none: the writer dropped the input, or holds it until `finish`).
    pub tensors: Vec<Encoded>,
    /// Set when the writer quantized: what it wrote (its own name for the type, such as
    /// `Q6_K`) and the error against the input values.
    pub quantized: Option<(String, ErrorStats)>,
}

impl Written {
    /// One tensor written as it came (a copied tensor the format keeps unchanged).
    pub fn copied(name: impl Into<String>, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Self {
        Written {
            tensors: vec![Encoded {
                name: name.into(),
                ty: EncodedType::Dtype(dtype),
                shape: shape.to_vec(),
                data,
            }],
            quantized: None,
        }
    }
}

/// An output writer. [`OutputWriter::linear`] and [`OutputWriter::tensor`] run on several
/// threads at once and only encode; [`OutputWriter::write`] receives their tensors one at a
/// time in module order.
pub trait OutputWriter: Send + Sync {
    /// Called once before the walk.
    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        let _ = start;
        Ok(())
    }

    /// Quantizes one Linear the exporters selected.
    fn linear(&self, weight: &LinearWeight<'_>) -> Result<Written, ExportError>;

    /// Encodes one tensor the exporters copied unchanged (renaming, converting or
    /// quantizing it as the format requires).
    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError>;

    /// Writes one encoded tensor, in module order.
    fn write(&mut self, tensor: Encoded) -> Result<(), ExportError>;

    /// Called once after the walk: writes what remains and the config files; returns the
    /// files written, relative to the output folder.
    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError>;

    /// Whether the writer stores scales from activation statistics (a calibrated input scale,
    /// KV-cache scales); an export that gives statistics to a writer that does not use them
    /// is refused, so they are never silently ignored.
    fn uses_statistics(&self) -> bool {
        false
    }

    /// What the writer substituted or noticed, one line each (printed as warnings).
    fn warnings(&self) -> Vec<String> {
        Vec::new()
    }

    /// What the format cannot express of a Linear whose weight has `shape` (`[out, in]`):
    /// `None` when it can, else the reason (`192 input features are not whole groups of
    /// 128`). Checked for every quantized Linear before an export starts.
    fn check_linear(&self, shape: &[usize]) -> Option<String> {
        let _ = shape;
        None
    }

    /// How `--calib` gathers statistics for this writer (its tool's observers; ModelOpt's by
    /// default).
    fn statistics_rules(&self) -> StatisticsRules {
        StatisticsRules::default()
    }

    /// Which inference engines load what this writer writes in its format, and the format
    /// each refusing engine takes instead (`super::engines`); empty: not stated.
    fn engines(&self) -> Vec<super::engines::EngineSupport> {
        Vec::new()
    }

    /// Who quantizes the Linears the exporters select: the writer itself
    /// ([`Encoding::Own`], the default), or the export context with ModelOpt's cross-module
    /// scale rules ([`Encoding::Shared`]).
    fn encoding(&self) -> Encoding {
        Encoding::Own
    }

    /// Whose GPTQ this writer's format has ([`OutputWriter::gptq_grid`]); `None`: none.
    fn gptq_style(&self) -> Option<GptqStyle> {
        None
    }

    /// Whether GPTQ quantizes the Linear `module` for this writer: the ones the writer itself
    /// quantizes (by default, what the recipe quantizes).
    fn gptq_covers(&self, module: &str, recipe: &Recipe) -> bool {
        recipe.quantizes(module)
    }

    /// For GPTQ: how this writer's format stores the Linear `target` of `cols` input features,
    /// with the per-group parameters it fixes from its `weight` (exactly as its own rounding
    /// computes them); `None`: the format has no GPTQ for it.
    fn gptq_grid(
        &self,
        target: &GptqTarget<'_>,
        weight: &WeightValues<'_>,
        cols: usize,
    ) -> Option<GptqGrid> {
        let _ = (target, weight, cols);
        None
    }

    /// Whether the writer's rounding takes importance weights (`--imatrix`,
    /// [`WriterStart::importance`]); an export that gives them to another writer is an error.
    fn uses_importance(&self) -> bool {
        false
    }

    /// The group sizes `--group-size` may choose for this writer's format (empty: its groups,
    /// if any, are fixed).
    fn group_sizes(&self) -> &'static [usize] {
        &[]
    }

    /// Sets the format's group size (`--group-size`), one of [`OutputWriter::group_sizes`];
    /// called right after the writer is made, before any check. A writer whose groups are
    /// fixed refuses any.
    fn set_group_size(&mut self, size: usize) -> Result<(), ExportError> {
        Err(ExportError::Writer {
            writer: "this".into(),
            what: format!("--group-size {size}: the format's groups are fixed"),
        })
    }
}

/// Applies the recipe's `--group-size` to a freshly made `writer` (named `name`, in format
/// `format`): one of the sizes it takes, or an error naming them.
pub fn configure(
    writer: &mut dyn OutputWriter,
    name: &str,
    format: &str,
    group_size: Option<usize>,
) -> Result<(), ExportError> {
    let Some(size) = group_size else {
        return Ok(());
    };
    let sizes = writer.group_sizes();
    if !sizes.contains(&size) {
        let what = if sizes.is_empty() {
            format!("--group-size {size}: {format}'s groups are fixed (or it has none)")
        } else {
            format!(
                "--group-size {size}: {format} takes groups of {}",
                sizes
                    .iter()
                    .map(usize::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(ExportError::Writer {
            writer: name.into(),
            what,
        });
    }
    writer.set_group_size(size).map_err(|e| match e {
        ExportError::Writer { what, .. } => ExportError::Writer {
            writer: name.into(),
            what,
        },
        e => e,
    })
}

/// Who quantizes the Linears the exporters select for a writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// The writer has an encoder of its own: each Linear's values arrive at
    /// [`OutputWriter::linear`], and the writer chooses the arithmetic and the scales.
    Own,
    /// The writer has no encoder of its own and takes what the exporters compute in this
    /// format with ModelOpt's cross-module scale rules (q/k/v and gate/up share an amax, a
    /// block's experts sync theirs, AWQ smooths whole groups, `--kv-cache` writes
    /// `k_scale`/`v_scale`): the quantized tensors arrive at [`OutputWriter::tensor`] like
    /// copied ones, and the exporters' declarations at [`WriterEnd::declared`].
    Shared(super::recipe::Format),
}

/// How `--calib` gathers MoE experts' input statistics for a writer's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MoeCalibration {
    /// ModelOpt's: each expert sees the tokens routed to it, and the experts of a block then
    /// share their largest input amax (`layer_sync_moe_local_experts_amax`).
    #[default]
    RoutedShared,
    /// llm-compressor's: every expert runs on every token (the routed ones alone give the
    /// output), and each keeps its own statistics.
    AllTokensPerExpert,
}

/// How `--calib` gathers statistics for a writer's output: its tool's observers.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StatisticsRules {
    /// MoE experts.
    pub moe: MoeCalibration,
    /// Keys' and values' statistic: `None`, the largest |value| over every sample (ModelOpt);
    /// `Some(c)`, a moving average of each sample's minimum and maximum with constant `c`
    /// (llm-compressor's `minmax` observer, its default for the KV cache), kept in the
    /// checkpoint's dtype as llm-compressor keeps it.
    pub kv_moving_average: Option<f32>,
}

impl StatisticsRules {
    /// llm-compressor 0.14's: every expert on every token, each its own statistics; the KV
    /// cache's `minmax` observer (moving average, constant 0.01); inputs' `static_minmax`.
    pub const LLM_COMPRESSOR: StatisticsRules = StatisticsRules {
        moe: MoeCalibration::AllTokensPerExpert,
        kv_moving_average: Some(0.01),
    };
}

/// A writer type the `#[writer]` attribute registers: its formats and its constructor.
pub trait WriterType: OutputWriter + Sized + 'static {
    /// The `--format` names it accepts, each with one line saying what it writes; the first
    /// is the default.
    fn formats() -> Vec<(&'static str, String)>;

    /// The writer for one export in `format` (one of [`WriterType::formats`]).
    fn new(format: &str) -> Result<Self, ExportError>;
}
