//! `apply_splice` is all-or-nothing: a failure injected at each step (pool exhaustion for
//! the replacements and for the copies, a rope that cannot shift, each replacement's
//! prefill) leaves the pool, the tree and every live byte of storage as they were, and the
//! free list hands out the same slots next. A splice after a rolled-back one gives the same
//! bytes as one on an untouched twin, and its rotated keys equal an independent rotation.

use leyline_core::{Directive, DirectiveBatch, Mode, Reuse, SessionState, ValidationContext};
use leyline_kernels::rope::{LayerRopes, RopeScaling, RopeSpec, RotaryLayout};
use leyline_kv::radix::{Namespace, PrefixCache};
use leyline_kv::shift::{KeyShift, RotationMode};
use leyline_kv::slots::Lineage;
use leyline_kv::splice::{apply_splice, SpliceError, SpliceTarget};
use leyline_kv::{KvDtype, KvError, KvGeometry, KvStorage};

const GEOM: KvGeometry = KvGeometry {
    layers: 2,
    k_heads: 2,
    k_head_dim: 8,
    v_width: 12,
};
const LEN: usize = 12;
const LINEAGE: Lineage = Lineage(5);

/// Deterministic row values for (slot, layer, index).
fn val(seed: u32, layer: usize, i: usize) -> f32 {
    let x = seed.wrapping_mul(2_654_435_761) ^ (layer as u32 * 97 + i as u32 * 13);
    ((x % 2001) as f32 - 1000.0) / 700.0
}

struct World {
    cache: PrefixCache,
    kv: KvStorage,
    seq: Vec<u32>,
}

/// A 12-token sequence: tokens 0..6 also stored in the shared tree (so the moved ones among
/// them are copied on write), the rest owned by the sequence alone; `extra` free slots more
/// than the sequence needs, and `held` of them taken by something else.
fn world(dtype: KvDtype, capacity: usize, held: usize) -> World {
    let mut cache = PrefixCache::new(capacity).unwrap();
    let mut kv = KvStorage::new(GEOM, dtype, capacity).unwrap();
    let seq = cache.pool_mut().alloc(LEN).unwrap();
    for (p, &s) in seq.iter().enumerate() {
        cache.pool_mut().set_position(s, p as u32).unwrap();
        if p >= 6 {
            cache.pool_mut().set_lineage(s, LINEAGE).unwrap();
        }
        for l in 0..GEOM.layers {
            let k: Vec<f32> = (0..GEOM.k_width()).map(|i| val(s, l, i)).collect();
            let v: Vec<f32> = (0..GEOM.v_width).map(|i| val(s + 1000, l, i)).collect();
            kv.write(l, s, &k, &v).unwrap();
        }
    }
    let tokens: Vec<u32> = (100..100 + LEN as u32).collect();
    cache
        .insert(Namespace::shared(0), &tokens[..6], &seq[..6])
        .unwrap();
    let _ = cache.pool_mut().alloc(held).unwrap();
    World { cache, kv, seq }
}

fn batch(ds: Vec<(usize, usize, usize)>) -> DirectiveBatch {
    let ctx = ValidationContext {
        seq_len: LEN,
        vocab_size: 1000,
        session: SessionState::Idle,
    };
    let ds = ds
        .into_iter()
        .map(|(s, e, r)| Directive::new(s, e, vec![7; r], Mode::Amortize))
        .collect();
    DirectiveBatch::validate(ds, &ctx).unwrap()
}

/// Two rope specs, as Gemma 3's local and global layers have: layer 0 at base 1e4, layer 1
/// at base 1e6; with `dynamic`, layer 1's cannot shift.
fn rope(dynamic: bool) -> LayerRopes {
    let local = RopeSpec::plain(10_000.0, GEOM.k_head_dim, RotaryLayout::Neox);
    let mut global = RopeSpec::plain(1_000_000.0, GEOM.k_head_dim, RotaryLayout::Neox);
    if dynamic {
        global.scaling = RopeScaling::DynamicNtk {
            factor: 2.0,
            original_max_position: 64.0,
        };
    }
    LayerRopes::new(vec![local, global], vec![0, 1]).unwrap()
}

