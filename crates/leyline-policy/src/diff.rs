//! From two rendered prompts to the edits that turn one into the other.
//!
//! [`diff`] aligns whole messages first (an unchanged message is an identical token range in
//! both sequences), so a policy's edit of one message becomes one [`Edit`], and only then trims
//! each changed message to its changed tokens. Because the aligned ranges tile both sequences,
//! applying the edits reproduces the new sequence exactly even where a tokenizer merges
//! tokens across a message boundary: such a boundary simply lands inside a changed range.

use crate::error::{PolicyError, Result};
use crate::message::Message;
use serde::{Deserialize, Serialize};
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::ops::Range;

/// Replace tokens `[start, end)` of the old sequence (pre-edit indices) by `replacement`.
/// Converts one to one into `leyline_core::Directive` once a mode is chosen.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Edit {
    /// First replaced index.
    pub start: usize,
    /// One past the last replaced index.
    pub end: usize,
    /// The tokens written in its place.
    pub replacement: Vec<u32>,
}

impl Edit {
    /// How far every token after the span moves: `|replacement| - (end - start)`.
    pub fn delta(&self) -> isize {
        self.replacement.len() as isize - self.removed() as isize
    }

    /// Tokens of the old sequence this edit removes (none for an inverted edit, which
    /// [`apply_edits`] refuses).
    pub fn removed(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether this edit only appends to a sequence of `old_len` tokens.
    pub fn is_append(&self, old_len: usize) -> bool {
        self.start == old_len && self.end == old_len
    }
}

/// A rendered prompt: its tokens and where each message starts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rendered {
    /// The token ids.
    pub tokens: Vec<u32>,
    /// `bounds[i]` is the token where message `i` starts and `bounds[n]` where the last one ends
    /// (non-decreasing, at most `tokens.len()`). Tokens before `bounds[0]` (e.g. BOS) and after
    /// `bounds[n]` (e.g. a generation prompt) are aligned as extra pseudo-messages.
    pub bounds: Vec<usize>,
}

/// Tokenizer plus chat template. Implemented by the model crate with the real ones; this crate
/// ships a stand-in ([`crate::ByteChatMl`]).
pub trait Renderer {
    /// Renders `messages` to tokens with message bounds.
    ///
    /// # Errors
    /// [`PolicyError::Render`] when the template or tokenizer fails.
    fn render_tokens(&self, messages: &[Message]) -> Result<Rendered>;
}

/// Edits turning `old` into `new`, aligned on message bounds (see the module docs): one edit
/// per changed message, each trimmed to the tokens that differ. Inserted or deleted messages
/// next to each other are one edit. Edits that would touch (one ends where the next starts)
/// are merged, so no two share a position.
/// An appended tail comes out as a last edit with `start == end == old.len()`, unless the
/// edit before it reaches `old.len()` (the last cached message changed at its very end, or a
/// tokenizer merged its last token with the appended text): then the two are one edit.
///
/// # Errors
/// [`PolicyError::BadBounds`] if either bound list is decreasing or runs past its tokens.
pub fn diff(
    old: &[u32],
    old_bounds: &[usize],
    new: &[u32],
    new_bounds: &[usize],
) -> Result<Vec<Edit>> {
    let a = segments(old, old_bounds)?;
    let b = segments(new, new_bounds)?;
    let ha: Vec<u64> = a.iter().map(|r| digest(&old[r.clone()])).collect();
    let hb: Vec<u64> = b.iter().map(|r| digest(&new[r.clone()])).collect();
    let same = |i: usize, j: usize| ha[i] == hb[j] && old[a[i].clone()] == new[b[j].clone()];

    let mut edits = Vec::new();
    let mut emit = |ia: Range<usize>, ib: Range<usize>| {
        edits.extend(run_edits(old, &a, ia, new, &b, ib));
    };
    let (mut i, mut j) = (0, 0);
    for (mi, mj) in align(a.len(), b.len(), same, |i| a[i].len()) {
        emit(i..mi, j..mj);
        i = mi + 1;
        j = mj + 1;
    }
    emit(i..a.len(), j..b.len());
    Ok(merge_touching(edits))
}

/// [`diff`] on two rendered prompts.
///
/// # Errors
/// As [`diff`].
pub fn diff_rendered(old: &Rendered, new: &Rendered) -> Result<Vec<Edit>> {
    diff(&old.tokens, &old.bounds, &new.tokens, &new.bounds)
}

/// Edits turning `old` into `new` without message bounds: at most one edit, spanning from the
/// first to the last differing token (common prefix and suffix are kept).
pub fn diff_tokens(old: &[u32], new: &[u32]) -> Vec<Edit> {
    let mut edits = Vec::new();
    push_trimmed(&mut edits, old, 0..old.len(), new, 0..new.len());
    edits
}

