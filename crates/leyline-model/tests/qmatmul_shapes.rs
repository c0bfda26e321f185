//! Every kernel path of `QMatrix` at the model's real shapes and every row count a decode
//! or small prefill batch can have (m = 1..=17), against candle's own dequantization (an
//! independent implementation of the GGML formats). Catches tiles that overrun when `m`
//! is not a multiple of the activation tile.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use leyline_model::qmatmul::{KernelPath, QMatrix};

#[test]
fn all_paths_all_row_counts_match_candle() {
    let paths: Vec<KernelPath> = [KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.is_available())
        .collect();
    for (rows, cols) in [
        (192usize, 576usize),
        (576, 576),
        (1536, 576),
        (576, 1536),
        (4099, 576),
    ] {
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
        for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&w, dt).unwrap();
            let qm = QMatrix::from_qtensor(&q).unwrap();
            let wd = q.dequantize(&Device::Cpu).unwrap();
            for m in 1..=17usize {
                let x = Tensor::randn(0f32, 1.0, (m, cols), &Device::Cpu).unwrap();
                let want: Vec<f32> = x
                    .matmul(&wd.t().unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
                for &path in &paths {
                    let mut y = vec![f32::NAN; m * rows];
                    qm.matmul_with(path, &xs, m, &mut y);
                    let d = y
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    // Sums of <= 1536 products of size ~1: f32 reordering error is ~1e-4.
                    assert!(
                        d < 5e-3,
                        "{path:?} {dt:?} [{rows}x{cols}] m={m}: max |diff| {d}"
                    );
                }
            }
        }
    }
}
