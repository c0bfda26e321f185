//! The policy arm's harness (scripts/policy_arm.py): its own tests (task layout, tools,
//! timeouts, statistics), and a two-task smoke run on Qwen2.5-Coder-0.5B through `leyline
//! serve`: the loop, the tools, the session splices and the report work (not whether tasks are
//! solved). Needs python3 with `openai`, `pytest` and `pytest-timeout` (.ci/run installs them).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the repository root")
        .to_path_buf()
}

fn require_python_packages() {
    let ok = Command::new("python3")
        .args(["-c", "import openai, pytest, pytest_timeout"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "python3 with openai, pytest and pytest-timeout is needed: \
         python3 -m pip install openai pytest pytest-timeout (.ci/run does)"
    );
}

#[test]
fn the_harness_tests_pass() {
    require_python_packages();
    let out = Command::new("python3")
        .args(["-m", "unittest", "scripts/test_policy_arm.py"])
        .current_dir(repo())
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The server process, killed when the test ends however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn healthy(port: u16) -> bool {
    use std::io::Write;
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut r = String::new();
    let _ = s.read_to_string(&mut r);
    r.starts_with("HTTP/1.1 200")
}

#[test]
fn a_two_task_smoke_run_on_qwen_goes_through_the_loop_and_the_report() {
    require_python_packages();
    leyline_hub::known_model_path("qwen2.5-coder-0.5b")
        .expect("fetch qwen2.5-coder-0.5b (leyline model fetch qwen2.5-coder-0.5b)");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let _server = Server(
        Command::new(env!("CARGO_BIN_EXE_leyline"))
            .arg("serve")
            .args(["--model", "qwen2.5-coder-0.5b"])
            .args([
                "--addr",
                &format!("127.0.0.1:{port}"),
                "--kv-slots",
                "16384",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start leyline serve"),
    );
    let start = Instant::now();
    while !healthy(port) {
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "the server did not start"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let dir = tempfile::tempdir().expect("a scratch directory");
    let out = dir.path().join("run.jsonl");
    let run = Command::new("python3")
        .arg("scripts/policy_arm.py")
        .arg("run")
        .args(["--url", &format!("http://127.0.0.1:{port}")])
        .args(["--model", "qwen2.5-coder-0.5b", "--tasks", "gcd,bitcount"])
        .args(["--arms", "truncate", "--seeds", "0", "--max-turns", "4"])
        .args([
            "--max-tokens",
            "128",
            "--test-timeout",
            "1",
            "--task-cap",
            "300",
        ])
        .arg("--out")
        .arg(&out)
        .current_dir(repo())
        .output()
        .expect("run scripts/policy_arm.py");
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let records: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .expect("the run file")
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(records.len(), 2, "{records:?}");
    for r in &records {
        assert!(r["turns"].as_u64().unwrap() >= 1, "{r}");
        assert!(r["prompt_tokens"].as_u64().unwrap() > 100, "{r}");
        assert!(r["end"] == "submit" || r["end"] == "turn_limit", "{r}");
    }
    let calls: u64 = records
        .iter()
        .map(|r| r["tool_calls"].as_u64().unwrap())
        .sum();
    assert!(calls >= 1, "the model called no tool: {records:?}");
    // A rerun resumes: nothing left to do.
    let again = Command::new("python3")
        .arg("scripts/policy_arm.py")
        .arg("run")
        .args(["--url", &format!("http://127.0.0.1:{port}")])
        .args(["--model", "qwen2.5-coder-0.5b", "--tasks", "gcd,bitcount"])
        .args(["--arms", "truncate", "--seeds", "0", "--out"])
        .arg(&out)
        .current_dir(repo())
        .output()
        .expect("rerun");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("2 done, 0 to run"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let report = Command::new("python3")
        .args(["scripts/policy_arm.py", "report", "--out"])
        .arg(&out)
        .current_dir(repo())
        .output()
        .expect("report");
    let text = String::from_utf8_lossy(&report.stdout);
    assert!(
        report.status.success() && text.contains("| truncate | 2 |"),
        "{text}"
    );
}
