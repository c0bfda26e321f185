//! The engine owns its sessions: a splice the pool cannot hold changes nothing and says so
//! by kind, FORGET erases on the token path too, the busy flag is one and is checked at
//! submission, idle sessions are reaped by the engine, and a dead engine thread shows.

mod common;

use common::{encode, lm};
use leyline_core::{Directive, Mode};
use leyline_engine::{
    Engine, EngineConfig, EngineError, EngineThread, ErrorKind, Event, Request, SessionEdits,
    SessionId, SessionRequest,
};
use leyline_kv::radix::Namespace;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn engine(slots: usize) -> Engine {
    let cfg = EngineConfig {
        prefill_chunk: 256,
        ..EngineConfig::new(slots)
    };
    Engine::new(Arc::clone(&lm().model), cfg).unwrap()
}

fn ctx() -> Vec<u32> {
    encode(
        "<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\nWhat is in the report?<|im_end|>\n\
         <|im_start|>tool\nThe vault code is 4-4-1-9 and the courier leaves at dawn.<|im_end|>\n\
         <|im_start|>assistant\n",
    )
}

fn quiet() -> Box<dyn FnMut(Event) -> ControlFlow<()> + Send> {
    Box::new(|_| ControlFlow::Continue(()))
}

fn run_turn(e: &mut Engine, id: SessionId, prompt: &[u32], mode: Mode, edits: SessionEdits) {
    let req =
        Request::greedy(prompt.to_vec(), 1, quiet()).in_session(SessionRequest { id, mode, edits });
    e.try_submit(req).unwrap();
    e.run_to_completion().unwrap();
}

/// Everything observable about a session and the pool: tokens, slots, positions, the
/// session's key and value bytes, the pool's use and the tree's paths.
fn snapshot(e: &Engine, id: SessionId) -> String {
    let i = e.session_info(id).unwrap();
    let g = e.storage().geometry();
    let mut bytes = Vec::new();
    for l in 0..g.layers {
        let mut k = vec![0.0; i.slots.len() * g.k_width()];
        let mut v = vec![0.0; i.slots.len() * g.v_width];
        e.storage().gather_k(l, &i.slots, &mut k).unwrap();
        e.storage().gather_v(l, &i.slots, &mut v).unwrap();
        bytes.extend(k.iter().chain(&v).map(|x| x.to_bits()));
    }
    format!(
        "{:?} {:?} {:?} {} {} {:?}",
        i.tokens,
        i.slots,
        i.positions,
        bytes.iter().fold(0u64, |h, &b| h.rotate_left(5) ^ b as u64),
        e.cache().pool().used_count(),
        e.cache().sequences()
    )
}

#[test]
fn an_edit_the_pool_cannot_hold_changes_nothing_and_is_out_of_kv() {
    let c = ctx();
    // Room for the session, its copies on write and ten more: not for 60 more tokens.
    let mut e = engine(2 * c.len() + 10);
    let id = e.create_session();
    run_turn(&mut e, id, &c, Mode::Amortize, SessionEdits::Tokens);
    let before = snapshot(&e, id);
    let n = e.session_info(id).unwrap().tokens.len();
    let big = vec![encode(" word")[0]; 60];
    for mode in [Mode::Amortize, Mode::Forget] {
        let err = e
            .apply_directives(id, vec![Directive::new(3, 5, big.clone(), mode)])
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::OutOfKv, "{mode:?}: {err}");
        assert_eq!(snapshot(&e, id), before, "{mode:?} changed something");
    }
    // A small edit still goes through afterwards.
    let r = e
        .apply_directives(id, vec![Directive::new(3, 5, vec![big[0]], Mode::Amortize)])
        .unwrap();
    assert_eq!(r.new_len, n - 1);
    e.check_no_leaks().unwrap();
}

#[test]
fn forget_without_message_bounds_erases_what_the_prompt_drops() {
    let c = ctx();
    let mut e = engine(4096);
    let id = e.create_session();
    run_turn(&mut e, id, &c, Mode::Forget, SessionEdits::Tokens);
    let old = e.session_info(id).unwrap();
    // The second half is replaced at the token level (no message bounds, as on completions).
    let mut edited = c[..c.len() / 2].to_vec();
    edited.extend(encode(" [removed]<|im_end|>\n<|im_start|>assistant\n"));
    let at = old
        .tokens
        .iter()
        .zip(&edited)
        .take_while(|(a, b)| a == b)
        .count();
    run_turn(&mut e, id, &edited, Mode::Forget, SessionEdits::Tokens);
    // Freed slots go back to the pool and may hold the new tokens' KV now: leave those out.
    let now = e.session_info(id).unwrap();
    let forgotten: std::collections::HashSet<u32> = old.slots[at..]
        .iter()
        .copied()
        .filter(|s| !now.slots.contains(s))
        .collect();
    for (_, _, slots) in e.cache().sequences() {
        assert!(
            slots.iter().all(|s| !forgotten.contains(s)),
            "a cached path still leads through a dropped slot"
        );
    }
    // Nobody matches the dropped part any more: not the shared tree, not a fresh lookup.
    let ns = Namespace::shared(0);
    assert!(
        e.cache().cached_len(ns, &c) <= at,
        "the secret is still cached"
    );
    for &s in &forgotten {
        if e.cache().pool().is_free(s).unwrap() {
            assert!(e.storage().slot_is_zero(s).unwrap(), "slot {s} kept data");
        }
    }
    e.check_no_leaks().unwrap();
}

