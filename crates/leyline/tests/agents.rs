//! Claude Code and Codex, unchanged, against `leyline serve` on Qwen2.5-Coder-0.5B: for each,
//! a one-shot turn, a continued turn (`claude -p --continue`, `codex exec resume --last`)
//! that must read at least 90% of its prompt from the cache with a time to first token at
//! most 0.1x the first turn's, and a turn in which the model calls a tool, the client runs
//! it and sends the result back. The clients come from npm at the versions
//! `scripts/test-clients/package.json` pins; `scripts/test-env` (the README's test command)
//! installs them under `target/test-env/node` and puts them on PATH. A missing client fails
//! the test with that instruction; nothing is skipped.
//!
//! The tool turn's decision must not hang on a hair: its first request is sent again with
//! `leyline.logprobs`, and the reply's first token must open a call (a JSON object, a code
//! fence or `<tool_call>`, the forms the server parses as calls) with a log-probability at
//! least [`MIN_CALL_MARGIN`] above the likeliest token that opens none.
//!
//! The server runs greedy (`--temperature 0 --seed 1`: neither client sets a temperature),
//! caps replies at 256 tokens (Claude Code asks for 32000, which a small model that loops
//! would fill) and records every request (`--record`), from which the tool round trips are read. The
//! time to first token of a turn is the mean over its requests of the server's
//! `leyline_ttft_us_total` per finished request.

use serde_json::Value;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "qwen2.5-coder-0.5b";
const SECRET: &str = "The secret number is 4172.";

/// Least margin, in nats, of the tool turn's call over prose at the reply's first token.
/// Fixed before measuring: a kernel change (summation order, 8-bit activations) moves
/// logits by well under 0.5, so a margin of twice that survives one.
const MIN_CALL_MARGIN: f64 = 1.0;

/// A `leyline serve` child process, killed on drop.
struct Server {
    child: Child,
    addr: String,
    record: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("its address").port()
}

/// One request on the server (`Connection: close`): the status and the body, `None` when
/// the server cannot be reached or answers no HTTP.
fn http(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(600))).ok()?;
    let data = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         anthropic-version: 2023-06-01\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{data}",
        data.len()
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, body.to_string()))
}

/// A GET on the server: the body of a 200, else `None`.
fn get(addr: &str, path: &str) -> Option<String> {
    http(addr, "GET", path, None).and_then(|(status, body)| (status == 200).then_some(body))
}

fn start_server(dir: &Path) -> Server {
    leyline_hub::known_model_path(MODEL)
        .unwrap_or_else(|e| panic!("{MODEL} is needed: `leyline model fetch {MODEL}`: {e}"));
    let addr = format!("127.0.0.1:{}", free_port());
    let record = dir.join("record");
    let log = std::fs::File::create(dir.join("server.log")).expect("server log");
    let child = Command::new(env!("CARGO_BIN_EXE_leyline"))
        .args([
            "serve",
            "--model",
            MODEL,
            "--addr",
            &addr,
            "--kv-slots",
            "40000",
        ])
        .args([
            "--temperature",
            "0",
            "--seed",
            "1",
            "--max-output-tokens",
            "256",
        ])
        .arg("--record")
        .arg(&record)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start leyline serve");
    let server = Server {
        child,
        addr,
        record,
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    while get(&server.addr, "/health").is_none() {
        assert!(Instant::now() < deadline, "the server did not come up");
        std::thread::sleep(Duration::from_millis(200));
    }
    server
}

/// The server's counters.
fn metrics(addr: &str) -> HashMap<String, f64> {
    get(addr, "/metrics")
        .expect("/metrics")
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// What the server did for the requests of one client turn.
#[derive(Debug)]
struct Turn {
    prompt: f64,
    cached: f64,
    /// Mean time to first token over the turn's requests, in seconds.
    ttft: f64,
}

fn turn(before: &HashMap<String, f64>, after: &HashMap<String, f64>) -> Turn {
    let d = |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
    let n = d("leyline_requests_finished_total");
    assert!(n >= 1.0, "the turn reached the server");
    Turn {
        prompt: d("leyline_prompt_tokens_total"),
        cached: d("leyline_cached_prompt_tokens_total"),
        ttft: d("leyline_ttft_us_total") / n / 1e6,
    }
}

/// The continued turn's acceptance: 90% of its prompt from the cache, and a time to first
/// token at most 0.1x the first turn's.
fn check_continued(client: &str, first: &Turn, second: &Turn) {
    eprintln!("{client}: first turn {first:?}, continued turn {second:?}");
    assert!(
        second.cached >= 0.9 * second.prompt,
        "{client}: the continued turn read {} of {} prompt tokens from the cache",
        second.cached,
        second.prompt
    );
    assert!(
        second.ttft <= 0.1 * first.ttft,
        "{client}: time to first token {:.3} s continued vs {:.3} s first",
        second.ttft,
        first.ttft
    );
}

/// The client's binary, from PATH.
fn client(name: &str) -> &str {
    let ok = Command::new(name)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "`{name}` is not on PATH: run the tests under scripts/test-env (the README's test command), which installs Claude Code \
         and Codex (scripts/test-clients/package.json) under target/test-env/node"
    );
    name
}

/// Runs a client command to its end (at most `limit`), and checks that it succeeded and
/// printed no API error.
fn run(what: &str, cmd: &mut Command, limit: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let started = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "{what}: {:?} in {:.1} s; stdout: {}",
        out.status,
        started.elapsed().as_secs_f64(),
        stdout.chars().take(300).collect::<String>()
    );
    assert!(
        out.status.success(),
        "{what} failed ({:?}):\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    for text in [&stdout, &stderr] {
        assert!(
            !text.contains("API Error") && !text.contains("stream error"),
            "{what}: an API error:\nstdout: {stdout}\nstderr: {stderr}"
        );
    }
    out
}

