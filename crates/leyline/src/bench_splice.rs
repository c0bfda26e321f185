//! `leyline bench splice`: latency of an AMORTIZE splice (a tool output replaced by a stub,
//! downstream keys rotated) against FORGET's re-prefill of the same edit, for several
//! downstream lengths, on the in-process engine.

use crate::eval::fidelity::{session_with, PROBE_STUB};
use crate::eval::stats::median;
use crate::{load_model, ModelArgs, ThreadsArgs};
use anyhow::{bail, Result};
use clap::Args;
use leyline_core::{Directive, Mode};
use leyline_engine::{EditReport, Engine, EngineConfig};
use std::sync::Arc;
use std::time::Instant;

/// Options of `bench splice`.
#[derive(Args)]
pub struct SpliceArgs {
    /// Downstream token counts (tokens after the edited span).
    #[arg(long, value_delimiter = ',', default_value = "1024,3072,6144")]
    pub downstream: Vec<usize>,
    /// Tokens before the edited span.
    #[arg(long, default_value_t = 512)]
    pub prefix: usize,
    /// Tokens of the replaced tool output.
    #[arg(long, default_value_t = 200)]
    pub span: usize,
    /// Tokens of the stub that replaces it.
    #[arg(long, default_value_t = 10)]
    pub stub: usize,
    /// Repetitions of each arm; the median is reported.
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

const SYSTEM: &str = "You are a careful assistant for an airline. Follow the policy, confirm \
every change with the user, and use the tools to read reservations before acting. ";
const TOOL: &str = "{\"reservation_id\": \"8JX2WO\", \"flights\": [{\"origin\": \"JFK\", \
\"destination\": \"SEA\", \"date\": \"2024-05-20\", \"price\": 187}], \"passengers\": 2} ";
const LATER: &str = "The user asked again about baggage, seats and the refund rules; the agent \
checked the membership level, explained the allowance and offered two alternatives. ";

/// Tokens of `text` repeated until there are `n`, cut to `n`.
fn tokens(lm: &leyline_model::LoadedModel, text: &str, n: usize) -> Result<Vec<u32>> {
    let one = lm.tokenizer.encode(text, false)?;
    if one.is_empty() {
        bail!("filler text encodes to no tokens");
    }
    Ok(one.iter().copied().cycle().take(n).collect())
}

struct Row {
    downstream: usize,
    amortize_ms: Vec<f64>,
    forget_ms: Vec<f64>,
    amortize: EditReport,
    forget: EditReport,
}

impl Row {
    /// Median milliseconds of the AMORTIZE and the FORGET arm.
    fn medians(&self) -> (f64, f64) {
        let m = |v: &[f64]| median(v).unwrap_or(f64::NAN);
        (m(&self.amortize_ms), m(&self.forget_ms))
    }
}

/// Runs `bench splice`.
pub fn run(a: SpliceArgs) -> Result<()> {
    if a.repeat == 0 || a.span == 0 || a.downstream.is_empty() {
        bail!("--repeat, --span and --downstream must be non-empty / at least 1");
    }
    a.pool.init()?;
    let lm = load_model(&a.model)?;
    let longest = a.prefix + a.span + a.downstream.iter().copied().max().unwrap_or(0);
    if longest + 1 >= lm.model.info().context_length {
        bail!(
            "{longest} tokens do not fit the model's context of {}",
            lm.model.info().context_length
        );
    }
    // The tree's copy plus the session's rotated copy of the longest context.
    let slots = a.model.kv_slots.unwrap_or(2 * longest + 1024);
    let cfg = EngineConfig {
        kv_dtype: a.model.kv_dtype,
        ..EngineConfig::new(slots)
    };
    let mut engine = Engine::new(Arc::clone(&lm.model), cfg)?;
    let prefix = tokens(&lm, SYSTEM, a.prefix)?;
    let span = tokens(&lm, TOOL, a.span)?;
    let stub = tokens(&lm, PROBE_STUB, a.stub)?;
    let later = tokens(&lm, LATER, *a.downstream.iter().max().unwrap_or(&0))?;
    let (start, end) = (a.prefix, a.prefix + a.span);
    let edit = |mode| Directive::new(start, end, stub.clone(), mode);

    let mut rows = Vec::new();
    for &d in &a.downstream {
        let mut ctx = prefix.clone();
        ctx.extend_from_slice(&span);
        ctx.extend_from_slice(&later[..d]);
        eprintln!(
            "bench splice: {d} downstream tokens ({} in context)",
            ctx.len()
        );
        // The first build prefills everything; later AMORTIZE builds reuse the tree's copy
        // (the splice copies shared slots before it rotates them, so the tree stays clean).
        let mut amortize_ms = Vec::new();
        let mut amortize = None;
        for _ in 0..a.repeat {
            let s = session_with(&mut engine, &ctx)?;
            let t = Instant::now();
            let r = engine.apply_directives(s, vec![edit(Mode::Amortize)])?;
            amortize_ms.push(t.elapsed().as_secs_f64() * 1e3);
            amortize = Some(r);
            engine.delete_session(s)?;
        }
        // FORGET purges the tree past the edit: each build re-prefills it, untimed.
        let mut forget_ms = Vec::new();
        let mut forget = None;
        for _ in 0..a.repeat {
            let s = session_with(&mut engine, &ctx)?;
            let t = Instant::now();
            let r = engine.apply_directives(s, vec![edit(Mode::Forget)])?;
            forget_ms.push(t.elapsed().as_secs_f64() * 1e3);
            forget = Some(r);
            engine.delete_session(s)?;
        }
        let (Some(amortize), Some(forget)) = (amortize, forget) else {
            bail!("no repetition ran");
        };
        rows.push(Row {
            downstream: d,
            amortize_ms,
            forget_ms,
            amortize,
            forget,
        });
    }
    print(&a, &lm, &rows);
    Ok(())
}

fn print(a: &SpliceArgs, lm: &leyline_model::LoadedModel, rows: &[Row]) {
    let name = &lm.model.info().name;
    if a.json {
        let rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let (am, fm) = r.medians();
                serde_json::json!({
                    "downstream": r.downstream,
                    "amortize_ms": am,
                    "forget_ms": fm,
                    "ratio": am / fm,
                    "amortize_ms_all": r.amortize_ms,
                    "forget_ms_all": r.forget_ms,
                    "rotated": r.amortize.rotated,
                    "copied": r.amortize.copied,
                    "amortize_prefilled": r.amortize.prefilled,
                    "forget_prefilled": r.forget.prefilled,
                })
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "model": name,
                "threads": a.pool.threads,
                "kv_dtype": a.model.kv_dtype.name(),
                "prefix": a.prefix,
                "span": a.span,
                "stub": a.stub,
                "repeat": a.repeat,
                "rows": rows,
            })
        );
        return;
    }
    println!(
        "{name}, kv {}, {} threads: {} prefix tokens, a {}-token span replaced by {} tokens; medians of {}\n",
        a.model.kv_dtype, a.pool.threads, a.prefix, a.span, a.stub, a.repeat
    );
    println!("| downstream tokens | AMORTIZE splice ms | FORGET re-prefill ms | ratio | rotated | copied | prefilled A / F |");
    println!("|---|---|---|---|---|---|---|");
    for r in rows {
        let (am, fm) = r.medians();
        println!(
            "| {} | {am:.1} | {fm:.1} | {:.4} | {} | {} | {} / {} |",
            r.downstream,
            am / fm,
            r.amortize.rotated,
            r.amortize.copied,
            r.amortize.prefilled,
            r.forget.prefilled
        );
    }
}
