//! Summaries of replay runs: per (arm, concurrency) totals and latency percentiles, and the
//! Markdown table.

use super::drive::{Arm, RequestRecord, RunOutcome};
use crate::eval::stats::percentile;
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// One row of `replay.json`'s `summary`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    /// The arm.
    pub arm: Arm,
    /// Sessions in flight.
    pub concurrency: usize,
    /// Requests.
    pub requests: usize,
    /// Of which edit turns.
    pub edit_requests: usize,
    /// Prompt tokens, all requests.
    pub prompt_tokens: usize,
    /// Of which reused.
    pub cached_tokens: usize,
    /// Of which computed.
    pub prefilled_tokens: usize,
    /// Tokens no cache could have held (the turns' [`super::prepare::PreparedTurn::fresh_tokens`]).
    #[serde(default)]
    pub fresh_tokens: usize,
    /// `prefilled_tokens / fresh_tokens`: how far the arm is from the least work possible.
    #[serde(default)]
    pub amplification: f64,
    /// Downstream tokens recomputed by repairs (the `repair` arm).
    #[serde(default)]
    pub repaired_tokens: usize,
    /// `cached_tokens / prompt_tokens`.
    pub cache_hit_rate: f64,
    /// Cache-hit rate of edit turns.
    pub cache_hit_rate_edit_turns: f64,
    /// Cache-hit rate of plain turns.
    pub cache_hit_rate_plain_turns: f64,
    /// Keys rotated by AMORTIZE edits.
    pub rotated_tokens: usize,
    /// AMORTIZE replacement tokens prefilled but not reused.
    pub edit_wasted_tokens: usize,
    /// Slots the engine evicted from its prefix cache.
    pub evicted_slots: u64,
    /// TTFT p50, ms.
    pub ttft_p50_ms: f64,
    /// TTFT p95, ms.
    pub ttft_p95_ms: f64,
    /// End-to-end p50, ms.
    pub e2e_p50_ms: f64,
    /// End-to-end p95, ms.
    pub e2e_p95_ms: f64,
    /// TTFT p50 of edit turns, ms.
    pub ttft_p50_ms_edit_turns: f64,
    /// End-to-end p50 of edit turns, ms.
    pub e2e_p50_ms_edit_turns: f64,
    /// End-to-end p95 of edit turns, ms.
    pub e2e_p95_ms_edit_turns: f64,
    /// End-to-end p50 of plain turns, ms.
    pub e2e_p50_ms_plain_turns: f64,
    /// Wall time of the run, s.
    pub wall_s: f64,
    /// Prompt tokens per second of wall time (served, cached or not).
    pub prompt_tokens_per_s: f64,
    /// Requests per second of wall time.
    pub requests_per_s: f64,
}

fn rate(records: &[&RequestRecord]) -> f64 {
    let prompt: usize = records.iter().map(|r| r.prompt_tokens).sum();
    let cached: usize = records.iter().map(|r| r.cached_tokens).sum();
    if prompt == 0 {
        f64::NAN
    } else {
        cached as f64 / prompt as f64
    }
}

