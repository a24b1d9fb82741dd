//! llama.cpp's i-quants below four bits: IQ2_XXS, IQ2_XS, IQ2_S (groups of eight magnitudes on
//! an E8 lattice of 2-bit levels) and IQ3_XXS, IQ3_S (groups of four on a D4 lattice of 3-bit
//! levels), as `quantize_iq*` of `ggml-quants.c` compute them: per 16 or 32 values the signs
//! apart (IQ2_XXS / IQ2_XS / IQ3_XXS keep an even number of minus signs, flipping the least
//! important value), a scale searched over candidates, each group of magnitudes rounded to the
//! nearest lattice point — or, off the lattice, to the best of its precomputed neighbours —
//! and 4-bit sub-block scales against the block's largest.
//!
//! The lattices are `gguf_iq_grids.rs` (llama.cpp's `kgrid_*` tables); the index map and the
//! neighbour lists are built from them once, exactly as `iq2xs_init_impl` /
//! `iq3xs_init_impl` build them (neighbours sorted by squared distance, then index, up to the
//! `nwant` nearest distances). The same rules as the parent module: f32 in the C code's order,
//! no fused multiply-add.

// The loops index as ggml-quants.c does, so that each line can be checked against the C.
#![allow(clippy::needless_range_loop)]

use super::{GgufType, half, nearest_int, unhalf};
use std::sync::OnceLock;

#[path = "gguf_iq_grids.rs"]
mod grids;

/// ggml's `GROUP_MAX_EPS`, `GROUP_MAX_EPS_IQ3_XXS`, `GROUP_MAX_EPS_IQ2_S`.
const EPS: f32 = 1e-15;
const EPS_IQ3_XXS: f32 = 1e-8;
const EPS_IQ2_S: f32 = 1e-8;

/// A lattice with its index map and neighbour lists (`iq2_entry_t` / `iq3_entry_t`).
pub(crate) struct Lattice {
    /// Each point's levels as `2·l + 1` (eight or four used).
    points: Vec<[i8; 8]>,
    /// Packed levels → point, or `-(offset + 1)` into `neighbours` for a pattern off the
    /// lattice.
    map: Vec<i32>,
    /// At each offset: a count `n`, then `n` point indices.
    neighbours: Vec<u16>,
    /// Levels per point (8 or 4) and bits per level (2 or 3).
    dims: usize,
    bits: usize,
}

impl Lattice {
    fn build(kgrid: &[u16], dims: usize, bits: usize, kmap_size: usize, nwant: usize) -> Lattice {
        let mask = (1u16 << bits) - 1;
        let points: Vec<[i8; 8]> = kgrid
            .iter()
            .map(|&g| {
                let mut p = [0i8; 8];
                for (i, v) in p.iter_mut().take(dims).enumerate() {
                    *v = 2 * ((g >> (bits * i)) & mask) as i8 + 1;
                }
                p
            })
            .collect();
        let mut map = vec![-1i32; kmap_size];
        for (i, p) in points.iter().enumerate() {
            let mut index = 0usize;
            for k in 0..dims {
                index |= (((p[k] - 1) / 2) as usize) << (bits * k);
            }
            map[index] = i as i32;
        }
        let mut neighbours = Vec::new();
        let mut dist: Vec<(i32, usize)> = Vec::with_capacity(points.len());
        for i in 0..kmap_size {
            if map[i] >= 0 {
                continue;
            }
            let mut pos = [0i32; 8];
            for k in 0..dims {
                pos[k] = 2 * ((i >> (bits * k)) as i32 & i32::from(mask)) + 1;
            }
            dist.clear();
            for (j, p) in points.iter().enumerate() {
                let mut d2 = 0;
                for k in 0..dims {
                    let d = i32::from(p[k]) - pos[k];
                    d2 += d * d;
                }
                dist.push((d2, j));
            }
            dist.sort_unstable();
            map[i] = -(neighbours.len() as i32 + 1);
            let start = neighbours.len();
            neighbours.push(0);
            let (mut d2, mut nhave, mut n) = (dist[0].0, 1, 0u16);
            for &(d, j) in &dist {
                if d > d2 {
                    if nhave == nwant {
                        break;
                    }
                    d2 = d;
                    nhave += 1;
                }
                neighbours.push(j as u16);
                n += 1;
            }
            neighbours[start] = n;
        }
        Lattice {
            points,
            map,
            neighbours,
            dims,
            bits,
        }
    }

