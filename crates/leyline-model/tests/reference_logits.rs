//! SmolLM2 logits against Hugging Face transformers (fixtures in tests/fixtures/smollm2,
//! produced by transformers from the same GGUF; see the README there), and the cache path:
//! a prompt prefilled in one call equals the same prompt prefilled in two calls.

mod common;

use common::{activations, prefill};
use leyline_kernels::qmatmul::Activations;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::arch::llama::Llama;
use leyline_model::gguf::GgufFile;
use leyline_model::{CausalLm, ForwardSeq, LogitsFor};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Max |logit difference| allowed against transformers' float32 forward. Both sides use
/// the same dequantized f32 weights; the rest is accumulation order over 30 layers.
const LOGIT_TOL: f32 = 2e-2;
/// llama.cpp's own max |logit difference| from these fixtures (`scripts/llamacpp_fixture_diff.py`,
/// BENCHMARKS.md "llama.cpp against the fixtures": 1.162, on p4): what an engine that
/// multiplies on 8-bit activations, as llama.cpp does, is measured against.
const LLAMACPP_MAX_DIFF: f32 = 1.162;
/// The bound of the default path (activations rounded to 8 bits per block of 32): 1.5 times
/// llama.cpp's distance, fixed before measuring (issue 59).
const INT8_TOL: f32 = 1.5 * LLAMACPP_MAX_DIFF;

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let path = leyline_hub::default_model_path()
            .expect("the default model is needed: `leyline model fetch` failed");
        let mut f = GgufFile::open(&path).expect("open GGUF");
        Llama::load(&mut f, "smollm2-135m").expect("load model")
    })
}

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2/logits")
}

