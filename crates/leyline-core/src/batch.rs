//! Validated directive batches and their span algebra.

use crate::error::{CoreError, Result};
use crate::{Directive, Mode, Pos, TokenId};
use std::ops::Range;

/// Whether the session a batch targets may be edited now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// No request in flight: directives may apply.
    Idle,
    /// A request is in flight: directives are refused.
    Busy,
}

/// What a batch is validated against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidationContext {
    /// Length of the session's current token sequence.
    pub seq_len: usize,
    /// Vocabulary size of the model; replacement ids must be below it.
    pub vocab_size: usize,
    /// The session's state.
    pub session: SessionState,
}

/// A kept pre-edit range and where it lands after the edit.
///
/// `new_range.start == old_range.start + delta` and both ranges have the same length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Indices before the edit.
    pub old_range: Range<usize>,
    /// Indices after the edit.
    pub new_range: Range<usize>,
    /// Cumulative shift: the sum of the deltas of every directive before the segment.
    pub delta: i64,
}

/// A run of replacement tokens that repeats a run of the pre-edit sequence, as a moved
/// message does: the splice may copy the old run's KV to its new place (rotated by the
/// move) instead of computing it. The copy keeps what the run attended to where it was,
/// as a splice's downstream tokens keep theirs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reuse {
    /// Post-edit indices of the run, inside one replacement.
    pub new_range: Range<usize>,
    /// Pre-edit index of the run's first token.
    pub old_start: usize,
}

impl Reuse {
    /// The pre-edit range the run repeats.
    pub fn old_range(&self) -> Range<usize> {
        self.old_start..self.old_start + self.new_range.len()
    }
}

/// `ranges` less `holes` (both sorted and disjoint): the parts of each range that no hole
/// covers, in order. What of a batch's replacements is computed when its reused runs are not.
pub fn ranges_without(ranges: &[Range<usize>], holes: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut first = 0;
    for r in ranges {
        while holes.get(first).is_some_and(|h| h.end <= r.start) {
            first += 1;
        }
        let mut at = r.start;
        let inside = holes[first..].iter().take_while(|h| h.start < r.end);
        for h in inside.filter(|h| !h.is_empty()) {
            if h.start > at {
                out.push(at..h.start);
            }
            at = at.max(h.end);
        }
        if at < r.end {
            out.push(at..r.end);
        }
    }
    out
}

/// Directives validated as a whole against one sequence, sorted by start.
///
/// Invariants (checked by [`DirectiveBatch::validate`]): every range lies inside the
/// sequence, `start <= end`, no two ranges overlap or share a start, no directive is a no-op
/// (empty range and empty replacement), every replacement token is in the vocabulary, all
/// directives share one [`Mode`], and the edited length fits in [`Pos`].
///
/// Mixed modes are refused: a FORGET re-prefills everything from its start on, which would
/// silently override any AMORTIZE after it, and an AMORTIZE before a FORGET is better sent
/// as its own batch. One mode per batch keeps "what happened" reportable in one word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectiveBatch {
    directives: Vec<Directive>,
    old_len: usize,
}

