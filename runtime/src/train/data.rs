//! Training data as users have it (JSONL, one example per line) and its tokenization as TRL
//! 0.29.1 does it (docs/TRAINING.md §1): the format is detected from the first line and every
//! line is checked against it; a bad line is an error naming the file and line.

use super::TrainError;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A dataset format, by its columns (TRL's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataFormat {
    /// `{"text"}`: language modelling.
    Text,
    /// `{"prompt", "completion"}`.
    PromptCompletion,
    /// `{"messages"}`: a conversation rendered with the chat template.
    Messages,
    /// `{"prompt", "chosen", "rejected"}`.
    Preference,
    /// `{"prompt", "completion", "label"}`: an unpaired completion marked desirable or not.
    Unpaired,
    /// `{"prompt", …}`: a prompt alone (GRPO samples the completions); the other columns
    /// (`answer`, …) go to the reward functions.
    Prompt,
}

impl DataFormat {
    /// The columns the format needs.
    pub fn columns(self) -> &'static [&'static str] {
        match self {
            DataFormat::Text => &["text"],
            DataFormat::PromptCompletion => &["prompt", "completion"],
            DataFormat::Messages => &["messages"],
            DataFormat::Preference => &["prompt", "chosen", "rejected"],
            DataFormat::Unpaired => &["prompt", "completion", "label"],
            DataFormat::Prompt => &["prompt"],
        }
    }

    fn detect(obj: &serde_json::Map<String, Value>) -> Option<Self> {
        let has = |k| obj.contains_key(k);
        Some(if has("chosen") && has("rejected") {
            DataFormat::Preference
        } else if has("prompt") && has("completion") && has("label") {
            DataFormat::Unpaired
        } else if has("prompt") && has("completion") {
            DataFormat::PromptCompletion
        } else if has("prompt") {
            DataFormat::Prompt
        } else if has("messages") {
            DataFormat::Messages
        } else if has("text") {
            DataFormat::Text
        } else {
            return None;
        })
    }
}

/// One line of a dataset: its 1-based line number and its object.
#[derive(Debug, Clone)]
pub struct Record {
    /// The line in the file.
    pub line: usize,
    /// The JSON object.
    pub fields: serde_json::Map<String, Value>,
}

/// A parsed dataset: its file, format and records.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// The file it came from.
    pub path: PathBuf,
    /// The detected format.
    pub format: DataFormat,
    /// Every non-blank line.
    pub records: Vec<Record>,
}

impl Dataset {
    /// Reads `path`; `accepted` lists the formats the task takes (the first line's format must
    /// be one of them, every other line must have the same columns as strings).
    pub fn read(path: &Path, accepted: &[DataFormat]) -> Result<Self, TrainError> {
        let err = |line: Option<usize>, message: String| TrainError::Data {
            path: path.to_path_buf(),
            line,
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut format = None;
        let mut records = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(raw)
                .map_err(|e| err(Some(line), format!("not valid JSON: {e}")))?;
            let Value::Object(fields) = v else {
                return Err(err(Some(line), "expected a JSON object".into()));
            };
            let f = match format {
                Some(f) => f,
                None => {
                    let f = DataFormat::detect(&fields).ok_or_else(|| {
                        err(
                            Some(line),
                            "unknown format: expected the columns text, prompt+completion, messages or prompt+chosen+rejected".into(),
                        )
                    })?;
                    if !accepted.contains(&f) {
                        let names: Vec<String> =
                            accepted.iter().map(|a| a.columns().join("+")).collect();
                        return Err(err(
                            Some(line),
                            format!(
                                "this task takes {} data, not {}",
                                names.join(" or "),
                                f.columns().join("+")
                            ),
                        ));
                    }
                    format = Some(f);
                    f
                }
            };
            for col in f.columns() {
                match fields.get(*col) {
                    Some(Value::Bool(_)) if *col == "label" => {}
                    Some(other) if *col == "label" => {
                        return Err(err(
                            Some(line),
                            format!("`label` must be true (desirable) or false, found {other}"),
                        ));
                    }
                    Some(Value::String(_)) => {}
                    Some(Value::Array(msgs)) if *col != "label" => {
                        // A conversation: a list of {"role", "content"} messages.
                        for (i, m) in msgs.iter().enumerate() {
                            let ok = m.get("role").is_some_and(Value::is_string)
                                && m.get("content").is_some_and(Value::is_string);
                            if !ok {
                                return Err(err(
                                    Some(line),
                                    format!(
                                        "`{col}` message {i} needs string `role` and `content`"
                                    ),
                                ));
                            }
                        }
                    }
                    Some(other) => {
                        return Err(err(
                            Some(line),
                            format!("`{col}` must be a string, found {other}"),
                        ));
                    }
                    None => {
                        return Err(err(
                            Some(line),
                            format!(
                                "missing `{col}` (the file's first example has the {} columns)",
                                f.columns().join("+")
                            ),
                        ));
                    }
                }
            }
            if f == DataFormat::Messages && !fields["messages"].is_array() {
                return Err(err(
                    Some(line),
                    "`messages` must be a list of messages".into(),
                ));
            }
            records.push(Record { line, fields });
        }
        let format = format.ok_or_else(|| err(None, "holds no examples".into()))?;
        Ok(Dataset {
            path: path.to_path_buf(),
            format,
            records,
        })
    }
}

