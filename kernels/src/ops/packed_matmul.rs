//! Matrix products with a weight that stays packed: QLoRA's frozen base. A quantized Linear's
//! weight `W [n, k]` is held in its format's own layout ([`PackedRows`]); each product decodes
//! it a tile of rows at a time into a bounded f32 buffer and multiplies that tile, so the f32
//! copy of a large weight never exists whole:
//!
//! - [`matmul_wt`]: `y [m, n] = x [m, k] · Wᵀ` (the Linear's forward), each tile writing its
//!   own columns of `y`;
//! - [`matmul_w`]: `dx [m, k] = dy [m, n] · W` (its backward with respect to the input), each
//!   tile adding its rows' share.
//!
//! Tiles are as large as an 8 MiB buffer allows (most Linears are one tile), decoded in
//! parallel pieces, and each product is one threaded GEMM.
//!
//! The values are exactly the format's decoded weights (the decode is the format's own, the
//! products f32 GEMMs), so a packed Linear computes what the decoded dense one computes, up to
//! the summation order of the GEMM.

use crate::KernelError;
use crate::cpu::gemm::{self as packed_gemm, Mat};
use crate::error::check_len;
use rayon::prelude::*;

/// Elements per parallel task of the adapters' element-wise passes (dropout's mask): each
/// value's arithmetic is its own, so the split changes no bits.
const ELEMENTWISE_CHUNK: usize = 1 << 14;

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
    /// Runs `f` on the whole weight as row-major f32 `[rows, cols]` when the layout holds
    /// exactly that (a frozen dense weight, LoRA's base) and says whether it did: the products
    /// then run as one threaded GEMM instead of tile by tile.
    fn with_dense(&self, f: &mut dyn FnMut(&[f32])) -> bool {
        let _ = f;
        false
    }
}

/// A plain f32 matrix as [`PackedRows`] (tests, weights a format leaves unquantized, and —
/// borrowed, `DenseRows<&[f32]>` — a trained weight's own values in [`dense`]).
#[derive(Debug, Clone)]
pub struct DenseRows<V = Vec<f32>> {
    values: V,
    rows: usize,
    cols: usize,
}

impl<V: AsRef<[f32]>> DenseRows<V> {
    /// `values` row-major `[rows, cols]`.
    pub fn new(values: V, rows: usize, cols: usize) -> Result<Self, KernelError> {
        check_len(
            "DenseRows",
            "values",
            values.as_ref().len(),
            rows * cols,
            &[rows, cols],
        )?;
        Ok(DenseRows { values, rows, cols })
    }
}

impl<V: AsRef<[f32]> + Send + Sync + std::fmt::Debug> PackedRows for DenseRows<V> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let src = self
            .values
            .as_ref()
            .get(start * self.cols..start * self.cols + out.len())
            .ok_or_else(|| KernelError::Parameter {
                op: "DenseRows::decode_rows",
                what: format!("rows from {start} past {}", self.rows),
            })?;
        out.copy_from_slice(src);
        Ok(())
    }
    fn packed_bytes(&self) -> usize {
        self.values.as_ref().len() * 4
    }
    fn with_dense(&self, f: &mut dyn FnMut(&[f32])) -> bool {
        f(self.values.as_ref());
        true
    }
}

/// A 16-bit float matrix (bf16 or f16, a frozen base kept in its checkpoint's dtype) as
/// [`PackedRows`]: each tile widened to f32, exactly.
#[derive(Debug, Clone)]
pub struct HalfRows {
    bits: Vec<u16>,
    bf16: bool,
    rows: usize,
    cols: usize,
}

impl HalfRows {
    /// `bits` row-major `[rows, cols]`: bf16 values (`bf16`) or f16.
    pub fn new(bits: Vec<u16>, bf16: bool, rows: usize, cols: usize) -> Result<Self, KernelError> {
        check_len("HalfRows", "bits", bits.len(), rows * cols, &[rows, cols])?;
        Ok(HalfRows {
            bits,
            bf16,
            rows,
            cols,
        })
    }
}

