//! The GGUF chat template against transformers' `apply_chat_template` (tests/fixtures/smollm2).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file;
use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use leyline_model::tokenizer::Tokenizer;
use serde_json::Value;

/// The default model file (`leyline_model::registry`, which fetches it if absent), or
/// `$LEYLINE_MODEL` when set.
fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LEYLINE_MODEL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    leyline_hub::default_model_path().expect("default model available")
}

struct Loaded {
    tok: Tokenizer,
    tmpl: ChatTemplate,
}

fn loaded() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| {
        let path = model_path();
        let mut f = std::fs::File::open(&path)
            .unwrap_or_else(|e| panic!("model file {}: {e} (set LEYLINE_MODEL)", path.display()));
        let md: HashMap<String, gguf_file::Value> = gguf_file::Content::read(&mut f)
            .expect("GGUF header parses")
            .metadata;
        let tok = Tokenizer::from_gguf_metadata(&md).expect("tokenizer builds");
        let tmpl = ChatTemplate::from_gguf_metadata(&md, &tok).expect("template compiles");
        Loaded { tok, tmpl }
    })
}

fn fixture() -> Value {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/smollm2/chat_template_cases.json"
    );
    serde_json::from_str(&std::fs::read_to_string(p).expect("fixture readable"))
        .expect("fixture is JSON")
}

fn messages(case: &Value) -> Vec<ChatMessage> {
    serde_json::from_value(case["messages"].clone()).expect("messages deserialize")
}

fn options(case: &Value, add_generation_prompt: bool) -> RenderOptions {
    let tools = case
        .get("apply_chat_template_kwargs")
        .and_then(|k| k.get("tools"))
        .map(|t| t.as_array().expect("tools array").clone());
    RenderOptions {
        add_generation_prompt,
        tools,
        ..RenderOptions::default()
    }
}

/// Ids under Leyline's digit-split pre-tokenizer where they differ from transformers'
/// (tests/fixtures/smollm2/chat_template_digit_split_ids.json, see the README there).
fn digit_split_ids() -> HashMap<String, Vec<u32>> {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/smollm2/chat_template_digit_split_ids.json"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(p).expect("fixture readable"))
        .expect("fixture is JSON");
    v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| {
            let name = c["name"].as_str().expect("name").to_string();
            (name, ids_of(&c["ids_digit_split_pretokenizer"]))
        })
        .collect()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn template_source_is_the_files() {
    let fx = fixture();
    assert_eq!(
        loaded().tmpl.source(),
        fx["chat_template_from_gguf_metadata"]
            .as_str()
            .expect("template")
    );
}

#[test]
fn render_and_ids_match_reference() {
    let Loaded { tok, tmpl } = loaded();
    let fx = fixture();
    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 10);
    let split = digit_split_ids();
    assert_eq!(split.len(), 1);
    let mut errors = 0;
    for c in cases {
        let name = &c["name"];
        let msgs = messages(c);
        let result = tmpl.render_with(&msgs, &options(c, true));
        if c.get("error").is_some() {
            let err = result.expect_err("the reference raised");
            eprintln!("{name}: {err}");
            errors += 1;
            continue;
        }
        let text = result.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(text, c["text"].as_str().expect("text"), "{name}");
        let reference = ids_of(&c["ids"]);
        let want = match split.get(name.as_str().expect("name")) {
            Some(ids) => {
                assert_ne!(ids, &reference, "{name}");
                ids.clone()
            }
            None => reference,
        };
        assert_eq!(tok.encode(&text, false).expect("encodes"), want, "{name}");
        let plain = tmpl
            .render_with(&msgs, &options(c, false))
            .expect("renders");
        assert_eq!(
            plain,
            c["text_without_generation_prompt"].as_str().expect("text"),
            "{name}"
        );
    }
    assert_eq!(errors, 1);
}

#[test]
fn render_shortcut_equals_render_with() {
    let tmpl = &loaded().tmpl;
    let msgs = vec![ChatMessage::new("user", "hi")];
    assert_eq!(
        tmpl.render(&msgs, true).expect("renders"),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// Checks that rendering a history message by message only ever appends: text and ids of
/// `messages[..k]` are prefixes of those of `messages[..k+1]`, and the generation prompt of
/// `messages[..k]` is a prefix of the history once an assistant turn `k` is appended.
fn assert_append_only(name: &str, msgs: &[ChatMessage]) {
    let Loaded { tok, tmpl } = loaded();
    let mut prev_text = String::new();
    let mut prev_ids: Vec<u32> = Vec::new();
    let mut prev_prompt: Option<String> = None;
    for k in 1..=msgs.len() {
        let text = tmpl.render(&msgs[..k], false).expect("renders");
        let ids = tok.encode(&text, false).expect("encodes");
        assert!(
            text.starts_with(&prev_text),
            "{name}: text of {} messages is not a prefix of {k}",
            k - 1
        );
        assert!(
            ids.starts_with(&prev_ids),
            "{name}: ids of {} messages are not a prefix of {k}",
            k - 1
        );
        if let Some(p) = prev_prompt.take() {
            if msgs[k - 1].role == "assistant" {
                assert!(
                    text.starts_with(&p),
                    "{name}: generation prompt before message {k} is not a prefix"
                );
                let pids = tok.encode(&p, false).expect("encodes");
                assert!(
                    ids.starts_with(&pids),
                    "{name}: prompt ids before message {k} are not a prefix"
                );
            }
        }
        prev_prompt = Some(tmpl.render(&msgs[..k], true).expect("renders"));
        prev_text = text;
        prev_ids = ids;
    }
}

#[test]
fn rendering_is_append_only_per_message() {
    let fx = fixture();
    for c in fx["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .filter(|c| c.get("error").is_none())
    {
        assert_append_only(c["name"].as_str().expect("name"), &messages(c));
    }
}

#[test]
fn rendering_is_append_only_on_a_trace() {
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
    let msgs: Vec<ChatMessage> =
        serde_json::from_value(line["messages"].clone()).expect("messages");
    assert!(msgs.len() > 4);
    assert_append_only("tau-bench[0]", &msgs);
}

#[test]
fn missing_content_is_an_error_not_a_panic() {
    let tmpl = &loaded().tmpl;
    let msgs: Vec<ChatMessage> =
        serde_json::from_str(r#"[{"role": "assistant", "tool_calls": []}]"#).expect("parses");
    let err = tmpl
        .render(&msgs, false)
        .expect_err("content is required by this template");
    assert!(err.to_string().contains("chat template"), "{err}");
    assert!(ChatTemplate::new("{% for %}", "", "").is_err());
}
