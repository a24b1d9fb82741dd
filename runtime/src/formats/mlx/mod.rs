//! The MLX writer (`--output-format mlx`): what `mlx_lm.convert -q` writes — MLX's quantized
//! Linear / Embedding layout (`weight` as packed `uint32`, `scales`, and `biases` for affine),
//! experts stacked into `switch_mlp` tensors, `config.json`'s `quantization` (and its copy
//! `quantization_config`), the tokenizer files — with MLX 0.32's own arithmetic
//! (`kiln_kernels::ops::mlx`, byte-identical to MLX's CPU device; docs/MLX.md).
//!
//! Which tensors: as mlx-lm, every Linear and Embedding weight whose rows are whole groups
//! (`lm_head` and `embed_tokens` included), except modules the user `--exclude`s; Qwen3-MoE's
//! routers (`mlp.gate`) in 8-bit affine with groups of 64, mlx-lm's `quant_predicate`.
//! Other tensors are copied in their dtype.

#[cfg(feature = "exec")]
pub mod read;
pub mod reader;

use crate::export::ExportError;
use crate::export::recipe::glob_match;
use crate::export::stats::ErrorStats;
use crate::export::writer::{
    ChosenCodes, Encoded, EncodedType, FloatValues, GptqGrid, GptqStyle, GptqTarget, LinearWeight,
    OutputWriter, WeightValues, WriterEnd, WriterStart, WriterType, Written,
};
use crate::sink::ShardWriter;
use half::{bf16, f16};
use kiln_kernels::Element;
use kiln_kernels::ops::mlx::{self as mq, FpMode};
use safetensors::Dtype;
use serde_json::{Map, Value as Json, json};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// One MLX quantization mode with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlxMode {
    /// `affine`: `bits` 2, 4 or 8, groups of 32, 64 or 128.
    Affine {
        /// Bits per weight.
        bits: usize,
        /// Group size.
        group: usize,
    },
    /// `mxfp4`, `mxfp8` or `nvfp4`.
    Fp(FpMode),
}

impl MlxMode {
    /// Every `--format`, the default first.
    pub const ALL: [(&'static str, MlxMode); 12] = [
        ("q4", MlxMode::Affine { bits: 4, group: 64 }),
        ("q4-g32", MlxMode::Affine { bits: 4, group: 32 }),
        (
            "q4-g128",
            MlxMode::Affine {
                bits: 4,
                group: 128,
            },
        ),
        ("q8", MlxMode::Affine { bits: 8, group: 64 }),
        ("q8-g32", MlxMode::Affine { bits: 8, group: 32 }),
        (
            "q8-g128",
            MlxMode::Affine {
                bits: 8,
                group: 128,
            },
        ),
        ("q2", MlxMode::Affine { bits: 2, group: 64 }),
        ("q2-g32", MlxMode::Affine { bits: 2, group: 32 }),
        (
            "q2-g128",
            MlxMode::Affine {
                bits: 2,
                group: 128,
            },
        ),
        ("mxfp4", MlxMode::Fp(FpMode::Mxfp4)),
        ("mxfp8", MlxMode::Fp(FpMode::Mxfp8)),
        ("nvfp4", MlxMode::Fp(FpMode::Nvfp4)),
    ];

    fn group(self) -> usize {
        match self {
            MlxMode::Affine { group, .. } => group,
            MlxMode::Fp(m) => m.group(),
        }
    }

    fn bits(self) -> usize {
        match self {
            MlxMode::Affine { bits, .. } => bits,
            MlxMode::Fp(m) => m.bits(),
        }
    }

    fn mode_name(self) -> &'static str {
        match self {
            MlxMode::Affine { .. } => "affine",
            MlxMode::Fp(m) => m.name(),
        }
    }

    /// The name the report uses (`affine4g64`, `mxfp4`).
    fn label(self) -> String {
        match self {
            MlxMode::Affine { bits, group } => format!("affine{bits}g{group}"),
            MlxMode::Fp(m) => m.name().to_string(),
        }
    }

