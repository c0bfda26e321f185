//! DeepSeek-V2 (MLA + MoE) against Hugging Face transformers: two tiny checkpoints that
//! transformers created (tests/fixtures/mla, see the README there), one with plain RoPE and
//! q_lora, one with YaRN. Checks logits in one call, split over cached slots (in shuffled slot
//! order, batched, token by token), the compressed cache itself, the pool's size, and that
//! shifting `k_pe` rows with leyline-kv's kernel equals RoPE recomputed at the new positions.

mod common;

use candle_core::{Device, Tensor};
use common::{f32s, f64s, max_diff, prefill, shuffled, u32s};
use leyline_kernels::rope::RotaryLayout;
use leyline_kernels::rotate::shift_table;
use leyline_kernels::Tier;
use leyline_kv::{KvDtype, KvGeometry, KvStorage};
use leyline_model::arch::deepseek2::DeepseekV2;
use leyline_model::{CausalLm, ForwardSeq, LogitsFor, ModelError};
use serde_json::Value;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Max |logit difference| against transformers' float32 eager forward (f32 storage). Same
/// f32 weights on both sides; the rest is summation order (measured: below 1e-5).
const LOGIT_TOL: f32 = 1e-4;
/// Positions whose reference top-1/top-2 gap is below this may flip without a bug.
const NEAR_TIE: f32 = 2.0 * LOGIT_TOL;
/// Max |difference| of cached latent / k_pe values against transformers' cache.
const CACHE_TOL: f32 = 1e-5;
const NAMES: [&str; 2] = ["plain", "yarn"];

struct Fixture {
    model: DeepseekV2,
    reference: Value,
    cache: HashMap<String, Tensor>,
}

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/mla")
        .join(name)
}

fn fixture(name: &str) -> &'static Fixture {
    static F: OnceLock<HashMap<&'static str, Fixture>> = OnceLock::new();
    let all = F.get_or_init(|| {
        NAMES
            .iter()
            .map(|&n| {
                let d = dir(n);
                let model = DeepseekV2::load_dir(&d).expect("load tiny checkpoint");
                let text = std::fs::read_to_string(d.join("reference.json")).unwrap();
                let reference = serde_json::from_str(&text).unwrap();
                let cache = candle_core::safetensors::load(
                    d.join("cache_seq130.safetensors"),
                    &Device::Cpu,
                )
                .unwrap();
                (
                    n,
                    Fixture {
                        model,
                        reference,
                        cache,
                    },
                )
            })
            .collect()
    });
    &all[name]
}

fn seq(f: &Fixture, i: usize) -> &Value {
    &f.reference["sequences"][i]
}

/// Compares `[t, vocab]` logits with the reference sequence; returns the max |diff| seen.
fn check_logits(what: &str, s: &Value, logits: &[f32], tol: f32) -> f32 {
    let vocab = 512;
    let argmax = u32s(&s["argmax"]);
    let t = argmax.len();
    assert_eq!(logits.len(), t * vocab, "{what}: logits shape");
    let gaps = f32s(&s["top1_minus_top2"]);
    let lse = f64s(&s["logsumexp"]);
    let mut worst = 0f32;
    for p in 0..t {
        let row = &logits[p * vocab..(p + 1) * vocab];
        for (id, want) in u32s(&s["top5_ids"][p])
            .iter()
            .zip(f32s(&s["top5_logits"][p]))
        {
            worst = worst.max((row[*id as usize] - want).abs());
        }
        let ours = (0..vocab)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap() as u32;
        if gaps[p] >= 2.0 * tol.max(NEAR_TIE / 2.0) {
            assert_eq!(ours, argmax[p], "{what}: argmax at position {p}");
        }
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let our_lse = m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        worst = worst.max((our_lse - lse[p]).abs() as f32);
    }
    let last = f32s(&s["last_position_logits"]);
    for (a, b) in logits[(t - 1) * vocab..].iter().zip(&last) {
        worst = worst.max((a - b).abs());
    }
    assert!(worst <= tol, "{what}: max |logit diff| {worst} > {tol}");
    worst
}

