//! `leyline verify`: the fidelity report of DESIGN.md §8 — first-token agreement of
//! AMORTIZE with the unedited full context and with FORGET over probes from recorded
//! trajectories, and the key drift of chained splices per storage dtype and rotation math.
//!
//! A model without tokenizer or chat template (a DeepSeek-V2 checkpoint directory) cannot
//! render trajectories; it gets seeded synthetic probes instead (random token ids with a
//! random older span evicted), and the report says which source it used.

use crate::eval::fidelity::{
    build_probes, by_reference_margin, chained_shift_drift, run_probe, splice_deltas,
    synthetic_probes, Probe, ProbeOptions, ProbeOutcome, RotationMath, SyntheticOptions,
    MARGIN_BANDS, PROBE_STUB, SYNTHETIC_MIN_TOKENS,
};
use crate::eval::stats::median;
use crate::{load_any_model, ModelArgs, ThreadsArgs};
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use leyline_core::{Repair, RepairRule};
use leyline_engine::REPAIR_DEVIATION_LAYER;
use leyline_engine::{ChatRenderer, Engine, EngineConfig};
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::{AnyModel, ForwardSeq, LogitsFor};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// Where `leyline verify` takes its probes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProbeSource {
    /// Trajectories when the model has a tokenizer and chat template, else synthetic.
    Auto,
    /// Assistant turns of recorded trajectories (needs a tokenizer and chat template).
    Traces,
    /// Seeded random token ids with an older span replaced by a short random stub.
    Synthetic,
}

/// Options of `leyline verify`.
#[derive(Args)]
pub struct VerifyArgs {
    /// Number of probes (assistant turns with an older tool output to evict, or synthetic
    /// sequences).
    #[arg(long, default_value_t = 50)]
    pub probes: usize,
    /// Longest probe prompt, in tokens (synthetic probes have between half of this, or of
    /// the model's context, and all of it).
    #[arg(long, default_value_t = 3072)]
    pub max_tokens_per_probe: usize,
    /// Probe source: `traces` needs the model's tokenizer and chat template; `auto` falls back
    /// to `synthetic` for a model without them (a DeepSeek-V2 checkpoint directory).
    #[arg(long, value_enum, default_value_t = ProbeSource::Auto)]
    pub probe_source: ProbeSource,
    /// Seed of synthetic probes.
    #[arg(long, default_value_t = 0x5EED)]
    pub seed: u64,
    /// Trajectory file (JSONL); default: shared/data/traces/tau-bench.jsonl found from the
    /// current directory upward.
    #[arg(long, env = "LEYLINE_TRACES")]
    pub traces: Option<PathBuf>,
    /// Trace probes move the oldest tool output to just before the turn's last message
    /// (as a client that reorders what it keeps) instead of replacing it by a stub; with
    /// `--reuse-min-tokens` 0 the moved output is prefilled, above it copied.
    #[arg(long)]
    pub moves: bool,
    /// Chain lengths of the drift measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pub drift_splices: Vec<usize>,
    /// Tokens of the first probe whose keys (every layer) the drift measurement moves.
    #[arg(long, default_value_t = 256)]
    pub drift_tokens: usize,
    /// Largest |delta| of one drift splice (deltas are random in ±[1, this]).
    #[arg(long, default_value_t = 512)]
    pub drift_max_delta: u64,
    /// Repairs to measure besides the plain splice, each on its own session per probe: a
    /// bare count N stands for `after_edit:N` (the first N tokens after the edit),
    /// `before_end:N` (the last N of the context) and `deviation:N` (the N whose KV a
    /// one-layer pass finds moving most); `0` is the splice alone. Example:
    /// `--repair 0,4,16,64`.
    #[arg(long, value_delimiter = ',')]
    pub repair: Vec<String>,
    /// With `--repair`: write the Pareto plot (agreement with FORGET where its margin is at
    /// least 0.25, against the recomputed share; a line per rule) to this PNG.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Rows of the per-probe table (disagreements first, then the nearest ties); 0 omits it.
    #[arg(long, default_value_t = 12)]
    pub show: usize,
    #[command(flatten)]
    pub pool: ThreadsArgs,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub rotation: crate::RotationArgs,
}

