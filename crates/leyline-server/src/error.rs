//! The one error type of `leyline-server`, and how each error reaches a client: an HTTP
//! status, a stable OpenAI `type`, and (mid-stream) an SSE `data: {"error": ...}` event.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The request is malformed or asks for something impossible (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for a human.
        message: String,
        /// The offending field, if one.
        param: Option<String>,
        /// A stable machine-readable code, if one.
        code: Option<&'static str>,
    },
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// Unknown model, session or route (404). A session of another key is also "unknown".
    #[error("{message}")]
    NotFound {
        /// What was not found.
        message: String,
        /// A stable machine-readable code.
        code: &'static str,
    },
    /// The request names a host or origin this server does not answer for (403).
    #[error("{0}")]
    Forbidden(String),
    /// The client was too slow sending the request (408).
    #[error("{0}")]
    RequestTimeout(String),
    /// The session has a request in flight (409).
    #[error("{0}")]
    Busy(String),
    /// The session's cache was dropped for room; resend its history (409).
    #[error("{0}")]
    Shed(String),
    /// The body is not `application/json` (415).
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The body exceeds the configured limit (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// Too many requests in flight (429).
    #[error("{0}")]
    Overloaded(String),
    /// The feature exists in the API but not in this build (501).
    #[error("{0}")]
    NotImplemented(String),
    /// The server is shutting down (503).
    #[error("{0}")]
    ShuttingDown(String),
    /// The server cannot take this now: the KV pool is full or the engine has stopped
    /// (503, with `Retry-After`).
    #[error("{message}")]
    Unavailable {
        /// What is short.
        message: String,
        /// A stable machine-readable code.
        code: &'static str,
    },
    /// The engine failed the request (500).
    #[error("{0}")]
    Engine(String),
    /// The server could not start (bind, runtime, engine thread); never an HTTP answer.
    #[error("{0}")]
    Startup(String),
}

/// Result alias of this crate.
pub type Result<T, E = ServerError> = std::result::Result<T, E>;

impl ServerError {
    /// A 400 naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// A 400 about the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::NotFound { .. } => StatusCode::NOT_FOUND,
            Self::Forbidden(_) => StatusCode::FORBIDDEN,
            Self::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::Busy(_) | Self::Shed(_) => StatusCode::CONFLICT,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Overloaded(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::ShuttingDown(_) | Self::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Engine(_) | Self::Startup(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable OpenAI error `type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::InvalidRequest { .. }
            | Self::NotFound { .. }
            | Self::PayloadTooLarge(_)
            | Self::UnsupportedMediaType(_)
            | Self::RequestTimeout(_) => "invalid_request_error",
            Self::Unauthorized(_) => "authentication_error",
            Self::Forbidden(_) => "permission_error",
            Self::Busy(_) | Self::Shed(_) => "conflict_error",
            Self::Overloaded(_) => "rate_limit_error",
            Self::NotImplemented(_) => "not_implemented_error",
            Self::ShuttingDown(_)
            | Self::Unavailable { .. }
            | Self::Engine(_)
            | Self::Startup(_) => "server_error",
        }
    }

    fn code(&self) -> Option<&'static str> {
        match self {
            Self::InvalidRequest { code, .. } => *code,
            Self::Unauthorized(_) => Some("invalid_api_key"),
            Self::NotFound { code, .. } => Some(code),
            Self::Forbidden(_) => Some("forbidden_host"),
            Self::RequestTimeout(_) => Some("body_timeout"),
            Self::Busy(_) => Some("session_busy"),
            Self::Shed(_) => Some("session_shed"),
            Self::PayloadTooLarge(_) => Some("body_too_large"),
            Self::UnsupportedMediaType(_) => Some("unsupported_media_type"),
            Self::Overloaded(_) => Some("overloaded"),
            Self::NotImplemented(_) => Some("not_implemented"),
            Self::ShuttingDown(_) => Some("shutting_down"),
            Self::Unavailable { code, .. } => Some(code),
            Self::Engine(_) | Self::Startup(_) => Some("engine_error"),
        }
    }

    fn param(&self) -> Option<&str> {
        match self {
            Self::InvalidRequest { param, .. } => param.as_deref(),
            _ => None,
        }
    }

    /// The `{"error": {message, type, param, code}}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.error_type(),
            "param": self.param(),
            "code": self.code(),
        }})
    }

    /// The SSE event that ends a stream that fails after its headers were sent.
    pub fn sse_event(&self) -> axum::response::sse::Event {
        axum::response::sse::Event::default().data(self.body().to_string())
    }
}

