//! A trained Linear's three products under PyTorch's CPU autocast to bf16 (what TRL's
//! `bf16=True` runs on a CPU): every operand rounded to bf16 (nearest, ties to even), each
//! product summed in f32, each result rounded to bf16. With `y = x · Wᵀ` (`x [m, k]`,
//! `W [n, k]`, `dy [m, n]`):
//!
//! - forward `y = bf16(bf16(x) · bf16(W)ᵀ)`;
//! - input gradient `dx = bf16(bf16(dy) · bf16(W))` (autocast's `linear` keeps its output's
//!   gradient in bf16, and the cast of `x` to bf16 widens `dx` back);
//! - weight gradient `dW = bf16(bf16(dy)ᵀ · bf16(x))` (the cast of the f32 weight to bf16
//!   widens it back into the f32 parameter's gradient).
//!
//! The results are f32 tensors holding bf16 values. Where the CPU has AVX-512 BF16 the three
//! products run on the packed GEMM ([`super::gemm::matmul_bf16_rounded`], `VDPBF16PS`: twice
//! f32 FMA's rate), which rounds each operand to bf16 as it packs it and reads it in its own
//! layout, so nothing is rounded or transposed whole first ([`product_bits`], for operands
//! already held as bf16 bits, runs on [`super::bf16_matmul`]). Elsewhere the bf16 values run through the f32 GEMM, whose products of
//! bf16 values are exact: the same values up to the order of the f32 sums (and
//! `VDPBF16PS`'s flushing of denormals), which the rounding to bf16 mostly absorbs — within
//! one bf16 step of each other, as PyTorch's oneDNN and a reference GEMM are.

use super::bf16_matmul;
use super::gemm::{self, Mat};
use crate::KernelError;
use crate::error::check_len;
use crate::ops::bf16_matmul::check as bf16_matmul_check;
use crate::ops::packed_matmul::dense;
use rayon::prelude::*;

/// Rows transposed per task (output rows of the transpose).
const TILE: usize = 16;
/// Source rows a transpose takes at a time (output values written in one piece).
const SPAN: usize = 64;

/// `v` rounded to the nearest bf16, ties to even, as an f32 (`half`'s rounding, PyTorch's).
#[inline]
pub fn round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// `src` rounded to bf16 bits (nearest, ties to even).
pub fn bits(src: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; src.len()];
    out.par_chunks_mut(1 << 14)
        .zip(src.par_chunks(1 << 14))
        .for_each(|(o, s)| {
            for (o, s) in o.iter_mut().zip(s) {
                *o = half::bf16::from_f32(*s).to_bits();
            }
        });
    out
}

/// `src [rows, cols]` transposed to `[cols, rows]`, each value through `f`: a task per
/// [`TILE`] output rows, each filled [`SPAN`] values at a time through a small tile held in L1
/// (a tile's `TILE` source row pieces read whole, its `TILE` output row pieces written whole).
fn transposed<T: Copy + Sync, U: Copy + Default + Send>(
    src: &[T],
    rows: usize,
    cols: usize,
    f: impl Fn(T) -> U + Sync,
) -> Vec<U> {
    let mut out = vec![U::default(); rows * cols];
    if rows == 0 {
        return out;
    }
    out.par_chunks_mut(TILE * rows)
        .enumerate()
        .for_each(|(t, block)| {
            let c0 = t * TILE;
            let width = block.len() / rows;
            let mut tile = [[U::default(); SPAN]; TILE];
            let mut piece = [U::default(); TILE];
            for r0 in (0..rows).step_by(SPAN) {
                let span = SPAN.min(rows - r0);
                for dr in 0..span {
                    let r = r0 + dr;
                    let row = &src[r * cols + c0..r * cols + c0 + width];
                    // Converted along the row first (in vector lanes), then scattered.
                    for (p, v) in piece.iter_mut().zip(row) {
                        *p = f(*v);
                    }
                    for (t, p) in tile.iter_mut().zip(&piece[..width]) {
                        t[dr] = *p;
                    }
                }
                for (c, t) in tile.iter().enumerate().take(width) {
                    block[c * rows + r0..c * rows + r0 + span].copy_from_slice(&t[..span]);
                }
            }
        });
    out
}

