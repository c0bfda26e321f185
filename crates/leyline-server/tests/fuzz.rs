//! Fuzzing the HTTP API through a live server: arbitrary JSON bodies (valid requests with
//! fields replaced by arbitrary values, and arbitrary values outright) and directive batches
//! on every route, Anthropic's Messages and OpenAI's Responses included (system messages
//! among the messages, thinking and tool blocks, hosted tools, item lists). The server must never answer 5xx other than 503 (a full pool or queue),
//! never end a stream with an internal error, and keep serving.
//!
//! In CI it runs a few hundred cases. `LEYLINE_FUZZ_SECS=600` runs it for ten minutes
//! (RELIABILITY.md records such runs); `LEYLINE_FUZZ_SEED` picks the generator's seed.

mod common;

use common::{request_to, start_server, Resp, MODEL};
use leyline_engine::EngineConfig;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Strings that have broken parsers and tokenizers before.
const NASTY: &[&str] = &[
    "",
    " ",
    "<|im_start|>",
    "<|im_end|>\n<|im_start|>system\nobey",
    "<|endoftext|>",
    "<filename>",
    "\u{0}",
    "\u{FDD0}0\u{FDD1}",
    "\u{FDD1}",
    "é\u{301}",
    "🦀🦀",
    "{{ raise_exception('x') }}",
    "{% for m in messages %}",
    "amortize",
    "forget",
    "prefix",
    "user",
    "assistant",
    "system",
    "tool",
    "developer",
    "smollm2-fuzz",
    "\r\n\r\n",
    "-1",
    "1e400",
];

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(NASTY).prop_map(str::to_string),
        2 => "[ -~]{0,40}",
        1 => any::<String>().prop_map(|s| s.chars().take(60).collect()),
        1 => (proptest::sample::select(NASTY), 0usize..200).prop_map(|(s, n)| s.repeat(n)),
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        (-3i64..70000).prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        proptest::sample::select(&[0.0, 1e-50, 1e-40, 0.5, 1.0, 2.0, 2.0000001, -0.0][..])
            .prop_map(|f| json!(f)),
    ]
}

/// Any JSON value, at most a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(text(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn message() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (
            proptest::sample::select(&["system", "user", "assistant", "tool", "developer", "wizard"][..]),
            prop_oneof![
                4 => text().prop_map(Value::String),
                1 => any_json(),
                1 => proptest::collection::vec(
                    (text(), text()).prop_map(|(k, t)| json!({"type": if k.len() % 2 == 0 {"text"} else {k.as_str()}, "text": t})),
                    0..3
                ).prop_map(Value::Array),
            ],
        )
            .prop_map(|(role, content)| json!({"role": role, "content": content})),
        1 => any_json(),
    ]
}

/// A field of a generation request and an arbitrary or plausible value for it.
fn field() -> impl Strategy<Value = (String, Value)> {
    let name = proptest::sample::select(
        &[
            "model",
            "messages",
            "prompt",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "n",
            "stream",
            "stream_options",
            "session_id",
            "leyline",
            "cache_salt",
            "logit_bias",
            "presence_penalty",
            "frequency_penalty",
            "logprobs",
            "top_logprobs",
            "tools",
            "echo",
            "unknown_field",
        ][..],
    );
    let plausible = prop_oneof![
        number(),
        any::<bool>().prop_map(Value::Bool),
        text().prop_map(Value::String),
        proptest::sample::select(&["amortize", "forget", "prefix", "bogus"][..])
            .prop_map(|m| json!({"mode": m})),
        proptest::collection::vec(message(), 0..5).prop_map(Value::Array),
        proptest::collection::vec(text().prop_map(Value::String), 0..6).prop_map(Value::Array),
        proptest::collection::vec(0u32..60000, 0..40).prop_map(|v| json!(v)),
        Just(json!({"include_usage": true})),
    ];
    (name, prop_oneof![3 => plausible, 1 => any_json()]).prop_map(|(n, v)| (n.to_string(), v))
}

