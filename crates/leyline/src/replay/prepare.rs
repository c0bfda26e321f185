//! Trajectories to sessions of rendered prompts, once for every arm and concurrency.

use anyhow::{Context, Result};
use clap::ValueEnum;
use leyline_policy::{
    diff_rendered, replay_turns, Message, Policy, Rendered, Renderer, Trajectory,
};

/// What happens to a trajectory whose prompt outgrows the model's context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LongRule {
    /// Keep its turns up to the first prompt that does not fit; drop that turn and the rest.
    Cut,
    /// Leave the whole trajectory out and take the next one in the file.
    Skip,
}

/// One assistant turn: the policy-edited prompt, rendered with the generation prompt.
#[derive(Debug, Clone)]
pub struct PreparedTurn {
    /// 0-based assistant turn of the trajectory.
    pub turn: usize,
    /// Tokens and message bounds.
    pub prompt: Rendered,
    /// The policy changed a message the previous request had already seen.
    pub edit_turn: bool,
    /// Tokens no cache could have held for this prompt: for a session's first turn, the
    /// prompt past the longest prefix of an earlier session's prompts; later, the tokens the
    /// turn adds to or writes into the previous prompt (new messages, replacement text).
    /// Their sum is the floor against which a run's prefill is amplification.
    pub fresh_tokens: usize,
}

/// A trajectory as one replay session.
#[derive(Debug, Clone)]
pub struct PreparedSession {
    /// `source/id` of the trajectory.
    pub name: String,
    /// Its turns, in order.
    pub turns: Vec<PreparedTurn>,
}

/// The sessions of a replay and what the length rule did.
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// Sessions in replay order.
    pub sessions: Vec<PreparedSession>,
    /// Trajectories left out by `--long skip` (or with no turn that fits).
    pub skipped: Vec<String>,
    /// Sessions that lost turns to `--long cut`.
    pub cut_sessions: usize,
    /// Turns dropped by `--long cut` (only turns within `--max-turns` are counted).
    pub cut_turns: usize,
}

impl Prepared {
    /// Requests one run sends.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// Longest prompt, in tokens.
    pub fn longest_prompt(&self) -> usize {
        self.sessions
            .iter()
            .flat_map(|s| &s.turns)
            .map(|t| t.prompt.tokens.len())
            .max()
            .unwrap_or(0)
    }
}

/// How many sessions and turns to take, and the length limit.
#[derive(Debug, Clone, Copy)]
pub struct PrepareOpts {
    /// Sessions to take, in file order.
    pub sessions: usize,
    /// Most turns per session.
    pub max_turns: usize,
    /// A prompt fits when `prompt + reserve < limit`.
    pub limit: usize,
    /// Tokens reserved after the prompt (generation).
    pub reserve: usize,
    /// What to do with a prompt that does not fit.
    pub rule: LongRule,
}

/// Renders the first `opts.sessions` usable trajectories under `policy`.
///
/// # Errors
/// A trajectory the renderer cannot render.
pub fn prepare(
    trajectories: &[Trajectory],
    policy: &dyn Policy,
    renderer: &dyn Renderer,
    opts: &PrepareOpts,
) -> Result<Prepared> {
    let mut out = Prepared::default();
    for t in trajectories {
        if out.sessions.len() >= opts.sessions {
            break;
        }
        let name = format!("{}/{}", t.source, t.id);
        let mut turns = Vec::new();
        let mut seen: Vec<Message> = Vec::new();
        let mut too_long = None;
        let all: Vec<_> = replay_turns(&t.messages, policy)
            .take(opts.max_turns)
            .collect();
        let total = all.len();
        for (k, turn) in all.into_iter().enumerate() {
            let prompt = renderer
                .render_tokens(&turn.prompt)
                .with_context(|| format!("rendering {name} turn {}", turn.turn))?;
            if prompt.tokens.len() + opts.reserve >= opts.limit {
                too_long = Some(k);
                break;
            }
            let edit_turn = seen
                .iter()
                .enumerate()
                .any(|(i, m)| turn.prompt.get(i) != Some(m));
            seen.clone_from(&turn.prompt);
            seen.push(turn.reply);
            turns.push(PreparedTurn {
                turn: turn.turn,
                prompt,
                edit_turn,
                fresh_tokens: 0,
            });
        }
        match too_long {
            Some(_) if opts.rule == LongRule::Skip => {
                out.skipped.push(name);
                continue;
            }
            Some(k) => {
                out.cut_sessions += 1;
                out.cut_turns += total - k;
            }
            None => {}
        }
        if turns.is_empty() {
            out.skipped.push(name);
            continue;
        }
        fresh_tokens(&mut turns, &out.sessions)?;
        out.sessions.push(PreparedSession { name, turns });
    }
    Ok(out)
}

