//! The tensor layouts each operation takes, validated once: every backend (reference, CPU,
//! CUDA) calls the same check, so a shape a format cannot take is the same named error
//! everywhere.

use crate::error::{KernelError, check_len, matrix_dims};

/// A weight `[rows, cols]` quantized element for element with one scale per row
/// (`scales.len() == rows`; `rows` = 1 for per-tensor) — FP8 per channel, INT8.
pub fn per_row(
    op: &'static str,
    rows: usize,
    cols: usize,
    w: usize,
    scales: usize,
    out: usize,
) -> Result<(), KernelError> {
    check_len(op, "input", w, rows * cols, &[rows, cols])?;
    check_len(op, "scales", scales, rows, &[rows])?;
    check_len(op, "output", out, rows * cols, &[rows, cols])
}

/// Stacked experts `[experts, rows, cols]` with one scale per expert; returns the elements
/// per expert.
pub fn stacked(
    op: &'static str,
    shape: &[usize],
    w: usize,
    scales: usize,
    out: usize,
) -> Result<usize, KernelError> {
    let (e, r, c) = matrix_dims(op, shape)?;
    check_len(op, "input", w, e * r * c, shape)?;
    check_len(op, "scales", scales, e, &[e])?;
    check_len(op, "output", out, w, shape)?;
    Ok(r * c)
}

/// `tile`×`tile` tiles of `[rows, cols]`, edge tiles partial; returns the tile columns.
pub fn tiles(
    op: &'static str,
    rows: usize,
    cols: usize,
    tile: usize,
    w: usize,
    scales: usize,
    out: usize,
) -> Result<usize, KernelError> {
    if tile == 0 {
        return Err(KernelError::BlockMismatch {
            op,
            cols,
            block: tile,
        });
    }
    let (tr, tc) = (rows.div_ceil(tile), cols.div_ceil(tile));
    check_len(op, "input", w, rows * cols, &[rows, cols])?;
    check_len(op, "scales", scales, tr * tc, &[tr, tc])?;
    check_len(op, "output", out, rows * cols, &[rows, cols])?;
    Ok(tc)
}

/// INT4 groups: `[rows, cols]` in groups of `group` along cols, rows packed in pairs;
/// returns the groups per row.
pub fn int4_groups(
    op: &'static str,
    rows: usize,
    cols: usize,
    group: usize,
    w: usize,
    scales: usize,
    out: usize,
) -> Result<usize, KernelError> {
    if group == 0 || !cols.is_multiple_of(group) {
        return Err(KernelError::BlockMismatch {
            op,
            cols,
            block: group,
        });
    }
    if !rows.is_multiple_of(2) {
        return Err(KernelError::OddRows { op, rows });
    }
    let groups = cols / group;
    check_len(op, "input", w, rows * cols, &[rows, cols])?;
    check_len(op, "scales", scales, rows * groups, &[rows, groups])?;
    check_len(op, "output", out, rows / 2 * cols, &[rows / 2, cols])?;
    Ok(groups)
}

/// Blocks of `block` along the last dimension of a 2-D or 3-D `shape`, packed to
/// `out_per_block` bytes with one scale byte per block (NVFP4).
pub fn blocks(
    op: &'static str,
    shape: &[usize],
    block: usize,
    w: usize,
    out: usize,
    out_per_block: usize,
    scales: usize,
) -> Result<(), KernelError> {
    let (e, r, c) = matrix_dims(op, shape)?;
    if !c.is_multiple_of(block) {
        return Err(KernelError::BlockMismatch { op, cols: c, block });
    }
    let n = e * r * c;
    check_len(op, "input", w, n, shape)?;
    check_len(op, "packed output", out, n / block * out_per_block, shape)?;
    check_len(op, "scales", scales, n / block, shape)
}

/// `n` elements in rows of `cols`, each row whole blocks of `block`: the number of blocks.
pub fn row_blocks(
    op: &'static str,
    n: usize,
    cols: usize,
    block: usize,
) -> Result<usize, KernelError> {
    if cols == 0 || !cols.is_multiple_of(block) || !n.is_multiple_of(cols) {
        return Err(KernelError::BlockMismatch { op, cols, block });
    }
    Ok(n / block)
}

/// Rows of `cols` in 32-element MX blocks: `out_per_block` bytes and one E8M0 scale per block.
pub fn mx_blocks(
    op: &'static str,
    w: usize,
    cols: usize,
    out: usize,
    out_per_block: usize,
    scales: usize,
) -> Result<(), KernelError> {
    if cols == 0 || !cols.is_multiple_of(32) || !w.is_multiple_of(cols) {
        return Err(KernelError::BlockMismatch {
            op,
            cols,
            block: 32,
        });
    }
    let shape = [w / cols, cols];
    check_len(op, "output", out, w / 32 * out_per_block, &shape)?;
    check_len(op, "scales", scales, w / 32, &shape)
}

/// A reduction of `[rows, cols]` to one value per row.
pub fn row_reduction(
    op: &'static str,
    rows: usize,
    cols: usize,
    x: usize,
    out: usize,
) -> Result<(), KernelError> {
    check_len(op, "input", x, rows * cols, &[rows, cols])?;
    check_len(op, "output", out, rows, &[rows])
}

/// A reduction of `[rows, cols]` to one value per 1×`block` block.
pub fn block_reduction(
    op: &'static str,
    rows: usize,
    cols: usize,
    block: usize,
    x: usize,
    out: usize,
) -> Result<(), KernelError> {
    if block == 0 || !cols.is_multiple_of(block) {
        return Err(KernelError::BlockMismatch { op, cols, block });
    }
    check_len(op, "input", x, rows * cols, &[rows, cols])?;
    check_len(
        op,
        "output",
        out,
        rows * (cols / block),
        &[rows, cols / block],
    )
}
