//! A row's attention output bits against the batch it is in: chunking, batching, threads,
//! shared-prefix groups.

use super::tests::{Rng, THETA};
use super::*;
use crate::model::{ForwardSeq, LogitsFor};
use leyline_kernels::attend::{Heads, KB, SPAN};
use leyline_kernels::rope::{LayerRopes, RopeSpec, RotaryLayout};
use leyline_kv::shift::KeyShift;
use leyline_kv::storage::{KvDtype, KvGeometry};
use std::num::NonZeroUsize;

/// One pass's part of a batch: sequence `.0`'s tokens `.1..` `.2` as new tokens, its
/// earlier tokens as context.
type Part = (usize, usize, usize);

/// Sequences' slots, shifted runs and per-token queries, with their keys and values
/// written at layer 0 of a pool, for [`batch_bits`].
struct Prompts {
    kv: KvStorage,
    slots: Vec<Vec<u32>>,
    shifts: Vec<Vec<KeyShift>>,
    /// Per sequence, every token's query row (all heads).
    q: Vec<Vec<f32>>,
}

impl Prompts {
    /// Sequences of `lens` tokens; the first `shared` slots are common to the sequences in
    /// `sharing` (their keys the same), the rest their own.
    fn new(
        shape: Heads,
        dtype: KvDtype,
        lens: &[usize],
        shared: usize,
        sharing: &[usize],
        shifts: Vec<Vec<KeyShift>>,
    ) -> Self {
        let (h, hd, w) = (shape.heads, shape.head_dim, shape.kv_heads * shape.head_dim);
        let cap: usize = lens.iter().sum::<usize>() + 3;
        let geo = KvGeometry {
            layers: 1,
            k_heads: shape.kv_heads,
            k_head_dim: hd,
            v_width: w,
        };
        let mut kv = KvStorage::new(geo, dtype, cap).unwrap();
        let mut rng = Rng(0x6a09_e667_f3bc_c908 ^ hd as u64);
        let mut free: Vec<u32> = (0..cap as u32).collect();
        for i in (1..free.len()).rev() {
            let j = ((rng.next() + 1.0) * 0.5 * i as f32) as usize % (i + 1);
            free.swap(i, j);
        }
        let common: Vec<u32> = free.drain(..shared).collect();
        let slots: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                if sharing.contains(&i) {
                    common
                        .iter()
                        .copied()
                        .chain(free.drain(..n - shared))
                        .collect()
                } else {
                    free.drain(..n).collect()
                }
            })
            .collect();
        for &slot in common.iter().chain(slots.iter().flatten()) {
            let k: Vec<f32> = (0..w).map(|_| rng.next() * 3.0).collect();
            let v: Vec<f32> = (0..w).map(|_| rng.next()).collect();
            kv.write(0, slot, &k, &v).unwrap();
        }
        let q = lens
            .iter()
            .map(|&n| (0..n * h * hd).map(|_| rng.next() * 2.0).collect())
            .collect();
        Self {
            kv,
            slots,
            shifts,
            q,
        }
    }
}

/// Layer 0's attention output rows for one forward pass of `parts`, planned for `threads`
/// threads, in the order of the parts' tokens; and whether a task held rows of several parts
/// (decodes grouped by a shared prefix).
fn batch_bits(
    p: &Prompts,
    shape: Heads,
    parts: &[Part],
    window: Option<usize>,
    threads: usize,
    tier: Tier,
) -> (Vec<f32>, bool) {
    let row = shape.heads * shape.head_dim;
    let toks = vec![0u32; p.slots.iter().map(Vec::len).max().unwrap_or(0)];
    let seqs: Vec<ForwardSeq<'_>> = parts
        .iter()
        .map(|&(s, c0, c1)| ForwardSeq {
            tokens: &toks[..c1 - c0],
            positions: &toks[..c1 - c0],
            context: &p.slots[s][..c0],
            new_slots: &p.slots[s][c0..c1],
            logits: LogitsFor::None,
            shifts: &p.shifts[s],
        })
        .collect();
    let q: Vec<f32> = parts
        .iter()
        .flat_map(|&(s, c0, c1)| p.q[s][c0 * row..c1 * row].iter().copied())
        .collect();
    let n = q.len() / row;
    let rope = LayerRopes::uniform(
        RopeSpec::plain(THETA, shape.head_dim, RotaryLayout::Neox),
        1,
    );
    let windows = [window.map(|w| NonZeroUsize::new(w).unwrap())];
    let pool = SpinPool::new(threads);
    let mut plan = Plan::new(&seqs, shape, &rope, &windows, threads);
    let mut out = vec![f32::NAN; n * row];
    let q = Queries {
        rows: &q,
        stride: row,
    };
    attend_with(tier, &pool, &p.kv, 0, q, &mut plan, &mut out);
    let part_of: Vec<usize> = parts
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, c0, c1))| std::iter::repeat_n(i, c1 - c0))
        .collect();
    // The kernel's contract (checked there in debug builds only): tasks start at key-block
    // edges, and a merged part lies in one span.
    for t in plan.cuts.iter().flat_map(|c| &c.work.tasks) {
        assert!(t.k0 % KB == 0, "task from key {}", t.k0);
        assert!(
            !t.merged || t.k0 / SPAN == (t.k1 - 1) / SPAN,
            "part {}..{}",
            t.k0,
            t.k1
        );
    }
    let grouped = plan.cuts.iter().flat_map(|c| &c.work.tasks).any(|t| {
        t.toks
            .iter()
            .any(|&(r, _)| part_of[r] != part_of[t.toks[0].0])
    });
    (out, grouped)
}

