//! Stand-in for the MLX backend when kiln-kernels is built without feature `mlx`: the same
//! API, each call a named error, so callers never need `cfg`.

use crate::element::Element;
use crate::error::KernelError;
use crate::ops::mlx::{Affine, FpMode};

fn not_built() -> KernelError {
    KernelError::DeviceUnavailable {
        device: "mlx",
        reason: "kiln was built without the `mlx` feature".into(),
    }
}

/// Where MLX runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlxDevice {
    /// MLX's CPU device.
    Cpu,
    /// MLX's Metal GPU.
    Gpu,
}

/// Always false: built without `mlx`.
pub fn metal_available() -> bool {
    false
}

/// MLX's quantization operations (unavailable in this build).
pub struct MlxKernels {
    _private: (),
}

impl MlxKernels {
    /// Always an error: built without `mlx`.
    pub fn cpu() -> Result<Self, KernelError> {
        Err(not_built())
    }
    /// Always an error: built without `mlx`.
    pub fn gpu() -> Result<Self, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `MlxKernels` exists in this build.
    pub fn device(&self) -> MlxDevice {
        MlxDevice::Cpu
    }
    /// Unreachable: no `MlxKernels` exists in this build.
    pub fn quantize_fp<T: Element>(
        &self,
        _mode: FpMode,
        _w: &[T],
        _cols: usize,
        _global_amax: Option<f32>,
    ) -> Result<(Vec<u8>, Vec<u8>), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `MlxKernels` exists in this build.
    pub fn quantize_affine<T: Element>(
        &self,
        _w: &[T],
        _cols: usize,
        _group: usize,
        _bits: usize,
    ) -> Result<Affine<T>, KernelError> {
        Err(not_built())
    }
}
