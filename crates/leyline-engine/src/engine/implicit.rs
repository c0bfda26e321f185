//! Implicit splices: a sessionless chat request that edits a conversation the engine holds
//! for its tenant continues that conversation by an AMORTIZE splice instead of prefilling
//! again from its first changed message. Agent harnesses that resend their whole edited
//! history, and know nothing of sessions, get the splice unchanged.
//!
//! Every request that carries message bounds ([`crate::Request::implicit`]) runs as a turn
//! of a hidden session, which outlives it as a cached conversation: at most
//! [`crate::EngineConfig::max_implicit_sessions`], the least recently used idle one dropped
//! first, and dropped whole (not just shed) when the pool needs its KV. A new request is
//! diffed along message bounds against each idle conversation of its tenant that it
//! continues (its edits leave the conversation's last message as it was, as agent policies
//! do: they edit older history; under the client's conversation key any rewrite continues
//! it, compactions included); the one that leaves the least to prefill (replacements and
//! what their repair recomputes included) is taken if it beats the prefix tree. With edits
//! the conversation is forked first: the fork holds its own reference on every slot, so the
//! splice copies each downstream slot before rotating it (or, under lazy rotation, leaves
//! it where it is and shares it) and the original stays as it was, for other continuations
//! of it. A spliced branch's KV carries the fork's lineage and never enters the shared
//! tree, so only a continuation of that branch within the tenant ever reads it.

use super::Engine;
use crate::error::Result;
use crate::request::{ImplicitTurn, RequestId, Tenant};
use crate::session::{message_edits, SessionId};
use leyline_core::{
    ranges_without, Directive, DirectiveBatch, Mode, Repair, SessionState, ValidationContext,
};
use leyline_kv::radix::{common_prefix, Namespace};
use leyline_kv::slots::Lineage;
use std::time::Instant;

/// A cached conversation a prompt can continue, and what continuing it costs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Candidate {
    id: SessionId,
    /// The diff's directives (none: the prompt extends the conversation or leaves it).
    directives: Vec<Directive>,
    /// Prompt tokens to compute: replacements, the tokens their repair recomputes, and what
    /// follows the reused prefix.
    cost: usize,
}

impl Engine {
    /// The hidden session that request `by` (no session of its own) runs in, claimed for
    /// it: a conversation it continues (in AMORTIZE mode a fork of it when it edits it), or
    /// a new one. Also says whether the session is new (a fork or empty), so a failed edit
    /// can drop it, and returns the directives that turn it into the prompt's context.
    /// `repair` is the request's own ([`crate::Request::repair`]).
    pub(super) fn implicit_session(
        &mut self,
        prompt: &[u32],
        turn: &ImplicitTurn,
        tenant: Tenant,
        repair: Option<Repair>,
        by: RequestId,
    ) -> Result<(SessionId, bool, Vec<Directive>)> {
        self.drop_stale_conversations()?;
        self.trim_conversations(1)?;
        // As admission does: the last prompt token always runs.
        let probe = &prompt[..prompt.len().saturating_sub(1)];
        let ns = Namespace::shared(self.model_id).for_tenant(tenant);
        let tree_cost = probe.len() - self.cache.cached_len(ns, probe);
        let best = self.best_conversation(prompt, probe, turn, tenant, repair);
        let (id, fresh, directives) = match best {
            // FORGET edits the conversation itself: what it drops goes for every reader.
            Some(c) if turn.mode == Mode::Forget => (c.id, false, c.directives),
            // Extending a conversation costs what the tree would, and keeps one record.
            Some(c) if c.directives.is_empty() && c.cost <= tree_cost => (c.id, false, Vec::new()),
            Some(c) if !c.directives.is_empty() && c.cost < tree_cost => {
                self.metrics.add(&self.metrics.implicit_splices, 1);
                (self.fork_session(c.id)?, true, c.directives)
            }
            _ => {
                let id = self.create_tenant_session(tenant);
                self.session_mut(id)?.implicit = true;
                (id, true, Vec::new())
            }
        };
        let s = self.session_mut(id)?;
        s.conversation = turn.conversation;
        s.busy = Some(by);
        s.last_used = Instant::now();
        Ok((id, fresh, directives))
    }

