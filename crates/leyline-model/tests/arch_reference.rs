//! Every GGUF architecture of issue 60 against the tiny seeded checkpoints of
//! `tests/fixtures/{arch}/` (made by transformers, converted by llama.cpp's own converter:
//! ARCHS.md says how; no code of ours made a number there).
//!
//! Tolerances, fixed before the first run from the fixtures' own figures:
//! - f32 files ([`F32_TOL`] = 1e-3 on every compared logit): llama.cpp with an F32 KV cache
//!   is 1.1e-5 to 2.3e-5 from transformers on these files, the same arithmetic in another
//!   order; 1e-3 leaves 40x for our orders and is 5000x under the smallest logit change of a
//!   wiring mistake the fixtures measured (5.7). Top-1 must equal transformers' wherever
//!   its top-1/top-2 gap is >= 0.1, and such positions must be at least half.
//! - q8_0 files: transformers ran on exactly the dequantized weights, so on f32 activations
//!   [`F32_TOL`] again; on 8-bit activations 1.5x llama.cpp's own distance from transformers
//!   on the same sequence (llama.cpp rounds activations the same way; the bound of the
//!   SmolLM2 and Qwen tests).
//! - Keys ([`KEY_TOL`] = 1e-3): the pool's keys after a prefill against transformers' post-RoPE
//!   keys, and after a shift by `delta` against an f64 RoPE of transformers' pre-RoPE keys
//!   at the new positions (llama: transformers' Llama 3 `inv_freq`; the others:
//!   `theta^(-2i/d)` from the config, gemma3's per layer kind).

mod common;

use common::{activations, f32s, listed_diff, max_diff, prefill, shuffled, u32s};
use leyline_kernels::qmatmul::Activations;
use leyline_kernels::rotate::shift_table;
use leyline_kernels::Tier;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::gguf::GgufFile;
use leyline_model::{load_network, CausalLm};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// See the file's doc.
const F32_TOL: f32 = 1e-3;
/// See the file's doc.
const KEY_TOL: f32 = 1e-3;
/// How far over llama.cpp's own q8_0 distance we may be.
const Q8_OVER_LLAMA_CPP: f32 = 1.5;
/// The top-1/top-2 gap from which top-1 must agree.
const GAP: f32 = 0.1;

/// The architectures Leyline runs from these fixtures.
const ARCHS: &[&str] = &["gemma3", "llama", "qwen3", "qwen3moe", "olmo2"];

fn dir(arch: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(arch)
}

fn reference(arch: &str) -> &'static Value {
    static R: OnceLock<std::sync::Mutex<HashMap<String, &'static Value>>> = OnceLock::new();
    let mut m = R.get_or_init(Default::default).lock().unwrap();
    m.entry(arch.to_string()).or_insert_with(|| {
        let text = std::fs::read_to_string(dir(arch).join("reference.json"))
            .unwrap_or_else(|e| panic!("{arch}/reference.json: {e}"));
        Box::leak(Box::new(serde_json::from_str(&text).unwrap()))
    })
}

fn model(arch: &str, variant: &str) -> Arc<dyn CausalLm> {
    let path = dir(arch).join(format!("model.{variant}.gguf"));
    let mut f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    load_network(&mut f).unwrap_or_else(|e| panic!("{arch} {variant}: {e}"))
}

fn sequences<'a>(r: &'a Value, variant: &str) -> &'a [Value] {
    r["variants"][variant]["sequences"].as_array().unwrap()
}

fn pool(m: &dyn CausalLm) -> KvStorage {
    KvStorage::new(m.info().geometry, KvDtype::F32, 300).unwrap()
}

