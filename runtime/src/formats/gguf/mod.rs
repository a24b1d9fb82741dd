//! The GGUF writer (`--output-format gguf`): what llama.cpp's `convert_hf_to_gguf.py`
//! followed by `llama-quantize` makes of a Hugging Face checkpoint, in one pass — the same
//! names, the Q/K row order of llama.cpp's Llama models, the per-tensor type mix of the file
//! type, block bytes identical to `ggml-quants.c` (`kiln_kernels::ops::gguf`), the
//! architecture metadata and the tokenizer (docs/FORMATS.md §7).
//!
//! Tensors stream: each encoded tensor is appended to a spool file beside the output while
//! the walk runs (a GGUF header lists every tensor before the data); `finish` writes the
//! header and moves the spooled bytes behind it, one tensor at a time.

pub mod container;
pub mod imatrix;
pub mod mix;
#[cfg(feature = "exec")]
pub mod read;
pub mod reader;
pub mod vocab;

use crate::export::ExportError;
use crate::export::recipe::glob_match;
use crate::export::stats::ErrorStats;
use crate::export::writer::{
    Encoded, EncodedType, FloatValues, LinearWeight, OutputWriter, WriterEnd, WriterStart,
    WriterType, Written,
};
use crate::formats::gguf::container::{GgufWriter, Value};
use kiln_kernels::ops::gguf::GgufType;
use mix::{BF16, F16, F32, FileType, MixModel};
use safetensors::Dtype;
use serde_json::{Map, Value as Json};
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The file the writer produces inside the output folder.
pub const FILE_NAME: &str = "model.gguf";
const SPOOL: &str = ".kiln-gguf-tensors.spool";

/// The GGUF file of an export: `path` itself when it ends in `.gguf`, else `path/model.gguf`
/// when that exists.
pub fn gguf_file(path: &Path) -> Option<PathBuf> {
    if path.extension().is_some_and(|e| e == "gguf") && path.is_file() {
        return Some(path.to_path_buf());
    }
    let f = path.join(FILE_NAME);
    f.is_file().then_some(f)
}

/// llama.cpp's GGUF, one file per model.
#[crate::writer(name = "gguf", reader = reader::GgufReader, crate = crate)]
pub struct GgufOutput {
    ftype: FileType,
    plan: Option<Plan>,
    spool: Option<Spool>,
    warnings: Mutex<Vec<String>>,
}

/// How a family's Hugging Face tensor names map to GGUF's ([`Names::target`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Names {
    family: Family,
    heads: usize,
    kv_heads: usize,
    experts: usize,
}

/// What `begin` learns about the model: names, metadata, the mix.
struct Plan {
    names: Names,
    mix: MixModel,
    /// The type unquantized 2-D weights keep: the checkpoint's float dtype.
    base: u32,
    exclude: Vec<String>,
    include: Vec<String>,
    metadata: Vec<(String, Value)>,
    /// `--imatrix`: importance weights by GGUF tensor name.
    importance: Option<std::sync::Arc<crate::export::writer::Importance>>,
}

/// The tensors written so far: their bytes in the spool, their header entries in order.
struct Spool {
    path: PathBuf,
    file: BufWriter<File>,
    len: u64,
    /// (name, dims innermost first, ggml type, spool offset, bytes).
    entries: Vec<(String, Vec<u64>, u32, u64, u64)>,
    /// Stacked expert tensors being gathered.
    stacks: super::Stacks<u32>,
}

/// The Hugging Face families the writer maps, with llama.cpp's architecture name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    /// `LlamaForCausalLM`, `MistralForCausalLM`, `MixtralForCausalLM`: llama.cpp's `llama`,
    /// whose Q and K rows are reordered (`LlamaModel.permute`).
    Llama,
    /// `Qwen2ForCausalLM`: `qwen2`.
    Qwen2,
    /// `Qwen3ForCausalLM`: `qwen3`.
    Qwen3,
    /// `Qwen3MoeForCausalLM`: `qwen3moe`.
    Qwen3Moe,
}

impl Family {
    const NAMES: [(&'static str, Family); 6] = [
        ("LlamaForCausalLM", Family::Llama),
        ("MistralForCausalLM", Family::Llama),
        ("MixtralForCausalLM", Family::Llama),
        ("Qwen2ForCausalLM", Family::Qwen2),
        ("Qwen3ForCausalLM", Family::Qwen3),
        ("Qwen3MoeForCausalLM", Family::Qwen3Moe),
    ];

    fn arch(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3moe",
        }
    }
}

/// Where a Hugging Face tensor goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// Not written (`rotary_emb.inv_freq`: llama.cpp computes it).
    Drop,
    /// A GGUF tensor; `expert`: its slot in a stacked `*_exps` tensor; `permute`: the number
    /// of heads whose rows llama.cpp reorders (Llama's Q and K).
    Tensor {
        name: String,
        expert: Option<usize>,
        permute: Option<usize>,
    },
}

impl GgufOutput {
    fn err(what: impl Into<String>) -> ExportError {
        ExportError::Writer {
            writer: "gguf".into(),
            what: what.into(),
        }
    }

    fn plan(&self) -> Result<&Plan, ExportError> {
        self.plan
            .as_ref()
            .ok_or_else(|| Self::err("used before `begin`"))
    }

