//! `leyline bench policy`: what each context policy does to the cached tokens of recorded
//! agent trajectories, with the model's real tokenizer and chat template. Every turn's prompt
//! is diffed against what the cache holds (previous prompt + recorded reply) and the edits are
//! checked to reproduce the prompt exactly before they are counted.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use leyline_engine::MemoRenderer;
use leyline_model::chat::ChatTemplate;
use leyline_model::tokenizer::Tokenizer;
use leyline_policy::{
    apply_edits, load_traces, replay_turns, replay_turns_stateful, turn_diffs, PolicyConfig,
    PolicyStats, Trajectory, Turn,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

/// Options of `bench policy`.
#[derive(Args)]
pub struct PolicyArgs {
    /// Trace files (JSONL, the format of data/traces/).
    #[arg(long, num_args = 1.., default_values = ["data/traces/tau-bench.jsonl", "data/traces/swe-agent-demos.jsonl"])]
    pub traces: Vec<PathBuf>,
    /// Policies, in the CLI form (`none`, `truncate_tool_outputs:2`, `clear_tool_uses:trigger=4000,keep=3`, JSON).
    #[arg(long, num_args = 1.., default_values = ["none", "truncate_tool_outputs:2", "clear_tool_uses:trigger=4000,keep=3"])]
    pub policy: Vec<String>,
    /// Each prompt is the policy applied to the previous (edited) prompt, its reply and the new
    /// messages, instead of to the original history.
    #[arg(long)]
    pub stateful: bool,
    /// A GGUF file or a known model's name whose tokenizer and chat template to use
    /// (default: the default model).
    #[arg(long, short = 'm', env = "LEYLINE_MODEL")]
    pub model: Option<PathBuf>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Tokenizer and chat template from the GGUF metadata, without the weights.
fn tokenizer_and_template(model: Option<PathBuf>) -> Result<(Tokenizer, ChatTemplate)> {
    let path = crate::resolve_model(model.as_deref())?;
    if path.is_dir() {
        return Err(leyline_model::ModelError::NoTokenizer { path }.into());
    }
    let f = leyline_model::gguf::GgufFile::open(&path)?;
    let tok = Tokenizer::from_gguf_metadata(f.metadata())?;
    let tmpl = ChatTemplate::from_gguf_metadata(f.metadata(), &tok)
        .with_context(|| format!("{}: no usable chat template", path.display()))?;
    Ok((tok, tmpl))
}

/// Runs `bench policy`.
pub fn run(a: PolicyArgs) -> Result<()> {
    if a.traces.is_empty() || a.policy.is_empty() {
        bail!("give at least one --traces file and one --policy");
    }
    let policies: Vec<(String, PolicyConfig)> = a
        .policy
        .iter()
        .map(|s| Ok((s.clone(), s.parse::<PolicyConfig>()?)))
        .collect::<Result<_>>()?;
    let mut trajectories: Vec<Trajectory> = Vec::new();
    for path in &a.traces {
        let t = load_traces(path).with_context(|| {
            format!(
                "{} (run from the repository root, or pass --traces)",
                path.display()
            )
        })?;
        trajectories.extend(t);
    }
    let (tok, tmpl) = tokenizer_and_template(a.model)?;
    let renderer = MemoRenderer::new(&tok, &tmpl);

    let bar = ProgressBar::new(trajectories.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} trajectories {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message("replaying");
    let started = Instant::now();
    // (policy index, source) -> sums
    let mut stats: BTreeMap<(usize, String), PolicyStats> = BTreeMap::new();
    for t in &trajectories {
        renderer.clear();
        for (pi, (spec, cfg)) in policies.iter().enumerate() {
            let policy = cfg.build();
            let turns: Vec<Turn> = if a.stateful {
                replay_turns_stateful(&t.messages, policy.as_ref()).collect()
            } else {
                replay_turns(&t.messages, policy.as_ref()).collect()
            };
            let s = stats.entry((pi, t.source.clone())).or_default();
            for d in turn_diffs(turns, &renderer) {
                let d = d.with_context(|| format!("{spec} on {}", t.id))?;
                if apply_edits(&d.old.tokens, &d.edits)? != d.new.tokens {
                    bail!(
                        "{spec} on {} turn {}: the edits do not reproduce the prompt",
                        t.id,
                        d.turn
                    );
                }
                s.record(d.old.tokens.len(), d.new.tokens.len(), &d.edits);
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();

    let per = |x: u64, n: u64| if n == 0 { 0.0 } else { x as f64 / n as f64 };
    if a.json {
        let rows: Vec<_> = stats
            .iter()
            .map(|((pi, source), s)| {
                serde_json::json!({
                    "policy": policies[*pi].0,
                    "source": source,
                    "stats": s,
                    "edits_per_turn": s.edits_per_turn(),
                    "tokens_removed_per_turn": s.tokens_removed_per_turn(),
                    "mean_abs_delta": s.mean_abs_delta(),
                    "edit_share": s.edit_share(),
                    "prompt_tokens_per_turn": per(s.prompt_tokens, s.turns),
                    "prefix_cache_prefill_per_turn": per(s.prefix_cache_prefill, s.turns),
                })
            })
            .collect();
        let out = serde_json::json!({"stateful": a.stateful, "seconds": secs, "rows": rows});
        println!("{out}");
        return Ok(());
    }
    println!(
        "| policy | source | turns | edits/turn | tokens removed/turn | mean \\|delta\\| | turns with an edit | prompt tokens/turn | prefix-cache prefill/turn |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for ((pi, source), s) in &stats {
        println!(
            "| `{}` | {source} | {} | {:.2} | {:.1} | {:.1} | {:.1}% | {:.0} | {:.0} |",
            policies[*pi].0,
            s.turns,
            s.edits_per_turn(),
            s.tokens_removed_per_turn(),
            s.mean_abs_delta(),
            100.0 * s.edit_share(),
            per(s.prompt_tokens, s.turns),
            per(s.prefix_cache_prefill, s.turns),
        );
    }
    eprintln!(
        "{} trajectories, {} policies, {}: every turn's edits reproduced its prompt ({secs:.1} s)",
        trajectories.len(),
        policies.len(),
        if a.stateful { "stateful" } else { "stateless" },
    );
    Ok(())
}
