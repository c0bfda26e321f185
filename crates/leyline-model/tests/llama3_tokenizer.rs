//! Llama 3's tokenizer against Meta's own (tests/fixtures/llama/tokenizer_cases.json: the
//! ids of `llama_models.llama3.tokenizer.Tokenizer`, tiktoken, on 50 texts).
//!
//! Meta's vocabulary comes from the PyPI wheel `llama-models==0.3.0`
//! (`llama_models/llama3/tokenizer.model`: tiktoken's mergeable ranks, one base64 token and
//! its rank per line), fetched and sha256-checked like a registry model into
//! `$LEYLINE_HOME` on first use; a failed fetch fails the test with its reason.
//!
//! No Llama 3.1 GGUF is on a registry the tests can reach, so the test writes the
//! `tokenizer.ggml.*` metadata a converter writes for that vocabulary: each rank's bytes in
//! the byte-level alphabet, merges ordered by the rank of the token they make (the same list
//! as in llama.cpp's Llama 3 vocabulary file), Meta's 256 control tokens after the 128,000
//! ranks, `pre = llama-bpe`. Leyline's tokenizer is built
//! from that metadata exactly as from a file, and must give Meta's ids.

mod common;

use candle_core::quantized::gguf_file::Value;
use leyline_hub::{KnownModel, WheelPart};
use leyline_model::tokenizer::{byte_level_text, Tokenizer};
use serde_json::Value as Json;
use std::collections::HashMap;

/// Meta's tokenizer file, fetched from its wheel (not a model: the registry does not list it).
const META_TOKENIZER: KnownModel = KnownModel {
    name: "llama3-tokenizer",
    description: "Meta's Llama 3 tiktoken ranks from llama-models 0.3.0",
    parts: &[WheelPart {
        package: "llama-models",
        version: "0.3.0",
        member: "llama_models/llama3/tokenizer.model",
        size: 2_183_982,
        sha256: "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
    }],
    file_name: "tokenizer.model",
    size: 2_183_982,
    sha256: "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55",
};

/// Meta's named control tokens, in id order from 128000; the other ids up to 128255 are
/// `<|reserved_special_token_{2..}|>` (llama_models/llama3/tokenizer.py).
const NAMED_SPECIALS: [&str; 12] = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|image|>",
];
const N_SPECIALS: usize = 256;

fn fixture(name: &str) -> Json {
    let path = format!("{}/tests/fixtures/llama/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).expect("fixture JSON")
}

/// The ranks file: token bytes by rank (ranks are 0..n, each once).
fn meta_ranks() -> Vec<Vec<u8>> {
    let path = leyline_hub::ensure_model(&META_TOKENIZER, &mut |_| {}).unwrap_or_else(|e| {
        panic!("Meta's Llama 3 tokenizer (llama-models==0.3.0 from PyPI) is needed: {e}")
    });
    let text = std::fs::read_to_string(&path).expect("ranks file is text");
    let mut by_rank: Vec<Option<Vec<u8>>> = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let (b64, rank) = line.split_once(' ').expect("`base64 rank` lines");
        let rank: usize = rank.parse().expect("an integer rank");
        if by_rank.len() <= rank {
            by_rank.resize(rank + 1, None);
        }
        assert!(by_rank[rank].is_none(), "rank {rank} twice");
        by_rank[rank] = Some(base64::decode(b64).expect("base64 token"));
    }
    by_rank
        .into_iter()
        .enumerate()
        .map(|(r, t)| t.unwrap_or_else(|| panic!("rank {r} missing")))
        .collect()
}

