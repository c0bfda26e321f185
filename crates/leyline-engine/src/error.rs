//! The one error type of `leyline-engine`, and the kinds its errors fall into when they
//! cross the engine thread to a server.

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
    /// The session's cache was dropped for room: its tokens are gone until its next turn
    /// resends the history.
    #[error("session {0} lost its cached context to make room; resend its history in a turn")]
    SessionShed(u64),
    /// The KV pool cannot hold what the request needs, even after evicting unlocked
    /// prefixes and shedding idle sessions' KV.
    #[error("{0}")]
    OutOfKv(String),
    /// The queue of waiting requests is full.
    #[error("{0}")]
    Overloaded(String),
    /// The engine thread has stopped.
    #[error("the engine has stopped")]
    Stopped,
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

/// What kind of failure an [`EngineError`] is: what a server needs to answer it (a status
/// code per kind), without the error itself crossing threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request or directive batch is invalid (HTTP 400).
    Invalid,
    /// No such session (404).
    UnknownSession,
    /// The session has a request in flight (409).
    Busy,
    /// The session's cache was dropped for room; its history must be resent (409).
    Shed,
    /// The KV pool is full (503, retry later).
    OutOfKv,
    /// Too many requests are waiting (503, retry later).
    Overloaded,
    /// The engine has stopped (503).
    Stopped,
    /// An internal failure of the model or the KV layer (500).
    Internal,
}

impl EngineError {
    /// The kind of this error.
    pub fn kind(&self) -> ErrorKind {
        use leyline_kv::KvError;
        match self {
            EngineError::InvalidRequest(_) | EngineError::Directive(_) => ErrorKind::Invalid,
            EngineError::UnknownSession(_) => ErrorKind::UnknownSession,
            EngineError::SessionBusy(_) => ErrorKind::Busy,
            EngineError::SessionShed(_) => ErrorKind::Shed,
            EngineError::OutOfKv(_)
            | EngineError::Kv(KvError::PoolExhausted { .. } | KvError::CowExhausted { .. }) => {
                ErrorKind::OutOfKv
            }
            // AMORTIZE on a model whose rope cannot shift: the caller asked for what the
            // model cannot do (FORGET can).
            EngineError::Kv(KvError::NotShiftable(_)) => ErrorKind::Invalid,
            EngineError::Overloaded(_) => ErrorKind::Overloaded,
            EngineError::Stopped => ErrorKind::Stopped,
            EngineError::Model(_) | EngineError::Kv(_) => ErrorKind::Internal,
        }
    }

    /// The error as it crosses the engine thread: its kind and its message.
    pub fn failure(&self) -> Failure {
        Failure {
            kind: self.kind(),
            message: self.to_string(),
        }
    }
}

/// An engine error as a request's receiver gets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What happened, for a human.
    pub message: String,
}

impl Failure {
    /// A failure of `kind` saying `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        e.failure()
    }
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
