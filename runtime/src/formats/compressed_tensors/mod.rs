//! The compressed-tensors writer (`--output-format compressed-tensors`): what llm-compressor
//! 0.14's `QuantizationModifier` (round to nearest) and `save_pretrained` write — vLLM's native
//! layout, loaded by transformers through the `compressed-tensors` package
//! (docs/FORMATS.md §9).
//!
//! Which tensors: the Linears the exporters quantize (by default every Linear but `lm_head`
//! and MoE routers, llm-compressor's usual `ignore`), each under its own name, experts per
//! expert; everything else copied in its dtype. `config.json` gains `quantization_config`: one
//! config group targeting `Linear`, the ignored Linears by name, `kv_cache_scheme`.

pub mod quant;
#[cfg(feature = "exec")]
pub mod read;
pub mod reader;

use crate::checkpoint::Checkpoint;
use crate::export::ExportError;
use crate::export::act_amax::ActAmax;
use crate::export::recipe::{KvCache, Recipe};
use crate::export::stats::ErrorStats;
use crate::export::writer::{
    ChosenCodes, Encoded, EncodedType, GptqGrid, GptqStyle, GptqTarget, IntGrid, LinearWeight,
    OutputWriter, WeightValues, WriterEnd, WriterStart, WriterType, Written,
};
use crate::module_tree::Linear;
use crate::sink::ShardWriter;
use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::formats::fp4::e2m1_to_f32;
use kiln_kernels::formats::fp8::e4m3_to_f32;
use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::{Map, Value as Json, json};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// The compressed-tensors version whose on-disk format kiln writes (`quantization_config.version`).
pub const FORMAT_VERSION: &str = "0.19.0";

/// One of llm-compressor's preset schemes (`QuantizationModifier(scheme=…)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// FP8 weights per output channel, FP8 activations per token at run time.
    Fp8Dynamic,
    /// FP8 weights per tensor, FP8 activations per tensor with a calibrated `input_scale`.
    Fp8,
    /// FP8 weights in 128 × 128 blocks, activations in groups of 128 at run time.
    Fp8Block,
    /// INT8 weights per output channel, INT8 activations per token at run time.
    W8a8,
    /// INT4 weights in groups of 128 (or `--group-size`), symmetric, packed into int32.
    W4a16,
    /// INT4 weights in groups of 128 (or `--group-size`) with zero points.
    W4a16Asym,
    /// INT8 weights in groups of 128 (or `--group-size`), symmetric, packed into int32.
    W8a16,
    /// NVFP4 weights (groups of 16, FP8 group scales, an f32 global scale); 16-bit activations.
    Nvfp4a16,
    /// NVFP4 weights and activations; the activations' global scale is calibrated.
    Nvfp4,
}

impl Scheme {
    /// Every `--format`, the default first, with llm-compressor's preset name.
    pub const ALL: [(&'static str, Scheme, &'static str); 9] = [
        ("fp8-dynamic", Scheme::Fp8Dynamic, "FP8_DYNAMIC"),
        ("fp8", Scheme::Fp8, "FP8"),
        ("fp8-block", Scheme::Fp8Block, "FP8_BLOCK"),
        ("w8a8", Scheme::W8a8, "W8A8"),
        ("w4a16", Scheme::W4a16, "W4A16"),
        ("w4a16-asym", Scheme::W4a16Asym, "W4A16_ASYM"),
        ("w8a16", Scheme::W8a16, "W8A16"),
        ("nvfp4a16", Scheme::Nvfp4a16, "NVFP4A16"),
        ("nvfp4", Scheme::Nvfp4, "NVFP4"),
    ];

    /// `(--format name, llm-compressor preset)`.
    fn names(self) -> (&'static str, &'static str) {
        Scheme::ALL
            .iter()
            .find(|(_, s, _)| *s == self)
            .map_or(("", ""), |(n, _, p)| (n, p))
    }

