//! `leyline verify --json` end to end on the default model: the report's fields exist and
//! agree with each other, and the drift figures order as the arithmetic says they must.

use std::path::PathBuf;
use std::process::Command;

fn traces() -> PathBuf {
    // crates/leyline -> the workspace root -> its sibling `shared/`.
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    [root.join("../shared/data/traces"), root.join("data/traces")]
        .into_iter()
        .map(|d| d.join("tau-bench.jsonl"))
        .find(|p| p.is_file())
        .expect("tau-bench.jsonl under ../shared/data/traces or data/traces")
}

/// `leyline verify --max-tokens-per-probe 2600 --json` on the tau-bench traces with `args`.
fn verify_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_leyline"))
        .args(["verify", "--max-tokens-per-probe", "2600", "--json"])
        .args(args)
        .arg("--traces")
        .arg(traces())
        .output()
        .expect("run leyline");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "leyline verify failed: {stderr}");
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn verify_json_reports_consistent_agreement_and_drift() {
    let v = verify_json(&[
        "--probes",
        "3",
        "--drift-tokens",
        "32",
        "--drift-splices",
        "1,100",
    ]);

    let n = v["probes"].as_u64().expect("probes");
    assert!((1..=3).contains(&n), "probes {n}");
    let per = v["per_probe"].as_array().expect("per_probe");
    assert_eq!(per.len() as u64, n);
    for (key, field) in [
        ("agree_full", "agree_full"),
        ("agree_forget", "agree_forget"),
    ] {
        let total = v[key].as_u64().expect(key);
        assert!(total <= n, "{key} {total} > {n}");
        let counted = per.iter().filter(|p| p[field] == true).count() as u64;
        assert_eq!(total, counted, "{key} disagrees with the per-probe records");
    }
    // The margin bands start at 0 and are open above: every probe falls in exactly one.
    let bands = v["by_full_margin"].as_array().expect("by_full_margin");
    let sum = |f: &str| bands.iter().map(|b| b[f].as_u64().unwrap()).sum::<u64>();
    assert_eq!(sum("probes"), n, "{bands:?}");
    assert_eq!(sum("agree_full"), v["agree_full"].as_u64().unwrap());
    assert_eq!(
        sum("forget_agree_full"),
        v["forget_agree_full"].as_u64().unwrap()
    );
    for b in bands {
        let (lo, hi) = (
            b["full_margin_from"].as_f64().unwrap(),
            &b["full_margin_below"],
        );
        let inside = per
            .iter()
            .filter(|p| {
                let m = p["full_margin"].as_f64().unwrap();
                m >= lo && hi.as_f64().is_none_or(|h| m < h)
            })
            .count() as u64;
        assert_eq!(b["probes"].as_u64().unwrap(), inside, "{b}");
    }
    for p in per {
        let tokens = p["tokens"].as_u64().unwrap();
        assert!(tokens <= 2600, "probe over the token budget: {p}");
        assert!(p["downstream"].as_u64().unwrap() < tokens);
        assert!(p["removed"].as_u64().unwrap() > 0);
        let margin = p["full_margin"].as_f64().unwrap();
        assert!(margin.is_finite() && margin >= 0.0, "{p}");
        let agrees = p["full_token"] == p["amortize_token"];
        assert_eq!(p["agree_full"] == true, agrees);
        // The reference ranks its own top token first: AMORTIZE's token is never above it.
        let gap = p["amortize_gap_in_full"].as_f64().unwrap();
        assert!(gap >= 0.0 && (!agrees || gap == 0.0), "{p}");
    }

    let drift = v["drift"].as_array().expect("drift");
    assert!(!drift.is_empty());
    let rel = |splices: u64, storage: &str, rotation: &str| -> f64 {
        drift
            .iter()
            .find(|d| {
                d["splices"] == splices && d["storage"] == storage && d["rotation"] == rotation
            })
            .and_then(|d| d["rel_l2"].as_f64())
            .unwrap_or_else(|| panic!("no drift row {splices} {storage} {rotation}"))
    };
    for d in drift {
        let r = d["rel_l2"].as_f64().expect("rel_l2");
        assert!(r.is_finite() && r >= 0.0, "{d}");
    }
    // bf16 math rounds every product and sum: it drifts at least as far as f32 math.
    assert!(rel(100, "bf16", "bf16") >= rel(100, "bf16", "f32"));
    // f32 storage only carries f32 rounding; bf16 storage carries 2^-9 per value at least.
    assert!(rel(100, "f32", "f32") < 1e-4);
    assert!(rel(1, "bf16", "f32") > 1e-4);
}

/// `verify --moves`: each probe moves a tool output; with `--reuse-min-tokens 0` the moved
/// tokens are prefilled, with 8 their KV is copied (a tool output repeats whole).
#[test]
fn move_probes_prefill_or_copy_the_moved_output() {
    for reuse in ["0", "8"] {
        let v = verify_json(&[
            "--moves",
            "--probes",
            "2",
            "--drift-splices",
            "1",
            "--drift-tokens",
            "8",
            "--reuse-min-tokens",
            reuse,
        ]);
        assert_eq!(v["moves"], true);
        let per = v["per_probe"].as_array().expect("per_probe");
        assert!(!per.is_empty());
        for p in per {
            let (inserted, moved, prefilled) = (
                p["stub"].as_u64().unwrap(),
                p["moved"].as_u64().unwrap(),
                p["prefilled"].as_u64().unwrap(),
            );
            // A move deletes what it inserts elsewhere.
            assert_eq!(p["removed"], p["stub"], "{p}");
            assert_eq!(moved + prefilled, inserted, "{p}");
            if reuse == "0" {
                assert_eq!(moved, 0, "{p}");
            } else {
                assert!(moved + 4 >= inserted && moved > 0, "{p}");
            }
        }
    }
}