    /// The lattice of `ty` (built on first use).
    pub(crate) fn of(ty: GgufType) -> &'static Lattice {
        static L: [OnceLock<Lattice>; 5] = [const { OnceLock::new() }; 5];
        let (slot, grid, dims, bits, kmap, nwant): (usize, &[u16], _, _, _, _) = match ty {
            GgufType::Iq2Xxs => (0, &grids::KGRID_2BIT_256, 8, 2, 43692, 2),
            GgufType::Iq2Xs => (1, &grids::KGRID_2BIT_512, 8, 2, 43692, 2),
            GgufType::Iq2S => (2, &grids::KGRID_2BIT_1024, 8, 2, 43692, 1),
            GgufType::Iq3Xxs => (3, &grids::KGRID_256, 4, 3, 4096, 2),
            _ => (4, &grids::KGRID_512, 4, 3, 4096, 3),
        };
        L[slot].get_or_init(|| Lattice::build(grid, dims, bits, kmap, nwant))
    }

    /// The point for `levels` (`dims` of them, each in `0..2^bits`): on the lattice, or its
    /// best neighbour by weighted error at `scale` (`iq2_find_best_neighbour` /
    /// `iq3_find_best_neighbour`, as `search` finds it), whose levels then replace `levels`.
    fn point<N: Neighbours>(
        &self,
        search: &N,
        levels: &mut [i8],
        xval: &[f32],
        weight: &[f32],
        scale: f32,
        rewrite_on_grid: bool,
    ) -> usize {
        let u = self.pattern(levels);
        let g = self.map[u];
        if g >= 0 {
            if rewrite_on_grid {
                self.levels_of(g as usize, levels);
            }
            return g as usize;
        }
        let at = (-g - 1) as usize;
        let mut best = search.best(self, u, at, xval, weight, scale);
        if best == usize::MAX {
            // No error below f32::MAX: an infinite or NaN value, or one so large that its
            // error overflows. llama.cpp's search asserts here (the process aborts); kiln takes
            // the nearest neighbour by lattice distance, the list's first, and goes on.
            best = usize::from(self.neighbours[at + 1]);
        }
        self.levels_of(best, levels);
        best
    }

    /// `levels` packed into the index of the map (`bits` per level).
    fn pattern(&self, levels: &[i8]) -> usize {
        let mut u = 0usize;
        for i in 0..self.dims {
            u |= (levels[i] as usize) << (self.bits * i);
        }
        u
    }

    /// Levels per point: 8 (IQ2) or 4 (IQ3).
    pub(crate) fn dims(&self) -> usize {
        self.dims
    }

    /// Point `g`'s levels as `2·l + 1` (the first [`Lattice::dims`] used).
    pub(crate) fn point_levels(&self, g: usize) -> &[i8; 8] {
        &self.points[g]
    }

    /// The patterns the map holds (on and off the lattice).
    pub(crate) fn patterns(&self) -> usize {
        self.map.len()
    }

    /// The neighbour list of pattern `u`, in the order the search visits it (by distance, then
    /// index); `None` for a pattern on the lattice.
    pub(crate) fn neighbours_of(&self, u: usize) -> Option<&[u16]> {
        let g = self.map[u];
        (g < 0).then(|| {
            let at = (-g - 1) as usize;
            &self.neighbours[at + 1..at + 1 + usize::from(self.neighbours[at])]
        })
    }

    fn levels_of(&self, g: usize, levels: &mut [i8]) {
        let p = &self.points[g];
        for i in 0..self.dims {
            levels[i] = (p[i] - 1) >> 1;
        }
    }

    /// The point packed from `levels` (which must be on the lattice: they always are when
    /// they came from [`Lattice::point`]).
    fn index(&self, levels: &[i8]) -> usize {
        self.map[self.pattern(levels)].max(0) as usize
    }

    /// The dequantization grid's value of level `l` (`iq*_grid` of `ggml-common.h`: IQ2's
    /// levels 8, 25, 43; IQ3_XXS's 4 … 52, 62; IQ3_S's odd 1 … 15).
    fn magnitude(ty: GgufType, l: i8) -> f32 {
        match ty {
            GgufType::Iq2Xxs | GgufType::Iq2Xs | GgufType::Iq2S => {
                [8.0, 25.0, 43.0, 0.0][l as usize]
            }
            GgufType::Iq3Xxs => [4.0, 12.0, 20.0, 28.0, 36.0, 44.0, 52.0, 62.0][l as usize],
            _ => f32::from(2 * l + 1),
        }
    }
}

