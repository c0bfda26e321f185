//! Lazy rotation against eager (f32 KV), on the default model and on both tiny DeepSeek-V2
//! checkpoints (MLA: only `k_pe` is read shifted): chains of random AMORTIZE edits leave the
//! same logits whichever way the downstream keys move, a lazy splice copies and rotates
//! nothing, and KV shared with the prefix tree stays the tree's, byte for byte.
//!
//! Every test here runs on f32 activations ([`f32_activations`]): the claims are about the
//! rotation's arithmetic, and 8-bit activations (the default) turn the float noise between
//! two orders of summation into a whole rounding step wherever a value sits near a step's
//! edge, so lazy and eager would differ by that step, not by anything the rotation did.

mod common;

use common::{encode, f32_activations, lm, request, session_with};
use leyline_core::{Directive, Mode};
use leyline_engine::{Engine, EngineConfig, SessionEdits, SessionRequest};
use leyline_kv::shift::RotationMode;
use leyline_kv::KvDtype;
use leyline_model::CausalLm;
use std::path::PathBuf;
use std::sync::Arc;

fn engine(rotation: RotationMode) -> Engine {
    engine_with(&lm().model, rotation, EngineConfig::new(8192).max_segments)
}

fn engine_with(model: &Arc<dyn CausalLm>, rotation: RotationMode, max_segments: usize) -> Engine {
    let cfg = EngineConfig {
        prefill_chunk: 256,
        kv_dtype: KvDtype::F32,
        rotation,
        max_segments,
        ..EngineConfig::new(8192)
    };
    Engine::new(Arc::clone(model), cfg).unwrap()
}

/// A tiny DeepSeek-V2 checkpoint of the model crate's fixtures (`plain` or `yarn`).
fn mla(name: &str) -> Arc<dyn CausalLm> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../leyline-model/tests/fixtures/mla")
        .join(name);
    leyline_model::arch::deepseek2::load_dir(&dir).expect("load the tiny DeepSeek-V2 checkpoint")
}

