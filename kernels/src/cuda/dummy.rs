//! Stand-in for the CUDA kernels when kiln-kernels is built without feature `cuda`: the same
//! API, each call a named error (candle's `dummy_cuda` pattern), so callers never need `cfg`.

use crate::element::Element;
use crate::error::KernelError;

fn not_built() -> KernelError {
    KernelError::DeviceUnavailable {
        device: "cuda",
        reason: "kiln was built without the `cuda` feature".into(),
    }
}

/// Always an error: built without `cuda`.
pub fn nvrtc_available() -> Result<(), KernelError> {
    Err(not_built())
}

/// Always an error: built without `cuda`.
pub fn driver_available() -> Result<(), KernelError> {
    Err(not_built())
}

/// The CUDA kernels (unavailable in this build).
pub struct CudaKernels {
    _private: (),
}

impl CudaKernels {
    /// Always an error: built without `cuda`.
    pub fn new(_ordinal: usize) -> Result<Self, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn amax<T: Element>(&self, _x: &[T]) -> Result<f32, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_fp8_per_tensor<T: Element>(
        &self,
        _w: &[T],
        _scale: f32,
        _out: &mut [u8],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_nvfp4<T: Element>(
        &self,
        _w: &[T],
        _shape: &[usize],
        _ws2: f32,
        _p: &mut [u8],
        _s: &mut [u8],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
}
