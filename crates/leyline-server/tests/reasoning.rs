//! Reasoning through the three APIs with the official clients
//! (tests/python/reasoning_clients.py): the default model served with a ChatML template
//! that opens a `<think>` block in its generation prompt, so its whole greedy output is
//! reasoning. The splitting itself (blocks the model opens, answers after `</think>`, tool
//! calls after reasoning, any streamed cut) is unit-tested in `src/reasoning.rs`. Fails
//! (never skips) when python3 or a client package is missing.

mod common;

use leyline_engine::EngineConfig;
use leyline_model::chat::ChatTemplate;

/// ChatML whose generation prompt opens a reasoning block (as Qwen3's thinking models'
/// do), or with `enable_thinking` false writes an empty closed one (as Qwen3's template
/// does), rendering earlier reasoning as Qwen3 does.
const THINKING_CHATML: &str = "{%- for m in messages -%}\
<|im_start|>{{ m.role }}\n\
{%- if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif -%}\
{{ m.content }}<|im_end|>\n\
{%- endfor -%}\
{%- if add_generation_prompt %}<|im_start|>assistant\n\
{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n\
{%- else %}<think>\n{% endif %}{% endif -%}";

#[test]
fn reasoning_comes_back_as_each_apis_reasoning() {
    let path =
        leyline_hub::default_model_path().expect("the default model is needed: fetching it failed");
    let addr = common::start_server_with(
        path,
        EngineConfig::new(4096),
        |lm| {
            let t = ChatTemplate::new(THINKING_CHATML, "", "<|im_end|>").expect("template");
            lm.chat = Some(t);
        },
        |sc| sc.api_keys = vec![common::KEY_A.to_string()],
    );
    common::run_client_script_on(addr, "reasoning_clients.py", "anthropic", true);
}
