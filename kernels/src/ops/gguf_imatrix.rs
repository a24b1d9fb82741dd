//! llama.cpp's quantizers that read importance weights (`quantize_<type>` of `ggml-quants.c`
//! called with `quant_weights`, what `llama-quantize --imatrix` runs), and the types below four
//! bits: Q2_K and Q3_K (reference and weighted), IQ4_NL and IQ4_XS (llama.cpp's non-linear
//! 4-bit grid). The same rules as the parent module: f32 in the C code's operation order, no
//! fused multiply-add, ggml's rounding helpers, C's integer conversions where the C code
//! narrows (`as u8` / `as i8` wrap as a C store to `uint8_t` / `int8_t` does).

// The loops index as ggml-quants.c does, so that each line can be checked against the C.
#![allow(clippy::needless_range_loop)]

use super::{
    GgufType, half, make_qkx2_quants, make_qx_quants, nearest_int, pack5, q6_k_finish,
    qk_asym_codes, unhalf,
};

/// ggml's `GROUP_MAX_EPS`.
const GROUP_MAX_EPS: f32 = 1e-15;

/// One row of `ty` with importance weights `qw` (one per column of the row).
pub(super) fn quantize_row(ty: GgufType, x: &[f32], qw: &[f32], o: &mut [u8]) {
    let bytes = ty.block_bytes();
    match ty {
        GgufType::Q4_0 | GgufType::Q5_0 | GgufType::Q4_1 | GgufType::Q5_1 => {
            // The legacy types' sigma² runs over the whole row.
            legacy_blocks(ty, x, qw, legacy_sigma2(x), o);
        }
        _ => {
            let block = ty.block_elems();
            for ((xb, qb), ob) in x
                .chunks_exact(block)
                .zip(qw.chunks_exact(block))
                .zip(o.chunks_exact_mut(bytes))
            {
                match ty {
                    GgufType::Q2K => q2_k_impl(xb, qb, ob),
                    GgufType::Q3K => q3_k_impl(xb, qb, ob),
                    GgufType::Q4K => qk_asym_impl(xb, qb, ob, 15),
                    GgufType::Q5K => qk_asym_impl(xb, qb, ob, 31),
                    GgufType::Q6K => q6_k_impl(xb, qb, ob),
                    GgufType::Iq4Nl | GgufType::Iq4Xs => iq4(xb, ob, Some(qb)),
                    GgufType::Iq2Xxs
                    | GgufType::Iq2Xs
                    | GgufType::Iq2S
                    | GgufType::Iq3Xxs
                    | GgufType::Iq3S => {
                        super::iq::quantize_block(ty, xb, Some(qb), ob, &super::iq::Scalar)
                    }
                    // Q8_0 and MXFP4 take no weights (`super::weighted`); the legacy types
                    // are above.
                    _ => {
                        let _ = super::quantize_blocks(ty, xb, ob);
                    }
                }
            }
        }
    }
}

/// `quantize_row_q{4,5}_{0,1}_impl`'s block with its weights.
fn legacy(ty: GgufType, xb: &[f32], weight: &[f32; 32], o: &mut [u8]) {
    match ty {
        GgufType::Q4_0 | GgufType::Q5_0 => {
            let nmax = if ty == GgufType::Q4_0 { 8 } else { 16 };
            let mut l = [0i8; 32];
            let d = make_qx_quants(nmax, xb, &mut l, Some(weight));
            legacy_pack_sym(ty, o, d, &l);
        }
        _ => {
            let nmax = if ty == GgufType::Q4_1 { 15 } else { 31 };
            let mut l = [0u8; 32];
            let (d, the_min) = make_qkx3_quants(nmax, xb, weight, &mut l, -0.9, 0.05, 36);
            legacy_pack_asym(ty, o, d, the_min, &l);
        }
    }
}

