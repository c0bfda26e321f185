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
    /// The file holds metadata keys of its architecture or tensors that no part of the
    /// architecture reads: refused rather than silently ignored.
    #[error("{path}: {what} {} read by no part of the {arch} architecture; refusing to ignore {}", list(names), if names.len() == 1 { "it" } else { "them" })]
    Unread {
        /// The file or checkpoint directory.
        path: PathBuf,
        /// The architecture it was loaded as.
        arch: String,
        /// `"tensor"` or `"metadata key"`.
        what: &'static str,
        /// What nobody reads, sorted.
        names: Vec<String>,
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

/// Names for a message: the first eight, then how many more.
fn list(names: &[String]) -> String {
    let mut s = names
        .iter()
        .take(8)
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 8 {
        s.push_str(&format!(" and {} more", names.len() - 8));
    }
    s + if names.len() == 1 { " is" } else { " are" }
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