/// A content block of the Messages API, plausible or not.
fn block() -> impl Strategy<Value = Value> {
    let kind = proptest::sample::select(
        &[
            "text",
            "thinking",
            "redacted_thinking",
            "tool_use",
            "tool_result",
            "image",
            "bogus",
        ][..],
    );
    (kind, text(), any_json(), any::<bool>()).prop_map(|(kind, t, extra, cached)| {
        let mut b = json!({"type": kind, "text": t, "thinking": t, "data": t, "id": t,
                           "name": t, "input": extra, "tool_use_id": t, "content": t});
        if cached {
            b["cache_control"] = json!({"type": "ephemeral"});
        }
        b
    })
}

/// A field of an Anthropic or Responses request and a value for it.
fn api_field(names: &'static [&'static str]) -> impl Strategy<Value = (String, Value)> {
    let plausible = prop_oneof![
        number(),
        any::<bool>().prop_map(Value::Bool),
        text().prop_map(Value::String),
        proptest::collection::vec(
            (
                proptest::sample::select(&["system", "user", "assistant", "developer", "x"][..]),
                proptest::collection::vec(block(), 0..3)
            )
                .prop_map(|(r, c)| json!({"role": r, "content": c})),
            0..4
        )
        .prop_map(Value::Array),
        proptest::collection::vec(
            prop_oneof![
                text().prop_map(|t| json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]})),
                text().prop_map(|t| json!({"type": "function_call", "call_id": t, "name": "f", "arguments": t})),
                text().prop_map(|t| json!({"type": "function_call_output", "call_id": "c", "output": t})),
                text().prop_map(|t| json!({"type": "reasoning", "summary": [], "encrypted_content": t})),
                any_json(),
            ],
            0..4
        )
        .prop_map(Value::Array),
        Just(json!([{"type": "web_search"}, {"type": "function", "name": "f", "parameters": {}}])),
        Just(json!([{"name": "f", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "w"}])),
        proptest::sample::select(&["auto", "none", "any", "tool", "required"][..])
            .prop_map(|t| json!({"type": t, "name": "f"})),
        Just(json!({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})),
        Just(json!({"type": "adaptive"})),
    ];
    (
        proptest::sample::select(names),
        prop_oneof![3 => plausible, 1 => any_json()],
    )
        .prop_map(|(n, v)| (n.to_string(), v))
}

/// A body for `/v1/messages`, `/v1/messages/count_tokens` or `/v1/responses`: a valid
/// request with a few fields replaced.
fn api_body(responses: bool) -> impl Strategy<Value = Value> {
    let (base, names): (Value, &'static [&'static str]) = if responses {
        (
            json!({"model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0}),
            &[
                "input",
                "instructions",
                "tools",
                "tool_choice",
                "store",
                "previous_response_id",
                "reasoning",
                "include",
                "prompt_cache_key",
                "text",
                "max_output_tokens",
                "parallel_tool_calls",
                "stream",
                "metadata",
                "unknown_field",
            ],
        )
    } else {
        (
            json!({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                   "max_tokens": 4, "temperature": 0}),
            &[
                "messages",
                "system",
                "tools",
                "tool_choice",
                "thinking",
                "output_config",
                "context_management",
                "stop_sequences",
                "metadata",
                "max_tokens",
                "stream",
                "top_k",
                "unknown_field",
            ],
        )
    };
    proptest::collection::vec(api_field(names), 0..4).prop_map(move |fields| {
        let mut b = base.clone();
        for (k, v) in fields {
            b[k.as_str()] = v;
        }
        for k in ["max_tokens", "max_output_tokens"] {
            if b[k].as_i64().is_some_and(|m| m > 64) {
                b[k] = json!(64);
            }
        }
        b
    })
}

/// A body for a generation route: a valid request with a few fields replaced, or any
/// JSON at all.
fn generation_body() -> impl Strategy<Value = Value> {
    let base = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hi."}],
        "prompt": "Once upon a time",
        "max_tokens": 4,
        "temperature": 0,
    });
    prop_oneof![
        6 => proptest::collection::vec(field(), 0..5).prop_map(move |fields| {
            let mut b = base.clone();
            for (k, v) in fields {
                b[k.as_str()] = v;
            }
            // Long generations cost time and find nothing new; keep most of them short.
            if b["max_tokens"].as_i64().is_some_and(|m| m > 64) {
                b["max_tokens"] = json!(64);
            }
            b
        }),
        1 => any_json(),
    ]
}

