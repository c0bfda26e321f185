use super::*;
use std::num::NonZeroUsize;

/// The lane-sum trees alone ([`avx512::sum16`], [`avx2::sum8`]). Lane i of vector j holds
/// `1024 j + 2^i`, so every sum is exact in f32 and a lane taken from another vector,
/// dropped or counted twice changes it.
#[cfg(target_arch = "x86_64")]
#[test]
fn lane_sum_trees_put_each_vectors_sum_in_its_lane() {
    use std::arch::x86_64::*;
    fn check<const N: usize>(sum: impl Fn(&[[f32; N]; N]) -> [f32; N]) {
        let rows: [[f32; N]; N] = std::array::from_fn(|j| {
            std::array::from_fn(|i| j as f32 * 1024.0 + (1u32 << i) as f32)
        });
        let want: [f32; N] = std::array::from_fn(|j| rows[j].iter().sum());
        assert_eq!(sum(&rows), want, "{N}-way lane sums");
    }
    Tier::note_lacking();
    for tier in Tier::all_available() {
        match tier {
            Tier::Portable => {}
            Tier::Avx512 | Tier::Avx512Vnni => check::<16>(|rows| {
                let mut out = [0f32; 16];
                // SAFETY: the CPU runs the AVX-512 tier (it has AVX-512F); each load reads one
                // 16-float row and the store writes the 16 floats of `out`.
                unsafe {
                    let a: [__m512; 16] =
                        std::array::from_fn(|j| _mm512_loadu_ps(rows[j].as_ptr()));
                    _mm512_storeu_ps(out.as_mut_ptr(), avx512::sum16(&a));
                }
                out
            }),
            Tier::Avx2 => check::<8>(|rows| {
                let mut out = [0f32; 8];
                // SAFETY: the CPU runs the AVX2 tier (it has AVX2); each load reads one 8-float
                // row and the store writes the 8 floats of `out`.
                unsafe {
                    let a: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(rows[j].as_ptr()));
                    _mm256_storeu_ps(out.as_mut_ptr(), avx2::sum8(&a));
                }
                out
            }),
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
    /// Parts the context keys each task reads are split into (merged afterwards).
    parts: usize,
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
        parts,
        from_zero,
    } = cut;
    let mut tasks = Vec::new();
    for t0 in (0..t).step_by(per_task) {
        let t1 = (t0 + per_task).min(t);
        let lo = match window {
            Some(w) if !from_zero => (ctx + t0 + 1).saturating_sub(w),
            _ => 0,
        };
        // Context keys split at uneven places (not key-block edges); the last part also
        // holds the new tokens' keys.
        let mut cuts: Vec<usize> = (0..parts)
            .map(|p| lo + p * ctx.saturating_sub(lo) / parts + p % 3)
            .filter(|&c| c < ctx.max(lo + 1))
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        cuts.push(ctx + t1);
        let merged = cuts.len() > 2;
        for kv_head in 0..kvh {
            let toks: Vec<(usize, usize)> =
                (t0..t1).map(|i| (i, (i * kvh + kv_head) * g)).collect();
            for (p, keys) in cuts.windows(2).enumerate() {
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
                    first: p == 0,
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
        Store::F16 => crate::convert::f16_to_f32(crate::convert::f32_to_f16(x)),
    };
    let kj: Vec<f32> = (0..keys * w).map(|_| round(rng.next() * 3.0)).collect();
    let vj: Vec<f32> = (0..keys * w).map(|_| round(rng.next())).collect();
    let mut kbuf = vec![0f32; cap * w];
    let mut vbuf = vec![0f32; cap * w];
    for (j, &s) in slots[..keys].iter().enumerate() {
        kbuf[s as usize * w..][..w].copy_from_slice(&kj[j * w..][..w]);
        vbuf[s as usize * w..][..w].copy_from_slice(&vj[j * w..][..w]);
    }
    let k16: Vec<u16> = kbuf
        .iter()
        .map(|&x| crate::convert::f32_to_f16(x))
        .collect();
    let v16: Vec<u16> = vbuf
        .iter()
        .map(|&x| crate::convert::f32_to_f16(x))
        .collect();
    let rows = match store {
        Store::F32 => KvRows {
            k: RowsRef::F32(&kbuf),
            v: RowsRef::F32(&vbuf),
            k_width: w,
            v_width: w,
        },
        Store::F16 => KvRows {
            k: RowsRef::F16(&k16),
            v: RowsRef::F16(&v16),
            k_width: w,
            v_width: w,
        },
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
/// context; decode rows whose context is split into parts some of which lie wholly below
/// the window (their weight in the merge must be 0, not NaN); blocks of query tokens (the
/// transposed product) and a few (the direct one); GQA groups of 1, 3 and 8.
#[test]
fn sliding_windows_match_a_scalar_f64_reference() {
    let shapes = [(6, 2, 64), (4, 4, 64), (8, 1, 64), (6, 2, 40)].map(|(h, kvh, hd)| Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    });
    let windows = [1, 2, 17, KB - 1, KB, KB + 1, 100, 2 * KB + 3, 5000];
    let decode = |parts, from_zero| Cutting {
        ctx: 700,
        new: 1,
        per_task: 1,
        parts,
        from_zero,
    };
    let prefill = |ctx, new, per_task, parts, from_zero| Cutting {
        ctx,
        new,
        per_task,
        parts,
        from_zero,
    };
    let cuts = [
        decode(1, false),
        decode(1, true),
        decode(5, true),
        decode(3, false),
        // A prompt from nothing; blocks of 64 tokens after a context, the context split.
        prefill(0, 70, 64, 1, false),
        prefill(150, 140, 64, 1, false),
        prefill(150, 140, 64, 3, true),
        prefill(300, 90, 32, 2, false),
        // A few tokens per task: the direct product over several tokens' rows.
        prefill(200, 7, 2, 1, false),
        prefill(200, 7, 1, 4, true),
    ];
    for shape in shapes {
        for cut in cuts {
            for w in windows {
                check_window(shape, cut, Some(w), Store::F32);
            }
            check_window(shape, cut, None, Store::F32);
        }
    }
    for cut in [decode(5, true), prefill(150, 140, 64, 3, true)] {
        for w in [1, KB, 100] {
            check_window(shapes[0], cut, Some(w), Store::F16);
        }
    }
}
