//! llama.cpp's k-quant scale searches (Q2_K, Q4_K, Q5_K, Q6_K; under an importance matrix
//! Q2_K, Q3_K, Q4_K, Q5_K and Q6_K) over eight sub-blocks at once (Q3_K without one: a
//! sub-block's sixteen codes at once, [`make_q3_lanes`]): the
//! searches that cost nearly all of a k-quant's time (Q4_K tries 21 candidate scales per
//! 32-element sub-block, each a pass with a weighted least-squares fit).
//!
//! The data is transposed: `x[i]` holds element `i` of eight sub-blocks, one per lane, so the
//! sub-blocks advance together through their elements. Each lane performs, for its sub-block,
//! exactly the f32 operations of the reference (`ops::gguf::make_qkx2_quants` /
//! `make_qx_quants`) in the same order — sums accumulate element by element, never
//! reassociated, no fused multiply-add — and the reference's branches become per-lane selects.
//! The bytes are therefore the reference's (`tests/simd_equals_reference.rs`; inputs holding
//! NaN excepted, whose payloads IEEE 754 lets an addition pick either way).
//!
//! `make_qkx2_quants` takes each candidate scale from the minimum the candidates before it
//! left, so a vector's candidates run one after another, each a chain of dependent adds: the
//! searches of Q2_K (a super-block's two halves) and Q4_K / Q5_K (two super-blocks) run two
//! vectors side by side ([`make_qkx2_quants_k`]), their chains interleaved.
//!
//! The searches are written once over [`Lanes`], eight f32 lanes: [`Portable`] (an array, any
//! CPU) and, on x86-64, `Avx2` (one `__m256`). Everything down to the lane operations is
//! `#[inline(always)]`, so inside the AVX2 `target_feature` entry point (`x86::quantize_gguf`, which AVX-512 machines run too)
//! the whole search compiles to vector instructions.

// Index loops rather than iterator adapters: an adapter's `fold` left un-inlined is a function
// of its own, compiled without the AVX2 entry point's target features.
#![allow(clippy::needless_range_loop)]

use crate::error::KernelError;
use crate::ops::gguf::{
    GgufType, check_layout, q2_k_finish, q6_k_finish, qk_asym_finish, qk_asym_grid,
    qk_asym_impl_finish, qk_asym_weights,
};

/// Eight f32 lanes and the operations the searches use, each lane-wise and IEEE-exact as the
/// scalar operator. A mask is a vector whose true lanes are all ones.
pub(crate) trait Lanes: Copy {
    fn splat(v: f32) -> Self;
    fn load(a: &[f32; 8]) -> Self;
    fn store(self, a: &mut [f32; 8]);
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    fn neg(self) -> Self;
    fn abs(self) -> Self;
    fn sqrt(self) -> Self;
    /// `self < o` (false where either is NaN).
    fn lt(self, o: Self) -> Self;
    /// `self == o` (false where either is NaN).
    fn eq(self, o: Self) -> Self;
    /// `self != o` (true where either is NaN).
    fn ne(self, o: Self) -> Self;
    fn and(self, o: Self) -> Self;
    /// Per lane: `a` where `self` is true, else `b`.
    fn select(self, a: Self, b: Self) -> Self;
    /// ggml's `nearest_int` clamped to `lo..=hi`, as f32.
    fn code(self, lo: i32, hi: i32) -> Self;
    /// Eight small integers as f32.
    fn from_i8(a: &[i8; 8]) -> Self;
    /// The least lane (for lanes without NaN).
    fn hmin(self) -> f32;
    /// A mask's lanes as bits, lane `k` in bit `k`.
    fn bits(self) -> u32;
    /// The i-quants' neighbour search in these lanes over `lists`.
    fn neighbours(lists: &'static super::iquants::LaneLists) -> super::iquants::LaneSearch;
}

/// [`Lanes`] as an array: any CPU.
#[derive(Clone, Copy)]
pub(crate) struct Portable([f32; 8]);

impl Portable {
    #[inline(always)]
    fn zip(self, o: Self, f: impl Fn(f32, f32) -> f32) -> Self {
        let mut r = [0f32; 8];
        for k in 0..8 {
            r[k] = f(self.0[k], o.0[k]);
        }
        Portable(r)
    }

