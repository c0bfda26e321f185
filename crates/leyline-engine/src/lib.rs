//! leyline-engine: the continuous-batching scheduler over the shared slot pool with prefix
//! reuse ([`Engine`], driven on its own thread through [`EngineHandle`]), sessions whose cached
//! context takes directives, sampling, single-sequence generation ([`generate`]) and the chat
//! renderer that context policies diff against.
//!
//! Design decision: the engine owns the KV storage and decides which slot holds which
//! token; models only read and write the slots they are handed. It also owns every session
//! end to end (tokens, slots, message bounds, the busy flag): a server hands it a rendered
//! prompt with its message bounds, and the engine diffs, validates and applies the edits.
#![deny(missing_docs)]

pub mod engine;
pub mod error;
pub mod generate;
pub mod handle;
pub mod metrics;
pub mod render;
pub mod request;
pub mod sampling;
pub mod session;

pub use engine::{
    Engine, EngineConfig, PrefillOrder, StepReport, DEFAULT_DECODE_PREFILL_CHUNK, DEFAULT_KV_DTYPE,
    DEFAULT_MAX_IMPLICIT_SESSIONS, DEFAULT_MAX_SEGMENTS, DEFAULT_MAX_WAITING,
    DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_PATIENCE, DEFAULT_REUSE_MIN_TOKENS,
    REPAIR_DEVIATION_LAYER,
};
pub use error::{EngineError, ErrorKind, Failure, Result};
pub use generate::{
    generate, generate_after, reusable_prefix, GenerateParams, GenerateStats, StopReason,
};
pub use handle::{EngineHandle, EngineThread};
pub use metrics::{Metrics, MetricsSnapshot};
pub use render::{render_pieces, render_prompt, to_chat_message, ChatRenderer, MemoRenderer};
pub use request::{
    Event, EventSink, FinishReason, ImplicitTurn, Liveness, Request, RequestId, Tenant, Usage,
};
pub use sampling::{argmax, logprobs, Sampler, SamplingParams, TokenLogprobs};
pub use session::{
    message_edits, EditReport, SessionEdits, SessionId, SessionInfo, SessionRequest,
};
