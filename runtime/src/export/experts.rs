//! Experts stored as 3-D tensors (docs/FORMATS.md §4.3b–c), the two layouts transformers uses:
//!
//! - **Fused experts** (transformers 5's in-memory layout, and checkpoints saved in it):
//!   `gate_up_proj [E, 2I, H]` (gate rows first) and `down_proj [E, H, I]` — `[E, out, in]`,
//!   `up_proj [E, I, H]` when there is no gate. Written as per-expert 2-D Linears
//!   `<experts>.<e>.{gate,up,down}_proj` (ModelOpt's fused-experts export). One input quantizer
//!   per projection, so every expert has the same `input_scale`; gate and up of an expert
//!   share the per-tensor weight amax (FP8 `weight_scale`, NVFP4 `weight_scale_2`); per-row and
//!   per-block amax are the slices' own.
//! - **BMM experts** (GPT-OSS, Llama4): `gate_up_proj [E, H, 2I]` and `down_proj [E, I, H]` —
//!   `[E, in, out]`. They stay 3-D, with one quantizer per projection across all experts:
//!   per-tensor scales, NVFP4 blocks along `in` (ModelOpt transposes, quantizes, transposes
//!   back), MX blocks along the last dimension, FP8 per-channel scales per expert.

use super::quantize::{Quantize, f32s, scalar, write_values};
use super::recipe::{Format, Recipe};
use super::scales::{ScaleSource, export_scale, input_scale_of};
use super::stats::ErrorStats;
use super::writer::Encoding;
use super::{ExportContext, ExportError, ModuleExporter, full_name, is_moe};
use crate::export::act_amax::ActAmax;
use crate::module_tree::{ModuleRef, ModuleTree};
use half::{bf16, f16};
use kiln_kernels::{Element, cpu, ops};
use safetensors::Dtype;

/// Experts classes that multiply with `bmm` (`[E, in, out]` weights).
const BMM_CLASSES: [&str; 2] = ["GptOssExperts", "Llama4TextExperts"];

fn is_3d(m: &ModuleRef<'_>, tensor: &str) -> bool {
    m.tensor(tensor).is_some_and(|t| t.shape.len() == 3)
}

/// An `experts` module of an MoE block holding fused `[E, out, in]` projections.
pub fn is_fused_experts(m: &ModuleRef<'_>) -> bool {
    m.local_name() == "experts"
        && !BMM_CLASSES.contains(&m.class_name())
        && m.parent().is_some_and(|p| is_moe(&p))
        && is_3d(m, "down_proj")
        && (is_3d(m, "gate_up_proj") || is_3d(m, "up_proj"))
}

/// The input projections of fused experts: `gate_up_proj`, or `up_proj` without a gate.
fn fused_input_projection(m: &ModuleRef<'_>) -> &'static str {
    if m.tensor("gate_up_proj").is_some() {
        "gate_up_proj"
    } else {
        "up_proj"
    }
}

/// The input quantizers 3-D experts need that `act` lacks (for formats with input scales).
pub fn missing_input_amax<'a>(
    tree: &'a ModuleTree,
    recipe: &'a Recipe,
    act: &'a ActAmax,
) -> impl Iterator<Item = String> + 'a {
    tree.walk()
        .flat_map(move |m| {
            let projections: Vec<&str> = if is_fused_experts(&m) {
                let first = fused_input_projection(&m);
                let local = if first == "gate_up_proj" {
                    "gate_proj"
                } else {
                    "up_proj"
                };
                [(first, local), ("down_proj", "down_proj")]
                    .into_iter()
                    .filter(|(_, l)| recipe.quantizes(&format!("{}.0.{l}", m.path())))
                    .map(|(p, _)| p)
                    .collect()
            } else if BMM_CLASSES.contains(&m.class_name()) && recipe.quantizes(m.path()) {
                ["gate_up_proj", "down_proj"]
                    .into_iter()
                    .filter(|p| is_3d(&m, p))
                    .collect()
            } else {
                Vec::new()
            };
            projections
                .into_iter()
                .map(move |p| format!("{}.{p}_input_quantizer", m.path()))
                .collect::<Vec<_>>()
        })
        .filter(move |q| act.quantizer(q).is_none())
}

