//! Implicit splices on the default model: a sessionless request that edits a cached
//! conversation gets what an explicit AMORTIZE session gets for the same turns (tokens and
//! counts), the conversation it edited stays intact for other continuations, tenants never
//! see each other's conversations, and FORGET by a sessionless request erases.

mod common;

use common::{lm, Shared};
use leyline_core::{Mode, Repair, RepairRule};
use leyline_engine::{
    render_prompt, Engine, EngineConfig, ImplicitTurn, Request, SessionEdits, SessionRequest, Usage,
};
use leyline_kv::radix::Namespace;
use leyline_model::chat::{ChatMessage, RenderOptions};
use std::sync::Arc;

fn engine() -> Engine {
    let cfg = EngineConfig {
        prefill_chunk: 256,
        ..EngineConfig::new(4096)
    };
    Engine::new(Arc::clone(&lm().model), cfg).unwrap()
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

const TOOL_OUTPUT: &str = "[{\"flight\": \"AF1404\", \"departs\": \"07:15\", \"price\": 182}, \
    {\"flight\": \"AZ317\", \"departs\": \"09:40\", \"price\": 149}, \
    {\"flight\": \"FR9801\", \"departs\": \"13:05\", \"price\": 61}]";

/// An agent's history with the tool output as given, then `tail`.
fn history(tool: &str, tail: &[(&str, &str)]) -> Vec<ChatMessage> {
    let mut m = vec![
        msg(
            "system",
            "You are a travel agent. Use tools to look things up.",
        ),
        msg("user", "Find me a flight from Paris to Rome on Friday."),
        msg("assistant", "Let me search the flights."),
        msg("tool", tool),
        msg(
            "assistant",
            "The cheapest option is FR9801 at 13:05 for 61 euros.",
        ),
        msg("user", "Great, which one leaves earliest?"),
    ];
    m.extend(tail.iter().map(|(r, c)| msg(r, c)));
    m
}

/// The rendered prompt and its message bounds.
fn render(chat: &[ChatMessage]) -> (Vec<u32>, Vec<usize>) {
    let lm = lm();
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let template = lm
        .chat
        .as_ref()
        .expect("the default model has a chat template");
    let (tokens, bounds) = render_prompt(&lm.tokenizer, template, chat, &opts, true).unwrap();
    (tokens, bounds.expect("bounds were asked for"))
}

/// A greedy request for 8 tokens whose sink records tokens and usage.
fn request(prompt: Vec<u32>) -> (Request, Shared) {
    common::request(prompt, 8)
}

/// Runs a sessionless request with message bounds (an implicit turn) to its end.
fn implicit(e: &mut Engine, chat: &[ChatMessage], mode: Mode, tenant: u64) -> (Vec<u32>, Usage) {
    keyed(e, chat, mode, tenant, None)
}

/// [`implicit`] under a client's conversation key.
fn keyed(
    e: &mut Engine,
    chat: &[ChatMessage],
    mode: Mode,
    tenant: u64,
    conversation: Option<u64>,
) -> (Vec<u32>, Usage) {
    let (prompt, bounds) = render(chat);
    let (mut req, out) = request(prompt);
    req.tenant = tenant;
    req.implicit = Some(ImplicitTurn {
        bounds,
        mode,
        conversation,
    });
    finish(e, req, out)
}

/// Runs a turn of an explicit session along message bounds.
fn explicit(
    e: &mut Engine,
    id: leyline_engine::SessionId,
    chat: &[ChatMessage],
) -> (Vec<u32>, Usage) {
    let (prompt, bounds) = render(chat);
    let (req, out) = request(prompt);
    let req = req.in_session(SessionRequest {
        id,
        mode: Mode::Amortize,
        edits: SessionEdits::Messages(bounds),
    });
    finish(e, req, out)
}

fn finish(e: &mut Engine, req: Request, out: Shared) -> (Vec<u32>, Usage) {
    e.submit(req);
    e.run_to_completion().unwrap();
    e.check_no_leaks().unwrap();
    let o = out.lock().unwrap();
    assert!(o.failed.is_none(), "{:?}", o.failed);
    let (_, usage) = o.finished.clone().expect("the request finished");
    (o.tokens.clone(), usage)
}

/// Where the tool message starts in the first turn's prompt: no prefix tree serves more.
fn tool_start() -> usize {
    render(&history(TOOL_OUTPUT, &[])).1[3]
}

#[test]
fn a_sessionless_edit_is_spliced_as_an_explicit_session_would_splice_it() {
    let turn1 = history(TOOL_OUTPUT, &[]);
    let turn2 = history(
        "[cleared]",
        &[("assistant", "AF1404."), ("user", "Book it.")],
    );
    let turn3 = history(
        "[cleared]",
        &[
            ("assistant", "AF1404."),
            ("user", "Book it."),
            ("assistant", "Done."),
            ("user", "Thanks!"),
        ],
    );

    let mut reference = engine();
    let sid = reference.create_session();
    let want: Vec<_> = [&turn1, &turn2, &turn3]
        .iter()
        .map(|t| explicit(&mut reference, sid, t))
        .collect();
    assert!(want[1].1.edit.is_some_and(|r| r.directives > 0));

    let mut e = engine();
    let got: Vec<_> = [&turn1, &turn2, &turn3]
        .iter()
        .map(|t| implicit(&mut e, t, Mode::Amortize, 0))
        .collect();
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "turn {}: tokens", k + 1);
        assert_eq!(g.1.cached_tokens, w.1.cached_tokens, "turn {}", k + 1);
        assert_eq!(g.1.prefilled_tokens, w.1.prefilled_tokens, "turn {}", k + 1);
        assert_eq!(
            g.1.edit.map(|r| r.directives),
            w.1.edit.map(|r| r.directives)
        );
    }
    // The edit turn reused what follows the cleared output, which no prefix match can.
    assert!(got[1].1.cached_tokens > tool_start() + 10, "{:?}", got[1].1);
    // Every turn whose history changed (the recorded replies differ from the generated
    // ones, too) was a splice of the cached conversation.
    let edited = want
        .iter()
        .filter(|w| w.1.edit.is_some_and(|r| r.directives > 0))
        .count();
    assert_eq!(e.metrics().snapshot().implicit_splices, edited as u64);
}