    #[inline(always)]
    fn mask(self, o: Self, f: impl Fn(f32, f32) -> bool) -> Self {
        self.zip(o, |a, b| f32::from_bits(if f(a, b) { u32::MAX } else { 0 }))
    }
}

impl Lanes for Portable {
    #[inline(always)]
    fn splat(v: f32) -> Self {
        Portable([v; 8])
    }
    #[inline(always)]
    fn load(a: &[f32; 8]) -> Self {
        Portable(*a)
    }
    #[inline(always)]
    fn store(self, a: &mut [f32; 8]) {
        *a = self.0;
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self.zip(o, |a, b| a + b)
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self.zip(o, |a, b| a - b)
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self.zip(o, |a, b| a * b)
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        self.zip(o, |a, b| a / b)
    }
    #[inline(always)]
    fn neg(self) -> Self {
        self.zip(self, |a, _| -a)
    }
    #[inline(always)]
    fn abs(self) -> Self {
        self.zip(self, |a, _| a.abs())
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        self.zip(self, |a, _| a.sqrt())
    }
    #[inline(always)]
    fn lt(self, o: Self) -> Self {
        self.mask(o, |a, b| a < b)
    }
    #[inline(always)]
    fn eq(self, o: Self) -> Self {
        self.mask(o, |a, b| a == b)
    }
    #[inline(always)]
    fn ne(self, o: Self) -> Self {
        self.mask(o, |a, b| a != b)
    }
    #[inline(always)]
    fn and(self, o: Self) -> Self {
        self.zip(o, |a, b| f32::from_bits(a.to_bits() & b.to_bits()))
    }
    #[inline(always)]
    fn select(self, a: Self, b: Self) -> Self {
        let mut r = [0f32; 8];
        for k in 0..8 {
            r[k] = if self.0[k].to_bits() != 0 {
                a.0[k]
            } else {
                b.0[k]
            };
        }
        Portable(r)
    }
    #[inline(always)]
    fn code(self, lo: i32, hi: i32) -> Self {
        self.zip(self, |a, _| {
            crate::ops::gguf::nearest_int(a).max(lo).min(hi) as f32
        })
    }
    #[inline(always)]
    fn from_i8(a: &[i8; 8]) -> Self {
        Portable(a.map(f32::from))
    }
    #[inline(always)]
    fn hmin(self) -> f32 {
        self.0.into_iter().fold(f32::INFINITY, f32::min)
    }
    #[inline(always)]
    fn bits(self) -> u32 {
        let mut b = 0;
        for k in 0..8 {
            b |= (self.0[k].to_bits() >> 31) << k;
        }
        b
    }
    fn neighbours(lists: &'static super::iquants::LaneLists) -> super::iquants::LaneSearch {
        super::iquants::LaneSearch::Portable(lists)
    }
}

/// [`Lanes`] as one AVX2 register. Its methods may only run where AVX2 is available: they are
/// reached only through `x86::quantize_gguf`, whose callers
/// detected it.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub(crate) struct Avx2(std::arch::x86_64::__m256);

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Avx2, Lanes};
    use std::arch::x86_64::*;

    impl Lanes for Avx2 {
        #[inline(always)]
        fn splat(v: f32) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_set1_ps(v) })
        }
        #[inline(always)]
        fn load(a: &[f32; 8]) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`); eight f32 behind the reference.
            Avx2(unsafe { _mm256_loadu_ps(a.as_ptr()) })
        }
        #[inline(always)]
        fn store(self, a: &mut [f32; 8]) {
            // SAFETY: AVX2 is available (see `Avx2`); eight f32 behind the reference.
            unsafe { _mm256_storeu_ps(a.as_mut_ptr(), self.0) }
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_add_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn sub(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_sub_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_mul_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn div(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_div_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn neg(self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_xor_ps(self.0, _mm256_set1_ps(-0.0)) })
        }
        #[inline(always)]
        fn abs(self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe {
                _mm256_castsi256_ps(_mm256_and_si256(
                    _mm256_castps_si256(self.0),
                    _mm256_set1_epi32(0x7fff_ffff),
                ))
            })
        }
        #[inline(always)]
        fn sqrt(self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_sqrt_ps(self.0) })
        }
        #[inline(always)]
        fn lt(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_cmp_ps::<_CMP_LT_OQ>(self.0, o.0) })
        }
        #[inline(always)]
        fn eq(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_cmp_ps::<_CMP_EQ_OQ>(self.0, o.0) })
        }
        #[inline(always)]
        fn ne(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_cmp_ps::<_CMP_NEQ_UQ>(self.0, o.0) })
        }
        #[inline(always)]
        fn and(self, o: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_and_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn select(self, a: Self, b: Self) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe { _mm256_blendv_ps(b.0, a.0, self.0) })
        }
        #[inline(always)]
        fn code(self, lo: i32, hi: i32) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`).
            Avx2(unsafe {
                let v = _mm256_castps_si256(_mm256_add_ps(self.0, _mm256_set1_ps(12_582_912.0)));
                let q = _mm256_sub_epi32(
                    _mm256_and_si256(v, _mm256_set1_epi32(0x007f_ffff)),
                    _mm256_set1_epi32(0x0040_0000),
                );
                let q = _mm256_min_epi32(
                    _mm256_max_epi32(q, _mm256_set1_epi32(lo)),
                    _mm256_set1_epi32(hi),
                );
                _mm256_cvtepi32_ps(q)
            })
        }
        #[inline(always)]
        fn from_i8(a: &[i8; 8]) -> Self {
            // SAFETY: AVX2 is available (see `Avx2`); the load reads the eight bytes of `a`.
            Avx2(unsafe {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    a.as_ptr().cast::<__m128i>(),
                )))
            })
        }
        #[inline(always)]
        fn hmin(self) -> f32 {
            // SAFETY: AVX2 is available (see `Avx2`).
            unsafe {
                let m = _mm_min_ps(
                    _mm256_castps256_ps128(self.0),
                    _mm256_extractf128_ps::<1>(self.0),
                );
                let m = _mm_min_ps(m, _mm_movehl_ps(m, m));
                let m = _mm_min_ss(m, _mm_shuffle_ps::<1>(m, m));
                _mm_cvtss_f32(m)
            }
        }
        #[inline(always)]
        fn bits(self) -> u32 {
            // SAFETY: AVX2 is available (see `Avx2`).
            unsafe { _mm256_movemask_ps(self.0) as u32 }
        }
        fn neighbours(
            lists: &'static crate::cpu::iquants::LaneLists,
        ) -> crate::cpu::iquants::LaneSearch {
            crate::cpu::iquants::LaneSearch::Avx2(lists)
        }
    }
}

/// Quantizes whole blocks of `ty` from `x` into `out` ([`GgufType::bytes_for`] bytes): the
/// k-quants by the lane searches on `V`, the other types by the reference's own code. Inlined
/// into the caller so that it compiles for the caller's target features.
#[inline(always)]
pub(crate) fn quantize_blocks<V: Lanes>(
    ty: GgufType,
    x: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    check_layout(ty, x.len(), x.len().max(ty.block_elems()), out.len())?;
    if super::iquants::is_iquant(ty) && !crate::ops::gguf::needs_weights(ty) {
        super::iquants::quantize::<V>(ty, x, x.len(), None, out);
        return Ok(());
    }
    if matches!(ty, GgufType::Iq4Nl | GgufType::Iq4Xs) {
        return iq4_blocks::<V>(ty, x, None, out);
    }
    if !matches!(
        ty,
        GgufType::Q2K | GgufType::Q3K | GgufType::Q4K | GgufType::Q5K | GgufType::Q6K
    ) {
        return crate::ops::gguf::quantize_blocks(ty, x, out);
    }
    // Plain index loops (not iterator adapters): a generic helper left un-inlined is a
    // function of its own, compiled without the caller's target features.
    let bytes = ty.block_bytes();
    let blocks = x.len() / 256;
    let mut b = 0;
    // Q4_K and Q5_K search two super-blocks at once (their add chains interleaved).
    if matches!(ty, GgufType::Q4K | GgufType::Q5K) {
        while b + 2 <= blocks {
            let (x, o) = (
                &x[256 * b..256 * b + 512],
                &mut out[bytes * b..bytes * b + 2 * bytes],
            );
            if ty == GgufType::Q4K {
                qk_asym::<V, 15, 2>(x, o);
            } else {
                qk_asym::<V, 31, 2>(x, o);
            }
            b += 2;
        }
    }
    while b < blocks {
        let (x, o) = (
            &x[256 * b..256 * b + 256],
            &mut out[bytes * b..bytes * b + bytes],
        );
        match ty {
            GgufType::Q2K => q2_k::<V>(x, o),
            GgufType::Q3K => q3_k::<V>(x, o),
            GgufType::Q4K => qk_asym::<V, 15, 1>(x, o),
            GgufType::Q5K => qk_asym::<V, 31, 1>(x, o),
            _ => q6_k::<V>(x, o),
        }
        b += 1;
    }
    Ok(())
}

