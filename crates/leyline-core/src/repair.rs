//! Repair: which downstream tokens an AMORTIZE splice recomputes under the edited context.
//!
//! A splice keeps every downstream token's KV and only corrects its rotary position, so what
//! those tokens computed while attending to the old span stays in their keys and values.
//! Recomputing some of them under the edited context trades prefill work for fidelity:
//! nothing at `tokens: 0`, FORGET's result when every downstream token is covered.
//!
//! ```
//! use leyline_core::{Directive, DirectiveBatch, Mode, Repair, RepairRule, SessionState,
//!     ValidationContext};
//!
//! let ctx = ValidationContext { seq_len: 10, vocab_size: 100, session: SessionState::Idle };
//! // Replace [2, 5) by one token: the downstream tokens land at 3..8.
//! let batch = DirectiveBatch::validate(vec![Directive::new(2, 5, vec![7], Mode::Amortize)], &ctx)
//!     .unwrap();
//! assert_eq!(Repair::new(2, RepairRule::AfterEdit).ranges(&batch), vec![3..5]);
//! assert_eq!(Repair::new(2, RepairRule::BeforeEnd).ranges(&batch), vec![6..8]);
//! assert_eq!(Repair::new(100, RepairRule::AfterEdit).ranges(&batch), vec![3..8]);
//! assert_eq!(Repair::downstream(&batch), 5);
//! ```

use crate::batch::DirectiveBatch;
use crate::TokenId;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// Which downstream tokens a repair recomputes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RepairRule {
    /// The first tokens after each replacement (as EPIC recomputes the start of each reused
    /// chunk). Recomputed in order after an exact prefix, so the first edit's window is exact.
    #[default]
    AfterEdit,
    /// The last tokens of the context, the ones nearest to what is asked next.
    BeforeEnd,
    /// The tokens whose KV changes most when recomputed (as CacheBlend selects them): a
    /// selection pass runs every downstream token through the first layer under the edited
    /// context and ranks them by how far their second layer's keys and values move.
    Deviation,
}

impl RepairRule {
    /// The rule's name on the wire and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::AfterEdit => "after_edit",
            Self::BeforeEnd => "before_end",
            Self::Deviation => "deviation",
        }
    }
}

/// How many downstream tokens an AMORTIZE splice recomputes, and which ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Repair {
    /// Tokens per window (per edit for [`RepairRule::AfterEdit`]); 0 is the plain splice.
    pub tokens: usize,
    /// Which tokens.
    #[serde(default)]
    pub rule: RepairRule,
}

impl Repair {
    /// No repair: the splice alone.
    pub const NONE: Self = Self {
        tokens: 0,
        rule: RepairRule::AfterEdit,
    };

    /// A repair of `tokens` tokens by `rule`.
    pub fn new(tokens: usize, rule: RepairRule) -> Self {
        Self { tokens, rule }
    }

    /// Whether the repair recomputes nothing.
    pub fn is_none(&self) -> bool {
        self.tokens == 0
    }

    /// Post-edit ranges a positional rule recomputes after `batch` is spliced: sorted,
    /// disjoint, all after the first replacement. A window that reaches a later replacement
    /// takes it in too: that replacement was computed while attending to the unrepaired
    /// tokens before it. Empty for an empty batch, [`Repair::NONE`] and
    /// [`RepairRule::Deviation`], whose tokens a selection pass over
    /// [`Repair::scan_range`] picks.
    pub fn ranges(&self, batch: &DirectiveBatch) -> Vec<Range<usize>> {
        let replaced = batch.new_ranges();
        let (Some(first), false) = (replaced.first(), self.is_none()) else {
            return Vec::new();
        };
        let len = batch.new_len();
        let windows: Vec<Range<usize>> = match self.rule {
            RepairRule::AfterEdit => replaced
                .iter()
                .map(|r| r.end..r.end.saturating_add(self.tokens).min(len))
                .collect(),
            RepairRule::BeforeEnd => {
                std::iter::once(len.saturating_sub(self.tokens).max(first.end)..len).collect()
            }
            RepairRule::Deviation => return Vec::new(),
        };
        let mut out: Vec<Range<usize>> = Vec::new();
        for w in windows.into_iter().filter(|w| !w.is_empty()) {
            match out.last_mut() {
                Some(last) if w.start <= last.end => last.end = last.end.max(w.end),
                _ => out.push(w),
            }
            if let Some(last) = out.last_mut() {
                for r in &replaced {
                    if r.start < last.end && r.end > last.end {
                        last.end = r.end;
                    }
                }
            }
        }
        out
    }

