//! Helpers shared by the model crate's integration tests: reading fixture JSON, deterministic
//! slot orders, prefills into a pool, and the process-wide activation switch.
#![allow(dead_code)] // each test crate uses a subset

pub mod tokenizer_json;

use leyline_kernels::qmatmul::{set_activations, Activations};
use leyline_kv::KvStorage;
use leyline_model::{CausalLm, ForwardSeq, LogitsFor};
use serde_json::Value;
use std::sync::MutexGuard;

/// A JSON array of numbers as f32.
pub fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

/// A JSON array of numbers as f64.
pub fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

/// A JSON array of non-negative integers as u32.
pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_u64().expect("an integer") as u32)
        .collect()
}

/// `0..n` in a deterministic shuffled order (SplitMix64 from `seed`, Fisher-Yates).
pub fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut s = seed;
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v: Vec<u32> = (0..n).collect();
    for i in (1..v.len()).rev() {
        v.swap(i, (next() % (i as u64 + 1)) as usize);
    }
    v
}

/// All logits of `tokens` at positions 0.., prefilled in calls cut at `cuts`, into `slots`
/// (each call reads the earlier ones' slots as its context).
pub fn prefill(
    m: &dyn CausalLm,
    kv: &mut KvStorage,
    tokens: &[u32],
    slots: &[u32],
    cuts: &[usize],
) -> Vec<f32> {
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(tokens.len());
    let mut out = Vec::new();
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        let s = ForwardSeq {
            tokens: &tokens[a..b],
            positions: &pos[a..b],
            context: &slots[..a],
            new_slots: &slots[a..b],
            logits: LogitsFor::All,
            shifts: &[],
        };
        out.extend(m.forward(kv, &[s]).expect("forward").remove(0));
    }
    out
}

/// Max |a - b| over two equally long slices.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The index of the largest value.
pub fn argmax(row: &[f32]) -> u32 {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .expect("a non-empty row") as u32
}

/// Sets the process-wide activation mode and holds it for the guard's life (the tests of
/// one binary share the process and run on threads).
pub fn activations(a: Activations) -> MutexGuard<'static, ()> {
    static SWITCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let guard = SWITCH.lock().unwrap_or_else(|e| e.into_inner());
    set_activations(a);
    guard
}

/// The cached file of registry model `name`, fetched on first use; panics naming the model
/// and the command that fetches it when that fails.
pub fn known_model(name: &str) -> std::path::PathBuf {
    leyline_hub::known_model_path(name).unwrap_or_else(|e| {
        panic!("the {name} model is needed (`leyline model fetch {name}`): {e}")
    })
}

/// Max |row[id] - want| over the listed ids and their reference logits (JSON arrays).
pub fn listed_diff(row: &[f32], ids: &Value, want: &Value) -> f32 {
    u32s(ids)
        .iter()
        .zip(f32s(want))
        .fold(0f32, |m, (&id, w)| m.max((row[id as usize] - w).abs()))
}
