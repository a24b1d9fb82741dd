//! The per-format writer of one Linear-shaped weight: quantizes it with the kernels and writes
//! ModelOpt's tensors (docs/FORMATS.md §2) and the error statistics.

use super::recipe::Format;
use super::scales::{
    GivenScales, Granularity, ScaleSource, TreeScales, export_scale, input_scale_of, nan_max,
    reduce_amax, scalar_div,
};
use super::stats::ErrorStats;
use super::writer::Encoding;
use super::{ExportContext, ExportError, full_name};
use crate::module_tree::ModuleRef;
use half::{bf16, f16};
use kiln_kernels::{Element, cpu, ops};
use safetensors::Dtype;

/// Quantizes the Linear `module` of the input checkpoint to `format` exactly as kiln's
/// built-in Linear exporter does — ModelOpt's scale rules, shared scales with its siblings
/// (q/k/v, gate/up, an expert's gate/up), AWQ / SmoothQuant smoothing when the export has it
/// — writes its tensors (`weight`, `weight_scale`, …; other tensors such as `bias` copied) and
/// declares the format. The export's own format need not be `format`: a module in another
/// format makes the checkpoint ModelOpt's `MIXED_PRECISION`.
///
/// This is what a plugin exporter calls to quantize a Linear it takes over:
///
/// ```
/// use kiln_runtime::export::{ExportContext, ExportError, ModuleExporter, quantize_linear};
/// use kiln_runtime::export::recipe::Format;
/// use kiln_runtime::ModuleRef;
///
/// /// Quantizes `lm_head` to FP8 (per-tensor scales) whatever the export's format.
/// #[kiln_runtime::exporter(predicate = is_lm_head, prepend, crate = kiln_runtime)]
/// struct Fp8LmHead;
///
/// fn is_lm_head(m: &ModuleRef<'_>) -> bool {
///     m.path() == "lm_head"
/// }
///
/// impl ModuleExporter for Fp8LmHead {
///     fn export(&self, _: &str, module: ModuleRef<'_>, ctx: &ExportContext) -> Result<(), ExportError> {
///         quantize_linear(ctx, module, Format::Fp8)
///     }
/// }
/// ```
pub fn quantize_linear(
    ctx: &ExportContext,
    module: ModuleRef<'_>,
    format: Format,
) -> Result<(), ExportError> {
    let name = module.path();
    refuse_modelopt_format(ctx, name, format)?;
    for t in module.tensors().iter().filter(|t| t.name != "weight") {
        ctx.copy_tensor(&full_name(name, &t.name))?;
    }
    let c = ctx.checkpoint()?;
    let (weight, meta, rows, cols) = linear_weight(c, name)?;
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
            // Already FP8 (docs/FORMATS.md: "weights already in float8_e4m3fn pass through").
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

/// Quantizes the Linear `module` in the export's own format, whichever writer the export
/// uses (`--output-format`): one without an encoder of its own gets [`quantize_linear`] in
/// its format with ModelOpt's scale rules ([`Encoding::Shared`]); one with an encoder
/// receives the weight's values and chooses the arithmetic ([`Encoding::Own`]). This is what
/// kiln's built-in Linear exporter calls; a plugin that quantizes a module the built-ins do
/// not take calls it too, so its module follows the export into every format.
pub fn quantize_module(ctx: &ExportContext, module: ModuleRef<'_>) -> Result<(), ExportError> {
    if let Encoding::Shared(format) = ctx.encoding()? {
        return quantize_linear(ctx, module, format);
    }
    let name = module.path();
    for t in module.tensors().iter().filter(|t| t.name != "weight") {
        ctx.copy_tensor(&full_name(name, &t.name))?;
    }
    let c = ctx.checkpoint()?;
    let (weight, meta, rows, cols) = linear_weight(c, name)?;
    match meta.dtype {
        Dtype::BF16 => write_values(ctx, name, &weight, &c.read_as::<bf16>(&weight)?, rows, cols),
        Dtype::F16 => write_values(ctx, name, &weight, &c.read_as::<f16>(&weight)?, rows, cols),
        Dtype::F32 => write_values(ctx, name, &weight, &c.read_as::<f32>(&weight)?, rows, cols),
        dtype => Err(ExportError::Dtype {
            tensor: weight,
            dtype,
        }),
    }
}

/// The `weight` of the Linear `module`: its name, its entry and `[rows, cols]`, or an error
/// naming it when it is missing or not 2-D.
fn linear_weight<'c>(
    c: &'c crate::checkpoint::Checkpoint,
    module: &str,
) -> Result<(String, &'c crate::checkpoint::TensorMeta, usize, usize), ExportError> {
    let weight = full_name(module, "weight");
    let meta = c
        .tensor(&weight)
        .ok_or_else(|| ExportError::MissingTensor {
            tensor: weight.clone(),
        })?;
    match meta.shape[..] {
        [r, k] => Ok((weight, meta, r, k)),
        ref s => Err(ExportError::Shape {
            tensor: weight,
            expected: "a 2-D Linear weight [out, in]".into(),
            found: s.to_vec(),
        }),
    }
}

