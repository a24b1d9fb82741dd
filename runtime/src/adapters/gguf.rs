//! llama.cpp's LoRA adapter file (what `convert_lora_to_gguf.py` writes from a PEFT adapter
//! and `llama-cli --lora` / `llama-server --lora` load): a GGUF with `general.type` `adapter`,
//! `adapter.type` `lora`, `adapter.lora.alpha`, and per adapted Linear two F32 tensors named
//! after the base tensor, `<gguf name>.lora_a` (dims `[in, r]`: PEFT's `A [r, in]` as stored)
//! and `<gguf name>.lora_b` (`[r, out]`: `B [out, r]`), with B's rows of Llama's Q and K in
//! llama.cpp's order (`LlamaModel.permute`, as the base weights). docs/FORMATS.md §7.3.

use crate::formats::gguf::container::{GgufWriter, Value};
use crate::formats::gguf::mix::F32;
use crate::formats::gguf::{Names, Target, permute_rows};
use crate::model::ModelError;
use crate::model::lora::Adapters;
use candle_core::DType;
use serde_json::{Map, Value as Json};
use std::path::Path;

/// The title `convert_lora_to_gguf.py` gives an adapter folder named `id` (gguf-py's
/// `Metadata.id_to_title`): words split at spaces and dashes, each all-lowercase word that is
/// not a version (`v1.2`) or number capitalised.
pub fn id_to_title(id: &str) -> String {
    let version_or_number = |w: &str| {
        w.starts_with(|c: char| c.is_ascii_digit())
            || w.strip_prefix('v').is_some_and(|r| {
                !r.is_empty()
                    && r.split('.')
                        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
            })
    };
    id.trim()
        .replace('-', " ")
        .split_whitespace()
        .map(|w| {
            let lower = w.chars().any(char::is_lowercase) && !w.chars().any(char::is_uppercase);
            if lower && !version_or_number(w) {
                // Python's str.title(): a letter after a non-letter starts a word.
                let mut out = String::with_capacity(w.len());
                let mut after_letter = false;
                for c in w.chars() {
                    if after_letter {
                        out.extend(c.to_lowercase());
                    } else {
                        out.extend(c.to_uppercase());
                    }
                    after_letter = c.is_alphabetic();
                }
                out
            } else {
                w.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl Adapters {
    /// Writes llama.cpp's LoRA adapter to `path` for a base whose `config.json` (or the one a
    /// GGUF base's metadata rebuilds) is `config`, titled `name` (`general.name`). The
    /// modules come in the order of PEFT's file (by name), as the converter writes them.
    /// llama.cpp scales by `alpha / r`: kiln writes `alpha` = its scale × r, which is PEFT's
    /// `lora_alpha` itself except under rsLoRA (which the converter does not carry).
    pub fn save_gguf(
        &self,
        path: &Path,
        config: &Map<String, Json>,
        name: &str,
    ) -> Result<(), ModelError> {
        let bad = |m: String| ModelError::file(path, m);
        let architecture = config
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Json::as_str)
            .unwrap_or("");
        let names = Names::for_model(architecture, config).ok_or_else(|| {
            bad(format!(
                "the base's architecture `{architecture}` has no GGUF mapping (llama.cpp's LoRA \
                 adapters are written for Llama, Mistral, Qwen2 and Qwen3 bases)"
            ))
        })?;
        let mut tensors: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
        for (module, layer) in self.layers() {
            let (gguf, permute) = match names.target(&format!("{module}.weight")) {
                Some(Target::Tensor {
                    name,
                    expert: None,
                    permute,
                }) => (name, permute),
                _ => {
                    return Err(bad(format!(
                        "the adapter on `{module}` has no place in a llama.cpp adapter (it \
                         adapts the decoder layers' attention and MLP Linears)"
                    )));
                }
            };
            let a = layer.a.as_tensor().to_dtype(DType::F32)?;
            let b = layer.b.as_tensor().to_dtype(DType::F32)?;
            let (r, inputs) = a.dims2()?;
            let (outputs, _) = b.dims2()?;
            let a: Vec<f32> = a.flatten_all()?.to_vec1()?;
            let mut b: Vec<f32> = b.flatten_all()?.to_vec1()?;
            if let Some(heads) = permute {
                b = permute_rows(&b, outputs, heads)
                    .map_err(|e| bad(format!("`{module}`: {e}")))?;
            }
            tensors.push((format!("{gguf}.lora_a"), vec![inputs as u64, r as u64], a));
            tensors.push((format!("{gguf}.lora_b"), vec![r as u64, outputs as u64], b));
        }
        let alpha = self.spec().scale() * self.spec().r as f64;
        let metadata = vec![
            (
                "general.architecture".to_string(),
                Value::String(names.arch().into()),
            ),
            ("general.type".into(), Value::String("adapter".into())),
            ("adapter.type".into(), Value::String("lora".into())),
            ("general.name".into(), Value::String(name.into())),
            ("adapter.lora.alpha".into(), Value::F32(alpha as f32)),
            ("general.quantization_version".into(), Value::U32(2)),
        ];
        let header: Vec<(String, Vec<u64>, u32)> = tensors
            .iter()
            .map(|(n, d, _)| (n.clone(), d.clone(), F32))
            .collect();
        let gguf = |e: crate::formats::gguf::container::GgufError| bad(e.to_string());
        let mut w = GgufWriter::create(path, &metadata, &header).map_err(gguf)?;
        for (n, _, data) in &tensors {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            w.write_tensor(n, &bytes).map_err(gguf)?;
        }
        w.finish().map_err(gguf)
    }
}

/// The Hugging Face config of the base at `model`: its `config.json`, or the one a GGUF file's
/// metadata rebuilds.
pub fn base_config(model: &Path) -> Result<Map<String, Json>, ModelError> {
    if let Some(file) = crate::formats::gguf::gguf_file(model) {
        return Ok(crate::formats::gguf::read::GgufModel::open(&file)?.config);
    }
    let path = model.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| ModelError::file(&path, e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| ModelError::file(&path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::id_to_title;

    #[test]
    fn folder_names_are_titled_as_gguf_py_titles_them() {
        assert_eq!(id_to_title("kiln-adapter"), "Kiln Adapter");
        assert_eq!(id_to_title("smollm2-135m-lora"), "Smollm2 135m Lora");
        assert_eq!(id_to_title("my-LoRA-v1.2"), "My LoRA v1.2");
        assert_eq!(id_to_title("out"), "Out");
    }
}
