//! Hostile and careless clients (issue "Trust", points 4-11): tenants that probe each
//! other's cache, browsers used against a local server, slow and vanishing clients, floods,
//! and parameters the server cannot honour. Each test names the point it covers.

mod common;

use common::{metric, request_to, server, start_server, Resp, KEY_A, KEY_B, MODEL};
use leyline_engine::EngineConfig;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Sends `head` (request line and headers, without the blank line) and `body` on a fresh
/// connection and reads the answer. `Content-Length` is added for a body.
fn raw(addr: SocketAddr, head: &str, body: &[u8]) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).ok();
    let mut msg = format!("{head}\r\nConnection: close\r\n");
    if !body.is_empty() {
        msg.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    msg.push_str("\r\n");
    s.write_all(msg.as_bytes()).expect("write head");
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse(&out)
}

fn parse(raw: &[u8]) -> Resp {
    let text = String::from_utf8_lossy(raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Resp {
        status,
        headers,
        body: body.to_string(),
    }
}

fn post_as(addr: SocketAddr, key: &str, path: &str, body: &Value) -> Resp {
    request_to(
        addr,
        "POST",
        path,
        Some(key),
        Some(body.to_string().as_bytes()),
    )
}

fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        "temperature": 0,
    });
    if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    b
}

fn cached(r: &Resp) -> u64 {
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

/// A paragraph no other test sends, about `tokens` tokens long.
fn unique_text(tag: &str) -> String {
    let nonce: u64 = rand_nonce();
    format!(
        "Record {tag}-{nonce}. {}",
        "The ledger names every cask that left the cellar, its vintage and its buyer. ".repeat(8)
    )
}

fn rand_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

#[test]
fn point4_tenants_do_not_share_cached_prefixes() {
    let addr = server();
    let text = unique_text("tenant");
    let first = cached(&post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &chat(&text, json!({})),
    ));
    let again = cached(&post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &chat(&text, json!({})),
    ));
    assert!(
        again >= first + 100,
        "key A reuses its own prompt: {first} then {again}"
    );
    // Key B guessing A's prompt learns nothing from cached_tokens: it matches at most the
    // template's system prompt that it cached itself.
    let other = cached(&post_as(
        addr,
        KEY_B,
        "/v1/chat/completions",
        &chat(&text, json!({})),
    ));
    assert!(other + 100 <= again, "key B saw {other} cached tokens");
    // A salt splits one key into users, and the same salt finds its own prefix again.
    let salted = json!({"cache_salt": format!("user-{}", rand_nonce())});
    let s1 = cached(&post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &chat(&text, salted.clone()),
    ));
    let s2 = cached(&post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &chat(&text, salted),
    ));
    assert!(s1 + 100 <= again, "a new salt saw {s1} cached tokens");
    assert!(s2 >= s1 + 100, "the same salt reuses: {s1} then {s2}");
    let bad = post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &chat("x", json!({"cache_salt": ""})),
    );
    assert_eq!(bad.expect_error(400)["param"], "cache_salt");
}

