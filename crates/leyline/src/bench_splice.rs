//! `leyline bench splice`: latency of an AMORTIZE splice (a tool output replaced by a stub,
//! downstream keys rotated, or left in place with `--rotation lazy`) against FORGET's
//! re-prefill of the same edit, for several downstream lengths, on the in-process engine;
//! optionally the speed of a turn after the splice (`--decode`), whose context holds one
//! shifted run per edit under lazy rotation (`--edits`).

use crate::eval::fidelity::{session_with, PROBE_STUB};
use crate::eval::stats::median;
use crate::{load_model, ModelArgs, ThreadsArgs};
use anyhow::{bail, Result};
use clap::Args;
use leyline_core::{Directive, Mode};
use leyline_engine::{
    EditReport, Engine, EngineConfig, Event, Request, SessionEdits, SessionId, SessionRequest,
};
use leyline_kv::shift::RotationMode;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};
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
    /// Edits in the batch: the stub, plus one single-token deletion at each of `edits - 1`
    /// evenly spaced places downstream (under lazy rotation the context then holds `edits`
    /// shifted runs after the prefix). 0: no edit, so `--decode`'s turn runs on the context
    /// as it was prefilled (with `--ab`: lazy rotation's cost on sequences it never spliced).
    #[arg(long, default_value_t = 1)]
    pub edits: usize,
    /// After each AMORTIZE splice, a turn of `--turn-prompt` new prompt tokens and this many
    /// generated ones in the spliced session; reports its prefill and decode speed (0: no
    /// turn).
    #[arg(long, default_value_t = 0)]
    pub decode: usize,
    /// New prompt tokens of the turn after the splice (`--decode`).
    #[arg(long, default_value_t = 256)]
    pub turn_prompt: usize,
    /// Skip the FORGET arm (its re-prefill of long contexts takes minutes).
    #[arg(long)]
    pub no_forget: bool,
    /// Run both rotation modes in this one process, eager then lazy in every repetition (two
    /// engines over one model; `--rotation` is ignored, `--max-segments` applies to lazy),
    /// and report lazy / eager ratios per repetition pair: their median and range. Slow
    /// drift of the machine's speed then cancels out of the ratios.
    #[arg(long)]
    pub ab: bool,
    #[command(flatten)]
    pub pool: ThreadsArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub rotation: crate::RotationArgs,
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
    rotation: RotationMode,
    downstream: usize,
    amortize_ms: Vec<f64>,
    /// Per repetition: the splice's time less its replacements' forward
    /// ([`EditReport::prefill_us`]).
    beyond_prefill_ms: Vec<f64>,
    forget_ms: Vec<f64>,
    amortize: EditReport,
    forget: Option<EditReport>,
    /// Runs of distinct offset in the spliced context.
    segments: usize,
    /// Per repetition with `--decode`: the turn's prefill and decode tokens per second.
    turn_prefill: Vec<f64>,
    turn_decode: Vec<f64>,
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
    let modes = if a.ab {
        vec![RotationMode::Eager, RotationMode::Lazy]
    } else {
        vec![a.rotation.rotation]
    };
    let mut engines = Vec::new();
    for &rotation in &modes {
        let cfg = EngineConfig {
            kv_dtype: a.model.kv_dtype,
            ..a.rotation.apply(EngineConfig::new(slots))
        };
        engines.push(Engine::new(
            Arc::clone(&lm.model),
            EngineConfig { rotation, ..cfg },
        )?);
    }
    let prefix = tokens(&lm, SYSTEM, a.prefix)?;
    let span = tokens(&lm, TOOL, a.span)?;
    let stub = tokens(&lm, PROBE_STUB, a.stub)?;
    let later = tokens(&lm, LATER, *a.downstream.iter().max().unwrap_or(&0))?;
    let extra = tokens(&lm, LATER, a.turn_prompt.max(1))?;
    let (start, end) = (a.prefix, a.prefix + a.span);
    if a.edits == 0 && a.decode == 0 {
        bail!("--edits 0 times nothing: give it a turn to time (--decode N)");
    }
    // The stub, then single-token deletions spread over `d` downstream tokens.
    let edits = |mode, d: usize| {
        if a.edits == 0 {
            return Vec::new();
        }
        let mut v = vec![Directive::new(start, end, stub.clone(), mode)];
        for k in 1..a.edits {
            let at = end + k * d / a.edits;
            v.push(Directive::new(at, at + 1, Vec::new(), mode));
        }
        v
    };

    let mut rows = Vec::new();
    for &d in &a.downstream {
        let mut ctx = prefix.clone();
        ctx.extend_from_slice(&span);
        ctx.extend_from_slice(&later[..d]);
        eprintln!(
            "bench splice: {d} downstream tokens ({} in context)",
            ctx.len()
        );
        if d < a.edits {
            bail!("{d} downstream tokens cannot hold {} edits", a.edits);
        }
        let mut reps: Vec<Vec<Rep>> = modes.iter().map(|_| Vec::new()).collect();
        // The first build prefills everything; later AMORTIZE builds reuse the tree's copy
        // (eager splices copy shared slots before they rotate them, so the tree stays clean).
        for _ in 0..a.repeat {
            for (engine, reps) in engines.iter_mut().zip(&mut reps) {
                let s = session_with(engine, &ctx)?;
                let t = Instant::now();
                let report = engine.apply_directives(s, edits(Mode::Amortize, d))?;
                let ms = t.elapsed().as_secs_f64() * 1e3;
                let slots = engine.session_info(s)?.slots;
                let shifts = engine.cache().pool().key_shifts(&slots)?;
                let segments = leyline_kv::shift::segment_count(&shifts, slots.len());
                let turn = if a.decode > 0 {
                    Some(turn(engine, s, &extra, a.decode)?)
                } else {
                    None
                };
                engine.delete_session(s)?;
                reps.push(Rep {
                    ms,
                    report,
                    segments,
                    turn,
                });
            }
        }
        for ((engine, reps), &rotation) in engines.iter_mut().zip(reps).zip(&modes) {
            // FORGET purges the tree past the edit: each build re-prefills it, untimed.
            let mut forget_ms = Vec::new();
            let mut forget = None;
            for _ in 0..if a.no_forget { 0 } else { a.repeat } {
                let s = session_with(engine, &ctx)?;
                let t = Instant::now();
                let r = engine.apply_directives(s, edits(Mode::Forget, d))?;
                forget_ms.push(t.elapsed().as_secs_f64() * 1e3);
                forget = Some(r);
                engine.delete_session(s)?;
            }
            let Some(last) = reps.last() else {
                bail!("no repetition ran");
            };
            rows.push(Row {
                rotation,
                downstream: d,
                amortize_ms: reps.iter().map(|r| r.ms).collect(),
                beyond_prefill_ms: reps
                    .iter()
                    .map(|r| r.ms - r.report.prefill_us as f64 / 1e3)
                    .collect(),
                forget_ms,
                amortize: last.report,
                forget,
                segments: last.segments,
                turn_prefill: reps.iter().filter_map(|r| r.turn.map(|t| t.0)).collect(),
                turn_decode: reps.iter().filter_map(|r| r.turn.map(|t| t.1)).collect(),
            });
        }
    }
    print(&a, &lm, &rows);
    Ok(())
}

