//! A real server on a free loopback port, over the default model, shared by the tests of
//! one test binary; and a minimal blocking HTTP/1.1 client (one connection per request).
#![allow(dead_code)]

use leyline_engine::{Engine, EngineConfig, EngineThread};
use leyline_server::{AppState, Server, ServerConfig};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The two API keys the test server accepts.
pub const KEY_A: &str = "test-key-a";
/// The second key.
pub const KEY_B: &str = "test-key-b";
/// The served model id.
pub const MODEL: &str = "smollm2-test";
/// Body limit of the test server.
pub const BODY_LIMIT: usize = 1 << 20;

/// The test server's address; started on first use.
pub fn server() -> SocketAddr {
    static ADDR: OnceLock<SocketAddr> = OnceLock::new();
    *ADDR.get_or_init(|| {
        let cfg = EngineConfig {
            prefill_chunk: 256,
            ..EngineConfig::new(8192)
        };
        start_server(cfg, |sc| {
            sc.api_keys = vec![KEY_A.to_string(), KEY_B.to_string()];
            sc.max_body_bytes = BODY_LIMIT;
            sc.default_max_tokens = 16;
            sc.aliases = vec![format!("{MODEL}-alias")];
            // Keep-alive events show within a short prefill.
            sc.stream_keepalive = Duration::from_millis(200);
        })
    })
}

/// Starts a server over the default model with `engine` settings, on a free loopback port,
/// after `configure` has adjusted its settings (model name `MODEL`); it serves until the
/// test process exits.
pub fn start_server(
    engine: EngineConfig,
    configure: impl FnOnce(&mut ServerConfig) + Send + 'static,
) -> SocketAddr {
    let path =
        leyline_hub::default_model_path().expect("the default model is needed: fetching it failed");
    start_server_on(path, engine, configure)
}

/// [`start_server`] over the GGUF file at `path`.
pub fn start_server_on(
    path: std::path::PathBuf,
    engine: EngineConfig,
    configure: impl FnOnce(&mut ServerConfig) + Send + 'static,
) -> SocketAddr {
    start_server_with(path, engine, |_| {}, configure)
}

/// [`start_server_on`], the loaded model adjusted by `adjust` first (another template).
pub fn start_server_with(
    path: std::path::PathBuf,
    engine: EngineConfig,
    adjust: impl FnOnce(&mut leyline_model::LoadedModel) + Send + 'static,
    configure: impl FnOnce(&mut ServerConfig) + Send + 'static,
) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lm = leyline_model::load_gguf(&path).expect("load the default model");
        adjust(&mut lm);
        let engine = Engine::new(Arc::clone(&lm.model), engine).expect("engine");
        let thread = EngineThread::spawn(engine).expect("engine thread");
        let mut sc = ServerConfig::new(MODEL);
        sc.addr = SocketAddr::from(([127, 0, 0, 1], 0));
        configure(&mut sc);
        let state = AppState::new(sc, thread.handle(), lm).expect("state");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let server = Server::start(state).await.expect("bind");
            tx.send(server.local_addr()).expect("report address");
            // Serve until the test process exits.
            std::future::pending::<()>().await;
            drop((server, thread));
        });
    });
    rx.recv_timeout(Duration::from_secs(300))
        .expect("the test server started")
}

/// A response: status, lower-cased headers, body (de-chunked).
#[derive(Debug)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Header lines, lower-cased names.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: String,
}

impl Resp {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts an OpenAI error body with `status`; returns its `error` object.
    pub fn expect_error(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status, status, "body: {}", self.body);
        let v = self.json();
        let e = v
            .get("error")
            .unwrap_or_else(|| panic!("no error object: {}", self.body))
            .clone();
        for k in ["message", "type", "param", "code"] {
            assert!(e.get(k).is_some(), "error lacks {k}: {e}");
        }
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
        e
    }
}

/// Sends one request to the shared test server; `key` becomes a Bearer header.
pub fn request(method: &str, path: &str, key: Option<&str>, body: Option<&[u8]>) -> Resp {
    request_to(server(), method, path, key, body)
}