    fn name(self) -> &'static str {
        self.names().0
    }

    fn preset(self) -> &'static str {
        self.names().1
    }

    /// Whether the scheme stores a calibrated activation scale (needs `--act-amax` / `--calib`).
    pub fn static_activations(self) -> bool {
        matches!(self, Scheme::Fp8 | Scheme::Nvfp4)
    }

    /// The integer weight-only schemes: `(bits, symmetric)`.
    fn int_weights(self) -> Option<(u32, bool)> {
        match self {
            Scheme::W4a16 => Some((4, true)),
            Scheme::W4a16Asym => Some((4, false)),
            Scheme::W8a16 => Some((8, true)),
            _ => None,
        }
    }

    /// The weight group size llm-compressor's preset uses (`None`: no groups, or fixed ones).
    fn default_group(self) -> Option<usize> {
        match self {
            Scheme::W4a16 | Scheme::W4a16Asym | Scheme::W8a16 => Some(128),
            _ => None,
        }
    }

    /// The columns a row must be a whole number of, with `--group-size` `group`.
    fn group(self, group: Option<usize>) -> usize {
        match self {
            Scheme::W4a16 | Scheme::W4a16Asym | Scheme::W8a16 => {
                group.or(self.default_group()).unwrap_or(1)
            }
            Scheme::Nvfp4 | Scheme::Nvfp4a16 => 16,
            _ => 1,
        }
    }

    /// `quantization_config.format` (and the group's `format`).
    fn format(self) -> &'static str {
        match self {
            Scheme::Fp8Dynamic | Scheme::Fp8 | Scheme::Fp8Block => "float-quantized",
            Scheme::W8a8 => "int-quantized",
            Scheme::W4a16 | Scheme::W4a16Asym | Scheme::W8a16 => "pack-quantized",
            Scheme::Nvfp4 | Scheme::Nvfp4a16 => "nvfp4-pack-quantized",
        }
    }

    /// The config group's `weights` and `input_activations`, as compressed-tensors 0.19
    /// serializes the preset's `QuantizationArgs` (with `--group-size` `group`).
    fn args(self, group: Option<usize>) -> (Json, Json) {
        let group = group.or(self.default_group());
        // Weights: observed by min/max when quantized. Dynamic activations: no observer.
        let weights = |bits, ty, strategy| {
            args(bits, ty, strategy).with("observer", json!("memoryless_minmax"))
        };
        let dynamic = |bits, ty, strategy| args(bits, ty, strategy).with("dynamic", json!(true));
        let fp4 = |observer: &str| {
            args(4, "float", "tensor_group")
                .with("group_size", json!(16))
                .with("observer", json!(observer))
                .with("scale_dtype", json!("torch.float8_e4m3fn"))
        };
        let (w, a) = match self {
            Scheme::Fp8Dynamic => (weights(8, "float", "channel"), dynamic(8, "float", "token")),
            Scheme::Fp8 => (
                weights(8, "float", "tensor"),
                args(8, "float", "tensor").with("observer", json!("static_minmax")),
            ),
            Scheme::Fp8Block => (
                weights(8, "float", "block").with("block_structure", json!([128, 128])),
                dynamic(8, "float", "group").with("group_size", json!(128)),
            ),
            Scheme::W8a8 => (weights(8, "int", "channel"), dynamic(8, "int", "token")),
            Scheme::W4a16 => (
                weights(4, "int", "group").with("group_size", json!(group)),
                Json::Null,
            ),
            Scheme::W4a16Asym => (
                weights(4, "int", "group")
                    .with("group_size", json!(group))
                    .with("symmetric", json!(false))
                    .with("zp_dtype", json!("torch.int8")),
                Json::Null,
            ),
            Scheme::W8a16 => (
                weights(8, "int", "group").with("group_size", json!(group)),
                Json::Null,
            ),
            Scheme::Nvfp4a16 => (fp4("memoryless_minmax"), Json::Null),
            Scheme::Nvfp4 => (
                fp4("memoryless_minmax"),
                fp4("static_minmax").with("dynamic", json!("local")),
            ),
        };
        (w, a)
    }
}

/// A `QuantizationArgs` as compressed-tensors serializes it — every field, sorted — with the
/// defaults: symmetric, static, no groups, blocks, observer or special dtypes.
fn args(bits: u32, ty: &str, strategy: &str) -> Json {
    json!({
        "actorder": null,
        "block_structure": null,
        "dynamic": false,
        "group_size": null,
        "num_bits": bits,
        "observer": null,
        "observer_kwargs": {},
        "scale_dtype": null,
        "strategy": strategy,
        "symmetric": true,
        "type": ty,
        "zp_dtype": null,
    })
}

trait With {
    fn with(self, key: &str, value: Json) -> Json;
}

impl With for Json {
    fn with(mut self, key: &str, value: Json) -> Json {
        if let Json::Object(m) = &mut self {
            m.insert(key.into(), value);
        }
        self
    }
}

/// compressed-tensors' `kv_cache_scheme` for an FP8 cache (static per-tensor scales).
fn kv_cache_scheme() -> Json {
    args(8, "float", "tensor")
}

/// vLLM's compressed-tensors layout.
#[crate::writer(name = "compressed-tensors", reader = reader::CompressedTensorsReader, crate = crate)]
pub struct CompressedTensors {
    scheme: Scheme,
    /// `--group-size`, where the scheme takes one (the preset's otherwise).
    group_size: Option<usize>,
    state: Option<State>,
    shards: Option<ShardWriter>,
    /// Each quantized weight's amax, by module (NVFP4's shared global scales).
    amax: Mutex<HashMap<String, f32>>,
}

struct State {
    checkpoint: Arc<Checkpoint>,
    recipe: Recipe,
    /// Every Linear in module order (`ignore` lists those left unquantized).
    linears: Vec<String>,
    /// `k_scale` / `v_scale` tensors, when the KV cache is quantized.
    kv: Vec<Encoded>,
    /// The codes GPTQ chose (`--algorithm gptq`), stored in place of round to nearest.
    codes: Option<Arc<dyn ChosenCodes>>,
}

fn err(what: impl Into<String>) -> ExportError {
    ExportError::Writer {
        writer: "compressed-tensors".into(),
        what: what.into(),
    }
}

