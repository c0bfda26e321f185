//! The radix prefix tree over token ids, and [`PrefixCache`], which owns it together with the
//! [`SlotPool`] whose slots it references. One concept in one file (about 1,000 lines): the
//! tree's lookups, insertion, locks, eviction and FORGET's purge share its private node
//! arena and invariants; the tests live in `radix/tests.rs`.
//!
//! The tree is namespaced by [`Namespace`] `(model, lineage)`: every namespace has its own root
//! and a lookup never leaves its namespace. [`Lineage::SHARED`] namespaces hold lineage-free
//! prefill that every session may match; a session's own namespace holds its edited sequences,
//! whose slots are of its lineage or shared. A session that wants both looks up both
//! ([`PrefixCache::match_prefix_session`]).
//!
//! Ownership: the tree holds one pool reference on every slot it stores. A running sequence
//! holds its own references; e.g. it allocates (refcount 1), inserts when finished (tree takes
//! one: 2), then releases its own (1: the tree's). Locks ([`PrefixCache::lock`]) walk from a
//! node to its root; a locked node is never evicted.
//!
//! FORGET ([`PrefixCache::purge_slots`]) may hit a locked node: a running sequence attends to
//! it. The node is then *detached*: unlinked from its parent, so no lookup finds it again, but
//! kept with its slots until its last lock goes ([`PrefixCache::unlock`] frees them then); its
//! locks still pin the ancestors the sequence also reads. Its slots are revoked in the pool,
//! so [`PrefixCache::insert`] never stores them again.

use std::collections::{BTreeSet, HashMap};

use crate::error::{KvError, Result};
use crate::slots::{Lineage, SlotPool};

/// A tree's namespace: one root per `(model, tenant, lineage)`. Nothing is matched across
/// namespaces, so two tenants never read each other's KV nor learn from a match what the
/// other cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Namespace {
    /// The model (or adapter) whose KV the slots hold.
    pub model: u32,
    /// Whose cache it is (an API key, or a key and a salt); 0 is the default tenant.
    pub tenant: u64,
    /// The edit history the slots may belong to.
    pub lineage: Lineage,
}

impl Namespace {
    /// The namespace `(model, lineage)` of the default tenant.
    pub const fn new(model: u32, lineage: Lineage) -> Self {
        Self {
            model,
            tenant: 0,
            lineage,
        }
    }

    /// The lineage-free namespace of `model` for the default tenant.
    pub const fn shared(model: u32) -> Self {
        Self::new(model, Lineage::SHARED)
    }

    /// The same namespace for `tenant`.
    pub const fn for_tenant(self, tenant: u64) -> Self {
        Self { tenant, ..self }
    }
}

/// A handle on a tree node. It carries a generation, so a handle to a node that was evicted
/// or removed is detected ([`KvError::StaleNode`]) instead of naming a recycled node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId {
    index: u32,
    generation: u32,
}

/// Proof of a lock taken by [`PrefixCache::lock`]; give it back to [`PrefixCache::unlock`].
/// Not `Clone`: one lock, one unlock.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lock held forever pins its slots; give the receipt to unlock"]
pub struct LockReceipt {
    node: NodeId,
}

impl LockReceipt {
    /// The locked node.
    pub fn node(&self) -> NodeId {
        self.node
    }
}

/// What [`PrefixCache::match_prefix`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatchResult {
    /// Slots of the longest cached prefix, in token order (borrowed: lock the node or retain
    /// the slots to keep them).
    pub slots: Vec<u32>,
    /// Matched tokens (`slots.len()`).
    pub len: usize,
    /// The node whose edge ends exactly at `len`; `None` when nothing matched.
    pub node: Option<NodeId>,
}

/// What [`PrefixCache::insert`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InsertResult {
    /// Tokens newly stored (the tree took a reference on each of their slots).
    pub inserted: usize,
    /// Caller slots not adopted because the tree already held a different slot for that
    /// prefix. The caller still owns its reference on them (as on all its slots) and will
    /// usually release it, freeing them.
    pub not_adopted: Vec<u32>,
}

/// What an eviction or removal dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Removed {
    /// Token entries removed from the tree (tree references dropped).
    pub tokens: usize,
    /// Slots whose last reference that was: now free; zero their storage rows if required.
    pub freed: Vec<u32>,
}

