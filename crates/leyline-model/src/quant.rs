//! candle's quantized tensors as the kernels' [`QMatrix`]: the one place where a GGUF
//! tensor's dtype meets [`GgmlKind`] (the kernels crate holds no tensors).

use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, StoredTensor};
use candle_core::quantized::{GgmlDType, QTensor};
use leyline_kernels::mem::Arena;
use leyline_kernels::qmatmul::{GgmlKind, QMatrix};
use std::sync::Arc;

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
    let kind = kind_of(t.dtype())?;
    let (rows, cols) = t.shape().dims2()?;
    let data = t.data()?;
    Ok(QMatrix::from_ggml(kind, &data, rows, cols)?)
}

/// Repacks a 2-D tensor `[rows, cols]` straight from the file's bytes, as [`qmatrix`].
///
/// # Errors
/// Another dtype or rank.
pub fn qmatrix_stored(t: &StoredTensor<'_>, arena: Option<&Arc<Arena>>) -> Result<QMatrix> {
    let kind = kind_of(t.dtype)?;
    let (rows, cols) = rows_cols(t)?;
    Ok(QMatrix::from_ggml_in(kind, t.bytes, rows, cols, arena)?)
}

/// `(rows, cols)` of a 2-D stored tensor.
fn rows_cols(t: &StoredTensor<'_>) -> Result<(usize, usize)> {
    match *t.dims.as_slice() {
        [rows, cols] => Ok((rows, cols)),
        _ => Err(ModelError::Input(format!(
            "quantized matrix: {} dimensions {:?}, expected 2",
            t.dims.len(),
            t.dims
        ))),
    }
}

/// The tensor `name` of `f` as a quantized matrix built straight from the file's bytes into
/// the file's arena (one buffer on huge pages for all its matrices), after which the file's
/// pages of it are released ([`GgufFile::release`]); `None` for a type without kernels (the
/// caller reads it as f32).
///
/// # Errors
/// A missing tensor, or one that is not 2-D.
pub fn load_qmatrix(f: &mut GgufFile, name: &str) -> Result<Option<QMatrix>> {
    let arena = f.arena(arena_size);
    let t = f.stored(name)?;
    if ggml_kind(t.dtype).is_none() {
        return Ok(None);
    }
    let q = qmatrix_stored(&t, Some(&arena))?;
    f.release(name);
    Ok(Some(q))
}

/// The table `name` of `f` left in the file's mapping, where the kernels read a K-quant's
/// rows as stored ([`QMatrix::from_stored`]): nothing copied, nothing in anonymous memory.
/// `None` for a type or layout they cannot read in place (the caller builds it instead).
///
/// # Errors
/// A missing tensor, or one that is not 2-D.
pub fn stored_qmatrix(f: &mut GgufFile, name: &str) -> Result<Option<QMatrix>> {
    let map = f.mapping();
    let t = f.stored(name)?;
    let Some(kind) = ggml_kind(t.dtype) else {
        return Ok(None);
    };
    let (rows, cols) = rows_cols(&t)?;
    Ok(QMatrix::from_stored(kind, rows, cols, map, t.start)?)
}

/// Room for every 2-D tensor of `f` that [`load_qmatrix`] may build (shapes the kernels
/// refuse count nothing: they fail at their own load).
fn arena_size(f: &GgufFile) -> usize {
    f.tensor_types()
        .filter_map(|(_, dtype, dims)| match (ggml_kind(dtype), dims) {
            (Some(kind), &[rows, cols]) => QMatrix::stored_len(kind, rows, cols).ok(),
            _ => None,
        })
        .map(|len| len.next_multiple_of(64))
        .sum()
}

fn kind_of(dtype: GgmlDType) -> Result<GgmlKind> {
    ggml_kind(dtype).ok_or_else(|| {
        ModelError::Input(format!(
            "quantized matrix: dtype {dtype:?} is not supported (Q4_0, Q4_1, Q5_0, Q8_0, \
             Q4_K, Q5_K, Q6_K)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file;
    use candle_core::{Device, Tensor};

    /// A matrix read from the mapping into the file's arena equals one repacked from
    /// candle's own reading of the file: the same bytes, the same products.
    #[test]
    fn matrices_from_the_mapping_equal_candles_reading() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        let vals: Vec<f32> = (0..48 * 512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let t = Tensor::from_vec(vals, (48, 512), &Device::Cpu).unwrap();
        let tensors = [
            ("a.weight", QTensor::quantize(&t, GgmlDType::Q4K).unwrap()),
            ("b.weight", QTensor::quantize(&t, GgmlDType::Q6K).unwrap()),
            ("c.weight", QTensor::quantize(&t, GgmlDType::F32).unwrap()),
        ];
        let mut out = std::fs::File::create(&path).unwrap();
        let named: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, q)| (*n, q)).collect();
        gguf_file::write(&mut out, &[], &named).unwrap();
        drop(out);

        let mut f = GgufFile::open(&path).unwrap();
        for (name, q) in &tensors[..2] {
            let want = qmatrix(q).unwrap();
            // Left in the mapping, its rows read back as the repacked matrix's.
            let kept = stored_qmatrix(&mut f, name)
                .unwrap()
                .expect("a K-quant, slack after");
            let (mut a, mut b) = (vec![0f32; 3 * 512], vec![1f32; 3 * 512]);
            want.dequantize_rows(40, &mut a);
            kept.dequantize_rows(40, &mut b);
            assert_eq!(a, b, "{name} kept as stored");
            let stored = f.stored(name).unwrap();
            assert_eq!(stored.dims, [48, 512]);
            assert_eq!(stored.bytes, &*q.data().unwrap());
            let got = load_qmatrix(&mut f, name)
                .unwrap()
                .expect("a kind with kernels");
            // Released pages read back from the file.
            assert_eq!(f.stored(name).unwrap().bytes, &*q.data().unwrap());
            let x: Vec<f32> = (0..3 * 512).map(|i| (i % 17) as f32 / 8.0 - 1.0).collect();
            let (mut a, mut b) = (vec![0f32; 3 * 48], vec![1f32; 3 * 48]);
            let tier = leyline_kernels::Tier::best();
            want.matmul_with(tier, &x, 3, &mut a);
            got.matmul_with(tier, &x, 3, &mut b);
            assert_eq!(a, b, "{name}");
        }
        assert!(load_qmatrix(&mut f, "c.weight").unwrap().is_none());
        assert!(stored_qmatrix(&mut f, "c.weight").unwrap().is_none());
        assert!(load_qmatrix(&mut f, "d.weight").is_err());
        f.ensure_all_taken("test").unwrap();
    }

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