fn formats() -> Vec<String> {
    Scheme::ALL.iter().map(|(n, _, _)| n.to_string()).collect()
}

fn st_dtype<T: Element>() -> Dtype {
    match T::DTYPE {
        "F16" => Dtype::F16,
        "F32" => Dtype::F32,
        _ => Dtype::BF16,
    }
}

/// One value of `T` as little-endian bytes.
fn t_bytes<T: Element>(x: f32) -> Vec<u8> {
    bytemuck::bytes_of(&T::from_f32(x)).to_vec()
}

/// `T`-typed values as little-endian bytes.
fn ts_bytes<T: Element>(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|&v| t_bytes::<T>(v)).collect()
}

/// Every E4M3 code's value.
fn e4m3_table() -> [f32; 256] {
    std::array::from_fn(|c| e4m3_to_f32(c as u8))
}

/// Siblings whose weights share NVFP4's global scale (llm-compressor's `FUSED_LAYER_NAMES`).
const FUSED: [&[&str]; 4] = [
    &["gate_proj", "up_proj"],
    &["q_proj", "k_proj", "v_proj"],
    &["q_a_proj", "kv_a_proj_with_mqa"],
    &["w1", "w3"],
];

impl CompressedTensors {
    /// The integer grid of a Linear with `cols` input features (the integer schemes).
    fn int_grid(&self, cols: usize) -> Option<IntGrid> {
        let (bits, symmetric) = self.scheme.int_weights()?;
        let group = match self.scheme.group(self.group_size) {
            1 => cols,
            g => g,
        };
        Some(IntGrid {
            bits,
            symmetric,
            group,
        })
    }

    fn state(&self) -> Result<&State, ExportError> {
        self.state
            .as_ref()
            .ok_or_else(|| err("used before `begin`"))
    }

    /// The amax NVFP4's global scale comes from: the largest of the quantized siblings'
    /// weights' amax (`fuse_weight_observers`), or the weight's own. A sibling is read from
    /// the checkpoint — its own tensor, or its rows of the fused experts tensor `source`
    /// (`gate_up_proj [E, 2I, H]`: gate rows first).
    fn shared_amax(&self, module: &str, source: &str, own: f32) -> Result<f32, ExportError> {
        let s = self.state()?;
        fused_amax(&s.checkpoint, &s.recipe, module, source, own, &self.amax)
    }

    fn encode<T: Element>(&self, w: &LinearWeight<'_>, x: &[T]) -> Result<Written, ExportError> {
        let (cols, module) = (w.cols, w.module);
        let scheme = self.scheme;
        if let Some(why) = self.check_linear(&[w.rows, cols]) {
            return Err(ExportError::WriterCannot {
                writer: "compressed-tensors".into(),
                what: format!(
                    "`{module}`: {why} ({}); leave it unquantized with --exclude",
                    scheme.name()
                ),
                supported: formats(),
            });
        }
        let mut out = Tensors::default();
        let mut decoded = vec![0f32; x.len()];
        match scheme {
            Scheme::Fp8Dynamic | Scheme::Fp8 | Scheme::Fp8Block | Scheme::W8a8 => {
                encode_8bit(scheme, w, x, &mut decoded, &mut out)?
            }
            Scheme::W4a16 | Scheme::W4a16Asym | Scheme::W8a16 => {
                let Some(grid) = self.int_grid(cols) else {
                    return Err(err(format!(
                        "`{module}`: {} has no integer grid",
                        scheme.name()
                    )));
                };
                let codes = self.chosen(module)?;
                encode_int(grid, codes, w, x, &mut decoded, &mut out)?
            }
            Scheme::Nvfp4 if self.state()?.codes.is_some() => {
                return Err(err(format!(
                    "`{module}`: GPTQ is for weight-only schemes (nvfp4a16, w4a16, \
                     w4a16-asym, w8a16), not {}",
                    scheme.name()
                )));
            }
            Scheme::Nvfp4 | Scheme::Nvfp4a16 => {
                let global =
                    quant::nvfp4_global::<T>(self.shared_amax(module, w.source, quant::amax(x))?);
                let codes = self.chosen(module)?;
                encode_nvfp4(scheme, w, x, global, codes, &mut decoded, &mut out)?
            }
        }
        let error = ErrorStats::measure(x, |i| decoded[i]);
        Ok(Written {
            tensors: out.0,
            quantized: Some((scheme.preset().to_string(), error)),
        })
    }

    /// The codes GPTQ chose for `module`, when it ran.
    fn chosen(&self, module: &str) -> Result<Option<Vec<i8>>, ExportError> {
        let Some(c) = &self.state()?.codes else {
            return Ok(None);
        };
        c.codes(module)
            .ok_or_else(|| {
                err(format!(
                    "`{module}`: {} chose no codes for it (it saw no input)",
                    c.algorithm()
                ))
            })?
            .map(Some)
            .map_err(err)
    }

