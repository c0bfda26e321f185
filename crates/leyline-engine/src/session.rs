//! Sessions: a cached context that outlives its requests and takes directives.
//!
//! A session holds one reference on the slot of each of its tokens, so its context is never
//! evicted while it lives. A directive batch edits it atomically: everything is validated
//! and every slot allocated before the first byte changes.
//!
//! - AMORTIZE keeps the prefix, copies shared downstream slots (copy-on-write), rotates the
//!   downstream keys by their segment's delta, then prefills each replacement at its new
//!   positions. Slots from the first replacement's end on carry the session's lineage: they
//!   keep influence of removed content and are never offered to other requests.
//! - FORGET purges every tree path through the old slots from the first start on, drops the
//!   session's references and zeroes the slots that became free; the replacement and the
//!   rest are prefilled again (by the request that follows, or at once on the explicit
//!   channel).

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use leyline_core::{Directive, DirectiveBatch, Mode, SessionState, ValidationContext};
use leyline_kv::rotate::{shift_rows_with, shift_table, KernelPath};
use leyline_kv::slots::Lineage;
use leyline_kv::splice::{SplicePlan, SpliceRequest};
use leyline_model::{ForwardSeq, LogitsFor};
use std::collections::HashSet;
use std::ops::Range;
use std::time::Instant;

/// Identifier of a session inside one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "session {}", self.0)
    }
}

/// A request's session part: which session, how to apply its edits, and the edits
/// (pre-edit indices into the session's current tokens). The request's prompt is the whole
/// new context; after the edits, the longest common prefix with the session is reused.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionRequest {
    /// The session.
    pub id: SessionId,
    /// AMORTIZE or FORGET.
    pub mode: Mode,
    /// Directives against the session's tokens (their `mode` is overridden by `mode`).
    pub edits: Vec<Directive>,
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
    /// Slots zeroed because a FORGET freed them.
    pub zeroed: usize,
    /// Session length after the edit.
    pub new_len: usize,
}

/// A session's state.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    pub(crate) lineage: Lineage,
    pub(crate) tokens: Vec<u32>,
    /// One reference held per slot.
    pub(crate) slots: Vec<u32>,
    /// Tokens before this index hold lineage-free KV (computed from tokens alone).
    pub(crate) clean_len: usize,
    /// A request is in flight.
    pub(crate) busy: bool,
    /// When a request last took the session (the least recently used idle session's KV is
    /// the first to go when the pool runs out).
    pub(crate) last_used: Instant,
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
}

