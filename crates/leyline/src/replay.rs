//! `leyline bench replay`: the paper's mechanism arm on real agent trajectories.
//!
//! Each trajectory is a session; each assistant turn is a request whose prompt is the history
//! so far after the policy edited it; the recorded assistant message is appended afterwards.
//! Arms: `baseline` (plain requests over the radix prefix cache), `amortize` and `forget`
//! (Leyline sessions whose edits are directives in that mode). Each (arm, C) runs on a fresh
//! engine, driven in-process through the engine API, with C sessions in flight.
//!
//! Design decision: the replay steps the engine itself and submits a finished request's
//! follow-up before the next step, so which requests meet in a step, and with it every token
//! count, is a function of the trajectories alone: two runs give the same counts.

mod drive;
mod plot;
mod prepare;
mod report;

use crate::{load_model, ModelArgs, ThreadsArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use drive::{Arm, RequestRecord, RunParams};
use indicatif::{ProgressBar, ProgressStyle};
use leyline_engine::{ChatRenderer, EngineConfig};
use leyline_policy::{load_traces, PolicyConfig};
use prepare::{LongRule, PrepareOpts};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;

/// Options of `bench replay`.
#[derive(Args)]
pub struct ReplayArgs {
    /// Trajectory files (JSONL, `data/traces` format), read in order.
    #[arg(long, num_args = 1.., required = true)]
    pub traces: Vec<PathBuf>,
    /// The context policy (CLI form, e.g. `truncate_tool_outputs:2`).
    #[arg(long, default_value = "truncate_tool_outputs:2")]
    pub policy: PolicyConfig,
    /// Arms to run.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "baseline,amortize,forget"
    )]
    pub arms: Vec<Arm>,
    /// Sessions in flight, one run per value.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16")]
    pub concurrency: Vec<usize>,
    /// Sessions: the first N usable trajectories, in file order.
    #[arg(long, default_value_t = 16)]
    pub sessions: usize,
    /// Most assistant turns replayed per session.
    #[arg(long)]
    pub max_turns: Option<usize>,
    /// Tokens generated per request (greedy); the recorded reply replaces them afterwards.
    #[arg(long, default_value_t = 8)]
    pub max_tokens: usize,
    /// Trajectories whose prompt outgrows the model's context: cut them at the first turn that
    /// does not fit, or skip them (and take the next trajectory).
    #[arg(long, value_enum, default_value_t = LongRule::Cut)]
    pub long: LongRule,
    /// Output directory: replay.json, replay.md and the PNG plots.
    #[arg(long, default_value = "replay-out")]
    pub out: PathBuf,
    #[command(flatten)]
    pub pool: ThreadsArgs,
    /// Most prompt tokens prefilled per engine step.
    #[arg(long, default_value_t = leyline_engine::DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
    /// Most prompt tokens prefilled in a step that also decodes.
    #[arg(long, default_value_t = leyline_engine::DEFAULT_DECODE_PREFILL_CHUNK)]
    pub decode_prefill_chunk: usize,
    /// Which prompts get a step's prefill budget first: `shortest` (fewest tokens left) or
    /// `arrival` (admission order).
    #[arg(long, default_value_t = leyline_engine::PrefillOrder::Shortest)]
    pub prefill_order: leyline_engine::PrefillOrder,
    /// With `--prefill-order shortest`: a prompt left without prefill in this many steps
    /// goes ahead of shorter ones from then on (bounds how long a long prompt waits).
    #[arg(long, default_value_t = leyline_engine::DEFAULT_PREFILL_PATIENCE)]
    pub prefill_patience: u32,
    /// Cap on the KV pool when `--kv-slots` is not given, in GiB.
    #[arg(long, default_value_t = 8.0)]
    pub kv_mem_gib: f64,
    /// The `repair` arm's repair: `N` (the first N tokens after each edit), `after_edit:N`,
    /// `before_end:N` or `deviation:N` (see `serve --repair`).
    #[arg(long, default_value = "after_edit:16")]
    pub repair: leyline_core::Repair,
    /// Only redraw the plots of an earlier run from `--out`/replay.json (`--traces` ignored).
    #[arg(long)]
    pub plot_only: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub rotation: crate::RotationArgs,
}

