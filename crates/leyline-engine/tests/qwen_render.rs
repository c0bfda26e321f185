//! The server's prompt rendering ([`render_prompt`]) with Qwen2.5-Coder's tokenizer and chat
//! template gives transformers' ids for the reference chat cases, the tool round trip
//! included (fixtures in leyline-model's tests/fixtures/qwen2.5-coder-0.5b): the template
//! writes `<tool_call>` tags and wraps a tool result in a user turn, and the pieces the server
//! tokenizes apart must still add up to the whole text's tokens.

use leyline_engine::render_prompt;
use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use leyline_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;

#[test]
fn server_rendering_gives_the_reference_ids_with_tools() {
    let path = leyline_hub::known_model_path("qwen2.5-coder-0.5b")
        .unwrap_or_else(|e| panic!("the qwen2.5-coder-0.5b model is needed: {e}"));
    let f = leyline_model::gguf::GgufFile::open(&path).expect("GGUF opens");
    let tok = Tokenizer::from_gguf_metadata(f.metadata()).expect("tokenizer");
    let tmpl = ChatTemplate::from_gguf_metadata(f.metadata(), &tok).expect("chat template");
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../leyline-model/tests/fixtures/qwen2.5-coder-0.5b/chat_template_cases.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture readable"))
        .expect("fixture is JSON");
    let cases = fx["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 4);
    for c in cases {
        let name = c["name"].as_str().expect("name");
        let chat: Vec<ChatMessage> =
            serde_json::from_value(c["messages"].clone()).expect("messages");
        let opts = RenderOptions {
            add_generation_prompt: true,
            tools: c["tools"].as_array().cloned(),
            ..RenderOptions::default()
        };
        let want: Vec<u32> = c["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|x| x.as_u64().expect("id") as u32)
            .collect();
        let (tokens, bounds) = render_prompt(&tok, &tmpl, &chat, &opts, true)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(tokens, want, "{name}");
        let bounds = bounds.unwrap_or_else(|| panic!("{name}: no message bounds"));
        // Where each message's piece starts, then where the last one ends (before the
        // generation prompt); the assistant turn with only a tool call has no content of its
        // own and shares the piece before it.
        let with_content = chat
            .iter()
            .filter(|m| m.content.as_deref().is_some_and(|c| !c.is_empty()))
            .count();
        assert_eq!(bounds.len(), with_content + 1, "{name}: {bounds:?}");
        assert_eq!(bounds.first(), Some(&0), "{name}: {bounds:?}");
        assert!(
            bounds.windows(2).all(|w| w[0] <= w[1]),
            "{name}: {bounds:?}"
        );
        assert!(bounds.last() < Some(&tokens.len()), "{name}: {bounds:?}");
        eprintln!("{name}: {} tokens, bounds {bounds:?}", tokens.len());
    }
}
