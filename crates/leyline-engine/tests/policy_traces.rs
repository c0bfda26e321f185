//! Acceptance of "policies: edited message lists become token directives", with the real
//! tokenizer and chat template of the default model ([`ChatRenderer`]): on every turn of every
//! trajectory in `data/traces/`, under each built-in policy, applying the diffed edits to the
//! cached tokens (previous prompt + recorded reply, as `turn_diffs` renders them) gives the new
//! prompt's tokens exactly, and there is one edit per edited message.
//!
//! The renderer runs without the generation prompt: the engine appends
//! `<|im_start|>assistant\n` to each request and the model's reply follows it, so what stays
//! cached is the prompt plus the reply as the template renders it (checked below).

use leyline_engine::{to_chat_message, ChatRenderer, MemoRenderer};
use leyline_model::chat::ChatTemplate;
use leyline_model::tokenizer::Tokenizer;
use leyline_policy::Renderer;
use leyline_policy::{
    apply_edits, first_unstable_boundary, load_traces, replay_turns, replay_turns_stateful,
    turn_diffs, Message, PolicyConfig, PolicyStats, Role, Trajectory, Turn,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

/// The default model file (fetched if absent), or `$LEYLINE_MODEL` when set.
fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LEYLINE_MODEL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    leyline_hub::default_model_path().expect("the default model (fetch failed)")
}

/// Tokenizer and template from the GGUF metadata alone (no weights).
fn model() -> &'static (Tokenizer, ChatTemplate) {
    static M: OnceLock<(Tokenizer, ChatTemplate)> = OnceLock::new();
    M.get_or_init(|| {
        let f = leyline_model::gguf::GgufFile::open(&model_path()).expect("GGUF opens");
        let tok = Tokenizer::from_gguf_metadata(f.metadata()).expect("tokenizer");
        let tmpl = ChatTemplate::from_gguf_metadata(f.metadata(), &tok).expect("chat template");
        (tok, tmpl)
    })
}

fn traces() -> &'static [Trajectory] {
    static T: OnceLock<Vec<Trajectory>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/traces");
        let mut all = Vec::new();
        for name in ["tau-bench.jsonl", "swe-agent-demos.jsonl"] {
            let t = load_traces(dir.join(name)).expect("trace file");
            assert!(!t.is_empty(), "{name}");
            all.extend(t);
        }
        all
    })
}

/// The policies under test; the `clear_tool_uses` triggers are low enough to fire on these
/// traces (the default, 100k tokens, never does). Stateful replay only where it differs.
fn policies() -> Vec<(&'static str, bool)> {
    vec![
        ("none", false),
        ("truncate_tool_outputs:0", false),
        ("truncate_tool_outputs:1", false),
        ("truncate_tool_outputs:2", false),
        ("truncate_tool_outputs:5", false),
        ("clear_tool_uses:trigger=4000,keep=3", false),
        ("clear_tool_uses:trigger=4000,keep=3", true),
        (
            "clear_tool_uses:trigger_tool_uses=2,keep=1,clear_tool_inputs=true",
            false,
        ),
    ]
}

#[derive(Default, Clone)]
struct Tally {
    turns: usize,
    exact: usize,
    /// Turns whose non-append edit count differs from the edited-message count.
    mismatch: usize,
    /// Of those, turns where the last edit ran into the append (documented merge in `diff`).
    merged_with_append: usize,
    /// Turns whose edit count differs because the diff kept a moved message (fewer tokens
    /// to prefill than editing in place), and their edits less their edited messages.
    moved: usize,
    moved_extra_edits: isize,
    /// Turns of `none` that were not a pure append at the end of the cache.
    not_pure_append: usize,
    edited_messages: usize,
    /// Replays whose last turn was also rendered by `ChatRenderer` and compared.
    checked_against_real: usize,
    stats: PolicyStats,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.turns += o.turns;
        self.exact += o.exact;
        self.mismatch += o.mismatch;
        self.merged_with_append += o.merged_with_append;
        self.moved += o.moved;
        self.moved_extra_edits += o.moved_extra_edits;
        self.not_pure_append += o.not_pure_append;
        self.edited_messages += o.edited_messages;
        self.checked_against_real += o.checked_against_real;
        self.stats.merge(&o.stats);
    }
}