    /// `k_scale` / `v_scale` of every attention module, from the KV statistics.
    fn kv_scales(
        checkpoint: &Checkpoint,
        tree: &crate::module_tree::ModuleTree,
        act: &ActAmax,
    ) -> Result<Vec<Encoded>, ExportError> {
        let mut out = Vec::new();
        let mut missing = Vec::new();
        for m in tree.walk() {
            let (Some(k), Some(_)) = (m.child("k_proj"), m.child("v_proj")) else {
                continue;
            };
            let dtype = checkpoint
                .tensor(&format!("{}.weight", k.path()))
                .map_or(Dtype::BF16, |t| t.dtype);
            for which in ['k', 'v'] {
                let Some(a) = act.kv(m.path(), which) else {
                    missing.push(format!("{}.{which}_bmm_quantizer", m.path()));
                    continue;
                };
                let data = match dtype {
                    Dtype::F16 => t_bytes::<f16>(quant::fp8_scale::<f16>(a)),
                    Dtype::F32 => t_bytes::<f32>(quant::fp8_scale::<f32>(a)),
                    _ => t_bytes::<bf16>(quant::fp8_scale::<bf16>(a)),
                };
                out.push(Encoded {
                    name: format!("{}.{which}_scale", m.path()),
                    ty: EncodedType::Dtype(match dtype {
                        Dtype::F16 | Dtype::F32 => dtype,
                        _ => Dtype::BF16,
                    }),
                    shape: vec![1],
                    data,
                });
            }
        }
        if !missing.is_empty() {
            return Err(err(format!(
                "--kv-cache fp8 stores calibrated k/v scales, and the activation statistics \
                 lack {} (--act-amax or --calib)",
                missing.join(", ")
            )));
        }
        Ok(out)
    }
}

/// [`CompressedTensors::shared_amax`] of `module` (whose own amax is `own`), with the amax
/// already read in `cache`.
fn fused_amax(
    checkpoint: &Checkpoint,
    recipe: &Recipe,
    module: &str,
    source: &str,
    own: f32,
    cache: &Mutex<HashMap<String, f32>>,
) -> Result<f32, ExportError> {
    let remember = |path: &str, a: f32| {
        cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(path.to_string(), a);
    };
    remember(module, own);
    let Some((parent, local)) = module.rsplit_once('.') else {
        return Ok(own);
    };
    let Some(group) = FUSED.iter().find(|g| g.contains(&local)) else {
        return Ok(own);
    };
    let mut best = own;
    for sib in group.iter().filter(|&&n| n != local) {
        let path = format!("{parent}.{sib}");
        if !recipe.quantizes(&path) {
            continue;
        }
        let known = cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&path)
            .copied();
        let a = match known {
            Some(a) => a,
            None => match sibling_amax(checkpoint, &path, source, sib)? {
                Some(a) => {
                    remember(&path, a);
                    a
                }
                None => continue,
            },
        };
        best = best.max(a);
    }
    Ok(best)
}

/// The amax of the weight of Linear `path` (local name `local`): its own checkpoint tensor, or
/// its rows of expert `e` in the fused experts tensor `fused` (`…experts.gate_up_proj`,
/// `[E, 2I, H]`, gate rows then up rows); `None` when the checkpoint holds neither.
fn sibling_amax(
    checkpoint: &Checkpoint,
    path: &str,
    fused: &str,
    local: &str,
) -> Result<Option<f32>, ExportError> {
    fn amax_of(
        c: &Checkpoint,
        name: &str,
        dtype: Dtype,
        range: Option<(usize, usize)>,
    ) -> Result<f32, ExportError> {
        let (start, len) = range.unwrap_or((0, c.tensor(name).map_or(0, |t| t.numel())));
        Ok(match dtype {
            Dtype::BF16 => quant::amax(&c.read_range_as::<bf16>(name, start, len)?),
            Dtype::F16 => quant::amax(&c.read_range_as::<f16>(name, start, len)?),
            Dtype::F32 => quant::amax(&c.read_range_as::<f32>(name, start, len)?),
            dtype => {
                return Err(ExportError::Dtype {
                    tensor: name.to_string(),
                    dtype,
                });
            }
        })
    }
    let own = format!("{path}.weight");
    if let Some(meta) = checkpoint.tensor(&own) {
        return amax_of(checkpoint, &own, meta.dtype, None).map(Some);
    }
    let Some(meta) = checkpoint.tensor(fused) else {
        return Ok(None);
    };
    let expert = path
        .rsplit_once('.')
        .and_then(|(head, _)| head.rsplit_once('.'))
        .and_then(|(_, e)| e.parse::<usize>().ok());
    match (fused.ends_with(".gate_up_proj"), &meta.shape[..], expert) {
        (true, &[experts, rows, cols], Some(e)) if e < experts && rows % 2 == 0 => {
            let half = rows / 2;
            let first = if local == "up_proj" { half } else { 0 };
            let start = (e * rows + first) * cols;
            amax_of(checkpoint, fused, meta.dtype, Some((start, half * cols))).map(Some)
        }
        _ => Ok(None),
    }
}