    fn warn(&self, w: String) {
        self.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(w);
    }
}

fn cfg_usize(c: &Map<String, Json>, key: &str) -> Option<usize> {
    c.get(key).and_then(Json::as_u64).map(|v| v as usize)
}

fn need(c: &Map<String, Json>, key: &str) -> Result<usize, ExportError> {
    cfg_usize(c, key).ok_or_else(|| {
        GgufOutput::err(format!(
            "config.json: `{key}` is missing or not a non-negative integer"
        ))
    })
}

impl Names {
    /// The names of a model of `architecture` (`config.json`'s first) with `config`, or `None`
    /// for an architecture the GGUF writer does not map.
    // Read back by `read.rs` (feature `exec`).
    #[cfg_attr(not(feature = "exec"), allow(dead_code))]
    pub(crate) fn for_model(architecture: &str, config: &Map<String, Json>) -> Option<Names> {
        let family = Family::NAMES
            .iter()
            .find(|(n, _)| *n == architecture)
            .map(|(_, f)| *f)?;
        let heads = cfg_usize(config, "num_attention_heads")?;
        Some(Names {
            family,
            heads,
            kv_heads: cfg_usize(config, "num_key_value_heads").unwrap_or(heads),
            experts: cfg_usize(config, "num_local_experts")
                .or_else(|| cfg_usize(config, "num_experts"))
                .unwrap_or(0),
        })
    }

    /// Names for any family's module paths (the family only changes row order, not names):
    /// what an imatrix is keyed by.
    #[cfg_attr(not(feature = "exec"), allow(dead_code))]
    pub(crate) fn generic(experts: usize) -> Names {
        Names {
            family: Family::Qwen2,
            heads: 1,
            kv_heads: 1,
            experts,
        }
    }

    /// llama.cpp's architecture name (`general.architecture`).
    #[cfg_attr(not(feature = "exec"), allow(dead_code))]
    pub(crate) fn arch(&self) -> &'static str {
        self.family.arch()
    }

    /// Where the Hugging Face tensor `hf` goes in the GGUF file, or `None` if it has no place.
    pub(crate) fn target(&self, hf: &str) -> Option<Target> {
        let t = |name: String| Target::Tensor {
            name,
            expert: None,
            permute: None,
        };
        match hf {
            "model.embed_tokens.weight" => return Some(t("token_embd.weight".into())),
            "model.norm.weight" => return Some(t("output_norm.weight".into())),
            "lm_head.weight" => return Some(t("output.weight".into())),
            _ => {}
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let n: usize = layer.parse().ok()?;
        let blk = |s: &str| format!("blk.{n}.{s}");
        if rest.ends_with("rotary_emb.inv_freq") {
            return Some(Target::Drop);
        }
        let (local, suffix) = rest.rsplit_once('.')?;
        let simple = match local {
            "input_layernorm" => Some("attn_norm"),
            "post_attention_layernorm" => Some("ffn_norm"),
            "self_attn.q_proj" => Some("attn_q"),
            "self_attn.k_proj" => Some("attn_k"),
            "self_attn.v_proj" => Some("attn_v"),
            "self_attn.o_proj" => Some("attn_output"),
            "self_attn.q_norm" => Some("attn_q_norm"),
            "self_attn.k_norm" => Some("attn_k_norm"),
            "mlp.gate_proj" => Some("ffn_gate"),
            "mlp.up_proj" => Some("ffn_up"),
            "mlp.down_proj" => Some("ffn_down"),
            "mlp.gate" | "block_sparse_moe.gate" if self.experts > 0 => Some("ffn_gate_inp"),
            _ => None,
        };
        if let Some(g) = simple {
            let permute = match (self.family, local) {
                (Family::Llama, "self_attn.q_proj") => Some(self.heads),
                (Family::Llama, "self_attn.k_proj") => Some(self.kv_heads),
                _ => None,
            };
            return Some(Target::Tensor {
                name: blk(&format!("{g}.{suffix}")),
                expert: None,
                permute,
            });
        }
        // Experts, one tensor per expert in the checkpoint, stacked in the GGUF.
        let (list, proj) = if let Some(r) = local.strip_prefix("mlp.experts.") {
            (r, ["gate_proj", "up_proj", "down_proj"])
        } else if let Some(r) = local.strip_prefix("block_sparse_moe.experts.") {
            (r, ["w1", "w3", "w2"])
        } else {
            return None;
        };
        let (e, p) = list.split_once('.')?;
        let e: usize = e.parse().ok()?;
        let g =
            ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"][proj.iter().position(|x| *x == p)?];
        (suffix == "weight").then(|| Target::Tensor {
            name: blk(&format!("{g}.weight")),
            expert: Some(e),
            permute: None,
        })
    }
}

impl Plan {
    fn target(&self, hf: &str) -> Option<Target> {
        self.names.target(hf)
    }

    /// Whether the user excluded the module owning `hf` with `--exclude` (and did not
    /// `--include` it): it keeps its unquantized type.
    fn user_excluded(&self, hf: &str) -> bool {
        let module = hf.rsplit_once('.').map_or(hf, |(m, _)| m);
        !self.include.iter().any(|g| glob_match(g, module))
            && self.exclude.iter().any(|g| glob_match(g, module))
    }
}

