//! The one error type of `leyline-kernels`.

use crate::Tier;

/// What a kernel refuses before it touches any data.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KernelError {
    /// A RoPE spec that cannot describe a rotation (odd or oversized rotary dim, bad theta...),
    /// or a rotation built for another head width.
    #[error("invalid RoPE spec: {0}")]
    InvalidRope(String),
    /// The RoPE cannot be shifted by a relative rotation (its frequencies depend on the
    /// sequence length).
    #[error("keys of this model cannot be shifted in place: {0}")]
    NotShiftable(String),
    /// A buffer or row of the wrong width.
    #[error("{what}: expected {expected} values, got {got}")]
    WidthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// A row index past the end of a row buffer.
    #[error("row {row} is out of range for a buffer of {rows} rows")]
    RowOutOfRange {
        /// The offending row.
        row: u32,
        /// Rows in the buffer.
        rows: usize,
    },
    /// Quantized weight bytes that do not form the matrix claimed (shape or length).
    #[error("{0}")]
    Quantized(String),
    /// A kernel tier was asked for that this CPU does not run.
    #[error("kernel tier {0} is not available on this CPU")]
    TierUnavailable(Tier),
    /// A tier name that is none of the tiers'.
    #[error("unknown kernel tier {0:?} (expected portable, avx2, avx512, avx512vnni or amx)")]
    UnknownTier(String),
}

/// Result alias of this crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;