#[test]
fn the_edited_conversation_stays_intact_for_its_other_continuations() {
    let turn1 = history(TOOL_OUTPUT, &[]);
    let (prompt1, _) = render(&turn1);
    let edit = history(
        "[cleared]",
        &[("assistant", "AF1404."), ("user", "Book it.")],
    );
    let mut e = engine();
    implicit(&mut e, &turn1, Mode::Amortize, 0);
    // The first turn's slots, as the prefix tree serves them, and every key they hold.
    let keys = |e: &Engine| {
        let (_, _, slots) = e
            .cache()
            .sequences()
            .into_iter()
            .find(|(_, tokens, _)| tokens.starts_with(&prompt1))
            .expect("the first turn is in the prefix tree");
        let g = lm().model.info().geometry;
        let mut k = vec![0.0f32; slots.len() * g.k_width() * g.layers];
        for (l, rows) in k.chunks_mut(slots.len() * g.k_width()).enumerate() {
            e.storage().gather_k(l, &slots, rows).unwrap();
        }
        (slots, k)
    };
    let before = keys(&e);
    let (_, usage) = implicit(&mut e, &edit, Mode::Amortize, 0);
    let report = usage.edit.expect("a turn of a conversation");
    assert!(report.rotated > 0 && report.copied > 0, "{report:?}");
    // The splice rotated copies: the original's keys did not move.
    assert!(
        before == keys(&e),
        "the cached conversation changed under the splice"
    );
}

