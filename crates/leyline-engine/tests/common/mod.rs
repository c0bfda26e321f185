//! Helpers shared by the engine's integration tests: the default model and plain requests
//! that record what their sink receives.
#![allow(dead_code)] // each test crate uses a subset

use leyline_core::{Directive, Mode};
use leyline_engine::{
    Engine, Event, FinishReason, Request, SessionEdits, SessionId, SessionRequest, Usage,
};
use leyline_model::LoadedModel;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, OnceLock};

/// The default model, fetched on first use.
/// Sets f32 activations for every quantized product in this process (the reference path),
/// for tests whose claims are about a splice's arithmetic against an f64-built reference:
/// 8-bit activations turn float noise between two computations of the same values into a
/// whole rounding step wherever a value sits at a step's edge. The switch is process-wide
/// and a binary's tests run on threads of one process, so each test of such a binary calls
/// this first.
#[allow(dead_code)]
pub fn f32_activations() {
    leyline_kernels::qmatmul::set_activations(leyline_kernels::qmatmul::Activations::F32);
}

pub fn lm() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| {
        let path = leyline_hub::default_model_path()
            .expect("the default model is needed: fetching it failed");
        leyline_model::load_gguf(&path).expect("load the default model")
    })
}

/// `text` as token ids, without special tokens added.
pub fn encode(text: &str) -> Vec<u32> {
    lm().tokenizer.encode(text, false).unwrap()
}

/// What a request's sink received.
#[derive(Default)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<leyline_engine::TokenLogprobs>,
    pub finished: Option<(FinishReason, Usage)>,
    pub failed: Option<String>,
}

pub type Shared = Arc<Mutex<Outcome>>;

/// A greedy plain (session-less) request and the outcome its sink fills in.
pub fn request(prompt: Vec<u32>, max_tokens: usize) -> (Request, Shared) {
    let out: Shared = Arc::default();
    let o = Arc::clone(&out);
    let sink = Box::new(move |e| {
        let mut o = o.lock().unwrap();
        match e {
            Event::Token(t) => o.tokens.push(t),
            Event::Logprobs(l) => o.logprobs.push(l),
            Event::Finished { reason, usage, .. } => o.finished = Some((reason, usage)),
            Event::Failed(m) => o.failed = Some(m.message),
        }
        ControlFlow::Continue(())
    });
    let req = Request::greedy(prompt, max_tokens, sink);
    (req, out)
}

/// Submits one greedy request per prompt; their outcomes in order.
pub fn submit_all(e: &mut Engine, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Shared> {
    prompts
        .iter()
        .map(|p| {
            let (req, out) = request(p.clone(), max_tokens);
            e.submit(req);
            out
        })
        .collect()
}

/// A session of `e` holding exactly `ctx`: a turn caches it and one generated token, which
/// a deletion at the end then drops.
pub fn session_with(e: &mut Engine, ctx: &[u32]) -> SessionId {
    let id = e.create_session();
    let (req, out) = request(ctx.to_vec(), 1);
    e.submit(req.in_session(SessionRequest {
        id,
        mode: Mode::Amortize,
        edits: SessionEdits::Tokens,
    }));
    e.run_to_completion().unwrap();
    assert!(out.lock().unwrap().failed.is_none());
    let n = e.session_info(id).unwrap().tokens.len();
    if n > ctx.len() {
        let cut = vec![Directive::new(ctx.len(), n, vec![], Mode::Amortize)];
        e.apply_directives(id, cut).unwrap();
    }
    assert_eq!(e.session_info(id).unwrap().tokens, ctx);
    id
}
