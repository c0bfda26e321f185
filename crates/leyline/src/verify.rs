//! `leyline verify`: the fidelity report of DESIGN.md §8 — first-token agreement of
//! AMORTIZE with the unedited full context and with FORGET over probes from recorded
//! trajectories, and the key drift of chained splices per storage dtype and rotation math.

use crate::{load_model, ModelArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use leyline_engine::fidelity::{
    build_probes, chained_shift_drift, run_probe, splice_deltas, ProbeOptions, ProbeOutcome,
    RotationMath, PROBE_STUB,
};
use leyline_engine::{ChatRenderer, Engine, EngineConfig};
use leyline_kv::{KvDtype, KvStorage};
use leyline_model::{ForwardSeq, LoadedModel, LogitsFor};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Options of `leyline verify`.
#[derive(Args)]
pub struct VerifyArgs {
    /// Number of probes (assistant turns with an older tool output to evict).
    #[arg(long, default_value_t = 50)]
    pub probes: usize,
    /// Longest probe prompt, in tokens.
    #[arg(long, default_value_t = 3072)]
    pub max_tokens_per_probe: usize,
    /// Trajectory file (JSONL); default: shared/data/traces/tau-bench.jsonl found from the
    /// current directory upward.
    #[arg(long, env = "LEYLINE_TRACES")]
    pub traces: Option<PathBuf>,
    /// Chain lengths of the drift measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    pub drift_splices: Vec<usize>,
    /// Tokens of the first probe whose keys (every layer) the drift measurement moves.
    #[arg(long, default_value_t = 256)]
    pub drift_tokens: usize,
    /// Largest |delta| of one drift splice (deltas are random in ±[1, this]).
    #[arg(long, default_value_t = 512)]
    pub drift_max_delta: u64,
    /// Rows of the per-probe table (disagreements first, then the nearest ties).
    #[arg(long, default_value_t = 12)]
    pub show: usize,
    /// Worker threads (sets RAYON_NUM_THREADS before the pool starts).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// One drift figure.
struct Drift {
    splices: usize,
    storage: KvDtype,
    rotation: &'static str,
    rel_l2: f64,
}

/// Runs `leyline verify`.
pub fn run(a: VerifyArgs) -> Result<()> {
    if a.probes == 0 {
        bail!("--probes must be at least 1");
    }
    std::env::set_var("RAYON_NUM_THREADS", a.threads.to_string());
    let traces_path = match &a.traces {
        Some(p) => p.clone(),
        None => find_traces()?,
    };
    let trajectories = leyline_policy::load_traces(&traces_path)
        .with_context(|| format!("reading {}", traces_path.display()))?;
    let lm = load_model(&a.model)?;
    let template = lm
        .chat
        .as_ref()
        .with_context(|| format!("{} has no chat template", lm.path.display()))?;
    let info = lm.model.info().clone();
    let max_tokens = a
        .max_tokens_per_probe
        .min(info.context_length.saturating_sub(2));
    let renderer = ChatRenderer::new(&lm.tokenizer, template, true);
    let opts = ProbeOptions {
        max_probes: a.probes,
        max_tokens,
        stub: PROBE_STUB.to_string(),
    };
    let probes = build_probes(&trajectories, &renderer, &opts)?;
    if probes.is_empty() {
        bail!(
            "no probe in {} fits {max_tokens} tokens with an older tool output to evict",
            traces_path.display()
        );
    }
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
        ..EngineConfig::new(slots)
    };
    let mut engine = Engine::new(Arc::clone(&lm.model), cfg)?;
    let bar = ProgressBar::new(probes.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("probes [{bar:30}] {pos}/{len} {elapsed} (eta {eta})")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let mut outcomes = Vec::with_capacity(probes.len());
    for p in &probes {
        let o = run_probe(&mut engine, p).with_context(|| format!("probe {}", p.label))?;
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

    if a.json {
        print_json(
            &a,
            &lm,
            &traces_path,
            &outcomes,
            &drift,
            (probe_secs, drift_secs),
            prefilled,
        );
    } else {
        print_tables(&a, &lm, &traces_path, &outcomes, &drift, probe_secs);
    }
    Ok(())
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
    bail!("no shared/data/traces/tau-bench.jsonl above the current directory; pass --traces")
}

/// Real keys: `drift_tokens` tokens of `prompt` prefilled at positions 0.. into f32 storage,
/// every layer's key rows.
fn model_keys(lm: &LoadedModel, prompt: &[u32], n: usize) -> Result<Vec<f32>> {
    let n = n.min(prompt.len()).max(1);
    let g = lm.model.info().geometry;
    let mut kv = KvStorage::new(g, KvDtype::F32, n)?;
    let slots: Vec<u32> = (0..n as u32).collect();
    lm.model.forward(
        &mut kv,
        &[ForwardSeq {
            tokens: &prompt[..n],
            positions: &slots,
            context: &[],
            new_slots: &slots,
            logits: LogitsFor::None,
        }],
    )?;
    let mut keys = vec![0f32; g.layers * n * g.k_width()];
    for (layer, out) in keys.chunks_exact_mut(n * g.k_width()).enumerate() {
        kv.gather_k(layer, &slots, out)?;
    }
    Ok(keys)
}

fn drift(lm: &LoadedModel, prompt: &[u32], a: &VerifyArgs) -> Result<Vec<Drift>> {
    let info = lm.model.info();
    let g = info.geometry;
    let keys = model_keys(lm, prompt, a.drift_tokens)?;
    let cases = [
        (KvDtype::F32, RotationMath::F32),
        (KvDtype::Bf16, RotationMath::F32),
        (KvDtype::Bf16, RotationMath::Storage),
    ];
    let mut out = Vec::new();
    for &n in &a.drift_splices {
        let deltas = splice_deltas(n, 0x5EED, a.drift_max_delta);
        for (storage, math) in cases {
            let rel_l2 = chained_shift_drift(
                &keys,
                g.k_heads,
                g.k_head_dim,
                &info.rope,
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
                rel_l2,
            });
        }
    }
    Ok(out)
}

fn count(o: &[ProbeOutcome], f: impl Fn(&ProbeOutcome) -> bool) -> usize {
    o.iter().filter(|x| f(x)).count()
}

fn median(mut v: Vec<usize>) -> usize {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn print_json(
    a: &VerifyArgs,
    lm: &LoadedModel,
    traces: &Path,
    o: &[ProbeOutcome],
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
                "rel_l2": d.rel_l2,
            })
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({
            "model": lm.model.info().name,
            "kv_dtype": a.model.kv_dtype.name(),
            "traces": traces.display().to_string(),
            "max_tokens_per_probe": a.max_tokens_per_probe,
            "probes": o.len(),
            "agree_full": count(o, ProbeOutcome::agree_full),
            "agree_forget": count(o, ProbeOutcome::agree_forget),
            "forget_agree_full": count(o, ProbeOutcome::forget_agree_full),
            "median_tokens": median(o.iter().map(|p| p.tokens).collect()),
            "median_downstream": median(o.iter().map(|p| p.downstream).collect()),
            "drift_tokens": a.drift_tokens,
            "drift_max_delta": a.drift_max_delta,
            "drift": drift,
            "per_probe": per_probe,
            "prefilled_tokens": prefilled,
            "probe_seconds": probe_secs,
            "drift_seconds": drift_secs,
        })
    );
}

