//! AMORTIZE with repair on the default model (f32 KV): a repair that covers the whole
//! downstream gives FORGET's logits, a repair of k tokens writes only their slots, a repair
//! of KV shared with the prefix tree writes copies, never the tree's slots, and the
//! deviation rule's selection pass measures what a recompute measures.

mod common;

use common::{encode, lm, request, session_with};
use leyline_core::{Directive, Mode, Repair, RepairRule};
use leyline_engine::{Engine, EngineConfig, SessionId, REPAIR_DEVIATION_LAYER};
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::{ForwardSeq, LogitsFor};
use std::sync::Arc;

fn engine() -> Engine {
    let cfg = EngineConfig {
        prefill_chunk: 256,
        kv_dtype: KvDtype::F32,
        ..EngineConfig::new(4096)
    };
    Engine::new(Arc::clone(&lm().model), cfg).unwrap()
}

/// A context with a tool output in the middle, the output's span, and a stub for it.
fn context() -> (Vec<u32>, usize, usize, Vec<u32>) {
    let head = encode(
        "<|im_start|>system\nYou help with train travel. Use tools.<|im_end|>\n\
         <|im_start|>user\nWhat trains go from Lyon to Turin tomorrow morning?<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>{\"name\": \"timetable\", \"arguments\": {\"from\": \"Lyon\", \"to\": \"Turin\"}}</tool_call><|im_end|>\n\
         <|im_start|>tool\n",
    );
    let tool = encode(
        "[{\"train\": \"TGV 9241\", \"departs\": \"06:52\", \"arrives\": \"10:41\", \"seats\": 12}, \
         {\"train\": \"FR 9603\", \"departs\": \"08:10\", \"arrives\": \"12:05\", \"seats\": 0}, \
         {\"train\": \"TGV 9245\", \"departs\": \"10:30\", \"arrives\": \"14:22\", \"seats\": 57}]",
    );
    let tail = encode(
        "<|im_end|>\n<|im_start|>assistant\nThe 06:52 TGV 9241 has 12 seats left; the 08:10 is full.<|im_end|>\n\
         <|im_start|>user\nAnd is there one after ten?<|im_end|>\n<|im_start|>assistant\n",
    );
    let (start, end) = (head.len(), head.len() + tool.len());
    let ctx = [head, tool, tail].concat();
    (ctx, start, end, encode("[evicted: older tool output]"))
}

/// Per token of the session: a checksum of its key and value rows in every layer.
fn slot_sums(e: &Engine, id: SessionId) -> Vec<u64> {
    let slots = e.session_info(id).unwrap().slots;
    sums_of(e, &slots)
}

