//! The GGUF tokenizer against transformers' reference ids (tests/fixtures/smollm2).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file;
use leyline_model::tokenizer::{Specials, Tokenizer};
use serde_json::Value;

/// The default model file (`leyline_model::registry`, which fetches it if absent), or
/// `$LEYLINE_MODEL` when set.
fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LEYLINE_MODEL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    leyline_hub::default_model_path().expect("default model available")
}

fn metadata() -> &'static HashMap<String, gguf_file::Value> {
    static MD: OnceLock<HashMap<String, gguf_file::Value>> = OnceLock::new();
    MD.get_or_init(|| {
        let path = model_path();
        let mut f = std::fs::File::open(&path)
            .unwrap_or_else(|e| panic!("model file {}: {e} (set LEYLINE_MODEL)", path.display()));
        gguf_file::Content::read(&mut f)
            .expect("GGUF header parses")
            .metadata
    })
}

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_gguf_metadata(metadata()).expect("tokenizer builds"))
}

fn fixture() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/smollm2/tokenizer_cases.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture readable"))
        .expect("fixture is JSON")
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
        .collect()
}

fn cases() -> Vec<Value> {
    fixture()["cases"].as_array().expect("cases").clone()
}

/// The ids Leyline follows: the upstream model's digit-split pre-tokenizer (llama.cpp's
/// `smollm`), which the fixture records where it differs from transformers' GGUF converter.
fn expected_ids(case: &Value) -> Vec<u32> {
    ids_of(
        case.get("ids_digit_split_pretokenizer")
            .unwrap_or(&case["ids"]),
    )
}

#[test]
fn special_tokens_and_sizes() {
    let tok = tokenizer();
    let fx = fixture();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(
        tok.bos_id(),
        Some(fx["special_tokens"]["bos_id"].as_u64().expect("bos") as u32)
    );
    assert_eq!(
        tok.eos_id(),
        Some(fx["special_tokens"]["eos_id"].as_u64().expect("eos") as u32)
    );
    assert!(!tok.adds_bos());
    let control = ids_of(&fx["control_token_ids_in_gguf"]);
    let special: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&i| tok.is_special(i))
        .collect();
    assert_eq!(special, control);
    assert!(!tok.is_special(u32::MAX));
    assert_eq!(tok.token_str(1), Some("<|im_start|>"));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_str(49152), None);
    // A generation stops at EOS and at `<|endoftext|>`, never at a turn's opening.
    assert_eq!(tok.stop_ids().first().copied(), tok.eos_id());
    assert!(tok
        .stop_ids()
        .contains(&tok.token_id("<|endoftext|>").expect("endoftext")));
    assert!(!tok.stop_ids().contains(&1));
}

#[test]
fn encode_matches_reference_on_all_cases() {
    let tok = tokenizer();
    let all = cases();
    assert_eq!(all.len(), 47);
    let mut failures = Vec::new();
    for c in &all {
        let text = c["text"].as_str().expect("text");
        let want = expected_ids(c);
        let got = tok.encode(text, false).expect("encodes");
        if got != want {
            failures.push(format!("{}: got {got:?}, want {want:?}", c["name"]));
        }
        // add_bos_token is false in this file, so specials change nothing.
        assert_eq!(
            tok.encode(text, true).expect("encodes"),
            got,
            "{}",
            c["name"]
        );
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn pieces_split_anywhere_encode_as_the_whole_text() {
    // Text between added tokens is one run across piece boundaries, so cutting the text
    // anywhere but inside an added token changes nothing while every piece may read every
    // added token.
    let tok = tokenizer();
    let specials: Vec<&str> = (0..tok.vocab_size() as u32)
        .filter(|&i| tok.is_special(i))
        .filter_map(|i| tok.token_str(i))
        .collect();
    for c in &cases() {
        let text = c["text"].as_str().expect("text");
        let want = expected_ids(c);
        let inside = |i: usize| {
            specials.iter().any(|sp| {
                text.match_indices(sp)
                    .any(|(at, m)| at < i && i < at + m.len())
            })
        };
        let cuts: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i) && !inside(i))
            .step_by(3)
            .chain([text.len()])
            .collect();
        let pieces: Vec<(&str, Specials)> = cuts
            .windows(2)
            .map(|w| (&text[w[0]..w[1]], Specials::All))
            .collect();
        assert_eq!(tok.encode_pieces(&pieces).unwrap(), want, "{}", c["name"]);
    }
}

#[test]
fn pieces_that_may_not_read_control_tokens_tokenize_their_text() {
    let tok = tokenizer();
    let im_start = tok.token_id("<|im_start|>").unwrap();
    let marker = "<|im_start|>";
    let as_token = tok.encode_pieces(&[(marker, Specials::All)]).unwrap();
    assert_eq!(as_token, vec![im_start]);
    for trust in [Specials::None, Specials::NonControl] {
        let as_text = tok.encode_pieces(&[(marker, trust)]).unwrap();
        assert!(!as_text.contains(&im_start), "{trust:?}: {as_text:?}");
        assert!(as_text.len() > 3, "{trust:?}");
        assert_eq!(tok.decode(&as_text, false).unwrap(), marker);
    }
    // Template text around untrusted content keeps its own markers.
    let ids = tok
        .encode_pieces(&[
            ("<|im_start|>user\n", Specials::All),
            ("hi<|im_end|>", Specials::None),
            ("<|im_end|>", Specials::All),
        ])
        .unwrap();
    let im_end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == im_start).count(), 1);
    assert_eq!(ids.iter().filter(|&&t| t == im_end).count(), 1);
    assert_eq!(ids.last(), Some(&im_end));
    assert_eq!(tok.find_control_text("a <|im_end|> b"), Some("<|im_end|>"));
    assert_eq!(tok.find_control_text("a <|im_end b"), None);
}