/// The model's tokenizer with the special tokens TRL uses (`tokenizer.json` +
/// `tokenizer_config.json`).
#[derive(Clone)]
pub struct TextTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// The end-of-sequence token's text (appended to completions as TRL does).
    pub eos_token: String,
    /// Its id.
    pub eos_id: u32,
    /// The padding id (`pad_token`, else the EOS, as TRL falls back).
    pub pad_id: u32,
    /// The beginning-of-sequence id (`bos_token`), if the tokenizer has one.
    pub bos_id: Option<u32>,
    /// The chat template, if the model has one.
    pub chat: Option<super::chat::ChatTemplate>,
}

fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    /// The tokenizer of the model in `dir`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TrainError> {
        let tok_path = dir.join("tokenizer.json");
        let cfg_path = dir.join("tokenizer_config.json");
        let io = |path: &Path, message: String| TrainError::Data {
            path: path.to_path_buf(),
            line: None,
            message,
        };
        if !tok_path.exists() {
            return Err(io(
                &tok_path,
                "missing: training needs the model's tokenizer".into(),
            ));
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| io(&tok_path, format!("unreadable: {e}")))?;
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => serde_json::from_str(&t)
                .map_err(|e| io(&cfg_path, format!("not valid JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Value::Null,
            Err(e) => return Err(io(&cfg_path, e.to_string())),
        };
        let eos_token = token_text(cfg.get("eos_token")).ok_or_else(|| {
            io(
                &cfg_path,
                "names no `eos_token` (TRL appends it to every completion)".into(),
            )
        })?;
        let id = |t: &str| tokenizer.token_to_id(t);
        let eos_id = id(&eos_token).ok_or_else(|| {
            io(
                &cfg_path,
                format!("`eos_token` {eos_token:?} is not in tokenizer.json's vocabulary"),
            )
        })?;
        let pad_id = token_text(cfg.get("pad_token"))
            .and_then(|t| id(&t))
            .unwrap_or(eos_id);
        let bos_id = token_text(cfg.get("bos_token")).and_then(|t| id(&t));
        let chat = super::chat::ChatTemplate::from_model_dir(dir)?;
        Ok(TextTokenizer {
            tokenizer,
            eos_token,
            eos_id,
            pad_id,
            bos_id,
            chat,
        })
    }

    /// `tokenizer(text)["input_ids"]`: the text's ids with the special tokens the tokenizer's
    /// post-processor adds (a BOS for Llama-style tokenizers).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// `tokenizer(text, add_special_tokens=False)["input_ids"]`.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// `apply_chat_template(messages, tokenize=True)`: the rendered conversation's ids
    /// (special tokens as the template writes them) and, per token, whether it lies in a
    /// `{% generation %}` block.
    pub fn encode_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<(Vec<u32>, Vec<u8>), String> {
        let chat = self
            .chat
            .as_ref()
            .ok_or("conversational data needs a chat template, and the model has none (tokenizer_config.json `chat_template` or chat_template.jinja)")?;
        let r = chat.render(messages, add_generation_prompt)?;
        let enc = self
            .tokenizer
            .encode(r.text.as_str(), false)
            .map_err(|e| e.to_string())?;
        let mask = enc
            .get_offsets()
            .iter()
            .map(|&(start, _)| u8::from(r.generation.iter().any(|&(a, b)| start >= a && start < b)))
            .collect();
        Ok((enc.get_ids().to_vec(), mask))
    }

    /// `messages` rendered with the chat template as text (transformers'
    /// `apply_chat_template(..., tokenize=False)`).
    pub fn render_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        continue_final_message: bool,
    ) -> Result<String, String> {
        let chat = self
            .chat
            .as_ref()
            .ok_or("conversational data needs a chat template, and the model has none (tokenizer_config.json `chat_template` or chat_template.jinja)")?;
        Ok(chat
            .render_with(messages, add_generation_prompt, continue_final_message)?
            .text)
    }

    /// Token ids back to text (special tokens dropped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| e.to_string())
    }
}

