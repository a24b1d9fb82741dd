//! The i-quants' neighbour search (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) over eight neighbours
//! at once: where nearly all of an i-quant's time goes (`perf` of the reference: 79–87 % in
//! the search of a pattern off the lattice, 8–17 % in the rest of the scale search).
//!
//! A pattern's neighbour list (`ops::gguf::Lattice`, sorted by distance, then index) is stored
//! here transposed, in chunks of eight: `coords[chunk][level]` holds that level of eight
//! neighbours, one per lane, so the eight weighted errors `Σ w·(scale·p − x)²` accumulate level
//! by level — each lane's sum in the reference's order, no fused multiply-add, so each equals
//! the reference's to the bit. Each lane keeps the first of its neighbours with the least
//! error; the least over the lanes, the earliest in the list on a tie, is then the
//! reference's choice (the first strict improvement over `f32::MAX` in list order).
//!
//! The rest of each quantizer is the reference's code (`ops::gguf::iq_block`), given this
//! search; the bytes are the reference's (`tests/simd_equals_reference.rs`).

// Index loops: see `kquants`.
#![allow(clippy::needless_range_loop)]

use super::kquants::{Lanes, Portable};
use crate::ops::gguf::{GgufType, Lattice, Neighbours};
use std::sync::OnceLock;

/// A lattice's neighbour lists in chunks of eight lanes.
pub(crate) struct LaneLists {
    /// Levels per point (8 or 4).
    dims: usize,
    /// Per pattern of the map: its first chunk and how many (none on the lattice).
    span: Vec<(u32, u32)>,
    /// Per chunk: the point of each lane.
    ids: Vec<[u16; 8]>,
    /// Per chunk: how many lanes hold a neighbour (the last chunk of a list may be short).
    used: Vec<u8>,
    /// Per chunk, per level: the eight lanes' levels as `2·l + 1` (0 past the list).
    coords: Vec<[i8; 8]>,
}

impl LaneLists {
    fn build(lat: &Lattice) -> LaneLists {
        let dims = lat.dims();
        let mut t = LaneLists {
            dims,
            span: Vec::with_capacity(lat.patterns()),
            ids: Vec::new(),
            used: Vec::new(),
            coords: Vec::new(),
        };
        for u in 0..lat.patterns() {
            let first = t.ids.len() as u32;
            let list = lat.neighbours_of(u).unwrap_or(&[]);
            for chunk in list.chunks(8) {
                let mut ids = [0u16; 8];
                ids[..chunk.len()].copy_from_slice(chunk);
                t.ids.push(ids);
                t.used.push(chunk.len() as u8);
                for i in 0..dims {
                    let mut lanes = [0i8; 8];
                    for (lane, &j) in chunk.iter().enumerate() {
                        lanes[lane] = lat.point_levels(usize::from(j))[i];
                    }
                    t.coords.push(lanes);
                }
            }
            t.span.push((first, t.ids.len() as u32 - first));
        }
        t
    }

    /// Levels per point (8 or 4).
    pub(crate) fn dims(&self) -> usize {
        self.dims
    }

    /// The lists of the i-quant `ty`'s lattice (built on first use).
    pub(crate) fn of(ty: GgufType) -> &'static LaneLists {
        static L: [OnceLock<LaneLists>; 5] = [const { OnceLock::new() }; 5];
        let slot = match ty {
            GgufType::Iq2Xxs => 0,
            GgufType::Iq2Xs => 1,
            GgufType::Iq2S => 2,
            GgufType::Iq3Xxs => 3,
            _ => 4,
        };
        L[slot].get_or_init(|| LaneLists::build(Lattice::of(ty)))
    }
}

/// Each lane's index.
const IOTA: [f32; 8] = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0];

/// Lane masks: `LIVE[n]` has its first `n` lanes true.
const LIVE: [[f32; 8]; 9] = {
    let mut m = [[0f32; 8]; 9];
    let mut n = 0;
    while n <= 8 {
        let mut lane = 0;
        while lane < n {
            m[n][lane] = f32::from_bits(u32::MAX);
            lane += 1;
        }
        n += 1;
    }
    m
};

/// The best neighbour of pattern `u` ([`Neighbours::best`]), eight neighbours a vector.
#[inline(always)]
pub(crate) fn best<V: Lanes, const D: usize>(
    t: &LaneLists,
    u: usize,
    xval: &[f32],
    weight: &[f32],
    scale: f32,
) -> usize {
    let (first, count) = (t.span[u].0 as usize, t.span[u].1 as usize);
    let s = V::splat(scale);
    let mut least = V::splat(f32::MAX);
    let mut at = V::splat(0.0);
    for c in 0..count {
        let k = first + c;
        let mut d2 = V::splat(0.0);
        for i in 0..D {
            let diff = s
                .mul(V::from_i8(&t.coords[k * D + i]))
                .sub(V::splat(xval[i]));
            d2 = d2.add(V::splat(weight[i]).mul(diff).mul(diff));
        }
        let better = d2.lt(least).and(V::load(&LIVE[usize::from(t.used[k])]));
        least = better.select(d2, least);
        at = better.select(V::splat(c as f32), at);
    }
    // The least error, then the earliest position in the list among the lanes that hold it.
    let min = least.hmin();
    // `least` holds no NaN: `min` is f32::MAX when no lane found an error below it.
    if min >= f32::MAX {
        return usize::MAX;
    }
    let pos = at.mul(V::splat(8.0)).add(V::load(&IOTA));
    let pos = least
        .eq(V::splat(min))
        .select(pos, V::splat(f32::INFINITY))
        .hmin() as usize;
    usize::from(t.ids[first + pos / 8][pos % 8])
}

