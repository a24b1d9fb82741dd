//! A packed GEMM on AVX-512 (BLIS's loop structure): `C [m, n] = A [m, k] · B [k, n]` for
//! strided f32 operands, in two arithmetics:
//!
//! - [`matmul`]: f32 fused multiply-adds, each output the sequential chain
//!   `acc = fma(A[i, p], B[p, j], acc)` for `p = 0..k`;
//! - [`matmul_bf16_rounded`]: PyTorch's CPU autocast — both operands rounded to bf16 (nearest,
//!   ties to even) as they are packed, summed on `VDPBF16PS` in f32 one pair of `k` at a time
//!   (`acc = dot_pair(acc, A[i, 2q..2q+2], B[2q..2q+2, j])`), the result rounded to bf16 and
//!   kept as an f32.
//!
//! Each output's order of operations is fixed by `k` alone — not by the blocking, the tiles or
//! the thread count — so both equal their scalar references ([`reference`]) bit for bit
//! (tests/simd_equals_reference.rs).
//!
//! The structure: `B` is packed a block of [`NC`] columns × `KC` rows at a time into
//! micro-panels of [`NR`] columns (64: four 16-lane vectors), each held in L1 while every
//! [`MR`]-row tile of `A` passes it; a tile keeps its 6 × 64 sums in 24 registers, broadcasting
//! one `A` value (f32) or pair (bf16) per step and multiplying it into four `B` vectors. `A`
//! is read where it lies when its rows are contiguous along `k` (f32), else packed once into
//! rows that are. Partial sums between `k` blocks wait in `C` itself (exact f32 values, so the
//! chain is unchanged). Threads take (row block, column block) tasks; packing buffers are kept
//! per thread between calls, so a product faults in no fresh pages.
//!
//! Operands' strides are free, so the three products of a trained Linear (`x · Wᵀ`, `dy · W`,
//! `dyᵀ · x`) run without a transposed copy of anything: the packing reads each layout.

use crate::KernelError;
use rayon::prelude::*;
use std::cell::RefCell;

/// Rows of a register tile.
pub const MR: usize = 6;
/// Columns of a register tile (four 16-lane vectors).
pub const NR: usize = 64;
/// Columns of `B` a task packs at a time.
pub const NC: usize = 256;
/// Rows of `A` a task takes at a time: their `KC`-unit block (120 KiB of f32) stays in L2 beside
/// the packed `B` block while the micro-panels pass it.
const MC: usize = 240;
/// `k` units per block (f32 values or bf16 pairs): a micro-panel of 128 × 64 units is 32 KiB.
const KC: usize = 128;

/// A strided f32 matrix: element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    /// The values.
    pub data: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row stride.
    pub rs: usize,
    /// Column stride.
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major `[rows, cols]` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (a view: the strides swapped).
    pub fn t(self) -> Self {
        Mat {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    #[inline(always)]
    fn at(&self, r: usize, c: usize) -> f32 {
        self.data[r * self.rs + c * self.cs]
    }

    fn check(&self, op: &'static str, name: &str) -> Result<(), KernelError> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|r| (self.cols - 1).checked_mul(self.cs).map(|c| (r, c)))
            .and_then(|(r, c)| r.checked_add(c));
        match last {
            Some(l) if l < self.data.len() => Ok(()),
            _ => Err(KernelError::Parameter {
                op,
                what: format!(
                    "{name} [{}, {}] with strides ({}, {}) reaches past its {} values",
                    self.rows,
                    self.cols,
                    self.rs,
                    self.cs,
                    self.data.len()
                ),
            }),
        }
    }
}

/// Whether this CPU runs [`matmul`]: AVX-512F, and `KILN_CPU` not forcing a narrower path.
pub fn available() -> bool {
    super::isa() == super::Isa::Avx512
}

/// Whether this CPU runs [`matmul_bf16_rounded`]: AVX-512 BF16 as well.
pub fn bf16_available() -> bool {
    super::bf16_matmul::available()
}

/// `v` rounded to the nearest bf16 (ties to even; a NaN quieted), in the high 16 bits of an
/// f32's bits, the low 16 zero: `half::bf16::from_f32(v)`'s value, branch-free.
#[inline(always)]
pub fn bf16_high(v: f32) -> u32 {
    let b = v.to_bits();
    if v.is_nan() {
        (b | 0x0040_0000) & 0xFFFF_0000
    } else {
        b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000
    }
}

/// Two values rounded to bf16 as one `VDPBF16PS` operand: `lo` (the even `k`) in the low half.
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    bf16_high(hi) | (bf16_high(lo) >> 16)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    /// bf16 pairs; `round`: the sums rounded to bf16 at the end.
    Bf16 {
        round: bool,
    },
    /// [`Kind::Bf16`]'s arithmetic on operands already held as bf16 pairs: each 32-bit value
    /// two bf16 values along `k` (the even one in the low half), packed as they are.
    Bf16Pairs {
        round: bool,
    },
}

impl Kind {
    /// Whether the operands' 32-bit values are packed as they are (f32 values, or pairs).
    fn as_is(self) -> bool {
        matches!(self, Kind::F32 | Kind::Bf16Pairs { .. })
    }
}

