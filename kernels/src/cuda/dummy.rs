//! Stand-in for the CUDA kernels when kiln-kernels is built without feature `cuda`: the same
//! API, each call a named error (candle's `dummy_cuda` pattern), so callers never need `cfg`.

use crate::element::Element;
use crate::error::KernelError;
use std::marker::PhantomData;

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

/// Elements on a GPU (none exist in this build).
pub struct DeviceSlice<T> {
    _element: PhantomData<T>,
}

impl<T: bytemuck::Pod> DeviceSlice<T> {
    /// The number of elements.
    pub fn len(&self) -> usize {
        0
    }
    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        true
    }
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
    pub fn device_name(&self) -> Result<String, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn upload<T: bytemuck::Pod>(&self, _x: &[T]) -> Result<DeviceSlice<T>, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn zeros<T: bytemuck::Pod>(&self, _len: usize) -> Result<DeviceSlice<T>, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn download_into<T: bytemuck::Pod>(
        &self,
        _x: &DeviceSlice<T>,
        _out: &mut [T],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn download<T: bytemuck::Pod>(&self, _x: &DeviceSlice<T>) -> Result<Vec<T>, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn copy_on_device<T: bytemuck::Pod>(
        &self,
        _src: &DeviceSlice<T>,
        _dst: &mut DeviceSlice<T>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn amax_on_device<T: Element>(
        &self,
        _x: &DeviceSlice<T>,
        _out: &mut DeviceSlice<f32>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn amax<T: Element>(&self, _x: &[T]) -> Result<f32, KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_fp8_per_tensor_on_device<T: Element>(
        &self,
        _w: &DeviceSlice<T>,
        _scale: f32,
        _out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_fp8_f32div_on_device<T: Element>(
        &self,
        _w: &DeviceSlice<T>,
        _scale: f32,
        _out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_nvfp4_on_device<T: Element>(
        &self,
        _w: &DeviceSlice<T>,
        _shape: &[usize],
        _ws2: f32,
        _packed: &mut DeviceSlice<u8>,
        _scales: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_mxfp8_on_device<T: Element>(
        &self,
        _w: &DeviceSlice<T>,
        _cols: usize,
        _q: &mut DeviceSlice<u8>,
        _scales: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_mxfp4_on_device<T: Element>(
        &self,
        _w: &DeviceSlice<T>,
        _cols: usize,
        _packed: &mut DeviceSlice<u8>,
        _scales: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    #[allow(clippy::too_many_arguments)]
    pub fn quantize_int4_groups_on_device<T: Element>(
        &self,
        _w: &DeviceSlice<T>,
        _rows: usize,
        _cols: usize,
        _group: usize,
        _scales: &DeviceSlice<f32>,
        _out: &mut DeviceSlice<u8>,
    ) -> Result<(), KernelError> {
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
    pub fn quantize_fp8_f32div<T: Element>(
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
        _packed: &mut [u8],
        _scales: &mut [u8],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_mxfp8<T: Element>(
        &self,
        _w: &[T],
        _cols: usize,
        _q: &mut [u8],
        _scales: &mut [u8],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_mxfp4<T: Element>(
        &self,
        _w: &[T],
        _cols: usize,
        _packed: &mut [u8],
        _scales: &mut [u8],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn quantize_int4_groups<T: Element>(
        &self,
        _w: &[T],
        _rows: usize,
        _cols: usize,
        _group: usize,
        _scales: &[f32],
        _out: &mut [u8],
    ) -> Result<(), KernelError> {
        Err(not_built())
    }
    /// Unreachable: no `CudaKernels` exists in this build.
    pub fn synchronize(&self) -> Result<(), KernelError> {
        Err(not_built())
    }
}