/// How a pattern off the lattice finds its best neighbour: the least `Σ w·(scale·p − x)²`
/// over its list, the first in list order on a tie (`usize::MAX` if no error is below
/// `f32::MAX`, as the C code's `grid_index` stays −1). [`Scalar`] is the C code's loop; the CPU
/// kernels search eight neighbours a vector (`cpu::iquants`), with each lane's sum in this
/// order, so the same neighbour wins.
pub(crate) trait Neighbours {
    /// The best neighbour of pattern `u` of `lat`, whose list starts at `at` of its
    /// neighbour table, for magnitudes `xval` with error weights `weight` at `scale`.
    fn best(
        &self,
        lat: &Lattice,
        u: usize,
        at: usize,
        xval: &[f32],
        weight: &[f32],
        scale: f32,
    ) -> usize;

    /// [`fit`] of each candidate's levels (`cands[c]`, the first `xval.len()` of them) into
    /// `out[c]`; each independent of the others.
    fn fits(&self, weight: &[f32], xval: &[f32], cands: &[[i8; 32]], out: &mut [(f32, f32)]) {
        for (c, o) in cands.iter().zip(out) {
            *o = fit(weight, xval, &c[..xval.len()]);
        }
    }
}

/// The reference's neighbour search (`iq2_find_best_neighbour`'s loop).
pub(crate) struct Scalar;

impl Neighbours for Scalar {
    fn best(
        &self,
        lat: &Lattice,
        _u: usize,
        at: usize,
        xval: &[f32],
        weight: &[f32],
        scale: f32,
    ) -> usize {
        let n = usize::from(lat.neighbours[at]);
        let (mut best_d2, mut best) = (f32::MAX, usize::MAX);
        for &j in &lat.neighbours[at + 1..at + 1 + n] {
            let p = &lat.points[usize::from(j)];
            let mut d2 = 0f32;
            for i in 0..lat.dims {
                let diff = scale * f32::from(p[i]) - xval[i];
                d2 += weight[i] * diff * diff;
            }
            if d2 < best_d2 {
                best_d2 = d2;
                best = usize::from(j);
            }
        }
        best
    }
}

/// One block of 256 of the i-quant `ty` (IQ2_XXS … IQ3_S) with importance weights `qw` (IQ2_XXS
/// and IQ2_XS need them: a block without is left as zeros), its neighbours found by `search`.
pub(crate) fn quantize_block<N: Neighbours>(
    ty: GgufType,
    x: &[f32],
    qw: Option<&[f32]>,
    o: &mut [u8],
    search: &N,
) {
    match (ty, qw) {
        (GgufType::Iq2Xxs, Some(qw)) => iq2_xxs(x, qw, o, search),
        (GgufType::Iq2Xs | GgufType::Iq2S, _) => iq2_xs_s(ty, x, qw, o, search),
        (GgufType::Iq3Xxs | GgufType::Iq3S, _) => iq3(ty, x, qw, o, search),
        _ => o.fill(0),
    }
}

/// The magnitudes of `xb` and the sign bits of each group of eight; with `even`, a group with an
/// odd number of minus signs flips its least important value (smallest `w·x²`), whose sign is
/// then implied by the others (7 stored bits).
fn signs(xb: &[f32], weight: &[f32], xval: &mut [f32], signs: &mut [u8], even: bool) {
    for k in 0..xb.len() / 8 {
        let mut nflip = 0;
        let mut s = 0u8;
        for i in 0..8 {
            if xb[8 * k + i] >= 0.0 {
                xval[8 * k + i] = xb[8 * k + i];
            } else {
                xval[8 * k + i] = -xb[8 * k + i];
                nflip += 1;
                s |= 1 << i;
            }
        }
        if even && nflip % 2 == 1 {
            let mut imin = 0;
            let mut min = weight[8 * k] * xb[8 * k] * xb[8 * k];
            for i in 1..8 {
                let ax = weight[8 * k + i] * xb[8 * k + i] * xb[8 * k + i];
                if ax < min {
                    min = ax;
                    imin = i;
                }
            }
            xval[8 * k + imin] = -xval[8 * k + imin];
            s ^= 1 << imin;
        }
        signs[k] = if even { s & 127 } else { s };
    }
}

fn max_of(xval: &[f32]) -> f32 {
    let mut max = xval[0];
    for &v in &xval[1..] {
        max = if max > v { max } else { v };
    }
    max
}

/// `Σ w·x·q` and `Σ w·q²` for levels `l` (`q = 2l + 1`).
fn fit(weight: &[f32], xval: &[f32], l: &[i8]) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for i in 0..xval.len() {
        let w = weight[i];
        let q = f32::from(2 * l[i] + 1);
        sumqx += w * xval[i] * q;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

/// The levels of `xval` at inverse scale `id`, clamped to `0..kmax`.
fn round_levels(id: f32, xval: &[f32], l: &mut [i8], kmax: i32) {
    for i in 0..xval.len() {
        l[i] = nearest_int(0.5 * (id * xval[i] - 1.0)).clamp(0, kmax - 1) as i8;
    }
}

/// A sub-block's magnitudes and neighbour-search weights on a lattice: what rounds a group of
/// levels and puts it on the lattice.
struct Placer<'a, N> {
    lat: &'a Lattice,
    nb: &'a N,
    xval: &'a [f32],
    waux: &'a [f32],
    kmax: i32,
}

