//! Admission: a waiting request's prefix is found in its session (whose edits applied at
//! submission) or the prefix tree, and its slots are reserved, evicting unlocked prefixes
//! and then idle sessions' KV when the pool is short; or it waits, or is refused.

use super::{Admission, Engine, Running, Waiting, MIN_INFLIGHT_SHARE};
use crate::error::{EngineError, ErrorKind, Failure, Result};
use crate::request::Event;
use crate::sampling::Sampler;
use leyline_core::Mode;
use leyline_kv::radix::{common_prefix, Namespace};
use leyline_kv::slots::Lineage;
use leyline_kv::KvError;
use std::time::Instant;

impl Engine {
    /// Admits waiting requests in order while slots allow.
    pub(super) fn admit(&mut self) -> Result<usize> {
        let mut admitted = 0;
        let mut deferred = Vec::new();
        while self.running.len() < self.cfg.max_running {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            if !w.req.is_alive() {
                self.cancel_waiting(w);
                continue;
            }
            match self.try_admit(w)? {
                Admission::Admitted => admitted += 1,
                Admission::Refused => {}
                Admission::Deferred(w) => deferred.push(w),
                Admission::Blocked(w) => {
                    self.waiting.push_front(w);
                    break;
                }
            }
        }
        // Deferred requests keep their places ahead of the rest of the queue.
        for w in deferred.into_iter().rev() {
            self.waiting.push_front(w);
        }
        self.update_gauges();
        Ok(admitted)
    }

    /// Drops a waiting request whose receiver has gone. Its session's edits, if they were
    /// applied, stay: the session holds the edited context.
    fn cancel_waiting(&mut self, w: Waiting) {
        self.unclaim_session(w.req.session.as_ref().map(|s| s.id));
        self.metrics.add(&self.metrics.requests_cancelled, 1);
    }

