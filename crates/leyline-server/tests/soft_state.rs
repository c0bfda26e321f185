//! Sessions as soft state, for replicas behind a proxy: a client names its conversation
//! (`X-Session-Id` or `session_id`) from the first turn on, a replica that does not hold the
//! session creates it from the turn's history, and ids are scoped by API key.

mod common;

use common::*;
use leyline_engine::EngineConfig;
use serde_json::{json, Value};
use std::net::SocketAddr;

fn small() -> EngineConfig {
    EngineConfig {
        prefill_chunk: 256,
        ..EngineConfig::new(4096)
    }
}

const ID: &str = "agent-run-0001.tau_airline~x";

fn with_keys(session_header: bool) -> SocketAddr {
    start_server(small(), move |sc| {
        sc.api_keys = vec![KEY_A.to_string(), KEY_B.to_string()];
        sc.default_max_tokens = 4;
        sc.session_header = session_header;
    })
}

fn chat(addr: SocketAddr, key: &str, headers: &[(&str, &str)], body: &Value) -> Resp {
    request_with(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(key),
        headers,
        Some(body.to_string().as_bytes()),
    )
}

fn turn(messages: &[(&str, &str)]) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect();
    json!({"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0})
}

fn rebuilt_total(addr: SocketAddr) -> u64 {
    let m = request_to(addr, "GET", "/metrics", Some(KEY_A), None).body;
    m.lines()
        .find_map(|l| l.strip_prefix("leyline_sessions_rebuilt_total "))
        .unwrap_or_else(|| panic!("no leyline_sessions_rebuilt_total in /metrics:\n{m}"))
        .trim()
        .parse()
        .expect("a count")
}

fn session_len(addr: SocketAddr, key: &str, id: &str) -> Option<u64> {
    let r = request_to(addr, "GET", &format!("/v1/sessions/{id}"), Some(key), None);
    (r.status == 200).then(|| r.json()["length"].as_u64().expect("length"))
}

#[test]
fn a_named_session_opens_on_its_first_turn_and_is_rebuilt_from_history_when_lost() {
    let addr = with_keys(true);
    let first = [
        ("system", "You are a travel agent. Answer briefly."),
        (
            "user",
            "I need a flight from Paris to Rome on Friday morning.",
        ),
    ];
    let r = chat(addr, KEY_A, &[("X-Session-Id", ID)], &turn(&first));
    assert_eq!(r.status, 200, "{}", r.body);
    let l = r.json()["leyline"].clone();
    assert_eq!(l["session_id"], ID, "{l}");
    assert_eq!(
        l["session_rebuilt"], false,
        "a first turn is not a rebuild: {l}"
    );
    let len1 = session_len(addr, KEY_A, ID).expect("the header opened the session");
    assert!(len1 > 10, "{len1}");

    // The second turn continues it from the cache.
    let mut second = first.to_vec();
    second.extend([
        ("assistant", "AF1404 leaves at 07:15."),
        ("user", "Book it, please."),
    ]);
    let r = chat(addr, KEY_A, &[("X-Session-Id", ID)], &turn(&second));
    assert_eq!(r.status, 200, "{}", r.body);
    let l = r.json()["leyline"].clone();
    assert_eq!(l["session_rebuilt"], false, "{l}");
    assert!(
        l["tokens_reused"].as_u64().unwrap() >= len1 - 8,
        "the session's cache was not reused: {l}"
    );

    // The replica loses it (failover, idle expiry): a directive batch cannot be applied...
    let path = format!("/v1/sessions/{ID}");
    assert_eq!(
        request_to(addr, "DELETE", &path, Some(KEY_A), None).status,
        200
    );
    let batch = json!({"directives": [{"start": 2, "end": 4, "text": "x"}]});
    let e = request_to(
        addr,
        "POST",
        &format!("{path}/directives"),
        Some(KEY_A),
        Some(batch.to_string().as_bytes()),
    )
    .expect_error(404);
    assert_eq!(e["code"], "session_unknown", "{e}");
    assert!(
        e["message"].as_str().unwrap().contains("history"),
        "the error says how to recover: {e}"
    );

    // ...but the next chat turn, which carries the history, rebuilds it under its id.
    let before = rebuilt_total(addr);
    let mut third = second.clone();
    third.extend([("assistant", "Booked."), ("user", "Thanks. A hotel too?")]);
    let mut body = turn(&third);
    body["session_id"] = json!(ID);
    let r = chat(addr, KEY_A, &[], &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let l = r.json()["leyline"].clone();
    assert_eq!(l["session_id"], ID, "{l}");
    assert_eq!(l["session_rebuilt"], true, "{l}");
    assert_eq!(rebuilt_total(addr), before + 1);
    let len3 = session_len(addr, KEY_A, ID).expect("rebuilt");
    assert!(len3 > len1, "{len3} vs {len1}");
    // Once rebuilt it is an ordinary session again.
    let mut fourth = third.clone();
    fourth.extend([("assistant", "Yes."), ("user", "Near the station.")]);
    let r = chat(addr, KEY_A, &[("X-Session-Id", ID)], &turn(&fourth));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["leyline"]["session_rebuilt"], false);
    assert_eq!(rebuilt_total(addr), before + 1);
}

#[test]
fn ids_are_scoped_by_key_and_checked() {
    let addr = with_keys(true);
    let id = "shared-looking-id-0000000042";
    let a = turn(&[("user", "Key A's conversation about trains.")]);
    let b = turn(&[(
        "user",
        "Key B's conversation, which differs in every word here.",
    )]);
    assert_eq!(chat(addr, KEY_A, &[("X-Session-Id", id)], &a).status, 200);
    assert_eq!(chat(addr, KEY_B, &[("X-Session-Id", id)], &b).status, 200);
    let tokens = |key| {
        request_to(
            addr,
            "GET",
            &format!("/v1/sessions/{id}?tokens=true"),
            Some(key),
            None,
        )
        .json()["tokens"]
            .clone()
    };
    assert_ne!(
        tokens(KEY_A),
        tokens(KEY_B),
        "one id, two keys, two sessions"
    );
    assert_eq!(
        request_to(
            addr,
            "DELETE",
            &format!("/v1/sessions/{id}"),
            Some(KEY_B),
            None
        )
        .status,
        200
    );
    assert!(
        session_len(addr, KEY_A, id).is_some(),
        "B's delete removed A's"
    );

    for bad in ["short-id", "has/a/slash/in/it/0000", &"x".repeat(129)] {
        let e = chat(addr, KEY_A, &[("X-Session-Id", bad)], &a).expect_error(400);
        assert_eq!(e["param"], "session_id", "{bad}: {e}");
        assert_eq!(e["code"], "invalid_session_id", "{bad}: {e}");
    }
    let mut body = a.clone();
    body["session_id"] = json!("another-id-entirely-0001");
    let e = chat(addr, KEY_A, &[("X-Session-Id", id)], &body).expect_error(400);
    assert_eq!(e["param"], "session_id", "{e}");
}

#[test]
fn with_the_header_for_routing_only_it_names_no_session() {
    let addr = with_keys(false);
    let id = "routing-only-key-000000001";
    let r = chat(
        addr,
        KEY_A,
        &[("X-Session-Id", id)],
        &turn(&[("user", "Hello there, how are you?")]),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["leyline"]["session_id"], Value::Null);
    assert_eq!(session_len(addr, KEY_A, id), None);
}
