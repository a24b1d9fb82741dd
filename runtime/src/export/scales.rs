//! Where a weight's scales come from (docs/FORMATS.md §2 "Where each amax comes from", §4): ModelOpt's
//! `export_amax` rules, and the amax a weight shares with its siblings or its MoE partner.

use super::groups::input_group;
use super::moe::expert_gate_up;
use super::recipe::Format;
use super::{ExportContext, ExportError, full_name};
use crate::module_tree::ModuleRef;
use half::{bf16, f16};
use kiln_kernels::{Element, cpu};
use safetensors::Dtype;

/// `amax / divisor` with the amax exported as ModelOpt's `export_amax` does: zero or NaN
/// becomes the bound (scale 1), and a subnormal is raised to `f32::MIN_POSITIVE`.
pub(crate) fn export_scale(amax: f32, divisor: f32) -> f32 {
    if amax == 0.0 || amax.is_nan() {
        1.0
    } else {
        amax.max(f32::MIN_POSITIVE) / divisor
    }
}

/// The input scale of `format` for an input amax: `amax / divisor`, a zero or NaN amax
/// becoming the quantizer's bound (ModelOpt's `export_amax`).
pub(crate) fn input_scale_of(format: Format, amax: f32) -> f32 {
    let (bound, divisor) = format.input_bound_and_divisor();
    let amax = if amax == 0.0 || amax.is_nan() {
        bound
    } else {
        amax
    };
    scalar_div(format, amax, divisor)
}

/// `x / divisor` for a 0-d scale as ModelOpt computes it for `format`: a true division
/// (PyTorch on the CPU), except for NVFP4 AWQ, which ModelOpt can only run on a GPU, where
/// PyTorch divides a tensor by a Python number as `x · (1/divisor)`.
pub(crate) fn scalar_div(format: Format, x: f32, divisor: f32) -> f32 {
    if format == Format::Nvfp4Awq {
        x * (1.0 / divisor)
    } else {
        x / divisor
    }
}

/// Where the scales a weight shares with other weights come from (docs/FORMATS.md §4): a Linear
/// of the module tree takes them from its siblings ([`TreeScales`]); one expert of fused 3-D
/// experts from its expert and the experts' single input quantizer per projection.
pub(crate) trait ScaleSource {
    /// The amax behind the per-tensor FP8 weight scale and NVFP4's `weight_scale_2`: the
    /// weight's max |w|, or the max over every weight that shares the scale.
    fn tensor_amax(&self, format: Format) -> Result<f32, ExportError>;
    /// The input amax (the max over every Linear sharing the input scale), raw;
    /// [`ExportError::MissingActAmax`] when none is known.
    fn input_amax(&self, format: Format) -> Result<f32, ExportError>;
    /// Per-row, per-tile or per-block amax of a partner weight whose amax this one's is
    /// synced with element-wise (an expert's gate/up), if any (by default none).
    fn partner_amax(
        &self,
        by: Granularity,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<f32>>, ExportError> {
        let _ = (by, rows, cols);
        Ok(None)
    }
    /// FP8 128×128 blocks: the one amax a shared-input group shares when every member is a
    /// single tile (ModelOpt's `preprocess_linear_fusion`), if that applies (by default not).
    fn shared_tile_amax(&self) -> Result<Option<f32>, ExportError> {
        Ok(None)
    }
}

/// The scales of a weight that shares none: its own amax, and an input amax given by the caller.
pub(crate) struct GivenScales<'a> {
    pub module: &'a str,
    pub tensor_amax: f32,
    pub input_amax: Option<f32>,
}

impl ScaleSource for GivenScales<'_> {
    fn tensor_amax(&self, _format: Format) -> Result<f32, ExportError> {
        Ok(self.tensor_amax)
    }

    fn input_amax(&self, format: Format) -> Result<f32, ExportError> {
        self.input_amax.ok_or_else(|| ExportError::MissingActAmax {
            format,
            quantizers: vec![format!("{}.input_quantizer", self.module)],
        })
    }
}

/// The scales of a Linear in the module tree.
pub(crate) struct TreeScales<'a> {
    pub ctx: &'a ExportContext,
    pub module: ModuleRef<'a>,
    pub name: &'a str,
}

/// What one amax covers: a row (per channel), a square tile, or a block of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Granularity {
    /// One amax per row.
    Rows,
    /// One amax per `t × t` tile (edge tiles partial).
    Tiles(usize),
    /// One amax per `1 × g` block along the row.
    Blocks(usize),
}

impl Granularity {
    /// The number of amax values for a `rows × cols` weight.
    pub(crate) fn len(self, rows: usize, cols: usize) -> usize {
        match self {
            Granularity::Rows => rows,
            Granularity::Tiles(t) => rows.div_ceil(t) * cols.div_ceil(t),
            Granularity::Blocks(g) => rows * (cols / g),
        }
    }
}

