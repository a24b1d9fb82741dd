//! Matrix products with a weight that stays packed: QLoRA's frozen base. A quantized Linear's
//! weight `W [n, k]` is held in its format's own layout ([`PackedRows`]); each product decodes
//! it a tile of rows at a time into a small f32 buffer and multiplies that tile, so the f32
//! weight never exists whole:
//!
//! - [`matmul_wt`]: `y [m, n] = x [m, k] · Wᵀ` (the Linear's forward), tiles in parallel, each
//!   writing its own columns of `y`;
//! - [`matmul_w`]: `dx [m, k] = dy [m, n] · W` (its backward with respect to the input), tiles
//!   in turn, each product threaded.
//!
//! The values are exactly the format's decoded weights (the decode is the format's own, the
//! products f32 GEMMs), so a packed Linear computes what the decoded dense one computes, up to
//! the summation order of the GEMM.

use crate::KernelError;
use crate::error::check_len;
use rayon::prelude::*;

/// A weight `[rows, cols]` kept in a packed layout, decoded a range of rows at a time.
pub trait PackedRows: Send + Sync + std::fmt::Debug {
    /// Output features `n`.
    fn rows(&self) -> usize;
    /// Input features `k`.
    fn cols(&self) -> usize;
    /// A tile's rows must be a multiple of this (layouts that pack along the rows: two rows a
    /// byte in ModelOpt's INT4, eight a word in packed zero points).
    fn row_align(&self) -> usize {
        1
    }
    /// Decodes rows `start .. start + out.len() / cols` into `out` (row-major f32); `start`
    /// and the count are multiples of [`PackedRows::row_align`] (the count may end at `rows`).
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), KernelError>;
    /// Bytes the packed weight holds.
    fn packed_bytes(&self) -> usize;
}

/// A plain f32 matrix as [`PackedRows`] (tests, and weights a format leaves unquantized).
#[derive(Debug, Clone)]
pub struct DenseRows {
    values: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl DenseRows {
    /// `values` row-major `[rows, cols]`.
    pub fn new(values: Vec<f32>, rows: usize, cols: usize) -> Result<Self, KernelError> {
        check_len(
            "DenseRows",
            "values",
            values.len(),
            rows * cols,
            &[rows, cols],
        )?;
        Ok(DenseRows { values, rows, cols })
    }
}

impl PackedRows for DenseRows {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let src = self
            .values
            .get(start * self.cols..start * self.cols + out.len())
            .ok_or_else(|| KernelError::Parameter {
                op: "DenseRows::decode_rows",
                what: format!("rows from {start} past {}", self.rows),
            })?;
        out.copy_from_slice(src);
        Ok(())
    }
    fn packed_bytes(&self) -> usize {
        self.values.len() * 4
    }
}

/// Rows a tile decodes: about 64, a multiple of the layout's alignment.
fn tile_rows(w: &dyn PackedRows) -> usize {
    let a = w.row_align().max(1);
    64usize.div_ceil(a) * a
}

