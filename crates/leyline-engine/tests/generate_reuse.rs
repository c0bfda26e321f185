//! `generate_after` (what `leyline chat` uses between turns): a second turn that reuses the
//! KV of the first turn's prompt and reply gives the same greedy tokens as a cold run of the
//! whole conversation on fresh storage, and prefills only the new text.

use leyline_engine::{generate, generate_after, reusable_prefix, GenerateParams, SamplingParams};
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::chat::ChatMessage;
use std::ops::ControlFlow;

#[test]
fn a_second_chat_turn_reuses_the_first_and_matches_a_cold_run() {
    let path =
        leyline_hub::default_model_path().expect("the default model is needed: fetching it failed");
    let lm = leyline_model::load_gguf(&path).expect("load the default model");
    let template = lm.chat.as_ref().expect("SmolLM2 carries a chat template");
    let params = GenerateParams {
        max_tokens: 12,
        sampling: SamplingParams::greedy(),
        ..Default::default()
    };
    let geom = lm.model.info().geometry;
    let mut kv = KvStorage::new(geom, KvDtype::F32, 1024).unwrap();
    let encode = |msgs: &[ChatMessage]| {
        let text = template.render(msgs, true).unwrap();
        lm.tokenizer.encode(&text, false).unwrap()
    };
    let mut msgs = vec![ChatMessage::new("user", "Name three colours.".to_string())];
    let first = encode(&msgs);
    let mut reply = Vec::new();
    let s1 = generate(lm.model.as_ref(), &mut kv, &first, &params, |t| {
        reply.push(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(s1.cached_tokens, 0);
    assert!(s1.kv_tokens >= first.len() && s1.kv_tokens <= first.len() + reply.len());
    let held: Vec<u32> = first
        .iter()
        .chain(&reply)
        .take(s1.kv_tokens)
        .copied()
        .collect();

    msgs.push(ChatMessage::new(
        "assistant",
        lm.tokenizer.decode(&reply, true).unwrap(),
    ));
    msgs.push(ChatMessage::new("user", "And three animals?".to_string()));
    let second = encode(&msgs);
    let cached = reusable_prefix(&held, &second);
    assert!(
        cached >= first.len() - 1,
        "the first prompt is reused ({cached} tokens)"
    );
    let mut warm = Vec::new();
    let s2 = generate_after(lm.model.as_ref(), &mut kv, &second, cached, &params, |t| {
        warm.push(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(s2.cached_tokens, cached);

    let mut cold_kv = KvStorage::new(geom, KvDtype::F32, 1024).unwrap();
    let mut cold = Vec::new();
    generate(lm.model.as_ref(), &mut cold_kv, &second, &params, |t| {
        cold.push(t);
        ControlFlow::Continue(())
    })
    .unwrap();
    assert!(!cold.is_empty());
    assert_eq!(warm, cold, "reused KV gives the cold run's greedy tokens");
}

#[test]
fn reusable_prefix_always_leaves_a_token_to_run() {
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3]), 2);
    assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
    assert_eq!(reusable_prefix(&[1, 2], &[1, 2, 3, 4]), 2);
    assert_eq!(reusable_prefix(&[], &[7]), 0);
    assert_eq!(reusable_prefix(&[9], &[1, 2]), 0);
}
