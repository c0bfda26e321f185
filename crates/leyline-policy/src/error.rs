//! The error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong in leyline-policy.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// Message boundaries are not non-decreasing or run past the token sequence.
    #[error("bad message bounds: {0}")]
    BadBounds(String),
    /// An edit batch is out of range, unsorted or overlapping.
    #[error("bad edit #{index} [{start}, {end}) on a sequence of {len} tokens: {reason}")]
    BadEdit {
        /// Position of the edit in its batch.
        index: usize,
        /// Its start.
        start: usize,
        /// Its end.
        end: usize,
        /// Length of the sequence it was applied to.
        len: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A policy configuration could not be parsed.
    #[error("bad policy config: {0}")]
    Config(String),
    /// A renderer (tokenizer + chat template) failed.
    #[error("render failed: {0}")]
    Render(String),
    /// A trace line is not a valid trajectory.
    #[error("trace line {line}: {source}")]
    Trace {
        /// 1-based line number.
        line: usize,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// Reading a trace file failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// This crate's result type.
pub type Result<T, E = PolicyError> = std::result::Result<T, E>;
