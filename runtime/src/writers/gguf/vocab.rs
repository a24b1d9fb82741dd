//! The tokenizer embedded in a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` writes a
//! byte-level BPE tokenizer (`_set_vocab_gpt2` and gguf-py's `SpecialVocab`): from
//! `tokenizer.json` and `tokenizer_config.json`.

use crate::gguf::Value;
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;
use std::path::Path;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const UNUSED: i32 = 5;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// The pre-tokenizer table (`scripts/gguf/pre_hashes.py`).
const PRE_TABLE: &str = include_str!("../gguf_pre.json");

/// The tokenizer metadata, and the warnings to print (a default substituted is said).
pub struct Vocab {
    /// `tokenizer.*` keys, in the order written.
    pub metadata: Vec<(String, Value)>,
    /// What was substituted or not found.
    pub warnings: Vec<String>,
}

fn read_json(path: &Path) -> Result<Map<String, Json>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    match serde_json::from_str(&text) {
        Ok(Json::Object(m)) => Ok(m),
        Ok(_) => Err(format!("{}: not a JSON object", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// A special-token field of `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_content(v: &Json) -> Option<&str> {
    match v {
        Json::String(s) => Some(s),
        Json::Object(o) => o.get("content").and_then(Json::as_str),
        _ => None,
    }
}

/// `does_token_look_special` of llama.cpp's converter.
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// Reads the tokenizer of `model` for a vocabulary of `vocab_size` ids.
pub fn read(model: &Path, vocab_size: usize) -> Result<Vocab, String> {
    let tok_path = model.join("tokenizer.json");
    let tok = read_json(&tok_path)?;
    let cfg_path = model.join("tokenizer_config.json");
    let cfg = if cfg_path.is_file() {
        read_json(&cfg_path)?
    } else {
        Map::new()
    };
    let bpe = tok
        .get("model")
        .and_then(Json::as_object)
        .ok_or_else(|| format!("{}: no `model` object", tok_path.display()))?;
    let kind = bpe.get("type").and_then(Json::as_str).unwrap_or("");
    if kind != "BPE" {
        return Err(format!(
            "{}: model type `{kind}`; the GGUF writer embeds byte-level BPE tokenizers \
             (Llama 3, Qwen2/3); SentencePiece (`tokenizer.model`) and WordPiece are not built",
            tok_path.display()
        ));
    }
    if bpe.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(format!(
            "{}: a BPE with `byte_fallback` is a SentencePiece vocabulary (Llama 2, Mistral), \
             which llama.cpp stores as `llama` with scores; the GGUF writer does not build \
             that yet",
            tok_path.display()
        ));
    }
    let mut by_id: BTreeMap<usize, String> = BTreeMap::new();
    for (t, id) in bpe
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| format!("{}: model.vocab is not an object", tok_path.display()))?
    {
        let id = id.as_u64().ok_or_else(|| {
            format!(
                "{}: vocab entry `{t}` has no integer id",
                tok_path.display()
            )
        })?;
        by_id.insert(id as usize, t.clone());
    }
    // Added tokens: id → (content, special).
    let mut added: BTreeMap<usize, (String, bool)> = BTreeMap::new();
    for a in tok
        .get("added_tokens")
        .and_then(Json::as_array)
        .map_or(&[][..], Vec::as_slice)
    {
        let (Some(id), Some(content)) = (
            a.get("id").and_then(Json::as_u64),
            a.get("content").and_then(Json::as_str),
        ) else {
            return Err(format!(
                "{}: an added token lacks `id` or `content`",
                tok_path.display()
            ));
        };
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        by_id.insert(id as usize, content.to_string());
        added.insert(id as usize, (content.to_string(), special));
    }
    if let Some((&max, t)) = by_id.iter().next_back()
        && max >= vocab_size
    {
        return Err(format!(
            "{}: token `{t}` has id {max}, beyond config.json's vocab_size {vocab_size}",
            tok_path.display()
        ));
    }
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    for i in 0..vocab_size {
        match (by_id.get(&i), added.get(&i)) {
            (None, _) => {
                tokens.push(Value::String(format!("[PAD{i}]")));
                types.push(Value::I32(UNUSED));
            }
            (Some(_), Some((content, special))) => {
                if *special || looks_special(content) {
                    tokens.push(Value::String(content.clone()));
                    types.push(Value::I32(CONTROL));
                } else {
                    tokens.push(Value::String(content.replace('\u{2581}', " ")));
                    types.push(Value::I32(USER_DEFINED));
                }
            }
            (Some(t), None) => {
                tokens.push(Value::String(t.clone()));
                types.push(Value::I32(NORMAL));
            }
        }
    }
    let merges: Vec<Value> = bpe
        .get("merges")
        .and_then(Json::as_array)
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => Ok(Value::String(format!("{a} {b}"))),
                _ => Err(()),
            },
            _ => Err(()),
        })
        .collect::<Result<_, ()>>()
        .map_err(|()| {
            format!(
                "{}: a merge is neither \"a b\" nor [a, b]",
                tok_path.display()
            )
        })?;

    let mut warnings = Vec::new();
    let pre = match pre_tokenizer(&tok_path) {
        Ok(Some(name)) => name,
        Ok(None) => {
            warnings.push(format!(
                "{}: its pre-tokenizer is none llama.cpp knows by hash; `tokenizer.ggml.pre` \
                 is `default` (llama.cpp's GPT-2 split)",
                tok_path.display()
            ));
            "default".to_string()
        }
        Err(e) => {
            warnings.push(format!("{e}; `tokenizer.ggml.pre` is `default`"));
            "default".to_string()
        }
    };
    let mut metadata = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre)),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
    ];
    // Written even when empty (a byte-level vocabulary without merges): llama.cpp refuses a
    // BPE vocabulary without the key.
    metadata.push(("tokenizer.ggml.merges".into(), Value::Array(merges)));
    // Special tokens, by content through the token list (gguf-py's SpecialVocab).
    let id_of = |content: &str| by_id.iter().find(|(_, t)| *t == content).map(|(&i, _)| i);
    for (key, field) in [
        ("bos", "bos_token"),
        ("eos", "eos_token"),
        ("unknown", "unk_token"),
        ("seperator", "sep_token"),
        ("padding", "pad_token"),
    ] {
        if let Some(content) = cfg.get(field).and_then(token_content) {
            match id_of(content) {
                Some(id) => metadata.push((
                    format!("tokenizer.ggml.{key}_token_id"),
                    Value::U32(id as u32),
                )),
                None => warnings.push(format!(
                    "{}: `{field}` `{content}` is no token of tokenizer.json; not embedded",
                    cfg_path.display()
                )),
            }
        }
    }
    let (add_bos, add_eos) = template_adds(&tok, &cfg);
    for (key, v) in [("add_bos_token", add_bos), ("add_eos_token", add_eos)] {
        if let Some(v) = cfg.get(key).and_then(Json::as_bool).or(v) {
            metadata.push((format!("tokenizer.ggml.{key}"), Value::Bool(v)));
        }
    }
    let template = match cfg.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        _ => std::fs::read_to_string(model.join("chat_template.jinja")).ok(),
    };
    if let Some(t) = template {
        metadata.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    Ok(Vocab { metadata, warnings })
}