/// Everything a sequence or the tree can observe, plus the next slots the free list gives.
fn snapshot(w: &World) -> String {
    let pool = w.cache.pool();
    let mut out = String::new();
    for s in 0..pool.capacity() as u32 {
        let rc = pool.refcount(s).unwrap();
        out.push_str(&format!("{s}:{rc}"));
        if rc > 0 {
            out.push_str(&format!(
                ",{},{},{}",
                pool.position(s).unwrap(),
                pool.lineage(s).unwrap(),
                pool.is_revoked(s).unwrap()
            ));
            for l in 0..GEOM.layers {
                let mut k = vec![0.0; GEOM.k_width()];
                let mut v = vec![0.0; GEOM.v_width];
                w.kv.gather_k(l, &[s], &mut k).unwrap();
                w.kv.gather_v(l, &[s], &mut v).unwrap();
                for x in k.iter().chain(&v) {
                    out.push_str(&format!(",{:x}", x.to_bits()));
                }
            }
        }
        out.push(';');
    }
    out.push_str(&format!("{:?}", w.cache.sequences()));
    let next = pool.clone().alloc(pool.free_count()).unwrap();
    out.push_str(&format!("next:{next:?}"));
    out
}

/// A prefill that writes recognisable rows, or fails on directive `fail_at`.
fn prefill(
    fail_at: Option<usize>,
) -> impl FnMut(&mut KvStorage, leyline_kv::splice::PrefillJob<'_>) -> Result<(), String> {
    move |kv, job| {
        if Some(job.index) == fail_at {
            // Half-written before failing, as a real forward could leave it.
            kv.write(0, job.slots[0], &[9.0; 16], &[9.0; 12]).unwrap();
            return Err(format!("injected failure in replacement {}", job.index));
        }
        for (&s, p) in job.slots.iter().zip(job.positions.clone()) {
            for l in 0..GEOM.layers {
                let k: Vec<f32> = (0..GEOM.k_width()).map(|i| (p * 10 + i) as f32).collect();
                kv.write(l, s, &k, &[p as f32; 12]).unwrap();
            }
        }
        Ok(())
    }
}

fn target(seq: &[u32]) -> SpliceTarget<'_> {
    SpliceTarget {
        slots: seq,
        lineage: LINEAGE,
        clean_len: 6,
        reuse: &[],
    }
}

/// [2,4) -> 3 tokens (+1) and [8,9) -> 2 tokens (+1 more): tokens 4..8 move by 1 before
/// the second prefill (4 and 5 shared: copied; 6 and 7 owned: rotated in place), 9..12 by 2.
fn two_edits() -> DirectiveBatch {
    batch(vec![(2, 4, 3), (8, 9, 2)])
}

/// [`two_edits`] applied to `w` with `rope`, the prefill failing at `fail_at`; on success the
/// world takes the new slot list.
fn splice(
    w: &mut World,
    dynamic_rope: bool,
    fail_at: Option<usize>,
) -> Result<leyline_kv::splice::Spliced, SpliceError<String>> {
    splice_in(w, RotationMode::Eager, dynamic_rope, fail_at)
}

/// [`splice`] in either rotation mode.
fn splice_in(
    w: &mut World,
    mode: RotationMode,
    dynamic_rope: bool,
    fail_at: Option<usize>,
) -> Result<leyline_kv::splice::Spliced, SpliceError<String>> {
    let r = apply_splice(
        &mut w.cache,
        &mut w.kv,
        &rope(dynamic_rope),
        mode,
        target(&w.seq),
        &two_edits(),
        prefill(fail_at),
    );
    if let Ok(done) = &r {
        w.seq = done.slots.clone();
    }
    r
}