impl<N: Neighbours> Placer<'_, N> {
    /// Group `k` of `levels` rounded at inverse scale `id`, then put on the lattice at `scale`
    /// ([`Lattice::point`]); whether the rounding alone landed on it.
    fn place(&self, k: usize, id: f32, scale: f32, levels: &mut [i8], rewrite: bool) -> bool {
        let r = self.lat.dims * k..self.lat.dims * (k + 1);
        let (x, l) = (&self.xval[r.clone()], &mut levels[r.clone()]);
        round_levels(id, x, l, self.kmax);
        let on = self.lat.map[self.lat.pattern(l)] >= 0;
        self.lat.point(self.nb, l, x, &self.waux[r], scale, rewrite);
        on
    }
}

/// The 4-bit sub-block scale `l` of `s` against `d` (`nearest_int(0.5·(s/d − 1))`).
fn scale4(id: f32, s: f32) -> u8 {
    nearest_int(0.5 * (id * s - 1.0)).clamp(0, 15) as u8
}

/// The weights of a block: `qw · √(σ² + x²)` with importance weights, else `fallback(x)`.
fn weights(
    xb: &[f32],
    qw: Option<&[f32]>,
    sigma2: f32,
    fallback: impl Fn(f32) -> f32,
) -> [f32; 32] {
    let mut w = [0f32; 32];
    for i in 0..xb.len() {
        w[i] = match qw {
            Some(q) => q[i] * (sigma2 + xb[i] * xb[i]).sqrt(),
            None => fallback(xb[i]),
        };
    }
    w
}

/// One sub-block of 16 or 32 values as every i-quant starts it: its weights
/// ([`weights`]), their square roots (the neighbour search's), its magnitudes and sign bits
/// ([`signs`]) and its largest magnitude.
struct Sub {
    n: usize,
    weight: [f32; 32],
    waux: [f32; 32],
    xval: [f32; 32],
    signs: [u8; 4],
    max: f32,
}

impl Sub {
    fn new(
        xb: &[f32],
        qw: Option<&[f32]>,
        sigma2: f32,
        fallback: impl Fn(f32) -> f32,
        even: bool,
    ) -> Sub {
        let n = xb.len();
        let weight = weights(xb, qw, sigma2, fallback);
        let mut waux = [0f32; 32];
        for i in 0..n {
            waux[i] = weight[i].sqrt();
        }
        let (mut xval, mut signs_) = ([0f32; 32], [0u8; 4]);
        signs(xb, &weight, &mut xval, &mut signs_, even);
        let max = max_of(&xval[..n]);
        Sub {
            n,
            weight,
            waux,
            xval,
            signs: signs_,
            max,
        }
    }

    fn weight(&self) -> &[f32] {
        &self.weight[..self.n]
    }

    fn waux(&self) -> &[f32] {
        &self.waux[..self.n]
    }

    fn xval(&self) -> &[f32] {
        &self.xval[..self.n]
    }
}

fn sum_sq(x: &[f32]) -> f32 {
    let mut s = 0f32;
    for &v in x {
        s += v * v;
    }
    s
}

