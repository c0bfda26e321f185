//! candle's quantized tensors as the kernels' [`QMatrix`]: the one place where a GGUF
//! tensor's dtype meets [`GgmlKind`] (the kernels crate holds no tensors).

use crate::error::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use leyline_kernels::qmatmul::{GgmlKind, QMatrix};

/// The kind of a candle dtype, if [`QMatrix`] supports it.
pub fn ggml_kind(dtype: GgmlDType) -> Option<GgmlKind> {
    Some(match dtype {
        GgmlDType::Q4_0 => GgmlKind::Q4_0,
        GgmlDType::Q4_1 => GgmlKind::Q4_1,
        GgmlDType::Q5_0 => GgmlKind::Q5_0,
        GgmlDType::Q8_0 => GgmlKind::Q8_0,
        GgmlDType::Q4K => GgmlKind::Q4K,
        GgmlDType::Q5K => GgmlKind::Q5K,
        GgmlDType::Q6K => GgmlKind::Q6K,
        _ => return None,
    })
}

/// Repacks a 2-D [`QTensor`] of shape `[rows, cols]` of a kind [`ggml_kind`] knows.
///
/// # Errors
/// Another dtype or rank, or unreadable data.
pub fn qmatrix(t: &QTensor) -> Result<QMatrix> {
    let kind = ggml_kind(t.dtype()).ok_or_else(|| {
        ModelError::Input(format!(
            "quantized matrix: dtype {:?} is not supported (Q4_0, Q4_1, Q5_0, Q8_0, \
             Q4_K, Q5_K, Q6_K)",
            t.dtype()
        ))
    })?;
    let (rows, cols) = t.shape().dims2()?;
    let data = t.data()?;
    Ok(QMatrix::from_ggml(kind, &data, rows, cols)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn every_kind_has_its_dtype_and_others_are_refused() {
        for (dtype, kind) in [
            (GgmlDType::Q4_0, GgmlKind::Q4_0),
            (GgmlDType::Q4_1, GgmlKind::Q4_1),
            (GgmlDType::Q5_0, GgmlKind::Q5_0),
            (GgmlDType::Q8_0, GgmlKind::Q8_0),
            (GgmlDType::Q4K, GgmlKind::Q4K),
            (GgmlDType::Q5K, GgmlKind::Q5K),
            (GgmlDType::Q6K, GgmlKind::Q6K),
        ] {
            assert_eq!(ggml_kind(dtype), Some(kind));
        }
        let t = Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q5_1).unwrap();
        assert!(qmatrix(&q).is_err());
        let q = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
        let m = qmatrix(&q).unwrap();
        assert_eq!((m.kind(), m.rows(), m.cols()), (GgmlKind::Q8_0, 4, 32));
    }
}
