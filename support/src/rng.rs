//! Deterministic data: the same values on every run and every machine.

use fsdp_fusion::DType;

use crate::values::narrow;

/// A small deterministic generator (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    /// `n` values uniform in `[-scale, scale)`.
    pub fn fill(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    /// Mostly values in `[-4, 4)`, with zeros of both signs and tiny magnitudes mixed in: the
    /// edge cases of rounding and of sign handling.
    pub fn mixed(&mut self) -> f32 {
        match self.next_u64() % 16 {
            0 => 0.0,
            1 => -0.0,
            2 => self.uniform() * 5e-31,
            _ => self.uniform() * 4.0,
        }
    }

    /// `n` [`Rng::mixed`] values.
    pub fn mixed_values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.mixed()).collect()
    }

    /// Values in `[-4, 4)`, one in four scaled by 1e8: sums of them depend on their order.
    pub fn wide(&mut self) -> f32 {
        let v = self.uniform() * 4.0;
        if self.next_u64() % 4 == 0 { v * 1e8 } else { v }
    }

    /// `n` [`Rng::wide`] values.
    pub fn wide_values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.wide()).collect()
    }

    /// `n` [`Rng::mixed`] values rounded to `dtype`, as little-endian bytes.
    pub fn mixed_bytes(&mut self, dtype: DType, n: usize) -> Vec<u8> {
        narrow(dtype, &self.mixed_values(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_values_and_others_differ() {
        let a = Rng::new(3).fill(64, 1.0);
        assert_eq!(a, Rng::new(3).fill(64, 1.0));
        assert_ne!(a, Rng::new(4).fill(64, 1.0));
        assert!(a.iter().all(|v| (-1.0..1.0).contains(v)));
    }

    #[test]
    fn mixed_values_hold_both_zeros_and_tiny_magnitudes() {
        let v = Rng::new(1).mixed_values(4096);
        assert!(v.iter().any(|x| *x == 0.0 && x.is_sign_negative()));
        assert!(v.iter().any(|x| *x == 0.0 && x.is_sign_positive()));
        assert!(v.iter().any(|x| *x != 0.0 && x.abs() < 1e-30));
        assert!(v.iter().all(|x| x.abs() <= 4.0));
    }

    #[test]
    fn wide_values_span_magnitudes_that_make_sums_order_dependent() {
        let v = Rng::new(2).wide_values(1024);
        assert!(v.iter().any(|x| x.abs() > 1e6));
        assert!(v.iter().any(|x| x.abs() < 4.0));
        assert!(v.iter().all(|x| x.abs() <= 4e8));
    }
}
