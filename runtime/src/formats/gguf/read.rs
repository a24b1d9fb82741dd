//! Loading a GGUF file kiln wrote (`--output-format gguf`, docs/FORMATS.md §7.2) for
//! execution: the model's `config.json` rebuilt from the GGUF metadata (architecture, sizes,
//! RoPE base, norm epsilon, experts), and every tensor read back under its Hugging Face name —
//! the GGUF writer's own name map run backwards, each block type dequantized as llama.cpp's
//! `dequantize_row_*` does (`kiln_kernels::ops::gguf`), llama.cpp's Q/K row order undone,
//! stacked experts split per expert. The activations run unquantized in f32: a GGUF stores no
//! activation scale, but llama.cpp's CPU matmuls do round the activations to 8 bits (Q8_0 /
//! Q8_K, the weight type's `vec_dot_type`) inside each quantized dot product, so its
//! perplexity of a quantized file sits a little above kiln's (BENCHMARKS.md §GGUF: 0.4–0.6 % on
//! SmolLM2's Q4_K_M).

use crate::formats::gguf::container::{GgufFile, Value};
use crate::formats::gguf::{Names, Target, unpermute_rows};
use crate::model::{ModelError, Weights};
use candle_core::{DType, Device};
use kiln_kernels::ops::gguf::GgufType;
use serde_json::{Map, Value as Json, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The tensor of per-frequency RoPE factors the converter generates for llama3 scaling.
const ROPE_FREQS: &str = "rope_freqs.weight";

fn err(path: &Path, what: String) -> ModelError {
    ModelError::file(path, what)
}

/// A GGUF file opened for reading back, with the Hugging Face config its metadata gives.
pub struct GgufModel {
    file: GgufFile,
    path: PathBuf,
    /// The rebuilt `config.json`.
    pub config: Map<String, Json>,
    /// llama.cpp's `rope_freqs` (llama3 RoPE scaling), when the file has them.
    pub rope_freqs: Option<Vec<f32>>,
}

impl GgufModel {
    /// Opens `path` (a `.gguf` file) and rebuilds its config.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = GgufFile::open(path).map_err(|e| err(path, e.to_string()))?;
        let config = hf_config(&file, path)?;
        let mut g = GgufModel {
            file,
            path: path.to_path_buf(),
            config,
            rope_freqs: None,
        };
        if g.file.tensor(ROPE_FREQS).is_some() {
            g.rope_freqs = Some(g.decode(ROPE_FREQS)?);
        }
        Ok(g)
    }

    /// `general.file_type` as llama.cpp names it (`Q4_K_M`), or its number.
    pub fn file_type(&self) -> String {
        let n = self
            .file
            .metadata
            .get("general.file_type")
            .and_then(Value::as_u64);
        match n.and_then(crate::formats::gguf::file_type_name) {
            Some(name) => name.to_string(),
            None => format!("file type {n:?}"),
        }
    }

    /// The Hugging Face architecture (`LlamaForCausalLM`, …).
    pub fn architecture(&self) -> &str {
        self.config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Json::as_str)
            .unwrap_or("")
    }

    /// Every tensor under its Hugging Face name, decoded to f32 in `dtype` on `device`, and
    /// the names of the weights that were block-quantized (not F32 / F16 / BF16).
    pub fn weights(
        &self,
        dtype: DType,
        device: &Device,
    ) -> Result<(Weights, BTreeSet<String>), ModelError> {
        self.weights_with(dtype, device, false)
    }

    /// [`GgufModel::weights`] in f32 with every block-quantized Linear weight (not the
    /// embeddings, not stacked experts) kept packed (QLoRA).
    pub fn packed_weights(&self, device: &Device) -> Result<Weights, ModelError> {
        Ok(self.weights_with(DType::F32, device, true)?.0)
    }

    fn weights_with(
        &self,
        dtype: DType,
        device: &Device,
        pack: bool,
    ) -> Result<(Weights, BTreeSet<String>), ModelError> {
        let names = Names::for_model(self.architecture(), &self.config).ok_or_else(|| {
            err(
                &self.path,
                format!("no name map for {}", self.architecture()),
            )
        })?;
        let mut vars = BTreeMap::new();
        let mut packed: BTreeMap<String, crate::model::packed::Packed> = BTreeMap::new();
        let mut quantized = BTreeSet::new();
        let mut used = BTreeSet::new();
        // A stacked expert tensor is decoded once, for all its experts.
        let mut stacked: Option<(String, Vec<f32>)> = None;
        for hf in candidates(&self.config) {
            let Some(Target::Tensor {
                name,
                expert,
                permute,
            }) = names.target(&hf)
            else {
                continue;
            };
            let Some(info) = self.file.tensor(&name) else {
                continue;
            };
            used.insert(name.clone());
            let shape: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
            let ty = info.ggml_type;
            let block = !matches!(ty, 0 | 1 | 30);
            if pack
                && block
                && expert.is_none()
                && shape.len() == 2
                && hf.ends_with(".weight")
                && !hf.ends_with("embed_tokens.weight")
            {
                packed.insert(
                    hf.clone(),
                    std::sync::Arc::new(self.packed(&name, &shape, permute)?),
                );
                quantized.insert(hf.trim_end_matches(".weight").to_string());
                continue;
            }
            let values = match expert {
                Some(e) => {
                    if stacked.as_ref().is_none_or(|(n, _)| *n != name) {
                        stacked = Some((name.clone(), self.decode(&name)?));
                    }
                    let all: &[f32] = stacked.as_ref().map_or(&[], |(_, v)| v.as_slice());
                    let per = shape[1..].iter().product::<usize>();
                    all.get(e * per..(e + 1) * per)
                        .ok_or_else(|| err(&self.path, format!("`{name}` has no expert {e}")))?
                        .to_vec()
                }
                None => self.decode(&name)?,
            };
            let shape = if expert.is_some() {
                shape[1..].to_vec()
            } else {
                shape
            };
            let values = match permute {
                Some(heads) => unpermute_rows(&values, shape[0], heads)
                    .map_err(|e| err(&self.path, format!("`{name}`: {e}")))?,
                None => values,
            };
            if block && hf.ends_with(".weight") {
                quantized.insert(hf.trim_end_matches(".weight").to_string());
            }
            vars.insert(hf, crate::model::to_var(values, &shape, dtype, device)?);
        }
        if let Some(t) = self
            .file
            .tensors
            .iter()
            .find(|t| !used.contains(&t.name) && t.name != ROPE_FREQS)
        {
            return Err(err(
                &self.path,
                format!("tensor `{}` has no Hugging Face name", t.name),
            ));
        }
        Ok((Weights::from_vars(vars).with_packed(packed), quantized))
    }

    /// The block-quantized 2-D tensor `name` (`[rows, cols]`) kept packed; `permute`: its rows
    /// are in llama.cpp's Q/K order over that many heads.
    fn packed(
        &self,
        name: &str,
        shape: &[usize],
        permute: Option<usize>,
    ) -> Result<GgufRows, ModelError> {
        let info = self
            .file
            .tensor(name)
            .ok_or_else(|| err(&self.path, format!("no tensor `{name}`")))?;
        let ty = GgufType::ALL
            .iter()
            .copied()
            .find(|g| g.ggml_type() == info.ggml_type)
            .ok_or_else(|| {
                err(
                    &self.path,
                    format!("`{name}`: ggml type {}", info.ggml_type),
                )
            })?;
        let (rows, cols) = (shape[0], shape[1]);
        let data = self
            .file
            .read(info)
            .map_err(|e| err(&self.path, e.to_string()))?;
        if !cols.is_multiple_of(ty.block_elems()) || data.len() != rows * ty.bytes_for(cols) {
            return Err(err(
                &self.path,
                format!(
                    "`{name}`: {} bytes for {rows} rows of {cols} {}",
                    data.len(),
                    ty.name()
                ),
            ));
        }
        // HF row r is GGUF row source[r] (the inverse of the writer's permutation).
        let source = match permute {
            Some(heads) => {
                let order: Vec<usize> = (0..rows).collect();
                let back = unpermute_rows(&order, rows, heads)
                    .map_err(|e| err(&self.path, format!("`{name}`: {e}")))?;
                Some(back)
            }
            None => None,
        };
        Ok(GgufRows {
            ty,
            rows,
            cols,
            data,
            source,
        })
    }

    fn decode(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let info = self
            .file
            .tensor(name)
            .ok_or_else(|| err(&self.path, format!("no tensor `{name}`")))?;
        let n: usize = info.dims.iter().map(|&d| d as usize).product();
        let data = self
            .file
            .read(info)
            .map_err(|e| err(&self.path, e.to_string()))?;
        let floats = |dtype| {
            crate::export::writer::FloatValues::decode(dtype, &data).map(|v| v.view().to_f32())
        };
        let out = match info.ggml_type {
            0 => floats(safetensors::Dtype::F32),
            1 => floats(safetensors::Dtype::F16),
            30 => floats(safetensors::Dtype::BF16),
            t => {
                let g = GgufType::ALL
                    .iter()
                    .copied()
                    .find(|g| g.ggml_type() == t)
                    .ok_or_else(|| err(&self.path, format!("`{name}`: ggml type {t}")))?;
                let mut out = vec![0f32; n];
                kiln_kernels::ops::gguf::dequantize(g, &data, &mut out).map_err(|e| {
                    ModelError::Tensor {
                        tensor: name.to_string(),
                        message: e.to_string(),
                    }
                })?;
                Some(out)
            }
        };
        out.filter(|v| v.len() == n)
            .ok_or_else(|| err(&self.path, format!("`{name}` does not decode")))
    }
}