    /// `config.json`'s `quantization` entry.
    fn config(self) -> Json {
        json!({"group_size": self.group(), "bits": self.bits(), "mode": self.mode_name()})
    }
}

/// mlx-lm's layout.
#[crate::writer(name = "mlx", reader = reader::MlxReader, crate = crate)]
pub struct MlxOutput {
    mode: MlxMode,
    state: Option<State>,
    shards: Option<ShardWriter>,
    /// Stacked experts being gathered.
    stacks: super::Stacks<Dtype>,
    /// Per-module quantization that differs from the default (`config.json`).
    overrides: Mutex<BTreeMap<String, Json>>,
    warnings: Mutex<Vec<String>>,
}

/// Keys mlx-lm 0.32 requires under transformers 4's names, for a transformers 5 config that
/// moved them: `rope_theta` (now in `rope_parameters`) and Qwen3-MoE's `num_experts` (now
/// `num_local_experts`).
fn mlx_lm_names(c: &Map<String, Json>) -> Vec<(&'static str, Json)> {
    let mut add = Vec::new();
    if !c.contains_key("rope_theta")
        && let Some(t) = c.get("rope_parameters").and_then(|r| r.get("rope_theta"))
    {
        add.push(("rope_theta", t.clone()));
    }
    if c.get("model_type").and_then(Json::as_str) == Some("qwen3_moe")
        && !c.contains_key("num_experts")
        && let Some(n) = c.get("num_local_experts")
    {
        add.push(("num_experts", n.clone()));
    }
    add
}

struct State {
    /// Routers get 8-bit affine, groups of 64 (Qwen3-MoE's `quant_predicate`).
    router_override: bool,
    exclude: Vec<String>,
    include: Vec<String>,
    /// Codes, scales and biases GPTQ chose (`--algorithm gptq`), by module.
    codes: Option<std::sync::Arc<dyn ChosenCodes>>,
}

fn err(what: impl Into<String>) -> ExportError {
    ExportError::Writer {
        writer: "mlx".into(),
        what: what.into(),
    }
}

/// `…experts.E.proj` → (`…switch_mlp.proj'`, E), with Mixtral's w1/w2/w3 renamed as mlx-lm.
fn stacked(module: &str) -> Option<(String, usize)> {
    let (head, tail) = module.rsplit_once(".experts.")?;
    let (e, proj) = tail.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let proj = match proj {
        "w1" => "gate_proj",
        "w2" => "down_proj",
        "w3" => "up_proj",
        p @ ("gate_proj" | "up_proj" | "down_proj") => p,
        _ => return None,
    };
    Some((format!("{head}.switch_mlp.{proj}"), e))
}

fn st_dtype<T: Element>() -> Dtype {
    match T::DTYPE {
        "F16" => Dtype::F16,
        "F32" => Dtype::F32,
        _ => Dtype::BF16,
    }
}

impl MlxOutput {
    fn state(&self) -> Result<&State, ExportError> {
        self.state
            .as_ref()
            .ok_or_else(|| err("used before `begin`"))
    }