    /// Drops every waiting request whose receiver has gone, wherever it is in the queue.
    pub(super) fn cancel_abandoned(&mut self) {
        if self.waiting.iter().all(|w| w.req.is_alive()) {
            return;
        }
        let (live, gone): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|w| w.req.is_alive());
        self.waiting = live.into();
        for w in gone {
            self.cancel_waiting(w);
        }
    }

    fn fail_waiting(&mut self, mut w: Waiting, failure: Failure) {
        self.unclaim_session(w.req.session.as_ref().map(|s| s.id));
        self.metrics.add(&self.metrics.requests_failed, 1);
        let _ = (w.req.sink)(Event::Failed(failure));
    }

    /// Admits `w`, or hands it back when it should wait for an in-flight prefill or the pool
    /// must first drain.
    fn try_admit(&mut self, w: Waiting) -> Result<Admission> {
        let prompt_len = w.req.prompt.len();
        let session = w.req.session.as_ref().map(|s| s.id);
        let tenant = match session.and_then(|id| self.sessions.get(&id)) {
            Some(s) => s.tenant,
            None => w.req.tenant,
        };
        let ns = Namespace::shared(self.model_id).for_tenant(tenant);
        // Leave at least the last prompt token to run: its logits pick the first token.
        let probe = &w.req.prompt[..prompt_len - 1];
        let (mut prefix, mut lock, mut lineage, mut clean_len) =
            (Vec::new(), None, Lineage::SHARED, usize::MAX);
        let forget_turn = w
            .req
            .session
            .as_ref()
            .is_some_and(|s| s.mode == Mode::Forget);
        let mut from_session = false;
        if let Some(id) = session {
            let s = self
                .sessions
                .get(&id)
                .ok_or(EngineError::UnknownSession(id.0))?;
            // The session's cache is stale where the prompt leaves it, and unusable from a slot
            // another session's FORGET revoked (it may have been shared through the tree).
            let revoked = self.cache.pool().first_revoked(&s.slots);
            let keep = common_prefix(&s.tokens, probe).min(revoked);
            // In FORGET mode, whatever the prompt drops is forgotten, by whatever path.
            self.truncate_session(id, keep, forget_turn)?;
            let mode = if forget_turn {
                Mode::Forget
            } else {
                Mode::Amortize
            };
            self.settle_shed(id, probe, mode, ns)?;
            let s = &self.sessions[&id];
            lineage = s.lineage;
            clean_len = s.clean_len;
            if !s.tokens.is_empty() {
                prefix = s.slots.clone();
                from_session = true;
            }
        }
        if !from_session {
            let in_flight = self
                .running
                .iter()
                .filter(|r| r.ns == ns && r.computed() < r.prompt_len.min(r.clean_len))
                .map(|r| common_prefix(&r.tokens[..r.prompt_len.min(r.clean_len)], probe))
                .max()
                .unwrap_or(0);
            // A side-effect-free peek, so a request deferred for many steps counts one lookup.
            if in_flight >= MIN_INFLIGHT_SHARE
                && in_flight >= self.cache.cached_len(ns, probe) + MIN_INFLIGHT_SHARE
            {
                return Ok(Admission::Deferred(w));
            }
            let m = self.cache.match_prefix(ns, probe);
            if let Some(node) = m.node {
                lock = Some(self.cache.lock(node)?);
            }
            prefix = m.slots;
        }
        let cached = prefix.len();
        if forget_turn {
            // What a FORGET turn computes stays its session's: it never enters the shared
            // tree, so that dropping it later (even after the server reaped the session)
            // leaves nothing anyone can match.
            clean_len = clean_len.min(cached);
        }
        let edit_in_prefix: usize = w
            .edit_ranges
            .iter()
            .map(|r| r.end.min(cached).saturating_sub(r.start))
            .sum();
        let room = self.max_sequence_len() - prompt_len;
        let need = prompt_len - cached + w.req.max_tokens.min(room);
        let mut alloc = self.cache.alloc_evicting(need);
        // Idle sessions' KV goes next, least recently used first: running sequences would
        // free none of it by finishing (a session keeps its KV), so waiting for them only
        // delays the same loss. Unless even shedding all of it leaves too little room: then
        // the request waits (or is refused) and no session loses its KV for nothing.
        if matches!(alloc, Err(KvError::PoolExhausted { .. })) && self.shedding_can_fit(need) {
            while matches!(alloc, Err(KvError::PoolExhausted { .. }))
                && self.shed_idle_session(None)?
            {
                alloc = self.cache.alloc_evicting(need);
            }
        }
        match alloc {
            Ok((slots, removed)) => {
                self.note_evicted(removed.freed.len());
                self.metrics
                    .add(&self.metrics.prompt_tokens, prompt_len as u64);
                self.metrics.add(
                    &self.metrics.cached_prompt_tokens,
                    (cached - edit_in_prefix) as u64,
                );
                let sampler = Sampler::new(w.req.sampling);
                self.running.push(Running {
                    id: w.id,
                    tokens: w.req.prompt.clone(),
                    req: w.req,
                    ns,
                    slots: prefix,
                    reserved: slots.into(),
                    cached,
                    lock,
                    sampler,
                    prompt_len,
                    generated: 0,
                    submitted: w.submitted,
                    admitted: Instant::now(),
                    first_token: None,
                    finish: None,
                    session,
                    lineage,
                    clean_len,
                    edit: w.edit,
                    edit_in_prefix,
                    passed_over: 0,
                    admission: self.admissions,
                    bounds: w.bounds,
                });
                self.admissions += 1;
                Ok(Admission::Admitted)
            }
            Err(KvError::PoolExhausted { .. }) => {
                if let Some(l) = lock.take() {
                    let freed = self.cache.unlock(l)?.freed;
                    self.scrub(&freed)?;
                }
                if !self.running.is_empty() {
                    // Running sequences will free slots; keep the queue order.
                    return Ok(Admission::Blocked(w));
                }
                // Nothing runs and eviction could not make room: it never fits.
                let cap = self.kv.capacity();
                self.fail_waiting(
                    w,
                    Failure::new(ErrorKind::OutOfKv, format!("the request needs {need} KV slots but the pool cannot free that many ({cap} slots in all)")),
                );
                Ok(Admission::Refused)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Whether `need` slots could be found with every idle session's KV gone: what running
    /// sequences and busy sessions hold stays (slots they share are counted once per holder,
    /// so this errs toward no).
    fn shedding_can_fit(&self, need: usize) -> bool {
        let running: usize = self
            .running
            .iter()
            .map(|r| r.slots.len() + r.reserved.len())
            .sum();
        let busy: usize = self
            .sessions
            .values()
            .filter(|s| s.busy.is_some())
            .map(|s| s.slots.len())
            .sum();
        need + running + busy <= self.kv.capacity()
    }
}
