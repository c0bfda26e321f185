//! `serve --record DIR`: what a recording holds (bodies as sent, the conversation headers,
//! the key's index) and never holds (API keys), where it is written, and the replay of a
//! recording (`scripts/replay_http.py --recording`) against a live server, including its
//! own Python tests. Needs python3 (standard library only).

mod common;

use common::{request_with, start_server, Resp, MODEL};
use leyline_engine::EngineConfig;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Keys of the recording server; long and unusual so that a search of the file means
/// something.
const KEY_A: &str = "rec-key-alpha-7f3c9e51d2";
const KEY_B: &str = "rec-key-bravo-2b8d41a6c0";
const BODY_LIMIT: usize = 64 << 10;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the repository root")
        .to_path_buf()
}

/// The temporary root the server may write under (its recording directory is `root/rec`,
/// which the server creates).
fn root() -> &'static Path {
    static ROOT: OnceLock<PathBuf> = OnceLock::new();
    ROOT.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("leyline-record-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).expect("temp root");
        root
    })
}

fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let dir = root().join("rec");
        let cfg = EngineConfig {
            prefill_chunk: 256,
            ..EngineConfig::new(8192)
        };
        start_server(cfg, move |sc| {
            sc.api_keys = vec![KEY_A.to_string(), KEY_B.to_string()];
            sc.max_body_bytes = BODY_LIMIT;
            sc.default_max_tokens = 4;
            sc.record = Some(dir);
        })
    })
}

fn post(path: &str, key: Option<&str>, headers: &[(&str, &str)], body: &Value) -> Resp {
    request_with(
        server(),
        "POST",
        path,
        key,
        headers,
        Some(body.to_string().as_bytes()),
    )
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("read dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files_under(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// The recording's raw text and its lines (there is one file: one server start).
fn recording() -> (String, Vec<Value>) {
    let files = files_under(root());
    assert_eq!(
        files.len(),
        1,
        "one recording file, nothing else: {files:?}"
    );
    let file = &files[0];
    assert_eq!(
        file.parent(),
        Some(root().join("rec").as_path()),
        "{file:?}"
    );
    assert!(file.extension().is_some_and(|e| e == "jsonl"), "{file:?}");
    let mut raw = std::fs::read_to_string(file).expect("read the recording");
    // Another test's line may be half written: only whole lines count.
    raw.truncate(raw.rfind('\n').map_or(0, |i| i + 1));
    let lines = raw
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    (raw, lines)
}

/// The recorded line whose body's JSON text holds `marker`.
fn line_with<'a>(lines: &'a [Value], marker: &str) -> Option<&'a Value> {
    lines
        .iter()
        .find(|l| l["body"].to_string().contains(marker))
}

#[test]
fn a_recording_keeps_bodies_and_conversation_headers_and_never_keys() {
    let chat = json!({"model": MODEL, "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "chat-marker-1: say hi"}]});
    let r = post(
        "/v1/chat/completions",
        Some(KEY_A),
        &[("User-Agent", "record-test/1"), ("Cookie", "secret-cookie")],
        &chat,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Anthropic's client: the key as x-api-key; a conversation header that looks like a path.
    let messages = json!({"model": MODEL, "max_tokens": 2, "temperature": 0,
        "system": [{"type": "text", "text": "messages-marker-2", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "../../escape.jsonl"}]}]});
    let r = post(
        "/v1/messages?beta=true",
        None,
        &[
            ("x-api-key", KEY_B),
            ("anthropic-version", "2023-06-01"),
            ("anthropic-beta", "some-beta-2025-01-01"),
            ("X-Claude-Code-Session-Id", "../../../tmp/evil"),
        ],
        &messages,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    let responses = json!({"model": MODEL, "max_output_tokens": 2, "temperature": 0, "store": false,
        "input": [{"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": "responses-marker-3"}]}],
        "prompt_cache_key": "/etc/passwd"});
    let r = post(
        "/v1/responses",
        Some(KEY_A),
        &[("session-id", "codex-conv-1"), ("originator", "test_cli")],
        &responses,
    );
    assert_eq!(r.status, 200, "{}", r.body);

    // Refused before the recorder (no key), and not a generation route: neither is recorded.
    let unauth =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "unauth-marker-4"}]});
    assert_eq!(post("/v1/chat/completions", None, &[], &unauth).status, 401);
    let r = request_with(server(), "GET", "/v1/models", Some(KEY_A), &[], None);
    assert_eq!(r.status, 200);

    let (raw, lines) = recording();
    assert!(lines.len() >= 3, "{raw}");
    for key in [KEY_A, KEY_B, "secret-cookie"] {
        assert!(!raw.contains(key), "{key} is in the recording:\n{raw}");
    }
    assert!(!raw.to_ascii_lowercase().contains("authorization"), "{raw}");
    assert!(!raw.contains("x-api-key"), "{raw}");
    assert!(line_with(&lines, "unauth-marker-4").is_none(), "{raw}");

    let c = line_with(&lines, "chat-marker-1").expect("the chat request is recorded");
    assert_eq!(c["body"], chat);
    assert_eq!(c["path"], "/v1/chat/completions");
    assert_eq!(c["method"], "POST");
    assert_eq!(c["status"], 200);
    assert_eq!(c["key"], 0);
    assert_eq!(c["headers"]["user-agent"], "record-test/1");
    assert_eq!(c["headers"]["content-type"], "application/json");

    let m = line_with(&lines, "messages-marker-2").expect("the messages request is recorded");
    assert_eq!(m["body"], messages);
    assert_eq!(m["path"], "/v1/messages?beta=true");
    assert_eq!(m["key"], 1);
    let h = m["headers"].as_object().expect("headers");
    assert_eq!(h["x-claude-code-session-id"], "../../../tmp/evil");
    assert_eq!(h["anthropic-version"], "2023-06-01");
    assert_eq!(h["anthropic-beta"], "some-beta-2025-01-01");

    let x = line_with(&lines, "responses-marker-3").expect("the responses request is recorded");
    assert_eq!(x["body"], responses);
    assert_eq!(x["headers"]["session-id"], "codex-conv-1");
    assert_eq!(x["headers"]["originator"], "test_cli");

    let allowed = [
        "content-type",
        "anthropic-beta",
        "anthropic-version",
        "x-leyline-mode",
        "x-session-id",
        "session-id",
        "x-claude-code-session-id",
        "user-agent",
        "originator",
    ];
    for l in &lines {
        for name in l["headers"].as_object().expect("headers").keys() {
            assert!(allowed.contains(&name.as_str()), "header {name} kept: {l}");
        }
        assert!(l["t"].as_f64().is_some_and(|t| t >= 0.0), "{l}");
        assert!(l["elapsed_s"].as_f64().is_some_and(|t| t >= 0.0), "{l}");
        assert!(l["seq"].as_u64().is_some(), "{l}");
    }
    let mut seqs: Vec<u64> = lines.iter().filter_map(|l| l["seq"].as_u64()).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), lines.len(), "seq numbers are distinct");
    // Requests sent one after another: arrival order.
    assert!(c["seq"].as_u64() < m["seq"].as_u64() && m["seq"].as_u64() < x["seq"].as_u64());
    assert!(c["t"].as_f64() <= x["t"].as_f64());
}

