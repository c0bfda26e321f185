//! Applying an AMORTIZE splice to the pool, the tree and the storage as one operation:
//! plan, then mutate, then commit, or roll back to exactly where it started.
//!
//! Order of work:
//! 1. **Plan** (no visible change): allocate the replacements' slots and the copy-on-write
//!    targets (an allocation that cannot succeed evicts nothing), compute every rotation
//!    table, check every slot against the storage.
//! 2. **Mutate**: copy the reused runs' sources into their fresh slots (rotated by their
//!    move) and the shared downstream slots, then for each replacement in order rotate the
//!    kept segments before it and let the caller prefill what of it is not reused (the
//!    model lives above this crate); the segment after the last replacement is rotated last.
//! 3. **Commit**: positions, lineages and revocations of the new slot list; the sequence's
//!    references on removed and copied-from slots are dropped, and those that come free
//!    holding session-private or forgotten KV are zeroed.
//!
//! A failure in a prefill rolls back: keys rotated in place are restored bit for bit from a
//! backup (taken only for segments rotated before a prefill that could still fail), the
//! fresh slots are zeroed and released in the reverse order of their allocation (so the free
//! list is as before), and the caller's sequence, tree and slot metadata were never touched.
//! The single-directive splice, the common case, needs no backup: its only downstream
//! segment is rotated after its only prefill.

use super::{SplicePlan, SpliceRequest};
use crate::error::{KvError, Result};
use crate::radix::PrefixCache;
use crate::shift::{key_shifts, KeyShift, RotationMode};
use crate::slots::Lineage;
use crate::storage::{KRowsBackup, KvStorage};
use leyline_core::{DirectiveBatch, Reuse};
use leyline_kernels::rope::{LayerRopes, Rotation};
use leyline_kernels::rotate::shift_tables;
use leyline_kernels::Tier;
use std::collections::{HashMap, HashSet};
use std::ops::Range;

/// The sequence a splice edits, as its owner holds it: one pool reference per slot.
#[derive(Debug, Clone, Copy)]
pub struct SpliceTarget<'a> {
    /// The sequence's slots, one per token.
    pub slots: &'a [u32],
    /// The owner's lineage: slots computed after an edit carry it.
    pub lineage: Lineage,
    /// Slots before this index hold lineage-free KV (computed from their tokens alone).
    pub clean_len: usize,
    /// Runs of the replacements whose KV is copied from the sequence's own slots they
    /// repeat (moved to their new positions) instead of prefilled: sorted, disjoint, each
    /// inside one replacement, the tokens matching ([`DirectiveBatch::reusable_runs`]). A
    /// run with a forgotten (revoked) source is prefilled instead.
    pub reuse: &'a [Reuse],
}

/// One replacement, or the part of it between reused runs, to prefill, handed to the
/// caller's prefill function.
#[derive(Debug, Clone)]
pub struct PrefillJob<'a> {
    /// Which directive (in sorted order).
    pub index: usize,
    /// The tokens to compute (the replacement's, less its reused runs).
    pub tokens: &'a [u32],
    /// Their positions in the edited sequence.
    pub positions: Range<usize>,
    /// The slots before them in the edited sequence: what they attend to. Eager: already
    /// rotated to their new positions; lazy: where they were, read through `shifts`.
    pub context: &'a [u32],
    /// The shifted runs of `context` (empty for an eager splice).
    pub shifts: &'a [KeyShift],
    /// Fresh slots to write, one per token.
    pub slots: &'a [u32],
}

/// What a committed splice did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spliced {
    /// The edited sequence's slots; the owner holds one reference on each.
    pub slots: Vec<u32>,
    /// The new [`SpliceTarget::clean_len`].
    pub clean_len: usize,
    /// Kept slots whose keys were rotated.
    pub rotated: usize,
    /// Shared slots copied before rotation.
    pub copied: usize,
    /// Replacement tokens prefilled.
    pub prefilled: usize,
    /// Post-edit ranges of the replacement tokens whose KV was copied from the slots they
    /// repeat (those of [`SpliceTarget::reuse`] whose sources were not forgotten).
    pub reused_ranges: Vec<Range<usize>>,
    /// Slots the allocations freed by evicting unlocked prefix-cache entries.
    pub evicted: usize,
}