    /// `batch` as the splice should apply it under this repair: for
    /// [`RepairRule::AfterEdit`], a directive that the window after the one before it would
    /// reach is merged into that one ([`DirectiveBatch::merge_close`]), since
    /// [`Repair::ranges`] would recompute its replacement a second time anyway, after the
    /// tokens between. Merged, the splice computes those tokens and the replacement once, in
    /// order, under the context the repair would have given them. Other rules and
    /// [`Repair::NONE`] leave the batch as it is. `tokens` is the pre-edit sequence.
    ///
    /// # Errors
    /// As [`DirectiveBatch::merge_close`].
    pub fn coalesce(
        &self,
        batch: DirectiveBatch,
        tokens: &[TokenId],
    ) -> crate::error::Result<DirectiveBatch> {
        match self.rule {
            RepairRule::AfterEdit if !self.is_none() => batch.merge_close(self.tokens, tokens),
            _ => Ok(batch),
        }
    }

    /// The post-edit range the deviation rule's selection pass scans (every token after the
    /// first replacement); `None` for the positional rules, an empty batch, [`Repair::NONE`]
    /// or nothing after the edit.
    pub fn scan_range(&self, batch: &DirectiveBatch) -> Option<Range<usize>> {
        let first = batch.new_ranges().first()?.end;
        (self.rule == RepairRule::Deviation && !self.is_none() && first < batch.new_len())
            .then(|| first..batch.new_len())
    }

    /// Downstream tokens of `batch`: kept tokens after its first replacement, whose KV the
    /// splice keeps (FORGET recomputes them; the replacements excluded).
    pub fn downstream(batch: &DirectiveBatch) -> usize {
        let replaced = batch.new_ranges();
        let Some(first) = replaced.first() else {
            return 0;
        };
        let later: usize = replaced[1..].iter().map(|r| r.len()).sum();
        batch.new_len() - first.end - later
    }
}

impl fmt::Display for Repair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            return f.write_str("0");
        }
        write!(f, "{}:{}", self.rule.name(), self.tokens)
    }
}

impl FromStr for Repair {
    type Err = String;

