//! Sessions and directives on the default model: AMORTIZE against an independently built
//! reference, atomicity, isolation between sessions, and FORGET's erasure.
//!
//! Every test here runs on f32 activations ([`common::f32_activations`]): the reference
//! rotates keys in f64, the engine in f32, and on 8-bit activations (the default) that
//! noise becomes whole rounding steps (0.5 logits on SmolLM2, measured), so the bound
//! would measure the rounding, not the splice. Splices on the default path are checked
//! against their own unspliced computations in `arch_splices.rs`.

mod common;

use common::{encode, lm, request};
use leyline_core::{Directive, Mode};
use leyline_engine::{
    Engine, EngineConfig, EngineError, Event, Request, SessionEdits, SessionId, SessionRequest,
};
use leyline_kernels::rope::RotaryLayout;
use leyline_kv::slots::Lineage;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::{ForwardSeq, LogitsFor};
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

fn engine(slots: usize) -> Engine {
    engine_with(slots, leyline_engine::DEFAULT_KV_DTYPE)
}

fn engine_with(slots: usize, kv_dtype: KvDtype) -> Engine {
    let cfg = EngineConfig {
        prefill_chunk: 256,
        kv_dtype,
        ..EngineConfig::new(slots)
    };
    Engine::new(Arc::clone(&lm().model), cfg).unwrap()
}

/// Runs a session request to completion; returns the generated tokens.
fn turn(
    e: &mut Engine,
    id: SessionId,
    prompt: &[u32],
    edits: Vec<Directive>,
    mode: Mode,
    n: usize,
) -> Vec<u32> {
    let out = Arc::new(Mutex::new((Vec::new(), None::<String>)));
    let o = Arc::clone(&out);
    let sink = Box::new(move |ev| {
        let mut o = o.lock().unwrap();
        match ev {
            Event::Token(t) => o.0.push(t),
            Event::Failed(m) => o.1 = Some(m.message),
            Event::Finished { .. } | Event::Logprobs(_) => {}
        }
        ControlFlow::Continue(())
    });
    e.submit(
        Request::greedy(prompt.to_vec(), n, sink).in_session(SessionRequest {
            id,
            mode,
            edits: SessionEdits::Directives(edits),
        }),
    );
    e.run_to_completion().unwrap();
    let o = out.lock().unwrap();
    assert!(o.1.is_none(), "{:?}", o.1);
    o.0.clone()
}

fn context() -> Vec<u32> {
    encode(
        "<|im_start|>system\nYou are a travel agent. Use tools to look things up.<|im_end|>\n\
         <|im_start|>user\nFind me a flight from Paris to Rome on Friday.<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>{\"name\": \"search_flights\", \"arguments\": {\"from\": \"CDG\", \"to\": \"FCO\"}}</tool_call><|im_end|>\n\
         <|im_start|>tool\n[{\"flight\": \"AF1404\", \"departs\": \"07:15\", \"price\": 182}, {\"flight\": \"AZ317\", \"departs\": \"09:40\", \"price\": 149}, {\"flight\": \"FR9801\", \"departs\": \"13:05\", \"price\": 61}]<|im_end|>\n\
         <|im_start|>assistant\nThe cheapest option is FR9801 at 13:05 for 61 euros.<|im_end|>\n\
         <|im_start|>user\nGreat, which one leaves earliest?<|im_end|>\n<|im_start|>assistant\n",
    )
}

/// The span of the tool output in `context()`, and a stub for it.
fn tool_span(ctx: &[u32]) -> (usize, usize, Vec<u32>) {
    let tool = encode("<|im_start|>tool\n");
    let end_marker = encode("<|im_end|>");
    let start = ctx
        .windows(tool.len())
        .position(|w| w == tool.as_slice())
        .unwrap()
        + tool.len();
    let end = start
        + ctx[start..]
            .windows(end_marker.len())
            .position(|w| w == end_marker.as_slice())
            .unwrap();
    (start, end, encode("[evicted: older tool output]"))
}

/// Independent f64 rotation of one head (interleaved or halves) from `from` to `to`.
fn rerotate(
    x: &mut [f32],
    theta: f64,
    rotary_dim: usize,
    layout: RotaryLayout,
    from: f64,
    to: f64,
) {
    let half = rotary_dim / 2;
    for i in 0..half {
        let f = theta.powf(-(2.0 * i as f64) / rotary_dim as f64);
        let (s, c) = ((to - from) * f).sin_cos();
        let (a, b) = match layout {
            RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
            RotaryLayout::Neox => (i, i + half),
        };
        let (xa, xb) = (x[a] as f64, x[b] as f64);
        x[a] = (xa * c - xb * s) as f32;
        x[b] = (xa * s + xb * c) as f32;
    }
}