/// Max |diff| of `[t, vocab]` logits from the sequence's reference (top-5 logits and the
/// log-sum-exp at every position, every logit of the last); with `top1`, asserts top-1
/// equal wherever the reference gap is >= [`GAP`] and returns how many positions counted.
fn compare(what: &str, s: &Value, logits: &[f32], top1: bool) -> (f32, usize) {
    let argmax = u32s(&s["argmax"]);
    let t = argmax.len();
    let vocab = logits.len() / t;
    assert_eq!(logits.len(), t * vocab, "{what}: logits shape");
    let gaps = f32s(&s["top1_minus_top2"]);
    let mut worst = 0f32;
    let mut counted = 0;
    for p in 0..t {
        let row = &logits[p * vocab..(p + 1) * vocab];
        worst = worst.max(listed_diff(row, &s["top5_ids"][p], &s["top5_logits"][p]));
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        worst = worst.max((lse - s["logsumexp"][p].as_f64().unwrap()).abs() as f32);
        if top1 && gaps[p] >= GAP {
            let ours = (0..vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap() as u32;
            assert_eq!(
                ours, argmax[p],
                "{what}: top-1 at position {p} (reference gap {})",
                gaps[p]
            );
            counted += 1;
        }
    }
    for (a, b) in logits[(t - 1) * vocab..]
        .iter()
        .zip(f32s(&s["last_position_logits"]))
    {
        worst = worst.max((a - b).abs());
    }
    (worst, counted)
}

#[test]
fn f32_files_give_transformers_logits_and_top1() {
    let _f32 = activations(Activations::F32);
    for arch in ARCHS {
        let m = model(arch, "f32");
        let r = reference(arch);
        let (mut counted, mut positions) = (0, 0);
        for (i, s) in sequences(r, "f32").iter().enumerate() {
            let tokens = u32s(&s["ids"]);
            let n = tokens.len();
            let slots = shuffled(300, i as u64 + 1);
            // One call, then the same tokens in three calls reading the earlier ones.
            for cuts in [vec![], vec![n / 3, n / 3 + n / 4 + 1]] {
                let cuts: Vec<usize> = cuts.into_iter().filter(|&c| c > 0 && c < n).collect();
                let mut kv = pool(m.as_ref());
                let logits = prefill(m.as_ref(), &mut kv, &tokens, &slots[..n], &cuts);
                let what = format!("{arch} f32 sequence {i} ({n} tokens) cut at {cuts:?}");
                let (worst, c) = compare(&what, s, &logits, true);
                eprintln!("{what}: max |logit diff| {worst:e}");
                assert!(worst <= F32_TOL, "{what}: {worst} > {F32_TOL}");
                if cuts.is_empty() {
                    counted += c;
                    positions += n;
                    // llama.cpp's logits too (for llama: with rope_freqs.weight), within
                    // its own distance from transformers.
                    let lc = &s["llama_cpp"];
                    let theirs = lc["max_abs_logit_diff"].as_f64().unwrap() as f32;
                    let last = &logits[(n - 1) * logits.len() / n..];
                    let d = last
                        .iter()
                        .zip(f32s(&lc["last_position_logits"]))
                        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(
                        d <= theirs + F32_TOL,
                        "{what}: {d} from llama.cpp's last logits (it is {theirs} from transformers)"
                    );
                }
            }
        }
        assert!(
            2 * counted >= positions,
            "{arch}: only {counted} of {positions} positions have a top-1 gap >= {GAP}"
        );
    }
}

#[test]
fn q8_0_files_stay_within_llama_cpps_distance() {
    for a in [Activations::F32, Activations::Int8] {
        let _mode = activations(a);
        for arch in ARCHS {
            let m = model(arch, "q8_0");
            let r = reference(arch);
            for (i, s) in sequences(r, "q8_0").iter().enumerate() {
                let tokens = u32s(&s["ids"]);
                let slots = shuffled(300, i as u64 + 7);
                let mut kv = pool(m.as_ref());
                let logits = prefill(m.as_ref(), &mut kv, &tokens, &slots[..tokens.len()], &[]);
                let what = format!("{arch} q8_0 {a:?} sequence {i}");
                let (worst, _) = compare(&what, s, &logits, false);
                let theirs = s["llama_cpp"]["max_abs_logit_diff"].as_f64().unwrap() as f32;
                let bound = match a {
                    Activations::F32 => F32_TOL,
                    Activations::Int8 => Q8_OVER_LLAMA_CPP * theirs,
                };
                eprintln!("{what}: max |logit diff| {worst} (bound {bound}, llama.cpp {theirs})");
                assert!(worst <= bound, "{what}: {worst} > {bound}");
            }
        }
    }
}

/// `[130, kv_heads, head_dim]` tensors of `keys_seq130.safetensors`, by name.
fn keys(arch: &str) -> HashMap<String, Vec<f32>> {
    let path = dir(arch).join("keys_seq130.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            assert_eq!(v["dtype"], "F32", "{arch} {k}");
            let o = u32s(&v["data_offsets"]);
            let vals = data[o[0] as usize..o[1] as usize]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (k.clone(), vals)
        })
        .collect()
}