/// Rows of `cols` of `ty` from `x` into `out` under the importance weights `qw` (one per
/// column): the k-quants by the lane searches (Q2_K, Q4_K, Q5_K: `make_qkx3_quants` with
/// weights `qw · sqrt(σ² + x²)`, 37 candidate scales; Q3_K: `make_qx_quants` with those
/// weights; Q6_K: `make_qx_quants` with `qw`), the other types by the reference's own code.
/// Inlined into the caller so that it compiles for the caller's target features.
#[inline(always)]
pub(crate) fn quantize_rows_with<V: Lanes>(
    ty: GgufType,
    x: &[f32],
    cols: usize,
    qw: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    if !matches!(
        ty,
        GgufType::Q4_0
            | GgufType::Q4_1
            | GgufType::Q5_0
            | GgufType::Q5_1
            | GgufType::Q2K
            | GgufType::Q3K
            | GgufType::Q4K
            | GgufType::Q5K
            | GgufType::Q6K
            | GgufType::Iq4Nl
            | GgufType::Iq4Xs
    ) && !super::iquants::is_iquant(ty)
    {
        return crate::ops::gguf::quantize_with(ty, x, cols, Some(qw), out);
    }
    check_layout(ty, x.len(), cols, out.len())?;
    if qw.len() != cols {
        return crate::ops::gguf::quantize_with(ty, x, cols, Some(qw), out);
    }
    if super::iquants::is_iquant(ty) {
        super::iquants::quantize::<V>(ty, x, cols, Some(qw), out);
        return Ok(());
    }
    let (bytes, row_bytes) = (ty.block_bytes(), ty.bytes_for(cols));
    if matches!(
        ty,
        GgufType::Q4_0 | GgufType::Q4_1 | GgufType::Q5_0 | GgufType::Q5_1
    ) {
        for r in 0..x.len() / cols.max(1) {
            let xr = &x[cols * r..cols * r + cols];
            let or = &mut out[row_bytes * r..row_bytes * r + row_bytes];
            legacy_row::<V>(ty, xr, qw, or)?;
        }
        return Ok(());
    }
    if matches!(ty, GgufType::Iq4Nl | GgufType::Iq4Xs) {
        for r in 0..x.len() / cols.max(1) {
            let xr = &x[cols * r..cols * r + cols];
            let or = &mut out[row_bytes * r..row_bytes * r + row_bytes];
            iq4_blocks::<V>(ty, xr, Some(qw), or)?;
        }
        return Ok(());
    }
    for r in 0..x.len() / cols.max(1) {
        let (xr, or) = (
            &x[cols * r..cols * r + cols],
            &mut out[row_bytes * r..row_bytes * r + row_bytes],
        );
        let (blocks, mut b) = (cols / 256, 0);
        // Q4_K and Q5_K search two super-blocks at once (their add chains interleaved).
        if matches!(ty, GgufType::Q4K | GgufType::Q5K) {
            while b + 2 <= blocks {
                let xb = &xr[256 * b..256 * b + 512];
                let qb = &qw[256 * b..256 * b + 512];
                let ob = &mut or[bytes * b..bytes * b + 2 * bytes];
                if ty == GgufType::Q4K {
                    qk_asym_weighted::<V, 15, 2>(xb, qb, ob);
                } else {
                    qk_asym_weighted::<V, 31, 2>(xb, qb, ob);
                }
                b += 2;
            }
        }
        while b < blocks {
            let xb = &xr[256 * b..256 * b + 256];
            let qb = &qw[256 * b..256 * b + 256];
            let ob = &mut or[bytes * b..bytes * b + bytes];
            match ty {
                GgufType::Q2K => q2_k_weighted::<V>(xb, qb, ob),
                GgufType::Q3K => q3_k_weighted::<V>(xb, qb, ob),
                GgufType::Q4K => qk_asym_weighted::<V, 15, 1>(xb, qb, ob),
                GgufType::Q5K => qk_asym_weighted::<V, 31, 1>(xb, qb, ob),
                _ => q6_k_weighted::<V>(xb, qb, ob),
            }
            b += 1;
        }
    }
    Ok(())
}

/// Q4_K / Q5_K under an importance matrix: the eight 32-element sub-blocks of one super-block,
/// one per lane (`quantize_row_q4_K_impl`'s search; its block scales and codes as the
/// reference computes them).
#[inline(always)]
fn qk_asym_weighted<V: Lanes, const NMAX: i32, const K: usize>(
    x: &[f32],
    qw: &[f32],
    o: &mut [u8],
) {
    let zero = V::splat(0.0);
    let (mut xs, mut ws) = ([[zero; 32]; K], [[zero; 32]; K]);
    let mut sw = [[0f32; 8]; K];
    for k in 0..K {
        let (xk, qk) = (&x[256 * k..256 * k + 256], &qw[256 * k..256 * k + 256]);
        let (weights, swk) = qk_asym_weights(xk, qk);
        sw[k] = swk;
        xs[k] = lanes(&transpose::<32>(xk, 0));
        ws[k] = lanes(&transpose::<32>(&weights, 0));
    }
    let found = make_qkx2_quants_k::<V, NMAX, 32, false, K>(&xs, &ws, -0.9, 0.05, 36);
    let bytes = o.len() / K;
    for k in 0..K {
        let (scales, mins, codes) = found[k];
        let (s, m, mut l) = untranspose32(scales, mins, &codes);
        let xk = &x[256 * k..256 * k + 256];
        let ok = &mut o[bytes * k..bytes * k + bytes];
        qk_asym_impl_finish(xk, ok, NMAX, &s, &m, &sw[k], &mut l);
    }
}

