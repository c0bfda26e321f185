//! The one error type of `leyline-core`.

use crate::Mode;

/// Why a directive batch was refused. Indices name directives in the order the caller gave
/// them (before sorting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    /// `start > end`.
    #[error("directive {index}: range [{start}, {end}) has start > end")]
    StartAfterEnd {
        /// Directive index in the caller's order.
        index: usize,
        /// Its start.
        start: usize,
        /// Its end.
        end: usize,
    },
    /// The range reaches past the sequence.
    #[error(
        "directive {index}: range [{start}, {end}) is out of range for a sequence of {len} tokens"
    )]
    OutOfRange {
        /// Directive index in the caller's order.
        index: usize,
        /// Its start.
        start: usize,
        /// Its end.
        end: usize,
        /// Sequence length.
        len: usize,
    },
    /// An empty range with an empty replacement: does nothing, most likely a caller bug.
    #[error("directive {index}: empty range at {at} with an empty replacement does nothing")]
    EmptyOp {
        /// Directive index in the caller's order.
        index: usize,
        /// Its start (= end).
        at: usize,
    },
    /// Two directives overlap or start at the same index (their order would be ambiguous).
    #[error(
        "directive {index}: range [{start}, {end}) overlaps directive {other} [{other_start}, {other_end})"
    )]
    Overlap {
        /// Directive index in the caller's order.
        index: usize,
        /// Its start.
        start: usize,
        /// Its end.
        end: usize,
        /// The directive it collides with.
        other: usize,
        /// That directive's start.
        other_start: usize,
        /// That directive's end.
        other_end: usize,
    },
    /// A replacement token id outside the vocabulary.
    #[error("directive {index}: replacement token {offset} has id {token}, outside a vocabulary of {vocab_size}")]
    TokenOutOfVocab {
        /// Directive index in the caller's order.
        index: usize,
        /// Offset of the token inside the replacement.
        offset: usize,
        /// The token id.
        token: u32,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// A batch mixes AMORTIZE and FORGET.
    #[error("directive {index}: mode {found:?} differs from the batch's mode {expected:?} (one mode per batch)")]
    MixedModes {
        /// Directive index in the caller's order.
        index: usize,
        /// The mode of directive 0.
        expected: Mode,
        /// This directive's mode.
        found: Mode,
    },
    /// The edited sequence would be longer than positions can express.
    #[error("the edited sequence would hold {len} tokens, more than positions (u32) can address")]
    TooLong {
        /// The new length.
        len: u128,
    },
    /// The session is busy (a request is in flight); directives apply to idle sessions only.
    #[error("the session is busy; directives apply to an idle session only")]
    SessionBusy,
    /// A token vector handed to a batch is not the sequence it was validated against.
    #[error("the batch was validated for {expected} tokens, got {got}")]
    LengthMismatch {
        /// Length at validation.
        expected: usize,
        /// Length given.
        got: usize,
    },
}

/// Result alias of this crate.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;
