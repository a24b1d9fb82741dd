//! Absolute maxima: per tensor, per row, per 1×B block, per T×T tile.
//!
//! NaN propagates (as `x.abs().amax()` does in PyTorch): any NaN in a group makes its amax
//! NaN. ±Inf gives Inf.

use crate::element::Element;
use crate::error::{KernelError, check_len};
use crate::layout;

/// max(a, |x|) with NaN winning.
#[inline]
fn absmax(a: f32, x: f32) -> f32 {
    let x = x.abs();
    if x.is_nan() || a.is_nan() {
        f32::NAN
    } else {
        a.max(x)
    }
}

/// max |x| over the whole slice (0 for an empty one).
pub fn amax<T: Element>(x: &[T]) -> f32 {
    x.iter().fold(0.0, |a, v| absmax(a, v.to_f32()))
}

/// max |x| of each row of `[rows, cols]` into `out[rows]`.
pub fn amax_rows<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    layout::row_reduction("amax_rows", rows, cols, x.len(), out.len())?;
    for (row, o) in x.chunks_exact(cols.max(1)).zip(out.iter_mut()) {
        *o = amax(row);
    }
    if cols == 0 {
        out.fill(0.0);
    }
    Ok(())
}

/// max |x| of each 1×`block` block along the columns of `[rows, cols]` into
/// `out[rows, cols / block]`. `cols` must be a multiple of `block`.
pub fn amax_blocks<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    block: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    layout::block_reduction("amax_blocks", rows, cols, block, x.len(), out.len())?;
    for (b, o) in x.chunks_exact(block).zip(out.iter_mut()) {
        *o = amax(b);
    }
    Ok(())
}

/// max |x| of each `tile`×`tile` tile of `[rows, cols]` into
/// `out[ceil(rows / tile), ceil(cols / tile)]`; edge tiles cover what is left.
pub fn amax_tiles<T: Element>(
    x: &[T],
    rows: usize,
    cols: usize,
    tile: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    if tile == 0 {
        return Err(KernelError::BlockMismatch {
            op: "amax_tiles",
            cols,
            block: tile,
        });
    }
    check_len("amax_tiles", "input", x.len(), rows * cols, &[rows, cols])?;
    let (tr, tc) = (rows.div_ceil(tile), cols.div_ceil(tile));
    check_len("amax_tiles", "output", out.len(), tr * tc, &[tr, tc])?;
    out.fill(0.0);
    for r in 0..rows {
        for c in 0..cols {
            let o = &mut out[(r / tile) * tc + c / tile];
            *o = absmax(*o, x[r * cols + c].to_f32());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_and_nan() {
        let x: Vec<f32> = vec![1.0, -3.0, 2.0, 0.5, f32::NAN, 1.0, -7.0, 0.0];
        assert!(amax(&x).is_nan());
        let mut rows = [0.0; 2];
        amax_rows(&x, 2, 4, &mut rows).unwrap();
        assert_eq!(rows[0], 3.0);
        assert!(rows[1].is_nan());
        let mut blocks = [0.0; 4];
        amax_blocks(&x, 2, 4, 2, &mut blocks).unwrap();
        assert_eq!(&blocks[..2], &[3.0, 2.0]);
        assert_eq!(blocks[3], 7.0);
        assert_eq!(
            amax_blocks(&x, 2, 4, 3, &mut blocks).unwrap_err(),
            KernelError::BlockMismatch {
                op: "amax_blocks",
                cols: 4,
                block: 3
            }
        );
        let mut tiles = [0.0; 4];
        let y: Vec<f32> = (0..15).map(|v| v as f32).collect(); // [3, 5], tiles of 2
        let mut t6 = [0.0; 6];
        amax_tiles(&y, 3, 5, 2, &mut t6).unwrap();
        assert_eq!(t6, [6.0, 8.0, 9.0, 11.0, 13.0, 14.0]);
        assert!(amax_tiles(&y, 3, 5, 2, &mut tiles).is_err());
    }
}