/// Lookup statistics since creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Calls of `match_prefix`.
    pub lookups: u64,
    /// Lookups that matched at least one token.
    pub hit_lookups: u64,
    /// Tokens asked for.
    pub queried_tokens: u64,
    /// Tokens matched (cache hit tokens).
    pub matched_tokens: u64,
    /// Tokens newly stored by `insert`.
    pub inserted_tokens: u64,
    /// Tokens dropped by `evict`.
    pub evicted_tokens: u64,
}

#[derive(Debug)]
struct Node {
    ns: Namespace,
    parent: Option<NodeId>,
    /// Edge token ids (empty only at a root).
    key: Vec<u32>,
    /// One slot per edge token.
    slots: Vec<u32>,
    /// Children by the first token of their edge.
    children: HashMap<u32, NodeId>,
    /// Locks through this node (own plus descendants').
    lock_ref: u32,
    /// Locks taken on this node itself.
    own_locks: u32,
    /// Locks of detached former children (counted in `lock_ref`).
    detached_locks: u32,
    /// Unreachable from its root: kept only until its locks are given back.
    detached: bool,
    last_access: u64,
    /// The key under which the node sits in `evictable`, if it does.
    evict_key: Option<u64>,
}

#[derive(Debug)]
struct Entry {
    generation: u32,
    node: Option<Node>,
}

/// The slot pool plus the radix tree over it.
#[derive(Debug)]
pub struct PrefixCache {
    pool: SlotPool,
    arena: Vec<Entry>,
    free_nodes: Vec<u32>,
    roots: HashMap<Namespace, NodeId>,
    /// Unlocked non-root leaves by (last access, id): LRU first.
    evictable: BTreeSet<(u64, NodeId)>,
    evictable_size: usize,
    protected_size: usize,
    detached_size: usize,
    clock: u64,
    stats: CacheStats,
}

// ---------------------------------------------------------------- public API

impl PrefixCache {
    /// An empty tree over a pool of `capacity` slots.
    ///
    /// # Errors
    /// As [`SlotPool::new`].
    pub fn new(capacity: usize) -> Result<Self> {
        Ok(Self::with_pool(SlotPool::new(capacity)?))
    }

