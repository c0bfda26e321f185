use super::*;
use std::num::NonZeroUsize;

/// A key block transposed on every tier: each value lands at `[d][key]`, for head dims
/// with and without a tail past whole vectors.
#[test]
fn key_blocks_transpose_on_every_tier() {
    for hd in [16, 40, 64, 7] {
        let rows: Vec<Vec<f32>> = (0..KB)
            .map(|j| (0..hd).map(|d| (j * 1000 + d) as f32).collect())
            .collect();
        let krows: [&[f32]; KB] = std::array::from_fn(|j| rows[j].as_slice());
        Tier::note_lacking();
        for tier in Tier::all_available() {
            let mut kt = vec![f32::NAN; hd * KB];
            kernel::transpose_block(tier, &krows, KB, &mut kt, hd);
            for d in 0..hd {
                for j in 0..KB {
                    assert_eq!(
                        kt[d * KB + j],
                        rows[j][d],
                        "{tier} hd {hd}: dim {d} key {j}"
                    );
                }
            }
        }
    }
}

/// A seeded xorshift stream of values in `[-1, 1)`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// One sequence's attention call cut by hand, as a planner might (or might not) cut it.
#[derive(Debug, Clone, Copy)]
struct Cutting {
    /// Context keys before the new tokens.
    ctx: usize,
    /// New (query) tokens.
    new: usize,
    /// Query tokens per task.
    per_task: usize,
    /// Whether a task's keys are split into one task per [`SPAN`] (merged afterwards).
    split: bool,
    /// Whether tasks read from key 0 (parts below the window then hold nothing a row sees)
    /// or from the lowest key their first row's window reaches.
    from_zero: bool,
}