impl Engine {
    /// Creates an empty session.
    pub fn create_session(&mut self) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        // Lineage 0 is the shared one; sessions take the rest.
        let lineage = Lineage(id.0);
        self.sessions.insert(
            id,
            Session {
                lineage,
                tokens: Vec::new(),
                slots: Vec::new(),
                clean_len: usize::MAX,
                busy: false,
                last_used: Instant::now(),
            },
        );
        id
    }

    /// A session's tokens, slots and positions.
    ///
    /// # Errors
    /// [`EngineError::UnknownSession`].
    pub fn session_info(&self, id: SessionId) -> Result<SessionInfo> {
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let pool = self.cache.pool();
        let positions = s
            .slots
            .iter()
            .map(|&x| pool.position(x))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(SessionInfo {
            tokens: s.tokens.clone(),
            slots: s.slots.clone(),
            positions,
            busy: s.busy,
        })
    }

    /// Deletes an idle session, releasing its slots (they stay cached where the tree holds
    /// them).
    ///
    /// # Errors
    /// Unknown or busy session.
    pub fn delete_session(&mut self, id: SessionId) -> Result<()> {
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        if s.busy {
            return Err(EngineError::SessionBusy(id.0));
        }
        let s = self
            .sessions
            .remove(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        self.cache.pool_mut().release_all(&s.slots)?;
        self.update_gauges();
        Ok(())
    }

    /// Cuts a session to its first `keep` tokens, releasing the slots of the rest (zeroed if
    /// a FORGET revoked any of them).
    ///
    /// # Errors
    /// [`EngineError::UnknownSession`]; pool failures.
    pub(crate) fn truncate_session(&mut self, id: SessionId, keep: usize) -> Result<()> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        if keep >= s.tokens.len() {
            return Ok(());
        }
        let revoked = self.cache.pool().first_revoked(&s.slots);
        let stale = s.slots.split_off(keep);
        s.tokens.truncate(keep);
        if keep == 0 {
            // Whatever it prefills next is computed from its tokens alone.
            s.clean_len = usize::MAX;
        }
        let freed = self.cache.pool_mut().release_all(&stale)?;
        if revoked < keep + stale.len() {
            self.scrub(&freed)?;
        }
        Ok(())
    }

    /// Drops the KV of the least recently used idle session that holds any; the session
    /// stays, and its next request prefills from the prefix tree. Returns whether one went.
    ///
    /// # Errors
    /// Pool failures.
    pub(crate) fn shed_idle_session(&mut self) -> Result<bool> {
        let lru = self
            .sessions
            .iter()
            .filter(|(_, s)| !s.busy && !s.slots.is_empty())
            .min_by_key(|(_, s)| s.last_used)
            .map(|(&id, _)| id);
        let Some(id) = lru else {
            return Ok(false);
        };
        self.truncate_session(id, 0)?;
        self.metrics.add(&self.metrics.sessions_shed, 1);
        Ok(true)
    }

    /// Applies a directive batch to an idle session now (the explicit channel). FORGET
    /// prefills everything from the first start on before returning.
    ///
    /// # Errors
    /// Validation errors name the directive; nothing changes on any error.
    pub fn apply_directives(
        &mut self,
        id: SessionId,
        directives: Vec<Directive>,
    ) -> Result<EditReport> {
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        if s.busy {
            return Err(EngineError::SessionBusy(id.0));
        }
        let mode = directives.first().map_or(Mode::Amortize, |d| d.mode);
        let (mut report, _) = self.edit_session(id, directives, mode)?;
        if mode == Mode::Forget {
            report.prefilled = self.prefill_session_tail(id)?;
        }
        Ok(report)
    }

    /// Validates and applies `directives` in `mode`. FORGET leaves the session cut at the
    /// first start: the caller prefills the rest (`pending` tokens) itself. Also returns the
    /// post-edit positions whose KV the edit computed (AMORTIZE replacements).
    pub(crate) fn edit_session(
        &mut self,
        id: SessionId,
        mut directives: Vec<Directive>,
        mode: Mode,
    ) -> Result<(EditReport, Vec<Range<usize>>)> {
        for d in &mut directives {
            d.mode = mode;
        }
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let ctx = ValidationContext {
            seq_len: s.tokens.len(),
            vocab_size: self.model.info().vocab_size,
            session: SessionState::Idle,
        };
        let batch = DirectiveBatch::validate(directives, &ctx)?;
        if batch.is_empty() {
            let report = EditReport {
                mode,
                directives: 0,
                reused: s.tokens.len(),
                rotated: 0,
                copied: 0,
                prefilled: 0,
                zeroed: 0,
                new_len: s.tokens.len(),
            };
            return Ok((report, Vec::new()));
        }
        if batch.new_len() >= self.max_sequence_len() {
            return Err(EngineError::InvalidRequest(format!(
                "the edited session would hold {} tokens; at most {} fit",
                batch.new_len(),
                self.max_sequence_len() - 1
            )));
        }
        match mode {
            Mode::Amortize => Ok((self.amortize(id, &batch)?, batch.new_ranges())),
            Mode::Forget => Ok((self.forget(id, &batch)?, Vec::new())),
        }
    }

    fn amortize(&mut self, id: SessionId, batch: &DirectiveBatch) -> Result<EditReport> {
        let info = self.model.info().clone();
        info.rope.ensure_shiftable()?;
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?
            .clone();
        let pool = self.cache.pool();
        let old_positions = s
            .slots
            .iter()
            .map(|&x| pool.position(x))
            .collect::<Result<Vec<_>, _>>()?;
        // Everything is allocated before anything changes.
        let n_repl: usize = batch.directives().iter().map(|d| d.replacement.len()).sum();
        let (fresh, removed) = self.cache.alloc_evicting(n_repl)?;
        self.note_evicted(removed.freed.len());
        let mut repl_slots = Vec::with_capacity(batch.directives().len());
        let mut it = fresh.iter().copied();
        for d in batch.directives() {
            repl_slots.push(it.by_ref().take(d.replacement.len()).collect::<Vec<u32>>());
        }
        let shared: HashSet<u32> = s
            .slots
            .iter()
            .copied()
            .filter(|&x| self.cache.pool().refcount(x).map_or(true, |r| r > 1))
            .collect();
        let req = SpliceRequest {
            old_slots: &s.slots,
            old_positions: &old_positions,
            batch,
            replacement_slots: &repl_slots,
        };
        let mut cow_slots: Vec<u32> = Vec::new();
        let cache = &mut self.cache;
        let planned = SplicePlan::with_cow(
            &req,
            |x| shared.contains(&x),
            |n| {
                let (v, _) = cache.alloc_evicting(n).ok()?;
                cow_slots = v.clone();
                Some(v)
            },
        );
        let plan = match planned {
            Ok(p) => p,
            Err(e) => {
                self.cache.pool_mut().release_all(&fresh)?;
                self.cache.pool_mut().release_all(&cow_slots)?;
                return Err(e.into());
            }
        };

        // Mutation starts here.
        let lineage = s.lineage;
        self.kv.copy_slots(&plan.cow)?;
        let geometry = info.geometry;
        let path = KernelPath::detect();
        for (delta, slots) in plan.rotation_groups() {
            let rot = shift_table(&info.rope, delta)?;
            for layer in 0..geometry.layers {
                shift_rows_with(
                    self.kv.k_rows_mut(layer),
                    geometry.k_heads,
                    geometry.k_head_dim,
                    &slots,
                    &rot,
                    path,
                )?;
            }
        }
        let first = &batch.directives()[0];
        let clean_len = s.clean_len.min(first.start + first.replacement.len());
        {
            let pool = self.cache.pool_mut();
            for (i, (&slot, &pos)) in plan.new_slots.iter().zip(&plan.new_positions).enumerate() {
                pool.set_position(slot, pos)?;
                if i >= clean_len {
                    pool.set_lineage(slot, lineage)?;
                }
            }
            // The copies replace the originals in this sequence; a copy of forgotten KV is
            // as forgotten as its source.
            for &(src, dst) in &plan.cow {
                if pool.is_revoked(src)? {
                    pool.revoke(dst)?;
                }
            }
            let sources: Vec<u32> = plan.cow.iter().map(|&(src, _)| src).collect();
            pool.release_all(&sources)?;
            pool.release_all(&plan.freed)?;
        }
        // Replacements attend to everything before them in the new sequence, rotated
        // segments included, so they run after the rotation and in order.
        for (d, (range, slots)) in batch
            .directives()
            .iter()
            .zip(plan.prefill.iter().zip(&repl_slots))
        {
            if slots.is_empty() {
                continue;
            }
            let positions: Vec<u32> = (range.start as u32..range.end as u32).collect();
            let seq = ForwardSeq {
                tokens: &d.replacement,
                positions: &positions,
                context: &plan.new_slots[..range.start],
                new_slots: slots,
                logits: LogitsFor::None,
            };
            self.model.forward(&mut self.kv, &[seq])?;
        }
        let tokens = batch.apply_to_tokens(&s.tokens)?;
        let reused = tokens.len() - n_repl;
        let report = EditReport {
            mode: Mode::Amortize,
            directives: batch.directives().len(),
            reused,
            rotated: plan.to_rotate.len(),
            copied: plan.cow.len(),
            prefilled: n_repl,
            zeroed: 0,
            new_len: tokens.len(),
        };
        let sess = self
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        sess.tokens = tokens;
        sess.slots = plan.new_slots;
        sess.clean_len = clean_len;
        self.metrics
            .add(&self.metrics.prefilled_tokens, n_repl as u64);
        self.metrics
            .add(&self.metrics.rotated_tokens, report.rotated as u64);
        self.metrics
            .add(&self.metrics.directives_amortize, report.directives as u64);
        self.update_gauges();
        Ok(report)
    }

    fn forget(&mut self, id: SessionId, batch: &DirectiveBatch) -> Result<EditReport> {
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let start = batch.directives()[0].start;
        let old_tail: Vec<u32> = s.slots[start..].to_vec();
        let target = batch.apply_to_tokens(&s.tokens)?;
        // No cached path may lead through a forgotten slot or one computed after it. A path a
        // running request reads leaves the tree now and is zeroed when that request ends.
        let purged = self.cache.purge_slots(&old_tail);
        let mut freed = purged.freed;
        freed.extend(self.cache.pool_mut().release_all(&old_tail)?);
        for &slot in &freed {
            self.kv.zero_slot(slot)?;
        }
        let sess = self
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        sess.tokens.truncate(start);
        sess.slots.truncate(start);
        if sess.clean_len >= start {
            // What follows is computed again from tokens alone.
            sess.clean_len = usize::MAX;
        }
        let report = EditReport {
            mode: Mode::Forget,
            directives: batch.directives().len(),
            reused: start,
            rotated: 0,
            copied: 0,
            prefilled: 0,
            zeroed: freed.len(),
            new_len: target.len(),
        };
        self.forget_pending.insert(id, target);
        self.metrics
            .add(&self.metrics.directives_forget, report.directives as u64);
        self.update_gauges();
        Ok(report)
    }

    /// Prefills the session's pending FORGET tail now; returns the tokens prefilled.
    fn prefill_session_tail(&mut self, id: SessionId) -> Result<usize> {
        let Some(target) = self.forget_pending.remove(&id) else {
            return Ok(0);
        };
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let have = s.tokens.len();
        let tail = target[have..].to_vec();
        if tail.is_empty() {
            return Ok(0);
        }
        let (slots, removed) = self.cache.alloc_evicting(tail.len())?;
        self.note_evicted(removed.freed.len());
        let (lineage, clean_len) = (s.lineage, s.clean_len);
        let prev = s.slots.clone();
        let chunk = self.cfg.prefill_chunk;
        let mut done = 0;
        while done < tail.len() {
            let end = (done + chunk).min(tail.len());
            let positions: Vec<u32> = ((have + done) as u32..(have + end) as u32).collect();
            let mut context = prev.clone();
            context.extend_from_slice(&slots[..done]);
            let seq = ForwardSeq {
                tokens: &tail[done..end],
                positions: &positions,
                context: &context,
                new_slots: &slots[done..end],
                logits: LogitsFor::None,
            };
            if let Err(e) = self.model.forward(&mut self.kv, &[seq]) {
                self.cache.pool_mut().release_all(&slots)?;
                return Err(e.into());
            }
            done = end;
        }
        let pool = self.cache.pool_mut();
        for (i, &slot) in slots.iter().enumerate() {
            pool.set_position(slot, (have + i) as u32)?;
            if have + i >= clean_len {
                pool.set_lineage(slot, lineage)?;
            }
        }
        let sess = self
            .sessions
            .get_mut(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        sess.tokens.extend_from_slice(&tail);
        sess.slots.extend_from_slice(&slots);
        self.metrics
            .add(&self.metrics.prefilled_tokens, tail.len() as u64);
        self.update_gauges();
        Ok(tail.len())
    }

    /// Runs `tokens` after the session's context in scratch slots and returns the logits of
    /// the last one; the session and the pool are left as they were (scoring, verification).
    ///
    /// # Errors
    /// Unknown session, empty `tokens`, a full pool.
    pub fn peek_logits(&mut self, id: SessionId, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidRequest("no tokens to score".into()));
        }
        let s = self
            .sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        let context = s.slots.clone();
        let start = context.len() as u32;
        let (scratch, removed) = self.cache.alloc_evicting(tokens.len())?;
        self.note_evicted(removed.freed.len());
        let positions: Vec<u32> = (start..start + tokens.len() as u32).collect();
        let seq = ForwardSeq {
            tokens,
            positions: &positions,
            context: &context,
            new_slots: &scratch,
            logits: LogitsFor::Last,
        };
        let out = self.model.forward(&mut self.kv, &[seq]);
        self.cache.pool_mut().release_all(&scratch)?;
        Ok(out?.swap_remove(0))
    }
}
