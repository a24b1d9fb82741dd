//! Dense linear algebra for GPTQ: the Cholesky factor of a symmetric positive definite matrix,
//! the inverse of a lower-triangular one (both f64, blocked so that nearly all their work is
//! GEMMs on the lower triangle only: `n³/6` multiply-adds each, as LAPACK's `potrf` and
//! `trtri` do), and `C −= A·B` on strided f32 views (GPTQ's lazy update of the columns after a
//! block). The GEMMs are the `gemm` crate's (candle's CPU GEMM).
//!
//! The scalar routines [`cholesky_unblocked`] and [`invert_lower_unblocked`] are the readable
//! definitions and the blocked routines' diagonal blocks; the blocked results equal them to
//! float rounding (a different summation order), which the tests check.

use rayon::prelude::*;

/// Rows and columns of the diagonal blocks.
pub const BLOCK: usize = 128;

/// A matrix inside a slice: element `(i, j)` at `offset + i·rs + j·cs`.
#[derive(Debug, Clone, Copy)]
struct View {
    offset: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl View {
    fn rows(offset: usize, rows: usize, cols: usize, rs: usize) -> View {
        View {
            offset,
            rows,
            cols,
            rs,
            cs: 1,
        }
    }

    /// The same elements read as the transpose.
    fn t(self) -> View {
        View {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// One past the last element it reaches (`offset` when it is empty).
    fn end(&self) -> usize {
        if self.rows == 0 || self.cols == 0 {
            self.offset
        } else {
            self.offset + (self.rows - 1) * self.rs + (self.cols - 1) * self.cs + 1
        }
    }
}

/// `d[dv] = alpha·d[dv] + beta·l[lv]·r[rv]` (`alpha` ignored unless `read_dst`), one GEMM.
/// `T` is f32 or f64.
#[allow(clippy::too_many_arguments)]
fn gemm_into<T: Copy + 'static>(
    d: &mut [T],
    dv: View,
    l: &[T],
    lv: View,
    r: &[T],
    rv: View,
    read_dst: bool,
    alpha: T,
    beta: T,
    threads: usize,
) {
    assert!(dv.rows == lv.rows && dv.cols == rv.cols && lv.cols == rv.rows);
    assert!(dv.end() <= d.len() && lv.end() <= l.len() && rv.end() <= r.len());
    if dv.rows == 0 || dv.cols == 0 {
        return;
    }
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: every element the three views reach lies within its slice (asserted above: the
    // last one, `end() − 1`, is the largest offset as strides are non-negative); `d` is a
    // unique borrow, so the destination overlaps neither operand; the shapes agree.
    unsafe {
        gemm::gemm(
            dv.rows,
            dv.cols,
            lv.cols,
            d.as_mut_ptr().add(dv.offset),
            dv.cs as isize,
            dv.rs as isize,
            read_dst,
            l.as_ptr().add(lv.offset),
            lv.cs as isize,
            lv.rs as isize,
            r.as_ptr().add(rv.offset),
            rv.cs as isize,
            rv.rs as isize,
            alpha,
            beta,
            false,
            false,
            false,
            par,
        );
    }
}

fn threads() -> usize {
    rayon::current_num_threads().max(1)
}

/// `Σ aᵢbᵢ` with four running sums (so it vectorizes).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut s = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            s[k] += x[k] * y[k];
        }
    }
    let tail: f64 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

/// The lower-triangular `L` with `L Lᵀ = a` (`n × n`, row-major; only the lower triangle of
/// `a` is read), column by column: `L[j][j] = √(a[j][j] − Σₖ L[j][k]²)`, `L[i][j] = (a[i][j] −
/// Σₖ L[i][k] L[j][k]) / L[j][j]`. `None` if `a` is not positive definite (a pivot ≤ 0 or
/// NaN).
pub fn cholesky_unblocked(a: &[f64], n: usize) -> Option<Vec<f64>> {
    assert_eq!(a.len(), n * n);
    let mut l = vec![0f64; n * n];
    for j in 0..n {
        let rest = &mut l[j * n..];
        let row_j: Vec<f64> = rest[..j].to_vec();
        let d = a[j * n + j] - dot(&row_j, &row_j);
        if d.is_nan() || d <= 0.0 {
            return None;
        }
        let d = d.sqrt();
        rest[j] = d;
        for (k, row) in rest[n..].chunks_exact_mut(n).enumerate() {
            let i = j + 1 + k;
            row[j] = (a[i * n + j] - dot(&row[..j], &row_j)) / d;
        }
    }
    Some(l)
}

/// `l⁻¹` for `l` lower triangular (`n × n`, row-major, nonzero diagonal), each column by
/// forward substitution: `X[c][c] = 1 / L[c][c]`, `X[i][c] = −(Σₖ L[i][k] X[k][c]) / L[i][i]`.
pub fn invert_lower_unblocked(l: &[f64], n: usize) -> Vec<f64> {
    assert_eq!(l.len(), n * n);
    let mut out = vec![0f64; n * n];
    let mut x = vec![0f64; n];
    for c in 0..n {
        x.fill(0.0);
        x[c] = 1.0 / l[c * n + c];
        for i in c + 1..n {
            let s = dot(&l[i * n + c..i * n + i], &x[c..i]);
            x[i] = -s / l[i * n + i];
        }
        for i in c..n {
            out[i * n + c] = x[i];
        }
    }
    out
}

/// The square block `[r0, r0 + k)²` of `a` (`n × n`), copied out.
fn block(a: &[f64], n: usize, r0: usize, k: usize) -> Vec<f64> {
    let mut b = Vec::with_capacity(k * k);
    for i in r0..r0 + k {
        b.extend_from_slice(&a[i * n + r0..i * n + r0 + k]);
    }
    b
}

/// [`cholesky_unblocked`] by blocks of [`BLOCK`] (right-looking, as LAPACK's `potrf`): each
/// diagonal block factored by the scalar routine, the panel below it solved against that
/// factor (a GEMM with the block's inverse), and the trailing matrix's lower triangle updated
/// block row by block row (`A₂₂ −= L₂₁ L₂₁ᵀ`, GEMMs in parallel). `a` is overwritten with `L`
/// (the upper triangle zeroed); `false` if it is not positive definite (`a` then holds
/// partial work).
pub fn cholesky_in_place(a: &mut [f64], n: usize) -> bool {
    assert_eq!(a.len(), n * n);
    let mut panel = Vec::new();
    for k0 in (0..n).step_by(BLOCK) {
        let kb = BLOCK.min(n - k0);
        let Some(lkk) = cholesky_unblocked(&block(a, n, k0, kb), kb) else {
            return false;
        };
        for i in 0..kb {
            a[(k0 + i) * n + k0..(k0 + i) * n + k0 + kb]
                .copy_from_slice(&lkk[i * kb..(i + 1) * kb]);
        }
        let r0 = k0 + kb;
        let m = n - r0;
        if m == 0 {
            break;
        }
        // The panel: L₂₁ = A₂₁ L₁₁⁻ᵀ, `[m, kb]`.
        let inv = invert_lower_unblocked(&lkk, kb);
        panel.clear();
        panel.resize(m * kb, 0.0);
        gemm_into(
            &mut panel,
            View::rows(0, m, kb, kb),
            a,
            View::rows(r0 * n + k0, m, kb, n),
            &inv,
            View::rows(0, kb, kb, kb).t(),
            false,
            0.0,
            1.0,
            threads(),
        );
        for (i, p) in panel.chunks_exact(kb).enumerate() {
            a[(r0 + i) * n + k0..(r0 + i) * n + k0 + kb].copy_from_slice(p);
        }
        // The trailing lower triangle, one block row at a time: rows [i0, i0 + ib) take
        // columns [r0, i0 + ib) of −L₂₁ L₂₁ᵀ.
        let panel = &panel;
        a[r0 * n..]
            .par_chunks_mut(BLOCK * n)
            .enumerate()
            .for_each(|(b, rows)| {
                let i0 = b * BLOCK;
                let ib = rows.len() / n;
                gemm_into(
                    rows,
                    View::rows(r0, ib, i0 + ib, n),
                    panel,
                    View::rows(i0 * kb, ib, kb, kb),
                    panel,
                    View::rows(0, i0 + ib, kb, kb).t(),
                    true,
                    1.0,
                    -1.0,
                    1,
                );
            });
    }
    for i in 0..n {
        a[i * n + i + 1..(i + 1) * n].fill(0.0);
    }
    true
}

/// [`invert_lower_unblocked`] by blocks of [`BLOCK`]: block row by block row, `X[i][i] =
/// L[i][i]⁻¹` (scalar) and, for each block column `j < i` in parallel, `X[i][j] = −X[i][i] ·
/// Σ_{j ≤ k < i} L[i][k] X[k][j]` (two GEMMs, the sum over the lower triangle only).
pub fn invert_lower(l: &[f64], n: usize) -> Vec<f64> {
    assert_eq!(l.len(), n * n);
    let mut x = vec![0f64; n * n];
    for i0 in (0..n).step_by(BLOCK) {
        let ib = BLOCK.min(n - i0);
        let xii = invert_lower_unblocked(&block(l, n, i0, ib), ib);
        let (done, cur) = x.split_at_mut(i0 * n);
        let done = &*done;
        let offs: Vec<(usize, Vec<f64>)> = (0..i0)
            .step_by(BLOCK)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|j0| {
                let jb = BLOCK.min(i0 - j0);
                let mut t = vec![0f64; ib * jb];
                gemm_into(
                    &mut t,
                    View::rows(0, ib, jb, jb),
                    l,
                    View::rows(i0 * n + j0, ib, i0 - j0, n),
                    done,
                    View::rows(j0 * n + j0, i0 - j0, jb, n),
                    false,
                    0.0,
                    1.0,
                    1,
                );
                let mut out = vec![0f64; ib * jb];
                gemm_into(
                    &mut out,
                    View::rows(0, ib, jb, jb),
                    &xii,
                    View::rows(0, ib, ib, ib),
                    &t,
                    View::rows(0, ib, jb, jb),
                    false,
                    0.0,
                    -1.0,
                    1,
                );
                (j0, out)
            })
            .collect();
        for (j0, out) in offs {
            let jb = out.len() / ib;
            for r in 0..ib {
                cur[r * n + j0..r * n + j0 + jb].copy_from_slice(&out[r * jb..(r + 1) * jb]);
            }
        }
        for r in 0..ib {
            cur[r * n + i0..r * n + i0 + ib].copy_from_slice(&xii[r * ib..(r + 1) * ib]);
        }
    }
    x
}