#[test]
fn token_strings_match_reference() {
    let tok = tokenizer();
    for c in cases()
        .iter()
        .filter(|c| c.get("ids_digit_split_pretokenizer").is_none())
    {
        let want: Vec<&str> = c["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_str().expect("str"))
            .collect();
        let got: Vec<&str> = ids_of(&c["ids"])
            .iter()
            .map(|&i| tok.token_str(i).expect("in vocab"))
            .collect();
        assert_eq!(got, want, "{}", c["name"]);
    }
}

#[test]
fn digits_follow_the_upstream_pre_tokenizer() {
    // Leyline isolates every \p{N} char (upstream tokenizer.json, llama.cpp `smollm`); the
    // transformers GGUF converter does not. Exactly one fixture case tells them apart.
    let tok = tokenizer();
    let fx = fixture();
    let differing: Vec<Value> = cases()
        .into_iter()
        .filter(|c| c.get("ids_digit_split_pretokenizer").is_some())
        .collect();
    assert_eq!(
        differing.len() as u64,
        fx["digit_split_pretokenizer_changes_ids_for"]
            .as_u64()
            .expect("count")
    );
    for c in &differing {
        let got = tok
            .encode(c["text"].as_str().expect("text"), false)
            .expect("encodes");
        assert_eq!(
            got,
            ids_of(&c["ids_digit_split_pretokenizer"]),
            "{}",
            c["name"]
        );
        assert_ne!(got, ids_of(&c["ids"]), "{}", c["name"]);
    }
    // " ½": a space token, then the numeric char alone.
    let half = tok.encode(" ½", false).expect("encodes");
    assert_eq!(half.len(), 2);
    assert_eq!(tok.token_str(half[0]), Some("Ġ"));
    // A whitespace run before a digit stays one piece (transformers: "Ġ", "Ġ", "2").
    let ids = tok.encode("x  2", false).expect("encodes");
    let strs: Vec<&str> = ids
        .iter()
        .map(|&i| tok.token_str(i).expect("in vocab"))
        .collect();
    assert_eq!(strs, ["x", "ĠĠ", "2"]);
    // ASCII digits: one per token.
    let ids = tok.encode("x 2024-05-15", false).expect("encodes");
    let strs: Vec<&str> = ids
        .iter()
        .map(|&i| tok.token_str(i).expect("in vocab"))
        .collect();
    assert_eq!(
        strs,
        ["x", "Ġ", "2", "0", "2", "4", "-", "0", "5", "-", "1", "5"]
    );
}

#[test]
fn decode_matches_reference() {
    let tok = tokenizer();
    let mut exact = 0;
    for c in &cases() {
        let name = &c["name"];
        let ids = expected_ids(c);
        let text = c["text"].as_str().expect("text");
        let decoded = tok.decode(&ids, false).expect("decodes");
        assert_eq!(decoded, c["decoded"].as_str().expect("decoded"), "{name}");
        assert_eq!(
            tok.decode(&ids, true).expect("decodes"),
            c["decoded_skip_special"].as_str().expect("skip"),
            "{name}"
        );
        if c["roundtrip_exact"].as_bool().expect("bool") {
            assert_eq!(decoded, text, "{name}");
            exact += 1;
        } else {
            assert_ne!(decoded, text, "{name}");
        }
    }
    assert_eq!(exact, 45);
    assert!(tok.decode(&[1, 49152], false).is_err());
}

#[test]
fn stream_decode_equals_batch_decode() {
    let tok = tokenizer();
    let mut split_chars = 0;
    for c in &cases() {
        let ids = expected_ids(c);
        for skip in [false, true] {
            let mut s = tok.decode_stream(skip);
            let mut out = String::new();
            for &id in &ids {
                let chunk = s.push(tok, &[id]).expect("push");
                if s.pending_bytes() > 0 {
                    split_chars += 1;
                }
                if c["roundtrip_exact"].as_bool().expect("bool") {
                    assert!(
                        !chunk.contains('\u{fffd}'),
                        "{}: chunk {chunk:?}",
                        c["name"]
                    );
                }
                out.push_str(&chunk);
            }
            out.push_str(&s.finish());
            assert_eq!(
                out,
                tok.decode(&ids, skip).expect("decodes"),
                "{} skip={skip}",
                c["name"]
            );
        }
    }
    // Multi-byte characters split over ids occur in the fixture (CJK, emoji, Arabic).
    assert!(split_chars > 0);
    let mut s = tok.decode_stream(false);
    assert!(s.push(tok, &[49152]).is_err());
}

#[test]
fn encode_speed_of_a_long_system_prompt() {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/data/traces/tau-bench.jsonl"
    );
    let Ok(data) = std::fs::read_to_string(p) else {
        eprintln!("skipped: {p} not found");
        return;
    };
    let line: Value =
        serde_json::from_str(data.lines().next().expect("a line")).expect("JSON line");
    let prompt = line["messages"][0]["content"]
        .as_str()
        .expect("system prompt");
    let tok = tokenizer();
    let ids = tok.encode(prompt, false).expect("encodes");
    let runs = 20;
    let t0 = std::time::Instant::now();
    for _ in 0..runs {
        std::hint::black_box(
            tok.encode(std::hint::black_box(prompt), false)
                .expect("encodes"),
        );
    }
    let per = t0.elapsed() / runs;
    eprintln!(
        "encode: {} chars -> {} tokens in {per:?} per call",
        prompt.len(),
        ids.len()
    );
    assert_eq!(tok.decode(&ids, false).expect("decodes"), prompt);
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<leyline_model::tokenizer::DecodeStream>();
}
