//! The scheduler: continuous batching over the shared slot pool with prefix reuse.
//!
//! Each [`Engine::step`] admits waiting requests (longest cached prefix first reused, the
//! rest of the prompt reserved in the pool, evicting unlocked prefixes when short, then idle
//! sessions' KV, least recently used first), then runs ONE forward over every running
//! sequence: a decode token for each sequence that has one, and prefill chunks for the
//! others within a token budget (`prefill_chunk`, or the smaller `decode_prefill_chunk` when
//! the step also decodes), so a long prompt never stalls decodes for long. The budget goes
//! to the prompt with the fewest tokens left first ([`PrefillOrder`]): a plain turn or a
//! spliced edit does not wait behind another session's long re-prefill, and a prompt passed
//! over `prefill_patience` times goes first from then on. Every prefilled chunk of
//! lineage-free prompt goes into the prefix tree at once, so a request that shares a prompt
//! prefix with one still prefilling waits for that prefill (a step or a few) instead of
//! computing the same prefix again; finished sequences leave their KV in the tree for later
//! hits.
//!
//! Slot ownership: a running sequence owns one reference on each slot it allocated; the
//! cached prefix it started from is pinned by a lock on the tree node instead. On finish the
//! tree adopts the sequence's slots, the sequence drops its references and its lock.

mod admit;
mod edit;
mod implicit;
mod repair;

use crate::error::{EngineError, ErrorKind, Failure, Result};
use crate::metrics::Metrics;
use crate::request::{Event, FinishReason, Request, RequestId, Usage};
use crate::sampling::Sampler;
use crate::session::{EditReport, Session, SessionEdits, SessionId, SessionRequest};
use leyline_core::Repair;
use leyline_kv::radix::{LockReceipt, Namespace, PrefixCache};
use leyline_kv::shift::RotationMode;
use leyline_kv::slots::Lineage;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::{CausalLm, ForwardSeq, LogitsFor};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// KV storage type.
    pub kv_dtype: KvDtype,
    /// Pool size in slots (tokens).
    pub kv_slots: usize,
    /// Most prompt tokens prefilled per step, over all sequences.
    pub prefill_chunk: usize,
    /// The same limit for steps that also decode: it bounds the time between two tokens of a
    /// running generation while others prefill (values above `prefill_chunk` change nothing).
    pub decode_prefill_chunk: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Which prefilling sequences get a step's prefill budget first.
    pub prefill_order: PrefillOrder,
    /// Under [`PrefillOrder::Shortest`], a sequence left without prefill in this many steps
    /// goes ahead of every shorter prompt from then on (no prompt starves).
    pub prefill_patience: u32,
    /// Most requests waiting for admission; more are refused ([`ErrorKind::Overloaded`]).
    pub max_waiting: usize,
    /// Most cached conversations of sessionless requests kept for implicit splices
    /// (`engine/implicit.rs`); the least recently used idle one goes first.
    pub max_implicit_sessions: usize,
    /// The repair of AMORTIZE edits whose batch and session name none ([`Repair::NONE`]:
    /// the splice alone).
    pub repair: Repair,
    /// Whether an AMORTIZE splice rotates downstream keys in storage or leaves them where they
    /// are and lets attention rotate the query ([`RotationMode`]).
    pub rotation: RotationMode,
    /// Under lazy rotation, the most runs of distinct offset a session's context may hold
    /// after a splice ([`leyline_kv::shift::segment_count`]); past it the session is
    /// compacted by the eager kernel. `usize::MAX`: never.
    pub max_segments: usize,
    /// An AMORTIZE replacement's runs of at least this many tokens that repeat tokens the
    /// session holds (a message the client moved) take a copy of those tokens' KV, rotated
    /// to the new place, instead of being prefilled: the copies keep what they attended to
    /// where they were, as a splice's downstream tokens do. 0: every replacement is
    /// prefilled.
    pub reuse_min_tokens: usize,
}

