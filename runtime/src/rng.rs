//! The one seeded generator kiln uses (the demo model's weights, LoRA initialisation and
//! dropout, sampling, the data order): SplitMix64, small and well known; runs repeat exactly
//! from a seed. Not for anything that needs cryptographic or statistical quality.

/// A SplitMix64 stream; the state is public so runs can save and resume it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in `[0, 1)` from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A uniform value in `[0, 1)` from the top 24 bits (exact in f32).
    pub fn uniform_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// A value below `n` (`next_u64() % n`; `n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference sequence of SplitMix64 from seed 1234567 (Vigna's `splitmix64.c`).
    #[test]
    fn the_stream_is_splitmix64() {
        let mut r = SplitMix64(1234567);
        let want = [
            6457827717110365317u64,
            3203168211198807973,
            9817491932198370423,
            4593380528125082431,
            16408922859458223821,
        ];
        for w in want {
            assert_eq!(r.next_u64(), w);
        }
        let mut r = SplitMix64(0);
        let u = r.uniform();
        assert!((0.0..1.0).contains(&u));
        assert_eq!(
            SplitMix64(0).uniform_f32(),
            (SplitMix64(0).next_u64() >> 40) as f32 / 16777216.0
        );
    }
}