impl OutputWriter for CompressedTensors {
    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        let kv = match start.recipe.kv_cache {
            None => Vec::new(),
            Some(KvCache::Fp8) => Self::kv_scales(start.checkpoint, start.tree, start.statistics)?,
            Some(other) => {
                return Err(ExportError::WriterCannot {
                    writer: "compressed-tensors".into(),
                    what: format!("--kv-cache {}", other.quant_algo().to_lowercase()),
                    supported: vec!["--kv-cache fp8".into()],
                });
            }
        };
        let mut linears: Vec<String> = start
            .tree
            .walk()
            .filter(|m| m.class_chain().is::<Linear>())
            .map(|m| m.path().to_string())
            .collect();
        // A tied `lm_head` has no tensor on disk but is a Linear in the model llm-compressor
        // loads: it lists it in `ignore` (as ModelOpt lists it in `exclude_modules`).
        if crate::export::run::ties_lm_head(start.checkpoint)
            && start.tree.find("lm_head").is_none()
        {
            linears.push("lm_head".into());
        }
        self.state = Some(State {
            checkpoint: start.checkpoint.clone(),
            recipe: start.recipe.clone(),
            linears,
            kv,
            codes: start.codes.cloned(),
        });
        self.shards = Some(super::shards(start, 5));
        Ok(())
    }

    fn check_linear(&self, shape: &[usize]) -> Option<String> {
        let cols = *shape.last()?;
        let group = self.scheme.group(self.group_size);
        if cols.is_multiple_of(group) {
            return None;
        }
        let fit: Vec<String> = self
            .group_sizes()
            .iter()
            .filter(|&&g| cols.is_multiple_of(g))
            .map(|g| format!("--group-size {g}"))
            .collect();
        let hint = match fit.len() {
            0 => String::new(),
            _ => format!("; {} would fit", fit.join(" or ")),
        };
        Some(format!(
            "{cols} input features are not whole groups of {group}{hint}"
        ))
    }

    fn group_sizes(&self) -> &'static [usize] {
        match self.scheme.int_weights() {
            Some(_) => &[32, 64, 128],
            None => &[],
        }
    }

    fn set_group_size(&mut self, size: usize) -> Result<(), ExportError> {
        self.group_size = Some(size);
        Ok(())
    }

    fn gptq_style(&self) -> Option<GptqStyle> {
        (self.scheme == Scheme::Nvfp4a16 || self.scheme.int_weights().is_some())
            .then_some(GptqStyle::LlmCompressor)
    }

    fn gptq_grid(
        &self,
        target: &GptqTarget<'_>,
        weight: &WeightValues<'_>,
        cols: usize,
    ) -> Option<GptqGrid> {
        if self.scheme == Scheme::Nvfp4a16 {
            if cols == 0 || !cols.is_multiple_of(16) {
                return None;
            }
            // The writer's own scales of the original weight, under the global scale its
            // fused siblings share, as effective f32 scales.
            let own = match weight {
                WeightValues::Bf16(x) => quant::amax(x),
                WeightValues::F16(x) => quant::amax(x),
                WeightValues::F32(x) => quant::amax(x),
            };
            let cache = Mutex::default();
            let amax = fused_amax(
                target.checkpoint,
                target.recipe,
                target.module,
                "",
                own,
                &cache,
            )
            .ok()?;
            let scales = match weight {
                WeightValues::Bf16(x) => nvfp4_effective_scales(x, amax),
                WeightValues::F16(x) => nvfp4_effective_scales(x, amax),
                WeightValues::F32(x) => nvfp4_effective_scales(x, amax),
            };
            return Some(GptqGrid::Fp4 { group: 16, scales });
        }
        let grid = self.int_grid(cols)?;
        if cols == 0 || !cols.is_multiple_of(grid.group) {
            return None;
        }
        Some(GptqGrid::Int {
            grid,
            params: match weight {
                WeightValues::Bf16(x) => int_params(x, grid),
                WeightValues::F16(x) => int_params(x, grid),
                WeightValues::F32(x) => int_params(x, grid),
            },
        })
    }

    fn statistics_rules(&self) -> crate::export::writer::StatisticsRules {
        // llm-compressor 0.14 calibrates every expert on every token (its MoE calibration
        // modules), each expert's observers its own, and the KV cache with `minmax`.
        crate::export::writer::StatisticsRules::LLM_COMPRESSOR
    }

    fn engines(&self) -> Vec<crate::export::engines::EngineSupport> {
        crate::export::engines::compressed_tensors(self.scheme.name())
    }

    fn uses_statistics(&self) -> bool {
        self.scheme.static_activations()
    }

    fn linear(&self, w: &LinearWeight<'_>) -> Result<Written, ExportError> {
        match w.values {
            WeightValues::Bf16(x) => self.encode(w, x),
            WeightValues::F16(x) => self.encode(w, x),
            WeightValues::F32(x) => self.encode(w, x),
        }
    }

    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError> {
        Ok(Written::copied(name, dtype, shape, data))
    }

    fn write(&mut self, t: Encoded) -> Result<(), ExportError> {
        let EncodedType::Dtype(dtype) = t.ty else {
            return Err(err(format!("`{}` is not a safetensors tensor", t.name)));
        };
        self.shards
            .as_mut()
            .ok_or_else(|| err("written before `begin`"))?
            .write(&t.name, dtype, &t.shape, &t.data)?;
        Ok(())
    }

    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        let state = self
            .state
            .take()
            .ok_or_else(|| err("finished before `begin`"))?;
        let mut shards = self
            .shards
            .take()
            .ok_or_else(|| err("finished before `begin`"))?;
        for t in &state.kv {
            if let EncodedType::Dtype(dtype) = t.ty {
                shards.write(&t.name, dtype, &t.shape, &t.data)?;
            }
        }
        let written = shards.finish()?;
        let mut files = written.files.clone();
        if files.len() > 1 {
            files.push("model.safetensors.index.json".into());
        }
        let mut config = end.checkpoint.config().raw().clone();
        config.insert(
            "quantization_config".into(),
            self.quantization_config(&state, end.written),
        );
        files.extend(super::config_and_model_files(end, config, 2)?);
        Ok(files)
    }
}