/// An agent-like context of a few hundred tokens.
fn context() -> Vec<u32> {
    let mut text =
        String::from("<|im_start|>system\nYou book train journeys. Use the tools.<|im_end|>\n");
    for (i, city) in ["Lyon", "Turin", "Basel", "Milan", "Geneva", "Bern"]
        .iter()
        .enumerate()
    {
        text.push_str(&format!(
            "<|im_start|>user\nWhich trains leave {city} after {h}:00?<|im_end|>\n\
             <|im_start|>assistant\n<tool_call>{{\"name\": \"timetable\", \"arguments\": \
             {{\"from\": \"{city}\"}}}}</tool_call><|im_end|>\n<|im_start|>tool\n\
             [{{\"train\": \"IC {n}\", \"departs\": \"{h}:12\", \"seats\": {s}}}, \
             {{\"train\": \"EC {m}\", \"departs\": \"{h}:47\", \"seats\": 0}}]<|im_end|>\n",
            h = 8 + i,
            n = 700 + 13 * i,
            m = 150 + 7 * i,
            s = 3 * i + 1,
        ));
    }
    text.push_str("<|im_start|>user\nSo which one do I take?<|im_end|>\n<|im_start|>assistant\n");
    encode(&text)
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// One or two random non-overlapping AMORTIZE directives on a sequence of `tokens`, after
/// its first `keep` tokens: deletions, replacements and insertions of up to 12 tokens, the
/// replacements drawn from `pool`; past `cap` tokens it mostly shrinks.
fn random_batch(
    rng: &mut Rng,
    tokens: &[u32],
    keep: usize,
    pool: &[u32],
    cap: usize,
) -> Vec<Directive> {
    let n = tokens.len();
    let mut out: Vec<Directive> = Vec::new();
    let mut from = keep;
    for _ in 0..1 + rng.below(2) {
        if from + 2 >= n {
            break;
        }
        let start = from + rng.below((n - from) / 2);
        // Longer contexts shrink more often than they grow.
        let cut = rng.below(13).min(n - start - 1);
        let grow = if n > cap { 4 } else { 13 };
        let len = rng.below(grow);
        if cut == 0 && len == 0 {
            continue;
        }
        let at = rng.below(pool.len() - len);
        out.push(Directive::new(
            start,
            start + cut,
            pool[at..at + len].to_vec(),
            Mode::Amortize,
        ));
        from = start + cut + 1;
    }
    if out.is_empty() {
        out.push(Directive::new(keep, keep + 1, vec![], Mode::Amortize));
    }
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// 100 random splices of `model` on twin sessions holding `ctx`, eager and lazy (compacted
/// past `max_segments`), compared by the logits after `probe`; the lazy one's compactions.
fn chain(
    model: &Arc<dyn CausalLm>,
    ctx: &[u32],
    probe: &[u32],
    cap: usize,
    max_segments: usize,
    bound: f32,
) -> usize {
    let ctx = ctx.to_vec();
    let mut eager = engine_with(model, RotationMode::Eager, usize::MAX);
    let mut lazy = engine_with(model, RotationMode::Lazy, max_segments);
    let mut compactions = 0;
    let (ide, idl) = (
        session_with(&mut eager, &ctx),
        session_with(&mut lazy, &ctx),
    );
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut worst = 0f32;
    for step in 1..=100 {
        let tokens = lazy.session_info(idl).unwrap().tokens;
        let batch = random_batch(&mut rng, &tokens, 20, &ctx, cap);
        let before = lazy.session_info(idl).unwrap().slots;
        let re = eager.apply_directives(ide, batch.clone()).unwrap();
        let rl = lazy.apply_directives(idl, batch.clone()).unwrap();
        assert_eq!(re.new_len, rl.new_len);
        if rl.compacted {
            compactions += 1;
        } else {
            assert_eq!((rl.rotated, rl.copied), (0, 0), "step {step}: {rl:?}");
            // Zero copy: every kept token keeps its slot.
            let after = lazy.session_info(idl).unwrap().slots;
            let kept: usize = after.iter().filter(|s| before.contains(s)).count();
            assert_eq!(kept, rl.reused, "step {step}");
        }
        assert_eq!(
            eager.session_info(ide).unwrap().tokens,
            lazy.session_info(idl).unwrap().tokens
        );
        if [1, 10, 100].contains(&step) {
            let a = eager.peek_logits(ide, probe).unwrap();
            let b = lazy.peek_logits(idl, probe).unwrap();
            let d = max_diff(&a, &b);
            let rel = d / a.iter().fold(0f32, |m, x| m.max(x.abs()));
            eprintln!(
                "limit {max_segments}, after {step} splices ({compactions} compactions): \
                 lazy vs eager max |logit diff| {d:e} ({rel:e} of the largest logit)"
            );
            assert!(
                rel < 1e-5,
                "after {step} splices: lazy and eager logits {rel:e} apart, relative"
            );
            worst = worst.max(d);
            assert!(
                d < bound,
                "after {step} splices: {d} between lazy and eager logits (bound {bound:e})"
            );
        }
    }
    // A turn after the chain decodes from the shifted context in both engines alike.
    let turn = |e: &mut Engine, id| {
        let mut t = e.session_info(id).unwrap().tokens;
        t.extend_from_slice(&ctx[..8]);
        let (req, out) = request(t, 12);
        e.submit(req.in_session(SessionRequest {
            id,
            mode: Mode::Amortize,
            edits: SessionEdits::Tokens,
        }));
        e.run_to_completion().unwrap();
        let o = out.lock().unwrap();
        assert!(o.failed.is_none(), "{:?}", o.failed);
        o.tokens.clone()
    };
    assert_eq!(turn(&mut eager, ide), turn(&mut lazy, idl));
    eprintln!("worst lazy vs eager logit difference: {worst:e}");
    eager.check_no_leaks().unwrap();
    lazy.check_no_leaks().unwrap();
    compactions
}

/// The f32 floor of SmolLM2's logits on `ctx`: how far two exact eager computations of the
/// same context are apart when only their prefill chunks differ (so their sums round in
/// other orders).
fn f32_floor(model: &Arc<dyn CausalLm>, ctx: &[u32], probe: &[u32]) -> f32 {
    let logits = |chunk: usize| {
        let cfg = EngineConfig {
            prefill_chunk: chunk,
            kv_dtype: KvDtype::F32,
            ..EngineConfig::new(8192)
        };
        let mut e = Engine::new(Arc::clone(model), cfg).unwrap();
        let id = session_with(&mut e, ctx);
        e.peek_logits(id, probe).unwrap()
    };
    let base = logits(256);
    [17, 33, 64, 100]
        .into_iter()
        .map(|c| max_diff(&base, &logits(c)))
        .fold(0f32, f32::max)
}

/// SmolLM2's logits are tens in size, and two eager runs that only chunk their prefill
/// differently are already 2e-5 to 5e-5 apart; an absolute 1e-5 is under that floor, so
/// lazy against eager is held to twice the floor measured here, and to 1e-5 relative to the
/// largest logit (the MLA checkpoints, whose logits are small, to 1e-5 absolute as well).
#[test]
fn lazy_and_eager_chains_give_the_same_logits() {
    f32_activations();
    let (ctx, probe) = (context(), encode(" The"));
    let m = &lm().model;
    let floor = f32_floor(m, &ctx, &probe);
    eprintln!("f32 floor of the logits (eager, prefill chunks 256 vs 17/33/64/100): {floor:e}");
    assert!(floor > 0.0, "prefill chunking changed no rounding");
    let bound = 2.0 * floor;
    assert_eq!(
        chain(m, &ctx, &probe, 700, usize::MAX, bound),
        0,
        "compaction is off"
    );
    let n = chain(
        m,
        &ctx,
        &probe,
        700,
        EngineConfig::new(8192).max_segments,
        bound,
    );
    assert!(n > 0, "100 splices never passed the segment limit");
}

/// MLA: the same chains on both tiny checkpoints (plain RoPE and YaRN, 512 positions).
#[test]
fn mla_lazy_and_eager_chains_give_the_same_logits() {
    f32_activations();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for name in ["plain", "yarn"] {
        let m = mla(name);
        let vocab = m.info().vocab_size;
        let ctx: Vec<u32> = (0..240).map(|_| rng.below(vocab) as u32).collect();
        assert_eq!(chain(&m, &ctx, &[7], 300, usize::MAX, 1e-5), 0, "{name}");
        let n = chain(&m, &ctx, &[7], 300, 8, 1e-5);
        assert!(n > 0, "{name}: 100 splices never passed 8 segments");
    }
}

/// A session whose context the prefix tree also holds: a lazy splice writes none of the
/// tree's slots (their bytes are unchanged, nothing is copied), and a plain request for the
/// original context still gets the original's logits.
#[test]
fn a_lazy_splice_shares_the_trees_slots_and_leaves_them_as_they_were() {
    f32_activations();
    let ctx = context();
    let mut e = engine(RotationMode::Lazy);
    // A plain request leaves the context in the prefix tree; the session then matches it.
    let (req, out) = request(ctx.clone(), 1);
    e.submit(req);
    e.run_to_completion().unwrap();
    let first = out.lock().unwrap().tokens.clone();
    let id = session_with(&mut e, &ctx);
    let slots = e.session_info(id).unwrap().slots;
    let shared = slots
        .iter()
        .filter(|&&s| e.cache().pool().refcount(s).unwrap() > 1)
        .count();
    assert!(
        shared > ctx.len() / 2,
        "only {shared} slots shared with the tree"
    );
    let bytes = |e: &Engine, slots: &[u32]| {
        let g = e.storage().geometry();
        let mut k = vec![0.0; slots.len() * g.k_width()];
        e.storage().gather_k(1, slots, &mut k).unwrap();
        k
    };
    let before = bytes(&e, &slots);
    let r = e
        .apply_directives(
            id,
            vec![Directive::new(30, 60, encode(" (cut)"), Mode::Amortize)],
        )
        .unwrap();
    assert_eq!((r.rotated, r.copied), (0, 0));
    assert_eq!(bytes(&e, &slots), before, "a lazy splice wrote cached keys");
    let (req, out) = request(ctx.clone(), 1);
    e.submit(req);
    e.run_to_completion().unwrap();
    assert_eq!(out.lock().unwrap().tokens, first);
    e.check_no_leaks().unwrap();
}

/// A compaction whose copies do not fit the pool is put off, not failed: the splice stands,
/// no idle session is shed for it, and a later splice compacts once there is room.
#[test]
fn a_compaction_without_room_waits_for_a_later_splice() {
    f32_activations();
    let a = context();
    // Another conversation, longer than `a`: once it is gone, `a`'s copies fit.
    let turn = "<|im_start|>user\nWill it snow in Zermatt tomorrow morning, and how cold will \
                it be at the station?<|im_end|>\n<|im_start|>assistant\nLight snow after \
                six, minus four at the station.<|im_end|>\n";
    let b = encode(&turn.repeat(a.len() / encode(turn).len() + 2));
    assert!(b.len() > a.len());
    // Room for both contexts and a little more: copying `a`'s shared keys does not fit.
    let cfg = EngineConfig {
        prefill_chunk: 256,
        kv_dtype: KvDtype::F32,
        rotation: RotationMode::Lazy,
        max_segments: 1,
        ..EngineConfig::new(a.len() + b.len() + 48)
    };
    let mut e = Engine::new(Arc::clone(&lm().model), cfg).unwrap();
    // A plain request leaves `a` in the prefix tree, so the session shares its slots.
    let (req, out) = request(a.clone(), 1);
    e.submit(req);
    e.run_to_completion().unwrap();
    assert!(out.lock().unwrap().failed.is_none());
    let id = session_with(&mut e, &a);
    let other = session_with(&mut e, &b);
    let cut = |at: usize| {
        vec![Directive::new(
            at,
            at + 20,
            encode(" (cut)"),
            Mode::Amortize,
        )]
    };
    let runs = |e: &Engine| {
        let slots = e.session_info(id).unwrap().slots;
        let shifts = e.cache().pool().key_shifts(&slots).unwrap();
        leyline_kv::shift::segment_count(&shifts, slots.len())
    };
    let r = e.apply_directives(id, cut(40)).unwrap();
    assert!(!r.compacted, "the copies cannot fit, yet it compacted");
    assert!(runs(&e) > 1, "the splice left no shifted run");
    assert_eq!(e.metrics().snapshot().compactions_deferred, 1);
    assert_eq!(
        e.session_info(other).unwrap().tokens,
        b,
        "an idle session lost its KV to a compaction"
    );
    assert_eq!(e.session_info(other).unwrap().slots.len(), b.len());
    e.delete_session(other).unwrap();
    let r = e.apply_directives(id, cut(100)).unwrap();
    assert!(r.compacted, "room was made, yet the runs stayed");
    assert_eq!(runs(&e), 1);
    e.check_no_leaks().unwrap();
}
