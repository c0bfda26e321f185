//! Leyline's core vocabulary: token directives, their validation and their span algebra.
//!
//! A [`Directive`] replaces the tokens `[start, end)` of a session's cached sequence by a
//! replacement. A [`DirectiveBatch`] is a set of directives given against the *pre-edit*
//! indices, validated as a whole, sorted by start and applied atomically.
//!
//! Design decision: every directive of a batch is expressed in the indices of the sequence
//! *before* the edit, never in the indices left by an earlier directive of the same batch.
//! The batch is then order-free for its author, and the effect of all directives is
//! described by one list of kept [`Segment`]s, each moved by the running sum of the deltas
//! before it. This crate holds no tensors and does no I/O.
//!
//! ```
//! use leyline_core::{Directive, DirectiveBatch, Mode, SessionState, ValidationContext};
//!
//! let ctx = ValidationContext { seq_len: 6, vocab_size: 100, session: SessionState::Idle };
//! let batch = DirectiveBatch::validate(
//!     vec![
//!         Directive::new(4, 5, vec![], Mode::Amortize),
//!         Directive::new(1, 3, vec![42], Mode::Amortize),
//!     ],
//!     &ctx,
//! )
//! .unwrap();
//! let tokens = batch.apply_to_tokens(&[10, 11, 12, 13, 14, 15]).unwrap();
//! assert_eq!(tokens, vec![10, 42, 13, 15]);
//! assert_eq!(batch.total_delta(), -2);
//! ```
#![deny(missing_docs)]

mod batch;
mod error;
mod repair;

pub use batch::{ranges_without, DirectiveBatch, Reuse, Segment, SessionState, ValidationContext};
pub use error::{CoreError, Result};
pub use repair::{Repair, RepairRule};

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A token id of the model's vocabulary.
pub type TokenId = u32;

/// A rotary position (the position a key is encoded at).
pub type Pos = u32;

/// How a directive is applied to the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Splice in place: keep the prefix, prefill the replacement, rotate downstream keys by
    /// `R(delta)`. Downstream values keep what they learned from the old span (by design).
    Amortize,
    /// Trim to `[0, start)` and prefill the replacement and everything after it again.
    Forget,
}

impl Mode {
    /// The mode's name on the wire and in metrics: `amortize` or `forget`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Amortize => "amortize",
            Mode::Forget => "forget",
        }
    }

    /// The mode [`Mode::name`] gives this name, if any (exact).
    pub fn from_name(name: &str) -> Option<Self> {
        [Mode::Amortize, Mode::Forget]
            .into_iter()
            .find(|m| m.name() == name)
    }
}

/// Replace tokens `[start, end)` of the current sequence by `replacement`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Directive {
    /// First replaced index (pre-edit).
    pub start: usize,
    /// One past the last replaced index (pre-edit); `start == end` inserts.
    pub end: usize,
    /// Tokens that take the place of `[start, end)`; empty deletes.
    pub replacement: Vec<TokenId>,
    /// How the directive is applied.
    pub mode: Mode,
}

impl Directive {
    /// A directive; nothing is checked until it is validated in a [`DirectiveBatch`].
    pub fn new(start: usize, end: usize, replacement: Vec<TokenId>, mode: Mode) -> Self {
        Self {
            start,
            end,
            replacement,
            mode,
        }
    }

    /// How far every token after the span moves: `|replacement| - (end - start)`.
    ///
    /// Meaningful for a directive with `start <= end` (a validated one).
    pub fn delta(&self) -> i64 {
        self.replacement.len() as i64 - (self.end as i64 - self.start as i64)
    }

    /// The replaced pre-edit range `start..end`.
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }
}