    /// An empty tree over `pool` (which may already have slots held outside the tree).
    pub fn with_pool(pool: SlotPool) -> Self {
        Self {
            pool,
            arena: Vec::new(),
            free_nodes: Vec::new(),
            roots: HashMap::new(),
            evictable: BTreeSet::new(),
            evictable_size: 0,
            protected_size: 0,
            detached_size: 0,
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    /// The slot pool.
    pub fn pool(&self) -> &SlotPool {
        &self.pool
    }

    /// The slot pool, mutably: for sequences' own references (alloc, retain, release) and
    /// slot metadata. Releasing a reference the tree holds breaks the invariants.
    pub fn pool_mut(&mut self) -> &mut SlotPool {
        &mut self.pool
    }

    /// Lookup statistics.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Tokens in unlocked nodes (what [`Self::evict`] could drop).
    pub fn evictable_size(&self) -> usize {
        self.evictable_size
    }

    /// Tokens in locked nodes.
    pub fn protected_size(&self) -> usize {
        self.protected_size
    }

    /// Tokens stored in the tree.
    pub fn total_size(&self) -> usize {
        self.evictable_size + self.protected_size
    }

    /// Finds the longest cached prefix of `tokens` in `ns`.
    ///
    /// Side effects: stamps the matched nodes and slots as recently used, and when the match
    /// ends inside an edge, splits that node so that the returned node ends exactly at the
    /// match (the cached content is unchanged). Updates [`Self::stats`].
    pub fn match_prefix(&mut self, ns: Namespace, tokens: &[u32]) -> MatchResult {
        let clock = self.tick();
        self.stats.lookups += 1;
        self.stats.queried_tokens += tokens.len() as u64;
        let mut slots = Vec::new();
        let mut last = None;
        if let Some(&root) = self.roots.get(&ns) {
            let mut cur = root;
            let mut i = 0;
            while i < tokens.len() {
                let Some(child) = self.node(cur).children.get(&tokens[i]).copied() else {
                    break;
                };
                let p = common_prefix(&self.node(child).key, &tokens[i..]);
                let target = if p < self.node(child).key.len() {
                    self.split(child, p)
                } else {
                    child
                };
                self.touch_node(target, clock);
                slots.extend_from_slice(&self.node(target).slots);
                last = Some(target);
                i += p;
                cur = target;
                if target != child {
                    break;
                }
            }
        }
        for &s in &slots {
            // Stored slots are in range; touch cannot fail.
            let _ = self.pool.touch(s, clock);
        }
        let len = slots.len();
        if len > 0 {
            self.stats.hit_lookups += 1;
            self.stats.matched_tokens += len as u64;
        }
        MatchResult {
            slots,
            len,
            node: last,
        }
    }

    /// Length of the longest cached prefix of `tokens` in `ns`, without
    /// [`Self::match_prefix`]'s side effects (no split, no recency stamp, no stats).
    pub fn cached_len(&self, ns: Namespace, tokens: &[u32]) -> usize {
        let Some(&root) = self.roots.get(&ns) else {
            return 0;
        };
        let (mut cur, mut i) = (root, 0);
        while i < tokens.len() {
            let Some(&child) = self.node(cur).children.get(&tokens[i]) else {
                break;
            };
            let key = &self.node(child).key;
            let p = common_prefix(key, &tokens[i..]);
            i += p;
            if p < key.len() {
                break;
            }
            cur = child;
        }
        i
    }

    /// Looks up `tokens` for a session of `lineage`: in its own namespace and in the shared
    /// one of `model`, and returns the longer match (its own on a tie). Both lookups have
    /// [`Self::match_prefix`]'s side effects.
    pub fn match_prefix_session(
        &mut self,
        model: u32,
        lineage: Lineage,
        tokens: &[u32],
    ) -> MatchResult {
        let own = self.match_prefix(Namespace::new(model, lineage), tokens);
        if lineage.is_shared() {
            return own;
        }
        let shared = self.match_prefix(Namespace::shared(model), tokens);
        if shared.len > own.len {
            shared
        } else {
            own
        }
    }

    /// Stores the sequence `tokens` with its `slots` under `ns`. Where the tree already holds
    /// a prefix, it keeps its own slots; the caller's slots there are reported in
    /// [`InsertResult::not_adopted`] (unless they are the very same slots). The tree takes one
    /// reference on each newly stored slot; the caller keeps all of its own references.
    /// Only the part before the first revoked slot ([`SlotPool::revoke`]) is stored.
    ///
    /// Side effects: may split a node; stamps the path as recently used.
    ///
    /// # Errors
    /// Before any change: [`KvError::LengthMismatch`]; an out-of-range or free slot; a slot
    /// whose lineage `ns` may not hold ([`KvError::LineageMismatch`]).
    pub fn insert(&mut self, ns: Namespace, tokens: &[u32], slots: &[u32]) -> Result<InsertResult> {
        if tokens.len() != slots.len() {
            return Err(KvError::LengthMismatch {
                tokens: tokens.len(),
                slots: slots.len(),
            });
        }
        let keep = self.pool.first_revoked(slots);
        let (tokens, slots) = (&tokens[..keep], &slots[..keep]);
        for &s in slots {
            if self.pool.is_free(s)? {
                return Err(KvError::SlotNotInUse { slot: s });
            }
            let l = self.pool.lineage(s)?;
            if !l.may_serve(ns.lineage) {
                return Err(KvError::LineageMismatch {
                    slot: s,
                    slot_lineage: l.0,
                    namespace: ns.lineage.0,
                });
            }
        }
        let mut out = InsertResult::default();
        if tokens.is_empty() {
            return Ok(out);
        }
        let clock = self.tick();
        let mut cur = self.root(ns);
        let mut i = 0;
        while i < tokens.len() {
            let Some(child) = self.node(cur).children.get(&tokens[i]).copied() else {
                let leaf = self.new_leaf(ns, cur, &tokens[i..], &slots[i..], clock);
                debug_assert!(self.node_opt(leaf).is_some());
                out.inserted = tokens.len() - i;
                break;
            };
            let p = common_prefix(&self.node(child).key, &tokens[i..]);
            let target = if p < self.node(child).key.len() {
                self.split(child, p)
            } else {
                child
            };
            for (&mine, &theirs) in self.node(target).slots.iter().zip(&slots[i..i + p]) {
                if mine != theirs {
                    out.not_adopted.push(theirs);
                }
            }
            self.touch_node(target, clock);
            i += p;
            cur = target;
        }
        for &s in slots {
            let _ = self.pool.touch(s, clock);
        }
        self.stats.inserted_tokens += out.inserted as u64;
        Ok(out)
    }

    /// Locks `node` and its ancestors: none of them is evicted or removed until
    /// [`Self::unlock`].
    ///
    /// # Errors
    /// [`KvError::StaleNode`] when `node` no longer exists.
    pub fn lock(&mut self, node: NodeId) -> Result<LockReceipt> {
        self.node_opt(node).ok_or(KvError::StaleNode(node.index))?;
        self.node_mut(node).own_locks += 1;
        let mut cur = Some(node);
        while let Some(id) = cur {
            let n = self.node_mut(id);
            n.lock_ref += 1;
            let (first, len, parent, is_root) =
                (n.lock_ref == 1, n.key.len(), n.parent, n.parent.is_none());
            if first && !is_root {
                self.evictable_size -= len;
                self.protected_size += len;
            }
            self.refresh(id);
            cur = parent;
        }
        Ok(LockReceipt { node })
    }

    /// Gives a lock back. Detached nodes ([`Self::purge_slots`]) that lose their last lock
    /// are deleted; the slots that frees are returned (zero their storage: they were
    /// forgotten).
    ///
    /// # Errors
    /// [`KvError::StaleNode`] for a receipt that is not this cache's (a locked node exists
    /// until unlocked).
    pub fn unlock(&mut self, receipt: LockReceipt) -> Result<Removed> {
        let node = receipt.node;
        match self.node_opt(node) {
            Some(n) if n.own_locks > 0 => {}
            _ => return Err(KvError::StaleNode(node.index)),
        }
        self.node_mut(node).own_locks -= 1;
        let mut dead = Vec::new();
        let mut prev: Option<NodeId> = None;
        let mut cur = Some(node);
        while let Some(id) = cur {
            if let Some(c) = prev.filter(|&c| !self.is_linked(c)) {
                debug_assert_eq!(self.node(c).parent, Some(id));
                self.node_mut(id).detached_locks -= 1;
            }
            let n = self.node_mut(id);
            n.lock_ref -= 1;
            let (last, len, parent, is_root, detached) = (
                n.lock_ref == 0,
                n.key.len(),
                n.parent,
                n.parent.is_none(),
                n.detached,
            );
            if last && detached {
                dead.push(id);
            } else if last && !is_root {
                self.protected_size -= len;
                self.evictable_size += len;
            }
            self.refresh(id);
            prev = cur;
            cur = parent;
        }
        // Deepest first: each is childless by then (a node's locks include its children's).
        let mut out = Removed::default();
        for id in dead {
            self.delete_leaf(id, &mut out);
        }
        Ok(out)
    }

    /// Evicts unlocked leaves, least recently used first (a parent left childless becomes a
    /// candidate), until at least `n_slots` slots were freed or nothing is evictable. Whole
    /// nodes go; a dropped slot still held elsewhere is not freed.
    pub fn evict(&mut self, n_slots: usize) -> Removed {
        let mut out = Removed::default();
        while out.freed.len() < n_slots {
            let Some((_, id)) = self.evictable.pop_first() else {
                break;
            };
            self.node_mut(id).evict_key = None;
            self.delete_leaf(id, &mut out);
        }
        self.stats.evicted_tokens += out.tokens as u64;
        out
    }

    /// Allocates `n` slots (refcount 1, owned by the caller), evicting first if the pool has
    /// too few free. Returns the slots and what the eviction dropped.
    ///
    /// # Errors
    /// [`KvError::PoolExhausted`] when even eviction could not free enough; the tree and the
    /// pool are then unchanged (nothing is evicted for nothing).
    pub fn alloc_evicting(&mut self, n: usize) -> Result<(Vec<u32>, Removed)> {
        let free = self.pool.free_count();
        if n <= free {
            return Ok((self.pool.alloc(n)?, Removed::default()));
        }
        if free + self.reclaimable() < n {
            return Err(KvError::PoolExhausted { requested: n, free });
        }
        let removed = self.evict(n - free);
        Ok((self.pool.alloc(n)?, removed))
    }

    /// Slots that evicting every unlocked entry would free: those held by an unlocked,
    /// reachable node and by nothing else. A lower bound (a slot stored twice in the tree is
    /// not counted); `O(tree)`.
    pub fn reclaimable(&self) -> usize {
        self.arena
            .iter()
            .filter_map(|e| e.node.as_ref())
            .filter(|n| n.parent.is_some() && !n.detached && n.lock_ref == 0)
            .flat_map(|n| &n.slots)
            .filter(|&&s| self.pool.refcount(s).is_ok_and(|r| r == 1))
            .count()
    }

    /// Drops from `ns` every cached entry at position `from` or later along the path of
    /// `tokens`, with everything below it: each of those entries was computed attending to
    /// the token at `from` (FORGET). Positions before `from` stay. A no-op when the tree
    /// holds fewer than `from + 1` tokens of this path.
    ///
    /// # Errors
    /// [`KvError::NodeLocked`] when a node to drop is locked; nothing changes then.
    pub fn remove_suffix(&mut self, ns: Namespace, tokens: &[u32], from: usize) -> Result<Removed> {
        let Some(&root) = self.roots.get(&ns) else {
            return Ok(Removed::default());
        };
        // Find the node holding position `from`, without mutating.
        let mut cur = root;
        let mut depth = 0;
        let (node, offset) = loop {
            let Some(&t) = tokens.get(depth) else {
                return Ok(Removed::default());
            };
            let Some(child) = self.node(cur).children.get(&t).copied() else {
                return Ok(Removed::default());
            };
            let key = &self.node(child).key;
            let p = common_prefix(key, &tokens[depth..]);
            if from < depth + p {
                break (child, from - depth);
            }
            if p < key.len() {
                return Ok(Removed::default());
            }
            depth += p;
            cur = child;
        };
        if self.node(node).lock_ref > 0 {
            return Err(KvError::NodeLocked(node.index));
        }
        let mut out = Removed::default();
        self.cut(node, offset, &mut out);
        Ok(out)
    }

    /// Drops, in every namespace, each node holding any of `slots` from the first such slot
    /// on, with everything below it. Afterwards no cached path contains those slots, and
    /// those of them still in use, with every slot of a detached node, are revoked. A locked
    /// part is detached rather than dropped (module docs): [`Removed::tokens`] counts it, its
    /// slots are freed by the last [`Self::unlock`].
    pub fn purge_slots(&mut self, slots: &[u32]) -> Removed {
        let set: std::collections::HashSet<u32> = slots.iter().copied().collect();
        let mut hits = Vec::new();
        for (index, e) in self.arena.iter().enumerate() {
            let Some(n) = &e.node else { continue };
            if n.detached {
                continue;
            }
            if let Some(off) = n.slots.iter().position(|s| set.contains(s)) {
                hits.push((
                    NodeId {
                        index: index as u32,
                        generation: e.generation,
                    },
                    off,
                ));
            }
        }
        let mut out = Removed::default();
        for (id, off) in hits {
            // An earlier hit may have removed or detached this one with its ancestor.
            if self.node_opt(id).is_some_and(|n| !n.detached) {
                if self.node(id).lock_ref > 0 {
                    self.detach(id, off, &mut out);
                } else {
                    self.cut(id, off, &mut out);
                }
            }
        }
        for &x in slots {
            if self.pool.refcount(x).is_ok_and(|r| r > 0) {
                let _ = self.pool.revoke(x);
            }
        }
        out
    }

    /// Drops the whole tree of `ns` (a deleted session).
    ///
    /// # Errors
    /// [`KvError::NodeLocked`] when any of its nodes is locked; nothing changes then.
    pub fn drop_namespace(&mut self, ns: Namespace) -> Result<Removed> {
        let Some(&root) = self.roots.get(&ns) else {
            return Ok(Removed::default());
        };
        if self.node(root).lock_ref > 0 {
            return Err(KvError::NodeLocked(root.index));
        }
        let mut out = Removed::default();
        let children: Vec<NodeId> = self.node(root).children.values().copied().collect();
        for c in children {
            self.delete_subtree(c, &mut out);
        }
        self.roots.remove(&ns);
        self.free_node(root);
        Ok(out)
    }

    /// Every cached sequence: `(namespace, tokens, slots)` per root-to-leaf path, sorted.
    /// For tests and debugging; `O(tree)`.
    pub fn sequences(&self) -> Vec<(Namespace, Vec<u32>, Vec<u32>)> {
        let mut out = Vec::new();
        for (&ns, &root) in &self.roots {
            let mut stack = vec![(root, Vec::new(), Vec::new())];
            while let Some((id, mut t, mut s)) = stack.pop() {
                let n = self.node(id);
                t.extend_from_slice(&n.key);
                s.extend_from_slice(&n.slots);
                if n.children.is_empty() {
                    if !t.is_empty() {
                        out.push((ns, t, s));
                    }
                } else {
                    for &c in n.children.values() {
                        stack.push((c, t.clone(), s.clone()));
                    }
                }
            }
        }
        out.sort();
        out
    }

    /// How many references the tree holds on each slot (indexed by slot).
    pub fn tree_references(&self) -> Vec<u32> {
        let mut refs = vec![0u32; self.pool.capacity()];
        for n in self.arena.iter().filter_map(|e| e.node.as_ref()) {
            for &s in &n.slots {
                if let Some(r) = refs.get_mut(s as usize) {
                    *r += 1;
                }
            }
        }
        refs
    }

    /// Checks the pool's and the tree's invariants: free xor referenced; each slot's refcount
    /// at least the tree's references on it; links, keys, lock counts, sizes and the eviction
    /// set consistent; every slot stored under a namespace its lineage may serve.
    ///
    /// # Errors
    /// A description of the first violation.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.pool.check_invariants()?;
        for (s, &r) in self.tree_references().iter().enumerate() {
            let rc = self.pool.refcount(s as u32).map_err(|e| e.to_string())?;
            if rc < r {
                return Err(format!("slot {s}: refcount {rc} < {r} tree references"));
            }
        }
        let (mut evictable, mut protected, mut detached, mut set_len) = (0, 0, 0, 0);
        for (index, e) in self.arena.iter().enumerate() {
            let Some(n) = &e.node else { continue };
            let id = NodeId {
                index: index as u32,
                generation: e.generation,
            };
            if n.key.len() != n.slots.len() {
                return Err(format!(
                    "node {index}: {} keys, {} slots",
                    n.key.len(),
                    n.slots.len()
                ));
            }
            let mut child_locks = 0;
            for (&t, &c) in &n.children {
                let cn = self
                    .node_opt(c)
                    .ok_or(format!("node {index}: dead child"))?;
                if cn.parent != Some(id) || cn.key.first() != Some(&t) || cn.ns != n.ns {
                    return Err(format!("node {index}: bad child link {t}"));
                }
                child_locks += cn.lock_ref;
            }
            if n.lock_ref != n.own_locks + child_locks + n.detached_locks {
                return Err(format!(
                    "node {index}: lock_ref {} != own + children",
                    n.lock_ref
                ));
            }
            for &s in &n.slots {
                let l = self.pool.lineage(s).map_err(|e| e.to_string())?;
                if !l.may_serve(n.ns.lineage) {
                    return Err(format!(
                        "slot {s} of lineage {l} under lineage {}",
                        n.ns.lineage
                    ));
                }
            }
            match n.parent {
                None => {
                    if self.roots.get(&n.ns) != Some(&id) || !n.key.is_empty() {
                        return Err(format!("node {index}: bad root"));
                    }
                }
                Some(p) => {
                    let pn = self
                        .node_opt(p)
                        .ok_or(format!("node {index}: dead parent"))?;
                    let linked = n.key.first().and_then(|t| pn.children.get(t)) == Some(&id);
                    if n.key.is_empty() || !(linked || n.detached) {
                        return Err(format!("node {index}: not its parent's child"));
                    }
                    if pn.detached && !n.detached {
                        return Err(format!("node {index}: live under a detached parent"));
                    }
                    if n.detached {
                        if n.lock_ref == 0 {
                            return Err(format!("node {index}: detached without locks"));
                        }
                        detached += n.key.len();
                    } else if n.lock_ref > 0 {
                        protected += n.key.len();
                    } else {
                        evictable += n.key.len();
                    }
                }
            }
            let want =
                (n.parent.is_some() && n.children.is_empty() && n.lock_ref == 0 && !n.detached)
                    .then_some(n.last_access);
            if n.evict_key != want || want.is_some_and(|a| !self.evictable.contains(&(a, id))) {
                return Err(format!("node {index}: eviction set out of date"));
            }
            set_len += usize::from(want.is_some());
        }
        if set_len != self.evictable.len() {
            return Err("eviction set holds dead nodes".into());
        }
        if (evictable, protected, detached)
            != (self.evictable_size, self.protected_size, self.detached_size)
        {
            return Err(format!(
                "sizes: counted {evictable}/{protected}/{detached}, kept {}/{}/{}",
                self.evictable_size, self.protected_size, self.detached_size
            ));
        }
        Ok(())
    }
}

/// Length of the longest common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

// ---------------------------------------------------------------- internals

impl PrefixCache {
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn node_opt(&self, id: NodeId) -> Option<&Node> {
        self.arena
            .get(id.index as usize)
            .filter(|e| e.generation == id.generation)
            .and_then(|e| e.node.as_ref())
    }