impl PackedRows for HalfRows {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn decode_rows(&self, start: usize, out: &mut [f32]) -> Result<(), KernelError> {
        let src = self
            .bits
            .get(start * self.cols..start * self.cols + out.len())
            .ok_or_else(|| KernelError::Parameter {
                op: "HalfRows::decode_rows",
                what: format!("rows from {start} past {}", self.rows),
            })?;
        if self.bf16 {
            for (o, &b) in out.iter_mut().zip(src) {
                *o = f32::from_bits(u32::from(b) << 16);
            }
        } else {
            for (o, &b) in out.iter_mut().zip(src) {
                *o = half::f16::from_bits(b).to_f32();
            }
        }
        Ok(())
    }
    fn packed_bytes(&self) -> usize {
        self.bits.len() * 2
    }
}

/// f32 values a tile holds at most (8 MiB): large enough that each product is one or a few
/// big GEMMs, bounded whatever the model's size.
const TILE_VALUES: usize = 2 << 20;

/// Rows a tile decodes: as many as [`TILE_VALUES`] allows (at least 64), a multiple of the
/// layout's alignment.
fn tile_rows(w: &dyn PackedRows) -> usize {
    let a = w.row_align().max(1);
    let rows = (TILE_VALUES / w.cols().max(1)).max(64);
    rows.div_ceil(a) * a
}

/// Rows `r0 ..` of `w` into `tile` (whole rows), decoded in parallel pieces of about 64 rows.
fn decode_tile(w: &dyn PackedRows, r0: usize, tile: &mut [f32]) -> Result<(), KernelError> {
    let k = w.cols();
    let a = w.row_align().max(1);
    let piece = 64usize.div_ceil(a) * a;
    tile.par_chunks_mut(piece * k)
        .enumerate()
        .try_for_each(|(i, out)| w.decode_rows(r0 + i * piece, out))
}

/// `y[:, r0 .. r0 + tr] = x · tileᵀ`: `x [m, k]`, `y [m, n]`, `tile` rows `r0 .. r0 + tr` of
/// `W` (`[tr, k]` row-major), one threaded GEMM.
fn product_wt(x: &[f32], m: usize, k: usize, tile: &[f32], r0: usize, y: &mut [f32]) {
    let tr = tile.len() / k;
    let n = y.len() / m;
    assert!(x.len() == m * k && r0 + tr <= n && tile.len() == tr * k);
    if packed() {
        let (a, b) = (Mat::row_major(x, m, k), Mat::row_major(tile, tr, k).t());
        return gemm_done(packed_gemm::matmul_into(a, b, &mut y[r0..], n, false));
    }
    // SAFETY: `y` is `[m, n]` and this writes its columns `r0 .. r0 + tr` (row stride n,
    // asserted within it); `x` is read as `[m, k]` (row stride k) and the tile as `[k, tr]`
    // (row stride 1, column stride k), both within their lengths (asserted).
    unsafe {
        gemm::gemm(
            m,
            tr,
            k,
            y.as_mut_ptr().add(r0),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            tile.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads().max(1)),
        );
    }
}

/// `dx (+)= dy[:, r0 .. r0 + tr] · tile`: `dy [m, n]`, `dx [m, k]`, `tile` rows `r0 .. r0 +
/// tr` of `W`; `accumulate` adds to `dx`, else overwrites it. One threaded GEMM.
fn product_w(dy: &[f32], m: usize, tile: &[f32], r0: usize, dx: &mut [f32], accumulate: bool) {
    let k = dx.len() / m;
    let tr = tile.len() / k;
    let n = dy.len() / m;
    assert!(dx.len() == m * k && r0 + tr <= n && tile.len() == tr * k);
    if packed() {
        let a = Mat {
            data: &dy[r0..],
            rows: m,
            cols: tr,
            rs: n,
            cs: 1,
        };
        let b = Mat::row_major(tile, tr, k);
        return gemm_done(packed_gemm::matmul_into(a, b, dx, k, accumulate));
    }
    // SAFETY: `dx` is `[m, k]`; `dy`'s columns `r0 .. r0 + tr` are read with row stride n and
    // the tile as `[tr, k]` row-major, all within their lengths (asserted).
    unsafe {
        gemm::gemm(
            m,
            k,
            tr,
            dx.as_mut_ptr(),
            1,
            k as isize,
            accumulate,
            dy.as_ptr().add(r0),
            1,
            n as isize,
            tile.as_ptr(),
            1,
            k as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads().max(1)),
        );
    }
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
    if w.with_dense(&mut |wd| product_wt(x, m, k, wd, 0, y)) {
        return Ok(());
    }
    let t = tile_rows(w).min(n);
    let mut buf = vec![0f32; t * k];
    for r0 in (0..n).step_by(t) {
        let tile = &mut buf[..t.min(n - r0) * k];
        decode_tile(w, r0, tile)?;
        product_wt(x, m, k, tile, r0, y);
    }
    Ok(())
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
    if m == 0 || n == 0 || k == 0 {
        // No product writes `dx` (its first one overwrites it otherwise).
        dx.fill(0.0);
        return Ok(());
    }
    if w.with_dense(&mut |wd| product_w(dy, m, wd, 0, dx, false)) {
        return Ok(());
    }
    let t = tile_rows(w).min(n);
    let mut buf = vec![0f32; t * k];
    for r0 in (0..n).step_by(t) {
        let tile = &mut buf[..t.min(n - r0) * k];
        decode_tile(w, r0, tile)?;
        product_w(dy, m, tile, r0, dx, r0 > 0);
    }
    Ok(())
}

