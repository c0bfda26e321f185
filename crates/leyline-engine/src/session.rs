//! Sessions as data: a cached context that outlives its requests and takes directives.
//!
//! The engine keeps each session's tokens, slots, message bounds and busy flag
//! ([`crate::engine`] applies edits to them); a request names its session with a
//! [`SessionRequest`], and the engine works out the directives itself from the prompt's
//! message bounds ([`message_edits`]), so a server hands over a rendered prompt and nothing
//! else.

use leyline_core::{Directive, Mode};
use leyline_kv::slots::Lineage;
use std::time::Instant;

/// Identifier of a session inside one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "session {}", self.0)
    }
}

/// A request's session part: which session, in which mode its edits apply, and how the
/// engine finds them. The request's prompt is the whole new context; after the edits, the
/// longest common prefix with the session is reused and the rest is prefilled.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionRequest {
    /// The session.
    pub id: SessionId,
    /// AMORTIZE or FORGET, for every directive of the turn.
    pub mode: Mode,
    /// How the prompt relates to what the session holds.
    pub edits: SessionEdits,
}

/// How the engine finds a turn's edits.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum SessionEdits {
    /// Where each message of the prompt starts, then where the last one ends (the rendered
    /// prompt's message bounds). The engine diffs the prompt against the session along these
    /// and the bounds it kept from the session's previous turn, and keeps these for the next.
    Messages(Vec<usize>),
    /// Directives the caller worked out itself (pre-edit indices into the session's
    /// tokens); each takes the request's mode.
    Directives(Vec<Directive>),
    /// Nothing is known of the prompt's structure: the longest common prefix is kept (in
    /// FORGET mode, what is dropped after it is forgotten).
    #[default]
    Tokens,
}

/// What an edit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EditReport {
    /// The mode applied.
    pub mode: Mode,
    /// Directives applied.
    pub directives: usize,
    /// Tokens whose cached KV was kept (prefix plus moved downstream tokens).
    pub reused: usize,
    /// Kept tokens whose keys were rotated.
    pub rotated: usize,
    /// Slots copied before rotation because another sequence shares them.
    pub copied: usize,
    /// Tokens prefilled by the edit itself (AMORTIZE replacements; FORGET on the explicit
    /// channel: everything from the first start on).
    pub prefilled: usize,
    /// Replacement tokens whose KV was copied from the cached tokens they repeat (a moved
    /// message) instead of prefilled ([`crate::EngineConfig::reuse_min_tokens`]); counted
    /// in `reused`.
    pub moved: usize,
    /// Downstream tokens an AMORTIZE edit recomputed under the edited context (its repair).
    pub repaired: usize,
    /// Tokens the repair's selection pass ran through its first layers (rule `deviation`:
    /// [`crate::REPAIR_DEVIATION_LAYER`] layers and that layer's key and value projections).
    pub scanned: usize,
    /// Slots zeroed because a FORGET freed them.
    pub zeroed: usize,
    /// Session length after the edit.
    pub new_len: usize,
    /// Microseconds an AMORTIZE splice spent in the model's forward of its replacements
    /// (what is left of its time is bookkeeping, rotation and copies); 0 for FORGET.
    pub prefill_us: u64,
    /// Whether a lazy splice left more shifted runs than
    /// [`crate::EngineConfig::max_segments`], so that the session was compacted (its keys
    /// rotated to their positions, counted in `rotated` and `copied`).
    pub compacted: bool,
}

impl EditReport {
    /// The report of an empty batch on a session of `len` tokens.
    pub(crate) fn unchanged(mode: Mode, len: usize) -> Self {
        Self {
            mode,
            directives: 0,
            reused: len,
            rotated: 0,
            copied: 0,
            prefilled: 0,
            moved: 0,
            prefill_us: 0,
            repaired: 0,
            scanned: 0,
            zeroed: 0,
            new_len: len,
            compacted: false,
        }
    }
}

