//! Element types of parameters and gradients.

use half::{bf16, f16};

use crate::types::DType;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A host element type the crate reads and writes: `f32`, `half::bf16` or `half::f16`.
pub trait Element: bytemuck::Pod + sealed::Sealed + Send + Sync {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    /// Rounds to nearest, ties to even.
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(value: f32) -> Self {
        value
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        bf16::from_f32(value)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    fn from_f32(value: f32) -> Self {
        f16::from_f32(value)
    }
}

/// Reads element `index` of a little-endian byte slice of `dtype` as f32.
pub(crate) fn load_f32(bytes: &[u8], dtype: DType, index: usize) -> f32 {
    let at = index * dtype.size();
    match dtype {
        DType::F32 => f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]),
        DType::Bf16 => bf16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32(),
        DType::F16 => f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32(),
    }
}

/// Writes `value` rounded to `dtype` as element `index` of a little-endian byte slice.
pub(crate) fn store_f32(bytes: &mut [u8], dtype: DType, index: usize, value: f32) {
    let at = index * dtype.size();
    match dtype {
        DType::F32 => bytes[at..at + 4].copy_from_slice(&value.to_le_bytes()),
        DType::Bf16 => bytes[at..at + 2].copy_from_slice(&bf16::from_f32(value).to_le_bytes()),
        DType::F16 => bytes[at..at + 2].copy_from_slice(&f16::from_f32(value).to_le_bytes()),
    }
}

/// `dst` = `src` converted between their dtypes, element by element through f32 (exact for
/// every pair but the narrowing ones, which round as the `half` crate does); `dst` holds as many
/// elements of its dtype as `src` of its own.
pub(crate) fn convert((dst, dst_dtype): (&mut [u8], DType), (src, src_dtype): (&[u8], DType)) {
    for i in 0..dst.len() / dst_dtype.size() {
        store_f32(dst, dst_dtype, i, load_f32(src, src_dtype, i));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_fail() {
        for d in [DType::Bf16, DType::F16, DType::F32] {
            assert_eq!(DType::parse(d.name()), Some(d));
        }
        assert_eq!(DType::parse("fp8"), None);
        assert_eq!(DType::parse("F32"), None);
    }

    #[test]
    fn byte_access_rounds_to_the_dtype() {
        let mut bytes = vec![0u8; 8];
        store_f32(&mut bytes, DType::Bf16, 1, 1.0 + 1.0 / 512.0);
        // 1 + 2^-9 is a tie between 1 and 1 + 2^-7 in bf16: it rounds to even, 1.0.
        assert_eq!(load_f32(&bytes, DType::Bf16, 1), 1.0);
        store_f32(&mut bytes, DType::F32, 1, -2.5);
        assert_eq!(load_f32(&bytes, DType::F32, 1), -2.5);
        store_f32(&mut bytes, DType::F16, 0, 0.333_333);
        assert_eq!(
            load_f32(&bytes, DType::F16, 0),
            f16::from_f32(0.333_333).to_f32()
        );
    }
}