/// One AMORTIZE repetition: the splice's time and report, the runs it left, and the turn
/// after it (prefill and decode tokens per second).
struct Rep {
    ms: f64,
    report: EditReport,
    segments: usize,
    turn: Option<(f64, f64)>,
}

/// Per repetition pair of an `--ab` run: `lazy / eager` of one figure.
fn pair_ratios(eager: &[f64], lazy: &[f64]) -> Vec<f64> {
    eager.iter().zip(lazy).map(|(e, l)| l / e).collect()
}

/// Median, least and largest of `v` as JSON (nulls when empty).
fn spread(v: &[f64]) -> serde_json::Value {
    let r = median_range(v);
    serde_json::json!({ "median": r.map(|x| x.0), "min": r.map(|x| x.1), "max": r.map(|x| x.2) })
}

/// Median, least and largest of `v`; `None` when empty.
fn median_range(v: &[f64]) -> Option<(f64, f64, f64)> {
    let m = median(v)?;
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Some((m, lo, hi))
}

/// A turn in session `id`: its tokens then `extra`, and `n` generated tokens (no stop
/// tokens); the prefill's and the decode's tokens per second.
fn turn(engine: &mut Engine, id: SessionId, extra: &[u32], n: usize) -> Result<(f64, f64)> {
    let mut prompt = engine.session_info(id)?.tokens;
    prompt.extend_from_slice(extra);
    let times = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let t = Arc::clone(&times);
    let sink = Box::new(move |ev| {
        if let Event::Token(_) = ev {
            if let Ok(mut v) = t.lock() {
                v.push(Instant::now());
            }
        }
        ControlFlow::Continue(())
    });
    let t0 = Instant::now();
    engine.submit(Request::greedy(prompt, n, sink).in_session(SessionRequest {
        id,
        mode: Mode::Amortize,
        edits: SessionEdits::Tokens,
    }));
    engine.run_to_completion()?;
    let v = times
        .lock()
        .map_err(|_| anyhow::anyhow!("token times poisoned"))?;
    let (Some(first), Some(last)) = (v.first(), v.last()) else {
        bail!("the turn after the splice generated nothing");
    };
    let prefill = extra.len() as f64 / (*first - t0).as_secs_f64();
    let decode = (v.len() - 1) as f64 / (*last - *first).as_secs_f64();
    Ok((prefill, decode))
}

