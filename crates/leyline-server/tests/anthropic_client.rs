//! The official `anthropic` Python client against a real server
//! (tests/python/anthropic_client.py): the Messages API plain and streamed, cache reads in
//! usage, stop sequences, tool blocks in the history, a session edit through `extra_body`,
//! and errors in Anthropic's envelope. Fails (never skips) when python3 or the `anthropic`
//! package is missing.

mod common;

#[test]
fn official_anthropic_client_conformance() {
    common::run_client_script("anthropic_client.py", "anthropic", true);
}
