//! Slot metadata: the token-granular pool's free list, reference counts, encoded positions,
//! lineages and LRU stamps. Metadata only: the KV rows themselves live in
//! [`crate::storage::KvStorage`], indexed by the same slot ids.
//!
//! A slot is *free* exactly when its reference count is 0, and then it sits on the free list
//! once. Every holder of a slot (a running sequence, the radix tree) owns one reference, taken
//! by [`SlotPool::alloc`] or [`SlotPool::retain`] and given back by [`SlotPool::release`].
//! Misuse (double free, out-of-range ids) is an `Err`, never a panic.

use crate::error::{KvError, Result};

/// Which edit history produced a slot's KV (DESIGN.md §1).
///
/// [`Lineage::SHARED`] marks lineage-free slots: plain prefill of the tokens before them, which
/// any session may match. Any other value is one session's edit history: such slots carry
/// influence of content that session evicted and must never be served to another lineage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Lineage(pub u64);

impl Lineage {
    /// Lineage-free prefix slots, matchable by every session.
    pub const SHARED: Lineage = Lineage(0);

    /// Whether this is [`Lineage::SHARED`].
    pub fn is_shared(self) -> bool {
        self == Self::SHARED
    }

    /// Whether a slot of lineage `self` may be stored in (and served from) a namespace of
    /// lineage `ns`: shared slots go anywhere, others only to their own lineage.
    pub fn may_serve(self, ns: Lineage) -> bool {
        self.is_shared() || self == ns
    }
}

impl std::fmt::Display for Lineage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Metadata of one slot.
#[derive(Debug, Clone, Copy, Default)]
struct SlotMeta {
    refcount: u32,
    position: u32,
    lineage: Lineage,
    stamp: u64,
    /// Withdrawn by a FORGET while still in use: never stored in the tree again.
    revoked: bool,
}

/// The pool's metadata: `capacity` token-granular slots.
#[derive(Debug, Clone)]
pub struct SlotPool {
    meta: Vec<SlotMeta>,
    /// Free slots, popped from the back; kept so that a fresh pool hands out 0, 1, 2, ...
    free: Vec<u32>,
}

impl SlotPool {
    /// A pool of `capacity` free slots.
    ///
    /// # Errors
    /// [`KvError::Sizing`] when `capacity` does not fit slot ids (`u32`).
    pub fn new(capacity: usize) -> Result<Self> {
        let cap = u32::try_from(capacity)
            .map_err(|_| KvError::Sizing(format!("{capacity} slots exceed u32 slot ids")))?;
        Ok(Self {
            meta: vec![SlotMeta::default(); capacity],
            free: (0..cap).rev().collect(),
        })
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.meta.len()
    }

    /// Slots on the free list.
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Slots with at least one reference.
    pub fn used_count(&self) -> usize {
        self.meta.len() - self.free.len()
    }