#[test]
fn another_tenant_never_continues_a_conversation() {
    let mut e = engine();
    implicit(&mut e, &history(TOOL_OUTPUT, &[]), Mode::Amortize, 0);
    let edited = history("[cleared]", &[("user", "Book it.")]);
    let (_, usage) = implicit(&mut e, &edited, Mode::Amortize, 7);
    assert_eq!(usage.cached_tokens, 0, "{usage:?}");
    assert_eq!(usage.edit.map(|r| r.directives), Some(0));
    assert_eq!(e.metrics().snapshot().implicit_splices, 0);
}

#[test]
fn a_conversation_key_continues_only_its_own_conversation() {
    let edited = history(
        "[cleared]",
        &[("assistant", "AF1404."), ("user", "Book it.")],
    );
    // Under another key (or none), the edit finds no conversation to splice: only the
    // prefix tree serves it, up into the edited tool message.
    for (first, second) in [(Some(1), Some(2)), (Some(1), None), (None, Some(1))] {
        let mut e = engine();
        keyed(&mut e, &history(TOOL_OUTPUT, &[]), Mode::Amortize, 0, first);
        let (_, usage) = keyed(&mut e, &edited, Mode::Amortize, 0, second);
        assert_eq!(
            usage.edit.map(|r| r.directives),
            Some(0),
            "{first:?} then {second:?}"
        );
        assert!(usage.cached_tokens < tool_start() + 10, "{usage:?}");
        assert_eq!(e.metrics().snapshot().implicit_splices, 0);
    }
    // Under the same key, it is spliced as a keyless conversation is.
    let mut e = engine();
    keyed(
        &mut e,
        &history(TOOL_OUTPUT, &[]),
        Mode::Amortize,
        0,
        Some(1),
    );
    let (_, usage) = keyed(&mut e, &edited, Mode::Amortize, 0, Some(1));
    assert!(usage.edit.is_some_and(|r| r.directives > 0), "{usage:?}");
    assert!(usage.cached_tokens > tool_start() + 10, "{usage:?}");
    assert_eq!(e.metrics().snapshot().implicit_splices, 1);
}

#[test]
fn another_conversation_with_the_same_system_prompt_is_not_spliced_into() {
    // A second agent of the same tenant: same system prompt, its own first message. The
    // diff against the first agent's conversation changes that conversation's last message,
    // so it is no continuation of it: the prefix tree alone serves the shared part.
    let mut e = engine();
    implicit(&mut e, &history(TOOL_OUTPUT, &[]), Mode::Amortize, 0);
    let other = [
        msg(
            "system",
            "You are a travel agent. Use tools to look things up.",
        ),
        msg("user", "Cancel my booking to Rome, please."),
    ];
    let (prompt, _) = render(&other);
    let shared = leyline_kv::radix::common_prefix(&prompt, &render(&history(TOOL_OUTPUT, &[])).0);
    let (_, usage) = implicit(&mut e, &other, Mode::Amortize, 0);
    assert_eq!(usage.edit.map(|r| r.directives), Some(0), "{usage:?}");
    assert_eq!(usage.cached_tokens, shared);
    assert_eq!(e.metrics().snapshot().implicit_splices, 0);
}

#[test]
fn a_keyed_compaction_that_moves_a_message_is_spliced() {
    // Claude Code's `/compact`: the follow-up puts a summary first, keeps the last reply and
    // moves a long message (its environment notes; here the tool output) to the end, after
    // the new request. The conversation's last message goes, so only the client's key says
    // that this is the same conversation.
    let turn1 = history(TOOL_OUTPUT, &[]);
    let compacted = [
        turn1[0].clone(),
        msg(
            "user",
            "Summary: the user wants the earliest flight from Paris to Rome on Friday.",
        ),
        turn1[4].clone(),
        msg("user", "Book the earliest one."),
        msg("tool", TOOL_OUTPUT),
    ];
    let (prompt, bounds) = render(&compacted);
    let shared = leyline_kv::radix::common_prefix(&prompt, &render(&turn1).0);
    let moved = bounds[5] - bounds[4];
    assert!(
        moved > 40,
        "the moved message is the long one: {moved} tokens"
    );
    for key in [None, Some(7)] {
        let mut e = engine();
        keyed(&mut e, &turn1, Mode::Amortize, 0, key);
        let (_, usage) = keyed(&mut e, &compacted, Mode::Amortize, 0, key);
        let splices = e.metrics().snapshot().implicit_splices;
        if key.is_none() {
            // Keyless, a changed last message means another conversation: the tree serves.
            assert_eq!(splices, 0, "{usage:?}");
            assert_eq!(usage.cached_tokens, shared);
        } else {
            // Keyed, the splice keeps the moved message's KV: it is not prefilled again.
            assert_eq!(splices, 1, "{usage:?}");
            assert!(usage.edit.is_some_and(|r| r.directives > 0), "{usage:?}");
            assert!(
                usage.prefilled_tokens + moved <= prompt.len() - shared,
                "{usage:?}"
            );
        }
    }
}

