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
        let q = Quantize {
            ctx,
            module,
            name,
            weight: &weight,
            rows,
            cols,
            format,
        };
        match meta.dtype {
            Dtype::BF16 => q.run(&c.read_as::<bf16>(&weight)?)?,
            Dtype::F16 => q.run(&c.read_as::<f16>(&weight)?)?,
            Dtype::F32 => q.run(&c.read_as::<f32>(&weight)?)?,
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
fn export_scale(amax: f32, divisor: f32) -> f32 {
    if amax == 0.0 || amax.is_nan() {
        1.0
    } else {
        amax.max(f32::MIN_POSITIVE) / divisor
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

/// One Linear's quantization.
struct Quantize<'a> {
    ctx: &'a ExportContext,
    module: ModuleRef<'a>,
    name: &'a str,
    weight: &'a str,
    rows: usize,
    cols: usize,
    format: Format,
}

fn scalar(v: f32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

fn f32s(v: &[f32]) -> Vec<u8> {
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
            .emit(&full_name(self.name, tensor), dtype, shape, data)
    }

    /// The input scale: `amax / divisor`, with the amax the max over the group members that have
    /// one (an error when none has); a zero or NaN amax becomes the quantizer's bound
    /// (ModelOpt's `export_amax`).
    fn input_scale(&self, group: &[String]) -> Result<f32, ExportError> {
        let (bound, divisor) = self.format.input_bound_and_divisor();
        let mut found = None;
        for m in group {
            if let Some(a) = self.ctx.input_amax(m)? {
                found = Some(found.map_or(a, |f: f32| f.max(a)));
            }
        }
        let amax = found.ok_or_else(|| ExportError::MissingActAmax {
            format: self.format,
            modules: group.to_vec(),
        })?;
        let amax = if amax == 0.0 || amax.is_nan() {
            bound
        } else {
            amax
        };
        Ok(amax / divisor)
    }

    /// Per-row (`tile = None`) or per-tile scales `amax / divisor`, the amax exported as
    /// ModelOpt's `export_amax` does: zero or NaN becomes the bound (scale 1), and a subnormal
    /// is raised to `f32::MIN_POSITIVE`. An expert's gate/up take the element-wise max of both
    /// amax (`sync_moe_gate_up_amax`).
    fn amax_scales<T: Element>(
        &self,
        w: &[T],
        tile: Option<usize>,
        divisor: f32,
    ) -> Result<Vec<f32>, ExportError> {
        let (rows, cols) = (self.rows, self.cols);
        let len = match tile {
            None => rows,
            Some(t) => rows.div_ceil(t) * cols.div_ceil(t),
        };
        fn reduce<T: Element>(
            x: &[T],
            rows: usize,
            cols: usize,
            tile: Option<usize>,
            out: &mut [f32],
        ) -> Result<(), kiln_kernels::KernelError> {
            match tile {
                None => cpu::amax_rows(x, rows, cols, out),
                Some(t) => cpu::amax_tiles(x, rows, cols, t, out),
            }
        }
        let mut a = vec![0f32; len];
        self.kernel(reduce(w, rows, cols, tile, &mut a))?;
        if let Some(pair) = expert_gate_up(self.module) {
            let other = if pair[0] == self.name {
                &pair[1]
            } else {
                &pair[0]
            };
            let mut b = vec![0f32; len];
            let c = self.ctx.checkpoint()?;
            let name = full_name(other, "weight");
            match c.tensor(&name).map(|t| t.dtype) {
                Some(Dtype::BF16) => {
                    self.kernel(reduce(&c.read_as::<bf16>(&name)?, rows, cols, tile, &mut b))?
                }
                Some(Dtype::F16) => {
                    self.kernel(reduce(&c.read_as::<f16>(&name)?, rows, cols, tile, &mut b))?
                }
                Some(Dtype::F32) => {
                    self.kernel(reduce(&c.read_as::<f32>(&name)?, rows, cols, tile, &mut b))?
                }
                other => {
                    return Err(ExportError::Invalid(format!(
                        "tensor `{name}`: cannot sync gate/up amax with dtype {other:?}"
                    )));
                }
            }
            for (x, y) in a.iter_mut().zip(&b) {
                *x = if x.is_nan() || y.is_nan() {
                    f32::NAN
                } else {
                    x.max(*y)
                };
            }
        }
        Ok(a.iter().map(|&x| export_scale(x, divisor)).collect())
    }

    fn run<T: Element>(&self, w: &[T]) -> Result<(), ExportError> {
        use kiln_kernels::cpu::bits::e4m3_to_f32;
        use kiln_kernels::formats::e8m0::e8m0_to_f32;
        use kiln_kernels::formats::fp4::e2m1_to_f32;
        let (n, cols, shape) = (w.len(), self.cols, [self.rows, self.cols]);
        let nibble = |p: &[u8], i: usize| (p[i / 2] >> (4 * (i % 2))) & 0xf;
        let error = match self.format {
            Format::Fp8 => {
                // FORMATS.md: the raw weight amax (a zero amax gives a zero scale), the quotient
                // rounded to the weight's dtype before the cast; an expert's gate/up share it.
                let amax = match expert_gate_up(self.module) {
                    Some(pair) => self
                        .ctx
                        .weight_amax(&full_name(&pair[0], "weight"))?
                        .max(self.ctx.weight_amax(&full_name(&pair[1], "weight"))?),
                    None => self.ctx.weight_amax(self.weight)?,
                };
                let s = ops::fp8::fp8_scale(amax);
                let mut q = vec![0u8; n];
                self.kernel(cpu::quantize_fp8_per_tensor(w, s, &mut q))?;
                let input = self.input_scale(&[self.name.to_string()])?;
                self.emit("weight", Dtype::F8_E4M3, &shape, &q)?;
                self.emit("weight_scale", Dtype::F32, &[], &scalar(s))?;
                self.emit("input_scale", Dtype::F32, &[], &scalar(input))?;
                ErrorStats::measure(w, |i| e4m3_to_f32(q[i]) * s)
            }
            Format::Fp8PerChannel => {
                let s = self.amax_scales(w, None, 448.0)?;
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
                let mut s = self.amax_scales(w, Some(TILE), 448.0)?;
                // `preprocess_linear_fusion`: when a shared-input group (q/k/v, gate/up) has
                // one tile each, its amax is a scalar and the group shares the max.
                let recipe = self.ctx.recipe()?;
                let group = input_group(self.module, |p| recipe.quantizes(p));
                let c = self.ctx.checkpoint()?;
                let one_tile = |m: &String| {
                    c.tensor(&full_name(m, "weight"))
                        .is_some_and(|t| t.shape.iter().all(|&d| d <= TILE))
                };
                if group.len() > 1 && group.iter().all(one_tile) {
                    let mut amax = 0f32;
                    for m in &group {
                        let a = self.ctx.weight_amax(&full_name(m, "weight"))?;
                        amax = if a.is_nan() || amax.is_nan() {
                            f32::NAN
                        } else {
                            amax.max(a)
                        };
                    }
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
            Format::Int8Wo => {
                let s = self.amax_scales(w, None, 127.0)?;
                let mut q = vec![0i8; n];
                self.kernel(cpu::quantize_int8_per_channel(
                    w, self.rows, cols, &s, &mut q,
                ))?;
                self.emit("weight", Dtype::I8, &shape, bytemuck::cast_slice(&q))?;
                self.emit("weight_scale", Dtype::F32, &[self.rows], &f32s(&s))?;
                ErrorStats::measure(w, |i| f32::from(q[i]) * s[i / cols])
            }
            Format::Nvfp4 | Format::W4a16Nvfp4 => {
                let recipe = self.ctx.recipe()?;
                let group = input_group(self.module, |p| recipe.quantizes(p));
                let mut amax = 0f32;
                for m in &group {
                    amax = amax.max(self.ctx.weight_amax(&full_name(m, "weight"))?);
                }
                let ws2 = ops::nvfp4::nvfp4_global_scale(amax);
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
                if self.format == Format::Nvfp4 {
                    let input = self.input_scale(&group)?;
                    self.emit("input_scale", Dtype::F32, &[], &scalar(input))?;
                }
                ErrorStats::measure(w, |i| {
                    e2m1_to_f32(nibble(&packed, i)) * (e4m3_to_f32(scales[i / 16]) * ws2)
                })
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
            other => {
                return Err(ExportError::Invalid(format!(
                    "format {other} is not implemented yet"
                )));
            }
        };
        self.ctx.record_error(self.format, &error)
    }
}
