//! The tokenizer embedded in a GGUF file, as llama.cpp's `convert_hf_to_gguf.py` writes it:
//! a byte-level BPE tokenizer (`_set_vocab_gpt2` and gguf-py's `SpecialVocab`) from
//! `tokenizer.json` and `tokenizer_config.json`, or — for the llama architecture — a
//! SentencePiece `tokenizer.model` (`_set_vocab_sentencepiece`).

use crate::formats::gguf::container::Value;
use serde_json::{Map, Value as Json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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

/// The keys of a `llama` (SentencePiece-style) vocabulary: model, `default` pre-tokenizer,
/// tokens, scores, token types.
fn llama_vocab(tokens: Vec<String>, scores: Vec<f32>, types: Vec<i32>) -> Vec<(String, Value)> {
    vec![
        ("tokenizer.ggml.model".into(), Value::String("llama".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        ),
        (
            "tokenizer.ggml.scores".into(),
            Value::Array(scores.into_iter().map(Value::F32).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
    ]
}

/// `model.vocab` of a BPE tokenizer.json: id → token.
fn bpe_vocab(bpe: &Map<String, Json>, tok_path: &Path) -> Result<BTreeMap<usize, String>, String> {
    let mut by_id = BTreeMap::new();
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
    Ok(by_id)
}

/// tokenizer.json's `added_tokens`: id → (content, special).
fn added_tokens(
    tok: &Map<String, Json>,
    tok_path: &Path,
) -> Result<BTreeMap<usize, (String, bool)>, String> {
    let mut added = BTreeMap::new();
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
        added.insert(id as usize, (content.to_string(), special));
    }
    Ok(added)
}

/// A JSON object file of the model folder, or an empty object when the file is absent.
fn read_json_if_present(path: &Path) -> Result<Map<String, Json>, String> {
    if path.is_file() {
        read_json(path)
    } else {
        Ok(Map::new())
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
///
/// Long on purpose: the converter's three vocabulary paths (SentencePiece, byte-level BPE,
/// byte-fallback) and their shared keys, in the converter's order.
pub fn read(model: &Path, vocab_size: usize, sentencepiece_first: bool) -> Result<Vocab, String> {
    if sentencepiece_first && model.join("tokenizer.model").is_file() {
        return read_sentencepiece(model, vocab_size);
    }
    let tok_path = model.join("tokenizer.json");
    let tok = read_json(&tok_path)?;
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
        // The converter's `LlamaHfVocab`: a byte-fallback BPE with a `Sequence` decoder.
        let sequence_decoder = tok
            .get("decoder")
            .and_then(|d| d.get("type"))
            .and_then(Json::as_str)
            == Some("Sequence");
        if sentencepiece_first && sequence_decoder {
            return read_llama_hf(model, &tok_path, &tok, bpe, vocab_size);
        }
        return Err(format!(
            "{}: a BPE with `byte_fallback` is a SentencePiece-style vocabulary (Llama 2, \
             Mistral), which llama.cpp stores as `llama`: kiln embeds it for the llama \
             architecture, from `tokenizer.model` or from a tokenizer.json whose decoder is a \
             `Sequence` (llama.cpp's converter does the same)",
            tok_path.display()
        ));
    }
    let mut by_id = bpe_vocab(bpe, &tok_path)?;
    // Added tokens: id → (content, special).
    let added = added_tokens(&tok, &tok_path)?;
    for (&id, (content, _)) in &added {
        by_id.insert(id, content.clone());
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
    let merges = merges(model, &tok_path, bpe)?;
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
    metadata.extend(special_vocab(model, Some(&tok), vocab_size, &mut warnings)?);
    Ok(Vocab { metadata, warnings })
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
    let cfg = read_json_if_present(&cfg_path)?;
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
    let mut metadata = llama_vocab(tokens, scores, types);
    metadata.extend(special_vocab(
        model,
        tok.as_ref(),
        vocab_size,
        &mut warnings,
    )?);
    Ok(Vocab { metadata, warnings })
}

/// `tokenizer.ggml.merges` as gguf-py's `SpecialVocab(load_merges=True)` reads them: the
/// model's merges (`"a b"` strings, or `[a, b]` pairs whose spaces become U+0120), else
/// `merges.txt`.
fn merges(model: &Path, tok_path: &Path, bpe: &Map<String, Json>) -> Result<Vec<Value>, String> {
    let bad = || {
        format!(
            "{}: a merge is neither \"a b\" nor [a, b]",
            tok_path.display()
        )
    };
    let list = bpe.get("merges").and_then(Json::as_array);
    if let Some(list) = list.filter(|l| !l.is_empty()) {
        return list
            .iter()
            .map(|m| match m {
                Json::String(s) => Ok(Value::String(s.clone())),
                Json::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                    (Some(a), Some(b)) => {
                        let enc = |s: &str| s.replace(' ', "\u{120}");
                        Ok(Value::String(format!("{} {}", enc(a), enc(b))))
                    }
                    _ => Err(bad()),
                },
                _ => Err(bad()),
            })
            .collect();
    }
    let path = model.join("merges.txt");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(Vec::new());
    };
    let mut lines = text.lines().peekable();
    if lines.peek().is_some_and(|l| l.trim().starts_with('#')) {
        lines.next();
    }
    Ok(lines
        .filter_map(|l| {
            let parts: Vec<&str> = l.split_whitespace().collect();
            (parts.len() == 2).then(|| Value::String(format!("{} {}", parts[0], parts[1])))
        })
        .collect())
}

/// The converter's `_set_vocab_llama_hf` (gguf-py's `LlamaHfVocab`): a byte-fallback BPE
/// `tokenizer.json` without `tokenizer.model`, stored as a `llama` vocabulary. Base tokens in
/// id order (`<0xHH>` bytes, the tokenizer's special tokens as control, the rest normal),
/// then the added tokens past the base vocabulary; every score -1000.
///
/// Long on purpose: the converter's `_set_vocab_llama_hf`, line for line.
fn read_llama_hf(
    model: &Path,
    tok_path: &Path,
    tok: &Map<String, Json>,
    bpe: &Map<String, Json>,
    vocab_size: usize,
) -> Result<Vocab, String> {
    let mut warnings = Vec::new();
    let vocab = bpe_vocab(bpe, tok_path)?;
    let base = vocab.len();
    if vocab.keys().next_back().is_some_and(|&m| m + 1 != base) {
        return Err(format!(
            "{}: model.vocab's ids are not 0..{base}",
            tok_path.display()
        ));
    }
    // The added tokens (`get_added_vocab`), by id: those at or past the base vocabulary are
    // appended; the others replace the base token of their id.
    let added: BTreeMap<usize, String> = added_tokens(tok, tok_path)?
        .into_iter()
        .map(|(id, (content, _))| (id, content))
        .collect();
    let mut by_id = vocab;
    for (&id, content) in added.range(..base) {
        by_id.insert(id, content.clone());
    }
    // The tokenizer's special tokens (`all_special_ids`): tokenizer_config.json's named ones and
    // its additional / extra special tokens.
    let cfg_path = model.join("tokenizer_config.json");
    let cfg = read_json_if_present(&cfg_path)?;
    let mut special_contents: Vec<String> = [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ]
    .iter()
    .filter_map(|k| cfg.get(*k).and_then(token_content).map(str::to_string))
    .collect();
    for k in ["additional_special_tokens", "extra_special_tokens"] {
        if let Some(list) = cfg.get(k).and_then(Json::as_array) {
            special_contents.extend(list.iter().filter_map(token_content).map(str::to_string));
        }
    }
    let id_of = |c: &str| {
        added
            .iter()
            .chain(by_id.iter())
            .find(|(_, t)| *t == c)
            .map(|(&i, _)| i)
    };
    let special_ids: std::collections::BTreeSet<usize> =
        special_contents.iter().filter_map(|c| id_of(c)).collect();
    let is_byte = |t: &str| {
        t.len() == 6
            && t.starts_with("<0x")
            && t.ends_with('>')
            && t[3..5].bytes().all(|b| b.is_ascii_hexdigit())
    };
    let mut tokens = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    for (&id, t) in &by_id {
        tokens.push(t.clone());
        types.push(if is_byte(t) {
            BYTE
        } else if special_ids.contains(&id) {
            CONTROL
        } else {
            NORMAL
        });
    }
    for (&id, t) in added.range(base..) {
        if id != tokens.len() {
            return Err(format!(
                "{}: added token `{t}` has id {id}; the ids past the base vocabulary must \
                 follow it without gaps (next is {})",
                tok_path.display(),
                tokens.len()
            ));
        }
        tokens.push(t.clone());
        types.push(if special_contents.contains(t) {
            CONTROL
        } else {
            USER_DEFINED
        });
    }
    if tokens.len() > vocab_size {
        return Err(format!(
            "{}: {} tokens, beyond config.json's vocab_size {vocab_size}",
            tok_path.display(),
            tokens.len()
        ));
    }
    if tokens.len() < vocab_size {
        // The converter writes only the tokenizer's tokens, and llama.cpp then refuses the
        // file (its embedding has vocab_size rows); kiln pads as the BPE path does.
        warnings.push(format!(
            "{}: {} tokens for config.json's vocab_size {vocab_size}: ids {}.. are written as \
             unused `[PADi]` tokens",
            tok_path.display(),
            tokens.len(),
            tokens.len()
        ));
        for i in tokens.len()..vocab_size {
            tokens.push(format!("[PAD{i}]"));
            types.push(UNUSED);
        }
    }
    let n = tokens.len();
    let mut metadata = llama_vocab(tokens, vec![-1000.0; n], types);
    metadata.extend(special_vocab(model, Some(tok), n, &mut warnings)?);
    Ok(Vocab { metadata, warnings })
}

/// Python's truthiness of a JSON value (`None`, `""`, `[]`, `{}`, `0`, `false` are false).
fn truthy(v: &Json) -> bool {
    match v {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64() != Some(0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// A template entry's special token id (`{"SpecialToken": {"id": ...}}`), as JSON.
fn template_special(entry: Option<&Json>) -> Json {
    entry
        .and_then(|e| e.get("SpecialToken"))
        .and_then(|s| s.get("id"))
        .cloned()
        .unwrap_or(Json::Null)
}

/// gguf-py 0.19's `SpecialVocab` (merges are read by the caller), line for line:
/// - tokenizer.json's post-processor: `RobertaProcessing` adds BOS, EOS and SEP;
///   `TemplateProcessing`'s single template sets `add_bos_token` / `add_eos_token` (a trailing
///   token other than the EOS becomes the EOS, the old one the EOT), its pair template
///   `add_sep_token`;
/// - tokenizer_config.json (when present and not empty): the chat template (its own, else
///   `chat_template.jinja` with `additional_chat_templates/`, else `chat_template.json`), then
///   each `add_<typ>_token` (overriding the template's) and each `<typ>_token`'s id, looked up
///   among tokenizer.json's added tokens;
/// - config.json's `<typ>_token_id` (or `text_config`'s) for the types still unset.
///
/// Ids past `n_vocab` are skipped with a warning, a negative id is an error; of the types, only
/// those gguf-py writes (bos, eos, unk, sep, pad, mask, eot, eom; `add_` for bos, eos, sep).
fn special_vocab(
    model: &Path,
    tok: Option<&Map<String, Json>>,
    n_vocab: usize,
    warnings: &mut Vec<String>,
) -> Result<Vec<(String, Value)>, String> {
    let cfg_path = model.join("tokenizer_config.json");
    let tc = read_json_if_present(&cfg_path)?;
    let mut st = Specials {
        has_tc: !tc.is_empty(),
        tc,
        types: vec!["bos", "eos", "unk", "sep", "pad", "cls", "mask"],
        add: Vec::new(),
    };
    let added: Vec<(Json, Json)> = tok
        .and_then(|t| t.get("added_tokens"))
        .and_then(Json::as_array)
        .map_or(&[][..], Vec::as_slice)
        .iter()
        .map(|a| {
            (
                a.get("content").cloned().unwrap_or(Json::Null),
                a.get("id").cloned().unwrap_or(Json::Null),
            )
        })
        .collect();
    if let Some(tok) = tok {
        st.post_processors(tok, warnings);
    }
    // Each type's id, in the order found (tokenizer_config.json's, then config.json's).
    let mut ids = SpecialIds {
        ids: Vec::new(),
        n_vocab,
    };
    let mut template: Option<Json> = None;
    if st.has_tc {
        template = chat_template(model, &st.tc, &cfg_path, warnings)?;
        for &typ in &st.types.clone() {
            if let Some(Json::Bool(v)) = st.tc.get(&format!("add_{typ}_token")) {
                st.set_add(typ, *v);
            }
            let Some(content) = st.tc.get(&format!("{typ}_token")).and_then(token_content) else {
                continue;
            };
            if let Some((_, id)) = added.iter().find(|(c, _)| c.as_str() == Some(content)) {
                ids.set(typ, id, &model.join("tokenizer.json"), warnings)?;
            }
        }
    }
    let config_path = model.join("config.json");
    if config_path.is_file() {
        let config = read_json(&config_path)?;
        for &typ in &st.types {
            let key = format!("{typ}_token_id");
            let id = match config.get(&key) {
                Some(v) if !v.is_null() => v.clone(),
                _ => config
                    .get("text_config")
                    .and_then(|t| t.get(&key))
                    .cloned()
                    .unwrap_or(Json::Null),
            };
            ids.set(typ, &id, &config_path, warnings)?;
        }
    }
    for &typ in &st.types {
        if let Some(content) = st.tc.get(&format!("{typ}_token")).and_then(token_content)
            && typ != "cls"
            && !ids.ids.iter().any(|(t, _)| *t == typ)
        {
            warnings.push(format!(
                "{}: `{typ}_token` `{content}` is no added token of tokenizer.json and \
                 config.json has no `{typ}_token_id`; not embedded",
                cfg_path.display()
            ));
        }
    }
    Ok(special_metadata(ids.ids, st.add, template))
}

/// What [`special_vocab`] knows while it reads the tokenizer's files: tokenizer_config.json
/// (as the post-processor amends it, as gguf-py's `SpecialVocab` does), the token types to
/// look up, and each `add_<typ>_token` found.
struct Specials {
    tc: Map<String, Json>,
    has_tc: bool,
    types: Vec<&'static str>,
    add: Vec<(&'static str, bool)>,
}

impl Specials {
    /// Sets `add_<typ>_token` (the last value wins, the first position stays).
    fn set_add(&mut self, typ: &'static str, v: bool) {
        match self.add.iter_mut().find(|(t, _)| *t == typ) {
            Some(e) => e.1 = v,
            None => self.add.push((typ, v)),
        }
    }

    /// tokenizer.json's post-processor(s): what each says of BOS, EOS, SEP and CLS.
    fn post_processors(&mut self, tok: &Map<String, Json>, warnings: &mut Vec<String>) {
        let get = |tc: &Map<String, Json>, k: &str| tc.get(k).cloned().unwrap_or(Json::Null);
        let mut t = SpecialTokens {
            bos: get(&self.tc, "bos_token"),
            cls: get(&self.tc, "cls_token"),
            eos: get(&self.tc, "eos_token"),
            sep: get(&self.tc, "sep_token"),
        };
        if !truthy(&t.bos) && truthy(&t.cls) && self.has_tc {
            t.bos = t.cls.clone();
            self.tc.insert("bos_token".into(), t.bos.clone());
        }
        if !truthy(&t.eos) && truthy(&t.sep) && self.has_tc {
            t.eos = t.sep.clone();
            self.tc.insert("eos_token".into(), t.eos.clone());
        }
        let post = tok.get("post_processor").filter(|p| truthy(p));
        let processors: Vec<&Json> = match post {
            Some(p) => match p.get("processors").and_then(Json::as_array) {
                Some(list) => list.iter().collect(),
                None => vec![p],
            },
            None => Vec::new(),
        };
        for processor in processors {
            match processor.get("type").and_then(Json::as_str) {
                Some("RobertaProcessing") => self.roberta(processor, &mut t),
                Some("TemplateProcessing") => self.template_processing(processor, &mut t, warnings),
                _ => {}
            }
        }
    }

    /// `RobertaProcessing`: BOS, EOS and SEP are added; its `cls` / `sep` fill the missing ones.
    fn roberta(&mut self, processor: &Json, t: &mut SpecialTokens) {
        for typ in ["bos", "eos", "sep"] {
            self.set_add(typ, true);
        }
        let first = |key: &str, default: &Json| match processor.get(key) {
            Some(Json::Array(a)) => a.first().cloned().unwrap_or(Json::Null),
            Some(_) => Json::Null,
            None => default.clone(),
        };
        if !truthy(&t.cls) && self.has_tc {
            t.cls = first("cls", &t.bos);
            self.tc.insert("cls_token".into(), t.cls.clone());
        }
        if !truthy(&t.sep) && self.has_tc {
            t.sep = first("sep", &t.eos);
            self.tc.insert("sep_token".into(), t.sep.clone());
        }
    }

    /// `TemplateProcessing`: the single template's first and last special tokens say whether
    /// BOS and EOS are added (a last token other than the EOS becomes the EOS, the old EOS the
    /// EOT or EOM); the pair template's middle says whether SEP is.
    fn template_processing(
        &mut self,
        processor: &Json,
        t: &mut SpecialTokens,
        warnings: &mut Vec<String>,
    ) {
        let list = |k: &str| {
            processor
                .get(k)
                .and_then(Json::as_array)
                .cloned()
                .unwrap_or_default()
        };
        let (single, pair) = (list("single"), list("pair"));
        let (mut special_first, mut special_last) = (Json::Null, Json::Null);
        if single.len() > 1 {
            special_first = template_special(single.first());
            if truthy(&special_first) {
                if !self.has_tc {
                    t.bos = special_first.clone();
                }
                let known = special_first == t.bos || special_first == t.cls;
                self.set_add("bos", known);
                if !known {
                    warnings.push(format!(
                        "tokenizer.json: unknown leading special token {special_first} \
                         in TemplateProcessing<single>"
                    ));
                }
            }
            special_last = template_special(single.last());
            if truthy(&special_last) {
                if !self.has_tc {
                    t.eos = special_last.clone();
                } else if special_last != t.eos {
                    if !self.types.contains(&"eot") {
                        self.types.push("eot");
                        self.tc.insert("eot_token".into(), t.eos.clone());
                    } else if !self.types.contains(&"eom") {
                        self.types.push("eom");
                        self.tc.insert("eom_token".into(), t.eos.clone());
                    }
                    t.eos = special_last.clone();
                    self.tc.insert("eos_token".into(), t.eos.clone());
                }
                self.set_add("eos", special_last == t.eos);
            }
        }
        if !pair.is_empty() {
            self.pair_template(&pair, &special_first, &special_last, t);
        }
    }

    /// The pair template `[first] A <middle> B [last]`: SEP is added when the middle holds
    /// the SEP (or EOS) token.
    fn pair_template(
        &mut self,
        pair: &[Json],
        special_first: &Json,
        special_last: &Json,
        t: &SpecialTokens,
    ) {
        let start =
            usize::from(truthy(special_first) && template_special(pair.first()) == *special_first);
        let stop = if truthy(special_last) && template_special(pair.last()) == *special_last {
            pair.len() - 1
        } else {
            pair.len()
        };
        let inner = pair.get(start..stop.max(start)).unwrap_or(&[]);
        let seq = |e: Option<&Json>| {
            e.and_then(|e| e.get("Sequence"))
                .and_then(|s| s.get("id"))
                .and_then(Json::as_str)
                .map(str::to_string)
        };
        if inner.len() > 2
            && seq(inner.first()).as_deref() == Some("A")
            && seq(inner.last()).as_deref() == Some("B")
        {
            let middle = &inner[1..inner.len() - 1];
            let mut add_sep = false;
            let entry = template_special(middle.first());
            if truthy(&entry) && (entry == t.sep || entry == t.eos) && !truthy(special_last) {
                add_sep = true;
            }
            if middle.len() == 2 {
                let entry = template_special(middle.get(1));
                if truthy(&entry) && (entry == t.sep || entry == t.eos) {
                    add_sep = true;
                }
            }
            self.set_add("sep", add_sep);
            if add_sep && !truthy(&t.sep) && self.has_tc {
                self.tc.insert("sep_token".into(), t.eos.clone());
            }
        }
    }
}

/// The special tokens as the post-processors see them (their contents, not ids).
struct SpecialTokens {
    bos: Json,
    cls: Json,
    eos: Json,
    sep: Json,
}

/// Each special type's id, in the order found; the first one found for a type wins.
struct SpecialIds {
    ids: Vec<(&'static str, u64)>,
    n_vocab: usize,
}

impl SpecialIds {
    /// Records `id` (from `source`) for `typ`: a negative id is an error, one past the
    /// vocabulary a warning.
    fn set(
        &mut self,
        typ: &'static str,
        id: &Json,
        source: &Path,
        warnings: &mut Vec<String>,
    ) -> Result<(), String> {
        let Json::Number(n) = id else { return Ok(()) };
        if let Some(i) = n.as_i64().filter(|i| *i < 0) {
            return Err(format!(
                "{}: special token `{typ}` has the negative id {i}",
                source.display()
            ));
        }
        let Some(i) = n.as_u64() else { return Ok(()) };
        if (i as usize) >= self.n_vocab {
            warnings.push(format!(
                "{}: special token `{typ}` has id {i}, outside the {}-token vocabulary; \
                 not embedded",
                source.display(),
                self.n_vocab
            ));
        } else if !self.ids.iter().any(|(t, _)| *t == typ) {
            self.ids.push((typ, i));
        }
        Ok(())
    }
}

/// The chat template gguf-py embeds: tokenizer_config.json's own, else `chat_template.jinja`
/// (with `additional_chat_templates/*.jinja`, a named list), else `chat_template.json`'s.
fn chat_template(
    model: &Path,
    tc: &Map<String, Json>,
    cfg_path: &Path,
    warnings: &mut Vec<String>,
) -> Result<Option<Json>, String> {
    let jinja = model.join("chat_template.jinja");
    let alt = if jinja.is_file() {
        let text =
            std::fs::read_to_string(&jinja).map_err(|e| format!("{}: {e}", jinja.display()))?;
        let mut more: Vec<PathBuf> = std::fs::read_dir(model.join("additional_chat_templates"))
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
                    .collect()
            })
            .unwrap_or_default();
        if more.is_empty() {
            Json::String(text)
        } else {
            more.sort();
            let mut list = vec![serde_json::json!({"name": "default", "template": text})];
            for p in more {
                let t = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
                let name = p.file_stem().map(|s| s.to_string_lossy().into_owned());
                list.push(serde_json::json!({"name": name, "template": t}));
            }
            Json::Array(list)
        }
    } else {
        let path = model.join("chat_template.json");
        if path.is_file() {
            read_json(&path)?
                .get("chat_template")
                .cloned()
                .unwrap_or(Json::Null)
        } else {
            Json::Null
        }
    };
    let chosen = tc.get("chat_template").cloned().unwrap_or(alt);
    Ok(match chosen {
        Json::Null => None,
        t @ (Json::String(_) | Json::Array(_)) => Some(t),
        _ => {
            warnings.push(format!(
                "{}: `chat_template` is neither a string nor a list; not embedded",
                cfg_path.display()
            ));
            None
        }
    })
}

/// The `tokenizer.ggml.*_token_id`, `add_*_token` and `tokenizer.chat_template*` keys.
fn special_metadata(
    ids: Vec<(&'static str, u64)>,
    add: Vec<(&'static str, bool)>,
    template: Option<Json>,
) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for (typ, id) in ids {
        let key = match typ {
            "bos" => "bos",
            "eos" => "eos",
            "unk" => "unknown",
            "sep" => "seperator",
            "pad" => "padding",
            "mask" => "mask",
            "eot" => "eot",
            "eom" => "eom",
            // gguf-py has no writer for the CLS id.
            _ => continue,
        };
        out.push((
            format!("tokenizer.ggml.{key}_token_id"),
            Value::U32(id as u32),
        ));
    }
    for (typ, v) in add {
        if matches!(typ, "bos" | "eos" | "sep") {
            out.push((format!("tokenizer.ggml.add_{typ}_token"), Value::Bool(v)));
        }
    }
    match template {
        Some(Json::String(t)) => out.push(("tokenizer.chat_template".into(), Value::String(t))),
        Some(Json::Array(choices)) => out.extend(named_templates(&choices)),
        _ => {}
    }
    out
}

/// A list of named chat templates as gguf-py writes it: `tokenizer.chat_template.<name>`
/// each (names sanitised, sorted: gguf-py takes them from a Python set, in no fixed order),
/// the list of names, and the `default` one as `tokenizer.chat_template`.
fn named_templates(choices: &[Json]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut default = None;
    let mut named = Vec::new();
    for c in choices {
        let name: String = c
            .get("name")
            .and_then(Json::as_str)
            .unwrap_or("")
            .chars()
            .map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' })
            .collect();
        let Some(t) = c.get("template").and_then(Json::as_str) else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        if name == "default" {
            default = Some(t.to_string());
        } else {
            named.push((name, t.to_string()));
        }
    }
    named.sort();
    named.dedup_by(|a, b| a.0 == b.0);
    for (name, t) in &named {
        out.push((
            format!("tokenizer.chat_template.{name}"),
            Value::String(t.clone()),
        ));
    }
    if !named.is_empty() {
        out.push((
            "tokenizer.chat_templates".into(),
            Value::Array(named.into_iter().map(|(n, _)| Value::String(n)).collect()),
        ));
    }
    if let Some(t) = default {
        out.push(("tokenizer.chat_template".into(), Value::String(t)));
    }
    out
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
