//! The splice planner: what an AMORTIZE batch does to a sequence's slot list, as metadata.
//!
//! Given the old slots and encoded positions of a sequence, a validated
//! [`DirectiveBatch`] and the fresh slots the caller allocated for each replacement, it
//! computes the new slot list and positions, the slots the sequence drops, the slots to
//! rotate (grouped by delta, so one cos/sin table serves a group across every layer) and,
//! optionally, the copies a copy-on-write needs first. It touches no storage;
//! [`apply_splice`] carries a plan out on the pool, the tree and the storage as one
//! operation with a rollback.

mod apply;
mod compact;

pub use apply::{apply_splice, PrefillJob, SpliceError, SpliceTarget, Spliced};
pub use compact::{compact, Compacted};

use crate::error::{KvError, Result};
use leyline_core::{DirectiveBatch, Mode, Pos, Reuse};
use std::collections::HashSet;
use std::ops::Range;

pub use leyline_core::Segment;

/// Inputs of a splice plan.
#[derive(Debug, Clone, Copy)]
pub struct SpliceRequest<'a> {
    /// The sequence's slots, one per token, before the edit.
    pub old_slots: &'a [u32],
    /// Each old slot's encoded position.
    pub old_positions: &'a [Pos],
    /// The validated AMORTIZE batch (pre-edit indices).
    pub batch: &'a DirectiveBatch,
    /// Fresh slots for each replacement, in the order of `batch.directives()`, each as long
    /// as its replacement.
    pub replacement_slots: &'a [Vec<u32>],
    /// Runs of the replacements whose KV is copied from the old slots they repeat instead
    /// of computed (sorted, disjoint, each inside one replacement). The caller vouches that
    /// the tokens match ([`DirectiveBatch::reusable_runs`]).
    pub reuse: &'a [Reuse],
}

/// What a splice does, before anything is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplicePlan {
    /// The slot of each token after the edit.
    pub new_slots: Vec<u32>,
    /// The encoded position of each new slot once the plan is applied: kept slots move by
    /// their segment's delta; replacement slots continue from the token before them
    /// (0 at the start of the sequence).
    pub new_positions: Vec<Pos>,
    /// Kept pre-edit ranges and where they land.
    pub segments: Vec<Segment>,
    /// Post-edit index ranges of the replacements, one per directive; what of them is not
    /// [`Self::reused`] is prefilled ([`Self::computed`]).
    pub prefill: Vec<Range<usize>>,
    /// `(src, dst, delta)`: the old slot `src` is copied into the replacement slot `dst`,
    /// whose position is `delta` past `src`'s.
    pub reused: Vec<(u32, u32, i64)>,
    /// Post-edit ranges of the reused runs, sorted.
    pub reused_ranges: Vec<Range<usize>>,
    /// Slots of removed spans: the sequence drops its reference to them.
    pub freed: Vec<u32>,
    /// `(src, dst)`: copy `src` into the fresh `dst` before rotating; the sequence then holds
    /// `dst` and drops its reference to `src` (which other sequences still use).
    pub cow: Vec<(u32, u32)>,
    /// `(slot, delta)` for every kept slot whose position changes (after copy-on-write: the
    /// copies), sorted by delta so that equal deltas are contiguous; sequence order within.
    pub to_rotate: Vec<(u32, i64)>,
}

impl SplicePlan {
    /// Plans a splice in which the sequence owns every slot it keeps (no copy-on-write).
    ///
    /// # Errors
    /// [`KvError::SpliceInput`] if the batch is not AMORTIZE, lengths disagree, a slot
    /// appears twice, or a moved position leaves `0..=u32::MAX`.
    pub fn new(req: &SpliceRequest<'_>) -> Result<Self> {
        Self::with_cow(req, |_| false, |_| Some(Vec::new()))
    }

