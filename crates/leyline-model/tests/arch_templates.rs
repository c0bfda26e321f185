//! The chat templates of the architectures of issue 60, tool calls and reasoning included,
//! render what transformers renders from the same template (fixtures: the publishers'
//! templates as llama.cpp ships them, rendered by transformers' `apply_chat_template`; see
//! `tests/fixtures/ARCHS.md`). Cases where transformers raises must be errors here too.

use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use serde_json::Value;

/// (fixture file, BOS text the template reads).
const FILES: &[(&str, &str)] = &[
    (
        "llama/chat_template_cases.llama3.1.json",
        "<|begin_of_text|>",
    ),
    (
        "llama/chat_template_cases.llama3.2.json",
        "<|begin_of_text|>",
    ),
    (
        "llama/chat_template_cases.llama3.3.json",
        "<|begin_of_text|>",
    ),
    ("qwen3/chat_template_cases.qwen2.5.json", ""),
    ("qwen3/chat_template_cases.qwen3.json", ""),
    ("qwen3/chat_template_cases.qwen3-4b.json", ""),
    ("qwen3moe/chat_template_cases.qwen3-coder.json", ""),
];

fn options(case: &Value, add_generation_prompt: bool) -> RenderOptions {
    let mut extra = case["apply_chat_template_kwargs"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let tools = extra
        .remove("tools")
        .map(|t| t.as_array().expect("tools array").clone());
    RenderOptions {
        add_generation_prompt,
        tools,
        extra,
    }
}

#[test]
fn templates_render_as_transformers_renders_them() {
    for (file, bos) in FILES {
        let path = format!("{}/tests/fixtures/{file}", env!("CARGO_MANIFEST_DIR"));
        let fx: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let source = fx["chat_template"].as_str().unwrap();
        let t = ChatTemplate::new(source, *bos, "").unwrap_or_else(|e| panic!("{file}: {e}"));
        let (mut rendered, mut raised) = (0, 0);
        for c in fx["cases"].as_array().unwrap() {
            let name = format!("{file} {}", c["name"]);
            let msgs: Vec<ChatMessage> = serde_json::from_value(c["messages"].clone())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let result = t.render_with(&msgs, &options(c, true));
            if c.get("error").is_some() {
                assert!(
                    result.is_err(),
                    "{name}: transformers raised, this rendered"
                );
                raised += 1;
                continue;
            }
            let text = result.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(text, c["text"].as_str().unwrap(), "{name}");
            let plain = t
                .render_with(&msgs, &options(c, false))
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(
                plain,
                c["text_without_generation_prompt"].as_str().unwrap(),
                "{name} without the generation prompt"
            );
            rendered += 1;
        }
        eprintln!("{file}: {rendered} rendered alike, {raised} raised alike");
        assert!(rendered >= 10, "{file}: only {rendered} cases rendered");
    }
}