/// llama.cpp's `LlamaModel.permute`: within each of `heads` heads, rows `[a0 a1 … b0 b1 …]`
/// (the two rotary halves) become `[a0 b0 a1 b1 …]`.
pub(crate) fn permute_rows<T: Copy>(v: &[T], rows: usize, heads: usize) -> Result<Vec<T>, String> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(format!("{rows} rows are not {heads} heads of an even size"));
    }
    let cols = v.len() / rows;
    let (per, half) = (rows / heads, rows / heads / 2);
    let mut out = Vec::with_capacity(v.len());
    for r in 0..rows {
        let (h, within) = (r / per, r % per);
        let src = h * per + (within % 2) * half + within / 2;
        out.extend_from_slice(&v[src * cols..(src + 1) * cols]);
    }
    Ok(out)
}

/// The inverse of [`permute_rows`]: llama.cpp's row order back to the checkpoint's.
// Read back by `read.rs` (feature `exec`).
#[cfg_attr(not(feature = "exec"), allow(dead_code))]
pub(crate) fn unpermute_rows<T: Copy>(
    v: &[T],
    rows: usize,
    heads: usize,
) -> Result<Vec<T>, String> {
    if heads == 0 || !rows.is_multiple_of(2 * heads) {
        return Err(format!("{rows} rows are not {heads} heads of an even size"));
    }
    let cols = v.len() / rows;
    let (per, half) = (rows / heads, rows / heads / 2);
    let mut out = vec![v[0]; v.len()];
    for r in 0..rows {
        let (h, within) = (r / per, r % per);
        let src = h * per + (within % 2) * half + within / 2;
        out[src * cols..(src + 1) * cols].copy_from_slice(&v[r * cols..(r + 1) * cols]);
    }
    Ok(out)
}

/// Little-endian float bytes as f32 values.
fn floats(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    FloatValues::decode(dtype, data).map(|v| v.view().to_f32())
}

fn block_type(t: u32) -> Option<GgufType> {
    GgufType::ALL.iter().copied().find(|g| g.ggml_type() == t)
}

/// llama.cpp's name of `general.file_type` `n` (`Q4_K_M`), for the file types kiln writes.
// Read back by `read.rs` (feature `exec`).
#[cfg_attr(not(feature = "exec"), allow(dead_code))]
pub(crate) fn file_type_name(n: u64) -> Option<&'static str> {
    FileType::ALL
        .iter()
        .find(|f| u64::from(f.number()) == n)
        .map(|f| f.llama_name())
}

/// A ggml type's name (`Q4_K`, `F16`).
pub fn type_name(t: u32) -> &'static str {
    match t {
        F32 => "F32",
        F16 => "F16",
        BF16 => "BF16",
        _ => block_type(t).map_or("?", |g| g.name()),
    }
}

impl GgufOutput {
    /// Encodes the values of HF tensor `hf` (`shape`, outermost first).
    ///
    /// Long on purpose: llama-quantize's per-tensor type rules, in its order.
    fn encode(
        &self,
        hf: &str,
        values: Vec<f32>,
        shape: &[usize],
        excluded: bool,
    ) -> Result<Written, ExportError> {
        let plan = self.plan()?;
        let Some(target) = plan.target(hf) else {
            return Err(Self::err(format!(
                "no GGUF name for tensor `{hf}` of a {} model",
                plan.names.family.arch()
            )));
        };
        let Target::Tensor {
            name,
            expert,
            permute,
        } = target
        else {
            return Ok(Written::default());
        };
        let (rows, cols) = match shape {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            s => {
                return Err(Self::err(format!(
                    "tensor `{hf}` has shape {s:?}; the GGUF writer maps 1-D and 2-D tensors"
                )));
            }
        };
        let values = match permute {
            Some(h) if shape.len() == 2 => permute_rows(&values, rows, h),
            Some(h) => permute_rows(&values, cols, h),
            None => Ok(values),
        }
        .map_err(|e| Self::err(format!("`{hf}`: {e}")))?;
        let dims = shape.len() + usize::from(expert.is_some());
        let chosen = if excluded {
            None
        } else {
            mix::tensor_type(self.ftype, &plan.mix, &name, dims, cols)
        };
        let ty = match chosen {
            Some((t, fallback)) => {
                if fallback {
                    self.warn(format!(
                        "`{name}`: rows of {cols} do not fill {}'s blocks; {} instead, as \
                         llama-quantize falls back",
                        self.ftype.llama_name(),
                        type_name(t)
                    ));
                }
                t
            }
            None if dims >= 2 && mix::allows_quantization(&name, dims) => plan.base,
            None => F32,
        };
        let data: Vec<u8> = match ty {
            F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
            F16 => values
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            BF16 => values
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
            t => {
                let g = block_type(t).ok_or_else(|| Self::err(format!("type {t}")))?;
                let weights = self.importance_of(plan, &name, expert, cols)?;
                if weights.is_none() && mix::requires_imatrix(&name, t) {
                    return Err(Self::err(format!(
                        "`{name}` would be {} in {}, which llama.cpp makes only with an \
                         importance matrix (\"the result will be garbage\"): give --imatrix \
                         FILE{} (`kiln imatrix` makes one)",
                        type_name(t),
                        self.ftype.llama_name(),
                        if plan.importance.is_some() {
                            " with an entry for it"
                        } else {
                            ""
                        }
                    )));
                }
                let mut out = vec![0u8; rows * g.bytes_for(cols)];
                kiln_kernels::cpu::quantize_gguf_with(g, &values, cols, weights, &mut out)
                    .map_err(|source| ExportError::Kernel {
                        tensor: hf.to_string(),
                        source,
                    })?;
                out
            }
        };
        let quantized = if chosen.is_some() {
            let decoded = decode(ty, &data, values.len())?;
            let w: Vec<f32> = values;
            Some((
                type_name(ty).to_string(),
                ErrorStats::measure(&w, |i| decoded[i]),
            ))
        } else {
            None
        };
        let name = match expert {
            Some(e) => format!("{name}#{e}"),
            None => name,
        };
        Ok(Written {
            tensors: vec![Encoded {
                name,
                ty: EncodedType::Ggml(ty),
                shape: shape.to_vec(),
                data,
            }],
            quantized,
        })
    }
}