fn sums_of(e: &Engine, slots: &[u32]) -> Vec<u64> {
    let g = e.storage().geometry();
    let mut sums = vec![0u64; slots.len()];
    for l in 0..g.layers {
        let mut k = vec![0.0; slots.len() * g.k_width()];
        let mut v = vec![0.0; slots.len() * g.v_width];
        e.storage().gather_k(l, slots, &mut k).unwrap();
        e.storage().gather_v(l, slots, &mut v).unwrap();
        for (i, sum) in sums.iter_mut().enumerate() {
            let rows = k[i * g.k_width()..(i + 1) * g.k_width()]
                .iter()
                .chain(&v[i * g.v_width..(i + 1) * g.v_width]);
            for x in rows {
                *sum = sum.rotate_left(5) ^ u64::from(x.to_bits());
            }
        }
    }
    sums
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The logits after `probe` once `directive` is applied to a fresh session on `ctx`.
fn logits_after(ctx: &[u32], directive: Directive, repair: Option<Repair>) -> Vec<f32> {
    let mut e = engine();
    let id = session_with(&mut e, ctx);
    let r = e
        .apply_directives_repaired(id, vec![directive], repair)
        .unwrap();
    if let Some(repair) = repair.filter(|r| !r.is_none()) {
        assert!(r.repaired > 0, "{repair}: nothing recomputed");
    }
    let logits = e.peek_logits(id, &encode(" The")).unwrap();
    e.check_no_leaks().unwrap();
    logits
}

#[test]
fn a_repair_of_the_whole_downstream_gives_forgets_logits() {
    let (ctx, start, end, stub) = context();
    let d = |mode| Directive::new(start, end, stub.clone(), mode);
    let forget = logits_after(&ctx, d(Mode::Forget), None);
    let plain = logits_after(&ctx, d(Mode::Amortize), Some(Repair::NONE));
    let gap = max_diff(&plain, &forget);
    eprintln!("AMORTIZE without repair vs FORGET: {gap}");
    assert!(
        gap > 1e-2,
        "the splice alone already equals FORGET ({gap}): nothing to test"
    );
    for rule in [
        RepairRule::AfterEdit,
        RepairRule::BeforeEnd,
        RepairRule::Deviation,
    ] {
        let repair = Repair::new(ctx.len(), rule);
        let got = logits_after(&ctx, d(Mode::Amortize), Some(repair));
        let diff = max_diff(&got, &forget);
        eprintln!("{repair} vs FORGET: {diff}");
        assert!(diff < 1e-3, "{repair}: {diff} from FORGET's logits");
    }
}

#[test]
fn a_repair_of_k_tokens_rewrites_those_and_no_other() {
    let (ctx, start, end, stub) = context();
    let d = Directive::new(start, end, stub.clone(), Mode::Amortize);
    let after = |repair| {
        let mut e = engine();
        let id = session_with(&mut e, &ctx);
        let r = e
            .apply_directives_repaired(id, vec![d.clone()], Some(repair))
            .unwrap();
        (r, slot_sums(&e, id))
    };
    let (r0, base) = after(Repair::NONE);
    assert_eq!(r0.repaired, 0);
    let stub_end = start + stub.len();
    let len = r0.new_len;
    for (repair, range) in [
        (
            Repair::new(4, RepairRule::AfterEdit),
            stub_end..stub_end + 4,
        ),
        (Repair::new(6, RepairRule::BeforeEnd), len - 6..len),
    ] {
        let (r, sums) = after(repair);
        assert_eq!(r.repaired, range.len(), "{repair}");
        for (i, (a, b)) in base.iter().zip(&sums).enumerate() {
            if range.contains(&i) {
                assert_ne!(a, b, "{repair}: token {i} was not recomputed");
            } else {
                assert_eq!(a, b, "{repair}: token {i} changed outside {range:?}");
            }
        }
    }
    // By deviation: five tokens somewhere downstream, after a pass over all of them.
    let repair = Repair::new(5, RepairRule::Deviation);
    let (r, sums) = after(repair);
    assert_eq!((r.repaired, r.scanned), (5, len - stub_end));
    let changed: Vec<usize> = (0..len).filter(|&i| base[i] != sums[i]).collect();
    assert_eq!(changed.len(), 5, "{changed:?}");
    assert!(changed.iter().all(|&i| i >= stub_end), "{changed:?}");
}

/// Writes `tokens` at positions 0.. into slots `first..` of `kv`; returns the slots.
fn prefill(kv: &mut KvStorage, tokens: &[u32], first: u32) -> Vec<u32> {
    let slots: Vec<u32> = (first..first + tokens.len() as u32).collect();
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let seq = ForwardSeq {
        tokens,
        positions: &positions,
        context: &[],
        new_slots: &slots,
        logits: LogitsFor::None,
        shifts: &[],
    };
    lm().model.forward(kv, &[seq]).unwrap();
    slots
}

#[test]
fn the_deviation_pass_measures_how_far_a_recompute_moves_the_kv() {
    let (ctx, start, end, _) = context();
    // Same length, so the old downstream KV sits at the positions of the new.
    let mut edited = ctx.clone();
    for t in &mut edited[start..end] {
        *t = encode(" x")[0];
    }
    let model = &lm().model;
    let n = ctx.len() as u32;
    let mut kv = KvStorage::new(model.info().geometry, KvDtype::F32, 4 * n as usize).unwrap();
    let old = prefill(&mut kv, &ctx, 0);
    let new = prefill(&mut kv, &edited, n);
    let down = end..ctx.len();
    let scratch: Vec<u32> = (2 * n..2 * n + down.len() as u32).collect();
    let positions: Vec<u32> = (down.start as u32..n).collect();
    let deviation = |kv: &mut KvStorage, context: &[u32], cached: &[u32]| {
        let seq = ForwardSeq {
            tokens: &edited[down.clone()],
            positions: &positions,
            context,
            new_slots: &scratch,
            logits: LogitsFor::None,
            shifts: &[],
        };
        model
            .kv_deviation(kv, seq, REPAIR_DEVIATION_LAYER, cached)
            .unwrap()
    };
    // Reference: the exact edited context's KV at that layer against the stale KV.
    let g = kv.geometry();
    let rows = |kv: &KvStorage, slots: &[u32]| {
        let mut k = vec![0.0; slots.len() * g.k_width()];
        let mut v = vec![0.0; slots.len() * g.v_width];
        kv.gather_k(REPAIR_DEVIATION_LAYER, slots, &mut k).unwrap();
        kv.gather_v(REPAIR_DEVIATION_LAYER, slots, &mut v).unwrap();
        (k, v)
    };
    let (ok, ov) = rows(&kv, &old[down.clone()]);
    let (nk, nv) = rows(&kv, &new[down.clone()]);
    let got = deviation(&mut kv, &new[..down.start], &old[down.clone()]);
    assert_eq!(got.len(), down.len());
    let (kw, vw) = (g.k_width(), g.v_width);
    let mut largest = 0f32;
    for (i, &d) in got.iter().enumerate() {
        let sq: f64 = (0..kw)
            .map(|j| f64::from(nk[i * kw + j] - ok[i * kw + j]).powi(2))
            .chain((0..vw).map(|j| f64::from(nv[i * vw + j] - ov[i * vw + j]).powi(2)))
            .sum();
        let want = sq.sqrt() as f32;
        assert!(
            (d - want).abs() <= 1e-3 * want.max(1.0),
            "token {i}: {d} vs {want}"
        );
        largest = largest.max(want);
    }
    assert!(largest > 0.1, "the edit moved no downstream KV ({largest})");
    // Against KV computed in the same context, nothing moves.
    let same = deviation(&mut kv, &new[..down.start], &new[down.clone()]);
    assert!(same.iter().all(|&d| d < 1e-3), "{same:?}");
}

#[test]
fn a_repair_writes_copies_of_slots_the_prefix_tree_shares() {
    let (ctx, start, end, _) = context();
    let mut e = engine();
    // A plain request leaves `ctx` in the shared tree; the session then reuses those slots.
    let (req, out) = request(ctx.clone(), 1);
    e.submit(req);
    e.run_to_completion().unwrap();
    assert!(out.lock().unwrap().failed.is_none());
    let id = session_with(&mut e, &ctx);
    let before = e.session_info(id).unwrap().slots;
    let tree_sums = sums_of(&e, &before);
    // Same length: the splice moves nothing, so the downstream slots stay shared.
    let same_len = vec![encode(" x")[0]; end - start];
    let repair = Repair::new(8, RepairRule::AfterEdit);
    let r = e
        .apply_directives_repaired(
            id,
            vec![Directive::new(start, end, same_len, Mode::Amortize)],
            Some(repair),
        )
        .unwrap();
    assert_eq!(r.repaired, 8);
    let after = e.session_info(id).unwrap().slots;
    let pool = e.cache().pool();
    for i in end..end + 8 {
        assert_ne!(
            after[i], before[i],
            "token {i} was repaired in the tree's slot"
        );
        assert!(!pool.lineage(after[i]).unwrap().is_shared(), "token {i}");
        assert_eq!(pool.refcount(after[i]).unwrap(), 1, "token {i}");
    }
    // The tree's slots hold what they held.
    assert_eq!(sums_of(&e, &before[end..]), tree_sums[end..].to_vec());
    e.check_no_leaks().unwrap();
    e.delete_session(id).unwrap();
    e.check_no_leaks().unwrap();
}
