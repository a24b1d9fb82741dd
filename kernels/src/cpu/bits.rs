//! Branch-light, exact conversions on bit patterns: the building blocks of the fast CPU paths,
//! each tested against the readable reference in `formats` (and written so the SIMD versions
//! are lane-for-lane the same steps).

/// f32 → E4M3FN, round to nearest even, non-saturating, NaN written 0x7F (the quantizers'
/// convention, `ops::fp8::e4m3_out`).
#[inline]
pub fn e4m3_out(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) as u8 & 0x80;
    let a = bits & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return 0x7f; // NaN
    }
    let code = if a >= 0x43e8_0000 {
        // |x| > 464 rounds past 448 (464 itself is a tie that rounds to even, 448); Inf too.
        if a == 0x43e8_0000 { 0x7e } else { 0x7f }
    } else if a < 0x3c80_0000 {
        // Below 2^-6: subnormal grid of 2^-9. Adding 2^-6·... as a float does the RNE shift:
        // f32(|x| + 0.5) has its ulp at 2^-24, so put the grid at the ulp with 2^14 scaling.
        let f = f32::from_bits(a) + f32::from_bits(141 << 23); // + 2^14: ulp 2^-9
        (f.to_bits() - (141 << 23)) as u8
    } else {
        // Normal: rebias the exponent (127 → 7) and round the 20 dropped bits to nearest even.
        let odd = (a >> 20) & 1;
        let r = a.wrapping_add(((7u32.wrapping_sub(127)) << 23).wrapping_add(0x7_ffff + odd));
        (r >> 20) as u8
    };
    if code == 0x7f { 0x7f } else { code | sign }
}

/// E4M3FN code → f32 (exact; 0x7F / 0xFF are NaN), by table: hot in dequantization loops.
#[inline]
pub fn e4m3_to_f32(c: u8) -> f32 {
    E4M3_TABLE[c as usize]
}

/// [`e4m3_decode`] of every code.
static E4M3_TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = e4m3_decode(c as u8);
        c += 1;
    }
    t
};

/// E4M3FN code → f32, computed.
const fn e4m3_decode(c: u8) -> f32 {
    let (sign, exp, man) = ((c as u32 & 0x80) << 24, (c as u32 >> 3) & 0xf, c as u32 & 7);
    let magnitude = if c & 0x7f == 0x7f {
        f32::NAN
    } else if exp == 0 {
        man as f32 * (1.0 / 512.0) // subnormal: man · 2^-9, exact
    } else {
        f32::from_bits(((exp + 120) << 23) | (man << 20))
    };
    f32::from_bits(magnitude.to_bits() | sign)
}

/// The NVFP4 block scale (`ops::nvfp4::nvfp4_block_scale`) with the bit-level encoder.
#[inline]
pub fn nvfp4_block_scale(bmax: f32, ws2: f32) -> u8 {
    let s = bmax / (6.0 * ws2);
    let s = if s == 0.0 { 1.0 } else { s };
    e4m3_out(s.clamp(1.0 / 512.0, 448.0))
}

/// `formats::e8m0::mxfp8_exponent` without a `log2` call in the common case. For a normal
/// `d = bmax / 448 = m · 2^e` (1 ≤ m < 2): `m == 1` gives exactly `e`; `m > 1 + 2^-14` gives
/// `e + 1`, since `log2 d` then sits further above `e` than half an f32 ulp near any |e| ≤ 149.
/// Everything else (m within 2^-14 of 1, subnormal, zero, NaN, Inf) takes the reference.
#[inline]
pub fn mxfp8_exponent(bmax: f32) -> i32 {
    ceil_log2_shortcut(bmax / 448.0).unwrap_or_else(|| crate::formats::e8m0::mxfp8_exponent(bmax))
}

/// `formats::e8m0::mxfp4_exponent` with the same shortcut (`bmax / 6`).
#[inline]
pub fn mxfp4_exponent(bmax: f32) -> Option<i32> {
    match ceil_log2_shortcut(bmax / 6.0) {
        Some(k) => Some(k),
        None => crate::formats::e8m0::mxfp4_exponent(bmax),
    }
}

/// `ceil(log2_f32(d))` clamped to [-127, 127] from `d`'s bits alone, when that is provably the
/// answer: `d` normal and its mantissa either exactly 1 or more than `1 + 2^-14` above it.
#[inline]
fn ceil_log2_shortcut(d: f32) -> Option<i32> {
    let b = d.to_bits();
    let exp_field = (b >> 23) & 0xff;
    let man = b & 0x7f_ffff;
    if d > 0.0 && exp_field != 0 && exp_field != 0xff {
        let e = exp_field as i32 - 127;
        if man == 0 {
            return Some(e.clamp(-127, 127));
        }
        if man > (1 << 9) {
            return Some((e + 1).clamp(-127, 127));
        }
    }
    None
}

