//! The official `openai` Python client against a real server (tests/python/openai_client.py):
//! plain and streamed chat, a two-turn session whose tool output is edited under AMORTIZE
//! and FORGET, 16 concurrent streams, auth and error cases. Fails (never skips) when
//! python3 or the `openai` package is missing.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn official_openai_client_conformance() {
    let probe = Command::new("python3")
        .args(["-c", "import openai; print(openai.__version__)"])
        .output();
    match probe {
        Err(e) => panic!("python3 is needed for this test and could not run: {e}"),
        Ok(o) if !o.status.success() => panic!(
            "the Python package `openai` is needed for this test: `python3 -m pip install openai` ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Ok(_) => {}
    }
    let addr = common::server();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let dir = std::env::temp_dir().join(format!("leyline-openai-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let out_path = dir.join("out.txt");
    let out = std::fs::File::create(&out_path).expect("output file");
    let mut child = Command::new("python3")
        .arg(script)
        .arg(format!("http://{addr}/v1"))
        .args([common::MODEL, common::KEY_A, common::KEY_B])
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
        None => panic!("the openai client script ran past 600 s:\n{log}"),
        Some(s) => assert!(s.success(), "the openai client script failed ({s}):\n{log}"),
    }
}