#[test]
fn every_injected_failure_leaves_everything_as_it_was() {
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        // Each replacement's prefill fails: rolled back, with the in-place rotation undone.
        for (fail_at, mode) in [0, 1]
            .into_iter()
            .flat_map(|f| [(f, RotationMode::Eager), (f, RotationMode::Lazy)])
        {
            let mut w = world(dtype, 64, 0);
            let before = snapshot(&w);
            let r = splice_in(&mut w, mode, false, Some(fail_at));
            assert!(
                matches!(r, Err(SpliceError::Prefill { index, .. }) if index == fail_at),
                "{dtype:?} {mode} {fail_at}: {r:?}"
            );
            assert_eq!(
                snapshot(&w),
                before,
                "{dtype:?} {mode}: failure in prefill {fail_at}"
            );
            w.cache.check_invariants().unwrap();
        }
        // A rope that cannot shift: refused before anything is allocated.
        let mut w = world(dtype, 64, 0);
        let before = snapshot(&w);
        let r = splice(&mut w, true, None);
        assert!(
            matches!(r, Err(SpliceError::Kv(KvError::NotShiftable(_)))),
            "{r:?}"
        );
        assert_eq!(snapshot(&w), before);
        // The pool is short for the replacements (5 slots), then for the copies (2 more).
        for (held, what) in [(64 - LEN - 4, "replacements"), (64 - LEN - 6, "copies")] {
            let mut w = world(dtype, 64, held);
            let before = snapshot(&w);
            let r = splice(&mut w, false, None);
            assert!(
                matches!(r, Err(SpliceError::Kv(KvError::PoolExhausted { .. }))),
                "{what}: {r:?}"
            );
            assert_eq!(snapshot(&w), before, "{dtype:?}: pool short for the {what}");
            w.cache.check_invariants().unwrap();
        }
    }
}

#[test]
fn a_splice_after_a_rollback_equals_one_on_an_untouched_twin_and_rotates_exactly() {
    let mut a = world(KvDtype::F32, 64, 0);
    let mut b = world(KvDtype::F32, 64, 0);
    // Per layer, per token: the keys before the splice.
    let originals: Vec<Vec<Vec<f32>>> = (0..GEOM.layers)
        .map(|l| {
            a.seq
                .iter()
                .map(|&s| {
                    let mut k = vec![0.0; GEOM.k_width()];
                    a.kv.gather_k(l, &[s], &mut k).unwrap();
                    k
                })
                .collect()
        })
        .collect();
    let failed = splice(&mut a, false, Some(1));
    assert!(failed.is_err());
    let done_a = splice(&mut a, false, None).unwrap();
    let done_b = splice(&mut b, false, None).unwrap();
    assert_eq!(done_a, done_b);
    assert_eq!(snapshot(&a), snapshot(&b));
    a.cache.check_invariants().unwrap();
    assert_eq!((done_a.rotated, done_a.copied, done_a.prefilled), (7, 2, 5));
    assert_eq!(
        done_a.clean_len, 5,
        "lineage from the first replacement's end on"
    );
    // Old token i lands at new index i + delta; its keys rotate by delta, head by head,
    // as the rope's own f64-phase rotation does it, each layer by its own spec.
    let ropes = rope(false);
    for (old, delta) in [(4usize, 1i64), (6, 1), (7, 1), (9, 2), (11, 2)] {
        let slot = done_a.slots[(old as i64 + delta) as usize];
        for (layer, originals) in originals.iter().enumerate() {
            let mut want = originals[old].clone();
            for h in want.chunks_mut(GEOM.k_head_dim) {
                ropes.spec(layer).rotate_f32(h, delta);
            }
            let mut got = vec![0.0; GEOM.k_width()];
            a.kv.gather_k(layer, &[slot], &mut got).unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "layer {layer} token {old}: {g} vs {w}"
                );
            }
            // The other layer's spec would give other keys: the layer map is what was used.
            let mut other = originals[old].clone();
            for h in other.chunks_mut(GEOM.k_head_dim) {
                ropes.spec(1 - layer).rotate_f32(h, delta);
            }
            assert!(got.iter().zip(&other).any(|(g, o)| (g - o).abs() > 1e-3));
        }
        assert_eq!(
            a.cache.pool().position(slot).unwrap(),
            (old as i64 + delta) as u32
        );
    }
}