/// TRL's `maybe_apply_chat_template`, for the trainers that tokenize text (orpo, simpo, kto):
/// a conversational record becomes strings. The prompt is rendered with the assistant's
/// header when its last message is the user's (or a tool's), continuing the last message when
/// it is the assistant's; each of `chosen`, `rejected`, `completion` (in that order) is
/// rendered after the prompt, the prompt is cut to the common prefix of the two renderings, and
/// the side is the rest. Text records pass unchanged; other columns are kept.
pub fn apply_chat_template(data: &Dataset, tok: &TextTokenizer) -> Result<Dataset, TrainError> {
    let mut records = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let err = |m: String| TrainError::Data {
            path: data.path.clone(),
            line: Some(r.line),
            message: m,
        };
        let sides = ["chosen", "rejected", "completion"];
        if !r.fields.values().any(Value::is_array) {
            records.push(r.clone());
            continue;
        }
        let Some(Value::Array(prompt)) = r.fields.get("prompt") else {
            return Err(err(
                "a conversational example needs its `prompt` as a list of messages too".into(),
            ));
        };
        let role = prompt
            .last()
            .and_then(|m| m.get("role"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        let (generation_prompt, continue_final) = match role {
            "user" | "tool" => (true, false),
            "assistant" => (false, true),
            other => {
                return Err(err(format!(
                    "the prompt's last message has role `{other}` (expected user, tool or assistant)"
                )));
            }
        };
        let mut text = tok
            .render_chat(
                &Value::Array(prompt.clone()),
                generation_prompt,
                continue_final,
            )
            .map_err(&err)?;
        let mut fields = r.fields.clone();
        for k in sides {
            let Some(v) = r.fields.get(k) else { continue };
            let Value::Array(side) = v else {
                return Err(err(format!(
                    "`{k}` is text while `prompt` is a conversation: give both as lists of messages"
                )));
            };
            let mut all = prompt.clone();
            all.extend(side.iter().cloned());
            let full = tok
                .render_chat(&Value::Array(all), false, false)
                .map_err(&err)?;
            // The common prefix, character by character, as TRL's `takewhile` takes it.
            let common = text
                .char_indices()
                .zip(full.chars())
                .find(|((_, a), b)| a != b)
                .map_or(text.len().min(full.len()), |((i, _), _)| i);
            text.truncate(common);
            fields.insert(k.to_string(), Value::String(full[common..].to_string()));
        }
        fields.insert("prompt".into(), Value::String(text));
        records.push(Record {
            line: r.line,
            fields,
        });
    }
    Ok(Dataset {
        path: data.path.clone(),
        format: data.format,
        records,
    })
}

/// TRL's `maybe_unpair_preference_dataset` (KTO on paired data): every pair becomes its
/// chosen completion, desirable, and its rejected one, undesirable — in the order `datasets`'
/// batched `map` gives (per block of 1,000 pairs: every chosen, then every rejected).
pub fn unpair(data: &Dataset) -> Dataset {
    if data.format != DataFormat::Preference {
        return data.clone();
    }
    let mut records = Vec::with_capacity(2 * data.records.len());
    for block in data.records.chunks(1000) {
        for (side, label) in [("chosen", true), ("rejected", false)] {
            for r in block {
                let mut fields = r.fields.clone();
                let completion = fields.remove(side).unwrap_or_default();
                fields.remove("chosen");
                fields.remove("rejected");
                fields.insert("completion".into(), completion);
                fields.insert("label".into(), Value::Bool(label));
                records.push(Record {
                    line: r.line,
                    fields,
                });
            }
        }
    }
    Dataset {
        path: data.path.clone(),
        format: DataFormat::Unpaired,
        records,
    }
}

/// A tokenized causal-LM example: ids and which of them are trained on.
#[derive(Debug, Clone, PartialEq)]
pub struct LmExample {
    /// Token ids.
    pub ids: Vec<u32>,
    /// 1 where the token is a label (the completion, or every token of `text` data).
    pub mask: Vec<u8>,
}

/// A tokenized preference pair: the prompt's ids and each completion's ids after it.
#[derive(Debug, Clone, PartialEq)]
pub struct PairExample {
    /// The prompt.
    pub prompt: Vec<u32>,
    /// The chosen completion (after the prompt).
    pub chosen: Vec<u32>,
    /// The rejected completion.
    pub rejected: Vec<u32>,
}

fn field<'a>(r: &'a Record, k: &str) -> &'a str {
    r.fields.get(k).and_then(Value::as_str).unwrap_or_default()
}

