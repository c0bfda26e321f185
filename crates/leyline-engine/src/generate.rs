//! Single-sequence generation: chunked prefill, then one token per step, streaming each
//! token to a callback. The sequence's KV lives in slots `0..n` of a storage the caller owns,
//! so a caller that keeps the storage (an interactive chat) can reuse the KV of a prompt's
//! leading tokens on the next call ([`generate_after`]).

use crate::error::{EngineError, Result};
use crate::sampling::{Sampler, SamplingParams};
use leyline_kv::KvStorage;
use leyline_model::{CausalLm, ForwardSeq, LogitsFor};
use std::ops::ControlFlow;
use std::time::{Duration, Instant};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_tokens: usize,
    /// How to pick them.
    pub sampling: SamplingParams,
    /// Tokens that end generation (not emitted).
    pub stop_tokens: Vec<u32>,
    /// Prompt tokens per prefill forward.
    pub prefill_chunk: usize,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            prefill_chunk: 512,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The callback asked to stop.
    Cancelled,
    /// The context is full.
    ContextFull,
}

/// Timings and counts of one generation.
#[derive(Debug, Clone)]
pub struct GenerateStats {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of which served from the KV already in the storage.
    pub cached_tokens: usize,
    /// Tokens whose KV the storage holds afterwards, in slots `0..kv_tokens`: the prompt,
    /// then the generated tokens that were run (all but a final one that ended generation).
    pub kv_tokens: usize,
    /// Generated tokens (emitted).
    pub generated_tokens: usize,
    /// Time from start to the first generated token's logits.
    pub prefill_time: Duration,
    /// Time spent in decode steps.
    pub decode_time: Duration,
    /// Why it ended.
    pub stop: StopReason,
}

/// Generates from `prompt`, calling `on_token` with each new token.
///
/// # Errors
/// An empty prompt, a prompt that does not fit the context or the storage, or a model error.
pub fn generate(
    model: &dyn CausalLm,
    kv: &mut KvStorage,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<GenerateStats> {
    generate_after(model, kv, prompt, 0, params, on_token)
}

/// Length of the longest common prefix of `held` (tokens whose KV is in slots `0..`) and
/// `prompt`, leaving at least the prompt's last token to run (its logits pick the first new
/// token): what [`generate_after`] may take as cached.
pub fn reusable_prefix(held: &[u32], prompt: &[u32]) -> usize {
    let common = held.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    common.min(prompt.len().saturating_sub(1))
}

/// [`generate`] when slots `0..cached` of `kv` already hold the KV of `prompt[..cached]`
/// at positions `0..cached` (from an earlier call on the same storage); only the rest of
/// the prompt is prefilled.
///
/// # Errors
/// As [`generate`], and `cached` not below the prompt length.
pub fn generate_after(
    model: &dyn CausalLm,
    kv: &mut KvStorage,
    prompt: &[u32],
    cached: usize,
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> ControlFlow<()>,
) -> Result<GenerateStats> {
    if prompt.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    params
        .sampling
        .validate()
        .map_err(EngineError::InvalidRequest)?;
    let limit = model.info().context_length.min(kv.capacity());
    if prompt.len() >= limit {
        return Err(EngineError::InvalidRequest(format!(
            "the prompt has {} tokens but the context holds {limit} (the model's context length is {}, the KV pool has {} slots)",
            prompt.len(),
            model.info().context_length,
            kv.capacity()
        )));
    }
    if cached >= prompt.len() {
        return Err(EngineError::InvalidRequest(format!(
            "{cached} cached tokens leave nothing of the {}-token prompt to run",
            prompt.len()
        )));
    }
    let start = Instant::now();
    let mut sampler = Sampler::new(params.sampling);
    let mut tokens: Vec<u32> = prompt.to_vec();
    let slots: Vec<u32> = (0..limit as u32).collect();
    let chunk = params.prefill_chunk.max(1);
    let mut done = cached;
    let mut logits = Vec::new();
    while done < prompt.len() {
        let end = (done + chunk).min(prompt.len());
        let last = end == prompt.len();
        let seq = ForwardSeq {
            tokens: &prompt[done..end],
            positions: &slots[done..end],
            context: &slots[..done],
            new_slots: &slots[done..end],
            logits: if last {
                LogitsFor::Last
            } else {
                LogitsFor::None
            },
            shifts: &[],
        };
        logits = model.forward(kv, &[seq])?.remove(0);
        done = end;
    }
    let prefill_time = start.elapsed();
    let decode_start = Instant::now();
    let mut generated = 0;
    let stop = loop {
        if generated >= params.max_tokens {
            break StopReason::Length;
        }
        let next = sampler.sample(&logits);
        if params.stop_tokens.contains(&next) {
            break StopReason::Stop;
        }
        generated += 1;
        if on_token(next).is_break() {
            break StopReason::Cancelled;
        }
        if generated >= params.max_tokens {
            break StopReason::Length;
        }
        let n = tokens.len();
        if n >= limit {
            break StopReason::ContextFull;
        }
        tokens.push(next);
        let seq = ForwardSeq {
            tokens: &tokens[n..],
            positions: &slots[n..n + 1],
            context: &slots[..n],
            new_slots: &slots[n..n + 1],
            logits: LogitsFor::Last,
            shifts: &[],
        };
        logits = model.forward(kv, &[seq])?.remove(0);
    };
    Ok(GenerateStats {
        prompt_tokens: prompt.len(),
        cached_tokens: cached,
        kv_tokens: tokens.len(),
        generated_tokens: generated,
        prefill_time,
        decode_time: decode_start.elapsed(),
        stop,
    })
}