#[test]
fn a_splice_that_moves_nothing_leaves_shared_slots_to_their_other_holders() {
    // [1,2) -> 1 token: delta 0, so nothing downstream is rotated or copied. Tokens 2..6
    // stay shared with the tree, which serves them for the old sequence: they keep their
    // lineage; only what the sequence holds alone takes its lineage.
    let mut w = world(KvDtype::F32, 64, 0);
    let done = apply_splice(
        &mut w.cache,
        &mut w.kv,
        &rope(false),
        RotationMode::Eager,
        target(&w.seq),
        &batch(vec![(1, 2, 1)]),
        prefill(None),
    )
    .unwrap();
    assert_eq!((done.copied, done.rotated, done.clean_len), (0, 0, 2));
    w.cache.check_invariants().unwrap();
    let pool = w.cache.pool();
    for (i, &s) in done.slots.iter().enumerate() {
        let want = if i < 6 { Lineage::SHARED } else { LINEAGE };
        assert_eq!(pool.lineage(s).unwrap(), want, "token {i}");
    }
}

/// A lazy splice writes no kept slot: the moved tokens keep their bytes and their encoded
/// positions, shared ones are not copied, the replacements sit at their own positions, and
/// a replacement's prefill reads the runs before it as shifted.
#[test]
fn a_lazy_splice_moves_nothing_and_hands_the_prefill_its_shifted_runs() {
    let mut w = world(KvDtype::F32, 64, 0);
    let old = w.seq.clone();
    let bytes = |w: &World, s: u32| {
        let mut k = vec![0.0; GEOM.k_width()];
        let mut v = vec![0.0; GEOM.v_width];
        w.kv.gather_k(1, &[s], &mut k).unwrap();
        w.kv.gather_v(1, &[s], &mut v).unwrap();
        (k, v)
    };
    let before: Vec<_> = old.iter().map(|&s| bytes(&w, s)).collect();
    let mut seen: Vec<Vec<KeyShift>> = Vec::new();
    let mut inner = prefill(None);
    let done = apply_splice(
        &mut w.cache,
        &mut w.kv,
        &rope(false),
        RotationMode::Lazy,
        target(&w.seq),
        &two_edits(),
        |kv, job| {
            seen.push(job.shifts.to_vec());
            inner(kv, job)
        },
    )
    .unwrap();
    assert_eq!((done.rotated, done.copied, done.prefilled), (0, 0, 5));
    w.cache.check_invariants().unwrap();
    // New order: 0 1 | three new | old 4..8 | two new | old 9..12.
    let kept = [0, 1, 4, 5, 6, 7, 9, 10, 11];
    let at = [0, 1, 5, 6, 7, 8, 11, 12, 13];
    let pool = w.cache.pool();
    for (&o, &n) in kept.iter().zip(&at) {
        assert_eq!(done.slots[n], old[o], "token {o} keeps its slot");
        assert_eq!(bytes(&w, old[o]), before[o], "token {o}: bytes");
        assert_eq!(
            pool.position(old[o]).unwrap(),
            o as u32,
            "token {o}: position"
        );
    }
    for n in [2, 3, 4, 9, 10] {
        assert_eq!(pool.position(done.slots[n]).unwrap(), n as u32);
    }
    let run = |a: usize, b: usize, offset: i64| KeyShift {
        range: a..b,
        offset,
    };
    assert_eq!(seen, vec![vec![], vec![run(5, 9, 1)]]);
    assert_eq!(
        pool.key_shifts(&done.slots).unwrap(),
        vec![run(5, 9, 1), run(11, 14, 2)]
    );
}

