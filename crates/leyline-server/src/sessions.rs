//! The server's session table: unguessable ids, the key that owns each session, and a busy
//! flag held by a RAII lease so a second edit while a request is in flight is refused (409)
//! instead of interleaving with it.
//!
//! A session of another key answers exactly like a missing one (404), so ids leak nothing.
//!
//! A session pins its KV in the pool for as long as it lives, so the table is bounded: idle
//! sessions expire after [`SessionLimits::idle_timeout`], and when [`SessionLimits::max`]
//! are open the least recently used idle one makes room for a new one.

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use leyline_engine::SessionId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// What the server keeps per session (the engine keeps its tokens and KV).
#[derive(Debug, Clone)]
pub struct SessionState {
    /// The engine's session.
    pub engine: SessionId,
    /// Where each message of the last chat prompt starts in the session's tokens, then
    /// where that prompt ends; `None` when unknown (first turn, completions, or after
    /// explicit directives), and the diff then works on tokens alone.
    pub bounds: Option<Vec<usize>>,
    /// Requests run in it.
    pub turns: usize,
}

struct Entry {
    owner: Principal,
    busy: bool,
    state: SessionState,
    /// When a request last took or released the session.
    last_used: Instant,
}

/// Bounds on the session table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionLimits {
    /// Most sessions open at once.
    pub max: usize,
    /// An idle session unused for longer than this is dropped.
    pub idle_timeout: Duration,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max: 1024,
            idle_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// The session table.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Entry>>,
}

/// Exclusive use of a session while a request runs in it; dropping it frees the session.
pub struct SessionLease {
    sessions: Arc<Sessions>,
    id: String,
    state: SessionState,
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Entry>> {
        // A panic while holding the lock leaves plain data; keep serving.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the engine's session `engine` as owned by `owner`; returns its id
    /// (`sess_` + 128 random bits).
    ///
    /// # Errors
    /// 429 when `max` sessions are already open (see [`Self::reap`]).
    pub fn create(&self, owner: Principal, engine: SessionId, max: usize) -> Result<String> {
        let id = format!("sess_{:032x}", rand::random::<u128>());
        let state = SessionState {
            engine,
            bounds: None,
            turns: 0,
        };
        let mut map = self.lock();
        if map.len() >= max {
            return Err(ServerError::Overloaded(format!(
                "all {max} sessions are busy; retry later or delete one"
            )));
        }
        map.insert(
            id.clone(),
            Entry {
                owner,
                busy: false,
                state,
                last_used: Instant::now(),
            },
        );
        Ok(id)
    }

    /// Removes every idle session unused since before `now - idle_timeout`, then the least
    /// recently used idle ones until `room` more fit under `max`. Returns their engine
    /// sessions, which the caller must delete. Busy sessions are never removed.
    pub fn reap(&self, now: Instant, limits: SessionLimits, room: usize) -> Vec<SessionId> {
        let mut map = self.lock();
        let mut idle: Vec<(Instant, String)> = map
            .iter()
            .filter(|(_, e)| !e.busy)
            .map(|(id, e)| (e.last_used, id.clone()))
            .collect();
        idle.sort();
        let mut gone = Vec::new();
        for (last_used, id) in idle {
            let expired = now.saturating_duration_since(last_used) > limits.idle_timeout;
            if !expired && map.len() + room <= limits.max {
                break;
            }
            if let Some(e) = map.remove(&id) {
                tracing::info!(session = %id, "session dropped (idle or over the session limit)");
                gone.push(e.state.engine);
            }
        }
        gone
    }

    /// Number of sessions.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes the session for one request or edit.
    ///
    /// # Errors
    /// 404 if it does not exist or belongs to another key; 409 if it is busy.
    pub fn acquire(self: &Arc<Self>, id: &str, owner: Principal) -> Result<SessionLease> {
        let mut map = self.lock();
        let e = find(&mut map, id, owner)?;
        if e.busy {
            return Err(ServerError::Busy(format!(
                "session {id} has a request in flight; retry when it has finished"
            )));
        }
        e.busy = true;
        e.last_used = Instant::now();
        Ok(SessionLease {
            sessions: Arc::clone(self),
            id: id.to_string(),
            state: e.state.clone(),
        })
    }

    /// A copy of the session's state and whether it is busy.
    ///
    /// # Errors
    /// 404 if it does not exist or belongs to another key.
    pub fn get(&self, id: &str, owner: Principal) -> Result<(SessionState, bool)> {
        let mut map = self.lock();
        let e = find(&mut map, id, owner)?;
        Ok((e.state.clone(), e.busy))
    }

    /// Deletes the session.
    ///
    /// # Errors
    /// 404 if it does not exist or belongs to another key; 409 if it is busy.
    pub fn delete(&self, id: &str, owner: Principal) -> Result<SessionState> {
        let mut map = self.lock();
        if find(&mut map, id, owner)?.busy {
            return Err(ServerError::Busy(format!(
                "session {id} has a request in flight"
            )));
        }
        map.remove(id).map(|e| e.state).ok_or_else(|| not_found(id))
    }
}

fn not_found(id: &str) -> ServerError {
    ServerError::NotFound {
        message: format!("no session {id:?} for this API key"),
        code: "session_not_found",
    }
}

fn find<'a>(
    map: &'a mut HashMap<String, Entry>,
    id: &str,
    owner: Principal,
) -> Result<&'a mut Entry> {
    match map.get_mut(id) {
        Some(e) if e.owner == owner => Ok(e),
        _ => Err(not_found(id)),
    }
}