fn pool(m: &DeepseekV2, dtype: KvDtype) -> KvStorage {
    KvStorage::new(m.info().geometry, dtype, 300).unwrap()
}

#[test]
fn info_describes_the_compressed_cache() {
    for name in NAMES {
        let f = fixture(name);
        let info = f.model.info();
        assert_eq!(
            info.geometry,
            KvGeometry {
                layers: 3,
                k_heads: 1,
                k_head_dim: 8,
                v_width: 32
            },
            "{name}"
        );
        assert_eq!(info.vocab_size, 512);
        assert_eq!(info.context_length, 512);
        assert_eq!(info.rope.specs().len(), 1, "{name}: one rope spec");
        let rope = info.rope.spec(0);
        assert_eq!(rope.layout, RotaryLayout::Interleaved);
        assert_eq!((rope.head_dim, rope.rotary_dim), (8, 8));
        let want = f64s(&f.reference["rope"]["inv_freq"]);
        for (g, w) in rope.inv_freq().iter().zip(&want) {
            assert!((g - w).abs() <= 1e-7 * w, "{name}: inv_freq {g} vs {w}");
        }
        let scale = f.reference["rope"]["cos_sin_scale"].as_f64().unwrap();
        assert!((rope.attention_factor() - scale).abs() < 1e-12, "{name}");
        let sm = f.reference["rope"]["softmax_scale"].as_f64().unwrap();
        assert!(
            (f.model.config().softmax_scale - sm).abs() < 1e-12,
            "{name}: softmax scale"
        );
        assert_eq!(
            f.model.config().q_lora_rank,
            if name == "plain" { Some(48) } else { None }
        );
    }
}

#[test]
fn logits_match_transformers_in_one_call() {
    for name in NAMES {
        let f = fixture(name);
        for i in 0..3 {
            let s = seq(f, i);
            let tokens = u32s(&s["ids"]);
            let slots: Vec<u32> = (0..tokens.len() as u32).collect();
            let mut kv = pool(&f.model, KvDtype::F32);
            let logits = prefill(&f.model, &mut kv, &tokens, &slots, &[]);
            let w = check_logits(&format!("{name} seq {i}"), s, &logits, LOGIT_TOL);
            eprintln!(
                "{name} seq {i} ({} tokens): max |diff| {w:.2e}",
                tokens.len()
            );
        }
    }
}

#[test]
fn split_prefill_reads_cached_slots_in_any_order() {
    for name in NAMES {
        let f = fixture(name);
        let s = seq(f, 2);
        let tokens = u32s(&s["ids"]);
        for (k, cuts) in [vec![1], vec![50], vec![129], vec![17, 64, 100]]
            .iter()
            .enumerate()
        {
            let slots = shuffled(300, k as u64 + 7);
            let mut kv = pool(&f.model, KvDtype::F32);
            let logits = prefill(&f.model, &mut kv, &tokens, &slots[..tokens.len()], cuts);
            check_logits(&format!("{name} cuts {cuts:?}"), s, &logits, LOGIT_TOL);
        }
        // Token by token: every step is a one-row query over the cached slots.
        let s = seq(f, 1);
        let tokens = u32s(&s["ids"]);
        let slots = shuffled(300, 99);
        let cuts: Vec<usize> = (1..tokens.len()).collect();
        let mut kv = pool(&f.model, KvDtype::F32);
        let logits = prefill(&f.model, &mut kv, &tokens, &slots[..tokens.len()], &cuts);
        check_logits(&format!("{name} decode"), s, &logits, LOGIT_TOL);
    }
}

