//! Gemma 3 270M Q4_K_M, real weights from the registry, against transformers (on the
//! file's weights dequantized to f32 by gguf-py) and llama.cpp on the four prompts of
//! `tests/fixtures/gemma3-270m/` (token ids given there, so this checks the network, not
//! the tokenizer): logits at every prompt position and 32 greedy tokens.
//!
//! Bounds, fixed before the first run: on f32 activations the arithmetic is transformers'
//! on the same weights in another order, so [`F32_TOL`] = 5e-3 on its top-10 logits at
//! every position (the logits are tens; 18 layers), top-1 equal where its gap is >= 0.1,
//! and its 32 greedy tokens exactly. llama.cpp departs from transformers on two prompts
//! (`p1_short` at token 21, where its own top-1/top-2 gap is 0.03; `p2_prose` at token 1,
//! after its top-10 logits moved up to 0.70 from transformers'): its tokens are required up to
//! that point, and on the other two prompts all 32. (On the opt-in 8-bit activations this
//! model is further from transformers than llama.cpp is, 1.08 against 0.70 on `p2_prose`:
//! measured, not yet held by a test; issue 59's integer path is where that is fixed.)

mod common;

use common::{activations, argmax, known_model, listed_diff, u32s};
use leyline_kernels::qmatmul::Activations;
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::gguf::GgufFile;
use leyline_model::{load_network, CausalLm, ForwardSeq, LogitsFor};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

const PROMPTS: &[&str] = &["p1_short", "p2_prose", "p3_code", "p4_agent_chat"];
/// See the file's doc.
const F32_TOL: f32 = 5e-3;

fn model() -> &'static Arc<dyn CausalLm> {
    static M: OnceLock<Arc<dyn CausalLm>> = OnceLock::new();
    M.get_or_init(|| {
        let path = known_model("gemma3-270m");
        let mut f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        load_network(&mut f).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    })
}

fn fixture(name: &str) -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gemma3-270m")
        .join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The prompt's logits at every position, then `n` greedy tokens decoded one at a time.
fn run(m: &dyn CausalLm, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let cap = prompt.len() + n + 1;
    let mut kv = KvStorage::new(m.info().geometry, KvDtype::F32, cap).unwrap();
    let slots: Vec<u32> = (0..cap as u32).collect();
    let s = ForwardSeq {
        tokens: prompt,
        positions: &slots[..prompt.len()],
        context: &[],
        new_slots: &slots[..prompt.len()],
        logits: LogitsFor::All,
        shifts: &[],
    };
    let logits = m.forward(&mut kv, &[s]).unwrap().remove(0);
    let vocab = m.info().vocab_size;
    let mut next = argmax(&logits[logits.len() - vocab..]);
    let mut out = vec![next];
    for i in prompt.len()..prompt.len() + n - 1 {
        let s = ForwardSeq {
            tokens: &[next],
            positions: &slots[i..i + 1],
            context: &slots[..i],
            new_slots: &slots[i..i + 1],
            logits: LogitsFor::Last,
            shifts: &[],
        };
        let l = m.forward(&mut kv, &[s]).unwrap().remove(0);
        next = argmax(&l);
        out.push(next);
    }
    (logits, out)
}

/// Max |diff| of the prompt's logits from transformers' top-10 at every position; asserts
/// top-1 equal where transformers' gap is >= 0.1.
fn prompt_distance(name: &str, f: &Value, logits: &[f32], vocab: usize) -> f32 {
    let t = &f["transformers"];
    let n = logits.len() / vocab;
    let mut worst = 0f32;
    for p in 0..n {
        let row = &logits[p * vocab..(p + 1) * vocab];
        worst = worst.max(listed_diff(row, &t["top10_ids"][p], &t["top10_logits"][p]));
        if t["top1_minus_top2"][p].as_f64().unwrap() >= 0.1 {
            let want = t["argmax"][p].as_u64().unwrap() as u32;
            assert_eq!(argmax(row), want, "{name}: top-1 at prompt position {p}");
        }
    }
    worst
}

#[test]
fn prompt_logits_and_greedy_tokens_match_transformers_and_llama_cpp() {
    let _g = activations(Activations::F32);
    let m = model();
    for name in PROMPTS {
        let f = fixture(name);
        let prompt = u32s(&f["input_ids"]);
        let (logits, got) = run(m.as_ref(), &prompt, 32);
        let d = prompt_distance(name, &f, &logits, m.info().vocab_size);
        eprintln!("{name}: prompt logits {d:e} from transformers'");
        assert!(
            d <= F32_TOL,
            "{name}: prompt logits {d} from transformers' (bound {F32_TOL})"
        );
        let tf = u32s(&f["transformers"]["greedy_ids"]);
        assert_eq!(got, tf, "{name}: 32 greedy tokens against transformers'");
        let lc = u32s(&f["llama_cpp"]["greedy_ids"]);
        let agree = match f["agreement"]["greedy_first_divergence"].as_u64() {
            Some(k) => k as usize,
            None => 32,
        };
        assert_eq!(
            got[..agree],
            lc[..agree],
            "{name}: greedy tokens against llama.cpp's, up to where llama.cpp leaves transformers"
        );
    }
}

/// The file's own tokenizer gives the fixtures' ids (transformers', `<bos>` first) for the
/// four prompts' texts.
#[test]
fn the_files_tokenizer_gives_the_prompts_ids() {
    let path = known_model("gemma3-270m");
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tok = leyline_model::tokenizer::Tokenizer::from_gguf_metadata(f.metadata()).unwrap();
    for name in PROMPTS {
        let fx = fixture(name);
        let text = fx["text"].as_str().unwrap();
        assert_eq!(
            tok.encode(text, true).unwrap(),
            u32s(&fx["input_ids"]),
            "{name}"
        );
    }
}
