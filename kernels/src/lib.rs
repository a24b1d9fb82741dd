//! kiln's number formats and quantization kernels: FP8, FP4 (NVFP4/MXFP4), E8M0 scales,
//! INT8/INT4, each with a scalar reference and SIMD / CUDA implementations, and MLX's own
//! layouts (affine, mxfp4, mxfp8, nvfp4) with MLX as the Metal backend.
//!
//! Kernels know nothing of models, files or registries; exporters call them. The exact
//! rounding of every format follows `docs/FORMATS.md`.
//!
//! ```
//! use kiln_kernels::formats::{Overflow, fp8};
//!
//! assert_eq!(fp8::f32_to_e4m3(448.0, Overflow::NonSaturating), 0x7e);
//! assert_eq!(fp8::e4m3_to_f32(0x7e), 448.0);
//! ```

#![warn(missing_docs)]

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(not(feature = "cuda"))]
#[path = "cuda/dummy.rs"]
pub mod cuda;
pub mod device;
pub mod element;
pub mod error;
pub mod formats;
pub mod layout;
pub mod metal;
#[cfg(feature = "mlx")]
pub mod mlx;
#[cfg(not(feature = "mlx"))]
#[path = "mlx/dummy.rs"]
pub mod mlx;
pub mod ops;

pub use device::Device;
pub use element::Element;
pub use error::KernelError;

/// This crate's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