    /// The idle conversation of `tenant` that `prompt` continues most cheaply, if any. An
    /// edit's cost counts what its repair recomputes (`repair`, else the conversation's, else
    /// the engine's), as the splice will run it: a splice that saves fewer tokens than its
    /// repair recomputes is no saving.
    fn best_conversation(
        &self,
        prompt: &[u32],
        probe: &[u32],
        turn: &ImplicitTurn,
        tenant: Tenant,
        repair: Option<Repair>,
    ) -> Option<Candidate> {
        let bounds = &turn.bounds;
        let vocab_size = self.model.info().vocab_size;
        let first_message = bounds.get(1).copied().unwrap_or(0);
        let mut best: Option<Candidate> = None;
        for (&id, s) in &self.sessions {
            if !s.implicit
                || s.tenant != tenant
                || s.conversation != turn.conversation
                || s.busy.is_some()
                || s.tokens.is_empty()
            {
                continue;
            }
            let Some(old_bounds) = &s.bounds else {
                continue;
            };
            // A conversation that does not even share the first message is not this one.
            if common_prefix(&s.tokens, prompt) < first_message.min(s.tokens.len()) {
                continue;
            }
            let directives = message_edits(&s.tokens, old_bounds, prompt, bounds, Mode::Amortize);
            // Without the client's key, a continuation keeps the conversation's last
            // message: policies edit older history. Another conversation that shares a system
            // prompt (or a few messages) changes it, and splicing its KV would carry a
            // stranger's context downstream. A keyed request names its conversation, so it
            // may rewrite the history whole, as a compaction does (Claude Code's `/compact`
            // puts a summary first and moves its environment message last).
            let last = match old_bounds.len() {
                n if n >= 2 => old_bounds[n - 2]..old_bounds[n - 1],
                _ => 0..usize::MAX,
            };
            if turn.conversation.is_none()
                && directives
                    .iter()
                    .any(|d| d.start < last.end && d.end.max(d.start + 1) > last.start)
            {
                continue;
            }
            let (reused, computed) = if directives.is_empty() {
                (common_prefix(&s.tokens, probe), 0)
            } else {
                let ctx = ValidationContext {
                    seq_len: s.tokens.len(),
                    vocab_size,
                    session: SessionState::Idle,
                };
                let repair = repair.or(s.repair).unwrap_or(self.cfg.repair);
                // As the splice will: moved runs found in the batch as sent, then merged.
                let edited = DirectiveBatch::validate(directives.clone(), &ctx).and_then(|sent| {
                    let moved = sent.reusable_runs(&s.tokens, self.cfg.reuse_min_tokens)?;
                    let batch = repair.coalesce(sent, &s.tokens)?;
                    let t = batch.apply_to_tokens(&s.tokens)?;
                    Ok((t, batch, moved))
                });
                let Ok((edited, batch, moved)) = edited else {
                    continue;
                };
                let reused = common_prefix(&edited, probe);
                if reused < directives.iter().map(|d| d.replacement.len()).sum() {
                    continue;
                }
                // Merged directives' replacements hold the kept tokens between them; moved
                // runs are copied, not computed.
                let moved: Vec<_> = moved.into_iter().map(|u| u.new_range).collect();
                let replaced: usize = ranges_without(&batch.new_ranges(), &moved)
                    .iter()
                    .map(|r| r.len())
                    .sum();
                (reused, replaced + repaired_within(repair, &batch, reused))
            };
            let cost = probe.len() - reused + computed;
            let better = best
                .as_ref()
                .is_none_or(|b| (cost, directives.len()) < (b.cost, b.directives.len()));
            if better {
                best = Some(Candidate {
                    id,
                    directives,
                    cost,
                });
            }
        }
        best
    }

    /// A new conversation holding what `id` holds: one more reference on each slot, a
    /// lineage of its own for what it computes. Idle, as `id` is.
    fn fork_session(&mut self, id: SessionId) -> Result<SessionId> {
        let original = self.session(id)?.clone();
        for &slot in &original.slots {
            self.cache.pool_mut().retain(slot)?;
        }
        let fork = self.create_tenant_session(original.tenant);
        let s = self.session_mut(fork)?;
        let lineage = s.lineage;
        *s = original;
        s.lineage = lineage;
        s.implicit = true;
        s.busy = None;
        s.shed = Vec::new();
        debug_assert_ne!(s.lineage, Lineage::SHARED);
        Ok(fork)
    }

    /// Drops the idle conversations that hold KV a FORGET revoked since: nothing from
    /// there on may be read again, and what they hold past it is dead weight.
    fn drop_stale_conversations(&mut self) -> Result<()> {
        let pool = self.cache.pool();
        let stale: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| {
                s.implicit && s.busy.is_none() && pool.first_revoked(&s.slots) < s.slots.len()
            })
            .map(|(&id, _)| id)
            .collect();
        for id in stale {
            self.delete_session(id)?;
        }
        Ok(())
    }

    /// Drops least recently used idle conversations until `room` more fit under the limit.
    fn trim_conversations(&mut self, room: usize) -> Result<()> {
        let total = self.sessions.values().filter(|s| s.implicit).count();
        let excess = (total + room).saturating_sub(self.cfg.max_implicit_sessions);
        if excess == 0 {
            return Ok(());
        }
        let idle: Vec<SessionId> = self
            .sessions_by_use()
            .into_iter()
            .filter(|&(id, _, busy)| !busy && self.sessions.get(&id).is_some_and(|s| s.implicit))
            .map(|(id, _, _)| id)
            .take(excess)
            .collect();
        for id in idle {
            self.delete_session(id)?;
        }
        Ok(())
    }
}

/// Tokens `repair` recomputes after `batch` is spliced, within the first `reused` (the rest
/// is prefilled anyway): its ranges, or for the deviation rule its token count.
fn repaired_within(repair: Repair, batch: &DirectiveBatch, reused: usize) -> usize {
    if let Some(scan) = repair.scan_range(batch) {
        return repair
            .tokens
            .min(scan.end.min(reused).saturating_sub(scan.start));
    }
    repair
        .ranges(batch)
        .iter()
        .map(|r| r.end.min(reused).saturating_sub(r.start))
        .sum()
}