/// A POST of JSON on the server: the status and the body parsed.
fn post(addr: &str, path: &str, body: &Value) -> (u16, Value) {
    let (status, text) = http(addr, "POST", path, Some(body)).expect("an HTTP answer");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// The model's decision to call a tool on a recorded request: the request is sent again,
/// not streamed, with `leyline.logprobs`; the reply's first token must open a call, and the
/// margin (nats) of its log-probability over the likeliest token that opens none is
/// returned.
fn call_margin(server: &Server, request: &Value) -> f64 {
    let path = request["path"].as_str().expect("a path");
    let mut body = request["body"].clone();
    body["stream"] = Value::Bool(false);
    let limit = if path.starts_with("/v1/responses") {
        "max_output_tokens"
    } else {
        "max_tokens"
    };
    body[limit] = 8.into();
    body["leyline"] = serde_json::json!({"logprobs": 20});
    let (status, reply) = post(&server.addr, path, &body);
    assert_eq!(status, 200, "the decision request: {reply}");
    let first = &reply["leyline"]["logprobs"][0];
    let opens = |t: &str| {
        let t = t.trim_start();
        t.starts_with('{') || t.starts_with("```") || t.starts_with("<tool_call>")
    };
    let token = first["token"].as_str().expect("a first token");
    assert!(opens(token), "the reply opens a call: {first}");
    let prose = first["top_logprobs"]
        .as_array()
        .expect("alternatives")
        .iter()
        .find(|t| !opens(t["token"].as_str().unwrap_or_default()))
        .map_or(-9999.0, |t| t["logprob"].as_f64().expect("a logprob"));
    let margin = first["logprob"].as_f64().expect("a logprob") - prose;
    eprintln!(
        "call decision: {token:?} at {}, prose at best {prose:.3}: margin {margin:.3}",
        first["logprob"]
    );
    margin
}

/// The requests the server recorded, in order.
fn recorded(server: &Server) -> Vec<Value> {
    let mut lines = Vec::new();
    for f in std::fs::read_dir(&server.record).expect("the record directory") {
        let text = std::fs::read_to_string(f.expect("entry").path()).expect("a recording");
        lines.extend(
            text.lines()
                .map(|l| serde_json::from_str::<Value>(l).expect("JSON")),
        );
    }
    lines.sort_by_key(|l| l["seq"].as_u64());
    lines
}

#[test]
fn claude_code_turns_run_on_leyline() {
    let claude = client("claude");
    let dir = tempfile::tempdir().expect("temp dir");
    let server = start_server(dir.path());
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    std::fs::write(work.join("secret.txt"), SECRET).expect("secret file");
    // `--tools` takes several values: the prompt goes after `--`.
    let claude_cmd = |args: &[&str], prompt: &str| {
        let mut c = Command::new(claude);
        c.current_dir(&work)
            .env("ANTHROPIC_BASE_URL", format!("http://{}", server.addr))
            .env("ANTHROPIC_API_KEY", "leyline-test")
            .env("CLAUDE_CONFIG_DIR", dir.path().join("claude"))
            .env("DISABLE_TELEMETRY", "1")
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .args(["-p", "--model", MODEL])
            .args(args)
            .args(["--", prompt]);
        c
    };
    let limit = Duration::from_secs(240);
    // The default system prompt, offered one tool (the clients' own flag): 2.4K tokens.
    let m0 = metrics(&server.addr);
    let out = run(
        "claude one-shot",
        &mut claude_cmd(&["--tools", "Read"], "Reply with the single word OK."),
        limit,
    );
    assert!(!out.stdout.trim_ascii().is_empty(), "an answer");
    let m1 = metrics(&server.addr);
    run(
        "claude --continue",
        &mut claude_cmd(
            &["--continue", "--tools", "Read"],
            "Now reply with the single word YES.",
        ),
        limit,
    );
    let m2 = metrics(&server.addr);
    check_continued("Claude Code", &turn(&m0, &m1), &turn(&m1, &m2));

    // A tool turn: the model calls Read, Claude Code reads the file and sends the result.
    let before = recorded(&server).len();
    let prompt = format!(
        "Read the file {} and tell me the secret number.",
        work.join("secret.txt").display()
    );
    let out = run(
        "claude tool turn",
        &mut claude_cmd(
            &[
                "--bare",
                "--system-prompt",
                "You are a coding agent. Use the Read tool to read files.",
                "--tools",
                "Read",
                "--output-format",
                "stream-json",
                "--verbose",
            ],
            &prompt,
        ),
        limit,
    );
    let events: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let call = events.iter().find_map(|e| {
        let blocks = e["message"]["content"].as_array()?;
        blocks
            .iter()
            .find(|b| b["type"] == "tool_use" && b["name"] == "Read")
            .cloned()
    });
    let call = call.unwrap_or_else(|| panic!("the model called Read: {events:?}"));
    let result = events.iter().find_map(|e| {
        let blocks = e["message"]["content"].as_array()?;
        blocks
            .iter()
            .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == call["id"])
            .cloned()
    });
    let result = result.unwrap_or_else(|| panic!("Claude Code ran the call: {events:?}"));
    assert!(
        result.to_string().contains("4172"),
        "the tool result holds the file: {result}"
    );
    // The result reached the server, in the request after the call.
    let sent = recorded(&server).iter().any(|r| {
        r["path"]
            .as_str()
            .is_some_and(|p| p.starts_with("/v1/messages"))
            && r["body"].to_string().contains("The secret number is 4172")
    });
    assert!(sent, "the tool result was sent back to the server");
    let decision = recorded(&server)
        .into_iter()
        .skip(before)
        .find(|r| r["body"].to_string().contains("tell me the secret number"))
        .expect("the tool turn's first request was recorded");
    let margin = call_margin(&server, &decision);
    assert!(
        margin >= MIN_CALL_MARGIN,
        "Claude Code's tool call wins by {margin:.3} nats, under {MIN_CALL_MARGIN}"
    );
}