/// What the splice should produce, built without the engine: prefill the original context,
/// move the downstream keys to their new positions in f64, keep their values, prefill the
/// replacement after the prefix, then score `probe`.
fn reference_logits(
    ctx: &[u32],
    start: usize,
    end: usize,
    repl: &[u32],
    probe: &[u32],
) -> Vec<f32> {
    let m = lm().model.as_ref();
    let info = m.info();
    let g = info.geometry;
    let n = ctx.len();
    let cap = n + repl.len() + probe.len() + 4;
    let mut kv = KvStorage::new(g, KvDtype::F32, cap).unwrap();
    let pos: Vec<u32> = (0..n as u32).collect();
    m.forward(
        &mut kv,
        &[ForwardSeq {
            tokens: ctx,
            positions: &pos,
            context: &[],
            new_slots: &pos,
            logits: LogitsFor::None,
            shifts: &[],
        }],
    )
    .unwrap();
    let delta = repl.len() as i64 - (end - start) as i64;
    let kw = g.k_width();
    for layer in 0..g.layers {
        for j in end..n {
            let mut k = vec![0f32; kw];
            let mut v = vec![0f32; g.v_width];
            kv.gather_k(layer, &[j as u32], &mut k).unwrap();
            kv.gather_v(layer, &[j as u32], &mut v).unwrap();
            let rope = info.rope.spec(layer);
            for h in k.chunks_exact_mut(g.k_head_dim) {
                rerotate(
                    h,
                    rope.theta,
                    rope.rotary_dim,
                    rope.layout,
                    j as f64,
                    (j as i64 + delta) as f64,
                );
            }
            kv.write(layer, j as u32, &k, &v).unwrap();
        }
    }
    // New sequence: prefix slots, replacement slots (fresh, after n), downstream slots.
    let repl_slots: Vec<u32> = (n as u32..(n + repl.len()) as u32).collect();
    let mut seq_slots: Vec<u32> = (0..start as u32).collect();
    if !repl.is_empty() {
        let rpos: Vec<u32> = (start as u32..(start + repl.len()) as u32).collect();
        m.forward(
            &mut kv,
            &[ForwardSeq {
                tokens: repl,
                positions: &rpos,
                context: &seq_slots,
                new_slots: &repl_slots,
                logits: LogitsFor::None,
                shifts: &[],
            }],
        )
        .unwrap();
    }
    seq_slots.extend_from_slice(&repl_slots);
    seq_slots.extend(end as u32..n as u32);
    let base = seq_slots.len() as u32;
    let ppos: Vec<u32> = (base..base + probe.len() as u32).collect();
    let pslots: Vec<u32> =
        ((n + repl.len()) as u32..(n + repl.len() + probe.len()) as u32).collect();
    m.forward(
        &mut kv,
        &[ForwardSeq {
            tokens: probe,
            positions: &ppos,
            context: &seq_slots,
            new_slots: &pslots,
            logits: LogitsFor::Last,
            shifts: &[],
        }],
    )
    .unwrap()
    .remove(0)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(v: &[f32]) -> usize {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b })
}

#[test]
fn amortize_matches_the_independent_reference() {
    common::f32_activations();
    let ctx = context();
    let (start, end, stub) = tool_span(&ctx);
    let probe = encode("The");
    let want = reference_logits(&ctx, start, end, &stub, &probe);
    // f32 storage holds what the reference computes; f16 rounds every stored key and value
    // once more (relative 2^-11).
    for (dtype, tol) in [(KvDtype::F32, 2e-3), (KvDtype::F16, TOL_F16)] {
        amortize_against(&ctx, (start, end, &stub), &probe, &want, dtype, tol);
    }
}

/// Largest logit difference allowed between an f16-storage engine and the f32 reference.
const TOL_F16: f32 = 0.05;