/// `quantize_row_iq2_xxs_impl`: 66 bytes per 256 (`d`; per 32, four point indices in one u32
/// and 4 × 7 sign bits plus a 4-bit scale in another). Needs importance weights.
fn iq2_xxs<N: Neighbours>(x: &[f32], qw: &[f32], o: &mut [u8], nb: &N) {
    const KMAX: i32 = 3;
    let lat = Lattice::of(GgufType::Iq2Xxs);
    o.fill(0);
    let mut q2 = [0u32; 16];
    let mut scales = [0f32; 8];
    let mut max_scale = 0f32;
    let sigma2 = sum_sq(x) / 256.0;
    let (mut l, mut laux) = ([0i8; 32], [0i8; 32]);
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let sub = Sub::new(xb, Some(&qw[32 * ib..32 * ib + 32]), sigma2, |_| 0.0, true);
        let (weight, waux, xval) = (sub.weight(), sub.waux(), sub.xval());
        let mut bsigns = sub.signs;
        if sub.max < EPS {
            scales[ib] = 0.0;
            l.fill(0);
            continue;
        }
        let mut lu = [0u8; 32];
        let mut scale = super::imatrix::make_qp_quants(KMAX + 1, xval, &mut lu, weight);
        for i in 0..32 {
            l[i] = lu[i] as i8;
        }
        let eff_max = scale * KMAX as f32;
        if eff_max <= 0.0 {
            scales[ib] = 0.0;
            l.fill(0);
            continue;
        }
        // Every candidate's levels, then their fits, the best kept in candidate order.
        let mut cands = [[0i8; 32]; 13];
        let placer = Placer {
            lat,
            nb,
            xval,
            waux,
            kmax: KMAX,
        };
        for (c, is) in (-6i32..=6).enumerate() {
            let id = ((2 * KMAX - 1) as f32 + is as f32 * 0.1) / eff_max;
            for k in 0..4 {
                placer.place(k, id, 1.0 / id, &mut laux, false);
            }
            cands[c] = laux;
        }
        let mut fits = [(0f32, 0f32); 13];
        nb.fits(weight, xval, &cands, &mut fits);
        let mut best = 0f32;
        for (c, &(sumqx, sumq2)) in fits.iter().enumerate() {
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                scale = sumqx / sumq2;
                best = scale * sumqx;
                l = cands[c];
            }
        }
        if scale > 0.0 {
            for k in 0..4 {
                placer.place(k, 1.0 / scale, scale, &mut l, true);
            }
            let (sumqx, sumq2) = fit(weight, xval, &l);
            if sumq2 > 0.0 {
                scale = sumqx / sumq2;
            }
        }
        if scale < 0.0 {
            scale = -scale;
            for s in &mut bsigns {
                *s = !*s & 127;
            }
        }
        for k in 0..4 {
            let g = lat.index(&l[8 * k..8 * k + 8]);
            q2[2 * ib] |= (g as u32) << (8 * k);
            q2[2 * ib + 1] |= u32::from(bsigns[k]) << (7 * k);
        }
        scales[ib] = scale;
        max_scale = if max_scale > scale { max_scale } else { scale };
    }
    if max_scale == 0.0 {
        return;
    }
    let d = max_scale / 31.0;
    o[..2].copy_from_slice(&half(d));
    let id = 1.0 / d;
    for ib in 0..8 {
        q2[2 * ib + 1] |= u32::from(scale4(id, scales[ib])) << 28;
    }
    for (b, q) in o[2..66].chunks_exact_mut(4).zip(q2) {
        b.copy_from_slice(&q.to_le_bytes());
    }
}

/// The candidate search shared by IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S: for each `is` in `steps`,
/// inverse scale `(2·kmax − 1 + is·step) / max`, every group of `dims` rounded (and put on the
/// lattice at that scale), the best weighted fit kept; then the groups that ended off the
/// lattice (all of them with `all_again`) re-rounded at the chosen scale and the scale refitted.
/// Returns the scale; the levels are in `l`.
#[allow(clippy::too_many_arguments)]
fn search<N: Neighbours>(
    nb: &N,
    lat: &Lattice,
    xval: &[f32],
    weight: &[f32],
    waux: &[f32],
    l: &mut [i8],
    kmax: i32,
    steps: std::ops::RangeInclusive<i32>,
    step: f32,
    on_grid_start: bool,
    all_again: bool,
    rewrite_on_grid: bool,
) -> f32 {
    let n = xval.len();
    let groups = n / lat.dims;
    let max = max_of(xval);
    let mut best = 0f32;
    let mut scale = max / (2 * kmax - 1) as f32;
    let mut on_grid = [on_grid_start; 8];
    // Every candidate's levels (and which groups landed on the lattice), then their fits, the
    // best kept in candidate order.
    let mut cands = [[0i8; 32]; 31];
    let mut grids = [[true; 8]; 31];
    let mut count = 0;
    let placer = Placer {
        lat,
        nb,
        xval,
        waux,
        kmax,
    };
    for is in steps {
        let id = ((2 * kmax - 1) as f32 + is as f32 * step) / max;
        for k in 0..groups {
            grids[count][k] = placer.place(k, id, 1.0 / id, &mut cands[count], false);
        }
        count += 1;
    }
    let mut fits = [(0f32, 0f32); 31];
    nb.fits(weight, xval, &cands[..count], &mut fits[..count]);
    for c in 0..count {
        let (sumqx, sumq2) = fits[c];
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            scale = sumqx / sumq2;
            best = scale * sumqx;
            l[..n].copy_from_slice(&cands[c][..n]);
            on_grid[..groups].copy_from_slice(&grids[c][..groups]);
        }
    }
    if on_grid[..groups].iter().any(|g| !g) && scale > 0.0 {
        for k in 0..groups {
            if all_again || !on_grid[k] {
                placer.place(k, 1.0 / scale, scale, l, rewrite_on_grid);
            }
        }
        let (sumqx, sumq2) = fit(weight, xval, &l[..n]);
        if sumq2 > 0.0 {
            scale = sumqx / sumq2;
        }
    }
    scale
}

