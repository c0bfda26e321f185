//! Stored responses (`store: true` on `POST /v1/responses`): each response object with the
//! conversation that led to it and its output, as chat messages, so that
//! `previous_response_id` can continue it and `GET` / `DELETE /v1/responses/{id}` can read
//! and remove it.
//!
//! Design decision: the store is memory only and bounded by a count
//! (`--responses-store N`, least recently used goes first), like the engine's cached
//! conversations: a response that is gone answers 404 `previous_response_not_found` and the
//! client resends its history. An entry is owned by the key that stored it; under another
//! key it answers exactly like a missing one.

use crate::auth::Principal;
use leyline_model::chat::ChatMessage;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

/// One stored response.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredResponse {
    /// The key that stored it.
    pub owner: Principal,
    /// The response object, as `GET` returns it.
    pub response: Value,
    /// Its whole conversation: the inputs of every response it continues and their outputs,
    /// then its own input and output (never `instructions`, which are not carried over).
    pub conversation: Vec<ChatMessage>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Id to (entry, last use).
    map: HashMap<String, (Arc<StoredResponse>, u64)>,
    /// Last use to id: the first is the least recently used.
    order: BTreeMap<u64, String>,
    tick: u64,
}

impl Inner {
    fn touch(&mut self, id: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some((_, used)) = self.map.get_mut(id) {
            self.order.remove(used);
            *used = tick;
            self.order.insert(tick, id.to_string());
        }
    }
}

/// The bounded store of responses.
#[derive(Debug, Default)]
pub struct ResponseStore {
    capacity: usize,
    inner: Mutex<Inner>,
}

impl ResponseStore {
    /// A store that keeps at most `capacity` responses (0: none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::default(),
        }
    }

    /// Whether responses are kept at all.
    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data; keep serving.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `stored` under `id`, dropping the least recently used responses beyond the
    /// capacity.
    pub fn insert(&self, id: String, stored: StoredResponse) {
        if !self.enabled() {
            return;
        }
        let mut g = self.lock();
        if let Some((_, used)) = g.map.remove(&id) {
            g.order.remove(&used);
        }
        while g.map.len() >= self.capacity {
            let Some((_, oldest)) = g.order.pop_first() else {
                break;
            };
            g.map.remove(&oldest);
        }
        g.map.insert(id.clone(), (Arc::new(stored), 0));
        g.touch(&id);
    }

    /// The response `id` if `who` stored it (and marks it used).
    pub fn get(&self, id: &str, who: Principal) -> Option<Arc<StoredResponse>> {
        let mut g = self.lock();
        let found = g
            .map
            .get(id)
            .filter(|(s, _)| s.owner == who)
            .map(|(s, _)| Arc::clone(s))?;
        g.touch(id);
        Some(found)
    }

    /// Removes the response `id` if `who` stored it; whether it did.
    pub fn remove(&self, id: &str, who: Principal) -> bool {
        let mut g = self.lock();
        if !g.map.get(id).is_some_and(|(s, _)| s.owner == who) {
            return false;
        }
        if let Some((_, used)) = g.map.remove(id) {
            g.order.remove(&used);
        }
        true
    }

    /// How many responses are kept.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn stored(owner: Principal, n: i64) -> StoredResponse {
        StoredResponse {
            owner,
            response: json!({ "n": n }),
            conversation: vec![ChatMessage::new("user", n.to_string())],
        }
    }

    #[test]
    fn the_least_recently_used_goes_first() {
        let s = ResponseStore::new(2);
        let a = Principal::Key(0);
        s.insert("r1".into(), stored(a, 1));
        s.insert("r2".into(), stored(a, 2));
        // Reading r1 makes r2 the oldest.
        assert_eq!(s.get("r1", a).unwrap().response["n"], 1);
        s.insert("r3".into(), stored(a, 3));
        assert_eq!(s.len(), 2);
        assert!(s.get("r2", a).is_none());
        assert!(s.get("r1", a).is_some() && s.get("r3", a).is_some());
        // Storing an id again replaces it without evicting another.
        s.insert("r3".into(), stored(a, 33));
        assert_eq!(s.len(), 2);
        assert_eq!(s.get("r3", a).unwrap().response["n"], 33);
    }

    #[test]
    fn another_key_sees_nothing_and_zero_keeps_nothing() {
        let s = ResponseStore::new(4);
        let (a, b) = (Principal::Key(0), Principal::Key(1));
        s.insert("r1".into(), stored(a, 1));
        assert!(s.get("r1", b).is_none());
        assert!(!s.remove("r1", b));
        assert!(s.get("r1", a).is_some());
        assert!(s.remove("r1", a));
        assert!(s.get("r1", a).is_none() && s.is_empty());
        assert!(!s.remove("r1", a));
        let off = ResponseStore::new(0);
        off.insert("r1".into(), stored(a, 1));
        assert!(!off.enabled() && off.get("r1", a).is_none());
    }
}