/// Scalar f64 sliding-window causal attention, written from the definition: the query of
/// new token `i` (index `ctx + i`) sees key `j` iff `j <= ctx + i` and `ctx + i - j < w`.
/// `k` and `v` hold key index `j`'s kv heads in row `j`.
fn reference(
    shape: Heads,
    ctx: usize,
    window: Option<usize>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Vec<f64> {
    let Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    } = shape;
    let g = h / kvh;
    let n = q.len() / (h * hd);
    let mut out = vec![0f64; n * h * hd];
    for i in 0..n {
        let at = ctx + i;
        let seen: Vec<usize> = (0..=at)
            .filter(|&j| window.is_none_or(|w| at - j < w))
            .collect();
        for head in 0..h {
            let kh = head / g;
            let qr = &q[(i * h + head) * hd..][..hd];
            let sc: Vec<f64> = seen
                .iter()
                .map(|&j| {
                    let kr = &k[(j * kvh + kh) * hd..][..hd];
                    let dot: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                    dot / (hd as f64).sqrt()
                })
                .collect();
            let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|s| (s - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            let o = &mut out[(i * h + head) * hd..][..hd];
            for (&j, p) in seen.iter().zip(&e) {
                let vr = &v[(j * kvh + kh) * hd..][..hd];
                for (o, &x) in o.iter_mut().zip(vr) {
                    *o += p / z * x as f64;
                }
            }
        }
    }
    out
}

/// The tasks of `cut` with `window`, over the context slots `context` and new slots `new`.
fn cut_tasks<'a>(
    cut: Cutting,
    shape: Heads,
    window: Option<usize>,
    context: &'a [u32],
    new: &'a [u32],
) -> Work<'a> {
    let Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    } = shape;
    let g = h / kvh;
    let Cutting {
        ctx,
        new: t,
        per_task,
        split,
        from_zero,
    } = cut;
    let mut tasks = Vec::new();
    for t0 in (0..t).step_by(per_task) {
        let t1 = (t0 + per_task).min(t);
        // From the key block of the lowest key the first row's window reaches.
        let lo = match window {
            Some(w) if !from_zero => (ctx + t0 + 1).saturating_sub(w) / KB * KB,
            _ => 0,
        };
        let mut cuts = vec![lo];
        if split {
            cuts.extend(
                (lo / SPAN + 1..)
                    .map(|s| s * SPAN)
                    .take_while(|&c| c < ctx + t1),
            );
        }
        cuts.push(ctx + t1);
        let merged = cuts.len() > 2;
        for kv_head in 0..kvh {
            let toks: Vec<(usize, usize)> =
                (t0..t1).map(|i| (i, (i * kvh + kv_head) * g)).collect();
            for keys in cuts.windows(2) {
                tasks.push(Task {
                    context,
                    new_rows: new,
                    kv_head,
                    toks: toks.clone(),
                    diag: ctx + t0,
                    window: window.and_then(NonZeroUsize::new),
                    k0: keys[0],
                    k1: keys[1],
                    merged,
                    pieces: vec![(keys[1], None)],
                    loads: vec![(keys[0], None)],
                });
            }
        }
    }
    let max_rows = tasks.iter().map(|t| t.rows(g)).max().unwrap_or(0);
    let len = tasks.iter().map(|t| t.rows(g) * (hd + 2)).sum();
    Work {
        shape,
        tasks,
        merge_rows: t * kvh * g,
        max_rows,
        scratch: vec![f32::NAN; len],
        rotations: Vec::new(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Store {
    F32,
    F16,
    /// f16 rows, each kv head's slots one after the other ([`Strides::head_major`]).
    F16Heads,
}

/// `rows: [n][heads * hd]` (heads side by side) laid out as `store` lays a pool of `n` slots
/// out: the same buffer, or each head's rows one after the other.
fn lay_out(rows: &[f32], heads: usize, hd: usize, store: Store) -> (Vec<f32>, Strides) {
    let n = rows.len() / (heads * hd);
    let want = match store {
        Store::F16Heads => Strides::head_major(n, hd),
        _ => Strides::slot_major(heads, hd),
    };
    let have = Strides::slot_major(heads, hd);
    let mut out = vec![0f32; rows.len()];
    for s in 0..n {
        for h in 0..heads {
            out[want.at(s, h)..][..hd].copy_from_slice(&rows[have.at(s, h)..][..hd]);
        }
    }
    (out, want)
}

/// Runs `cut` with `window` on every tier this CPU runs and compares each output row (one
/// token's head) with [`reference`] on the stored values: relative L2 error below 1e-5.
fn check_window(shape: Heads, cut: Cutting, window: Option<usize>, store: Store) {
    let Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    } = shape;
    let keys = cut.ctx + cut.new;
    let w = kvh * hd;
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ (keys as u64) << 9 ^ hd as u64);
    // Keys with a large common component make the softmax peaked in places; rows stored at
    // scattered slots (index j at slot `slots[j]`).
    let cap = keys + 11;
    let mut slots: Vec<u32> = (0..cap as u32).collect();
    for i in (1..slots.len()).rev() {
        let j = ((rng.next() + 1.0) * 0.5 * i as f32) as usize % (i + 1);
        slots.swap(i, j);
    }
    let round = |x: f32| match store {
        Store::F32 => x,
        Store::F16 | Store::F16Heads => crate::convert::f16_to_f32(crate::convert::f32_to_f16(x)),
    };
    let kj: Vec<f32> = (0..keys * w).map(|_| round(rng.next() * 3.0)).collect();
    let vj: Vec<f32> = (0..keys * w).map(|_| round(rng.next())).collect();
    let mut kbuf = vec![0f32; cap * w];
    let mut vbuf = vec![0f32; cap * w];
    for (j, &s) in slots[..keys].iter().enumerate() {
        kbuf[s as usize * w..][..w].copy_from_slice(&kj[j * w..][..w]);
        vbuf[s as usize * w..][..w].copy_from_slice(&vj[j * w..][..w]);
    }
    let (kbuf, strides) = lay_out(&kbuf, kvh, hd, store);
    let (vbuf, _) = lay_out(&vbuf, kvh, hd, store);
    let to16 =
        |b: &[f32]| -> Vec<u16> { b.iter().map(|&x| crate::convert::f32_to_f16(x)).collect() };
    let (k16, v16) = (to16(&kbuf), to16(&vbuf));
    let (k, v) = match store {
        Store::F32 => (RowsRef::F32(&kbuf), RowsRef::F32(&vbuf)),
        Store::F16 | Store::F16Heads => (RowsRef::F16(&k16), RowsRef::F16(&v16)),
    };
    let rows = KvRows {
        k,
        v,
        k_strides: strides,
        v_strides: strides,
    };
    let q: Vec<f32> = (0..cut.new * h * hd).map(|_| rng.next() * 2.0).collect();
    let want = reference(shape, cut.ctx, window, &q, &kj, &vj);
    let (context, new) = slots[..keys].split_at(cut.ctx);
    let pool = SpinPool::new(2);
    Tier::note_lacking();
    for tier in Tier::all_available() {
        let mut work = cut_tasks(cut, shape, window, context, new);
        let mut out = vec![f32::NAN; cut.new * h * hd];
        let queries = Queries {
            rows: &q,
            stride: h * hd,
        };
        attend(tier, &pool, rows, queries, &mut work, &mut out);
        check_parts(
            &work,
            window,
            &format!("{tier} {store:?} {shape:?} {cut:?} {window:?}"),
        );
        for (r, (got, want)) in out.chunks_exact(hd).zip(want.chunks_exact(hd)).enumerate() {
            let (mut num, mut den) = (0f64, 0f64);
            for (&a, &b) in got.iter().zip(want) {
                num += (a as f64 - b).powi(2);
                den += b * b;
            }
            let rel = (num / den).sqrt();
            assert!(
                rel < 1e-5,
                "{tier} {store:?} {shape:?} {cut:?} window {window:?}: token {} head {}: \
                 rel-L2 {rel:e} against the f64 reference",
                r / h,
                r % h
            );
        }
    }
}