fn load_case(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture_dir().join(format!("{name}.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn run_all(m: &Llama, tokens: &[u32], dtype: KvDtype) -> Vec<f32> {
    let mut kv = KvStorage::new(m.info().geometry, dtype, tokens.len()).unwrap();
    let slots: Vec<u32> = (0..tokens.len() as u32).collect();
    prefill(m, &mut kv, tokens, &slots, &[])
}

const CASES: [&str; 4] = ["p1_short", "p2_prose", "p3_code", "p4_agent_chat"];

/// The model's arithmetic (f32 activations) against transformers' at every position.
#[test]
fn logits_match_transformers_at_every_position() {
    let _mode = activations(Activations::F32);
    for name in CASES {
        check_case(name, LOGIT_TOL);
    }
}

/// The default path (8-bit activations) against transformers', within 1.5x llama.cpp's own
/// distance.
#[test]
fn int8_logits_are_within_llamacpps_distance() {
    let _mode = activations(Activations::Int8);
    let worst = CASES.map(|name| check_case(name, INT8_TOL));
    eprintln!("8-bit activations: max |diff| per prompt {worst:?} (llama.cpp: 1.162 on p4)");
}

/// Checks every position of fixture `name` in one forward call: top-10 logits and logsumexp
/// within `tol`, top-1 equal where the reference's gap is at least `2 * tol`, and all logits
/// of the last position; returns the worst difference.
fn check_case(name: &str, tol: f32) -> f32 {
    let m = model();
    let vocab = m.info().vocab_size;
    let case = load_case(name);
    let tokens = ids(&case["input_ids"]);
    let logits = run_all(m, &tokens, KvDtype::F32);
    assert_eq!(logits.len(), tokens.len() * vocab);
    let pp = &case["per_position"];
    let mut worst = 0f32;
    for (p, row) in logits.chunks_exact(vocab).enumerate() {
        let top_ids = ids(&pp["top10_ids"][p]);
        let top_logits: Vec<f32> = pp["top10_logits"][p]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        for (id, want) in top_ids.iter().zip(&top_logits) {
            worst = worst.max((row[*id as usize] - want).abs());
        }
        let gap = pp["top1_minus_top2"][p].as_f64().unwrap() as f32;
        let ours = argmax(row);
        if gap >= 2.0 * tol {
            assert_eq!(
                ours, top_ids[0],
                "{name}: top-1 differs at position {p} (gap {gap})"
            );
        }
        let lse_ref = pp["logsumexp"][p].as_f64().unwrap();
        let lse = logsumexp(row);
        assert!(
            (lse - lse_ref).abs() < tol as f64,
            "{name} pos {p}: lse {lse} vs {lse_ref}"
        );
    }
    assert!(worst <= tol, "{name}: max |diff| {worst} > {tol}");
    // All 49152 logits of the last position.
    let bytes = std::fs::read(fixture_dir().join(format!("{name}.last_logits.f32le.bin"))).unwrap();
    let want: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let last = &logits[(tokens.len() - 1) * vocab..];
    let max = last
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max <= tol, "{name}: last-position max |diff| {max}");
    eprintln!(
        "{name}: {} tokens, top-10 max |diff| {worst:.2e}, last row {max:.2e}",
        tokens.len()
    );
    worst.max(max)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

fn logsumexp(row: &[f32]) -> f64 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    max + row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

/// Prefill in one call vs. two calls where the second reads the first half's slots from
/// the pool, in f32 and bf16 storage.
#[test]
fn split_prefill_reads_the_cached_half() {
    let _mode = activations(Activations::F32);
    let m = model();
    let vocab = m.info().vocab_size;
    let tokens = ids(&load_case("p3_code")["input_ids"]);
    let n = tokens.len();
    let half = n / 2;
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let whole = run_all(m, &tokens, dtype);
        let mut kv = KvStorage::new(m.info().geometry, dtype, n + 7).unwrap();
        // Non-contiguous, shuffled slots: the model must follow the slot list.
        let slots: Vec<u32> = (0..n as u32)
            .map(|i| (i * 37 + 5) % (n as u32 + 7))
            .collect();
        let pos: Vec<u32> = (0..n as u32).collect();
        let first = ForwardSeq {
            tokens: &tokens[..half],
            positions: &pos[..half],
            context: &[],
            new_slots: &slots[..half],
            logits: LogitsFor::None,
            shifts: &[],
        };
        assert!(m.forward(&mut kv, &[first]).unwrap()[0].is_empty());
        let second = ForwardSeq {
            tokens: &tokens[half..],
            positions: &pos[half..],
            context: &slots[..half],
            new_slots: &slots[half..],
            logits: LogitsFor::All,
            shifts: &[],
        };
        let split = m.forward(&mut kv, &[second]).unwrap().remove(0);
        let max = split
            .iter()
            .zip(&whole[half * vocab..])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        // In bf16 a last-bit difference of the f32 activations (matmul blocking differs with
        // the row count) can flip a key's rounding; f32 storage shows the path itself is exact.
        let tol = if dtype == KvDtype::F32 { 1e-3 } else { 0.15 };
        eprintln!("{dtype}: split vs whole max |diff| {max:.2e}");
        assert!(max < tol, "{dtype}: split prefill differs by {max}");
    }
}

/// Two sequences in one batch give the same logits as each alone.
#[test]
fn batched_sequences_do_not_mix() {
    let _mode = activations(Activations::F32);
    batched_against_alone(1e-3);
}

/// On 8-bit activations each sequence's rows take the kernels its own row count picks and
/// each row is rounded alone: batched equals alone to the bit.
#[test]
fn batched_sequences_equal_alone_bit_for_bit_on_int8() {
    let _mode = activations(Activations::Int8);
    batched_against_alone(0.0);
}

/// p1 (9 tokens: few-row products) and p2 (38: the wide product) in one batch against each
/// alone: no logit may differ by more than `tol`.
fn batched_against_alone(tol: f32) {
    let m = model();
    let a = ids(&load_case("p1_short")["input_ids"]);
    let b = ids(&load_case("p2_prose")["input_ids"]);
    let alone_a = run_all(m, &a, KvDtype::F32);
    let alone_b = run_all(m, &b, KvDtype::F32);
    let mut kv = KvStorage::new(m.info().geometry, KvDtype::F32, a.len() + b.len()).unwrap();
    let pa: Vec<u32> = (0..a.len() as u32).collect();
    let pb: Vec<u32> = (0..b.len() as u32).collect();
    let sb: Vec<u32> = (a.len() as u32..(a.len() + b.len()) as u32).collect();
    let out = m
        .forward(
            &mut kv,
            &[
                ForwardSeq {
                    tokens: &a,
                    positions: &pa,
                    context: &[],
                    new_slots: &pa,
                    logits: LogitsFor::All,
                    shifts: &[],
                },
                ForwardSeq {
                    tokens: &b,
                    positions: &pb,
                    context: &[],
                    new_slots: &sb,
                    logits: LogitsFor::All,
                    shifts: &[],
                },
            ],
        )
        .unwrap();
    for (got, want) in [(&out[0], &alone_a), (&out[1], &alone_b)] {
        let max = got
            .iter()
            .zip(want.iter())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max <= tol, "batched differs by {max}");
    }
}

