//! [`PolicyStats`]: what a policy's edits cost, summed over turns (for `leyline bench policy`).

use crate::diff::Edit;
use serde::{Deserialize, Serialize};

/// Sums over the turns of one policy (on one source, or any grouping the caller picks). An
/// edit at `start == old_len` is the turn's append (new messages), counted apart from edits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyStats {
    /// Turns recorded.
    pub turns: u64,
    /// Turns with at least one edit of cached tokens.
    pub turns_with_edit: u64,
    /// Edits of cached tokens (directives, appends not counted).
    pub edits: u64,
    /// Cached tokens those edits removed.
    pub tokens_removed: u64,
    /// Tokens those edits wrote in their place.
    pub tokens_inserted: u64,
    /// Sum over edits of `|delta|`.
    pub abs_delta: u64,
    /// Tokens appended after the cached sequence.
    pub tokens_appended: u64,
    /// Tokens of all new prompts.
    pub prompt_tokens: u64,
    /// Tokens a prefix cache must prefill: each prompt's tokens from its first edit on.
    pub prefix_cache_prefill: u64,
}

impl PolicyStats {
    /// Records one turn: the cached sequence had `old_len` tokens, the prompt has `new_len`,
    /// and `edits` (sorted, as [`crate::diff()`] returns them) turn one into the other.
    pub fn record(&mut self, old_len: usize, new_len: usize, edits: &[Edit]) {
        self.turns += 1;
        self.prompt_tokens += new_len as u64;
        self.prefix_cache_prefill +=
            edits.first().map_or(0, |e| new_len.saturating_sub(e.start)) as u64;
        let mut edited = false;
        for e in edits {
            if e.start >= old_len {
                self.tokens_appended += e.replacement.len() as u64;
                continue;
            }
            edited = true;
            self.edits += 1;
            self.tokens_removed += e.removed() as u64;
            self.tokens_inserted += e.replacement.len() as u64;
            self.abs_delta += e.delta().unsigned_abs() as u64;
        }
        self.turns_with_edit += u64::from(edited);
    }

    /// Adds another set of sums to this one.
    pub fn merge(&mut self, o: &PolicyStats) {
        self.turns += o.turns;
        self.turns_with_edit += o.turns_with_edit;
        self.edits += o.edits;
        self.tokens_removed += o.tokens_removed;
        self.tokens_inserted += o.tokens_inserted;
        self.abs_delta += o.abs_delta;
        self.tokens_appended += o.tokens_appended;
        self.prompt_tokens += o.prompt_tokens;
        self.prefix_cache_prefill += o.prefix_cache_prefill;
    }

    fn per(x: u64, n: u64) -> f64 {
        if n == 0 {
            0.0
        } else {
            x as f64 / n as f64
        }
    }

    /// Edits per turn.
    pub fn edits_per_turn(&self) -> f64 {
        Self::per(self.edits, self.turns)
    }

    /// Net cached tokens removed per turn (removed minus inserted).
    pub fn tokens_removed_per_turn(&self) -> f64 {
        (self.tokens_removed as f64 - self.tokens_inserted as f64) / self.turns.max(1) as f64
    }

    /// Mean `|delta|` of an edit (how far the tokens after it move).
    pub fn mean_abs_delta(&self) -> f64 {
        Self::per(self.abs_delta, self.edits)
    }

    /// Share of turns with at least one edit.
    pub fn edit_share(&self) -> f64 {
        Self::per(self.turns_with_edit, self.turns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_edits_apart_from_appends() {
        let mut s = PolicyStats::default();
        // Turn 1: 100 cached, one edit 10..60 -> 5 tokens, then 20 appended.
        s.record(
            100,
            75,
            &[
                Edit {
                    start: 10,
                    end: 60,
                    replacement: vec![0; 5],
                },
                Edit {
                    start: 100,
                    end: 100,
                    replacement: vec![0; 20],
                },
            ],
        );
        // Turn 2: append only.
        s.record(
            75,
            80,
            &[Edit {
                start: 75,
                end: 75,
                replacement: vec![0; 5],
            }],
        );
        assert_eq!((s.turns, s.turns_with_edit, s.edits), (2, 1, 1));
        assert_eq!(
            (s.tokens_removed, s.tokens_inserted, s.tokens_appended),
            (50, 5, 25)
        );
        assert_eq!(s.prefix_cache_prefill, (75 - 10) + (80 - 75));
        assert_eq!(s.edits_per_turn(), 0.5);
        assert_eq!(s.tokens_removed_per_turn(), 22.5);
        assert_eq!(s.mean_abs_delta(), 45.0);
        assert_eq!(s.edit_share(), 0.5);
        let mut t = s.clone();
        t.merge(&s);
        assert_eq!(t.turns, 4);
        assert_eq!(t.mean_abs_delta(), 45.0);
    }
}