#[test]
fn batched_sequences_match_and_logits_selection() {
    let f = fixture("yarn");
    let toks: Vec<Vec<u32>> = (0..3).map(|i| u32s(&seq(f, i)["ids"])).collect();
    let pos: Vec<Vec<u32>> = toks.iter().map(|t| (0..t.len() as u32).collect()).collect();
    let slots = shuffled(300, 3);
    let (a, b) = (toks[0].len(), toks[0].len() + toks[1].len());
    let parts = [&slots[..a], &slots[a..b], &slots[b..b + toks[2].len()]];
    let wants = [LogitsFor::All, LogitsFor::Last, LogitsFor::None];
    let seqs: Vec<ForwardSeq<'_>> = (0..3)
        .map(|i| ForwardSeq {
            tokens: &toks[i],
            positions: &pos[i],
            context: &[],
            new_slots: parts[i],
            logits: wants[i],
            shifts: &[],
        })
        .collect();
    let mut kv = pool(&f.model, KvDtype::F32);
    let out = f.model.forward(&mut kv, &seqs).unwrap();
    check_logits("batch seq 0", seq(f, 0), &out[0], LOGIT_TOL);
    let last = f32s(&seq(f, 1)["last_position_logits"]);
    assert_eq!(out[1].len(), 512);
    let worst = out[1]
        .iter()
        .zip(&last)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= LOGIT_TOL, "batch seq 1 last logits: {worst}");
    assert!(out[2].is_empty());
    // Sequence 2 wrote its cache although it asked for no logits: continue it by one token.
    let next = [seq(f, 2)["argmax"][129].as_u64().unwrap() as u32];
    let s = ForwardSeq {
        tokens: &next,
        positions: &[130],
        context: parts[2],
        new_slots: &slots[299..],
        logits: LogitsFor::Last,
        shifts: &[],
    };
    let one = f.model.forward(&mut kv, &[s]).unwrap().remove(0);
    let mut full = toks[2].clone();
    full.push(next[0]);
    let seq_slots: Vec<u32> = (0..131).collect();
    let mut kv2 = pool(&f.model, KvDtype::F32);
    let all = prefill(&f.model, &mut kv2, &full, &seq_slots, &[]);
    let worst = one
        .iter()
        .zip(&all[130 * 512..])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-5,
        "decode after a batch vs one prefill: {worst}"
    );
}

/// Reads the pool rows of `slots` for `layer` as (k_pe rows, latent rows).
fn cached(kv: &KvStorage, layer: usize, slots: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let g = kv.geometry();
    let mut k = vec![0f32; slots.len() * g.k_width()];
    let mut v = vec![0f32; slots.len() * g.v_width];
    kv.gather_k(layer, slots, &mut k).unwrap();
    kv.gather_v(layer, slots, &mut v).unwrap();
    (k, v)
}