fn shapes(op: &'static str, a: &Mat, b: &Mat, c: usize, ldc: usize) -> Result<(), KernelError> {
    a.check(op, "A")?;
    b.check(op, "B")?;
    if a.cols != b.rows {
        return Err(KernelError::Parameter {
            op,
            what: format!(
                "A [{}, {}] times B [{}, {}]: inner sizes differ",
                a.rows, a.cols, b.rows, b.cols
            ),
        });
    }
    let (m, n) = (a.rows, b.cols);
    if ldc < n || (m > 0 && n > 0 && c < (m - 1) * ldc + n) {
        return Err(KernelError::Parameter {
            op,
            what: format!("C holds {c} values, not [{m}, {n}] with rows {ldc} apart"),
        });
    }
    Ok(())
}

/// `c [m, n]` (row-major) `= a [m, k] · b [k, n]` in f32 fused multiply-adds (sequential
/// along `k`). An error where [`available`] is false or the shapes disagree.
pub fn matmul(a: Mat, b: Mat, c: &mut [f32]) -> Result<(), KernelError> {
    let n = b.cols;
    matmul_into(a, b, c, n, false)
}

/// [`matmul`] into rows of `c` `ldc` apart (`c[i * ldc + j]`, the rest untouched); with
/// `accumulate` each output's chain starts from `c`'s value instead of zero.
pub fn matmul_into(
    a: Mat,
    b: Mat,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<(), KernelError> {
    let op = "gemm::matmul";
    shapes(op, &a, &b, c.len(), ldc)?;
    if !available() {
        return Err(KernelError::Unsupported {
            op,
            device: "this CPU (it needs AVX-512F)",
        });
    }
    drive(Kind::F32, a, b, (c, ldc), accumulate);
    Ok(())
}

/// The error of a bf16 product where [`bf16_available`] is false.
fn need_bf16(op: &'static str) -> Result<(), KernelError> {
    if bf16_available() {
        Ok(())
    } else {
        Err(KernelError::Unsupported {
            op,
            device: "this CPU (it needs AVX-512 BF16)",
        })
    }
}

/// `c [m, n] = bf16(bf16(a) · bf16(b))` with f32 sums on `VDPBF16PS`, the results bf16 values
/// held as f32. An error where [`bf16_available`] is false or the shapes disagree.
pub fn matmul_bf16_rounded(a: Mat, b: Mat, c: &mut [f32]) -> Result<(), KernelError> {
    let n = b.cols;
    matmul_bf16_into(a, b, (c, n), false, true)
}

/// The bf16 arithmetic of [`matmul_bf16_rounded`] into rows of `c` `ldc` apart, each output's
/// chain started from `c`'s value (`accumulate`) and its sum rounded to bf16 at the end only
/// with `round`: a product over `k` split into calls (even splits keep the pairs) chains as
/// one product.
pub fn matmul_bf16_into(
    a: Mat,
    b: Mat,
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
    round: bool,
) -> Result<(), KernelError> {
    let op = "gemm::matmul_bf16_rounded";
    shapes(op, &a, &b, c.len(), ldc)?;
    need_bf16(op)?;
    drive(Kind::Bf16 { round }, a, b, (c, ldc), accumulate);
    Ok(())
}

/// `y [m, n] = bf16(x [m, k] · w [n, k]ᵀ)` for bf16 values given as their bits (a frozen bf16
/// Linear: `x` its input, `w` its weight), written as bf16 bits: [`matmul_bf16_rounded`]'s
/// arithmetic, so the same bits as it gives on the values widened to f32. Pairs along `k` are
/// read as they lie (rows of even length at 4-byte addresses; others are paired into a copy
/// first, an odd `k`'s last value paired with zero), `w`'s rows packed by register transposes
/// with nothing rounded. An error where [`bf16_available`] is false or a length disagrees.
pub fn matmul_bf16_bits_wt(
    x: &[u16],
    w: &[u16],
    y: &mut [u16],
    (m, n, k): (usize, usize, usize),
) -> Result<(), KernelError> {
    let op = "gemm::matmul_bf16_bits_wt";
    crate::error::check_len(op, "x", x.len(), m * k, &[m, k])?;
    crate::error::check_len(op, "w", w.len(), n * k, &[n, k])?;
    crate::error::check_len(op, "y", y.len(), m * n, &[m, n])?;
    need_bf16(op)?;
    let (xp, wp) = (pairs(x, k), pairs(w, k));
    let kp = k.div_ceil(2);
    let a = Mat::row_major(&xp, m, kp);
    let b = Mat::row_major(&wp, n, kp).t();
    let mut c = vec![0f32; m * n];
    shapes(op, &a, &b, c.len(), n)?;
    drive(Kind::Bf16Pairs { round: true }, a, b, (&mut c, n), false);
    // Each sum was rounded to bf16: its high half is the value.
    y.par_chunks_mut(1 << 14)
        .zip(c.par_chunks(1 << 14))
        .for_each(|(y, c)| {
            for (o, v) in y.iter_mut().zip(c) {
                *o = (v.to_bits() >> 16) as u16;
            }
        });
    Ok(())
}

/// Rows of `k` bf16 bits as rows of `⌈k/2⌉` pairs held in f32 slots: the same memory where `k`
/// is even and the address 4-byte aligned, else a copy (an odd `k`'s last value paired with 0).
fn pairs(v: &[u16], k: usize) -> std::borrow::Cow<'_, [f32]> {
    if k.is_multiple_of(2)
        && let Ok(p) = bytemuck::try_cast_slice::<u16, f32>(v)
    {
        return std::borrow::Cow::Borrowed(p);
    }
    let kp = k.div_ceil(2);
    let rows = v.len().checked_div(k).unwrap_or(0);
    let mut out = vec![0f32; rows * kp];
    for (src, dst) in v.chunks(k.max(1)).zip(out.chunks_mut(kp.max(1))) {
        for (q, d) in dst.iter_mut().enumerate() {
            let lo = u32::from(src[2 * q]);
            let hi = src.get(2 * q + 1).map_or(0, |&h| u32::from(h));
            *d = f32::from_bits((hi << 16) | lo);
        }
    }
    std::borrow::Cow::Owned(out)
}