/// Each task's partial output in `work.scratch`: a row that sees no key of its task (a part
/// below its window) holds zeros, max `-inf` and sum exactly 0 (so the merge weighs it 0
/// whatever the other parts hold); a row that sees some holds a finite max and a sum >= 1.
fn check_parts(work: &Work<'_>, window: Option<usize>, what: &str) {
    let hd = work.shape.head_dim;
    let g = work.shape.heads / work.shape.kv_heads;
    let mut off = 0;
    for t in &work.tasks {
        let rows = t.rows(g);
        let (o, ml) = work.scratch[off..off + rows * (hd + 2)].split_at(rows * hd);
        for r in 0..rows {
            let at = t.diag + r / g;
            let sees = (t.k0..t.k1).any(|j| j <= at && window.is_none_or(|w| at - j < w));
            let (m, l) = (ml[r], ml[rows + r]);
            if sees {
                assert!(
                    m.is_finite() && l >= 1.0,
                    "{what}: row {r} keys {}..{}: max {m} sum {l}",
                    t.k0,
                    t.k1
                );
            } else {
                assert!(
                    m == f32::NEG_INFINITY
                        && l == 0.0
                        && o[r * hd..][..hd].iter().all(|&x| x == 0.0),
                    "{what}: row {r} sees none of keys {}..{}: max {m} sum {l}",
                    t.k0,
                    t.k1
                );
            }
        }
        off += rows * (hd + 2);
    }
}

/// Windows below, at and across a key block's [`KB`] keys, of one key, and wider than the
/// context; decode rows whose keys are split into spans some of which lie wholly below
/// the window (their weight in the merge must be 0, not NaN); blocks of query tokens (the
/// transposed product) and a few (the direct one), within one span and across spans;
/// GQA groups of 1, 3 and 8; f32 storage, and f16 for groups of 3, 6 and 8 (AVX2 reads a
/// decode's 6 or 8 rows' f16 keys and values as stored) in both layouts of the pool.
#[test]
fn sliding_windows_match_a_scalar_f64_reference() {
    let shapes = [(6, 2, 64), (4, 4, 64), (8, 1, 64), (6, 2, 40)].map(|(h, kvh, hd)| Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    });
    let windows = [1, 2, 17, KB - 1, KB, KB + 1, 100, 2 * KB + 3, 5000];
    let decode = |split, from_zero| Cutting {
        ctx: SPAN + 190,
        new: 1,
        per_task: 1,
        split,
        from_zero,
    };
    let prefill = |ctx, new, per_task, split, from_zero| Cutting {
        ctx,
        new,
        per_task,
        split,
        from_zero,
    };
    let cuts = [
        decode(false, false),
        decode(false, true),
        decode(true, true),
        decode(true, false),
        // A prompt from nothing; blocks of 64 tokens after a context, split or not.
        prefill(0, 70, 64, false, false),
        prefill(150, 140, 64, false, false),
        prefill(SPAN - 60, 140, 64, true, true),
        prefill(SPAN - 60, 140, 64, false, true),
        prefill(300, 90, 32, true, false),
        // A few tokens per task: the direct product over several tokens' rows.
        prefill(200, 7, 2, false, false),
        prefill(2 * SPAN - 3, 7, 1, true, true),
    ];
    for shape in shapes {
        for cut in cuts {
            for w in windows {
                check_window(shape, cut, Some(w), Store::F32);
            }
            check_window(shape, cut, None, Store::F32);
        }
    }
    // f16 storage: GQA groups of 3 and 8 (a decode of 8 rows takes AVX2's fused f16 path).
    // Both layouts of the pool; a group of 6 with a head dim of 4 chunks of 16 and one of 8.
    let six = Heads {
        heads: 12,
        kv_heads: 2,
        head_dim: 72,
    };
    for shape in [shapes[0], shapes[2], six] {
        for cut in [decode(true, true), prefill(SPAN - 60, 140, 64, true, true)] {
            for store in [Store::F16, Store::F16Heads] {
                for w in [1, KB, 100] {
                    check_window(shape, cut, Some(w), store);
                }
                check_window(shape, cut, None, store);
            }
        }
    }
}

