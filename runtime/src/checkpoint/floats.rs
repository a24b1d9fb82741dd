//! The one decoder of little-endian float bytes kiln uses (safetensors' layout): typed values,
//! or values widened to f32 (exact for every dtype here).

use half::{bf16, f16};
use safetensors::Dtype;

/// `bytes` (little-endian, any alignment) as values of `T`; a partial trailing value is
/// dropped.
pub fn decode<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let whole = bytes.len() / std::mem::size_of::<T>() * std::mem::size_of::<T>();
    bytemuck::pod_collect_to_vec(&bytes[..whole])
}

/// F32, BF16 or F16 bytes widened to f32; `None` for other dtypes.
pub fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    match dtype {
        Dtype::F32 => Some(decode::<f32>(bytes)),
        Dtype::BF16 => Some(decode::<bf16>(bytes).into_iter().map(f32::from).collect()),
        Dtype::F16 => Some(decode::<f16>(bytes).into_iter().map(f32::from).collect()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_float_dtype_decodes_from_unaligned_bytes() {
        // 1.5 and −2 in each dtype, after one byte of padding (unaligned on purpose).
        let f32s = [0u8, 0, 0, 0xc0, 0x3f, 0, 0, 0, 0xc0];
        assert_eq!(to_f32(Dtype::F32, &f32s[1..]), Some(vec![1.5, -2.0]));
        let bf16s = [0u8, 0xc0, 0x3f, 0x00, 0xc0];
        assert_eq!(to_f32(Dtype::BF16, &bf16s[1..]), Some(vec![1.5, -2.0]));
        let f16s = [0u8, 0x00, 0x3e, 0x00, 0xc0];
        assert_eq!(to_f32(Dtype::F16, &f16s[1..]), Some(vec![1.5, -2.0]));
        assert_eq!(to_f32(Dtype::I8, &[1, 2]), None);
    }
}
