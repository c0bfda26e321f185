//! Decode attention at depth: one query token over a long context of f16 keys and values,
//! cut as the model's planner cuts a decode step (one task per kv head and [`SPAN`] of keys,
//! partial sums merged), on the global pool's threads.
//!
//! `cargo bench -p leyline-kernels --bench attend [-- KEYS] [TIER...] [SHAPE...] [cached] [f32] [slots]`
//! prints,
//! per shape (those whose name contains a SHAPE argument, e.g. `1.5b`; all by default) and tier (every tier the CPU runs unless some are named), the best and median time of a whole
//! token's attention (one call per layer, each layer's keys and values in memory of their
//! own; `cached`: one layer's, read by every layer, which the last-level cache may hold) and
//! the key and value bytes streamed per second. `f32` stores keys and values as f32 (default:
//! f16, the engine's default); `slots` lays each slot's kv heads side by side (default: each
//! head's slots one after the other, as the engine's pool). The shapes are Qwen2.5-Coder 0.5B (14 heads,
//! 2 kv heads, head dim 64, 24 layers) and 1.5B (12, 2, 128, 28 layers); KEYS defaults to 16384.

use leyline_kernels::attend::{attend, Heads, KvRows, Queries, Task, Work, SPAN};
use leyline_kernels::mem::HugeBuf;
use leyline_kernels::pool::SpinPool;
use leyline_kernels::rows::{RowsRef, Strides};
use leyline_kernels::Tier;
use std::time::Instant;

struct Shape {
    name: &'static str,
    heads: Heads,
    layers: usize,
}

const SHAPES: [Shape; 2] = [
    Shape {
        name: "qwen2.5-coder-0.5b",
        heads: Heads {
            heads: 14,
            kv_heads: 2,
            head_dim: 64,
        },
        layers: 24,
    },
    Shape {
        name: "qwen2.5-coder-1.5b",
        heads: Heads {
            heads: 12,
            kv_heads: 2,
            head_dim: 128,
        },
        layers: 28,
    },
];

/// A decode step's work over `keys` context rows (slots `0..keys`) and the token's own row.
fn decode_work<'a>(shape: Heads, context: &'a [u32], new: &'a [u32]) -> Work<'a> {
    let g = shape.heads / shape.kv_heads;
    let keys = context.len() + 1;
    let mut cuts: Vec<usize> = (0..keys).step_by(SPAN).collect();
    cuts.push(keys);
    let mut tasks = Vec::new();
    for kv_head in 0..shape.kv_heads {
        for k in cuts.windows(2) {
            tasks.push(Task {
                context,
                new_rows: new,
                kv_head,
                toks: vec![(0, kv_head * g)],
                diag: context.len(),
                window: None,
                k0: k[0],
                k1: k[1],
                merged: cuts.len() > 2,
                pieces: vec![(k[1], None)],
                loads: vec![(k[0], None)],
            });
        }
    }
    let len = tasks.len() * g * (shape.head_dim + 2);
    Work {
        shape,
        tasks,
        merge_rows: shape.heads,
        max_rows: g,
        scratch: vec![0.0; len],
        rotations: Vec::new(),
    }
}

/// One layer's keys and values.
enum Store {
    F16(HugeBuf<u16>, HugeBuf<u16>),
    F32(HugeBuf<f32>, HugeBuf<f32>),
}

impl Store {
    fn rows(&self) -> (RowsRef<'_>, RowsRef<'_>) {
        match self {
            Store::F16(k, v) => (RowsRef::F16(k), RowsRef::F16(v)),
            Store::F32(k, v) => (RowsRef::F32(k), RowsRef::F32(v)),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let keys: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(16384);
    let only: Vec<Tier> = Tier::ALL
        .into_iter()
        .filter(|t| args.iter().any(|a| a == t.name()))
        .collect();
    let cached = args.iter().any(|a| a == "cached");
    let f32_store = args.iter().any(|a| a == "f32");
    let slot_major = args.iter().any(|a| a == "slots");
    let pool = SpinPool::global();
    let dtype = if f32_store { "f32" } else { "f16" };
    let layout = if slot_major {
        "slot-major"
    } else {
        "head-major"
    };
    println!(
        "decode attention over {keys} {dtype} keys ({layout}), {} threads",
        pool.threads()
    );
    let named = |s: &Shape| args.iter().any(|a| s.name.contains(a.as_str()));
    let any_named = SHAPES.iter().any(named);
    for s in SHAPES.iter().filter(|s| !any_named || named(s)) {
        let Heads {
            heads,
            kv_heads,
            head_dim: hd,
        } = s.heads;
        let width = kv_heads * hd;
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let f16 = |x: f32| half::f16::from_f32(x).to_bits();
        // One store per layer, as a decode step streams them: a layer's keys are not in the
        // cache when its turn comes. Huge pages, as the engine's KV pool.
        let kv: Vec<Store> = (0..if cached { 1 } else { s.layers })
            .map(|_| {
                let n = (keys + 1) * width;
                if f32_store {
                    let (mut k, mut v) = (HugeBuf::zeroed(n), HugeBuf::zeroed(n));
                    k.iter_mut().for_each(|x| *x = next() * 4.0);
                    v.iter_mut().for_each(|x| *x = next());
                    Store::F32(k, v)
                } else {
                    let (mut k, mut v) = (HugeBuf::zeroed(n), HugeBuf::zeroed(n));
                    k.iter_mut().for_each(|x| *x = f16(next() * 4.0));
                    v.iter_mut().for_each(|x| *x = f16(next()));
                    Store::F16(k, v)
                }
            })
            .collect();
        let q: Vec<f32> = (0..heads * hd).map(|_| next()).collect();
        let context: Vec<u32> = (0..keys as u32).collect();
        let new = [keys as u32];
        let queries = Queries {
            rows: &q,
            stride: heads * hd,
        };
        let mut out = vec![0f32; heads * hd];
        let strides = if slot_major {
            Strides::slot_major(kv_heads, hd)
        } else {
            Strides::head_major(keys + 1, hd)
        };
        for tier in Tier::ALL
            .into_iter()
            .filter(|t| t.available() && (only.is_empty() || only.contains(t)))
        {
            let mut work = decode_work(s.heads, &context, &new);
            let mut times = Vec::new();
            for _ in 0..9 {
                let t = Instant::now();
                for store in kv.iter().cycle().take(s.layers) {
                    let (k, v) = store.rows();
                    let rows = KvRows {
                        k,
                        v,
                        k_strides: strides,
                        v_strides: strides,
                    };
                    attend(tier, pool, rows, queries, &mut work, &mut out);
                }
                times.push(t.elapsed().as_secs_f64());
            }
            std::hint::black_box(&out);
            times.sort_by(f64::total_cmp);
            let (best, median) = (times[0], times[times.len() / 2]);
            let bytes = (s.layers * 2 * (keys + 1) * width * if f32_store { 4 } else { 2 }) as f64;
            println!(
                "{:<20} {:<10} token ({} layers) best {:7.2} ms median {:7.2} ms; {:5.1} GB/s of K and V",
                s.name,
                tier.name(),
                s.layers,
                best * 1e3,
                median * 1e3,
                bytes / median / 1e9
            );
        }
    }
}