/// [`EngineConfig::kv_dtype`] unless set otherwise. f16 by measurement on the default model
/// (BENCHMARKS.md, "KV storage type"): the same prefill speed and first-token agreement as
/// f32, faster decode at long context, half the memory per cached token.
pub const DEFAULT_KV_DTYPE: KvDtype = KvDtype::F16;
/// [`EngineConfig::max_segments`] unless set otherwise. By measurement (BENCHMARKS.md,
/// "Lazy rotation"): a turn after a splice reads 32 runs at 0.76x eager's prefill speed and
/// 0.93x its decode speed (every run boundary ends a key block early), 8 runs at about 0.84x
/// and 0.95x.
pub const DEFAULT_MAX_SEGMENTS: usize = 8;
/// The command line's [`EngineConfig::reuse_min_tokens`]: off. On `verify --moves` probes
/// (a tool output moved to just before the turn's last message), copying the moved KV
/// instead of prefilling it lowered SmolLM2's agreement with FORGET's next token from 44
/// to 38 of 50 (BENCHMARKS.md, "Moved messages"); a server trading that for the prefill
/// sets it (8 keeps a run to a message's text rather than a template's framing).
pub const DEFAULT_REUSE_MIN_TOKENS: usize = 0;
/// [`EngineConfig::prefill_patience`] unless set otherwise.
pub const DEFAULT_PREFILL_PATIENCE: u32 = 32;
/// [`EngineConfig::prefill_chunk`] unless set otherwise.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;
/// [`EngineConfig::decode_prefill_chunk`] unless set otherwise.
pub const DEFAULT_DECODE_PREFILL_CHUNK: usize = 128;
/// [`EngineConfig::max_waiting`] unless set otherwise.
pub const DEFAULT_MAX_WAITING: usize = 256;
/// The layer at which the repair rule `deviation` compares recomputed KV with the cached:
/// the first whose keys and values depend on the context (layer 0's depend on the token and
/// its position alone, which the splice keeps exact).
pub const REPAIR_DEVIATION_LAYER: usize = 1;

/// [`EngineConfig::max_implicit_sessions`] unless set otherwise.
pub const DEFAULT_MAX_IMPLICIT_SESSIONS: usize = 256;

/// How a step hands its prefill budget to the sequences still prefilling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillOrder {
    /// In admission order: the oldest prompt finishes first.
    Arrival,
    /// Fewest prompt tokens left first, so that a short prompt (a plain turn, a spliced
    /// edit) does not queue behind a long re-prefill; ties in admission order.
    Shortest,
}

impl PrefillOrder {
    /// The name `FromStr` reads.
    pub fn name(self) -> &'static str {
        match self {
            PrefillOrder::Arrival => "arrival",
            PrefillOrder::Shortest => "shortest",
        }
    }
}

impl std::str::FromStr for PrefillOrder {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "arrival" | "fcfs" => Ok(PrefillOrder::Arrival),
            "shortest" | "srpt" => Ok(PrefillOrder::Shortest),
            other => Err(format!(
                "unknown prefill order {other:?} (expected shortest or arrival)"
            )),
        }
    }
}

impl std::fmt::Display for PrefillOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl EngineConfig {
    /// Settings for `model` with a pool of `kv_slots`.
    pub fn new(kv_slots: usize) -> Self {
        Self {
            kv_dtype: DEFAULT_KV_DTYPE,
            kv_slots,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            decode_prefill_chunk: DEFAULT_DECODE_PREFILL_CHUNK,
            max_running: 64,
            prefill_order: PrefillOrder::Shortest,
            prefill_patience: DEFAULT_PREFILL_PATIENCE,
            max_waiting: DEFAULT_MAX_WAITING,
            max_implicit_sessions: DEFAULT_MAX_IMPLICIT_SESSIONS,
            repair: Repair::NONE,
            rotation: RotationMode::Eager,
            max_segments: DEFAULT_MAX_SEGMENTS,
            reuse_min_tokens: 0,
        }
    }

    /// A pool sized from a byte budget for `model`'s geometry.
    pub fn slots_for_memory(model: &dyn CausalLm, dtype: KvDtype, bytes: usize) -> usize {
        KvStorage::slots_for_bytes(model.info().geometry, dtype, bytes)
    }
}