/// Transformers' rotary inverse frequencies of `layer` (HF order: pairs `(i, i + d/2)`).
fn inv_freq(arch: &str, r: &Value, head_dim: usize, layer: usize) -> Vec<f64> {
    if arch == "llama" {
        return r["llama3_rope"]["inv_freq_transformers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
    }
    let theta = match arch {
        "gemma3" => {
            let g = &r["gemma3_layers"];
            let global = g["global_layers"].as_array().unwrap();
            match global.contains(&layer.into()) {
                true => g["rope_theta_global"].as_f64().unwrap(),
                false => g["rope_theta_sliding"].as_f64().unwrap(),
            }
        }
        _ => r["config"]["rope_parameters"]["rope_theta"]
            .as_f64()
            .unwrap(),
    };
    (0..head_dim / 2)
        .map(|i| theta.powf(-(2.0 * i as f64) / head_dim as f64))
        .collect()
}

/// An f64 RoPE of one HF-order head at `pos`.
fn rope_ref(x: &[f32], inv: &[f64], pos: f64) -> Vec<f32> {
    let h = x.len() / 2;
    let mut out = vec![0f32; x.len()];
    for (i, f) in inv.iter().enumerate() {
        let (s, c) = (pos * f).sin_cos();
        let (a, b) = (x[i] as f64, x[i + h] as f64);
        out[i] = (a * c - b * s) as f32;
        out[i + h] = (b * c + a * s) as f32;
    }
    out
}

/// HF-order heads to the order the file's K rows have (llama's converter permutes them).
fn to_file_order(arch: &str, r: &Value, hf: &[f32], head_dim: usize) -> Vec<f32> {
    if arch != "llama" {
        return hf.to_vec();
    }
    let map = u32s(&r["variants"]["f32"]["sequences"][2]["keys"]["gguf_dim_from_hf_dim"]);
    hf.chunks_exact(head_dim)
        .flat_map(|h| map.iter().map(|&j| h[j as usize]).collect::<Vec<_>>())
        .collect()
}

#[test]
fn cached_keys_are_transformers_keys_and_shift_to_new_positions() {
    let _f32 = activations(Activations::F32);
    for arch in ARCHS {
        let m = model(arch, "f32");
        let r = reference(arch);
        let k = keys(arch);
        let g = m.info().geometry;
        let (kvh, hd) = (g.k_heads, g.k_head_dim);
        let tokens = u32s(&sequences(r, "f32")[2]["ids"]);
        let n = tokens.len();
        for delta in [0i64, 1, -1, 37, 1000, -129] {
            let slots = shuffled(300, delta.unsigned_abs() + 3);
            let slots = &slots[..n];
            let mut kv = pool(m.as_ref());
            prefill(m.as_ref(), &mut kv, &tokens, slots, &[]);
            for l in 0..g.layers {
                let mut ours = vec![0f32; n * kvh * hd];
                if delta == 0 {
                    kv.gather_k(l, slots, &mut ours).unwrap();
                    let want = to_file_order(arch, r, &k[&format!("layers.{l}.k_post_rope")], hd);
                    let d = max_diff(&ours, &want);
                    assert!(d <= KEY_TOL, "{arch} layer {l}: |k - transformers' k| {d}");
                    continue;
                }
                let inv = inv_freq(arch, r, hd, l);
                let spec = m.info().rope.spec(l).clone();
                let rot = shift_table(&spec, delta).unwrap();
                kv.shift_k([(l, &rot)], slots, Tier::best()).unwrap();
                kv.gather_k(l, slots, &mut ours).unwrap();
                let pre = &k[&format!("layers.{l}.k_pre_rope")];
                let hf: Vec<f32> = pre
                    .chunks_exact(kvh * hd)
                    .enumerate()
                    .flat_map(|(p, row)| {
                        row.chunks_exact(hd)
                            .flat_map(|h| rope_ref(h, &inv, (p as i64 + delta) as f64))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let want = to_file_order(arch, r, &hf, hd);
                let d = max_diff(&ours, &want);
                assert!(
                    d <= KEY_TOL,
                    "{arch} layer {l}: keys shifted by {delta} are {d} from RoPE at the new positions"
                );
            }
        }
    }
}