thread_local! {
    /// The calling thread's packed `A`; each worker's packed `B` block.
    static A_PACK: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static B_PACK: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a buffer of at least `len` units from `cell` (grown, never shrunk; a fresh one
/// if the cell is in use further up this thread's stack).
fn with_buf<R>(
    cell: &'static std::thread::LocalKey<RefCell<Vec<u32>>>,
    len: usize,
    f: impl FnOnce(&mut [u32]) -> R,
) -> R {
    cell.with(|c| match c.try_borrow_mut() {
        Ok(mut v) => {
            if v.len() < len {
                v.resize(len, 0);
            }
            f(&mut v[..len])
        }
        Err(_) => f(&mut vec![0u32; len]),
    })
}

/// Addresses shared by the tasks (each writes its own tiles of `C`).
#[derive(Clone, Copy)]
struct Shared {
    a: *const u32,
    c: *mut f32,
}
impl Shared {
    // Methods, so closures capture the whole (Send) struct, not its raw-pointer fields.
    fn a(&self) -> *const u32 {
        self.a
    }
    fn c(&self) -> *mut f32 {
        self.c
    }
}
// SAFETY: `a` is read-only for the product's duration; the tasks write disjoint tiles of `c`,
// which outlives the parallel loop.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// Rows (unit rows: `k` f32 values or `⌈k/2⌉` bf16 pairs) of `A` packed row-major, in tiles
/// of 16 rows × 64 units (reads and writes both stay in L1 whichever stride is 1).
fn pack_a(kind: Kind, a: &Mat, units: usize, out: &mut [u32]) {
    let k = a.cols;
    out.par_chunks_mut(16 * units)
        .enumerate()
        .for_each(|(t, rows)| {
            let r0 = t * 16;
            let nr = rows.len() / units;
            for u0 in (0..units).step_by(64) {
                let u1 = (u0 + 64).min(units);
                if kind.as_is() && a.rs == 1 {
                    // Columns of `A` are contiguous: read them whole, write across the rows.
                    for u in u0..u1 {
                        let col = &a.data[u * a.cs + r0..u * a.cs + r0 + nr];
                        for (r, v) in col.iter().enumerate() {
                            rows[r * units + u] = v.to_bits();
                        }
                    }
                    continue;
                }
                for r in 0..nr {
                    let row = &mut rows[r * units..(r + 1) * units];
                    match kind {
                        Kind::F32 | Kind::Bf16Pairs { .. } => {
                            for (u, o) in (u0..u1).zip(&mut row[u0..u1]) {
                                *o = a.at(r0 + r, u).to_bits();
                            }
                        }
                        Kind::Bf16 { .. } => {
                            for (u, o) in (u0..u1).zip(&mut row[u0..u1]) {
                                let lo = a.at(r0 + r, 2 * u);
                                let hi = if 2 * u + 1 < k {
                                    a.at(r0 + r, 2 * u + 1)
                                } else {
                                    0.0
                                };
                                *o = pair(lo, hi);
                            }
                        }
                    }
                }
            }
        });
}

/// Columns `j0..j0 + w` of `B`, unit rows `u0..u1`, packed as micro-panels `[panel][u][NR]`
/// (columns past `w` zero).
fn pack_b(kind: Kind, b: &Mat, (j0, w): (usize, usize), (u0, u1): (usize, usize), out: &mut [u32]) {
    let k = b.rows;
    let us = u1 - u0;
    for (pi, panel) in out.chunks_mut(us * NR).enumerate() {
        let pj = pi * NR;
        if pj >= w {
            break;
        }
        let pw = NR.min(w - pj);
        let jb = j0 + pj;
        match (kind, b.cs == 1) {
            (Kind::F32 | Kind::Bf16Pairs { .. }, true) => {
                for (u, dst) in (u0..u1).zip(panel.chunks_mut(NR)) {
                    let src = &b.data[u * b.rs + jb..u * b.rs + jb + pw];
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = s.to_bits();
                    }
                    dst[pw..].fill(0);
                }
            }
            (Kind::F32 | Kind::Bf16Pairs { .. }, false) => {
                for dst in panel.chunks_mut(NR) {
                    dst[pw..].fill(0);
                }
                if b.rs == 1 {
                    pack_b_columns(kind, b, (jb, pw), (u0, us), panel);
                    continue;
                }
                for j in 0..pw {
                    for (u, dst) in (u0..u1).zip(panel.chunks_mut(NR)) {
                        dst[j] = b.at(u, jb + j).to_bits();
                    }
                }
            }
            (Kind::Bf16 { .. }, true) => {
                for (u, dst) in (u0..u1).zip(panel.chunks_mut(NR)) {
                    let lo = &b.data[2 * u * b.rs + jb..2 * u * b.rs + jb + pw];
                    if 2 * u + 1 < k {
                        let hi = &b.data[(2 * u + 1) * b.rs + jb..(2 * u + 1) * b.rs + jb + pw];
                        for ((d, l), h) in dst.iter_mut().zip(lo).zip(hi) {
                            *d = pair(*l, *h);
                        }
                    } else {
                        for (d, l) in dst.iter_mut().zip(lo) {
                            *d = pair(*l, 0.0);
                        }
                    }
                    dst[pw..].fill(0);
                }
            }
            (Kind::Bf16 { .. }, false) => {
                for dst in panel.chunks_mut(NR) {
                    dst[pw..].fill(0);
                }
                if b.rs == 1 && 2 * u1 <= k {
                    pack_b_columns(kind, b, (jb, pw), (u0, us), panel);
                    continue;
                }
                for j in 0..pw {
                    for (u, dst) in (u0..u1).zip(panel.chunks_mut(NR)) {
                        let lo = b.at(2 * u, jb + j);
                        let hi = if 2 * u + 1 < k {
                            b.at(2 * u + 1, jb + j)
                        } else {
                            0.0
                        };
                        dst[j] = pair(lo, hi);
                    }
                }
            }
        }
    }
}

/// [`pack_b`] of a micro-panel whose columns of `B` are contiguous (`x · Wᵀ`: each weight row
/// is a column of `Wᵀ`; for bf16, a unit's pair two adjacent values): 16 × 16 blocks transposed
/// in registers, the edges value by value.
fn pack_b_columns(
    kind: Kind,
    b: &Mat,
    (jb, pw): (usize, usize),
    (u0, us): (usize, usize),
    panel: &mut [u32],
) {
    // Values of a column per unit.
    let per = match kind {
        Kind::F32 | Kind::Bf16Pairs { .. } => 1,
        Kind::Bf16 { .. } => 2,
    };
    let (fj, fu) = (pw / 16 * 16, us / 16 * 16);
    #[cfg(target_arch = "x86_64")]
    for j0 in (0..fj).step_by(16) {
        for du in (0..fu).step_by(16) {
            let src = &b.data[(jb + j0) * b.cs + per * (u0 + du)..];
            let dst = &mut panel[du * NR + j0..];
            assert!(src.len() >= 15 * b.cs + 16 * per && dst.len() >= 15 * NR + 16);
            // SAFETY: the callers checked `available()` (AVX-512F) and, for bf16,
            // `bf16_available()` (BW and BF16 too); the 16 columns hold `16 · per` values each
            // from here and the 16 panel rows 16 writable values each (asserted).
            unsafe {
                match kind {
                    Kind::F32 | Kind::Bf16Pairs { .. } => {
                        x86::transpose16(src.as_ptr(), b.cs, dst.as_mut_ptr(), NR)
                    }
                    Kind::Bf16 { .. } => {
                        x86::transpose16_pairs(src.as_ptr(), b.cs, dst.as_mut_ptr(), NR)
                    }
                }
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let (fj, fu) = (0usize, 0usize);
    for j in 0..pw {
        let col = &b.data[(jb + j) * b.cs + per * u0..];
        for u in if j < fj { fu } else { 0 }..us {
            panel[u * NR + j] = match kind {
                Kind::F32 | Kind::Bf16Pairs { .. } => col[u].to_bits(),
                Kind::Bf16 { .. } => pair(col[2 * u], col[2 * u + 1]),
            };
        }
    }
}

fn drive(kind: Kind, a: Mat, b: Mat, (c, ldc): (&mut [f32], usize), accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    let units = match kind {
        Kind::F32 | Kind::Bf16Pairs { .. } => k,
        Kind::Bf16 { .. } => k.div_ceil(2),
    };
    let in_place = kind.as_is() && a.cs == 1;
    let cp = c.as_mut_ptr();
    let run = |ap: *const u32, lda: usize| {
        // The task grid: column blocks of NC, and enough row blocks for every thread.
        let nb = n.div_ceil(NC);
        let threads = rayon::current_num_threads().max(1);
        let mb = (2 * threads).div_ceil(nb).clamp(1, m.div_ceil(MR));
        let rows_per = m.div_ceil(mb).div_ceil(MR) * MR;
        let mb = m.div_ceil(rows_per);
        let sh = Shared { a: ap, c: cp };
        (0..mb * nb).into_par_iter().for_each(|t| {
            let (ib, jb) = (t / nb, t % nb);
            let (i0, i1) = (ib * rows_per, ((ib + 1) * rows_per).min(m));
            let (j0, j1) = (jb * NC, ((jb + 1) * NC).min(n));
            let w = j1 - j0;
            let panels = w.div_ceil(NR);
            with_buf(&B_PACK, panels * KC * NR, |bp| {
                for u0 in (0..units).step_by(KC) {
                    let u1 = (u0 + KC).min(units);
                    let us = u1 - u0;
                    pack_b(kind, &b, (j0, w), (u0, u1), &mut bp[..panels * us * NR]);
                    for ic in (i0..i1).step_by(MC) {
                        let ie = (ic + MC).min(i1);
                        for p in 0..panels {
                            let pj = p * NR;
                            let cols = NR.min(w - pj);
                            let bpan = bp[p * us * NR..].as_ptr();
                            for i in (ic..ie).step_by(MR) {
                                let rows = MR.min(ie - i);
                                #[cfg(target_arch = "x86_64")]
                                // SAFETY: `available()` / `bf16_available()` were checked by the
                                // callers; `A`'s unit rows `i..i + rows` hold `units` values from
                                // `lda · i` (`u0..u1` read), the micro-panel `us × NR` units; `C`'s
                                // rows `i..i + rows`, columns `j0 + pj..+ cols` are this task's alone.
                                unsafe {
                                    let (ap, cp) =
                                        (sh.a().add(i * lda + u0), sh.c().add(i * ldc + j0 + pj));
                                    match kind {
                                        Kind::F32 => x86::tile_f32(
                                            ap.cast(),
                                            lda,
                                            bpan.cast(),
                                            us,
                                            cp,
                                            ldc,
                                            (rows, cols),
                                            u0 > 0 || accumulate,
                                        ),
                                        Kind::Bf16 { round } | Kind::Bf16Pairs { round } => {
                                            x86::tile_bf16(
                                                ap,
                                                lda,
                                                bpan,
                                                us,
                                                cp,
                                                ldc,
                                                (rows, cols),
                                                (u0 > 0 || accumulate, round && u1 == units),
                                            )
                                        }
                                    }
                                }
                                #[cfg(not(target_arch = "x86_64"))]
                                let _ = (rows, cols, bpan, lda);
                            }
                        }
                    }
                }
            });
        });
    };
    if in_place {
        // f32 bits are f32 values (or pairs already): A's rows read where they lie.
        run(a.data.as_ptr().cast::<u32>(), a.rs);
    } else {
        with_buf(&A_PACK, m * units, |ap| {
            pack_a(kind, &a, units, ap);
            run(ap.as_ptr(), units);
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// `v` rounded to bf16 (nearest, ties to even, NaN quieted) and widened back.
    #[target_feature(enable = "avx512f")]
    fn round_bf16(v: __m512) -> __m512 {
        let b = _mm512_castps_si512(v);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
        let hi = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let r = _mm512_and_si512(_mm512_add_epi32(b, bias), hi);
        let q = _mm512_and_si512(_mm512_or_si512(b, _mm512_set1_epi32(0x0040_0000)), hi);
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_castsi512_ps(_mm512_mask_blend_epi32(nan, r, q))
    }

    /// A 16 × 16 transpose of 32-bit values in registers: `out[c]` lane `t` = `r[t]` lane `c`
    /// (pairs interleaved, then 64-bit pairs, then 128-bit lanes twice).
    #[target_feature(enable = "avx512f")]
    fn t16(r: [__m512; 16]) -> [__m512; 16] {
        let pd = _mm512_castps_pd;
        let ps = _mm512_castpd_ps;
        let mut t = [_mm512_setzero_ps(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = ps(_mm512_unpacklo_pd(pd(a), pd(c)));
            u[4 * g + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(c)));
            u[4 * g + 2] = ps(_mm512_unpacklo_pd(pd(b), pd(d)));
            u[4 * g + 3] = ps(_mm512_unpackhi_pd(pd(b), pd(d)));
        }
        let mut v = [_mm512_setzero_ps(); 16];
        for i in 0..4 {
            v[i] = _mm512_shuffle_f32x4::<0x88>(u[i], u[i + 4]);
            v[i + 4] = _mm512_shuffle_f32x4::<0xdd>(u[i], u[i + 4]);
            v[i + 8] = _mm512_shuffle_f32x4::<0x88>(u[i + 8], u[i + 12]);
            v[i + 12] = _mm512_shuffle_f32x4::<0xdd>(u[i + 8], u[i + 12]);
        }
        std::array::from_fn(|c| {
            if c < 8 {
                _mm512_shuffle_f32x4::<0x88>(v[c], v[c + 8])
            } else {
                _mm512_shuffle_f32x4::<0xdd>(v[c - 8], v[c])
            }
        })
    }

    /// `dst` row `c` (16 values, rows `ds` apart) = value `c` of each of the 16 `src` rows
    /// (`ss` apart): a 16 × 16 block of `B` whose columns are contiguous, packed.
    ///
    /// SAFETY: AVX-512F present; `src` holds 16 rows of 16 values, `dst` 16 writable rows.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn transpose16(src: *const f32, ss: usize, dst: *mut u32, ds: usize) {
        // SAFETY: the caller's contract.
        let r = std::array::from_fn(|t| unsafe { _mm512_loadu_ps(src.add(t * ss)) });
        for (c, v) in t16(r).into_iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { _mm512_storeu_ps(dst.add(c * ds).cast(), v) };
        }
    }

    /// [`transpose16`] of bf16 pairs: each `src` row holds 32 values, rounded to bf16 and
    /// paired (`2c`, `2c + 1`) into value `c`.
    ///
    /// SAFETY: AVX-512F and BW present; `src` holds 16 rows of 32 values, `dst` 16 writable
    /// rows of 16.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn transpose16_pairs(src: *const f32, ss: usize, dst: *mut u32, ds: usize) {
        // The high 16-bit word of each value: words 1, 3, 5, … of the two vectors.
        let odd = _mm512_set_epi16(
            63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25, 23, 21,
            19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
        );
        let r = std::array::from_fn(|t| {
            // SAFETY: the caller's contract.
            let (lo, hi) = unsafe {
                (
                    _mm512_loadu_ps(src.add(t * ss)),
                    _mm512_loadu_ps(src.add(t * ss + 16)),
                )
            };
            let (lo, hi) = (
                _mm512_castps_si512(round_bf16(lo)),
                _mm512_castps_si512(round_bf16(hi)),
            );
            _mm512_castsi512_ps(_mm512_permutex2var_epi16(lo, odd, hi))
        });
        for (c, v) in t16(r).into_iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { _mm512_storeu_ps(dst.add(c * ds).cast(), v) };
        }
    }

    /// `R` accumulator rows from `C` (`load`) or zero.
    ///
    /// SAFETY: AVX-512F present; with `load`, `c` holds `R` rows, `ldc` apart, of the masks'
    /// columns.
    #[target_feature(enable = "avx512f")]
    unsafe fn start<const R: usize>(
        c: *const f32,
        ldc: usize,
        masks: &[__mmask16; 4],
        load: bool,
    ) -> [[__m512; 4]; R] {
        let mut acc = [[_mm512_setzero_ps(); 4]; R];
        if load {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    // SAFETY: the caller's contract; masked-off lanes are not read.
                    *x = unsafe { _mm512_maskz_loadu_ps(masks[v], c.add(r * ldc + 16 * v)) };
                }
            }
        }
        acc
    }

    /// Stores the accumulators (rounded to bf16 with `round`).
    ///
    /// SAFETY: AVX-512F present; `c` holds `R` writable rows, `ldc` apart, of the masks'
    /// columns.
    #[target_feature(enable = "avx512f")]
    unsafe fn finish<const R: usize>(
        acc: &[[__m512; 4]; R],
        c: *mut f32,
        ldc: usize,
        masks: &[__mmask16; 4],
        round: bool,
    ) {
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                let x = if round { round_bf16(*x) } else { *x };
                // SAFETY: the caller's contract; masked-off lanes are not written.
                unsafe { _mm512_mask_storeu_ps(c.add(r * ldc + 16 * v), masks[v], x) };
            }
        }
    }

    fn masks(cols: usize) -> [__mmask16; 4] {
        std::array::from_fn(|v| {
            let left = cols.saturating_sub(16 * v).min(16);
            ((1u32 << left) - 1) as __mmask16
        })
    }

    /// One f32 tile: `C[r, j]` (`r < rows`, `j < cols`) gets the fused multiply-add chain
    /// over `us` values of `A`'s row `r` (rows `lda` apart) and the micro-panel's column `j`,
    /// started from `C`'s value (`load`) or zero.
    ///
    /// SAFETY: AVX-512F present; `a` holds `rows` rows of `us` values, `lda` apart; `b` holds
    /// `us × NR` values; `c` points at `rows` rows of `cols` writable values, `ldc` apart, that
    /// no other thread touches meanwhile.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn tile_f32(
        a: *const f32,
        lda: usize,
        b: *const f32,
        us: usize,
        c: *mut f32,
        ldc: usize,
        (rows, cols): (usize, usize),
        load: bool,
    ) {
        macro_rules! go {
            ($($r:literal)*) => {
                match rows {
                    // SAFETY: the caller's contract, `R` = `rows`.
                    $($r => unsafe { f32_kernel::<$r>(a, lda, b, us, c, ldc, cols, load) },)*
                    _ => unreachable!("a tile has at most {MR} rows"),
                }
            };
        }
        go!(1 2 3 4 5 6);
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn f32_kernel<const R: usize>(
        a: *const f32,
        lda: usize,
        b: *const f32,
        us: usize,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        load: bool,
    ) {
        let masks = masks(cols);
        // SAFETY: the caller's contract.
        let mut acc = unsafe { start::<R>(c, ldc, &masks, load) };
        for u in 0..us {
            // SAFETY: value `u` of the micro-panel: NR values from `u · NR`.
            let bv: [__m512; 4] =
                std::array::from_fn(|v| unsafe { _mm512_loadu_ps(b.add(u * NR + 16 * v)) });
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: value `u` of row `r` of `A`.
                let av = unsafe { _mm512_set1_ps(*a.add(r * lda + u)) };
                for (x, bv) in row.iter_mut().zip(&bv) {
                    *x = _mm512_fmadd_ps(av, *bv, *x);
                }
            }
        }
        // SAFETY: the caller's contract.
        unsafe { finish::<R>(&acc, c, ldc, &masks, false) };
    }

    /// One bf16 tile: as [`tile_f32`] with `us` pairs of bf16 values (`u32` units) summed by
    /// `VDPBF16PS`, the sums rounded to bf16 when `round`.
    ///
    /// SAFETY: AVX-512F, BW and BF16 present; otherwise as [`tile_f32`].
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn tile_bf16(
        a: *const u32,
        lda: usize,
        b: *const u32,
        us: usize,
        c: *mut f32,
        ldc: usize,
        (rows, cols): (usize, usize),
        (load, round): (bool, bool),
    ) {
        macro_rules! go {
            ($($r:literal)*) => {
                match rows {
                    // SAFETY: the caller's contract, `R` = `rows`.
                    $($r => unsafe { bf16_kernel::<$r>(a, lda, b, us, c, ldc, cols, load, round) },)*
                    _ => unreachable!("a tile has at most {MR} rows"),
                }
            };
        }
        go!(1 2 3 4 5 6);
    }

    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn bf16_kernel<const R: usize>(
        a: *const u32,
        lda: usize,
        b: *const u32,
        us: usize,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        load: bool,
        round: bool,
    ) {
        let masks = masks(cols);
        // SAFETY: the caller's contract.
        let mut acc = unsafe { start::<R>(c, ldc, &masks, load) };
        for u in 0..us {
            // SAFETY: unit `u` of the micro-panel: NR pairs from `u · NR`; plain bits as the
            // instruction's operand.
            let bv: [__m512bh; 4] = std::array::from_fn(|v| unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    b.add(u * NR + 16 * v).cast(),
                ))
            });
            for (r, row) in acc.iter_mut().enumerate() {
                // SAFETY: unit `u` of row `r` of `A`; plain bits as the operand.
                let av = unsafe {
                    std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        *a.add(r * lda + u) as i32
                    ))
                };
                for (x, bv) in row.iter_mut().zip(&bv) {
                    *x = _mm512_dpbf16_ps(*x, av, *bv);
                }
            }
        }
        // SAFETY: the caller's contract.
        unsafe { finish::<R>(&acc, c, ldc, &masks, round) };
    }
}