fn with_eos(s: &str, eos: &str) -> String {
    if s.ends_with(eos) {
        s.to_string()
    } else {
        format!("{s}{eos}")
    }
}

/// The ids of `prompt + completion` split at the prompt's length, as TRL splits them (it
/// tokenizes the prompt alone and the concatenation, and takes the concatenation's ids past
/// the prompt's count).
fn split_ids(
    tok: &TextTokenizer,
    data: &Dataset,
    r: &Record,
    prompt: &str,
    full: &str,
) -> Result<(Vec<u32>, Vec<u32>), TrainError> {
    let err = |m: String| TrainError::Data {
        path: data.path.clone(),
        line: Some(r.line),
        message: format!("tokenizing: {m}"),
    };
    let p = tok.encode(prompt).map_err(err)?;
    let all = tok.encode(full).map_err(err)?;
    let rest = all.get(p.len()..).unwrap_or_default().to_vec();
    Ok((p, rest))
}

/// SFT examples (TRL's `SFTTrainer` preprocessing): `text` gets the EOS appended and every
/// token is a label; `prompt`+`completion` gets the EOS appended to the completion and, with
/// `completion_only_loss` (TRL's default for this format), only the completion's tokens are
/// labels. Sequences are cut to `max_length` tokens, keeping the start.
pub fn sft_examples(
    data: &Dataset,
    tok: &TextTokenizer,
    completion_only_loss: bool,
    max_length: Option<usize>,
) -> Result<Vec<LmExample>, TrainError> {
    sft_examples_with(data, tok, completion_only_loss, false, max_length)
}

