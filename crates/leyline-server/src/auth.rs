//! `--api-key`: a Bearer token (or `x-api-key` header) guarding every route but `/health`,
//! and the tenant a caller's prefix cache belongs to.

use crate::error::ServerError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// Who is calling: the index of the API key they presented, or anyone when no key is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Principal {
    /// The server has no API keys.
    Anonymous,
    /// The caller presented the key at this index.
    Key(usize),
}

impl Principal {
    /// Whose prefix cache the caller uses: one per API key, split further by an optional
    /// `cache_salt` (users behind one key). With no keys and no salt, the one default
    /// tenant, as before tenants existed.
    pub fn tenant(self, cache_salt: Option<&str>) -> leyline_engine::Tenant {
        use std::hash::{Hash, Hasher};
        let key = match self {
            Principal::Anonymous => 0,
            Principal::Key(i) => i as u64 + 1,
        };
        match cache_salt {
            None => key,
            Some(salt) => {
                // A fixed-key SipHash: the same (key, salt) is the same tenant in every run.
                let mut h = std::collections::hash_map::DefaultHasher::new();
                (key, salt).hash(&mut h);
                // The high bit keeps salted tenants apart from the small unsalted ones.
                h.finish() | (1 << 63)
            }
        }
    }
}

/// Checks configured keys at startup: an empty key would match a missing or malformed
/// header.
///
/// # Errors
/// [`ServerError::Startup`] naming the empty key's position.
pub fn check_keys(keys: &[String]) -> Result<(), ServerError> {
    match keys.iter().position(|k| k.trim().is_empty()) {
        Some(i) => Err(ServerError::Startup(format!(
            "API key {} of {} is empty (check --api-key / LEYLINE_API_KEY for a stray comma)",
            i + 1,
            keys.len()
        ))),
        None => Ok(()),
    }
}

/// Compares without an early exit, so timing does not reveal a matching prefix.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token of an `Authorization: Bearer TOKEN` value (the scheme in any case).
fn bearer_token(h: &str) -> Option<&str> {
    let (scheme, token) = h.trim().split_once(char::is_whitespace)?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Finds the caller's principal from an `Authorization` header value or, failing that, an
/// `x-api-key` header value (Anthropic's clients send that).
///
/// # Errors
/// [`ServerError::Unauthorized`] when keys are configured and none matches.
pub fn authenticate(
    keys: &[String],
    authorization: Option<&str>,
    x_api_key: Option<&str>,
) -> Result<Principal, ServerError> {
    if keys.is_empty() {
        return Ok(Principal::Anonymous);
    }
    let token = match (authorization, x_api_key) {
        (None, None) => {
            return Err(ServerError::Unauthorized(
                "missing API key: send it as an `Authorization: Bearer KEY` header".into(),
            ))
        }
        (Some(h), _) => bearer_token(h),
        (None, Some(k)) => Some(k.trim()).filter(|k| !k.is_empty()),
    };
    let Some(token) = token else {
        return Err(ServerError::Unauthorized(
            "malformed Authorization header: expected `Bearer KEY`".into(),
        ));
    };
    let mut found = None;
    for (i, k) in keys.iter().enumerate() {
        if same(k.as_bytes(), token.as_bytes()) {
            found = Some(i);
        }
    }
    found
        .map(Principal::Key)
        .ok_or_else(|| ServerError::Unauthorized("incorrect API key provided".into()))
}

/// Middleware: rejects unauthenticated requests and stores the [`Principal`] in the request.
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let headers = req.headers();
    let value = |name| headers.get(name).and_then(|v| v.to_str().ok());
    let found = authenticate(
        &state.config.api_keys,
        value(axum::http::header::AUTHORIZATION.as_str()),
        value("x-api-key"),
    );
    match found {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
        }
        Err(e) if req.uri().path().starts_with("/v1/messages") => {
            crate::anthropic::error_response(e)
        }
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_map_to_their_index_and_anything_else_is_refused() {
        let keys = vec!["alpha".to_string(), "beta".to_string()];
        let auth = |h| authenticate(&keys, h, None);
        assert_eq!(auth(Some("Bearer beta")).unwrap(), Principal::Key(1));
        assert_eq!(auth(Some("Bearer alpha")).unwrap(), Principal::Key(0));
        // The scheme is case-insensitive (RFC 9110), and x-api-key works alone.
        assert_eq!(auth(Some("bearer alpha")).unwrap(), Principal::Key(0));
        assert_eq!(auth(Some("BEARER  beta ")).unwrap(), Principal::Key(1));
        assert_eq!(
            authenticate(&keys, None, Some("beta")).unwrap(),
            Principal::Key(1)
        );
        for bad in [
            None,
            Some("beta"),
            Some("Bearer bet"),
            Some("Bearer "),
            Some("Basic alpha"),
            Some("x"),
            Some(""),
        ] {
            assert_eq!(auth(bad).unwrap_err().status().as_u16(), 401, "{bad:?}");
        }
        assert_eq!(
            authenticate(&keys, None, Some(""))
                .unwrap_err()
                .status()
                .as_u16(),
            401
        );
        assert_eq!(authenticate(&[], None, None).unwrap(), Principal::Anonymous);
    }

    #[test]
    fn an_empty_key_is_refused_at_startup() {
        // `--api-key 'A,'` gave the key "", which matched any header that was not Bearer.
        let keys = vec!["A".to_string(), String::new()];
        let e = check_keys(&keys).unwrap_err();
        assert!(e.to_string().contains("key 2 of 2 is empty"), "{e}");
        assert!(check_keys(&[" ".to_string()]).is_err());
        assert!(check_keys(&["A".to_string()]).is_ok());
        // And even unchecked, an empty key never matches a malformed header.
        for h in ["x", "", "Bearer "] {
            assert!(authenticate(&keys, Some(h), None).is_err(), "{h:?}");
        }
    }

    #[test]
    fn tenants_are_per_key_and_salt() {
        let (a, b) = (Principal::Key(0), Principal::Key(1));
        assert_eq!(Principal::Anonymous.tenant(None), 0);
        assert_ne!(a.tenant(None), b.tenant(None));
        assert_ne!(a.tenant(None), 0);
        assert_ne!(a.tenant(Some("u1")), a.tenant(Some("u2")));
        assert_ne!(a.tenant(Some("u1")), b.tenant(Some("u1")));
        assert_ne!(a.tenant(Some("u1")), a.tenant(None));
        assert_eq!(a.tenant(Some("u1")), a.tenant(Some("u1")));
    }
}