#[test]
fn a_moved_message_takes_its_kv_along_instead_of_being_prefilled() {
    // Codex's second compaction reorders what it keeps; here the tool output moves ahead
    // of the first user message and the reply after it, and the last message stays. The
    // message diff keeps the most messages in place (the two short ones), so the tool
    // output is deleted and inserted again: prefilled by the splice, unless its run is
    // found in the cached conversation.
    let turn1 = history(TOOL_OUTPUT, &[]);
    let moved = [
        turn1[0].clone(),
        turn1[3].clone(),
        turn1[1].clone(),
        turn1[2].clone(),
        turn1[4].clone(),
        turn1[5].clone(),
    ];
    let (_, bounds) = render(&moved);
    let (_, old_bounds) = render(&turn1);
    let span = bounds[2] - bounds[1];
    assert_eq!(span, old_bounds[4] - old_bounds[3], "the tool message");
    let run = |reuse_min_tokens: usize| {
        let cfg = EngineConfig {
            prefill_chunk: 256,
            reuse_min_tokens,
            ..EngineConfig::new(4096)
        };
        let mut e = Engine::new(Arc::clone(&lm().model), cfg).unwrap();
        implicit(&mut e, &turn1, Mode::Amortize, 0);
        let (_, usage) = implicit(&mut e, &moved, Mode::Amortize, 0);
        assert_eq!(e.metrics().snapshot().implicit_splices, 1, "{usage:?}");
        usage
    };
    let prefilled = run(0);
    let copied = run(8);
    let report = copied.edit.expect("an edit");
    assert_eq!(prefilled.edit.map(|r| r.moved), Some(0));
    // Every token of the moved messages is found (they were adjacent before, too), unless
    // a tokenizer merge at a message bound cut a token off an end.
    assert!(
        report.moved + 2 >= span && report.moved <= span,
        "{report:?}, {span}"
    );
    assert_eq!(
        copied.prefilled_tokens + report.moved,
        prefilled.prefilled_tokens,
        "{copied:?} vs {prefilled:?}"
    );
    assert_eq!(copied.cached_tokens, prefilled.cached_tokens + report.moved);
    assert_eq!(copied.prompt_tokens, prefilled.prompt_tokens);
}

#[test]
fn a_splice_whose_repair_recomputes_what_it_saves_is_not_taken() {
    // The last reply is edited near its end: everything after the edit is a few tokens, all
    // inside a 64-token repair window. Spliced, those tokens are recomputed anyway, so the
    // splice saves nothing over the prefix tree and the tree serves; without repair, the
    // splice saves them.
    let turn1 = history(TOOL_OUTPUT, &[]);
    let mut edited = history(TOOL_OUTPUT, &[("user", "Book it.")]);
    edited[4] = msg(
        "assistant",
        "The cheapest option is FR9801 at 13:05 for 61 EUR.",
    );
    let (prompt, bounds) = render(&edited);
    let shared = leyline_kv::radix::common_prefix(&prompt, &render(&turn1).0);
    assert!(shared > bounds[4], "the two part inside the reply");
    for (repair, spliced) in [
        (Repair::new(64, RepairRule::AfterEdit), 0),
        (Repair::NONE, 1),
    ] {
        let cfg = EngineConfig {
            prefill_chunk: 256,
            repair,
            ..EngineConfig::new(4096)
        };
        let mut e = Engine::new(Arc::clone(&lm().model), cfg).unwrap();
        implicit(&mut e, &turn1, Mode::Amortize, 0);
        let (_, usage) = implicit(&mut e, &edited, Mode::Amortize, 0);
        let m = e.metrics().snapshot();
        assert_eq!(m.implicit_splices, spliced, "{repair}: {usage:?}");
        if spliced == 0 {
            assert_eq!(usage.cached_tokens, shared, "the tree served: {usage:?}");
        } else {
            assert!(usage.prefilled_tokens < prompt.len() - shared, "{usage:?}");
        }
    }
}