/// `c[:, c0 .. c0 + n] −= a · b[:, b0 .. b0 + n]` in f32, one threaded GEMM: `c` has rows of
/// `c_stride` values and `m` rows, `a` is `[m, k]` row-major, `b` has `k` rows of `b_stride`
/// values. The products are accumulated by the GEMM (fused into the destination with
/// `alpha = 1, beta = −1`), PyTorch's `C -= A.matmul(B)` up to the order of the sums.
#[allow(clippy::too_many_arguments)]
pub fn sub_matmul_f32(
    c: &mut [f32],
    c_stride: usize,
    c0: usize,
    m: usize,
    n: usize,
    a: &[f32],
    k: usize,
    b: &[f32],
    b_stride: usize,
    b0: usize,
) {
    gemm_into(
        c,
        View::rows(c0, m, n, c_stride),
        a,
        View::rows(0, m, k, k),
        b,
        View::rows(b0, k, n, b_stride),
        true,
        1.0,
        -1.0,
        threads(),
    );
}

/// The lower triangle of `xᵀ·x` (`[cols, cols]`, row-major) for `x` `[t, cols]` row-major,
/// f32, into a buffer the caller keeps (GPTQ's per-sample `XᵀX`, 321 MB at 8 960 inputs, is
/// then not allocated and faulted in afresh for every sample). As BLAS's `ssyrk`, only half
/// the products are computed: block row by block row of [`BLOCK`] rows, `out[i₀ .. i₀ + b,
/// 0 .. i₀ + b] = x[:, i₀ .. i₀ + b]ᵀ · x[:, 0 .. i₀ + b]` (one GEMM each, in parallel). Every
/// `(i, j)` with `j < (⌊i / BLOCK⌋ + 1)·BLOCK` is written — the lower triangle and the
/// diagonal blocks — and nothing else, so the values strictly above the diagonal blocks stay
/// what they were; [`mirror_lower`] makes the matrix whole.
pub fn gram_lower_f32(x: &[f32], t: usize, cols: usize, out: &mut [f32]) {
    assert_eq!(x.len(), t * cols);
    assert_eq!(out.len(), cols * cols);
    out.par_chunks_mut(BLOCK * cols.max(1))
        .enumerate()
        .for_each(|(b, rows)| {
            let i0 = b * BLOCK;
            let ib = rows.len() / cols;
            gemm_into(
                rows,
                View::rows(0, ib, i0 + ib, cols),
                x,
                View::rows(i0, t, ib, cols).t(),
                x,
                View::rows(0, t, i0 + ib, cols),
                false,
                0.0,
                1.0,
                1,
            );
        });
}