    /// Plans a splice; every kept slot that must rotate and for which `is_shared(slot)` holds
    /// is copied to a fresh slot first. `alloc(n)` is called at most once, with the number of
    /// copies, and must return `n` fresh slots or `None`.
    ///
    /// On error no slot handed out by `alloc` is referenced by anything the caller gets
    /// back: if `alloc` succeeded before a later failure, the caller frees those slots (only
    /// [`KvError::CowExhausted`] and the length check of `alloc`'s answer can follow it).
    ///
    /// # Errors
    /// As [`SplicePlan::new`], and [`KvError::CowExhausted`] if `alloc` returns `None`.
    pub fn with_cow(
        req: &SpliceRequest<'_>,
        is_shared: impl Fn(u32) -> bool,
        alloc: impl FnOnce(usize) -> Option<Vec<u32>>,
    ) -> Result<Self> {
        let plan = plan_metadata(req)?;
        plan.copy_on_write(is_shared, alloc)
    }

    /// The parts of directive `i`'s replacement that are prefilled: [`Self::prefill`]'s range
    /// less the reused runs in it.
    pub fn computed(&self, i: usize) -> Vec<Range<usize>> {
        let r = self.prefill.get(i).cloned().unwrap_or_default();
        leyline_core::ranges_without(&[r], &self.reused_ranges)
    }

    /// `(delta, slots)` groups of [`Self::to_rotate`], by increasing delta.
    pub fn rotation_groups(&self) -> Vec<(i64, Vec<u32>)> {
        by_delta(self.to_rotate.iter().copied())
    }

    /// `(delta, slots)` groups of the reused copies ([`Self::reused`]'s destinations) whose
    /// position moved, by increasing delta.
    pub fn reused_rotation_groups(&self) -> Vec<(i64, Vec<u32>)> {
        by_delta(
            self.reused
                .iter()
                .filter(|r| r.2 != 0)
                .map(|&(_, dst, delta)| (dst, delta)),
        )
    }

    fn copy_on_write(
        mut self,
        is_shared: impl Fn(u32) -> bool,
        alloc: impl FnOnce(usize) -> Option<Vec<u32>>,
    ) -> Result<Self> {
        let shared: Vec<usize> = (0..self.to_rotate.len())
            .filter(|&i| is_shared(self.to_rotate[i].0))
            .collect();
        if shared.is_empty() {
            return Ok(self);
        }
        let fresh = alloc(shared.len()).ok_or(KvError::CowExhausted {
            needed: shared.len(),
        })?;
        if fresh.len() != shared.len() {
            return Err(KvError::SpliceInput(format!(
                "copy-on-write asked for {} slots, the allocator returned {}",
                shared.len(),
                fresh.len()
            )));
        }
        let mut renamed = std::collections::HashMap::with_capacity(shared.len());
        for (&i, &dst) in shared.iter().zip(&fresh) {
            let src = self.to_rotate[i].0;
            self.cow.push((src, dst));
            self.to_rotate[i].0 = dst;
            renamed.insert(src, dst);
        }
        for s in &mut self.new_slots {
            if let Some(&dst) = renamed.get(s) {
                *s = dst;
            }
        }
        Ok(self)
    }
}

/// `(slot, delta)` pairs grouped by delta, by increasing delta; slots keep their order within
/// a group.
fn by_delta(pairs: impl Iterator<Item = (u32, i64)>) -> Vec<(i64, Vec<u32>)> {
    let mut pairs: Vec<(u32, i64)> = pairs.collect();
    pairs.sort_by_key(|&(_, delta)| delta);
    let mut out: Vec<(i64, Vec<u32>)> = Vec::new();
    for (slot, delta) in pairs {
        match out.last_mut() {
            Some((d, slots)) if *d == delta => slots.push(slot),
            _ => out.push((delta, vec![slot])),
        }
    }
    out
}

fn bad(msg: String) -> KvError {
    KvError::SpliceInput(msg)
}

/// The first slot that `slots` yields a second time. A bit per slot id when the ids are
/// dense enough (a pool's are), which at tens of thousands of slots is several times
/// cheaper than hashing each one; a hash set otherwise.
fn first_repeat(slots: impl Iterator<Item = u32> + Clone) -> Option<u32> {
    let (n, max) = slots
        .clone()
        .fold((0usize, 0u32), |(n, m), s| (n + 1, m.max(s)));
    if (max as usize) < 64 * n + 4096 {
        let mut bits = vec![0u64; max as usize / 64 + 1];
        for s in slots {
            let (w, b) = (s as usize / 64, 1u64 << (s % 64));
            if bits[w] & b != 0 {
                return Some(s);
            }
            bits[w] |= b;
        }
        return None;
    }
    let mut seen = HashSet::with_capacity(n);
    slots.into_iter().find(|&s| !seen.insert(s))
}