    /// Quantizes `w` (`rows × cols`) of module `module` in `mode`.
    fn quantize<T: Element + bytemuck::Pod>(
        &self,
        module: &str,
        w: &[T],
        rows: usize,
        cols: usize,
        mode: MlxMode,
    ) -> Result<Written, ExportError> {
        let kernel = |source| ExportError::Kernel {
            tensor: format!("{module}.weight"),
            source,
        };
        let n = w.len();
        let groups = n / mode.group();
        let words = n * mode.bits() / 32;
        let chosen = match (&self.state()?.codes, mode) {
            (Some(c), MlxMode::Affine { .. }) => match (c.codes(module), c.params(module)) {
                (Some(q), Some(p)) => Some((q.map_err(err)?, p.map_err(err)?)),
                (None, None) => {
                    // Embeddings: GPTQ quantizes Linears; mlx-lm rounds the rest to nearest.
                    if !module.ends_with("embed_tokens") {
                        self.warnings
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(format!(
                                "`{module}`: {} chose no codes for it; rounded to nearest",
                                c.algorithm()
                            ));
                    }
                    None
                }
                _ => {
                    return Err(err(format!(
                        "`{module}`: {} chose codes without scales and biases",
                        c.algorithm()
                    )));
                }
            },
            _ => None,
        };
        let (out, decoded) = match mode {
            MlxMode::Affine { bits, group } => {
                let mut packed = vec![0u32; words];
                let mut scales = vec![T::from_f32(0.0); groups];
                let mut biases = vec![T::from_f32(0.0); groups];
                match chosen {
                    // GPTQ's codes on its own f32 scales and biases, stored in the weight's
                    // dtype (mlx-lm's `layer.set_dtype`).
                    Some((q, p)) if q.len() == n && p.len() == groups => {
                        let q: Vec<u8> = q.iter().map(|&c| c as u8).collect();
                        mq::pack_affine(&q, bits, &mut packed).map_err(kernel)?;
                        for ((s, b), &(ps, pb)) in scales.iter_mut().zip(biases.iter_mut()).zip(&p)
                        {
                            *s = T::from_f32(ps);
                            *b = T::from_f32(pb);
                        }
                    }
                    Some((q, p)) => {
                        return Err(err(format!(
                            "`{module}`: {} codes and {} groups chosen for {n} weights in \
                             groups of {group}",
                            q.len(),
                            p.len()
                        )));
                    }
                    None => mq::quantize_affine(
                        w,
                        cols,
                        group,
                        bits,
                        &mut packed,
                        &mut scales,
                        &mut biases,
                    )
                    .map_err(kernel)?,
                }
                let mut d = vec![0f32; n];
                mq::dequantize_affine(&packed, &scales, &biases, group, bits, &mut d)
                    .map_err(kernel)?;
                let g = [rows, cols / group];
                (
                    vec![
                        (
                            "weight",
                            Dtype::U32,
                            vec![rows, cols * bits / 32],
                            bytemuck::cast_slice(&packed).to_vec(),
                        ),
                        (
                            "scales",
                            st_dtype::<T>(),
                            g.to_vec(),
                            bytemuck::cast_slice(&scales).to_vec(),
                        ),
                        (
                            "biases",
                            st_dtype::<T>(),
                            g.to_vec(),
                            bytemuck::cast_slice(&biases).to_vec(),
                        ),
                    ],
                    d,
                )
            }
            MlxMode::Fp(m) => {
                let mut packed = vec![0u8; m.packed_len(n)];
                let mut scales = vec![0u8; groups];
                mq::quantize_fp(m, w, cols, None, &mut packed, &mut scales).map_err(kernel)?;
                let mut d = vec![0f32; n];
                mq::dequantize_fp(m, &packed, &scales, None, &mut d).map_err(kernel)?;
                (
                    vec![
                        (
                            "weight",
                            Dtype::U32,
                            vec![rows, cols * m.bits() / 32],
                            packed,
                        ),
                        ("scales", Dtype::U8, vec![rows, cols / m.group()], scales),
                    ],
                    d,
                )
            }
        };
        let error = ErrorStats::measure(w, |i| decoded[i]);
        let (base, expert) = match stacked(module) {
            Some((b, e)) => (b, Some(e)),
            None => (module.to_string(), None),
        };
        let tensors = out
            .into_iter()
            .map(|(local, dtype, shape, data)| Encoded {
                name: match expert {
                    Some(e) => format!("{base}.{local}#{e}"),
                    None => format!("{base}.{local}"),
                },
                ty: EncodedType::Dtype(dtype),
                shape,
                data,
            })
            .collect();
        Ok(Written {
            tensors,
            quantized: Some((mode.label(), error)),
        })
    }