/// A dense Linear's three products, for a weight `W [n, k]` held row-major in f32 (a trained
/// weight): each one threaded GEMM with its operands laid out as candle's
/// `x.matmul(&w.t())` and that product's backward lay them, so the same values as candle's
/// matmul, bit for bit.
pub mod dense {
    use super::{DenseRows, KernelError, Mat, check_len, matmul_w, matmul_wt, packed_gemm};

    /// `y [m, n] = x [m, k] · Wᵀ` ([`matmul_wt`] on the weight's own values).
    pub fn forward(
        x: &[f32],
        w: &[f32],
        (m, n, k): (usize, usize, usize),
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        matmul_wt(x, m, &DenseRows::new(w, n, k)?, y)
    }

    /// `dx [m, k] = dy [m, n] · W`, the gradient with respect to the input ([`matmul_w`]).
    pub fn input_grad(
        dy: &[f32],
        w: &[f32],
        (m, n, k): (usize, usize, usize),
        dx: &mut [f32],
    ) -> Result<(), KernelError> {
        matmul_w(dy, m, &DenseRows::new(w, n, k)?, dx)
    }

    /// `dW [n, k] = (xᵀ · dy)ᵀ`: the gradient with respect to the weight, as candle computes it
    /// for `x.matmul(&w.t())` — the product `xᵀ [k, m] · dy [m, n]` (one GEMM into a `[k, n]`
    /// buffer), then transposed into `W`'s layout as `0 + value` (candle adds it to a zeroed
    /// gradient, which turns a `-0` into `+0`).
    pub fn weight_grad(
        x: &[f32],
        dy: &[f32],
        (m, n, k): (usize, usize, usize),
        dw: &mut [f32],
    ) -> Result<(), KernelError> {
        use rayon::prelude::*;
        let op = "dense::weight_grad";
        check_len(op, "x", x.len(), m * k, &[m, k])?;
        check_len(op, "dy", dy.len(), m * n, &[m, n])?;
        check_len(op, "dw", dw.len(), n * k, &[n, k])?;
        if n == 0 || k == 0 {
            return Ok(());
        }
        if super::packed() {
            // dW = dyᵀ · x, each operand read in its own layout.
            let (a, b) = (Mat::row_major(dy, m, n).t(), Mat::row_major(x, m, k));
            return packed_gemm::matmul(a, b, dw);
        }
        let mut r = vec![0f32; k * n];
        if m > 0 {
            // SAFETY: `r` is `[k, n]` row-major; `x` is read as `xᵀ [k, m]` (row stride 1,
            // column stride k) and `dy` as `[m, n]` (row stride n), every element within its
            // slice (lengths checked above).
            unsafe {
                gemm::gemm(
                    k,
                    n,
                    m,
                    r.as_mut_ptr(),
                    1,
                    n as isize,
                    false,
                    x.as_ptr(),
                    k as isize,
                    1,
                    dy.as_ptr(),
                    1,
                    n as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::Rayon(rayon::current_num_threads().max(1)),
                );
            }
        }
        // The transpose a block of 64 rows of `dW` at a time (each reading 64 columns of `r`).
        dw.par_chunks_mut(64 * k).enumerate().for_each(|(b, rows)| {
            let j0 = b * 64;
            for i0 in (0..k).step_by(64) {
                let i1 = (i0 + 64).min(k);
                for (jj, row) in rows.chunks_mut(k).enumerate() {
                    let j = j0 + jj;
                    for i in i0..i1 {
                        row[i] = 0.0 + r[i * n + j];
                    }
                }
            }
        });
        Ok(())
    }
}