/// Compaction after a lazy splice gives the bytes and positions an eager splice gives: the
/// shifted runs are rotated by their offsets (the shared ones as copies, so the tree's
/// slots keep their bytes), and nothing is shifted afterwards.
#[test]
fn compaction_after_a_lazy_splice_equals_the_eager_splice() {
    let keys = |w: &World, slots: &[u32]| {
        let mut out = Vec::new();
        for l in 0..GEOM.layers {
            let mut k = vec![0.0; slots.len() * GEOM.k_width()];
            w.kv.gather_k(l, slots, &mut k).unwrap();
            out.extend(k.iter().map(|x| x.to_bits()));
        }
        out
    };
    let mut eager = world(KvDtype::F32, 64, 0);
    let want = splice_in(&mut eager, RotationMode::Eager, false, None).unwrap();
    let mut lazy = world(KvDtype::F32, 64, 0);
    let tree_slots = lazy.seq[..6].to_vec();
    let tree_before = keys(&lazy, &tree_slots);
    splice_in(&mut lazy, RotationMode::Lazy, false, None).unwrap();
    let done = leyline_kv::splice::compact(&mut lazy.cache, &mut lazy.kv, &rope(false), &lazy.seq)
        .unwrap();
    lazy.seq = done.slots.clone();
    // Tokens 4 and 5 are the tree's too: copied; 6, 7 and 9..12 rotated in place.
    assert_eq!((done.rotated, done.copied), (7, 2));
    assert_eq!(keys(&lazy, &lazy.seq), keys(&eager, &want.slots));
    assert_eq!(
        keys(&lazy, &tree_slots),
        tree_before,
        "the tree's slots were written"
    );
    let pool = lazy.cache.pool();
    assert!(pool.key_shifts(&lazy.seq).unwrap().is_empty());
    for (i, &s) in lazy.seq.iter().enumerate() {
        assert_eq!(pool.position(s).unwrap(), i as u32);
    }
    lazy.cache.check_invariants().unwrap();
    // Compacting what is not shifted does nothing.
    let again = leyline_kv::splice::compact(&mut lazy.cache, &mut lazy.kv, &rope(false), &lazy.seq)
        .unwrap();
    assert_eq!((again.rotated, again.copied), (0, 0));
}

type SpliceResult = Result<leyline_kv::splice::Spliced, SpliceError<String>>;
/// A prefill job as (directive, positions, tokens).
type Job = (usize, std::ops::Range<usize>, usize);

/// Old tokens 2..4 deleted and three tokens inserted at old index 9, `reuse` naming runs
/// to copy; the jobs the prefill saw as (directive, positions, tokens).
fn splice_moved(
    w: &mut World,
    mode: RotationMode,
    reuse: &[Reuse],
    fail_at: Option<usize>,
) -> (SpliceResult, Vec<Job>) {
    let seq = w.seq.clone();
    let mut jobs = Vec::new();
    let mut inner = prefill(fail_at);
    let r = apply_splice(
        &mut w.cache,
        &mut w.kv,
        &rope(false),
        mode,
        SpliceTarget {
            reuse,
            ..target(&seq)
        },
        &batch(vec![(2, 4, 0), (9, 9, 3)]),
        |kv, job| {
            jobs.push((job.index, job.positions.clone(), job.tokens.len()));
            inner(kv, job)
        },
    );
    (r, jobs)
}

