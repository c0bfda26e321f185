//! Compaction: the eager rotation a lazy sequence catches up on, so that the runs attention
//! cuts its key blocks at stay few.
//!
//! Every shifted run of the sequence is brought to its own positions: slots it holds alone
//! are rotated in place; slots another sequence or the prefix tree also holds are copied
//! first (those holders keep reading the originals as they were encoded). Nothing fails
//! once storage is touched: allocation and every check come first.

use crate::error::{KvError, Result};

use crate::radix::PrefixCache;
use crate::storage::KvStorage;
use leyline_kernels::rope::LayerRopes;
use leyline_kernels::rotate::shift_tables;
use leyline_kernels::Tier;

/// What [`compact`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compacted {
    /// The sequence's slots afterwards (copies in place of shared slots); the owner holds
    /// one reference on each.
    pub slots: Vec<u32>,
    /// Keys rotated (in place or as copies).
    pub rotated: usize,
    /// Shared slots copied first.
    pub copied: usize,
    /// Slots the copies' allocation freed by evicting unlocked prefix-cache entries.
    pub evicted: usize,
}

/// Rotates every key of `slots` that is encoded off its index to its index (see the module
/// docs). The caller replaces its slot list by [`Compacted::slots`]; its references on the
/// copied-from slots are already given back.
///
/// # Errors
/// [`KvError::PoolExhausted`] if the copies do not fit after eviction, a rope that cannot
/// shift, an out-of-range slot; nothing changed then.
pub fn compact(
    cache: &mut PrefixCache,
    kv: &mut KvStorage,
    rope: &LayerRopes,
    slots: &[u32],
) -> Result<Compacted> {
    super::apply::check_rope_layers(rope, kv.geometry().layers)?;
    let runs = cache.pool().key_shifts(slots)?;
    let mut out = Compacted {
        slots: slots.to_vec(),
        rotated: 0,
        copied: 0,
        evicted: 0,
    };
    if runs.is_empty() {
        return Ok(out);
    }
    let tables = runs
        .iter()
        .map(|r| shift_tables(rope, r.offset))
        .collect::<leyline_kernels::Result<Vec<_>>>()?;
    for &s in slots {
        if s as usize >= kv.capacity() {
            return Err(KvError::SlotOutOfRange {
                slot: s,
                capacity: kv.capacity(),
            });
        }
    }
    let tier = Tier::best();
    for rot in tables.iter().flatten() {
        // Zero slots: checks the shapes and the tier, rotates nothing.
        kv.shift_k([(0, rot)], &[], tier)?;
    }
    let pool = cache.pool();
    let shared: Vec<usize> = runs
        .iter()
        .flat_map(|r| r.range.clone())
        .filter(|&i| pool.refcount(slots[i]).map_or(true, |c| c > 1))
        .collect();
    let (fresh, removed) = cache.alloc_evicting(shared.len())?;
    out.evicted = removed.freed.len();
    // Storage from here on; every slot and table was checked.
    let pairs: Vec<(u32, u32)> = shared.iter().map(|&i| slots[i]).zip(fresh).collect();
    kv.copy_slots(&pairs)
        .expect("sources checked above, copies allocated from this storage's pool");
    for (&i, &(_, dst)) in shared.iter().zip(&pairs) {
        out.slots[i] = dst;
    }
    for (run, rot) in runs.iter().zip(&tables) {
        let moved = &out.slots[run.range.clone()];
        super::apply::rotate_checked(kv, moved, rot, rope.of_layer(), tier);
        out.rotated += moved.len();
    }
    let pool = cache.pool_mut();
    for &(src, dst) in &pairs {
        // A copy keeps what its source was: its lineage, and a FORGET's revocation.
        let _ = pool.set_lineage(dst, pool.lineage(src).unwrap_or_default());
        if pool.is_revoked(src).unwrap_or(false) {
            let _ = pool.revoke(dst);
        }
    }
    for run in &runs {
        for i in run.range.clone() {
            let _ = pool.set_position(out.slots[i], i as u32);
        }
    }
    let sources: Vec<u32> = pairs.iter().map(|&(src, _)| src).collect();
    // An eviction above may have left this sequence the last holder of a source.
    super::apply::release_scrubbed(cache, kv, &sources);
    out.copied = pairs.len();
    Ok(out)
}