    /// A live node. Internal ids are live by construction.
    fn node(&self, id: NodeId) -> &Node {
        self.arena[id.index as usize]
            .node
            .as_ref()
            .expect("live node")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        debug_assert_eq!(self.arena[id.index as usize].generation, id.generation);
        self.arena[id.index as usize]
            .node
            .as_mut()
            .expect("live node")
    }

    fn alloc_node(&mut self, node: Node) -> NodeId {
        if let Some(index) = self.free_nodes.pop() {
            let e = &mut self.arena[index as usize];
            e.node = Some(node);
            NodeId {
                index,
                generation: e.generation,
            }
        } else {
            let index = self.arena.len() as u32;
            self.arena.push(Entry {
                generation: 0,
                node: Some(node),
            });
            NodeId {
                index,
                generation: 0,
            }
        }
    }

    fn free_node(&mut self, id: NodeId) {
        let e = &mut self.arena[id.index as usize];
        e.node = None;
        e.generation = e.generation.wrapping_add(1);
        self.free_nodes.push(id.index);
    }

    fn root(&mut self, ns: Namespace) -> NodeId {
        if let Some(&r) = self.roots.get(&ns) {
            return r;
        }
        let r = self.alloc_node(Node {
            ns,
            parent: None,
            key: Vec::new(),
            slots: Vec::new(),
            children: HashMap::new(),
            lock_ref: 0,
            own_locks: 0,
            detached_locks: 0,
            detached: false,
            last_access: 0,
            evict_key: None,
        });
        self.roots.insert(ns, r);
        r
    }

