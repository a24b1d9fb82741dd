//! The built-in exporter for `Linear` modules (ModelOpt's `_export_quant_linear`): quantizes
//! `weight` with the recipe's format and writes ModelOpt's tensors (FORMATS.md §2); excluded
//! Linears (`lm_head`, routers, `--exclude`) are copied unchanged. Any other tensor the module
//! owns (`bias`) is copied unchanged.

use super::moe::expert_gate_up;
use super::recipe::Format;
use super::stats::ErrorStats;
use super::{ExportContext, ExportError, ModuleExporter, full_name};
use crate::module_tree::{Linear, ModuleRef};
use half::{bf16, f16};
use kiln_kernels::{Element, cpu, ops};
use safetensors::Dtype;

/// Quantizes every `Linear` the recipe selects.
#[crate::exporter(keys = [Linear], crate = crate)]
#[derive(Debug, Default)]
pub struct QuantLinear;

/// Siblings that receive the same input and so share `input_scale` and `weight_scale_2` in the
/// NVFP4 family (FORMATS.md §4.2): q/k/v; gate/up; Mixtral's w1/w3.
const SHARED_INPUT_GROUPS: [&[&str]; 3] = [
    &["q_proj", "k_proj", "v_proj"],
    &["gate_proj", "up_proj"],
    &["w1", "w3"],
];

/// The quantized siblings of `module` (itself included) that share its input.
pub fn input_group(module: ModuleRef<'_>, quantized: impl Fn(&str) -> bool) -> Vec<String> {
    let me = module.local_name();
    let Some(parent) = module.parent() else {
        return vec![module.path().to_string()];
    };
    match SHARED_INPUT_GROUPS.iter().find(|g| g.contains(&me)) {
        Some(group) => group
            .iter()
            .filter_map(|n| parent.child(n))
            .filter(|m| m.tensor("weight").is_some() && quantized(m.path()))
            .map(|m| m.path().to_string())
            .collect(),
        None => vec![module.path().to_string()],
    }
}

impl ModuleExporter for QuantLinear {
    fn export(
        &self,
        name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        if !ctx.is_exporting() {
            return Ok(());
        }
        let recipe = ctx.recipe()?;
        kv_cache_scale(name, module, ctx)?;
        if !recipe.quantizes(name) || module.tensor("weight").is_none() {
            return ctx.copy_module(module);
        }
        for t in module.tensors().iter().filter(|t| t.name != "weight") {
            ctx.copy_tensor(&full_name(name, &t.name))?;
        }
        let weight = full_name(name, "weight");
        let c = ctx.checkpoint()?;
        let meta = c
            .tensor(&weight)
            .ok_or_else(|| ExportError::Invalid(format!("no tensor `{weight}`")))?;
        let (rows, cols) = match meta.shape[..] {
            [r, k] => (r, k),
            ref s => {
                return Err(ExportError::Invalid(format!(
                    "tensor `{weight}`: a Linear weight must be 2-D, found {s:?}"
                )));
            }
        };
        let format = recipe.format;
        let scales = TreeScales { ctx, module, name };
        let q = Quantize {
            ctx,
            scales: &scales,
            out: name,
            weight: &weight,
            rows,
            cols,
            format,
        };
        match meta.dtype {
            Dtype::BF16 => q.run_smoothed(c.read_as::<bf16>(&weight)?)?,
            Dtype::F16 => q.run_smoothed(c.read_as::<f16>(&weight)?)?,
            Dtype::F32 => q.run_smoothed(c.read_as::<f32>(&weight)?)?,
            Dtype::F8_E4M3 if format == Format::Fp8 => {
                // Already FP8 (FORMATS.md: "weights already in float8_e4m3fn pass through").
                ctx.copy_tensor(&weight)?;
            }
            dtype => {
                return Err(ExportError::Dtype {
                    tensor: weight,
                    dtype,
                });
            }
        }
        ctx.record_quantized(name, format)
    }
}

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

/// With `--kv-cache`, an attention's `k_proj` / `v_proj` carry the KV-cache scale:
/// `<attention>.k_proj.k_scale = k_bmm amax / 448` (likewise `v`), the same formula for FP8 and
/// NVFP4 KV (FORMATS.md "KV cache"). Without a calibrated amax no scale is written — ModelOpt's
/// constant-amax default — while `kv_cache_quant_algo` still names the format.
fn kv_cache_scale(
    name: &str,
    module: ModuleRef<'_>,
    ctx: &ExportContext,
) -> Result<(), ExportError> {
    if ctx.recipe()?.kv_cache.is_none() {
        return Ok(());
    }
    let which = match module.local_name() {
        "k_proj" => 'k',
        "v_proj" => 'v',
        _ => return Ok(()),
    };
    let Some(attention) = module
        .parent()
        .filter(|p| p.class_name().ends_with("Attention"))
    else {
        return Ok(());
    };
    if let Some(amax) = ctx.kv_amax(attention.path(), which)? {
        ctx.emit(
            &full_name(name, &format!("{which}_scale")),
            Dtype::F32,
            &[],
            &scalar(amax / 448.0),
        )?;
    }
    Ok(())
}