/// A block-quantized GGUF Linear kept packed (QLoRA): its blocks, decoded a range of rows at
/// a time with `dequantize_row_*`'s arithmetic; rows in llama.cpp's Q/K order are read in the
/// checkpoint's.
#[derive(Debug)]
struct GgufRows {
    ty: GgufType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    /// For each Hugging Face row, the GGUF row holding it (Q/K), or the identity.
    source: Option<Vec<usize>>,
}

impl kiln_kernels::ops::packed_matmul::PackedRows for GgufRows {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), kiln_kernels::KernelError> {
        let rb = self.ty.bytes_for(self.cols);
        let n = out.len() / self.cols.max(1);
        match &self.source {
            None => kiln_kernels::ops::gguf::dequantize(
                self.ty,
                &self.data[start * rb..(start + n) * rb],
                out,
            ),
            Some(source) => {
                for (i, row) in out.chunks_exact_mut(self.cols).enumerate() {
                    let s = source[start + i];
                    kiln_kernels::ops::gguf::dequantize(
                        self.ty,
                        &self.data[s * rb..(s + 1) * rb],
                        row,
                    )?;
                }
                Ok(())
            }
        }
    }
    fn packed_bytes(&self) -> usize {
        self.data.len() + self.source.as_ref().map_or(0, |s| s.len() * 8)
    }
}