/// A matrix operand: its values and the (row, column) strides reading it.
#[derive(Clone, Copy)]
struct Operand<'a>(&'a [f32], usize, usize);

/// Whether the products run on the packed AVX-512 GEMM ([`packed_gemm`]: f32 fused multiply-adds in
/// order along `k`), else on the `gemm` crate's (candle's).
fn packed() -> bool {
    packed_gemm::available()
}

/// A packed product's result: its shapes were checked by the caller and the CPU by
/// [`packed`], so an error here is a bug.
fn gemm_done(r: Result<(), KernelError>) {
    if let Err(e) = r {
        panic!("the packed GEMM refused a checked product: {e}");
    }
}

thread_local! {
    /// A product scaled before it is added (`beta ≠ 1`), kept between calls.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst [m, n]` (row-major) `= (dst if accumulate) + beta · lhs [m, k] · rhs [k, n]`, one
/// threaded GEMM; panics if an operand's strides reach past its values. On the packed GEMM an
/// accumulating product with `beta = 1` starts each output's chain from `dst`.
#[allow(clippy::too_many_arguments)]
fn mm(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    accumulate: bool,
    lhs: Operand,
    rhs: Operand,
    beta: f32,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    let last = |o: Operand, rows: usize, cols: usize| (rows - 1) * o.1 + (cols - 1) * o.2;
    assert!(dst.len() >= m * n && last(lhs, m, k) < lhs.0.len() && last(rhs, k, n) < rhs.0.len());
    if packed() {
        let a = Mat {
            data: lhs.0,
            rows: m,
            cols: k,
            rs: lhs.1,
            cs: lhs.2,
        };
        let b = Mat {
            data: rhs.0,
            rows: k,
            cols: n,
            rs: rhs.1,
            cs: rhs.2,
        };
        let dst = &mut dst[..m * n];
        if beta == 1.0 {
            return gemm_done(packed_gemm::matmul_into(a, b, dst, n, accumulate));
        }
        // `dst (+)= beta · (the product)`: the product first, then scaled (and added).
        let mut scaled = |t: &mut Vec<f32>| {
            t.clear();
            t.resize(m * n, 0.0);
            gemm_done(packed_gemm::matmul(a, b, t));
            dst.par_chunks_mut(1 << 14)
                .zip(t.par_chunks(1 << 14))
                .for_each(|(d, t)| {
                    for (d, t) in d.iter_mut().zip(t) {
                        *d = if accumulate { *d + beta * t } else { beta * t };
                    }
                });
        };
        return SCRATCH.with(|t| match t.try_borrow_mut() {
            Ok(mut t) => scaled(&mut t),
            Err(_) => scaled(&mut Vec::new()),
        });
    }
    // SAFETY: `dst` holds `[m, n]` row-major, and every element of `lhs` (`[m, k]`) and `rhs`
    // (`[k, n]`) read through its strides lies within its slice (asserted above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.0.as_ptr(),
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0.as_ptr(),
            rhs.2 as isize,
            rhs.1 as isize,
            if accumulate { 1.0 } else { 0.0 },
            beta,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(rayon::current_num_threads().max(1)),
        );
    }
}

/// A LoRA adapter on a packed Linear: `A [r, k]`, `B [n, r]`, its scale, and (while training
/// with dropout) the input's dropout: the keep mask `[m, k]` (0 or 1) and `1 / (1 − p)`.
#[derive(Debug, Clone, Copy)]
pub struct Lora<'a> {
    /// `lora_A.weight` `[r, k]`.
    pub a: &'a [f32],
    /// `lora_B.weight` `[n, r]`.
    pub b: &'a [f32],
    /// The rank.
    pub r: usize,
    /// `α / r` (or `α / √r`).
    pub scale: f32,
    /// The dropout mask on the adapter's input and its factor.
    pub keep: Option<(&'a [f32], f32)>,
}

