//! The HTTP API over a real server on a loopback port: auth, errors, completions, SSE
//! framing, concurrency and metrics, sessions and directives.

mod common;

use common::*;
use serde_json::{json, Value};

fn chat_body(text: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

#[test]
fn health_is_open_and_every_guarded_route_needs_the_key() {
    let r = request("GET", "/health", None, None);
    assert_eq!(r.status, 200, "{}", r.body);
    let guarded = [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/sessions"),
        ("GET", "/v1/sessions/sess_x"),
        ("DELETE", "/v1/sessions/sess_x"),
        ("POST", "/v1/sessions/sess_x/directives"),
    ];
    for (m, p) in guarded {
        let body = (m == "POST").then_some(&b"{}"[..]);
        let e = request(m, p, None, body).expect_error(401);
        assert_eq!(e["type"], "authentication_error", "{m} {p}");
        request(m, p, Some("wrong-key"), body).expect_error(401);
    }
    let models = get("/v1/models");
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], MODEL);
}

#[test]
fn bad_requests_get_4xx_with_a_clear_message_and_the_server_keeps_serving() {
    let e = request(
        "POST",
        "/v1/chat/completions",
        Some(KEY_A),
        Some(b"{\"model\": "),
    )
    .expect_error(400);
    assert!(
        e["message"].as_str().unwrap().contains("not valid JSON"),
        "{e}"
    );

    let mut b = chat_body("hi", 4, false);
    b["max_tokens"] = json!("many");
    let e = post("/v1/chat/completions", &b).expect_error(400);
    assert_eq!(e["param"], "max_tokens", "{e}");

    b["max_tokens"] = json!(-5);
    let e = post("/v1/chat/completions", &b).expect_error(400);
    assert!(e["message"].as_str().unwrap().contains("-5"), "{e}");

    let mut b = chat_body("hi", 4, false);
    b["messages"] = json!("not a list");
    let e = post("/v1/chat/completions", &b).expect_error(400);
    assert_eq!(e["param"], "messages", "{e}");

    let mut b = chat_body("hi", 4, false);
    b["model"] = json!("gpt-17");
    let e = post("/v1/chat/completions", &b).expect_error(404);
    assert_eq!(e["code"], "model_not_found");
    assert!(e["message"].as_str().unwrap().contains("gpt-17"));

    for (field, value) in [
        ("temperature", json!(9.0)),
        ("top_p", json!(0)),
        ("top_k", json!(-3)),
        ("n", json!(3)),
    ] {
        let mut b = chat_body("hi", 4, false);
        b[field] = value;
        let e = post("/v1/chat/completions", &b).expect_error(400);
        assert_eq!(e["param"], field, "{e}");
    }
    // More new tokens than the context holds is what fits, not an error (Claude Code asks
    // for 32000 on every model): tests/python/anthropic_client.py checks it on a server of
    // its own, since such a request reserves the whole context's KV.
    let e = post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": []}),
    )
    .expect_error(400);
    assert_eq!(e["param"], "messages");

    // 10 MB body against a 1 MiB limit.
    let big = format!(
        "{{\"model\": \"{MODEL}\", \"prompt\": \"{}\"}}",
        "a".repeat(10 << 20)
    );
    let e = request("POST", "/v1/completions", Some(KEY_A), Some(big.as_bytes())).expect_error(413);
    assert!(e["message"].as_str().unwrap().contains("limit"), "{e}");

    let e = request("GET", "/v1/nothing", Some(KEY_A), None).expect_error(404);
    assert_eq!(e["code"], "unknown_route");

    // Still serving.
    let r = post("/v1/chat/completions", &chat_body("Say hi.", 2, false));
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn chat_completion_has_the_openai_shape_and_a_repeat_hits_the_cache() {
    let mut body = chat_body("What is the capital of France?", 8, false);
    // A cache of its own: another test's FORGET of the default system prompt, which this
    // prompt shares, rightly purges every cached prompt that continues it.
    body["cache_salt"] = json!("repeat-hits-the-cache");
    let r = post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], MODEL);
    let c = &v["choices"][0];
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(["stop", "length"].contains(&c["finish_reason"].as_str().unwrap()));
    let u = &v["usage"];
    let prompt = u["prompt_tokens"].as_u64().unwrap();
    let completion = u["completion_tokens"].as_u64().unwrap();
    assert!(prompt > 5 && (1..=8).contains(&completion), "{u}");
    assert_eq!(u["total_tokens"].as_u64().unwrap(), prompt + completion);

    let again = post("/v1/chat/completions", &body).json();
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Everything but the last prompt token (whose logits pick the first new token).
    assert!(
        cached + 1 >= prompt && cached < prompt,
        "cached {cached} of {prompt}"
    );
    // Greedy decoding is repeatable.
    assert_eq!(
        again["choices"][0]["message"]["content"],
        c["message"]["content"]
    );
}

