//! Requests as the scheduler sees them, and the events it streams back.

use crate::error::Failure;
use crate::sampling::SamplingParams;
use crate::session::{EditReport, SessionRequest};
use leyline_core::Mode;
use std::ops::ControlFlow;
use std::time::Duration;

/// Identifier of a submitted request, unique per engine.
pub type RequestId = u64;

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was produced (not emitted).
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The context (model or pool) is full.
    ContextFull,
    /// The receiver went away or asked to stop.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's name for it.
    pub fn as_openai(self) -> &'static str {
        match self {
            FinishReason::Stop | FinishReason::Cancelled => "stop",
            FinishReason::Length | FinishReason::ContextFull => "length",
        }
    }
}

/// Counts and timings of a finished request.
#[derive(Debug, Clone, PartialEq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was in place before the request and cost it nothing: its
    /// session's or the prefix tree's, not an AMORTIZE replacement its own edit prefilled.
    pub cached_tokens: usize,
    /// Prompt tokens computed for this request (`prompt_tokens - cached_tokens`): its
    /// prefill and the replacements of its edit that the prompt kept.
    pub prefilled_tokens: usize,
    /// Length of the prompt prefix whose KV was in place at admission: `cached_tokens` plus
    /// the edit's replacements inside it.
    pub reused_tokens: usize,
    /// Generated tokens (emitted).
    pub completion_tokens: usize,
    /// Time in the queue before admission.
    pub queued: Duration,
    /// Time from submission to the first token.
    pub ttft: Duration,
    /// Time from submission to the end.
    pub total: Duration,
    /// What the request's session edit did, if it carried one.
    pub edit: Option<EditReport>,
}

impl Usage {
    /// Prompt tokens computed for this request, in its prefill or by its edit, counting
    /// edit replacements (and repaired tokens) that the prompt then did not keep.
    pub fn computed_tokens(&self) -> usize {
        let kept = self.reused_tokens - self.cached_tokens;
        self.prefilled_tokens
            + self
                .edit
                .map_or(0, |e| (e.prefilled + e.repaired).saturating_sub(kept))
    }
}

/// What the engine tells a request's receiver.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The log-probabilities of the token that follows (requests whose sampling asks for
    /// them, [`SamplingParams::logprobs`]).
    Logprobs(crate::sampling::TokenLogprobs),
    /// A generated token.
    Token(u32),
    /// The request ended normally.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Counts and timings.
        usage: Usage,
        /// Prompt plus generated tokens that have KV in the cache.
        tokens: Vec<u32>,
    },
    /// The request failed; nothing more follows.
    Failed(Failure),
}

/// Receives a request's events; returning `Break` cancels the request.
pub type EventSink = Box<dyn FnMut(Event) -> ControlFlow<()> + Send>;

/// Says whether anyone still waits for a request's events. The engine asks before
/// admission and before every prefill chunk, so a request whose client has gone costs
/// nothing more (its sink is only asked when a token is ready).
pub type Liveness = Box<dyn Fn() -> bool + Send>;

/// Whose prefix cache a request may read and feed: requests of different tenants never
/// share KV, so one tenant's `cached_tokens` say nothing about another's prompts and one
/// tenant's FORGET never touches another's cache. 0 is the default tenant.
pub type Tenant = u64;

/// How a sessionless chat request may use the cached conversations of its tenant (an
/// implicit splice, `engine/implicit.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImplicitTurn {
    /// The rendered prompt's message bounds (as [`crate::SessionEdits::Messages`]).
    pub bounds: Vec<usize>,
    /// AMORTIZE: a fork of the conversation the prompt edits is spliced, when that prefills
    /// less than the prefix tree would; the conversation itself stays. FORGET: the
    /// conversation itself takes the turn in FORGET mode, so what the prompt drops of it is
    /// never served again.
    pub mode: Mode,
    /// The client's name for its conversation (a hash of `prompt_cache_key`, a
    /// `session-id` header, ...), if it gives one: the prompt then continues only a
    /// conversation cached under the same key, and one it starts carries the key. Without a
    /// key it continues only conversations that have none.
    pub conversation: Option<u64>,
}

/// A generation request.
pub struct Request {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// Most new tokens.
    pub max_tokens: usize,
    /// How to pick them.
    pub sampling: SamplingParams,
    /// Tokens that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// The session the request continues, with the edits to apply first.
    pub session: Option<SessionRequest>,
    /// Where events go.
    pub sink: EventSink,
    /// Whether the receiver is still there; `None` means always.
    pub alive: Option<Liveness>,
    /// Whose prefix cache the request uses (a session request uses its session's).
    pub tenant: Tenant,
    /// For a request without a session: continue the tenant's cached conversation that
    /// the prompt edits ([`ImplicitTurn`]); `None` serves it from the prefix tree only.
    pub implicit: Option<ImplicitTurn>,
    /// The repair of this turn's AMORTIZE edits, over its session's and the engine's
    /// ([`crate::EngineConfig::repair`]).
    pub repair: Option<leyline_core::Repair>,
}

impl Request {
    /// A greedy request for at most `max_tokens` tokens after `prompt`, without stop tokens
    /// or session.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize, sink: EventSink) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop_tokens: Vec::new(),
            session: None,
            sink,
            alive: None,
            tenant: 0,
            implicit: None,
            repair: None,
        }
    }

    /// Whether the receiver still waits for the request's events.
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.as_ref().is_none_or(|f| f())
    }

    /// The same request, continuing `session` (whose edits apply first).
    pub fn in_session(self, session: SessionRequest) -> Self {
        Self {
            session: Some(session),
            ..self
        }
    }
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("prompt_len", &self.prompt.len())
            .field("max_tokens", &self.max_tokens)
            .field("session", &self.session)
            .field("tenant", &self.tenant)
            .field("implicit", &self.implicit.is_some())
            .finish_non_exhaustive()
    }
}
