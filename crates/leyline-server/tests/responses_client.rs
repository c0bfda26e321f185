//! The official `openai` Python client against a real server's Responses API
//! (tests/python/responses_client.py): plain, item-list and streamed creates, cached usage
//! on a repeat, stored responses with GET, DELETE and `previous_response_id` (per API key),
//! refusals naming the field, and the fields Codex CLI sends. Fails (never skips) when
//! python3 or the `openai` package is missing.

mod common;

#[test]
fn official_openai_client_responses_api() {
    common::run_client_script("responses_client.py", "openai", false);
}
