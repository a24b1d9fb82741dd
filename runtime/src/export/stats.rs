//! Quantization error for the report: per format, the max and mean absolute error of the
//! dequantized weights against the originals, computed without materializing the dequantized
//! tensor (weights can be hundreds of millions of elements).

use kiln_kernels::Element;
use rayon::prelude::*;

/// How many values of a tensor's raw little-endian bytes are NaN or ±Inf (BF16, F16, F32,
/// F64 and F8 E4M3; 0 for integer dtypes, which have none).
pub fn nonfinite_in_bytes(dtype: safetensors::Dtype, bytes: &[u8]) -> usize {
    use safetensors::Dtype;
    match dtype {
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .filter(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7F80 == 0x7F80)
            .count(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .filter(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7C00 == 0x7C00)
            .count(),
        Dtype::F32 => bytes
            .chunks_exact(4)
            .filter(|b| !f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite())
            .count(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .filter(|b| !f64::from_le_bytes((*b).try_into().expect("8 bytes")).is_finite())
            .count(),
        // E4M3FN has no infinities; its NaN is S.1111.111.
        Dtype::F8_E4M3 => bytes.iter().filter(|&&b| b & 0x7F == 0x7F).count(),
        Dtype::F8_E5M2 => bytes.iter().filter(|&&b| b & 0x7C == 0x7C).count(),
        _ => 0,
    }
}

/// Absolute-error statistics over many weights.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ErrorStats {
    /// The largest absolute error.
    pub max_abs: f64,
    /// The sum of absolute errors.
    pub sum_abs: f64,
    /// Weights measured.
    pub count: u64,
    /// Modules measured.
    pub modules: u64,
}

impl ErrorStats {
    /// The mean absolute error.
    pub fn mean_abs(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum_abs / self.count as f64
        }
    }

    /// Adds another module's statistics.
    pub fn merge(&mut self, other: &ErrorStats) {
        self.max_abs = self.max_abs.max(other.max_abs);
        self.sum_abs += other.sum_abs;
        self.count += other.count;
        self.modules += other.modules;
    }

    /// The error of one weight: `|w[i] − dequant(i)|` over every finite `w[i]`.
    ///
    /// Errors are summed in f32 over runs of 256 weights, eight independent sums at a time
    /// (an f64 add per weight is a latency chain that costs more than the dequantization), and
    /// the runs in f64.
    pub fn measure<T: Element>(w: &[T], dequant: impl Fn(usize) -> f32 + Sync) -> ErrorStats {
        const CHUNK: usize = 1 << 16;
        const RUN: usize = 256;
        w.par_chunks(CHUNK)
            .enumerate()
            .map(|(c, chunk)| {
                let mut s = ErrorStats::default();
                let mut max = [0f32; 8];
                for (r, run) in chunk.chunks(RUN).enumerate() {
                    let base = c * CHUNK + r * RUN;
                    // Eight lanes: the errors first, then the sums and maxima as whole
                    // arrays (constant indices, so they stay in a vector register).
                    let mut sums = [0f32; 8];
                    let mut count = 0u64;
                    let error = |i: usize, x: T| {
                        let x = x.to_f32();
                        let e = (x - dequant(i)).abs();
                        // Non-finite weights, and errors of NaN codes, are not counted.
                        if x.is_finite() && e.is_finite() {
                            (e, 1)
                        } else {
                            (0.0, 0)
                        }
                    };
                    let eights = run.chunks_exact(8);
                    let tail = eights.remainder();
                    for (k, eight) in eights.enumerate() {
                        let mut e = [0f32; 8];
                        for lane in 0..8 {
                            let (v, n) = error(base + k * 8 + lane, eight[lane]);
                            e[lane] = v;
                            count += n;
                        }
                        for lane in 0..8 {
                            sums[lane] += e[lane];
                            max[lane] = max[lane].max(e[lane]);
                        }
                    }
                    let start = run.len() - tail.len();
                    for (j, &x) in tail.iter().enumerate() {
                        let (v, n) = error(base + start + j, x);
                        sums[j] += v;
                        max[j] = max[j].max(v);
                        count += n;
                    }
                    s.count += count;
                    s.sum_abs += sums.iter().map(|&v| f64::from(v)).sum::<f64>();
                }
                s.max_abs = f64::from(max.iter().fold(0f32, |a, &b| a.max(b)));
                s
            })
            .reduce(ErrorStats::default, |mut a, b| {
                a.merge(&b);
                a
            })
            .with_module()
    }

    fn with_module(mut self) -> Self {
        self.modules = 1;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn measures_max_and_mean_and_skips_non_finite() {
        let w = [1.0f32, -2.0, f32::NAN, 4.0];
        let s = ErrorStats::measure(&w, |i| [1.5, -2.0, 0.0, 3.0][i]);
        assert_eq!((s.max_abs, s.count, s.modules), (1.0, 3, 1));
        assert!((s.mean_abs() - 0.5).abs() < 1e-12);
    }
}
