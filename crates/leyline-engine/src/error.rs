//! The one error type of `leyline-engine`.

/// Everything that can go wrong while serving a request.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request itself is invalid (empty prompt, too long, bad parameters).
    #[error("{0}")]
    InvalidRequest(String),
    /// No session with that id.
    #[error("unknown session {0}")]
    UnknownSession(u64),
    /// The session has a request in flight.
    #[error("session {0} is busy: a request is in flight")]
    SessionBusy(u64),
    /// A directive batch is invalid.
    #[error(transparent)]
    Directive(#[from] leyline_core::CoreError),
    /// The model failed.
    #[error(transparent)]
    Model(#[from] leyline_model::ModelError),
    /// The KV layer failed.
    #[error(transparent)]
    Kv(#[from] leyline_kv::KvError),
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