struct Running {
    id: RequestId,
    req: Request,
    ns: Namespace,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    /// Slot of every token with KV (`tokens[..slots.len()]`).
    slots: Vec<u32>,
    /// Own slots not used yet, handed out in order.
    reserved: VecDeque<u32>,
    /// Prefix length served from the cache (pinned by `lock`).
    cached: usize,
    lock: Option<LockReceipt>,
    sampler: Sampler,
    prompt_len: usize,
    generated: usize,
    submitted: Instant,
    admitted: Instant,
    first_token: Option<Instant>,
    /// Set once the sequence must leave at the end of the step.
    finish: Option<FinishReason>,
    /// The session the sequence continues, if any.
    session: Option<SessionId>,
    /// Lineage of slots past `clean_len`.
    lineage: Lineage,
    /// Slots at this index or later get the sequence's lineage; before it, shared.
    clean_len: usize,
    /// What the request's edit did.
    edit: Option<EditReport>,
    /// Of the `cached` prefix, tokens the request's edit computed (AMORTIZE replacements):
    /// work done for this request, so not counted as cached in its usage.
    edit_in_prefix: usize,
    /// Steps in which this sequence still had prompt to prefill and got none of the budget.
    passed_over: u32,
    /// Admission number (`running` loses that order when sequences retire).
    admission: u64,
    /// The prompt's message bounds, for the session's next turn.
    bounds: Option<Vec<usize>>,
}

impl Running {
    fn computed(&self) -> usize {
        self.slots.len()
    }
}

struct Waiting {
    id: RequestId,
    req: Request,
    submitted: Instant,
    /// What the session's edits did (they apply at submission).
    edit: Option<EditReport>,
    /// Positions whose KV the edit computed (AMORTIZE replacements).
    edit_ranges: Vec<Range<usize>>,
    /// The prompt's message bounds, kept by the session for its next turn.
    bounds: Option<Vec<usize>>,
}

/// What a session request's edits did at submission.
#[derive(Default)]
struct TurnEdit {
    report: Option<EditReport>,
    /// Positions whose KV the edit computed (AMORTIZE replacements).
    ranges: Vec<Range<usize>>,
    /// The prompt's message bounds, kept by the session for its next turn.
    bounds: Option<Vec<usize>>,
}

/// What became of an admission attempt.
enum Admission {
    Admitted,
    /// A running sequence is prefilling a longer prefix of this prompt than the tree holds:
    /// the request waits for it and later requests may go first.
    Deferred(Waiting),
    /// The pool must drain first; the queue waits in order.
    Blocked(Waiting),
    /// It can never run; its sink was told why.
    Refused,
}

/// A request defers to an in-flight prefill only when that saves it at least this many
/// prompt tokens of prefill.
const MIN_INFLIGHT_SHARE: usize = 32;

/// What one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Sequences in the forward call.
    pub seqs: usize,
    /// Of which decoding one token.
    pub decode_seqs: usize,
    /// Prompt tokens prefilled.
    pub prefill_tokens: usize,
    /// Requests admitted.
    pub admitted: usize,
    /// Requests finished or failed.
    pub retired: usize,
}

/// The scheduler and everything it owns: model, KV storage, prefix cache, queues.
pub struct Engine {
    pub(crate) model: Arc<dyn CausalLm>,
    pub(crate) model_id: u32,
    pub(crate) cfg: EngineConfig,
    pub(crate) kv: KvStorage,
    pub(crate) cache: PrefixCache,
    waiting: VecDeque<Waiting>,
    running: Vec<Running>,
    next_id: RequestId,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) sessions: HashMap<SessionId, Session>,
    pub(crate) next_session: u64,
    /// Admissions so far (numbers the running sequences).
    admissions: u64,
}

