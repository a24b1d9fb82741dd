//! [`ops::bf16_matmul`](crate::ops::bf16_matmul) on AVX-512 BF16 (`VDPBF16PS`): 32 bf16
//! multiply-adds an instruction, twice f32 FMA's rate, and the weight read in its own 2 bytes.
//! Each output is the reference's dot product — the same chunks, lanes and lane tree — so the
//! bytes equal the reference's whatever the shape, blocking or thread count.
//!
//! Threads take blocks of [`BLOCK`] weight rows; a block runs tiles of [`MR`] input rows ×
//! [`NR`] weight rows, 24 accumulators in registers, both operands read along `k` where they
//! lie (no packing: a weight row is contiguous, and so is an input row).

use crate::KernelError;
use crate::ops::bf16_matmul as reference;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Input rows per tile.
pub const MR: usize = 4;
/// Weight rows per tile.
pub const NR: usize = 6;
/// Weight rows per parallel task (a multiple of [`NR`]): 48 rows of 4096 bf16 values are
/// 384 KiB, inside a core's L2 while its input rows stream past.
pub const BLOCK: usize = 8 * NR;

/// Whether this CPU runs [`matmul_wt`]: x86-64 with AVX-512F, BW and BF16, and `KILN_CPU`
/// not forcing a narrower path (`avx2`, `scalar`).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            super::isa() == super::Isa::Avx512
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// `y [m, n] = x [m, k] · Wᵀ` (`W [n, k]`), bf16 bits in, f32 out, equal to
/// [`reference::matmul_wt`] bit for bit. An error where [`available`] is false.
pub fn matmul_wt(
    x: &[u16],
    w: &[u16],
    y: &mut [f32],
    dims: (usize, usize, usize),
) -> Result<(), KernelError> {
    product_f32("bf16 matmul_wt", x, w, y, dims, |v| v)
}

/// [`matmul_wt`] with each output rounded to bf16 (nearest, ties to even; `half`'s
/// conversion, as candle's bf16 tensors and PyTorch round), written as bf16 bits — the
/// rounding done by the threads that computed the values.
pub fn matmul_wt_bf16(
    x: &[u16],
    w: &[u16],
    y: &mut [u16],
    dims: (usize, usize, usize),
) -> Result<(), KernelError> {
    product("bf16 matmul_wt_bf16", x, w, y, dims, |v| {
        half::bf16::from_f32(v).to_bits()
    })
}

/// [`matmul_wt`] with each output then rounded to the nearest bf16 (ties to even) and kept
/// as an f32: what a bf16 product whose result stays in an f32 buffer holds (autocast's).
pub fn matmul_wt_rounded(
    x: &[u16],
    w: &[u16],
    y: &mut [f32],
    dims: (usize, usize, usize),
) -> Result<(), KernelError> {
    product_f32("bf16 matmul_wt_rounded", x, w, y, dims, |v| {
        half::bf16::from_f32(v).to_f32()
    })
}

/// `y`'s address, shared by the tasks that write its disjoint column blocks.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the tasks holding it write disjoint elements of one live buffer (see `product_f32`).
#[cfg(target_arch = "x86_64")]
unsafe impl Send for Out {}
// SAFETY: as above.
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for Out {}

/// Checks a product's shapes and this CPU; `false` where there is nothing to compute.
fn ready(
    op: &'static str,
    (x, w, y): (usize, usize, usize),
    (m, n, k): (usize, usize, usize),
) -> Result<bool, KernelError> {
    reference::check(op, x, w, y, (m, n, k))?;
    if !available() {
        return Err(KernelError::Unsupported {
            op,
            device: "this CPU (it needs AVX-512 BF16)",
        });
    }
    Ok(m > 0 && n > 0)
}

