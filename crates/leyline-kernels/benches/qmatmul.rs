//! Quantized matrix products at the decode shapes of SmolLM2-135M (Q4_1 blocks, Q8_0 head).
//! Throughput is weight bytes read per second; `model_m1` runs one decode token's worth of
//! products (30 layers of q, k, v, o, gate, up, down, then the head) on distinct matrices.

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use leyline_kernels::qmatmul::{GgmlKind, QMatrix};
use leyline_kernels::Tier;
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

/// The tiers above the portable one that this CPU runs.
fn simd_tiers() -> impl Iterator<Item = Tier> {
    Tier::all_available()
        .into_iter()
        .filter(|&t| t != Tier::Portable)
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
    let paths = Tier::all_available();
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
    for p in simd_tiers() {
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

/// `QMATMUL_PROBE=1 cargo bench -p leyline-kernels --bench qmatmul`: best-of-N timings of a
/// decode token's products on 1 and 2 threads (robust to a busy machine), then exit.
/// `QMATMUL_M` lists the activation rows of those (default 1,4,16), `QMATMUL_CACHE_M` those
/// of the cache-resident single-matrix timings (default 1), `QMATMUL_REPS` the repetitions.
fn probe() {
    let mut mats = Vec::new();
    for l in 0..30u64 {
        for (j, (rows, cols)) in [
            (576, 576),
            (192, 576),
            (192, 576),
            (576, 576),
            (1536, 576),
            (1536, 576),
            (576, 1536),
        ]
        .into_iter()
        .enumerate()
        {
            mats.push(random_matrix(
                GgmlKind::Q4_1,
                rows,
                cols,
                l * 10 + j as u64 + 1,
            ));
        }
    }
    mats.push(random_matrix(GgmlKind::Q8_0, 49152, 576, 999));
    let bytes: usize = mats.iter().map(QMatrix::weight_bytes).sum();
    let reps: usize = std::env::var("QMATMUL_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    for threads in [1, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        for p in simd_tiers() {
            let ms: Vec<usize> = std::env::var("QMATMUL_M")
                .ok()
                .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
                .unwrap_or(vec![1, 4, 16]);
            for &m in &ms {
                let xs: Vec<Vec<f32>> = mats.iter().map(|w| activations(m, w.cols())).collect();
                let mut ys: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; m * w.rows()]).collect();
                let (mut best, mut best_head) = (f64::MAX, f64::MAX);
                pool.install(|| {
                    for _ in 0..reps {
                        let t = std::time::Instant::now();
                        let n = mats.len();
                        for ((w, x), y) in mats[..n - 1].iter().zip(&xs).zip(ys.iter_mut()) {
                            w.matmul_with(p, black_box(x), m, y);
                        }
                        let t1 = std::time::Instant::now();
                        mats[n - 1].matmul_with(p, &xs[n - 1], m, &mut ys[n - 1]);
                        let head = t1.elapsed().as_secs_f64();
                        best = best.min(t.elapsed().as_secs_f64());
                        best_head = best_head.min(head);
                    }
                });
                println!(
                    "probe threads={threads} {p:?} m={m}: token {:.2} ms (head {:.2} ms), {:.1} GB/s",
                    best * 1e3,
                    best_head * 1e3,
                    bytes as f64 / best / 1e9
                );
            }
        }
    }
    // One small matrix over and over (cache-resident): the kernels' compute ceiling.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let in_cache_ms: Vec<usize> = std::env::var("QMATMUL_CACHE_M")
        .ok()
        .map(|v| v.split(',').filter_map(|t| t.parse().ok()).collect())
        .unwrap_or(vec![1]);
    for (kind, rows, cols) in [(GgmlKind::Q4_1, 576, 576), (GgmlKind::Q8_0, 1024, 576)] {
        let w = random_matrix(kind, rows, cols, 5);
        for p in simd_tiers() {
            for &m in &in_cache_ms {
                let x = activations(m, cols);
                let mut y = vec![0f32; m * rows];
                let mut best = f64::MAX;
                pool.install(|| {
                    for _ in 0..reps * 10 {
                        let t = std::time::Instant::now();
                        w.matmul_with(p, black_box(&x), m, &mut y);
                        best = best.min(t.elapsed().as_secs_f64());
                    }
                });
                println!(
                    "probe in-cache {kind:?} [{rows},{cols}] {p:?} m={m} 1 thread: {:.1} us, {:.1} GB/s, {:.1} GMAC/s",
                    best * 1e6,
                    w.weight_bytes() as f64 / best / 1e9,
                    (m * rows * cols) as f64 / best / 1e9
                );
            }
        }
    }
    // Plain streaming read of as many bytes, for the memory-bandwidth ceiling.
    let buf: Vec<u64> = (0..bytes as u64 / 8).collect();
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = std::time::Instant::now();
        black_box(buf.iter().fold(0u64, |a, &v| a ^ v));
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "probe memory read 1 thread: {:.1} GB/s",
        bytes as f64 / best / 1e9
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("pool");
    let mut best = f64::MAX;
    pool.install(|| {
        use rayon::prelude::*;
        for _ in 0..reps {
            let t = std::time::Instant::now();
            let chunks = buf.par_chunks(1 << 16);
            black_box(
                chunks
                    .map(|c| c.iter().fold(0u64, |a, &v| a ^ v))
                    .reduce(|| 0, |a, b| a ^ b),
            );
            best = best.min(t.elapsed().as_secs_f64());
        }
    });
    println!(
        "probe memory read 2 threads: {:.1} GB/s",
        bytes as f64 / best / 1e9
    );
}

criterion_group!(benches, shapes, model_m1);

fn main() {
    if std::env::var_os("QMATMUL_PROBE").is_some() {
        probe();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