/// One sequence's keys, values and queries, stored at scattered slots, as f32 and as f16.
struct Prompt {
    slots: Vec<u32>,
    k: Vec<f32>,
    v: Vec<f32>,
    k16: Vec<u16>,
    v16: Vec<u16>,
    /// `k16` and `v16` laid out head-major, and their strides.
    k16h: Vec<u16>,
    v16h: Vec<u16>,
    heads: Strides,
    q: Vec<f32>,
}

impl Prompt {
    fn new(shape: Heads, keys: usize, seed: u64) -> Self {
        let w = shape.kv_heads * shape.head_dim;
        let mut rng = Rng(seed);
        let cap = keys + 5;
        let mut slots: Vec<u32> = (0..cap as u32).collect();
        for i in (1..slots.len()).rev() {
            let j = ((rng.next() + 1.0) * 0.5 * i as f32) as usize % (i + 1);
            slots.swap(i, j);
        }
        // Values that f16 holds exactly, so both stores hold the same keys.
        let round = |x: f32| crate::convert::f16_to_f32(crate::convert::f32_to_f16(x));
        let mut k = vec![0f32; cap * w];
        let mut v = vec![0f32; cap * w];
        for &s in &slots[..keys] {
            for x in &mut k[s as usize * w..][..w] {
                *x = round(rng.next() * 3.0);
            }
            for x in &mut v[s as usize * w..][..w] {
                *x = round(rng.next());
            }
        }
        let to16 = |b: &[f32]| b.iter().map(|&x| crate::convert::f32_to_f16(x)).collect();
        let q = (0..keys * shape.heads * shape.head_dim)
            .map(|_| rng.next() * 2.0)
            .collect();
        let (kh, heads) = lay_out(&k, shape.kv_heads, shape.head_dim, Store::F16Heads);
        let (vh, _) = lay_out(&v, shape.kv_heads, shape.head_dim, Store::F16Heads);
        Self {
            slots,
            k16: to16(&k),
            v16: to16(&v),
            k16h: to16(&kh),
            v16h: to16(&vh),
            heads,
            k,
            v,
            q,
        }
    }

    fn rows(&self, store: Store, shape: Heads) -> KvRows<'_> {
        let flat = Strides::slot_major(shape.kv_heads, shape.head_dim);
        let (k, v, strides) = match store {
            Store::F32 => (RowsRef::F32(&self.k), RowsRef::F32(&self.v), flat),
            Store::F16 => (RowsRef::F16(&self.k16), RowsRef::F16(&self.v16), flat),
            Store::F16Heads => (
                RowsRef::F16(&self.k16h),
                RowsRef::F16(&self.v16h),
                self.heads,
            ),
        };
        KvRows {
            k,
            v,
            k_strides: strides,
            v_strides: strides,
        }
    }
}

/// How one run cuts a prompt: into forward passes (chunks ending at `bounds`), each into
/// tasks of `per_task` tokens, split into spans or not, on `threads` threads.
#[derive(Debug, Clone)]
struct Run {
    bounds: Vec<usize>,
    per_task: usize,
    split: bool,
    threads: usize,
}

/// Every token's attention output for `run` of `prompt`.
fn run_prompt(
    tier: Tier,
    prompt: &Prompt,
    shape: Heads,
    run: &Run,
    window: Option<usize>,
    store: Store,
) -> Vec<f32> {
    let row = shape.heads * shape.head_dim;
    let keys = *run.bounds.last().expect("a chunk");
    let mut out = vec![f32::NAN; keys * row];
    let pool = SpinPool::new(run.threads);
    let rows = prompt.rows(store, shape);
    let mut c0 = 0;
    for &c1 in &run.bounds {
        let cut = Cutting {
            ctx: c0,
            new: c1 - c0,
            per_task: run.per_task,
            split: run.split,
            from_zero: false,
        };
        let (context, new) = prompt.slots[..c1].split_at(c0);
        let mut work = cut_tasks(cut, shape, window, context, new);
        let q = Queries {
            rows: &prompt.q[c0 * row..c1 * row],
            stride: row,
        };
        attend(
            tier,
            &pool,
            rows,
            q,
            &mut work,
            &mut out[c0 * row..c1 * row],
        );
        c0 = c1;
    }
    out
}