impl CompressedTensors {
    /// `config.json`'s `quantization_config`: what was written, as llm-compressor states it.
    fn quantization_config(&self, state: &State, written: &BTreeMap<String, String>) -> Json {
        let (mut weights, inputs) = self.scheme.args(self.group_size);
        // GPTQ states its activation ordering, as llm-compressor's config does.
        if let Some(c) = &state.codes
            && c.actorder()
        {
            weights = weights.with("actorder", json!("static"));
        }
        let ignore: Vec<&String> = state
            .linears
            .iter()
            .filter(|m| !written.contains_key(*m))
            .collect();
        let kv = if state.kv.is_empty() {
            Json::Null
        } else {
            kv_cache_scheme()
        };
        let mut groups = Map::new();
        if !written.is_empty() {
            groups.insert(
                "group_0".into(),
                json!({
                    "format": self.scheme.format(),
                    "input_activations": inputs,
                    "output_activations": null,
                    "targets": ["Linear"],
                    "weights": weights,
                }),
            );
        }
        json!({
            "config_groups": groups,
            "format": self.scheme.format(),
            "global_compression_ratio": null,
            "ignore": ignore,
            "kv_cache_scheme": kv,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
            "sparsity_config": {},
            "transform_config": {},
            "version": FORMAT_VERSION,
        })
    }
}

/// A Linear's output tensors, named under its module.
#[derive(Default)]
struct Tensors(Vec<Encoded>);

impl Tensors {
    fn push(&mut self, module: &str, local: &str, dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) {
        self.0.push(Encoded {
            name: format!("{module}.{local}"),
            ty: EncodedType::Dtype(dtype),
            shape,
            data,
        });
    }
}

/// The Linear's calibrated input amax, which `scheme` stores a scale of.
fn input_amax(w: &LinearWeight<'_>, scheme: Scheme) -> Result<f32, ExportError> {
    w.input_amax.ok_or_else(|| {
        err(format!(
            "`{}`: {} stores a calibrated input scale, and the activation statistics have no \
             `{}.input_quantizer` (--act-amax or --calib)",
            w.module,
            scheme.name(),
            w.module
        ))
    })
}

/// FP8 (per tensor, per channel, 128×128 blocks) and INT8 per channel: the codes, their
/// scales and (static FP8) the input scale; `decoded` gets the dequantized values.
fn encode_8bit<T: Element>(
    scheme: Scheme,
    w: &LinearWeight<'_>,
    x: &[T],
    decoded: &mut [f32],
    out: &mut Tensors,
) -> Result<(), ExportError> {
    let (rows, cols, module) = (w.rows, w.cols, w.module);
    // (rows of a block, columns of a block): one scale per tensor, row or block.
    let (br, bc) = match scheme {
        Scheme::Fp8 => (rows, cols),
        Scheme::Fp8Block => (128, 128),
        _ => (1, cols),
    };
    let (gr, gc) = (rows.div_ceil(br), cols.div_ceil(bc));
    let int = scheme == Scheme::W8a8;
    let scales: Vec<f32> = (0..gr * gc)
        .into_par_iter()
        .map(|b| {
            let (i, j) = (b / gc, b % gc);
            let a = (i * br..((i + 1) * br).min(rows))
                .map(|r| quant::amax(&x[r * cols + j * bc..r * cols + ((j + 1) * bc).min(cols)]))
                .fold(0.0f32, f32::max);
            if int {
                quant::int8_scale::<T>(a)
            } else {
                quant::fp8_scale::<T>(a)
            }
        })
        .collect();
    let mut q = vec![0u8; x.len()];
    let e4m3 = e4m3_table();
    q.par_chunks_mut(cols)
        .zip(decoded.par_chunks_mut(cols))
        .zip(x.par_chunks(cols))
        .enumerate()
        .try_for_each(|(r, ((qr, dr), xr))| {
            // Each run of columns sharing a scale (a row, or a block's row).
            for j in 0..gc {
                let (c0, c1) = (j * bc, ((j + 1) * bc).min(cols));
                let s = scales[(r / br) * gc + j];
                if int {
                    for c in c0..c1 {
                        let i = quant::int(xr[c], s, -128.0, 127.0);
                        qr[c] = i as u8;
                        dr[c] = f32::from(i) * s;
                    }
                } else {
                    // `quant::fp8`, with the kernels' SIMD: the same rounding
                    // (`T(x / s)` then E4M3, tested equal).
                    kiln_kernels::cpu::quantize_fp8_per_tensor(&xr[c0..c1], s, &mut qr[c0..c1])
                        .map_err(|source| ExportError::Kernel {
                            tensor: format!("{module}.weight"),
                            source,
                        })?;
                    for c in c0..c1 {
                        dr[c] = e4m3[qr[c] as usize] * s;
                    }
                }
            }
            Ok::<(), ExportError>(())
        })?;
    let scale_shape = match scheme {
        Scheme::Fp8 => vec![1],
        Scheme::Fp8Block => vec![gr, gc],
        _ => vec![rows, 1],
    };
    let dtype = if int { Dtype::I8 } else { Dtype::F8_E4M3 };
    out.push(w.module, "weight", dtype, vec![rows, cols], q);
    out.push(
        w.module,
        "weight_scale",
        st_dtype::<T>(),
        scale_shape,
        ts_bytes::<T>(&scales),
    );
    if scheme == Scheme::Fp8 {
        let s = quant::fp8_scale::<T>(input_amax(w, scheme)?);
        out.push(
            w.module,
            "input_scale",
            st_dtype::<T>(),
            vec![1],
            t_bytes::<T>(s),
        );
    }
    Ok(())
}