    /// Puts `id` into or out of the eviction set as its state requires.
    fn refresh(&mut self, id: NodeId) {
        let n = self.node(id);
        let want = (n.parent.is_some() && n.children.is_empty() && n.lock_ref == 0 && !n.detached)
            .then_some(n.last_access);
        let have = n.evict_key;
        if want == have {
            return;
        }
        if let Some(a) = have {
            self.evictable.remove(&(a, id));
        }
        if let Some(a) = want {
            self.evictable.insert((a, id));
        }
        self.node_mut(id).evict_key = want;
    }

    fn touch_node(&mut self, id: NodeId, clock: u64) {
        self.node_mut(id).last_access = clock;
        self.refresh(id);
    }

    /// A new leaf under `parent`; the tree retains its slots (checked in use by the caller).
    fn new_leaf(
        &mut self,
        ns: Namespace,
        parent: NodeId,
        key: &[u32],
        slots: &[u32],
        clock: u64,
    ) -> NodeId {
        for &s in slots {
            let r = self.pool.retain(s);
            debug_assert!(r.is_ok());
        }
        let id = self.alloc_node(Node {
            ns,
            parent: Some(parent),
            key: key.to_vec(),
            slots: slots.to_vec(),
            children: HashMap::new(),
            lock_ref: 0,
            own_locks: 0,
            detached_locks: 0,
            detached: false,
            last_access: clock,
            evict_key: None,
        });
        self.node_mut(parent).children.insert(key[0], id);
        self.evictable_size += key.len();
        self.refresh(parent);
        self.refresh(id);
        id
    }

