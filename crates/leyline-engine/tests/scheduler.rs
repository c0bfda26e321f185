//! The scheduler on the default model: prefix reuse is exact, batching gives the same
//! greedy outputs as running alone, and memory pressure neither deadlocks nor leaks.

mod common;

use common::{encode, lm, request, session_with, submit_all, Shared};
use leyline_engine::{Engine, EngineConfig, FinishReason, PrefillOrder};
use std::sync::Arc;

fn engine(slots: usize) -> Engine {
    engine_with(EngineConfig {
        prefill_chunk: 64,
        ..EngineConfig::new(slots)
    })
}

fn engine_with(cfg: EngineConfig) -> Engine {
    Engine::new(Arc::clone(&lm().model), cfg).unwrap()
}

const TEXTS: [&str; 16] = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The three primary colors are",
    "In mathematics, a prime number is",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
    "SELECT name, email FROM users WHERE",
    "The Pythagorean theorem states that",
    "My favourite book is",
    "Photosynthesis is the process by which plants",
    "The quick brown fox",
    "A haiku about autumn:\n",
    "Rust is a programming language that",
    "The first person to walk on the moon was",
];

fn run_alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut e = engine(2048);
    let (req, out) = request(prompt.to_vec(), max_tokens);
    e.submit(req);
    e.run_to_completion().unwrap();
    let o = out.lock().unwrap();
    assert!(o.failed.is_none(), "{:?}", o.failed);
    o.tokens.clone()
}

#[test]
fn prefix_reuse_is_exact_and_counted() {
    let base = encode(
        "You are a careful assistant. Answer briefly and precisely, and never invent facts. \
         Question: what is the boiling point of water at sea level?",
    );
    let mut longer = base.clone();
    longer.extend(encode(" Answer:"));
    let cold = run_alone(&longer, 12);

    let mut e = engine(2048);
    let (warm_up, _) = request(base.clone(), 4);
    e.submit(warm_up);
    e.run_to_completion().unwrap();
    let (req, out) = request(longer.clone(), 12);
    e.submit(req);
    e.run_to_completion().unwrap();
    let o = out.lock().unwrap();
    let (_, usage) = o.finished.clone().expect("finished");
    assert_eq!(o.tokens, cold, "a warm prefix changed the greedy output");
    // The first request cached its prompt and generated tokens; `base` is a prefix of `longer`.
    assert!(
        usage.cached_tokens >= base.len() - 1,
        "cached {}",
        usage.cached_tokens
    );
    assert_eq!(usage.prefilled_tokens, longer.len() - usage.cached_tokens);
    let m = e.metrics().snapshot();
    assert_eq!(
        m.prefilled_tokens as usize,
        base.len() + longer.len() - usage.cached_tokens
    );
    e.check_no_leaks().unwrap();
}

#[test]
fn sixteen_concurrent_requests_match_their_solo_runs() {
    let prompts: Vec<Vec<u32>> = TEXTS.iter().map(|t| encode(t)).collect();
    let max_tokens = 6;
    let solo: Vec<Vec<u32>> = prompts.iter().map(|p| run_alone(p, max_tokens)).collect();
    let mut e = engine(4096);
    let outs = submit_all(&mut e, &prompts, max_tokens);
    e.run_to_completion().unwrap();
    for (i, (o, want)) in outs.iter().zip(&solo).enumerate() {
        let o = o.lock().unwrap();
        assert!(o.failed.is_none(), "request {i}: {:?}", o.failed);
        assert_eq!(&o.tokens, want, "request {i} differs when batched");
    }
    let m = e.metrics().snapshot();
    assert!(
        m.max_batch_seqs > 1,
        "never more than one sequence per forward"
    );
    assert!(m.batched_decode_seqs > 0, "decode steps were not batched");
    e.check_no_leaks().unwrap();
}