#[test]
fn codex_turns_run_on_leyline() {
    let codex = client("codex");
    let dir = tempfile::tempdir().expect("temp dir");
    let server = start_server(dir.path());
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).expect("work dir");
    std::fs::write(work.join("secret.txt"), SECRET).expect("secret file");
    let home = dir.path().join("codex");
    std::fs::create_dir_all(&home).expect("codex home");
    let provider = format!(
        "model_providers.leyline={{name=\"leyline\",base_url=\"http://{}/v1\",wire_api=\"responses\",env_key=\"LEYLINE_TEST_KEY\"}}",
        server.addr
    );
    let codex_cmd = |args: &[&str]| {
        let mut c = Command::new(codex);
        c.current_dir(&work)
            .env("CODEX_HOME", &home)
            .env("LEYLINE_TEST_KEY", "leyline-test")
            .args(["exec", "--skip-git-repo-check", "--json"])
            .args(["-c", "model_provider=leyline", "-c", &provider])
            .args(["-c", "check_for_update_on_startup=false"])
            .args(["-m", MODEL])
            .args(args);
        c
    };
    let limit = Duration::from_secs(240);
    // Codex's own instructions and tools: 6K tokens.
    let m0 = metrics(&server.addr);
    run(
        "codex one-shot",
        &mut codex_cmd(&["Reply with the single word OK."]),
        limit,
    );
    let m1 = metrics(&server.addr);
    run(
        "codex resume --last",
        &mut codex_cmd(&["resume", "--last", "Now reply with the single word YES."]),
        limit,
    );
    let m2 = metrics(&server.addr);
    check_continued("Codex", &turn(&m0, &m1), &turn(&m1, &m2));

    // A tool turn: the model calls exec_command; Codex runs it (or answers why not) and
    // sends a function_call_output for the call back.
    let before = recorded(&server).len();
    run(
        "codex tool turn",
        &mut codex_cmd(&[
            "Call the exec_command tool with cmd \"cat secret.txt\", then tell me the secret number.",
        ]),
        limit,
    );
    let requests = recorded(&server);
    let round_trip = requests[before..].iter().any(|r| {
        let items = r["body"]["input"].as_array().cloned().unwrap_or_default();
        items.iter().any(|call| {
            call["type"] == "function_call"
                && call["name"] == "exec_command"
                && items
                    .iter()
                    .any(|o| o["type"] == "function_call_output" && o["call_id"] == call["call_id"])
        })
    });
    assert!(
        round_trip,
        "a request carried the model's exec_command call and Codex's output for it"
    );
    let margin = call_margin(&server, &requests[before]);
    assert!(
        margin >= MIN_CALL_MARGIN,
        "Codex's tool call wins by {margin:.3} nats, under {MIN_CALL_MARGIN}"
    );
}
