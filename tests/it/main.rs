//! kiln's integration tests that share one process: one binary, linked once (candle and the
//! whole runtime are large; sixteen binaries each linked them). Each file is a module; filter
//! by it (`cargo test --test it compat::`).
//!
//! Not here, each its own binary: `registry_rules.rs` and `invalid_registry.rs` register
//! exporters, writers and trainers of their own into the process's registries (in one
//! process with the others they would change every export); `memory.rs` reads a child's peak
//! memory with nothing else running beside it; `faults.rs` kills and starves processes.

mod common;

mod bad_input;
mod bnb;
mod cli;
mod compat;
mod compressed_tensors;
mod eval_text;
mod forward;
mod fuzz_smoke;
mod gguf;
mod gguf_export;
mod gguf_imatrix;
mod gptq;
mod layers;
mod mlx_export;
mod qlora;
mod train;
mod train_cli;
mod train_e2e;