/// Where the scales a weight shares with other weights come from (FORMATS.md §4): a Linear
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
    /// synced with element-wise (an expert's gate/up), if any.
    fn partner_amax(
        &self,
        by: Granularity,
        rows: usize,
        cols: usize,
    ) -> Result<Option<Vec<f32>>, ExportError>;
    /// FP8 128×128 blocks: the one amax a shared-input group shares when every member is a
    /// single tile (ModelOpt's `preprocess_linear_fusion`), if that applies.
    fn shared_tile_amax(&self) -> Result<Option<f32>, ExportError>;
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
fn reduce_amax<T: Element>(
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
fn nan_max(a: f32, b: f32) -> f32 {
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
                return Err(ExportError::Invalid(format!(
                    "tensor `{name}`: cannot sync gate/up amax with dtype {other:?}"
                )));
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

/// One Linear-shaped weight's quantization: reads nothing itself, takes the weight's values
/// and where its shared scales come from, and writes `<out>.weight`, `<out>.weight_scale`, ….
pub(crate) struct Quantize<'a> {
    pub ctx: &'a ExportContext,
    pub scales: &'a dyn ScaleSource,
    /// The output module path.
    pub out: &'a str,
    /// The input tensor, for error messages.
    pub weight: &'a str,
    pub rows: usize,
    pub cols: usize,
    pub format: Format,
}

pub(crate) fn scalar(v: f32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

pub(crate) fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

impl Quantize<'_> {
    fn kernel(&self, r: Result<(), kiln_kernels::KernelError>) -> Result<(), ExportError> {
        r.map_err(|source| ExportError::Kernel {
            tensor: self.weight.to_string(),
            source,
        })
    }

    fn emit(
        &self,
        tensor: &str,
        dtype: Dtype,
        shape: &[usize],
        data: &[u8],
    ) -> Result<(), ExportError> {
        self.ctx
            .emit(&full_name(self.out, tensor), dtype, shape, data)
    }

    /// The input scale `amax / divisor`; a zero or NaN amax becomes the quantizer's bound
    /// (ModelOpt's `export_amax`).
    fn input_scale(&self) -> Result<f32, ExportError> {
        Ok(input_scale_of(
            self.format,
            self.scales.input_amax(self.format)?,
        ))
    }

    /// Per-row, per-tile or per-block scales `amax / divisor`, the amax exported as
    /// ModelOpt's `export_amax` does: zero or NaN becomes the bound (scale 1), and a subnormal
    /// is raised to `f32::MIN_POSITIVE`. An expert's gate/up take the element-wise max of both
    /// amax (`sync_moe_gate_up_amax`).
    fn amax_scales<T: Element>(
        &self,
        w: &[T],
        by: Granularity,
        divisor: f32,
    ) -> Result<Vec<f32>, ExportError> {
        let (rows, cols) = (self.rows, self.cols);
        let mut a = vec![0f32; by.len(rows, cols)];
        self.kernel(reduce_amax(w, rows, cols, by, &mut a))?;
        if let Some(b) = self.scales.partner_amax(by, rows, cols)? {
            for (x, y) in a.iter_mut().zip(&b) {
                *x = nan_max(*x, *y);
            }
        }
        Ok(a.iter().map(|&x| export_scale(x, divisor)).collect())
    }

    /// The clipped block amax AWQ's clipping search gave for this Linear's weight
    /// (`<linear>.weight_quantizer`), when the export keeps it: as in ModelOpt, a Linear that
    /// is resmoothed (its weight rescaled to a shared-input group's mean scale) is
    /// recalibrated, and its clipping is lost.
    fn clipped_block_amax(&self, group: usize) -> Result<Option<Vec<f32>>, ExportError> {
        let Some(amax) = self.ctx.given_weight_amax(self.out)? else {
            return Ok(None);
        };
        if self.ctx.smoothing(self.out).is_some_and(|s| s.rescaled()) {
            return Ok(None);
        }
        let want = self.rows * (self.cols / group);
        if amax.len() != want {
            return Err(ExportError::Invalid(format!(
                "`{}.weight_quantizer` has {} block amax; the weight has {want} blocks of {group}",
                self.out,
                amax.len()
            )));
        }
        Ok(Some(amax))
    }

    /// [`Quantize::run`] after the AWQ / SmoothQuant smoothing of the Linear, if any, writing
    /// its `pre_quant_scale` (in the weight's dtype) unless a norm absorbed it.
    fn run_smoothed<T: Element>(&self, w: Vec<T>) -> Result<(), ExportError> {
        // The weight is in memory: its amax costs little here and a second read later.
        self.ctx.remember_weight_amax(self.weight, cpu::amax(&w))?;
        let Some(s) = self.ctx.smoothing(self.out) else {
            return self.run(&w);
        };
        let smoothed = s.apply(&w, self.cols);
        drop(w);
        if let Some(scale) = &s.scale {
            let pqs: Vec<T> = scale.iter().map(|&x| T::from_f32(x)).collect();
            let dtype = match T::DTYPE {
                "F16" => Dtype::F16,
                "F32" => Dtype::F32,
                _ => Dtype::BF16,
            };
            self.emit(
                "pre_quant_scale",
                dtype,
                &[self.cols],
                bytemuck::cast_slice(&pqs),
            )?;
        }
        self.run(&smoothed)
    }

    /// Quantizes `w` (`rows × cols`, row-major) and writes the tensors and error statistics.
    pub(crate) fn run<T: Element>(&self, w: &[T]) -> Result<(), ExportError> {
        use kiln_kernels::cpu::bits::e4m3_to_f32;
        use kiln_kernels::formats::e8m0::e8m0_to_f32;
        use kiln_kernels::formats::fp4::e2m1_to_f32;
        let (n, cols, shape) = (w.len(), self.cols, [self.rows, self.cols]);
        let nibble = |p: &[u8], i: usize| (p[i / 2] >> (4 * (i % 2))) & 0xf;
        let error = match self.format {
            Format::Fp8 => {
                // FORMATS.md: the raw weight amax (a zero amax gives a zero scale), the quotient
                // rounded to the weight's dtype before the cast; an expert's gate/up share it.
                let s = ops::fp8::fp8_scale(self.scales.tensor_amax(self.format)?);
                let mut q = vec![0u8; n];
                self.kernel(cpu::quantize_fp8_per_tensor(w, s, &mut q))?;
                let input = self.input_scale()?;
                self.emit("weight", Dtype::F8_E4M3, &shape, &q)?;
                self.emit("weight_scale", Dtype::F32, &[], &scalar(s))?;
                self.emit("input_scale", Dtype::F32, &[], &scalar(input))?;
                ErrorStats::measure(w, |i| e4m3_to_f32(q[i]) * s)
            }
            Format::Fp8PerChannel => {
                let s = self.amax_scales(w, Granularity::Rows, 448.0)?;
                let mut q = vec![0u8; n];
                self.kernel(cpu::quantize_fp8_per_channel(
                    w, self.rows, cols, &s, &mut q,
                ))?;
                self.emit("weight", Dtype::F8_E4M3, &shape, &q)?;
                self.emit("weight_scale", Dtype::F32, &[self.rows], &f32s(&s))?;
                ErrorStats::measure(w, |i| e4m3_to_f32(q[i]) * s[i / cols])
            }
            Format::Fp8Block => {
                // FORMATS.md fp8_pb_wo: one f32 scale per 128×128 tile (edge tiles partial),
                // stored [N/128, 1, K/128, 1] — a 0-d tensor when there is one tile.
                const TILE: usize = 128;
                let mut s = self.amax_scales(w, Granularity::Tiles(TILE), 448.0)?;
                // `preprocess_linear_fusion`: when a shared-input group (q/k/v, gate/up) has
                // one tile each, its amax is a scalar and the group shares the max.
                if let Some(amax) = self.scales.shared_tile_amax()? {
                    s = vec![export_scale(amax, 448.0)];
                }
                let (tr, tc) = (self.rows.div_ceil(TILE), cols.div_ceil(TILE));
                let mut q = vec![0u8; n];
                self.kernel(cpu::quantize_fp8_tiles(
                    w, self.rows, cols, TILE, &s, &mut q,
                ))?;
                let scale_shape: &[usize] = if s.len() == 1 { &[] } else { &[tr, 1, tc, 1] };
                self.emit("weight", Dtype::F8_E4M3, &shape, &q)?;
                self.emit("weight_scale", Dtype::F32, scale_shape, &f32s(&s))?;
                ErrorStats::measure(w, |i| {
                    let (r, c) = (i / cols, i % cols);
                    e4m3_to_f32(q[i]) * s[(r / TILE) * tc + c / TILE]
                })
            }
            Format::Int8Wo | Format::Int8Sq => {
                let s = self.amax_scales(w, Granularity::Rows, 127.0)?;
                let mut q = vec![0i8; n];
                self.kernel(cpu::quantize_int8_per_channel(
                    w, self.rows, cols, &s, &mut q,
                ))?;
                self.emit("weight", Dtype::I8, &shape, bytemuck::cast_slice(&q))?;
                self.emit("weight_scale", Dtype::F32, &[self.rows], &f32s(&s))?;
                if self.format == Format::Int8Sq {
                    self.emit("input_scale", Dtype::F32, &[], &scalar(self.input_scale()?))?;
                }
                ErrorStats::measure(w, |i| f32::from(q[i]) * s[i / cols])
            }
            Format::Int4Awq | Format::W4a8Awq => {
                // Groups of 128 along K: scale = block amax / 7 (a zero block → 1), nibble
                // pairs along the output dimension: weight [N/2, K], weight_scale [N, K/128].
                const G: usize = 128;
                let rows = self.rows;
                // An expert's gate/up share the element-wise max (`sync_moe_gate_up_amax`);
                // AWQ's clipping search may have given the block amax instead.
                let s = match self.clipped_block_amax(G)? {
                    Some(a) => a.iter().map(|&x| export_scale(x, 7.0)).collect(),
                    None => self.amax_scales(w, Granularity::Blocks(G), 7.0)?,
                };
                let mut q = vec![0u8; n / 2];
                self.kernel(cpu::quantize_int4_groups(w, rows, cols, G, &s, &mut q))?;
                self.emit("weight", Dtype::U8, &[rows / 2, cols], &q)?;
                self.emit("weight_scale", Dtype::F32, &[rows, cols / G], &f32s(&s))?;
                if self.format == Format::W4a8Awq {
                    // The FP8 stage: max |W| over the shared-input group / 448; the INT4
                    // packing above does not fold it in.
                    let ws2 = export_scale(self.scales.tensor_amax(self.format)?, 448.0);
                    self.emit("weight_scale_2", Dtype::F32, &[], &scalar(ws2))?;
                    self.emit("input_scale", Dtype::F32, &[], &scalar(self.input_scale()?))?;
                }
                ErrorStats::measure(w, |i| {
                    let (r, c) = (i / cols, i % cols);
                    let code = (q[(r / 2) * cols + c] >> (4 * (r % 2))) & 0xf;
                    f32::from(((code << 4) as i8) >> 4) * s[r * (cols / G) + c / G]
                })
            }
            Format::Nvfp4 | Format::Nvfp4Awq | Format::W4a16Nvfp4 => {
                let ws2 = scalar_div(
                    self.format,
                    self.scales.tensor_amax(self.format)?,
                    6.0 * 448.0,
                );
                let (mut packed, mut scales) = (vec![0u8; n / 2], vec![0u8; n / 16]);
                self.kernel(cpu::quantize_nvfp4(
                    w,
                    &shape,
                    ws2,
                    &mut packed,
                    &mut scales,
                ))?;
                self.emit("weight", Dtype::U8, &[self.rows, cols / 2], &packed)?;
                self.emit(
                    "weight_scale",
                    Dtype::F8_E4M3,
                    &[self.rows, cols / 16],
                    &scales,
                )?;
                self.emit("weight_scale_2", Dtype::F32, &[], &scalar(ws2))?;
                if self.format != Format::W4a16Nvfp4 {
                    let input = self.input_scale()?;
                    self.emit("input_scale", Dtype::F32, &[], &scalar(input))?;
                }
                // Each block's dequantization scale once, not once per element.
                let block: Vec<f32> = scales.iter().map(|&s| e4m3_to_f32(s) * ws2).collect();
                ErrorStats::measure(w, |i| e2m1_to_f32(nibble(&packed, i)) * block[i / 16])
            }
            Format::Mxfp8 => {
                let (mut q, mut s) = (vec![0u8; n], vec![0u8; n / 32]);
                self.kernel(cpu::quantize_mxfp8(w, cols, &mut q, &mut s))?;
                self.emit("weight", Dtype::F8_E4M3, &shape, &q)?;
                self.emit("weight_scale", Dtype::U8, &[self.rows, cols / 32], &s)?;
                ErrorStats::measure(w, |i| e4m3_to_f32(q[i]) * e8m0_to_f32(s[i / 32]))
            }
            Format::Mxfp4 => {
                let (mut q, mut s) = (vec![0u8; n / 2], vec![0u8; n / 32]);
                self.kernel(cpu::quantize_mxfp4(w, cols, &mut q, &mut s))?;
                self.emit("weight", Dtype::U8, &[self.rows, cols / 2], &q)?;
                self.emit("weight_scale", Dtype::U8, &[self.rows, cols / 32], &s)?;
                ErrorStats::measure(w, |i| e2m1_to_f32(nibble(&q, i)) * e8m0_to_f32(s[i / 32]))
            }
        };
        self.ctx.record_error(self.format, &error)
    }
}