/// Per downstream length of an `--ab` run (rows eager then lazy): the lazy / eager ratios
/// of the splice's time and the turn's speeds, per repetition pair.
fn ab_pairs(rows: &[Row]) -> Vec<(usize, [Vec<f64>; 3])> {
    rows.chunks_exact(2)
        .filter(|p| p[0].rotation == RotationMode::Eager && p[1].rotation == RotationMode::Lazy)
        .map(|p| {
            let (e, l) = (&p[0], &p[1]);
            (
                e.downstream,
                [
                    pair_ratios(&e.amortize_ms, &l.amortize_ms),
                    pair_ratios(&e.turn_prefill, &l.turn_prefill),
                    pair_ratios(&e.turn_decode, &l.turn_decode),
                ],
            )
        })
        .collect()
}

/// [`ab_pairs`] as JSON.
fn ab_rows(rows: &[Row]) -> Vec<serde_json::Value> {
    ab_pairs(rows)
        .iter()
        .map(|(d, [splice, prefill, decode])| {
            serde_json::json!({
                "downstream": d,
                "splice_ms": spread(splice),
                "turn_prefill_tok_s": spread(prefill),
                "turn_decode_tok_s": spread(decode),
            })
        })
        .collect()
}

fn print(a: &SpliceArgs, lm: &leyline_model::LoadedModel, rows: &[Row]) {
    let name = &lm.model.info().name;
    let rotations = if a.ab {
        "eager,lazy".to_string()
    } else {
        a.rotation.rotation.to_string()
    };
    if a.json {
        let json_rows: Vec<serde_json::Value> = rows
            .iter()
            .map(|r| {
                let (am, fm) = r.medians();
                serde_json::json!({
                    "rotation": r.rotation.to_string(),
                    "downstream": r.downstream,
                    "amortize_ms": am,
                    "forget_ms": fm,
                    "ratio": am / fm,
                    "amortize_ms_all": r.amortize_ms,
                    "beyond_prefill_ms": median(&r.beyond_prefill_ms),
                    "forget_ms_all": r.forget_ms,
                    "rotated": r.amortize.rotated,
                    "copied": r.amortize.copied,
                    "compacted": r.amortize.compacted,
                    "segments": r.segments,
                    "amortize_prefilled": r.amortize.prefilled,
                    "forget_prefilled": r.forget.map(|f| f.prefilled),
                    "turn_prefill_tok_s": median(&r.turn_prefill),
                    "turn_decode_tok_s": median(&r.turn_decode),
                    "turn_decode_tok_s_all": r.turn_decode,
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
                "edits": a.edits,
                "rotation": rotations,
                "repeat": a.repeat,
                "rows": json_rows,
                "ab": ab_rows(rows),
            })
        );
        return;
    }
    println!(
        "{name}, kv {}, {} threads, {} rotation: {} prefix tokens, a {}-token span replaced by {} \
         tokens, {} edits; medians of {}\n",
        a.model.kv_dtype, a.pool.threads, rotations, a.prefix, a.span, a.stub, a.edits, a.repeat
    );
    println!("| rotation | downstream tokens | AMORTIZE splice ms | of it beyond the stub's forward | FORGET re-prefill ms | ratio | rotated | copied | segments | prefilled A / F | turn prefill / decode tok/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let opt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.1}"));
    for r in rows {
        let (am, fm) = r.medians();
        println!(
            "| {} | {} | {am:.1} | {} | {} | {} | {} | {} | {} | {} / {} | {} / {} |",
            r.rotation,
            r.downstream,
            opt(median(&r.beyond_prefill_ms)),
            opt(r.forget.map(|_| fm)),
            r.forget
                .map_or("-".to_string(), |_| format!("{:.4}", am / fm)),
            r.amortize.rotated,
            r.amortize.copied,
            r.segments,
            r.amortize.prefilled,
            r.forget
                .map_or("-".to_string(), |f| f.prefilled.to_string()),
            opt(median(&r.turn_prefill)),
            opt(median(&r.turn_decode)),
        );
    }
    let pairs = ab_pairs(rows);
    if !pairs.is_empty() {
        println!("\nlazy / eager per repetition pair, median (range):\n");
        println!("| downstream tokens | splice ms | turn prefill tok/s | turn decode tok/s |");
        println!("|---|---|---|---|");
        let cell = |v: &[f64]| {
            median_range(v).map_or("-".to_string(), |(m, lo, hi)| {
                format!("{m:.3} ({lo:.3}-{hi:.3})")
            })
        };
        for (d, [splice, prefill, decode]) in &pairs {
            println!(
                "| {d} | {} | {} | {} |",
                cell(splice),
                cell(prefill),
                cell(decode)
            );
        }
    }
}