    /// The mode for module `module` with rows of `cols`, or `None` to copy it.
    fn mode_for(&self, module: &str, cols: usize) -> Result<Option<MlxMode>, ExportError> {
        let s = self.state()?;
        let excluded = !s.include.iter().any(|g| glob_match(g, module))
            && s.exclude.iter().any(|g| glob_match(g, module));
        if excluded {
            return Ok(None);
        }
        let router = s.router_override && module.ends_with(".mlp.gate");
        let mode = if router {
            MlxMode::Affine { bits: 8, group: 64 }
        } else {
            self.mode
        };
        if !cols.is_multiple_of(mode.group()) {
            return Ok(None);
        }
        if router {
            self.overrides
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(module.to_string(), json!({"group_size": 64, "bits": 8}));
        }
        Ok(Some(mode))
    }

    fn encode(
        &self,
        module: &str,
        values: WeightValues<'_>,
        rows: usize,
        cols: usize,
    ) -> Result<Written, ExportError> {
        let Some(mode) = self.mode_for(module, cols)? else {
            return self.copy(
                &format!("{module}.weight"),
                values.dtype(),
                &[rows, cols],
                values.bytes().to_vec(),
            );
        };
        match values {
            WeightValues::Bf16(w) => self.quantize::<bf16>(module, w, rows, cols, mode),
            WeightValues::F16(w) => self.quantize::<f16>(module, w, rows, cols, mode),
            WeightValues::F32(w) => self.quantize::<f32>(module, w, rows, cols, mode),
        }
    }

    fn copy(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError> {
        let name = match name
            .rsplit_once('.')
            .and_then(|(m, local)| Some((stacked(m)?, local)))
        {
            Some(((base, e), local)) => format!("{base}.{local}#{e}"),
            None => name.to_string(),
        };
        Ok(Written::copied(name, dtype, shape, data))
    }
}

impl OutputWriter for MlxOutput {
    fn gptq_style(&self) -> Option<GptqStyle> {
        match self.mode {
            MlxMode::Affine { group, .. } => Some(GptqStyle::MlxLm { group }),
            MlxMode::Fp(_) => None,
        }
    }

    /// mlx-lm quantizes every Linear, `lm_head` included, unless the user excludes it.
    fn gptq_covers(&self, module: &str, recipe: &crate::export::recipe::Recipe) -> bool {
        recipe.include.iter().any(|g| glob_match(g, module))
            || !recipe.exclude.iter().any(|g| glob_match(g, module))
    }

    /// mlx-lm's GPTQ: affine modes, every Linear whose rows are whole groups.
    fn gptq_grid(&self, _: &GptqTarget<'_>, _: &WeightValues<'_>, cols: usize) -> Option<GptqGrid> {
        match self.mode {
            MlxMode::Affine { bits, group } if cols > 0 && cols.is_multiple_of(group) => {
                Some(GptqGrid::Affine {
                    bits: bits as u32,
                    group,
                })
            }
            _ => None,
        }
    }

    fn group_sizes(&self) -> &'static [usize] {
        match self.mode {
            MlxMode::Affine { .. } => &[32, 64, 128],
            MlxMode::Fp(_) => &[],
        }
    }

