//! Values as the engine stores them: little-endian bytes of a dtype, and comparisons of f32 sets.

use fsdp_fusion::DType;
use half::{bf16, f16};

/// Narrows f32 values to little-endian bytes of `dtype`, rounding to nearest, ties to even.
pub fn narrow(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => bytemuck::cast_slice(values).to_vec(),
        DType::Bf16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// Widens little-endian bytes of `dtype` to f32; a trailing partial element is ignored.
pub fn widen(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

/// Round-trips f32 values through `dtype`.
pub fn round_to(dtype: DType, values: &[f32]) -> Vec<f32> {
    widen(dtype, &narrow(dtype, values))
}

/// The largest difference between two sets of values, relative to the largest magnitude of the
/// reference's parameter: `max_i |a_i - b_i| / max_i |b_i|`, maximised over parameters; infinite
/// where one side is NaN and the other not.
pub fn max_relative_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(a, b)| {
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| {
                if x.is_nan() != y.is_nan() {
                    f32::INFINITY
                } else {
                    m.max((x - y).abs())
                }
            });
            if scale > 0.0 { diff / scale } else { diff }
        })
        .fold(0f32, f32::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_rounds_to_even_and_widening_inverts_it() {
        // 1 + 2^-9 is a tie between 1 and 1 + 2^-7 in bf16: it rounds to even, 1.0.
        assert_eq!(round_to(DType::Bf16, &[1.0 + 1.0 / 512.0]), [1.0]);
        let v = [-2.5f32, 0.333_333, 7.0];
        assert_eq!(round_to(DType::F32, &v), v);
        assert_eq!(narrow(DType::F16, &v).len(), 6);
        assert_eq!(
            round_to(DType::F16, &v)[1],
            f16::from_f32(0.333_333).to_f32()
        );
    }

    #[test]
    fn relative_difference_scales_by_the_reference_and_flags_nan() {
        let a = vec![vec![1.0, 2.5], vec![0.0]];
        let b = vec![vec![1.0, 2.0], vec![0.0]];
        assert_eq!(max_relative_difference(&a, &b), 0.25);
        assert_eq!(max_relative_difference(&b, &b), 0.0);
        let nan = vec![vec![f32::NAN, 2.0], vec![0.0]];
        assert_eq!(max_relative_difference(&nan, &b), f32::INFINITY);
    }
}