/// `src [rows, cols]` transposed to `[cols, rows]`, each value rounded to bf16 bits.
pub fn bits_t(src: &[f32], rows: usize, cols: usize) -> Vec<u16> {
    transposed(src, rows, cols, |v| half::bf16::from_f32(v).to_bits())
}

/// bf16 bits `src [rows, cols]` transposed to `[cols, rows]`.
pub fn transpose_bits(src: &[u16], rows: usize, cols: usize) -> Vec<u16> {
    transposed(src, rows, cols, |v| v)
}

fn widen(bits: &[u16]) -> Vec<f32> {
    let mut out = vec![0f32; bits.len()];
    out.par_chunks_mut(1 << 14)
        .zip(bits.par_chunks(1 << 14))
        .for_each(|(o, s)| {
            for (o, s) in o.iter_mut().zip(s) {
                *o = f32::from_bits(u32::from(*s) << 16);
            }
        });
    out
}

/// Which unit sums the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `VDPBF16PS` ([`bf16_matmul::matmul_wt`]).
    Bf16Instruction,
    /// The f32 GEMM on the bf16 values.
    F32Gemm,
}

/// The path this CPU takes.
pub fn path() -> Path {
    if bf16_matmul::available() {
        Path::Bf16Instruction
    } else {
        Path::F32Gemm
    }
}

/// `y [m, n] = bf16(a [m, k] · b [n, k]ᵀ)` for bf16 bits `a`, `b` (already rounded, laid out
/// along the summed dimension), on this CPU's [`path`].
pub fn product_bits(
    a: &[u16],
    b: &[u16],
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
) -> Result<(), KernelError> {
    bf16_matmul_check(
        "autocast::product_bits",
        a.len(),
        b.len(),
        y.len(),
        (m, n, k),
    )?;
    product_wt(a, b, (m, n, k), y, path())
}

/// `y [m, n] = bf16(a [m, k] · b [n, k]ᵀ)` for bf16 bits `a`, `b`, on `path`.
fn product_wt(
    a: &[u16],
    b: &[u16],
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    path: Path,
) -> Result<(), KernelError> {
    match path {
        // Rounded by the threads that computed the sums, while they are in cache.
        Path::Bf16Instruction => bf16_matmul::matmul_wt_rounded(a, b, y, (m, n, k)),
        Path::F32Gemm => {
            dense::forward(&widen(a), &widen(b), (m, n, k), y)?;
            y.par_chunks_mut(1 << 14).for_each(|c| {
                for v in c {
                    *v = round(*v);
                }
            });
            Ok(())
        }
    }
}