impl GgufOutput {
    /// The importance weights of GGUF tensor `name` (expert `expert`'s slice of a stacked
    /// one) for rows of `cols`, as llama-quantize finds them: `None` without `--imatrix`, or
    /// (warned by name, as llama-quantize reports it) when the matrix has no entry; an entry
    /// of another size is an error, except for `token_embd` (llama-quantize ignores it).
    fn importance_of<'p>(
        &self,
        plan: &'p Plan,
        name: &str,
        expert: Option<usize>,
        cols: usize,
    ) -> Result<Option<&'p [f32]>, ExportError> {
        let Some(imp) = &plan.importance else {
            return Ok(None);
        };
        let Some(w) = imp.weights.get(name) else {
            self.warn(format!(
                "`{name}`: {} has no entry for it; quantized without importance weights, as                  llama-quantize does",
                imp.source.display()
            ));
            return Ok(None);
        };
        let mats = plan.names.experts.max(1);
        let want = if expert.is_some() { cols * mats } else { cols };
        if w.len() != want {
            if name == "token_embd.weight" {
                return Ok(None);
            }
            return Err(Self::err(format!(
                "{}: the importance matrix of `{name}` has {} values, the tensor {want}                  columns (in all its matrices); llama-quantize refuses it too",
                imp.source.display(),
                w.len()
            )));
        }
        let e = expert.unwrap_or(0);
        Ok(Some(&w[e * cols..(e + 1) * cols]))
    }
}

/// Values of `n` elements of ggml type `ty`, for the error statistics.
fn decode(ty: u32, data: &[u8], n: usize) -> Result<Vec<f32>, ExportError> {
    let dt = match ty {
        F32 => Dtype::F32,
        F16 => Dtype::F16,
        BF16 => Dtype::BF16,
        t => {
            let g = block_type(t).ok_or_else(|| GgufOutput::err(format!("type {t}")))?;
            let mut out = vec![0f32; n];
            kiln_kernels::ops::gguf::dequantize(g, data, &mut out).map_err(|source| {
                ExportError::Kernel {
                    tensor: "decoding for the error statistics".into(),
                    source,
                }
            })?;
            return Ok(out);
        }
    };
    floats(dt, data).ok_or_else(|| GgufOutput::err("decode"))
}

/// config.json's RoPE scaling, as llama.cpp's converter writes it (`conversion/base.py`
/// `set_gguf_parameters`, `conversion/llama.py` `generate_extra_tensors`).
#[derive(Debug, Clone, PartialEq)]
enum RopeScaling {
    /// None, or `rope_type` `default`.
    None,
    /// `llama3`: a `rope_freqs` tensor of per-frequency factors (the llama architecture).
    Llama3(Map<String, Json>),
    /// `linear` / `yarn`: `rope.scaling.*` metadata keys.
    Keys(Vec<(String, Value)>),
}