impl Lora<'_> {
    fn check(&self, op: &'static str, m: usize, n: usize, k: usize) -> Result<(), KernelError> {
        check_len(op, "a", self.a.len(), self.r * k, &[self.r, k])?;
        check_len(op, "b", self.b.len(), n * self.r, &[n, self.r])?;
        if let Some((keep, _)) = self.keep {
            check_len(op, "keep", keep.len(), m * k, &[m, k])?;
        }
        Ok(())
    }

    /// The adapter's input: `x`, or `x · keep · factor` under dropout.
    fn input<'x>(&self, x: &'x [f32]) -> std::borrow::Cow<'x, [f32]> {
        match self.keep {
            Some((keep, f)) => {
                let mut xd = vec![0f32; x.len()];
                xd.par_chunks_mut(ELEMENTWISE_CHUNK)
                    .zip(x.par_chunks(ELEMENTWISE_CHUNK))
                    .zip(keep.par_chunks(ELEMENTWISE_CHUNK))
                    .for_each(|((o, x), keep)| {
                        for ((o, v), k) in o.iter_mut().zip(x).zip(keep) {
                            *o = v * k * f;
                        }
                    });
                std::borrow::Cow::Owned(xd)
            }
            None => std::borrow::Cow::Borrowed(x),
        }
    }

    /// `h = x_d · Aᵀ` `[m, r]`.
    fn down(&self, xd: &[f32], m: usize, k: usize) -> Vec<f32> {
        let mut h = vec![0f32; m * self.r];
        mm(
            m,
            self.r,
            k,
            &mut h,
            false,
            Operand(xd, k, 1),
            Operand(self.a, 1, k),
            1.0,
        );
        h
    }
}

/// PEFT's LoRA Linear over a packed (or frozen) weight: `y = x · Wᵀ (+ bias) + scale · (x_d ·
/// Aᵀ) · Bᵀ`, `x_d` the adapter's input ([`Lora`]), in that order (PEFT's `result + lora_B(
/// lora_A(dropout(x))) * scaling`), no intermediate the size of `y` kept beside it.
pub fn lora_forward(
    x: &[f32],
    m: usize,
    w: &dyn PackedRows,
    bias: Option<&[f32]>,
    lora: &Lora<'_>,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let (n, k) = (w.rows(), w.cols());
    lora.check("lora_forward", m, n, k)?;
    if let Some(b) = bias {
        check_len("lora_forward", "bias", b.len(), n, &[n])?;
    }
    matmul_wt(x, m, w, y)?;
    if let Some(b) = bias {
        for row in y.chunks_mut(n.max(1)) {
            for (v, b) in row.iter_mut().zip(b) {
                *v += b;
            }
        }
    }
    let xd = lora.input(x);
    let h = lora.down(&xd, m, k);
    mm(
        m,
        n,
        lora.r,
        y,
        true,
        Operand(&h, lora.r, 1),
        Operand(lora.b, 1, lora.r),
        lora.scale,
    );
    Ok(())
}