/// [`sft_examples`] with TRL's `assistant_only_loss`: for `messages` data, only the tokens
/// the chat template marks with `{% generation %}` are labels. Conversational data is
/// rendered with the chat template (no EOS appended: the template writes its own end of
/// turn); a conversational `prompt`+`completion` is split at the prompt rendered with the
/// assistant's header.
pub fn sft_examples_with(
    data: &Dataset,
    tok: &TextTokenizer,
    completion_only_loss: bool,
    assistant_only_loss: bool,
    max_length: Option<usize>,
) -> Result<Vec<LmExample>, TrainError> {
    let mut out = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let chat_err = |m: String| TrainError::Data {
            path: data.path.clone(),
            line: Some(r.line),
            message: m,
        };
        let conversational = r.fields.get("prompt").is_some_and(Value::is_array);
        let mut ex = match data.format {
            DataFormat::Messages => {
                let (ids, gen_mask) = tok
                    .encode_chat(&r.fields["messages"], false)
                    .map_err(chat_err)?;
                let mask = if assistant_only_loss {
                    if !gen_mask.contains(&1) {
                        return Err(chat_err(
                            "assistant_only_loss needs assistant tokens, and the chat template marks none (it has no {% generation %} block)".into(),
                        ));
                    }
                    gen_mask
                } else {
                    vec![1; ids.len()]
                };
                LmExample { ids, mask }
            }
            DataFormat::PromptCompletion if conversational => {
                let prompt = &r.fields["prompt"];
                let mut all = prompt.as_array().cloned().unwrap_or_default();
                all.extend(
                    r.fields["completion"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default(),
                );
                let (p, _) = tok.encode_chat(prompt, true).map_err(&chat_err)?;
                let (ids, gen_mask) = tok
                    .encode_chat(&Value::Array(all), false)
                    .map_err(&chat_err)?;
                let mut mask: Vec<u8> = (0..ids.len())
                    .map(|i| u8::from(i >= p.len() || !completion_only_loss))
                    .collect();
                if assistant_only_loss {
                    for (m, g) in mask.iter_mut().zip(&gen_mask) {
                        *m &= g;
                    }
                }
                LmExample { ids, mask }
            }
            DataFormat::Text => {
                let text = with_eos(field(r, "text"), &tok.eos_token);
                let ids = tok.encode(&text).map_err(|m| TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: format!("tokenizing: {m}"),
                })?;
                let mask = vec![1; ids.len()];
                LmExample { ids, mask }
            }
            DataFormat::PromptCompletion => {
                let prompt = field(r, "prompt");
                let full = format!(
                    "{prompt}{}",
                    with_eos(field(r, "completion"), &tok.eos_token)
                );
                let (p, c) = split_ids(tok, data, r, prompt, &full)?;
                let label = u8::from(!completion_only_loss);
                let mut mask = vec![label; p.len()];
                mask.extend(std::iter::repeat_n(1, c.len()));
                let mut ids = p;
                ids.extend(c);
                LmExample { ids, mask }
            }
            other => {
                return Err(TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: format!("sft does not take {} data", other.columns().join("+")),
                });
            }
        };
        if let Some(n) = max_length {
            ex.ids.truncate(n);
            ex.mask.truncate(n);
        }
        out.push(ex);
    }
    Ok(out)
}

/// Preference pairs (TRL's `DPOTrainer` preprocessing): the EOS is appended to both
/// completions; each is the ids of `prompt + completion` past the prompt's ids.
pub fn pair_examples(data: &Dataset, tok: &TextTokenizer) -> Result<Vec<PairExample>, TrainError> {
    data.records
        .iter()
        .map(|r| {
            if r.fields.get("prompt").is_some_and(Value::is_array) {
                // Conversational: the prompt with the assistant's header, then each side
                // rendered after it (TRL's DPOTrainer).
                let err = |m: String| TrainError::Data {
                    path: data.path.clone(),
                    line: Some(r.line),
                    message: m,
                };
                let prompt = r.fields["prompt"].as_array().cloned().unwrap_or_default();
                let (p, _) = tok
                    .encode_chat(&Value::Array(prompt.clone()), true)
                    .map_err(&err)?;
                let side = |k: &str| -> Result<Vec<u32>, TrainError> {
                    let mut all = prompt.clone();
                    all.extend(r.fields[k].as_array().cloned().unwrap_or_default());
                    let (ids, _) = tok.encode_chat(&Value::Array(all), false).map_err(&err)?;
                    Ok(ids.get(p.len()..).unwrap_or_default().to_vec())
                };
                let chosen = side("chosen")?;
                let rejected = side("rejected")?;
                return Ok(PairExample {
                    prompt: p,
                    chosen,
                    rejected,
                });
            }
            let prompt = field(r, "prompt");
            let chosen = format!("{prompt}{}", with_eos(field(r, "chosen"), &tok.eos_token));
            let rejected = format!("{prompt}{}", with_eos(field(r, "rejected"), &tok.eos_token));
            let (p, c) = split_ids(tok, data, r, prompt, &chosen)?;
            let (_, rj) = split_ids(tok, data, r, prompt, &rejected)?;
            Ok(PairExample {
                prompt: p,
                chosen: c,
                rejected: rj,
            })
        })
        .collect()
}

