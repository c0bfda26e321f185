//! `--api-key`: a Bearer token guarding every route but `/health`.

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

/// Compares without an early exit, so timing does not reveal a matching prefix.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Finds the caller's principal from an `Authorization` header value.
///
/// # Errors
/// [`ServerError::Unauthorized`] when keys are configured and none matches.
pub fn authenticate(keys: &[String], header: Option<&str>) -> Result<Principal, ServerError> {
    if keys.is_empty() {
        return Ok(Principal::Anonymous);
    }
    let Some(h) = header else {
        return Err(ServerError::Unauthorized(
            "missing API key: send it as an `Authorization: Bearer KEY` header".into(),
        ));
    };
    let token = h.strip_prefix("Bearer ").map(str::trim).unwrap_or("");
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
    let header = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match authenticate(&state.config.api_keys, header) {
        Ok(p) => {
            req.extensions_mut().insert(p);
            next.run(req).await
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
        assert_eq!(
            authenticate(&keys, Some("Bearer beta")).unwrap(),
            Principal::Key(1)
        );
        assert_eq!(
            authenticate(&keys, Some("Bearer alpha")).unwrap(),
            Principal::Key(0)
        );
        for bad in [
            None,
            Some("beta"),
            Some("Bearer bet"),
            Some("Bearer "),
            Some("Basic alpha"),
        ] {
            assert_eq!(
                authenticate(&keys, bad).unwrap_err().status().as_u16(),
                401,
                "{bad:?}"
            );
        }
        assert_eq!(authenticate(&[], None).unwrap(), Principal::Anonymous);
    }
}