fn ref_rows(f: &Fixture, key: &str) -> Vec<f32> {
    f.cache[key]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

#[test]
fn cache_equals_transformers_compressed_cache() {
    for name in NAMES {
        let f = fixture(name);
        let tokens = u32s(&seq(f, 2)["ids"]);
        let slots = shuffled(300, 11);
        let slots = &slots[..tokens.len()];
        let mut kv = pool(&f.model, KvDtype::F32);
        prefill(&f.model, &mut kv, &tokens, slots, &[64]);
        for l in 0..3 {
            let (k, v) = cached(&kv, l, slots);
            let dk = max_diff(&k, &ref_rows(f, &format!("layers.{l}.k_pe_post_rope")));
            let dv = max_diff(&v, &ref_rows(f, &format!("layers.{l}.latent_normed")));
            assert!(
                dk <= CACHE_TOL && dv <= CACHE_TOL,
                "{name} layer {l}: k_pe {dk}, latent {dv}"
            );
        }
    }
}

#[test]
fn pool_bytes_per_token_and_half_storage() {
    let f = fixture("yarn");
    let g = f.model.info().geometry;
    let s = seq(f, 2);
    let tokens = u32s(&s["ids"]);
    let slots: Vec<u32> = (0..130).collect();
    let mut kv = KvStorage::new(g, KvDtype::F32, 130).unwrap();
    let exact = prefill(&f.model, &mut kv, &tokens, &slots, &[]);
    check_logits("f32 storage", s, &exact, LOGIT_TOL);
    // Half storage rounds each latent / k_pe once (relative 2^-11 f16, 2^-8 bf16). A toy model
    // with near-tied experts may route one token differently: allow 2 such positions.
    for (dtype, size, tol) in [
        (KvDtype::F32, 4, LOGIT_TOL),
        (KvDtype::F16, 2, 1e-2),
        (KvDtype::Bf16, 2, 5e-2),
    ] {
        // layers * (kv_lora_rank + qk_rope_head_dim) * dtype size.
        assert_eq!(g.bytes_per_slot(dtype), 3 * (32 + 8) * size);
        let mut kv = KvStorage::new(g, dtype, 130).unwrap();
        assert_eq!(kv.bytes(), 130 * 3 * 40 * size);
        let logits = prefill(&f.model, &mut kv, &tokens, &slots, &[]);
        let off: Vec<usize> = (0..130)
            .filter(|&p| {
                max_diff(
                    &logits[p * 512..(p + 1) * 512],
                    &exact[p * 512..(p + 1) * 512],
                ) > tol
            })
            .collect();
        assert!(
            off.len() <= 2,
            "{dtype} storage: positions off by more than {tol}: {off:?}"
        );
    }
}

/// Independent f64 RoPE of one interleaved `k_pe` row at `pos`, from transformers' inv_freq.
fn rope_ref(x: &[f32], inv_freq: &[f64], gain: f64, pos: f64) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (i, f) in inv_freq.iter().enumerate() {
        let (s, c) = (pos * f).sin_cos();
        let (a, b) = (x[2 * i] as f64, x[2 * i + 1] as f64);
        out[2 * i] = (gain * (a * c - b * s)) as f32;
        out[2 * i + 1] = (gain * (a * s + b * c)) as f32;
    }
    out
}

fn shift_all(m: &DeepseekV2, kv: &mut KvStorage, slots: &[u32], delta: i64) {
    for l in 0..3 {
        let rot = shift_table(m.info().rope.spec(l), delta).unwrap();
        kv.shift_k([(l, &rot)], slots, Tier::best()).unwrap();
    }
}

#[test]
fn shifted_k_pe_equals_rope_at_new_positions_and_latents_stay() {
    for name in NAMES {
        let f = fixture(name);
        let inv = f64s(&f.reference["rope"]["inv_freq"]);
        let gain = f.reference["rope"]["cos_sin_scale"].as_f64().unwrap();
        let tokens = u32s(&seq(f, 2)["ids"]);
        for delta in [0i64, 1, -1, 127, -128, 129, 1024, -1024] {
            let slots = shuffled(300, delta.unsigned_abs());
            let slots = &slots[..tokens.len()];
            let mut kv = pool(&f.model, KvDtype::F32);
            prefill(&f.model, &mut kv, &tokens, slots, &[]);
            let before: Vec<_> = (0..3).map(|l| cached(&kv, l, slots).1).collect();
            shift_all(&f.model, &mut kv, slots, delta);
            for (l, latent_before) in before.iter().enumerate() {
                let (k, v) = cached(&kv, l, slots);
                let same = v
                    .iter()
                    .zip(latent_before)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{name} delta {delta} layer {l}: a latent changed");
                let pre = ref_rows(f, &format!("layers.{l}.k_pe_pre_rope"));
                let want: Vec<f32> = pre
                    .chunks_exact(8)
                    .enumerate()
                    .flat_map(|(p, x)| rope_ref(x, &inv, gain, (p as i64 + delta) as f64))
                    .collect();
                let d = max_diff(&k, &want);
                assert!(
                    d <= 2.0 * CACHE_TOL,
                    "{name} delta {delta} layer {l}: |k_pe - ref| {d}"
                );
            }
        }
    }
}