/// The shape of a 3-D tensor of `module`, or a named error.
fn shape3(module: &ModuleRef<'_>, tensor: &str) -> Result<[usize; 3], ExportError> {
    let t = module
        .tensor(tensor)
        .ok_or_else(|| ExportError::MissingTensor {
            tensor: full_name(module.path(), tensor),
        })?;
    match t.shape[..] {
        [e, r, c] => Ok([e, r, c]),
        ref s => Err(ExportError::Shape {
            tensor: full_name(module.path(), tensor),
            expected: "a 3-D experts tensor".into(),
            found: s.to_vec(),
        }),
    }
}

/// Calls `$f::<T>(...)` with `T` the element type of dtype `$dtype` (BF16, F16, F32).
macro_rules! by_dtype {
    ($dtype:expr, $tensor:expr, $f:ident($($arg:expr),*)) => {
        match $dtype {
            Some(Dtype::BF16) => $f::<bf16>($($arg),*),
            Some(Dtype::F16) => $f::<f16>($($arg),*),
            Some(Dtype::F32) => $f::<f32>($($arg),*),
            Some(dtype) => Err(ExportError::Dtype { tensor: $tensor, dtype }),
            None => Err(ExportError::MissingTensor { tensor: $tensor }),
        }
    };
}

/// Fused experts → per-expert Linears.
#[crate::exporter(predicate = is_fused_experts, crate = crate)]
#[derive(Debug, Default)]
pub struct FusedExperts;

/// One expert slice's scales: its expert's amax and the projection's input quantizer.
struct SliceScales<'a> {
    ctx: &'a ExportContext,
    amax: f32,
    quantizer: String,
    /// The expert's whole matrix is one 128×128 tile: ModelOpt's block amax is then a scalar
    /// of the whole matrix, which gate and up both keep (nothing to slice).
    single_tile: bool,
}

impl ScaleSource for SliceScales<'_> {
    fn tensor_amax(&self, _format: Format) -> Result<f32, ExportError> {
        Ok(self.amax)
    }
    fn input_amax(&self, format: Format) -> Result<f32, ExportError> {
        self.ctx
            .quantizer_amax(&self.quantizer)?
            .ok_or_else(|| ExportError::MissingActAmax {
                format,
                quantizers: vec![self.quantizer.clone()],
            })
    }
    fn shared_tile_amax(&self) -> Result<Option<f32>, ExportError> {
        Ok(self.single_tile.then_some(self.amax))
    }
}

impl ModuleExporter for FusedExperts {
    fn export(
        &self,
        name: &str,
        module: ModuleRef<'_>,
        ctx: &ExportContext,
    ) -> Result<(), ExportError> {
        if !ctx.is_exporting() {
            return Ok(());
        }
        let first = fused_input_projection(&module);
        let [e, r, h] = shape3(&module, first)?;
        let [e2, h2, i] = shape3(&module, "down_proj")?;
        let gated = first == "gate_up_proj";
        let inter = if gated { r / 2 } else { r };
        if e2 != e || h2 != h || inter != i || (gated && r % 2 != 0) {
            return Err(ExportError::Shape {
                tensor: full_name(name, "down_proj"),
                expected: format!(
                    "[E, H, I] agreeing with `{first}` {:?} ([E, {}I, H])",
                    [e, r, h],
                    if gated { "2" } else { "" }
                ),
                found: vec![e2, h2, i],
            });
        }
        for t in module
            .tensors()
            .iter()
            .filter(|t| t.name != first && t.name != "down_proj")
        {
            ctx.copy_tensor(&full_name(name, &t.name))?;
        }
        let c = ctx.checkpoint()?;
        let dtype = |p: &str| c.tensor(&full_name(name, p)).map(|t| t.dtype);
        for expert in 0..e {
            let parts: &[(&str, usize)] = if gated {
                &[("gate_proj", 0), ("up_proj", i * h)]
            } else {
                &[("up_proj", 0)]
            };
            let input = Projection {
                ctx,
                experts: name,
                tensor: first,
                expert,
                rows: r,
                cols: h,
                parts,
                part_rows: i,
            };
            by_dtype!(dtype(first), full_name(name, first), slices(&input))?;
            let down = Projection {
                ctx,
                experts: name,
                tensor: "down_proj",
                expert,
                rows: h,
                cols: i,
                parts: &[("down_proj", 0)],
                part_rows: h,
            };
            by_dtype!(
                dtype("down_proj"),
                full_name(name, "down_proj"),
                slices(&down)
            )?;
        }
        Ok(())
    }
}

