//! The engine's session operations: create, inspect, delete, and edit by directives.
//!
//! A session holds one reference on the slot of each of its tokens, so its context is never
//! evicted while it lives. A directive batch is validated against the session's real state
//! and applied all-or-nothing:
//!
//! - AMORTIZE is one operation of the KV layer ([`leyline_kv::splice::apply_splice`]):
//!   allocate, copy shared downstream slots, rotate the downstream keys by their segment's
//!   delta, prefill each replacement at its new positions (the model forward is passed in),
//!   commit; any failure rolls back. Slots from the first replacement's end on carry the
//!   session's lineage: they keep influence of removed content and are never offered to
//!   other requests.
//! - FORGET first makes sure the slots its re-prefill needs can be had, then purges every
//!   tree path through the old slots from the first start on, drops the session's
//!   references and zeroes the slots that became free. That purge is its commit point: the
//!   replacement and the rest are prefilled afterwards (by the request that follows, or at
//!   once on the explicit channel), and what was forgotten stays forgotten even if that
//!   prefill fails.
//!
//! Every slot a session gives back is zeroed when it becomes free and held session-private
//! or forgotten KV ([`Engine::release_slots`]).

use super::Engine;
use crate::error::{EngineError, Result};
use crate::request::RequestId;
use crate::session::{message_edits, EditReport, Session, SessionEdits, SessionId, SessionInfo};
use leyline_core::{
    Directive, DirectiveBatch, Mode, Repair, Reuse, SessionState, ValidationContext,
};
use leyline_kv::shift::{segment_count, RotationMode};
use leyline_kv::slots::Lineage;
use leyline_kv::splice::{apply_splice, compact, SpliceError, SpliceTarget, Spliced};
use leyline_model::{ForwardSeq, LogitsFor};
use std::ops::Range;
use std::time::Instant;

/// What an edit did, the post-edit positions whose KV it computed (AMORTIZE replacements),
/// and for FORGET the full edited token list still to prefill.
pub(crate) type Edited = (EditReport, Vec<Range<usize>>, Option<Vec<u32>>);

impl Engine {
    /// Creates an empty session of the default tenant.
    pub fn create_session(&mut self) -> SessionId {
        self.create_tenant_session(0)
    }