/// `quantize_row_iq2_xs_impl` (74 bytes per 256: `d`, 32 × u16 point | 7 sign bits << 9, 8
/// bytes of 4-bit scales per 16) and `quantize_row_iq2_s_impl` (82 bytes: `d`, 32 point
/// bytes, 32 sign bytes, 8 bytes of high index bits, 8 of scales; weights optional).
fn iq2_xs_s<N: Neighbours>(ty: GgufType, x: &[f32], qw: Option<&[f32]>, o: &mut [u8], nb: &N) {
    const KMAX: i32 = 3;
    let lat = Lattice::of(ty);
    let is_s = ty == GgufType::Iq2S;
    o.fill(0);
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let sumx2 = sum_sq(x);
    let sigma2 = if is_s {
        2.0 * sumx2 / 256.0
    } else {
        sumx2 / 256.0
    };
    let mut l = [0i8; 16];
    for ib in 0..16 {
        let xb = &x[16 * ib..16 * ib + 16];
        let qb = qw.map(|q| &q[16 * ib..16 * ib + 16]);
        let sub = Sub::new(xb, qb, sigma2, |v| 0.25 * sigma2 + v * v, !is_s);
        let mut bsigns = sub.signs;
        l.fill(0);
        if sub.max < if is_s { EPS_IQ2_S } else { EPS } {
            scales[ib] = 0.0;
            continue;
        }
        let mut scale = search(
            nb,
            lat,
            sub.xval(),
            sub.weight(),
            sub.waux(),
            &mut l,
            KMAX,
            -9..=9,
            0.1,
            true,
            false,
            false,
        );
        if scale < 0.0 {
            scale = -scale;
            for s in &mut bsigns {
                *s = if is_s { !*s } else { !*s & 127 };
            }
        }
        for k in 0..2 {
            let g = lat.index(&l[8 * k..8 * k + 8]);
            if is_s {
                let i8 = 2 * ib + k;
                o[2 + i8] = (g & 255) as u8;
                o[66 + i8 / 4] |= ((g >> 8) << (2 * (i8 % 4))) as u8;
                o[2 + 32 + i8] = bsigns[k];
            } else {
                let v = g as u16 | u16::from(bsigns[k]) << 9;
                o[2 + 2 * (2 * ib + k)..4 + 2 * (2 * ib + k)].copy_from_slice(&v.to_le_bytes());
            }
        }
        scales[ib] = scale;
        max_scale = if max_scale > scale { max_scale } else { scale };
    }
    if max_scale == 0.0 {
        if !is_s {
            o[2..66].fill(0);
        }
        return;
    }
    let d = max_scale / 31.0;
    o[..2].copy_from_slice(&half(if is_s { d * 0.9875 } else { d }));
    let id = 1.0 / d;
    let at = if is_s { 74 } else { 66 };
    for ib in 0..16 {
        let s = scale4(id, scales[ib]);
        if ib % 2 == 0 {
            o[at + ib / 2] = s;
        } else {
            o[at + ib / 2] |= s << 4;
        }
    }
}