/// Totals and percentiles of one run.
pub fn summarize(arm: Arm, concurrency: usize, run: &RunOutcome) -> Summary {
    let all: Vec<&RequestRecord> = run.records.iter().collect();
    let edit: Vec<&RequestRecord> = all.iter().copied().filter(|r| r.edit_turn).collect();
    let plain: Vec<&RequestRecord> = all.iter().copied().filter(|r| !r.edit_turn).collect();
    let col = |rs: &[&RequestRecord], f: fn(&RequestRecord) -> f64| -> Vec<f64> {
        rs.iter().map(|r| f(r)).collect()
    };
    let ttft = |rs: &[&RequestRecord]| col(rs, |r| r.ttft_ms);
    let e2e = |rs: &[&RequestRecord]| col(rs, |r| r.e2e_ms);
    let sum = |f: fn(&RequestRecord) -> usize| all.iter().map(|r| f(r)).sum::<usize>();
    let prompt_tokens = sum(|r| r.prompt_tokens);
    let prefilled_tokens = sum(|r| r.prefilled_tokens);
    let fresh_tokens = sum(|r| r.fresh_tokens);
    let wall_s = run.wall.as_secs_f64();
    Summary {
        arm,
        concurrency,
        requests: all.len(),
        edit_requests: edit.len(),
        prompt_tokens,
        cached_tokens: sum(|r| r.cached_tokens),
        prefilled_tokens,
        fresh_tokens,
        amplification: prefilled_tokens as f64 / fresh_tokens as f64,
        repaired_tokens: sum(|r| r.repaired_tokens),
        cache_hit_rate: rate(&all),
        cache_hit_rate_edit_turns: rate(&edit),
        cache_hit_rate_plain_turns: rate(&plain),
        rotated_tokens: sum(|r| r.rotated_tokens),
        edit_wasted_tokens: sum(|r| r.edit_wasted_tokens),
        evicted_slots: run.metrics.evicted_slots,
        ttft_p50_ms: percentile(&ttft(&all), 0.5),
        ttft_p95_ms: percentile(&ttft(&all), 0.95),
        e2e_p50_ms: percentile(&e2e(&all), 0.5),
        e2e_p95_ms: percentile(&e2e(&all), 0.95),
        ttft_p50_ms_edit_turns: percentile(&ttft(&edit), 0.5),
        e2e_p50_ms_edit_turns: percentile(&e2e(&edit), 0.5),
        e2e_p95_ms_edit_turns: percentile(&e2e(&edit), 0.95),
        e2e_p50_ms_plain_turns: percentile(&e2e(&plain), 0.5),
        wall_s,
        prompt_tokens_per_s: prompt_tokens as f64 / wall_s,
        requests_per_s: all.len() as f64 / wall_s,
    }
}

fn pct(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{:.1}%", 100.0 * x)
    }
}

fn msf(x: f64) -> String {
    if x.is_nan() {
        "-".into()
    } else {
        format!("{x:.0}")
    }
}

/// The Markdown table: one row per (arm, concurrency), edit and plain turns apart.
pub fn markdown(rows: &[Summary]) -> String {
    let mut s = String::from(
        "| arm | C | requests (edit) | prompt tok | cached tok | prefilled tok | amplification | hit rate | hit rate edit / plain turns | TTFT p50 / p95 ms | E2E p50 / p95 ms | E2E p50 edit / plain turns ms | TTFT p50 edit turns ms | rotated tok | repaired tok | wall s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {} | {} ({}) | {} | {} | {} | {:.3}x | {} | {} / {} | {} / {} | {} / {} | {} / {} | {} | {} | {} | {:.1} |",
            r.arm,
            r.concurrency,
            r.requests,
            r.edit_requests,
            r.prompt_tokens,
            r.cached_tokens,
            r.prefilled_tokens,
            r.amplification,
            pct(r.cache_hit_rate),
            pct(r.cache_hit_rate_edit_turns),
            pct(r.cache_hit_rate_plain_turns),
            msf(r.ttft_p50_ms),
            msf(r.ttft_p95_ms),
            msf(r.e2e_p50_ms),
            msf(r.e2e_p95_ms),
            msf(r.e2e_p50_ms_edit_turns),
            msf(r.e2e_p50_ms_plain_turns),
            msf(r.ttft_p50_ms_edit_turns),
            r.rotated_tokens,
            r.repaired_tokens,
            r.wall_s,
        );
    }
    s
}

/// Against the targets, per concurrency: amortize's hit rate minus baseline's (pp) and
/// amortize's edit-turn E2E p50 over baseline's.
pub fn targets(rows: &[Summary]) -> String {
    let mut s = String::from(
        "| C | hit rate amortize - baseline (target >= +30 pp) | edit-turn E2E p50 amortize / baseline (target <= 0.5) | forget / baseline |\n|---|---|---|---|\n",
    );
    let find = |arm: Arm, c: usize| rows.iter().find(|r| r.arm == arm && r.concurrency == c);
    let mut cs: Vec<usize> = rows.iter().map(|r| r.concurrency).collect();
    cs.sort_unstable();
    cs.dedup();
    for c in cs {
        let (Some(b), Some(a)) = (find(Arm::Baseline, c), find(Arm::Amortize, c)) else {
            continue;
        };
        let f = find(Arm::Forget, c).map_or("-".to_string(), |f| {
            format!("{:.2}", f.e2e_p50_ms_edit_turns / b.e2e_p50_ms_edit_turns)
        });
        let _ = writeln!(
            s,
            "| {c} | {:+.1} pp | {:.2} | {f} |",
            100.0 * (a.cache_hit_rate - b.cache_hit_rate),
            a.e2e_p50_ms_edit_turns / b.e2e_p50_ms_edit_turns,
        );
    }
    s
}
