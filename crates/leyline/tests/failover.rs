//! Scale-out: three replicas behind nginx on loopback (deploy/local.sh), 24 conversations of
//! recorded tau-bench trajectories routed by `X-Session-Id`, one replica killed mid-round
//! (deploy/scale_out.py). Every conversation completes, the killed replica's conversations
//! are rebuilt on the others, and no other conversation moves. Needs nginx and curl
//! (`.ci/run` installs them) and python3.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the repository root")
        .to_path_buf()
}

fn require(tool: &str, probe: &[&str]) {
    let ok = Command::new(tool)
        .args(probe)
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{tool} is needed by the failover test: apt-get install nginx-light curl (.ci/run does)"
    );
}

/// A base port whose next four are likely free: a port the OS just handed out.
fn free_base_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let p = l.local_addr().expect("its address").port();
    if p > 65000 {
        p - 100
    } else {
        p
    }
}

#[test]
fn killing_a_replica_moves_only_its_conversations_and_each_is_rebuilt() {
    require("nginx", &["-v"]);
    require("curl", &["--version"]);
    leyline_hub::default_model_path().expect("fetch the default model");
    let root = repo();
    let traces = root.join("data/traces/tau-bench.jsonl");
    assert!(traces.exists(), "no tau-bench trajectories at {traces:?}");
    let dir = tempfile::Builder::new()
        .prefix("leyline-failover-")
        .tempdir()
        .expect("a scratch directory");
    let out = dir.path().join("failover.json");
    let run = Command::new("python3")
        .arg(root.join("deploy/scale_out.py"))
        .args(["--replicas", "3", "--sessions", "24", "--turns", "4"])
        .args(["--kill-in-round", "2", "--check", "--traces"])
        .arg(&traces)
        .arg("--out")
        .arg(&out)
        .env("LEYLINE", env!("CARGO_BIN_EXE_leyline"))
        .env("LEYLINE_PORT", free_base_port().to_string())
        .env("LEYLINE_DEPLOY_DIR", dir.path().join("deploy"))
        .env("LEYLINE_SERVE_ARGS", "--threads 1 --kv-slots 16384")
        .output()
        .expect("run deploy/scale_out.py");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "the failover check failed:\n{stderr}");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("the report")).expect("JSON");
    let s = &v["summary"];
    assert_eq!(s["requests"], 96, "{s}");
    assert_eq!(s["reached_holder_share"], 1.0, "{s}");
    let moved = s["conversations_moved"].as_u64().expect("moved");
    assert!(moved > 0 && moved < 24, "{s}");
    assert_eq!(s["rebuilt_turns"].as_u64(), Some(moved), "{s}");
}