/// One row of a legacy type (Q4_0, Q4_1, Q5_0, Q5_1) under the importance weights `qw`: σ²
/// over the whole row, then eight 32-element blocks per vector (Q4_0 / Q5_0: weighted
/// `make_qx_quants`; Q4_1 / Q5_1: `make_qkx3_quants`), each block packed by the reference's
/// code; the blocks past the last group of eight by the reference.
#[inline(always)]
fn legacy_row<V: Lanes>(
    ty: GgufType,
    x: &[f32],
    qw: &[f32],
    out: &mut [u8],
) -> Result<(), KernelError> {
    use crate::ops::gguf::{legacy_pack_asym, legacy_pack_sym, legacy_sigma2};
    let sigma2 = legacy_sigma2(x);
    let bytes = ty.block_bytes();
    let groups = x.len() / 256;
    for g in 0..groups {
        let xg = &x[256 * g..256 * g + 256];
        let mut weights = [0f32; 256];
        for j in 0..256 {
            weights[j] = qw[256 * g + j] * (sigma2 + xg[j] * xg[j]).sqrt();
        }
        let xs: [V; 32] = lanes(&transpose::<32>(xg, 0));
        let ws: [V; 32] = lanes(&transpose::<32>(&weights, 0));
        let og = &mut out[8 * bytes * g..8 * bytes * (g + 1)];
        let (d, min, codes) = match ty {
            GgufType::Q4_0 => {
                let (d, c) = make_qx_quants::<V, 8, 32>(&xs, &ws);
                (d, V::splat(0.0), c)
            }
            GgufType::Q5_0 => {
                let (d, c) = make_qx_quants::<V, 16, 32>(&xs, &ws);
                (d, V::splat(0.0), c)
            }
            GgufType::Q4_1 => make_qkx2_quants::<V, 15, 32, false>(&xs, &ws, -0.9, 0.05, 36),
            _ => make_qkx2_quants::<V, 31, 32, false>(&xs, &ws, -0.9, 0.05, 36),
        };
        let (ds, mins, l) = untranspose32(d, min, &codes);
        for k in 0..8 {
            let o = &mut og[bytes * k..bytes * (k + 1)];
            let mut block = [0u8; 32];
            block.copy_from_slice(&l[32 * k..32 * k + 32]);
            if matches!(ty, GgufType::Q4_0 | GgufType::Q5_0) {
                legacy_pack_sym(ty, o, ds[k], &block.map(|c| c as i8));
            } else {
                legacy_pack_asym(ty, o, ds[k], mins[k], &block);
            }
        }
    }
    // Blocks past the last whole group of eight, by the reference with the row's σ².
    let done = 256 * groups;
    if done < x.len() {
        crate::ops::gguf::legacy_blocks(
            ty,
            &x[done..],
            &qw[done..],
            sigma2,
            &mut out[8 * bytes * groups..],
        );
    }
    Ok(())
}

/// IQ4_NL / IQ4_XS over whole blocks of `x` (with the importance weights `qw` of the same
/// elements, or none): eight 32-element sub-blocks per vector (IQ4_XS: one super-block;
/// IQ4_NL: eight blocks, each with its own σ²), the reference's code for the blocks left over
/// and for the codes.
#[inline(always)]
fn iq4_blocks<V: Lanes>(
    ty: GgufType,
    x: &[f32],
    qw: Option<&[f32]>,
    out: &mut [u8],
) -> Result<(), KernelError> {
    use crate::ops::gguf::{iq4_finish, iq4_weights};
    let bytes = ty.block_bytes();
    let per = 256 / ty.block_elems();
    let groups = x.len() / 256;
    for g in 0..groups {
        let xg = &x[256 * g..256 * g + 256];
        let qg = qw.map(|q| &q[256 * g..256 * g + 256]);
        let og = &mut out[bytes * per * g..bytes * per * (g + 1)];
        let mut weights = [0f32; 256];
        if per == 1 {
            weights = iq4_weights(xg, qg);
        } else {
            for k in 0..8 {
                let w = iq4_weights(
                    &xg[32 * k..32 * k + 32],
                    qg.map(|q| &q[32 * k..32 * k + 32]),
                );
                weights[32 * k..32 * k + 32].copy_from_slice(&w[..32]);
            }
        }
        let scales = iq4_scales::<V>(xg, &weights);
        if per == 1 {
            iq4_finish(xg, og, &scales);
        } else {
            for k in 0..8 {
                iq4_finish(
                    &xg[32 * k..32 * k + 32],
                    &mut og[bytes * k..bytes * (k + 1)],
                    &scales[k..k + 1],
                );
            }
        }
    }
    // IQ4_NL blocks past the last whole group of eight.
    let done = 256 * groups;
    let left = &x[done..];
    let out = &mut out[bytes * per * groups..];
    match qw {
        _ if left.is_empty() => Ok(()),
        Some(q) => crate::ops::gguf::quantize_with(ty, left, left.len(), Some(&q[done..]), out),
        None => crate::ops::gguf::quantize_blocks(ty, left, out),
    }
}

/// IQ4's search (`quantize_row_iq4_nl_impl`, `ntry` 7) on eight 32-element sub-blocks, one per
/// lane, with their weights: each sub-block's scale (0 for a sub-block of zeros).
#[inline(always)]
fn iq4_scales<V: Lanes>(x: &[f32], weights: &[f32]) -> [f32; 8] {
    let v0i = i32::from(crate::ops::gguf::KVALUES_IQ4NL[0]);
    let xs: [V; 32] = lanes(&transpose::<32>(x, 0));
    let ws: [V; 32] = lanes(&transpose::<32>(weights, 0));
    let zero = V::splat(0.0);
    // The value of largest magnitude, the first one on ties.
    let (mut max, mut amax) = (zero, zero);
    for v in xs {
        let a = v.abs();
        let larger = amax.lt(a);
        amax = larger.select(a, amax);
        max = larger.select(v, max);
    }
    let empty = amax.lt(V::splat(1e-15));
    let id = V::splat(1.0).div(max.neg().div(V::splat(v0i as f32)));
    let (sumqx, sumq2) = iq4_sums(&xs, &ws, id);
    let mut d = zero.lt(sumq2).select(sumqx.div(sumq2), zero);
    let mut best = d.mul(sumqx);
    for itry in -7..=7 {
        let id = V::splat((itry + v0i) as f32).div(max);
        let (sumqx, sumq2) = iq4_sums(&xs, &ws, id);
        let better = zero.lt(sumq2).and(best.mul(sumq2).lt(sumqx.mul(sumqx)));
        d = better.select(sumqx.div(sumq2), d);
        best = better.select(d.mul(sumqx), best);
    }
    let mut scales = [0f32; 8];
    empty.select(zero, d).store(&mut scales);
    scales
}

