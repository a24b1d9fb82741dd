//! What the kernel benchmarks share: the input and the sizes.

use half::bf16;

/// A deterministic, roughly normal spread with an outlier every 997 elements (no
/// allocation-heavy RNG needed).
pub fn weights(n: usize) -> Vec<bf16> {
    (0..n)
        .map(|i| {
            let u =
                ((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((u - 0.5) * 0.1 + if i % 997 == 0 { 0.8 } else { 0.0 })
        })
        .collect()
}

/// Matrix sides from `KILN_BENCH_SIZES` (comma-separated), else `default`.
pub fn sizes(default: &[usize]) -> Vec<usize> {
    match std::env::var("KILN_BENCH_SIZES") {
        Ok(s) => s.split(',').filter_map(|v| v.trim().parse().ok()).collect(),
        Err(_) => default.to_vec(),
    }
}