    /// Splits `child`'s edge after `p` tokens (0 < p < len): a new node takes the first `p`
    /// and becomes `child`'s parent; `child` keeps its id and the rest. Returns the new node.
    fn split(&mut self, child: NodeId, p: usize) -> NodeId {
        let linked = self.is_linked(child);
        let c = self.node_mut(child);
        debug_assert!(p > 0 && p < c.key.len());
        let rest_key = c.key.split_off(p);
        let rest_slots = c.slots.split_off(p);
        let head_key = std::mem::replace(&mut c.key, rest_key);
        let head_slots = std::mem::replace(&mut c.slots, rest_slots);
        let (ns, parent, lock_ref, last_access, detached) =
            (c.ns, c.parent, c.lock_ref, c.last_access, c.detached);
        let next = c.key[0];
        let first = head_key[0];
        let mid = self.alloc_node(Node {
            ns,
            parent,
            key: head_key,
            slots: head_slots,
            children: HashMap::from([(next, child)]),
            lock_ref,
            own_locks: 0,
            detached_locks: 0,
            detached,
            last_access,
            evict_key: None,
        });
        self.node_mut(child).parent = Some(mid);
        if let Some(par) = parent {
            if linked {
                self.node_mut(par).children.insert(first, mid);
            } else {
                // `child` hung detached from `par`; `mid` takes its place there.
                self.node_mut(mid).detached = true;
            }
        }
        mid
    }