/// A session's state, owned by the engine.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub(crate) lineage: Lineage,
    /// Whose prefix cache the session reads and feeds.
    pub(crate) tenant: u64,
    pub(crate) tokens: Vec<u32>,
    /// One reference held per slot.
    pub(crate) slots: Vec<u32>,
    /// Tokens before this index hold lineage-free KV (computed from tokens alone).
    pub(crate) clean_len: usize,
    /// Tokens whose KV was shed for room while the prefix tree may still hold a prefix of
    /// them (the session's lineage-free part): a later FORGET turn purges from the tree
    /// what it drops of these, as it would from the session's own slots.
    pub(crate) shed: Vec<u32>,
    /// Message bounds of the last prompt run in the session, while its tokens still begin
    /// with that prompt; `None` after explicit directives or a turn without bounds.
    pub(crate) bounds: Option<Vec<usize>>,
    /// The request in flight (its [`crate::RequestId`]), if any: the session's one busy
    /// flag.
    pub(crate) busy: Option<u64>,
    /// Requests finished in it.
    pub(crate) turns: usize,
    /// When a request last took the session (the least recently used idle session's KV is
    /// the first to go when the pool runs out).
    pub(crate) last_used: Instant,
    /// A cached conversation of sessionless requests (`engine/implicit.rs`), not a named
    /// session: it goes whole when its KV must go, and no client can name it.
    pub(crate) implicit: bool,
    /// The client's key for the conversation ([`crate::ImplicitTurn::conversation`]).
    pub(crate) conversation: Option<u64>,
    /// The repair of this session's AMORTIZE edits; `None`: the engine's default.
    pub(crate) repair: Option<leyline_core::Repair>,
}

impl Session {
    pub(crate) fn new(lineage: Lineage, tenant: u64) -> Self {
        Self {
            lineage,
            tenant,
            tokens: Vec::new(),
            slots: Vec::new(),
            clean_len: usize::MAX,
            shed: Vec::new(),
            bounds: None,
            busy: None,
            turns: 0,
            last_used: Instant::now(),
            implicit: false,
            conversation: None,
            repair: None,
        }
    }
}

/// A read-only view of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Cached tokens.
    pub tokens: Vec<u32>,
    /// Their slots.
    pub slots: Vec<u32>,
    /// Their encoded positions.
    pub positions: Vec<u32>,
    /// Whether a request is in flight.
    pub busy: bool,
    /// Requests finished in it.
    pub turns: usize,
    /// When a request last took it.
    pub last_used: Instant,
}

/// The directives that turn a session's cached `old` tokens into a prefix of the `new`
/// prompt, by a message-aligned diff of the two renderings; the pure append at the end is
/// left out (the request prefills it). Empty when the old bounds no longer describe the
/// session's tokens or the diff fails: the engine then keeps the longest common prefix.
pub fn message_edits(
    old: &[u32],
    old_bounds: &[usize],
    new: &[u32],
    new_bounds: &[usize],
    mode: Mode,
) -> Vec<Directive> {
    if old_bounds.last().is_none_or(|&end| end > old.len()) {
        return Vec::new();
    }
    match leyline_policy::diff(old, old_bounds, new, new_bounds) {
        Ok(edits) => edits
            .into_iter()
            .filter(|e| !(e.start == old.len() && e.end == old.len()))
            .map(|e| Directive::new(e.start, e.end, e.replacement, mode))
            .collect(),
        Err(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_edits_replace_a_changed_message_and_skip_the_append() {
        // Three messages [0,2) [2,4) [4,6); the middle one changes, one is appended.
        let old = [1, 2, 3, 4, 5, 6];
        let new = [1, 2, 9, 5, 6, 7, 8];
        let e = message_edits(&old, &[0, 2, 4, 6], &new, &[0, 2, 3, 5, 7], Mode::Forget);
        assert_eq!(e, vec![Directive::new(2, 4, vec![9], Mode::Forget)]);
        // Bounds past the session's tokens (it was cut since): nothing to diff.
        assert!(message_edits(
            &old[..3],
            &[0, 2, 4, 6],
            &new,
            &[0, 2, 3, 5, 7],
            Mode::Amortize
        )
        .is_empty());
    }
}