impl Engine {
    /// An engine over `model` with a pool of `cfg.kv_slots` slots.
    ///
    /// # Errors
    /// A zero-sized pool or bad settings.
    pub fn new(model: Arc<dyn CausalLm>, cfg: EngineConfig) -> Result<Self> {
        if cfg.prefill_chunk == 0 || cfg.decode_prefill_chunk == 0 || cfg.max_running == 0 {
            return Err(EngineError::InvalidRequest(
                "prefill_chunk, decode_prefill_chunk and max_running must be at least 1".into(),
            ));
        }
        let kv = KvStorage::new(model.info().geometry, cfg.kv_dtype, cfg.kv_slots)?;
        let cache = PrefixCache::new(cfg.kv_slots)?;
        let metrics = Arc::new(Metrics::default());
        metrics.set(&metrics.pool_capacity_slots, cfg.kv_slots as u64);
        let slot_bytes = model.info().geometry.bytes_per_slot(cfg.kv_dtype);
        metrics.set(&metrics.pool_slot_bytes, slot_bytes as u64);
        Ok(Self {
            model,
            model_id: 0,
            cfg,
            kv,
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 1,
            metrics,
            sessions: HashMap::new(),
            next_session: 1,
            admissions: 0,
        })
    }

    /// The model.
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    /// Live counters.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(&self.metrics)
    }

    /// The prefix cache (slot metadata and tree), for inspection.
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// The KV storage, for inspection.
    pub fn storage(&self) -> &KvStorage {
        &self.kv
    }

    /// Settings.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Whether anything is queued or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Most tokens one sequence can hold: the model's context or the pool, whichever is less.
    pub fn max_sequence_len(&self) -> usize {
        self.model.info().context_length.min(self.kv.capacity())
    }

    /// Queues a request. Requests that can never run fail here, with their sink told why;
    /// a session request's edits apply here.
    pub fn submit(&mut self, mut req: Request) -> RequestId {
        let id = self.take_id();
        match self.prepare(&mut req, id) {
            Ok(turn) => self.enqueue(id, req, turn),
            Err(e) => {
                let _ = (req.sink)(Event::Failed(e.failure()));
            }
        }
        id
    }

    /// Queues a request, or answers at once why it cannot run (the sink is then not
    /// called): invalid, unknown or busy session, a full queue, or a session edit that is
    /// invalid or finds the pool short. A server answers these with a status before it
    /// starts a response.
    ///
    /// # Errors
    /// As above; the request is dropped and its session is as it was.
    pub fn try_submit(&mut self, mut req: Request) -> Result<RequestId> {
        let id = self.take_id();
        let turn = self.prepare(&mut req, id)?;
        self.enqueue(id, req, turn);
        Ok(id)
    }

    /// Validates `req`, claims its session and applies the session's edits (once, now:
    /// an edit that fails is answered before the request is queued).
    fn prepare(&mut self, req: &mut Request, id: RequestId) -> Result<TurnEdit> {
        self.check_and_claim(req, id)?;
        let mut implicit = None;
        let mut bounds = None;
        if let (None, Some(turn), true) = (
            &req.session,
            req.implicit.take(),
            self.cfg.max_implicit_sessions > 0,
        ) {
            // The conversation search has diffed the prompt already: its directives go as is.
            let (sid, fresh, directives) =
                self.implicit_session(&req.prompt, &turn, req.tenant, req.repair, id)?;
            implicit = Some((sid, fresh));
            bounds = Some(turn.bounds);
            req.session = Some(SessionRequest {
                id: sid,
                mode: turn.mode,
                edits: SessionEdits::Directives(directives),
            });
        }
        let Some(sr) = req.session.as_mut() else {
            return Ok(TurnEdit::default());
        };
        let edits = std::mem::take(&mut sr.edits);
        if let SessionEdits::Messages(b) = &edits {
            bounds = Some(b.clone());
        }
        let (sid, mode) = (sr.id, sr.mode);
        let edited = self
            .turn_directives(sid, edits, &req.prompt, mode)
            .and_then(|d| self.edit_session(sid, d, mode, Some(id), req.repair));
        match edited {
            Ok((report, ranges, _)) => Ok(TurnEdit {
                report: Some(report),
                ranges,
                bounds,
            }),
            Err(e) => {
                self.unclaim_session(Some(sid));
                if let Some((sid, true)) = implicit {
                    // A fork or new conversation that never ran is nobody's.
                    self.delete_session(sid)?;
                }
                self.metrics.add(&self.metrics.requests_failed, 1);
                Err(e)
            }
        }
    }

    fn take_id(&mut self) -> RequestId {
        let id = self.next_id;
        self.next_id += 1;
        self.metrics.add(&self.metrics.requests_submitted, 1);
        id
    }

    fn check_and_claim(&mut self, req: &Request, id: RequestId) -> Result<()> {
        let claimed = self
            .validate(req)
            .and_then(|()| self.check_queue_room())
            .and_then(|()| self.claim_session(req, id));
        if claimed.is_err() {
            self.metrics.add(&self.metrics.requests_failed, 1);
        }
        claimed
    }

    fn enqueue(&mut self, id: RequestId, req: Request, turn: TurnEdit) {
        self.waiting.push_back(Waiting {
            id,
            req,
            submitted: Instant::now(),
            edit: turn.report,
            edit_ranges: turn.ranges,
            bounds: turn.bounds,
        });
        self.update_gauges();
    }

    fn check_queue_room(&mut self) -> Result<()> {
        if self.waiting.len() >= self.cfg.max_waiting {
            self.cancel_abandoned();
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            self.metrics
                .add(&self.metrics.requests_rejected_queue_full, 1);
            return Err(EngineError::Overloaded(format!(
                "{} requests are waiting already; retry later",
                self.waiting.len()
            )));
        }
        Ok(())
    }

    /// Marks the request's session busy until the request ends.
    fn claim_session(&mut self, req: &Request, by: RequestId) -> Result<()> {
        if let Some(sr) = &req.session {
            let s = self
                .sessions
                .get_mut(&sr.id)
                .ok_or(EngineError::UnknownSession(sr.id.0))?;
            if s.busy.is_some() {
                return Err(EngineError::SessionBusy(sr.id.0));
            }
            s.busy = Some(by);
            s.last_used = Instant::now();
        }
        Ok(())
    }

    fn unclaim_session(&mut self, id: Option<SessionId>) {
        if let Some(s) = id.and_then(|id| self.sessions.get_mut(&id)) {
            s.busy = None;
            s.last_used = Instant::now();
        }
    }

    fn validate(&self, req: &Request) -> Result<()> {
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        req.sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        let vocab = self.model.info().vocab_size;
        if let Some(t) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {t} is outside the vocabulary of {vocab}"
            )));
        }
        let limit = self.max_sequence_len();
        if req.prompt.len() >= limit {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens but a sequence holds at most {} here (context length {}, KV pool {} slots)",
                req.prompt.len(),
                limit - 1,
                self.model.info().context_length,
                self.kv.capacity()
            )));
        }
        Ok(())
    }

    /// Runs one scheduling step: admit, one batched forward, sample, retire.
    ///
    /// # Errors
    /// Only for engine-internal failures; per-request problems go to that request's sink.
    pub fn step(&mut self) -> Result<StepReport> {
        let mut report = StepReport::default();
        self.cancel_abandoned();
        if self.cancel_abandoned_prefills() {
            // Their slots go back before admission.
            self.retire(&mut report);
        }
        report.admitted = self.admit()?;
        if self.running.is_empty() {
            self.update_gauges();
            return Ok(report);
        }
        // Plan the batch: decodes first, then prefill chunks within the budget.
        let mut plan: Vec<(usize, usize, usize)> = Vec::new(); // (running index, from, to)
        for (i, r) in self.running.iter().enumerate() {
            let c = r.computed();
            if c >= r.prompt_len && c < r.tokens.len() {
                plan.push((i, c, c + 1));
                report.decode_seqs += 1;
            }
        }
        let mut budget = if report.decode_seqs > 0 {
            self.cfg.prefill_chunk.min(self.cfg.decode_prefill_chunk)
        } else {
            self.cfg.prefill_chunk
        };
        for i in self.prefill_queue() {
            let r = &mut self.running[i];
            let c = r.computed();
            if budget == 0 {
                r.passed_over += 1;
                continue;
            }
            let to = (c + budget).min(r.prompt_len);
            budget -= to - c;
            report.prefill_tokens += to - c;
            plan.push((i, c, to));
        }
        if plan.is_empty() {
            self.retire(&mut report);
            return Ok(report);
        }
        // Hand out slots for the new tokens.
        let mut new_slots: Vec<Vec<u32>> = Vec::with_capacity(plan.len());
        let mut positions: Vec<Vec<u32>> = Vec::with_capacity(plan.len());
        for &(i, from, to) in &plan {
            let r = &mut self.running[i];
            let take: Vec<u32> = r.reserved.drain(..to - from).collect();
            debug_assert_eq!(take.len(), to - from, "reservation covers the sequence");
            for (k, &s) in take.iter().enumerate() {
                let pos = from + k;
                let lineage = if pos < r.clean_len {
                    Lineage::SHARED
                } else {
                    r.lineage
                };
                self.cache.pool_mut().set_position(s, pos as u32)?;
                self.cache.pool_mut().set_lineage(s, lineage)?;
            }
            positions.push((from as u32..to as u32).collect());
            new_slots.push(take);
        }
        // Contexts a lazy splice left shifted are read through their runs; under eager
        // rotation every key sits at its position, so the per-step scan is skipped.
        let shifts = match self.cfg.rotation {
            RotationMode::Eager => vec![Vec::new(); plan.len()],
            RotationMode::Lazy => plan
                .iter()
                .map(|&(i, from, _)| self.cache.pool().key_shifts(&self.running[i].slots[..from]))
                .collect::<std::result::Result<Vec<_>, _>>()?,
        };
        let logits = {
            let seqs: Vec<ForwardSeq<'_>> = plan
                .iter()
                .enumerate()
                .map(|(k, &(i, from, to))| {
                    let r = &self.running[i];
                    ForwardSeq {
                        tokens: &r.tokens[from..to],
                        positions: &positions[k],
                        context: &r.slots[..from],
                        new_slots: &new_slots[k],
                        logits: if to >= r.prompt_len {
                            LogitsFor::Last
                        } else {
                            LogitsFor::None
                        },
                        shifts: &shifts[k],
                    }
                })
                .collect();
            self.model.forward(&mut self.kv, &seqs)
        };
        let m = &self.metrics;
        m.add(&m.forward_calls, 1);
        m.max(&m.max_batch_seqs, plan.len() as u64);
        if report.decode_seqs > 1 {
            m.add(&m.batched_decode_seqs, report.decode_seqs as u64);
        }
        m.add(&m.prefilled_tokens, report.prefill_tokens as u64);
        report.seqs = plan.len();
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // Give the slots back to their sequences' ownership and fail them.
                let failure = Failure::new(ErrorKind::Internal, format!("forward failed: {e}"));
                for (k, &(i, _, _)) in plan.iter().enumerate() {
                    let r = &mut self.running[i];
                    for &s in new_slots[k].iter().rev() {
                        r.reserved.push_front(s);
                    }
                    let _ = (r.req.sink)(Event::Failed(failure.clone()));
                    r.finish = Some(FinishReason::Cancelled);
                }
                self.retire(&mut report);
                return Ok(report);
            }
        };
        let now = Instant::now();
        for (k, &(i, from, to)) in plan.iter().enumerate() {
            let max_len = self.max_sequence_len();
            let r = &mut self.running[i];
            r.slots.extend_from_slice(&new_slots[k]);
            let clean = to.min(r.clean_len);
            if from < r.prompt_len && clean > 0 {
                // Served to other requests from now on, while this one still runs; the tree
                // takes its own references, so this sequence's ownership is unchanged.
                self.cache
                    .insert(r.ns, &r.tokens[..clean], &r.slots[..clean])?;
            }
            if to < r.prompt_len {
                continue;
            }
            let next = r.sampler.sample(&logits[k]);
            if r.first_token.is_none() {
                r.first_token = Some(now);
            }
            if r.req.stop_tokens.contains(&next) {
                r.finish = Some(FinishReason::Stop);
                continue;
            }
            r.generated += 1;
            self.metrics.add(&self.metrics.generated_tokens, 1);
            r.tokens.push(next);
            if let Some(top) = r.req.sampling.logprobs {
                let report = crate::sampling::logprobs(&logits[k], next, top);
                // The token's own event, next, carries the request's fate.
                let _ = (r.req.sink)(Event::Logprobs(report));
            }
            if (r.req.sink)(Event::Token(next)).is_break() {
                r.finish = Some(FinishReason::Cancelled);
            } else if r.generated >= r.req.max_tokens {
                r.finish = Some(FinishReason::Length);
            } else if r.tokens.len() >= max_len || r.reserved.is_empty() {
                r.finish = Some(FinishReason::ContextFull);
            }
        }
        self.retire(&mut report);
        Ok(report)
    }

    /// Ends running sequences still prefilling whose receiver has gone: the rest of their
    /// prompt is computed for nobody. (A generating one learns it at its next token.)
    fn cancel_abandoned_prefills(&mut self) -> bool {
        let mut any = false;
        for r in &mut self.running {
            if r.finish.is_none() && r.computed() < r.prompt_len && !r.req.is_alive() {
                r.finish = Some(FinishReason::Cancelled);
                self.metrics.add(&self.metrics.requests_cancelled, 1);
                any = true;
            }
        }
        any
    }

    /// Indices of the sequences with prompt left to prefill, in the order they get budget.
    fn prefill_queue(&self) -> Vec<usize> {
        let mut queue: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].computed() < self.running[i].prompt_len)
            .collect();
        let patience = self.cfg.prefill_patience;
        queue.sort_by_key(|&i| {
            let r = &self.running[i];
            match self.cfg.prefill_order {
                PrefillOrder::Arrival => (false, 0, r.admission),
                PrefillOrder::Shortest if r.passed_over >= patience => (false, 0, r.admission),
                PrefillOrder::Shortest => (true, r.prompt_len - r.computed(), r.admission),
            }
        });
        queue
    }

    /// Zeroes the storage of freed slots that held forgotten (revoked) KV or KV computed
    /// from it.
    pub(crate) fn scrub(&mut self, freed: &[u32]) -> Result<()> {
        for &slot in freed {
            self.kv.zero_slot(slot)?;
        }
        Ok(())
    }

    pub(crate) fn note_evicted(&self, n: usize) {
        self.metrics.add(&self.metrics.evicted_slots, n as u64);
    }

    /// Removes finished sequences: their KV goes into the tree, their references go away.
    fn retire(&mut self, report: &mut StepReport) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].finish.is_none() {
                i += 1;
                continue;
            }
            let mut r = self.running.swap_remove(i);
            report.retired += 1;
            let reason = r.finish.unwrap_or(FinishReason::Cancelled);
            let computed = r.computed();
            let outcome = self.release(&mut r);
            let now = Instant::now();
            let usage = Usage {
                prompt_tokens: r.prompt_len,
                cached_tokens: r.cached - r.edit_in_prefix,
                prefilled_tokens: r.prompt_len - r.cached + r.edit_in_prefix,
                reused_tokens: r.cached,
                completion_tokens: r.generated,
                queued: r.admitted - r.submitted,
                ttft: r.first_token.unwrap_or(now) - r.submitted,
                total: now - r.submitted,
                edit: r.edit,
            };
            match outcome {
                Ok(()) => {
                    self.metrics.add(&self.metrics.requests_finished, 1);
                    let ttft_us = u64::try_from(usage.ttft.as_micros()).unwrap_or(u64::MAX);
                    self.metrics.add(&self.metrics.ttft_us, ttft_us);
                    let tokens = r.tokens[..computed].to_vec();
                    let _ = (r.req.sink)(Event::Finished {
                        reason,
                        usage,
                        tokens,
                    });
                }
                Err(e) => {
                    self.metrics.add(&self.metrics.requests_failed, 1);
                    tracing::error!(request = r.id, "releasing KV failed: {e}");
                    let failure =
                        Failure::new(ErrorKind::Internal, format!("internal KV error: {e}"));
                    let _ = (r.req.sink)(Event::Failed(failure));
                }
            }
        }
        self.update_gauges();
    }

    fn release(&mut self, r: &mut Running) -> Result<()> {
        let computed = r.computed();
        let clean = computed.min(r.clean_len);
        // Lineage-free KV is shared with every later request (up to a revoked slot).
        self.cache
            .insert(r.ns, &r.tokens[..clean], &r.slots[..clean])?;
        let unused: Vec<u32> = r.reserved.drain(..).collect();
        self.cache.pool_mut().release_all(&unused)?;
        // A FORGET elsewhere may have revoked part of the prefix while this ran: nothing from
        // there on is kept, and what this sequence frees is zeroed.
        let usable = self.cache.pool().first_revoked(&r.slots);
        let mut retain = Vec::new();
        let drop = match r.session.and_then(|id| self.sessions.get_mut(&id)) {
            Some(s) => {
                // The session takes over the sequence: it already holds its own prefix (or
                // retains the one borrowed from the tree) and the request's slots pass to it.
                let from_tree = s.tokens.is_empty();
                let first_owned = if from_tree {
                    retain = r.slots[..r.cached.min(usable)].to_vec();
                    r.cached
                } else {
                    0
                };
                s.tokens = r.tokens[..usable].to_vec();
                s.slots = r.slots[..usable].to_vec();
                s.clean_len = s.clean_len.min(r.clean_len);
                s.busy = None;
                s.last_used = Instant::now();
                s.turns += 1;
                // The bounds describe the prompt: kept while the session still holds it.
                s.bounds = r.bounds.take().filter(|_| usable >= r.prompt_len);
                r.slots[usable.max(first_owned)..].to_vec()
            }
            None => r.slots[r.cached..].to_vec(),
        };
        for slot in retain {
            self.cache.pool_mut().retain(slot)?;
        }
        let mut freed = self.cache.pool_mut().release_all(&drop)?;
        if let Some(l) = r.lock.take() {
            freed.extend(self.cache.unlock(l)?.freed);
        }
        if usable < r.slots.len() {
            self.scrub(&freed)?;
        } else {
            self.zero_private(&freed)?;
        }
        Ok(())
    }

    pub(crate) fn update_gauges(&self) {
        let m = &self.metrics;
        m.set(&m.queue_depth, self.waiting.len() as u64);
        m.set(&m.running, self.running.len() as u64);
        m.set(&m.pool_used_slots, self.cache.pool().used_count() as u64);
        let conversations = self.sessions.values().filter(|s| s.implicit).count();
        m.set(&m.conversations, conversations as u64);
    }

    /// Runs steps until nothing is queued or running.
    ///
    /// # Errors
    /// Engine-internal failures.
    pub fn run_to_completion(&mut self) -> Result<()> {
        while self.has_work() {
            self.step()?;
        }
        Ok(())
    }

    /// Checks the pool/tree invariants and, when nothing runs, that every reference on a
    /// slot belongs to the tree or a session: for tests after a workload.
    ///
    /// # Errors
    /// A description of the first violated invariant.
    pub fn check_no_leaks(&self) -> std::result::Result<(), String> {
        self.cache.check_invariants()?;
        if self.running.is_empty() {
            let mut refs = self.cache.tree_references();
            for s in self.sessions.values() {
                for &slot in &s.slots {
                    refs[slot as usize] += 1;
                }
            }
            for (slot, &want) in refs.iter().enumerate() {
                let held = self
                    .cache
                    .pool()
                    .refcount(slot as u32)
                    .map_err(|e| e.to_string())?;
                if held != want {
                    return Err(format!(
                        "slot {slot}: {held} references but the tree and sessions hold {want}"
                    ));
                }
            }
        }
        Ok(())
    }
}