/// One expert of one fused projection, cut into its Linears.
struct Projection<'a> {
    ctx: &'a ExportContext,
    experts: &'a str,
    tensor: &'a str,
    expert: usize,
    /// The expert's matrix: `rows × cols`.
    rows: usize,
    cols: usize,
    /// Each Linear's local name and first element in the expert's matrix.
    parts: &'a [(&'a str, usize)],
    /// Rows per Linear.
    part_rows: usize,
}

fn slices<T: Element>(p: &Projection<'_>) -> Result<(), ExportError> {
    let ctx = p.ctx;
    let source = full_name(p.experts, p.tensor);
    let per_expert = p.rows * p.cols;
    let w: Vec<T> = ctx
        .checkpoint()?
        .read_range_as(&source, p.expert * per_expert, per_expert)?;
    // gate and up are copies of one per-expert quantizer: they share its amax.
    let scales = SliceScales {
        ctx,
        amax: cpu::amax(&w),
        quantizer: format!("{}_input_quantizer", source),
        single_tile: p.rows <= 128 && p.cols <= 128,
    };
    let recipe = ctx.recipe()?;
    for &(local, start) in p.parts {
        let out = format!("{}.{}.{local}", p.experts, p.expert);
        let slice = &w[start..start + p.part_rows * p.cols];
        if !recipe.quantizes(&out) {
            let dtype = ctx
                .checkpoint()?
                .tensor(&source)
                .map_or(Dtype::BF16, |t| t.dtype);
            ctx.emit(
                &full_name(&out, "weight"),
                dtype,
                &[p.part_rows, p.cols],
                bytemuck::cast_slice(slice),
            )?;
            continue;
        }
        if ctx.encoding()? == Encoding::Own {
            write_values(ctx, &out, &source, slice, p.part_rows, p.cols)?;
            continue;
        }
        Quantize {
            ctx,
            scales: &scales,
            out: &out,
            weight: &source,
            rows: p.part_rows,
            cols: p.cols,
            format: recipe.format,
        }
        .run(slice)?;
        ctx.record_quantized(&out, recipe.format)?;
    }
    Ok(())
}

/// BMM experts (GPT-OSS, Llama4) → 3-D quantized tensors.
#[crate::exporter(keys = ["GptOssExperts", "Llama4TextExperts"], crate = crate)]
#[derive(Debug, Default)]
pub struct BmmExperts;

impl ModuleExporter for BmmExperts {
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
        if !recipe.quantizes(name) {
            return ctx.copy_module(module);
        }
        if ctx.encoding()? == Encoding::Own {
            return Err(ExportError::WriterCannot {
                writer: ctx.writer_name()?.to_string(),
                what: format!("the BMM experts of `{name}` (GPT-OSS / Llama4 layout)"),
                supported: ctx.writer_formats(),
            });
        }
        let projections = ["gate_up_proj", "down_proj"];
        for t in module
            .tensors()
            .iter()
            .filter(|t| !projections.contains(&t.name.as_str()) || t.shape.len() != 3)
        {
            ctx.copy_tensor(&full_name(name, &t.name))?;
        }
        let c = ctx.checkpoint()?;
        for p in projections.into_iter().filter(|p| is_3d(&module, p)) {
            let shape = shape3(&module, p)?;
            let tensor = full_name(name, p);
            let bmm = Bmm {
                ctx,
                tensor: &tensor,
                shape,
                format: recipe.format,
            };
            by_dtype!(
                c.tensor(&tensor).map(|t| t.dtype),
                tensor.clone(),
                bmm_run(&bmm)
            )?;
        }
        ctx.record_quantized(name, recipe.format)
    }
}

