//! `leyline bench replay` on a small replay (2 sessions, 3 turns, 2 tokens, C=2), through the
//! binary and the default model: per-request counts add up, agree with the engine's own
//! counters, the three arms see the same prompts, AMORTIZE reuses more than the baseline on
//! edit turns, and two runs give identical counts.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

fn trajectory(id: &str, topic: &str) -> String {
    // Outputs with different words, so the diff pairs each output with its own stub.
    const WORDS: [&str; 3] = [
        "harbour gauge north",
        "ridge sensor eastern",
        "valley probe deep",
    ];
    let out = |k: usize| {
        let w = WORDS[k];
        let lines: Vec<String> = (0..12)
            .map(|i| format!("{w} {topic} reading {i}"))
            .collect();
        lines.join("; ")
    };
    let call = |k: usize| {
        format!("Let me look.\n<tool_call>{{\"name\":\"lookup\",\"arguments\":{{\"key\":\"{topic}-{k}\"}}}}</tool_call>")
    };
    let messages = serde_json::json!([
        {"role": "system", "content": "You are a careful assistant with a lookup tool."},
        {"role": "user", "content": format!("Tell me about {topic}.")},
        {"role": "assistant", "content": call(0)},
        {"role": "tool", "name": "lookup", "content": out(0)},
        {"role": "assistant", "content": call(1)},
        {"role": "tool", "name": "lookup", "content": out(1)},
        {"role": "assistant", "content": call(2)},
        {"role": "tool", "name": "lookup", "content": out(2)},
        {"role": "assistant", "content": format!("That is all about {topic}.")},
    ]);
    serde_json::json!({"id": id, "source": "test", "messages": messages}).to_string()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("leyline-replay-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn replay(traces: &Path, out: &Path) -> Value {
    let st = Command::new(env!("CARGO_BIN_EXE_leyline"))
        .args(["bench", "replay", "--traces"])
        .arg(traces)
        .args([
            "--policy",
            "truncate_tool_outputs:0",
            "--arms",
            "baseline,amortize,forget",
            "--concurrency",
            "2",
            "--sessions",
            "2",
            "--max-turns",
            "3",
            "--max-tokens",
            "2",
            "--out",
        ])
        .arg(out)
        .status()
        .expect("run the leyline binary");
    assert!(st.success(), "bench replay failed: {st}");
    let text = std::fs::read_to_string(out.join("replay.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// The deterministic part of every record: its arm, then its counts.
fn counts(j: &Value) -> Vec<(String, Vec<u64>)> {
    let keys = [
        "session",
        "turn",
        "prompt_tokens",
        "cached_tokens",
        "prefilled_tokens",
        "directives",
        "rotated_tokens",
        "completion_tokens",
    ];
    let mut v: Vec<_> = j["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let arm = r["arm"].as_str().unwrap().to_string();
            (arm, keys.iter().map(|k| u(r, k)).collect())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn replay_counts_add_up_and_repeat() {
    let dir = scratch("counts");
    let traces = dir.join("t.jsonl");
    std::fs::write(
        &traces,
        format!(
            "{}\n{}\n",
            trajectory("a", "tides"),
            trajectory("b", "volcanoes")
        ),
    )
    .unwrap();
    let first = replay(&traces, &dir.join("out1"));
    let reqs = first["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 3 * 2 * 3, "3 arms x 2 sessions x 3 turns");

    for r in reqs {
        assert_eq!(
            u(r, "cached_tokens") + u(r, "prefilled_tokens"),
            u(r, "prompt_tokens"),
            "{r}"
        );
        assert!(u(r, "completion_tokens") <= 2);
    }
    // Every arm sends the same prompts.
    let prompt = |arm: &str, s: u64, t: u64| {
        reqs.iter()
            .find(|r| r["arm"] == arm && u(r, "session") == s && u(r, "turn") == t)
            .unwrap_or_else(|| panic!("{arm} {s} {t}"))
    };
    for s in 0..2 {
        for t in 0..3 {
            let b = u(prompt("baseline", s, t), "prompt_tokens");
            assert_eq!(u(prompt("amortize", s, t), "prompt_tokens"), b);
            assert_eq!(u(prompt("forget", s, t), "prompt_tokens"), b);
        }
    }
    // The per-request split agrees with the engine's own counters of each run: prompt and
    // cached tokens at admission, and every token that went through a prefill forward.
    for run in first["runs"].as_array().unwrap() {
        let m = &run["engine_metrics"];
        let rs: Vec<&Value> = reqs
            .iter()
            .filter(|r| r["arm"] == run["arm"] && r["concurrency"] == run["concurrency"])
            .collect();
        let sum = |k: &str| rs.iter().map(|r| u(r, k)).sum::<u64>();
        assert_eq!(u(m, "prompt_tokens"), sum("prompt_tokens"), "{run}");
        assert_eq!(u(m, "cached_prompt_tokens"), sum("cached_tokens"), "{run}");
        assert_eq!(
            u(m, "prefilled_tokens"),
            sum("prefilled_tokens") + sum("edit_wasted_tokens"),
            "{run}"
        );
        assert_eq!(u(m, "requests_failed"), 0);
    }
    // The policy edits turn 2 (the first tool output becomes a stub); AMORTIZE keeps the
    // tokens after the stub, the baseline and FORGET prefill them again.
    let mut saw_edit = false;
    for s in 0..2 {
        let a = prompt("amortize", s, 2);
        if !a["edit_turn"].as_bool().unwrap() {
            continue;
        }
        saw_edit = true;
        let b = prompt("baseline", s, 2);
        let f = prompt("forget", s, 2);
        assert!(u(a, "directives") >= 1 && u(a, "rotated_tokens") > 0, "{a}");
        assert!(u(a, "cached_tokens") > u(b, "cached_tokens"), "{a}\n{b}");
        assert!(u(f, "cached_tokens") <= u(a, "cached_tokens"), "{f}\n{a}");
    }
    assert!(saw_edit, "the policy should edit turn 2");
    // Summary rows: one per (arm, C), hit rate = cached / prompt.
    let summary = first["summary"].as_array().unwrap();
    assert_eq!(summary.len(), 3);
    for row in summary {
        for k in [
            "arm",
            "concurrency",
            "requests",
            "prompt_tokens",
            "cached_tokens",
            "prefilled_tokens",
            "cache_hit_rate",
            "ttft_p50_ms",
            "e2e_p50_ms",
            "e2e_p50_ms_edit_turns",
        ] {
            assert!(!row[k].is_null(), "{k} missing in {row}");
        }
        let rate = row["cache_hit_rate"].as_f64().unwrap();
        let want = u(row, "cached_tokens") as f64 / u(row, "prompt_tokens") as f64;
        assert!((rate - want).abs() < 1e-12);
    }
    for f in ["replay.md", "replay_cache_hit.png", "replay_latency.png"] {
        let bytes = std::fs::read(dir.join("out1").join(f)).unwrap();
        assert!(bytes.len() > 100, "{f} is empty");
        if f.ends_with(".png") {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{f} is not a PNG");
        }
    }

    let second = replay(&traces, &dir.join("out2"));
    assert_eq!(counts(&first), counts(&second), "two runs, same counts");
    let _ = std::fs::remove_dir_all(&dir);
}
