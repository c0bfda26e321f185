use super::format::Bytes;
use super::*;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;

/// splitmix64: a small seeded generator for test data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random GGML bytes of a `[rows, cols]` matrix.
fn random_ggml(kind: GgmlKind, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let mut raw = Vec::with_capacity(rows * cols / 32 * kind.block_bytes());
    for _ in 0..rows * cols / 32 {
        let d = f16::from_f32(rng.unit() * 0.05);
        raw.extend_from_slice(&d.to_bits().to_le_bytes());
        match kind {
            GgmlKind::Q4_1 => {
                let m = f16::from_f32(rng.unit() * 0.4);
                raw.extend_from_slice(&m.to_bits().to_le_bytes());
                raw.extend((0..16).map(|_| rng.next() as u8));
            }
            GgmlKind::Q8_0 => raw.extend((0..32).map(|_| rng.next() as u8)),
        }
    }
    raw
}

/// Dequantizes GGML bytes straight from the format description, in f64.
fn dequant_ref(kind: GgmlKind, raw: &[u8]) -> Vec<f64> {
    let mut w = Vec::new();
    for blk in raw.chunks_exact(kind.block_bytes()) {
        let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
        match kind {
            GgmlKind::Q4_1 => {
                let m = f16::from_bits(u16::from_le_bytes([blk[2], blk[3]])).to_f64();
                let mut vals = [0f64; 32];
                for j in 0..16 {
                    vals[j] = d * f64::from(blk[4 + j] & 0x0f) + m;
                    vals[j + 16] = d * f64::from(blk[4 + j] >> 4) + m;
                }
                w.extend_from_slice(&vals);
            }
            GgmlKind::Q8_0 => w.extend(blk[2..34].iter().map(|&q| d * f64::from(q as i8))),
        }
    }
    w
}

/// Checks `y` against `x W^T` in f64: |y - ref| <= gamma(cols + 2) * sum |w x|, the
/// classic bound for f32 sums of products in any order (u = 2^-24), plus a tiny floor.
fn check(w: &[f64], rows: usize, cols: usize, x: &[f32], m: usize, y: &[f32], what: &str) {
    let u = f64::powi(2.0, -24);
    let n = (cols + 2) as f64;
    let gamma = n * u / (1.0 - n * u);
    for i in 0..m {
        for r in 0..rows {
            let (mut s, mut a) = (0f64, 0f64);
            for c in 0..cols {
                let p = w[r * cols + c] * f64::from(x[i * cols + c]);
                s += p;
                a += p.abs();
            }
            let got = f64::from(y[i * rows + r]);
            let err = (got - s).abs();
            assert!(
                err <= gamma * a + 1e-30,
                "{what}: y[{i},{r}] = {got}, reference {s}, error {err} > {}",
                gamma * a
            );
        }
    }
}

fn paths() -> Vec<KernelPath> {
    [KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.is_available())
        .collect()
}

#[test]
fn every_path_matches_the_f64_reference() {
    let mut rng = Rng(7);
    let shapes = [(192, 576), (1000, 576), (37, 1536), (64, 32), (5, 2080)];
    for kind in [GgmlKind::Q4_1, GgmlKind::Q8_0] {
        for &(rows, cols) in &shapes {
            let raw = random_ggml(kind, rows, cols, &mut rng);
            let qm = QMatrix::from_ggml(kind, &raw, rows, cols).unwrap();
            let w = dequant_ref(kind, &raw);
            for m in [1, 3, 6, 9, 16, 24, 33, 70] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
                for path in paths() {
                    let mut y = vec![f32::NAN; m * rows];
                    qm.matmul_with(path, &x, m, &mut y);
                    check(
                        &w,
                        rows,
                        cols,
                        &x,
                        m,
                        &y,
                        &format!("{kind:?} {path:?} [{rows},{cols}] m={m}"),
                    );
                }
            }
        }
    }
}

