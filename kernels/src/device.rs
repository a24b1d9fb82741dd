//! Where a kernel runs. One enum picks the implementation; a device without an implementation
//! (or built without its feature) is a named error, so callers never sprinkle `cfg`.

use crate::error::KernelError;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The CPU: SIMD chosen at run time, rayon over rows.
    Cpu,
    /// An NVIDIA GPU by ordinal (feature `cuda`).
    Cuda(usize),
    /// An Apple GPU through MLX (feature `mlx`; MLX's layouts only).
    Metal(usize),
}

impl Device {
    /// Checks that the device can run kernels here, with the reason when it cannot.
    pub fn check(self) -> Result<(), KernelError> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(i) => crate::cuda::CudaKernels::new(i).map(|_| ()),
            Device::Metal(i) => crate::metal::MetalKernels::new(i).map(|_| ()),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    /// `cpu`, `cuda`, `cuda:N`, `metal`, `metal:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, index) = s.split_once(':').map_or((s, None), |(k, i)| (k, Some(i)));
        let index = match index {
            None => 0,
            Some(i) => i
                .parse()
                .map_err(|_| format!("device `{s}`: `{i}` is not a device index"))?,
        };
        match kind {
            "cpu" if index == 0 => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(index)),
            "metal" => Ok(Device::Metal(index)),
            _ => Err(format!(
                "unknown device `{s}` (expected cpu, cuda[:N] or metal[:N])"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_reports_unbuilt_devices_by_name() {
        assert_eq!("cuda:1".parse::<Device>(), Ok(Device::Cuda(1)));
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert!(
            "tpu"
                .parse::<Device>()
                .unwrap_err()
                .contains("unknown device `tpu`")
        );
        assert!("cuda:x".parse::<Device>().is_err());
        assert!(Device::Cpu.check().is_ok());
        if !cfg!(feature = "mlx") {
            assert_eq!(
                Device::Metal(0).check().unwrap_err().to_string(),
                "metal is not available: kiln was built without the `mlx` feature (MLX is \
                 kiln's Metal backend)"
            );
        } else if !crate::mlx::metal_available() {
            let e = Device::Metal(0).check().unwrap_err().to_string();
            assert!(e.contains("MLX sees no Metal GPU"), "{e}");
        }
        if !cfg!(feature = "cuda") {
            assert_eq!(
                Device::Cuda(0).check().unwrap_err().to_string(),
                "cuda is not available: kiln was built without the `cuda` feature"
            );
        }
    }
}
