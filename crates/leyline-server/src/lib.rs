//! leyline-server: Leyline's HTTP API. OpenAI-compatible completions and chat completions
//! (JSON or SSE streaming), sessions whose cached context is edited by directives, and
//! Prometheus `/metrics`, over an engine running on its own thread.
//!
//! Design decision: handlers are thin. Wire types live in [`openai`] with conversions into
//! engine types, every failure is one [`ServerError`] that knows its HTTP status, OpenAI
//! error `type` and SSE form, and the only state shared between requests is the engine
//! handle, the session table and counters, so a handler never blocks the engine.
//!
//! ```
//! use leyline_server::ServerConfig;
//! let cfg = ServerConfig::new("smollm2-135m");
//! assert_eq!(cfg.addr.to_string(), "127.0.0.1:8000");
//! assert!(cfg.api_keys.is_empty());
//! ```
#![deny(missing_docs)]

pub mod anthropic;
pub mod auth;
pub mod context;
pub mod error;
pub mod generation;
mod guard;
mod handler;
pub mod logprobs;
mod messages;
pub mod metrics;
pub mod openai;
pub mod reasoning;
mod record;
pub mod responses;
pub mod responses_output;
mod responses_routes;
pub mod responses_store;
mod routes;
mod server;
mod session_routes;
pub mod sessions;
mod state;
mod submit;
pub mod toolcall;

pub use auth::Principal;
pub use error::{Result, ServerError};
pub use server::{serve, Server};
pub use state::{AppState, ServerConfig};