/// An unpaired example as TRL's KTO trainer tokenizes it (`_tokenize` + `_process_tokens`).
#[derive(Debug, Clone, PartialEq)]
pub struct UnpairedExample {
    /// `prompt + completion` with the completion's label mask.
    pub seq: LmExample,
    /// The same prompt with the previous example's completion (TRL's KL batch; empty when the
    /// KL term is not computed).
    pub kl_seq: LmExample,
    /// Desirable (`true`) or not.
    pub label: bool,
}

/// The prompt's and the answer's ids of `prompt + answer` without special tokens, split as
/// TRL splits them (one token earlier when the tokenizer merged across the boundary).
fn split_plain(
    tok: &TextTokenizer,
    prompt: &str,
    answer: &str,
) -> Result<(Vec<u32>, Vec<u32>), String> {
    let plain_prompt = tok.encode_plain(prompt)?;
    let full = tok.encode_plain(&format!("{prompt}{answer}"))?;
    let mut start = plain_prompt.len().min(full.len());
    if full[..start] != plain_prompt[..] {
        start = start.saturating_sub(1);
    }
    Ok((full[..start].to_vec(), full[start..].to_vec()))
}

/// KTO's `_process_tokens`: the completion is cut so that the sequence with its BOS and EOS
/// fits `max_length`; a BOS goes first and an EOS last when missing; the prompt is masked.
fn kto_sequence(
    tok: &TextTokenizer,
    prompt: &[u32],
    answer: &[u32],
    max_length: usize,
) -> LmExample {
    let mut max = max_length as i64;
    let bos_missing = !prompt.is_empty() && tok.bos_id != Some(prompt[0]);
    if bos_missing {
        max -= 1;
    }
    if answer.last().is_some_and(|&a| a != tok.eos_id) {
        max -= 1;
    }
    let mut answer = answer.to_vec();
    if (prompt.len() + answer.len()) as i64 > max {
        py_head(&mut answer, max - prompt.len() as i64);
    }
    let mut ids = Vec::with_capacity(prompt.len() + answer.len() + 2);
    if let Some(bos) = tok.bos_id
        && prompt.first() != Some(&bos)
    {
        ids.push(bos);
    }
    ids.extend(prompt);
    let prompt_len = ids.len();
    ids.extend(&answer);
    if answer.last() != Some(&tok.eos_id) {
        ids.push(tok.eos_id);
    }
    let mut mask = vec![0u8; prompt_len];
    mask.resize(ids.len(), 1);
    LmExample { ids, mask }
}

/// KTO preprocessing; with `kl_batch` (the KL term is computed) each example's KL sequence
/// pairs its prompt with the completion of the example before it within consecutive groups
/// of `kl_batch` (the first takes the group's last), as TRL builds its KL dataset.
pub fn unpaired_examples(
    data: &Dataset,
    tok: &TextTokenizer,
    max_length: usize,
    kl_batch: Option<usize>,
) -> Result<Vec<UnpairedExample>, TrainError> {
    let mut split = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let (p, a) = split_plain(tok, field(r, "prompt"), field(r, "completion")).map_err(|m| {
            TrainError::Data {
                path: data.path.clone(),
                line: Some(r.line),
                message: format!("tokenizing: {m}"),
            }
        })?;
        let label = r
            .fields
            .get("label")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        split.push((p, a, label));
    }
    let mut out = Vec::with_capacity(split.len());
    for (i, (p, a, label)) in split.iter().enumerate() {
        let kl_seq = match kl_batch {
            Some(b) => {
                let start = i / b * b;
                let end = (start + b).min(split.len());
                let from = if i == start { end - 1 } else { i - 1 };
                kto_sequence(tok, p, &split[from].1, max_length)
            }
            None => LmExample {
                ids: Vec::new(),
                mask: Vec::new(),
            },
        };
        out.push(UnpairedExample {
            seq: kto_sequence(tok, p, a, max_length),
            kl_seq,
            label: *label,
        });
    }
    Ok(out)
}

/// A preference pair as TRL's ORPO and CPO trainers tokenize it: each side is the prompt's
/// ids (a BOS put first when missing) and the completion's (the EOS put last when missing),
/// with a label mask over the completion.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredPair {
    /// `prompt + chosen` and its label mask.
    pub chosen: LmExample,
    /// `prompt + rejected` and its label mask.
    pub rejected: LmExample,
}

