//! One decode row (m = 1) at Qwen2.5-0.5B's shapes and formats: `Linear::forward_rows` as the
//! engine runs it (the integer kernels where the kind takes the AVX2 tier) against the f32
//! tile kernels on the same blocks (`QMatrix::matmul_with`, the decode path before the
//! integer kernels), both on the global pools.
//!
//!     cargo bench -p leyline-model --bench decode_formats
//!
//! Each figure cycles through copies of its matrix (about 256 MB in all), so the weights come
//! from memory as in a decode step. `DECODE_THREADS` sets the compute threads (default 2), `DECODE_SAMPLES` the samples per
//! figure (default 9). Each sample times enough calls for about 20 ms; quantized and f32
//! samples alternate so both see the same machine. Prints the median, min and max per call.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use leyline_kernels::qmatmul::QMatrix;
use leyline_model::linear::Linear;
use leyline_model::quant::qmatrix;
use std::hint::black_box;
use std::time::Instant;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // The sum of two uniforms: a bell-ish weight distribution with a tail.
            let a = (s >> 40) as f32 / (1u64 << 24) as f32;
            let b = ((s >> 16) & 0xff_ffff) as f32 / (1u64 << 24) as f32;
            (a + b - 1.0) * 0.05
        })
        .collect()
}

/// Seconds per call of `f`, one sample: as many calls as fill about 20 ms.
fn sample(reps: usize, f: &mut impl FnMut()) -> f64 {
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    t.elapsed().as_secs_f64() / reps as f64
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let threads: usize = std::env::var("DECODE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let samples: usize = std::env::var("DECODE_SAMPLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(9)
        .max(5);
    leyline_kernels::pool::init_threads(threads).expect("first use of the pools");
    // (what, format, out, in): Qwen2.5-0.5B's ffn_down (Q4_K, or Q6_K in some layers),
    // gate / up and q / o (Q5_0 in Q4_K_M files: 896 columns are no whole super-blocks),
    // then the older kinds at the same shapes for comparison.
    let cases = [
        ("ffn_down", GgmlDType::Q4K, 896, 4864),
        ("ffn_down", GgmlDType::Q6K, 896, 4864),
        ("ffn_down", GgmlDType::Q5K, 896, 4864),
        ("ffn_down", GgmlDType::Q4_0, 896, 4864),
        ("ffn_down", GgmlDType::Q4_1, 896, 4864),
        ("ffn_down", GgmlDType::Q8_0, 896, 4864),
        ("ffn_up", GgmlDType::Q5_0, 4864, 896),
        ("attn_q", GgmlDType::Q5_0, 896, 896),
        ("lm_head", GgmlDType::Q8_0, 151936, 896),
    ];
    println!(
        "m = 1, {threads} threads, {samples} samples: median (min-max) per call; GB/s of the \
         format's bytes"
    );
    for (what, dt, out, inp) in cases {
        let t = Tensor::from_vec(
            values(out * inp, out as u64 ^ inp as u64),
            (out, inp),
            &Device::Cpu,
        )
        .expect("shape");
        let q = QTensor::quantize(&t, dt).expect("quantizable shape");
        // Enough copies to stream about 256 MB per round, as a decode step streams a model's
        // weights from memory rather than from the cache.
        let bytes = q.storage_size_in_bytes();
        let copies = (256 << 20) / bytes + 1;
        let quant: Vec<Linear> = (0..copies)
            .map(|_| Linear::from_qtensor(&q, None).expect("layer"))
            .collect();
        let blocks: Vec<QMatrix> = (0..copies)
            .map(|_| qmatrix(&q).expect("a kind with kernels"))
            .collect();
        let tier = blocks[0].kind().best_tier();
        let (mut iq, mut ib) = (0, 0);
        let x = values(inp, 7);
        let mut y = vec![0f32; out];
        let mut run_q = || {
            iq = (iq + 1) % copies;
            quant[iq]
                .forward_rows(black_box(&x), 1, &mut y)
                .expect("lengths")
        };
        // Warm up, then size the samples.
        let once = sample(20, &mut run_q);
        let reps = ((0.02 / once) as usize).max(1);
        let mut y2 = vec![0f32; out];
        let mut run_f = || {
            ib = (ib + 1) % copies;
            blocks[ib].matmul_with(tier, black_box(&x), 1, &mut y2)
        };
        let once_f = sample(5, &mut run_f);
        let reps_f = ((0.02 / once_f) as usize).max(1);
        let (mut tq, mut tf) = (Vec::new(), Vec::new());
        for _ in 0..samples {
            tq.push(sample(reps, &mut run_q));
            tf.push(sample(reps_f, &mut run_f));
        }
        let (mq, lq, hq) = stats(tq);
        let (mf, lf, hf) = stats(tf);
        println!(
            "{what} [{out} x {inp}] {dt:?}: engine {:.1} us ({:.1}-{:.1}), {:.1} GB/s; \
             f32 tiles {:.1} us ({:.1}-{:.1}), {:.1} GB/s; f32 tiles / engine {:.2}",
            mq * 1e6,
            lq * 1e6,
            hq * 1e6,
            bytes as f64 / mq / 1e9,
            mf * 1e6,
            lf * 1e6,
            hf * 1e6,
            bytes as f64 / mf / 1e9,
            mf / mq
        );
    }
}
