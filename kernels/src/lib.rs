//! kiln's number formats and quantization kernels: FP8, FP4 (NVFP4/MXFP4), E8M0 scales,
//! INT8/INT4, each with a scalar reference and SIMD / CUDA / Metal implementations.
//!
//! Kernels know nothing of models, files or registries; exporters call them. The formats
//! and operations land with the kernels issue (see `../shared/docs/FORMATS.md`); until then
//! this crate only reserves its place in the workspace.
//!
//! ```
//! assert!(!kiln_kernels::VERSION.is_empty());
//! ```

/// This crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
