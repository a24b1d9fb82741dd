//! E8M0: an unsigned power-of-two scale, `2^(byte - 127)`; 0xFF is NaN. Used by MXFP4/MXFP8.
//!
//! The block exponents reproduce ModelOpt 0.47's arithmetic: `ceil(log2(amax / max))` with
//! the amax in f32 and the logarithm rounded to f32 (so not the exact ceiling when `amax / max`
//! sits within an f32 rounding of a power of two).

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

/// MXFP4's block exponent (ModelOpt 0.47 `MXFP4QTensor.quantize`, in f32: it casts the block
/// to float first): `ceil(maximum(log2(bmax / 6), -127))`. `None` for a NaN block, where
/// ModelOpt's uint8 cast of NaN is undefined; +Inf clamps to 127.
pub fn mxfp4_exponent(bmax: f32) -> Option<i32> {
    let l = log2_f32(bmax / 6.0); // log2(0) = -inf
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
/// `log2f`s differ in the last ulp and can move a ceiling.
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

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn exponents_follow_modelopt_arithmetic() {
        assert_eq!(mxfp4_exponent(6.0), Some(0));
        assert_eq!(mxfp4_exponent(6.000001), Some(1));
        assert_eq!(mxfp4_exponent(3.0), Some(-1));
        assert_eq!(mxfp4_exponent(0.0), Some(-127));
        assert_eq!(mxfp4_exponent(f32::NAN), None);
        assert_eq!(mxfp4_exponent(f32::INFINITY), Some(127));
        // A bf16 block max whose log2(amax / 6) ≈ -6.99: the f32 ceiling is -6 (ModelOpt 0.47;
        // computing in bf16 would round the logarithm to -7.0).
        assert_eq!(mxfp4_exponent(f32::from_bits(0x3d42_0000)), Some(-6)); // bf16 0x3d42 = 0.0473633

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
