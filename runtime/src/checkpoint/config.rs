//! `config.json`: kept whole (export writes it back with one key added), with the fields
//! kiln relies on checked up front.

use super::{CheckpointError, io};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// A model's `config.json`.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    path: PathBuf,
    raw: Map<String, Value>,
}

impl ModelConfig {
    /// Reads and checks `path`.
    pub fn read(path: &Path) -> Result<Self, CheckpointError> {
        let text = std::fs::read_to_string(path).map_err(io(path))?;
        Self::parse(path, &text)
    }

    /// Parses and checks `text` (reported as `path`).
    pub fn parse(path: &Path, text: &str) -> Result<Self, CheckpointError> {
        let bad = |message: String| CheckpointError::Config {
            file: path.to_path_buf(),
            message,
        };
        let raw: Map<String, Value> = match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => return Err(bad("not a JSON object".into())),
            Err(e) => return Err(bad(format!("invalid JSON: {e}"))),
        };
        let config = ModelConfig {
            path: path.to_path_buf(),
            raw,
        };
        config.check()?;
        Ok(config)
    }

    fn bad(&self, message: String) -> CheckpointError {
        CheckpointError::Config {
            file: self.path.clone(),
            message,
        }
    }

    fn check(&self) -> Result<(), CheckpointError> {
        match self.raw.get("architectures") {
            None if self.raw.get("model_type").is_some_and(Value::is_string) => {}
            None => return Err(self.bad(
                "field `architectures` is missing (and there is no `model_type` to fall back on)"
                    .into(),
            )),
            Some(Value::Array(a))
                if !a.is_empty() && a.iter().all(|v| v.as_str().is_some_and(|s| !s.is_empty())) => {
            }
            Some(v) => {
                return Err(self.bad(format!(
                    "field `architectures` must be a non-empty list of names, found {v}"
                )));
            }
        }
        for field in [
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_hidden_layers",
            "vocab_size",
        ] {
            self.usize_field(field)?;
        }
        if let (Some(h), Some(n)) = (
            self.usize_field("hidden_size")?,
            self.usize_field("num_attention_heads")?,
        ) {
            if n == 0 {
                return Err(self.bad("field `num_attention_heads` is 0".into()));
            }
            if self.usize_field("head_dim")?.is_none() && h % n != 0 {
                return Err(self.bad(format!(
                    "`hidden_size` {h} is not divisible by `num_attention_heads` {n}, and there is no `head_dim`"
                )));
            }
            if let Some(kv) = self.usize_field("num_key_value_heads")?
                && (kv == 0 || n % kv != 0)
            {
                return Err(self.bad(format!(
                    "`num_attention_heads` {n} is not a multiple of `num_key_value_heads` {kv}"
                )));
            }
        }
        if let Some(d) = self.dtype()
            && !matches!(d, "bfloat16" | "float16" | "float32")
        {
            return Err(self.bad(format!(
                "field `torch_dtype` is {d:?}; expected bfloat16, float16 or float32"
            )));
        }
        Ok(())
    }

    /// A non-negative integer field; `Ok(None)` when absent, an error naming the field when it
    /// has another type.
    pub fn usize_field(&self, field: &str) -> Result<Option<usize>, CheckpointError> {
        match self.raw.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.bad(format!(
                    "field `{field}` must be a non-negative integer, found {v}"
                ))
            }),
        }
    }

    /// `architectures[0]`, or `None` when the config names only a `model_type`.
    pub fn architecture(&self) -> Option<&str> {
        self.raw.get("architectures")?.as_array()?.first()?.as_str()
    }

    /// `torch_dtype` (transformers 4) or `dtype` (transformers 5), when given.
    pub fn dtype(&self) -> Option<&str> {
        self.raw
            .get("torch_dtype")
            .or_else(|| self.raw.get("dtype"))
            .and_then(Value::as_str)
    }

    /// The whole object, as read.
    pub fn raw(&self) -> &Map<String, Value> {
        &self.raw
    }

    /// The file it came from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