fn plan_metadata(req: &SpliceRequest<'_>) -> Result<SplicePlan> {
    let batch = req.batch;
    if batch.mode() == Some(Mode::Forget) {
        return Err(bad("a FORGET batch is re-prefilled, not spliced".into()));
    }
    let n = batch.old_len();
    if req.old_slots.len() != n || req.old_positions.len() != n {
        return Err(bad(format!(
            "batch validated for {n} tokens, got {} slots and {} positions",
            req.old_slots.len(),
            req.old_positions.len()
        )));
    }
    let directives = batch.directives();
    if req.replacement_slots.len() != directives.len() {
        return Err(bad(format!(
            "{} directives but {} replacement slot lists",
            directives.len(),
            req.replacement_slots.len()
        )));
    }
    for (i, (d, r)) in directives.iter().zip(req.replacement_slots).enumerate() {
        if d.replacement.len() != r.len() {
            return Err(bad(format!(
                "directive {i} (sorted) has {} replacement tokens but {} slots",
                d.replacement.len(),
                r.len()
            )));
        }
    }
    let all = req
        .old_slots
        .iter()
        .chain(req.replacement_slots.iter().flatten())
        .copied();
    if let Some(s) = first_repeat(all) {
        return Err(bad(format!(
            "slot {s} appears twice in the sequence or its replacements"
        )));
    }

    let segments = batch.segments();
    let prefill = batch.new_ranges();
    let mut new_slots = Vec::with_capacity(batch.new_len());
    let mut new_positions: Vec<Pos> = Vec::with_capacity(batch.new_len());
    let mut to_rotate = Vec::new();
    let mut freed = Vec::new();
    let mut seg = segments.iter().peekable();
    let mut push_kept =
        |s: &Segment, new_slots: &mut Vec<u32>, new_positions: &mut Vec<Pos>| -> Result<()> {
            for i in s.old_range.clone() {
                let p = req.old_positions[i] as i64 + s.delta;
                let p = Pos::try_from(p)
                    .map_err(|_| bad(format!("token {i} would move to position {p}")))?;
                new_slots.push(req.old_slots[i]);
                new_positions.push(p);
                if s.delta != 0 {
                    to_rotate.push((req.old_slots[i], s.delta));
                }
            }
            Ok(())
        };
    for (d, slots) in directives.iter().zip(req.replacement_slots) {
        if let Some(s) = seg.next_if(|s| s.old_range.start < d.start) {
            push_kept(s, &mut new_slots, &mut new_positions)?;
        }
        freed.extend_from_slice(&req.old_slots[d.start..d.end]);
        for &slot in slots {
            let p = new_positions.last().map_or(Some(0), |&p| p.checked_add(1));
            let p = p.ok_or_else(|| bad("a replacement position overflows u32".into()))?;
            new_slots.push(slot);
            new_positions.push(p);
        }
    }
    for s in seg {
        push_kept(s, &mut new_slots, &mut new_positions)?;
    }
    to_rotate.sort_by_key(|&(_, delta)| delta);
    let mut reused = Vec::new();
    let mut reused_ranges: Vec<Range<usize>> = Vec::new();
    for u in req.reuse {
        let inside = prefill
            .iter()
            .any(|r| r.start <= u.new_range.start && u.new_range.end <= r.end);
        let after = reused_ranges
            .last()
            .is_none_or(|l| l.end <= u.new_range.start);
        if u.new_range.is_empty() || !inside || !after || u.old_range().end > n {
            return Err(bad(format!(
                "reused run {:?} from {} is not a sorted run inside a replacement, or its source leaves the {n} tokens",
                u.new_range, u.old_start
            )));
        }
        for (j, o) in u.new_range.clone().zip(u.old_range()) {
            let delta = new_positions[j] as i64 - req.old_positions[o] as i64;
            reused.push((req.old_slots[o], new_slots[j], delta));
        }
        reused_ranges.push(u.new_range.clone());
    }
    Ok(SplicePlan {
        new_slots,
        new_positions,
        segments,
        prefill,
        reused,
        reused_ranges,
        freed,
        cow: Vec::new(),
        to_rotate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_repeat_finds_the_second_occurrence_dense_or_sparse() {
        for ids in [
            vec![3u32, 9, 0, 64, 65],
            vec![7, 1 << 30, 12, 4_000_000_000],
        ] {
            assert_eq!(first_repeat(ids.iter().copied()), None, "{ids:?}");
            let mut rep = ids.clone();
            rep.insert(3, ids[1]);
            rep.push(ids[0]);
            assert_eq!(first_repeat(rep.iter().copied()), Some(ids[1]), "{rep:?}");
        }
        assert_eq!(first_repeat(std::iter::empty()), None);
    }
    use leyline_core::{Directive, SessionState, ValidationContext};
    use proptest::prelude::*;

    fn batch(len: usize, ds: Vec<(usize, usize, usize)>) -> DirectiveBatch {
        let ds = ds
            .into_iter()
            .map(|(s, e, r)| Directive::new(s, e, vec![1; r], Mode::Amortize))
            .collect();
        let ctx = ValidationContext {
            seq_len: len,
            vocab_size: 10,
            session: SessionState::Idle,
        };
        DirectiveBatch::validate(ds, &ctx).unwrap()
    }

    #[test]
    fn replace_and_delete() {
        // 10 tokens in slots 100..110; [2,4) -> 3 tokens (+1); [6,9) deleted (-3).
        let b = batch(10, vec![(6, 9, 0), (2, 4, 3)]);
        let old: Vec<u32> = (100..110).collect();
        let pos: Vec<u32> = (0..10).collect();
        let reps = vec![vec![7, 8, 9], vec![]];
        let req = SpliceRequest {
            old_slots: &old,
            old_positions: &pos,
            batch: &b,
            replacement_slots: &reps,
            reuse: &[],
        };
        let p = SplicePlan::new(&req).unwrap();
        assert_eq!(p.new_slots, vec![100, 101, 7, 8, 9, 104, 105, 109]);
        assert_eq!(p.new_positions, (0..8).collect::<Vec<u32>>());
        assert_eq!(p.freed, vec![102, 103, 106, 107, 108]);
        assert_eq!(p.to_rotate, vec![(109, -2), (104, 1), (105, 1)]);
        assert_eq!(
            p.rotation_groups(),
            vec![(-2, vec![109]), (1, vec![104, 105])]
        );
        assert_eq!(p.prefill, vec![2..5, 7..7]);
        assert!(p.cow.is_empty());
    }

    #[test]
    fn cow_copies_only_shared_slots_that_move() {
        let b = batch(6, vec![(1, 2, 2)]);
        let old: Vec<u32> = vec![10, 11, 12, 13, 14, 15];
        let pos: Vec<u32> = (0..6).collect();
        let reps = vec![vec![20, 21]];
        let req = SpliceRequest {
            old_slots: &old,
            old_positions: &pos,
            batch: &b,
            replacement_slots: &reps,
            reuse: &[],
        };
        // 10 is shared but in the prefix (delta 0): not copied. 13 and 15 are shared and move.
        let shared = |s: u32| [10, 13, 15].contains(&s);
        let asked = std::cell::Cell::new(0);
        let p = SplicePlan::with_cow(&req, shared, |n| {
            asked.set(n);
            Some(vec![30, 31])
        })
        .unwrap();
        assert_eq!(asked.get(), 2);
        assert_eq!(p.cow, vec![(13, 30), (15, 31)]);
        assert_eq!(p.new_slots, vec![10, 20, 21, 12, 30, 14, 31]);
        assert_eq!(p.to_rotate, vec![(12, 1), (30, 1), (14, 1), (31, 1)]);
        assert_eq!(p.freed, vec![11]);
        let e = SplicePlan::with_cow(&req, shared, |_| None).unwrap_err();
        assert_eq!(e, KvError::CowExhausted { needed: 2 });
        assert!(SplicePlan::with_cow(&req, shared, |_| Some(vec![30])).is_err());
    }

    #[test]
    fn positions_follow_encoded_positions_and_errors() {
        // Encoded positions offset by 50 (e.g. a shifted sequence): kept ones move by delta.
        let b = batch(4, vec![(0, 1, 0)]);
        let old = [1u32, 2, 3, 4];
        let pos = [50u32, 51, 52, 53];
        let reps = vec![vec![]];
        let mut req = SpliceRequest {
            old_slots: &old,
            old_positions: &pos,
            batch: &b,
            replacement_slots: &reps,
            reuse: &[],
        };
        assert_eq!(
            SplicePlan::new(&req).unwrap().new_positions,
            vec![50, 51, 52]
        );
        let short = [1u32, 2, 3];
        req.old_slots = &short;
        assert!(matches!(
            SplicePlan::new(&req),
            Err(KvError::SpliceInput(_))
        ));
        let dup = [1u32, 2, 2, 4];
        req.old_slots = &dup;
        assert!(SplicePlan::new(&req)
            .unwrap_err()
            .to_string()
            .contains("slot 2 appears twice"));
        req.old_slots = &old;
        let low = [0u32, 0, 0, 0];
        req.old_positions = &low;
        assert!(SplicePlan::new(&req).is_err(), "position 0 - 1 is refused");
        let wrong = vec![vec![9]];
        req.old_positions = &pos;
        req.replacement_slots = &wrong;
        assert!(SplicePlan::new(&req).is_err());
        let ctx = ValidationContext {
            seq_len: 4,
            vocab_size: 10,
            session: SessionState::Idle,
        };
        let forget =
            DirectiveBatch::validate(vec![Directive::new(0, 1, vec![], Mode::Forget)], &ctx)
                .unwrap();
        req.batch = &forget;
        req.replacement_slots = &reps;
        assert!(SplicePlan::new(&req)
            .unwrap_err()
            .to_string()
            .contains("FORGET"));
    }

    fn arb_batch() -> impl Strategy<Value = (usize, Vec<(usize, usize, usize)>)> {
        (1usize..30).prop_flat_map(|len| {
            let cuts = proptest::collection::vec((0..=len, 0usize..4, 0usize..4), 0..5);
            cuts.prop_map(move |mut cuts| {
                cuts.sort();
                let mut out = Vec::new();
                let mut free_from = 0;
                for (s, w, r) in cuts {
                    let e = (s + w).min(len);
                    if s < free_from || (s == e && r == 0) {
                        continue;
                    }
                    free_from = if e > s { e } else { s + 1 };
                    out.push((s, e, r));
                }
                (len, out)
            })
        })
    }

    proptest! {
        /// Every old slot is kept once or freed; kept slots move by their index shift and are
        /// listed for rotation exactly when that shift is non-zero; positions are indices.
        #[test]
        fn plan_is_consistent((len, ds) in arb_batch()) {
            let b = batch(len, ds);
            let old: Vec<u32> = (0..len as u32).map(|i| 1000 + i).collect();
            let pos: Vec<u32> = (0..len as u32).collect();
            let mut next = 0u32;
            let reps: Vec<Vec<u32>> = b.directives().iter().map(|d| {
                d.replacement.iter().map(|_| { next += 1; next }).collect()
            }).collect();
            let req = SpliceRequest { old_slots: &old, old_positions: &pos, batch: &b, replacement_slots: &reps, reuse: &[] };
            let p = SplicePlan::new(&req).unwrap();
            prop_assert_eq!(p.new_slots.len(), b.new_len());
            prop_assert_eq!(&p.new_positions, &(0..b.new_len() as u32).collect::<Vec<_>>());
            let mut rotated = std::collections::HashMap::new();
            for &(s, d) in &p.to_rotate { rotated.insert(s, d); }
            prop_assert!(p.to_rotate.windows(2).all(|w| w[0].1 <= w[1].1));
            for (o, &slot) in old.iter().enumerate() {
                let kept: Vec<usize> = (0..p.new_slots.len()).filter(|&j| p.new_slots[j] == slot).collect();
                match b.map_old_index(o) {
                    Some(j) => {
                        prop_assert_eq!(&kept, &vec![j]);
                        let shift = j as i64 - o as i64;
                        prop_assert_eq!(rotated.get(&slot).copied(), (shift != 0).then_some(shift));
                        prop_assert!(!p.freed.contains(&slot));
                    }
                    None => {
                        prop_assert!(kept.is_empty());
                        prop_assert!(p.freed.contains(&slot));
                    }
                }
            }
            for (r, slots) in p.prefill.iter().zip(&reps) {
                prop_assert_eq!(&p.new_slots[r.clone()], &slots[..]);
            }
        }
    }
}