    /// A new, empty session of `tenant`: its requests read and feed only that tenant's
    /// prefix cache.
    pub fn create_tenant_session(&mut self, tenant: crate::Tenant) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        // Lineage 0 is the shared one; sessions take the rest.
        self.sessions
            .insert(id, Session::new(Lineage(id.0), tenant));
        id
    }

    /// Sets the repair every AMORTIZE edit of session `id` makes from now on, unless its
    /// batch names one; `None` goes back to the engine's default ([`crate::EngineConfig::repair`]).
    ///
    /// # Errors
    /// [`EngineError::UnknownSession`].
    pub fn set_session_repair(&mut self, id: SessionId, repair: Option<Repair>) -> Result<()> {
        self.session_mut(id)?.repair = repair;
        Ok(())
    }

    pub(super) fn session(&self, id: SessionId) -> Result<&Session> {
        self.sessions
            .get(&id)
            .ok_or(EngineError::UnknownSession(id.0))
    }

    pub(super) fn session_mut(&mut self, id: SessionId) -> Result<&mut Session> {
        self.sessions
            .get_mut(&id)
            .ok_or(EngineError::UnknownSession(id.0))
    }

    /// A session's tokens, slots and positions.
    ///
    /// # Errors
    /// [`EngineError::UnknownSession`].
    pub fn session_info(&self, id: SessionId) -> Result<SessionInfo> {
        let s = self.session(id)?;
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
            busy: s.busy.is_some(),
            turns: s.turns,
            last_used: s.last_used,
        })
    }

    /// Ids of the sessions, least recently used first.
    pub(super) fn sessions_by_use(&self) -> Vec<(SessionId, Instant, bool)> {
        let mut v: Vec<_> = self
            .sessions
            .iter()
            .map(|(&id, s)| (id, s.last_used, s.busy.is_some()))
            .collect();
        v.sort_by_key(|&(id, t, _)| (t, id));
        v
    }

    /// Deletes an idle session, releasing its slots (they stay cached where the tree holds
    /// them; session-private ones are zeroed).
    ///
    /// # Errors
    /// Unknown or busy session.
    pub fn delete_session(&mut self, id: SessionId) -> Result<()> {
        if self.session(id)?.busy.is_some() {
            return Err(EngineError::SessionBusy(id.0));
        }
        let s = self
            .sessions
            .remove(&id)
            .ok_or(EngineError::UnknownSession(id.0))?;
        self.release_slots(&s.slots)?;
        self.update_gauges();
        Ok(())
    }

    /// Empties the prefix cache of `tenant` (every tenant's with `None`) of whatever no
    /// running request holds, its idle cached conversations (implicit splices) included;
    /// named sessions keep their KV. Returns the slots freed.
    ///
    /// # Errors
    /// Pool failures.
    pub fn flush_prefix_cache(&mut self, tenant: Option<crate::Tenant>) -> Result<usize> {
        let conversations: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.implicit && s.busy.is_none() && tenant.is_none_or(|t| t == s.tenant))
            .map(|(&id, _)| id)
            .collect();
        let before = self.cache.pool().free_count();
        for id in conversations {
            self.delete_session(id)?;
        }
        let from_conversations = self.cache.pool().free_count() - before;
        let removed = match tenant {
            None => self.cache.evict(usize::MAX),
            Some(t) => {
                let ns = leyline_kv::radix::Namespace::shared(self.model_id).for_tenant(t);
                self.cache.drop_namespace(ns).map_err(|e| match e {
                    leyline_kv::KvError::NodeLocked(_) => EngineError::Overloaded(
                        "a running request holds part of this cache; retry when it ends".into(),
                    ),
                    e => e.into(),
                })?
            }
        };
        self.zero_private(&removed.freed)?;
        self.update_gauges();
        Ok(removed.freed.len() + from_conversations)
    }

    /// Drops one reference on each of `slots` and zeroes those that became free while
    /// holding session-private (not lineage-free) or forgotten KV.
    pub(crate) fn release_slots(&mut self, slots: &[u32]) -> Result<usize> {
        let freed = self.cache.pool_mut().release_all(slots)?;
        self.zero_private(&freed)
    }

    /// Zeroes those of the `freed` slots that held session-private or forgotten KV.
    pub(crate) fn zero_private(&mut self, freed: &[u32]) -> Result<usize> {
        let mut zeroed = 0;
        for &s in freed {
            let pool = self.cache.pool();
            if pool.is_revoked(s)? || !pool.lineage(s)?.is_shared() {
                self.kv.zero_slot(s)?;
                zeroed += 1;
            }
        }
        Ok(zeroed)
    }

    /// Cuts a session to its first `keep` tokens. With `forget`, what goes is forgotten as
    /// by a FORGET directive (purged from the tree, revoked, zeroed when free); otherwise its
    /// slots are released (zeroed if a FORGET revoked any or they were session-private).
    pub(crate) fn truncate_session(
        &mut self,
        id: SessionId,
        keep: usize,
        forget: bool,
    ) -> Result<()> {
        let s = self.session_mut(id)?;
        if keep >= s.tokens.len() {
            return Ok(());
        }
        let stale = s.slots.split_off(keep);
        s.tokens.truncate(keep);
        if forget {
            // What it prefills next in FORGET mode stays private (see `forget`).
            s.clean_len = s.clean_len.min(keep);
        } else if keep == 0 {
            // Whatever it prefills next is computed from its tokens alone.
            s.clean_len = usize::MAX;
        }
        if forget {
            self.purge(&stale)?;
        } else {
            self.release_slots(&stale)?;
        }
        Ok(())
    }

    /// What a turn in `mode` does with the tokens session `id` shed: in FORGET mode, every
    /// cached entry along them from where `prompt` leaves them is purged from `ns` (the
    /// session no longer holds those slots, so the tree is searched by tokens); either way
    /// the record goes, since the session's next tokens are its own again.
    pub(crate) fn settle_shed(
        &mut self,
        id: SessionId,
        prompt: &[u32],
        mode: Mode,
        ns: leyline_kv::radix::Namespace,
    ) -> Result<()> {
        let shed = std::mem::take(&mut self.session_mut(id)?.shed);
        let keep = leyline_kv::radix::common_prefix(&shed, prompt);
        if mode != Mode::Forget || keep >= shed.len() {
            return Ok(());
        }
        let path = self.cache.match_prefix(ns, &shed).slots;
        if path.len() > keep {
            let removed = self.cache.purge_slots(&path[keep..]);
            self.scrub(&removed.freed)?;
        }
        Ok(())
    }

    /// FORGET's erasure of `slots` the caller holds: no cached path leads through them or
    /// anything computed after them, they are revoked, the caller's references go, and every
    /// slot that became free is zeroed. Returns the slots zeroed. A path a running request
    /// reads leaves the tree now and is zeroed when that request ends.
    fn purge(&mut self, slots: &[u32]) -> Result<usize> {
        let purged = self.cache.purge_slots(slots);
        let mut freed = purged.freed;
        freed.extend(self.cache.pool_mut().release_all(slots)?);
        self.scrub(&freed)?;
        Ok(freed.len())
    }

    /// Drops the KV of the least recently used idle session that holds any, other than
    /// `except`; the session stays, and its next request prefills from the prefix tree.
    /// Cached conversations (implicit splices) go first, and go whole. Returns whether one
    /// went.
    ///
    /// # Errors
    /// Pool failures.
    pub(crate) fn shed_idle_session(&mut self, except: Option<SessionId>) -> Result<bool> {
        let lru = self
            .sessions
            .iter()
            .filter(|(&id, s)| s.busy.is_none() && !s.slots.is_empty() && Some(id) != except)
            // Cached conversations of sessionless requests go before named sessions.
            .min_by_key(|(_, s)| (!s.implicit, s.last_used))
            .map(|(&id, _)| id);
        let Some(id) = lru else {
            return Ok(false);
        };
        if self.session(id)?.implicit {
            // Nobody names a cached conversation: without its KV it is nothing.
            self.delete_session(id)?;
            self.metrics.add(&self.metrics.sessions_shed, 1);
            return Ok(true);
        }
        let s = self.session_mut(id)?;
        let clean = s.clean_len.min(s.tokens.len());
        if clean > 0 {
            s.shed = s.tokens[..clean].to_vec();
        }
        self.truncate_session(id, 0, false)?;
        self.metrics.add(&self.metrics.sessions_shed, 1);
        Ok(true)
    }

    /// Makes sure `need` slots can be allocated for `id`'s edit, shedding other idle
    /// sessions' KV if the pool is short; `own` more slots become free during the edit.
    fn ensure_room(&mut self, id: SessionId, need: usize, own: usize) -> Result<()> {
        loop {
            let have = self.cache.pool().free_count() + self.cache.reclaimable() + own;
            if have >= need {
                return Ok(());
            }
            if !self.shed_idle_session(Some(id))? {
                return Err(EngineError::OutOfKv(format!(
                    "the edit needs {need} KV slots and at most {have} can be freed; retry when other work has finished"
                )));
            }
        }
    }

    /// Applies a directive batch to an idle session now (the explicit channel). FORGET
    /// prefills everything from the first start on before returning. The session's message
    /// bounds are dropped: its tokens no longer follow the last prompt's layout.
    ///
    /// # Errors
    /// Validation errors name the directive; an unknown or busy session; a full pool
    /// ([`EngineError::OutOfKv`]). Nothing changes on any error but a failed FORGET
    /// re-prefill (module docs).
    pub fn apply_directives(
        &mut self,
        id: SessionId,
        directives: Vec<Directive>,
    ) -> Result<EditReport> {
        self.apply_directives_repaired(id, directives, None)
    }

    /// [`Self::apply_directives`] with a repair for this batch in place of the session's
    /// ([`Self::set_session_repair`]) or the engine's default ([`crate::EngineConfig::repair`]).
    ///
    /// # Errors
    /// As [`Self::apply_directives`]. A repair that fails after the splice committed
    /// leaves the session cut where it failed.
    pub fn apply_directives_repaired(
        &mut self,
        id: SessionId,
        directives: Vec<Directive>,
        repair: Option<Repair>,
    ) -> Result<EditReport> {
        let s = self.session(id)?;
        if s.tokens.is_empty() && !s.shed.is_empty() && !directives.is_empty() {
            // Its cache went for room since the caller last looked: the directives' ranges
            // describe tokens the session no longer holds.
            return Err(EngineError::SessionShed(id.0));
        }
        let mode = directives.first().map_or(Mode::Amortize, |d| d.mode);
        let (mut report, _, target) = self.edit_session(id, directives, mode, None, repair)?;
        self.session_mut(id)?.bounds = None;
        if let Some(target) = target {
            report.prefilled = self.prefill_session_tail(id, &target)?;
        }
        Ok(report)
    }

    /// The directives of request `by`'s turn in session `id` in `mode`: `edits` as given, or
    /// a diff of `prompt` against the session along message bounds.
    pub(crate) fn turn_directives(
        &self,
        id: SessionId,
        edits: SessionEdits,
        prompt: &[u32],
        mode: Mode,
    ) -> Result<Vec<Directive>> {
        let s = self.session(id)?;
        Ok(match edits {
            SessionEdits::Directives(d) => d,
            SessionEdits::Tokens => Vec::new(),
            SessionEdits::Messages(new_bounds) => match &s.bounds {
                Some(old_bounds) => message_edits(&s.tokens, old_bounds, prompt, &new_bounds, mode),
                None => Vec::new(),
            },
        })
    }

    /// Validates `directives` against the session (as seen by request `by`, which may hold
    /// it) and applies them in `mode`. FORGET leaves the session cut at the first start and
    /// returns the full edited token list for the caller to prefill. Also returns the
    /// post-edit positions whose KV the edit computed (AMORTIZE replacements).
    pub(crate) fn edit_session(
        &mut self,
        id: SessionId,
        mut directives: Vec<Directive>,
        mode: Mode,
        by: Option<RequestId>,
        repair: Option<Repair>,
    ) -> Result<Edited> {
        for d in &mut directives {
            d.mode = mode;
        }
        let s = self.session(id)?;
        let state = match s.busy {
            Some(holder) if Some(holder) != by => SessionState::Busy,
            _ => SessionState::Idle,
        };
        let ctx = ValidationContext {
            seq_len: s.tokens.len(),
            vocab_size: self.model.info().vocab_size,
            session: state,
        };
        let batch = DirectiveBatch::validate(directives, &ctx).map_err(|e| match e {
            leyline_core::CoreError::SessionBusy => EngineError::SessionBusy(id.0),
            e => e.into(),
        })?;
        if batch.is_empty() {
            return Ok((
                EditReport::unchanged(mode, s.tokens.len()),
                Vec::new(),
                None,
            ));
        }
        if batch.new_len() >= self.max_sequence_len() {
            return Err(EngineError::InvalidRequest(format!(
                "the edited session would hold {} tokens; at most {} fit",
                batch.new_len(),
                self.max_sequence_len() - 1
            )));
        }
        match mode {
            Mode::Amortize => {
                let repair = repair
                    .or(self.session(id)?.repair)
                    .unwrap_or(self.cfg.repair);
                let (report, computed) = self.amortize(id, &batch, repair)?;
                Ok((report, union(computed), None))
            }
            Mode::Forget => {
                let (report, target) = self.forget(id, &batch)?;
                Ok((report, Vec::new(), Some(target)))
            }
        }
    }

    /// The splice, then `repair`; also returns the post-edit ranges both computed (the
    /// replacements less their moved runs, and what the repair recomputed).
    fn amortize(
        &mut self,
        id: SessionId,
        batch: &DirectiveBatch,
        repair: Repair,
    ) -> Result<(EditReport, Vec<Range<usize>>)> {
        let info = self.model.info().clone();
        info.rope
            .ensure_shiftable()
            .map_err(leyline_kv::KvError::from)?;
        // Directives a repair window would reach go as one, so that no replacement is
        // computed twice; the report and the metrics count the directives as sent.
        let sent = batch.directives().len();
        let old_tokens = &self.session(id)?.tokens;
        // Moved runs are found in the replacements as sent: the kept tokens a merge adds
        // between them are the repair's to compute. Post-edit indices are the same in both.
        let reuse = batch.reusable_runs(old_tokens, self.cfg.reuse_min_tokens)?;
        let merged = repair.coalesce(batch.clone(), old_tokens)?;
        let batch = &merged;
        let mut forward = std::time::Duration::ZERO;
        let spliced = loop {
            match self.try_splice(id, batch, &reuse, &info.rope, &mut forward) {
                // A refused splice changed nothing: idle sessions' KV goes, as for prefill.
                Err(SpliceError::Kv(
                    e @ (leyline_kv::KvError::PoolExhausted { .. }
                    | leyline_kv::KvError::CowExhausted { .. }),
                )) => {
                    if !self.shed_idle_session(Some(id))? {
                        return Err(EngineError::OutOfKv(format!(
                            "no room for the splice after evicting cached prefixes and idle sessions: {e}"
                        )));
                    }
                }
                Err(SpliceError::Kv(e)) => return Err(e.into()),
                Err(SpliceError::Prefill { source, .. }) => return Err(source.into()),
                Ok(s) => break s,
            }
        };
        self.note_evicted(spliced.evicted);
        let moved = spliced.reused_ranges.clone();
        let s = self.session(id)?;
        let tokens = batch.apply_to_tokens(&s.tokens)?;
        let mut report = EditReport {
            mode: Mode::Amortize,
            directives: sent,
            reused: tokens.len() - spliced.prefilled,
            rotated: spliced.rotated,
            copied: spliced.copied,
            prefilled: spliced.prefilled,
            moved: spliced.reused(),
            prefill_us: forward.as_micros() as u64,
            repaired: 0,
            scanned: 0,
            zeroed: 0,
            new_len: tokens.len(),
            compacted: false,
        };
        let sess = self.session_mut(id)?;
        sess.tokens = tokens;
        sess.slots = spliced.slots;
        sess.clean_len = spliced.clean_len;
        self.compact_if_needed(id, &info.rope, &mut report)?;
        let m = &self.metrics;
        m.add(&m.prefilled_tokens, report.prefilled as u64);
        m.add(&m.rotated_tokens, report.rotated as u64);
        m.add(&m.directives_amortize, report.directives as u64);
        // The splice has committed: a repair that fails leaves its session cut where the
        // failure struck, never holding KV half written.
        let ranges = self.repair_ranges(id, batch, repair, &mut report)?;
        report.repaired = self.repair_session(id, &ranges)?;
        self.update_gauges();
        let mut computed = leyline_core::ranges_without(&batch.new_ranges(), &moved);
        computed.extend(ranges);
        Ok((report, computed))
    }

    /// After a lazy splice: compacts session `id` (its keys rotated to their own positions,
    /// shared ones copied first) when it holds more shifted runs than the engine allows, so
    /// that attention does not cut its keys at more places.
    ///
    /// Compaction only bounds attention's work: the splice is done and exact either way. So
    /// when the copies do not fit after evicting unlocked prefix-cache entries, no idle
    /// session loses its KV for it; the session keeps its runs, and a later splice tries
    /// again.
    fn compact_if_needed(
        &mut self,
        id: SessionId,
        rope: &leyline_kernels::rope::LayerRopes,
        report: &mut EditReport,
    ) -> Result<()> {
        if self.cfg.rotation != RotationMode::Lazy {
            return Ok(());
        }
        let slots = self.session(id)?.slots.clone();
        let shifts = self.cache.pool().key_shifts(&slots)?;
        if segment_count(&shifts, slots.len()) <= self.cfg.max_segments {
            return Ok(());
        }
        let done = match compact(&mut self.cache, &mut self.kv, rope, &slots) {
            Err(leyline_kv::KvError::PoolExhausted { .. }) => {
                self.metrics.add(&self.metrics.compactions_deferred, 1);
                return Ok(());
            }
            r => r?,
        };
        self.note_evicted(done.evicted);
        report.rotated += done.rotated;
        report.copied += done.copied;
        report.compacted = true;
        let m = &self.metrics;
        m.add(&m.rotated_tokens, done.rotated as u64);
        self.session_mut(id)?.slots = done.slots;
        Ok(())
    }

    /// One attempt at the KV layer's splice of session `id`, the model forward passed in;
    /// adds the forward's time to `forward`.
    fn try_splice(
        &mut self,
        id: SessionId,
        batch: &DirectiveBatch,
        reuse: &[Reuse],
        rope: &leyline_kernels::rope::LayerRopes,
        forward: &mut std::time::Duration,
    ) -> std::result::Result<Spliced, SpliceError<leyline_model::ModelError>> {
        let s = self
            .sessions
            .get(&id)
            .ok_or(SpliceError::Kv(leyline_kv::KvError::SpliceInput(format!(
                "no session {}",
                id.0
            ))))?;
        let target = SpliceTarget {
            slots: &s.slots,
            lineage: s.lineage,
            clean_len: s.clean_len,
            reuse,
        };
        let model = &self.model;
        apply_splice(
            &mut self.cache,
            &mut self.kv,
            rope,
            self.cfg.rotation,
            target,
            batch,
            |kv, job| {
                let positions: Vec<u32> =
                    (job.positions.start as u32..job.positions.end as u32).collect();
                let seq = ForwardSeq {
                    tokens: job.tokens,
                    positions: &positions,
                    context: job.context,
                    new_slots: job.slots,
                    logits: LogitsFor::None,
                    shifts: job.shifts,
                };
                let t = std::time::Instant::now();
                let done = model.forward(kv, &[seq]).map(|_| ());
                *forward += t.elapsed();
                done
            },
        )
    }

    fn forget(&mut self, id: SessionId, batch: &DirectiveBatch) -> Result<(EditReport, Vec<u32>)> {
        let s = self.session(id)?;
        let start = batch.directives()[0].start;
        let target = batch.apply_to_tokens(&s.tokens)?;
        // The re-prefill must be possible before anything is forgotten. The session's own
        // slots from `start` on that nothing else holds come free in the purge.
        let own = s.slots[start..]
            .iter()
            .filter(|&&x| self.cache.pool().refcount(x).is_ok_and(|r| r == 1))
            .count();
        self.ensure_room(id, target.len() - start, own)?;
        let old_tail: Vec<u32> = self.session(id)?.slots[start..].to_vec();
        let sess = self.session_mut(id)?;
        sess.tokens.truncate(start);
        sess.slots.truncate(start);
        // What follows is computed again from tokens alone, but stays the session's: KV a
        // FORGET turn computes never enters the shared tree, so a later FORGET can always
        // find all of it in the session (even once the server has reaped the session, its
        // private KV is zeroed, never left for others to match).
        sess.clean_len = sess.clean_len.min(start);
        let zeroed = self.purge(&old_tail)?;
        let report = EditReport {
            mode: Mode::Forget,
            directives: batch.directives().len(),
            reused: start,
            rotated: 0,
            copied: 0,
            prefilled: 0,
            moved: 0,
            prefill_us: 0,
            repaired: 0,
            scanned: 0,
            zeroed,
            new_len: target.len(),
            compacted: false,
        };
        self.metrics
            .add(&self.metrics.directives_forget, report.directives as u64);
        self.update_gauges();
        Ok((report, target))
    }

    /// Prefills `target` past what the session holds (the explicit channel's FORGET);
    /// returns the tokens prefilled.
    fn prefill_session_tail(&mut self, id: SessionId, target: &[u32]) -> Result<usize> {
        let s = self.session(id)?;
        let have = s.tokens.len();
        let tail = target[have..].to_vec();
        if tail.is_empty() {
            return Ok(0);
        }
        let (lineage, clean_len) = (s.lineage, s.clean_len);
        let prev = s.slots.clone();
        // The new slots sit at their own positions: only the held context can be shifted.
        let shifts = self.cache.pool().key_shifts(&prev)?;
        let (slots, removed) = self.cache.alloc_evicting(tail.len())?;
        self.note_evicted(removed.freed.len());
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
                shifts: &shifts,
            };
            if let Err(e) = self.model.forward(&mut self.kv, &[seq]) {
                self.scrub(&slots)?;
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
        let sess = self.session_mut(id)?;
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
        let context = self.session(id)?.slots.clone();
        let shifts = self.cache.pool().key_shifts(&context)?;
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
            shifts: &shifts,
        };
        let out = self.model.forward(&mut self.kv, &[seq]);
        // Scratch KV read the session's context: it goes back zeroed.
        self.scrub(&scratch)?;
        self.cache.pool_mut().release_all(&scratch)?;
        Ok(out?.swap_remove(0))
    }
}