/// The RoPE scaling of `c`: `rope_parameters` (transformers 5) or `rope_scaling`, with
/// `type` read as `rope_type`, as the converter does. Types llama.cpp's converter handles
/// elsewhere or not at all are an error naming them.
fn rope_scaling(c: &Map<String, Json>) -> Result<RopeScaling, ExportError> {
    let params = c
        .get("rope_parameters")
        .filter(|v| !v.is_null())
        .or_else(|| c.get("rope_scaling").filter(|v| !v.is_null()))
        .and_then(Json::as_object);
    let Some(p) = params else {
        return Ok(RopeScaling::None);
    };
    let p = p
        .get("full_attention")
        .and_then(Json::as_object)
        .unwrap_or(p);
    let ty = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Json::as_str);
    let f32_of = |k: &str| {
        p.get(k)
            .and_then(Json::as_f64)
            .map(|v| Value::F32(v as f32))
    };
    let cannot = |what: String| ExportError::WriterCannot {
        writer: "gguf".into(),
        what,
        supported: vec![
            "RoPE default".into(),
            "linear".into(),
            "yarn".into(),
            "llama3".into(),
        ],
    };
    match ty {
        None | Some("default") => Ok(RopeScaling::None),
        Some(t) if t.eq_ignore_ascii_case("llama3") => Ok(RopeScaling::Llama3(p.clone())),
        Some("linear") => match f32_of("factor") {
            Some(f) => Ok(RopeScaling::Keys(vec![
                ("rope.scaling.type".into(), Value::String("linear".into())),
                ("rope.scaling.factor".into(), f),
            ])),
            None => Ok(RopeScaling::None),
        },
        Some("yarn") => {
            let Some(f) = f32_of("factor") else {
                return Ok(RopeScaling::None);
            };
            let orig = p
                .get("original_max_position_embeddings")
                .and_then(Json::as_u64)
                .ok_or_else(|| {
                    cannot("yarn RoPE scaling without original_max_position_embeddings".into())
                })?;
            let mut keys = vec![
                ("rope.scaling.type".into(), Value::String("yarn".into())),
                ("rope.scaling.factor".into(), f),
                (
                    "rope.scaling.original_context_length".into(),
                    Value::U32(orig as u32),
                ),
            ];
            for (hf, gguf) in [
                ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
                ("attention_factor", "rope.scaling.yarn_attn_factor"),
                ("beta_fast", "rope.scaling.yarn_beta_fast"),
                ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ] {
                let v = match (hf, f32_of(hf)) {
                    ("attention_factor", None) => f32_of("attn_factor"),
                    (_, v) => v,
                };
                if let Some(v) = v {
                    keys.push((gguf.into(), v));
                }
            }
            Ok(RopeScaling::Keys(keys))
        }
        Some(other) => Err(cannot(format!("config.json's RoPE scaling `{other}`"))),
    }
}

