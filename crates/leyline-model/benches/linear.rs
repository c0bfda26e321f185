//! The f32 GEMM path of a SmolLM2-135M block at prefill row counts: Q/K/V and gate/up as
//! separate products against one fused product each (`FusedLinear`), same weights.

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use leyline_model::linear::{FusedLinear, Linear};
use std::hint::black_box;
use std::time::Duration;

fn layer(out: usize, inp: usize, seed: usize) -> Linear {
    let w: Vec<f32> = (0..out * inp)
        .map(|i| (((i + seed) * 7919 % 1000) as f32 - 500.0) * 1e-4)
        .collect();
    let t = Tensor::from_vec(w, (out, inp), &Device::Cpu).expect("shape matches");
    Linear::from_f32(t, None).expect("an f32 matrix")
}

fn groups(c: &mut Criterion) {
    // (name, input width, output widths): attention's Q/K/V and the MLP's gate/up.
    let cases: [(&str, usize, &[usize]); 2] = [
        ("qkv 576->576+192+192", 576, &[576, 192, 192]),
        ("gate_up 576->1536+1536", 576, &[1536, 1536]),
    ];
    let mut g = c.benchmark_group("linear");
    g.warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(10);
    for (name, inp, outs) in cases {
        let separate: Vec<Linear> = outs
            .iter()
            .enumerate()
            .map(|(i, &o)| layer(o, inp, i))
            .collect();
        let fused = FusedLinear::new(
            outs.iter()
                .enumerate()
                .map(|(i, &o)| layer(o, inp, i))
                .collect(),
        )
        .expect("equal input widths");
        for m in [128, 512] {
            let x: Vec<f32> = (0..m * inp)
                .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
                .collect();
            let mut ys: Vec<Vec<f32>> = outs.iter().map(|&o| vec![0f32; m * o]).collect();
            let flops: usize = outs.iter().map(|&o| 2 * m * inp * o).sum();
            g.throughput(Throughput::Elements(flops as u64));
            g.bench_with_input(
                BenchmarkId::new(format!("{name} separate"), m),
                &m,
                |b, &m| {
                    b.iter(|| {
                        for (l, y) in separate.iter().zip(ys.iter_mut()) {
                            l.forward_rows(black_box(&x), m, y).expect("lengths match");
                        }
                    })
                },
            );
            let mut y = vec![0f32; m * fused.out()];
            g.bench_with_input(BenchmarkId::new(format!("{name} fused"), m), &m, |b, &m| {
                b.iter(|| {
                    fused
                        .forward(black_box(&x), m, &mut y)
                        .expect("lengths match")
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, groups);
criterion_main!(benches);