/// Every Hugging Face tensor name a model with `config` may have, in the writer's families.
fn candidates(config: &Map<String, Json>) -> Vec<String> {
    let n = |k: &str| config.get(k).and_then(Json::as_u64).unwrap_or(0) as usize;
    let (layers, experts) = (
        n("num_hidden_layers"),
        n("num_local_experts").max(n("num_experts")),
    );
    let mixtral = config.get("model_type").and_then(Json::as_str) == Some("mixtral");
    let mut out = vec![
        "model.embed_tokens.weight".to_string(),
        "model.norm.weight".into(),
        "lm_head.weight".into(),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for local in [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
        ] {
            out.push(format!("{p}.{local}"));
        }
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            for t in ["weight", "bias"] {
                out.push(format!("{p}.self_attn.{proj}.{t}"));
            }
        }
        if experts == 0 {
            for proj in ["gate_proj", "up_proj", "down_proj"] {
                out.push(format!("{p}.mlp.{proj}.weight"));
            }
            continue;
        }
        let (moe, projs) = if mixtral {
            ("block_sparse_moe", ["w1", "w3", "w2"])
        } else {
            ("mlp", ["gate_proj", "up_proj", "down_proj"])
        };
        out.push(format!("{p}.{moe}.gate.weight"));
        for e in 0..experts {
            for proj in projs {
                out.push(format!("{p}.{moe}.experts.{e}.{proj}.weight"));
            }
        }
    }
    out
}