#[test]
fn top_k_is_honoured_on_the_openai_routes() {
    // top_k 1 leaves only the most likely token, so even temperature 2 decodes greedily;
    // a server that dropped the field would sample 16 tokens at temperature 2.
    let prompt = "List the first ten prime numbers.";
    let greedy = post("/v1/chat/completions", &chat_body(prompt, 16, false));
    assert_eq!(greedy.status, 200, "{}", greedy.body);
    let mut hot = chat_body(prompt, 16, false);
    hot["temperature"] = json!(2.0);
    hot["top_k"] = json!(1);
    for seed in [1, 2, 3] {
        hot["seed"] = json!(seed);
        let r = post("/v1/chat/completions", &hot);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(
            r.json()["choices"][0]["message"]["content"],
            greedy.json()["choices"][0]["message"]["content"],
            "seed {seed}"
        );
    }
    // -1 is vLLM's spelling of off.
    hot["top_k"] = json!(-1);
    let r = post("/v1/chat/completions", &hot);
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn streams_are_framed_like_openai_and_match_the_non_streaming_text() {
    let full = post(
        "/v1/chat/completions",
        &chat_body("Name three colors.", 10, false),
    )
    .json();
    let mut b = chat_body("Name three colors.", 10, true);
    b["stream_options"] = json!({"include_usage": true});
    let r = post("/v1/chat/completions", &b);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let data = sse_data(&r.body);
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let id = chunks[0]["id"].clone();
    let mut text = String::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["id"], id);
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(choice) = c["choices"].get(0) {
            assert!(c["usage"].is_null(), "usage is null on content chunks: {c}");
            text.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
            if !choice["finish_reason"].is_null() {
                finish = Some(choice["finish_reason"].clone());
            }
        }
    }
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"].as_array().unwrap().len(),
        0,
        "usage chunk has no choices"
    );
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][k], full["usage"][k], "{k}");
    }
    assert!(last["usage"]["prompt_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(finish.as_ref(), Some(&full["choices"][0]["finish_reason"]));
    assert_eq!(
        text,
        full["choices"][0]["message"]["content"].as_str().unwrap()
    );
}

#[test]
fn completions_cut_at_stop_strings() {
    let body =
        json!({"model": MODEL, "prompt": "One, two, three,", "max_tokens": 12, "temperature": 0});
    let v = post("/v1/completions", &body).json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 6, "need some text to cut: {text:?}");
    let stop: String = chars[3..5].iter().collect();
    let mut b = body.clone();
    b["stop"] = json!([stop]);
    let cut = post("/v1/completions", &b).json();
    let at = text.find(&stop).unwrap();
    assert_eq!(cut["choices"][0]["text"].as_str().unwrap(), &text[..at]);
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    // Streamed, the same cut.
    b["stream"] = json!(true);
    let data = sse_data(&post("/v1/completions", &b).body);
    let streamed: String = data[..data.len() - 1]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(streamed, &text[..at]);
}