#[test]
fn pressure_completes_or_fails_clearly_without_leaks() {
    // 64 requests; the pool holds about 10% of their total demand.
    let prompts: Vec<Vec<u32>> = (0..64).map(|i| encode(TEXTS[i % 16])).collect();
    let max_tokens = 4;
    let demand: usize = prompts.iter().map(|p| p.len() + max_tokens).sum();
    let slots = demand / 10;
    let mut e = engine_with(EngineConfig {
        prefill_chunk: 64,
        max_running: 16,
        ..EngineConfig::new(slots)
    });
    // One request that can never fit.
    let (huge, huge_out) = request(vec![42; slots + 5], 1);
    e.submit(huge);
    let outs = submit_all(&mut e, &prompts, max_tokens);
    let mut steps = 0;
    while e.has_work() {
        e.step().unwrap();
        steps += 1;
        assert!(steps < 10_000, "no progress: deadlock?");
    }
    let err = huge_out
        .lock()
        .unwrap()
        .failed
        .clone()
        .expect("the oversized request fails");
    assert!(err.contains("tokens"), "{err}");
    for (i, o) in outs.iter().enumerate() {
        let o = o.lock().unwrap();
        match (&o.finished, &o.failed) {
            (Some((reason, _)), None) => assert_eq!(*reason, FinishReason::Length, "request {i}"),
            (None, Some(msg)) => assert!(!msg.is_empty()),
            other => panic!("request {i} neither finished nor failed: {:?}", other.0),
        }
    }
    let done = outs
        .iter()
        .filter(|o| o.lock().unwrap().finished.is_some())
        .count();
    assert_eq!(done, 64, "every request fits alone, so all must complete");
    let m = e.metrics().snapshot();
    assert!(m.evicted_slots > 0, "the pool was never under pressure");
    e.check_no_leaks().unwrap();
}

#[test]
fn bad_requests_fail_with_a_reason() {
    let mut e = engine(256);
    let (empty, out) = request(Vec::new(), 4);
    e.submit(empty);
    assert!(out
        .lock()
        .unwrap()
        .failed
        .as_deref()
        .unwrap()
        .contains("empty"));
    let (long, out) = request(vec![1; 300], 4);
    e.submit(long);
    assert!(out
        .lock()
        .unwrap()
        .failed
        .as_deref()
        .unwrap()
        .contains("300 tokens"));
    let (bad, out) = request(vec![1, 999_999], 4);
    e.submit(bad);
    assert!(out
        .lock()
        .unwrap()
        .failed
        .as_deref()
        .unwrap()
        .contains("999999"));
    assert!(!e.has_work());
}

#[test]
fn steps_that_decode_prefill_within_the_smaller_budget() {
    let mut e = engine_with(EngineConfig {
        prefill_chunk: 64,
        decode_prefill_chunk: 8,
        ..EngineConfig::new(2048)
    });
    let (a, out_a) = request(encode(TEXTS[3]), 10);
    e.submit(a);
    while e.step().unwrap().decode_seqs == 0 {}
    let long: Vec<u32> = TEXTS.iter().flat_map(|t| encode(t)).collect();
    assert!(long.len() > 100, "prompt of {} tokens", long.len());
    let (b, out_b) = request(long.clone(), 3);
    e.submit(b);
    let (mut shared_steps, mut full_steps) = (0, 0);
    while out_b.lock().unwrap().finished.is_none() {
        let r = e.step().unwrap();
        if r.prefill_tokens == 0 {
            continue;
        }
        if r.decode_seqs > 0 {
            assert!(r.prefill_tokens <= 8, "{r:?}");
            shared_steps += 1;
        } else {
            assert!(r.prefill_tokens <= 64, "{r:?}");
            full_steps += usize::from(r.prefill_tokens > 8);
        }
    }
    assert!(
        shared_steps > 0 && full_steps > 0,
        "{shared_steps} steps prefilled beside a decode, {full_steps} alone"
    );
    assert!(out_a.lock().unwrap().finished.is_some());
    // Small chunks change nothing in what is computed.
    assert_eq!(out_b.lock().unwrap().tokens, run_alone(&long, 3));
    e.check_no_leaks().unwrap();
}

/// A shared ~250-token head for prompts that differ only at the end.
fn shared_head() -> Vec<u32> {
    let head: Vec<u32> = TEXTS.iter().chain(&TEXTS).flat_map(|t| encode(t)).collect();
    assert!(head.len() > 150, "head of {} tokens", head.len());
    head
}