impl Engine {
    /// Deletes every idle named session unused since before `now - idle_timeout`, then the
    /// least recently used idle ones until `room` more fit under `max`; returns them. Busy
    /// sessions are never deleted. Cached conversations of sessionless requests (implicit
    /// splices) expire alike but count against their own limit, and are not returned.
    pub fn reap_sessions(
        &mut self,
        now: Instant,
        idle_timeout: std::time::Duration,
        max: usize,
        room: usize,
    ) -> Vec<SessionId> {
        let mut gone = Vec::new();
        let mut named = self.sessions.values().filter(|s| !s.implicit).count();
        for (id, last_used, busy) in self.sessions_by_use() {
            let implicit = self.sessions.get(&id).is_some_and(|s| s.implicit);
            if busy {
                continue;
            }
            let expired = now.saturating_duration_since(last_used) > idle_timeout;
            if implicit {
                if expired {
                    let _ = self.delete_session(id);
                }
                continue;
            }
            if !expired && named + room <= max {
                continue;
            }
            if self.delete_session(id).is_ok() {
                named -= 1;
                gone.push(id);
            }
        }
        gone
    }
}

/// `ranges` sorted and merged where they overlap or touch.
pub(super) fn union(mut ranges: Vec<Range<usize>>) -> Vec<Range<usize>> {
    ranges.retain(|r| !r.is_empty());
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}
