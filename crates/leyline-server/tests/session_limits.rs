//! Session limits: the table is bounded, idle sessions expire, and a dropped session's KV
//! goes back to the pool, so a stream of abandoned sessions never exhausts it.

mod common;

use common::{metric, request_to, start_server, Resp, MODEL};
use leyline_engine::EngineConfig;
use leyline_server::sessions::SessionLimits;
use serde_json::json;
use std::net::SocketAddr;
use std::time::Duration;

/// A server over a `kv_slots` pool with `limits`.
fn start(kv_slots: usize, limits: SessionLimits) -> SocketAddr {
    start_server(EngineConfig::new(kv_slots), move |sc| sc.sessions = limits)
}

fn call(addr: SocketAddr, method: &str, path: &str, body: Option<serde_json::Value>) -> Resp {
    let body = body.map(|b| b.to_string());
    request_to(addr, method, path, None, body.as_deref().map(str::as_bytes))
}

fn new_session(addr: SocketAddr) -> String {
    let r = call(addr, "POST", "/v1/sessions", Some(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["id"].as_str().expect("an id").to_string()
}

fn sessions_gauge(addr: SocketAddr) -> u64 {
    metric(
        &call(addr, "GET", "/metrics", None).body,
        "leyline_sessions",
    )
}

#[test]
fn sessions_over_the_limit_push_out_the_least_recently_used_and_free_its_kv() {
    let limits = SessionLimits {
        max: 2,
        idle_timeout: Duration::from_secs(3600),
    };
    // Eight sessions of about 200 tokens each would pin more than this pool if a dropped
    // session kept its KV.
    let addr = start(1024, limits);
    let filler = "The archive lists every ship that entered the harbour, its cargo and its crew. "
        .repeat(12);
    let mut ids = Vec::new();
    for i in 0..8 {
        let id = new_session(addr);
        let body = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": format!("Session {i}. {filler} Summarize.")}],
            "max_tokens": 2,
            "temperature": 0,
            "session_id": id,
        });
        let r = call(addr, "POST", "/v1/chat/completions", Some(body));
        assert_eq!(r.status, 200, "session {i}: {}", r.body);
        let prompt = r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(prompt > 150, "prompt of {prompt} tokens");
        ids.push(id);
    }
    for (i, id) in ids.iter().enumerate() {
        let r = call(addr, "GET", &format!("/v1/sessions/{id}"), None);
        let want = if i >= 6 { 200 } else { 404 };
        assert_eq!(r.status, want, "session {i}: {}", r.body);
    }
    assert_eq!(sessions_gauge(addr), 2);
}

#[test]
fn idle_sessions_expire() {
    let limits = SessionLimits {
        max: 16,
        idle_timeout: Duration::from_millis(200),
    };
    let addr = start(1024, limits);
    let id = new_session(addr);
    assert_eq!(sessions_gauge(addr), 1);
    std::thread::sleep(Duration::from_millis(800));
    let r = call(addr, "GET", &format!("/v1/sessions/{id}"), None);
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(sessions_gauge(addr), 0);
}

#[test]
fn an_edit_the_pool_cannot_hold_is_a_503_with_retry_after_and_changes_nothing() {
    let addr = start(600, SessionLimits::default());
    let id = new_session(addr);
    let filler = "The archive lists every ship that entered the harbour, its cargo and its crew. "
        .repeat(12);
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": format!("{filler} Summarize.")}],
        "max_tokens": 2,
        "temperature": 0,
        "session_id": id,
    });
    let r = call(addr, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(r.status, 200, "{}", r.body);
    let path = format!("/v1/sessions/{id}?tokens=true");
    let before = call(addr, "GET", &path, None).json()["tokens"].clone();
    // About 250 tokens: the edited session still fits a sequence (599 tokens), but the
    // replacement plus the copies of the downstream slots that the tree shares do not fit
    // the 400 free slots, nor does FORGET's re-prefill.
    let huge = "The harbour master signs each entry, notes the tide and the weather. ".repeat(18);
    for mode in ["amortize", "forget"] {
        let edit = json!({"mode": mode, "directives": [{"start": 3, "end": 5, "text": huge}]});
        let r = call(
            addr,
            "POST",
            &format!("/v1/sessions/{id}/directives"),
            Some(edit),
        );
        assert_eq!(r.status, 503, "{mode}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "kv_pool_exhausted", "{mode}");
        assert!(
            r.headers.iter().any(|(k, _)| k == "retry-after"),
            "{mode}: no Retry-After"
        );
        let after = call(addr, "GET", &path, None).json()["tokens"].clone();
        assert_eq!(
            after, before,
            "{mode}: the refused edit changed the session"
        );
    }
    // An invalid batch is a 400 and an unknown session a 404 on the same route.
    let bad = json!({"directives": [{"start": 9, "end": 3, "text": "x"}]});
    let r = call(
        addr,
        "POST",
        &format!("/v1/sessions/{id}/directives"),
        Some(bad.clone()),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    let r = call(addr, "POST", "/v1/sessions/sess_nope/directives", Some(bad));
    assert_eq!(r.status, 404, "{}", r.body);
}

#[test]
fn a_chat_turn_whose_edit_the_pool_cannot_hold_is_a_503_before_any_stream() {
    let addr = start(600, SessionLimits::default());
    let id = new_session(addr);
    let filler = "The archive lists every ship that entered the harbour, its cargo and its crew. "
        .repeat(12);
    let history = |first: &str| {
        json!([
            {"role": "user", "content": first},
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": format!("{filler} Summarize.")},
        ])
    };
    let body = json!({
        "model": MODEL, "messages": history(&filler), "max_tokens": 2, "temperature": 0,
        "session_id": id,
    });
    let r = call(addr, "POST", "/v1/chat/completions", Some(body));
    assert_eq!(r.status, 200, "{}", r.body);
    let path = format!("/v1/sessions/{id}?tokens=true");
    let before = call(addr, "GET", &path, None).json()["tokens"].clone();
    // The first message grows: the splice needs the replacement plus copies of everything
    // after it that the tree shares, more than the pool has free.
    let huge = "The harbour master signs each entry, notes the tide and the weather. ".repeat(18);
    for stream in [true, false] {
        let body = json!({
            "model": MODEL, "messages": history(&huge), "max_tokens": 2, "temperature": 0,
            "session_id": id, "stream": stream, "leyline": {"mode": "amortize"},
        });
        let r = call(addr, "POST", "/v1/chat/completions", Some(body));
        assert_eq!(r.status, 503, "stream {stream}: {}", r.body);
        assert_eq!(r.json()["error"]["code"], "kv_pool_exhausted");
        assert_eq!(r.header("retry-after"), Some("1"));
        let after = call(addr, "GET", &path, None).json()["tokens"].clone();
        assert_eq!(
            after, before,
            "stream {stream}: the refused turn changed the session"
        );
    }
}
