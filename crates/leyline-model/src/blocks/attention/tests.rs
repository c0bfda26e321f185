use super::plan::{common_prefix, shared_prefixes, QB};
use super::*;
use crate::model::{ForwardSeq, LogitsFor};
use leyline_kernels::attend::{Heads, KB};
use leyline_kernels::rope::{LayerRopes, RopeSpec, RotaryLayout};
use leyline_kv::shift::KeyShift;
use leyline_kv::storage::{KvDtype, KvGeometry};
use std::num::NonZeroUsize;

pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

pub(super) const THETA: f64 = 10_000.0;

/// `R(angle)` applied in f64 to one head row of plain RoPE (base [`THETA`], all dims).
fn rotate_f64(x: &mut [f64], angle: f64, layout: RotaryLayout) {
    let hd = x.len();
    let h = hd / 2;
    for i in 0..h {
        let (s, c) = (angle * THETA.powf(-(2.0 * i as f64) / hd as f64)).sin_cos();
        let (a, b) = match layout {
            RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
            RotaryLayout::Neox => (i, i + h),
        };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

/// Scalar f64 attention over the values the pool actually stores; the keys of a sequence's
/// shifted runs are first rotated forward by the run's offset (what an eager splice stores).
/// With a `window` of `w`, the query at index `i` (context then new tokens) sees key `j` iff
/// `j <= i` and `i - j < w`.
fn reference(
    kv: &KvStorage,
    layer: usize,
    shape: Heads,
    layout: RotaryLayout,
    q: &[f32],
    seqs: &[ForwardSeq<'_>],
    window: Option<usize>,
) -> Vec<f64> {
    let Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    } = shape;
    let g = h / kvh;
    let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
    let mut out = vec![0f64; n * h * hd];
    let mut row = 0;
    for s in seqs {
        let slots: Vec<u32> = s.context.iter().chain(s.new_slots).copied().collect();
        let mut ks = vec![0f32; slots.len() * kvh * hd];
        let mut vs = vec![0f32; slots.len() * kvh * hd];
        kv.gather_k(layer, &slots, &mut ks).unwrap();
        kv.gather_v(layer, &slots, &mut vs).unwrap();
        let mut ks: Vec<f64> = ks.iter().map(|&x| x as f64).collect();
        for sh in s.shifts {
            for j in sh.range.clone() {
                for kh in 0..kvh {
                    let row = &mut ks[j * kvh * hd + kh * hd..][..hd];
                    rotate_f64(row, sh.offset as f64, layout);
                }
            }
        }
        for i in 0..s.tokens.len() {
            let at = s.context.len() + i;
            let visible: Vec<usize> = (0..=at)
                .filter(|&j| window.is_none_or(|w| at - j < w))
                .collect();
            for head in 0..h {
                let kh = head / g;
                let qr = &q[(row + i) * h * hd + head * hd..][..hd];
                let sc: Vec<f64> = visible
                    .iter()
                    .map(|&j| {
                        let kr = &ks[j * kvh * hd + kh * hd..][..hd];
                        qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                let o = &mut out[(row + i) * h * hd + head * hd..][..hd];
                for (&j, p) in visible.iter().zip(&e) {
                    let vr = &vs[j * kvh * hd + kh * hd..][..hd];
                    for (o, &x) in o.iter_mut().zip(vr) {
                        *o += p / z * x as f64;
                    }
                }
            }
        }
        row += s.tokens.len();
    }
    out
}

fn check(dtype: KvDtype, shape: Heads, plan: &[(usize, usize)], threads: usize) {
    let plan: Vec<_> = plan.iter().map(|&(c, t)| (c, t, 0)).collect();
    check_shared(dtype, shape, &plan, threads);
}

/// [`check`] for sequences `(context, new tokens, shared)` whose contexts begin with the
/// first `shared` slots of one common run, as the prefix tree hands them out.
fn check_shared(dtype: KvDtype, shape: Heads, plan: &[(usize, usize, usize)], threads: usize) {
    check_windowed(dtype, shape, plan, None, threads);
}

/// [`check_shared`] for a layer with a sliding window.
fn check_windowed(
    dtype: KvDtype,
    shape: Heads,
    plan: &[(usize, usize, usize)],
    window: Option<usize>,
    threads: usize,
) {
    let none = vec![Vec::new(); plan.len()];
    check_shifted(
        dtype,
        shape,
        plan,
        &none,
        RotaryLayout::Neox,
        window,
        threads,
    );
}

/// [`check_windowed`] with each sequence's shifted runs.
///
/// Three layers share one plan, run in order, and layer 2 is checked. Layer 0 has another
/// window (`None` for a windowed layer, 3 keys for a global one: its cut comes first, so the
/// plan must hand each layer its own window's tasks); layer 1 has layer 2's window, but
/// another rope spec and other rows (a stale output or rotation must not leak).
fn check_shifted(
    dtype: KvDtype,
    shape: Heads,
    plan: &[(usize, usize, usize)],
    shifts: &[Vec<KeyShift>],
    layout: RotaryLayout,
    window: Option<usize>,
    threads: usize,
) {
    let Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    } = shape;
    let common = plan.iter().map(|p| p.2).max().unwrap_or(0);
    let total: usize = common + plan.iter().map(|(c, t, sh)| c - sh + t).sum::<usize>();
    let cap = total + 37;
    let geo = KvGeometry {
        layers: 3,
        k_heads: kvh,
        k_head_dim: hd,
        v_width: kvh * hd,
    };
    let mut kv = KvStorage::new(geo, dtype, cap).unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (hd as u64) << 7);
    // Scattered slots, in a shuffled order.
    let mut free: Vec<u32> = (0..cap as u32).collect();
    for i in (1..free.len()).rev() {
        let j = ((rng.next() + 1.0) * 0.5 * i as f32) as usize % (i + 1);
        free.swap(i, j);
    }
    let w = kvh * hd;
    let layer = 2;
    // Keys with a large common component make the softmax peaked in places. Layers 0 and
    // 1 hold other rows, read first with the same plan.
    for li in 0..3 {
        for &slot in &free[..total] {
            let k: Vec<f32> = (0..w).map(|_| rng.next() * 3.0).collect();
            let shift = if li == layer { 0.0 } else { 2.0 };
            let v: Vec<f32> = (0..w).map(|_| rng.next() + shift).collect();
            kv.write(li, slot, &k, &v).unwrap();
        }
    }
    let mut parts = Vec::new();
    let mut at = common;
    for &(c, t, sh) in plan {
        let own = c - sh;
        let ctx: Vec<u32> = free[..sh]
            .iter()
            .chain(&free[at..at + own])
            .copied()
            .collect();
        parts.push((ctx, free[at + own..at + own + t].to_vec()));
        at += own + t;
    }
    let toks: Vec<Vec<u32>> = plan.iter().map(|&(_, t, _)| vec![0; t]).collect();
    let seqs: Vec<ForwardSeq<'_>> = parts
        .iter()
        .zip(&toks)
        .zip(shifts)
        .map(|(((ctx, new), tk), sh)| ForwardSeq {
            tokens: tk,
            positions: tk,
            context: ctx,
            new_slots: new,
            logits: LogitsFor::None,
            shifts: sh,
        })
        .collect();
    let n: usize = plan.iter().map(|(_, t, _)| t).sum();
    let q: Vec<f32> = (0..n * h * hd).map(|_| rng.next() * 2.0).collect();
    let pool = SpinPool::new(threads);
    let want = reference(&kv, layer, shape, layout, &q, &seqs, window);
    // Layers 0 and 1 read their shifted runs by another spec (the first, which the plan is
    // built with), layer 2 (the one checked) by THETA's: the plan must hand each its own.
    let rope = LayerRopes::new(
        vec![
            RopeSpec::plain(7.0 * THETA, hd, layout),
            RopeSpec::plain(THETA, hd, layout),
        ],
        vec![0, 0, 1],
    )
    .unwrap();
    let other = match window {
        Some(_) => None,
        None => NonZeroUsize::new(3),
    };
    let window = window.map(|w| NonZeroUsize::new(w).unwrap());
    let windows = [other, window, window];
    // Rows wider than the queries (as in the fused Q/K/V buffer), padding unread.
    let stride = h * hd + 5;
    let padded: Vec<f32> = q
        .chunks_exact(h * hd)
        .flat_map(|r| r.iter().copied().chain([f32::NAN; 5]))
        .collect();
    Tier::note_lacking();
    for tier in Tier::all_available() {
        let mut out = vec![f32::NAN; n * h * hd];
        let q = Queries {
            rows: &padded,
            stride,
        };
        // The plan serves every layer: a stale output of layer 0 must not leak into layer 1.
        let mut work = Plan::new(&seqs, shape, &rope, &windows, pool.threads());
        for li in 0..=layer {
            attend_with(tier, &pool, &kv, li, q, &mut work, &mut out);
        }
        let (mut num, mut den) = (0f64, 0f64);
        for (a, b) in out.iter().zip(&want) {
            num += (*a as f64 - b).powi(2);
            den += b * b;
        }
        let rel = (num / den).sqrt();
        assert!(
            rel < 2e-6,
            "{tier} {dtype:?} hd={hd} plan={plan:?} shifts={shifts:?} window={window:?}: \
             rel-L2 {rel:e} against the f64 reference"
        );
    }
}

#[test]
fn decodes_that_share_a_prefix_match_the_reference() {
    let shape = Heads {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    // (context, new tokens, leading slots shared with the others)
    let plans: &[&[(usize, usize, usize)]] = &[
        // A group of three with different tails, a sequence too short to join, one with
        // three new tokens (not a decode), one that shares only 100 slots.
        &[
            (300, 1, 300),
            (520, 1, 300),
            (1000, 1, 300),
            (10, 1, 0),
            (700, 3, 300),
            (900, 1, 100),
        ],
        // A context that is all prefix (its own part is its new token), long tails.
        &[
            (1024, 1, 1024),
            (2100, 1, 1024),
            (1500, 1, 1024),
            (1030, 1, 1024),
        ],
        // More members than one task holds (chunks of QB).
        &[(640, 1, 600); QB + 6],
    ];
    for plan in plans {
        for threads in [1, 2, 8] {
            check_shared(KvDtype::F32, shape, plan, threads);
        }
        check_shared(KvDtype::F16, shape, plan, 2);
    }
    fn slots(v: &[u32]) -> ForwardSeq<'_> {
        ForwardSeq {
            tokens: &[0],
            positions: &[0],
            context: v,
            new_slots: &[9999],
            logits: LogitsFor::None,
            shifts: &[],
        }
    }
    // Grouping: the shared length is what all members share, cut to whole key blocks.
    let a: Vec<u32> = (0..700).collect();
    let mut b = a.clone();
    b[650] = 5000;
    let mut c = a.clone();
    c[100] = 6000;
    let seqs = [slots(&a), slots(&b), slots(&c), slots(&a[..300])];
    assert_eq!(shared_prefixes(&seqs), vec![(vec![0, 1, 3], 256)]);
    assert_eq!(common_prefix(&a, &b), 650);
    assert_eq!(common_prefix(&a, &a[..300]), 300);
    assert_eq!(common_prefix(&a[..64], &a[..64]), 64);
}

#[test]
fn matches_a_scalar_f64_reference() {
    let plans: &[&[(usize, usize)]] = &[
        &[(0, 1)],
        &[(0, 70)],
        &[(130, 1), (5, 3), (0, 17)],
        &[(300, 33), (64, 64), (63, 2)],
        // Several blocks of query tokens, the last one partial.
        &[(100, 2 * QB + 22)],
        // Decode shapes with long contexts: the context is split over several tasks.
        &[(1000, 1)],
        &[(2100, 1), (700, 2)],
        &[(777, 5)],
    ];
    for &hd in &[64, 128, 40] {
        let shape = Heads {
            heads: 6,
            kv_heads: 2,
            head_dim: hd,
        };
        for plan in plans {
            for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
                check(dtype, shape, plan, 2);
            }
        }
    }
    // One thread, and more threads than tasks.
    let shape = Heads {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    check(KvDtype::F32, shape, &[(200, 40)], 1);
    check(KvDtype::F32, shape, &[(10, 2)], 8);
    check(KvDtype::F32, shape, &[(3000, 1)], 1);
    check(KvDtype::Bf16, shape, &[(3000, 1), (513, 1)], 8);
    // MHA (a task of up to four tokens takes the direct-score path) and a group of 8.
    for (heads, kv_heads) in [(4, 4), (8, 1)] {
        let shape = Heads {
            heads,
            kv_heads,
            head_dim: 64,
        };
        for plan in plans {
            check(KvDtype::F32, shape, plan, 2);
        }
    }
}

/// Lazy rotation: keys of shifted runs, read with the query turned back by the run's offset,
/// give the attention of keys rotated forward (the f64 reference rotates the keys).
#[test]
fn shifted_runs_match_rotated_keys() {
    let run = |a: usize, b: usize, offset: i64| KeyShift {
        range: a..b,
        offset,
    };
    // (context, new tokens, shared), and each sequence's runs.
    type Case = (Vec<(usize, usize, usize)>, Vec<Vec<KeyShift>>);
    let cases: Vec<Case> = vec![
        // A prefill after one splice: the run reaches the end of the context.
        (vec![(200, 40, 0)], vec![vec![run(70, 200, -13)]]),
        // Decodes: several runs, one beginning at key 0, adjacent runs of other offsets,
        // and a context split over tasks.
        (
            vec![(1500, 1, 0), (90, 1, 0)],
            vec![
                vec![run(0, 5, 3), run(5, 300, -7), run(700, 1499, 250)],
                vec![run(10, 11, 1)],
            ],
        ),
        // Decodes that share a prefix holding runs, and a run after it.
        (
            vec![(600, 1, 400), (900, 1, 400), (420, 1, 400)],
            vec![
                vec![run(100, 380, -2), run(500, 600, 4)],
                vec![run(100, 380, -2)],
                vec![run(100, 380, -2), run(400, 420, 9)],
            ],
        ),
        // Several blocks of query tokens, the runs cutting blocks of keys anywhere.
        (
            vec![(333, 2 * QB + 5, 0)],
            vec![vec![
                run(1, 2, 100_000),
                run(63, 129, -40),
                run(200, 333, 17),
            ]],
        ),
        // Many short runs of alternating offsets: several in every key block, so a block's
        // keys turn to the offset of its largest piece.
        (
            vec![(290, 70, 0)],
            vec![(0..29)
                .filter(|i| i % 3 != 2)
                .map(|i| run(10 * i, 10 * i + 7 + i % 3, (i as i64 - 14) * 37))
                .collect()],
        ),
    ];
    let shape = Heads {
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
    };
    for (plan, shifts) in &cases {
        for layout in [RotaryLayout::Neox, RotaryLayout::Interleaved] {
            for threads in [1, 2] {
                check_shifted(KvDtype::F32, shape, plan, shifts, layout, None, threads);
            }
        }
        check_shifted(
            KvDtype::Bf16,
            shape,
            plan,
            shifts,
            RotaryLayout::Neox,
            None,
            2,
        );
    }
    // MHA and a group of 8 (the direct-score path).
    for (heads, kv_heads) in [(4, 4), (8, 1)] {
        let shape = Heads {
            heads,
            kv_heads,
            head_dim: 64,
        };
        let (plan, shifts) = &cases[1];
        check_shifted(
            KvDtype::F32,
            shape,
            plan,
            shifts,
            RotaryLayout::Neox,
            None,
            2,
        );
    }
}

/// Decodes whose shared slots carry different shifts (which slots from one pool cannot)
/// are not grouped past the first difference.
#[test]
fn shared_prefixes_stop_where_shifts_differ() {
    let a: Vec<u32> = (0..700).collect();
    let one = [KeyShift {
        range: 300..700,
        offset: 2,
    }];
    let seq = |sh| ForwardSeq {
        tokens: &[0],
        positions: &[0],
        context: &a,
        new_slots: &[9999],
        logits: LogitsFor::None,
        shifts: sh,
    };
    let seqs = [seq(&one), seq(&[]), seq(&one)];
    assert_eq!(shared_prefixes(&seqs), vec![(vec![0, 1, 2], 256)]);
    let seqs = [seq(&one), seq(&one)];
    assert_eq!(shared_prefixes(&seqs), vec![(vec![0, 1], 640)]);
}

/// Sliding-window layers through the planner: windows of one key, below, at and across a
/// key block, and wider than some contexts (planned as global); several sequences in one
/// batch, blocks of query tokens, decodes with long contexts split into merged parts, GQA
/// groups of 1, 3 and 8, and decodes behind one shared prefix (not grouped when windowed).
#[test]
fn sliding_window_layers_match_the_reference() {
    let plans: &[&[(usize, usize, usize)]] = &[
        &[(0, 70, 0)],
        &[(130, 1, 0), (5, 3, 0), (0, 17, 0)],
        &[(300, 33, 0), (64, 64, 0), (63, 2, 0)],
        &[(100, 2 * QB + 22, 0)],
        &[(3000, 1, 0), (700, 2, 0)],
        &[(300, 1, 300), (520, 1, 300), (1000, 1, 300), (700, 3, 300)],
    ];
    let windows = [1, 2, KB - 1, KB, KB + 1, 200, 1500, 100_000];
    for (heads, kv_heads) in [(6, 2), (4, 4), (8, 1)] {
        let shape = Heads {
            heads,
            kv_heads,
            head_dim: 64,
        };
        for plan in plans {
            for w in windows {
                check_windowed(KvDtype::F32, shape, plan, Some(w), 2);
            }
        }
    }
    let shape = Heads {
        heads: 6,
        kv_heads: 2,
        head_dim: 64,
    };
    for threads in [1, 8] {
        check_windowed(
            KvDtype::F32,
            shape,
            &[(3000, 1, 0), (513, 1, 0)],
            Some(1200),
            threads,
        );
    }
    for dtype in [KvDtype::Bf16, KvDtype::F16] {
        check_windowed(dtype, shape, plans[2], Some(KB + 1), 2);
        check_windowed(dtype, shape, plans[4], Some(1200), 2);
    }
}

/// Lazy splices under a window: keys stored at other offsets than their index are read with
/// the queries turned back, and the window counts indices, not stored positions.
#[test]
fn shifted_runs_under_a_window_match_rotated_keys() {
    let run = |a: usize, b: usize, offset: i64| KeyShift {
        range: a..b,
        offset,
    };
    type Case = (Vec<(usize, usize, usize)>, Vec<Vec<KeyShift>>);
    let cases: Vec<Case> = vec![
        (vec![(200, 40, 0)], vec![vec![run(70, 200, -13)]]),
        (
            vec![(1500, 1, 0), (90, 1, 0)],
            vec![
                vec![run(0, 5, 3), run(5, 300, -7), run(700, 1499, 250)],
                vec![run(10, 11, 1), run(60, 85, -300)],
            ],
        ),
        (
            vec![(290, 70, 0)],
            vec![(0..29)
                .filter(|i| i % 3 != 2)
                .map(|i| run(10 * i, 10 * i + 7 + i % 3, (i as i64 - 14) * 37))
                .collect()],
        ),
    ];
    for (heads, kv_heads) in [(6, 2), (8, 1)] {
        let shape = Heads {
            heads,
            kv_heads,
            head_dim: 64,
        };
        for (plan, shifts) in &cases {
            for w in [1, 50, KB, 130, 900] {
                for layout in [RotaryLayout::Neox, RotaryLayout::Interleaved] {
                    check_shifted(KvDtype::F32, shape, plan, shifts, layout, Some(w), 2);
                }
            }
        }
    }
}

/// A decode on a long context reads only its window's keys (from the key block of the first)
/// in a windowed layer, every key in a global one; layers of one window share one cut, and a window that reaches every key
/// shares the global one.
#[test]
fn windowed_decodes_read_only_the_window() {
    let ctx: Vec<u32> = (0..16_384).collect();
    // Other slots than `ctx`'s: no shared prefix groups the two.
    let long: Vec<u32> = (20_000..20_600).collect();
    let seq = |context| ForwardSeq {
        tokens: &[0],
        positions: &[0],
        context,
        new_slots: &[99_999],
        logits: LogitsFor::None,
        shifts: &[],
    };
    let seqs = [seq(&ctx), seq(&long)];
    let shape = Heads {
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
    };
    let spec = RopeSpec::plain(THETA, 64, RotaryLayout::Neox);
    let rope = LayerRopes::uniform(spec, 6);
    let w = |n| NonZeroUsize::new(n);
    // Gemma 3's pattern: local layers with one window, a global one between them.
    let windows = [w(512), w(512), None, w(512), w(512), w(1 << 20)];
    for threads in [1, 2, 16] {
        let mut plan = Plan::new(&seqs, shape, &rope, &windows, threads);
        assert_eq!(plan.cuts.len(), 2, "one cut per distinct window");
        assert_eq!(plan.cut_of_layer, [0, 0, 1, 0, 0, 1]);
        for (l, want) in [w(512), w(512), None, w(512), w(512), None]
            .into_iter()
            .enumerate()
        {
            assert!(
                plan.select(l).tasks.iter().all(|t| t.window == want),
                "layer {l}"
            );
        }
        for (cut, want) in plan.cuts.iter().zip([512, 16_385]) {
            let keys = |seq: usize, kv_head: usize| {
                let mut ranges: Vec<_> = cut
                    .work
                    .tasks
                    .iter()
                    .filter(|t| t.kv_head == kv_head && t.toks[0].0 == seq)
                    .map(|t| t.k0..t.k1)
                    .collect();
                ranges.sort_by_key(|r| r.start);
                ranges
            };
            // Key blocks fall at fixed keys: a task starts at its first key's block.
            let lo_long = (16_385 - want) / KB * KB;
            let lo_short = 601usize.saturating_sub(want) / KB * KB;
            for kv_head in 0..2 {
                let ranges = keys(0, kv_head);
                // The parts tile exactly the key blocks the decode sees.
                assert_eq!(ranges.first().map(|r| r.start), Some(lo_long));
                assert_eq!(ranges.last().map(|r| r.end), Some(16_385));
                assert!(ranges.windows(2).all(|p| p[0].end == p[1].start));
                let short = keys(1, kv_head);
                assert_eq!((short[0].start, short.last().unwrap().end), (lo_short, 601));
            }
            let read: usize = cut.work.tasks.iter().map(|t| t.k1 - t.k0).sum();
            assert_eq!(
                read,
                2 * (16_385 - lo_long + 601 - lo_short),
                "{threads} threads"
            );
        }
    }
    // No windows at all, and windows wider than every sequence: one global cut.
    for windows in [&[][..], &[w(20_000); 6][..]] {
        let plan = Plan::new(&seqs, shape, &rope, windows, 2);
        assert_eq!(plan.cuts.len(), 1);
        assert!(plan.cuts[0].work.tasks.iter().all(|t| t.window.is_none()));
    }
}