/// An f32 product written where it lies: each task computes a block of [`BLOCK`] weight
/// rows straight into those columns of `y` and applies `post` to them while they are in cache.
fn product_f32(
    op: &'static str,
    x: &[u16],
    w: &[u16],
    y: &mut [f32],
    (m, n, k): (usize, usize, usize),
    post: impl Fn(f32) -> f32 + Sync,
) -> Result<(), KernelError> {
    if !ready(op, (x.len(), w.len(), y.len()), (m, n, k))? {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let out = Out(y.as_mut_ptr());
        (0..n)
            .step_by(BLOCK)
            .collect::<Vec<_>>()
            .into_par_iter()
            .for_each(|j0| {
                let nb = BLOCK.min(n - j0);
                let o = out;
                // SAFETY: `available()` detected AVX-512F, BW and BF16; `x` and the weight
                // block hold the rows `block` reads (shapes checked above); columns
                // `j0..j0 + nb` of `y`'s `m` rows (row stride `n`) are this task's alone, and
                // `y` outlives the parallel loop.
                unsafe {
                    x86::block(x, &w[j0 * k..(j0 + nb) * k], o.0.add(j0), n, (m, nb, k));
                    for i in 0..m {
                        let row = std::slice::from_raw_parts_mut(o.0.add(i * n + j0), nb);
                        for v in row {
                            *v = post(*v);
                        }
                    }
                }
            });
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (post, y);
    Ok(())
}

fn product<T: Copy + Default + Send + Sync>(
    op: &'static str,
    x: &[u16],
    w: &[u16],
    y: &mut [T],
    (m, n, k): (usize, usize, usize),
    out: impl Fn(f32) -> T + Sync,
) -> Result<(), KernelError> {
    if !ready(op, (x.len(), w.len(), y.len()), (m, n, k))? {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        let blocks: Vec<(usize, Vec<T>)> = (0..n)
            .step_by(BLOCK)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|j0| {
                let nb = BLOCK.min(n - j0);
                let mut sums = vec![0f32; m * nb];
                // SAFETY: `available()` detected AVX-512F, BW and BF16; the slices hold the
                // rows `block` reads (shapes checked above); `sums` is this task's `[m, nb]`.
                unsafe {
                    x86::block(
                        x,
                        &w[j0 * k..(j0 + nb) * k],
                        sums.as_mut_ptr(),
                        nb,
                        (m, nb, k),
                    )
                };
                (j0, sums.into_iter().map(&out).collect())
            })
            .collect();
        y.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
            for (j0, block) in &blocks {
                let nb = block.len() / m;
                row[*j0..j0 + nb].copy_from_slice(&block[i * nb..(i + 1) * nb]);
            }
        });
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (out, y);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{MR, NR};
    use std::arch::x86_64::*;

    /// The 16 lanes' sum in the reference's tree: `l + (l + 8)`, `+ 4`, `+ 2`, `+ 1`.
    #[target_feature(enable = "avx512f")]
    fn reduce(v: __m512) -> f32 {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s8 = _mm256_add_ps(lo, hi);
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2)))
    }

    /// A chunk of 32 bf16 values at `p` (with a `mask`, only the values it selects, the
    /// rest zero) as the instruction's operand.
    ///
    /// SAFETY: the selected values lie inside one allocation (masked-off lanes never fault).
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn chunk(p: *const u16, mask: Option<__mmask32>) -> __m512bh {
        // SAFETY: the caller's contract.
        let v = unsafe {
            match mask {
                None => _mm512_loadu_si512(p.cast()),
                Some(m) => _mm512_maskz_loadu_epi16(m, p.cast()),
            }
        };
        // SAFETY: both are 64-byte vectors of plain bits.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }

    /// A tile: `out[i * ldo + j]` = the dot product of input row `i` and weight row `j`,
    /// `R` input rows of `x` and `C` weight rows of `w`, each `k` long.
    ///
    /// SAFETY: `x` holds `R · k` values, `w` `C · k`; `out` points at `(R − 1) · ldo + C`
    /// writable values no other thread touches meanwhile.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const u16,
        w: *const u16,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        let full = k / 32;
        let rem = k % 32;
        let mut step = |o: usize, mask: Option<__mmask32>| {
            let mut wv = [chunk_zero(); C];
            for (j, v) in wv.iter_mut().enumerate() {
                // SAFETY: row `j` of `w` holds `k` values from `j · k`; `o` + the selected
                // lanes stay inside it.
                *v = unsafe { chunk(w.add(j * k + o), mask) };
            }
            for (i, row) in acc.iter_mut().enumerate() {
                // SAFETY: as above, for row `i` of `x`.
                let xv = unsafe { chunk(x.add(i * k + o), mask) };
                for (a, v) in row.iter_mut().zip(&wv) {
                    *a = _mm512_dpbf16_ps(*a, xv, *v);
                }
            }
        };
        for c in 0..full {
            step(c * 32, None);
        }
        if rem > 0 {
            step(full * 32, Some((1u32 << rem) - 1));
        }
        for (i, row) in acc.iter().enumerate() {
            for (j, a) in row.iter().enumerate() {
                // SAFETY: the caller's contract: `i < R`, `j < C`.
                unsafe { *out.add(i * ldo + j) = reduce(*a) };
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    fn chunk_zero() -> __m512bh {
        // SAFETY: a zero vector's bits as the operand type.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()) }
    }

    /// Tile `(r, c)` rows (at most [`MR`] × [`NR`]) at input row `i` and weight row `j`.
    ///
    /// SAFETY: AVX-512F/BW/BF16 present; the rows lie in `x` / `w`; `out` points at a
    /// `[·, ldo]` matrix whose rows `i..i + r`, columns `j..j + c` are this thread's to write.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn tile_at(
        x: &[u16],
        w: &[u16],
        out: *mut f32,
        (i, j, r, c): (usize, usize, usize, usize),
        (ldo, k): (usize, usize),
    ) {
        let xp = x[i * k..].as_ptr();
        let wp = w[j * k..].as_ptr();
        // SAFETY: the caller's contract: the element (i, j) lies in `out`'s matrix.
        let o = unsafe { out.add(i * ldo + j) };
        macro_rules! dispatch {
            ($($r:literal, $c:literal);*) => {
                match (r, c) {
                    // SAFETY: the caller's contract; `r` and `c` rows exist from `i` and `j`.
                    $(($r, $c) => unsafe { tile::<$r, $c>(xp, wp, k, o, ldo) },)*
                    _ => unreachable!("a tile is at most {MR} × {NR}"),
                }
            };
        }
        dispatch!(
            4, 6; 4, 5; 4, 4; 4, 3; 4, 2; 4, 1;
            3, 6; 3, 5; 3, 4; 3, 3; 3, 2; 3, 1;
            2, 6; 2, 5; 2, 4; 2, 3; 2, 2; 2, 1;
            1, 6; 1, 5; 1, 4; 1, 3; 1, 2; 1, 1
        );
    }

    /// `out [m, nb]` (rows `ldo` apart) = `x [m, k]` · `w [nb, k]`ᵀ, tile by tile: each
    /// input tile stays in L1 while the block's weight rows pass it.
    ///
    /// SAFETY: AVX-512F/BW/BF16 present; `x` and `w` hold `m · k` and `nb · k` values;
    /// `out` points at `m` rows of `nb` values, `ldo` apart, that no other thread touches
    /// meanwhile.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn block(
        x: &[u16],
        w: &[u16],
        out: *mut f32,
        ldo: usize,
        (m, nb, k): (usize, usize, usize),
    ) {
        for i in (0..m).step_by(MR) {
            let r = MR.min(m - i);
            for j in (0..nb).step_by(NR) {
                let c = NR.min(nb - j);
                // SAFETY: the caller's contract; `r` rows from `i`, `c` from `j`.
                unsafe { tile_at(x, w, out, (i, j, r, c), (ldo, k)) };
            }
        }
    }
}