/// f32 → bf16 → f32, round to nearest even; NaN keeps its sign and becomes quiet (as `half`).
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return f32::from_bits((bits | 0x0040_0000) & 0xffff_0000);
    }
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    f32::from_bits(rounded & 0xffff_0000)
}

/// bf16 bits → f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// E2M1 code under the NVFP4 rule, from comparisons only (no branches on the value).
#[inline]
pub fn e2m1_nvfp4(x: f32) -> u8 {
    let a = x.abs();
    // idx = #(bounds < a) + (a on an "up" tie); NaN compares false everywhere, so treat it
    // as beyond every bound (searchsorted puts NaN last).
    let nan = a.is_nan() as u8;
    let idx = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    let idx = if nan == 1 { 7 } else { idx };
    ((x < 0.0) as u8) << 3 | idx
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::Overflow;
    use crate::formats::fp4::f32_to_e2m1_nvfp4;
    use crate::formats::fp8::f32_to_e4m3;
    use half::bf16;

    fn reference_e4m3(x: f32) -> u8 {
        let c = f32_to_e4m3(x, Overflow::NonSaturating);
        if c == 0xff { 0x7f } else { c }
    }

    /// Every f32 whose low 12 mantissa bits are zero (2^20 values: every exponent, sign and
    /// the 11 mantissa bits that matter for rounding), plus their neighbours ±1 ulp.
    fn dense_f32() -> impl Iterator<Item = f32> {
        (0u32..1 << 20).flat_map(|hi| {
            let b = hi << 12;
            [
                b,
                b.wrapping_add(1),
                b.wrapping_sub(1),
                b | 0x800,
                (b | 0x800).wrapping_add(1),
            ]
            .map(f32::from_bits)
        })
    }

    #[test]
    fn e4m3_bits_equals_the_reference_on_a_dense_f32_sweep() {
        for x in dense_f32() {
            assert_eq!(
                e4m3_out(x),
                reference_e4m3(x),
                "x = {x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    #[test]
    fn bf16_rounding_equals_half_on_a_dense_f32_sweep() {
        for x in dense_f32() {
            let want = bf16::from_f32(x).to_f32();
            let got = round_bf16(x);
            assert!(
                got.to_bits() == want.to_bits(),
                "x = {x:e}: {got:e} vs {want:e}"
            );
        }
    }

    #[test]
    fn e4m3_decode_and_block_scale_equal_the_reference() {
        for c in 0..=255u8 {
            let (got, want) = (e4m3_to_f32(c), crate::formats::fp8::e4m3_to_f32(c));
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{c:#x}"
            );
        }
        for x in dense_f32().step_by(7) {
            for ws2 in [1.0, 6.0 / 2688.0, 1e-30, 0.0] {
                let want = crate::ops::nvfp4::nvfp4_block_scale(x.abs(), ws2);
                assert_eq!(
                    nvfp4_block_scale(x.abs(), ws2),
                    want,
                    "bmax {x:e}, ws2 {ws2:e}"
                );
            }
        }
    }

    #[test]
    fn mxfp8_exponent_shortcut_equals_the_reference() {
        for x in dense_f32() {
            let x = x.abs();
            assert_eq!(
                mxfp8_exponent(x),
                crate::formats::e8m0::mxfp8_exponent(x),
                "bmax {x:e}"
            );
        }
        // Right at and around the shortcut's edge, for every binade.
        for e in -140..128 {
            for man in [0u32, 1, (1 << 9) - 1, 1 << 9, (1 << 9) + 1, 0x7f_ffff] {
                let d = f32::from_bits((((e + 127).clamp(1, 254) as u32) << 23) | man);
                for bmax in [d * 448.0, f32::from_bits((d * 448.0).to_bits() + 1)] {
                    assert_eq!(
                        mxfp8_exponent(bmax),
                        crate::formats::e8m0::mxfp8_exponent(bmax),
                        "bmax {bmax:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn mxfp4_exponent_shortcut_equals_the_reference() {
        for x in dense_f32() {
            let x = x.abs();
            assert_eq!(
                mxfp4_exponent(x),
                crate::formats::e8m0::mxfp4_exponent(x),
                "bmax {x:e}"
            );
        }
    }

    #[test]
    fn e2m1_bits_equals_the_reference() {
        for x in dense_f32() {
            assert_eq!(e2m1_nvfp4(x), f32_to_e2m1_nvfp4(x), "x = {x:e}");
        }
    }
}
