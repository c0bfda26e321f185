//! `leyline bench ...`: measurements that print medians, for BENCHMARKS.md.

use crate::eval::stats::median;
use crate::{load_model, storage_for, ModelArgs, ThreadsArgs};
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use leyline_engine::{generate, generate_after, GenerateParams, SamplingParams};
use std::ops::ControlFlow;
use std::time::Instant;

/// Benchmarks.
#[derive(Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode tokens/s of one sequence (compare with llama-bench pp/tg).
    Engine(EngineArgs),
    /// Batched decode tokens/s at several batch sizes; TTFT cold vs. with a cached prefix.
    Batch(crate::bench_batch::BatchArgs),
    /// What each context policy does to the cached tokens of recorded agent trajectories.
    Policy(crate::bench_policy::PolicyArgs),
    /// Latency of an AMORTIZE splice vs. FORGET's re-prefill of the same edit.
    Splice(crate::bench_splice::SpliceArgs),
    /// Replay agent trajectories under a context policy: baseline vs AMORTIZE vs FORGET.
    Replay(Box<crate::replay::ReplayArgs>),
    /// Memory read bandwidth of this machine, and the decode speed it bounds for a model.
    Bandwidth(crate::bench_bandwidth::BandwidthArgs),
}

/// Options of `bench engine`.
#[derive(Args)]
pub struct EngineArgs {
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated for the decode measurement.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Tokens already in the context before both measurements (as `llama-bench -d`): they
    /// are prefilled once, untimed, and both tests run after them.
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    /// Repetitions; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    #[command(flatten)]
    pub pool: ThreadsArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

const FILLER: &str = "The history of navigation is a story of instruments and patience. \
Sailors read the stars, timed the sun at noon, and counted knots on a rope to guess their speed. \
Each improvement, from the magnetic compass to the marine chronometer, shortened voyages and saved lives. ";

/// Runs a benchmark.
pub fn run(cmd: BenchCommand) -> Result<()> {
    match cmd {
        BenchCommand::Engine(a) => engine(a),
        BenchCommand::Batch(a) => crate::bench_batch::run(a),
        BenchCommand::Policy(a) => crate::bench_policy::run(a),
        BenchCommand::Splice(a) => crate::bench_splice::run(a),
        BenchCommand::Replay(a) => crate::replay::run(*a),
        BenchCommand::Bandwidth(a) => crate::bench_bandwidth::run(a),
    }
}

fn engine(a: EngineArgs) -> Result<()> {
    if a.repeat == 0 || a.prompt_tokens == 0 {
        bail!("--repeat and --prompt-tokens must be at least 1");
    }
    a.pool.init()?;
    let lm = load_model(&a.model)?;
    let mut text = String::new();
    // The depth, then the measured prompt: one text, so the prompt continues the depth.
    let (depth, want) = (a.depth, a.depth + a.prompt_tokens);
    let mut prompt = Vec::new();
    while prompt.len() < want {
        text.push_str(FILLER);
        prompt = lm.tokenizer.encode(&text, false)?;
    }
    prompt.truncate(want);
    let mut kv = storage_for(&lm, &a.model)?;
    let one = GenerateParams {
        max_tokens: 1,
        ..Default::default()
    };
    if depth > 0 {
        eprintln!("prefilling the depth of {depth} tokens (untimed)");
        generate(
            lm.model.as_ref(),
            &mut kv,
            &prompt[..depth + 1],
            &one,
            |_| ControlFlow::Continue(()),
        )?;
    }
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for i in 0..=a.repeat {
        // Prefill alone: generate one token (the first sample needs only the prefill). Slots
        // past the depth are rewritten each time; the depth's stay.
        let t = Instant::now();
        generate_after(lm.model.as_ref(), &mut kv, &prompt, depth, &one, |_| {
            ControlFlow::Continue(())
        })?;
        let prefill = t.elapsed().as_secs_f64();
        // Decode: a short prompt, then gen_tokens steps (no stop tokens).
        let params = GenerateParams {
            max_tokens: a.gen_tokens + 1,
            sampling: SamplingParams::greedy(),
            ..Default::default()
        };
        let stats = generate_after(
            lm.model.as_ref(),
            &mut kv,
            &prompt[..depth + 8.min(a.prompt_tokens)],
            depth,
            &params,
            |_| ControlFlow::Continue(()),
        )?;
        if i == 0 {
            continue; // warm-up
        }
        pp.push(a.prompt_tokens as f64 / prefill);
        tg.push(a.gen_tokens as f64 / stats.decode_time.as_secs_f64());
    }
    let (pp, tg) = (
        median(&pp).unwrap_or(f64::NAN),
        median(&tg).unwrap_or(f64::NAN),
    );
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": lm.model.info().name,
                "threads": a.pool.threads,
                "kv_dtype": a.model.kv_dtype.name(),
                "prompt_tokens": a.prompt_tokens,
                "gen_tokens": a.gen_tokens,
                "depth": a.depth,
                "prefill_tok_s": pp,
                "decode_tok_s": tg,
            })
        );
    } else {
        println!(
            "| model | threads | kv | test | tok/s (median of {}) |",
            a.repeat
        );
        println!("|---|---|---|---|---|");
        let name = &lm.model.info().name;
        let kv = a.model.kv_dtype;
        let at = if depth > 0 {
            format!(" @ d{depth}")
        } else {
            String::new()
        };
        println!(
            "| {name} | {} | {kv} | pp{}{at} | {pp:.1} |",
            a.pool.threads, a.prompt_tokens
        );
        println!(
            "| {name} | {} | {kv} | tg{}{at} | {tg:.1} |",
            a.pool.threads, a.gen_tokens
        );
    }
    Ok(())
}
