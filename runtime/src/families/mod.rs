//! kiln's built-in model families, registered with the same `#[architecture]` users write.
//!
//! A family turns a checkpoint's tensor names into a module tree with the class names
//! transformers gives those modules (`LlamaDecoderLayer`, `Qwen3MoeSparseMoeBlock`,
//! `GptOssExperts`, …), which is what exporters key on. Paths a family does not know are
//! classified generically (a 2-D `weight` is a `Linear`), so a checkpoint with extra modules
//! still exports.

mod decoder;
mod generic;

pub use decoder::{DecoderFamily, MoeLayout};

#[cfg(test)]
mod tests;