    /// `--group-size` for an affine mode: `--format q4 --group-size 32` is `q4-g32`
    /// (mlx-lm's `--q-group-size`).
    fn set_group_size(&mut self, size: usize) -> Result<(), ExportError> {
        if let MlxMode::Affine { group, .. } = &mut self.mode {
            *group = size;
        }
        Ok(())
    }

    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        if start.recipe.kv_cache.is_some() {
            return Err(ExportError::WriterCannot {
                writer: "mlx".into(),
                what: "--kv-cache (mlx-lm quantizes its KV cache at generation time: --kv-bits)"
                    .into(),
                supported: MlxMode::ALL.iter().map(|(n, _)| n.to_string()).collect(),
            });
        }
        let c = start.checkpoint.config().raw();
        let experts = ["num_local_experts", "num_experts"]
            .iter()
            .find_map(|k| c.get(*k).and_then(Json::as_u64))
            .unwrap_or(0) as usize;
        self.stacks = super::Stacks::new(experts);
        self.state = Some(State {
            router_override: start.architecture == "Qwen3MoeForCausalLM",
            exclude: start.recipe.exclude.clone(),
            include: start.recipe.include.clone(),
            codes: start.codes.cloned(),
        });
        self.shards = Some(super::shards(start, 3));
        Ok(())
    }

    fn linear(&self, w: &LinearWeight<'_>) -> Result<Written, ExportError> {
        self.encode(w.module, w.values, w.rows, w.cols)
    }

    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError> {
        // A Linear or Embedding weight the exporters left unquantized (`lm_head`, the
        // embeddings, routers): mlx-lm quantizes it.
        if let (Some(module), [rows, cols]) = (name.strip_suffix(".weight"), shape)
            && let Some(values) = FloatValues::decode(dtype, &data)
        {
            // `encode` quantizes it where mlx-lm would, and copies it otherwise.
            return self.encode(module, values.view(), *rows, *cols);
        }
        if name.ends_with("rotary_emb.inv_freq") {
            return Ok(Written::default());
        }
        self.copy(name, dtype, shape, data)
    }

    fn write(&mut self, t: Encoded) -> Result<(), ExportError> {
        let EncodedType::Dtype(dtype) = t.ty else {
            return Err(err(format!("`{}` is not a safetensors tensor", t.name)));
        };
        let shards = self
            .shards
            .as_mut()
            .ok_or_else(|| err("written before `begin`"))?;
        let Some(parsed) = super::Stacks::<Dtype>::parse(&t.name) else {
            shards.write(&t.name, dtype, &t.shape, &t.data)?;
            return Ok(());
        };
        let (name, e) = parsed.map_err(err)?;
        if let Some((dtype, shape, data)) = self
            .stacks
            .add(name, e, dtype, &t.shape, t.data)
            .map_err(err)?
        {
            shards.write(name, dtype, &shape, &data)?;
        }
        Ok(())
    }

    fn engines(&self) -> Vec<crate::export::engines::EngineSupport> {
        crate::export::engines::mlx(self.mode.mode_name())
    }

    fn warnings(&self) -> Vec<String> {
        self.take_warnings()
    }

    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        self.stacks.check_complete().map_err(err)?;
        let shards = self
            .shards
            .take()
            .ok_or_else(|| err("finished before `begin`"))?;
        let written = shards.finish()?;
        let mut files = written.files.clone();
        if files.len() > 1 {
            files.push("model.safetensors.index.json".into());
        }
        let mut q = match self.mode.config() {
            Json::Object(m) => m,
            _ => Map::new(),
        };
        for (path, v) in self
            .overrides
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            q.insert(path.clone(), v.clone());
        }
        let mut config = end.checkpoint.config().raw().clone();
        for (key, value) in mlx_lm_names(&config) {
            self.warnings
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!(
                    "config.json: added `{key}` = {value}, transformers 4's name that mlx-lm \
                     0.32 reads (this checkpoint has transformers 5's)"
                ));
            config.insert(key.to_string(), value);
        }
        config.insert("quantization".into(), Json::Object(q.clone()));
        config.insert("quantization_config".into(), Json::Object(q));
        files.extend(super::config_and_model_files(end, config, 4)?);
        Ok(files)
    }
}

impl MlxOutput {
    /// What the writer added or noticed.
    fn take_warnings(&self) -> Vec<String> {
        self.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl WriterType for MlxOutput {
    fn formats() -> Vec<(&'static str, String)> {
        MlxMode::ALL
            .iter()
            .map(|(n, m)| {
                let d = format!(
                    "mlx-lm `{}`, {} bits, groups of {}",
                    m.mode_name(),
                    m.bits(),
                    m.group()
                );
                (*n, d)
            })
            .collect()
    }

    fn new(format: &str) -> Result<Self, ExportError> {
        let mode = MlxMode::ALL
            .iter()
            .find(|(n, _)| *n == format)
            .map(|(_, m)| *m)
            .ok_or_else(|| err(format!("no format `{format}`")))?;
        Ok(MlxOutput {
            mode,
            state: None,
            shards: None,
            stacks: super::Stacks::new(0),
            overrides: Mutex::default(),
            warnings: Mutex::default(),
        })
    }
}