/// [`Neighbours::fits`] eight candidates a vector: lane `k` sums candidate `k`'s
/// `w·x·q` and `w·q²` element by element, in the reference's order.
#[inline(always)]
pub(crate) fn fits<V: Lanes>(
    weight: &[f32],
    xval: &[f32],
    cands: &[[i8; 32]],
    out: &mut [(f32, f32)],
) {
    let n = xval.len();
    for start in (0..cands.len()).step_by(8) {
        let lanes = (cands.len() - start).min(8);
        let mut t = [[0i8; 8]; 32];
        for k in 0..lanes {
            for i in 0..n {
                t[i][k] = cands[start + k][i];
            }
        }
        let (mut sumqx, mut sumq2) = (V::splat(0.0), V::splat(0.0));
        for i in 0..n {
            let q = V::from_i8(&t[i]).mul(V::splat(2.0)).add(V::splat(1.0));
            let w = V::splat(weight[i]);
            sumqx = sumqx.add(V::splat(weight[i] * xval[i]).mul(q));
            sumq2 = sumq2.add(w.mul(q).mul(q));
        }
        let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
        sumqx.store(&mut a);
        sumq2.store(&mut b);
        for k in 0..lanes {
            out[start + k] = (a[k], b[k]);
        }
    }
}

/// The neighbour search in lanes of one kind ([`Lanes::neighbours`]).
pub(crate) enum LaneSearch {
    /// Plain arrays, any CPU.
    Portable(&'static LaneLists),
    /// AVX2 registers: built only by the AVX2 [`Lanes`], which runs only where AVX2 was
    /// detected (see `kquants::Avx2`).
    #[cfg(target_arch = "x86_64")]
    Avx2(&'static LaneLists),
}

impl Neighbours for LaneSearch {
    fn best(
        &self,
        _lat: &Lattice,
        u: usize,
        _at: usize,
        xval: &[f32],
        weight: &[f32],
        scale: f32,
    ) -> usize {
        match *self {
            LaneSearch::Portable(t) if t.dims == 8 => {
                best::<Portable, 8>(t, u, xval, weight, scale)
            }
            LaneSearch::Portable(t) => best::<Portable, 4>(t, u, xval, weight, scale),
            // SAFETY: this variant is built only where AVX2 and F16C were detected (above).
            #[cfg(target_arch = "x86_64")]
            LaneSearch::Avx2(t) => unsafe { super::x86::iq_best(t, u, xval, weight, scale) },
        }
    }

    fn fits(&self, weight: &[f32], xval: &[f32], cands: &[[i8; 32]], out: &mut [(f32, f32)]) {
        match *self {
            LaneSearch::Portable(_) => fits::<Portable>(weight, xval, cands, out),
            // SAFETY: as above.
            #[cfg(target_arch = "x86_64")]
            LaneSearch::Avx2(_) => unsafe { super::x86::iq_fits(weight, xval, cands, out) },
        }
    }
}

/// Whether `ty` is one of the i-quants below four bits.
pub(crate) fn is_iquant(ty: GgufType) -> bool {
    matches!(
        ty,
        GgufType::Iq2Xxs | GgufType::Iq2Xs | GgufType::Iq2S | GgufType::Iq3Xxs | GgufType::Iq3S
    )
}

/// Blocks of the i-quant `ty` from `x` into `out`, with importance weights `qw` (one per
/// column of rows of `cols`) or without, the neighbours found in `V`'s lanes. The layout is
/// the caller's to have checked.
#[inline(always)]
pub(crate) fn quantize<V: Lanes>(
    ty: GgufType,
    x: &[f32],
    cols: usize,
    qw: Option<&[f32]>,
    out: &mut [u8],
) {
    let search = V::neighbours(LaneLists::of(ty));
    let bytes = ty.block_bytes();
    for b in 0..x.len() / 256 {
        let col = (256 * b) % cols.max(1);
        crate::ops::gguf::iq_block(
            ty,
            &x[256 * b..256 * b + 256],
            qw.map(|q| &q[col..col + 256]),
            &mut out[bytes * b..bytes * b + bytes],
            &search,
        );
    }
}