#[test]
fn the_one_busy_flag_is_checked_at_submission_and_by_every_session_call() {
    let mut e = engine(2048);
    let id = e.create_session();
    let session = |edits| SessionRequest {
        id,
        mode: Mode::Amortize,
        edits,
    };
    let first = Request::greedy(ctx(), 1, quiet()).in_session(session(SessionEdits::Tokens));
    e.try_submit(first).unwrap();
    let second = Request::greedy(ctx(), 1, quiet()).in_session(session(SessionEdits::Tokens));
    let err = e.try_submit(second).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy);
    assert!(e.session_info(id).unwrap().busy);
    let edit = vec![Directive::new(0, 0, vec![1], Mode::Amortize)];
    assert_eq!(
        e.apply_directives(id, edit).unwrap_err().kind(),
        ErrorKind::Busy
    );
    assert_eq!(e.delete_session(id).unwrap_err().kind(), ErrorKind::Busy);
    let unknown = Request::greedy(ctx(), 1, quiet()).in_session(SessionRequest {
        id: SessionId(999),
        mode: Mode::Amortize,
        edits: SessionEdits::Tokens,
    });
    assert_eq!(
        e.try_submit(unknown).unwrap_err().kind(),
        ErrorKind::UnknownSession
    );
    e.run_to_completion().unwrap();
    let info = e.session_info(id).unwrap();
    assert!(!info.busy);
    assert_eq!(info.turns, 1);
    e.delete_session(id).unwrap();
    e.check_no_leaks().unwrap();
}

