//! `serve --record DIR`: every generation request a client sends, one JSON line each, so that
//! a real client's session (Claude Code, Codex) becomes a replay trace
//! (`scripts/replay_http.py --recording`).
//!
//! Design decision: an allowlist, not a denylist. A line keeps the body as sent and only the
//! headers a replay needs (content type, API versions and betas, Leyline's mode, the
//! conversation names, the client's name); `Authorization` and `x-api-key` are never among
//! them, and a kept header value or body string holding a configured key has the key
//! replaced. The file's name is generated (`<unix-ms-at-start>.jsonl` under the directory),
//! never taken from a request. The middleware buffers the body within `max_body_bytes` and
//! hands the bytes on, so the handler reads the same body as without it.

use crate::auth::Principal;
use crate::error::{Result, ServerError};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Map, Value};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

/// The routes whose POSTs are recorded.
const RECORDED: [&str; 5] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
];

/// The request headers a line keeps (lower case); every other header is dropped.
const KEPT_HEADERS: [&str; 9] = [
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

/// What replaces a configured API key found in a kept header value or a body string.
const REDACTED: &str = "[redacted]";

/// Keys shorter than this are not searched for in body strings: replacing a short key
/// everywhere would garble the recording (header values are checked for every key).
const MIN_BODY_KEY_LEN: usize = 8;

/// The open recording of one server start, with what recording a request needs of the
/// server's configuration.
pub(crate) struct Recorder {
    file: Mutex<File>,
    path: PathBuf,
    start: Instant,
    seq: AtomicU64,
    warned: AtomicBool,
    /// The configured API keys: redacted wherever a line would hold one.
    keys: Vec<String>,
    /// The server's body size limit and body timeout (`Config::max_body_bytes`,
    /// `Config::body_timeout`), which buffering a body keeps.
    max_body_bytes: usize,
    body_timeout: Duration,
}

impl Recorder {
    /// Creates `dir` if missing and a new file `<unix-ms-now>.jsonl` in it (`-1`, `-2`, ...
    /// appended when a file of that name exists). `keys` are redacted from every line;
    /// bodies are read within `max_body_bytes` and `body_timeout`.
    ///
    /// # Errors
    /// [`ServerError::Startup`] when the directory or the file cannot be created.
    pub(crate) fn open(
        dir: &Path,
        keys: Vec<String>,
        max_body_bytes: usize,
        body_timeout: Duration,
    ) -> Result<Self> {
        let fail = |what: &str, e: std::io::Error| {
            ServerError::Startup(format!("--record {}: {what}: {e}", dir.display()))
        };
        std::fs::create_dir_all(dir).map_err(|e| fail("cannot create the directory", e))?;
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis())
            .unwrap_or(0);
        let mut n = 0u32;
        loop {
            let name = match n {
                0 => format!("{ms}.jsonl"),
                n => format!("{ms}-{n}.jsonl"),
            };
            let path = dir.join(name);
            match File::options().append(true).create_new(true).open(&path) {
                Ok(file) => {
                    tracing::info!("recording requests to {}", path.display());
                    return Ok(Self {
                        file: Mutex::new(file),
                        path,
                        start: Instant::now(),
                        seq: AtomicU64::new(0),
                        warned: AtomicBool::new(false),
                        keys,
                        max_body_bytes,
                        body_timeout,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 1000 => n += 1,
                Err(e) => return Err(fail("cannot create the recording file", e)),
            }
        }
    }

    /// Appends one line; a failure is logged once and otherwise ignored (serving goes on).
    fn write(&self, line: &Value) {
        let mut bytes = line.to_string().into_bytes();
        bytes.push(b'\n');
        let res = match self.file.lock() {
            Ok(mut f) => f.write_all(&bytes),
            Err(_) => Err(std::io::Error::other(
                "the recording file's lock is poisoned",
            )),
        };
        if let Err(e) = res {
            if !self.warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "writing the recording {} failed (further failures are not logged): {e}",
                    self.path.display()
                );
            }
        }
    }
}

/// `router` with the recording middleware on its routes when the server records; to be
/// layered inside `require_key`, so that a line names the key index the caller used.
pub(crate) fn layer<S>(router: Router<S>, recorder: Option<&Arc<Recorder>>) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    match recorder {
        Some(rec) => router.route_layer(from_fn_with_state(Arc::clone(rec), record)),
        None => router,
    }
}