#[test]
fn requests_sharing_a_prefix_with_a_running_prefill_reuse_it() {
    let head = shared_head();
    let prompts: Vec<Vec<u32>> = TEXTS[..4]
        .iter()
        .map(|t| [head.clone(), encode(t)].concat())
        .collect();
    let max_tokens = 4;
    let solo: Vec<Vec<u32>> = prompts.iter().map(|p| run_alone(p, max_tokens)).collect();
    let mut e = engine(4096); // prefill chunks of 64 tokens
    let outs = submit_all(&mut e, &prompts, max_tokens);
    e.run_to_completion().unwrap();
    let mut prompt_tokens = 0;
    for (i, (o, want)) in outs.iter().zip(&solo).enumerate() {
        let o = o.lock().unwrap();
        let (_, usage) = o.finished.clone().expect("finished");
        assert_eq!(&o.tokens, want, "request {i} differs from its solo run");
        prompt_tokens += usage.prompt_tokens;
        if i > 0 {
            // The first request's prefill is reused up to a chunk boundary near the head's end.
            assert!(
                usage.cached_tokens + 32 >= head.len(),
                "request {i} reused {} of {} shared tokens",
                usage.cached_tokens,
                head.len()
            );
        }
    }
    let prefilled = e.metrics().snapshot().prefilled_tokens as usize;
    assert!(
        prefilled + 3 * (head.len() - 32) <= prompt_tokens,
        "{prefilled} of {prompt_tokens} prompt tokens prefilled"
    );
    // Waiting for the running prefill is not a cache lookup: one per request.
    assert_eq!(e.cache().stats().lookups, 4);
    e.check_no_leaks().unwrap();
}

#[test]
fn a_prompt_is_reusable_while_its_request_still_decodes() {
    let head = shared_head();
    let mut e = engine(4096);
    let (a, out_a) = request([head.clone(), encode(TEXTS[0])].concat(), 16);
    e.submit(a);
    while e.step().unwrap().decode_seqs == 0 {}
    let (b, out_b) = request([head.clone(), encode(TEXTS[1])].concat(), 4);
    e.submit(b);
    e.step().unwrap();
    assert!(
        out_a.lock().unwrap().finished.is_none(),
        "the first request must still be running for this test"
    );
    e.run_to_completion().unwrap();
    let (_, usage) = out_b.lock().unwrap().finished.clone().expect("finished");
    assert!(
        usage.cached_tokens >= head.len(),
        "reused {} of {} shared tokens",
        usage.cached_tokens,
        head.len()
    );
    assert_eq!(
        out_b.lock().unwrap().tokens,
        run_alone(&[head, encode(TEXTS[1])].concat(), 4)
    );
    e.check_no_leaks().unwrap();
}

/// Steps until each request's first token, for a long prompt submitted just before a
/// short one (prefill budget 64 per step).
fn first_token_steps(order: PrefillOrder) -> (usize, usize, Vec<u32>, Vec<u32>) {
    let mut e = engine_with(EngineConfig {
        prefill_chunk: 64,
        prefill_order: order,
        ..EngineConfig::new(4096)
    });
    let long = shared_head();
    let short = encode(TEXTS[5]);
    let outs = submit_all(&mut e, &[long.clone(), short.clone()], 2);
    let mut first = [None, None];
    let mut step = 0;
    while e.has_work() {
        e.step().unwrap();
        step += 1;
        for (f, o) in first.iter_mut().zip(&outs) {
            if f.is_none() && !o.lock().unwrap().tokens.is_empty() {
                *f = Some(step);
            }
        }
    }
    e.check_no_leaks().unwrap();
    let tokens = |o: &Shared| o.lock().unwrap().tokens.clone();
    (
        first[0].expect("long prompt answered"),
        first[1].expect("short prompt answered"),
        tokens(&outs[0]),
        tokens(&outs[1]),
    )
}

