//! The one error type of `leyline-model`.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A model file could not be read or parsed.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The file is well-formed but describes something Leyline cannot run.
    #[error("{path}: unsupported model: {reason}")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Why it is not supported.
        reason: String,
    },
    /// The model was loaded without a tokenizer (a checkpoint directory) but the caller
    /// needs one.
    #[error("{path} has no tokenizer; this command needs one")]
    NoTokenizer {
        /// Where the model was loaded from.
        path: PathBuf,
    },
    /// Tokenizer construction or use failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Chat template parse or render failure.
    #[error("chat template: {0}")]
    Template(String),
    /// Invalid input to a forward pass.
    #[error("{0}")]
    Input(String),
    /// A tensor operation failed.
    #[error("tensor op: {0}")]
    Candle(#[from] candle_core::Error),
    /// The KV layer refused an operation.
    #[error(transparent)]
    Kv(#[from] leyline_kv::KvError),
    /// A kernel refused its input (quantized bytes that do not form the claimed matrix, a
    /// RoPE spec that describes no rotation).
    #[error(transparent)]
    Kernel(#[from] leyline_kernels::KernelError),
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
