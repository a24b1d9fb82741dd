//! Kernel errors: a shape a format cannot take, or a buffer of the wrong size — named, never a
//! panic.

/// Why a kernel refused its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The innermost dimension is not a multiple of the format's block.
    #[error("{op}: the last dimension ({cols}) must be a multiple of the block size {block}")]
    BlockMismatch {
        /// The kernel that refused.
        op: &'static str,
        /// The innermost dimension.
        cols: usize,
        /// The format's block size.
        block: usize,
    },
    /// INT4 packs pairs of rows: the row count must be even.
    #[error(
        "{op}: the row count ({rows}) must be even to pack nibble pairs along the output dimension"
    )]
    OddRows {
        /// The kernel that refused.
        op: &'static str,
        /// The row count given.
        rows: usize,
    },
    /// A buffer's length disagrees with the shape.
    #[error("{op}: {what} has {got} elements, expected {expected} for shape {shape:?}")]
    Length {
        /// The kernel that refused.
        op: &'static str,
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length the shape implies.
        expected: usize,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// The shape is not `[rows, cols]` or `[experts, rows, cols]`.
    #[error("{op}: expected a 2-D or 3-D shape, got {shape:?}")]
    Rank {
        /// The kernel that refused.
        op: &'static str,
        /// The shape given.
        shape: Vec<usize>,
    },
    /// A parameter the operation does not take.
    #[error("{op}: {what}")]
    Parameter {
        /// The kernel that refused.
        op: &'static str,
        /// What was wrong.
        what: String,
    },
    /// The operation has no implementation on this device.
    #[error("{op} has no {device} implementation")]
    Unsupported {
        /// The kernel that refused.
        op: &'static str,
        /// The device asked for.
        device: &'static str,
    },
    /// The device backend was not compiled in, or cannot start here.
    #[error("{device} is not available: {reason}")]
    DeviceUnavailable {
        /// The device asked for.
        device: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
}

/// `[experts, rows, cols]` of a 2-D (`experts = 1`) or 3-D shape.
pub fn matrix_dims(
    op: &'static str,
    shape: &[usize],
) -> Result<(usize, usize, usize), KernelError> {
    match *shape {
        [rows, cols] => Ok((1, rows, cols)),
        [experts, rows, cols] => Ok((experts, rows, cols)),
        _ => Err(KernelError::Rank {
            op,
            shape: shape.to_vec(),
        }),
    }
}

/// Checks that `got` elements fit `shape` (product of its dimensions times `per_element`
/// divided by `divisor`).
pub fn check_len(
    op: &'static str,
    what: &'static str,
    got: usize,
    expected: usize,
    shape: &[usize],
) -> Result<(), KernelError> {
    if got == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            op,
            what,
            got,
            expected,
            shape: shape.to_vec(),
        })
    }
}