/// `quantize_row_iq3_xxs_impl` (98 bytes per 256: `d`, 64 point bytes, per 32 a u32 of 4 × 7
/// sign bits and a 4-bit scale) and `quantize_row_iq3_s_impl` (110 bytes: `d`, 64 point
/// bytes, 8 bytes of ninth index bits, 32 sign bytes, 4 bytes of scales per 64). Weights
/// optional (`x²` without them).
fn iq3<N: Neighbours>(ty: GgufType, x: &[f32], qw: Option<&[f32]>, o: &mut [u8], nb: &N) {
    const KMAX: i32 = 8;
    let lat = Lattice::of(ty);
    let is_s = ty == GgufType::Iq3S;
    o.fill(0);
    let mut scales = [0f32; 8];
    let mut max_scale = 0f32;
    let sigma2 = 2.0 * sum_sq(x) / 256.0;
    let mut l = [0i8; 32];
    // IQ3_S's point bytes and sign bytes are written through pointers that ggml advances only
    // past a sub-block it quantized: after an all-zero sub-block (`!max`, skipped by a
    // `continue` before the advance) the next ones land a slot early and the last slots stay
    // zero, while the ninth index bits and the scales stay at their own sub-block. llama-quantize
    // writes that, so kiln does (its decoder reads it as ggml's does).
    let mut slot = 0;
    for ib in 0..8 {
        let xb = &x[32 * ib..32 * ib + 32];
        let sub = Sub::new(
            xb,
            qw.map(|q| &q[32 * ib..32 * ib + 32]),
            sigma2,
            |v| v * v,
            !is_s,
        );
        let mut bsigns = sub.signs;
        l.fill(0);
        let degenerate = if is_s {
            sub.max == 0.0
        } else {
            sub.max < EPS_IQ3_XXS
        };
        if degenerate {
            scales[ib] = 0.0;
            continue;
        }
        let (steps, on_grid_start, all_again) = if is_s {
            (-9..=9, false, true)
        } else {
            (-15..=15, true, false)
        };
        let mut scale = search(
            nb,
            lat,
            sub.xval(),
            sub.weight(),
            sub.waux(),
            &mut l,
            KMAX,
            steps,
            0.2,
            on_grid_start,
            all_again,
            true,
        );
        if scale < 0.0 {
            scale = -scale;
            for s in &mut bsigns {
                *s = if is_s { !*s } else { !*s & 127 };
            }
        }
        let mut packed = 0u32;
        let at = if is_s { slot } else { ib };
        for k in 0..8 {
            let g = lat.index(&l[4 * k..4 * k + 4]);
            o[2 + 8 * at + k] = (g & 255) as u8;
            if is_s {
                o[66 + ib] |= ((g >> 8) << k) as u8;
            }
        }
        slot += 1;
        if is_s {
            o[74 + 4 * at..78 + 4 * at].copy_from_slice(&bsigns);
        } else {
            for (k, &s) in bsigns.iter().enumerate() {
                packed |= u32::from(s) << (7 * k);
            }
            o[66 + 4 * ib..70 + 4 * ib].copy_from_slice(&packed.to_le_bytes());
        }
        scales[ib] = scale;
        max_scale = if max_scale > scale { max_scale } else { scale };
    }
    if max_scale == 0.0 {
        // IQ3_S keeps the signs and indices it wrote; IQ3_XXS clears its quants.
        if !is_s {
            o[2..98].fill(0);
        }
        return;
    }
    let d = max_scale / 31.0;
    o[..2].copy_from_slice(&half(d * if is_s { 1.033 } else { 1.0125 }));
    let id = 1.0 / d;
    if is_s {
        for ib in (0..8).step_by(2) {
            o[106 + ib / 2] = scale4(id, scales[ib]) | scale4(id, scales[ib + 1]) << 4;
        }
    } else {
        for ib in 0..8 {
            let at = 66 + 4 * ib;
            let mut v = u32::from_le_bytes([o[at], o[at + 1], o[at + 2], o[at + 3]]);
            v |= u32::from(scale4(id, scales[ib])) << 28;
            o[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
    }
}

/// ggml's `ksigns_iq2xs`: 7 sign bits and the eighth that makes their count even.
fn ksign(s7: u8) -> u8 {
    s7 | if s7.count_ones() % 2 == 1 { 0x80 } else { 0 }
}

/// Decodes one block of an i-quant (`dequantize_row_iq*`).
pub(super) fn dequantize_block(ty: GgufType, b: &[u8], y: &mut [f32]) {
    let lat = Lattice::of(ty);
    let d = unhalf(b);
    let sign = |s: u8, j: usize| if s >> j & 1 == 1 { -1.0 } else { 1.0 };
    // Point `g`'s level `j` as the dequantization grid's byte.
    let m = |g: usize, j: usize| Lattice::magnitude(ty, (lat.points[g][j] - 1) / 2);
    match ty {
        GgufType::Iq2Xxs => {
            for ib in 0..8 {
                let w = |i: usize| {
                    let a = 2 + 8 * ib + 4 * i;
                    u32::from_le_bytes([b[a], b[a + 1], b[a + 2], b[a + 3]])
                };
                let (a0, a1) = (w(0), w(1));
                let db = d * (0.5 + (a1 >> 28) as f32) * 0.25;
                for l in 0..4 {
                    let g = ((a0 >> (8 * l)) & 255) as usize;
                    let s = ksign(((a1 >> (7 * l)) & 127) as u8);
                    for j in 0..8 {
                        y[32 * ib + 8 * l + j] = db * m(g, j) * sign(s, j);
                    }
                }
            }
        }
        GgufType::Iq2Xs | GgufType::Iq2S => {
            let at = if ty == GgufType::Iq2S { 74 } else { 66 };
            for ib in 0..8 {
                let sc = b[at + ib];
                let db = [
                    d * (0.5 + f32::from(sc & 0xf)) * 0.25,
                    d * (0.5 + f32::from(sc >> 4)) * 0.25,
                ];
                for l in 0..4 {
                    let (g, s) = if ty == GgufType::Iq2S {
                        let qh = usize::from(b[66 + ib]);
                        (
                            usize::from(b[2 + 4 * ib + l]) | (qh << (8 - 2 * l) & 0x300),
                            b[34 + 4 * ib + l],
                        )
                    } else {
                        let a = 2 + 2 * (4 * ib + l);
                        let v = u16::from_le_bytes([b[a], b[a + 1]]);
                        (usize::from(v & 511), ksign((v >> 9) as u8))
                    };
                    for j in 0..8 {
                        y[32 * ib + 8 * l + j] = db[l / 2] * m(g, j) * sign(s, j);
                    }
                }
            }
        }
        GgufType::Iq3Xxs => {
            for ib in 0..8 {
                let a = 66 + 4 * ib;
                let aux = u32::from_le_bytes([b[a], b[a + 1], b[a + 2], b[a + 3]]);
                let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
                for l in 0..4 {
                    let s = ksign(((aux >> (7 * l)) & 127) as u8);
                    let (g1, g2) = (
                        usize::from(b[2 + 8 * ib + 2 * l]),
                        usize::from(b[2 + 8 * ib + 2 * l + 1]),
                    );
                    for j in 0..4 {
                        y[32 * ib + 8 * l + j] = db * m(g1, j) * sign(s, j);
                        y[32 * ib + 8 * l + j + 4] = db * m(g2, j) * sign(s, j + 4);
                    }
                }
            }
        }
        _ => {
            for ib in 0..8 {
                let sc = b[106 + ib / 2];
                let db = d * f32::from(1 + 2 * if ib % 2 == 0 { sc & 0xf } else { sc >> 4 });
                let qh = usize::from(b[66 + ib]);
                for l in 0..4 {
                    let g1 = usize::from(b[2 + 8 * ib + 2 * l]) | ((qh << (8 - 2 * l)) & 256);
                    let g2 = usize::from(b[2 + 8 * ib + 2 * l + 1]) | ((qh << (7 - 2 * l)) & 256);
                    let s = b[74 + 4 * ib + l];
                    for j in 0..4 {
                        y[32 * ib + 8 * l + j] = db * m(g1, j) * sign(s, j);
                        y[32 * ib + 8 * l + j + 4] = db * m(g2, j) * sign(s, j + 4);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lattices_fit_their_maps_and_every_pattern_has_a_point() {
        for ty in [
            GgufType::Iq2Xxs,
            GgufType::Iq2Xs,
            GgufType::Iq2S,
            GgufType::Iq3Xxs,
            GgufType::Iq3S,
        ] {
            let lat = Lattice::of(ty);
            let on = lat.map.iter().filter(|&&m| m >= 0).count();
            assert_eq!(
                on,
                lat.points.len(),
                "{ty:?}: every point has its own pattern"
            );
            for &m in &lat.map {
                if m < 0 {
                    let at = (-m - 1) as usize;
                    assert!(
                        lat.neighbours[at] > 0,
                        "{ty:?}: a pattern without neighbours"
                    );
                }
            }
        }
    }

    #[test]
    fn ksigns_have_even_parity() {
        for s in 0..128u8 {
            assert_eq!(ksign(s).count_ones() % 2, 0);
            assert_eq!(ksign(s) & 127, s);
        }
    }

    /// Values whose errors overflow (±∞, NaN, near `f32::MAX`) leave the neighbour search
    /// without a winner: llama.cpp asserts there; kiln takes the nearest neighbour and writes
    /// a block.
    #[test]
    fn values_whose_errors_overflow_still_quantize() {
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 3e38, -3e38] {
            let x: Vec<f32> = (0..256)
                .map(|i| {
                    if i % 7 == 3 {
                        bad
                    } else {
                        (i as f32 * 0.37).sin()
                    }
                })
                .collect();
            let qw = vec![1f32; 256];
            for ty in [
                GgufType::Iq2Xxs,
                GgufType::Iq2Xs,
                GgufType::Iq2S,
                GgufType::Iq3Xxs,
                GgufType::Iq3S,
            ] {
                let mut o = vec![0u8; ty.block_bytes()];
                quantize_block(ty, &x, Some(&qw), &mut o, &Scalar);
                if ty != GgufType::Iq2Xxs && ty != GgufType::Iq2Xs {
                    quantize_block(ty, &x, None, &mut o, &Scalar);
                }
            }
        }
    }
}
