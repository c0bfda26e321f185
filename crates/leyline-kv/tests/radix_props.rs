//! Property tests of the prefix cache against a naive reference.
//!
//! The reference is a prefix-closed map `(namespace, token prefix) -> slot`: the slot cached
//! for the last token of that prefix. Longest-prefix search walks it one token at a time.
//! External holders (running requests) and locks are tracked beside it, so that after every
//! step each slot's refcount must equal tree references plus external references exactly.

use std::collections::BTreeMap;

use leyline_kv::radix::{LockReceipt, Namespace, PrefixCache};
use leyline_kv::slots::Lineage;
use leyline_kv::KvError;
use proptest::prelude::*;

const CAP: usize = 40;
/// Shared and per-session lineages, a second model, and a second tenant of the first: no
/// match may cross any of them.
const NAMESPACES: [Namespace; 5] = [
    Namespace::shared(0),
    Namespace::new(0, Lineage(1)),
    Namespace::new(0, Lineage(2)),
    Namespace::shared(1),
    Namespace::shared(0).for_tenant(7),
];

type Model = BTreeMap<(Namespace, Vec<u32>), u32>;

#[derive(Debug, Clone)]
enum Op {
    /// A finished request stores its sequence; with `extend` it first reuses the match.
    Insert {
        ns: usize,
        tokens: Vec<u32>,
        extend: bool,
        own_lineage: bool,
    },
    Match {
        ns: usize,
        tokens: Vec<u32>,
    },
    Lock {
        ns: usize,
        tokens: Vec<u32>,
    },
    Unlock {
        pick: usize,
    },
    Evict {
        n: usize,
    },
    /// A running request allocates slots outside the tree.
    Hold {
        n: usize,
    },
    Drop {
        pick: usize,
    },
    Forget {
        ns: usize,
        tokens: Vec<u32>,
        from: usize,
    },
    Purge {
        pick: usize,
    },
    DropNamespace {
        ns: usize,
    },
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(0u32..3, 0..8)
}

fn op() -> impl Strategy<Value = Op> {
    let ns = 0..NAMESPACES.len();
    prop_oneof![
        4 => (ns.clone(), tokens(), any::<bool>(), any::<bool>()).prop_map(
            |(ns, tokens, extend, own_lineage)| Op::Insert { ns, tokens, extend, own_lineage }
        ),
        3 => (ns.clone(), tokens()).prop_map(|(ns, tokens)| Op::Match { ns, tokens }),
        2 => (ns.clone(), tokens()).prop_map(|(ns, tokens)| Op::Lock { ns, tokens }),
        2 => any::<usize>().prop_map(|pick| Op::Unlock { pick }),
        2 => (0..12usize).prop_map(|n| Op::Evict { n }),
        1 => (0..10usize).prop_map(|n| Op::Hold { n }),
        1 => any::<usize>().prop_map(|pick| Op::Drop { pick }),
        1 => (ns.clone(), tokens(), 0..8usize)
            .prop_map(|(ns, tokens, from)| Op::Forget { ns, tokens, from }),
        1 => any::<usize>().prop_map(|pick| Op::Purge { pick }),
        1 => ns.prop_map(|ns| Op::DropNamespace { ns }),
    ]
}

struct World {
    cache: PrefixCache,
    model: Model,
    /// Outstanding external references (one entry per reference).
    held: Vec<Vec<u32>>,
    /// Locks with their path; once a purge detached the locked node, how many tokens of the
    /// path the lock still pins in the tree.
    locks: Vec<(LockReceipt, Namespace, Vec<u32>, Option<usize>)>,
}

fn longest(model: &Model, ns: Namespace, tokens: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    for k in 1..=tokens.len() {
        match model.get(&(ns, tokens[..k].to_vec())) {
            Some(&s) => out.push(s),
            None => break,
        }
    }
    out
}

fn model_of(cache: &PrefixCache) -> Model {
    let mut m = Model::new();
    for (ns, t, s) in cache.sequences() {
        for k in 1..=t.len() {
            m.insert((ns, t[..k].to_vec()), s[k - 1]);
        }
    }
    m
}

impl World {
    fn new() -> Self {
        Self {
            cache: PrefixCache::new(CAP).unwrap(),
            model: Model::new(),
            held: Vec::new(),
            locks: Vec::new(),
        }
    }

    /// Whether a lock protects the entry `(ns, prefix)`.
    fn protected(&self, ns: Namespace, prefix: &[u32]) -> bool {
        self.locks.iter().any(|(_, lns, q, pinned)| {
            *lns == ns && q.starts_with(prefix) && pinned.is_none_or(|k| prefix.len() <= k)
        })
    }