/// Fills in [`PreparedTurn::fresh_tokens`] of a session's `turns`, `earlier` being the
/// sessions replayed before it.
fn fresh_tokens(turns: &mut [PreparedTurn], earlier: &[PreparedSession]) -> Result<()> {
    let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let first = &turns[0].prompt.tokens;
    let shared = earlier
        .iter()
        .flat_map(|s| &s.turns)
        .map(|t| common(&t.prompt.tokens, first))
        .max()
        .unwrap_or(0);
    turns[0].fresh_tokens = first.len() - shared;
    for k in 1..turns.len() {
        let edits = diff_rendered(&turns[k - 1].prompt, &turns[k].prompt)
            .context("diffing consecutive prompts")?;
        turns[k].fresh_tokens = edits.iter().map(|e| e.replacement.len()).sum();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use leyline_policy::{ByteChatMl, PolicyConfig};

    fn trajectory(id: &str, tool_chars: usize) -> Trajectory {
        let out = "x".repeat(tool_chars);
        let messages = vec![
            Message::system("sys"),
            Message::user("go"),
            Message::assistant("a1"),
            Message::tool("t", out.clone()),
            Message::assistant("a2"),
            Message::tool("t", out.clone()),
            Message::assistant("a3"),
            Message::tool("t", out),
            Message::assistant("a4"),
        ];
        Trajectory {
            id: id.into(),
            source: "test".into(),
            meta: serde_json::Value::Null,
            messages,
        }
    }

    fn opts(limit: usize, rule: LongRule) -> PrepareOpts {
        PrepareOpts {
            sessions: 2,
            max_turns: 10,
            limit,
            reserve: 4,
            rule,
        }
    }

    #[test]
    fn edit_turns_are_the_turns_where_an_old_message_changed() {
        let policy: PolicyConfig = "truncate_tool_outputs:1".parse().unwrap();
        let p = policy.build();
        let t = [trajectory("a", 50)];
        let got = prepare(&t, p.as_ref(), &ByteChatMl, &opts(100_000, LongRule::Cut)).unwrap();
        let s = &got.sessions[0];
        assert_eq!(s.turns.len(), 4);
        // Independent view: a turn edits iff the previous prompt's messages are no longer a
        // token prefix of this prompt.
        for w in s.turns.windows(2) {
            let prev = &w[0].prompt;
            let kept = &prev.tokens[..*prev.bounds.last().unwrap()];
            assert_eq!(
                w[1].edit_turn,
                !w[1].prompt.tokens.starts_with(kept),
                "turn {}",
                w[1].turn
            );
        }
        assert!(!s.turns[0].edit_turn);
        assert!(
            s.turns.iter().any(|t| t.edit_turn),
            "the policy stubs some output"
        );
        let none = PolicyConfig::None.build();
        let got = prepare(
            &t,
            none.as_ref(),
            &ByteChatMl,
            &opts(100_000, LongRule::Cut),
        )
        .unwrap();
        assert!(got.sessions[0].turns.iter().all(|t| !t.edit_turn));
    }

    #[test]
    fn fresh_tokens_are_what_no_cache_could_hold() {
        let policy: PolicyConfig = "truncate_tool_outputs:1".parse().unwrap();
        let p = policy.build();
        let t = [trajectory("a", 50), trajectory("b", 50)];
        let got = prepare(&t, p.as_ref(), &ByteChatMl, &opts(100_000, LongRule::Cut)).unwrap();
        let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let (a, b) = (&got.sessions[0].turns, &got.sessions[1].turns);
        // Nothing before the first session; the second repeats the first's opening.
        assert_eq!(a[0].fresh_tokens, a[0].prompt.tokens.len());
        assert_eq!(b[0].fresh_tokens, 0, "the same first prompt");
        for w in a.windows(2) {
            let (prev, cur) = (&w[0].prompt.tokens, &w[1].prompt.tokens);
            // Byte tokens: past the common prefix, a plain turn is all new, and an edit
            // turn writes only the stub and the new messages, fewer than a re-prefill.
            let tail = cur.len() - common(prev, cur);
            if w[1].edit_turn {
                assert!(w[1].fresh_tokens < tail, "turn {}", w[1].turn);
                assert!(w[1].fresh_tokens >= cur.len().saturating_sub(prev.len()));
            } else {
                assert_eq!(w[1].fresh_tokens, tail, "turn {}", w[1].turn);
            }
        }
    }

    #[test]
    fn long_trajectories_are_cut_or_skipped_and_counted() {
        let none = PolicyConfig::None.build();
        let t = [
            trajectory("long", 400),
            trajectory("short", 10),
            trajectory("c", 10),
        ];
        // Turn 0 of "long" fits, turn 1 holds one 400-char output and does not.
        let cut = prepare(&t, none.as_ref(), &ByteChatMl, &opts(300, LongRule::Cut)).unwrap();
        assert_eq!(cut.sessions.len(), 2);
        assert_eq!(cut.sessions[0].name, "test/long");
        assert_eq!(cut.sessions[0].turns.len(), 1);
        assert_eq!((cut.cut_sessions, cut.cut_turns), (1, 3));
        let skip = prepare(&t, none.as_ref(), &ByteChatMl, &opts(300, LongRule::Skip)).unwrap();
        let names: Vec<&str> = skip.sessions.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["test/short", "test/c"]);
        assert_eq!(skip.skipped, ["test/long"]);
        for s in &skip.sessions {
            for t in &s.turns {
                assert!(t.prompt.tokens.len() + 4 < 300);
            }
        }
    }
}
