//! Stand-in for Metal kernels: kiln has none yet (nothing here can build or test them). The
//! place is kept so a `metal` implementation slots in beside `cuda`; until then every call is a
//! named error.

use crate::error::KernelError;

/// The Metal kernels (not implemented).
pub struct MetalKernels {
    _private: (),
}

impl MetalKernels {
    /// Always an error: kiln has no Metal kernels in this build.
    pub fn new(_ordinal: usize) -> Result<Self, KernelError> {
        Err(KernelError::DeviceUnavailable {
            device: "metal",
            reason: "kiln was built without Metal kernels (not implemented yet)".into(),
        })
    }
}