#[test]
fn sixteen_concurrent_streams_complete_and_metrics_move() {
    let before = get("/metrics");
    assert_eq!(before.status, 200);
    let finished0 = metric(&before.body, "leyline_requests_finished_total");
    let generated0 = metric(&before.body, "leyline_generated_tokens_total");
    let handles: Vec<_> = (0..16)
        .map(|i| {
            std::thread::spawn(move || {
                let r = post(
                    "/v1/chat/completions",
                    &chat_body(&format!("Count to {i}."), 8, true),
                );
                assert_eq!(r.status, 200, "{}", r.body);
                let data = sse_data(&r.body);
                let mut finish = 0;
                for d in &data[..data.len() - 1] {
                    let c: Value =
                        serde_json::from_str(d).unwrap_or_else(|e| panic!("chunk {d}: {e}"));
                    assert!(c.get("error").is_none(), "{c}");
                    if !c["choices"][0]["finish_reason"].is_null() {
                        finish += 1;
                    }
                }
                assert_eq!(finish, 1, "exactly one finish chunk");
            })
        })
        .collect();
    for h in handles {
        h.join().expect("stream thread");
    }
    let after = get("/metrics").body;
    assert!(metric(&after, "leyline_requests_finished_total") >= finished0 + 16);
    assert!(metric(&after, "leyline_generated_tokens_total") > generated0);
    assert!(after
        .contains("leyline_http_responses_total{route=\"/v1/chat/completions\",status=\"200\"}"));
}

fn session_tokens(id: &str) -> Vec<u64> {
    let v = get(&format!("/v1/sessions/{id}?tokens=true")).json();
    let t: Vec<u64> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(v["length"].as_u64().unwrap() as usize, t.len());
    t
}