fn check(
    op: &'static str,
    (a, an): (&'static str, usize),
    (b, bn): (&'static str, usize),
    (o, on): (&'static str, usize),
    dims: [(usize, usize); 3],
) -> Result<(), KernelError> {
    check_len(op, a, an, dims[0].0 * dims[0].1, &[dims[0].0, dims[0].1])?;
    check_len(op, b, bn, dims[1].0 * dims[1].1, &[dims[1].0, dims[1].1])?;
    check_len(op, o, on, dims[2].0 * dims[2].1, &[dims[2].0, dims[2].1])
}

/// `y [m, n] = bf16(bf16(x) · bf16(W)ᵀ)`, `x [m, k]`, `W [n, k]`.
pub fn forward(
    x: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
) -> Result<(), KernelError> {
    forward_on(x, w, (m, n, k), y, path())
}

/// [`forward`] on a given path (tests compare the two).
pub fn forward_on(
    x: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    y: &mut [f32],
    path: Path,
) -> Result<(), KernelError> {
    let op = "autocast::forward";
    check(
        op,
        ("x", x.len()),
        ("w", w.len()),
        ("y", y.len()),
        [(m, k), (n, k), (m, n)],
    )?;
    if path == Path::Bf16Instruction {
        let (a, b) = (Mat::row_major(x, m, k), Mat::row_major(w, n, k).t());
        return gemm::matmul_bf16_rounded(a, b, y);
    }
    product_wt(&bits(x), &bits(w), (m, n, k), y, path)
}

/// `dx [m, k] = bf16(bf16(dy) · bf16(W))`, `dy [m, n]`, `W [n, k]`.
pub fn input_grad(
    dy: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    dx: &mut [f32],
) -> Result<(), KernelError> {
    input_grad_on(dy, w, (m, n, k), dx, path())
}

/// [`input_grad`] on a given path.
pub fn input_grad_on(
    dy: &[f32],
    w: &[f32],
    (m, n, k): (usize, usize, usize),
    dx: &mut [f32],
    path: Path,
) -> Result<(), KernelError> {
    let op = "autocast::input_grad";
    check(
        op,
        ("dy", dy.len()),
        ("w", w.len()),
        ("dx", dx.len()),
        [(m, n), (n, k), (m, k)],
    )?;
    if path == Path::Bf16Instruction {
        let (a, b) = (Mat::row_major(dy, m, n), Mat::row_major(w, n, k));
        return gemm::matmul_bf16_rounded(a, b, dx);
    }
    // dx = dy · W = dy [m, n] · (Wᵀ [k, n])ᵀ.
    product_wt(&bits(dy), &bits_t(w, n, k), (m, k, n), dx, path)
}

/// `dW [n, k] = bf16(bf16(dy)ᵀ · bf16(x))`, `x [m, k]`, `dy [m, n]`.
pub fn weight_grad(
    x: &[f32],
    dy: &[f32],
    (m, n, k): (usize, usize, usize),
    dw: &mut [f32],
) -> Result<(), KernelError> {
    weight_grad_on(x, dy, (m, n, k), dw, path())
}

/// [`weight_grad`] on a given path.
pub fn weight_grad_on(
    x: &[f32],
    dy: &[f32],
    (m, n, k): (usize, usize, usize),
    dw: &mut [f32],
    path: Path,
) -> Result<(), KernelError> {
    let op = "autocast::weight_grad";
    check(
        op,
        ("x", x.len()),
        ("dy", dy.len()),
        ("dw", dw.len()),
        [(m, k), (m, n), (n, k)],
    )?;
    if path == Path::Bf16Instruction {
        let (a, b) = (Mat::row_major(dy, m, n).t(), Mat::row_major(x, m, k));
        return gemm::matmul_bf16_rounded(a, b, dw);
    }
    // dW = dyᵀ · x = (dyᵀ [n, m]) · (xᵀ [k, m])ᵀ.
    product_wt(&bits_t(dy, m, n), &bits_t(x, m, k), (n, k, m), dw, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The readable reference: operands rounded to bf16, the sum in f64 (exact enough to be
    /// the true value), rounded to bf16 once.
    fn reference(a: &[f32], b: &[f32], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                y[i * n + j] = (0..k)
                    .map(|t| f64::from(round(a[i * k + t])) * f64::from(round(b[j * k + t])))
                    .sum();
            }
        }
        y
    }

    fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0f32; v.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = v[r * cols + c];
            }
        }
        t
    }

    /// `got` is a bf16 value within one bf16 step of the exact sum's rounding (the f32 sums of
    /// either path may land on the other side of a rounding boundary), and at most half a
    /// step plus the f32 sums' error from the exact sum.
    fn close(got: &[f32], exact: &[f64], what: &str) {
        for (i, (g, e)) in got.iter().zip(exact).enumerate() {
            assert_eq!(*g, round(*g), "{what}[{i}] = {g} is not a bf16 value");
            let want = round(*e as f32);
            let step = (f64::from(want.abs()) * 2f64.powi(-7)).max(1e-30);
            assert!(
                (f64::from(*g) - f64::from(want)).abs() <= step,
                "{what}[{i}]: {g} against {want} (exact {e})"
            );
        }
    }

    fn data(len: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed * 97)
                    >> 8;
                ((h % 20_001) as f32 / 10_000.0 - 1.0) * scale
            })
            .collect()
    }

    fn all_three(m: usize, n: usize, k: usize, p: Path) {
        let x = data(m * k, 1, 1.0);
        let w = data(n * k, 2, 0.05);
        let dy = data(m * n, 3, 1e-3);
        let mut y = vec![0f32; m * n];
        forward_on(&x, &w, (m, n, k), &mut y, p).unwrap();
        close(&y, &reference(&x, &w, (m, n, k)), "y");
        let mut dx = vec![0f32; m * k];
        input_grad_on(&dy, &w, (m, n, k), &mut dx, p).unwrap();
        close(&dx, &reference(&dy, &transpose(&w, n, k), (m, k, n)), "dx");
        let mut dw = vec![0f32; n * k];
        weight_grad_on(&x, &dy, (m, n, k), &mut dw, p).unwrap();
        close(
            &dw,
            &reference(&transpose(&dy, m, n), &transpose(&x, m, k), (n, k, m)),
            "dW",
        );
    }

    #[test]
    fn the_three_products_round_where_autocast_rounds() {
        let mut paths = vec![Path::F32Gemm];
        if bf16_matmul::available() {
            paths.push(Path::Bf16Instruction);
        } else {
            eprintln!("skipping the VDPBF16PS path: this CPU has no AVX-512 BF16");
        }
        for p in paths {
            // Odd widths, one wider than a transpose tile, sums longer than a 32-chunk.
            for (m, n, k) in [
                (1, 1, 1),
                (3, 5, 7),
                (17, 70, 33),
                (40, 9, 130),
                (130, 65, 64),
            ] {
                all_three(m, n, k, p);
            }
        }
    }

    #[test]
    fn a_value_already_bf16_is_kept_and_products_of_bf16_values_are_exact() {
        // Small integers: every product and sum exact, so both paths give the exact value.
        let (m, n, k) = (4, 3, 40);
        let x: Vec<f32> = (0..m * k).map(|i| (i % 5) as f32 - 2.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 3) as f32).collect();
        for p in [Path::F32Gemm, path()] {
            let mut y = vec![0f32; m * n];
            forward_on(&x, &w, (m, n, k), &mut y, p).unwrap();
            let want: Vec<f32> = reference(&x, &w, (m, n, k))
                .iter()
                .map(|v| *v as f32)
                .collect();
            assert_eq!(y, want, "{p:?}");
        }
        // An operand between two bf16 values is rounded first: 1 + 2⁻⁹ rounds to 1 (a tie, to
        // even), so 1 · (1 + 2⁻⁹) is 1, not 1.002.
        let mut y = [0f32];
        forward(&[1.0], &[1.0 + 2f32.powi(-9)], (1, 1, 1), &mut y).unwrap();
        assert_eq!(y, [1.0]);
    }

    #[test]
    fn a_shape_mismatch_is_named() {
        let mut y = vec![0f32; 6];
        let e = forward(&[0.0; 5], &[0.0; 6], (2, 3, 2), &mut y).unwrap_err();
        assert!(e.to_string().contains("autocast::forward"), "{e}");
        let e = weight_grad(&[0.0; 4], &[0.0; 5], (2, 3, 2), &mut y).unwrap_err();
        assert!(e.to_string().contains("dy"), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn both_paths_agree_within_a_bf16_step(
            m in 1usize..20, n in 1usize..20, k in 1usize..80, seed in 0u32..1000
        ) {
            let x = data(m * k, seed, 2.0);
            let w = data(n * k, seed + 1, 0.3);
            let (mut a, mut b) = (vec![0f32; m * n], vec![0f32; m * n]);
            forward_on(&x, &w, (m, n, k), &mut a, Path::F32Gemm).unwrap();
            forward_on(&x, &w, (m, n, k), &mut b, path()).unwrap();
            for (p, q) in a.iter().zip(&b) {
                let step = (p.abs().max(q.abs()) * 2f32.powi(-7)).max(1e-30);
                prop_assert!((p - q).abs() <= step, "{p} against {q}");
            }
        }
    }
}