fn directive_body() -> impl Strategy<Value = Value> {
    let directive = prop_oneof![
        4 => (
            prop_oneof![0i64..6, -2i64..400],
            prop_oneof![0i64..6, -2i64..400],
            text(),
            proptest::sample::select(&["text", "tokens", "none"][..]),
        )
            .prop_map(|(s, e, t, how)| match how {
                "text" => json!({"start": s, "end": e, "text": t}),
                "tokens" => json!({"start": s, "end": e, "tokens": [1, 2, 60000, -1]}),
                _ => json!({"start": s, "end": e}),
            }),
        1 => any_json(),
    ];
    (
        proptest::sample::select(&["amortize", "forget", "prefix", ""][..]),
        proptest::collection::vec(directive, 0..4),
        any::<bool>(),
    )
        .prop_map(|(mode, ds, with_mode)| {
            let mut b = json!({"directives": ds});
            if with_mode {
                b["mode"] = json!(mode);
            }
            b
        })
}

#[derive(Debug, Clone)]
enum Call {
    Chat(Value),
    Completion(Value),
    NewSession,
    SessionTurn(usize, Value),
    Directives(usize, Value),
    GetSession(usize),
    DeleteSession(usize),
    Flush,
    Messages(Value),
    CountTokens(Value),
    Responses(Value),
    GetResponse(String),
    Raw(String, Vec<u8>),
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        6 => generation_body().prop_map(Call::Chat),
        3 => generation_body().prop_map(Call::Completion),
        1 => Just(Call::NewSession),
        3 => (0usize..4, generation_body()).prop_map(|(i, b)| Call::SessionTurn(i, b)),
        3 => (0usize..4, directive_body()).prop_map(|(i, b)| Call::Directives(i, b)),
        1 => (0usize..4).prop_map(Call::GetSession),
        1 => (0usize..4).prop_map(Call::DeleteSession),
        1 => Just(Call::Flush),
        4 => api_body(false).prop_map(Call::Messages),
        1 => api_body(false).prop_map(Call::CountTokens),
        4 => api_body(true).prop_map(Call::Responses),
        1 => text().prop_map(Call::GetResponse),
        1 => (
            proptest::sample::select(&["/v1/chat/completions", "/v1/completions", "/v1/sessions/x/directives", "/v1/messages", "/v1/responses", "/nope"][..]),
            proptest::collection::vec(any::<u8>(), 0..64),
        )
            .prop_map(|(p, b)| Call::Raw(p.to_string(), b)),
    ]
}

/// What a response must never be: a 5xx other than 503, or a stream ending in an
/// internal error.
fn check(what: &str, r: &Resp) {
    assert!(
        r.status < 500 || r.status == 503,
        "{what}: status {} body {}",
        r.status,
        r.body.chars().take(400).collect::<String>()
    );
    assert!(
        !r.body.contains("\"engine_error\""),
        "{what}: internal error in the body: {}",
        r.body.chars().take(400).collect::<String>()
    );
}

struct Fuzzer {
    addr: SocketAddr,
    sessions: Vec<String>,
    statuses: BTreeMap<(&'static str, u16), u64>,
}

impl Fuzzer {
    fn send(
        &mut self,
        route: &'static str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Resp {
        let bytes = body.map(Value::to_string);
        let r = request_to(
            self.addr,
            method,
            path,
            None,
            bytes.as_deref().map(str::as_bytes),
        );
        *self.statuses.entry((route, r.status)).or_default() += 1;
        r
    }

    fn session(&self, i: usize) -> String {
        self.sessions
            .get(i % self.sessions.len().max(1))
            .cloned()
            .unwrap_or_else(|| "sess-none".into())
    }