#[test]
fn point4_a_forget_under_one_key_leaves_the_other_keys_cache_alone() {
    let addr = server();
    let text = unique_text("forget");
    let warm = |key| post_as(addr, key, "/v1/chat/completions", &chat(&text, json!({})));
    cached(&warm(KEY_A));
    let before = cached(&warm(KEY_A));
    // Key B caches the same text in a FORGET session, then forgets it.
    let r = post_as(
        addr,
        KEY_B,
        "/v1/chat/completions",
        &chat(&text, json!({"leyline": {"mode": "forget"}})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let sid = r.json()["leyline"]["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = post_as(
        addr,
        KEY_B,
        "/v1/chat/completions",
        &chat(
            "Something else entirely.",
            json!({"session_id": sid, "leyline": {"mode": "forget"}}),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        cached(&warm(KEY_A)),
        before,
        "A's cache survived B's FORGET"
    );
}

#[test]
fn point5_bearer_scheme_in_any_case_and_x_api_key_authenticate() {
    let addr = server();
    for auth in [
        format!("Authorization: bearer {KEY_A}"),
        format!("Authorization: BEARER {KEY_B}"),
        format!("x-api-key: {KEY_A}"),
    ] {
        let r = raw(
            addr,
            &format!("GET /v1/models HTTP/1.1\r\nHost: localhost\r\n{auth}"),
            b"",
        );
        assert_eq!(r.status, 200, "{auth}: {}", r.body);
    }
    for auth in ["Authorization: x", "Authorization: Bearer", "x-api-key: "] {
        let r = raw(
            addr,
            &format!("GET /v1/models HTTP/1.1\r\nHost: localhost\r\n{auth}"),
            b"",
        );
        assert_eq!(r.status, 401, "{auth}");
    }
}

#[test]
fn point6_cross_site_bodies_and_foreign_hosts_are_refused() {
    let addr = server();
    let body = chat("Hello", json!({})).to_string();
    let auth = format!("Authorization: Bearer {KEY_A}");
    let post = |extra: &str| {
        raw(
            addr,
            &format!("POST /v1/chat/completions HTTP/1.1\r\n{auth}\r\n{extra}"),
            body.as_bytes(),
        )
    };
    // A page can POST text/plain across origins without a preflight.
    let r = post("Host: localhost\r\nContent-Type: text/plain");
    assert_eq!(r.status, 415, "{}", r.body);
    assert!(r.body.contains("application/json"), "{}", r.body);
    let r = post("Host: localhost");
    assert_eq!(r.status, 415, "no Content-Type: {}", r.body);
    // DNS rebinding: the browser names the attacker's host.
    let r = post("Host: evil.example:8000\r\nContent-Type: application/json");
    assert_eq!(r.status, 403, "{}", r.body);
    let r =
        post("Host: localhost\r\nOrigin: http://evil.example\r\nContent-Type: application/json");
    assert_eq!(r.status, 403, "{}", r.body);
    // The same request from the server's own names goes through.
    for host in [
        "Host: localhost:8000",
        &format!("Host: {addr}"),
        "Host: localhost\r\nOrigin: http://localhost:3000",
    ] {
        let r = post(&format!("{host}\r\nContent-Type: application/json"));
        assert_eq!(r.status, 200, "{host}: {}", r.body);
    }
}

#[test]
fn point6_allowed_hosts_extend_the_list() {
    let addr = start_server(EngineConfig::new(2048), |sc| {
        sc.allowed_hosts = vec!["leyline.internal".into()];
    });
    let get = |host: &str| {
        raw(
            addr,
            &format!("GET /v1/models HTTP/1.1\r\nHost: {host}"),
            b"",
        )
    };
    assert_eq!(get("leyline.internal:8000").status, 200);
    assert_eq!(get("other.internal").status, 403);
}

#[test]
fn point8_a_huge_message_list_neither_stalls_the_server_nor_takes_long() {
    let addr = server();
    // 8,000 short messages: under the context in count, over it once rendered. Rendering
    // every prefix of it (as the server once did) takes minutes.
    let messages: Vec<Value> = (0..8000)
        .map(|i| json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": "hi"}))
        .collect();
    let body = json!({"model": MODEL, "messages": messages, "max_tokens": 1});
    let started = Instant::now();
    let big = std::thread::spawn(move || {
        request_to(
            addr,
            "POST",
            "/v1/chat/completions",
            Some(KEY_A),
            Some(body.to_string().as_bytes()),
        )
    });
    // /health answers promptly meanwhile.
    while !big.is_finished() {
        let t = Instant::now();
        let h = request_to(addr, "GET", "/health", None, None);
        assert_eq!(h.status, 200);
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "/health took {:?}",
            t.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = big.join().expect("request thread");
    let e = r.expect_error(400);
    assert_eq!(e["code"], "context_length_exceeded", "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "answered after {:?}",
        started.elapsed()
    );
    // Counted before rendering at all: more messages than the context has tokens.
    let many: Vec<Value> = (0..9000)
        .map(|_| json!({"role": "user", "content": "x"}))
        .collect();
    let r = post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": many}),
    );
    assert_eq!(r.expect_error(400)["code"], "context_length_exceeded");
}

/// A server with one-second header and body timeouts and at most `conns` connections.
fn impatient_server(conns: usize) -> SocketAddr {
    start_server(EngineConfig::new(2048), move |sc| {
        sc.header_timeout = Duration::from_secs(1);
        sc.body_timeout = Duration::from_secs(1);
        sc.max_connections = conns;
    })
}

/// Reads until the peer closes or `limit` passes; returns what arrived and when it ended.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, Duration) {
    let t = Instant::now();
    s.set_read_timeout(Some(limit)).ok();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    (out, t.elapsed())
}

#[test]
fn point9_slow_headers_and_stalled_bodies_are_cut_off() {
    let addr = impatient_server(64);
    // Half a request head, then silence (slowloris).
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        .unwrap();
    let (_, took) = read_until_closed(&mut s, Duration::from_secs(20));
    assert!(took < Duration::from_secs(10), "held for {took:?}");
    // A connection that never sends anything is closed too.
    let mut idle = TcpStream::connect(addr).unwrap();
    let (_, took) = read_until_closed(&mut idle, Duration::from_secs(20));
    assert!(took < Duration::from_secs(10), "idle held for {took:?}");
    // Headers promise 100 bytes of body; 10 arrive.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"model\":",
    )
    .unwrap();
    let (out, took) = read_until_closed(&mut s, Duration::from_secs(20));
    assert!(took < Duration::from_secs(10), "held for {took:?}");
    let r = parse(&out);
    assert_eq!(r.status, 408, "{}", r.body);
}

#[test]
fn point9_connections_are_capped_and_idle_ones_make_room() {
    let addr = impatient_server(4);
    // Four silent connections fill the cap.
    let hogs: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    // A real request waits in the backlog until the header timeout clears the hogs, then
    // is served; the server never had more than four open.
    let t = Instant::now();
    let r = request_to(addr, "GET", "/metrics", None, None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        t.elapsed() >= Duration::from_millis(500),
        "{:?}",
        t.elapsed()
    );
    assert!(metric(&r.body, "leyline_http_connections_open") <= 4);
    drop(hogs);
}

#[test]
fn point10_abandoned_requests_stop_costing_prefill() {
    // Small prefill steps, so a long prompt takes many steps.
    let cfg = EngineConfig {
        prefill_chunk: 32,
        decode_prefill_chunk: 32,
        max_running: 2,
        ..EngineConfig::new(8192)
    };
    let addr = start_server(cfg, |_| {});
    let before = request_to(addr, "GET", "/metrics", None, None).body;
    let n = 6;
    let mut prompt_tokens = 0;
    let mut open = Vec::new();
    for i in 0..n {
        // Distinct prompts of about 1,000 tokens: no prefix sharing between them.
        let text = format!("{i} {}", unique_text(&format!("gone{i}")).repeat(6));
        prompt_tokens += 1000;
        let body = chat(&text, json!({"max_tokens": 4})).to_string();
        let mut s = TcpStream::connect(addr).unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.as_bytes()).unwrap();
        open.push(s);
    }
    // Once they are queued or prefilling, every client goes away. (A client that leaves
    // sooner is dropped before its request reaches the engine at all.)
    std::thread::sleep(Duration::from_millis(400));
    drop(open);
    // Wait until the engine is idle.
    let deadline = Instant::now() + Duration::from_secs(120);
    let after = loop {
        std::thread::sleep(Duration::from_millis(300));
        let m = request_to(addr, "GET", "/metrics", None, None).body;
        if metric(&m, "leyline_queue_depth") == 0 && metric(&m, "leyline_running") == 0 {
            break m;
        }
        assert!(Instant::now() < deadline, "the engine never went idle");
    };
    let delta = |name| metric(&after, name) - metric(&before, name);
    let cancelled = delta("leyline_requests_cancelled_total");
    let prefilled = delta("leyline_prefilled_tokens_total");
    let submitted = delta("leyline_requests_submitted_total");
    assert!(
        cancelled >= 3,
        "{cancelled} of {n} cancelled ({submitted} submitted, {prefilled} tokens prefilled)"
    );
    assert!(
        prefilled * 2 < prompt_tokens,
        "{prefilled} tokens prefilled for {n} abandoned prompts of ~1,000"
    );
}

#[test]
fn point10_a_full_queue_answers_503_with_retry_after() {
    let cfg = EngineConfig {
        max_running: 1,
        max_waiting: 1,
        ..EngineConfig::new(4096)
    };
    let addr = start_server(cfg, |_| {});
    let body = chat("Count slowly from one to fifty.", json!({"max_tokens": 48}));
    let threads: Vec<_> = (0..6)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || post_as(addr, KEY_A, "/v1/chat/completions", &body))
        })
        .collect();
    let answers: Vec<Resp> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let full: Vec<&Resp> = answers.iter().filter(|r| r.status == 503).collect();
    assert!(answers.iter().any(|r| r.status == 200));
    assert!(
        !full.is_empty(),
        "{:?}",
        answers.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for r in full {
        assert_eq!(r.header("retry-after"), Some("1"));
        assert_eq!(r.expect_error(503)["code"], "queue_full");
    }
    assert!(answers.iter().all(|r| r.status == 200 || r.status == 503));
}

#[test]
fn point11_parameters_the_server_cannot_honour_are_refused_by_name() {
    let addr = server();
    let post = |extra: Value| post_as(addr, KEY_A, "/v1/chat/completions", &chat("Hi", extra));
    for (extra, param) in [
        (json!({"top_p": 1e-50}), "top_p"),
        (json!({"logit_bias": {"50": 10}}), "logit_bias"),
        (json!({"presence_penalty": 0.5}), "presence_penalty"),
        (json!({"frequency_penalty": -1.0}), "frequency_penalty"),
        (json!({"logprobs": "yes"}), "logprobs"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (json!({"stop": "x".repeat(300)}), "stop"),
    ] {
        let r = post(extra.clone());
        assert_eq!(r.expect_error(400)["param"], param, "{extra}");
    }
    // Neutral values of the same fields pass, and a tiny temperature is greedy, not NaN.
    for extra in [
        json!({"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": false}),
        json!({"temperature": 1e-40, "max_tokens": 4}),
        json!({"stop": "y".repeat(256)}),
    ] {
        let r = post(extra.clone());
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
    let r = post_as(
        addr,
        KEY_A,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}),
    );
    assert_eq!(r.expect_error(400)["param"], "messages[0].role");
}