fn amortize_against(
    ctx: &[u32],
    (start, end, stub): (usize, usize, &[u32]),
    probe: &[u32],
    want: &[f32],
    dtype: KvDtype,
    tol: f32,
) {
    let mut e = engine_with(4096, dtype);
    let id = e.create_session();
    // Build the session's cache: the request caches the prompt and one generated token.
    turn(&mut e, id, ctx, Vec::new(), Mode::Amortize, 1);
    let info = e.session_info(id).unwrap();
    let cut = ctx.len();
    // Drop the generated token so the session holds exactly `ctx` (an AMORTIZE deletion).
    let mut directives = vec![Directive::new(start, end, stub.to_vec(), Mode::Amortize)];
    if info.tokens.len() > cut {
        directives.push(Directive::new(
            cut,
            info.tokens.len(),
            Vec::new(),
            Mode::Amortize,
        ));
    }
    let report = e.apply_directives(id, directives).unwrap();
    let delta = stub.len() as i64 - (end - start) as i64;
    assert_eq!(report.new_len as i64, ctx.len() as i64 + delta);
    assert_eq!(
        report.rotated,
        ctx.len() - end,
        "every downstream key rotates once"
    );
    let after = e.session_info(id).unwrap();
    assert_eq!(
        after.positions,
        (0..after.tokens.len() as u32).collect::<Vec<_>>()
    );
    let got = e.peek_logits(id, probe).unwrap();
    let d = max_diff(&got, want);
    eprintln!("{dtype}: largest logit difference {d}");
    assert!(
        d < tol,
        "{dtype}: AMORTIZE differs from the reference by {d}"
    );
    assert_eq!(argmax(&got), argmax(want), "{dtype}");

    // Generation continues from the spliced cache, reusing all of it.
    let mut prompt = after.tokens.clone();
    prompt.extend(encode("The earliest"));
    let gen = turn(&mut e, id, &prompt, Vec::new(), Mode::Amortize, 8);
    let text = lm().tokenizer.decode(&gen, true).unwrap();
    assert_eq!(gen.len(), 8, "{text:?}");
    e.check_no_leaks().unwrap();
}

#[test]
fn an_amortize_replacement_is_prefilled_work_not_a_cache_hit() {
    common::f32_activations();
    let ctx = context();
    let (start, end, stub) = tool_span(&ctx);
    let mut e = engine(4096);
    let id = e.create_session();
    turn(&mut e, id, &ctx, Vec::new(), Mode::Amortize, 1);
    // The next prompt: the context with the tool output stubbed, then a new line.
    let mut prompt = ctx[..start].to_vec();
    prompt.extend(&stub);
    prompt.extend(&ctx[end..]);
    prompt.extend(encode("The earliest"));
    let edits = vec![Directive::new(start, end, stub.clone(), Mode::Amortize)];
    let before = e.metrics().snapshot().cached_prompt_tokens;
    let (req, out) = request(prompt.clone(), 1);
    e.submit(req.in_session(SessionRequest {
        id,
        mode: Mode::Amortize,
        edits: SessionEdits::Directives(edits),
    }));
    e.run_to_completion().unwrap();
    let u = out.lock().unwrap().finished.clone().expect("finished").1;
    let edited_ctx = ctx.len() - (end - start) + stub.len();
    assert_eq!(u.prompt_tokens, prompt.len());
    assert!(u.reused_tokens >= edited_ctx, "{u:?}");
    // The stub was computed for this request: cached is everything reused but the stub.
    assert_eq!(u.cached_tokens, u.reused_tokens - stub.len(), "{u:?}");
    assert_eq!(
        u.cached_tokens + u.prefilled_tokens,
        u.prompt_tokens,
        "{u:?}"
    );
    assert_eq!(
        u.computed_tokens(),
        u.prefilled_tokens,
        "the prompt kept the whole stub"
    );
    assert_eq!(u.edit.map(|r| r.prefilled), Some(stub.len()));
    let m = e.metrics().snapshot();
    assert_eq!(
        m.cached_prompt_tokens - before,
        u.cached_tokens as u64,
        "{m:?}"
    );
    e.check_no_leaks().unwrap();
}