/// Where the probes came from, for the report.
enum Source {
    Traces(PathBuf),
    Synthetic { seed: u64 },
}

impl Source {
    fn name(&self) -> &'static str {
        match self {
            Self::Traces(_) => "traces",
            Self::Synthetic { .. } => "synthetic",
        }
    }

    fn describe(&self) -> String {
        match self {
            Self::Traces(p) => p.display().to_string(),
            Self::Synthetic { seed } => format!("synthetic token ids (seed {seed})"),
        }
    }
}

/// One drift figure.
struct Drift {
    splices: usize,
    storage: KvDtype,
    rotation: &'static str,
    /// Times the stored keys were rewritten: every splice (eager), or each compaction (lazy).
    rewrites: usize,
    rel_l2: f64,
}

/// Runs `leyline verify`.
pub fn run(a: VerifyArgs) -> Result<()> {
    if a.probes == 0 {
        bail!("--probes must be at least 1");
    }
    let repairs = repair_list(&a.repair)?;
    if a.plot.is_some() && repairs.is_empty() {
        bail!("--plot draws the repair settings: give them with --repair (e.g. 0,4,16,64)");
    }
    a.pool.init()?;
    let lm = load_any_model(&a.model)?;
    let max_tokens = probe_budget(&a, lm.model().info());
    let (probes, source) = probes(&a, &lm, max_tokens)?;
    if probes.len() < a.probes {
        eprintln!(
            "leyline verify: only {} probes fit (asked for {})",
            probes.len(),
            a.probes
        );
    }

    // Three sequences of one probe at most live at once (two sessions and a copy-on-write
    // tail); the rest of the pool caches shared prefixes between probes.
    let slots = a
        .model
        .kv_slots
        .unwrap_or(4 * max_tokens + 1024)
        .max(max_tokens + 2);
    let cfg = EngineConfig {
        kv_dtype: a.model.kv_dtype,
        ..a.rotation.apply(EngineConfig::new(slots))
    };
    let mut engine = Engine::new(Arc::clone(lm.model()), cfg)?;
    let bar = ProgressBar::new(probes.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("probes [{bar:30}] {pos}/{len} {elapsed} (eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let mut outcomes = Vec::with_capacity(probes.len());
    for p in &probes {
        let extra: Vec<Repair> = repairs.iter().copied().filter(|r| !r.is_none()).collect();
        let o = run_probe(&mut engine, p, &extra).with_context(|| format!("probe {}", p.label))?;
        outcomes.push(o);
        bar.inc(1);
        if bar.is_hidden() && outcomes.len() % 10 == 0 {
            // No terminal for the bar: a line now and then.
            eprintln!("leyline verify: {}/{} probes", outcomes.len(), probes.len());
        }
    }
    bar.finish_and_clear();
    let probe_secs = started.elapsed().as_secs_f64();
    let prefilled = engine.metrics().snapshot().prefilled_tokens;

    let t = Instant::now();
    let drift = drift(&lm, &probes[0].prompt, &a)?;
    let drift_secs = t.elapsed().as_secs_f64();

    let rows = repair_rows(&outcomes, &repairs, lm.model().info().geometry.layers);
    if let Some(path) = &a.plot {
        plot_repairs(path, lm.model().info(), a.model.kv_dtype, &rows)?;
    }
    if a.json {
        print_json(
            &a,
            &lm,
            &source,
            (&outcomes, &rows),
            &drift,
            (probe_secs, drift_secs),
            prefilled,
        );
    } else {
        print_tables(&a, &lm, &source, (&outcomes, &rows), &drift, probe_secs);
    }
    Ok(())
}

/// `--repair` as repairs, in order, each once: a bare count stands for both rules.
fn repair_list(specs: &[String]) -> Result<Vec<Repair>> {
    let mut out: Vec<Repair> = Vec::new();
    for s in specs {
        let r: Repair = s
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--repair: {e}"))?;
        let expanded = if r.is_none() {
            vec![Repair::NONE]
        } else if s.contains(':') {
            vec![r]
        } else {
            vec![
                r,
                Repair::new(r.tokens, RepairRule::BeforeEnd),
                Repair::new(r.tokens, RepairRule::Deviation),
            ]
        };
        for r in expanded {
            if !out.contains(&r) {
                out.push(r);
            }
        }
    }
    Ok(out)
}

/// The Pareto plot of `rows`: each rule's line starts at the plain splice (`0`).
fn plot_repairs(
    path: &std::path::Path,
    info: &leyline_model::ModelInfo,
    dtype: KvDtype,
    rows: &[RepairRow],
) -> Result<()> {
    let none = rows.iter().find(|r| r.repair.is_none());
    let mut points = Vec::new();
    for rule in [
        RepairRule::AfterEdit,
        RepairRule::BeforeEnd,
        RepairRule::Deviation,
    ] {
        let line: Vec<&RepairRow> = rows
            .iter()
            .filter(|r| !r.repair.is_none() && r.repair.rule == rule)
            .collect();
        if line.is_empty() {
            continue;
        }
        for r in none.into_iter().chain(line) {
            points.push(crate::eval::plot::ParetoPoint {
                line: rule.name().to_string(),
                label: format!(" {}", r.repair.tokens),
                share: r.recomputed_share,
                agree: r.agree_forget_margin as f64 / r.forget_margin_probes.max(1) as f64,
            });
        }
    }
    let title = format!("AMORTIZE with repair: {} (kv {dtype})", info.name);
    crate::eval::plot::pareto(
        path,
        &title,
        &format!("agreement with FORGET (its margin >= {FORGET_MARGIN})"),
        &points,
    )
    .with_context(|| format!("writing {}", path.display()))
}

/// Smallest FORGET margin at which a probe counts as decided for the exact edited context.
const FORGET_MARGIN: f32 = 0.25;

/// One (setting, rule) of `--repair`, over every probe.
struct RepairRow {
    repair: Repair,
    /// Recomputed downstream tokens over those FORGET recomputes (replacements excluded);
    /// a selection pass counts as the fraction of a whole forward its layers are (the
    /// deviation pass runs [`REPAIR_DEVIATION_LAYER`] layers and one more layer's key and
    /// value projections, counted as a whole layer).
    recomputed_share: f64,
    agree_full: usize,
    agree_forget: usize,
    kl_forget_mean: f64,
    /// Probes whose FORGET margin is at least [`FORGET_MARGIN`], and how many of those agree
    /// with FORGET.
    forget_margin_probes: usize,
    agree_forget_margin: usize,
}

fn repair_rows(o: &[ProbeOutcome], repairs: &[Repair], layers: usize) -> Vec<RepairRow> {
    let scan_cost = (REPAIR_DEVIATION_LAYER + 1) as f64 / layers.max(1) as f64;
    repairs
        .iter()
        .map(|&repair| {
            // (token, KL, recomputed tokens, selection pass in forward-token units).
            let per: Vec<(u32, f64, usize, f64)> = o
                .iter()
                .map(|p| {
                    if repair.is_none() {
                        return (p.amortize.0, p.kl_forget, 0, 0.0);
                    }
                    p.repairs.iter().find(|r| r.repair == repair).map_or(
                        (u32::MAX, f64::NAN, 0, 0.0),
                        |r| {
                            (
                                r.token.0,
                                r.kl_forget,
                                r.repaired,
                                r.scanned as f64 * scan_cost,
                            )
                        },
                    )
                })
                .collect();
            let decided: Vec<usize> = (0..o.len())
                .filter(|&i| o[i].forget.1 >= FORGET_MARGIN)
                .collect();
            let recomputed: f64 = per.iter().map(|x| x.2 as f64 + x.3).sum();
            let forget_total: usize = o.iter().map(ProbeOutcome::forget_recomputed).sum();
            RepairRow {
                repair,
                recomputed_share: recomputed / forget_total.max(1) as f64,
                agree_full: (0..o.len()).filter(|&i| per[i].0 == o[i].full.0).count(),
                agree_forget: (0..o.len()).filter(|&i| per[i].0 == o[i].forget.0).count(),
                kl_forget_mean: per.iter().map(|x| x.1).sum::<f64>() / o.len().max(1) as f64,
                forget_margin_probes: decided.len(),
                agree_forget_margin: decided
                    .iter()
                    .filter(|&&i| per[i].0 == o[i].forget.0)
                    .count(),
            }
        })
        .collect()
}

/// Longest probe prompt: `--max-tokens-per-probe` within the model's context (the scored
/// last token and one generated token must fit too).
fn probe_budget(a: &VerifyArgs, info: &leyline_model::ModelInfo) -> usize {
    a.max_tokens_per_probe
        .min(info.context_length.saturating_sub(2))
}

/// The probes `a.probe_source` asks for, each at most `max_tokens` long.
fn probes(a: &VerifyArgs, lm: &AnyModel, max_tokens: usize) -> Result<(Vec<Probe>, Source)> {
    let renderable = match lm {
        AnyModel::Served(m) => m.chat.is_some(),
        AnyModel::Bare(_) => false,
    };
    let synthetic = match a.probe_source {
        ProbeSource::Synthetic => true,
        ProbeSource::Traces => false,
        ProbeSource::Auto => {
            if !renderable {
                eprintln!(
                    "leyline verify: {} has no tokenizer and chat template; using synthetic probes",
                    lm.path().display()
                );
            }
            !renderable
        }
    };
    if synthetic {
        if max_tokens < SYNTHETIC_MIN_TOKENS {
            bail!(
                "synthetic probes need at least {SYNTHETIC_MIN_TOKENS} tokens; the budget is \
                 {max_tokens} (--max-tokens-per-probe and the model's context)"
            );
        }
        let opts = SyntheticOptions {
            probes: a.probes,
            vocab_size: lm.model().info().vocab_size,
            max_tokens,
            seed: a.seed,
        };
        return Ok((synthetic_probes(&opts)?, Source::Synthetic { seed: a.seed }));
    }
    let lm = match lm {
        AnyModel::Served(m) => m,
        AnyModel::Bare(m) => {
            return Err(leyline_model::ModelError::NoTokenizer {
                path: m.path.clone(),
            }
            .into())
        }
    };
    let template = lm.chat.as_ref().with_context(|| {
        format!(
            "{} has no chat template; use --probe-source synthetic",
            lm.path.display()
        )
    })?;
    let traces_path = match &a.traces {
        Some(p) => p.clone(),
        None => find_traces()?,
    };
    let trajectories = leyline_policy::load_traces(&traces_path)
        .with_context(|| format!("reading {}", traces_path.display()))?;
    let renderer = ChatRenderer::new(&lm.tokenizer, template, true);
    let opts = ProbeOptions {
        max_probes: a.probes,
        max_tokens,
        stub: PROBE_STUB.to_string(),
        moves: a.moves,
    };
    let probes = build_probes(&trajectories, &renderer, &opts)?;
    if probes.is_empty() {
        bail!(
            "no probe in {} fits {max_tokens} tokens with an older tool output to evict",
            traces_path.display()
        );
    }
    Ok((probes, Source::Traces(traces_path)))
}

/// `shared/data/traces/tau-bench.jsonl` in the current directory or one above it.
fn find_traces() -> Result<PathBuf> {
    let cwd = std::env::current_dir()?;
    for dir in cwd.ancestors() {
        for base in [dir.join("shared"), dir.to_path_buf()] {
            let p = base.join("data").join("traces").join("tau-bench.jsonl");
            if p.is_file() {
                return Ok(p);
            }
        }
    }
    bail!(
        "no shared/data/traces/tau-bench.jsonl above the current directory; pass --traces (or \
         --probe-source synthetic)"
    )
}

/// Real keys: `drift_tokens` tokens of `prompt` prefilled at positions 0.. into f32 storage,
/// every layer's key rows.
fn model_keys(lm: &AnyModel, prompt: &[u32], n: usize) -> Result<Vec<f32>> {
    let n = n.min(prompt.len()).max(1);
    let g = lm.model().info().geometry;
    let mut kv = KvStorage::new(g, KvDtype::F32, n)?;
    let slots: Vec<u32> = (0..n as u32).collect();
    lm.model().forward(
        &mut kv,
        &[ForwardSeq {
            tokens: &prompt[..n],
            positions: &slots,
            context: &[],
            new_slots: &slots,
            logits: LogitsFor::None,
            shifts: &[],
        }],
    )?;
    let mut keys = vec![0f32; g.layers * n * g.k_width()];
    for (layer, out) in keys.chunks_exact_mut(n * g.k_width()).enumerate() {
        kv.gather_k(layer, &slots, out)?;
    }
    Ok(keys)
}

/// Drift of the model's cached key rows: for MLA those are `k_pe` alone (one rotary head),
/// for llama-family models every KV head; [`chained_shift_drift`] counts the rotary dims of
/// each head as the model's [`leyline_kernels::rope::RopeSpec`] gives them.
fn drift(lm: &AnyModel, prompt: &[u32], a: &VerifyArgs) -> Result<Vec<Drift>> {
    let info = lm.model().info();
    let g = info.geometry;
    let keys = model_keys(lm, prompt, a.drift_tokens)?;
    let cases = [
        (KvDtype::F32, RotationMath::F32),
        (KvDtype::F16, RotationMath::F32),
        (KvDtype::Bf16, RotationMath::F32),
        (KvDtype::Bf16, RotationMath::Storage),
    ];
    let mut out = Vec::new();
    for &n in &a.drift_splices {
        let mut deltas = splice_deltas(n, 0x5EED, a.drift_max_delta);
        if a.rotation.rotation == leyline_kv::shift::RotationMode::Lazy {
            // Lazy splices leave the keys alone; a compaction rotates them once by what the
            // splices since the last one added up to. Each of these splices adds one run, so
            // a compaction follows every `max_segments - 1` of them (0: never).
            let every = a.rotation.max_segments.saturating_sub(1);
            deltas = if every == 0 {
                Vec::new()
            } else {
                deltas.chunks_exact(every).map(|c| c.iter().sum()).collect()
            };
        }
        for (storage, math) in cases {
            let rel_l2 = chained_shift_drift(
                &keys,
                g.k_heads,
                g.k_head_dim,
                // The drift of the first layer's spec (every layer's, for a one-spec model).
                info.rope.spec(0),
                &deltas,
                storage,
                math,
            )?;
            let rotation = match math {
                RotationMath::F32 => "f32",
                RotationMath::Storage => storage.name(),
            };
            out.push(Drift {
                splices: n,
                storage,
                rotation,
                rewrites: deltas.len(),
                rel_l2,
            });
        }
    }
    Ok(out)
}

fn count(o: &[ProbeOutcome], f: impl Fn(&ProbeOutcome) -> bool) -> usize {
    o.iter().filter(|x| f(x)).count()
}

/// Median prompt tokens and median downstream tokens of the probes (0 for none).
fn medians(o: &[ProbeOutcome]) -> (usize, usize) {
    let m =
        |f: fn(&ProbeOutcome) -> usize| median(&o.iter().map(f).collect::<Vec<_>>()).unwrap_or(0);
    (m(|p| p.tokens), m(|p| p.downstream))
}

fn print_json(
    a: &VerifyArgs,
    lm: &AnyModel,
    source: &Source,
    (o, rows): (&[ProbeOutcome], &[RepairRow]),
    drift: &[Drift],
    (probe_secs, drift_secs): (f64, f64),
    prefilled: u64,
) {
    let per_probe: Vec<serde_json::Value> = o
        .iter()
        .map(|p| {
            serde_json::json!({
                "label": p.label,
                "tokens": p.tokens,
                "removed": p.removed,
                "stub": p.stub,
                "downstream": p.downstream,
                "full_token": p.full.0,
                "full_margin": p.full.1,
                "amortize_token": p.amortize.0,
                "amortize_margin": p.amortize.1,
                "forget_token": p.forget.0,
                "forget_margin": p.forget.1,
                "agree_full": p.agree_full(),
                "agree_forget": p.agree_forget(),
                "forget_agree_full": p.forget_agree_full(),
                "amortize_gap_in_full": p.amortize_gap_in_full,
                "amortize_forget_max_abs_diff": p.amortize_forget_max_diff,
                "rotated": p.amortize_report.rotated,
                "copied": p.amortize_report.copied,
                "prefilled": p.amortize_report.prefilled,
                "moved": p.amortize_report.moved,
                "kl_forget": p.kl_forget,
                "repairs": p.repairs.iter().map(|r| serde_json::json!({
                    "repair": r.repair.tokens,
                    "rule": r.repair.rule.name(),
                    "token": r.token.0,
                    "margin": r.token.1,
                    "kl_forget": r.kl_forget,
                    "repaired": r.repaired,
                    "scanned": r.scanned,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let drift: Vec<serde_json::Value> = drift
        .iter()
        .map(|d| {
            serde_json::json!({
                "splices": d.splices,
                "storage": d.storage.name(),
                "rotation": d.rotation,
                "rewrites": d.rewrites,
                "rel_l2": d.rel_l2,
            })
        })
        .collect();
    let bands: Vec<serde_json::Value> = by_reference_margin(o, &MARGIN_BANDS)
        .iter()
        .map(|b| {
            serde_json::json!({
                "full_margin_from": b.lo,
                "full_margin_below": if b.hi.is_finite() { Some(b.hi) } else { None },
                "probes": b.probes,
                "agree_full": b.agree_full,
                "forget_agree_full": b.forget_agree_full,
            })
        })
        .collect();
    let info = lm.model().info();
    let (traces, seed) = match source {
        Source::Traces(p) => (Some(p.display().to_string()), None),
        Source::Synthetic { seed } => (None, Some(*seed)),
    };
    println!(
        "{}",
        serde_json::json!({
            "model": info.name,
            "arch": info.arch,
            "kv_dtype": a.model.kv_dtype.name(),
            "probe_source": source.name(),
            "moves": a.moves,
            "reuse_min_tokens": a.rotation.reuse_min_tokens,
            "traces": traces,
            "synthetic_seed": seed,
            "max_tokens_per_probe": a.max_tokens_per_probe,
            "probe_token_budget": probe_budget(a, info),
            "probes": o.len(),
            "agree_full": count(o, ProbeOutcome::agree_full),
            "agree_forget": count(o, ProbeOutcome::agree_forget),
            "forget_agree_full": count(o, ProbeOutcome::forget_agree_full),
            "by_full_margin": bands,
            "median_tokens": medians(o).0,
            "median_downstream": medians(o).1,
            "drift_tokens": a.drift_tokens,
            "drift_max_delta": a.drift_max_delta,
            "drift_key_width": info.geometry.k_width(),
            "drift_rotary_dim": info.rope.spec(0).rotary_dim,
            "drift": drift,
            "repair": rows.iter().map(|r| serde_json::json!({
                "repair": r.repair.tokens,
                "rule": r.repair.rule.name(),
                "recomputed_share": r.recomputed_share,
                "agree_full": r.agree_full,
                "agree_forget": r.agree_forget,
                "kl_forget_mean": r.kl_forget_mean,
                "forget_margin_probes": r.forget_margin_probes,
                "agree_forget_margin": r.agree_forget_margin,
            })).collect::<Vec<_>>(),
            "per_probe": per_probe,
            "prefilled_tokens": prefilled,
            "probe_seconds": probe_secs,
            "drift_seconds": drift_secs,
        })
    );
}

fn token_text(lm: &AnyModel, t: u32) -> String {
    match lm.tokenizer().and_then(|tok| tok.decode(&[t], false).ok()) {
        Some(s) => format!("{s:?}").replace('|', "\\|"),
        None => format!("#{t}"),
    }
}

fn print_tables(
    a: &VerifyArgs,
    lm: &AnyModel,
    source: &Source,
    (o, rows): (&[ProbeOutcome], &[RepairRow]),
    drift: &[Drift],
    probe_secs: f64,
) {
    let n = o.len();
    println!(
        "## Fidelity: {} (kv {}), {n} probes from {} in {probe_secs:.0} s\n",
        lm.model().info().name,
        a.model.kv_dtype,
        source.describe()
    );
    println!("| probes | AMORTIZE = full context | AMORTIZE = FORGET | FORGET = full context | median tokens | median downstream |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {n} | {}/{n} | {}/{n} | {}/{n} | {} | {} |\n",
        count(o, ProbeOutcome::agree_full),
        count(o, ProbeOutcome::agree_forget),
        count(o, ProbeOutcome::forget_agree_full),
        medians(o).0,
        medians(o).1,
    );
    println!("By the reference's margin (top1 - top2 logit of the unedited context; a near-tie flips on any change of context):\n");
    println!("| reference margin | probes | AMORTIZE = full context | FORGET = full context |");
    println!("|---|---|---|---|");
    for b in by_reference_margin(o, &MARGIN_BANDS) {
        let band = if b.hi.is_finite() {
            format!("{:.2} - {:.2}", b.lo, b.hi)
        } else {
            format!(">= {:.2}", b.lo)
        };
        println!(
            "| {band} | {} | {}/{} | {}/{} |",
            b.probes, b.agree_full, b.probes, b.forget_agree_full, b.probes
        );
    }
    println!();
    if !rows.is_empty() {
        println!("AMORTIZE with repair (recomputed share: recomputed downstream tokens over FORGET's, replacements excluded; decided: FORGET margin >= {FORGET_MARGIN}):\n");
        println!("| repair | rule | recomputed share | = full context | = FORGET | = FORGET where decided | mean KL(FORGET \\|\\| AMORTIZE) |");
        println!("|---|---|---|---|---|---|---|");
        for r in rows {
            println!(
                "| {} | {} | {:.3} | {}/{n} | {}/{n} | {}/{} | {:.4} |",
                r.repair.tokens,
                if r.repair.is_none() {
                    "-"
                } else {
                    r.repair.rule.name()
                },
                r.recomputed_share,
                r.agree_full,
                r.agree_forget,
                r.agree_forget_margin,
                r.forget_margin_probes,
                r.kl_forget_mean,
            );
        }
        println!();
    }
    // Disagreements first, then the nearest ties of the reference.
    let mut rows: Vec<&ProbeOutcome> = o.iter().collect();
    rows.sort_by(|x, y| {
        let key = |p: &ProbeOutcome| (p.agree_full() && p.agree_forget(), p.full.1);
        let (kx, ky) = (key(x), key(y));
        kx.0.cmp(&ky.0).then(kx.1.total_cmp(&ky.1))
    });
    if a.show > 0 {
        println!(
            "Disagreements, then the smallest reference margins (margin = top1 - top2 logit):\n"
        );
        println!("| probe | tokens | removed -> stub | downstream | full (margin) | AMORTIZE (margin) | FORGET (margin) | AMORTIZE's gap in full | max abs logit diff A-F |");
        println!("|---|---|---|---|---|---|---|---|---|");
        for p in rows.iter().take(a.show) {
            println!(
                "| {} | {} | {} -> {} | {} | {} ({:.2}) | {} ({:.2}) | {} ({:.2}) | {:.2} | {:.3} |",
                p.label,
                p.tokens,
                p.removed,
                p.stub,
                p.downstream,
                token_text(lm, p.full.0),
                p.full.1,
                token_text(lm, p.amortize.0),
                p.amortize.1,
                token_text(lm, p.forget.0),
                p.forget.1,
                p.amortize_gap_in_full,
                p.amortize_forget_max_diff,
            );
        }
    }
    let info = lm.model().info();
    println!(
        "\nKey drift after n chained splices ({} tokens x every layer, key rows of {} with {} rotary dims per head of {}, |delta| <= {}), rel-L2 over the rotary dims against one f64 rotation of the f32 keys by the total:\n",
        a.drift_tokens,
        info.geometry.k_width(),
        info.rope.spec(0).rotary_dim,
        info.geometry.k_head_dim,
        a.drift_max_delta
    );
    println!(
        "{} rotation{}\n",
        a.rotation.rotation,
        match a.rotation.rotation {
            leyline_kv::shift::RotationMode::Eager =>
                ": every splice rewrites the keys".to_string(),
            leyline_kv::shift::RotationMode::Lazy if a.rotation.max_segments == 0 =>
                ", compaction off: the keys are never rewritten".to_string(),
            leyline_kv::shift::RotationMode::Lazy => format!(
                ": only compactions rewrite the keys (one per {} single-edit splices at \
                 --max-segments {})",
                a.rotation.max_segments.saturating_sub(1),
                a.rotation.max_segments
            ),
        }
    );
    println!("| splices | key rewrites | storage | rotation math | rel-L2 |");
    println!("|---|---|---|---|---|");
    for d in drift {
        println!(
            "| {} | {} | {} | {} | {:.3e} |",
            d.splices, d.rewrites, d.storage, d.rotation, d.rel_l2
        );
    }
}
