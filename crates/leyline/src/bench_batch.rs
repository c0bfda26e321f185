//! `leyline bench batch`: decode throughput of the continuous-batching engine at several
//! batch sizes, and time-to-first-token of a long prompt cold vs. with a cached prefix.

use crate::eval::stats::median;
use crate::{load_model, ModelArgs};
use anyhow::{bail, Result};
use clap::Args;
use leyline_engine::{Engine, EngineConfig, Event, Request, Usage};
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Prefill budget per step while the decode measurement sets up its sequences.
const SETUP_CHUNK: usize = 4096;

/// Options of `bench batch`.
#[derive(Args)]
pub struct BatchArgs {
    /// Batch sizes (sequences decoding together).
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub batch: Vec<usize>,
    /// Decode steps measured per batch size.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Prompt tokens of each decoding sequence, all distinct, so that the measured steps
    /// attend over this much context per sequence (prefilled first, not timed).
    #[arg(long, default_value_t = 32)]
    pub context: usize,
    /// Leading tokens of `--context` that every decoding sequence shares, as agent sessions
    /// share a system prompt: prefilled once before the sequences start, whose prompts then
    /// reuse it from the prefix cache. 0: nothing shared.
    #[arg(long, default_value_t = 0)]
    pub shared_prefix: usize,
    /// Prompt length of the TTFT measurement.
    #[arg(long, default_value_t = 2048)]
    pub ttft_prompt: usize,
    /// Cached prefix length of the warm TTFT measurement.
    #[arg(long, default_value_t = 1900)]
    pub ttft_prefix: usize,
    /// Repetitions of the TTFT pair; medians are reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// Deterministic filler token ids of the model's vocabulary (ordinary text tokens).
fn tokens(lm: &leyline_model::LoadedModel, n: usize, salt: usize) -> Result<Vec<u32>> {
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut i = salt;
    // An entry is about 20 tokens: add a batch of entries per encode, not one, so a long
    // prompt is not re-encoded once per entry.
    while ids.len() < n {
        for _ in 0..(n - ids.len()).div_ceil(16) {
            text.push_str(&format!(
                "Entry {i}: the ledger records a shipment of {} crates to harbour {}. ",
                (i * 37) % 1000,
                (i * 11) % 97
            ));
            i += 1;
        }
        ids = lm.tokenizer.encode(&text, false)?;
    }
    ids.truncate(n);
    Ok(ids)
}

fn request(prompt: Vec<u32>, max_tokens: usize, out: Arc<Mutex<Option<Usage>>>) -> Request {
    let sink = Box::new(move |e| {
        if let Event::Finished { usage, .. } = e {
            if let Ok(mut o) = out.lock() {
                *o = Some(usage);
            }
        }
        ControlFlow::Continue(())
    });
    Request::greedy(prompt, max_tokens, sink)
}

/// Runs the benchmark.
pub fn run(a: BatchArgs) -> Result<()> {
    if a.batch.is_empty() || a.steps == 0 || a.repeat == 0 || a.ttft_prefix >= a.ttft_prompt {
        bail!("need batch sizes, --steps >= 1, --repeat >= 1 and --ttft-prefix < --ttft-prompt");
    }
    if a.context == 0 {
        bail!("--context must be at least 1 token");
    }
    if a.shared_prefix >= a.context {
        bail!(
            "--shared-prefix ({}) must be shorter than --context ({})",
            a.shared_prefix,
            a.context
        );
    }
    let lm = load_model(&a.model)?;
    // The first sequences decode while later ones prefill: they get tokens for those steps
    // and then for `steps` with all `n` sequences decoding.
    let max_tokens = |n: usize| a.steps + 2 + (n * a.context).div_ceil(SETUP_CHUNK);
    let most = a.batch.iter().max().copied().unwrap_or(1);
    let slots = a
        .model
        .kv_slots
        .unwrap_or((most * (a.context + max_tokens(most))).max(16 * 1024));
    let cfg = |chunk| EngineConfig {
        kv_dtype: a.model.kv_dtype,
        prefill_chunk: chunk,
        decode_prefill_chunk: chunk,
        ..EngineConfig::new(slots)
    };
    // Decode throughput: all sequences prefilled first, then only decode steps are timed.
    let mut decode = Vec::new();
    for &n in &a.batch {
        let mut e = Engine::new(Arc::clone(&lm.model), cfg(SETUP_CHUNK))?;
        if a.context > 256 {
            eprintln!("batch {n}: prefilling {n} x {} tokens", a.context);
        }
        let prefix = tokens(&lm, a.shared_prefix, 777_000)?;
        if !prefix.is_empty() {
            e.submit(request(prefix.clone(), 1, Arc::default()));
            e.run_to_completion()?;
        }
        let mut usages = Vec::with_capacity(n);
        for i in 0..n {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(&lm, a.context - a.shared_prefix, i * 1000)?);
            let usage = Arc::new(Mutex::new(None));
            e.submit(request(prompt, max_tokens(n), Arc::clone(&usage)));
            usages.push(usage);
        }
        let mut times = Vec::new();
        while e.has_work() {
            let t = Instant::now();
            let r = e.step()?;
            if r.decode_seqs == n && r.prefill_tokens == 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        if times.is_empty() {
            bail!("no pure decode step with {n} sequences was seen");
        }
        for u in &usages {
            let cached = u
                .lock()
                .ok()
                .and_then(|u| u.as_ref().map(|u| u.cached_tokens));
            if cached.unwrap_or(0) + 1 < a.shared_prefix {
                bail!(
                    "a sequence reused {} of the {} shared prefix tokens",
                    cached.unwrap_or(0),
                    a.shared_prefix
                );
            }
        }
        let step = median(&times).unwrap_or(f64::NAN);
        decode.push((n, step, n as f64 / step));
        eprintln!(
            "batch {n}: {:.1} ms/step, {:.1} tok/s",
            step * 1e3,
            n as f64 / step
        );
    }
    // TTFT: a prompt whose first `ttft_prefix` tokens are cached vs. the same prompt cold.
    let base = tokens(&lm, a.ttft_prompt, 7)?;
    let tail_len = a.ttft_prompt - a.ttft_prefix;
    let (mut cold, mut warm) = (Vec::new(), Vec::new());
    for rep in 0..a.repeat {
        let mut prompt = base[..a.ttft_prefix].to_vec();
        prompt.extend(tokens(&lm, tail_len, 50_000 + rep)?);
        let mut other = base[..a.ttft_prefix].to_vec();
        other.extend(tokens(&lm, tail_len, 90_000 + rep)?);
        let cold_usage = Arc::new(Mutex::new(None));
        let mut e = Engine::new(
            Arc::clone(&lm.model),
            cfg(leyline_engine::DEFAULT_PREFILL_CHUNK),
        )?;
        e.submit(request(prompt.clone(), 1, Arc::clone(&cold_usage)));
        e.run_to_completion()?;
        let warm_usage = Arc::new(Mutex::new(None));
        let mut e = Engine::new(
            Arc::clone(&lm.model),
            cfg(leyline_engine::DEFAULT_PREFILL_CHUNK),
        )?;
        e.submit(request(other, 1, Arc::default()));
        e.run_to_completion()?;
        e.submit(request(prompt, 1, Arc::clone(&warm_usage)));
        e.run_to_completion()?;
        let get = |u: &Arc<Mutex<Option<Usage>>>| u.lock().ok().and_then(|u| u.clone());
        let (Some(c), Some(w)) = (get(&cold_usage), get(&warm_usage)) else {
            bail!("a TTFT request did not finish");
        };
        if w.cached_tokens < a.ttft_prefix - 1 {
            bail!("the warm request reused only {} tokens", w.cached_tokens);
        }
        cold.push(c.ttft.as_secs_f64());
        warm.push(w.ttft.as_secs_f64());
    }
    let (cold, warm) = (
        median(&cold).unwrap_or(f64::NAN),
        median(&warm).unwrap_or(f64::NAN),
    );
    if a.json {
        let d: Vec<_> = decode
            .iter()
            .map(|(n, s, t)| serde_json::json!({"batch": n, "step_ms": s * 1e3, "tok_s": t}))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": lm.model.info().name,
                "kv_dtype": a.model.kv_dtype.name(),
                "context": a.context,
                "shared_prefix": a.shared_prefix,
                "decode": d,
                "ttft_prompt": a.ttft_prompt,
                "ttft_prefix": a.ttft_prefix,
                "ttft_cold_ms": cold * 1e3,
                "ttft_warm_ms": warm * 1e3,
                "ttft_ratio": warm / cold,
            })
        );
    } else {
        println!("| sequences | context | ms per decode step | tokens/s |");
        println!("|---|---|---|---|");
        for (n, s, t) in &decode {
            println!("| {n} | {} | {:.1} | {t:.1} |", a.context, s * 1e3);
        }
        println!();
        println!(
            "| prompt | cached prefix | TTFT cold (ms) | TTFT warm (ms) | warm/cold |\n|---|---|---|---|---|\n| {} | {} | {:.1} | {:.1} | {:.3} |",
            a.ttft_prompt,
            a.ttft_prefix,
            cold * 1e3,
            warm * 1e3,
            warm / cold
        );
    }
    Ok(())
}