/// `y = x · Wᵀ`: `x [m, k]`, `y [m, n]`, both row-major f32.
pub fn matmul_wt(
    x: &[f32],
    m: usize,
    w: &dyn PackedRows,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let op = "matmul_wt";
    let (n, k) = (w.rows(), w.cols());
    check_len(op, "x", x.len(), m * k, &[m, k])?;
    check_len(op, "y", y.len(), m * n, &[m, n])?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        y.fill(0.0);
        return Ok(());
    }
    let t = tile_rows(w);
    let out = SharedOut(y.as_mut_ptr());
    (0..n.div_ceil(t))
        .into_par_iter()
        .try_for_each(|tile| -> Result<(), KernelError> {
            let r0 = tile * t;
            let tr = t.min(n - r0);
            let mut buf = vec![0f32; tr * k];
            w.decode_rows(r0, &mut buf)?;
            // SAFETY: `y` has `m · n` elements (checked above); this tile writes only columns
            // `r0 .. r0 + tr` of it, which no other tile writes, and `y` outlives the loop. The
            // operands are read as `[m, k]` (`x`, row stride k) and `[k, tr]` (the tile, row
            // stride 1, column stride k), both within their lengths.
            unsafe {
                gemm::gemm(
                    m,
                    tr,
                    k,
                    out.get().add(r0),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    buf.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            Ok(())
        })
}

/// `dx = dy · W`: `dy [m, n]`, `dx [m, k]`, both row-major f32.
pub fn matmul_w(
    dy: &[f32],
    m: usize,
    w: &dyn PackedRows,
    dx: &mut [f32],
) -> Result<(), KernelError> {
    let op = "matmul_w";
    let (n, k) = (w.rows(), w.cols());
    check_len(op, "dy", dy.len(), m * n, &[m, n])?;
    check_len(op, "dx", dx.len(), m * k, &[m, k])?;
    dx.fill(0.0);
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    let t = tile_rows(w);
    let threads = rayon::current_num_threads().max(1);
    let mut buf = vec![0f32; t * k];
    for r0 in (0..n).step_by(t) {
        let tr = t.min(n - r0);
        let tile = &mut buf[..tr * k];
        w.decode_rows(r0, tile)?;
        // SAFETY: `dx` is `[m, k]` (checked), `dy`'s columns `r0 .. r0 + tr` are read with row
        // stride n, the tile as `[tr, k]` row-major; every pointer stays within its slice.
        unsafe {
            gemm::gemm(
                m,
                k,
                tr,
                dx.as_mut_ptr(),
                1,
                k as isize,
                true,
                dy.as_ptr().add(r0),
                1,
                n as isize,
                tile.as_ptr(),
                1,
                k as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(threads),
            );
        }
    }
    Ok(())
}

/// A raw output pointer shared by tiles that write disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

impl SharedOut {
    fn get(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: the pointer is only written through by tiles whose column ranges are disjoint
// (see `matmul_wt`), and the slice it points into outlives every use.
unsafe impl Send for SharedOut {}
// SAFETY: as above; no two threads write the same element.
unsafe impl Sync for SharedOut {}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// A dense matrix whose tiles must be whole pairs of rows (as ModelOpt's INT4).
    #[derive(Debug)]
    struct Paired(DenseRows);

    impl PackedRows for Paired {
        fn rows(&self) -> usize {
            self.0.rows
        }
        fn cols(&self) -> usize {
            self.0.cols
        }
        fn row_align(&self) -> usize {
            2
        }
        fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), KernelError> {
            assert_eq!(start % 2, 0, "tile start {start} splits a pair");
            let rows = out.len() / self.0.cols;
            assert!(rows.is_multiple_of(2) || start + rows == self.0.rows);
            self.0.decode_rows(start, out)
        }
        fn packed_bytes(&self) -> usize {
            self.0.packed_bytes()
        }
    }

    #[test]
    fn packed_products_equal_the_textbook_ones() {
        for (m, n, k) in [
            (1, 1, 1),
            (3, 130, 7),
            (17, 64, 33),
            (5, 129, 64),
            (0, 4, 4),
        ] {
            let mut seed = (m * 1000 + n * 10 + k) as u64;
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let wv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
            let dy: Vec<f32> = (0..m * n).map(|_| lcg(&mut seed)).collect();
            let w = Paired(DenseRows::new(wv.clone(), n, k).unwrap());
            let mut y = vec![f32::NAN; m * n];
            matmul_wt(&x, m, &w, &mut y).unwrap();
            let mut dx = vec![f32::NAN; m * k];
            matmul_w(&dy, m, &w, &mut dx).unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|c| f64::from(x[i * k + c]) * f64::from(wv[j * k + c]))
                        .sum();
                    let got = f64::from(y[i * n + j]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "y[{i},{j}]"
                    );
                }
                for c in 0..k {
                    let want: f64 = (0..n)
                        .map(|j| f64::from(dy[i * n + j]) * f64::from(wv[j * k + c]))
                        .sum();
                    let got = f64::from(dx[i * k + c]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "dx[{i},{c}]"
                    );
                }
            }
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let w = DenseRows::new(vec![0.0; 6], 2, 3).unwrap();
        assert!(matmul_wt(&[0.0; 5], 2, &w, &mut [0.0; 4]).is_err());
        assert!(matmul_w(&[0.0; 4], 2, &w, &mut [0.0; 5]).is_err());
        assert!(DenseRows::new(vec![0.0; 5], 2, 3).is_err());
    }
}