/// Blocks of a legacy type under the importance weights `qw`, the row's `sigma2` given.
pub(crate) fn legacy_blocks(ty: GgufType, x: &[f32], qw: &[f32], sigma2: f32, o: &mut [u8]) {
    for ((xb, qb), ob) in x
        .chunks_exact(32)
        .zip(qw.chunks_exact(32))
        .zip(o.chunks_exact_mut(ty.block_bytes()))
    {
        let mut weight = [0f32; 32];
        for j in 0..32 {
            weight[j] = qb[j] * (sigma2 + xb[j] * xb[j]).sqrt();
        }
        legacy(ty, xb, &weight, ob);
    }
}

/// The legacy types' σ² under an importance matrix: `Σx²/len` over the whole row (each weight
/// is then `qw · sqrt(σ² + x²)`).
pub(crate) fn legacy_sigma2(x: &[f32]) -> f32 {
    let sum_x2 = x.iter().fold(0f32, |s, v| s + v * v);
    sum_x2 / x.len() as f32
}

/// Q4_0 / Q5_0's block from its scale `d` and codes `l` (offset by `nmax`).
pub(crate) fn legacy_pack_sym(ty: GgufType, o: &mut [u8], d: f32, l: &[i8; 32]) {
    o[..2].copy_from_slice(&half(d));
    if ty == GgufType::Q4_0 {
        for j in 0..16 {
            o[2 + j] = (l[j] as u8) | (l[j + 16] as u8) << 4;
        }
    } else {
        let (qh, qs) = o[2..].split_at_mut(4);
        pack5(|j| l[j] as u8, qh, qs);
    }
}

/// Q4_1 / Q5_1's block from its scale `d`, `-min` and codes `l`.
pub(crate) fn legacy_pack_asym(ty: GgufType, o: &mut [u8], d: f32, the_min: f32, l: &[u8; 32]) {
    o[..2].copy_from_slice(&half(d));
    o[2..4].copy_from_slice(&half(-the_min));
    if ty == GgufType::Q4_1 {
        for j in 0..16 {
            o[4 + j] = l[j] | l[j + 16] << 4;
        }
    } else {
        let (qh, qs) = o[4..].split_at_mut(4);
        pack5(|j| l[j], qh, qs);
    }
}

/// ggml's `make_qkx3_quants` with weights and squared errors (`use_mad` false, as every
/// caller here passes): with weights given it is `make_qkx2_quants` operation for operation
/// (its degenerate case `max <= min` is `max == min` for any input, NaN included). Returns
/// `(scale, -min)`, codes into `l`.
fn make_qkx3_quants(
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    make_qkx2_quants(nmax, x, weights, l, rmin, rdelta, nstep, false)
}