/// Whether the post-processor's single-sequence template adds BOS / EOS (gguf-py reads
/// `TemplateProcessing` this way when tokenizer_config.json does not say).
fn template_adds(tok: &Map<String, Json>, cfg: &Map<String, Json>) -> (Option<bool>, Option<bool>) {
    let Some(single) = tok
        .get("post_processor")
        .filter(|p| p.get("type").and_then(Json::as_str) == Some("TemplateProcessing"))
        .and_then(|p| p.get("single"))
        .and_then(Json::as_array)
    else {
        return (None, None);
    };
    let special = |i: usize| {
        single
            .get(i)
            .and_then(|s| s.get("SpecialToken"))
            .and_then(|s| s.get("id"))
            .and_then(Json::as_str)
    };
    let bos = cfg.get("bos_token").and_then(token_content);
    let eos = cfg.get("eos_token").and_then(token_content);
    let first = special(0);
    let last = single.len().checked_sub(1).and_then(special);
    (
        Some(first.is_some() && first == bos),
        Some(single.len() > 1 && last.is_some() && last == eos),
    )
}

/// llama.cpp's name for the tokenizer's pre-tokenizer: the SHA-256 of the Python repr of the
/// token ids of a fixed text, looked up in llama.cpp's table. `Ok(None)`: not in the table.
#[cfg(feature = "exec")]
fn pre_tokenizer(tok_path: &Path) -> Result<Option<String>, String> {
    use sha2::Digest;
    let table: Json = serde_json::from_str(PRE_TABLE).map_err(|e| format!("gguf_pre.json: {e}"))?;
    let text = table["chktxt"].as_str().unwrap_or_default();
    let tokenizer = tokenizers::Tokenizer::from_file(tok_path)
        .map_err(|e| format!("{}: {e}", tok_path.display()))?;
    let ids = tokenizer
        .encode(text, true)
        .map_err(|e| format!("{}: {e}", tok_path.display()))?;
    let repr = format!(
        "[{}]",
        ids.get_ids()
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    let hash: String = sha2::Sha256::digest(repr.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(table["hashes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|h| h["hash"].as_str() == Some(hash.as_str()))
        .and_then(|h| h["pre"].as_str())
        .map(str::to_string))
}

#[cfg(not(feature = "exec"))]
fn pre_tokenizer(_: &Path) -> Result<Option<String>, String> {
    let _ = PRE_TABLE;
    Err("kiln was built without feature `exec` (no tokenizer), so the pre-tokenizer was not identified".into())
}
