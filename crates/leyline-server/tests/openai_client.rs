//! The official `openai` Python client against a real server (tests/python/openai_client.py):
//! plain and streamed chat, a two-turn session whose tool output is edited under AMORTIZE
//! and FORGET, 16 concurrent streams, auth and error cases. Fails (never skips) when
//! python3 or the `openai` package is missing.

mod common;

#[test]
fn official_openai_client_conformance() {
    common::run_client_script("openai_client.py", "openai", false);
}