impl Spliced {
    /// Replacement tokens whose KV was copied rather than prefilled.
    pub fn reused(&self) -> usize {
        self.reused_ranges.iter().map(|r| r.len()).sum()
    }
}

/// Where a splice failed.
#[derive(Debug, thiserror::Error)]
pub enum SpliceError<E> {
    /// The KV layer refused (pool exhausted, a rope that cannot shift, bad input); nothing
    /// changed.
    #[error(transparent)]
    Kv(#[from] KvError),
    /// The caller's prefill of a replacement failed; everything was rolled back.
    #[error("prefilling replacement {index} failed: {source}")]
    Prefill {
        /// The directive (sorted order).
        index: usize,
        /// The prefill's error.
        source: E,
    },
}

/// Applies the validated AMORTIZE `batch` to `target`: see the module docs for the order
/// and the rollback. `prefill` computes one replacement's KV into its fresh slots.
///
/// [`RotationMode::Lazy`] copies and rotates nothing: kept slots keep their bytes and their
/// encoded positions (so every sequence sharing them still reads them as before), the
/// replacements are encoded at their own positions, and the edited sequence reads the
/// kept runs whose position moved through [`key_shifts`].
///
/// On success the caller replaces its slot list by [`Spliced::slots`] (its references on
/// them are already in place, those on dropped slots already given back).
///
/// # Errors
/// [`SpliceError::Kv`] before anything changed (pool exhausted after eviction, a rope
/// scaling that does not compose, inconsistent input); [`SpliceError::Prefill`] after a
/// complete rollback. Either way the target, the tree, the slot metadata and every byte of
/// storage that a sequence or the tree can read are as before; an eviction that made room
/// for a splice whose prefill then failed stays done.
pub fn apply_splice<E>(
    cache: &mut PrefixCache,
    kv: &mut KvStorage,
    rope: &LayerRopes,
    mode: RotationMode,
    target: SpliceTarget<'_>,
    batch: &DirectiveBatch,
    mut prefill: impl FnMut(&mut KvStorage, PrefillJob<'_>) -> std::result::Result<(), E>,
) -> std::result::Result<Spliced, SpliceError<E>> {
    let mut txn = Txn::plan(cache, kv, rope, mode, target, batch)?;
    let directives = batch.directives();
    for (i, d) in directives.iter().enumerate() {
        let whole = txn.plan.prefill[i].start;
        for range in txn.plan.computed(i) {
            // The segments before this replacement must sit at their new positions; a later
            // prefill can still fail, so keys rotated in place now are backed up.
            txn.rotate_before(kv, range.start, true);
            let shifts = match mode {
                RotationMode::Eager => Vec::new(),
                RotationMode::Lazy => {
                    let before = &txn.plan.new_positions[..range.start];
                    key_shifts(before, |p| p)
                }
            };
            let job = PrefillJob {
                index: i,
                tokens: &d.replacement[range.start - whole..range.end - whole],
                positions: range.clone(),
                context: &txn.plan.new_slots[..range.start],
                shifts: &shifts,
                slots: &txn.plan.new_slots[range.clone()],
            };
            if let Err(source) = prefill(kv, job) {
                txn.rollback(cache, kv);
                return Err(SpliceError::Prefill { index: i, source });
            }
        }
    }
    txn.rotate_before(kv, usize::MAX, false);
    Ok(txn.commit(cache, kv))
}

/// A splice between plan and commit.
struct Txn {
    plan: SplicePlan,
    /// Fresh slots of the replacements, then of the copies, in allocation order.
    fresh: Vec<u32>,
    copies_from: usize,
    /// Kept segments with a non-zero delta, in sequence order: new-index range and one
    /// table per rope spec.
    rotations: Vec<(Range<usize>, Vec<Rotation>)>,
    /// Whether the reused runs are still to be copied ([`SplicePlan::reused`]), and (eager)
    /// the copies' rotations, grouped by delta.
    reuse_pending: bool,
    reuse_rotations: Vec<(Vec<u32>, Vec<Rotation>)>,
    /// Per layer, the index of its rope spec's table.
    spec_of_layer: Vec<usize>,
    /// Rotations done so far.
    rotated: usize,
    /// Slots the sequence owns alone (rotated in place, not copied).
    owned: HashSet<u32>,
    backups: Vec<KRowsBackup>,
    tier: Tier,
    lineage: Lineage,
    clean_len: usize,
    evicted: usize,
}

impl Txn {
    fn plan(
        cache: &mut PrefixCache,
        kv: &mut KvStorage,
        rope: &LayerRopes,
        mode: RotationMode,
        target: SpliceTarget<'_>,
        batch: &DirectiveBatch,
    ) -> Result<Self> {
        // Tables first: a rope that cannot shift refuses before any allocation.
        let geometry = kv.geometry();
        check_rope_layers(rope, geometry.layers)?;
        let segments = batch.segments();
        let mut tables: HashMap<i64, Vec<Rotation>> = HashMap::new();
        for s in segments.iter().filter(|s| s.delta != 0) {
            if let std::collections::hash_map::Entry::Vacant(e) = tables.entry(s.delta) {
                e.insert(shift_tables(rope, s.delta)?);
            }
        }
        for &s in target.slots {
            if s as usize >= kv.capacity() {
                return Err(KvError::SlotOutOfRange {
                    slot: s,
                    capacity: kv.capacity(),
                });
            }
        }
        let pool = cache.pool();
        let old_positions = target
            .slots
            .iter()
            .map(|&x| pool.position(x))
            .collect::<Result<Vec<_>>>()?;
        let lazy = mode == RotationMode::Lazy;
        // Only an eager splice copies what others hold; a lazy one moves no kept slot.
        let shared: HashSet<u32> = if lazy {
            HashSet::new()
        } else {
            target
                .slots
                .iter()
                .copied()
                .filter(|&x| pool.refcount(x).map_or(true, |r| r > 1))
                .collect()
        };

        // Nothing derived from a forgotten span is served again: such a run is prefilled.
        let reuse: Vec<Reuse> = target
            .reuse
            .iter()
            .filter(|u| {
                target
                    .slots
                    .get(u.old_range())
                    .is_some_and(|src| src.iter().all(|&x| pool.is_revoked(x).is_ok_and(|r| !r)))
            })
            .cloned()
            .collect();
        let n_repl: usize = batch.directives().iter().map(|d| d.replacement.len()).sum();
        let (mut fresh, removed) = cache.alloc_evicting(n_repl)?;
        let mut evicted = removed.freed.len();
        let mut repl_slots = Vec::with_capacity(batch.directives().len());
        let mut it = fresh.iter().copied();
        for d in batch.directives() {
            repl_slots.push(it.by_ref().take(d.replacement.len()).collect::<Vec<u32>>());
        }
        let copies_from = fresh.len();
        let req = SpliceRequest {
            old_slots: target.slots,
            old_positions: &old_positions,
            batch,
            replacement_slots: &repl_slots,
            reuse: &reuse,
        };
        let mut cow_alloc: Result<Vec<u32>> = Ok(Vec::new());
        let planned = SplicePlan::with_cow(
            &req,
            |x| !lazy && shared.contains(&x),
            |n| match cache.alloc_evicting(n) {
                Ok((v, removed)) => {
                    evicted += removed.freed.len();
                    cow_alloc = Ok(v.clone());
                    Some(v)
                }
                Err(e) => {
                    cow_alloc = Err(e);
                    None
                }
            },
        );
        if let Ok(copies) = &cow_alloc {
            fresh.extend_from_slice(copies);
        }
        let mut plan = match (planned, cow_alloc) {
            (Ok(p), _) => p,
            (Err(e), alloc) => {
                release_reversed(cache, &fresh);
                // The allocator's own error says more than "copy-on-write exhausted".
                return Err(alloc.err().unwrap_or(e));
            }
        };
        if lazy {
            // Kept slots stay as they are encoded; replacements sit at their own index.
            for s in &plan.segments {
                for (k, i) in s.new_range.clone().enumerate() {
                    plan.new_positions[i] = old_positions[s.old_range.start + k];
                }
            }
            for r in &plan.prefill {
                for i in r.clone() {
                    plan.new_positions[i] = i as u32;
                }
            }
            // A reused copy stays encoded where its source was, and is read through a shift.
            for u in &reuse {
                for (j, o) in u.new_range.clone().zip(u.old_range()) {
                    plan.new_positions[j] = old_positions[o];
                }
            }
            plan.to_rotate.clear();
        }
        let mut reuse_rotations: Vec<(Vec<u32>, Vec<Rotation>)> = Vec::new();
        if !lazy {
            for (delta, slots) in plan.reused_rotation_groups() {
                if let std::collections::hash_map::Entry::Vacant(e) = tables.entry(delta) {
                    match shift_tables(rope, delta) {
                        Ok(t) => {
                            e.insert(t);
                        }
                        Err(err) => {
                            release_reversed(cache, &fresh);
                            return Err(err.into());
                        }
                    }
                }
                reuse_rotations.push((slots, tables[&delta].clone()));
            }
        }
        let rotations = plan
            .segments
            .iter()
            .filter(|s| !lazy && s.delta != 0 && !s.new_range.is_empty())
            .map(|s| (s.new_range.clone(), tables[&s.delta].clone()))
            .collect();
        // Every kernel call below is checked now, so the mutation cannot fail half-way.
        let tier = Tier::best();
        for rot in tables.values().flatten() {
            // Zero slots: checks the shapes and the tier, rotates nothing.
            if let Err(e) = kv.shift_k([(0, rot)], &[], tier) {
                release_reversed(cache, &fresh);
                return Err(e.into());
            }
        }
        let copied: HashSet<u32> = plan.cow.iter().map(|&(_, dst)| dst).collect();
        let owned = plan
            .to_rotate
            .iter()
            .map(|&(s, _)| s)
            .filter(|s| !copied.contains(s))
            .collect();
        let first = &batch.directives()[0];
        // A reused copy carries what its source attended to: not clean.
        let first_reused = plan.reused_ranges.first().map_or(usize::MAX, |r| r.start);
        Ok(Txn {
            reuse_pending: !plan.reused.is_empty(),
            clean_len: target
                .clean_len
                .min(first.start + first.replacement.len())
                .min(first_reused),
            plan,
            fresh,
            copies_from,
            rotations,
            reuse_rotations,
            spec_of_layer: rope.of_layer().to_vec(),
            rotated: 0,
            owned,
            backups: Vec::new(),
            tier,
            lineage: target.lineage,
            evicted,
        })
    }

    /// Copies shared slots (once, before the first rotation) and rotates every segment not
    /// yet rotated that starts before `end`, backing up the owned rows first if `undoable`.
    fn rotate_before(&mut self, kv: &mut KvStorage, end: usize, undoable: bool) {
        if std::mem::take(&mut self.reuse_pending) {
            // Before any kept slot is rotated in place: the sources are read as they were.
            let pairs: Vec<(u32, u32)> = self.plan.reused.iter().map(|r| (r.0, r.1)).collect();
            kv.copy_slots(&pairs)
                .expect("reused slots checked against the storage in `plan`");
            for (slots, rot) in std::mem::take(&mut self.reuse_rotations) {
                rotate_checked(kv, &slots, &rot, &self.spec_of_layer, self.tier);
            }
        }
        if self.rotated == 0 && !self.plan.cow.is_empty() {
            // A failure here would leave the splice half applied; `plan` checked every slot.
            kv.copy_slots(&self.plan.cow)
                .expect("copy-on-write slots checked against the storage in `plan`");
        }
        while let Some((range, rot)) = self.rotations.get(self.rotated) {
            if range.start >= end {
                break;
            }
            let slots = &self.plan.new_slots[range.clone()];
            if undoable {
                let own: Vec<u32> = slots
                    .iter()
                    .copied()
                    .filter(|s| self.owned.contains(s))
                    .collect();
                if !own.is_empty() {
                    if let Ok(b) = kv.save_k(&own) {
                        self.backups.push(b);
                    }
                }
            }
            // Shapes, tier and slots were checked in `plan`.
            rotate_checked(kv, slots, rot, &self.spec_of_layer, self.tier);
            self.rotated += 1;
        }
    }

    fn rollback(self, cache: &mut PrefixCache, kv: &mut KvStorage) {
        for b in self.backups.iter().rev() {
            let _ = kv.restore_k(b);
        }
        // Copies and replacements may hold session-private KV: zeroed before they go back.
        for &s in &self.fresh {
            let _ = kv.zero_slot(s);
        }
        release_reversed(cache, &self.fresh);
    }

    fn commit(self, cache: &mut PrefixCache, kv: &mut KvStorage) -> Spliced {
        let plan = self.plan;
        let pool = cache.pool_mut();
        // Every slot here is held by the sequence or was just allocated: these cannot fail.
        for (i, (&slot, &pos)) in plan.new_slots.iter().zip(&plan.new_positions).enumerate() {
            let _ = pool.set_position(slot, pos);
            // A slot others hold too was neither moved nor copied (delta 0): its KV is still
            // theirs, unchanged, and keeps their lineage.
            if i >= self.clean_len && pool.refcount(slot).is_ok_and(|r| r == 1) {
                let _ = pool.set_lineage(slot, self.lineage);
            }
        }
        // A copy of forgotten KV is as forgotten as its source.
        for &(src, dst) in &plan.cow {
            if pool.is_revoked(src).unwrap_or(false) {
                let _ = pool.revoke(dst);
            }
        }
        let mut dropped: Vec<u32> = plan.cow.iter().map(|&(src, _)| src).collect();
        dropped.extend_from_slice(&plan.freed);
        release_scrubbed(cache, kv, &dropped);
        Spliced {
            rotated: plan.to_rotate.len(),
            copied: plan.cow.len(),
            prefilled: self.copies_from - plan.reused.len(),
            reused_ranges: plan.reused_ranges,
            slots: plan.new_slots,
            clean_len: self.clean_len,
            evicted: self.evicted,
        }
    }
}

/// Rotates the keys of `slots` in every layer `l` by `rots[spec_of_layer[l]]` (one table per
/// rope spec); the caller has checked the slots, the tables' shapes, the tier (a zero-slot
/// [`shift_rows_with`] call) and the layer map ([`check_rope_layers`]), so nothing fails.
pub(super) fn rotate_checked(
    kv: &mut KvStorage,
    slots: &[u32],
    rots: &[Rotation],
    spec_of_layer: &[usize],
    tier: Tier,
) {
    let layers = kv.geometry().layers;
    let per_layer = spec_of_layer.iter().take(layers).map(|&spec| &rots[spec]);
    let _ = kv.shift_k(per_layer.enumerate(), slots, tier);
}

/// Checks that `rope` names a spec for each of the pool's `layers`.
///
/// # Errors
/// [`KvError::SpliceInput`] naming both counts.
pub(super) fn check_rope_layers(rope: &LayerRopes, layers: usize) -> Result<()> {
    if rope.layers() != layers {
        return Err(KvError::SpliceInput(format!(
            "the rope names specs for {} layers; the pool has {layers}",
            rope.layers()
        )));
    }
    Ok(())
}

/// Drops one reference on each of `slots`; those that come free holding session-private or
/// forgotten KV are zeroed (what a sequence alone held was its own).
pub(super) fn release_scrubbed(cache: &mut PrefixCache, kv: &mut KvStorage, slots: &[u32]) {
    let pool = cache.pool_mut();
    let freed = pool.release_all(slots).unwrap_or_default();
    for s in freed {
        let private = !pool.lineage(s).is_ok_and(|l| l.is_shared());
        if private || pool.is_revoked(s).unwrap_or(true) {
            let _ = kv.zero_slot(s);
        }
    }
}

/// Releases freshly allocated slots in the reverse order of their allocation, which puts
/// the free list back as it was.
fn release_reversed(cache: &mut PrefixCache, fresh: &[u32]) {
    let pool = cache.pool_mut();
    for &s in fresh.iter().rev() {
        let _ = pool.release(s);
    }
}