type Key = (String, bool, String);

fn replay(trajectories: &[Trajectory], check_every: usize) -> BTreeMap<Key, Tally> {
    let (tok, tmpl) = model();
    let memo = MemoRenderer::new(tok, tmpl);
    let real = ChatRenderer::new(tok, tmpl, false);
    let mut out: BTreeMap<Key, Tally> = BTreeMap::new();
    // Trajectory first, so the memo serves every policy of one trajectory, then is dropped.
    for (ti, t) in trajectories.iter().enumerate() {
        memo.clear();
        for (spec, stateful) in policies() {
            let policy = spec.parse::<PolicyConfig>().unwrap().build();
            let turns: Vec<Turn> = if stateful {
                replay_turns_stateful(&t.messages, policy.as_ref()).collect()
            } else {
                replay_turns(&t.messages, policy.as_ref()).collect()
            };
            let tally = out
                .entry((spec.to_string(), stateful, t.source.clone()))
                .or_default();
            let mut last = None;
            for d in turn_diffs(turns.clone(), &memo) {
                let d = d.unwrap_or_else(|e| panic!("{spec} on {}: {e}", t.id));
                let old_len = d.old.tokens.len();
                tally.turns += 1;
                let applied = apply_edits(&d.old.tokens, &d.edits).expect("edits apply");
                tally.exact += usize::from(applied == d.new.tokens);
                let directives = d.edits.iter().filter(|e| !e.is_append(old_len)).count();
                let appends = d.edits.len() - directives;
                tally.edited_messages += d.edited_messages;
                if directives != d.edited_messages {
                    // A repeated output whose old copy the diff keeps (a move) prefills less
                    // than editing in place; not a mismatch.
                    if d.prefill() < d.in_place_prefill() {
                        tally.moved += 1;
                        tally.moved_extra_edits += directives as isize - d.edited_messages as isize;
                    } else {
                        tally.mismatch += 1;
                        // `diff` merges an edit ending at the cache's end with the append.
                        let merged = appends == 0
                            && d.edits.last().is_some_and(|e| e.end == old_len)
                            && directives + 1 == d.edited_messages;
                        tally.merged_with_append += usize::from(merged);
                    }
                }
                if spec == "none" {
                    let pure = match d.edits.as_slice() {
                        [] => d.new.tokens == d.old.tokens,
                        [e] => e.is_append(old_len),
                        _ => false,
                    };
                    tally.not_pure_append += usize::from(!pure);
                }
                tally.stats.record(old_len, d.new.tokens.len(), &d.edits);
                last = Some(d);
            }
            // The memo renders exactly what `ChatRenderer` renders: the last turn's cache
            // and prompt, which carry every edit of the replay.
            if let (Some(d), Some(turn)) = (last, turns.last()) {
                if ti % check_every == 0 {
                    let mut cached = turn.prompt.clone();
                    cached.push(turn.reply.clone());
                    assert_eq!(real.render_tokens(&turn.prompt).unwrap(), d.new, "{}", t.id);
                    let full = real.render_tokens(&cached).unwrap();
                    assert_eq!(memo.render_tokens(&cached).unwrap(), full, "{}", t.id);
                    tally.checked_against_real += 1;
                }
            }
        }
    }
    out
}

