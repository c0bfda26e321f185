//! Unit tests of the prefix cache: splitting, namespaces, LRU eviction, removal.

use super::*;

const NS: Namespace = Namespace::shared(0);

/// Allocates slots for `tokens`, inserts them and drops the caller's references, as a
/// finished request would. Returns the slots passed in.
fn put(c: &mut PrefixCache, ns: Namespace, tokens: &[u32]) -> Vec<u32> {
    let slots = c.pool_mut().alloc(tokens.len()).unwrap();
    for &s in &slots {
        c.pool_mut().set_lineage(s, ns.lineage).unwrap();
    }
    c.insert(ns, tokens, &slots).unwrap();
    c.pool_mut().release_all(&slots).unwrap();
    c.check_invariants().unwrap();
    slots
}

#[test]
fn cached_len_agrees_with_match_and_changes_nothing() {
    let mut c = PrefixCache::new(16).unwrap();
    put(&mut c, NS, &[1, 2, 3, 4]);
    put(&mut c, NS, &[1, 2, 7]);
    let before = (c.stats(), c.sequences());
    let queries: [&[u32]; 6] = [
        &[1, 2, 3, 4, 5],
        &[1, 2, 3],
        &[1, 2, 7, 8],
        &[1, 9],
        &[5],
        &[],
    ];
    let peeked: Vec<usize> = queries.iter().map(|q| c.cached_len(NS, q)).collect();
    assert_eq!((c.stats(), c.sequences()), before);
    let other = Namespace::new(0, Lineage(3));
    assert_eq!(c.cached_len(other, &[1, 2, 3]), 0);
    let matched: Vec<usize> = queries.iter().map(|q| c.match_prefix(NS, q).len).collect();
    assert_eq!(peeked, matched);
    assert_eq!(peeked, vec![4, 3, 3, 1, 0, 0]);
}

#[test]
fn match_splits_inside_an_edge() {
    let mut c = PrefixCache::new(16).unwrap();
    let s = put(&mut c, NS, &[1, 2, 3, 4]);
    let m = c.match_prefix(NS, &[1, 2, 9]);
    assert_eq!((m.len, m.slots.clone()), (2, s[..2].to_vec()));
    c.check_invariants().unwrap();
    // The split kept the content: the full sequence still matches.
    let full = c.match_prefix(NS, &[1, 2, 3, 4, 5]);
    assert_eq!(full.slots, s);
    assert_ne!(full.node, m.node);
    assert_eq!(c.sequences(), vec![(NS, vec![1, 2, 3, 4], s.clone())]);
    // Locking the split-off head protects two tokens, leaves two evictable.
    let r = c.lock(m.node.unwrap()).unwrap();
    assert_eq!((c.protected_size(), c.evictable_size()), (2, 2));
    c.check_invariants().unwrap();
    c.unlock(r).unwrap();
    assert_eq!((c.protected_size(), c.evictable_size()), (0, 4));
}

#[test]
fn insert_keeps_existing_prefix_and_reports_duplicates() {
    let mut c = PrefixCache::new(16).unwrap();
    let a = put(&mut c, NS, &[1, 2, 3]);
    let b = c.pool_mut().alloc(5).unwrap();
    // Reuse the tree's first slot, as a request that matched it would.
    let mut mine = b.clone();
    mine[0] = a[0];
    c.pool_mut().retain(a[0]).unwrap();
    let r = c.insert(NS, &[1, 2, 7, 8, 9], &mine).unwrap();
    assert_eq!(r.inserted, 3);
    assert_eq!(r.not_adopted, vec![b[1]]);
    let freed = c.pool_mut().release_all(&mine).unwrap();
    assert!(freed.contains(&b[1]) && freed.len() == 1, "{freed:?}");
    let m = c.match_prefix(NS, &[1, 2, 7, 8, 9]);
    assert_eq!(m.slots, vec![a[0], a[1], b[2], b[3], b[4]]);
    assert_eq!(c.pool().refcount(a[0]), Ok(1));
    c.check_invariants().unwrap();
}

