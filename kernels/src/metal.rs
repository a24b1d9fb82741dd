//! The Metal path of kiln's kernels: MLX's quantize operation on the Apple GPU
//! ([`crate::mlx`], feature `mlx`). It offers MLX's own layouts (affine, `mxfp4`, `mxfp8`,
//! `nvfp4`); the ModelOpt formats stay on the CPU and CUDA kernels, because MLX rounds them
//! differently (docs/MLX.md "Quantization on MLX").
//!
//! Without the `mlx` feature, or on a machine where MLX sees no Metal GPU (Linux), every call is
//! a named error; on Linux the same MLX operations run on MLX's CPU device
//! (`MlxKernels::cpu()`).

use crate::element::Element;
use crate::error::KernelError;
use crate::mlx::MlxKernels;
use crate::ops::mlx::{Affine, FpMode};

/// The Metal kernels (MLX on the GPU).
pub struct MetalKernels {
    mlx: MlxKernels,
}

impl MetalKernels {
    /// MLX on the Metal GPU `ordinal` (MLX drives one GPU: only 0).
    pub fn new(ordinal: usize) -> Result<Self, KernelError> {
        if !cfg!(feature = "mlx") {
            return Err(KernelError::DeviceUnavailable {
                device: "metal",
                reason: "kiln was built without the `mlx` feature (MLX is kiln's Metal backend)"
                    .into(),
            });
        }
        if ordinal != 0 {
            return Err(KernelError::DeviceUnavailable {
                device: "metal",
                reason: format!("MLX drives one GPU (metal:0), not metal:{ordinal}"),
            });
        }
        Ok(MetalKernels {
            mlx: MlxKernels::gpu()?,
        })
    }

    /// MLX's FP modes on the GPU: see [`MlxKernels::quantize_fp`].
    pub fn quantize_fp<T: Element>(
        &self,
        mode: FpMode,
        w: &[T],
        cols: usize,
        global_amax: Option<f32>,
    ) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        self.mlx.quantize_fp(mode, w, cols, global_amax)
    }

    /// MLX's affine quantization on the GPU: see [`MlxKernels::quantize_affine`].
    pub fn quantize_affine<T: Element>(
        &self,
        w: &[T],
        cols: usize,
        group: usize,
        bits: usize,
    ) -> Result<Affine<T>, KernelError> {
        self.mlx.quantize_affine(w, cols, group, bits)
    }
}
