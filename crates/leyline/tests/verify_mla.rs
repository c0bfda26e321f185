//! `leyline verify --json` on the two tiny DeepSeek-V2 (MLA) checkpoints of leyline-model's
//! fixtures: a directory has no tokenizer, so the report runs on synthetic probes and says so;
//! its counts agree with its per-probe records and the drift of `k_pe` rows (one rotary head)
//! is what the arithmetic allows. The weights are random: first tokens are near ties, so the
//! agreement counts are only checked for consistency, not against a target.

use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;

const PROBES: u64 = 4;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../leyline-model/tests/fixtures/mla")
        .join(name)
}

fn verify(name: &str, extra: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_leyline"))
        .arg("verify")
        .arg("--model")
        .arg(fixture(name))
        .args(["--probes", &PROBES.to_string(), "--json"])
        .args(["--drift-tokens", "64", "--drift-splices", "1,100"])
        .args(extra)
        .output()
        .expect("run leyline");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "leyline verify failed: {stderr}");
    assert!(
        stderr.contains("synthetic probes"),
        "no note on stderr: {stderr}"
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn check_report(name: &str, v: &Value) {
    assert_eq!(v["probe_source"], "synthetic", "{name}");
    assert_eq!(v["traces"], Value::Null, "{name}");
    assert_eq!(v["arch"], "deepseek_v2", "{name}");
    assert_eq!(v["probes"].as_u64(), Some(PROBES), "{name}");
    // The tiny model's context is 512: the budget is cut to it.
    let budget = v["probe_token_budget"]
        .as_u64()
        .expect("probe_token_budget");
    assert_eq!(budget, 510, "{name}");
    let per = v["per_probe"].as_array().expect("per_probe");
    assert_eq!(per.len() as u64, PROBES);
    for key in ["agree_full", "agree_forget", "forget_agree_full"] {
        let total = v[key].as_u64().expect(key);
        assert!(total <= PROBES, "{name}: {key} {total}");
        let counted = per.iter().filter(|p| p[key] == true).count() as u64;
        assert_eq!(
            total, counted,
            "{name}: {key} disagrees with the per-probe records"
        );
    }
    for p in per {
        let tokens = p["tokens"].as_u64().unwrap();
        assert!((budget / 2..=budget).contains(&tokens), "{name}: {p}");
        let (removed, stub) = (p["removed"].as_u64().unwrap(), p["stub"].as_u64().unwrap());
        assert!(stub >= 1 && stub < removed, "{name}: {p}");
        // The evicted span lies in the older part: more than half the prompt follows it.
        assert!(
            p["downstream"].as_u64().unwrap() > tokens / 2,
            "{name}: {p}"
        );
        for t in ["full_token", "amortize_token", "forget_token"] {
            assert!(p[t].as_u64().unwrap() < 512, "{name}: {p}");
        }
        for m in ["full_margin", "amortize_margin", "forget_margin"] {
            let x = p[m].as_f64().unwrap();
            assert!(x.is_finite() && x >= 0.0, "{name}: {p}");
        }
        let agrees = p["full_token"] == p["amortize_token"];
        assert_eq!(p["agree_full"] == true, agrees, "{name}: {p}");
        let gap = p["amortize_gap_in_full"].as_f64().unwrap();
        assert!(gap >= 0.0 && (!agrees || gap == 0.0), "{name}: {p}");
        assert!(p["amortize_forget_max_abs_diff"]
            .as_f64()
            .unwrap()
            .is_finite());
        // AMORTIZE rotated the k_pe rows of every kept token after the span (the scored last
        // token is not in the cache yet).
        let downstream = p["downstream"].as_u64().unwrap();
        assert_eq!(p["rotated"].as_u64(), Some(downstream - 1), "{name}: {p}");
    }

    // MLA's key row is k_pe alone: 8 wide, all of it rotary.
    assert_eq!(v["drift_key_width"].as_u64(), Some(8), "{name}");
    assert_eq!(v["drift_rotary_dim"].as_u64(), Some(8), "{name}");
    let drift = v["drift"].as_array().expect("drift");
    // f32, f16 and bf16 storage with f32 math, bf16 with bf16 math; eager: one rewrite a splice.
    assert_eq!(drift.len(), 2 * 4, "{name}: {drift:?}");
    let rel = |splices: u64, storage: &str, rotation: &str| -> f64 {
        drift
            .iter()
            .find(|d| {
                d["splices"] == splices && d["storage"] == storage && d["rotation"] == rotation
            })
            .and_then(|d| d["rel_l2"].as_f64())
            .unwrap_or_else(|| panic!("{name}: no drift row {splices} {storage} {rotation}"))
    };
    for d in drift {
        let r = d["rel_l2"].as_f64().expect("rel_l2");
        assert!(r.is_finite() && r >= 0.0, "{name}: {d}");
        assert_eq!(d["rewrites"], d["splices"], "{name}: {d}");
    }
    for n in [1, 100] {
        let f = rel(n, "f32", "f32");
        assert!(
            f < 1e-5,
            "{name}: f32 storage with f32 rotation drifts {f} after {n}"
        );
        // bf16 storage rounds every value to 8 bits at least once, f16 to 11.
        assert!(rel(n, "bf16", "f32") > 1e-4, "{name}");
        assert!(rel(n, "bf16", "f32") > rel(n, "f16", "f32"), "{name}");
        assert!(rel(n, "f16", "f32") > rel(n, "f32", "f32"), "{name}");
        assert!(rel(n, "bf16", "bf16") >= rel(n, "bf16", "f32"), "{name}");
    }
    assert!(rel(100, "bf16", "f32") > rel(1, "bf16", "f32"), "{name}");
}

#[test]
fn verify_runs_on_the_plain_rope_checkpoint() {
    check_report("plain", &verify("plain", &[]));
}

#[test]
fn verify_runs_on_the_yarn_checkpoint() {
    check_report("yarn", &verify("yarn", &[]));
}

#[test]
fn synthetic_probes_follow_the_seed() {
    let a = verify("plain", &["--seed", "11"]);
    let b = verify("plain", &["--seed", "11"]);
    let c = verify("plain", &["--seed", "12"]);
    assert_eq!(a["synthetic_seed"].as_u64(), Some(11));
    assert_eq!(a["per_probe"], b["per_probe"]);
    assert_ne!(a["per_probe"], c["per_probe"]);
}
