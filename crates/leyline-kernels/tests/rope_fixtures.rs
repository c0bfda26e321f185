//! RoPE against transformers' numbers (fixtures copied from the shared reference set; see
//! tests/fixtures/README.md).

use leyline_kernels::rope::{RopeScaling, RopeSpec, RotaryLayout};
use leyline_kernels::rotate::shift_rows;
use leyline_kernels::rows::RowsMut;
use serde_json::Value;

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn rows(v: &Value) -> Vec<Vec<f64>> {
    v.as_array().unwrap().iter().map(floats).collect()
}

fn yarn_spec(f: &Value) -> RopeSpec {
    let g = |k: &str| f[k].as_f64().unwrap();
    RopeSpec {
        theta: g("rope_theta"),
        head_dim: 8,
        rotary_dim: 8,
        layout: RotaryLayout::Interleaved,
        scaling: RopeScaling::Yarn {
            factor: g("factor"),
            original_max_position: g("original_max_position_embeddings"),
            beta_fast: g("beta_fast"),
            beta_slow: g("beta_slow"),
            mscale: g("mscale"),
            mscale_all_dim: g("mscale_all_dim"),
        },
        freq_factors: None,
    }
}

#[test]
fn yarn_inv_freq_and_k_pe_match_transformers() {
    let f = fixture("yarn_mla_rope.json");
    let spec = yarn_spec(&f);
    // transformers computes inv_freq in f32: agree to f32 precision.
    for (g, w) in spec.inv_freq().iter().zip(floats(&f["inv_freq"])) {
        assert!((g - w).abs() <= 1e-7 * w, "{g} vs {w}");
    }
    assert_eq!(
        spec.attention_factor(),
        f["cos_sin_scale"].as_f64().unwrap()
    );
    let positions = floats(&f["positions"]);
    for ((pre, post), p) in rows(&f["k_pe_pre_rope"])
        .iter()
        .zip(rows(&f["k_pe_post_rope"]))
        .zip(positions)
    {
        let mut x: Vec<f32> = pre.iter().map(|&v| v as f32).collect();
        spec.rotate_f32(&mut x, p as i64);
        for (g, w) in x.iter().zip(&post) {
            // transformers takes cos/sin of an f32 phase; at p <= 129 that is within ~1e-5.
            assert!((*g as f64 - w).abs() < 2e-5, "pos {p}: {x:?} vs {post:?}");
        }
    }
}

/// Shifting transformers' post-RoPE k_pe from position 0..3 by delta lands on its rows at
/// position + delta (a YaRN model: the shift must not apply any attention factor).
#[test]
fn yarn_shift_lands_on_transformers_rows() {
    let f = fixture("yarn_mla_rope.json");
    let spec = yarn_spec(&f);
    let positions: Vec<i64> = floats(&f["positions"]).iter().map(|&p| p as i64).collect();
    let post = rows(&f["k_pe_post_rope"]);
    let pre = rows(&f["k_pe_pre_rope"]);
    // Rows from different tokens have different pre-RoPE keys: shift pre-RoPE row i rotated to
    // 0 (= itself) up to its position, and compare with transformers' post row.
    for (i, &p) in positions.iter().enumerate() {
        let mut buf: Vec<f32> = pre[i].iter().map(|&v| v as f32).collect();
        shift_rows(RowsMut::F32(&mut buf), 1, 8, &[0], &spec, p).unwrap();
        for (g, w) in buf.iter().zip(&post[i]) {
            assert!((*g as f64 - w).abs() < 2e-5, "pos {p}");
        }
    }
}

#[test]
fn llama_rope_matches_transformers_in_both_layouts() {
    let f = fixture("smollm2_rope.json");
    let theta = f["rope_theta"].as_f64().unwrap();
    let head_dim = f["head_dim"].as_u64().unwrap() as usize;
    let neox = RopeSpec::plain(theta, head_dim, RotaryLayout::Neox);
    for (g, w) in neox
        .inv_freq()
        .iter()
        .zip(floats(&f["inv_freq_used_by_transformers"]))
    {
        assert!((g - w).abs() <= 2e-7 * w, "{g} vs {w}");
    }
    let positions = floats(&f["positions"]);
    for (layout, pre, post) in [
        (
            RotaryLayout::Neox,
            "pre_rope_keys_hf_layout",
            "post_rope_keys_hf_layout",
        ),
        (
            RotaryLayout::Interleaved,
            "pre_rope_keys_gguf_layout",
            "post_rope_keys_gguf_layout",
        ),
    ] {
        let spec = RopeSpec::plain(theta, head_dim, layout);
        for ((x, y), &p) in rows(&f[pre]).iter().zip(rows(&f[post])).zip(&positions) {
            let mut v: Vec<f32> = x.iter().map(|&a| a as f32).collect();
            spec.rotate_f32(&mut v, p as i64);
            let scale = y.iter().fold(0f64, |m, a| m.max(a.abs()));
            for (g, w) in v.iter().zip(&y) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-5 * scale.max(1.0),
                    "{layout:?} pos {p}"
                );
            }
        }
    }
}