/// Applies `edits` (pre-edit indices, sorted by start, non-overlapping) to `old`.
///
/// # Errors
/// [`PolicyError::BadEdit`] if an edit is out of range, inverted, or starts before the end of
/// the previous one.
pub fn apply_edits(old: &[u32], edits: &[Edit]) -> Result<Vec<u32>> {
    let grow: isize = edits.iter().map(Edit::delta).sum();
    let mut out = Vec::with_capacity(old.len().saturating_add_signed(grow.max(0)));
    let mut at = 0;
    for (index, e) in edits.iter().enumerate() {
        let bad = |reason| PolicyError::BadEdit {
            index,
            start: e.start,
            end: e.end,
            len: old.len(),
            reason,
        };
        if e.start > e.end {
            return Err(bad("start after end"));
        }
        if e.end > old.len() {
            return Err(bad("past the end of the sequence"));
        }
        if e.start < at {
            return Err(bad("unsorted or overlapping the previous edit"));
        }
        out.extend_from_slice(&old[at..e.start]);
        out.extend_from_slice(&e.replacement);
        at = e.end;
    }
    out.extend_from_slice(&old[at..]);
    Ok(out)
}

/// Checks that rendering is stable at message boundaries: for every `i`, rendering
/// `messages[..i]` gives the same tokens before its bound `i` as rendering all of `messages`
/// gives before its bound `i`. Returns the first `i` where that fails, or `None`.
///
/// # Errors
/// Whatever the renderer returns, or [`PolicyError::BadBounds`] if a render's bounds are
/// shorter than its message count + 1.
pub fn first_unstable_boundary(
    renderer: &dyn Renderer,
    messages: &[Message],
) -> Result<Option<usize>> {
    let full = renderer.render_tokens(messages)?;
    let bound = |r: &Rendered, i: usize| {
        r.bounds
            .get(i)
            .copied()
            .filter(|&b| b <= r.tokens.len())
            .ok_or_else(|| PolicyError::BadBounds(format!("no valid bound {i}")))
    };
    for i in 1..=messages.len() {
        let part = renderer.render_tokens(&messages[..i])?;
        if part.tokens[..bound(&part, i)?] != full.tokens[..bound(&full, i)?] {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

/// Splits `tokens` into ranges at `bounds`, with a head range before `bounds[0]` and a tail
/// range after the last bound (each possibly empty).
fn segments(tokens: &[u32], bounds: &[usize]) -> Result<Vec<Range<usize>>> {
    let mut out = Vec::with_capacity(bounds.len() + 1);
    let mut at = 0;
    for (i, &b) in bounds.iter().enumerate() {
        if b < at || b > tokens.len() {
            return Err(PolicyError::BadBounds(format!(
                "bound {i} = {b} after {at}, sequence of {} tokens",
                tokens.len()
            )));
        }
        out.push(at..b);
        at = b;
    }
    out.push(at..tokens.len());
    Ok(out)
}

fn digest(tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

/// Token range covered by segments `ids`; an empty run sits at the start of the next segment.
fn span(segs: &[Range<usize>], ids: Range<usize>, len: usize) -> Range<usize> {
    let at = |i: usize| segs.get(i).map_or(len, |r| r.start);
    if ids.is_empty() {
        let p = at(ids.start);
        return p..p;
    }
    segs[ids.start].start..segs[ids.end - 1].end
}

/// Matched segment pairs `(i, j)`, increasing in both: common prefix and suffix first, then,
/// of the middle, a common subsequence with the most messages and, of those, the most tokens
/// (`tokens(i)` for old segment `i`; quadratic in the message count, which is small). The
/// tokens decide where a client moves a message: a compaction that puts its summary first and
/// a long system message last keeps the long message, not a short reply that stayed in place.
fn align(
    n: usize,
    m: usize,
    same: impl Fn(usize, usize) -> bool,
    tokens: impl Fn(usize) -> usize,
) -> Vec<(usize, usize)> {
    let mut pre = 0;
    while pre < n && pre < m && same(pre, pre) {
        pre += 1;
    }
    let mut suf = 0;
    while suf < n - pre && suf < m - pre && same(n - 1 - suf, m - 1 - suf) {
        suf += 1;
    }
    let (n2, m2) = (n - pre - suf, m - pre - suf);
    let mut pairs: Vec<(usize, usize)> = (0..pre).map(|i| (i, i)).collect();
    if n2 > 0 && m2 > 0 {
        // kept[i][j]: (messages, tokens) that the best common subsequence of the middles'
        // suffixes a[i..], b[j..] keeps, compared in that order.
        let w = m2 + 1;
        let with = |(k, t): (usize, usize), i: usize| (k + 1, t + tokens(pre + i));
        let mut kept = vec![(0usize, 0usize); (n2 + 1) * w];
        for i in (0..n2).rev() {
            for j in (0..m2).rev() {
                let skip = kept[(i + 1) * w + j].max(kept[i * w + j + 1]);
                kept[i * w + j] = if same(pre + i, pre + j) {
                    skip.max(with(kept[(i + 1) * w + j + 1], i))
                } else {
                    skip
                };
            }
        }
        let (mut i, mut j) = (0, 0);
        while i < n2 && j < m2 {
            if same(pre + i, pre + j) && kept[i * w + j] == with(kept[(i + 1) * w + j + 1], i) {
                pairs.push((pre + i, pre + j));
                i += 1;
                j += 1;
            } else if kept[(i + 1) * w + j] >= kept[i * w + j + 1] {
                i += 1;
            } else {
                j += 1;
            }
        }
    }
    pairs.extend((0..suf).map(|k| (n - suf + k, m - suf + k)));
    pairs
}

/// The edit turning `old[ra]` into `new[rb]`, less their common prefix and suffix; `None` if
/// they are equal.
fn trimmed(old: &[u32], ra: Range<usize>, new: &[u32], rb: Range<usize>) -> Option<Edit> {
    let (x, y) = (&old[ra.clone()], &new[rb]);
    let pre = x.iter().zip(y).take_while(|(p, q)| p == q).count();
    let max_suf = x.len().min(y.len()) - pre;
    let suf = x
        .iter()
        .rev()
        .zip(y.iter().rev())
        .take(max_suf)
        .take_while(|(p, q)| p == q)
        .count();
    let (start, end) = (ra.start + pre, ra.end - suf);
    let replacement = y[pre..y.len() - suf].to_vec();
    (start < end || !replacement.is_empty()).then_some(Edit {
        start,
        end,
        replacement,
    })
}

fn push_trimmed(
    edits: &mut Vec<Edit>,
    old: &[u32],
    ra: Range<usize>,
    new: &[u32],
    rb: Range<usize>,
) {
    edits.extend(trimmed(old, ra, new, rb));
}

/// Edits for one run of unmatched segments `ia` (old) against `ib` (new). Equal counts pair one
/// to one. Otherwise the `d` surplus segments are one insertion (or deletion) placed at the
/// offset that keeps the edits smallest (latest offset on ties), the rest pair one to one.
fn run_edits(
    old: &[u32],
    a: &[Range<usize>],
    ia: Range<usize>,
    new: &[u32],
    b: &[Range<usize>],
    ib: Range<usize>,
) -> Vec<Edit> {
    let (la, lb) = (ia.len(), ib.len());
    let d = la.abs_diff(lb);
    let pairs = la.min(lb);
    // Too many placements to try: put the surplus at the end of the run.
    let offsets: Vec<usize> = if (d + 1) * pairs > 256 {
        vec![pairs]
    } else {
        (0..=pairs).collect()
    };
    let mut best: Option<(usize, Vec<Edit>)> = None;
    for k in offsets {
        let mut edits = Vec::new();
        // The surplus block sits before paired rank k; emitting in rank order keeps the edits
        // in the order of both sequences, also where several sit at one position.
        let surplus = |edits: &mut Vec<Edit>| {
            if d > 0 {
                let (sa, sb) = if la > lb {
                    (ia.start + k..ia.start + k + d, ib.start + k..ib.start + k)
                } else {
                    (ia.start + k..ia.start + k, ib.start + k..ib.start + k + d)
                };
                push_trimmed(
                    edits,
                    old,
                    span(a, sa, old.len()),
                    new,
                    span(b, sb, new.len()),
                );
            }
        };
        for r in 0..pairs {
            if r == k {
                surplus(&mut edits);
            }
            let skip = |surplus_here: bool| if r >= k && surplus_here { r + d } else { r };
            let (i, j) = (ia.start + skip(la > lb), ib.start + skip(lb > la));
            push_trimmed(&mut edits, old, a[i].clone(), new, b[j].clone());
        }
        if k == pairs {
            surplus(&mut edits);
        }
        let cost = edits
            .iter()
            .map(|e| e.removed() + e.replacement.len())
            .sum();
        // Ties go to the later offset: surplus messages are most often appended.
        if best.as_ref().is_none_or(|(c, _)| cost <= *c) {
            best = Some((cost, edits));
        }
    }
    best.map(|(_, e)| e).unwrap_or_default()
}

/// Merges edits where one ends exactly where the next starts (input sorted by start).
fn merge_touching(edits: Vec<Edit>) -> Vec<Edit> {
    let mut out: Vec<Edit> = Vec::with_capacity(edits.len());
    for e in edits {
        match out.last_mut() {
            Some(last) if last.end == e.start => {
                last.end = e.end;
                last.replacement.extend_from_slice(&e.replacement);
            }
            _ => out.push(e),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(start: usize, end: usize, r: &[u32]) -> Edit {
        Edit {
            start,
            end,
            replacement: r.to_vec(),
        }
    }

    #[test]
    fn one_changed_message_is_one_trimmed_edit() {
        // Messages [1,2,3] [4,5,6,7] [8,9]; the middle one changes 5,6 -> 50.
        let old = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let new = [1, 2, 3, 4, 50, 7, 8, 9];
        let edits = diff(&old, &[0, 3, 7, 9], &new, &[0, 3, 6, 8]).unwrap();
        assert_eq!(edits, vec![e(4, 6, &[50])]);
    }

    #[test]
    fn two_changed_messages_are_two_edits_and_append_is_last() {
        let old = [1, 2, 9, 3, 4, 9, 5, 6, 9];
        let new = [1, 7, 9, 3, 4, 9, 5, 8, 9, 10, 11];
        let edits = diff(&old, &[0, 3, 6, 9], &new, &[0, 3, 6, 9, 11]).unwrap();
        assert_eq!(
            edits,
            vec![e(1, 2, &[7]), e(7, 8, &[8]), e(9, 9, &[10, 11])]
        );
        assert!(edits[2].is_append(old.len()));
        assert_eq!(apply_edits(&old, &edits).unwrap(), new);
    }

    #[test]
    fn a_deleted_message_is_one_edit() {
        let old = [1, 1, 2, 2, 3, 3];
        let new = [1, 1, 3, 3];
        let edits = diff(&old, &[0, 2, 4, 6], &new, &[0, 2, 4]).unwrap();
        assert_eq!(edits, vec![e(2, 4, &[])]);
    }

    #[test]
    fn a_moved_message_keeps_the_longer_of_two_that_cannot_both_stay() {
        // Old: system [1], a long message [7,7,7,7], a short one [8], a user turn [2].
        // New: system, a summary [3], the short one, the long one moved last. Only one of the
        // two can stay in order; the long one does, so four tokens are reused, not one.
        let old = [1, 7, 7, 7, 7, 8, 2];
        let new = [1, 3, 8, 7, 7, 7, 7];
        let edits = diff(&old, &[0, 1, 5, 6, 7], &new, &[0, 1, 2, 3, 7]).unwrap();
        assert_eq!(edits, vec![e(1, 1, &[3, 8]), e(5, 7, &[])]);
        assert_eq!(apply_edits(&old, &edits).unwrap(), new);
    }

    #[test]
    fn touching_edits_merge() {
        // Messages [1][2]: both change, and nothing separates them.
        let edits = diff(&[1, 2], &[0, 1, 2], &[3, 4], &[0, 1, 2]).unwrap();
        assert_eq!(edits, vec![e(0, 2, &[3, 4])]);
    }

    #[test]
    fn a_boundary_merge_joins_the_append() {
        // The tokenizer merged the cached message's last token (6) with appended text: the
        // message's edit ends where the append starts, so both are one edit, not an append.
        let edits = diff(&[5, 6], &[0, 2], &[5, 7, 8], &[0, 2, 3]).unwrap();
        assert_eq!(edits, vec![e(1, 2, &[7, 8])]);
        assert!(!edits[0].is_append(2));
    }

    #[test]
    fn diff_tokens_keeps_prefix_and_suffix() {
        assert_eq!(diff_tokens(&[1, 2, 3], &[1, 2, 3]), vec![]);
        assert_eq!(diff_tokens(&[1, 2, 3], &[1, 3]), vec![e(1, 2, &[])]);
        // Repeated tokens: prefix and suffix must not overlap.
        assert_eq!(diff_tokens(&[1, 1], &[1, 1, 1]), vec![e(2, 2, &[1])]);
        assert_eq!(diff_tokens(&[], &[5]), vec![e(0, 0, &[5])]);
    }

    #[test]
    fn apply_rejects_bad_batches() {
        let old = [1, 2, 3, 4];
        assert!(apply_edits(&old, &[e(3, 2, &[])]).is_err());
        assert!(apply_edits(&old, &[e(3, 5, &[])]).is_err());
        assert!(apply_edits(&old, &[e(1, 3, &[]), e(2, 4, &[])]).is_err());
        assert_eq!(
            apply_edits(&old, &[e(0, 1, &[9]), e(3, 4, &[])]).unwrap(),
            vec![9, 2, 3]
        );
    }

    #[test]
    fn bad_bounds_are_errors() {
        assert!(diff(&[1, 2], &[0, 3], &[1], &[0, 1]).is_err());
        assert!(diff(&[1, 2], &[1, 0], &[1], &[0, 1]).is_err());
    }
}