/// The `(scale, zero point)` of every group of `grid.group` values of `x` (row-major), as
/// `calculate_qparams` computes them from the min/max observer: symmetric `T(amax / T(range /
/// 2))`, or [`quant::int_asym_params`].
fn int_params<T: Element>(x: &[T], grid: IntGrid) -> Vec<(f32, i8)> {
    let (lo, hi) = grid.range();
    x.par_chunks(grid.group)
        .map(|g| {
            if grid.symmetric {
                (
                    quant::symmetric_scale::<T>(quant::amax(g), (hi - lo) / 2.0),
                    0,
                )
            } else {
                quant::int_asym_params(g, grid.bits)
            }
        })
        .collect()
}

/// Integer weights (INT4, INT8) on `grid`, symmetric or with zero points, packed into int32:
/// rounded to nearest, or the `codes` an algorithm chose (GPTQ) on the same scales.
fn encode_int<T: Element>(
    grid: IntGrid,
    codes: Option<Vec<i8>>,
    w: &LinearWeight<'_>,
    x: &[T],
    decoded: &mut [f32],
    out: &mut Tensors,
) -> Result<(), ExportError> {
    let params = int_params(x, grid);
    let (lo, hi) = grid.range();
    let q = match codes {
        Some(c) if c.len() == x.len() => c,
        Some(c) => {
            return Err(err(format!(
                "`{}`: {} chosen codes for {} weights",
                w.module,
                c.len(),
                x.len()
            )));
        }
        None => {
            let mut q = vec![0i8; x.len()];
            q.par_chunks_mut(grid.group)
                .zip(x.par_chunks(grid.group))
                .zip(params.par_iter())
                .for_each(|((qg, xg), &(s, zp))| {
                    for (q, &x) in qg.iter_mut().zip(xg) {
                        *q = if grid.symmetric {
                            quant::int(x, s, lo, hi)
                        } else {
                            quant::int_asym(x, s, zp, grid.bits)
                        };
                    }
                });
            q
        }
    };
    decoded
        .par_chunks_mut(grid.group)
        .zip(q.par_chunks(grid.group))
        .zip(params.par_iter())
        .for_each(|((dg, qg), &(s, zp))| {
            for (d, &q) in dg.iter_mut().zip(qg) {
                *d = (f32::from(q) - f32::from(zp)) * s;
            }
        });
    write_int::<T>(w, grid.bits, !grid.symmetric, &q, &params, out);
    Ok(())
}

/// The tensors of `bits`-bit codes `q` (`[rows, cols]`) with their `(scale, zero point)` per
/// group, row-major `[rows, groups]` (one group per row: per channel), as compressed-tensors'
/// `pack-quantized` compressor saves them: `weight_packed` (int32 words along the rows),
/// `weight_scale [rows, groups]` in the weight's dtype, `weight_shape`, and with zero points
/// `weight_zero_point` packed along the columns.
fn write_int<T: Element>(
    w: &LinearWeight<'_>,
    bits: u32,
    asym: bool,
    q: &[i8],
    params: &[(f32, i8)],
    out: &mut Tensors,
) {
    let (rows, cols, bits_u) = (w.rows, w.cols, bits as usize);
    let groups = params.len() / rows.max(1);
    let packed = quant::pack_int32(q, cols, bits_u);
    out.push(
        w.module,
        "weight_packed",
        Dtype::I32,
        vec![rows, (cols * bits_u).div_ceil(32)],
        bytemuck::cast_slice(&packed).to_vec(),
    );
    let scales: Vec<f32> = params.iter().map(|p| p.0).collect();
    out.push(
        w.module,
        "weight_scale",
        st_dtype::<T>(),
        vec![rows, groups],
        ts_bytes::<T>(&scales),
    );
    let shape = [rows as i64, cols as i64];
    out.push(
        w.module,
        "weight_shape",
        Dtype::I64,
        vec![2],
        bytemuck::cast_slice(&shape).to_vec(),
    );
    if asym {
        let zps: Vec<i8> = params.iter().map(|p| p.1).collect();
        let packed = quant::pack_int32_columns(&zps, rows, groups, bits_u);
        out.push(
            w.module,
            "weight_zero_point",
            Dtype::I32,
            vec![(rows * bits_u).div_ceil(32), groups],
            bytemuck::cast_slice(&packed).to_vec(),
        );
    }
}

