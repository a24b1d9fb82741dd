//! Number formats with exact conversions: FP8 (E4M3FN, E5M2), FP4 (E2M1 under the NVFP4 and
//! MXFP4 rounding rules), E8M0 scales. Each format's conversion here is the readable scalar
//! reference the SIMD and GPU kernels are tested against; docs/FORMATS.md defines the rules.

pub mod e8m0;
pub mod fp4;
pub mod fp8;
pub mod minifloat;

/// What a conversion does with a finite value beyond the format's largest finite value
/// (after rounding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overflow {
    /// Clamp to ±max (and ±Inf to ±max). ModelOpt clamps before casting where it saturates.
    Saturate,
    /// Become ±Inf where the format has one (E5M2), else NaN (E4M3FN) — PyTorch's and
    /// ml_dtypes' cast.
    NonSaturating,
}