/// ggml's `make_qp_quants`: a positive scale for the non-negative `x` with codes in
/// `0..=nmax` (the block scales of Q2_K / Q4_K / Q5_K with weights `qw`), nine candidates by
/// weighted error, then up to five rounds of single-code refinement. Codes into `l`.
pub(super) fn make_qp_quants(nmax: i32, x: &[f32], l: &mut [u8], qw: &[f32]) -> f32 {
    let n = x.len();
    let mut max = 0f32;
    for &v in x {
        max = if max > v { max } else { v };
    }
    if max < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / max;
    for i in 0..n {
        l[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best_mse = 0f32;
    for i in 0..n {
        let diff = x[i] - scale * f32::from(l[i]);
        best_mse += qw[i] * diff * diff;
    }
    for is in -4i32..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax_f) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0f32;
        for i in 0..n {
            let q = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * q as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best_mse {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..n {
        let q = nearest_int(iscale * x[i]).min(nmax);
        l[i] = q as u8;
        let w = qw[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..n {
            let w = qw[i];
            let li = f32::from(l[i]);
            let mut slx = sumlx - w * x[i] * li;
            let mut sl2 = suml2 - w * li * li;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != i32::from(l[i]) {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// ggml's `make_q3_quants` with `do_rmse`: Q3_K's reference sub-block scale (weights `x²`),
/// codes in `-nmax..nmax` refined one at a time, offset by `nmax` into `l`.
fn make_q3_quants(nmax: i32, x: &[f32], l: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for i in 0..x.len() {
        let q = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l[i] = q as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * q as f32;
        suml2 += w * q as f32 * q as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..x.len() {
            let w = x[i] * x[i];
            let li = f32::from(l[i]);
            let mut slx = sumlx - w * x[i] * li;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li * li;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != i32::from(l[i]) {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for v in l.iter_mut() {
        *v += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// Q2_K's and Q3_K's 2-bit code planes: byte `j/4 + l` of each 128 holds codes `j + l`,
/// `+32`, `+64`, `+96`.
fn pack2(l: &[u8; 256], qs: &mut [u8]) {
    for j in (0..256).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] = l[j + i] | l[j + i + 32] << 2 | l[j + i + 64] << 4 | l[j + i + 96] << 6;
        }
    }
}

/// Q2_K's codes from the stored `d`, `dmin` and 4-bit scales (`o[..16]`, `o[80..84]`), packed.
fn q2_k_codes(x: &[f32], o: &mut [u8], l: &mut [u8; 256]) {
    let (d_all, dmin_all) = (unhalf(&o[80..82]), unhalf(&o[82..84]));
    for j in 0..16 {
        let d = d_all * f32::from(o[j] & 0xf);
        if d == 0.0 {
            continue;
        }
        let dm = dmin_all * f32::from(o[j] >> 4);
        for i in 0..16 {
            l[16 * j + i] = nearest_int((x[16 * j + i] + dm) / d).clamp(0, 3) as u8;
        }
    }
    pack2(l, &mut o[16..80]);
}

/// `quantize_row_q2_K_ref`: 16 sub-blocks of 16, each a (scale, min) by `make_qkx2_quants`
/// (weights `|x|`, absolute errors), both quantized to 4 bits against their maximum.
pub(super) fn q2_k_ref(x: &[f32], o: &mut [u8]) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    for j in 0..16 {
        let xs = &x[16 * j..16 * j + 16];
        let mut weights = [0f32; 16];
        for (w, v) in weights.iter_mut().zip(xs) {
            *w = v.abs();
        }
        (scales[j], mins[j]) = make_qkx2_quants(
            3,
            xs,
            &weights,
            &mut l[16 * j..16 * j + 16],
            -0.5,
            0.1,
            15,
            true,
        );
    }
    q2_k_finish(x, o, &scales, &mins, &mut l);
}

/// Q2_K after its sub-block searches: the sub-blocks' scales and minimums (as
/// `make_qkx2_quants` returns them) quantized to 4 bits against their maximum, then the codes
/// from the stored values, packed (the part of `quantize_row_q2_K_ref` after its loop; the
/// lane searches of `cpu::kquants` share it).
pub(crate) fn q2_k_finish(
    x: &[f32],
    o: &mut [u8],
    scales: &[f32; 16],
    mins: &[f32; 16],
    l: &mut [u8; 256],
) {
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..16 {
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let q4scale = 15f32;
    if max_scale > 0.0 {
        let iscale = q4scale / max_scale;
        for j in 0..16 {
            o[j] = nearest_int(iscale * scales[j]) as u8;
        }
        o[80..82].copy_from_slice(&half(max_scale / q4scale));
    } else {
        o[..16].fill(0);
        o[80..82].copy_from_slice(&half(0.0));
    }
    if max_min > 0.0 {
        let iscale = q4scale / max_min;
        for j in 0..16 {
            o[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        o[82..84].copy_from_slice(&half(max_min / q4scale));
    } else {
        o[82..84].copy_from_slice(&half(0.0));
    }
    q2_k_codes(x, o, l);
}

/// `quantize_row_q2_K_impl`: sub-block (scale, min) by `make_qkx3_quants` with weights
/// `qw · sqrt(σ² + x²)`, the 4-bit scales and minimums by `make_qp_quants` weighted by each
/// sub-block's total weight.
fn q2_k_impl(x: &[f32], qw: &[f32], o: &mut [u8]) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 16], [0f32; 16]);
    let (weights, sw) = k16_weights(x, qw, 1.0);
    for j in 0..16 {
        (scales[j], mins[j]) = make_qkx3_quants(
            3,
            &x[16 * j..16 * j + 16],
            &weights[16 * j..16 * j + 16],
            &mut l[16 * j..16 * j + 16],
            -0.9,
            0.05,
            36,
        );
    }
    q2_k_impl_finish(x, o, &scales, &mins, &sw, &mut l);
}

/// The weights of Q2_K's and Q3_K's 16-element sub-blocks under an importance matrix: per
/// element `qw · sqrt(σ² + x²)` with `σ² = k·Σx²/256` (Q2_K: k = 1, Q3_K: k = 2), and each
/// sub-block's total.
pub(crate) fn k16_weights(x: &[f32], qw: &[f32], k: f32) -> ([f32; 256], [f32; 16]) {
    let mut weights = [0f32; 256];
    let mut sw = [0f32; 16];
    let sumx2 = x.iter().fold(0f32, |s, v| s + v * v);
    // `sumx2/QK_K` (Q2_K) and `2*sumx2/QK_K` (Q3_K); 1·Σ is exact.
    let sigma2 = k * sumx2 / 256.0;
    for j in 0..16 {
        for i in 0..16 {
            weights[16 * j + i] = qw[16 * j + i] * (sigma2 + x[16 * j + i] * x[16 * j + i]).sqrt();
        }
        let mut sumw = 0f32;
        for i in 0..16 {
            sumw += weights[16 * j + i];
        }
        sw[j] = sumw;
    }
    (weights, sw)
}

/// Q2_K under an importance matrix after its sub-block searches: the 4-bit scales and
/// minimums by `make_qp_quants` weighted by `sw`, then the codes (shared with the lane search
/// of `cpu::kquants`).
pub(crate) fn q2_k_impl_finish(
    x: &[f32],
    o: &mut [u8],
    scales: &[f32; 16],
    mins: &[f32; 16],
    sw: &[f32; 16],
    l: &mut [u8; 256],
) {
    let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
    let dm = make_qp_quants(15, scales, &mut ls, sw);
    let mm = make_qp_quants(15, mins, &mut lm, sw);
    o[80..82].copy_from_slice(&half(dm));
    o[82..84].copy_from_slice(&half(mm));
    for j in 0..16 {
        o[j] = ls[j] | lm[j] << 4;
    }
    q2_k_codes(x, o, l);
}

/// Q3_K's 6-bit signed scale `j` (offset by 32) into the 12 scale bytes `sc`.
fn q3_k_put_scale(sc: &mut [u8], j: usize, l: u8) {
    if j < 8 {
        sc[j] = l & 0xf;
    } else {
        sc[j - 8] |= (l & 0xf) << 4;
    }
    sc[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
}

/// Q3_K's step of each sub-block, `d · scale_j`, from the stored `d` and 6-bit signed
/// scales (`o[96..110]`).
#[inline(always)]
pub(crate) fn q3_k_steps(o: &[u8]) -> [f32; 16] {
    let d_all = unhalf(&o[108..110]);
    let sc: [u8; 12] = o[96..108].try_into().expect("12 scale bytes");
    let mut d = [0f32; 16];
    for j in 0..16 {
        let low = if j < 8 { sc[j] & 0xf } else { sc[j - 8] >> 4 };
        let s = i32::from(low | ((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32;
        d[j] = d_all * s as f32;
    }
    d
}

/// Q3_K's 3-bit codes `l` (offset by 4, so `0..8`) into `o[..96]`: the high bit of code `j`
/// in bit `j / 32` of `hmask[j % 32]`, the low two bits packed.
#[inline(always)]
pub(crate) fn q3_k_pack(o: &mut [u8], l: &[i8; 256]) {
    let (hmask, qs) = o[..96].split_at_mut(32);
    let mut high = [0u8; 32];
    let mut codes = [0u8; 256];
    for b in 0..8 {
        for k in 0..32 {
            let c = l[32 * b + k] as u8;
            high[k] |= (c >> 2) << b;
            codes[32 * b + k] = c & 3;
        }
    }
    hmask.copy_from_slice(&high);
    pack2(&codes, qs);
}

/// Q3_K's codes from the stored `d` and scales (`o[96..110]`), packed ([`q3_k_pack`]); a
/// sub-block whose step is zero keeps the codes its search left in `l`.
fn q3_k_codes(x: &[f32], o: &mut [u8], l: &mut [i8; 256]) {
    let d = q3_k_steps(o);
    for j in 0..16 {
        if d[j] == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / d[j]).clamp(-4, 3) + 4) as i8;
        }
    }
    q3_k_pack(o, l);
}

/// `quantize_row_q3_K_ref`: sub-block scales by `make_q3_quants`, 6-bit signed scales against
/// the largest (`-32 / max`).
pub(super) fn q3_k_ref(x: &[f32], o: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    for j in 0..16 {
        scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
    }
    q3_k_ref_scales(o, &scales);
    q3_k_codes(x, o, &mut l);
}

/// `quantize_row_q3_K_ref`'s 6-bit signed scales against the largest sub-block scale
/// (`-32 / max`), and `d`, into `o[96..110]`.
pub(crate) fn q3_k_ref_scales(o: &mut [u8], scales: &[f32; 16]) {
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for j in 0..16 {
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    o[96..108].fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..16 {
            // `int8_t l = nearest_int(…)`: narrowed before the clamp, as the C stores it.
            let q = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
            q3_k_put_scale(&mut o[96..108], j, q as u8);
        }
        o[108..110].copy_from_slice(&half(1.0 / iscale));
    } else {
        o[108..110].copy_from_slice(&half(0.0));
    }
}

/// `quantize_row_q3_K_impl`: sub-block scales by `make_qx_quants` with weights
/// `qw · sqrt(σ² + x²)` (σ² twice the mean square), the 6-bit scales by `make_qx_quants`
/// weighted by each sub-block's total weight.
fn q3_k_impl(x: &[f32], qw: &[f32], o: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    let (weights, sw) = k16_weights(x, qw, 2.0);
    for j in 0..16 {
        scales[j] = make_qx_quants(
            4,
            &x[16 * j..16 * j + 16],
            &mut l[16 * j..16 * j + 16],
            Some(&weights[16 * j..16 * j + 16]),
        );
    }
    q3_k_impl_scales(o, &scales, &sw);
    q3_k_codes(x, o, &mut l);
}

/// `quantize_row_q3_K_impl`'s 6-bit scales by `make_qx_quants` weighted by `sw`, and `d`,
/// into `o[96..110]`.
pub(crate) fn q3_k_impl_scales(o: &mut [u8], scales: &[f32; 16], sw: &[f32; 16]) {
    o[96..108].fill(0);
    let mut ls = [0i8; 16];
    let d_block = make_qx_quants(32, scales, &mut ls, Some(sw));
    for j in 0..16 {
        q3_k_put_scale(&mut o[96..108], j, ls[j] as u8);
    }
    o[108..110].copy_from_slice(&half(d_block));
}

/// `quantize_row_q{4,5}_K_impl`: sub-block (scale, min) by `make_qkx3_quants` with weights
/// `qw · sqrt(σ² + x²)`, the 6-bit scales and minimums by `make_qp_quants`.
fn qk_asym_impl(x: &[f32], qw: &[f32], o: &mut [u8], nmax: i32) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (weights, sw) = qk_asym_weights(x, qw);
    for j in 0..8 {
        (scales[j], mins[j]) = make_qkx3_quants(
            nmax,
            &x[32 * j..32 * j + 32],
            &weights[32 * j..32 * j + 32],
            &mut l[32 * j..32 * j + 32],
            -0.9,
            0.05,
            36,
        );
    }
    qk_asym_impl_finish(x, o, nmax, &scales, &mins, &sw, &mut l);
}

/// Q4_K / Q5_K's weights under an importance matrix: per element `qw · sqrt(σ² + x²)` with
/// `σ² = 2·Σx²/256`, and each sub-block's total (the weights of its block scale).
pub(crate) fn qk_asym_weights(x: &[f32], qw: &[f32]) -> ([f32; 256], [f32; 8]) {
    let mut weights = [0f32; 256];
    let mut sw = [0f32; 8];
    let sum_x2 = x.iter().fold(0f32, |s, v| s + v * v);
    let sigma2 = 2.0 * sum_x2 / 256.0;
    for j in 0..8 {
        for i in 0..32 {
            weights[32 * j + i] = qw[32 * j + i] * (sigma2 + x[32 * j + i] * x[32 * j + i]).sqrt();
        }
        let mut sumw = 0f32;
        for i in 0..32 {
            sumw += weights[32 * j + i];
        }
        sw[j] = sumw;
    }
    (weights, sw)
}

/// Q4_K / Q5_K under an importance matrix after the sub-block searches: the block scales by
/// `make_qp_quants` weighted by each sub-block's total weight `sw`, then the codes (the part
/// of `quantize_row_q4_K_impl` / `q5_K` after its loop; the lane searches of `cpu::kquants`
/// share it).
pub(crate) fn qk_asym_impl_finish(
    x: &[f32],
    o: &mut [u8],
    nmax: i32,
    scales: &[f32; 8],
    mins: &[f32; 8],
    sw: &[f32; 8],
    l: &mut [u8; 256],
) {
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let d_block = make_qp_quants(63, scales, &mut ls, sw);
    let m_block = make_qp_quants(63, mins, &mut lm, sw);
    let sc = &mut o[4..16];
    sc.fill(0);
    for j in 0..8 {
        // Q5_K clamps to 63; Q4_K stores the byte as it is (make_qp_quants's codes are ≤ 63).
        let (ls, lm) = if nmax == 31 {
            (ls[j].min(63), lm[j].min(63))
        } else {
            (ls[j], lm[j])
        };
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xf) | (lm & 0xf) << 4;
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    o[..2].copy_from_slice(&half(d_block));
    o[2..4].copy_from_slice(&half(m_block));
    qk_asym_codes(x, o, nmax, l);
}

/// `quantize_row_q6_K_impl`: each sub-block's scale by `make_qx_quants` weighted by the
/// importance weights themselves (no σ² term), then Q6_K's usual 8-bit scales.
fn q6_k_impl(x: &[f32], qw: &[f32], o: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    for ib in 0..16 {
        scales[ib] = make_qx_quants(
            32,
            &x[16 * ib..16 * ib + 16],
            &mut l[16 * ib..16 * ib + 16],
            Some(&qw[16 * ib..16 * ib + 16]),
        );
    }
    q6_k_finish(x, o, &scales, &mut l);
}

/// ggml's `kvalues_iq4nl`: IQ4_NL's and IQ4_XS's 16 non-linear levels.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's `best_index_int8`: the level of `values` nearest to `x` (the upper one on ties).
fn best_index_int8(values: &[i8; 16], x: f32) -> usize {
    let v = |i: usize| f32::from(values[i]);
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut ml, mut mu) = (0, 15);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < v(mav) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - v(mu - 1) < v(mu) - x {
        mu - 1
    } else {
        mu
    }
}

/// `quantize_row_iq4_nl_impl` with `ntry` 7, as `quantize_iq4_nl` / `quantize_iq4_xs` call it
/// (with or without weights): one super-block of `x.len()` elements (32: IQ4_NL, one f16
/// scale; 256: IQ4_XS, 8 sub-blocks with 6-bit scales against `d = -max / 32`). Weights
/// `qw · sqrt(σ² + x²)` (σ² twice the mean square), or `x²` without importance weights.
pub(super) fn iq4(x: &[f32], o: &mut [u8], qw: Option<&[f32]>) {
    let nb = x.len() / 32;
    let weights = iq4_weights(x, qw);
    let mut scales = [0f32; 8];
    for ib in 0..nb {
        scales[ib] = iq4_search(&x[32 * ib..32 * ib + 32], &weights[32 * ib..32 * ib + 32]);
    }
    iq4_finish(x, o, &scales[..nb]);
}

/// IQ4's weights for the super-block `x` (32 or 256 elements): `qw · sqrt(σ² + x²)` with
/// `σ² = Σx² · (2 / len)`, or `x²` without importance weights.
pub(crate) fn iq4_weights(x: &[f32], qw: Option<&[f32]>) -> [f32; 256] {
    let mut sigma2 = 0f32;
    for &v in x {
        sigma2 += v * v;
    }
    sigma2 *= 2.0 / x.len() as f32;
    let mut weight = [0f32; 256];
    for j in 0..x.len() {
        weight[j] = match qw {
            Some(qw) => qw[j] * (sigma2 + x[j] * x[j]).sqrt(),
            None => x[j] * x[j],
        };
    }
    weight
}

/// One 32-element sub-block's scale (`quantize_row_iq4_nl_impl`'s search, `ntry` 7): the
/// levels of `d = -max / values[0]`, then 15 candidate inverse scales, each by its weighted
/// least-squares scale; 0 for a sub-block of zeros.
fn iq4_search(xb: &[f32], weight: &[f32]) -> f32 {
    const NTRY: i32 = 7;
    let values = &KVALUES_IQ4NL;
    let v0 = f32::from(values[0]);
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in xb {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let mut d = -max / v0;
    let mut id = 1.0 / d;
    let (mut sumqx, mut sumq2) = (0f32, 0f32);
    for j in 0..32 {
        let q = f32::from(values[best_index_int8(values, id * xb[j])]);
        let w = weight[j];
        sumqx += w * q * xb[j];
        sumq2 += w * q * q;
    }
    d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        id = (itry + i32::from(values[0])) as f32 / max;
        sumqx = 0.0;
        sumq2 = 0.0;
        for j in 0..32 {
            let q = f32::from(values[best_index_int8(values, id * xb[j])]);
            let w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// IQ4 after its sub-block searches (`scales`: one per 32 elements of `x`; one: IQ4_NL, eight:
/// IQ4_XS): the block scale(s), every code from the stored scale, packed (shared with the lane
/// search of `cpu::kquants`).
pub(crate) fn iq4_finish(x: &[f32], o: &mut [u8], scales: &[f32]) {
    let values = &KVALUES_IQ4NL;
    let sbs = x.len();
    let nb = scales.len();
    let mut l = [0u8; 256];
    let (mut max_scale, mut amax_scale) = (0f32, 0f32);
    for &d in scales {
        if d.abs() > amax_scale {
            amax_scale = d.abs();
            max_scale = d;
        }
    }
    let qs_at;
    if nb > 1 {
        // IQ4_XS: d, scales_h (u16), scales_l (4), qs (128).
        let d = -max_scale / 32.0;
        o[..2].copy_from_slice(&half(d));
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        o[4..8].fill(0);
        for ib in 0..nb {
            let q = nearest_int(id * scales[ib]).clamp(-32, 31);
            let dl = d * q as f32;
            let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
            for j in 0..32 {
                l[32 * ib + j] = best_index_int8(values, idl * x[32 * ib + j]) as u8;
            }
            let q = (q + 32) as u8;
            let (lo, hi) = (q & 0xf, q >> 4);
            if ib % 2 == 0 {
                o[4 + ib / 2] = lo;
            } else {
                o[4 + ib / 2] |= lo << 4;
            }
            scales_h |= u16::from(hi) << (2 * (ib % 8));
        }
        o[2..4].copy_from_slice(&scales_h.to_le_bytes());
        qs_at = 8;
    } else {
        o[..2].copy_from_slice(&half(scales[0]));
        let id = if scales[0] != 0.0 {
            1.0 / scales[0]
        } else {
            0.0
        };
        for j in 0..32 {
            l[j] = best_index_int8(values, id * x[j]) as u8;
        }
        qs_at = 2;
    }
    let qs = &mut o[qs_at..qs_at + sbs / 2];
    for i in 0..sbs / 32 {
        for j in 0..16 {
            qs[16 * i + j] = l[32 * i + j] | l[32 * i + 16 + j] << 4;
        }
    }
}