impl DirectiveBatch {
    /// Validates `directives` (any order, pre-edit indices) and sorts them by start.
    ///
    /// An empty list is a valid no-op batch.
    ///
    /// # Errors
    /// The first [`CoreError`] found; each names the directive by its index in `directives`.
    pub fn validate(directives: Vec<Directive>, ctx: &ValidationContext) -> Result<Self> {
        if ctx.session == SessionState::Busy {
            return Err(CoreError::SessionBusy);
        }
        let first_mode = directives.first().map(|d| d.mode);
        for (index, d) in directives.iter().enumerate() {
            let (start, end) = (d.start, d.end);
            if start > end {
                return Err(CoreError::StartAfterEnd { index, start, end });
            }
            if end > ctx.seq_len {
                return Err(CoreError::OutOfRange {
                    index,
                    start,
                    end,
                    len: ctx.seq_len,
                });
            }
            if start == end && d.replacement.is_empty() {
                return Err(CoreError::EmptyOp { index, at: start });
            }
            if let Some((offset, &token)) = d
                .replacement
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= ctx.vocab_size)
            {
                return Err(CoreError::TokenOutOfVocab {
                    index,
                    offset,
                    token,
                    vocab_size: ctx.vocab_size,
                });
            }
            if let Some(expected) = first_mode {
                if d.mode != expected {
                    return Err(CoreError::MixedModes {
                        index,
                        expected,
                        found: d.mode,
                    });
                }
            }
        }
        let mut order: Vec<usize> = (0..directives.len()).collect();
        order.sort_by_key(|&i| (directives[i].start, directives[i].end));
        for w in order.windows(2) {
            let (a, b) = (&directives[w[0]], &directives[w[1]]);
            if b.start < a.end || b.start == a.start {
                return Err(CoreError::Overlap {
                    index: w[1],
                    start: b.start,
                    end: b.end,
                    other: w[0],
                    other_start: a.start,
                    other_end: a.end,
                });
            }
        }
        let new_len =
            ctx.seq_len as i128 + directives.iter().map(|d| d.delta() as i128).sum::<i128>();
        if new_len > Pos::MAX as i128 {
            return Err(CoreError::TooLong {
                len: new_len as u128,
            });
        }
        let mut slots: Vec<Option<Directive>> = directives.into_iter().map(Some).collect();
        let directives = order.iter().filter_map(|&i| slots[i].take()).collect();
        Ok(Self {
            directives,
            old_len: ctx.seq_len,
        })
    }

    /// The directives, sorted by start.
    pub fn directives(&self) -> &[Directive] {
        &self.directives
    }

    /// The batch's mode; `None` for an empty batch.
    pub fn mode(&self) -> Option<Mode> {
        self.directives.first().map(|d| d.mode)
    }

    /// Whether the batch holds no directive.
    pub fn is_empty(&self) -> bool {
        self.directives.is_empty()
    }

    /// Length of the sequence before the edit.
    pub fn old_len(&self) -> usize {
        self.old_len
    }

    /// Length of the sequence after the edit.
    pub fn new_len(&self) -> usize {
        (self.old_len as i64 + self.total_delta()) as usize
    }

    /// Sum of all deltas.
    pub fn total_delta(&self) -> i64 {
        self.directives.iter().map(Directive::delta).sum()
    }

    /// The kept pre-edit ranges (non-empty ones only), in order, each with where it lands and
    /// its cumulative delta. The prefix before the first directive has delta 0.
    pub fn segments(&self) -> Vec<Segment> {
        let mut out = Vec::with_capacity(self.directives.len() + 1);
        let mut old_cursor = 0usize;
        let mut delta = 0i64;
        let push = |out: &mut Vec<Segment>, old: Range<usize>, delta: i64| {
            if !old.is_empty() {
                let s = (old.start as i64 + delta) as usize;
                out.push(Segment {
                    new_range: s..s + old.len(),
                    old_range: old,
                    delta,
                });
            }
        };
        for d in &self.directives {
            push(&mut out, old_cursor..d.start, delta);
            delta += d.delta();
            old_cursor = d.end;
        }
        push(&mut out, old_cursor..self.old_len, delta);
        out
    }

    /// Post-edit index ranges of each replacement, in the order of [`Self::directives`].
    pub fn new_ranges(&self) -> Vec<Range<usize>> {
        let mut delta = 0i64;
        self.directives
            .iter()
            .map(|d| {
                let s = (d.start as i64 + delta) as usize;
                delta += d.delta();
                s..s + d.replacement.len()
            })
            .collect()
    }

    /// Where pre-edit index `old` lands after the edit; `None` if it is replaced (or out of
    /// range).
    pub fn map_old_index(&self, old: usize) -> Option<usize> {
        if old >= self.old_len {
            return None;
        }
        let mut delta = 0i64;
        for d in &self.directives {
            if old < d.start {
                break;
            }
            if old < d.end {
                return None;
            }
            delta += d.delta();
        }
        Some((old as i64 + delta) as usize)
    }

    /// This batch with each directive that starts fewer than `gap` tokens after the end of
    /// the one before it merged into that one: the kept tokens between them (read from
    /// `tokens`, the sequence the batch was validated against) join the replacement. The
    /// edited sequence is the same; what changes is that the tokens between are computed
    /// with the replacements, in order, instead of kept.
    ///
    /// # Errors
    /// [`CoreError::LengthMismatch`] if `tokens` is not `old_len` long.
    pub fn merge_close(self, gap: usize, tokens: &[TokenId]) -> Result<Self> {
        if tokens.len() != self.old_len {
            return Err(CoreError::LengthMismatch {
                expected: self.old_len,
                got: tokens.len(),
            });
        }
        let mut out: Vec<Directive> = Vec::with_capacity(self.directives.len());
        for d in self.directives {
            match out.last_mut() {
                Some(last) if d.start - last.end < gap => {
                    last.replacement
                        .extend_from_slice(&tokens[last.end..d.start]);
                    last.replacement.extend_from_slice(&d.replacement);
                    last.end = d.end;
                }
                _ => out.push(d),
            }
        }
        Ok(Self {
            directives: out,
            old_len: self.old_len,
        })
    }

    /// The runs of at least `min_len` replacement tokens that repeat a run of `tokens` (the
    /// sequence the batch was validated against), longest first at each place, scanned left
    /// to right; sorted and disjoint. `min_len == 0` finds none.
    ///
    /// # Errors
    /// [`CoreError::LengthMismatch`] if `tokens` is not `old_len` long.
    pub fn reusable_runs(&self, tokens: &[TokenId], min_len: usize) -> Result<Vec<Reuse>> {
        if tokens.len() != self.old_len {
            return Err(CoreError::LengthMismatch {
                expected: self.old_len,
                got: tokens.len(),
            });
        }
        let mut out = Vec::new();
        if min_len == 0 || tokens.len() < min_len {
            return Ok(out);
        }
        // Where each run of `min_len` old tokens starts; a long run of one repeated token
        // would list every place, so a key keeps its first few.
        const PLACES: usize = 16;
        let mut starts: std::collections::HashMap<&[TokenId], Vec<usize>> =
            std::collections::HashMap::new();
        for (i, w) in tokens.windows(min_len).enumerate() {
            let v = starts.entry(w).or_default();
            if v.len() < PLACES {
                v.push(i);
            }
        }
        for (d, range) in self.directives.iter().zip(self.new_ranges()) {
            let r = &d.replacement;
            let mut at = 0;
            while at + min_len <= r.len() {
                let longest = starts.get(&r[at..at + min_len]).and_then(|places| {
                    places
                        .iter()
                        .map(|&o| {
                            let n = r[at..]
                                .iter()
                                .zip(&tokens[o..])
                                .take_while(|(a, b)| a == b)
                                .count();
                            (n, o)
                        })
                        .max_by_key(|&(n, o)| (n, std::cmp::Reverse(o)))
                });
                match longest {
                    Some((n, o)) => {
                        let s = range.start + at;
                        out.push(Reuse {
                            new_range: s..s + n,
                            old_start: o,
                        });
                        at += n;
                    }
                    None => at += 1,
                }
            }
        }
        Ok(out)
    }

    /// Applies the batch to `tokens` (the sequence it was validated against).
    ///
    /// # Errors
    /// [`CoreError::LengthMismatch`] if `tokens` is not `old_len` long.
    pub fn apply_to_tokens(&self, tokens: &[TokenId]) -> Result<Vec<TokenId>> {
        if tokens.len() != self.old_len {
            return Err(CoreError::LengthMismatch {
                expected: self.old_len,
                got: tokens.len(),
            });
        }
        let mut out = Vec::with_capacity(self.new_len());
        let mut cursor = 0;
        for d in &self.directives {
            out.extend_from_slice(&tokens[cursor..d.start]);
            out.extend_from_slice(&d.replacement);
            cursor = d.end;
        }
        out.extend_from_slice(&tokens[cursor..]);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ctx(seq_len: usize) -> ValidationContext {
        ValidationContext {
            seq_len,
            vocab_size: 50,
            session: SessionState::Idle,
        }
    }

    fn am(start: usize, end: usize, r: &[u32]) -> Directive {
        Directive::new(start, end, r.to_vec(), Mode::Amortize)
    }

    fn err(ds: Vec<Directive>, len: usize) -> String {
        DirectiveBatch::validate(ds, &ctx(len))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn errors_name_the_directive_and_the_problem() {
        assert_eq!(
            err(vec![am(0, 1, &[1]), am(2, 2, &[1]), am(10, 8, &[])], 20),
            "directive 2: range [10, 8) has start > end"
        );
        assert!(
            err(vec![am(3, 21, &[])], 20).starts_with("directive 0: range [3, 21) is out of range")
        );
        assert!(err(vec![am(1, 2, &[]), am(5, 5, &[])], 20)
            .starts_with("directive 1: empty range at 5"));
        assert_eq!(
            err(vec![am(1, 2, &[3, 99])], 20),
            "directive 0: replacement token 1 has id 99, outside a vocabulary of 50"
        );
        let mixed = vec![am(1, 2, &[]), Directive::new(4, 5, vec![], Mode::Forget)];
        assert!(err(mixed, 20).starts_with("directive 1: mode Forget differs"));
        // Caller order is kept in messages even though directives are sorted.
        assert_eq!(
            err(vec![am(8, 12, &[]), am(2, 4, &[]), am(10, 11, &[1])], 20),
            "directive 2: range [10, 11) overlaps directive 0 [8, 12)"
        );
        // Same start is ambiguous, even for an insertion.
        assert!(err(vec![am(5, 5, &[1]), am(5, 7, &[])], 20).contains("overlaps"));
        let busy = ValidationContext {
            session: SessionState::Busy,
            ..ctx(5)
        };
        assert_eq!(
            DirectiveBatch::validate(vec![], &busy),
            Err(CoreError::SessionBusy)
        );
    }

    #[test]
    fn adjacent_ranges_and_insertions_are_fine() {
        let b = DirectiveBatch::validate(vec![am(5, 5, &[7]), am(2, 5, &[8, 9])], &ctx(8)).unwrap();
        let t: Vec<u32> = (0..8).collect();
        assert_eq!(b.apply_to_tokens(&t).unwrap(), vec![0, 1, 8, 9, 7, 5, 6, 7]);
        assert_eq!(b.directives()[0].start, 2);
        assert_eq!(b.new_ranges(), vec![2..4, 4..5]);
        assert!(b.apply_to_tokens(&t[..7]).is_err());
    }

    #[test]
    fn segments_and_index_map() {
        // tokens 0..10; replace [2,4) by 3 tokens (+1), delete [6,9) (-3).
        let b =
            DirectiveBatch::validate(vec![am(6, 9, &[]), am(2, 4, &[1, 1, 1])], &ctx(10)).unwrap();
        let segs = b.segments();
        let want = [(0..2, 0..2, 0), (4..6, 5..7, 1), (9..10, 7..8, -2)];
        assert_eq!(segs.len(), 3);
        for (s, (o, n, d)) in segs.iter().zip(want) {
            assert_eq!(
                (s.old_range.clone(), s.new_range.clone(), s.delta),
                (o, n, d)
            );
        }
        assert_eq!(b.new_len(), 8);
        assert_eq!(b.total_delta(), -2);
        assert_eq!(b.map_old_index(1), Some(1));
        assert_eq!(b.map_old_index(3), None);
        assert_eq!(b.map_old_index(5), Some(6));
        assert_eq!(b.map_old_index(9), Some(7));
        assert_eq!(b.map_old_index(10), None);
    }

    #[test]
    fn mode_serializes_lowercase() {
        let d = am(0, 1, &[]);
        assert_eq!(d.delta(), -1);
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains(r#""mode":"amortize""#), "{json}");
        let back: Directive = serde_json::from_str(&json).unwrap();
        assert_eq!(back, d);
        assert!(serde_json::from_str::<Mode>(r#""Forget""#).is_err());
    }

    /// Non-overlapping directives with distinct starts over a sequence of `len` tokens.
    fn arb_case() -> impl Strategy<Value = (Vec<u32>, Vec<Directive>)> {
        (1usize..40).prop_flat_map(|len| {
            let toks = proptest::collection::vec(0u32..50, len);
            let cuts = proptest::collection::vec(
                (
                    0..=len,
                    0usize..4,
                    proptest::collection::vec(0u32..50, 0..4),
                ),
                0..6,
            );
            (toks, cuts).prop_map(move |(toks, cuts)| {
                let mut ds: Vec<Directive> = Vec::new();
                let mut sorted = cuts;
                sorted.sort_by_key(|c| c.0);
                let mut free_from = 0usize;
                for (start, width, mut rep) in sorted {
                    if start < free_from {
                        continue;
                    }
                    let end = (start + width).min(len);
                    if start == end && rep.is_empty() {
                        rep.push(1);
                    }
                    free_from = if end > start { end } else { start + 1 };
                    ds.push(am(start, end, &rep));
                }
                ds.reverse(); // hand them over unsorted
                (toks, ds)
            })
        })
    }

    #[test]
    fn ranges_without_cuts_out_the_holes() {
        assert_eq!(
            ranges_without(&[0..10, 12..20, 25..30], &[2..4, 8..14, 15..15, 19..26]),
            vec![0..2, 4..8, 14..19, 26..30]
        );
        let (r, all) = (3..5, 0..9);
        let one = std::slice::from_ref(&r);
        assert_eq!(ranges_without(one, &[]), one);
        assert!(ranges_without(one, std::slice::from_ref(&all)).is_empty());
    }

    #[test]
    fn a_moved_run_is_found_where_it_was() {
        // Old: 0..20 as [a: 0..5][b: 5..12][c: 12..20]; new: [a][c][b] with b moved behind
        // c, written as deleting b and inserting it (plus one new token) after c.
        let toks: Vec<u32> = (0..20).collect();
        let mut moved: Vec<u32> = (5..12).collect();
        moved.push(40);
        let b =
            DirectiveBatch::validate(vec![am(5, 12, &[]), am(20, 20, &moved)], &ctx(20)).unwrap();
        let runs = b.reusable_runs(&toks, 4).unwrap();
        // The insertion lands at 13..21 after the edit; its first 7 tokens repeat 5..12.
        assert_eq!(
            runs,
            vec![Reuse {
                new_range: 13..20,
                old_start: 5
            }]
        );
        assert_eq!(runs[0].old_range(), 5..12);
        assert!(b.reusable_runs(&toks, 8).unwrap().is_empty(), "7 < 8");
        assert!(b.reusable_runs(&toks, 0).unwrap().is_empty());
        assert!(b.reusable_runs(&toks[1..], 4).is_err());
        // Of two places, the longer match wins; a replacement may hold several runs.
        let toks: Vec<u32> = vec![1, 2, 3, 9, 1, 2, 3, 4, 5, 8, 8];
        let b =
            DirectiveBatch::validate(vec![am(9, 11, &[1, 2, 3, 4, 7, 1, 2, 3])], &ctx(11)).unwrap();
        let runs = b.reusable_runs(&toks, 3).unwrap();
        assert_eq!(
            runs,
            vec![
                Reuse {
                    new_range: 9..13,
                    old_start: 4
                },
                Reuse {
                    new_range: 14..17,
                    old_start: 0
                }
            ]
        );
    }

    proptest! {
        #[test]
        fn batch_equals_one_by_one_from_the_back((toks, ds) in arb_case()) {
            let b = DirectiveBatch::validate(ds.clone(), &ctx(toks.len())).unwrap();
            let got = b.apply_to_tokens(&toks).unwrap();
            let mut want = toks.clone();
            let mut sorted = ds.clone();
            sorted.sort_by_key(|d| std::cmp::Reverse(d.start));
            for d in &sorted {
                want.splice(d.start..d.end, d.replacement.iter().copied());
            }
            prop_assert_eq!(&got, &want);
            prop_assert_eq!(b.new_len(), want.len());
            for s in b.segments() {
                prop_assert_eq!(&got[s.new_range.clone()], &toks[s.old_range.clone()]);
                for (i, o) in s.old_range.clone().enumerate() {
                    prop_assert_eq!(b.map_old_index(o), Some(s.new_range.start + i));
                }
            }
            for (d, r) in b.directives().iter().zip(b.new_ranges()) {
                prop_assert_eq!(&got[r], &d.replacement[..]);
            }
            // Reusable runs repeat old tokens, lie inside one replacement, are long enough,
            // sorted and disjoint.
            let runs = b.reusable_runs(&toks, 2).unwrap();
            let ranges = b.new_ranges();
            for (i, run) in runs.iter().enumerate() {
                prop_assert!(run.new_range.len() >= 2);
                prop_assert_eq!(&got[run.new_range.clone()], &toks[run.old_range()]);
                prop_assert!(ranges.iter().any(|r| r.start <= run.new_range.start && run.new_range.end <= r.end));
                if i > 0 {
                    prop_assert!(runs[i - 1].new_range.end <= run.new_range.start);
                }
            }
        }
    }
}