#[test]
fn a_request_that_does_not_fit_sheds_an_idle_session_instead_of_waiting() {
    common::f32_activations();
    let mut e = engine(1024);
    let (a, b) = (e.create_session(), e.create_session());
    turn(
        &mut e,
        a,
        &filler("alpha", 400),
        Vec::new(),
        Mode::Amortize,
        4,
    );
    turn(
        &mut e,
        b,
        &filler("beta", 400),
        Vec::new(),
        Mode::Amortize,
        4,
    );
    // A plain request that keeps running for 64 steps (no stop tokens).
    let (long, long_out) = request(filler("delta", 20), 64);
    e.submit(long);
    e.step().unwrap();
    // The sessions pin ~810 slots and the running request ~84 of 1024; this needs ~490.
    let (req, out) = request(filler("gamma", 480), 4);
    e.submit(req);
    while out.lock().unwrap().tokens.is_empty() {
        assert!(e.has_work(), "the request ended without a token");
        e.step().unwrap();
        let o = out.lock().unwrap();
        assert!(o.failed.is_none(), "{:?}", o.failed);
    }
    assert!(
        long_out.lock().unwrap().finished.is_none(),
        "the request waited for the running one to finish"
    );
    assert_eq!(e.metrics().snapshot().sessions_shed, 1);
    assert_eq!(e.session_info(a).unwrap().tokens.len(), 0, "a kept its KV");
    assert!(
        e.session_info(b).unwrap().tokens.len() >= 400,
        "b lost its KV"
    );
    e.run_to_completion().unwrap();
    assert_eq!(long_out.lock().unwrap().tokens.len(), 64);
    assert_eq!(out.lock().unwrap().tokens.len(), 4);
    e.check_no_leaks().unwrap();
}

#[test]
fn no_session_is_shed_when_shedding_cannot_make_room() {
    common::f32_activations();
    let mut e = engine(1024);
    let a = e.create_session();
    turn(
        &mut e,
        a,
        &filler("alpha", 400),
        Vec::new(),
        Mode::Amortize,
        4,
    );
    // A running request holds ~560 slots: with a's ~400 gone there would still be only ~460
    // free, short of the next request's ~490.
    let (long, long_out) = request(filler("delta", 500), 64);
    e.submit(long);
    e.step().unwrap();
    let (req, out) = request(filler("gamma", 480), 4);
    e.submit(req);
    e.step().unwrap();
    assert_eq!(
        e.metrics().snapshot().sessions_shed,
        0,
        "a was shed for nothing"
    );
    assert!(
        e.session_info(a).unwrap().tokens.len() >= 400,
        "a lost its KV"
    );
    // Once the running request ends, its KV is evictable and the waiting one fits.
    e.run_to_completion().unwrap();
    assert_eq!(long_out.lock().unwrap().tokens.len(), 64);
    let o = out.lock().unwrap();
    assert!(o.failed.is_none(), "{:?}", o.failed);
    assert_eq!(o.tokens.len(), 4);
    assert_eq!(e.metrics().snapshot().sessions_shed, 0);
    e.check_no_leaks().unwrap();
}

/// About `n` tokens of text unlike any other `tag`'s.
fn filler(tag: &str, n: usize) -> Vec<u32> {
    let mut text = String::new();
    let mut i = 0;
    while encode(&text).len() < n {
        text.push_str(&format!(
            "{tag} entry {i}: item {} costs {}. ",
            i * 7,
            i * 13 % 97
        ));
        i += 1;
    }
    encode(&text)
}

#[test]
fn idle_sessions_give_up_their_kv_when_the_pool_runs_out() {
    common::f32_activations();
    let mut e = engine(1024);
    let (a, b) = (e.create_session(), e.create_session());
    let (pa, pb) = (filler("alpha", 400), filler("beta", 400));
    turn(&mut e, a, &pa, Vec::new(), Mode::Amortize, 4);
    turn(&mut e, b, &pb, Vec::new(), Mode::Amortize, 4);
    let held = |e: &Engine, id| e.session_info(id).unwrap().tokens.len();
    assert!(held(&e, a) >= 400 && held(&e, b) >= 400);
    // The two sessions pin ~810 of 1024 slots; this request needs ~500.
    let pc = filler("gamma", 480);
    let (req, out) = request(pc, 8);
    e.submit(req);
    e.run_to_completion().unwrap();
    {
        let o = out.lock().unwrap();
        assert!(o.failed.is_none(), "{:?}", o.failed);
        assert_eq!(o.tokens.len(), 8);
    }
    // The least recently used session went first, and one was enough.
    assert_eq!(e.metrics().snapshot().sessions_shed, 1);
    assert_eq!(held(&e, a), 0, "session a kept its KV");
    assert!(held(&e, b) >= 400, "session b lost its KV");
    e.check_no_leaks().unwrap();
    // Session a still works: its next turn prefills again and continues as a fresh engine.
    let mut next = pa.clone();
    next.extend(encode(" And then"));
    let got = turn(&mut e, a, &next, Vec::new(), Mode::Amortize, 6);
    let mut fresh = engine(1024);
    let f = fresh.create_session();
    assert_eq!(
        got,
        turn(&mut fresh, f, &next, Vec::new(), Mode::Amortize, 6)
    );
    e.check_no_leaks().unwrap();
}