    /// After an eviction: the tree may only have lost unlocked entries; adopt it as model.
    fn sync_after_evict(&mut self) -> Result<(), TestCaseError> {
        let now = model_of(&self.cache);
        for (k, v) in &now {
            prop_assert_eq!(self.model.get(k), Some(v), "eviction invented {:?}", k);
        }
        for (_, ns, q, pinned) in &self.locks {
            for k in 1..=pinned.unwrap_or(q.len()) {
                prop_assert!(
                    now.contains_key(&(*ns, q[..k].to_vec())),
                    "locked entry evicted"
                );
            }
        }
        self.model = now;
        Ok(())
    }

    /// Removes the model entries `gone`, expecting `result` to be the cache's answer.
    fn expect_removal(
        &mut self,
        gone: Vec<(Namespace, Vec<u32>)>,
        result: leyline_kv::Result<leyline_kv::radix::Removed>,
    ) -> Result<(), TestCaseError> {
        if gone.iter().any(|(ns, p)| self.protected(*ns, p)) {
            prop_assert!(
                matches!(result, Err(KvError::NodeLocked(_))),
                "{:?}",
                result
            );
            return Ok(());
        }
        let out = result.map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(out.tokens, gone.len());
        for s in &out.freed {
            prop_assert_eq!(self.cache.pool().refcount(*s).unwrap(), 0);
        }
        for k in gone {
            self.model.remove(&k);
        }
        Ok(())
    }