/// Hands `rows × cols` values of a Linear (output module `module`, read from `source`) to the
/// export's writer, which has an encoder of its own ([`Encoding::Own`]).
pub(crate) fn write_values<T: Element>(
    ctx: &ExportContext,
    module: &str,
    source: &str,
    w: &[T],
    rows: usize,
    cols: usize,
) -> Result<(), ExportError> {
    use super::writer::{LinearWeight, WeightValues};
    ctx.count_nonfinite(source, w)?;
    let values = WeightValues::from_bytes(element_dtype::<T>(), bytemuck::cast_slice(w))
        .ok_or_else(|| ExportError::Dtype {
            tensor: source.to_string(),
            dtype: element_dtype::<T>(),
        })?;
    ctx.write_linear(&LinearWeight {
        module,
        source,
        values,
        rows,
        cols,
        input_amax: ctx.input_amax(module)?,
    })
}

/// The safetensors dtype of a kernel element type.
fn element_dtype<T: Element>() -> Dtype {
    match T::DTYPE {
        "F16" => Dtype::F16,
        "F32" => Dtype::F32,
        _ => Dtype::BF16,
    }
}

/// Under a writer with an encoder of its own, a ModelOpt format named explicitly by an exporter
/// is refused by name: the writer has its own formats (`--format`), and silently writing
/// another would misstate what the module holds.
fn refuse_modelopt_format(
    ctx: &ExportContext,
    module: &str,
    format: Format,
) -> Result<(), ExportError> {
    match ctx.encoding()? {
        Encoding::Shared(_) => Ok(()),
        Encoding::Own => Err(ExportError::WriterCannot {
            writer: ctx.writer_name()?.to_string(),
            what: format!("ModelOpt's `{format}`, which an exporter asked for module `{module}`"),
            supported: ctx.writer_formats(),
        }),
    }
}

/// Quantizes weight values a plugin computed itself (`rows × cols`, row-major, `[out, in]`)
/// to `format`, writes `<module>.weight`, `<module>.weight_scale`, … with ModelOpt's scale
/// rules for a Linear that shares no scale with another, and declares the format.
/// `input_amax` is the input's calibrated amax, needed by formats with a static input scale
/// (`fp8`, `nvfp4`, `int8-sq`, `w4a8-awq`, `nvfp4-awq`): without one those formats fail with
/// [`ExportError::MissingActAmax`]. `values_of` names the input tensor in error messages.
pub fn quantize_weight<T: Element>(
    ctx: &ExportContext,
    module: &str,
    values_of: &str,
    w: &[T],
    [rows, cols]: [usize; 2],
    format: Format,
    input_amax: Option<f32>,
) -> Result<(), ExportError> {
    refuse_modelopt_format(ctx, module, format)?;
    if w.len() != rows * cols {
        return Err(ExportError::Shape {
            tensor: values_of.to_string(),
            expected: format!("{rows} × {cols} = {} values", rows * cols),
            found: vec![w.len()],
        });
    }
    ctx.count_nonfinite(values_of, w)?;
    let scales = GivenScales {
        module,
        tensor_amax: cpu::amax(w),
        input_amax,
    };
    Quantize {
        ctx,
        scales: &scales,
        out: module,
        weight: values_of,
        rows,
        cols,
        format,
    }
    .run(w)?;
    ctx.record_quantized(module, format)
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
            return Err(ExportError::StatisticLength {
                quantizer: format!("{}.weight_quantizer", self.out),
                found: amax.len(),
                expected: format!("the weight has {want} blocks of {group}"),
            });
        }
        Ok(Some(amax))
    }

    /// [`Quantize::run`] after the AWQ / SmoothQuant smoothing of the Linear, if any, writing
    /// its `pre_quant_scale` (in the weight's dtype) unless a norm absorbed it.
    fn run_smoothed<T: Element>(&self, w: Vec<T>) -> Result<(), ExportError> {
        // The weight is in memory: its amax costs little here and a second read later.
        self.ctx.remember_weight_amax(self.weight, cpu::amax(&w))?;
        self.ctx.count_nonfinite(self.weight, &w)?;
        let Some(s) = self.ctx.smoothing(self.out) else {
            return self.run(&w);
        };
        let smoothed = s.apply(&w, self.cols);
        drop(w);
        if let Some(scale) = &s.scale {
            let pqs: Vec<T> = scale.iter().map(|&x| T::from_f32(x)).collect();
            let dtype = element_dtype::<T>();
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
    ///
    /// Long on purpose: ModelOpt's scale rules, one arm per format, as its export code has them.
    pub(crate) fn run<T: Element>(&self, w: &[T]) -> Result<(), ExportError> {
        use kiln_kernels::cpu::bits::e4m3_to_f32;
        use kiln_kernels::formats::e8m0::e8m0_to_f32;
        use kiln_kernels::formats::fp4::e2m1_to_f32;
        let (n, cols, shape) = (w.len(), self.cols, [self.rows, self.cols]);
        let nibble = |p: &[u8], i: usize| (p[i / 2] >> (4 * (i % 2))) & 0xf;
        let error = match self.format {
            Format::Fp8 => {
                // docs/FORMATS.md: the raw weight amax (a zero amax gives a zero scale), the quotient
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
                // docs/FORMATS.md fp8_pb_wo: one f32 scale per 128×128 tile (edge tiles partial),
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
                // Blocks of G (128, or --group-size) along K: scale = block amax / 7 (a zero
                // block → 1), nibble pairs along the output dimension: weight [N/2, K],
                // weight_scale [N, K/G].
                let g = self
                    .format
                    .block(self.ctx.recipe()?.group_size)
                    .unwrap_or(128);
                #[allow(non_snake_case)]
                let G = g;
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
