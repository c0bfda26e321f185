//! The server's session table: each session's id, the key that owns it and the engine
//! session behind it. Everything else about a session (tokens, message bounds, the busy
//! flag, when it was last used) lives in the engine.
//!
//! Ids are scoped by key: the table is indexed by (key, id), so the same id under another
//! key is another session, and a session of another key answers exactly like a missing one
//! (404). The server makes unguessable ids (`sess_` + 128 random bits); a client may also
//! choose its own ([`check_client_id`]), which is what a proxy in front of several replicas
//! hashes to keep a conversation on one of them.
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

/// Shortest id a client may choose.
pub const MIN_CLIENT_ID: usize = 16;
/// Longest id a client may choose.
pub const MAX_CLIENT_ID: usize = 128;

/// Checks an id a client chose: 16 to 128 characters of `A-Z a-z 0-9 - _ . ~` (URL-safe, so it
/// goes into paths and headers as it is). Server-made ids pass too.
///
/// # Errors
/// 400 naming `param`.
pub fn check_client_id(id: &str, param: &str) -> Result<()> {
    let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '~');
    if (MIN_CLIENT_ID..=MAX_CLIENT_ID).contains(&id.len()) && id.chars().all(safe) {
        return Ok(());
    }
    Err(ServerError::InvalidRequest {
        message: format!(
            "a session id must be {MIN_CLIENT_ID} to {MAX_CLIENT_ID} characters of \
             A-Z a-z 0-9 - _ . ~ (got {} characters)",
            id.chars().count()
        ),
        param: Some(param.into()),
        code: Some("invalid_session_id"),
    })
}

/// The session table, indexed by (owner, id).
#[derive(Default)]
pub struct Sessions {
    map: Mutex<HashMap<(Principal, String), SessionId>>,
}

impl Sessions {
    fn lock(&self) -> MutexGuard<'_, HashMap<(Principal, String), SessionId>> {
        // A panic while holding the lock leaves plain data; keep serving.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the engine's session `engine` as owned by `owner`, under `id` if given
    /// (a client's choice, checked by the caller) or else a new one (`sess_` + 128 random
    /// bits); returns the id.
    ///
    /// # Errors
    /// 429 when `max` sessions are already open; 409 when `owner` already has `id`.
    pub fn create(
        &self,
        owner: Principal,
        id: Option<&str>,
        engine: SessionId,
        max: usize,
    ) -> Result<String> {
        let id = id.map_or_else(
            || format!("sess_{:032x}", rand::random::<u128>()),
            str::to_owned,
        );
        let mut map = self.lock();
        if map.len() >= max {
            return Err(ServerError::Overloaded(format!(
                "all {max} sessions are busy; retry later or delete one"
            )));
        }
        let key = (owner, id);
        if map.contains_key(&key) {
            return Err(ServerError::Busy(format!(
                "session {:?} already exists",
                key.1
            )));
        }
        let id = key.1.clone();
        map.insert(key, engine);
        Ok(id)
    }

    /// The engine session behind `owner`'s `id`.
    ///
    /// # Errors
    /// 404 if `owner` has no such session.
    pub fn resolve(&self, id: &str, owner: Principal) -> Result<SessionId> {
        self.lock()
            .get(&(owner, id.to_owned()))
            .copied()
            .ok_or_else(|| not_found(id))
    }

    /// Removes `owner`'s `id` (its engine session must be gone already).
    ///
    /// # Errors
    /// 404 if `owner` has no such session.
    pub fn remove(&self, id: &str, owner: Principal) -> Result<SessionId> {
        self.lock()
            .remove(&(owner, id.to_owned()))
            .ok_or_else(|| not_found(id))
    }

    /// Removes the entries of engine sessions that are gone (reaped).
    pub fn remove_engine_sessions(&self, gone: &[SessionId]) {
        if gone.is_empty() {
            return;
        }
        self.lock().retain(|_, e| !gone.contains(e));
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
        message: format!(
            "no session {id:?} for this API key on this server; a chat turn naming it with \
             the conversation's full history creates it again"
        ),
        code: "session_unknown",
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
        let id = s.create(a, None, SessionId(1), 8).unwrap();
        assert!(id.starts_with("sess_") && id.len() == 5 + 32);
        check_client_id(&id, "session_id").unwrap();
        assert_ne!(
            id,
            s.create(a, None, SessionId(2), 8).unwrap(),
            "ids differ"
        );
        assert_eq!(s.resolve(&id, b).unwrap_err().status().as_u16(), 404);
        assert_eq!(s.resolve(&id, a).unwrap(), SessionId(1));
        assert_eq!(s.remove(&id, b).unwrap_err().status().as_u16(), 404);
        assert_eq!(
            s.create(a, None, SessionId(3), 2)
                .unwrap_err()
                .status()
                .as_u16(),
            429
        );
        s.remove(&id, a).unwrap();
        assert_eq!(s.resolve(&id, a).unwrap_err().status().as_u16(), 404);
        s.remove_engine_sessions(&[SessionId(2)]);
        assert!(s.is_empty());
    }

    #[test]
    fn client_ids_are_scoped_by_key() {
        let s = Sessions::default();
        let (a, b) = (Principal::Key(0), Principal::Key(1));
        let id = "conversation-0042-abcdef";
        assert_eq!(s.create(a, Some(id), SessionId(1), 8).unwrap(), id);
        assert_eq!(
            s.create(a, Some(id), SessionId(2), 8)
                .unwrap_err()
                .status()
                .as_u16(),
            409,
            "one key cannot hold an id twice"
        );
        // The same string under another key is another session.
        s.create(b, Some(id), SessionId(3), 8).unwrap();
        assert_eq!(s.resolve(id, a).unwrap(), SessionId(1));
        assert_eq!(s.resolve(id, b).unwrap(), SessionId(3));
        s.remove(id, b).unwrap();
        assert_eq!(s.resolve(id, a).unwrap(), SessionId(1));
    }

    #[test]
    fn client_ids_are_url_safe_and_bounded() {
        for ok in ["a".repeat(16), "A-z_0.9~".repeat(2), "x".repeat(128)] {
            check_client_id(&ok, "session_id").unwrap();
        }
        for bad in [
            "a".repeat(15),
            "x".repeat(129),
            "conversation/0042/x".into(),
            "conversation 0042 x".into(),
            "conversation-\u{e9}-00000".into(),
        ] {
            let e = check_client_id(&bad, "session_id").unwrap_err();
            assert_eq!(e.status().as_u16(), 400, "{bad}");
        }
    }
}