/// Checks `rows` (logits of positions `p0..`) of fixture `name` against transformers, as
/// the whole-prompt test does; returns the worst top-10 |diff|.
fn check_positions(name: &str, p0: usize, rows: &[f32], vocab: usize, tol: f32) -> f32 {
    let pp = &load_case(name)["per_position"];
    let mut worst = 0f32;
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let p = p0 + i;
        let top_ids = ids(&pp["top10_ids"][p]);
        for (j, id) in top_ids.iter().enumerate() {
            let want = pp["top10_logits"][p][j].as_f64().unwrap() as f32;
            worst = worst.max((row[*id as usize] - want).abs());
        }
        let gap = pp["top1_minus_top2"][p].as_f64().unwrap() as f32;
        if gap >= 2.0 * tol {
            assert_eq!(
                argmax(row),
                top_ids[0],
                "{name}: top-1 differs at position {p}"
            );
        }
    }
    assert!(worst <= tol, "{name}: max |diff| {worst} > {tol}");
    worst
}

/// Small batches (here at most 16 tokens) run the projections on the quantized weights (attention
/// reading the pool in place). Two prompts advance together in uneven chunks, down to one
/// token per call, and every position is checked against transformers, for each dtype.
#[test]
fn decode_path_matches_transformers_in_small_interleaved_batches() {
    let _mode = activations(Activations::F32);
    // 16-bit storage rounds every key and value once (bf16 keeps 8 mantissa bits); measured
    // worst cases were 0.19 (bf16) and 0.014 (f16), a wrong conversion is off by whole logits.
    small_interleaved_batches(&[
        (KvDtype::F32, LOGIT_TOL),
        (KvDtype::Bf16, 0.4),
        (KvDtype::F16, 0.05),
    ]);
}

/// The same on the default 8-bit activations, within 1.5x llama.cpp's distance.
#[test]
fn int8_path_is_within_llamacpps_distance() {
    let _mode = activations(Activations::Int8);
    small_interleaved_batches(&[(KvDtype::F32, INT8_TOL), (KvDtype::F16, INT8_TOL)]);
}

/// Two prompts advance together in uneven chunks (at most 16 tokens per call), every
/// position checked against transformers, for each (dtype, tolerance).
fn small_interleaved_batches(dtypes: &[(KvDtype, f32)]) {
    let m = model();
    let vocab = m.info().vocab_size;
    let names = ["p2_prose", "p4_agent_chat"];
    let prompts: Vec<Vec<u32>> = names
        .iter()
        .map(|n| ids(&load_case(n)["input_ids"]))
        .collect();
    let total: usize = prompts.iter().map(Vec::len).sum();
    // Chunk sizes cycle so both sequences together stay within 16 tokens per call.
    let chunks = [1usize, 7, 2, 8, 1, 3, 5];
    for &(dtype, tol) in dtypes {
        let mut kv = KvStorage::new(m.info().geometry, dtype, 2 * total + 40).unwrap();
        // Interleaved slots: the two sequences' KV rows alternate in the pool.
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(), Vec::new()];
        let mut next_slot = 3u32;
        let mut done = [0usize; 2];
        let mut worst = 0f32;
        let mut step = 0;
        while done.iter().zip(&prompts).any(|(d, p)| d < &p.len()) {
            let mut plan = Vec::new();
            for s in 0..2 {
                let want = chunks[(step + 3 * s) % chunks.len()];
                let take = want.min(prompts[s].len() - done[s]);
                if take > 0 {
                    let new: Vec<u32> = (0..take as u32)
                        .map(|i| next_slot + 2 * i + s as u32)
                        .collect();
                    plan.push((s, take, new));
                }
            }
            next_slot += 2 * plan.iter().map(|p| p.1).max().unwrap_or(0) as u32;
            let pos: Vec<Vec<u32>> = plan
                .iter()
                .map(|(s, take, _)| (done[*s] as u32..(done[*s] + take) as u32).collect())
                .collect();
            let seqs: Vec<ForwardSeq> = plan
                .iter()
                .zip(&pos)
                .map(|((s, take, new), p)| ForwardSeq {
                    tokens: &prompts[*s][done[*s]..done[*s] + take],
                    positions: p,
                    context: &slots[*s],
                    new_slots: new,
                    logits: LogitsFor::All,
                    shifts: &[],
                })
                .collect();
            assert!(seqs.iter().map(|s| s.tokens.len()).sum::<usize>() <= 16);
            let out = m.forward(&mut kv, &seqs).unwrap();
            for ((s, _, new), rows) in plan.iter().zip(&out) {
                worst = worst.max(check_positions(names[*s], done[*s], rows, vocab, tol));
                slots[*s].extend_from_slice(new);
                done[*s] += new.len();
            }
            step += 1;
        }
        eprintln!("{dtype}: small-batch path, top-10 max |diff| {worst:.2e} over {step} calls");
    }
}
