//! FP4 E2M1: the values {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives, as 4-bit codes
//! `sign << 3 | index`, under the two rounding rules docs/FORMATS.md gives.

use super::minifloat::{MiniFloat, Specials};

/// E2M1 as a minifloat (no Inf, no NaN).
pub const E2M1: MiniFloat = MiniFloat {
    exp_bits: 2,
    man_bits: 1,
    bias: 1,
    specials: Specials::FiniteOnly,
};

/// The magnitude of each 3-bit index.
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The largest E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// The rounding boundaries between neighbouring magnitudes.
const BOUNDS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

/// NVFP4's rule (ModelOpt `_cast_fp4`): round half to even on the grid, saturate above 6.
/// The sign bit is `x < 0`, so a negative value that rounds to zero gives code 8 while
/// `-0.0` gives code 0; NaN gives code 7 (it sorts after every bound, like `searchsorted`).
pub fn f32_to_e2m1_nvfp4(x: f32) -> u8 {
    let a = x.abs();
    // searchsorted(BOUNDS, a, side="left"): the number of bounds strictly below a.
    let mut idx = if a.is_nan() {
        BOUNDS.len()
    } else {
        BOUNDS.iter().filter(|&&b| b < a).count()
    };
    // Ties at .75, 1.75 and 3.5 go up, to the even neighbour (1, 2, 4).
    if a == 0.75 || a == 1.75 || a == 3.5 {
        idx += 1;
    }
    (u8::from(x < 0.0) << 3) | idx as u8
}

/// MXFP4's rule (ModelOpt `MXFP4QTensor`): `#(bounds < |x|)`, so ties round toward zero;
/// the sign bit is `(2 - sign(x)) // 2`, so an exact zero (either sign) encodes as 0x8.
/// NaN is not defined by ModelOpt; here it gives code 0x8 (no bound is below NaN, and it is
/// treated like zero for the sign), documented and tested.
pub fn f32_to_e2m1_mx(x: f32) -> u8 {
    let a = x.abs();
    let idx = BOUNDS.iter().filter(|&&b| b < a).count() as u8;
    // sign(x) = 1 → 0; sign(x) ∈ {0, -1} (and NaN) → 1
    let sign = u8::from(x.is_nan() || x <= 0.0);
    (sign << 3) | idx
}

/// E2M1 code → f32 (the low 4 bits are used; code 8 is −0.0), by table.
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    E2M1_SIGNED[(code & 15) as usize]
}

/// Every E2M1 code's value: the magnitudes, then their negations.
const E2M1_SIGNED: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 8 {
        t[i] = E2M1_VALUES[i];
        t[i + 8] = -E2M1_VALUES[i];
        i += 1;
    }
    t
};

/// Packs two 4-bit codes per byte, the even element in the low nibble.
/// `codes.len()` must be even; `out.len()` is half of it.
pub fn pack_nibbles(codes: &[u8], out: &mut [u8]) {
    debug_assert_eq!(codes.len(), out.len() * 2);
    for (byte, pair) in out.iter_mut().zip(codes.chunks_exact(2)) {
        *byte = (pair[0] & 0xf) | (pair[1] & 0xf) << 4;
    }
}

/// The inverse of [`pack_nibbles`].
pub fn unpack_nibbles(packed: &[u8], out: &mut [u8]) {
    debug_assert_eq!(out.len(), packed.len() * 2);
    for (pair, byte) in out.chunks_exact_mut(2).zip(packed) {
        pair[0] = byte & 0xf;
        pair[1] = byte >> 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::Overflow;

    #[test]
    fn the_nvfp4_rule_is_round_half_even_on_the_grid() {
        // The generic minifloat reference, saturating, agrees everywhere but -0.0's sign.
        for i in 0..=2800 {
            let x = i as f32 * 0.0025;
            for x in [x, -x] {
                if x == 0.0 {
                    continue;
                }
                assert_eq!(
                    f32_to_e2m1_nvfp4(x),
                    E2M1.encode(x, Overflow::Saturate),
                    "x = {x}"
                );
            }
        }
        assert_eq!(f32_to_e2m1_nvfp4(-0.0), 0);
        assert_eq!(f32_to_e2m1_nvfp4(-0.1), 8);
        assert_eq!(f32_to_e2m1_nvfp4(f32::NAN), 7);
        assert_eq!(f32_to_e2m1_nvfp4(f32::NEG_INFINITY), 0xf);
    }

    #[test]
    fn the_mx_rule_rounds_ties_toward_zero_and_zero_to_0x8() {
        assert_eq!(f32_to_e2m1_mx(0.0), 0x8);
        assert_eq!(f32_to_e2m1_mx(-0.0), 0x8);
        assert_eq!(f32_to_e2m1_mx(0.25), 0x0, "tie toward zero, positive sign");
        assert_eq!(f32_to_e2m1_mx(0.26), 0x1);
        assert_eq!(f32_to_e2m1_mx(5.0), 0x6);
        assert_eq!(f32_to_e2m1_mx(-5.0), 0xe);
        assert_eq!(f32_to_e2m1_mx(-100.0), 0xf);
        assert_eq!(f32_to_e2m1_mx(f32::NAN), 0x8);
    }

    #[test]
    fn nibbles_round_trip_even_element_low() {
        let codes = [0x1, 0xf, 0x8, 0x3];
        let mut packed = [0u8; 2];
        pack_nibbles(&codes, &mut packed);
        assert_eq!(packed, [0xf1, 0x38]);
        let mut back = [0u8; 4];
        unpack_nibbles(&packed, &mut back);
        assert_eq!(back, codes);
        for c in 0..16u8 {
            assert_eq!(e2m1_to_f32(c).abs(), E2M1_VALUES[(c & 7) as usize]);
        }
    }
}