/// llama.cpp's `rope_freqs` for llama3 RoPE scaling (`LlamaModel.generate_extra_tensors`), in
/// f32 as PyTorch computes it there: `freq = 1 / base^(i/dim)` for even `i`,
/// `wavelen = 2π / freq`; the factor is 1 below `orig / high`, `factor` above `orig / low`,
/// and `1 / ((1 − s) / factor + s)` between, `s = (orig / wavelen − low) / (high − low)`.
fn llama3_rope_factors(p: &Map<String, Json>, base: f64, dim: usize) -> Vec<f32> {
    let get = |k: &str, d: f64| p.get(k).and_then(Json::as_f64).unwrap_or(d) as f32;
    let factor = get("factor", 8.0);
    let low = get("low_freq_factor", 1.0);
    let high = get("high_freq_factor", 4.0);
    let orig = get("original_max_position_embeddings", 8192.0);
    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    (0..dim)
        .step_by(2)
        .map(|i| {
            let freq = 1.0 / (base as f32).powf(i as f32 / dim as f32);
            let wavelen = two_pi / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

impl OutputWriter for GgufOutput {
    fn uses_importance(&self) -> bool {
        self.ftype.quantizes()
    }

    fn begin(&mut self, start: &WriterStart<'_>) -> Result<(), ExportError> {
        let family = Family::NAMES
            .iter()
            .find(|(n, _)| *n == start.architecture)
            .map(|(_, f)| *f)
            .ok_or_else(|| ExportError::WriterCannot {
                writer: "gguf".into(),
                what: format!("the `{}` architecture", start.architecture),
                supported: Family::NAMES.iter().map(|(n, _)| n.to_string()).collect(),
            })?;
        if start.recipe.kv_cache.is_some() {
            return Err(ExportError::WriterCannot {
                writer: "gguf".into(),
                what: "--kv-cache (llama.cpp chooses its KV-cache type at load time: \
                       --cache-type-k / --cache-type-v)"
                    .into(),
                supported: FileType::ALL.iter().map(|f| f.cli_name().into()).collect(),
            });
        }
        if start.importance.is_none() && self.ftype.requires_imatrix() {
            return Err(Self::err(format!(
                "{} needs an importance matrix, as llama-quantize refuses it without one (its \
                 IQ2 and IQ3_XXS tensors \"will be garbage\"): give --imatrix FILE (`kiln \
                 imatrix` makes one)",
                self.ftype.llama_name()
            )));
        }
        let c = start.checkpoint.config().raw();
        let dims = Dims::of(c)?;
        let (mut md, rope_freqs) = hparams(c, start.model, start.architecture, family, &dims)?;
        // Where convert_hf_to_gguf.py puts them; a quantized file has them last (below).
        let quantizes = self.ftype.quantizes();
        if !quantizes {
            md.push(("general.file_type".into(), Value::U32(self.ftype.number())));
            md.push(("general.quantization_version".into(), Value::U32(2)));
        }
        // The converter's LlamaModel: `add_space_prefix` from tokenizer_config.json, then
        // SentencePiece before BPE.
        if family == Family::Llama
            && let Some(v) = std::fs::read_to_string(start.model.join("tokenizer_config.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<Json>(&t).ok())
                .and_then(|c| c.get("add_prefix_space").and_then(Json::as_bool))
        {
            md.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(v)));
        }
        let vocab = vocab::read(start.model, dims.vocab_size, family == Family::Llama)
            .map_err(Self::err)?;
        for w in vocab.warnings {
            self.warn(w);
        }
        md.extend(vocab.metadata);
        // llama-quantize copies the converted file's keys, then sets these two (ggml's
        // `gguf_set_val_*` removes a key and appends it): after every other key.
        if quantizes {
            md.push(("general.quantization_version".into(), Value::U32(2)));
            md.push(("general.file_type".into(), Value::U32(self.ftype.number())));
        }
        // What llama-quantize records of an importance matrix (its `kv_overrides`, after every
        // other key): the file as given, its first dataset, the entries, the chunks.
        if let Some(i) = start.importance {
            let clip = |s: String| s.chars().take(127).collect::<String>();
            md.push((
                "quantize.imatrix.file".into(),
                Value::String(clip(i.source.display().to_string())),
            ));
            if let Some(d) = i.datasets.first() {
                md.push((
                    "quantize.imatrix.dataset".into(),
                    Value::String(clip(d.clone())),
                ));
            }
            md.push((
                "quantize.imatrix.entries_count".into(),
                Value::U32(i.weights.len() as u32),
            ));
            if i.chunks > 0 {
                md.push(("quantize.imatrix.chunks_count".into(), Value::U32(i.chunks)));
            }
        }
        let has_output = start.checkpoint.tensor("lm_head.weight").is_some()
            && c.get("tie_word_embeddings").and_then(Json::as_bool) != Some(true);
        let is_70b = dims.layers == 80
            && match family {
                Family::Llama => dims.heads != dims.kv_heads,
                Family::Qwen2 => true,
                _ => false,
            };
        self.plan = Some(Plan {
            names: Names {
                family,
                heads: dims.heads,
                kv_heads: dims.kv_heads,
                experts: dims.experts,
            },
            mix: MixModel {
                experts: dims.experts,
                layers: dims.layers,
                is_70b,
                tied_embeddings: !has_output,
                gqa: dims.heads / dims.kv_heads.max(1),
                has_imatrix: start.importance.is_some(),
            },
            base: base_type(start),
            exclude: start.recipe.exclude.clone(),
            include: start.recipe.include.clone(),
            metadata: md,
            importance: start.importance.cloned(),
        });
        self.spool = Some(Spool::create(start.out, dims.experts, rope_freqs)?);
        Ok(())
    }

    fn linear(&self, w: &LinearWeight<'_>) -> Result<Written, ExportError> {
        let hf = crate::export::full_name(w.module, "weight");
        self.encode(&hf, w.values.to_f32(), &[w.rows, w.cols], false)
    }

    fn tensor(
        &self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Written, ExportError> {
        let values = floats(dtype, &data).ok_or_else(|| {
            Self::err(format!(
                "tensor `{name}` is {dtype:?}; GGUF tensors are written from F32, F16 or BF16"
            ))
        })?;
        drop(data);
        let excluded = self.plan()?.user_excluded(name);
        self.encode(name, values, shape, excluded)
    }

    fn write(&mut self, t: Encoded) -> Result<(), ExportError> {
        let EncodedType::Ggml(ty) = t.ty else {
            return Err(Self::err(format!("`{}` is not a ggml tensor", t.name)));
        };
        let spool = self
            .spool
            .as_mut()
            .ok_or_else(|| Self::err("written before `begin`"))?;
        let Some(parsed) = super::Stacks::<u32>::parse(&t.name) else {
            let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
            return spool.append(t.name.clone(), dims, ty, &t.data);
        };
        let (name, e) = parsed.map_err(Self::err)?;
        if let Some((ty, shape, data)) = spool
            .stacks
            .add(name, e, ty, &t.shape, t.data)
            .map_err(Self::err)?
        {
            let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
            spool.append(name.to_string(), dims, ty, &data)?;
        }
        Ok(())
    }

    fn finish(&mut self, end: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        let plan = self
            .plan
            .take()
            .ok_or_else(|| Self::err("finished before `begin`"))?;
        let mut spool = self
            .spool
            .take()
            .ok_or_else(|| Self::err("finished before `begin`"))?;
        spool.stacks.check_complete().map_err(Self::err)?;
        let io =
            |p: &std::path::Path, e: std::io::Error| Self::err(format!("{}: {e}", p.display()));
        spool.file.flush().map_err(|e| io(&spool.path, e))?;
        let mut src = spool
            .file
            .into_inner()
            .map_err(|e| io(&spool.path, e.into_error()))?;
        // llama-quantize writes tensors in its loader's order (`weight_name_comparer`): by layer
        // (`blk.N.`; other tensors first), then by name.
        if self.ftype.quantizes() {
            spool
                .entries
                .sort_by(|a, b| llama_tensor_order(&a.0).cmp(&llama_tensor_order(&b.0)));
        }
        let tensors: Vec<(String, Vec<u64>, u32)> = spool
            .entries
            .iter()
            .map(|(n, d, t, _, _)| (n.clone(), d.clone(), *t))
            .collect();
        let path = end.out.join(FILE_NAME);
        let gguf_err = |e: crate::formats::gguf::container::GgufError| Self::err(e.to_string());
        let mut w = GgufWriter::create(&path, &plan.metadata, &tensors).map_err(gguf_err)?;
        let mut buf = Vec::new();
        for (name, _, _, offset, len) in &spool.entries {
            buf.resize(*len as usize, 0);
            src.seek(SeekFrom::Start(*offset))
                .and_then(|_| src.read_exact(&mut buf))
                .map_err(|e| io(&spool.path, e))?;
            w.write_tensor(name, &buf).map_err(gguf_err)?;
        }
        w.finish().map_err(gguf_err)?;
        drop(src);
        std::fs::remove_file(&spool.path).map_err(|e| io(&spool.path, e))?;
        Ok(vec![FILE_NAME.to_string()])
    }

    fn engines(&self) -> Vec<crate::export::engines::EngineSupport> {
        crate::export::engines::gguf(self.ftype.cli_name())
    }

    fn warnings(&self) -> Vec<String> {
        self.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Spool {
    /// A new spool in `out`; the converter yields its generated tensors (llama3's
    /// `rope_freqs.weight`) before the checkpoint's.
    fn create(
        out: &Path,
        experts: usize,
        rope_freqs: Option<Vec<f32>>,
    ) -> Result<Self, ExportError> {
        let path = out.join(SPOOL);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| GgufOutput::err(format!("{}: {e}", path.display())))?;
        let mut spool = Spool {
            path,
            file: BufWriter::new(file),
            len: 0,
            entries: Vec::new(),
            stacks: super::Stacks::new(experts),
        };
        if let Some(f) = rope_freqs {
            let bytes: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
            spool.append(
                "rope_freqs.weight".into(),
                vec![f.len() as u64],
                F32,
                &bytes,
            )?;
        }
        Ok(spool)
    }

    fn append(
        &mut self,
        name: String,
        dims: Vec<u64>,
        ty: u32,
        data: &[u8],
    ) -> Result<(), ExportError> {
        self.file
            .write_all(data)
            .map_err(|e| GgufOutput::err(format!("{}: {e}", self.path.display())))?;
        self.entries
            .push((name, dims, ty, self.len, data.len() as u64));
        self.len += data.len() as u64;
        Ok(())
    }
}

/// GGUF metadata keys and values, in the order they are written.
type Metadata = Vec<(String, Value)>;

/// The model's sizes from `config.json`.
struct Dims {
    heads: usize,
    kv_heads: usize,
    layers: usize,
    hidden: usize,
    vocab_size: usize,
    experts: usize,
}

impl Dims {
    fn of(c: &Map<String, Json>) -> Result<Self, ExportError> {
        let heads = need(c, "num_attention_heads")?;
        Ok(Dims {
            heads,
            kv_heads: cfg_usize(c, "num_key_value_heads").unwrap_or(heads),
            layers: need(c, "num_hidden_layers")?,
            hidden: need(c, "hidden_size")?,
            vocab_size: need(c, "vocab_size")?,
            experts: cfg_usize(c, "num_local_experts")
                .or_else(|| cfg_usize(c, "num_experts"))
                .unwrap_or(0),
        })
    }
}

/// The type an unquantized weight keeps: the dtype of the model's first 2-D weight.
/// The key llama.cpp's model loader sorts tensors by: the layer of a `blk.N.` name (−1 for
/// the rest), then the name (`llama_model_loader::weight_name_comparer`).
fn llama_tensor_order(name: &str) -> (i64, &str) {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(n, _)| n.parse::<i64>().ok())
        .unwrap_or(-1);
    (layer, name)
}

fn base_type(start: &WriterStart<'_>) -> u32 {
    start
        .tree
        .walk()
        .find_map(|m| {
            m.tensor("weight")
                .filter(|t| t.shape.len() == 2)
                .and_then(|t| {
                    start
                        .checkpoint
                        .tensor(&crate::export::full_name(m.path(), &t.name))
                })
        })
        .map_or(BF16, |t| match t.dtype {
            Dtype::F16 => F16,
            Dtype::F32 => F32,
            _ => BF16,
        })
}

/// `general.*` and the architecture's hyper-parameter keys, as `convert_hf_to_gguf.py` writes
/// them, and llama3 RoPE scaling's per-frequency factors (the `rope_freqs.weight` tensor).
fn hparams(
    c: &Map<String, Json>,
    model: &Path,
    architecture: &str,
    family: Family,
    dims: &Dims,
) -> Result<(Metadata, Option<Vec<f32>>), ExportError> {
    let Dims {
        heads,
        kv_heads,
        layers,
        hidden,
        vocab_size,
        experts,
    } = *dims;
    let rope = c.get("rope_parameters").and_then(Json::as_object);
    let scaling = rope_scaling(c)?;
    let theta = c
        .get("rope_theta")
        .or_else(|| rope.and_then(|r| r.get("rope_theta")))
        .and_then(Json::as_f64);
    let arch = family.arch();
    // `general.name`: the model's name in config.json (`_name_or_path`, its last part),
    // else the folder's name, as the converter does.
    let name = c
        .get("_name_or_path")
        .and_then(Json::as_str)
        .and_then(|p| p.trim_end_matches('/').rsplit('/').next())
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .or_else(|| model.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "model".to_string());
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        ("general.type".into(), Value::String("model".into())),
        ("general.name".into(), Value::String(name)),
    ];
    let a = |k: &str| format!("{arch}.{k}");
    let u = |v: usize| Value::U32(v as u32);
    md.push((a("vocab_size"), u(vocab_size)));
    if let Some(ctx) = cfg_usize(c, "max_position_embeddings") {
        md.push((a("context_length"), u(ctx)));
    }
    md.push((a("embedding_length"), u(hidden)));
    md.push((a("block_count"), u(layers)));
    if let Some(ff) = cfg_usize(c, "intermediate_size") {
        md.push((a("feed_forward_length"), u(ff)));
    }
    md.push((a("attention.head_count"), u(heads)));
    md.push((a("attention.head_count_kv"), u(kv_heads)));
    if let Some(t) = theta {
        md.push((a("rope.freq_base"), Value::F32(t as f32)));
    }
    let rope_freqs = match &scaling {
        RopeScaling::None => None,
        RopeScaling::Llama3(p) if family == Family::Llama => Some(llama3_rope_factors(
            p,
            theta.unwrap_or(10000.0),
            cfg_usize(c, "head_dim").unwrap_or(hidden / heads.max(1)),
        )),
        RopeScaling::Llama3(_) => {
            return Err(ExportError::WriterCannot {
                writer: "gguf".into(),
                what: format!("llama3 RoPE scaling on `{architecture}`"),
                supported: vec!["llama3 RoPE scaling on the llama architecture".into()],
            });
        }
        RopeScaling::Keys(keys) => {
            md.extend(keys.iter().map(|(k, v)| (a(k), v.clone())));
            None
        }
    };
    if let Some(eps) = c.get("rms_norm_eps").and_then(Json::as_f64) {
        md.push((
            a("attention.layer_norm_rms_epsilon"),
            Value::F32(eps as f32),
        ));
    }
    let head_dim = cfg_usize(c, "head_dim");
    if let Some(hd) = head_dim {
        md.push((a("attention.key_length"), u(hd)));
        md.push((a("attention.value_length"), u(hd)));
    }
    if family == Family::Llama {
        md.push((
            a("rope.dimension_count"),
            u(head_dim.unwrap_or(hidden / heads.max(1))),
        ));
    }
    if experts > 0 {
        md.push((a("expert_count"), u(experts)));
        if let Some(k) = cfg_usize(c, "num_experts_per_tok") {
            md.push((a("expert_used_count"), u(k)));
        }
        if let Some(ff) = cfg_usize(c, "moe_intermediate_size") {
            md.push((a("expert_feed_forward_length"), u(ff)));
        }
    }
    Ok((md, rope_freqs))
}

impl WriterType for GgufOutput {
    fn formats() -> Vec<(&'static str, String)> {
        FileType::ALL
            .iter()
            .map(|f| (f.cli_name(), f.describe()))
            .collect()
    }

    fn new(format: &str) -> Result<Self, ExportError> {
        let ftype = FileType::ALL
            .into_iter()
            .find(|f| f.cli_name() == format)
            .ok_or_else(|| Self::err(format!("no file type `{format}`")))?;
        Ok(GgufOutput {
            ftype,
            plan: None,
            spool: None,
            warnings: Mutex::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_scaling_follows_the_converter() {
        let cfg = |j: &str| -> Map<String, Json> { serde_json::from_str(j).unwrap() };
        let keys = |j: &str| match rope_scaling(&cfg(j)).unwrap() {
            RopeScaling::Keys(k) => k,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            keys(r#"{"rope_scaling": {"type": "linear", "factor": 2.0}}"#),
            vec![
                ("rope.scaling.type".into(), Value::String("linear".into())),
                ("rope.scaling.factor".into(), Value::F32(2.0)),
            ]
        );
        let yarn = keys(
            r#"{"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                "original_max_position_embeddings": 32768, "rope_theta": 1e6}}"#,
        );
        assert_eq!(
            yarn[2],
            (
                "rope.scaling.original_context_length".into(),
                Value::U32(32768)
            )
        );
        assert_eq!(
            yarn[3],
            ("rope.scaling.yarn_beta_fast".into(), Value::F32(32.0))
        );
        assert_eq!(yarn.len(), 4);
        assert_eq!(
            rope_scaling(&cfg(r#"{"rope_parameters": {"rope_type": "default"}}"#)).unwrap(),
            RopeScaling::None
        );
        let e = rope_scaling(&cfg(r#"{"rope_scaling": {"rope_type": "dynamic"}}"#)).unwrap_err();
        assert!(e.to_string().contains("`dynamic`"), "{e}");
        // llama3: high frequencies keep 1, the lowest are divided by `factor`, a blend between.
        let p = cfg(
            r#"{"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}"#,
        );
        let f = llama3_rope_factors(&p, 500000.0, 128);
        assert_eq!(f.len(), 64);
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.iter().any(|&x| x > 1.0 && x < 8.0));
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn permutation_interleaves_the_rotary_halves_per_head() {
        // Two heads of four rows, one column: [a0 a1 b0 b1 | c0 c1 d0 d1] → [a0 b0 a1 b1 | …].
        let v = [0, 1, 2, 3, 4, 5, 6, 7];
        assert_eq!(permute_rows(&v, 8, 2).unwrap(), [0, 2, 1, 3, 4, 6, 5, 7]);
        assert!(permute_rows(&v, 8, 3).is_err());
        // Reading back undoes it, for rows of several columns too.
        let w: Vec<u32> = (0..48).collect();
        let p = permute_rows(&w, 12, 2).unwrap();
        assert_ne!(p, w);
        assert_eq!(unpermute_rows(&p, 12, 2).unwrap(), w);
    }
}