/// One 3-D BMM projection `[E, in, out]`.
struct Bmm<'a> {
    ctx: &'a ExportContext,
    tensor: &'a str,
    shape: [usize; 3],
    format: Format,
}

impl Bmm<'_> {
    fn emit(
        &self,
        suffix: &str,
        dtype: Dtype,
        shape: &[usize],
        data: &[u8],
    ) -> Result<(), ExportError> {
        self.ctx
            .emit(&format!("{}{suffix}", self.tensor), dtype, shape, data)
    }

    fn kernel(&self, r: Result<(), kiln_kernels::KernelError>) -> Result<(), ExportError> {
        r.map_err(|source| ExportError::Kernel {
            tensor: self.tensor.to_string(),
            source,
        })
    }

    fn input_scale(&self) -> Result<f32, ExportError> {
        let quantizer = format!("{}_input_quantizer", self.tensor);
        let amax = self
            .ctx
            .quantizer_amax(&quantizer)?
            .ok_or(ExportError::MissingActAmax {
                format: self.format,
                quantizers: vec![quantizer],
            })?;
        Ok(input_scale_of(self.format, amax))
    }
}

/// Long on purpose: GPT-OSS's and Llama4's BMM expert layout, both projections and their scales, as
/// ModelOpt exports them.
fn bmm_run<T: Element>(b: &Bmm<'_>) -> Result<(), ExportError> {
    use kiln_kernels::cpu::bits::e4m3_to_f32;
    use kiln_kernels::formats::e8m0::e8m0_to_f32;
    use kiln_kernels::formats::fp4::e2m1_to_f32;
    let [e, k, n] = b.shape;
    let w: Vec<T> = b.ctx.checkpoint()?.read_as(b.tensor)?;
    let len = w.len();
    let shape = b.shape.to_vec();
    let nibble = |p: &[u8], i: usize| (p[i / 2] >> (4 * (i % 2))) & 0xf;
    let error = match b.format {
        Format::Fp8 => {
            // One quantizer over every expert: a 0-d scale (the raw amax). Unlike a 2-D
            // weight, the quotient is not rounded to the weight's dtype: divided in f32.
            let s = ops::fp8::fp8_scale(cpu::amax(&w));
            let mut q = vec![0u8; len];
            b.kernel(cpu::quantize_fp8_stacked(&w, &shape, &vec![s; e], &mut q))?;
            b.emit("", Dtype::F8_E4M3, &shape, &q)?;
            b.emit("_weight_scale", Dtype::F32, &[], &scalar(s))?;
            b.emit("_input_scale", Dtype::F32, &[], &scalar(b.input_scale()?))?;
            ErrorStats::measure(&w, |i| e4m3_to_f32(q[i]) * s)
        }
        Format::Fp8PerChannel => {
            // "Per channel" along axis 0 of a 3-D tensor: one scale per expert, divided in f32.
            let mut a = vec![0f32; e];
            b.kernel(cpu::amax_rows(&w, e, k * n, &mut a))?;
            let s: Vec<f32> = a.iter().map(|&x| export_scale(x, 448.0)).collect();
            let mut q = vec![0u8; len];
            b.kernel(cpu::quantize_fp8_stacked(&w, &shape, &s, &mut q))?;
            b.emit("", Dtype::F8_E4M3, &shape, &q)?;
            b.emit("_weight_scale", Dtype::F32, &[e], &f32s(&s))?;
            ErrorStats::measure(&w, |i| e4m3_to_f32(q[i]) * s[i / (k * n)])
        }
        Format::Fp8Block => {
            // 128×128 tiles of each expert's [in, out], scales [E, in/128, 1, out/128, 1].
            const TILE: usize = 128;
            let (tr, tc) = (k.div_ceil(TILE), n.div_ceil(TILE));
            let mut s = vec![0f32; e * tr * tc];
            let mut q = vec![0u8; len];
            for ((we, se), qe) in w
                .chunks_exact(k * n)
                .zip(s.chunks_exact_mut(tr * tc))
                .zip(q.chunks_exact_mut(k * n))
            {
                b.kernel(cpu::amax_tiles(we, k, n, TILE, se))?;
                for x in se.iter_mut() {
                    *x = export_scale(*x, 448.0);
                }
                b.kernel(cpu::quantize_fp8_tiles(we, k, n, TILE, se, qe))?;
            }
            b.emit("", Dtype::F8_E4M3, &shape, &q)?;
            b.emit("_weight_scale", Dtype::F32, &[e, tr, 1, tc, 1], &f32s(&s))?;
            ErrorStats::measure(&w, |i| {
                let (x, r, col) = (i / (k * n), (i / n) % k, i % n);
                e4m3_to_f32(q[i]) * s[(x * tr + r / TILE) * tc + col / TILE]
            })
        }
        Format::Nvfp4 | Format::W4a16Nvfp4 => {
            let ws2 = ops::nvfp4::nvfp4_global_scale(cpu::amax(&w));
            let (mut packed, mut scales) = (vec![0u8; len / 2], vec![0u8; len / 16]);
            b.kernel(ops::nvfp4::quantize_nvfp4_transposed(
                &w,
                &shape,
                ws2,
                &mut packed,
                &mut scales,
            ))?;
            b.emit("", Dtype::U8, &[e, k / 2, n], &packed)?;
            b.emit("_weight_scale", Dtype::F8_E4M3, &[e, k / 16, n], &scales)?;
            b.emit("_weight_scale_2", Dtype::F32, &[], &scalar(ws2))?;
            if b.format == Format::Nvfp4 {
                b.emit("_input_scale", Dtype::F32, &[], &scalar(b.input_scale()?))?;
            }
            ErrorStats::measure(&w, |i| {
                let (x, r, col) = (i / (k * n), (i / n) % k, i % n);
                let code = (packed[(x * (k / 2) + r / 2) * n + col] >> (4 * (r % 2))) & 0xf;
                let sc = scales[(x * (k / 16) + r / 16) * n + col];
                e2m1_to_f32(code) * (e4m3_to_f32(sc) * ws2)
            })
        }
        Format::Mxfp8 => {
            let (mut q, mut s) = (vec![0u8; len], vec![0u8; len / 32]);
            b.kernel(cpu::quantize_mxfp8(&w, n, &mut q, &mut s))?;
            b.emit("", Dtype::F8_E4M3, &shape, &q)?;
            b.emit("_weight_scale", Dtype::U8, &[e, k, n / 32], &s)?;
            ErrorStats::measure(&w, |i| e4m3_to_f32(q[i]) * e8m0_to_f32(s[i / 32]))
        }
        Format::Mxfp4 => {
            let (mut q, mut s) = (vec![0u8; len / 2], vec![0u8; len / 32]);
            b.kernel(cpu::quantize_mxfp4(&w, n, &mut q, &mut s))?;
            b.emit("", Dtype::U8, &[e, k, n / 2], &q)?;
            b.emit("_weight_scale", Dtype::U8, &[e, k, n / 32], &s)?;
            ErrorStats::measure(&w, |i| e2m1_to_f32(nibble(&q, i)) * e8m0_to_f32(s[i / 32]))
        }
        other => {
            return Err(ExportError::Unsupported {
                target: b.tensor.to_string(),
                format: other,
                reason: "cannot quantize BMM experts (3-D [experts, in, out]; ModelOpt 0.47 cannot either); formats that can: fp8, fp8-per-channel, fp8-block, nvfp4, w4a16-nvfp4, mxfp8, mxfp4".into(),
            });
        }
    };
    b.ctx.record_error(b.format, &error)
}