/// The gradients of [`lora_forward`] from `dy [m, n]`: `dx [m, k]`, `da [r, k]`, `db [n, r]`.
pub fn lora_backward(
    x: &[f32],
    m: usize,
    w: &dyn PackedRows,
    lora: &Lora<'_>,
    dy: &[f32],
    (dx, da, db): (&mut [f32], &mut [f32], &mut [f32]),
) -> Result<(), KernelError> {
    let op = "lora_backward";
    let (n, k, r) = (w.rows(), w.cols(), lora.r);
    lora.check(op, m, n, k)?;
    check_len(op, "x", x.len(), m * k, &[m, k])?;
    check_len(op, "da", da.len(), r * k, &[r, k])?;
    check_len(op, "db", db.len(), n * r, &[n, r])?;
    matmul_w(dy, m, w, dx)?;
    // gh = scale · dy · B  [m, r]
    let mut gh = vec![0f32; m * r];
    mm(
        m,
        r,
        n,
        &mut gh,
        false,
        Operand(dy, n, 1),
        Operand(lora.b, r, 1),
        lora.scale,
    );
    // dx += (gh · A) · keep · factor
    match lora.keep {
        None => mm(
            m,
            k,
            r,
            dx,
            true,
            Operand(&gh, r, 1),
            Operand(lora.a, k, 1),
            1.0,
        ),
        Some((keep, f)) => {
            let mut dxd = vec![0f32; m * k];
            mm(
                m,
                k,
                r,
                &mut dxd,
                false,
                Operand(&gh, r, 1),
                Operand(lora.a, k, 1),
                1.0,
            );
            dx.par_chunks_mut(ELEMENTWISE_CHUNK)
                .zip(dxd.par_chunks(ELEMENTWISE_CHUNK))
                .zip(keep.par_chunks(ELEMENTWISE_CHUNK))
                .for_each(|((dx, dxd), keep)| {
                    for ((d, v), kp) in dx.iter_mut().zip(dxd).zip(keep) {
                        *d += v * kp * f;
                    }
                });
        }
    }
    let xd = lora.input(x);
    // dA = ghᵀ · x_d  [r, k]
    mm(
        r,
        k,
        m,
        da,
        false,
        Operand(&gh, 1, r),
        Operand(&xd, k, 1),
        1.0,
    );
    // dB = scale · dyᵀ · h  [n, r]
    let h = lora.down(&xd, m, k);
    mm(
        n,
        r,
        m,
        db,
        false,
        Operand(dy, 1, n),
        Operand(&h, r, 1),
        lora.scale,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::ops::test_values::lcg;

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

    /// The exact sum of `terms` and the sum of their magnitudes.
    fn sum_and_size(terms: impl Iterator<Item = f64>) -> (f64, f64) {
        terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()))
    }

    /// What an f32 dot product may be off by: a few ulps of the sum of magnitudes.
    fn tol(size: f64) -> f64 {
        4.0 * f64::from(f32::EPSILON) * (1.0 + size)
    }

    #[test]
    fn packed_products_equal_the_textbook_ones() {
        for (m, n, k) in [
            (1, 1, 1),
            (3, 130, 7),
            (17, 64, 33),
            (5, 129, 64),
            (0, 4, 4),
            // Two tiles (the first of 2 098 rows: the most an 8 MiB tile holds, rounded to
            // the pairs), each decoded in pieces.
            (3, 2100, 1000),
        ] {
            let mut seed = (m * 1000 + n * 10 + k) as u64;
            let x: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let wv: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
            let dy: Vec<f32> = (0..m * n).map(|_| lcg(&mut seed)).collect();
            let dense = DenseRows::new(wv.clone(), n, k).unwrap();
            let w = Paired(dense.clone());
            let mut y = vec![f32::NAN; m * n];
            matmul_wt(&x, m, &w, &mut y).unwrap();
            let mut dx = vec![f32::NAN; m * k];
            matmul_w(&dy, m, &w, &mut dx).unwrap();
            // The whole-matrix path (a dense weight) gives the same products.
            let mut y2 = vec![f32::NAN; m * n];
            matmul_wt(&x, m, &dense, &mut y2).unwrap();
            let mut dx2 = vec![f32::NAN; m * k];
            matmul_w(&dy, m, &dense, &mut dx2).unwrap();
            for (a, b) in y.iter().zip(&y2).chain(dx.iter().zip(&dx2)) {
                assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
            }
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|c| f64::from(x[i * k + c]) * f64::from(wv[j * k + c]));
                    let (want, size) = sum_and_size(terms);
                    let got = f64::from(y[i * n + j]);
                    assert!(
                        (got - want).abs() <= tol(size),
                        "y[{i},{j}]: {got} vs {want}"
                    );
                }
                for c in 0..k {
                    let terms = (0..n).map(|j| f64::from(dy[i * n + j]) * f64::from(wv[j * k + c]));
                    let (want, size) = sum_and_size(terms);
                    let got = f64::from(dx[i * k + c]);
                    assert!(
                        (got - want).abs() <= tol(size),
                        "dx[{i},{c}]: {got} vs {want}"
                    );
                }
            }
        }
    }

    /// The LoRA Linear and its gradients against a textbook f64 computation (with and
    /// without dropout and a bias), over a packed weight of two tiles' alignment.
    #[test]
    fn lora_linear_and_its_gradients_match_f64() {
        let (m, n, k, r) = (5, 7, 9, 3);
        let mut seed = 77u64;
        let mut v = |len: usize| -> Vec<f32> { (0..len).map(|_| lcg(&mut seed)).collect() };
        let (x, wv, a, b, bias, dy) = (v(m * k), v(n * k), v(r * k), v(n * r), v(n), v(m * n));
        let keep: Vec<f32> = (0..m * k)
            .map(|i| if i % 3 == 0 { 0.0 } else { 1.0 })
            .collect();
        let w = Paired(DenseRows::new(wv.clone(), n, k).unwrap());
        for dropout in [false, true] {
            let lora = Lora {
                a: &a,
                b: &b,
                r,
                scale: 1.5,
                keep: dropout.then_some((&keep[..], 1.25)),
            };
            let f = |x: &[f64], a: &[f32], b: &[f32]| -> Vec<f64> {
                let mut y = vec![0f64; m * n];
                for i in 0..m {
                    let xd: Vec<f64> = (0..k)
                        .map(|c| {
                            x[i * k + c]
                                * if dropout {
                                    f64::from(keep[i * k + c]) * 1.25
                                } else {
                                    1.0
                                }
                        })
                        .collect();
                    let h: Vec<f64> = (0..r)
                        .map(|j| (0..k).map(|c| xd[c] * f64::from(a[j * k + c])).sum())
                        .collect();
                    for o in 0..n {
                        let base: f64 = (0..k)
                            .map(|c| x[i * k + c] * f64::from(wv[o * k + c]))
                            .sum();
                        let d: f64 = (0..r).map(|j| h[j] * f64::from(b[o * r + j])).sum();
                        y[i * n + o] = base + f64::from(bias[o]) + 1.5 * d;
                    }
                }
                y
            };
            let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
            let mut y = vec![0f32; m * n];
            lora_forward(&x, m, &w, Some(&bias), &lora, &mut y).unwrap();
            for (g, want) in y.iter().zip(f(&x64, &a, &b)) {
                assert!((f64::from(*g) - want).abs() < 1e-5 * (1.0 + want.abs()));
            }
            let (mut dx, mut da, mut db) =
                (vec![0f32; m * k], vec![0f32; r * k], vec![0f32; n * r]);
            lora_backward(&x, m, &w, &lora, &dy, (&mut dx, &mut da, &mut db)).unwrap();
            // The function is linear in each of x, A, B: its gradient is exact by any difference.
            let loss =
                |y: &[f64]| -> f64 { y.iter().zip(&dy).map(|(y, d)| y * f64::from(*d)).sum() };
            for i in 0..m * k {
                let mut xp = x64.clone();
                xp[i] += 1.0;
                let want = loss(&f(&xp, &a, &b)) - loss(&f(&x64, &a, &b));
                assert!(
                    (f64::from(dx[i]) - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "dx[{i}]"
                );
            }
            for i in 0..r * k {
                let mut ap = a.clone();
                ap[i] += 1.0;
                let want = loss(&f(&x64, &ap, &b)) - loss(&f(&x64, &a, &b));
                assert!(
                    (f64::from(da[i]) - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "da[{i}]"
                );
            }
            for i in 0..n * r {
                let mut bp = b.clone();
                bp[i] += 1.0;
                let want = loss(&f(&x64, &a, &bp)) - loss(&f(&x64, &a, &b));
                assert!(
                    (f64::from(db[i]) - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "db[{i}]"
                );
            }
        }
    }

    #[test]
    fn half_rows_widen_exactly() {
        let values = [1.5f32, -0.0078125, 3.0e-3, 65504.0, -2.5, 1.0e-7];
        for bf16 in [true, false] {
            let bits: Vec<u16> = values
                .iter()
                .map(|&v| {
                    if bf16 {
                        half::bf16::from_f32(v).to_bits()
                    } else {
                        half::f16::from_f32(v).to_bits()
                    }
                })
                .collect();
            let w = HalfRows::new(bits.clone(), bf16, 3, 2).unwrap();
            let mut out = [0f32; 4];
            w.decode_rows(1, &mut out).unwrap();
            for (i, o) in out.iter().enumerate() {
                let want = if bf16 {
                    half::bf16::from_bits(bits[2 + i]).to_f32()
                } else {
                    half::f16::from_bits(bits[2 + i]).to_f32()
                };
                assert_eq!(o.to_bits(), want.to_bits(), "{bf16} {i}");
            }
            assert!(w.decode_rows(2, &mut out).is_err());
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