/// `(Σ w·q·x, Σ w·q²)` over a sub-block's levels `q` at the inverse scale `id`.
#[inline(always)]
fn iq4_sums<V: Lanes>(xs: &[V; 32], ws: &[V; 32], id: V) -> (V, V) {
    let (mut sumqx, mut sumq2) = (V::splat(0.0), V::splat(0.0));
    for j in 0..32 {
        let q = iq4_level(id.mul(xs[j]));
        let wq = ws[j].mul(q);
        sumqx = sumqx.add(wq.mul(xs[j]));
        sumq2 = sumq2.add(wq.mul(q));
    }
    (sumqx, sumq2)
}

/// The IQ4 level nearest to `al` (ggml's `best_index_int8`, as a value): the levels around it,
/// the lower one when strictly nearer; the first level at or below it, the last at or above.
#[inline(always)]
fn iq4_level<V: Lanes>(al: V) -> V {
    let values = crate::ops::gguf::KVALUES_IQ4NL;
    let (mut lo, mut hi) = (
        V::splat(f32::from(values[0])),
        V::splat(f32::from(values[15])),
    );
    for &v in &values {
        let v = V::splat(f32::from(v));
        // `v <= al` (where `al` is NaN the result is the last level either way).
        lo = al.lt(v).select(lo, v);
    }
    for &v in values.iter().rev() {
        let v = V::splat(f32::from(v));
        hi = al.lt(v).select(v, hi);
    }
    al.sub(lo).lt(hi.sub(al)).select(lo, hi)
}

/// Q2_K under an importance matrix: sixteen 16-element sub-blocks, eight lanes at a time
/// (`quantize_row_q2_K_impl`'s search: `make_qkx3_quants`, squared errors); its block scales
/// and codes as the reference computes them.
#[inline(always)]
fn q2_k_weighted<V: Lanes>(x: &[f32], qw: &[f32], o: &mut [u8]) {
    let (weights, sw) = crate::ops::gguf::k16_weights(x, qw, 1.0);
    let (scales, mins, mut l) = q2_search::<V, false>(x, Some(&weights), (-0.9, 0.05, 36));
    crate::ops::gguf::q2_k_impl_finish(x, o, &scales, &mins, &sw, &mut l);
}

/// `make_qkx2_quants` (3-bit codes; `MAD`: absolute errors) on Q2_K's sixteen 16-element
/// sub-blocks, eight lanes at a time, with `weights` (`|x|` when `None`) and the candidate grid
/// `(rmin, rdelta, nstep)`: the sub-blocks' scales, `-min`s and codes in block order.
#[inline(always)]
fn q2_search<V: Lanes, const MAD: bool>(
    x: &[f32],
    weights: Option<&[f32]>,
    (rmin, rdelta, nstep): (f32, f32, i32),
) -> ([f32; 16], [f32; 16], [u8; 256]) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    // Both halves in one search, their sums interleaved.
    let xs: [[V; 16]; 2] = [
        lanes(&transpose::<16>(x, 0)),
        lanes(&transpose::<16>(x, 128)),
    ];
    let ws = [
        weight_lanes(&xs[0], weights, 0, V::abs),
        weight_lanes(&xs[1], weights, 1, V::abs),
    ];
    let found = make_qkx2_quants_k::<V, 3, 16, MAD, 2>(&xs, &ws, rmin, rdelta, nstep);
    for half in 0..2 {
        let (scale, min, codes) = found[half];
        let code = |c: f32| c as u8;
        untranspose16(
            half,
            scale,
            min,
            &codes,
            &mut scales,
            &mut mins,
            code,
            &mut l,
        );
    }
    (scales, mins, l)
}

/// Q3_K without an importance matrix (`quantize_row_q3_K_ref`): each 16-element sub-block's
/// `make_q3_quants` by [`make_q3_lanes`], then the reference's block scales and codes.
#[inline(always)]
fn q3_k<V: Lanes>(x: &[f32], o: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    for j in 0..16 {
        let xj: &[f32; 16] = x[16 * j..16 * j + 16].try_into().expect("16 values");
        let lj: &mut [i8; 16] = (&mut l[16 * j..16 * j + 16]).try_into().expect("16 codes");
        scales[j] = make_q3_lanes::<V>(xj, lj);
    }
    crate::ops::gguf::q3_k_ref_scales(o, &scales);
    q3_k_codes::<V>(x, o, &mut l);
}

/// Q3_K's codes from the stored `d` and scales, eight at a time (the reference's
/// `nearest_int(x / d)`, clamped), then packed; a sub-block whose step is zero keeps the codes
/// its search left in `l`.
#[inline(always)]
fn q3_k_codes<V: Lanes>(x: &[f32], o: &mut [u8], l: &mut [i8; 256]) {
    let d = crate::ops::gguf::q3_k_steps(o);
    for j in 0..16 {
        if d[j] == 0.0 {
            continue;
        }
        let step = V::splat(d[j]);
        for h in 0..2 {
            let at = 16 * j + 8 * h;
            let xs: &[f32; 8] = x[at..at + 8].try_into().expect("8 values");
            let mut c = [0f32; 8];
            V::load(xs).div(step).code(-4, 3).store(&mut c);
            for k in 0..8 {
                l[at + k] = c[k] as i8 + 4;
            }
        }
    }
    crate::ops::gguf::q3_k_pack(o, l);
}

