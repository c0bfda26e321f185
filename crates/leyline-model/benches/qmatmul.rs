//! Quantized matrix products at the decode shapes of SmolLM2-135M (Q4_1 blocks, Q8_0 head).
//! Throughput is weight bytes read per second; `model_m1` runs one decode token's worth of
//! products (30 layers of q, k, v, o, gate, up, down, then the head) on distinct matrices.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use leyline_model::qmatmul::{GgmlKind, KernelPath, QMatrix};
use std::hint::black_box;
use std::time::Duration;

/// Random but valid GGML bytes (small finite f16 scales), from a seeded xorshift.
fn random_matrix(kind: GgmlKind, rows: usize, cols: usize, seed: u64) -> QMatrix {
    let mut s = seed | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let nblocks = rows * cols / 32;
    let mut raw = Vec::with_capacity(nblocks * kind.block_bytes());
    for _ in 0..nblocks {
        let d = half::f16::from_f32(((next() % 1000) as f32 - 500.0) * 1e-4);
        raw.extend_from_slice(&d.to_bits().to_le_bytes());
        if kind == GgmlKind::Q4_1 {
            let m = half::f16::from_f32(((next() % 1000) as f32 - 500.0) * 1e-3);
            raw.extend_from_slice(&m.to_bits().to_le_bytes());
        }
        let qbytes = kind.block_bytes() - if kind == GgmlKind::Q4_1 { 4 } else { 2 };
        raw.extend((0..qbytes).map(|_| next() as u8));
    }
    QMatrix::from_ggml(kind, &raw, rows, cols).expect("valid bytes")
}

fn activations(m: usize, cols: usize) -> Vec<f32> {
    (0..m * cols)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3)
        .collect()
}

fn shapes(c: &mut Criterion) {
    let cases = [
        ("q4_1 576->576", GgmlKind::Q4_1, 576, 576),
        ("q4_1 576->192", GgmlKind::Q4_1, 192, 576),
        ("q4_1 576->1536", GgmlKind::Q4_1, 1536, 576),
        ("q4_1 1536->576", GgmlKind::Q4_1, 576, 1536),
        ("q8_0 576->49152", GgmlKind::Q8_0, 49152, 576),
    ];
    let paths: Vec<KernelPath> = [KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.is_available())
        .collect();
    let mut g = c.benchmark_group("qmatmul");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    for (name, kind, rows, cols) in cases {
        let w = random_matrix(kind, rows, cols, 42);
        g.throughput(Throughput::Bytes(w.weight_bytes() as u64));
        for m in [1, 4, 16] {
            let x = activations(m, cols);
            let mut y = vec![0f32; m * rows];
            for &p in &paths {
                g.bench_with_input(BenchmarkId::new(format!("{name} {p:?}"), m), &m, |b, &m| {
                    b.iter(|| w.matmul_with(p, black_box(&x), m, &mut y))
                });
            }
        }
    }
    g.finish();
}

fn model_m1(c: &mut Criterion) {
    const LAYERS: usize = 30;
    let mut mats = Vec::new();
    let mut seed = 1;
    for _ in 0..LAYERS {
        for (rows, cols) in [
            (576, 576),
            (192, 576),
            (192, 576),
            (576, 576),
            (1536, 576),
            (1536, 576),
            (576, 1536),
        ] {
            seed += 1;
            mats.push(random_matrix(GgmlKind::Q4_1, rows, cols, seed));
        }
    }
    mats.push(random_matrix(GgmlKind::Q8_0, 49152, 576, 999));
    let bytes: usize = mats.iter().map(QMatrix::weight_bytes).sum();
    let xs: Vec<Vec<f32>> = mats.iter().map(|w| activations(1, w.cols())).collect();
    let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; w.rows()]).collect();
    let mut g = c.benchmark_group("model");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    g.throughput(Throughput::Bytes(bytes as u64));
    for p in [KernelPath::Avx2, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.is_available())
    {
        g.bench_function(format!("decode token m=1 {p:?}"), |b| {
            b.iter(|| {
                for ((w, x), y) in mats.iter().zip(&xs).zip(ys.iter_mut()) {
                    w.matmul_with(p, black_box(x), 1, y);
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, shapes, model_m1);
criterion_main!(benches);