impl SessionLease {
    /// The session id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The state when the lease was taken (plus changes made through the lease).
    pub fn state(&self) -> &SessionState {
        &self.state
    }

    /// Records a new state; it is written back now (the lease stays held).
    pub fn commit(&mut self, state: SessionState) {
        self.state = state;
        if let Some(e) = self.sessions.lock().get_mut(&self.id) {
            e.state = self.state.clone();
        }
    }
}

impl Drop for SessionLease {
    fn drop(&mut self) {
        if let Some(e) = self.sessions.lock().get_mut(&self.id) {
            e.busy = false;
            e.last_used = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_scoped_busy_is_exclusive_and_released_on_drop() {
        let s = Arc::new(Sessions::default());
        let a = Principal::Key(0);
        let b = Principal::Key(1);
        let id = s.create(a, SessionId(1), 8).unwrap();
        assert!(id.starts_with("sess_") && id.len() == 5 + 32);
        assert_ne!(id, s.create(a, SessionId(2), 8).unwrap(), "ids differ");
        assert_eq!(s.get(&id, b).unwrap_err().status().as_u16(), 404);
        let lease = s.acquire(&id, a).unwrap();
        assert_eq!(
            s.acquire(&id, a).err().map(|e| e.status().as_u16()),
            Some(409)
        );
        assert_eq!(s.delete(&id, a).unwrap_err().status().as_u16(), 409);
        drop(lease);
        let mut lease = s.acquire(&id, a).unwrap();
        let mut st = lease.state().clone();
        st.bounds = Some(vec![0, 2, 3]);
        lease.commit(st);
        drop(lease);
        assert_eq!(s.get(&id, a).unwrap().0.bounds, Some(vec![0, 2, 3]));
        assert_eq!(s.delete(&id, b).unwrap_err().status().as_u16(), 404);
        s.delete(&id, a).unwrap();
        assert_eq!(s.get(&id, a).unwrap_err().status().as_u16(), 404);
    }

    #[test]
    fn reaping_drops_expired_then_least_recently_used_idle_sessions_never_busy_ones() {
        let s = Arc::new(Sessions::default());
        let a = Principal::Key(0);
        let limits = SessionLimits {
            max: 3,
            idle_timeout: Duration::from_secs(60),
        };
        let ids: Vec<String> = (0..3)
            .map(|i| s.create(a, SessionId(i), limits.max).unwrap())
            .collect();
        // Full: a fourth is refused until room is made.
        let full = s.create(a, SessionId(9), limits.max).unwrap_err();
        assert_eq!(full.status().as_u16(), 429);
        // Use order: 1, then 0, then 2 (held busy).
        drop(s.acquire(&ids[1], a).unwrap());
        std::thread::sleep(Duration::from_millis(5));
        drop(s.acquire(&ids[0], a).unwrap());
        std::thread::sleep(Duration::from_millis(5));
        let busy = s.acquire(&ids[2], a).unwrap();
        let now = Instant::now();
        // Nothing expired and room for none asked: nothing goes.
        assert!(s.reap(now, limits, 0).is_empty());
        // Room for one: the least recently used idle session goes.
        assert_eq!(s.reap(now, limits, 1), vec![SessionId(1)]);
        assert_eq!(s.get(&ids[1], a).unwrap_err().status().as_u16(), 404);
        // Later than the timeout: every idle one expires, the busy one stays.
        let later = now + Duration::from_secs(61);
        assert_eq!(s.reap(later, limits, 0), vec![SessionId(0)]);
        assert!(s.get(&ids[2], a).is_ok());
        // Even when room is asked for, a busy session is kept.
        assert!(s
            .reap(later, SessionLimits { max: 1, ..limits }, 1)
            .is_empty());
        drop(busy);
        assert_eq!(s.reap(later, limits, 0), vec![SessionId(2)]);
        assert!(s.is_empty());
    }
}