/// Copies the lower triangle of `a` (`[n, n]`, row-major) onto its upper triangle: `a[i][j] =
/// a[j][i]` for `j > i`. In tiles, in parallel over the tiles' rows.
pub fn mirror_lower<T: Copy + Send + Sync>(a: &mut [T], n: usize) {
    assert_eq!(a.len(), n * n);
    const TILE: usize = 64;
    if n == 0 {
        return;
    }
    // Row block r's upper part (columns past its own rows) comes from the columns of the
    // later row blocks: read them from a copy of the lower triangle, column tile by column
    // tile.
    let src: Vec<T> = a.to_vec();
    a.par_chunks_mut(TILE * n)
        .enumerate()
        .for_each(|(rb, rows)| {
            let i0 = rb * TILE;
            let ib = rows.len() / n;
            for j0 in (i0..n).step_by(TILE) {
                let jb = TILE.min(n - j0);
                for i in 0..ib {
                    let row = &mut rows[i * n..(i + 1) * n];
                    for j in j0.max(i0 + i + 1)..j0 + jb {
                        row[j] = src[j * n + i0 + i];
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) - 0.5
    }

    /// `M Mᵀ / n + δ I` for a random `M`: symmetric positive definite.
    fn spd(n: usize, seed: u64) -> Vec<f64> {
        let mut seed = seed;
        let m: Vec<f64> = (0..n * n).map(|_| lcg(&mut seed)).collect();
        let mut a = vec![0f64; n * n];
        for i in 0..n {
            for j in 0..=i {
                let v = dot(&m[i * n..(i + 1) * n], &m[j * n..(j + 1) * n]) / n as f64;
                a[i * n + j] = v;
                a[j * n + i] = v;
            }
            a[i * n + i] += 0.01;
        }
        a
    }

    fn max_diff(a: &[f64], b: &[f64]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    }

    /// Sizes around the block: one block, a block and one, several with a ragged end.
    const SIZES: [usize; 6] = [1, 7, BLOCK, BLOCK + 1, 2 * BLOCK + 37, 3 * BLOCK];

    #[test]
    fn blocked_cholesky_equals_the_column_by_column_one() {
        for (s, n) in SIZES.into_iter().enumerate() {
            let a = spd(n, s as u64 + 1);
            let want = cholesky_unblocked(&a, n).unwrap();
            let mut got = a.clone();
            assert!(cholesky_in_place(&mut got, n), "n = {n}");
            assert!(max_diff(&got, &want) < 1e-12, "n = {n}");
            // L Lᵀ = a, and the upper triangle is zero.
            for i in 0..n {
                for j in 0..n {
                    let v = dot(&got[i * n..i * n + n], &got[j * n..j * n + n]);
                    assert!((v - a[i * n + j]).abs() < 1e-12, "n = {n} ({i}, {j})");
                    if j > i {
                        assert_eq!(got[i * n + j], 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn blocked_cholesky_refuses_what_is_not_positive_definite() {
        for n in [3, BLOCK + 5, 2 * BLOCK + 3] {
            let mut a = spd(n, 9);
            // A negative pivot in the last block.
            a[(n - 1) * n + n - 1] = -1.0;
            assert!(cholesky_unblocked(&a, n).is_none());
            assert!(!cholesky_in_place(&mut a.clone(), n), "n = {n}");
            let mut nan = spd(n, 9);
            nan[n / 2 * n + n / 2] = f64::NAN;
            assert!(!cholesky_in_place(&mut nan, n), "n = {n}");
        }
    }

    #[test]
    fn blocked_inverse_equals_forward_substitution() {
        for (s, n) in SIZES.into_iter().enumerate() {
            let l = cholesky_unblocked(&spd(n, s as u64 + 20), n).unwrap();
            let want = invert_lower_unblocked(&l, n);
            let got = invert_lower(&l, n);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            assert!(max_diff(&got, &want) <= 1e-12 * scale, "n = {n}");
            // L X = I.
            for i in 0..n {
                for j in 0..n {
                    let v: f64 = (0..n).map(|k| l[i * n + k] * got[k * n + j]).sum();
                    let e = if i == j { 1.0 } else { 0.0 };
                    assert!((v - e).abs() < 1e-9, "n = {n} ({i}, {j}): {v}");
                    if j > i {
                        assert_eq!(got[i * n + j], 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn sub_matmul_subtracts_the_product_of_strided_blocks() {
        let mut seed = 5;
        let (m, k, n, cs, bs) = (5, 3, 4, 11, 9);
        let mut c: Vec<f32> = (0..m * cs).map(|_| lcg(&mut seed) as f32).collect();
        let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) as f32).collect();
        let b: Vec<f32> = (0..k * bs).map(|_| lcg(&mut seed) as f32).collect();
        let before = c.clone();
        sub_matmul_f32(&mut c, cs, 6, m, n, &a, k, &b, bs, 2);
        for i in 0..m {
            for j in 0..cs {
                let want = if (6..6 + n).contains(&j) {
                    let p: f64 = (0..k)
                        .map(|q| f64::from(a[i * k + q]) * f64::from(b[q * bs + 2 + j - 6]))
                        .sum();
                    f64::from(before[i * cs + j]) - p
                } else {
                    f64::from(before[i * cs + j])
                };
                assert!((f64::from(c[i * cs + j]) - want).abs() < 1e-6, "({i}, {j})");
            }
        }
    }

    #[test]
    fn the_lower_gram_is_the_products_lower_triangle() {
        let mut seed = 8;
        for (t, cols) in [
            (1, 1),
            (5, 3),
            (37, BLOCK),
            (300, BLOCK + 9),
            (70, 2 * BLOCK + 5),
        ] {
            let x: Vec<f32> = (0..t * cols).map(|_| lcg(&mut seed) as f32).collect();
            let mut out = vec![f32::NAN; cols * cols];
            gram_lower_f32(&x, t, cols, &mut out);
            for i in 0..cols {
                for j in 0..cols {
                    let v = out[i * cols + j];
                    if j < (i / BLOCK + 1) * BLOCK {
                        let want: f64 = (0..t)
                            .map(|r| f64::from(x[r * cols + i]) * f64::from(x[r * cols + j]))
                            .sum();
                        assert!((f64::from(v) - want).abs() < 1e-4, "{t}x{cols} ({i}, {j})");
                    } else {
                        assert!(v.is_nan(), "{t}x{cols} ({i}, {j}) written");
                    }
                }
            }
            mirror_lower(&mut out, cols);
            for i in 0..cols {
                for j in 0..cols {
                    assert_eq!(
                        out[i * cols + j].to_bits(),
                        out[j * cols + i].to_bits(),
                        "{t}x{cols} ({i}, {j})"
                    );
                }
            }
        }
    }

    #[test]
    fn mirroring_keeps_the_lower_triangle() {
        for n in [1, 2, 63, 64, 65, 200] {
            let mut a: Vec<u32> = (0..(n * n) as u32).collect();
            mirror_lower(&mut a, n);
            for i in 0..n {
                for j in 0..n {
                    let want = if j <= i { i * n + j } else { j * n + i };
                    assert_eq!(a[i * n + j] as usize, want, "n = {n} ({i}, {j})");
                }
            }
        }
    }
}