/// The FP8 scale code of every group of 16 values of `x` under the `global` scale.
fn nvfp4_scales<T: Element>(x: &[T], global: f32) -> Vec<u8> {
    x.par_chunks(16)
        .map(|g| quant::nvfp4_scale::<T>(quant::amax(g), global))
        .collect()
}

/// For GPTQ: the effective scale `e4m3 / global` (f32) of every group of 16 values of `x`,
/// the global scale from `amax` (the fused siblings').
fn nvfp4_effective_scales<T: Element>(x: &[T], amax: f32) -> Vec<f32> {
    let global = quant::nvfp4_global::<T>(amax);
    nvfp4_scales(x, global)
        .into_iter()
        .map(|s| e4m3_to_f32(s) / global)
        .collect()
}

/// NVFP4: E2M1 codes in groups of 16 with E4M3 scales under the `global` scale, rounded to
/// nearest or the `codes` an algorithm chose (GPTQ) on the same scales, and (NVFP4 with
/// activations) the input's global scale.
fn encode_nvfp4<T: Element>(
    scheme: Scheme,
    w: &LinearWeight<'_>,
    x: &[T],
    global: f32,
    chosen: Option<Vec<i8>>,
    decoded: &mut [f32],
    out: &mut Tensors,
) -> Result<(), ExportError> {
    let (rows, cols) = (w.rows, w.cols);
    let scales = nvfp4_scales(x, global);
    let mut codes = vec![0u8; x.len()];
    let e4m3 = e4m3_table();
    match chosen {
        Some(c) if c.len() != x.len() => {
            return Err(err(format!(
                "`{}`: {} chosen codes for {} weights",
                w.module,
                c.len(),
                x.len()
            )));
        }
        Some(c) => {
            if let Some(bad) = c.iter().find(|&&q| q as u8 > 15) {
                return Err(err(format!(
                    "`{}`: chosen code {bad} is not an E2M1 nibble",
                    w.module
                )));
            }
            codes.iter_mut().zip(&c).for_each(|(q, &v)| *q = v as u8);
        }
        None => codes
            .par_chunks_mut(16)
            .zip(x.par_chunks(16))
            .zip(scales.par_iter())
            .for_each(|((cg, xg), &s)| {
                for i in 0..xg.len() {
                    cg[i] = quant::nvfp4(xg[i], s, global);
                }
            }),
    }
    decoded
        .par_chunks_mut(16)
        .zip(codes.par_chunks(16))
        .zip(scales.par_iter())
        .for_each(|((dg, cg), &s)| {
            for i in 0..cg.len() {
                dg[i] = e2m1_to_f32(cg[i]) * (e4m3[s as usize] / global);
            }
        });
    let mut packed = vec![0u8; x.len() / 2];
    kiln_kernels::formats::fp4::pack_nibbles(&codes, &mut packed);
    out.push(
        w.module,
        "weight_packed",
        Dtype::U8,
        vec![rows, cols / 2],
        packed,
    );
    out.push(
        w.module,
        "weight_scale",
        Dtype::F8_E4M3,
        vec![rows, cols / 16],
        scales,
    );
    out.push(
        w.module,
        "weight_global_scale",
        Dtype::F32,
        vec![1],
        global.to_le_bytes().to_vec(),
    );
    if scheme == Scheme::Nvfp4 {
        let g = quant::nvfp4_global::<T>(input_amax(w, scheme)?);
        out.push(
            w.module,
            "input_global_scale",
            Dtype::F32,
            vec![1],
            g.to_le_bytes().to_vec(),
        );
    }
    Ok(())
}

impl WriterType for CompressedTensors {
    fn formats() -> Vec<(&'static str, String)> {
        Scheme::ALL
            .iter()
            .map(|(n, s, p)| (*n, format!("llm-compressor `{p}` ({})", s.format())))
            .collect()
    }

    fn new(format: &str) -> Result<Self, ExportError> {
        let scheme = Scheme::ALL
            .iter()
            .find(|(n, _, _)| *n == format)
            .map(|(_, s, _)| *s)
            .ok_or_else(|| err(format!("no format `{format}`")))?;
        Ok(CompressedTensors {
            scheme,
            group_size: None,
            state: None,
            shards: None,
            amax: Mutex::default(),
        })
    }
}