#[test]
fn a_splice_recomputes_the_repair_a_batch_or_a_turn_asks_for() {
    let id = post("/v1/sessions", &json!({})).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let system = |s: &str| {
        json!([
            {"role": "system", "content": s},
            {"role": "user", "content": "Name three rivers of Europe, one per line."},
        ])
    };
    let turn = |messages: Value, leyline: Value| {
        let mut b = chat_body("", 2, false);
        b["messages"] = messages;
        b["session_id"] = json!(id);
        b["leyline"] = leyline;
        post("/v1/chat/completions", &b)
    };
    let r = turn(
        system("You are a geography tutor."),
        json!({"mode": "amortize"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // A turn that edits the system message: its splice recomputes the two tokens after it.
    let r = turn(
        system("You are a terse tutor."),
        json!({"mode": "amortize", "repair": "after_edit:2"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let report = &r.json()["leyline"];
    assert!(report["spliced"].as_bool().unwrap(), "{report}");
    assert_eq!(report["tokens_repaired"], 2, "{report}");

    let path = format!("/v1/sessions/{id}/directives");
    let batch = |repair: Value| {
        json!({"mode": "amortize", "repair": repair,
               "directives": [{"start": 2, "end": 4, "text": " x"}]})
    };
    for (repair, want) in [
        (json!(3), 3),
        (json!({"tokens": 2, "rule": "before_end"}), 2),
        (json!("0"), 0),
    ] {
        let r = post(&path, &batch(repair.clone()));
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["tokens_repaired"], want, "{repair}: {}", r.body);
    }
    let before = session_tokens(&id);
    for bad in [json!("middle:3"), json!("after_edit:many"), json!(-1)] {
        let e = post(&path, &batch(bad.clone())).expect_error(400);
        assert!(
            e["param"] == "repair" || e["message"].as_str().unwrap().contains("repair"),
            "{bad}: {e}"
        );
    }
    assert_eq!(
        session_tokens(&id),
        before,
        "a refused repair changed the session"
    );
    let e = turn(
        system("x"),
        json!({"mode": "amortize", "repair": "sideways:1"}),
    )
    .expect_error(400);
    assert_eq!(e["param"], "leyline.repair", "{e}");
}

#[test]
fn directive_batches_are_atomic_and_sessions_are_scoped_to_their_key() {
    for mode in ["forget", "amortize"] {
        let id = post("/v1/sessions", &json!({})).json()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let mut b = chat_body("Tell me a short story about a cat.", 4, false);
        b["session_id"] = json!(id);
        b["leyline"] = json!({"mode": mode});
        let r = post("/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["leyline"]["session_id"], json!(id));
        let before = session_tokens(&id);
        assert!(before.len() > 12, "{}", before.len());

        // Invalid: overlapping directives; named, and nothing changes.
        let bad = json!({"mode": mode, "directives": [
            {"start": 2, "end": 6, "tokens": [1]},
            {"start": 4, "end": 8, "tokens": []},
        ]});
        let e = post(&format!("/v1/sessions/{id}/directives"), &bad).expect_error(400);
        assert!(
            e["message"].as_str().unwrap().contains("directive 1"),
            "{e}"
        );
        assert_eq!(session_tokens(&id), before);
        let bad = json!({"mode": mode, "directives": [{"start": 3, "end": 100000, "tokens": []}]});
        let e = post(&format!("/v1/sessions/{id}/directives"), &bad).expect_error(400);
        assert!(
            e["message"].as_str().unwrap().contains("directive 0"),
            "{e}"
        );
        assert_eq!(session_tokens(&id), before);

        // Valid: deltas -2 and +1.
        let ok = json!({"mode": mode, "directives": [
            {"start": 2, "end": 5, "tokens": [before[2]]},
            {"start": 9, "end": 9, "tokens": [42]},
        ]});
        let r = post(&format!("/v1/sessions/{id}/directives"), &ok);
        assert_eq!(r.status, 200, "{}", r.body);
        let mut expected = before[..3].to_vec();
        expected.extend_from_slice(&before[5..9]);
        expected.push(42);
        expected.extend_from_slice(&before[9..]);
        assert_eq!(expected.len(), before.len() - 1);
        assert_eq!(session_tokens(&id), expected, "{mode}");
        assert_eq!(
            r.json()["length"].as_u64().unwrap() as usize,
            before.len() - 1
        );

        // Another key sees nothing: the id names nothing under it, and a chat turn naming it
        // opens that key's own session of the same name, which reads none of A's KV.
        let path = format!("/v1/sessions/{id}");
        request("GET", &path, Some(KEY_B), None).expect_error(404);
        request("DELETE", &path, Some(KEY_B), None).expect_error(404);
        let mut b2 = chat_body("hi", 2, false);
        b2["session_id"] = json!(id);
        let r = request(
            "POST",
            "/v1/chat/completions",
            Some(KEY_B),
            Some(b2.to_string().as_bytes()),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.json()["leyline"]["session_id"], json!(id));
        assert_eq!(
            session_tokens(&id),
            expected,
            "{mode}: B's turn changed A's session"
        );
        let b_tokens = request("GET", &format!("{path}?tokens=true"), Some(KEY_B), None).json()
            ["tokens"]
            .clone();
        assert_ne!(b_tokens, json!(expected), "{mode}: B reads A's session");
        assert_eq!(request("DELETE", &path, Some(KEY_B), None).status, 200);
        assert_eq!(request("DELETE", &path, Some(KEY_A), None).status, 200);
        let e = get(&path).expect_error(404);
        assert_eq!(e["code"], "session_unknown", "{e}");
    }
}

#[test]
fn a_busy_session_refuses_a_second_edit() {
    use std::io::{BufRead, BufReader, Write};
    let id = post("/v1/sessions", &json!({})).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut b = chat_body("Write a long poem about the sea.", 16, true);
    b["session_id"] = json!(id);
    b["leyline"] = json!({"mode": "forget"});
    let body = b.to_string();
    let mut s = std::net::TcpStream::connect(server()).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(300)))
        .ok();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {KEY_A}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(s);
    // Wait for the first event: the request holds the session from now until its end.
    let mut line = String::new();
    for _ in 0..64 {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 || line.contains("data: ") {
            break;
        }
    }
    assert!(line.contains("data: "), "stream started: {line:?}");
    let edit = json!({"mode": "forget", "directives": [{"start": 0, "end": 1, "tokens": []}]});
    let e = post(&format!("/v1/sessions/{id}/directives"), &edit).expect_error(409);
    assert_eq!(e["code"], "session_busy");
    let mut b2 = chat_body("hi", 2, false);
    b2["session_id"] = json!(id);
    post("/v1/chat/completions", &b2).expect_error(409);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut reader, &mut rest).unwrap();
    assert!(rest.contains("data: [DONE]"), "{rest}");
    // Free again.
    let r = post(&format!("/v1/sessions/{id}/directives"), &edit);
    assert_eq!(r.status, 200, "{}", r.body);
}
