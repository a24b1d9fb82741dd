//! Which inference engines load each format kiln writes, read from the engines' own source
//! (docs/FORMATS.md §10 cites the file and symbol for every cell): vLLM 0.34, SGLang 0.5.23,
//! TensorRT-LLM (main, PyTorch backend), llama.cpp, mlx-lm 0.32. A writer states its format's
//! support through [`crate::OutputWriter::engines`]; `kiln registry writers` and `kiln
//! export`'s report print it, with the format an engine takes instead where it refuses.

use std::fmt;

/// Whether one engine loads a format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The engine's loader takes it.
    Loads,
    /// The engine refuses it; `instead` is the kiln format it takes (`writer format`), if any.
    Refuses {
        /// `--output-format W --format F` the engine loads instead.
        instead: Option<&'static str>,
    },
    /// The engine's source does not settle it.
    Unsure,
}

/// One engine's support for a format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSupport {
    /// The engine: `vLLM`, `SGLang`, `TensorRT-LLM`, `llama.cpp`, `mlx-lm`.
    pub engine: &'static str,
    /// Whether it loads the format.
    pub support: Support,
}

const fn yes(engine: &'static str) -> EngineSupport {
    EngineSupport {
        engine,
        support: Support::Loads,
    }
}

const fn no(engine: &'static str, instead: Option<&'static str>) -> EngineSupport {
    EngineSupport {
        engine,
        support: Support::Refuses { instead },
    }
}

const fn unsure(engine: &'static str) -> EngineSupport {
    EngineSupport {
        engine,
        support: Support::Unsure,
    }
}

const VLLM: &str = "vLLM";
const SGLANG: &str = "SGLang";
const TRTLLM: &str = "TensorRT-LLM";
const LLAMA_CPP: &str = "llama.cpp";
const MLX_LM: &str = "mlx-lm";

const CT_W4A16: Option<&str> = Some("compressed-tensors w4a16");
const CT_W8A8: Option<&str> = Some("compressed-tensors w8a8");

/// ModelOpt's layout, by kiln's `--format` name.
pub fn modelopt(format: &str) -> Vec<EngineSupport> {
    match format {
        "fp8" | "nvfp4" | "w4a16-nvfp4" | "mxfp8" => vec![yes(VLLM), yes(SGLANG), yes(TRTLLM)],
        "fp8-per-channel" => vec![
            yes(VLLM),
            no(SGLANG, Some("compressed-tensors fp8-dynamic")),
            yes(TRTLLM),
        ],
        "fp8-block" => vec![
            yes(VLLM),
            no(SGLANG, Some("compressed-tensors fp8-block")),
            yes(TRTLLM),
        ],
        "int8-wo" => vec![no(VLLM, None), no(SGLANG, None), yes(TRTLLM)],
        // TensorRT-LLM's TensorRT-engine workflow; its PyTorch backend has no int8-activation
        // Linear.
        "int8-sq" => vec![
            no(VLLM, CT_W8A8),
            no(SGLANG, CT_W8A8),
            yes("TensorRT-LLM (TensorRT engines; not its PyTorch backend)"),
        ],
        "int4-awq" | "w4a8-awq" => vec![no(VLLM, CT_W4A16), no(SGLANG, CT_W4A16), yes(TRTLLM)],
        "nvfp4-awq" => vec![no(VLLM, Some("modelopt nvfp4")), yes(SGLANG), yes(TRTLLM)],
        "mxfp4" => vec![no(VLLM, None), no(SGLANG, None), no(TRTLLM, None)],
        _ => Vec::new(),
    }
}