/// `tokenizer.ggml.*` metadata for the ranks: tiktoken merges the adjacent pair whose union
/// has the lowest rank, so every split of a token into two tokens is a merge with that
/// token's priority (ties by the parts' ranks). This list equals, entry for entry, the
/// 280,147 merges of llama.cpp's `models/ggml-vocab-llama-bpe.gguf` (llama-cpp-python
/// 0.3.36 sdist; checked once with gguf-py, the file is not fetched here).
fn metadata(ranks: &[Vec<u8>]) -> (HashMap<String, Value>, usize) {
    let rank_of: HashMap<&[u8], usize> = ranks
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let mut merges = Vec::new();
    for t in ranks {
        let mut splits: Vec<(usize, usize, usize)> = (1..t.len())
            .filter_map(|i| Some((*rank_of.get(&t[..i])?, *rank_of.get(&t[i..])?, i)))
            .collect();
        splits.sort_unstable();
        merges.extend(splits.into_iter().map(|(_, _, i)| {
            Value::String(format!(
                "{} {}",
                byte_level_text(&t[..i]),
                byte_level_text(&t[i..])
            ))
        }));
    }
    let mut tokens: Vec<Value> = ranks
        .iter()
        .map(|t| Value::String(byte_level_text(t)))
        .collect();
    let mut types = vec![Value::I32(1); ranks.len()];
    for i in 0..N_SPECIALS {
        tokens.push(Value::String(match NAMED_SPECIALS.get(i) {
            Some(name) => name.to_string(),
            None => format!(
                "<|reserved_special_token_{}|>",
                i - NAMED_SPECIALS.len() + 2
            ),
        }));
        types.push(Value::I32(3));
    }
    let base = ranks.len() as u32;
    let n_merges = merges.len();
    let md = HashMap::from([
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        (
            "tokenizer.ggml.pre".into(),
            Value::String("llama-bpe".into()),
        ),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(base)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(base + 9)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(true)),
    ]);
    (md, n_merges)
}

/// Leyline's tokenizer over Meta's vocabulary, built once per test binary.
fn tokenizer() -> &'static Tokenizer {
    static T: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let (md, n_merges) = metadata(&meta_ranks());
        assert_eq!(
            n_merges, 280_147,
            "merges (llama.cpp's Llama 3 vocabulary has 280,147)"
        );
        Tokenizer::from_gguf_metadata(&md).expect("tokenizer builds")
    })
}

#[test]
fn llama3_ids_equal_metas_tokenizer() {
    let fx = fixture("tokenizer_cases.json");
    let tok = tokenizer();
    let n_words = fx["n_words"].as_u64().expect("n_words") as usize;
    assert_eq!(tok.vocab_size(), n_words, "vocabulary size");
    for (key, name) in [
        ("bos_id", "<|begin_of_text|>"),
        ("eos_id", "<|end_of_text|>"),
        ("eot_id", "<|eot_id|>"),
        ("eom_id", "<|eom_id|>"),
        ("python_tag_id", "<|python_tag|>"),
    ] {
        let want = fx[key].as_u64().expect(key) as u32;
        assert_eq!(tok.token_id(name), Some(want), "{name}");
        assert!(tok.is_special(want), "{name} is a control token");
    }

    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 50);
    let got = common::tokenizer_json::check_cases(tok, cases, "Meta's tokenizer");
    for (c, ids) in cases.iter().zip(&got) {
        let name = c["name"].as_str().expect("name");
        for (id, hex) in ids
            .iter()
            .zip(c["token_bytes_hex"].as_array().expect("hex"))
        {
            let bytes = tok.token_bytes(*id).expect("id in vocabulary");
            let hex_got: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(hex_got, hex.as_str().expect("hex"), "{name}: bytes of {id}");
        }
    }
    // The file asks for BOS, as Llama 3's GGUFs do.
    assert_eq!(tok.encode("Hello", true).expect("encodes"), [128_000, 9906]);
}

/// The Llama 3.1 / 3.2 / 3.3 chat templates' renderings (transformers) tokenize to the ids
/// Meta's tokenizer gives them: headers, `<|eot_id|>`, `<|python_tag|>` tool calls.
#[test]
fn llama3_chat_renderings_tokenize_as_metas() {
    let tok = tokenizer();
    let mut checked = 0;
    for version in ["3.1", "3.2", "3.3"] {
        let fx = fixture(&format!("chat_template_cases.llama{version}.json"));
        for c in fx["cases"].as_array().expect("cases") {
            let Some(ids) = c.get("ids") else {
                assert!(c.get("error").is_some(), "a case has ids or an error");
                continue;
            };
            let name = c["name"].as_str().expect("name");
            let text = c["text"].as_str().expect("text");
            assert_eq!(
                tok.encode(text, false).expect("encodes"),
                common::u32s(ids),
                "llama {version}: {name}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 54, "18 renderings with ids per template");
}
