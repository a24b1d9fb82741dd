//! E8M0: an unsigned power-of-two scale, `2^(byte - 127)`; 0xFF is NaN. Used by MXFP4/MXFP8.
//!
//! The block exponents reproduce ModelOpt's arithmetic, which is *not* the exact
//! `ceil(log2(bmax / max))`: MXFP4 computes in the weight's dtype (a bf16 weight's
//! `log2(amax / 6)` is rounded to bf16 before the ceiling), MXFP8 in f32.

use crate::element::Element;

/// The E8M0 NaN byte.
pub const E8M0_NAN: u8 = 0xff;

/// The byte for `2^k`, `k` clamped to [-127, 127].
pub fn e8m0_from_exponent(k: i32) -> u8 {
    (k.clamp(-127, 127) + 127) as u8
}

/// The scale a byte stands for (`NaN` for 0xFF).
pub fn e8m0_to_f32(byte: u8) -> f32 {
    if byte == E8M0_NAN {
        f32::NAN
    } else {
        2f64.powi(byte as i32 - 127) as f32
    }
}

/// MXFP4's block exponent for a block of `T` whose largest magnitude is `bmax`
/// (ModelOpt `MXFP4QTensor.quantize`, all in `T`):
/// `ceil(maximum(log2(T(bmax / 6)), -127))`. `None` for a NaN block, where ModelOpt's result
/// is undefined (its uint8 cast of NaN); +Inf clamps to 127 likewise.
pub fn mxfp4_exponent<T: Element>(bmax: f32) -> Option<i32> {
    let descale = T::round_f32(bmax / 6.0);
    let l = T::round_f32(log2_f32(descale)); // log2(0) = -inf
    if l.is_nan() {
        return None;
    }
    Some(l.max(-127.0).ceil().min(127.0) as i32)
}

/// MXFP8's block exponent (ModelOpt `MXFP8QTensor._compute_e8m0_exponent`, in f32):
/// `ceil(log2(bmax / 448))` where `bmax / 448 > 0`, else -127 (zero and NaN), clamped to
/// [-127, 127] (+Inf → 127).
pub fn mxfp8_exponent(bmax: f32) -> i32 {
    let descale = bmax / 448.0;
    let l = if descale > 0.0 {
        descale.log2()
    } else {
        -127.0
    };
    l.ceil().clamp(-127.0, 127.0) as i32
}

/// log2 rounded to f32 once: for a normal `x = m · 2^e` (1 ≤ m < 2), `f32(e + log2_f64(m))`
/// (zero, subnormals, Inf and NaN through `f64::log2`). f64's log2 is accurate far beyond f32's
/// precision, so every implementation — CPU, SIMD, CUDA — gets the same value, where libm
/// `log2f`s differ in the last ulp and can move a ceiling. Splitting off `e` lets the fast
/// paths take `log2_f64(m)` from a table for bf16 mantissas ([`log2_mantissa_bf16`]).
#[inline]
pub fn log2_f32(x: f32) -> f32 {
    let bits = x.to_bits();
    let exp_field = (bits >> 23) & 0xff;
    if x <= 0.0 || exp_field == 0 || exp_field == 0xff {
        return f64::from(x).log2() as f32;
    }
    let m = f32::from_bits((bits & 0x7f_ffff) | (127 << 23));
    (f64::from(exp_field as i32 - 127) + f64::from(m).log2()) as f32
}

/// `log2_f64(1 + i/128)` for the 128 mantissas of a bf16 value: the same `f64::log2` calls
/// [`log2_f32`] makes, computed once.
pub fn log2_mantissa_bf16() -> &'static [f64; 128] {
    static TABLE: std::sync::OnceLock<[f64; 128]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|i| f64::from(1.0f32 + i as f32 / 128.0).log2()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn exponents_follow_modelopt_arithmetic() {
        assert_eq!(mxfp4_exponent::<f32>(6.0), Some(0));
        assert_eq!(mxfp4_exponent::<f32>(6.000001), Some(1));
        assert_eq!(mxfp4_exponent::<f32>(3.0), Some(-1));
        assert_eq!(mxfp4_exponent::<f32>(0.0), Some(-127));
        assert_eq!(mxfp4_exponent::<f32>(f32::NAN), None);
        assert_eq!(mxfp4_exponent::<f32>(f32::INFINITY), Some(127));
        // bf16: 6 · 2^20 · (1 + 2^-7) / 6 rounds to bf16 exactly, but its log2 (20.0112…)
        // rounds to 20.0 in bf16, so the ceiling is 20 where the exact one is 21.
        let bmax = bf16::from_f32(6.0 * 2f32.powi(20) * (1.0 + 2f32.powi(-7))).to_f32();
        assert_eq!(mxfp4_exponent::<bf16>(bmax), Some(20));
        assert_eq!(mxfp4_exponent::<f32>(bmax), Some(21));

        assert_eq!(mxfp8_exponent(448.0), 0);
        assert_eq!(mxfp8_exponent(449.0), 1);
        assert_eq!(mxfp8_exponent(0.0), -127);
        assert_eq!(mxfp8_exponent(f32::NAN), -127);
        assert_eq!(mxfp8_exponent(f32::INFINITY), 127);
        assert_eq!(mxfp8_exponent(f32::MAX), 120, "2^128 / 448 ≈ 2^119.2");
        assert_eq!(e8m0_from_exponent(-200), 0);
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert!(e8m0_to_f32(255).is_nan());
    }
}