#[test]
fn a_body_over_the_limit_is_refused_as_without_recording_and_not_recorded() {
    let big = "y".repeat(BODY_LIMIT + 10);
    let body = json!({"model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": format!("big-marker-5 {big}")}]});
    let r = post("/v1/messages", Some(KEY_A), &[], &body);
    assert_eq!(r.status, 413, "{}", r.body);
    // Answered in Anthropic's envelope, by the handler, as without the recorder.
    assert_eq!(r.json()["type"], "error", "{}", r.body);
    let r = post("/v1/chat/completions", Some(KEY_A), &[], &body);
    r.expect_error(413);
    let (raw, lines) = recording();
    assert!(!raw.contains("big-marker-5"));
    let big_lines: Vec<&Value> = lines
        .iter()
        .filter(|l| l["body_too_large"] == true)
        .collect();
    assert!(big_lines.len() >= 2, "{raw:.2000}");
    for l in big_lines {
        assert!(l["body"].is_null(), "{l}");
        assert_eq!(l["status"], 413, "{l}");
    }
}

#[test]
fn the_replay_scripts_own_tests_pass() {
    let out = Command::new("python3")
        .args(["-m", "unittest", "scripts/test_replay_http.py"])
        .current_dir(repo())
        .output()
        .expect("python3 is needed for this test");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn replaying_the_synthetic_recording_splices_its_edit_turn() {
    let addr = server();
    let recording = repo().join("crates/leyline-server/tests/data/recording-synthetic.jsonl");
    let out_dir = std::env::temp_dir().join(format!("leyline-replay-out-{}", std::process::id()));
    std::fs::create_dir_all(&out_dir).expect("out dir");
    let out_path = out_dir.join("replay.json");
    let out = Command::new("python3")
        .arg(repo().join("scripts/replay_http.py"))
        .args(["--recording".as_ref(), recording.as_os_str()])
        .args(["--base", &format!("http://{addr}")])
        .args(["--api-key", KEY_B, "--model", MODEL, "--max-tokens", "4"])
        .args(["--out".as_ref(), out_path.as_os_str()])
        .output()
        .expect("python3 is needed for this test");
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{log}");
    assert!(out.status.success(), "the replay failed:\n{log}");
    assert!(log.contains("| turn | api |"), "a Markdown table:\n{log}");
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&out_path).expect("the replay wrote --out"))
            .expect("--out is JSON");
    let _ = std::fs::remove_dir_all(&out_dir);
    let turns = report["turns"].as_array().expect("turns");
    assert_eq!(turns.len(), 11, "{report}");
    assert!(turns.iter().all(|t| t["status"] == 200), "{report}");
    let apis: Vec<&str> = turns.iter().filter_map(|t| t["api"].as_str()).collect();
    assert_eq!(apis.iter().filter(|a| **a == "messages").count(), 6);
    assert_eq!(apis.iter().filter(|a| **a == "responses").count(), 4);
    let first_edit = turns
        .iter()
        .position(|t| t["edit_turn"] == true)
        .unwrap_or_else(|| panic!("an edit turn: {report}"));
    assert!(
        turns[first_edit..].iter().any(|t| t["spliced"] == true),
        "a turn from the edit on was spliced: {report}"
    );
    // Plain turns splice too (the recorded reply replaces the one this model generated, a
    // few tokens), but the edit turn's splice moves everything after the cleared result.
    let rotated = |t: &Value| t["leyline"]["tokens_rotated"].as_u64().unwrap_or(0);
    let edit = &turns[first_edit];
    assert_eq!(edit["spliced"], true, "{edit}");
    let plain_max = turns
        .iter()
        .filter(|t| t["api"] == edit["api"] && t["edit_turn"] != true)
        .map(rotated)
        .max()
        .unwrap_or(0);
    assert!(rotated(edit) > plain_max, "{edit} vs {plain_max}");
    // The leyline object was read on every generation turn.
    for t in turns.iter().filter(|t| t["api"] != "count_tokens") {
        assert!(t["tokens_prefilled"].as_u64().is_some(), "{t}");
        assert!(t["prompt_tokens"].as_u64().is_some_and(|n| n > 0), "{t}");
    }
}