/// The scalar definitions both kernels equal bit for bit.
pub mod reference {
    use super::{Mat, bf16_high};
    use crate::ops::bf16_matmul::dot_pair;

    /// `A · B`, each output `acc = A[i, p].mul_add(B[p, j], acc)` for `p = 0..k` from `+0`.
    pub fn matmul(a: &Mat, b: &Mat) -> Vec<f32> {
        matmul_from(a, b, &vec![0f32; a.rows * b.cols])
    }

    /// [`matmul`] with each chain starting from `start [m, n]` (an accumulating product).
    pub fn matmul_from(a: &Mat, b: &Mat, start: &[f32]) -> Vec<f32> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = start[i * n + j];
                for p in 0..k {
                    acc = a.at(i, p).mul_add(b.at(p, j), acc);
                }
                c[i * n + j] = acc;
            }
        }
        c
    }

    /// `bf16(bf16(A) · bf16(B))`: pairs along `k` through one `VDPBF16PS` lane each (a missing
    /// last value zero), the sum rounded to bf16 (`half`'s rounding).
    pub fn matmul_bf16_rounded(a: &Mat, b: &Mat) -> Vec<f32> {
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let bits = |v: f32| (bf16_high(v) >> 16) as u16;
        let mut c = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for q in 0..k.div_ceil(2) {
                    let (a1, b1) = if 2 * q + 1 < k {
                        (a.at(i, 2 * q + 1), b.at(2 * q + 1, j))
                    } else {
                        (0.0, 0.0)
                    };
                    acc = dot_pair(
                        acc,
                        [bits(a.at(i, 2 * q)), bits(a1)],
                        [bits(b.at(2 * q, j)), bits(b1)],
                    );
                }
                c[i * n + j] = half::bf16::from_f32(acc).to_f32();
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed.wrapping_mul(40_503))
                    >> 7;
                (h % 20_001) as f32 / 7_000.0 - 1.4
            })
            .collect()
    }

    /// Every layout of both operands (row-major and transposed views), shapes around the
    /// tile, panel, block and pair sizes.
    fn layouts(m: usize, k: usize, n: usize, seed: u32) -> Vec<(Vec<f32>, bool, Vec<f32>, bool)> {
        let mut v = Vec::new();
        for at in [false, true] {
            for bt in [false, true] {
                v.push((data(m * k, seed), at, data(k * n, seed + 1), bt));
            }
        }
        v
    }

    fn view(d: &[f32], rows: usize, cols: usize, t: bool) -> Mat<'_> {
        if t {
            Mat::row_major(d, cols, rows).t()
        } else {
            Mat::row_major(d, rows, cols)
        }
    }

    #[test]
    fn both_arithmetics_equal_their_references_bit_for_bit() {
        let f32_ok = available();
        let bf16_ok = bf16_available();
        if !f32_ok {
            eprintln!("skipping: this CPU has no AVX-512F");
            return;
        }
        if !bf16_ok {
            eprintln!("skipping the bf16 products: this CPU has no AVX-512 BF16");
        }
        for (m, k, n) in [
            (1, 1, 1),
            (7, 3, 5),
            (6, 129, 64),
            (13, 257, 65),
            (20, 300, 300),
            (5, 2, 600),
        ] {
            for (ad, at, bd, bt) in layouts(m, k, n, (m * 31 + n) as u32) {
                let (a, b) = (view(&ad, m, k, at), view(&bd, k, n, bt));
                let mut c = vec![f32::NAN; m * n];
                matmul(a, b, &mut c).unwrap();
                let want = reference::matmul(&a, &b);
                assert!(
                    c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "f32 {m}x{k}x{n} at={at} bt={bt}"
                );
                if bf16_ok {
                    let mut c = vec![f32::NAN; m * n];
                    matmul_bf16_rounded(a, b, &mut c).unwrap();
                    let want = reference::matmul_bf16_rounded(&a, &b);
                    assert!(
                        c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "bf16 {m}x{k}x{n} at={at} bt={bt}"
                    );
                }
            }
        }
    }

    #[test]
    fn bf16_bits_in_give_the_widened_values_bits() {
        if !bf16_available() {
            eprintln!("skipping: this CPU has no AVX-512 BF16");
            return;
        }
        let bits =
            |d: Vec<f32>| -> Vec<u16> { d.iter().map(|&v| (bf16_high(v) >> 16) as u16).collect() };
        let widen = |b: &[u16]| -> Vec<f32> {
            b.iter()
                .map(|&h| f32::from_bits(u32::from(h) << 16))
                .collect()
        };
        // Even and odd `k`, and operands one element into their buffers (2-byte aligned
        // only), so both the in-place pairs and the copies are taken.
        for (m, k, n) in [
            (1, 1, 1),
            (7, 3, 5),
            (6, 130, 64),
            (13, 257, 65),
            (20, 300, 300),
            (3, 0, 4),
        ] {
            for offset in [0usize, 1] {
                let xb = bits(data(m * k + offset, (m + k) as u32));
                let wb = bits(data(n * k + offset, (n + k) as u32 + 7));
                let (x, w) = (&xb[offset..], &wb[offset..]);
                let mut y = vec![0x7FC1u16; m * n];
                matmul_bf16_bits_wt(x, w, &mut y, (m, n, k)).unwrap();
                let (xf, wf) = (widen(x), widen(w));
                let want = reference::matmul_bf16_rounded(
                    &Mat::row_major(&xf, m, k),
                    &Mat::row_major(&wf, n, k).t(),
                );
                assert!(
                    y.iter()
                        .zip(&want)
                        .all(|(&g, w)| u32::from(g) << 16 == w.to_bits()),
                    "{m}x{k}x{n} offset {offset}"
                );
            }
        }
        let mut y = vec![0u16; 4];
        assert!(matmul_bf16_bits_wt(&[0; 5], &[0; 6], &mut y, (2, 2, 3)).is_err());
    }

    #[test]
    fn an_accumulating_product_into_spaced_rows_starts_each_chain_from_c() {
        if !available() {
            eprintln!("skipping: this CPU has no AVX-512F");
            return;
        }
        let (m, k, n, ldc) = (9, 140, 70, 75);
        let (ad, bd) = (data(m * k, 5), data(k * n, 6));
        let (a, b) = (Mat::row_major(&ad, m, k), Mat::row_major(&bd, k, n).t().t());
        let start = data(m * n, 7);
        let mut c = vec![-7.0f32; (m - 1) * ldc + n + 3];
        for i in 0..m {
            c[i * ldc..i * ldc + n].copy_from_slice(&start[i * n..(i + 1) * n]);
        }
        matmul_into(a, b, &mut c, ldc, true).unwrap();
        let want = reference::matmul_from(&a, &b, &start);
        for i in 0..m {
            for j in 0..ldc.min(c.len() - i * ldc) {
                let got = c[i * ldc + j];
                if j < n {
                    assert_eq!(got.to_bits(), want[i * n + j].to_bits(), "({i}, {j})");
                } else {
                    assert_eq!(got, -7.0, "({i}, {j}) outside C was written");
                }
            }
        }
    }

    #[test]
    fn a_bf16_product_split_along_k_at_an_even_point_chains_as_one() {
        if !bf16_available() {
            eprintln!("skipping: this CPU has no AVX-512 BF16");
            return;
        }
        let (m, k, n, cut) = (7, 300, 70, 130);
        let (ad, bd) = (data(m * k, 8), data(k * n, 9));
        let mut whole = vec![0f32; m * n];
        let (a, b) = (Mat::row_major(&ad, m, k), Mat::row_major(&bd, k, n));
        matmul_bf16_rounded(a, b, &mut whole).unwrap();
        let part = |from: usize, to: usize| {
            let a = Mat {
                data: &ad[from..],
                rows: m,
                cols: to - from,
                rs: k,
                cs: 1,
            };
            (a, Mat::row_major(&bd[from * n..to * n], to - from, n))
        };
        let mut split = vec![0f32; m * n];
        let (a0, b0) = part(0, cut);
        matmul_bf16_into(a0, b0, (&mut split, n), false, false).unwrap();
        assert!(
            split
                .iter()
                .any(|v| *v != half::bf16::from_f32(*v).to_f32())
        );
        let (a1, b1) = part(cut, k);
        matmul_bf16_into(a1, b1, (&mut split, n), true, true).unwrap();
        assert_eq!(
            split.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            whole.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn bf16_high_is_halfs_rounding() {
        for v in [
            0.0f32,
            -0.0,
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-9),
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
            1e-40,
            -3.3e38,
        ] {
            let want = u32::from(half::bf16::from_f32(v).to_bits()) << 16;
            assert_eq!(bf16_high(v), want, "{v}");
        }
    }

    #[test]
    fn shapes_and_strides_are_checked() {
        let d = [0f32; 6];
        let mut c = [0f32; 4];
        let e = matmul(Mat::row_major(&d, 2, 3), Mat::row_major(&d, 2, 3), &mut c).unwrap_err();
        assert!(e.to_string().contains("inner sizes"), "{e}");
        let bad = Mat {
            data: &d,
            rows: 2,
            cols: 3,
            rs: 4,
            cs: 1,
        };
        let e = matmul(bad, Mat::row_major(&d, 3, 2), &mut c).unwrap_err();
        assert!(e.to_string().contains("reaches past"), "{e}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]
        #[test]
        fn any_shape_and_layout_equals_the_reference(
            m in 1usize..20, k in 1usize..300, n in 1usize..140,
            at in any::<bool>(), bt in any::<bool>(), seed in 0u32..1000,
        ) {
            prop_assume!(available());
            let (ad, bd) = (data(m * k, seed), data(k * n, seed + 1));
            let (a, b) = (view(&ad, m, k, at), view(&bd, k, n, bt));
            let mut c = vec![0f32; m * n];
            matmul(a, b, &mut c).unwrap();
            let want = reference::matmul(&a, &b);
            prop_assert!(c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()));
            if bf16_available() {
                matmul_bf16_rounded(a, b, &mut c).unwrap();
                let want = reference::matmul_bf16_rounded(&a, &b);
                prop_assert!(c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
        }
    }
}