#[test]
fn chained_yarn_shifts_keep_norms() {
    let f = fixture("yarn");
    let inv = f64s(&f.reference["rope"]["inv_freq"]);
    let tokens = u32s(&seq(f, 2)["ids"]);
    let slots = shuffled(300, 5);
    let slots = &slots[..tokens.len()];
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let mut kv = pool(&f.model, dtype);
        prefill(&f.model, &mut kv, &tokens, slots, &[]);
        let norms = |kv: &KvStorage| -> Vec<f64> {
            (0..3)
                .flat_map(|l| cached(kv, l, slots).0)
                .collect::<Vec<f32>>()
                .chunks_exact(8)
                .map(|r| r.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt())
                .collect()
        };
        let start = norms(&kv);
        let (mut total, mut worst) = (0i64, 0f64);
        for i in 0..100 {
            let delta = [13i64, -7, 129, -1, 1024][i % 5];
            shift_all(&f.model, &mut kv, slots, delta);
            total += delta;
            for (a, b) in norms(&kv).iter().zip(&start) {
                worst = worst.max(a / b);
            }
        }
        // Rounding only, no compounding gain: f32 stays within 1e-5; bf16 rounds once per
        // shift (relative 2^-9 per element), a random walk of about 2% over 100 shifts.
        let bound = if dtype == KvDtype::F32 {
            1.0 + 1e-5
        } else {
            1.0 + 0.05
        };
        assert!(worst <= bound, "{dtype}: a k_pe norm grew by {worst}");
        let mean = norms(&kv)
            .iter()
            .zip(&start)
            .map(|(a, b)| a / b)
            .sum::<f64>()
            / start.len() as f64;
        assert!(
            (mean - 1.0).abs() <= 2e-3,
            "{dtype}: mean k_pe norm ratio {mean}"
        );
        if dtype == KvDtype::F32 {
            for l in 0..3 {
                let pre = ref_rows(f, &format!("layers.{l}.k_pe_pre_rope"));
                let want: Vec<f32> = pre
                    .chunks_exact(8)
                    .enumerate()
                    .flat_map(|(p, x)| rope_ref(x, &inv, 1.0, (p as i64 + total) as f64))
                    .collect();
                let d = max_diff(&cached(&kv, l, slots).0, &want);
                assert!(d <= 1e-4, "layer {l}: after 100 shifts |k_pe - ref| {d}");
            }
        }
    }
}

#[test]
fn bad_input_and_files_are_errors() {
    let f = fixture("plain");
    let wrong = KvGeometry {
        layers: 3,
        k_heads: 1,
        k_head_dim: 8,
        v_width: 16,
    };
    let mut kv = KvStorage::new(wrong, KvDtype::F32, 8).unwrap();
    let s = ForwardSeq {
        tokens: &[1],
        positions: &[0],
        context: &[],
        new_slots: &[0],
        logits: LogitsFor::Last,
        shifts: &[],
    };
    assert!(matches!(
        f.model.forward(&mut kv, &[s]),
        Err(ModelError::Input(_))
    ));
    let mut kv = pool(&f.model, KvDtype::F32);
    let s = ForwardSeq {
        tokens: &[512],
        ..s
    };
    assert!(matches!(
        f.model.forward(&mut kv, &[s]),
        Err(ModelError::Input(_))
    ));
    let e = leyline_model::arch::deepseek2::load_dir(&dir("missing"))
        .err()
        .unwrap();
    assert!(matches!(e, ModelError::File { .. }), "{e}");
}