/// A row's attention output bits depend on its sequence's keys and its query only: a
/// prompt's rows get the same bits whole in one pass, as a cached head and a tail (cut
/// inside key blocks and spans too), in several chunks, batched with other sequences or
/// alone, on 1 to 3 threads (split into spans or not); decodes get their prefill's bits
/// alone or grouped by a shared prefix; with lazily rotated runs, with and without a window,
/// f32 and f16 storage, on every tier.
#[test]
fn rows_get_the_same_bits_in_any_batch() {
    let run = |a: usize, b: usize, offset: i64| KeyShift {
        range: a..b,
        offset,
    };
    // Sequence 0 is chunked; 1 is batched beside it; 2, 3 and 4 share 1100 slots (two
    // spans) and decode their last token.
    let lens = [1300, 150, 1150, 1300, 1700];
    let prefix = vec![run(100, 380, -2), run(700, 705, 9)];
    let shifts = vec![
        vec![run(0, 5, 3), run(40, 90, -7), run(600, 1290, 250)],
        vec![],
        prefix.clone(),
        prefix.clone(),
        [prefix.clone(), vec![run(1200, 1300, 5)]].concat(),
    ];
    let shapes = [(8, 2, 64), (6, 2, 40)].map(|(heads, kv_heads, head_dim)| Heads {
        heads,
        kv_heads,
        head_dim,
    });
    let chunkings: Vec<Vec<usize>> = [1, 63, 64, 500, 512, 513, 1024, 1299]
        .iter()
        .map(|&c| vec![c, 1300])
        .chain([vec![200, 577, 1024, 1100, 1300], vec![7, 8, 9, 700, 1300]])
        .collect();
    Tier::note_lacking();
    for (dtype, shape, window) in [
        (KvDtype::F32, shapes[0], None),
        (KvDtype::F32, shapes[1], None),
        (KvDtype::F32, shapes[0], Some(300)),
        (KvDtype::F16, shapes[0], None),
        (KvDtype::F16, shapes[1], Some(KB)),
    ] {
        let p = Prompts::new(shape, dtype, &lens, 1100, &[2, 3, 4], shifts.clone());
        let row = shape.heads * shape.head_dim;
        for tier in Tier::all_available() {
            let what = format!("{tier} {dtype:?} {shape:?} window {window:?}");
            // Each prompt whole and alone.
            let want: Vec<Vec<f32>> = (0..lens.len())
                .map(|s| batch_bits(&p, shape, &[(s, 0, lens[s])], window, 1, tier).0)
                .collect();
            let same = |got: &[f32], s: usize, c0: usize, how: &str| {
                for (i, (a, b)) in got
                    .chunks_exact(row)
                    .zip(want[s][c0 * row..].chunks_exact(row))
                    .enumerate()
                {
                    assert!(
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{what}: {how}: sequence {s} token {} differs",
                        c0 + i
                    );
                }
            };
            // The portable tier's `mul_add` is a library call in baseline x86-64 code: it
            // takes a few of the cuts.
            let slow = tier == Tier::Portable && cfg!(target_arch = "x86_64");
            for (ci, bounds) in chunkings.iter().enumerate() {
                if slow && ci % 4 != 1 {
                    continue;
                }
                let mut c0 = 0;
                for (pi, &c1) in bounds.iter().enumerate() {
                    // Sequence 1 whole beside some passes; a decode of 2 beside others.
                    let mut parts = vec![(0, c0, c1)];
                    match (ci + pi) % 3 {
                        0 => parts.push((1, 0, lens[1])),
                        1 => parts.insert(0, (2, lens[2] - 1, lens[2])),
                        _ => {}
                    }
                    let threads = 1 + (ci + pi) % 3;
                    let (got, _) = batch_bits(&p, shape, &parts, window, threads, tier);
                    let how = format!("{parts:?} on {threads} threads");
                    let mut at = 0;
                    for &(s, a, b) in &parts {
                        same(&got[at * row..(at + b - a) * row], s, a, &how);
                        at += b - a;
                    }
                    c0 = c1;
                }
            }
            // Decodes alone, and grouped by their shared prefix (with another beside).
            for threads in [1, 2, 3] {
                if slow && threads != 2 {
                    continue;
                }
                for (s, &n) in lens.iter().enumerate().skip(2) {
                    let part = [(s, n - 1, n)];
                    let (got, _) = batch_bits(&p, shape, &part, window, threads, tier);
                    same(&got, s, n - 1, "alone");
                }
                let parts: Vec<Part> = [4, 2, 1, 3]
                    .iter()
                    .map(|&s| (s, lens[s] - 1, lens[s]))
                    .collect();
                let (got, grouped) = batch_bits(&p, shape, &parts, window, threads, tier);
                // Not with a window: a windowed cut groups nothing.
                assert_eq!(grouped, window.is_none(), "{what}: grouped");
                for (i, &(s, a, _)) in parts.iter().enumerate() {
                    same(&got[i * row..(i + 1) * row], s, a, "grouped");
                }
            }
        }
    }
}