/// A query row's output bits depend on its keys only: not on how many rows share its task
/// (the direct product for a few rows, the transposed one for many), on how the prompt is
/// chunked into forward passes (cuts inside key blocks and spans too), on whether its keys
/// are split into spans merged afterwards, nor on the thread count, nor on the pool's layout;
/// on every tier, with and without a window, with f32 and f16 storage.
#[test]
fn a_rows_bits_do_not_depend_on_how_the_batch_is_cut() {
    let keys = 2 * SPAN + 77;
    // GQA groups of 4 (a token alone takes the direct product; two tokens, 8 rows, AVX2's
    // rows-across one), 1, 8 (a token alone: rows across) and 6 with a head dim that is not
    // a multiple of 8 (tail dims in AVX2's fused f16 value sums).
    let shapes = [(4, 1, 32), (3, 3, 40), (8, 1, 16), (12, 2, 20)].map(|(h, kvh, hd)| Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    });
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    let mut runs = vec![
        // Each token alone, split into spans or not.
        Run {
            bounds: vec![keys],
            per_task: 1,
            split: false,
            threads: 2,
        },
        Run {
            bounds: vec![keys],
            per_task: 1,
            split: true,
            threads: 3,
        },
        Run {
            bounds: vec![keys],
            per_task: 64,
            split: true,
            threads: 2,
        },
    ];
    // A cached head, then the tail in one pass.
    for cut in [1, KB - 1, KB, 300, SPAN, SPAN + 1, keys - 1] {
        runs.push(Run {
            bounds: vec![cut, keys],
            per_task: [3, 64, 2][cut % 3],
            split: cut % 2 == 0,
            threads: 1 + cut % 3,
        });
    }
    // Several chunks at random places, random tokens per task.
    for _ in 0..3 {
        let mut bounds: Vec<usize> = (0..4)
            .map(|_| ((rng.next() + 1.0) * 0.5 * keys as f32) as usize % keys + 1)
            .chain([keys])
            .collect();
        bounds.sort_unstable();
        bounds.dedup();
        let pick = ((rng.next() + 1.0) * 4.0) as usize;
        runs.push(Run {
            bounds,
            per_task: [1, 2, 5, 64, 100, 7, 3, 4][pick % 8],
            split: pick % 2 == 1,
            threads: 1 + pick % 3,
        });
    }
    let whole = Run {
        bounds: vec![keys],
        per_task: keys,
        split: false,
        threads: 1,
    };
    Tier::note_lacking();
    for (si, shape) in shapes.into_iter().enumerate() {
        let prompt = Prompt::new(shape, keys, 0x1234_5678 ^ si as u64);
        let row = shape.heads * shape.head_dim;
        for (window, store) in [
            (None, Store::F32),
            (Some(100), Store::F32),
            (Some(SPAN + 3), Store::F32),
            (None, Store::F16),
            (Some(KB), Store::F16),
            (None, Store::F16Heads),
        ] {
            for tier in Tier::all_available() {
                // All rows in one task, from key 0.
                // The portable tier's `mul_add` is a library call in baseline x86-64 code:
                // a few of its cuts only.
                let slow = tier == Tier::Portable && cfg!(target_arch = "x86_64");
                if slow && (si > 0 || store != Store::F32) {
                    continue;
                }
                let want = run_prompt(tier, &prompt, shape, &whole, window, store);
                if store == Store::F16Heads {
                    // Nor on how the pool lays its rows out.
                    let flat = run_prompt(tier, &prompt, shape, &whole, window, Store::F16);
                    assert!(
                        want.iter()
                            .zip(&flat)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{tier} {shape:?}: head-major rows give other bits"
                    );
                }
                for run in runs.iter().step_by(if slow { 3 } else { 1 }) {
                    let got = run_prompt(tier, &prompt, shape, run, window, store);
                    for (i, (a, b)) in got
                        .chunks_exact(row)
                        .zip(want.chunks_exact(row))
                        .enumerate()
                    {
                        assert!(
                            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{tier} {shape:?} {window:?} {store:?} {run:?}: token {i} differs"
                        );
                    }
                }
            }
        }
    }
}