/// Middleware: buffers a recorded route's body, runs the handler on it, and writes the line
/// once the response head is ready.
async fn record(State(rec): State<Arc<Recorder>>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST || !RECORDED.contains(&req.uri().path()) {
        return next.run(req).await;
    }
    let arrived = Instant::now();
    let seq = rec.seq.fetch_add(1, Ordering::Relaxed);
    let t = arrived.duration_since(rec.start).as_secs_f64();
    let path = req
        .uri()
        .path_and_query()
        .map_or_else(|| req.uri().path().to_string(), |p| p.as_str().to_string());
    let keys = &rec.keys;
    let headers = kept_headers(req.headers(), keys);
    let key = match req.extensions().get::<Principal>() {
        Some(Principal::Key(i)) => json!(i),
        _ => Value::Null,
    };
    let (parts, body) = req.into_parts();
    let (body, recorded) = match buffer(body, &rec).await {
        Ok(b) => b,
        Err(e) if parts.uri.path().starts_with("/v1/messages") => {
            return crate::anthropic::error_response(e)
        }
        Err(e) => return e.into_response(),
    };
    let mut line = json!({
        "seq": seq,
        "t": t,
        "method": "POST",
        "path": path,
        "headers": headers,
        "status": Value::Null,
        "elapsed_s": Value::Null,
        "key": key,
    });
    match recorded {
        Recorded::Json(mut v) => {
            redact_strings(&mut v, keys);
            line["body"] = v;
        }
        Recorded::NotJson(text) => {
            line["body"] = Value::Null;
            line["body_text"] = Value::String(redact(&text, keys, MIN_BODY_KEY_LEN));
        }
        Recorded::TooLarge => {
            line["body"] = Value::Null;
            line["body_too_large"] = Value::Bool(true);
        }
    }
    let mut pending = Pending {
        rec: Arc::clone(&rec),
        line: Some(line),
        arrived,
    };
    let resp = next.run(Request::from_parts(parts, body)).await;
    pending.finish(Some(resp.status().as_u16()));
    resp
}

/// A request's line until it is written: at the response head, or, when the client goes
/// away first (the handler's future is dropped), with `status: null` and `cancelled: true`,
/// so that the replay still sends what the client sent.
struct Pending {
    rec: Arc<Recorder>,
    line: Option<Value>,
    arrived: Instant,
}

impl Pending {
    fn finish(&mut self, status: Option<u16>) {
        let Some(mut line) = self.line.take() else {
            return;
        };
        line["status"] = json!(status);
        line["elapsed_s"] = json!(self.arrived.elapsed().as_secs_f64());
        if status.is_none() {
            line["cancelled"] = Value::Bool(true);
        }
        self.rec.write(&line);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.finish(None);
    }
}

/// What a line keeps of a body.
enum Recorded {
    Json(Value),
    NotJson(String),
    /// Past `max_body_bytes`: passed on unrecorded (the handler answers 413).
    TooLarge,
}

/// Reads `body` within the server's size limit and body timeout; returns a body that yields
/// the same bytes for the handler, and what to record. A body over the limit is handed on
/// as it arrives (the bytes read first, then the rest), for the handler to refuse.
async fn buffer(body: Body, rec: &Recorder) -> Result<(Body, Recorded)> {
    let limit = rec.max_body_bytes;
    let timeout = rec.body_timeout;
    let mut stream = body.into_data_stream();
    let mut buf: Vec<u8> = Vec::new();
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk
                .map_err(|e| ServerError::bad_request(format!("reading the body failed: {e}")))?;
            buf.extend_from_slice(&chunk);
            if buf.len() > limit {
                return Ok(false);
            }
        }
        Ok::<bool, ServerError>(true)
    };
    let whole = tokio::time::timeout(timeout, read).await.map_err(|_| {
        ServerError::RequestTimeout(format!(
            "the request body did not arrive within {} s",
            timeout.as_secs_f64()
        ))
    })??;
    if !whole {
        let first = tokio_stream::once(Ok::<Bytes, axum::Error>(Bytes::from(buf)));
        return Ok((Body::from_stream(first.chain(stream)), Recorded::TooLarge));
    }
    let recorded = match serde_json::from_slice::<Value>(&buf) {
        Ok(v) => Recorded::Json(v),
        Err(_) => Recorded::NotJson(String::from_utf8_lossy(&buf).into_owned()),
    };
    Ok((Body::from(buf), recorded))
}