#[test]
fn a_short_prompt_does_not_wait_behind_a_long_prefill() {
    let (long, short) = (shared_head(), encode(TEXTS[5]));
    let (solo_long, solo_short) = (run_alone(&long, 2), run_alone(&short, 2));
    let (l, s, out_long, out_short) = first_token_steps(PrefillOrder::Shortest);
    assert_eq!(s, 1, "short prompt answered at step {s} (long at {l})");
    assert!(l > s, "long prompt at step {l}, short at {s}");
    assert_eq!(
        (out_long, out_short),
        (solo_long.clone(), solo_short.clone())
    );
    // In arrival order the short prompt waits for the long one's prefill.
    let (l, s, out_long, out_short) = first_token_steps(PrefillOrder::Arrival);
    assert!(s >= l, "arrival order: short at step {s}, long at {l}");
    assert_eq!((out_long, out_short), (solo_long, solo_short));
}

/// Whether a long prompt gets its first token within `steps` steps while a new short prompt
/// (more tokens than a step's budget) arrives before every step.
fn long_prompt_answered(patience: u32, steps: usize) -> bool {
    let mut e = engine_with(EngineConfig {
        prefill_chunk: 16,
        prefill_patience: patience,
        ..EngineConfig::new(8192)
    });
    let long = shared_head();
    let (req, out) = request(long, 1);
    e.submit(req);
    for i in 0..steps {
        // Distinct from the second token on, so the prefix tree saves a short prompt little.
        let text: Vec<&str> = (0..4).map(|k| TEXTS[(i + 7 * k) % 16]).collect();
        let text = format!("{i}: {}", text.join(" "));
        let short: Vec<u32> = encode(&text).into_iter().take(24).collect();
        assert!(short.len() >= 20, "short prompt of {} tokens", short.len());
        let (req, _) = request(short, 1);
        e.submit(req);
        e.step().unwrap();
        if !out.lock().unwrap().tokens.is_empty() {
            return true;
        }
    }
    false
}

#[test]
fn a_long_prompt_passed_over_long_enough_goes_first() {
    let need = shared_head().len().div_ceil(16);
    // Three steps passed over, then every step's budget until its prefill is done.
    assert!(long_prompt_answered(3, 3 + need + 1));
    // Without patience the stream of shorter prompts starves it.
    assert!(!long_prompt_answered(u32::MAX, 3 * need));
}

/// A request that asks for log-probabilities gets one report per emitted token, before it:
/// the token's log-softmax and its top alternatives, checked against a scalar f64
/// log-softmax of the logits the engine computes for the same context by another path
/// (`peek_logits`). Bound: 1e-3, twenty times the 5e-5 that two exact f32 runs of SmolLM2
/// differ by when only their prefill chunking differs (tests/lazy.rs).
#[test]
fn logprobs_are_reported_per_token_and_match_the_logits() {
    let prompt = encode("The capital of France is");
    let mut e = engine(2048);
    let (mut req, out) = request(prompt.clone(), 4);
    req.sampling.logprobs = Some(3);
    e.submit(req);
    e.run_to_completion().unwrap();
    let o = out.lock().unwrap();
    assert!(o.failed.is_none(), "{:?}", o.failed);
    assert_eq!(o.logprobs.len(), o.tokens.len());
    assert_eq!(o.tokens.len(), 4);
    let mut ctx = prompt.clone();
    for (lp, &t) in o.logprobs.iter().zip(&o.tokens) {
        assert_eq!(lp.token, t);
        assert_eq!(lp.top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top[0], (t, lp.logprob));
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{:?}", lp.top);
        let last = ctx.pop().unwrap();
        let id = session_with(&mut e, &ctx);
        let logits = e.peek_logits(id, &[last]).unwrap();
        e.delete_session(id).unwrap();
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = max
            + logits
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        for &(tok, got) in &lp.top {
            let want = logits[tok as usize] as f64 - lse;
            assert!(
                (got as f64 - want).abs() < 1e-3,
                "token {tok}: logprob {got} vs {want}"
            );
        }
        ctx.push(last);
        ctx.push(t);
    }
    // Without the option nothing is reported.
    let (req, out) = request(prompt, 2);
    e.submit(req);
    e.run_to_completion().unwrap();
    assert!(out.lock().unwrap().logprobs.is_empty());
}