#[test]
fn a_sessionless_forget_erases_what_it_drops() {
    let turn1 = history(TOOL_OUTPUT, &[]);
    let (prompt1, _) = render(&turn1);
    let mut e = engine();
    implicit(&mut e, &turn1, Mode::Amortize, 0);
    let ns = Namespace::shared(0).for_tenant(0);
    assert_eq!(e.cache().cached_len(ns, &prompt1), prompt1.len());

    let edited = history("[cleared]", &[("user", "Book it.")]);
    // Where the two histories part: inside the tool message, after its header.
    let kept = leyline_kv::radix::common_prefix(&prompt1, &render(&edited).0);
    assert!(kept > tool_start());
    let (_, usage) = implicit(&mut e, &edited, Mode::Forget, 0);
    assert!(usage
        .edit
        .is_some_and(|r| r.mode == Mode::Forget && r.directives > 0));
    assert_eq!(e.metrics().snapshot().implicit_splices, 0);
    // Nothing computed from the old tool output is served again, by any path.
    assert_eq!(e.cache().cached_len(ns, &prompt1), kept);
    // The original history again: its tool output is computed anew (the conversation
    // holds only what the FORGET turn computed after the stub).
    let tool_end = render(&turn1).1[4] - 2; // before `<|im_end|>\n`
    let (_, again) = implicit(&mut e, &turn1, Mode::Amortize, 0);
    assert!(again.prefilled_tokens >= tool_end - kept, "{again:?}");
}

#[test]
fn conversations_are_bounded() {
    let cfg = EngineConfig {
        max_implicit_sessions: 2,
        ..EngineConfig::new(4096)
    };
    let mut e = Engine::new(Arc::clone(&lm().model), cfg).unwrap();
    for (k, user) in ["one", "two", "three", "four"].iter().enumerate() {
        let chat = [msg("system", "Be brief."), msg("user", user)];
        implicit(&mut e, &chat, Mode::Amortize, 0);
        assert_eq!(e.metrics().snapshot().conversations, (k as u64 + 1).min(2));
    }
    // The dropped conversations' KV is still in the prefix tree for plain prefixes.
    let (p, _) = render(&[msg("system", "Be brief."), msg("user", "one")]);
    let (req, out) = request(p.clone());
    let (_, usage) = finish(&mut e, req, out);
    assert_eq!(usage.cached_tokens, p.len() - 1);
}

#[test]
fn a_cache_flush_drops_the_tenants_conversations() {
    let mut e = engine();
    implicit(&mut e, &history(TOOL_OUTPUT, &[]), Mode::Amortize, 0);
    implicit(&mut e, &history(TOOL_OUTPUT, &[]), Mode::Amortize, 3);
    assert_eq!(e.metrics().snapshot().conversations, 2);
    e.flush_prefix_cache(Some(3)).unwrap();
    assert_eq!(e.metrics().snapshot().conversations, 1);
    e.flush_prefix_cache(Some(0)).unwrap();
    assert_eq!(e.metrics().snapshot().conversations, 0);
    assert_eq!(e.cache().pool().used_count(), 0);
    e.check_no_leaks().unwrap();
}
