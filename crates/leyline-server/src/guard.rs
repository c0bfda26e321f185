//! Guards against browsers used as a weapon: DNS rebinding (a page on a name the attacker
//! controls, resolved to this server) and cross-site requests (a page posting to a local
//! server). The `Host` and `Origin` headers must name this server, and request bodies must
//! be `application/json`, which a cross-site form or `text/plain` fetch cannot send without a
//! CORS preflight that this server never grants.

use crate::error::ServerError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::IpAddr;
use std::sync::Arc;

/// Splits `host[:port]` (IPv6 in brackets) into the host and the port, if any.
fn split_host(authority: &str) -> (&str, Option<&str>) {
    if let Some(rest) = authority.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((h, tail)) => (h, tail.strip_prefix(':')),
            None => (authority, None),
        };
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, Some(p)),
        _ => (authority, None),
    }
}

/// Whether a request naming `authority` (a `Host` value, or the host part of an `Origin`)
/// is for this server. IP literals always are (rebinding needs a name), so are `localhost`
/// and its subdomains; other names only when `allowed` lists them (`name` or `name:port`),
/// or when it holds `*`.
pub fn host_allowed(authority: &str, allowed: &[String]) -> bool {
    let authority = authority.trim();
    let (host, _) = split_host(authority);
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    if host.parse::<IpAddr>().is_ok() || host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    allowed
        .iter()
        .any(|a| a == "*" || a.eq_ignore_ascii_case(&host) || a.eq_ignore_ascii_case(authority))
}

/// The `host[:port]` of an `Origin` value (`scheme://host[:port]`); `None` for `null` and
/// anything malformed.
fn origin_authority(origin: &str) -> Option<&str> {
    let (_, rest) = origin.trim().split_once("://")?;
    Some(rest.split('/').next().unwrap_or(rest)).filter(|a| !a.is_empty())
}

/// Middleware: refuses requests whose `Host` or `Origin` names another site (403).
/// Requests without those headers (non-browser clients) pass.
pub(crate) async fn check_host(
    State(st): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let allowed = &st.config.allowed_hosts;
    let headers = req.headers();
    let value = |name| headers.get(name).map(|v| v.to_str().unwrap_or("\u{0}"));
    if let Some(host) = value(axum::http::header::HOST.as_str()) {
        if !host_allowed(host, allowed) {
            return ServerError::Forbidden(format!(
                "this server does not answer for host {host:?}; start it with \
                 --allowed-hosts to add the name"
            ))
            .into_response();
        }
    }
    if let Some(origin) = value(axum::http::header::ORIGIN.as_str()) {
        if !origin_authority(origin).is_some_and(|a| host_allowed(a, allowed)) {
            return ServerError::Forbidden(format!(
                "cross-origin requests from {origin:?} are not allowed"
            ))
            .into_response();
        }
    }
    next.run(req).await
}

/// Checks that a request body is declared as JSON (`application/json`, any parameters).
///
/// # Errors
/// [`ServerError::UnsupportedMediaType`] otherwise, missing header included.
pub(crate) fn require_json(headers: &HeaderMap) -> Result<(), ServerError> {
    let declared = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let is_json = declared.is_some_and(|v| {
        let media = v.split(';').next().unwrap_or("").trim();
        media.eq_ignore_ascii_case("application/json")
    });
    if is_json {
        return Ok(());
    }
    Err(ServerError::UnsupportedMediaType(format!(
        "the request body must be sent with `Content-Type: application/json` (got {})",
        declared.map_or("none".to_string(), |v| format!("{v:?}"))
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_ip_literals_pass_other_names_need_the_list() {
        let none: Vec<String> = Vec::new();
        for ok in [
            "localhost",
            "localhost:8000",
            "LOCALHOST.:80",
            "app.localhost:1",
            "127.0.0.1:8000",
            "10.1.2.3",
            "[::1]:8000",
            "[fe80::1]",
        ] {
            assert!(host_allowed(ok, &none), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8000",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "",
        ] {
            assert!(!host_allowed(bad, &none), "{bad}");
        }
        let list = vec!["api.example.com".to_string(), "b.example:9000".to_string()];
        assert!(host_allowed("API.example.com:443", &list));
        assert!(host_allowed("b.example:9000", &list));
        assert!(!host_allowed("b.example:9001", &list));
        assert!(host_allowed("anything.at.all", &["*".to_string()]));
    }

    #[test]
    fn origins_are_checked_by_their_host() {
        assert_eq!(
            origin_authority("http://localhost:3000"),
            Some("localhost:3000")
        );
        assert_eq!(
            origin_authority("https://evil.example/x"),
            Some("evil.example")
        );
        assert_eq!(origin_authority("null"), None);
    }

    #[test]
    fn only_json_bodies_are_accepted() {
        let mut h = HeaderMap::new();
        assert!(require_json(&h).is_err());
        for (v, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("multipart/form-data; boundary=x", false),
        ] {
            h.insert(axum::http::header::CONTENT_TYPE, v.parse().unwrap());
            assert_eq!(require_json(&h).is_ok(), ok, "{v}");
        }
        assert_eq!(
            require_json(&h).unwrap_err().status().as_u16(),
            415,
            "multipart"
        );
    }
}
