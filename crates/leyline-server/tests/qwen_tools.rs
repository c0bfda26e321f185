//! Tool round trips on Qwen2.5-Coder-0.5B, whose chat template renders tools (SmolLM2's
//! ignores them): the official `openai` client without `extra_body` (`tool_calls`, plain and
//! streamed, and the call sent back), `leyline.context_management` on chat completions, and
//! the official `anthropic` client (`tool_use` blocks). The model comes through the registry
//! (fetched on first use, as CI does); python3 with both packages is required, never skipped.

mod common;

use leyline_engine::EngineConfig;

#[test]
fn official_clients_round_trip_tool_calls_on_qwen() {
    let path = leyline_hub::known_model_path("qwen2.5-coder-0.5b")
        .expect("Qwen2.5-Coder-0.5B is needed: `leyline model fetch qwen2.5-coder-0.5b`");
    let addr = common::start_server_on(path, EngineConfig::new(8192), |sc| {
        sc.api_keys = vec![common::KEY_A.to_string(), common::KEY_B.to_string()];
    });
    common::run_client_script_on(addr, "qwen_tools.py", "anthropic", true);
}