/// Per-row, per-tile or per-block amax of `x`.
pub(crate) fn reduce_amax<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    by: Granularity,
    out: &mut [f32],
) -> Result<(), kiln_kernels::KernelError> {
    match by {
        Granularity::Rows => cpu::amax_rows(x, rows, cols, out),
        Granularity::Tiles(t) => cpu::amax_tiles(x, rows, cols, t, out),
        Granularity::Blocks(g) => cpu::amax_blocks(x, rows, cols, g, out),
    }
}

/// max, NaN-propagating.
pub(crate) fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() {
        f32::NAN
    } else {
        a.max(b)
    }
}

impl ScaleSource for TreeScales<'_> {
    fn tensor_amax(&self, format: Format) -> Result<f32, ExportError> {
        let members = if format.shares_group_scales() {
            // NVFP4 family: q/k/v and gate/up share `weight_scale_2` (the max).
            let recipe = self.ctx.recipe()?;
            input_group(self.module, |p| recipe.quantizes(p))
        } else {
            // FP8: an expert's gate/up share the weight scale (`sync_moe_gate_up_amax`).
            expert_gate_up(self.module).map_or_else(|| vec![self.name.to_string()], |p| p.to_vec())
        };
        let mut amax = 0f32;
        for m in &members {
            // AWQ formats: the amax of the smoothed weight (ModelOpt recalibrates after
            // smoothing and resmoothing).
            amax = amax.max(self.ctx.smoothed_weight_amax(m)?);
        }
        Ok(amax)
    }

    fn input_amax(&self, format: Format) -> Result<f32, ExportError> {
        let group = if format.shares_input_amax() {
            let recipe = self.ctx.recipe()?;
            input_group(self.module, |p| recipe.quantizes(p))
        } else {
            vec![self.name.to_string()]
        };
        let mut found = None;
        for m in &group {
            if let Some(a) = self.ctx.input_amax(m)? {
                found = Some(found.map_or(a, |f: f32| f.max(a)));
            }
        }
        found.ok_or_else(|| ExportError::MissingActAmax {
            format,
            quantizers: group
                .iter()
                .map(|m| format!("{m}.input_quantizer"))
                .collect(),
        })
    }

    fn partner_amax(
        &self,
        by: Granularity,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<f32>>, ExportError> {
        let Some(pair) = expert_gate_up(self.module) else {
            return Ok(None);
        };
        let other = if pair[0] == self.name {
            &pair[1]
        } else {
            &pair[0]
        };
        let mut b = vec![0f32; by.len(rows, cols)];
        let c = self.ctx.checkpoint()?;
        let name = full_name(other, "weight");
        let kernel = |r: Result<(), kiln_kernels::KernelError>| {
            r.map_err(|source| ExportError::Kernel {
                tensor: name.clone(),
                source,
            })
        };
        fn read<T: Element>(
            c: &crate::checkpoint::Checkpoint,
            name: &str,
            rows: usize,
            cols: usize,
            by: Granularity,
            out: &mut [f32],
            smoothing: Option<&crate::export::smooth::LinearSmoothing>,
        ) -> Result<Result<(), kiln_kernels::KernelError>, ExportError> {
            let w = c.read_as::<T>(name)?;
            // The partner's amax is taken on its smoothed weight (SmoothQuant experts).
            let w = match smoothing {
                Some(s) => s.apply(&w, cols),
                None => w,
            };
            Ok(reduce_amax(&w, rows, cols, by, out))
        }
        let smoothing = self.ctx.smoothing(other);
        let reduced = match c.tensor(&name).map(|t| t.dtype) {
            Some(Dtype::BF16) => read::<bf16>(c, &name, rows, cols, by, &mut b, smoothing)?,
            Some(Dtype::F16) => read::<f16>(c, &name, rows, cols, by, &mut b, smoothing)?,
            Some(Dtype::F32) => read::<f32>(c, &name, rows, cols, by, &mut b, smoothing)?,
            other => {
                return Err(match other {
                    Some(dtype) => ExportError::Dtype {
                        tensor: name,
                        dtype,
                    },
                    None => ExportError::MissingTensor { tensor: name },
                });
            }
        };
        kernel(reduced)?;
        Ok(Some(b))
    }

    fn shared_tile_amax(&self) -> Result<Option<f32>, ExportError> {
        const TILE: usize = 128;
        let recipe = self.ctx.recipe()?;
        let group = input_group(self.module, |p| recipe.quantizes(p));
        let c = self.ctx.checkpoint()?;
        let one_tile = |m: &String| {
            c.tensor(&full_name(m, "weight"))
                .is_some_and(|t| t.shape.iter().all(|&d| d <= TILE))
        };
        if group.len() < 2 || !group.iter().all(one_tile) {
            return Ok(None);
        }
        let mut amax = 0f32;
        for m in &group {
            amax = nan_max(amax, self.ctx.weight_amax(&full_name(m, "weight"))?);
        }
        Ok(Some(amax))
    }
}