#[test]
fn a_checkpoint_directory_loads_bare_and_refuses_tokenizer_callers() {
    let d = dir("plain");
    let m = leyline_model::load_model_path(&d).unwrap();
    assert!(matches!(m, leyline_model::AnyModel::Bare(_)));
    assert!(m.tokenizer().is_none());
    assert_eq!(m.path(), d.as_path());
    assert_eq!(m.model().info().arch, "deepseek_v2");
    let e = m.into_served().err().unwrap();
    assert!(matches!(e, ModelError::NoTokenizer { .. }), "{e}");
    assert!(e
        .to_string()
        .ends_with("has no tokenizer; this command needs one"));
    let e = leyline_model::load_with_tokenizer(&d).err().unwrap();
    assert!(matches!(e, ModelError::NoTokenizer { .. }), "{e}");
    // A directory that is no checkpoint names that problem, not the tokenizer.
    let scratch = tempfile::Builder::new()
        .prefix("leyline-mla-empty-")
        .tempdir()
        .unwrap();
    let empty = scratch.path().to_path_buf();
    for e in [
        leyline_model::load_with_tokenizer(&empty).err().unwrap(),
        leyline_model::load_model_path(&empty).err().unwrap(),
    ] {
        assert!(
            matches!(&e, ModelError::File { path, .. } if path == &empty),
            "{e}"
        );
        assert!(e.to_string().contains("no config.json"), "{e}");
    }
}

/// The deviation pass of MLA compares `k_pe` and the latent: recomputing a sequence's tail
/// after its head changed (same length) moves them by what a full prefill of the changed
/// sequence holds, and recomputing it in its own context moves nothing.
#[test]
fn the_deviation_pass_compares_the_compressed_cache() {
    for name in NAMES {
        let m = &fixture(name).model;
        let mut kv = pool(m, KvDtype::F32);
        let n = 40u32;
        let old: Vec<u32> = shuffled(n, 7).iter().map(|t| t % 50 + 3).collect();
        let mut new = old.clone();
        for t in &mut new[4..9] {
            *t = 1;
        }
        let (a, b): (Vec<u32>, Vec<u32>) = ((0..n).collect(), (n..2 * n).collect());
        prefill(m, &mut kv, &old, &a, &[]);
        prefill(m, &mut kv, &new, &b, &[]);
        let scratch: Vec<u32> = (2 * n..3 * n - 9).collect();
        let positions: Vec<u32> = (9..n).collect();
        let tail = 9..n as usize;
        let deviation = |kv: &mut KvStorage, layer: usize, cached: &[u32]| {
            let seq = ForwardSeq {
                tokens: &new[tail.clone()],
                positions: &positions,
                context: &b[..9],
                new_slots: &scratch,
                logits: LogitsFor::None,
                shifts: &[],
            };
            m.kv_deviation(kv, seq, layer, cached)
        };
        let got = deviation(&mut kv, 1, &a[tail.clone()]).unwrap();
        let (ok, ol) = cached(&kv, 1, &a[tail.clone()]);
        let (nk, nl) = cached(&kv, 1, &b[tail.clone()]);
        let (kw, vw) = (ok.len() / tail.len(), ol.len() / tail.len());
        for (i, &d) in got.iter().enumerate() {
            let sq: f64 = (0..kw)
                .map(|j| f64::from(nk[i * kw + j] - ok[i * kw + j]).powi(2))
                .chain((0..vw).map(|j| f64::from(nl[i * vw + j] - ol[i * vw + j]).powi(2)))
                .sum();
            let want = sq.sqrt() as f32;
            assert!(
                (d - want).abs() <= 1e-4 * want.max(1.0),
                "{name} token {i}: {d} vs {want}"
            );
        }
        assert!(
            got.iter().any(|&d| d > 1e-3),
            "{name}: nothing moved: {got:?}"
        );
        let same = deviation(&mut kv, 1, &b[tail.clone()]).unwrap();
        assert!(same.iter().all(|&d| d < 1e-4), "{name}: {same:?}");
        // A layer the model does not have is an error, not a panic.
        let layers = m.info().geometry.layers;
        assert!(deviation(&mut kv, layers, &a[tail.clone()]).is_err());
    }
}
