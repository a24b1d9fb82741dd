//! The quantization operations, as readable scalar code: the ground truth every faster path
//! (SIMD, CUDA) is tested against, bit for bit. Layouts are row-major `[rows, cols]`, or
//! `[experts, rows, cols]` where stated; blocks run along `cols` (the input dimension K)
//! unless a function says otherwise. The formulas and their arithmetic order are docs/FORMATS.md's.

pub mod amax;
pub mod bf16_matmul;
pub mod bnb;
mod bnb_tables;
pub mod fp8;
pub mod fused;
pub mod fused_bf16;
pub mod gguf;
pub mod int;
pub mod mlx;
pub mod mx;
pub mod nvfp4;
pub mod optim;
pub mod packed_matmul;

/// Rounds to the nearest integer, ties to even (f32; exact for every f32).
#[inline]
pub fn round_half_even(x: f32) -> f32 {
    x.round_ties_even()
}

/// Deterministic test values shared by the kernels' unit tests.
#[cfg(test)]
pub(crate) mod test_values {
    /// The next value of a 64-bit LCG in `[-1, 1)`.
    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