#[test]
fn insert_validates_before_changing() {
    let mut c = PrefixCache::new(4).unwrap();
    let s = c.pool_mut().alloc(2).unwrap();
    assert_eq!(
        c.insert(NS, &[1], &s),
        Err(KvError::LengthMismatch {
            tokens: 1,
            slots: 2
        })
    );
    assert_eq!(
        c.insert(NS, &[1, 2], &[s[0], 3]),
        Err(KvError::SlotNotInUse { slot: 3 })
    );
    c.pool_mut().set_lineage(s[1], Lineage(5)).unwrap();
    assert!(
        matches!(c.insert(NS, &[1, 2], &s), Err(KvError::LineageMismatch { slot, .. }) if slot == s[1])
    );
    assert!(c.sequences().is_empty());
    assert_eq!(c.pool().refcount(s[0]), Ok(1));
    c.check_invariants().unwrap();
}

#[test]
fn namespaces_are_isolated() {
    let mut c = PrefixCache::new(32).unwrap();
    let l1 = Namespace::new(0, Lineage(1));
    let l2 = Namespace::new(0, Lineage(2));
    let other_model = Namespace::shared(1);
    let shared = put(&mut c, NS, &[1, 2, 3]);
    let own = put(&mut c, l1, &[1, 2, 3, 4]);
    assert_eq!(c.match_prefix(l2, &[1, 2, 3, 4]).len, 0);
    assert_eq!(c.match_prefix(other_model, &[1, 2, 3]).len, 0);
    // Another tenant shares nothing, not even lineage-free slots.
    assert_eq!(c.match_prefix(NS.for_tenant(3), &[1, 2, 3]).len, 0);
    assert_eq!(c.cached_len(NS.for_tenant(3), &[1, 2, 3]), 0);
    assert_eq!(c.match_prefix(NS, &[1, 2, 3, 4]).slots, shared);
    assert_eq!(c.match_prefix(l1, &[1, 2, 3, 4]).slots, own);
    // A session sees the shared namespace and its own, never another lineage's.
    assert_eq!(
        c.match_prefix_session(0, Lineage(2), &[1, 2, 3, 4]).slots,
        shared
    );
    assert_eq!(
        c.match_prefix_session(0, Lineage(1), &[1, 2, 3, 4]).slots,
        own
    );
    // Lineage-1 slots cannot enter lineage 2 or the shared namespace.
    c.pool_mut().retain(own[3]).unwrap();
    assert!(c.insert(l2, &[9], &own[3..]).is_err());
    assert!(c.insert(NS, &[9], &own[3..]).is_err());
    // Shared slots may also be stored under a lineage (an edited sequence's prefix).
    assert!(c.insert(l2, &[1, 2, 3], &shared).is_ok());
    c.pool_mut().release(own[3]).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn evicts_lru_leaves_first_and_never_locked_ones() {
    let mut c = PrefixCache::new(32).unwrap();
    let a = put(&mut c, NS, &[1, 1]);
    let b = put(&mut c, NS, &[2, 2]);
    let d = put(&mut c, NS, &[3, 3]);
    let e = put(&mut c, NS, &[4, 4]);
    c.match_prefix(NS, &[1, 1]); // a is now the most recent
    let locked = c.match_prefix(NS, &[2, 2]).node.unwrap();
    let r = c.lock(locked).unwrap();
    // Order by recency: d (3), e (4), a (touched), b locked.
    let out = c.evict(2);
    assert_eq!(out.tokens, 2);
    assert_eq!(sorted(out.freed), sorted(d.clone()));
    let out = c.evict(3);
    assert_eq!(
        sorted(out.freed),
        sorted(e.iter().chain(&a).copied().collect())
    );
    assert_eq!(c.evict(100), Removed::default());
    assert_eq!(c.match_prefix(NS, &[2, 2]).slots, b);
    c.check_invariants().unwrap();
    c.unlock(r).unwrap();
    assert_eq!(c.evict(1).freed.len(), 2);
    assert_eq!(c.pool().free_count(), 32);
    c.check_invariants().unwrap();
}

#[test]
fn eviction_climbs_to_parents_and_spares_held_slots() {
    let mut c = PrefixCache::new(8).unwrap();
    let s = put(&mut c, NS, &[1, 2, 3]);
    put(&mut c, NS, &[1, 2, 4]);
    // A request still holds s[0]: dropping the tree's reference does not free it.
    c.pool_mut().retain(s[0]).unwrap();
    let out = c.evict(8);
    assert_eq!(out.tokens, 4);
    assert_eq!(out.freed.len(), 3);
    assert!(!out.freed.contains(&s[0]));
    assert_eq!(c.pool().refcount(s[0]), Ok(1));
    assert_eq!(c.total_size(), 0);
    c.check_invariants().unwrap();
}

#[test]
fn alloc_evicting_and_exhaustion() {
    let mut c = PrefixCache::new(4).unwrap();
    put(&mut c, NS, &[1, 2, 3]);
    let (s, removed) = c.alloc_evicting(2).unwrap();
    assert_eq!((s.len(), removed.freed.len()), (2, 3));
    assert_eq!(
        c.alloc_evicting(3).map(|_| ()),
        Err(KvError::PoolExhausted {
            requested: 3,
            free: 2
        })
    );
    c.check_invariants().unwrap();
    // A refused allocation evicts nothing: the cached entry that could not make room stays.
    c.pool_mut().release_all(&s).unwrap();
    put(&mut c, NS, &[7]);
    assert_eq!(c.reclaimable(), 1);
    let held = c.pool_mut().alloc(3).unwrap();
    assert!(c.alloc_evicting(2).is_err());
    assert_eq!((c.total_size(), c.pool().free_count()), (1, 0));
    assert_eq!(c.alloc_evicting(1).unwrap().1.freed.len(), 1);
    c.pool_mut().release_all(&held).unwrap();
}

#[test]
fn remove_suffix_forgets_everything_after() {
    let mut c = PrefixCache::new(32).unwrap();
    let l = Namespace::new(0, Lineage(7));
    let a = put(&mut c, l, &[1, 2, 3, 4]);
    let b = put(&mut c, l, &[1, 2, 3, 5, 6]);
    put(&mut c, l, &[1, 9]);
    // Forget from position 2 along [1,2,3,4]: both branches through token 3 go.
    let out = c.remove_suffix(l, &[1, 2, 3, 4], 2).unwrap();
    // [1,2,3] of the second sequence was already cached (a's slots); b[3..] was adopted.
    assert_eq!(out.tokens, 4);
    assert_eq!(sorted(out.freed), sorted(vec![a[2], a[3], b[3], b[4]]));
    assert_eq!(c.match_prefix(l, &[1, 2, 3, 5]).len, 2);
    assert_eq!(c.match_prefix(l, &[1, 9]).len, 2);
    c.check_invariants().unwrap();
    // Past the cached path: nothing to do.
    assert_eq!(c.remove_suffix(l, &[1, 2], 2).unwrap(), Removed::default());
    assert_eq!(
        c.remove_suffix(l, &[1, 8, 8], 1).unwrap(),
        Removed::default()
    );
    // Locked: refused, unchanged.
    let n = c.match_prefix(l, &[1, 2]).node.unwrap();
    let r = c.lock(n).unwrap();
    assert_eq!(
        c.remove_suffix(l, &[1, 2], 1),
        Err(KvError::NodeLocked(n.index))
    );
    assert_eq!(c.match_prefix(l, &[1, 2]).len, 2);
    c.unlock(r).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn purge_slots_and_drop_namespace() {
    let mut c = PrefixCache::new(32).unwrap();
    let l = Namespace::new(0, Lineage(3));
    let s = put(&mut c, NS, &[1, 2, 3]);
    for &x in &s {
        c.pool_mut().retain(x).unwrap();
    }
    c.insert(l, &[1, 2, 3], &s).unwrap();
    c.pool_mut().release_all(&s).unwrap();
    let out = c.purge_slots(&[s[1]]);
    assert_eq!(out.tokens, 4);
    assert_eq!(sorted(out.freed), sorted(vec![s[1], s[2]]));
    for ns in [NS, l] {
        assert_eq!(c.match_prefix(ns, &[1, 2, 3]).slots, vec![s[0]]);
    }
    c.check_invariants().unwrap();
    let out = c.drop_namespace(l).unwrap();
    assert_eq!((out.tokens, out.freed.len()), (1, 0));
    assert_eq!(c.match_prefix(NS, &[1]).len, 1);
    assert_eq!(c.match_prefix(l, &[1]).len, 0);
    c.check_invariants().unwrap();
}

#[test]
fn stale_ids_and_stats() {
    let mut c = PrefixCache::new(8).unwrap();
    put(&mut c, NS, &[1, 2]);
    let n = c.match_prefix(NS, &[1, 2]).node.unwrap();
    c.match_prefix(NS, &[5]);
    c.evict(2);
    assert_eq!(c.lock(n), Err(KvError::StaleNode(n.index)));
    put(&mut c, NS, &[3]); // may recycle the arena entry
    assert_eq!(c.lock(n), Err(KvError::StaleNode(n.index)));
    let st = c.stats();
    assert_eq!(
        (
            st.lookups,
            st.hit_lookups,
            st.queried_tokens,
            st.matched_tokens
        ),
        (2, 1, 3, 2)
    );
    assert_eq!((st.inserted_tokens, st.evicted_tokens), (3, 2));
}

fn sorted(mut v: Vec<u32>) -> Vec<u32> {
    v.sort_unstable();
    v
}

#[test]
fn purging_a_locked_path_detaches_it_until_the_last_unlock() {
    let mut c = PrefixCache::new(32).unwrap();
    let s = put(&mut c, NS, &[1, 2, 3, 4]);
    let t = put(&mut c, NS, &[1, 2, 7]);
    let m = c.match_prefix(NS, &[1, 2, 3, 4]);
    let held = c.lock(m.node.unwrap()).unwrap();
    let out = c.purge_slots(&[s[2]]);
    // [3, 4] leave the tree but stay allocated: the lock's holder still attends to them.
    assert_eq!(out.tokens, 2);
    assert!(out.freed.is_empty());
    assert_eq!(c.match_prefix(NS, &[1, 2, 3, 4]).len, 2);
    assert_eq!(c.match_prefix(NS, &[1, 2, 7]).slots, vec![s[0], s[1], t[2]]);
    assert!(c.pool().first_revoked(&s) == 2);
    c.check_invariants().unwrap();
    // The head the holder reads is still pinned: eviction cannot take it.
    c.evict(32);
    assert_eq!(c.match_prefix(NS, &[1, 2]).slots, s[..2].to_vec());
    assert_eq!(c.pool().refcount(s[2]).unwrap(), 1);
    // Revoked slots are not stored again, nor anything after them.
    let fresh = c.pool_mut().alloc(1).unwrap();
    let path = [s[0], s[1], s[2], s[3], fresh[0]];
    let r = c.insert(NS, &[1, 2, 3, 4, 5], &path).unwrap();
    assert_eq!(r.inserted, 0);
    assert_eq!(c.match_prefix(NS, &[1, 2, 3]).len, 2);
    c.pool_mut().release_all(&fresh).unwrap();
    c.check_invariants().unwrap();
    let out = c.unlock(held).unwrap();
    assert_eq!(sorted(out.freed), sorted(s[2..].to_vec()));
    assert_eq!(out.tokens, 0);
    c.check_invariants().unwrap();
    c.evict(32);
    assert_eq!(c.pool().free_count(), 32);
    c.check_invariants().unwrap();
}

#[test]
fn a_purge_that_splits_a_locked_edge_keeps_the_head_pinned() {
    let mut c = PrefixCache::new(32).unwrap();
    let s = put(&mut c, NS, &[1, 2, 3, 4, 5, 6]);
    let node = c.match_prefix(NS, &[1, 2, 3, 4, 5, 6]).node.unwrap();
    let a = c.lock(node).unwrap();
    let b = c.lock(node).unwrap();
    let out = c.purge_slots(&[s[4]]);
    assert_eq!((out.tokens, out.freed.len()), (2, 0));
    c.check_invariants().unwrap();
    c.evict(32);
    assert_eq!(
        c.match_prefix(NS, &[1, 2, 3, 4, 5, 6]).slots,
        s[..4].to_vec()
    );
    assert!(
        c.unlock(a).unwrap().freed.is_empty(),
        "the second lock still holds"
    );
    c.check_invariants().unwrap();
    assert_eq!(sorted(c.unlock(b).unwrap().freed), sorted(s[4..].to_vec()));
    c.check_invariants().unwrap();
    c.evict(32);
    assert_eq!(c.pool().free_count(), 32);
}