fn checksum(e: &Engine, id: SessionId) -> (Vec<u32>, Vec<u32>, Vec<u32>, usize) {
    let i = e.session_info(id).unwrap();
    (
        i.tokens,
        i.slots,
        i.positions,
        e.cache().pool().used_count(),
    )
}

#[test]
fn invalid_batches_change_nothing() {
    common::f32_activations();
    let mut e = engine(2048);
    let id = e.create_session();
    let ctx = context();
    turn(&mut e, id, &ctx, Vec::new(), Mode::Amortize, 2);
    let before = checksum(&e, id);
    let n = before.0.len();
    let bad: Vec<(Vec<Directive>, &str)> = vec![
        (
            vec![
                Directive::new(5, 10, vec![1], Mode::Amortize),
                Directive::new(8, 12, vec![], Mode::Amortize),
            ],
            "overlap",
        ),
        (
            vec![Directive::new(n - 2, n + 3, vec![1], Mode::Amortize)],
            "out of range",
        ),
        (
            vec![Directive::new(3, 4, vec![49_999_999], Mode::Amortize)],
            "token",
        ),
        (vec![Directive::new(4, 4, vec![], Mode::Forget)], "nothing"),
    ];
    for (batch, what) in bad {
        let err = e.apply_directives(id, batch).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, EngineError::Directive(_)), "{what}: {msg}");
        assert!(msg.contains("directive"), "{what}: {msg}");
        assert_eq!(checksum(&e, id), before, "{what} changed the session");
    }
    let err = e
        .apply_directives(
            SessionId(9999),
            vec![Directive::new(0, 1, vec![], Mode::Amortize)],
        )
        .unwrap_err();
    assert!(matches!(err, EngineError::UnknownSession(9999)));
    assert_eq!(checksum(&e, id), before);
}

#[test]
fn amortize_in_one_session_leaves_another_untouched() {
    common::f32_activations();
    let mut e = engine(8192);
    let mut shared = Vec::new();
    let ctx = context();
    while shared.len() < 1024 {
        shared.extend_from_slice(&ctx);
    }
    shared.truncate(1024);
    let mut pa = shared.clone();
    pa.extend(encode(" Session A asks about trains."));
    let mut pb = shared.clone();
    pb.extend(encode(" Session B asks about hotels."));
    let (a, b) = (e.create_session(), e.create_session());
    turn(&mut e, a, &pa, Vec::new(), Mode::Amortize, 4);
    turn(&mut e, b, &pb, Vec::new(), Mode::Amortize, 4);
    // B reused A's prefix through the shared tree: the slots are the same.
    let (ia, ib) = (e.session_info(a).unwrap(), e.session_info(b).unwrap());
    assert_eq!(
        ia.slots[..1000],
        ib.slots[..1000],
        "B did not share A's prefix"
    );

    let mut follow = ib.tokens.clone();
    follow.extend(encode(" Which hotel"));
    let before_b = {
        let mut probe = e.peek_logits(b, &encode(" Which hotel")).unwrap();
        probe.truncate(64);
        probe
    };
    // Edit A inside the shared prefix and after it.
    let n = ia.tokens.len();
    let edits = vec![
        Directive::new(100, 140, encode("[evicted]"), Mode::Amortize),
        Directive::new(1030, 1033, Vec::new(), Mode::Amortize),
    ];
    let report = e.apply_directives(a, edits).unwrap();
    assert!(
        report.copied > 0,
        "shared slots must be copied, not rotated in place"
    );
    assert!(report.new_len < n);
    let after_b = {
        let mut probe = e.peek_logits(b, &encode(" Which hotel")).unwrap();
        probe.truncate(64);
        probe
    };
    assert_eq!(before_b, after_b, "B's cache changed");
    assert_eq!(e.session_info(b).unwrap(), ib);
    // No cached path mixes lineages, and A's amortized slots are in no shared path.
    let pool = e.cache().pool();
    let ia2 = e.session_info(a).unwrap();
    for (ns, _, slots) in e.cache().sequences() {
        for s in slots {
            let l = pool.lineage(s).unwrap();
            assert!(
                l == Lineage::SHARED || l == ns.lineage,
                "slot {s} of lineage {l} under {:?}",
                ns
            );
            assert!(
                !ia2.slots[140..].contains(&s) || l == Lineage::SHARED,
                "amortized slot {s} is shared"
            );
        }
    }
    // A plain request with A's edited text reuses nothing past the first edit.
    let out = Arc::new(Mutex::new(None));
    let o = Arc::clone(&out);
    let mut prompt = ia2.tokens.clone();
    prompt.extend(encode(" more"));
    let sink = Box::new(move |ev| {
        if let Event::Finished { usage, .. } = ev {
            *o.lock().unwrap() = Some(usage);
        }
        ControlFlow::Continue(())
    });
    e.submit(Request::greedy(prompt, 1, sink));
    e.run_to_completion().unwrap();
    let usage = out.lock().unwrap().clone().unwrap();
    assert!(
        usage.cached_tokens <= 100 + encode("[evicted]").len(),
        "cached {}",
        usage.cached_tokens
    );
    // B's greedy continuation is still what it was.
    let gen_b = turn(&mut e, b, &follow, Vec::new(), Mode::Amortize, 6);
    let mut e2 = engine(8192);
    let b2 = e2.create_session();
    let gen_b_cold = turn(&mut e2, b2, &follow, Vec::new(), Mode::Amortize, 6);
    assert_eq!(gen_b, gen_b_cold);
    e.check_no_leaks().unwrap();
}

