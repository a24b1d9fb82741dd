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
pub mod linalg;
pub mod mlx;
pub mod mx;
pub mod nvfp4;
pub mod optim;
pub mod packed_matmul;

/// Rounds to the nearest integer, ties to even: `x.round_ties_even()`, bit for bit for every
/// f32 (the sign of a zero result included), without the libm call that `round_ties_even`
/// compiles to on x86-64 targets without SSE4.1 (the default): for |x| < 2²², adding 1.5·2²³
/// lands in [2²³, 2²⁴), where f32's spacing is 1, so IEEE addition rounds to the nearest
/// integer, ties to even (1.5·2²³ is even), and the subtraction is exact; the result takes
/// `x`'s sign, as rounding never changes it (−0.4 → −0). Larger values, infinities and NaN take
/// `round_ties_even` itself.
#[inline]
pub fn round_half_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        ((x + MAGIC) - MAGIC).copysign(x)
    } else {
        x.round_ties_even()
    }
}

#[cfg(test)]
mod round_tests {
    use proptest::prelude::*;

    fn same(x: f32) -> bool {
        let (a, b) = (super::round_half_even(x), x.round_ties_even());
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn round_half_even_is_round_ties_even_at_the_edges() {
        let mut edges = vec![
            0.0f32,
            -0.0,
            0.5,
            1.5,
            2.5,
            0.49999997,
            4_194_303.5,
            4_194_304.0,
            4_194_304.5,
            8_388_607.5,
            8_388_608.0,
            12_582_912.0,
            f32::MIN_POSITIVE,
            1e-45,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
        ];
        edges.extend(edges.clone().iter().map(|v| -v));
        for i in -600..600 {
            edges.push(i as f32 * 0.25);
        }
        for x in edges {
            assert!(same(x), "{x}");
        }
    }

    proptest! {
        #[test]
        fn round_half_even_is_round_ties_even(bits in any::<u32>(), small in -300.0f32..300.0) {
            prop_assert!(same(f32::from_bits(bits)), "{}", f32::from_bits(bits));
            prop_assert!(same(small), "{small}");
        }
    }
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
