//! Every kernel tier of `QMatrix` at the model's real shapes and every row count a decode
//! or small prefill batch can have (m = 1..=17), against candle's own dequantization (an
//! independent implementation of the GGML formats). Catches tiles that overrun when `m`
//! is not a multiple of the activation tile.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use leyline_kernels::qmatmul::{GgmlKind, QMatrix};
use leyline_kernels::Tier;
use leyline_model::quant::qmatrix;

#[test]
fn all_tiers_all_row_counts_match_candle() {
    Tier::note_lacking();
    let tiers = Tier::all_available();
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
            let qm = qmatrix(&q).unwrap();
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
                for &tier in &tiers {
                    let mut y = vec![f32::NAN; m * rows];
                    qm.matmul_with(tier, &xs, m, &mut y);
                    let d = y
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    // Sums of <= 1536 products of size ~1: f32 reordering error is ~1e-4.
                    assert!(
                        d < 5e-3,
                        "{tier} {dt:?} [{rows}x{cols}] m={m}: max |diff| {d}"
                    );
                }
            }
        }
    }
}

/// `matmul_concat` (several matrices, one pool region, rows split across threads) against
/// candle on the dequantized weights, for pools of 1-3 threads and odd row counts that do
/// not split evenly.
#[test]
fn matmul_concat_splits_rows_across_threads_correctly() {
    use leyline_kernels::pool::SpinPool;
    let shapes = [(192usize, 576usize), (4099, 576), (13, 64)];
    let mats: Vec<(QMatrix, Tensor)> = shapes
        .iter()
        .zip([GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4_1])
        .map(|(&(r, c), dt)| {
            let w = Tensor::randn(0f32, 1.0, (r, c), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, dt).unwrap();
            (qmatrix(&q).unwrap(), q.dequantize(&Device::Cpu).unwrap())
        })
        .collect();
    for threads in 1..=3 {
        let pool = SpinPool::new(threads);
        for m in [1usize, 2, 5, 16] {
            // The first two share an input width; the third runs alone.
            let x = Tensor::randn(0f32, 1.0, (m, 576), &Device::Cpu).unwrap();
            let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let mut y01 = vec![f32::NAN; m * (192 + 4099)];
            QMatrix::matmul_concat(&pool, &xs, m, &[&mats[0].0, &mats[1].0], &mut y01);
            let (y0, y1): (Vec<f32>, Vec<f32>) = (
                y01.chunks_exact(192 + 4099)
                    .flat_map(|r| r[..192].to_vec())
                    .collect(),
                y01.chunks_exact(192 + 4099)
                    .flat_map(|r| r[192..].to_vec())
                    .collect(),
            );
            let x2 = Tensor::randn(0f32, 1.0, (m, 64), &Device::Cpu).unwrap();
            let xs2: Vec<f32> = x2.flatten_all().unwrap().to_vec1().unwrap();
            let mut y2 = vec![f32::NAN; m * 13];
            QMatrix::matmul_concat(&pool, &xs2, m, &[&mats[2].0], &mut y2);
            // The products read the activations as the products with these kinds (Q4_1,
            // Q8_0: blocks of 32) round them.
            let read = |t: &Tensor, cols: usize| {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                let r = leyline_kernels::qmatmul::activations_as_read(GgmlKind::Q8_0, &v, cols);
                Tensor::from_vec(r, (m, cols), &Device::Cpu).unwrap()
            };
            let (x, x2) = (read(&x, 576), read(&x2, 64));
            for (got, (input, wd)) in [
                (&y0, (&x, &mats[0].1)),
                (&y1, (&x, &mats[1].1)),
                (&y2, (&x2, &mats[2].1)),
            ] {
                let want: Vec<f32> = input
                    .matmul(&wd.t().unwrap())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let d = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d < 5e-3, "threads={threads} m={m}: max |diff| {d}");
            }
        }
    }
}