#[test]
fn forget_erases_the_span_and_everything_after_it() {
    common::f32_activations();
    // f32 storage: the re-prefill and the cold prefill below run their products in chunks of
    // other sizes, so on other kernels (quantized or GEMM); f16 storage would turn those
    // last-bit differences into differences of whole f16 steps.
    let mut e = engine_with(4096, KvDtype::F32);
    let id = e.create_session();
    let ctx = context();
    turn(&mut e, id, &ctx, Vec::new(), Mode::Forget, 3);
    let old = e.session_info(id).unwrap();
    let (start, end, stub) = tool_span(&ctx);
    let report = e
        .apply_directives(
            id,
            vec![Directive::new(start, end, stub.clone(), Mode::Forget)],
        )
        .unwrap();
    assert!(report.zeroed > 0);
    let new = e.session_info(id).unwrap();
    let mut want = old.tokens[..start].to_vec();
    want.extend_from_slice(&stub);
    want.extend_from_slice(&old.tokens[end..]);
    assert_eq!(new.tokens, want);
    let forgotten: std::collections::HashSet<u32> = old.slots[start..].iter().copied().collect();
    for (_, _, slots) in e.cache().sequences() {
        assert!(
            slots.iter().all(|s| !forgotten.contains(s)),
            "a cached path still leads through a forgotten slot"
        );
    }
    for &s in &forgotten {
        if e.cache().pool().is_free(s).unwrap() {
            assert!(
                e.storage().slot_is_zero(s).unwrap(),
                "freed slot {s} still holds data"
            );
        }
    }
    // A cold prefill of the new tokens gives the same next-token logits (FORGET is exact).
    let mut e2 = engine_with(4096, KvDtype::F32);
    let c = e2.create_session();
    let mut prompt = new.tokens.clone();
    prompt.push(new.tokens[0]);
    turn(
        &mut e2,
        c,
        &prompt[..prompt.len() - 1],
        Vec::new(),
        Mode::Forget,
        1,
    );
    e2.apply_directives(c, {
        let n = e2.session_info(c).unwrap().tokens.len();
        if n > new.tokens.len() {
            vec![Directive::new(new.tokens.len(), n, vec![], Mode::Amortize)]
        } else {
            vec![]
        }
    })
    .unwrap();
    let probe = encode(" The");
    let d = max_diff(
        &e.peek_logits(id, &probe).unwrap(),
        &e2.peek_logits(c, &probe).unwrap(),
    );
    assert!(d < 1e-3, "FORGET differs from a cold prefill by {d}");
    e.check_no_leaks().unwrap();
}