    fn step(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Insert {
                ns,
                tokens,
                extend,
                own_lineage,
            } => {
                let ns = NAMESPACES[ns];
                let mut slots = Vec::new();
                if extend {
                    let m = self.cache.match_prefix(ns, &tokens);
                    prop_assert_eq!(&m.slots, &longest(&self.model, ns, &tokens));
                    for &s in &m.slots {
                        self.cache.pool_mut().retain(s).unwrap();
                    }
                    slots = m.slots;
                }
                let before = self.cache.pool().free_count();
                let stored_before = self.cache.total_size();
                let need = tokens.len() - slots.len();
                match self.cache.alloc_evicting(need) {
                    Ok((fresh, removed)) => {
                        prop_assert_eq!(
                            before + removed.freed.len() - need,
                            self.cache.pool().free_count()
                        );
                        self.sync_after_evict()?;
                        for &s in &fresh {
                            let l = if own_lineage {
                                ns.lineage
                            } else {
                                Lineage::SHARED
                            };
                            self.cache.pool_mut().set_lineage(s, l).unwrap();
                        }
                        slots.extend(fresh);
                    }
                    Err(e) => {
                        prop_assert!(matches!(e, KvError::PoolExhausted { .. }), "{:?}", e);
                        // A refused allocation evicts nothing: the cache is as it was.
                        prop_assert_eq!(self.cache.pool().free_count(), before);
                        prop_assert_eq!(self.cache.total_size(), stored_before);
                        prop_assert!(before + self.cache.reclaimable() < need);
                        self.sync_after_evict()?;
                        self.cache.pool_mut().release_all(&slots).unwrap();
                        return Ok(());
                    }
                }
                // Reference insert.
                let (mut inserted, mut not_adopted) = (0, Vec::new());
                for k in 1..=tokens.len() {
                    let key = (ns, tokens[..k].to_vec());
                    match self.model.get(&key) {
                        Some(&s) if s != slots[k - 1] => not_adopted.push(slots[k - 1]),
                        Some(_) => {}
                        None => {
                            self.model.insert(key, slots[k - 1]);
                            inserted += 1;
                        }
                    }
                }
                let r = self.cache.insert(ns, &tokens, &slots).unwrap();
                prop_assert_eq!(r.inserted, inserted);
                prop_assert_eq!(r.not_adopted, not_adopted);
                self.cache.pool_mut().release_all(&slots).unwrap();
            }
            Op::Match { ns, tokens } => {
                let ns = NAMESPACES[ns];
                let want = longest(&self.model, ns, &tokens);
                let m = self.cache.match_prefix(ns, &tokens);
                prop_assert_eq!(m.len, want.len());
                prop_assert_eq!(m.node.is_some(), !want.is_empty());
                prop_assert_eq!(m.slots, want);
            }
            Op::Lock { ns, tokens } => {
                let ns = NAMESPACES[ns];
                let m = self.cache.match_prefix(ns, &tokens);
                prop_assert_eq!(&m.slots, &longest(&self.model, ns, &tokens));
                if let Some(node) = m.node {
                    let r = self.cache.lock(node).unwrap();
                    self.locks.push((r, ns, tokens[..m.len].to_vec(), None));
                }
            }
            Op::Unlock { pick } => {
                if !self.locks.is_empty() {
                    let (r, _, _, _) = self.locks.swap_remove(pick % self.locks.len());
                    let out = self.cache.unlock(r).unwrap();
                    prop_assert_eq!(out.tokens, 0);
                    for s in out.freed {
                        prop_assert_eq!(self.cache.pool().refcount(s).unwrap(), 0);
                    }
                }
            }
            Op::Evict { n } => {
                let before = self.cache.pool().free_count();
                let out = self.cache.evict(n);
                prop_assert_eq!(self.cache.pool().free_count(), before + out.freed.len());
                if out.freed.len() < n {
                    prop_assert_eq!(self.cache.evictable_size(), 0);
                }
                let size_before = self.model.len();
                self.sync_after_evict()?;
                prop_assert_eq!(size_before - self.model.len(), out.tokens);
            }
            Op::Hold { n } => {
                let free = self.cache.pool().free_count();
                match self.cache.pool_mut().alloc(n) {
                    Ok(s) => self.held.push(s),
                    Err(e) => {
                        prop_assert_eq!(e, KvError::PoolExhausted { requested: n, free });
                        prop_assert!(n > free);
                    }
                }
            }
            Op::Drop { pick } => {
                if !self.held.is_empty() {
                    let h = self.held.swap_remove(pick % self.held.len());
                    self.cache.pool_mut().release_all(&h).unwrap();
                }
            }
            Op::Forget { ns, tokens, from } => {
                let ns = NAMESPACES[ns];
                let gone: Vec<_> = if tokens.len() > from {
                    let stem = &tokens[..=from];
                    self.model
                        .keys()
                        .filter(|(n, p)| *n == ns && p.starts_with(stem))
                        .cloned()
                        .collect()
                } else {
                    Vec::new()
                };
                let r = self.cache.remove_suffix(ns, &tokens, from);
                self.expect_removal(gone, r)?;
            }
            Op::Purge { pick } => {
                let values: Vec<u32> = self.model.values().copied().collect();
                if values.is_empty() {
                    return Ok(());
                }
                let slot = values[pick % values.len()];
                let gone: Vec<_> = self
                    .model
                    .keys()
                    .filter(|(n, p)| {
                        (1..=p.len()).any(|k| self.model.get(&(*n, p[..k].to_vec())) == Some(&slot))
                    })
                    .cloned()
                    .collect();
                // Locked entries go too: their nodes leave the tree, detached, until unlocked.
                let out = self.cache.purge_slots(&[slot]);
                prop_assert_eq!(out.tokens, gone.len());
                for s in &out.freed {
                    prop_assert_eq!(self.cache.pool().refcount(*s).unwrap(), 0);
                }
                for (_, ns, q, pinned) in &mut self.locks {
                    let cut = gone
                        .iter()
                        .filter(|(n, p)| n == ns && q.starts_with(p))
                        .map(|(_, p)| p.len() - 1)
                        .min();
                    if let Some(cut) = cut {
                        *pinned = Some(pinned.map_or(cut, |k| k.min(cut)));
                    }
                }
                for k in gone {
                    self.model.remove(&k);
                }
            }
            Op::DropNamespace { ns } => {
                let ns = NAMESPACES[ns];
                let gone: Vec<_> = self
                    .model
                    .keys()
                    .filter(|(n, _)| *n == ns)
                    .cloned()
                    .collect();
                let locked = self.locks.iter().any(|(_, n, _, _)| *n == ns);
                let r = self.cache.drop_namespace(ns);
                if locked {
                    prop_assert!(matches!(r, Err(KvError::NodeLocked(_))), "{:?}", r);
                } else {
                    self.expect_removal(gone, r)?;
                }
            }
        }
        self.check()
    }

    fn check(&self) -> Result<(), TestCaseError> {
        self.cache.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(&model_of(&self.cache), &self.model);
        let tree = self.cache.tree_references();
        let mut ext = [0u32; CAP];
        for h in &self.held {
            for &s in h {
                ext[s as usize] += 1;
            }
        }
        for s in 0..CAP {
            let rc = self.cache.pool().refcount(s as u32).unwrap();
            prop_assert_eq!(rc, tree[s] + ext[s], "slot {}", s);
        }
        // Sizes: locked entries are exactly the protected ones.
        let protected = self
            .model
            .keys()
            .filter(|(ns, p)| self.protected(*ns, p))
            .count();
        prop_assert_eq!(self.cache.protected_size(), protected);
        prop_assert_eq!(self.cache.total_size(), self.model.len());
        // No slot of a lineage is reachable from another lineage's namespace.
        for ((ns, _), &s) in &self.model {
            prop_assert!(self.cache.pool().lineage(s).unwrap().may_serve(ns.lineage));
        }
        Ok(())
    }

    /// Gives everything back; the pool must end empty.
    fn teardown(mut self) -> Result<(), TestCaseError> {
        for (r, _, _, _) in std::mem::take(&mut self.locks) {
            self.cache.unlock(r).unwrap();
        }
        for h in std::mem::take(&mut self.held) {
            self.cache.pool_mut().release_all(&h).unwrap();
        }
        self.cache.evict(CAP);
        prop_assert_eq!(self.cache.pool().free_count(), CAP);
        prop_assert_eq!(self.cache.total_size(), 0);
        self.cache.check_invariants().map_err(TestCaseError::fail)?;
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn cache_matches_reference(ops in prop::collection::vec(op(), 1..60)) {
        let mut w = World::new();
        for op in ops {
            w.step(op)?;
        }
        w.teardown()?;
    }
}