#[test]
fn matrices_on_shared_pages_keep_their_products() {
    let mut rng = Rng(13);
    // Byte sizes that are not multiples of a cache line, so every start is rounded.
    let specs = [
        (GgmlKind::Q4_1, 37, 1536),
        (GgmlKind::Q8_0, 5, 2080),
        (GgmlKind::Q4_1, 64, 32),
        (GgmlKind::Q8_0, 192, 576),
    ];
    let mut mats = Vec::new();
    let mut refs = Vec::new();
    for &(kind, rows, cols) in &specs {
        let raw = random_ggml(kind, rows, cols, &mut rng);
        mats.push(QMatrix::from_ggml(kind, &raw, rows, cols).unwrap());
        refs.push(dequant_ref(kind, &raw));
    }
    let kept = mats.clone();
    QMatrix::share_pages(mats.iter_mut());
    // One buffer, in the order given, no overlaps.
    for pair in mats.windows(2) {
        let end = pair[0].data.as_ptr() as usize + pair[0].data.len();
        assert!(end <= pair[1].data.as_ptr() as usize);
        assert!(pair[1].data.as_ptr() as usize - end < 64);
    }
    for ((qm, w), old) in mats.iter().zip(&refs).zip(&kept) {
        assert!(matches!(qm.data, Bytes::Shared { .. }));
        assert_eq!(&*qm.data, &*old.data);
        let (rows, cols) = (qm.rows(), qm.cols());
        for m in [1, 6] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
            for path in paths() {
                let mut y = vec![f32::NAN; m * rows];
                qm.matmul_with(path, &x, m, &mut y);
                check(
                    w,
                    rows,
                    cols,
                    &x,
                    m,
                    &y,
                    &format!("shared {path:?} [{rows},{cols}]"),
                );
            }
            let mut y = vec![f32::NAN; m * rows];
            QMatrix::matmul_concat(SpinPool::global(), &x, m, &[qm], &mut y);
            check(
                w,
                rows,
                cols,
                &x,
                m,
                &y,
                &format!("shared, concat [{rows},{cols}]"),
            );
        }
    }
}

#[test]
fn concatenated_products_match_the_reference_at_every_row_count() {
    // One activation layout (transposed once per call for the broadcast tiles) feeds
    // every matrix and thread; three threads split the columns unevenly.
    let mut rng = Rng(17);
    let cols = 320;
    let specs = [
        (GgmlKind::Q4_1, 72),
        (GgmlKind::Q8_0, 40),
        (GgmlKind::Q4_1, 8),
    ];
    let mut mats = Vec::new();
    let mut refs = Vec::new();
    for &(kind, rows) in &specs {
        let raw = random_ggml(kind, rows, cols, &mut rng);
        mats.push(QMatrix::from_ggml(kind, &raw, rows, cols).unwrap());
        refs.push(dequant_ref(kind, &raw));
    }
    let width: usize = mats.iter().map(QMatrix::rows).sum();
    let pools = [SpinPool::new(1), SpinPool::new(3)];
    for pool in &pools {
        for m in [1, 6, 13, 16, 24, 32, 33, 47, 70, 96] {
            let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
            let mut y = vec![f32::NAN; m * width];
            let refs_of: Vec<&QMatrix> = mats.iter().collect();
            QMatrix::matmul_concat(pool, &x, m, &refs_of, &mut y);
            let mut col = 0;
            for (qm, w) in mats.iter().zip(&refs) {
                let rows = qm.rows();
                let part: Vec<f32> = (0..m)
                    .flat_map(|i| y[i * width + col..i * width + col + rows].to_vec())
                    .collect();
                let what = format!("concat, {} threads, m={m}, rows {rows}", pool.threads());
                check(w, rows, cols, &x, m, &part, &what);
                col += rows;
            }
        }
    }
}

#[test]
fn byte_layout_matches_candle() {
    let mut rng = Rng(11);
    let (rows, cols) = (48, 576);
    let data: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
    let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
    for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let q = QTensor::quantize(&t, dt).unwrap();
        let w: Vec<f64> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        let qm = QMatrix::from_qtensor(&q).unwrap();
        assert_eq!((qm.rows(), qm.cols()), (rows, cols));
        let m = 3;
        let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
        for path in paths() {
            let mut y = vec![0f32; m * rows];
            qm.matmul_with(path, &x, m, &mut y);
            check(
                &w,
                rows,
                cols,
                &x,
                m,
                &y,
                &format!("candle {dt:?} {path:?}"),
            );
        }
    }
}

#[test]
fn rejects_bad_shapes() {
    assert!(QMatrix::from_ggml(GgmlKind::Q4_1, &[0; 20], 1, 16).is_err());
    assert!(QMatrix::from_ggml(GgmlKind::Q4_1, &[0; 21], 1, 32).is_err());
    assert!(QMatrix::from_ggml(GgmlKind::Q8_0, &[0; 34 * 2], 2, 32).is_ok());
    let t = Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::Q4_0).unwrap();
    assert!(QMatrix::from_qtensor(&q).is_err());
}
