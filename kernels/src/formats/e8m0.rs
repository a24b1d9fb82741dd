//! E8M0: an unsigned power-of-two scale, `2^(byte - 127)`; 0xFF is NaN. Used by MXFP4/MXFP8.

/// The byte for `2^k`, `k` clamped to [-127, 127].
pub fn e8m0_from_exponent(k: i32) -> u8 {
    (k.clamp(-127, 127) + 127) as u8
}

/// The scale a byte stands for (`NaN` for 0xFF).
pub fn e8m0_to_f32(byte: u8) -> f32 {
    if byte == 0xff {
        f32::NAN
    } else {
        2f64.powi(byte as i32 - 127) as f32
    }
}

/// MXFP4's block exponent (ModelOpt): `ceil(max(log2(bmax / 6), -127))` for an E2M1 block
/// whose largest magnitude is `bmax` (0 → -127).
pub fn mxfp4_exponent(bmax: f32) -> i32 {
    exponent_ceil(bmax, 6.0)
}

/// MXFP8's block exponent (ModelOpt): `ceil(log2(bmax / 448))` if bmax > 0, else -127,
/// clamped to [-127, 127].
pub fn mxfp8_exponent(bmax: f32) -> i32 {
    exponent_ceil(bmax, 448.0)
}

/// `ceil(log2(bmax / max))` computed exactly from the f64 representation (no `log2` rounding).
fn exponent_ceil(bmax: f32, max: f64) -> i32 {
    if bmax.is_nan() || bmax <= 0.0 {
        return -127;
    }
    let r = f64::from(bmax) / max;
    let bits = r.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i32 - 1023; // r is normal: bmax ≥ 2^-149, max ≤ 448
    let exact_power = bits & ((1u64 << 52) - 1) == 0;
    (if exact_power { e } else { e + 1 }).clamp(-127, 127)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponents_are_exact_ceilings() {
        assert_eq!(mxfp4_exponent(6.0), 0);
        assert_eq!(mxfp4_exponent(6.000001), 1);
        assert_eq!(mxfp4_exponent(3.0), -1);
        assert_eq!(mxfp4_exponent(0.0), -127);
        assert_eq!(mxfp8_exponent(448.0), 0);
        assert_eq!(mxfp8_exponent(449.0), 1);
        assert_eq!(mxfp8_exponent(f32::MAX), 120, "2^128 / 448 ≈ 2^119.2");
        assert_eq!(e8m0_from_exponent(-200), 0);
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert!(e8m0_to_f32(255).is_nan());
    }
}
