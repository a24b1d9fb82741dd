//! A generic, readable reference for small binary floating-point formats (≤ 8 bits):
//! round to nearest, ties to even, computed exactly in f64.
//!
//! Formats differ only in their field widths and in how they spell Inf and NaN; everything
//! else — subnormals, the carry from mantissa into exponent, overflow — follows from the grid.

use super::Overflow;

/// How a format spells the special values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Specials {
    /// IEEE-like: the top exponent holds Inf (mantissa 0) and NaN (the given mantissa).
    Ieee {
        /// The mantissa bits of the canonical NaN.
        nan_mantissa: u8,
    },
    /// "fn" formats (E4M3FN): no Inf; only all-ones exponent and mantissa is NaN.
    FiniteNanAllOnes,
    /// No Inf, no NaN (E2M1).
    FiniteOnly,
}

/// A sign bit, `exp_bits` exponent bits with `bias`, `man_bits` mantissa bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MiniFloat {
    /// Exponent field width.
    pub exp_bits: u32,
    /// Mantissa field width.
    pub man_bits: u32,
    /// Exponent bias.
    pub bias: i32,
    /// How Inf and NaN are spelled.
    pub specials: Specials,
}

impl MiniFloat {
    fn sign_bit(&self) -> u8 {
        1 << (self.exp_bits + self.man_bits)
    }

    fn exp_max_field(&self) -> u32 {
        (1 << self.exp_bits) - 1
    }

    /// The largest finite value.
    pub fn max_finite(&self) -> f64 {
        let (e, m) = self.max_fields();
        2f64.powi(e as i32 - self.bias) * (1.0 + m as f64 / 2f64.powi(self.man_bits as i32))
    }

    /// The exponent and mantissa fields of the largest finite value.
    fn max_fields(&self) -> (u32, u32) {
        let all = (1 << self.man_bits) - 1;
        match self.specials {
            Specials::Ieee { .. } => (self.exp_max_field() - 1, all),
            Specials::FiniteNanAllOnes => (self.exp_max_field(), all - 1),
            Specials::FiniteOnly => (self.exp_max_field(), all),
        }
    }

    fn max_code(&self) -> u8 {
        let (e, m) = self.max_fields();
        ((e << self.man_bits) | m) as u8
    }

    fn nan_code(&self) -> Option<u8> {
        let top = self.exp_max_field() << self.man_bits;
        match self.specials {
            Specials::Ieee { nan_mantissa } => Some((top | nan_mantissa as u32) as u8),
            Specials::FiniteNanAllOnes => Some((top | ((1 << self.man_bits) - 1)) as u8),
            Specials::FiniteOnly => None,
        }
    }

    fn inf_code(&self) -> Option<u8> {
        match self.specials {
            Specials::Ieee { .. } => Some((self.exp_max_field() << self.man_bits) as u8),
            _ => None,
        }
    }

    /// Encodes `x`: round to nearest even, the sign of `x` kept (also for zero and NaN).
    /// A format without NaN maps NaN to its largest magnitude (documented per format).
    pub fn encode(&self, x: f32, overflow: Overflow) -> u8 {
        let sign = if x.is_sign_negative() {
            self.sign_bit()
        } else {
            0
        };
        if x.is_nan() {
            return sign | self.nan_code().unwrap_or_else(|| self.max_code());
        }
        let a = f64::from(x.abs());
        let overflowed = sign
            | match (overflow, self.inf_code(), self.nan_code()) {
                (Overflow::Saturate, _, _) => self.max_code(),
                (Overflow::NonSaturating, Some(inf), _) => inf,
                (Overflow::NonSaturating, None, Some(nan)) => nan,
                (Overflow::NonSaturating, None, None) => self.max_code(),
            };
        if a.is_infinite() {
            return overflowed;
        }
        if a == 0.0 {
            return sign;
        }
        let emin = 1 - self.bias; // the smallest normal exponent
        let e = exponent_of(a).max(emin);
        let ulp = 2f64.powi(e - self.man_bits as i32);
        let v = round_half_even(a / ulp) * ulp; // exact: a/ulp is a power-of-two scaling
        if v > self.max_finite() {
            return overflowed;
        }
        if v == 0.0 {
            return sign;
        }
        let ev = exponent_of(v); // may be e + 1 after a carry
        let fields = if ev < emin {
            (v / 2f64.powi(emin - self.man_bits as i32)) as u32 // subnormal: exponent field 0
        } else {
            let man = v / 2f64.powi(ev - self.man_bits as i32) - 2f64.powi(self.man_bits as i32);
            (((ev + self.bias) as u32) << self.man_bits) | man as u32
        };
        sign | fields as u8
    }

    /// Decodes a code (bits above the format's width are ignored).
    pub fn decode(&self, code: u8) -> f32 {
        let width = 1 + self.exp_bits + self.man_bits;
        let code = (code as u32) & ((1 << width) - 1);
        let negative = code & (self.sign_bit() as u32) != 0;
        let e = (code >> self.man_bits) & self.exp_max_field();
        let m = code & ((1 << self.man_bits) - 1);
        let magnitude = if Some((code & !(self.sign_bit() as u32)) as u8) == self.nan_code() {
            f64::NAN
        } else if Some((code & !(self.sign_bit() as u32)) as u8) == self.inf_code() {
            f64::INFINITY
        } else if matches!(self.specials, Specials::Ieee { .. }) && e == self.exp_max_field() {
            f64::NAN // every other all-ones-exponent pattern of an IEEE-like format
        } else if e == 0 {
            m as f64 * 2f64.powi(1 - self.bias - self.man_bits as i32)
        } else {
            (1.0 + m as f64 / 2f64.powi(self.man_bits as i32)) * 2f64.powi(e as i32 - self.bias)
        };
        let v = magnitude as f32;
        if negative { -v } else { v }
    }
}

/// floor(log2(a)) for a finite a > 0, exactly (from the f64 bits; a is never subnormal in f64
/// because it comes from an f32).
fn exponent_of(a: f64) -> i32 {
    ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023
}

/// Rounds to the nearest integer, ties to even.
pub fn round_half_even(x: f64) -> f64 {
    let r = x.round(); // ties away from zero
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_half_even_on_ties_and_non_ties() {
        for (x, r) in [
            (0.5, 0.0),
            (1.5, 2.0),
            (2.5, 2.0),
            (-2.5, -2.0),
            (2.4, 2.0),
            (2.6, 3.0),
            (3.0, 3.0),
        ] {
            assert_eq!(round_half_even(x), r, "{x}");
        }
    }
}