/// Old tokens 2..4 move behind old token 8: deleted where they were, inserted (with one new
/// token after them) at old index 9, and the two moved tokens' KV copied from their old
/// slots instead of computed. Eager: the copies' keys are the old keys rotated by the move
/// (+5), as the rope's own rotation gives them, their values the old values bit for bit;
/// only the new token is prefilled. Lazy: the copies keep the old bytes and the old
/// encoded positions, and the prefill reads them as a shifted run. A forgotten source is
/// prefilled instead, and a failed prefill rolls the copies back.
#[test]
fn a_moved_run_is_copied_and_rotated_not_prefilled() {
    let reuse = [Reuse {
        new_range: 7..9,
        old_start: 2,
    }];
    let rows = |w: &World, l: usize, s: u32| {
        let mut k = vec![0.0; GEOM.k_width()];
        let mut v = vec![0.0; GEOM.v_width];
        w.kv.gather_k(l, &[s], &mut k).unwrap();
        w.kv.gather_v(l, &[s], &mut v).unwrap();
        (k, v)
    };
    let ropes = rope(false);
    for mode in [RotationMode::Eager, RotationMode::Lazy] {
        let mut w = world(KvDtype::F32, 64, 0);
        let old = w.seq.clone();
        let before: Vec<Vec<_>> = (0..GEOM.layers)
            .map(|l| old.iter().map(|&s| rows(&w, l, s)).collect())
            .collect();
        let (done, jobs) = splice_moved(&mut w, mode, &reuse, None);
        let done = done.unwrap();
        w.cache.check_invariants().unwrap();
        assert_eq!((done.reused(), done.prefilled), (2, 1), "{mode}");
        assert_eq!(jobs, vec![(1, 9..10, 1)], "{mode}: only the new token runs");
        assert_eq!(done.clean_len, 2, "{mode}: lineage from the first edit on");
        let pool = w.cache.pool();
        for (n, o) in [(7usize, 2usize), (8, 3)] {
            let slot = done.slots[n];
            assert!(!old.contains(&slot), "{mode}: a fresh slot holds the copy");
            assert_eq!(pool.lineage(slot).unwrap(), LINEAGE);
            for (l, before) in before.iter().enumerate() {
                let (k, v) = rows(&w, l, slot);
                assert_eq!(v, before[o].1, "{mode} layer {l}: values copied");
                let mut want = before[o].0.clone();
                if mode == RotationMode::Eager {
                    for h in want.chunks_mut(GEOM.k_head_dim) {
                        ropes.spec(l).rotate_f32(h, 5);
                    }
                }
                for (g, x) in k.iter().zip(&want) {
                    assert!(
                        (g - x).abs() <= 1e-5 * (1.0 + x.abs()),
                        "{mode} layer {l}: {g} vs {x}"
                    );
                }
            }
            let encoded = if mode == RotationMode::Eager { n } else { o };
            assert_eq!(pool.position(slot).unwrap(), encoded as u32, "{mode}");
        }
        if mode == RotationMode::Lazy {
            // Old 4..9 now at 2..7 (offset -2), the copies at 7..9 (+5), the new token at
            // its own index 9, old 9..12 at 10..13 (+1).
            let run = |range, offset| KeyShift { range, offset };
            assert_eq!(
                pool.key_shifts(&done.slots).unwrap(),
                vec![run(2..7, -2), run(7..9, 5), run(10..13, 1)]
            );
        }
        // The old slots of the moved tokens are the tree's too: kept, bytes unchanged.
        for o in [2, 3] {
            assert_eq!(rows(&w, 1, old[o]), before[1][o]);
        }
    }

    // A failed prefill after the copies: everything as it was.
    let mut w = world(KvDtype::F16, 64, 0);
    let snap = snapshot(&w);
    let (r, _) = splice_moved(&mut w, RotationMode::Eager, &reuse, Some(1));
    assert!(
        matches!(r, Err(SpliceError::Prefill { index: 1, .. })),
        "{r:?}"
    );
    assert_eq!(snapshot(&w), snap);

    // A forgotten source is not copied: the run is prefilled.
    let mut w = world(KvDtype::F32, 64, 0);
    w.cache.pool_mut().revoke(w.seq[3]).unwrap();
    let (done, jobs) = splice_moved(&mut w, RotationMode::Eager, &reuse, None);
    let done = done.unwrap();
    assert_eq!((done.reused(), done.prefilled), (0, 3));
    assert_eq!(jobs, vec![(1, 7..10, 3)]);

    // A run outside every replacement is refused before anything changes.
    let mut w = world(KvDtype::F32, 64, 0);
    let snap = snapshot(&w);
    let bad = [Reuse {
        new_range: 5..7,
        old_start: 2,
    }];
    let (r, _) = splice_moved(&mut w, RotationMode::Eager, &bad, None);
    assert!(
        matches!(r, Err(SpliceError::Kv(KvError::SpliceInput(_)))),
        "{r:?}"
    );
    assert_eq!(snapshot(&w), snap);
}
