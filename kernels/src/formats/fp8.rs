//! FP8: E4M3FN (max 448, no Inf, NaN = S.1111.111) and E5M2 (IEEE-like, max 57344).

use super::Overflow;
use super::minifloat::{MiniFloat, Specials};

/// OCP / PyTorch `float8_e4m3fn`.
pub const E4M3FN: MiniFloat = MiniFloat {
    exp_bits: 4,
    man_bits: 3,
    bias: 7,
    specials: Specials::FiniteNanAllOnes,
};

/// OCP / PyTorch `float8_e5m2` (NaN written as S.11111.10, as ml_dtypes and PyTorch do).
pub const E5M2: MiniFloat = MiniFloat {
    exp_bits: 5,
    man_bits: 2,
    bias: 15,
    specials: Specials::Ieee { nan_mantissa: 2 },
};

/// The largest finite E4M3FN value.
pub const E4M3_MAX: f32 = 448.0;

/// The largest finite E5M2 value.
pub const E5M2_MAX: f32 = 57344.0;

/// f32 → E4M3FN, round to nearest even. Non-saturating: |x| > 464 (which rounds past 448)
/// and ±Inf become NaN, as PyTorch and ml_dtypes do; saturating clamps them to ±448.
pub fn f32_to_e4m3(x: f32, overflow: Overflow) -> u8 {
    E4M3FN.encode(x, overflow)
}

/// E4M3FN → f32 (exact).
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3FN.decode(code)
}

/// f32 → E5M2, round to nearest even. Non-saturating: overflow becomes ±Inf.
pub fn f32_to_e5m2(x: f32, overflow: Overflow) -> u8 {
    E5M2.encode(x, overflow)
}

/// E5M2 → f32 (exact).
pub fn e5m2_to_f32(code: u8) -> f32 {
    E5M2.decode(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_limits_and_the_464_tie() {
        assert_eq!(E4M3FN.max_finite(), 448.0);
        assert_eq!(f32_to_e4m3(448.0, Overflow::NonSaturating), 0x7e);
        assert_eq!(
            f32_to_e4m3(464.0, Overflow::NonSaturating),
            0x7e,
            "tie rounds to even 448"
        );
        assert_eq!(
            f32_to_e4m3(464.5, Overflow::NonSaturating),
            0x7f,
            "rounds to 480: NaN"
        );
        assert_eq!(f32_to_e4m3(-1e9, Overflow::Saturate), 0xfe);
        assert_eq!(f32_to_e4m3(f32::INFINITY, Overflow::NonSaturating), 0x7f);
        assert_eq!(
            f32_to_e4m3(2f32.powi(-9), Overflow::NonSaturating),
            0x01,
            "smallest subnormal"
        );
        assert_eq!(
            f32_to_e4m3(2f32.powi(-10), Overflow::NonSaturating),
            0x00,
            "tie to even zero"
        );
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6), "smallest normal");
    }

    #[test]
    fn e5m2_limits() {
        assert_eq!(E5M2.max_finite(), 57344.0);
        assert_eq!(f32_to_e5m2(1e9, Overflow::NonSaturating), 0x7c);
        assert_eq!(f32_to_e5m2(-1e9, Overflow::Saturate), 0xfb);
        assert_eq!(f32_to_e5m2(f32::NAN, Overflow::NonSaturating), 0x7e);
        assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
    }
}