/// compressed-tensors (llm-compressor's layout), by kiln's `--format` name.
pub fn compressed_tensors(format: &str) -> Vec<EngineSupport> {
    match format {
        "fp8-dynamic" | "fp8-block" | "nvfp4" => vec![yes(VLLM), yes(SGLANG), yes(TRTLLM)],
        "fp8" => vec![
            yes(VLLM),
            yes(SGLANG),
            no(TRTLLM, Some("compressed-tensors fp8-dynamic")),
        ],
        "w8a8" => vec![yes(VLLM), yes(SGLANG), no(TRTLLM, None)],
        "w8a16" => vec![yes(VLLM), yes(SGLANG), no(TRTLLM, Some("modelopt int8-wo"))],
        "w4a16" | "w4a16-asym" => vec![
            yes(VLLM),
            yes(SGLANG),
            no(TRTLLM, Some("modelopt int4-awq")),
        ],
        "nvfp4a16" => vec![yes(VLLM), yes(SGLANG), unsure(TRTLLM)],
        _ => Vec::new(),
    }
}

/// GGUF, by kiln's `--format` name. vLLM's GGUF loader was removed in 0.24.
pub fn gguf(format: &str) -> Vec<EngineSupport> {
    let sglang = if format == "mxfp4-moe" {
        no(SGLANG, None)
    } else {
        yes(SGLANG)
    };
    vec![
        yes(LLAMA_CPP),
        sglang,
        no(VLLM, Some("compressed-tensors w4a16")),
        no(MLX_LM, Some("mlx q4")),
    ]
}

/// mlx-lm's layout (every mode).
pub fn mlx(_format: &str) -> Vec<EngineSupport> {
    vec![
        yes(MLX_LM),
        no(LLAMA_CPP, Some("gguf q4-k-m")),
        no(VLLM, Some("compressed-tensors w4a16")),
    ]
}

/// bitsandbytes' 4-bit layout (transformers' saved `load_in_4bit` checkpoints).
pub fn bnb(_format: &str) -> Vec<EngineSupport> {
    vec![
        yes("transformers + bitsandbytes"),
        unsure(VLLM),
        no(LLAMA_CPP, Some("gguf q4-k-m")),
        no(MLX_LM, Some("mlx q4")),
    ]
}

/// The support as one line: `loads in vLLM, SGLang; not TensorRT-LLM (use …)`.
pub struct Line<'a>(pub &'a [EngineSupport]);

impl fmt::Display for Line<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return write!(f, "engines not stated by the writer");
        }
        let loads: Vec<&str> = self
            .0
            .iter()
            .filter(|s| s.support == Support::Loads)
            .map(|s| s.engine)
            .collect();
        let mut parts = Vec::new();
        parts.push(if loads.is_empty() {
            "no engine loads it".to_string()
        } else {
            format!("loads in {}", loads.join(", "))
        });
        for s in self.0 {
            match s.support {
                Support::Loads => {}
                Support::Refuses { instead: Some(i) } => {
                    parts.push(format!("not {} (use {i})", s.engine))
                }
                Support::Refuses { instead: None } => parts.push(format!("not {}", s.engine)),
                Support::Unsure => parts.push(format!("{} unsure", s.engine)),
            }
        }
        write!(f, "{}", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every format of the four built-in writers states its engines, and each "use instead"
    /// names a writer and a format that writer has.
    #[test]
    fn every_format_states_its_engines_and_alternatives_exist() {
        let registry = crate::WriterRegistry::try_global().unwrap();
        for e in registry.entries() {
            if !["modelopt", "compressed-tensors", "gguf", "mlx"].contains(&e.name.as_ref()) {
                continue;
            }
            for (format, _) in (e.formats)() {
                let w = e.make(format).unwrap();
                let engines = w.engines();
                assert!(!engines.is_empty(), "{} {format}: no engines", e.name);
                for s in engines {
                    if let Support::Refuses { instead: Some(i) } = s.support {
                        let (writer, f) = i.split_once(' ').unwrap();
                        let target = registry.get(writer).unwrap();
                        assert!(
                            (target.formats)().iter().any(|(n, _)| *n == f),
                            "{} {format}: `{i}` is no format",
                            e.name
                        );
                    }
                }
            }
        }
        assert_eq!(
            Line(&modelopt("int4-awq")).to_string(),
            "loads in TensorRT-LLM; not vLLM (use compressed-tensors w4a16); not SGLang (use compressed-tensors w4a16)"
        );
    }
}
