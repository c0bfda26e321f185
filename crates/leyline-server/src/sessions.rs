//! The server's session table: the public, unguessable id of each session, the key that
//! owns it and the engine session behind it. Everything else about a session (tokens,
//! message bounds, the busy flag, when it was last used) lives in the engine.
//!
//! A session of another key answers exactly like a missing one (404), so ids leak nothing.
//!
//! A session pins its KV in the pool for as long as it lives, so the number of sessions is
//! bounded: idle sessions expire after [`SessionLimits::idle_timeout`], and when
//! [`SessionLimits::max`] are open the least recently used idle one makes room for a new one
//! (the engine picks them: [`leyline_engine::Engine::reap_sessions`]).

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use leyline_engine::SessionId;
use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Bounds on open sessions.
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

struct Entry {
    owner: Principal,
    engine: SessionId,
}

/// The session table.
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<String, Entry>>,
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
    /// 429 when `max` sessions are already open.
    pub fn create(&self, owner: Principal, engine: SessionId, max: usize) -> Result<String> {
        let id = format!("sess_{:032x}", rand::random::<u128>());
        let mut map = self.lock();
        if map.len() >= max {
            return Err(ServerError::Overloaded(format!(
                "all {max} sessions are busy; retry later or delete one"
            )));
        }
        map.insert(id.clone(), Entry { owner, engine });
        Ok(id)
    }

    /// The engine session behind `id`.
    ///
    /// # Errors
    /// 404 if it does not exist or belongs to another key.
    pub fn resolve(&self, id: &str, owner: Principal) -> Result<SessionId> {
        match self.lock().get(id) {
            Some(e) if e.owner == owner => Ok(e.engine),
            _ => Err(not_found(id)),
        }
    }

    /// Removes `id` (its engine session must be gone already).
    ///
    /// # Errors
    /// 404 if it does not exist or belongs to another key.
    pub fn remove(&self, id: &str, owner: Principal) -> Result<SessionId> {
        let engine = self.resolve(id, owner)?;
        self.lock().remove(id);
        Ok(engine)
    }

    /// Removes the entries of engine sessions that are gone (reaped).
    pub fn remove_engine_sessions(&self, gone: &[SessionId]) {
        if gone.is_empty() {
            return;
        }
        self.lock().retain(|_, e| !gone.contains(&e.engine));
    }

    /// Number of sessions.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn not_found(id: &str) -> ServerError {
    ServerError::NotFound {
        message: format!("no session {id:?} for this API key"),
        code: "session_not_found",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_scoped_unguessable_and_bounded() {
        let s = Sessions::default();
        let a = Principal::Key(0);
        let b = Principal::Key(1);
        let id = s.create(a, SessionId(1), 8).unwrap();
        assert!(id.starts_with("sess_") && id.len() == 5 + 32);
        assert_ne!(id, s.create(a, SessionId(2), 8).unwrap(), "ids differ");
        assert_eq!(s.resolve(&id, b).unwrap_err().status().as_u16(), 404);
        assert_eq!(s.resolve(&id, a).unwrap(), SessionId(1));
        assert_eq!(s.remove(&id, b).unwrap_err().status().as_u16(), 404);
        assert_eq!(
            s.create(a, SessionId(3), 2).unwrap_err().status().as_u16(),
            429
        );
        s.remove(&id, a).unwrap();
        assert_eq!(s.resolve(&id, a).unwrap_err().status().as_u16(), 404);
        s.remove_engine_sessions(&[SessionId(2)]);
        assert!(s.is_empty());
    }
}
