//! Input element types: bf16, f16 and f32 weights, read as f32.

use half::{bf16, f16};

/// A floating-point element a kernel reads. Widening to f32 is exact for every implementor.
pub trait Element: bytemuck::Pod + Send + Sync + 'static {
    /// The dtype name as safetensors spells it (`BF16`, `F16`, `F32`).
    const DTYPE: &'static str;
    /// The suffix of this element's GPU kernel names (`bf16`, `f16`, `f32`).
    const KERNEL_SUFFIX: &'static str;
    /// Exact widening.
    fn to_f32(self) -> f32;
    /// Rounds an f32 to this type (round to nearest even) and widens it back: the value a
    /// PyTorch op computing in this dtype would produce.
    fn round_f32(x: f32) -> f32;
    /// Zero (for scratch buffers).
    fn from_f32_zero() -> Self;
    /// Rounds an f32 to this type (round to nearest even).
    fn from_f32(x: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: &'static str = "F32";
    const KERNEL_SUFFIX: &'static str = "f32";
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn round_f32(x: f32) -> f32 {
        x
    }
    fn from_f32_zero() -> Self {
        0.0
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Element for bf16 {
    const DTYPE: &'static str = "BF16";
    const KERNEL_SUFFIX: &'static str = "bf16";
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline]
    fn round_f32(x: f32) -> f32 {
        bf16::from_f32(x).to_f32()
    }
    fn from_f32_zero() -> Self {
        bf16::ZERO
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Element for f16 {
    const DTYPE: &'static str = "F16";
    const KERNEL_SUFFIX: &'static str = "f16";
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn round_f32(x: f32) -> f32 {
        f16::from_f32(x).to_f32()
    }
    fn from_f32_zero() -> Self {
        f16::ZERO
    }
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