/// `v[..end]` with Python's slice semantics (a negative end counts from the back).
fn py_head(v: &mut Vec<u32>, end: i64) {
    let n = v.len() as i64;
    let end = if end < 0 {
        (n + end).max(0)
    } else {
        end.min(n)
    };
    v.truncate(end as usize);
}

/// ORPO / CPO preprocessing (`build_tokenized_answer` + `tokenize_row` of TRL's experimental
/// trainers): the completion is `enc(prompt + answer)[len(enc(prompt)):]` without special
/// tokens (one token earlier when the tokenizer merged across the boundary); a BOS is put
/// before each prompt and an EOS after each completion when missing; when the prompt plus the
/// longer completion exceeds `max_length`, both completions are cut to
/// `max_length − longer` tokens (Python slicing: a negative count cuts from the end).
pub fn scored_pairs(
    data: &Dataset,
    tok: &TextTokenizer,
    max_length: usize,
) -> Result<Vec<ScoredPair>, TrainError> {
    let mut out = Vec::with_capacity(data.records.len());
    for r in &data.records {
        let err = |m: String| TrainError::Data {
            path: data.path.clone(),
            line: Some(r.line),
            message: m,
        };
        let prompt = field(r, "prompt");
        let plain_prompt = tok.encode_plain(prompt).map_err(&err)?;
        let mut sides = Vec::with_capacity(2);
        for answer in [field(r, "chosen"), field(r, "rejected")] {
            let full = tok
                .encode_plain(&format!("{prompt}{answer}"))
                .map_err(&err)?;
            let mut start = plain_prompt.len().min(full.len());
            if full[..start] != plain_prompt[..] {
                start = start.saturating_sub(1);
            }
            let (mut p, mut a) = (full[..start].to_vec(), full[start..].to_vec());
            if let Some(bos) = tok.bos_id
                && p.first() != Some(&bos)
            {
                p.insert(0, bos);
            }
            if a.last() != Some(&tok.eos_id) {
                a.push(tok.eos_id);
            }
            sides.push((p, a));
        }
        let longer = sides.iter().map(|(_, a)| a.len()).max().unwrap_or(0);
        let make = |(p, mut a): (Vec<u32>, Vec<u32>)| {
            if p.len() + longer > max_length {
                py_head(&mut a, max_length as i64 - longer as i64);
            }
            let mut mask = vec![0u8; p.len()];
            mask.extend(std::iter::repeat_n(1, a.len()));
            let mut ids = p;
            ids.extend(a);
            LmExample { ids, mask }
        };
        let rejected = sides.pop().expect("two sides");
        let chosen = sides.pop().expect("two sides");
        out.push(ScoredPair {
            chosen: make(chosen),
            rejected: make(rejected),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn formats_are_detected_and_bad_lines_named() {
        let dir = tempfile::tempdir().unwrap();
        let ok = write(
            dir.path(),
            "a.jsonl",
            "{\"prompt\":\"1+1=\",\"completion\":\"2\"}\n\n{\"prompt\":\"2+2=\",\"completion\":\"4\"}\n",
        );
        let d = Dataset::read(&ok, &[DataFormat::PromptCompletion]).unwrap();
        assert_eq!(
            (d.format, d.records.len(), d.records[1].line),
            (DataFormat::PromptCompletion, 2, 3)
        );
        let bad = write(
            dir.path(),
            "b.jsonl",
            "{\"prompt\":\"a\",\"completion\":\"b\"}\n{\"prompt\":\"a\"}\n",
        );
        let e = Dataset::read(&bad, &[DataFormat::PromptCompletion])
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("b.jsonl:2: missing `completion` (the file's first example has the prompt+completion columns)"), "{e}");
        let e = Dataset::read(&ok, &[DataFormat::Preference])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with(
                "a.jsonl:1: this task takes prompt+chosen+rejected data, not prompt+completion"
            ),
            "{e}"
        );
        let junk = write(dir.path(), "c.jsonl", "{\"text\": 3}\n");
        let e = Dataset::read(&junk, &[DataFormat::Text])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("c.jsonl:1: `text` must be a string, found 3"),
            "{e}"
        );
        let broken = write(dir.path(), "d.jsonl", "{\"text\": \n");
        let e = Dataset::read(&broken, &[DataFormat::Text])
            .unwrap_err()
            .to_string();
        assert!(e.contains("d.jsonl:1: not valid JSON"), "{e}");
        let chat = write(
            dir.path(),
            "f.jsonl",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"content\": \"yo\"}]}\n",
        );
        let e = Dataset::read(&chat, &[DataFormat::Messages])
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("f.jsonl:1: `messages` message 1 needs string `role` and `content`"),
            "{e}"
        );
        let empty = write(dir.path(), "e.jsonl", "\n");
        let e = Dataset::read(&empty, &[DataFormat::Text])
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("e.jsonl: holds no examples"), "{e}");
    }

    /// TRL's `maybe_apply_chat_template` on the demo template: the prompt with the assistant's
    /// header (or continuing the assistant's last words), each side the rest of its rendering;
    /// mixed text and conversation is an error naming the line.
    #[test]
    fn conversations_render_into_text_as_trl_renders_them() {
        let dir = tempfile::tempdir().unwrap();
        crate::demo::write_byte_tokenizer(dir.path()).unwrap();
        let tok = TextTokenizer::from_model_dir(dir.path()).unwrap();
        let f = write(
            dir.path(),
            "p.jsonl",
            concat!(
                r#"{"prompt":[{"role":"user","content":"1+1?"}],"chosen":[{"role":"assistant","content":"2"}],"rejected":[{"role":"assistant","content":"3"}]}"#,
                "\n",
                r#"{"prompt":[{"role":"user","content":"2+2?"},{"role":"assistant","content":"It is "}],"chosen":[{"role":"assistant","content":"4"}],"rejected":[{"role":"assistant","content":"5"}]}"#,
                "\n",
                r#"{"prompt":"text","chosen":"a","rejected":"b"}"#,
                "\n",
            ),
        );
        let d = apply_chat_template(&Dataset::read(&f, &[DataFormat::Preference]).unwrap(), &tok)
            .unwrap();
        let row = |i: usize| {
            ["prompt", "chosen", "rejected"].map(|k| field(&d.records[i], k).to_string())
        };
        assert_eq!(row(0), ["<|user|>1+1?<|assistant|>", "2</s>", "3</s>"]);
        assert_eq!(
            row(1),
            [
                "<|user|>2+2?<|assistant|>It is ",
                "</s><|assistant|>4</s>",
                "</s><|assistant|>5</s>"
            ]
        );
        assert_eq!(row(2), ["text", "a", "b"]);
        let unpaired = unpair(&d);
        assert_eq!(unpaired.records.len(), 6);
        let labels: Vec<bool> = unpaired
            .records
            .iter()
            .map(|r| r.fields["label"].as_bool().unwrap())
            .collect();
        assert_eq!(labels, [true, true, true, false, false, false]);
        assert_eq!(
            field(&unpaired.records[4], "completion"),
            "</s><|assistant|>5</s>"
        );
        let mixed = write(
            dir.path(),
            "m.jsonl",
            concat!(
                r#"{"prompt":[{"role":"user","content":"x"}],"chosen":"a","rejected":"b"}"#,
                "\n"
            ),
        );
        let e = apply_chat_template(
            &Dataset::read(&mixed, &[DataFormat::Preference]).unwrap(),
            &tok,
        )
        .unwrap_err()
        .to_string();
        assert!(e.ends_with("m.jsonl:1: `chosen` is text while `prompt` is a conversation: give both as lists of messages"), "{e}");
        let system = write(
            dir.path(),
            "s.jsonl",
            concat!(
                r#"{"prompt":[{"role":"system","content":"x"}],"completion":[{"role":"assistant","content":"a"}],"label":true}"#,
                "\n"
            ),
        );
        let e = apply_chat_template(
            &Dataset::read(&system, &[DataFormat::Unpaired]).unwrap(),
            &tok,
        )
        .unwrap_err()
        .to_string();
        assert!(e.ends_with("s.jsonl:1: the prompt's last message has role `system` (expected user, tool or assistant)"), "{e}");
    }
}
