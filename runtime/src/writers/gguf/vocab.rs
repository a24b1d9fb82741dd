//! The tokenizer embedded in a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` writes it:
//! a byte-level BPE tokenizer (`_set_vocab_gpt2` and gguf-py's `SpecialVocab`) from
//! `tokenizer.json` and `tokenizer_config.json`, or — for the llama architecture — a
//! SentencePiece `tokenizer.model` (`_set_vocab_sentencepiece`).

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

/// Reads the tokenizer of `model` for a vocabulary of `vocab_size` ids. For the llama
/// architecture (`sentencepiece_first`) a `tokenizer.model` is read first, as the converter's
/// `LlamaModel.set_vocab` does; otherwise `tokenizer.json` as byte-level BPE.
pub fn read(model: &Path, vocab_size: usize, sentencepiece_first: bool) -> Result<Vocab, String> {
    if sentencepiece_first && model.join("tokenizer.model").is_file() {
        return read_sentencepiece(model, vocab_size);
    }
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
             (Llama 3, Qwen2/3) and, for the llama architecture, SentencePiece \
             (`tokenizer.model`); WordPiece is not built",
            tok_path.display()
        ));
    }
    if bpe.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(format!(
            "{}: a BPE with `byte_fallback` is a SentencePiece vocabulary (Llama 2, Mistral), \
             which llama.cpp stores as `llama` with scores: give the model's \
             `tokenizer.model` (the GGUF writer reads SentencePiece from it, for the llama \
             architecture)",
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

/// SentencePiece piece types (`sentencepiece_model.proto`) and llama.cpp's token types.
const UNKNOWN: i32 = 2;
const BYTE: i32 = 6;

/// One piece of a SentencePiece model: its text, score and type.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: i32,
}

/// A protobuf varint at `*at`.
fn varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or("a varint runs past the end")?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a varint longer than 10 bytes".into())
}

/// One protobuf field: its number, wire type and payload (a varint's bytes, a fixed value's
/// bytes, or a length-delimited field's contents).
type Field<'a> = (u64, u64, &'a [u8]);

/// The fields of one protobuf message.
fn fields(b: &[u8]) -> Result<Vec<Field<'_>>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    let take = |at: &mut usize, n: usize| -> Result<&[u8], String> {
        let p = at
            .checked_add(n)
            .and_then(|end| b.get(*at..end))
            .ok_or("a field runs past the end")?;
        *at += n;
        Ok(p)
    };
    while at < b.len() {
        let key = varint(b, &mut at)?;
        let (field, wire) = (key >> 3, key & 7);
        let payload = match wire {
            0 => {
                let start = at;
                varint(b, &mut at)?;
                &b[start..at]
            }
            1 => take(&mut at, 8)?,
            5 => take(&mut at, 4)?,
            2 => {
                let n = usize::try_from(varint(b, &mut at)?).map_err(|_| "a huge length")?;
                take(&mut at, n)?
            }
            w => return Err(format!("wire type {w}")),
        };
        out.push((field, wire, payload));
    }
    Ok(out)
}

/// The pieces of a SentencePiece `tokenizer.model` (`ModelProto.pieces`, field 1: `piece` 1,
/// `score` 2, `type` 3 defaulting to NORMAL).
pub(crate) fn sentencepiece_pieces(bytes: &[u8]) -> Result<Vec<Piece>, String> {
    let mut out = Vec::new();
    for (field, wire, payload) in fields(bytes)? {
        if field != 1 || wire != 2 {
            continue;
        }
        let mut p = Piece {
            text: String::new(),
            score: 0.0,
            kind: NORMAL,
        };
        for (f, w, v) in fields(payload)? {
            match (f, w) {
                (1, 2) => {
                    p.text = String::from_utf8(v.to_vec())
                        .map_err(|_| format!("piece {} is not UTF-8", out.len()))?
                }
                (2, 5) => p.score = f32::from_le_bytes([v[0], v[1], v[2], v[3]]),
                (3, 0) => p.kind = varint(v, &mut 0)? as i32,
                _ => {}
            }
        }
        out.push(p);
    }
    Ok(out)
}