/// Sends one request to the server at `addr`.
pub fn request_to(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&[u8]>,
) -> Resp {
    request_with(addr, method, path, key, &[], body)
}

/// [`request_to`] with extra header lines.
pub fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(300))).ok();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(k) = key {
        head.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).expect("write head");
    if let Some(b) = body {
        // A server may answer (413) before reading everything; that is fine here.
        let _ = s.write_all(b);
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_response(&raw)
}

/// `POST path` with a JSON body and key A.
pub fn post(path: &str, body: &serde_json::Value) -> Resp {
    request("POST", path, Some(KEY_A), Some(body.to_string().as_bytes()))
}

/// `GET path` with key A.
pub fn get(path: &str) -> Resp {
    request("GET", path, Some(KEY_A), None)
}

fn parse_response(raw: &[u8]) -> Resp {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| {
            panic!(
                "no header end in response: {:?}",
                String::from_utf8_lossy(raw)
            )
        });
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    if headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"))
    {
        body = dechunk(&body);
    }
    Resp {
        status,
        headers,
        body: String::from_utf8(body).expect("UTF-8 body"),
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("0").trim(), 16)
            .expect("chunk size");
        if size == 0 {
            break;
        }
        let start = eol + 2;
        assert!(b.len() >= start + size, "truncated chunk");
        out.extend_from_slice(&b[start..start + size]);
        b = &b[(start + size + 2).min(b.len())..];
    }
    out
}

/// Parses an SSE body into its `data:` payloads, checking the framing: every event is one
/// `data: ` line followed by a blank line (comment lines allowed), and the last is `[DONE]`.
pub fn sse_data(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let datas: Vec<&str> = event.lines().filter(|l| !l.starts_with(':')).collect();
        if datas.is_empty() {
            continue;
        }
        assert_eq!(datas.len(), 1, "one data line per event: {event:?}");
        let d = datas[0]
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data line: {:?}", datas[0]));
        out.push(d.to_string());
    }
    assert_eq!(
        out.last().map(String::as_str),
        Some("[DONE]"),
        "stream ends with [DONE]: {body}"
    );
    out
}

/// The value of a metric line `name value` in a Prometheus exposition.
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Runs `tests/python/{script}` against the shared test server (`BASE_URL MODEL KEY_A
/// KEY_B`, base URL ending in `/v1` unless `bare_base`), failing with its output unless it
/// exits 0 within 600 s. Fails, never skips, when python3 or the package `package` is missing.
pub fn run_client_script(script: &str, package: &str, bare_base: bool) {
    run_client_script_on(server(), script, package, bare_base)
}

/// [`run_client_script`] against the server at `addr`.
pub fn run_client_script_on(addr: SocketAddr, script: &str, package: &str, bare_base: bool) {
    use std::process::{Command, Stdio};
    use std::time::Instant;
    let probe = Command::new("python3")
        .args([
            "-c",
            &format!("import {package}; print({package}.__version__)"),
        ])
        .output();
    match probe {
        Err(e) => panic!("python3 is needed for this test and could not run: {e}"),
        Ok(o) if !o.status.success() => panic!(
            "the Python package `{package}` is needed for this test: `python3 -m pip install {package}` ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Ok(_) => {}
    }
    let path = format!("{}/tests/python/{script}", env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("leyline-{package}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let out_path = dir.join("out.txt");
    let out = std::fs::File::create(&out_path).expect("output file");
    let base = if bare_base {
        format!("http://{addr}")
    } else {
        format!("http://{addr}/v1")
    };
    let mut child = Command::new("python3")
        .arg(&path)
        .arg(base)
        .args([MODEL, KEY_A, KEY_B])
        .stdout(Stdio::from(out.try_clone().expect("dup")))
        .stderr(Stdio::from(out))
        .spawn()
        .expect("start python3");
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let log = std::fs::read_to_string(&out_path).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&dir);
    println!("{log}");
    match status {
        None => panic!("{script} ran past 600 s:\n{log}"),
        Some(s) => assert!(s.success(), "{script} failed ({s}):\n{log}"),
    }
}