    /// Whether `id` is its parent's child (roots count as linked). Only the top node of a
    /// detached subtree is not.
    fn is_linked(&self, id: NodeId) -> bool {
        let n = self.node(id);
        match n.parent {
            None => true,
            Some(p) => n
                .key
                .first()
                .and_then(|t| self.node(p).children.get(t))
                .is_some_and(|&c| c == id),
        }
    }

    /// Takes `node`'s edge from `offset` on, with its locked descendants, out of the tree;
    /// its unlocked descendants are deleted. The locks keep pinning the ancestors.
    fn detach(&mut self, node: NodeId, offset: usize, out: &mut Removed) {
        if offset > 0 {
            self.split(node, offset);
        }
        let mut stack = vec![node];
        let mut kept = Vec::new();
        while let Some(n) = stack.pop() {
            kept.push(n);
            let children: Vec<NodeId> = self.node(n).children.values().copied().collect();
            for c in children {
                if self.node(c).lock_ref > 0 {
                    stack.push(c);
                } else {
                    self.delete_subtree(c, out);
                }
            }
        }
        let n = self.node(node);
        let (parent, first, locks) = (n.parent, n.key[0], n.lock_ref);
        if let Some(p) = parent {
            let pn = self.node_mut(p);
            pn.children.remove(&first);
            pn.detached_locks += locks;
            self.refresh(p);
        }
        for id in kept {
            let n = self.node_mut(id);
            n.detached = true;
            let len = n.key.len();
            let slots = n.slots.clone();
            self.protected_size -= len;
            self.detached_size += len;
            out.tokens += len;
            for s in slots {
                let _ = self.pool.revoke(s);
            }
            self.refresh(id);
        }
    }

