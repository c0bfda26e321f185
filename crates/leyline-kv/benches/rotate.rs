//! Rotation throughput against a plain in-place read-modify-write and a memcpy of the same
//! bytes (the memory-bound limit): 4096 slots x (3 heads x 64) x 30 layers, as SmolLM2-135M.
//!
//! `cargo bench -p leyline-kv --bench rotate` prints criterion's numbers and, at the end, one
//! line per path with GB/s and its ratio to the read-modify-write.

use criterion::{criterion_group, Criterion, Throughput};
use leyline_kv::rope::{RopeSpec, RotaryLayout};
use leyline_kv::rotate::{shift_rows_with, shift_table, KernelPath};
use leyline_kv::storage::RowsMut;
use std::hint::black_box;
use std::time::Instant;

const SLOTS: usize = 4096;
const HEADS: usize = 3;
const DIM: usize = 64;
const LAYERS: usize = 30;

fn layers_bf16() -> Vec<Vec<u16>> {
    (0..LAYERS)
        .map(|l| {
            (0..SLOTS * HEADS * DIM)
                .map(|i| 0x3f00 | ((i + l) % 255) as u16)
                .collect()
        })
        .collect()
}

fn spec(layout: RotaryLayout) -> RopeSpec {
    RopeSpec::plain(100000.0, DIM, layout)
}

const LAYOUTS: [RotaryLayout; 2] = [RotaryLayout::Interleaved, RotaryLayout::Neox];

fn paths() -> Vec<KernelPath> {
    [KernelPath::Portable, KernelPath::Avx2, KernelPath::Avx512]
        .into_iter()
        .filter(|p| p.available())
        .collect()
}

fn rotate_all(layers: &mut [Vec<u16>], slots: &[u32], path: KernelPath, layout: RotaryLayout) {
    let rot = shift_table(&spec(layout), -37).expect("shiftable");
    for l in layers.iter_mut() {
        shift_rows_with(RowsMut::Bf16(l), HEADS, DIM, slots, &rot, path).expect("valid");
    }
}

fn rmw_all(layers: &mut [Vec<u16>]) {
    for l in layers.iter_mut() {
        for x in l.iter_mut() {
            *x = x.wrapping_add(1);
        }
        black_box(&l);
    }
}

fn bench(c: &mut Criterion) {
    let mut layers = layers_bf16();
    let slots: Vec<u32> = (0..SLOTS as u32).collect();
    let bytes = (LAYERS * SLOTS * HEADS * DIM * 2) as u64;
    let mut g = c.benchmark_group("rotate_bf16_4096x3x64x30");
    g.throughput(Throughput::Bytes(bytes)).sample_size(10);
    for layout in LAYOUTS {
        for path in paths() {
            g.bench_function(format!("{layout:?}/{path:?}"), |b| {
                b.iter(|| rotate_all(&mut layers, &slots, path, layout))
            });
        }
    }
    g.bench_function("rmw_add", |b| b.iter(|| rmw_all(&mut layers)));
    let mut dst = layers_bf16();
    g.bench_function("memcpy", |b| {
        b.iter(|| {
            for (d, s) in dst.iter_mut().zip(&layers) {
                d.copy_from_slice(s);
            }
            black_box(&dst);
        })
    });
    g.finish();
}

/// Best-of-5 GB/s of `f` over the benchmark's bytes.
fn gbps(mut f: impl FnMut()) -> f64 {
    let bytes = (LAYERS * SLOTS * HEADS * DIM * 2) as f64;
    f();
    (0..5)
        .map(|_| {
            let t = Instant::now();
            f();
            bytes / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max)
}

fn ratio_report() {
    let mut layers = layers_bf16();
    let slots: Vec<u32> = (0..SLOTS as u32).collect();
    let rmw = gbps(|| rmw_all(&mut layers));
    println!("in-place read-modify-write: {rmw:.2} GB/s");
    for layout in LAYOUTS {
        for path in paths() {
            let r = gbps(|| rotate_all(&mut layers, &slots, path, layout));
            println!(
                "rotation {layout:?} {path:?}: {r:.2} GB/s = {:.2} x rmw",
                r / rmw
            );
        }
    }
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    ratio_report();
}