    /// Takes `n` free slots, all or nothing. Each comes back with refcount 1 (owned by the
    /// caller), position 0, [`Lineage::SHARED`] and stamp 0.
    ///
    /// # Errors
    /// [`KvError::PoolExhausted`] when fewer than `n` slots are free; the pool is unchanged.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(KvError::PoolExhausted {
                requested: n,
                free: self.free.len(),
            });
        }
        let out: Vec<u32> = self
            .free
            .split_off(self.free.len() - n)
            .into_iter()
            .rev()
            .collect();
        for &s in &out {
            self.meta[s as usize] = SlotMeta {
                refcount: 1,
                ..SlotMeta::default()
            };
        }
        Ok(out)
    }

    fn check(&self, slot: u32) -> Result<usize> {
        let i = slot as usize;
        if i < self.meta.len() {
            Ok(i)
        } else {
            Err(KvError::SlotOutOfRange {
                slot,
                capacity: self.meta.len(),
            })
        }
    }

    fn check_used(&self, slot: u32) -> Result<usize> {
        let i = self.check(slot)?;
        if self.meta[i].refcount == 0 {
            return Err(KvError::SlotNotInUse { slot });
        }
        Ok(i)
    }

    /// Adds one reference to an allocated slot.
    ///
    /// # Errors
    /// Out-of-range or free slot (a free slot can only come back through [`Self::alloc`]).
    pub fn retain(&mut self, slot: u32) -> Result<()> {
        let i = self.check_used(slot)?;
        let m = &mut self.meta[i];
        m.refcount = m
            .refcount
            .checked_add(1)
            .ok_or_else(|| KvError::Sizing(format!("slot {slot}: refcount overflow")))?;
        Ok(())
    }

    /// Drops one reference. Returns `true` when that was the last one: the slot is then back
    /// on the free list and its storage rows may be zeroed (FORGET) or reused.
    ///
    /// # Errors
    /// Out-of-range slot, or [`KvError::SlotNotInUse`] for a free slot (double free).
    pub fn release(&mut self, slot: u32) -> Result<bool> {
        let i = self.check_used(slot)?;
        let m = &mut self.meta[i];
        m.refcount -= 1;
        if m.refcount == 0 {
            self.free.push(slot);
            return Ok(true);
        }
        Ok(false)
    }

    /// Releases one reference on each of `slots` (a slot listed twice loses two), all or
    /// nothing: every release is validated before any happens. Returns the slots freed.
    ///
    /// # Errors
    /// As [`Self::release`], or when a slot is listed more often than it has references;
    /// the pool is then unchanged.
    pub fn release_all(&mut self, slots: &[u32]) -> Result<Vec<u32>> {
        let mut need: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &s in slots {
            let i = self.check_used(s)?;
            let n = need.entry(s).or_insert(0);
            *n += 1;
            if *n > self.meta[i].refcount {
                return Err(KvError::SlotNotInUse { slot: s });
            }
        }
        let mut freed = Vec::new();
        for &s in slots {
            if self.release(s)? {
                freed.push(s);
            }
        }
        Ok(freed)
    }

    /// Marks an allocated slot as withdrawn by a FORGET while something still holds it: the
    /// prefix tree stores neither it nor anything after it again, and whoever frees it zeroes
    /// its storage. [`Self::alloc`] clears the mark.
    ///
    /// # Errors
    /// Out-of-range or free slot.
    pub fn revoke(&mut self, slot: u32) -> Result<()> {
        let i = self.check_used(slot)?;
        self.meta[i].revoked = true;
        Ok(())
    }

    /// Whether `slot` is revoked ([`Self::revoke`]).
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn is_revoked(&self, slot: u32) -> Result<bool> {
        Ok(self.meta[self.check(slot)?].revoked)
    }

    /// Index of the first revoked slot in `slots` (`slots.len()` when none is): the usable
    /// prefix of a sequence, since everything after a revoked slot was computed from it.
    /// Out-of-range slots count as not revoked.
    pub fn first_revoked(&self, slots: &[u32]) -> usize {
        slots
            .iter()
            .position(|&x| self.meta.get(x as usize).is_some_and(|m| m.revoked))
            .unwrap_or(slots.len())
    }

    /// References held on `slot` (0 when free).
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn refcount(&self, slot: u32) -> Result<u32> {
        Ok(self.meta[self.check(slot)?].refcount)
    }

    /// Whether `slot` is free.
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn is_free(&self, slot: u32) -> Result<bool> {
        Ok(self.refcount(slot)? == 0)
    }

    /// Sets the position the slot's keys are rotated to.
    ///
    /// # Errors
    /// Out-of-range or free slot.
    pub fn set_position(&mut self, slot: u32, position: u32) -> Result<()> {
        let i = self.check_used(slot)?;
        self.meta[i].position = position;
        Ok(())
    }

    /// The position the slot's keys are rotated to.
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn position(&self, slot: u32) -> Result<u32> {
        Ok(self.meta[self.check(slot)?].position)
    }

    /// The runs of `context` whose keys are encoded off their indices (lazy splices left
    /// them there): [`crate::shift::key_shifts`] over this pool's positions.
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn key_shifts(&self, context: &[u32]) -> Result<Vec<crate::shift::KeyShift>> {
        self.key_shifts_from(context, 0)
    }

    /// [`Self::key_shifts`] for queries sitting `base` before their own positions
    /// ([`crate::shift::key_shifts_from`]).
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn key_shifts_from(
        &self,
        context: &[u32],
        base: i64,
    ) -> Result<Vec<crate::shift::KeyShift>> {
        for &slot in context {
            self.check(slot)?;
        }
        Ok(crate::shift::key_shifts_from(
            context,
            |s| self.meta[s as usize].position,
            base,
        ))
    }

    /// Sets the slot's lineage.
    ///
    /// # Errors
    /// Out-of-range or free slot.
    pub fn set_lineage(&mut self, slot: u32, lineage: Lineage) -> Result<()> {
        let i = self.check_used(slot)?;
        self.meta[i].lineage = lineage;
        Ok(())
    }

    /// The slot's lineage.
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn lineage(&self, slot: u32) -> Result<Lineage> {
        Ok(self.meta[self.check(slot)?].lineage)
    }

    /// Stamps the slot with an LRU clock value (larger = more recent).
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn touch(&mut self, slot: u32, clock: u64) -> Result<()> {
        let i = self.check(slot)?;
        self.meta[i].stamp = clock;
        Ok(())
    }

    /// The slot's last LRU stamp.
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn stamp(&self, slot: u32) -> Result<u64> {
        Ok(self.meta[self.check(slot)?].stamp)
    }

    /// Checks that every slot is free xor referenced: the free list holds exactly the slots
    /// with refcount 0, each once.
    ///
    /// # Errors
    /// A description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut on_list = vec![false; self.meta.len()];
        for &s in &self.free {
            let i = s as usize;
            if i >= self.meta.len() {
                return Err(format!("free list holds out-of-range slot {s}"));
            }
            if on_list[i] {
                return Err(format!("slot {s} is on the free list twice"));
            }
            on_list[i] = true;
        }
        for (i, m) in self.meta.iter().enumerate() {
            if on_list[i] != (m.refcount == 0) {
                return Err(format!(
                    "slot {i}: refcount {} but on free list = {}",
                    m.refcount, on_list[i]
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_is_all_or_nothing() {
        let mut p = SlotPool::new(4).unwrap();
        let a = p.alloc(3).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(p.free_count(), 1);
        assert_eq!(
            p.alloc(2),
            Err(KvError::PoolExhausted {
                requested: 2,
                free: 1
            })
        );
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.used_count(), 3);
        let b = p.alloc(1).unwrap();
        let mut all: Vec<u32> = a.iter().chain(&b).copied().collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
        assert_eq!(p.alloc(0), Ok(vec![]));
        p.check_invariants().unwrap();
    }

    #[test]
    fn refcounts_and_double_free() {
        let mut p = SlotPool::new(2).unwrap();
        let s = p.alloc(1).unwrap()[0];
        p.retain(s).unwrap();
        assert_eq!(p.refcount(s), Ok(2));
        assert_eq!(p.release(s), Ok(false));
        assert_eq!(p.release(s), Ok(true));
        assert!(p.is_free(s).unwrap());
        assert_eq!(p.release(s), Err(KvError::SlotNotInUse { slot: s }));
        assert_eq!(p.retain(s), Err(KvError::SlotNotInUse { slot: s }));
        assert_eq!(
            p.release(7),
            Err(KvError::SlotOutOfRange {
                slot: 7,
                capacity: 2
            })
        );
        assert_eq!(p.free_count(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn release_all_validates_first() {
        let mut p = SlotPool::new(3).unwrap();
        let s = p.alloc(2).unwrap();
        // s[0] listed twice but held once: nothing may change.
        assert!(p.release_all(&[s[1], s[0], s[0]]).is_err());
        assert_eq!(p.refcount(s[0]), Ok(1));
        assert_eq!(p.refcount(s[1]), Ok(1));
        p.retain(s[0]).unwrap();
        let freed = p.release_all(&[s[0], s[1], s[0]]).unwrap();
        assert_eq!(freed, vec![s[1], s[0]]);
        assert_eq!(p.free_count(), 3);
        p.check_invariants().unwrap();
    }

    #[test]
    fn metadata_resets_on_reuse() {
        let mut p = SlotPool::new(1).unwrap();
        let s = p.alloc(1).unwrap()[0];
        p.set_position(s, 42).unwrap();
        p.set_lineage(s, Lineage(9)).unwrap();
        p.touch(s, 5).unwrap();
        assert_eq!(
            (p.position(s), p.lineage(s), p.stamp(s)),
            (Ok(42), Ok(Lineage(9)), Ok(5))
        );
        assert!(p.release(s).unwrap());
        assert_eq!(
            p.set_lineage(s, Lineage(1)),
            Err(KvError::SlotNotInUse { slot: s })
        );
        let t = p.alloc(1).unwrap()[0];
        assert_eq!((p.position(t), p.lineage(t)), (Ok(0), Ok(Lineage::SHARED)));
    }

    #[test]
    fn lineage_serving_rule() {
        assert!(Lineage::SHARED.may_serve(Lineage(3)));
        assert!(Lineage(3).may_serve(Lineage(3)));
        assert!(!Lineage(3).may_serve(Lineage(4)));
        assert!(!Lineage(3).may_serve(Lineage::SHARED));
    }
}