/// ggml's `make_q3_quants` (`nmax` 4, `do_rmse`) on one 16-element sub-block, its refinement
/// passes speculated in lanes. The reference walks the codes one at a time, each code's new
/// value computed from the running sums `Σ w·x·l` and `Σ w·l²`, which change only where it
/// accepts a move. So every code's candidate is computed at once from the current sums (the
/// same f32 operations, lane-wise), and only the codes whose candidate differs go through the
/// reference's acceptance test, in order; an accepted move changes the sums, and the candidates
/// after it are computed again. Codes that do not move, nearly all of them, cost no scalar
/// work. The initial sums are added element by element as the reference adds them.
#[inline(always)]
fn make_q3_lanes<V: Lanes>(x: &[f32; 16], l: &mut [i8; 16]) -> f32 {
    const NMAX: i32 = 4;
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    // ggml's `GROUP_MAX_EPS`: an all-but-zero sub-block gets zero codes and scale.
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(NMAX as f32) / max;
    let half = |h: usize| -> &[f32; 8] { x[8 * h..8 * h + 8].try_into().expect("8 values") };
    let xv = [V::load(half(0)), V::load(half(1))];
    let w = [xv[0].mul(xv[0]), xv[1].mul(xv[1])];
    // `w * x[i]`, as the reference's left-to-right `w*x[i]*l` forms it.
    let wx = [w[0].mul(xv[0]), w[1].mul(xv[1])];
    let mut lv = [
        xv[0].mul(V::splat(iscale)).code(-NMAX, NMAX - 1),
        xv[1].mul(V::splat(iscale)).code(-NMAX, NMAX - 1),
    ];
    let (mut p, mut q) = ([[0f32; 8]; 2], [[0f32; 8]; 2]);
    for h in 0..2 {
        wx[h].mul(lv[h]).store(&mut p[h]);
        w[h].mul(lv[h]).mul(lv[h]).store(&mut q[h]);
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..16 {
        sumlx += p[i / 8][i % 8];
        suml2 += q[i / 8][i % 8];
    }
    // Scalar copies: the weights and the codes (which `lv` holds in lanes).
    let (mut wa, mut wxa, mut codes) = ([[0f32; 8]; 2], [[0f32; 8]; 2], [[0f32; 8]; 2]);
    for h in 0..2 {
        w[h].store(&mut wa[h]);
        wx[h].store(&mut wxa[h]);
        lv[h].store(&mut codes[h]);
    }
    let zero = V::splat(0.0);
    for _ in 0..5 {
        let mut changed = false;
        // Codes before `from` were settled in this pass under the current sums.
        let mut from = 0;
        'pass: loop {
            let (mut slx, mut sl2, mut new) = ([[0f32; 8]; 2], [[0f32; 8]; 2], [[0f32; 8]; 2]);
            let mut cand = 0u32;
            for h in 0..2 {
                let s = V::splat(sumlx).sub(wx[h].mul(lv[h]));
                let s2 = V::splat(suml2).sub(w[h].mul(lv[h]).mul(lv[h]));
                let n = xv[h].mul(s2).div(s).code(-NMAX, NMAX - 1);
                cand |= zero.lt(s).and(n.ne(lv[h])).bits() << (8 * h);
                s.store(&mut slx[h]);
                s2.store(&mut sl2[h]);
                n.store(&mut new[h]);
            }
            cand &= !((1u32 << from) - 1);
            while cand != 0 {
                let i = cand.trailing_zeros() as usize;
                cand &= cand - 1;
                let (h, k) = (i / 8, i % 8);
                let n = new[h][k];
                let s = slx[h][k] + wxa[h][k] * n;
                let s2 = sl2[h][k] + wa[h][k] * n * n;
                if s2 > 0.0 && s * s * suml2 > sumlx * sumlx * s2 {
                    codes[h][k] = n;
                    lv = [V::load(&codes[0]), V::load(&codes[1])];
                    sumlx = s;
                    suml2 = s2;
                    changed = true;
                    from = i + 1;
                    if from == 16 {
                        break 'pass;
                    }
                    continue 'pass;
                }
            }
            break;
        }
        if !changed {
            break;
        }
    }
    for i in 0..16 {
        l[i] = codes[i / 8][i % 8] as i8 + NMAX as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Q3_K under an importance matrix: sixteen 16-element sub-blocks, eight lanes at a time
/// (`make_qx_quants` with weights `qw · sqrt(σ² + x²)`); its block scales and codes as the
/// reference computes them.
#[inline(always)]
fn q3_k_weighted<V: Lanes>(x: &[f32], qw: &[f32], o: &mut [u8]) {
    let (weights, sw) = crate::ops::gguf::k16_weights(x, qw, 2.0);
    let (scales, mut l) = qx_search::<V, 4>(x, Some(&weights));
    crate::ops::gguf::q3_k_impl_scales(o, &scales, &sw);
    q3_k_codes::<V>(x, o, &mut l);
}

/// Q6_K under an importance matrix: `make_qx_quants` weighted by the importance weights
/// themselves, eight sub-blocks at a time, then Q6_K's usual scales.
#[inline(always)]
fn q6_k_weighted<V: Lanes>(x: &[f32], qw: &[f32], o: &mut [u8]) {
    let (scales, mut l) = qx_search::<V, 32>(x, Some(qw));
    q6_k_finish(x, o, &scales, &mut l);
}

/// `make_qx_quants` on the sixteen 16-element sub-blocks of one super-block, eight lanes at a
/// time, with `weights` (the reference's `x²` when `None`): the sub-blocks' scales and the
/// codes (offset by `NMAX`) in block order.
#[inline(always)]
fn qx_search<V: Lanes, const NMAX: i32>(
    x: &[f32],
    weights: Option<&[f32]>,
) -> ([f32; 16], [i8; 256]) {
    let mut l = [0i8; 256];
    let (mut scales, mut unused) = ([0f32; 16], [0f32; 16]);
    for half in 0..2 {
        let xs: [V; 16] = lanes(&transpose::<16>(x, 128 * half));
        let ws = weight_lanes(&xs, weights, half, |v: V| v.mul(v));
        let (scale, codes) = make_qx_quants::<V, NMAX, 16>(&xs, &ws);
        let zero = V::splat(0.0);
        let code = |c: f32| c as i8;
        untranspose16(
            half,
            scale,
            zero,
            &codes,
            &mut scales,
            &mut unused,
            code,
            &mut l,
        );
    }
    (scales, l)
}

/// The weights of one half's eight 16-element sub-blocks as lanes: `weights`' (transposed as
/// `x` is), or `default` of each of `xs` (the reference's weights without an importance
/// matrix).
#[inline(always)]
fn weight_lanes<V: Lanes>(
    xs: &[V; 16],
    weights: Option<&[f32]>,
    half: usize,
    default: impl Fn(V) -> V,
) -> [V; 16] {
    match weights {
        Some(w) => lanes(&transpose::<16>(w, 128 * half)),
        None => {
            let mut w = *xs;
            for i in 0..16 {
                w[i] = default(xs[i]);
            }
            w
        }
    }
}

/// One half (eight 16-element sub-blocks) of a lane search's results back in block order:
/// its lanes' scales and minimums into `scales[8·half..]`, `mins[8·half..]`, the codes
/// (through `code`) into `l[128·half..]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn untranspose16<V: Lanes, T: Copy>(
    half: usize,
    scale: V,
    min: V,
    codes: &[V; 16],
    scales: &mut [f32; 16],
    mins: &mut [f32; 16],
    code: impl Fn(f32) -> T,
    l: &mut [T; 256],
) {
    let (mut s, mut m) = ([0f32; 8], [0f32; 8]);
    scale.store(&mut s);
    min.store(&mut m);
    scales[8 * half..8 * half + 8].copy_from_slice(&s);
    mins[8 * half..8 * half + 8].copy_from_slice(&m);
    for i in 0..16 {
        let mut c = [0f32; 8];
        codes[i].store(&mut c);
        for k in 0..8 {
            l[128 * half + 16 * k + i] = code(c[k]);
        }
    }
}

/// The lane search's results for eight 32-element sub-blocks back in block order: each
/// sub-block's scale and `-min`, and the 256 codes.
#[inline(always)]
fn untranspose32<V: Lanes>(scales: V, mins: V, codes: &[V; 32]) -> ([f32; 8], [f32; 8], [u8; 256]) {
    let mut l = [0u8; 256];
    for i in 0..32 {
        let mut c = [0f32; 8];
        codes[i].store(&mut c);
        for k in 0..8 {
            l[32 * k + i] = c[k] as u8;
        }
    }
    let (mut s, mut m) = ([0f32; 8], [0f32; 8]);
    scales.store(&mut s);
    mins.store(&mut m);
    (s, m, l)
}

/// Eight sub-blocks of `E` elements starting at `x[start]`, `E` apart, transposed to lanes.
#[inline(always)]
fn transpose<const E: usize>(x: &[f32], start: usize) -> [[f32; 8]; E] {
    let mut t = [[0f32; 8]; E];
    for k in 0..8 {
        for i in 0..E {
            t[i][k] = x[start + E * k + i];
        }
    }
    t
}

/// Q4_K / Q5_K: the eight 32-element sub-blocks of each of `K` super-blocks (`x` holds
/// `256·K` values, `o` their `K` blocks), one sub-block per lane, the `K` searches
/// interleaved.
#[inline(always)]
fn qk_asym<V: Lanes, const NMAX: i32, const K: usize>(x: &[f32], o: &mut [u8]) {
    let zero = V::splat(0.0);
    let mut xs = [[zero; 32]; K];
    let mut w = [[zero; 32]; K];
    for k in 0..K {
        xs[k] = lanes(&transpose::<32>(x, 256 * k));
        let mut sum_x2 = zero;
        for i in 0..32 {
            sum_x2 = sum_x2.add(xs[k][i].mul(xs[k][i]));
        }
        let av_x = sum_x2.div(V::splat(32.0)).sqrt();
        for i in 0..32 {
            w[k][i] = av_x.add(xs[k][i].abs());
        }
    }
    let (rmin, nstep) = qk_asym_grid(NMAX);
    let found = make_qkx2_quants_k::<V, NMAX, 32, false, K>(&xs, &w, rmin, 0.1, nstep);
    let bytes = o.len() / K;
    for k in 0..K {
        let (scales, mins, codes) = found[k];
        let (s, m, mut l) = untranspose32(scales, mins, &codes);
        let xk = &x[256 * k..256 * k + 256];
        qk_asym_finish(
            xk,
            &mut o[bytes * k..bytes * k + bytes],
            NMAX,
            &s,
            &m,
            &mut l,
        );
    }
}

#[inline(always)]
fn lanes<V: Lanes, const E: usize>(t: &[[f32; 8]; E]) -> [V; E] {
    let mut v = [V::splat(0.0); E];
    for i in 0..E {
        v[i] = V::load(&t[i]);
    }
    v
}

/// Q2_K: the sixteen 16-element sub-blocks of one super-block, eight lanes at a time
/// (`make_qkx2_quants` with weights `|x|`, absolute errors, 16 candidate scales).
#[inline(always)]
fn q2_k<V: Lanes>(x: &[f32], o: &mut [u8]) {
    let (scales, mins, mut l) = q2_search::<V, true>(x, None, (-0.5, 0.1, 15));
    q2_k_finish(x, o, &scales, &mins, &mut l);
}

/// `make_qkx2_quants` on eight sub-blocks of `N` elements: each lane's scale, `-min` and
/// codes (as f32); `MAD`: absolute errors (Q2_K) rather than squared ones.
#[inline(always)]
fn make_qkx2_quants<V: Lanes, const NMAX: i32, const N: usize, const MAD: bool>(
    x: &[V; N],
    weights: &[V; N],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (V, V, [V; N]) {
    let [r] = make_qkx2_quants_k::<V, NMAX, N, MAD, 1>(
        std::array::from_ref(x),
        std::array::from_ref(weights),
        rmin,
        rdelta,
        nstep,
    );
    r
}

/// [`make_qkx2_quants`] on `K` vectors of eight sub-blocks at once: the same operations per
/// lane, the `K` vectors' running sums interleaved so that their add chains overlap (each
/// candidate's scale depends on the one before through `min`, so a vector alone waits on its
/// own sums).
#[inline(always)]
fn make_qkx2_quants_k<
    V: Lanes,
    const NMAX: i32,
    const N: usize,
    const MAD: bool,
    const K: usize,
>(
    x: &[[V; N]; K],
    weights: &[[V; N]; K],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> [(V, V, [V; N]); K] {
    // `|d|` or `d²`, as the reference's `use_mad` chooses.
    let err = |d: V| if MAD { d.abs() } else { d.mul(d) };
    let zero = V::splat(0.0);
    let (mut min, mut max, mut sum_w, mut sum_x) = ([zero; K], [zero; K], [zero; K], [zero; K]);
    for k in 0..K {
        (min[k], max[k]) = (x[k][0], x[k][0]);
        sum_w[k] = weights[k][0];
        sum_x[k] = sum_w[k].mul(x[k][0]);
    }
    for i in 1..N {
        for k in 0..K {
            let xi = x[k][i];
            min[k] = xi.lt(min[k]).select(xi, min[k]);
            max[k] = max[k].lt(xi).select(xi, max[k]);
            sum_w[k] = sum_w[k].add(weights[k][i]);
            sum_x[k] = sum_x[k].add(weights[k][i].mul(xi));
        }
    }
    let nmax_f = V::splat(NMAX as f32);
    // Lanes whose sub-block is constant return early in the reference; here they run along
    // (on infinite scales) and are set at the end.
    let (mut flat, mut flat_min, mut scale, mut best_error) =
        ([zero; K], [zero; K], [zero; K], [zero; K]);
    let mut iscale = [zero; K];
    for k in 0..K {
        min[k] = zero.lt(min[k]).select(zero, min[k]);
        flat[k] = max[k].eq(min[k]);
        flat_min[k] = min[k];
        iscale[k] = nmax_f.div(max[k].sub(min[k]));
        scale[k] = V::splat(1.0).div(iscale[k]);
    }
    let mut l = [[zero; N]; K];
    for i in 0..N {
        for k in 0..K {
            l[k][i] = iscale[k].mul(x[k][i].sub(min[k])).code(0, NMAX);
            let diff = scale[k].mul(l[k][i]).add(min[k]).sub(x[k][i]);
            best_error[k] = best_error[k].add(weights[k][i].mul(err(diff)));
        }
    }
    let mut laux = [[zero; N]; K];
    for is in 0..=nstep {
        // `min` moves with each better candidate, as in the reference.
        let c = V::splat(rmin + rdelta * is as f32 + NMAX as f32);
        let (mut sum_l, mut sum_l2, mut sum_xl) = ([zero; K], [zero; K], [zero; K]);
        for k in 0..K {
            iscale[k] = c.div(max[k].sub(min[k]));
        }
        for i in 0..N {
            for k in 0..K {
                let q = iscale[k].mul(x[k][i].sub(min[k])).code(0, NMAX);
                laux[k][i] = q;
                let wq = weights[k][i].mul(q);
                sum_l[k] = sum_l[k].add(wq);
                sum_l2[k] = sum_l2[k].add(wq.mul(q));
                sum_xl[k] = sum_xl[k].add(wq.mul(x[k][i]));
            }
        }
        let (mut this_scale, mut this_min, mut det) = ([zero; K], [zero; K], [zero; K]);
        for k in 0..K {
            det[k] = sum_w[k].mul(sum_l2[k]).sub(sum_l[k].mul(sum_l[k]));
            let s = sum_w[k]
                .mul(sum_xl[k])
                .sub(sum_x[k].mul(sum_l[k]))
                .div(det[k]);
            let m = sum_l2[k]
                .mul(sum_x[k])
                .sub(sum_l[k].mul(sum_xl[k]))
                .div(det[k]);
            let positive = zero.lt(m);
            this_scale[k] = positive.select(sum_xl[k].div(sum_l2[k]), s);
            this_min[k] = positive.select(zero, m);
        }
        let mut cur_error = [zero; K];
        for i in 0..N {
            for k in 0..K {
                let diff = this_scale[k].mul(laux[k][i]).add(this_min[k]).sub(x[k][i]);
                cur_error[k] = cur_error[k].add(weights[k][i].mul(err(diff)));
            }
        }
        for k in 0..K {
            // The reference takes a candidate when `det > 0` and its error is lower.
            let better = zero.lt(det[k]).and(cur_error[k].lt(best_error[k]));
            for i in 0..N {
                l[k][i] = better.select(laux[k][i], l[k][i]);
            }
            best_error[k] = better.select(cur_error[k], best_error[k]);
            scale[k] = better.select(this_scale[k], scale[k]);
            min[k] = better.select(this_min[k], min[k]);
        }
    }
    let mut out = [(zero, zero, [zero; N]); K];
    for k in 0..K {
        for i in 0..N {
            out[k].2[i] = flat[k].select(zero, l[k][i]);
        }
        out[k].0 = flat[k].select(zero, scale[k]);
        out[k].1 = flat[k].select(flat_min[k], min[k]).neg();
    }
    out
}

/// Q6_K: the sixteen 16-element sub-blocks of one super-block, eight lanes at a time.
#[inline(always)]
fn q6_k<V: Lanes>(x: &[f32], o: &mut [u8]) {
    let (scales, mut l) = qx_search::<V, 32>(x, None);
    q6_k_finish(x, o, &scales, &mut l);
}

/// `make_qx_quants` (`rmse_type` 1) with weights `w` (`x²` without an importance matrix) on
/// eight sub-blocks: each lane's scale and codes (offset by `NMAX`, as f32).
#[inline(always)]
fn make_qx_quants<V: Lanes, const NMAX: i32, const N: usize>(
    x: &[V; N],
    w: &[V; N],
) -> (V, [V; N]) {
    let zero = V::splat(0.0);
    // The value of largest magnitude, the first one on ties.
    let (mut max, mut amax) = (zero, zero);
    for v in x {
        let a = v.abs();
        let larger = amax.lt(a);
        amax = larger.select(a, amax);
        max = larger.select(*v, max);
    }
    let tiny = amax.lt(V::splat(1e-15));
    let mut l = [zero; N];
    let (sumlx, suml2) = qx_sums::<V, NMAX, N>(x, w, V::splat(-(NMAX as f32)).div(max), &mut l);
    let mut scale = suml2.ne(zero).select(sumlx.div(suml2), zero);
    let mut best = scale.mul(sumlx);
    let mut laux = [zero; N];
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = V::splat(-(NMAX as f32 + 0.1 * is as f32)).div(max);
        let (sumlx, suml2) = qx_sums::<V, NMAX, N>(x, w, iscale, &mut laux);
        let better = zero.lt(suml2).and(best.mul(suml2).lt(sumlx.mul(sumlx)));
        for i in 0..N {
            l[i] = better.select(laux[i], l[i]);
        }
        scale = better.select(sumlx.div(suml2), scale);
        best = better.select(scale.mul(sumlx), best);
    }
    for c in l.iter_mut() {
        *c = tiny.select(zero, *c);
    }
    (tiny.select(zero, scale), l)
}

/// `make_qx_quants`'s codes for `iscale` (offset by `NMAX`, into `codes`) and their sums
/// `(Σ w·x·q, Σ w·q²)`.
#[inline(always)]
fn qx_sums<V: Lanes, const NMAX: i32, const N: usize>(
    x: &[V; N],
    w: &[V; N],
    iscale: V,
    codes: &mut [V; N],
) -> (V, V) {
    let (mut sumlx, mut suml2) = (V::splat(0.0), V::splat(0.0));
    for i in 0..N {
        let q = iscale.mul(x[i]).code(-NMAX, NMAX - 1);
        codes[i] = q.add(V::splat(NMAX as f32));
        sumlx = sumlx.add(w[i].mul(x[i]).mul(q));
        suml2 = suml2.add(w[i].mul(q).mul(q));
    }
    (sumlx, suml2)
}