/// A SentencePiece vocabulary, as `_set_vocab_sentencepiece` writes it: `tokenizer.ggml.model`
/// `llama`, tokens with scores and types, then gguf-py's `SpecialVocab` (no merges).
fn read_sentencepiece(model: &Path, vocab_size: usize) -> Result<Vocab, String> {
    let path = model.join("tokenizer.model");
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let pieces = sentencepiece_pieces(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut warnings = Vec::new();
    let mut tokens: Vec<String> = (0..vocab_size).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-10000.0f32; vocab_size];
    let mut types = vec![UNUSED; vocab_size];
    if pieces.len() > vocab_size {
        warnings.push(format!(
            "{}: {} pieces, config.json's vocab_size is {vocab_size}: pieces from id {vocab_size} \
             are not embedded",
            path.display(),
            pieces.len()
        ));
    }
    for (i, p) in pieces.iter().enumerate().take(vocab_size) {
        tokens[i] = p.text.clone();
        scores[i] = p.score;
        types[i] = match p.kind {
            UNKNOWN | CONTROL | UNUSED | BYTE => p.kind,
            _ => NORMAL,
        };
    }
    let added_path = model.join("added_tokens.json");
    if added_path.is_file() {
        for (content, id) in read_json(&added_path)? {
            match id.as_u64().map(|i| i as usize) {
                Some(id) if id < vocab_size => {
                    tokens[id] = content;
                    scores[id] = -1000.0;
                    types[id] = USER_DEFINED;
                }
                _ => warnings.push(format!(
                    "{}: `{content}` has id {id}, outside the vocabulary; not embedded",
                    added_path.display()
                )),
            }
        }
    }
    let cfg_path = model.join("tokenizer_config.json");
    let cfg = if cfg_path.is_file() {
        read_json(&cfg_path)?
    } else {
        Map::new()
    };
    if let Some(decoder) = cfg.get("added_tokens_decoder").and_then(Json::as_object) {
        for (id, data) in decoder {
            let (Ok(id), Some(content)) = (
                id.parse::<usize>(),
                data.get("content").and_then(Json::as_str),
            ) else {
                return Err(format!(
                    "{}: added_tokens_decoder entry `{id}` lacks a numeric id or `content`",
                    cfg_path.display()
                ));
            };
            if id >= vocab_size {
                warnings.push(format!(
                    "{}: added token {id} is outside the vocabulary; not embedded",
                    cfg_path.display()
                ));
                continue;
            }
            let special = data.get("special").and_then(Json::as_bool) == Some(true);
            if special || looks_special(content) {
                types[id] = CONTROL;
                tokens[id] = content.to_string();
            } else {
                types[id] = USER_DEFINED;
                tokens[id] = content.replace('\u{2581}', " ");
            }
            scores[id] = -1000.0;
        }
    }
    let tok_path = model.join("tokenizer.json");
    let tok = if tok_path.is_file() {
        Some(read_json(&tok_path)?)
    } else {
        None
    };
    let mut metadata = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("llama".into()),
        ),
        (
            "tokenizer.ggml.pre".to_string(),
            Value::String("default".into()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".to_string(),
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
    ];
    metadata.extend(special_vocab(model, tok.as_ref(), &cfg, vocab_size)?);
    Ok(Vocab { metadata, warnings })
}

/// gguf-py's `SpecialVocab` (without merges): each special token's id — its content
/// (tokenizer_config.json's `<typ>_token`) among tokenizer.json's added tokens, else
/// config.json's `<typ>_token_id` — `add_<typ>_token` flags (the post-processor's template,
/// then tokenizer_config.json) and the chat template.
fn special_vocab(
    model: &Path,
    tok: Option<&Map<String, Json>>,
    cfg: &Map<String, Json>,
    n_vocab: usize,
) -> Result<Vec<(String, Value)>, String> {
    const TYPES: [(&str, &str); 7] = [
        ("bos", "bos"),
        ("eos", "eos"),
        ("unk", "unknown"),
        ("sep", "seperator"),
        ("pad", "padding"),
        ("cls", "cls"),
        ("mask", "mask"),
    ];
    let added: Vec<(&str, u64)> = tok
        .and_then(|t| t.get("added_tokens"))
        .and_then(Json::as_array)
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .filter_map(|a| Some((a.get("content")?.as_str()?, a.get("id")?.as_u64()?)))
        .collect();
    let config_path = model.join("config.json");
    let config = if config_path.is_file() {
        read_json(&config_path)?
    } else {
        Map::new()
    };
    let mut out = Vec::new();
    for (typ, key) in TYPES {
        let from_tokenizer = cfg
            .get(&format!("{typ}_token"))
            .and_then(token_content)
            .and_then(|c| added.iter().find(|(a, _)| *a == c).map(|(_, id)| *id));
        let id = from_tokenizer.or_else(|| {
            config
                .get(&format!("{typ}_token_id"))
                .and_then(Json::as_u64)
        });
        if let Some(id) = id.filter(|&i| (i as usize) < n_vocab) {
            out.push((
                format!("tokenizer.ggml.{key}_token_id"),
                Value::U32(id as u32),
            ));
        }
    }
    let (bos, eos) = match tok {
        Some(t) => template_adds(t, cfg),
        None => (None, None),
    };
    for (typ, from_template) in [("bos", bos), ("eos", eos)] {
        let key = format!("add_{typ}_token");
        if let Some(v) = from_template.or_else(|| cfg.get(&key).and_then(Json::as_bool)) {
            out.push((format!("tokenizer.ggml.{key}"), Value::Bool(v)));
        }
    }
    let template = match cfg.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        _ => std::fs::read_to_string(model.join("chat_template.jinja")).ok(),
    };
    if let Some(t) = template {
        out.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sentencepiece_pieces_are_read_from_the_protobuf() {
        // ModelProto { pieces: [{piece: "<unk>", score: 0, type: UNKNOWN}, {piece: "▁a",
        // score: -1.5}] , trainer_spec: {...} } written by hand.
        let piece = |text: &str, score: Option<f32>, kind: Option<u8>| {
            let mut m = vec![0x0a, text.len() as u8];
            m.extend(text.as_bytes());
            if let Some(s) = score {
                m.push(0x15);
                m.extend(s.to_le_bytes());
            }
            if let Some(k) = kind {
                m.extend([0x18, k]);
            }
            let mut f = vec![0x0a, m.len() as u8];
            f.extend(m);
            f
        };
        let mut proto = piece("<unk>", Some(0.0), Some(2));
        proto.extend(piece("\u{2581}a", Some(-1.5), None));
        proto.extend([0x12, 0x02, 0x08, 0x01]); // trainer_spec { model_type: 1 }: skipped
        let p = sentencepiece_pieces(&proto).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].text.as_str(), p[0].score, p[0].kind),
            ("<unk>", 0.0, UNKNOWN)
        );
        assert_eq!(
            (p[1].text.as_str(), p[1].score, p[1].kind),
            ("\u{2581}a", -1.5, NORMAL)
        );
        // A length past the end is an error, not a panic.
        assert!(sentencepiece_pieces(&[0x0a, 0x7f, 0x00]).is_err());
        assert!(sentencepiece_pieces(&[0x0a]).is_err());
    }
}