#[derive(Serialize)]
struct Record<'a> {
    arm: Arm,
    concurrency: usize,
    #[serde(flatten)]
    r: &'a RequestRecord,
}

#[derive(Serialize)]
struct RunInfo {
    arm: Arm,
    concurrency: usize,
    kv_slots: usize,
    wall_s: f64,
    engine_metrics: serde_json::Map<String, serde_json::Value>,
}

/// Runs the replay and writes its outputs.
///
/// # Errors
/// Bad options, unreadable traces, a model without a chat template, engine failures.
pub fn run(a: ReplayArgs) -> Result<()> {
    if a.plot_only {
        return replot(&a.out);
    }
    if a.sessions == 0 || a.max_tokens == 0 || a.arms.is_empty() {
        bail!("--sessions, --max-tokens and --arms must not be empty or zero");
    }
    if a.concurrency.contains(&0) || a.concurrency.is_empty() {
        bail!("--concurrency values must be at least 1");
    }
    a.pool.init()?;
    let lm = load_model(&a.model)?;
    let template = lm
        .chat
        .as_ref()
        .with_context(|| format!("{} has no chat template", lm.path.display()))?;
    let mut trajectories = Vec::new();
    for p in &a.traces {
        trajectories.extend(load_traces(p).with_context(|| format!("reading {}", p.display()))?);
    }
    let info = lm.model.info().clone();
    let renderer = ChatRenderer::new(&lm.tokenizer, template, true);
    let policy = a.policy.build();
    let opts = PrepareOpts {
        sessions: a.sessions,
        max_turns: a.max_turns.unwrap_or(usize::MAX),
        limit: info.context_length,
        reserve: a.max_tokens,
        rule: a.long,
    };
    let prepared = prepare::prepare(&trajectories, policy.as_ref(), &renderer, &opts)?;
    if prepared.sessions.is_empty() {
        bail!("no trajectory has a turn that fits the model's context");
    }
    let edit_turns = prepared
        .sessions
        .iter()
        .flat_map(|s| &s.turns)
        .filter(|t| t.edit_turn)
        .count();
    eprintln!(
        "replay: {} sessions, {} requests per run ({edit_turns} edit turns), longest prompt {} tokens; {} skipped, {} cut ({} turns)",
        prepared.sessions.len(),
        prepared.requests(),
        prepared.longest_prompt(),
        prepared.skipped.len(),
        prepared.cut_sessions,
        prepared.cut_turns
    );
    let stop_tokens = lm.tokenizer.stop_ids().to_vec();
    let cap = EngineConfig::slots_for_memory(
        lm.model.as_ref(),
        a.model.kv_dtype,
        (a.kv_mem_gib * (1u64 << 30) as f64) as usize,
    );
    let per_session = prepared.longest_prompt() + a.max_tokens + 1;

    let runs = a.concurrency.len() * a.arms.len();
    let bar = ProgressBar::new((runs * prepared.requests()) as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:>18} [{bar:30}] {pos}/{len} requests, {elapsed} ({eta} left)",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut summary = Vec::new();
    let mut records = Vec::new();
    let mut run_info = Vec::new();
    for &c in &a.concurrency {
        // Sessions hold their context and the tree the baseline's: twice the live contexts
        // keeps the pool from evicting what a later turn reuses.
        let live = c.min(prepared.sessions.len());
        let kv_slots = a.model.kv_slots.unwrap_or_else(|| {
            (2 * live * per_session + a.prefill_chunk)
                .min(cap)
                .max(per_session + 1)
        });
        for &arm in &a.arms {
            bar.set_message(format!("{arm} C={c}"));
            let params = RunParams {
                arm,
                concurrency: c,
                max_tokens: a.max_tokens,
                stop_tokens: stop_tokens.clone(),
                engine: EngineConfig {
                    kv_dtype: a.model.kv_dtype,
                    prefill_chunk: a.prefill_chunk,
                    decode_prefill_chunk: a.decode_prefill_chunk,
                    prefill_order: a.prefill_order,
                    prefill_patience: a.prefill_patience,
                    max_running: live.max(1),
                    repair: if arm == Arm::Repair {
                        a.repair
                    } else {
                        leyline_core::Repair::NONE
                    },
                    ..a.rotation.apply(EngineConfig::new(kv_slots))
                },
            };
            let out = drive::run(lm.model.clone(), &prepared, &params, &mut || bar.inc(1))
                .with_context(|| format!("arm {arm}, C={c}"))?;
            summary.push(report::summarize(arm, c, &out));
            run_info.push(RunInfo {
                arm,
                concurrency: c,
                kv_slots,
                wall_s: out.wall.as_secs_f64(),
                engine_metrics: out
                    .metrics
                    .pairs()
                    .into_iter()
                    .map(|(k, v)| (k.to_string(), v.into()))
                    .collect(),
            });
            records.push((arm, c, out.records));
            if !std::io::stderr().is_terminal() {
                // No bar without a terminal: one line per finished run instead.
                eprintln!(
                    "replay: run {}/{runs} ({arm}, C={c}) took {:.1} s",
                    summary.len(),
                    out.wall.as_secs_f64()
                );
            }
        }
    }
    bar.finish_and_clear();

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut sources: Vec<&str> = trajectories.iter().map(|t| t.source.as_str()).collect();
    sources.dedup();
    let title = sources.join(" + ");
    let flat: Vec<Record<'_>> = records
        .iter()
        .flat_map(|(arm, c, rs)| {
            rs.iter().map(|r| Record {
                arm: *arm,
                concurrency: *c,
                r,
            })
        })
        .collect();
    let command: Vec<String> = std::env::args().collect();
    let json = serde_json::json!({
        "command": command.join(" "),
        "model": info.name,
        "model_path": lm.path.display().to_string(),
        "kv_dtype": a.model.kv_dtype.name(),
        "threads": a.pool.threads,
        "policy": a.policy,
        "repair": a.repair.to_string(),
        "max_tokens": a.max_tokens,
        "prefill_chunk": a.prefill_chunk,
        "decode_prefill_chunk": a.decode_prefill_chunk,
        "prefill_order": a.prefill_order.name(),
        "prefill_patience": a.prefill_patience,
        "long_rule": format!("{:?}", a.long).to_lowercase(),
        "context_length": info.context_length,
        "sessions": prepared.sessions.iter().map(|s| s.name.clone()).collect::<Vec<_>>(),
        "requests_per_run": prepared.requests(),
        "edit_turns_per_run": edit_turns,
        "skipped": prepared.skipped,
        "cut_sessions": prepared.cut_sessions,
        "cut_turns": prepared.cut_turns,
        "runs": run_info,
        "summary": summary,
        "requests": flat,
    });
    let path = a.out.join("replay.json");
    std::fs::write(&path, serde_json::to_string_pretty(&json)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let md = format!(
        "{}\n{}\nSessions: {} ({title}); {} requests per run, {edit_turns} of them edit turns; {} trajectories skipped, {} cut ({} turns dropped) by `--long {}`.\n",
        report::markdown(&summary),
        report::targets(&summary),
        prepared.sessions.len(),
        prepared.requests(),
        prepared.skipped.len(),
        prepared.cut_sessions,
        prepared.cut_turns,
        format!("{:?}", a.long).to_lowercase(),
    );
    std::fs::write(a.out.join("replay.md"), &md)?;
    plot::plots(&a.out, &summary, &title)?;
    println!("{md}");
    eprintln!("replay: wrote {}", a.out.display());
    Ok(())
}

/// Redraws the plots from `dir/replay.json`.
fn replot(dir: &std::path::Path) -> Result<()> {
    let path = dir.join("replay.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let j: serde_json::Value = serde_json::from_str(&text)?;
    let rows: Vec<report::Summary> = serde_json::from_value(j["summary"].clone())
        .with_context(|| format!("{}: no summary list", path.display()))?;
    let mut sources: Vec<String> = j["sessions"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter_map(|n| n.as_str()?.split('/').next().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    sources.dedup();
    plot::plots(dir, &rows, &sources.join(" + "))
}