    /// Removes `node`'s edge from `offset` on, and its whole subtree (unlocked, checked).
    fn cut(&mut self, node: NodeId, offset: usize, out: &mut Removed) {
        if offset > 0 {
            // `node` keeps its id as the lower part; the new head stays in the tree.
            self.split(node, offset);
        }
        self.delete_subtree(node, out);
    }

    fn delete_subtree(&mut self, id: NodeId, out: &mut Removed) {
        let mut stack = vec![id];
        let mut order = Vec::new();
        while let Some(n) = stack.pop() {
            order.push(n);
            stack.extend(self.node(n).children.values().copied());
        }
        // Children before parents, so each is a leaf when deleted.
        for &n in order.iter().rev() {
            let key = self.node(n).evict_key;
            if let Some(a) = key {
                self.evictable.remove(&(a, n));
                self.node_mut(n).evict_key = None;
            }
            self.delete_leaf(n, out);
        }
    }

    /// Unlinks a childless non-root node, releases its slots and frees it.
    fn delete_leaf(&mut self, id: NodeId, out: &mut Removed) {
        let n = self.node(id);
        debug_assert!(n.children.is_empty() && n.evict_key.is_none());
        let (parent, first, len, locked, detached) =
            (n.parent, n.key[0], n.key.len(), n.lock_ref > 0, n.detached);
        let linked = self.is_linked(id);
        let slots = std::mem::take(&mut self.node_mut(id).slots);
        for s in slots {
            if let Ok(true) = self.pool.release(s) {
                out.freed.push(s);
            }
        }
        if detached {
            // Counted in `tokens` when it was detached.
            self.detached_size -= len;
        } else {
            out.tokens += len;
            if locked {
                self.protected_size -= len;
            } else {
                self.evictable_size -= len;
            }
        }
        self.free_node(id);
        if let (Some(p), true) = (parent, linked) {
            self.node_mut(p).children.remove(&first);
            self.refresh(p);
        }
    }
}

#[cfg(test)]
mod tests;