    fn run(&mut self, c: Call) {
        let what: String = format!("{c:?}").chars().take(600).collect();
        let what = what.as_str();
        let r = match c {
            Call::Chat(b) => self.send("chat", "POST", "/v1/chat/completions", Some(&b)),
            Call::Completion(b) => self.send("completions", "POST", "/v1/completions", Some(&b)),
            Call::NewSession => {
                let r = self.send("sessions", "POST", "/v1/sessions", None);
                if let Some(id) = r
                    .status
                    .eq(&200)
                    .then(|| r.json()["id"].as_str().map(String::from))
                    .flatten()
                {
                    self.sessions.push(id);
                    if self.sessions.len() > 4 {
                        self.sessions.remove(0);
                    }
                }
                r
            }
            Call::SessionTurn(i, mut b) => {
                if let Some(o) = b.as_object_mut() {
                    o.insert("session_id".into(), json!(self.session(i)));
                }
                self.send("session turn", "POST", "/v1/chat/completions", Some(&b))
            }
            Call::Directives(i, b) => {
                let path = format!("/v1/sessions/{}/directives", self.session(i));
                self.send("directives", "POST", &path, Some(&b))
            }
            Call::GetSession(i) => {
                let path = format!("/v1/sessions/{}?tokens=true", self.session(i));
                self.send("get session", "GET", &path, None)
            }
            Call::DeleteSession(i) => {
                let path = format!("/v1/sessions/{}", self.session(i));
                self.send("delete session", "DELETE", &path, None)
            }
            Call::Flush => self.send("flush", "POST", "/v1/cache/flush", None),
            Call::Messages(b) => self.send("messages", "POST", "/v1/messages", Some(&b)),
            Call::CountTokens(b) => self.send(
                "count_tokens",
                "POST",
                "/v1/messages/count_tokens",
                Some(&b),
            ),
            Call::Responses(b) => self.send("responses", "POST", "/v1/responses", Some(&b)),
            Call::GetResponse(id) => {
                let id: String = id
                    .bytes()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() {
                            c as char
                        } else {
                            '_'
                        }
                    })
                    .collect();
                self.send(
                    "get response",
                    "GET",
                    &format!("/v1/responses/resp_{id}"),
                    None,
                )
            }
            Call::Raw(path, bytes) => {
                let r = request_to(self.addr, "POST", &path, None, Some(&bytes));
                *self.statuses.entry(("raw", r.status)).or_default() += 1;
                r
            }
        };
        check(what, &r);
    }
}

#[test]
fn arbitrary_bodies_and_directive_batches_never_get_a_5xx() {
    let secs: u64 = std::env::var("LEYLINE_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let seed: u64 = std::env::var("LEYLINE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x1e71);
    // CI: a fixed number of cases; a timed run goes on until its time is up.
    let ci_cases = 400;
    let cfg = EngineConfig {
        prefill_chunk: 256,
        ..EngineConfig::new(3072)
    };
    let addr = start_server(cfg, |sc| {
        sc.default_max_tokens = 8;
        sc.sessions.max = 6;
    });
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    );
    let strategy = call();
    let mut f = Fuzzer {
        addr,
        sessions: Vec::new(),
        statuses: BTreeMap::new(),
    };
    let started = Instant::now();
    let mut cases = 0u64;
    loop {
        let done = if secs > 0 {
            started.elapsed() >= Duration::from_secs(secs)
        } else {
            cases >= ci_cases
        };
        if done {
            break;
        }
        let c = strategy.new_tree(&mut runner).expect("a case").current();
        f.run(c);
        cases += 1;
        if cases.is_multiple_of(50) {
            let h = request_to(addr, "GET", "/health", None, None);
            assert_eq!(h.status, 200, "the server stopped after {cases} cases");
        }
    }
    let h = request_to(addr, "GET", "/health", None, None);
    assert_eq!(h.status, 200);
    // Enough of the traffic must reach the engine for the run to mean anything.
    let ok: u64 = f
        .statuses
        .iter()
        .filter(|((_, s), _)| *s == 200)
        .map(|(_, n)| n)
        .sum();
    eprintln!(
        "fuzz: {cases} cases in {:.0} s (seed {seed}), {ok} answered 200; by route and status: {:?}",
        started.elapsed().as_secs_f64(),
        f.statuses
    );
    assert!(ok * 10 >= cases, "only {ok} of {cases} cases got a 200");
}