/// The kept headers of a request, names lower case; a value holding a configured key is
/// replaced whole, a value that is not text is left out.
fn kept_headers(headers: &axum::http::HeaderMap, keys: &[String]) -> Map<String, Value> {
    let mut out = Map::new();
    for name in KEPT_HEADERS {
        let Some(v) = headers.get(name).and_then(|v| v.to_str().ok()) else {
            continue;
        };
        let v = if keys.iter().any(|k| !k.is_empty() && v.contains(k.as_str())) {
            REDACTED
        } else {
            v
        };
        out.insert(name.to_string(), Value::String(v.to_string()));
    }
    out
}

/// `text` with every configured key of at least `min_len` bytes replaced.
fn redact(text: &str, keys: &[String], min_len: usize) -> String {
    let mut text = text.to_string();
    for k in keys.iter().filter(|k| k.len() >= min_len.max(1)) {
        if text.contains(k.as_str()) {
            text = text.replace(k.as_str(), REDACTED);
        }
    }
    text
}

/// Replaces configured keys (of at least [`MIN_BODY_KEY_LEN`] bytes) in every string of `v`,
/// object keys included.
fn redact_strings(v: &mut Value, keys: &[String]) {
    if !keys.iter().any(|k| k.len() >= MIN_BODY_KEY_LEN) {
        return;
    }
    match v {
        Value::String(s) if keys.iter().any(|k| s.contains(k.as_str())) => {
            *s = redact(s, keys, MIN_BODY_KEY_LEN);
        }
        Value::Array(a) => a.iter_mut().for_each(|x| redact_strings(x, keys)),
        Value::Object(o) => {
            let leaky: Vec<String> = o
                .keys()
                .filter(|name| keys.iter().any(|k| name.contains(k.as_str())))
                .cloned()
                .collect();
            for name in leaky {
                if let Some(x) = o.remove(&name) {
                    o.insert(redact(&name, keys, MIN_BODY_KEY_LEN), x);
                }
            }
            o.values_mut().for_each(|x| redact_strings(x, keys));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{HeaderMap, HeaderValue};

    #[test]
    fn only_the_kept_headers_stay_and_keys_never_do() {
        let keys = vec!["sk-secret-0123456789".to_string()];
        let mut h = HeaderMap::new();
        for (name, value) in [
            ("authorization", "Bearer sk-secret-0123456789"),
            ("x-api-key", "sk-secret-0123456789"),
            ("cookie", "a=b"),
            ("x-claude-code-session-id", "conv-1"),
            ("user-agent", "ua sk-secret-0123456789"),
        ] {
            h.insert(name, HeaderValue::from_static(value));
        }
        let kept = kept_headers(&h, &keys);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert_eq!(kept["x-claude-code-session-id"], "conv-1");
        assert_eq!(kept["user-agent"], REDACTED);
        let mut body = json!({"messages": [{"content": "my key is sk-secret-0123456789"}],
                              "sk-secret-0123456789": 1});
        redact_strings(&mut body, &keys);
        assert!(!body.to_string().contains("sk-secret"), "{body}");
        assert_eq!(body["messages"][0]["content"], "my key is [redacted]");
        // A short key is not searched for in body text (it would garble it).
        let mut short = json!({"text": "abc"});
        redact_strings(&mut short, &["abc".to_string()]);
        assert_eq!(short["text"], "abc");
    }

    #[test]
    fn files_are_named_by_the_server_and_never_clobbered() {
        let dir = std::env::temp_dir().join(format!("leyline-record-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let open = || {
            Recorder::open(
                &dir.join("nested"),
                Vec::new(),
                1 << 20,
                Duration::from_secs(5),
            )
        };
        let (a, b) = (open().unwrap(), open().unwrap());
        assert_ne!(a.path, b.path);
        for r in [&a, &b] {
            assert_eq!(r.path.parent(), Some(dir.join("nested").as_path()));
            assert!(r.path.extension().is_some_and(|e| e == "jsonl"));
        }
        a.write(&json!({"seq": 0}));
        a.write(&json!({"seq": 1}));
        let text = std::fs::read_to_string(&a.path).unwrap();
        assert_eq!(text, "{\"seq\":0}\n{\"seq\":1}\n");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