#[test]
fn forget_while_another_request_reads_the_span() {
    common::f32_activations();
    let ctx = context();
    let (start, end, stub) = tool_span(&ctx);
    let reader_prompt = [ctx.clone(), encode("Summarize the flights.")].concat();
    let solo = {
        let mut e = engine(4096);
        let (req, out) = request(reader_prompt.clone(), 8);
        e.submit(req);
        e.run_to_completion().unwrap();
        let o = out.lock().unwrap();
        o.tokens.clone()
    };
    let mut e = engine(4096);
    let id = e.create_session();
    // Sent in an AMORTIZE turn, the context is shared with the tree (a FORGET turn would
    // keep it private): the reader matches it there and is still decoding when the
    // session forgets the tool output.
    turn(&mut e, id, &ctx, Vec::new(), Mode::Amortize, 3);
    let old = e.session_info(id).unwrap();
    let (req, reader) = request(reader_prompt, 8);
    e.submit(req);
    while e.step().unwrap().decode_seqs == 0 {}
    let report = e
        .apply_directives(id, vec![Directive::new(start, end, stub, Mode::Forget)])
        .expect("FORGET goes ahead while another request reads the span");
    assert!(report.zeroed > 0);
    let forgotten: std::collections::HashSet<u32> = old.slots[start..].iter().copied().collect();
    let no_path_through_forgotten = |e: &Engine| {
        for (_, _, slots) in e.cache().sequences() {
            assert!(
                slots.iter().all(|s| !forgotten.contains(s)),
                "a cached path still leads through a forgotten slot"
            );
        }
    };
    no_path_through_forgotten(&e);
    // What the reader still holds; the rest was freed and zeroed (and may be in use again).
    let held: Vec<u32> = forgotten
        .iter()
        .copied()
        .filter(|&s| !e.cache().pool().is_free(s).unwrap())
        .filter(|s| !e.session_info(id).unwrap().slots.contains(s))
        .collect();
    assert!(!held.is_empty(), "the reader held none of the span");
    e.run_to_completion().unwrap();
    let o = reader.lock().unwrap();
    assert!(o.failed.is_none(), "{:?}", o.failed);
    let cached = o.finished.as_ref().expect("finished").1.cached_tokens;
    assert!(
        cached >= end,
        "the reader did not read the span from the cache ({cached} cached)"
    );
    assert_eq!(o.tokens, solo, "the reader's KV changed under it");
    // The reader's end published nothing from the span on, and freed (zeroed) the rest.
    no_path_through_forgotten(&e);
    for &s in &held {
        assert!(e.cache().pool().is_free(s).unwrap(), "slot {s} still held");
        assert!(
            e.storage().slot_is_zero(s).unwrap(),
            "freed slot {s} still holds data"
        );
    }
    e.check_no_leaks().unwrap();
}

#[test]
fn copies_of_forgotten_kv_stay_forgotten() {
    common::f32_activations();
    let ctx = context();
    let (start, end, stub) = tool_span(&ctx);
    let mut e = engine(4096);
    let s = e.create_session();
    // Sent in an AMORTIZE turn, so that it is published to the tree.
    turn(&mut e, s, &ctx, Vec::new(), Mode::Amortize, 2);
    // Two sessions whose first turns borrow the published context from the tree.
    let follow = [ctx.clone(), encode("Thanks.")].concat();
    let (t, u) = (e.create_session(), e.create_session());
    turn(&mut e, t, &follow, Vec::new(), Mode::Amortize, 2);
    turn(&mut e, u, &follow, Vec::new(), Mode::Amortize, 2);
    let span_slot = e.session_info(s).unwrap().slots[start];
    assert_eq!(e.session_info(t).unwrap().slots[start], span_slot);
    e.apply_directives(s, vec![Directive::new(start, end, stub, Mode::Forget)])
        .unwrap();
    let before = e.session_info(t).unwrap();
    assert_eq!(e.cache().pool().first_revoked(&before.slots), start);
    // T edits before the span: the downstream slots, also held by U, are copied and rotated.
    let report = e
        .apply_directives(t, vec![Directive::new(2, 4, Vec::new(), Mode::Amortize)])
        .unwrap();
    assert!(report.copied > 0, "{report:?}");
    let after = e.session_info(t).unwrap();
    assert_eq!(
        e.cache().pool().first_revoked(&after.slots),
        start - 2,
        "a copy of forgotten KV lost its mark"
    );
    e.check_no_leaks().unwrap();
}
