//! leyline-engine: sequences, sampling and generation over the slot pool; later the
//! continuous-batching scheduler, sessions, policies and directives.
//!
//! Design decision: the engine owns the KV storage and decides which slot holds which
//! token; models only read and write the slots they are handed.
#![deny(missing_docs)]

pub mod error;
pub mod generate;
pub mod sampling;

pub use error::{EngineError, Result};
pub use generate::{generate, GenerateParams, GenerateStats, StopReason};
pub use sampling::{argmax, Sampler, SamplingParams};
