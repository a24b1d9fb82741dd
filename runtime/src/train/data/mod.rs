//! Training data as users have it (JSONL, one example per line) and its tokenization as TRL
//! 0.29.1 does it (docs/TRAINING.md §1): the format is detected from the first line and every
//! line is checked against it; a bad line is an error naming the file and line.

pub mod pack;
mod tokenizer;

pub use tokenizer::TextTokenizer;

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
    /// `{"chosen", "rejected"}`: a preference pair whose prompt is part of both sides (TRL's
    /// implicit prompt).
    ImplicitPreference,
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
            DataFormat::ImplicitPreference => &["chosen", "rejected"],
            DataFormat::Unpaired => &["prompt", "completion", "label"],
            DataFormat::Prompt => &["prompt"],
        }
    }

    fn detect(obj: &serde_json::Map<String, Value>) -> Option<Self> {
        let has = |k| obj.contains_key(k);
        Some(if has("chosen") && has("rejected") && !has("prompt") {
            DataFormat::ImplicitPreference
        } else if has("chosen") && has("rejected") {
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
    /// The file's column of language-modelling text (TRL's `dataset_text_field`), read into
    /// each record's `text`.
    pub text_field: String,
}

impl Dataset {
    /// Reads `path`; `accepted` lists the formats the task takes (the first line's format must
    /// be one of them, every other line must have the same columns as strings).
    ///
    /// Long on purpose: format detection and every per-line check, each naming the file and line.
    pub fn read(path: &Path, accepted: &[DataFormat]) -> Result<Self, TrainError> {
        Self::read_with(path, accepted, "text")
    }

    /// [`Dataset::read`] with language-modelling text in the column `text_field` (TRL's
    /// `dataset_text_field`), and plain text files (`.txt`) read as `datasets`' text loader
    /// reads them: one example per line.
    pub fn read_with(
        path: &Path,
        accepted: &[DataFormat],
        text_field: &str,
    ) -> Result<Self, TrainError> {
        let err = |line: Option<usize>, message: String| TrainError::Data {
            path: path.to_path_buf(),
            line,
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        if path.extension().is_some_and(|e| e == "txt") {
            if !accepted.contains(&DataFormat::Text) {
                return Err(err(
                    None,
                    "a plain text file is language-modelling data (text), which this task does not take".into(),
                ));
            }
            let records: Vec<Record> = text
                .lines()
                .enumerate()
                .map(|(i, l)| Record {
                    line: i + 1,
                    fields: serde_json::Map::from_iter([("text".to_string(), Value::from(l))]),
                })
                .collect();
            if records.is_empty() {
                return Err(err(None, "holds no examples".into()));
            }
            return Ok(Dataset {
                path: path.to_path_buf(),
                format: DataFormat::Text,
                records,
                text_field: "text".into(),
            });
        }
        let mut format = None;
        let mut records = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(raw)
                .map_err(|e| err(Some(line), format!("not valid JSON: {e}")))?;
            let Value::Object(mut fields) = v else {
                return Err(err(Some(line), "expected a JSON object".into()));
            };
            if text_field != "text"
                && let Some(t) = fields.remove(text_field)
            {
                fields.insert("text".into(), t);
            }
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
            text_field: text_field.into(),
        })
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
        text_field: data.text_field.clone(),
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
        text_field: data.text_field.clone(),
    }
}

pub(crate) fn field<'a>(r: &'a Record, k: &str) -> &'a str {
    r.fields.get(k).and_then(Value::as_str).unwrap_or_default()
}

pub(crate) fn with_eos(s: &str, eos: &str) -> String {
    if s.ends_with(eos) {
        s.to_string()
    } else {
        format!("{s}{eos}")
    }
}

/// The ids of `prompt + completion` split at the prompt's length, as TRL splits them (it
/// tokenizes the prompt alone and the concatenation, and takes the concatenation's ids past
/// the prompt's count).
pub(crate) fn split_ids(
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

/// A tokenized causal-LM example: ids and which of them are trained on.
#[derive(Debug, Clone, PartialEq)]
pub struct LmExample {
    /// Token ids.
    pub ids: Vec<u32>,
    /// 1 where the token is a label (the completion, or every token of `text` data).
    pub mask: Vec<u8>,
}

/// `v[..end]` with Python's slice semantics (a negative end counts from the back).
pub(crate) fn py_head(v: &mut Vec<u32>, end: i64) {
    let n = v.len() as i64;
    let end = if end < 0 {
        (n + end).max(0)
    } else {
        end.min(n)
    };
    v.truncate(end as usize);
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
