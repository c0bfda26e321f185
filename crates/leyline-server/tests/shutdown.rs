//! Graceful shutdown: a stream still running when the grace period ends gets an error event
//! and `[DONE]`, shutdown returns in bounded time, and the port stops accepting.

use leyline_engine::{Engine, EngineConfig, EngineThread};
use leyline_server::{AppState, Server, ServerConfig};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn in_flight_streams_end_with_an_error_event_and_nothing_hangs() {
    let path = leyline_hub::default_model_path().expect("the default model");
    let lm = leyline_model::load_gguf(&path).expect("load the default model");
    let engine = Engine::new(Arc::clone(&lm.model), EngineConfig::new(2048)).expect("engine");
    let thread = EngineThread::spawn(engine).expect("engine thread");
    let mut cfg = ServerConfig::new("m");
    cfg.addr = SocketAddr::from(([127, 0, 0, 1], 0));
    cfg.shutdown_grace = Duration::from_millis(300);
    let state = AppState::new(cfg, thread.handle(), lm).expect("state");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(Server::start(state)).expect("bind");
    let addr = server.local_addr();

    // A stream far longer than the grace period (about 50 tokens/s here).
    let body = r#"{"model": "m", "prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": true}"#;
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    for _ in 0..64 {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 || line.starts_with("data: ") {
            break;
        }
    }
    assert!(line.starts_with("data: "), "the stream started: {line:?}");

    let t0 = Instant::now();
    rt.block_on(server.shutdown());
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        t0.elapsed()
    );
    let mut rest = String::new();
    let _ = reader.read_to_string(&mut rest);
    assert!(
        rest.contains("\"shutting_down\""),
        "an error event ends the stream: {rest}"
    );
    assert!(rest.contains("data: [DONE]"), "{rest}");
    assert!(TcpStream::connect(addr).is_err(), "the port is closed");
    drop(rt);
    thread.shutdown();
}