/// Splits the trajectories over two threads (the cost is tokenizing every prompt twice per
/// policy) and sums the tallies.
fn replay_all() -> BTreeMap<Key, Tally> {
    let all = traces();
    // Interleave so both halves get long and short trajectories.
    let halves: [Vec<Trajectory>; 2] = [0, 1].map(|h| {
        all.iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == h)
            .map(|(_, t)| t.clone())
            .collect()
    });
    let parts: Vec<BTreeMap<Key, Tally>> = std::thread::scope(|s| {
        let handles: Vec<_> = halves.iter().map(|h| s.spawn(|| replay(h, 4))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut out: BTreeMap<Key, Tally> = BTreeMap::new();
    for p in parts {
        for (k, t) in p {
            out.entry(k).or_default().add(&t);
        }
    }
    out
}

#[test]
fn real_tokenizer_round_trip_on_every_turn() {
    let started = Instant::now();
    let r = replay_all();
    eprintln!("replayed in {:.1} s", started.elapsed().as_secs_f64());
    let expected: BTreeMap<&str, usize> = traces().iter().fold(BTreeMap::new(), |mut m, t| {
        let n = t
            .messages
            .iter()
            .filter(|m| m.role == Role::Assistant)
            .count();
        *m.entry(t.source.as_str()).or_default() += n;
        m
    });
    for ((p, stateful, s), t) in &r {
        eprintln!(
            "{p:<66} stateful={stateful:<5} {s:<16} turns {:>5} exact {:>5} edited msgs {:>5} \
             mismatch {:>3} (merged with append {:>3}) moved {:>3} edits/turn {:.2} share {:.2} \
             removed/turn {:.0} mean|delta| {:.0}",
            t.turns,
            t.exact,
            t.edited_messages,
            t.mismatch,
            t.merged_with_append,
            t.moved,
            t.stats.edits_per_turn(),
            t.stats.edit_share(),
            t.stats.tokens_removed_per_turn(),
            t.stats.mean_abs_delta(),
        );
        assert_eq!(
            t.turns,
            expected[s.as_str()],
            "{p} on {s}: every turn replayed"
        );
        assert_eq!(
            t.exact, t.turns,
            "{p} on {s}: apply(old, diff) == new on every turn"
        );
        assert!(
            t.checked_against_real > 0,
            "{p} on {s}: memo never compared with ChatRenderer"
        );
        // Every mismatch must be the documented merge, and rare.
        assert_eq!(
            t.mismatch, t.merged_with_append,
            "{p} on {s}: unexplained count mismatch"
        );
        assert!(
            t.mismatch * 100 <= t.stats.turns_with_edit.max(1) as usize,
            "{p} on {s}: merges with the append in more than 1% of edited turns"
        );
        // A repeated output is uncommon; more would mean the alignment moves messages that
        // merely look alike.
        assert!(t.moved * 20 <= t.turns, "{p} on {s}: moves are rare");
        assert_eq!(t.not_pure_append, 0, "{p} on {s}: `none` only appends");
        // Edits count cached tokens, appends not: under `none` there are none.
        if p == "none" {
            assert_eq!(t.stats.edits, 0);
        }
    }
    // Not vacuous: each editing policy edits on both sources.
    for ((p, _, s), t) in &r {
        if p != "none" {
            assert!(t.stats.edits > 0, "{p} on {s} never edited");
            assert_eq!(
                t.stats.edits as isize,
                (t.edited_messages - t.merged_with_append) as isize + t.moved_extra_edits
            );
        }
    }
}

/// Runs `f` on `trajectories` over two threads and concatenates the results.
fn on_two_threads<T: Send>(
    trajectories: &[&Trajectory],
    f: impl Fn(&Trajectory) -> Vec<T> + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = [0, 1]
            .map(|h| {
                let f = &f;
                s.spawn(move || {
                    let mine = trajectories.iter().skip(h).step_by(2);
                    mine.flat_map(|t| f(t)).collect::<Vec<T>>()
                })
            })
            .into_iter()
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// `first_unstable_boundary` with the real renderer renders every prefix of a trajectory
/// (quadratic tokenizing), so it runs on every fourth trajectory; the whole-text check below
/// covers all of them.
#[test]
fn rendering_is_stable_at_every_message_boundary() {
    let (tok, tmpl) = model();
    let renderer = ChatRenderer::new(tok, tmpl, false);
    let started = Instant::now();
    let some: Vec<&Trajectory> = traces().iter().step_by(4).collect();
    assert!(
        some.iter().any(|t| t.source != some[0].source),
        "both sources"
    );
    let unstable = on_two_threads(&some, |t| {
        let at = first_unstable_boundary(&renderer, &t.messages).expect("renders");
        at.map(|i| (t.id.clone(), i)).into_iter().collect()
    });
    eprintln!(
        "boundary check of {} trajectories in {:.1} s",
        some.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(unstable.is_empty(), "unstable boundaries: {unstable:?}");
}

/// `ChatRenderer` tokenizes each message's text on its own; the model sees the whole text
/// tokenized at once. Both agree on every trajectory, and each message's bounds frame one
/// `<|im_start|>` .. `<|im_end|>` block.
#[test]
fn per_message_tokens_equal_whole_text_tokens() {
    let (tok, tmpl) = model();
    let renderer = ChatRenderer::new(tok, tmpl, false);
    let all: Vec<&Trajectory> = traces().iter().collect();
    let checked = on_two_threads(&all, |t| {
        let r = Renderer::render_tokens(&renderer, &t.messages).unwrap();
        let chat: Vec<_> = t.messages.iter().map(to_chat_message).collect();
        let text = tmpl.render(&chat, false).unwrap();
        assert_eq!(r.tokens, tok.encode(&text, false).unwrap(), "{}", t.id);
        assert_eq!(r.bounds.len(), t.messages.len() + 1);
        let (start, end) = (tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>"));
        for i in 0..t.messages.len() {
            let ids = &r.tokens[r.bounds[i]..r.bounds[i + 1]];
            let count = |x| ids.iter().filter(|&&y| Some(y) == x).count();
            let framed = ids.first().copied() == start && count(start) == 1 && count(end) == 1;
            assert!(
                framed,
                "{} message {i}: bounds do not frame one message",
                t.id
            );
        }
        vec![()]
    });
    assert_eq!(checked.len(), traces().len());
}

/// The cache after a turn is the prompt with the generation prompt plus the generated reply;
/// `turn_diffs` models it as the template's rendering of prompt + reply. They agree up to
/// what the template writes after the reply's end token (appended on the next turn anyway).
#[test]
fn cached_sequence_is_prompt_plus_reply() {
    let (tok, tmpl) = model();
    let plain = ChatRenderer::new(tok, tmpl, false);
    let with_gen = ChatRenderer::new(tok, tmpl, true);
    let eos = tok
        .token_id("<|im_end|>")
        .expect("ChatML end-of-turn token");
    let mut checked = 0;
    for t in traces().iter().step_by(11) {
        for turn in replay_turns(&t.messages, &leyline_policy::NoPolicy).take(4) {
            let prompt = Renderer::render_tokens(&with_gen, &turn.prompt).unwrap();
            let mut engine_cache = prompt.tokens.clone();
            engine_cache.extend(tok.encode(&turn.reply.content, false).unwrap());
            engine_cache.push(eos);
            let mut cached_msgs: Vec<Message> = turn.prompt.clone();
            cached_msgs.push(turn.reply.clone());
            let modelled = Renderer::render_tokens(&plain, &cached_msgs).unwrap();
            assert!(
                modelled.tokens.starts_with(&engine_cache),
                "{} turn {}: the cache is not a prefix of the rendered prompt + reply",
                t.id,
                turn.turn
            );
            let rest = tok
                .decode(&modelled.tokens[engine_cache.len()..], false)
                .unwrap();
            assert!(
                rest.trim().is_empty(),
                "{} turn {}: after the reply: {rest:?}",
                t.id,
                turn.turn
            );
            checked += 1;
        }
    }
    assert!(checked > 50, "{checked}");
}