impl IntoResponse for ServerError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::warn!(error_type = self.error_type(), "{self}");
        }
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if matches!(self, Self::Unavailable { .. } | Self::Overloaded(_)) {
            resp.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        if matches!(self, Self::Unauthorized(_)) {
            resp.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Bearer"),
            );
        }
        resp
    }
}

impl From<leyline_model::ModelError> for ServerError {
    /// Tokenizer and template errors come from the request's content.
    fn from(e: leyline_model::ModelError) -> Self {
        Self::bad_request(e.to_string())
    }
}

impl From<leyline_engine::EngineError> for ServerError {
    fn from(e: leyline_engine::EngineError) -> Self {
        match e {
            leyline_engine::EngineError::Directive(d) => Self::invalid("directives", d.to_string()),
            e => e.failure().into(),
        }
    }
}

impl From<leyline_engine::Failure> for ServerError {
    /// Each kind of engine failure has its status: 400, 404, 409, 503 or 500.
    fn from(f: leyline_engine::Failure) -> Self {
        use leyline_engine::ErrorKind as K;
        match f.kind {
            K::Invalid => Self::bad_request(f.message),
            K::UnknownSession => Self::NotFound {
                message: f.message,
                code: "session_unknown",
            },
            K::Busy => Self::Busy(f.message),
            K::Shed => Self::Shed(f.message),
            K::OutOfKv => Self::Unavailable {
                message: f.message,
                code: "kv_pool_exhausted",
            },
            K::Overloaded => Self::Unavailable {
                message: f.message,
                code: "queue_full",
            },
            K::Stopped => Self::Unavailable {
                message: f.message,
                code: "engine_stopped",
            },
            K::Internal => Self::Engine(f.message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ServerError::invalid("max_tokens", "max_tokens must be at least 1, got -3");
        let b = e.body();
        assert_eq!(b["error"]["param"], "max_tokens");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert!(b["error"]["message"].as_str().unwrap().contains("-3"));
        assert!(b["error"]["code"].is_null());
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn statuses_are_distinct_per_kind() {
        let all = [
            ServerError::bad_request("x"),
            ServerError::Unauthorized("x".into()),
            ServerError::NotFound {
                message: "x".into(),
                code: "model_not_found",
            },
            ServerError::Forbidden("x".into()),
            ServerError::RequestTimeout("x".into()),
            ServerError::Busy("x".into()),
            ServerError::PayloadTooLarge("x".into()),
            ServerError::UnsupportedMediaType("x".into()),
            ServerError::Overloaded("x".into()),
            ServerError::NotImplemented("x".into()),
            ServerError::ShuttingDown("x".into()),
            ServerError::Engine("x".into()),
        ];
        let codes: Vec<u16> = all.iter().map(|e| e.status().as_u16()).collect();
        assert_eq!(
            codes,
            [400, 401, 404, 403, 408, 409, 413, 415, 429, 501, 503, 500]
        );
    }

    #[test]
    fn every_engine_failure_kind_has_its_status() {
        use leyline_engine::{ErrorKind as K, Failure};
        let cases = [
            (K::Invalid, 400),
            (K::UnknownSession, 404),
            (K::Busy, 409),
            (K::Shed, 409),
            (K::OutOfKv, 503),
            (K::Overloaded, 503),
            (K::Stopped, 503),
            (K::Internal, 500),
        ];
        for (kind, status) in cases {
            let e = ServerError::from(Failure::new(kind, "x"));
            assert_eq!(e.status().as_u16(), status, "{kind:?}");
        }
        for kind in [K::OutOfKv, K::Overloaded] {
            let out = ServerError::from(Failure::new(kind, "full")).into_response();
            assert_eq!(out.headers()["retry-after"], "1", "{kind:?}");
        }
    }
}