/// The Hugging Face `config.json` the GGUF metadata gives (what the writer took from it).
fn hf_config(file: &GgufFile, path: &Path) -> Result<Map<String, Json>, ModelError> {
    let md = &file.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| err(path, "no general.architecture".into()))?
        .to_string();
    let u = |k: &str| md.get(&format!("{arch}.{k}")).and_then(Value::as_u64);
    let f = |k: &str| match md.get(&format!("{arch}.{k}")) {
        Some(Value::F32(v)) => Some(f64::from(*v)),
        Some(Value::F64(v)) => Some(*v),
        _ => None,
    };
    let need = |k: &str| u(k).ok_or_else(|| err(path, format!("no `{arch}.{k}`")));
    let experts = u("expert_count").unwrap_or(0);
    let (architecture, model_type) = match (arch.as_str(), experts > 0) {
        ("llama", false) => ("LlamaForCausalLM", "llama"),
        ("llama", true) => ("MixtralForCausalLM", "mixtral"),
        ("qwen2", _) => ("Qwen2ForCausalLM", "qwen2"),
        ("qwen3", _) => ("Qwen3ForCausalLM", "qwen3"),
        ("qwen3moe", _) => ("Qwen3MoeForCausalLM", "qwen3_moe"),
        (other, _) => {
            return Err(err(
                path,
                format!("architecture `{other}` (kiln reads llama, qwen2, qwen3, qwen3moe)"),
            ));
        }
    };
    let vocab = match u("vocab_size") {
        Some(v) => v,
        None => file
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| err(path, "no vocabulary size".into()))?,
    };
    let mut c = json!({
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": need("embedding_length")?,
        "num_hidden_layers": need("block_count")?,
        "num_attention_heads": need("attention.head_count")?,
        "num_key_value_heads": u("attention.head_count_kv").unwrap_or(need("attention.head_count")?),
        "vocab_size": vocab,
        "tie_word_embeddings": file.tensor("output.weight").is_none(),
        // Not in the metadata: every architecture this reader maps uses SiLU.
        "hidden_act": "silu",
    });
    let Json::Object(m) = &mut c else {
        unreachable!("a JSON object literal")
    };
    let mut put = |k: &str, v: Option<Json>| {
        if let Some(v) = v {
            m.insert(k.to_string(), v);
        }
    };
    put(
        "intermediate_size",
        u("feed_forward_length").map(Json::from),
    );
    put(
        "max_position_embeddings",
        u("context_length").map(Json::from),
    );
    put("rope_theta", f("rope.freq_base").map(Json::from));
    put(
        "rms_norm_eps",
        f("attention.layer_norm_rms_epsilon").map(Json::from),
    );
    put("head_dim", u("attention.key_length").map(Json::from));
    if experts > 0 {
        let key = if model_type == "mixtral" {
            "num_local_experts"
        } else {
            "num_experts"
        };
        put(key, Some(Json::from(experts)));
        put(
            "num_experts_per_tok",
            u("expert_used_count").map(Json::from),
        );
        put(
            "moe_intermediate_size",
            u("expert_feed_forward_length").map(Json::from),
        );
    }
    if model_type == "qwen2" {
        put("attention_bias", Some(Json::Bool(true)));
    }
    Ok(m.clone())
}
