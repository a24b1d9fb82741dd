//! The model's tokenizer (`tokenizer.json`) and chat template, as TRL applies them.

use super::super::TrainError;
use serde_json::Value;
use std::path::Path;

/// Token ids and each token's byte offsets `(start, end)` in the text.
pub type IdsAndOffsets = (Vec<u32>, Vec<(usize, usize)>);

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
    pub chat: Option<super::super::chat::ChatTemplate>,
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
        let chat = super::super::chat::ChatTemplate::from_model_dir(dir)?;
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

    /// [`TextTokenizer::encode_plain`] with each token's byte offsets in `text`.
    pub fn encode_plain_offsets(&self, text: &str) -> Result<IdsAndOffsets, String> {
        let e = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| e.to_string())?;
        Ok((e.get_ids().to_vec(), e.get_offsets().to_vec()))
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
