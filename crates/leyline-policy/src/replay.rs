//! Replaying a trajectory under a policy: the prompt of every assistant turn, and the token
//! edits between what the cache holds and the next prompt.

use crate::diff::{diff_rendered, Edit, Rendered, Renderer};
use crate::error::Result;
use crate::message::{Message, Role};
use crate::policy::Policy;

/// One assistant turn of a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// 0-based count of assistant messages before this one.
    pub turn: usize,
    /// Index of the recorded assistant message in the trajectory.
    pub message_index: usize,
    /// The prompt: the history before the reply, as the policy edited it.
    pub prompt: Vec<Message>,
    /// The recorded assistant message, appended as if the model had written it.
    pub reply: Message,
}

/// The turns of `messages` under `policy`, stateless: each prompt is the policy applied to the
/// original history before the reply (what a client that resends the full history gets).
pub fn replay_turns<'a>(
    messages: &'a [Message],
    policy: &'a dyn Policy,
) -> impl Iterator<Item = Turn> + 'a {
    assistant_indices(messages)
        .enumerate()
        .map(move |(turn, i)| Turn {
            turn,
            message_index: i,
            prompt: policy.transform(&messages[..i], turn),
            reply: messages[i].clone(),
        })
}

/// The turns of `messages` under `policy`, stateful: each prompt is the policy applied to the
/// previous prompt, its reply, and the messages recorded since (what a server that keeps the
/// edited history gets). Same as [`replay_turns`] for policies whose decisions only grow with
/// the history (`truncate_tool_outputs`); `clear_tool_uses` differs because its trigger and
/// `clear_at_least` then see the already-cleared history.
pub fn replay_turns_stateful<'a>(
    messages: &'a [Message],
    policy: &'a dyn Policy,
) -> impl Iterator<Item = Turn> + 'a {
    let mut history: Vec<Message> = Vec::new();
    let mut seen = 0;
    assistant_indices(messages)
        .enumerate()
        .map(move |(turn, i)| {
            history.extend_from_slice(&messages[seen..i]);
            let prompt = policy.transform(&history, turn);
            history.clone_from(&prompt);
            history.push(messages[i].clone());
            seen = i + 1;
            Turn {
                turn,
                message_index: i,
                prompt,
                reply: messages[i].clone(),
            }
        })
}

fn assistant_indices(messages: &[Message]) -> impl Iterator<Item = usize> + '_ {
    messages
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == Role::Assistant)
        .map(|(i, _)| i)
}

/// What changes in the cache at one turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnDiff {
    /// The turn.
    pub turn: usize,
    /// What the cache holds: the previous prompt and its reply (empty before turn 0).
    pub old: Rendered,
    /// This turn's prompt.
    pub new: Rendered,
    /// [`crate::diff()`] of the two; `apply_edits(old, edits) == new`.
    pub edits: Vec<Edit>,
    /// How many messages of the old history the new prompt changed.
    pub edited_messages: usize,
}

impl TurnDiff {
    /// Tokens this turn would prefill if each message that differs from the cached one at
    /// its index were replaced where it stands and the new ones appended (the tokens after
    /// the last message, e.g. a generation prompt, included). [`crate::diff()`] prefills
    /// fewer where it keeps a message that moved instead.
    pub fn in_place_prefill(&self) -> usize {
        fn seg(r: &Rendered, i: usize) -> &[u32] {
            &r.tokens[r.bounds[i]..r.bounds[i + 1]]
        }
        let n_old = self.old.bounds.len().saturating_sub(1);
        let Some(n_new) = self.new.bounds.len().checked_sub(1) else {
            return self.new.tokens.len();
        };
        let changed: usize = (0..n_new)
            .filter(|&i| i >= n_old || seg(&self.old, i) != seg(&self.new, i))
            .map(|i| seg(&self.new, i).len())
            .sum();
        changed + self.new.tokens.len() - self.new.bounds[n_new]
    }

    /// Tokens the diff's edits prefill: their replacements.
    pub fn prefill(&self) -> usize {
        self.edits.iter().map(|e| e.replacement.len()).sum()
    }
}

/// Renders consecutive turns and diffs each prompt against the previous prompt plus its reply.
pub fn turn_diffs<'a, I>(
    turns: I,
    renderer: &'a dyn Renderer,
) -> impl Iterator<Item = Result<TurnDiff>> + 'a
where
    I: IntoIterator<Item = Turn>,
    I::IntoIter: 'a,
{
    let mut cached: Vec<Message> = Vec::new();
    let mut old = Rendered::default();
    turns.into_iter().map(move |t| {
        let new = renderer.render_tokens(&t.prompt)?;
        let edits = diff_rendered(&old, &new)?;
        let edited_messages = cached
            .iter()
            .enumerate()
            .filter(|(i, m)| t.prompt.get(*i) != Some(m))
            .count();
        let out = TurnDiff {
            turn: t.turn,
            old: std::mem::take(&mut old),
            new,
            edits,
            edited_messages,
        };
        cached = t.prompt;
        cached.push(t.reply);
        old = renderer.render_tokens(&cached)?;
        Ok(out)
    })
}