    /// `0` (none), `N` (the first N tokens after each edit), `after_edit:N`, `before_end:N`
    /// or `deviation:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (rule, n) = match s.split_once(':') {
            None => (RepairRule::AfterEdit, s),
            Some(("after_edit", n)) => (RepairRule::AfterEdit, n),
            Some(("before_end", n)) => (RepairRule::BeforeEnd, n),
            Some(("deviation", n)) => (RepairRule::Deviation, n),
            Some((r, _)) => {
                return Err(format!(
                    "unknown repair rule '{r}' (expected after_edit, before_end or deviation)"
                ))
            }
        };
        let tokens = n
            .trim()
            .parse()
            .map_err(|_| format!("repair '{s}': '{n}' is not a token count"))?;
        Ok(Self { tokens, rule })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Directive, Mode, SessionState, ValidationContext};

    fn batch(len: usize, ds: &[(usize, usize, usize)]) -> DirectiveBatch {
        let ctx = ValidationContext {
            seq_len: len,
            vocab_size: 100,
            session: SessionState::Idle,
        };
        let ds = ds
            .iter()
            .map(|&(s, e, r)| Directive::new(s, e, vec![1; r], Mode::Amortize))
            .collect();
        DirectiveBatch::validate(ds, &ctx).unwrap()
    }

    /// Every post-edit index after the first replacement, by brute force.
    fn after_first(b: &DirectiveBatch) -> Vec<usize> {
        let first = b.new_ranges()[0].end;
        (first..b.new_len()).collect()
    }

    #[test]
    fn a_window_as_long_as_the_context_covers_everything_after_the_first_edit() {
        let b = batch(40, &[(3, 6, 2), (10, 10, 4), (20, 30, 0)]);
        for rule in [RepairRule::AfterEdit, RepairRule::BeforeEnd] {
            let r = Repair::new(1000, rule).ranges(&b);
            let covered: Vec<usize> = r.iter().flat_map(|r| r.clone()).collect();
            assert_eq!(covered, after_first(&b), "{rule:?}");
            assert_eq!(Repair::new(1000, rule).scan_range(&b), None, "{rule:?}");
        }
        // The deviation rule scans the same tokens and names none until it has scanned.
        let d = Repair::new(4, RepairRule::Deviation);
        let scan: Vec<usize> = d.scan_range(&b).unwrap().collect();
        assert_eq!(scan, after_first(&b));
        assert!(d.ranges(&b).is_empty());
        assert_eq!(Repair::new(0, RepairRule::Deviation).scan_range(&b), None);
    }

    #[test]
    fn after_edit_takes_k_tokens_after_each_replacement_and_merges_overlaps() {
        // Replacements land at 3..5, 9..13 and (empty) 23..23; 30 tokens after the edit.
        let b = batch(40, &[(3, 6, 2), (10, 10, 4), (20, 30, 0)]);
        assert_eq!(b.new_ranges(), vec![3..5, 9..13, 23..23]);
        assert_eq!(
            Repair::new(2, RepairRule::AfterEdit).ranges(&b),
            vec![5..7, 13..15, 23..25]
        );
        // A window reaching the next replacement runs on through it.
        assert_eq!(
            Repair::new(5, RepairRule::AfterEdit).ranges(&b),
            vec![5..18, 23..28]
        );
        assert_eq!(Repair::downstream(&b), b.new_len() - 5 - 4);
    }

    /// Post-edit indices the splice (replacements) and the repair compute, with repeats.
    fn computed(b: &DirectiveBatch, r: Repair) -> Vec<usize> {
        let mut all: Vec<usize> = b.new_ranges().into_iter().flatten().collect();
        all.extend(r.ranges(b).into_iter().flatten());
        all.sort_unstable();
        all
    }

    #[test]
    fn coalesce_computes_the_same_tokens_once_each() {
        let tokens: Vec<TokenId> = (0..40).collect();
        let b = batch(40, &[(3, 6, 2), (10, 10, 4), (20, 30, 0)]);
        let r = Repair::new(5, RepairRule::AfterEdit);
        // Unmerged, the first window runs through the second replacement: 9..13 twice.
        let before = computed(&b, r);
        let mut once = before.clone();
        once.dedup();
        assert_eq!(before.len(), once.len() + 4);
        // The second directive starts 4 < 5 tokens after the first: merged, with the kept
        // tokens 6..10 between them; the third starts 10 after and stays apart.
        let c = r.coalesce(b.clone(), &tokens).unwrap();
        let mut merged = vec![1, 1, 6, 7, 8, 9];
        merged.extend([1; 4]);
        assert_eq!(
            c.directives(),
            &[
                Directive::new(3, 10, merged, Mode::Amortize),
                Directive::new(20, 30, vec![], Mode::Amortize)
            ]
        );
        assert_eq!(
            c.apply_to_tokens(&tokens).unwrap(),
            b.apply_to_tokens(&tokens).unwrap()
        );
        assert_eq!(computed(&c, r), once);
        // Other rules, no repair, or a window shorter than every gap: unchanged.
        for r in [
            Repair::NONE,
            Repair::new(5, RepairRule::BeforeEnd),
            Repair::new(5, RepairRule::Deviation),
            Repair::new(4, RepairRule::AfterEdit),
        ] {
            assert_eq!(r.coalesce(b.clone(), &tokens).unwrap(), b, "{r:?}");
        }
        assert!(r.coalesce(b, &tokens[1..]).is_err());
    }

    #[test]
    fn before_end_stops_at_the_first_replacement_and_none_is_empty() {
        let b = batch(10, &[(2, 5, 1)]);
        assert_eq!(Repair::new(3, RepairRule::BeforeEnd).ranges(&b), vec![5..8]);
        assert_eq!(
            Repair::new(50, RepairRule::BeforeEnd).ranges(&b),
            vec![3..8]
        );
        assert!(Repair::NONE.ranges(&b).is_empty());
        assert!(Repair::new(4, RepairRule::AfterEdit)
            .ranges(&batch(10, &[]))
            .is_empty());
    }

    #[test]
    fn parses_what_it_prints() {
        for s in ["0", "after_edit:16", "before_end:4", "deviation:8"] {
            assert_eq!(s.parse::<Repair>().unwrap().to_string(), s);
        }
        assert_eq!(
            "16".parse::<Repair>().unwrap(),
            Repair::new(16, RepairRule::AfterEdit)
        );
        assert!("middle:3".parse::<Repair>().is_err());
        assert!("after_edit:x".parse::<Repair>().is_err());
    }
}