fn token_text(lm: &LoadedModel, t: u32) -> String {
    let s = lm
        .tokenizer
        .decode(&[t], false)
        .unwrap_or_else(|_| format!("#{t}"));
    format!("{s:?}").replace('|', "\\|")
}

fn print_tables(
    a: &VerifyArgs,
    lm: &LoadedModel,
    traces: &Path,
    o: &[ProbeOutcome],
    drift: &[Drift],
    probe_secs: f64,
) {
    let n = o.len();
    println!(
        "## Fidelity: {} (kv {}), {n} probes from {} in {probe_secs:.0} s\n",
        lm.model.info().name,
        a.model.kv_dtype,
        traces.display()
    );
    println!("| probes | AMORTIZE = full context | AMORTIZE = FORGET | FORGET = full context | median tokens | median downstream |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {n} | {}/{n} | {}/{n} | {}/{n} | {} | {} |\n",
        count(o, ProbeOutcome::agree_full),
        count(o, ProbeOutcome::agree_forget),
        count(o, ProbeOutcome::forget_agree_full),
        median(o.iter().map(|p| p.tokens).collect()),
        median(o.iter().map(|p| p.downstream).collect()),
    );
    // Disagreements first, then the nearest ties of the reference.
    let mut rows: Vec<&ProbeOutcome> = o.iter().collect();
    rows.sort_by(|x, y| {
        let key = |p: &ProbeOutcome| (p.agree_full() && p.agree_forget(), p.full.1);
        let (kx, ky) = (key(x), key(y));
        kx.0.cmp(&ky.0).then(kx.1.total_cmp(&ky.1))
    });
    println!("Disagreements, then the smallest reference margins (margin = top1 - top2 logit):\n");
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
    println!(
        "\nKey drift after n chained splices ({} tokens x every layer, |delta| <= {}), rel-L2 against one f64 rotation of the f32 keys by the total:\n",
        a.drift_tokens, a.drift_max_delta
    );
    println!("| splices | storage | rotation math | rel-L2 |");
    println!("|---|---|---|---|");
    for d in drift {
        println!(
            "| {} | {} | {} | {:.3e} |",
            d.splices, d.storage, d.rotation, d.rel_l2
        );
    }
}