#[test]
fn reaping_drops_expired_then_least_recently_used_idle_sessions_never_busy_ones() {
    let mut e = engine(2048);
    let ids: Vec<SessionId> = (0..3).map(|_| e.create_session()).collect();
    let timeout = Duration::from_secs(60);
    // Use order: 1, then 0, then 2 (held busy).
    for &i in &[1usize, 0] {
        run_turn(
            &mut e,
            ids[i],
            &encode("Hello"),
            Mode::Amortize,
            SessionEdits::Tokens,
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let busy = Request::greedy(encode("Hi"), 1, quiet()).in_session(SessionRequest {
        id: ids[2],
        mode: Mode::Amortize,
        edits: SessionEdits::Tokens,
    });
    e.try_submit(busy).unwrap();
    let now = Instant::now();
    // Nothing expired and no room asked for: nothing goes.
    assert!(e.reap_sessions(now, timeout, 3, 0).is_empty());
    // Room for one: the least recently used idle session goes.
    assert_eq!(e.reap_sessions(now, timeout, 3, 1), vec![ids[1]]);
    assert!(e.session_info(ids[1]).is_err());
    // Later than the timeout: every idle one expires, the busy one stays.
    let later = now + Duration::from_secs(61);
    assert_eq!(e.reap_sessions(later, timeout, 3, 0), vec![ids[0]]);
    assert!(e.reap_sessions(later, timeout, 1, 1).is_empty());
    e.run_to_completion().unwrap();
    let later = Instant::now() + Duration::from_secs(61);
    assert_eq!(e.reap_sessions(later, timeout, 3, 0), vec![ids[2]]);
    e.check_no_leaks().unwrap();
}

#[test]
fn a_panic_on_the_engine_thread_shows_as_a_stopped_engine() {
    let thread = EngineThread::spawn(engine(256)).unwrap();
    let h = thread.handle();
    assert!(h.is_alive());
    let _ = h.call(|_: &mut Engine| -> u8 { panic!("injected panic on the engine thread") });
    let t0 = Instant::now();
    while h.is_alive() && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!h.is_alive());
    let err = h.call(|e| e.create_session()).unwrap_err();
    assert!(matches!(err, EngineError::Stopped));
    assert_eq!(err.kind(), ErrorKind::Stopped);
}

#[test]
fn every_slot_freed_with_session_private_kv_is_zeroed() {
    let c = ctx();
    let mut e = engine(4096);
    let id = e.create_session();
    run_turn(&mut e, id, &c, Mode::Amortize, SessionEdits::Tokens);
    // An AMORTIZE edit makes everything after it session-private (it read the old span).
    let stub = encode(" [gone]");
    e.apply_directives(
        id,
        vec![Directive::new(8, 20, stub.clone(), Mode::Amortize)],
    )
    .unwrap();
    let private: Vec<u32> = e.session_info(id).unwrap().slots[8 + stub.len()..].to_vec();
    // A second edit drops some of them; deleting the session drops the rest.
    e.apply_directives(id, vec![Directive::new(12, 16, vec![], Mode::Amortize)])
        .unwrap();
    e.delete_session(id).unwrap();
    let mut freed = 0;
    for &s in &private {
        if e.cache().pool().is_free(s).unwrap() {
            freed += 1;
            assert!(
                e.storage().slot_is_zero(s).unwrap(),
                "slot {s} kept private KV"
            );
        }
    }
    assert!(freed > 0, "nothing was freed");
    e.check_no_leaks().unwrap();
}

#[test]
fn forget_erases_from_the_tree_what_a_shed_session_dropped() {
    // A session whose KV was shed for room no longer holds the slots of its past turns,
    // but the prefix tree may: a later FORGET turn must purge them from there too.
    let sys = encode("<|im_start|>system\nYou answer briefly.<|im_end|>\n");
    let secret = encode(
        "<|im_start|>user\nThe vault code is 4-4-1-9 and the courier leaves at dawn.<|im_end|>\n\
         <|im_start|>assistant\n",
    );
    // Long enough that, once evicted for the stranger below, the pool has room for the
    // FORGET turn without evicting anything else.
    let more = encode(&format!(
        "<|im_start|>user\nAnd the weather? {}<|im_end|>\n<|im_start|>assistant\n",
        "Tell me about the clouds, the wind and the rain. ".repeat(5)
    ));
    let a: Vec<u32> = sys.iter().chain(&secret).copied().collect();
    let ab: Vec<u32> = a.iter().chain(&more).copied().collect();
    let pool = ab.len() + 40;
    let mut e = engine(pool);
    let id = e.create_session();
    // Sent in AMORTIZE turns, the messages are shared with the tree.
    run_turn(&mut e, id, &a, Mode::Amortize, SessionEdits::Tokens);
    run_turn(&mut e, id, &ab, Mode::Amortize, SessionEdits::Tokens);
    // A stranger's prompt that fits only once the session's KV goes: the session is shed
    // and the tree keeps the older part of its path (the one holding the secret).
    let filler = vec![encode(" word")[0]; 46];
    e.try_submit(Request::greedy(filler, 1, quiet())).unwrap();
    e.run_to_completion().unwrap();
    assert!(
        e.session_info(id).unwrap().tokens.is_empty(),
        "the session was shed"
    );
    let ns = Namespace::shared(0);
    assert!(
        e.cache().cached_len(ns, &a) > sys.len() + 4,
        "the tree still holds the secret before the FORGET (else this test shows nothing)"
    );
    // Directives written against the tokens the session had are refused as such (a client
    // racing the shedding gets "resend", not "your range is wrong").
    let err = e
        .apply_directives(id, vec![Directive::new(0, 1, vec![], Mode::Forget)])
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Shed, "{err}");
    // The FORGET turn drops the secret message.
    let mut edited = sys.clone();
    edited.extend(encode(
        "<|im_start|>user\n[removed]<|im_end|>\n<|im_start|>assistant\n",
    ));
    run_turn(&mut e, id, &edited, Mode::Forget, SessionEdits::Tokens);
    let at = a.iter().zip(&edited).take_while(|(x, y)| x == y).count();
    assert!(
        e.cache().cached_len(ns, &a) <= at,
        "the forgotten message is still cached: {} of {} tokens, {at} kept",
        e.cache().cached_len(ns, &a),
        a.len()
    );
    e.check_no_leaks().unwrap();
}

#[test]
fn what_a_forget_turn_computes_never_enters_the_shared_tree() {
    // A session in FORGET mode keeps its KV to itself: once the server drops the session
    // (reaped, shed, deleted), nothing it computed can be matched by anyone, even when the
    // client later forgets that content through another session.
    let c = ctx();
    let ns = Namespace::shared(0);
    let mut e = engine(4096);
    let forget = e.create_session();
    run_turn(&mut e, forget, &c, Mode::Forget, SessionEdits::Tokens);
    assert_eq!(
        e.cache().cached_len(ns, &c),
        0,
        "a FORGET turn fed the tree"
    );
    let held = e.session_info(forget).unwrap().slots;
    assert!(held.len() + 1 >= c.len(), "the session holds its context");
    e.delete_session(forget).unwrap();
    for &s in &held {
        assert!(e.cache().pool().is_free(s).unwrap(), "slot {s} still held");
        assert!(e.storage().slot_is_zero(s).unwrap(), "slot {s} kept data");
    }
    // The same context in AMORTIZE mode is shared, as before.
    let amortize = e.create_session();
    run_turn(&mut e, amortize, &c, Mode::Amortize, SessionEdits::Tokens);
    assert!(e.cache().cached_len(ns, &c) + 1 >= c.len());
    e.check_no_leaks().unwrap();
}
