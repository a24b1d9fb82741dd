//! Quantization error for the report: per format, the max and mean absolute error of the
//! dequantized weights against the originals, computed without materializing the dequantized
//! tensor (weights can be hundreds of millions of elements).

use kiln_kernels::Element;
use rayon::prelude::*;

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
    pub fn measure<T: Element>(w: &[T], dequant: impl Fn(usize) -> f32 + Sync) -> ErrorStats {
        const CHUNK: usize = 1 << 16;
        w.par_chunks(CHUNK)
            .enumerate()
            .map(|(c, chunk)| {
                let mut s = ErrorStats::default();
                for (j, x) in chunk.iter().enumerate() {
                    let x = x.to_f32();
                    if !x.is_finite() {
                        continue;
                    }
                    let e = f64::from((x - dequant(c * CHUNK + j)).abs());
                    if e.is_finite() {
                        s.max_abs = s.max_abs.max(e);
                        s.sum_abs += e;
                        s.count += 1;
                    }
                }
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
