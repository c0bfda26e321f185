//! Fidelity measurements (DESIGN.md §8), shared by `leyline verify` and `leyline bench splice`.
//!
//! - Probes: a prompt rendered from a recorded trajectory and one edit that replaces an old
//!   tool output by a stub ([`build_probes`]), or, for a model without tokenizer or chat
//!   template, a seeded random token sequence with a random span in its older part replaced
//!   by a short random stub ([`synthetic_probes`]). [`run_probe`] compares the next-token
//!   argmax of AMORTIZE with the unedited full-context reference and with FORGET (an exact
//!   re-prefill of the edit).
//! - Drift: [`chained_shift_drift`] moves real keys through `n` chained shifts in a storage
//!   dtype and measures, over the rotary dims, their rel-L2 distance from one f64 rotation by
//!   the total delta.
//!
//! Design decision: a probe's last prompt token is kept out of the session and scored with
//! [`Engine::peek_logits`] after the edit, so every arm's logits come from a forward pass
//! that attends to the edited cache.

use leyline_core::{Directive, Mode, Repair};
use leyline_engine::{
    EditReport, Engine, EngineError, Event, Request, Result, SessionEdits, SessionId,
    SessionRequest,
};
use leyline_kernels::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use leyline_kernels::rope::{RopeSpec, RotaryLayout};
use leyline_kernels::rotate::{shift_rows, shift_rows_lowprec};
use leyline_kernels::rows::RowsMut;
use leyline_kv::{KvDtype, KvError};
use leyline_policy::{apply_edits, diff_rendered, Edit, Renderer, Role, Trajectory};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

/// What an evicted tool output becomes in a probe.
pub const PROBE_STUB: &str = "[evicted: older tool output]";

/// One probe: a rendered prompt and the edits of one change to an older tool output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// `trajectory id#turn`.
    pub label: String,
    /// The unedited prompt, generation prompt included.
    pub prompt: Vec<u32>,
    /// The edits (pre-edit indices into `prompt`, sorted, disjoint): one for a stub, a
    /// deletion and an insertion for a move; all end before the last prompt token.
    pub edits: Vec<Edit>,
}

/// How probes are picked.
#[derive(Debug, Clone)]
pub struct ProbeOptions {
    /// Most probes.
    pub max_probes: usize,
    /// Longest rendered prompt, in tokens.
    pub max_tokens: usize,
    /// The stub text.
    pub stub: String,
    /// Move the oldest tool output to just before the turn's last message instead of
    /// replacing it by the stub (a client that reorders what it keeps).
    pub moves: bool,
}

/// Probes from `trajectories`: assistant turns whose history holds at least two tool outputs
/// (so one older than the latest can go) and whose rendered prompt fits `max_tokens`. The
/// oldest tool output is replaced by the stub. Round-robin over trajectories, latest fitting
/// turn first, so the set spreads over many conversations.
///
/// # Errors
/// Rendering or diff errors of the policy crate.
pub fn build_probes(
    trajectories: &[Trajectory],
    renderer: &dyn Renderer,
    opts: &ProbeOptions,
) -> leyline_policy::Result<Vec<Probe>> {
    // Per trajectory: candidate turns (assistant message indices), latest first.
    let mut queues: Vec<(usize, Vec<usize>)> = trajectories
        .iter()
        .enumerate()
        .map(|(t, traj)| {
            let m = &traj.messages;
            let mut turns: Vec<usize> = (0..m.len())
                .filter(|&i| m[i].role == Role::Assistant)
                .filter(|&i| m[..i].iter().filter(|x| x.role == Role::Tool).count() >= 2)
                // Cheap bound before rendering: no tokenizer packs more than ~8 chars a token.
                .filter(|&i| {
                    m[..i].iter().map(|x| x.content.len()).sum::<usize>() / 8 <= opts.max_tokens
                })
                .collect();
            turns.reverse();
            (t, turns)
        })
        .collect();
    let mut probes = Vec::new();
    while probes.len() < opts.max_probes && queues.iter().any(|(_, q)| !q.is_empty()) {
        for (t, queue) in &mut queues {
            if probes.len() >= opts.max_probes {
                break;
            }
            // Take this trajectory's next turn that fits.
            while !queue.is_empty() {
                let i = queue.remove(0);
                if let Some(p) = probe_at(&trajectories[*t], i, renderer, opts)? {
                    probes.push(p);
                    break;
                }
            }
        }
    }
    Ok(probes)
}

fn probe_at(
    traj: &Trajectory,
    i: usize,
    renderer: &dyn Renderer,
    opts: &ProbeOptions,
) -> leyline_policy::Result<Option<Probe>> {
    let history = &traj.messages[..i];
    let Some(oldest) = history.iter().position(|m| m.role == Role::Tool) else {
        return Ok(None);
    };
    let old = renderer.render_tokens(history)?;
    if old.tokens.len() > opts.max_tokens || old.tokens.len() < 2 {
        return Ok(None);
    }
    let mut edited = history.to_vec();
    if opts.moves {
        // Something must lie between it and the last message for the move to move it.
        if oldest + 2 >= edited.len() {
            return Ok(None);
        }
        let tool = edited.remove(oldest);
        let last = edited.len() - 1;
        edited.insert(last, tool);
    } else {
        if edited[oldest].content == opts.stub {
            return Ok(None);
        }
        edited[oldest].content.clone_from(&opts.stub);
    }
    let new = match renderer.render_tokens(&edited) {
        Ok(new) => new,
        // A template that renders a tool output with its neighbours (Qwen's joins
        // consecutive ones) may not render the moved history message by message.
        Err(_) if opts.moves => return Ok(None),
        Err(e) => return Err(e),
    };
    let edits = diff_rendered(&old, &new)?;
    let fits = edits.last().is_some_and(|e| e.end < old.tokens.len() - 1);
    if !fits || (!opts.moves && edits.len() != 1) {
        return Ok(None);
    }
    let turn = traj.messages[..i]
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .count();
    Ok(Some(Probe {
        label: format!("{}#{turn}", traj.id),
        prompt: old.tokens,
        edits,
    }))
}

/// Shortest prompt budget [`synthetic_probes`] accepts.
pub const SYNTHETIC_MIN_TOKENS: usize = 32;

/// How synthetic probes are drawn.
#[derive(Debug, Clone)]
pub struct SyntheticOptions {
    /// Number of probes.
    pub probes: usize,
    /// Token ids are drawn uniformly from `0..vocab_size`.
    pub vocab_size: usize,
    /// Longest prompt, in tokens (at least [`SYNTHETIC_MIN_TOKENS`]).
    pub max_tokens: usize,
    /// Seed of the generator; the same options give the same probes.
    pub seed: u64,
}

/// Uniform in `lo..=hi`; `lo` when `hi <= lo`.
fn range(rng: &mut StdRng, lo: usize, hi: usize) -> usize {
    if hi <= lo {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

/// Probes for a model without tokenizer or chat template: seeded random token ids in
/// `0..vocab_size`. Each prompt has `max_tokens / 2 ..= max_tokens` tokens; its "tool output"
/// is a span of `len / 8 ..= len / 4` tokens starting in `len / 16 ..= len / 8` (so it lies
/// in the older part, before `3 * len / 8`), replaced by a stub of 1 to 8 random tokens that
/// is shorter than the span (an eviction: every later token moves left). Labels are
/// `synthetic#i`.
///
/// # Errors
/// [`EngineError::InvalidRequest`] for `max_tokens` below [`SYNTHETIC_MIN_TOKENS`] or a
/// vocabulary of fewer than 2 ids.
pub fn synthetic_probes(opts: &SyntheticOptions) -> Result<Vec<Probe>> {
    if opts.max_tokens < SYNTHETIC_MIN_TOKENS {
        return Err(EngineError::InvalidRequest(format!(
            "synthetic probes need at least {SYNTHETIC_MIN_TOKENS} tokens, the budget is {}",
            opts.max_tokens
        )));
    }
    if opts.vocab_size < 2 || opts.vocab_size > u32::MAX as usize {
        return Err(EngineError::InvalidRequest(format!(
            "vocabulary of {} ids",
            opts.vocab_size
        )));
    }
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let vocab = opts.vocab_size as u32;
    let ids = |rng: &mut StdRng, n: usize| -> Vec<u32> {
        (0..n).map(|_| rng.random_range(0..vocab)).collect()
    };
    Ok((0..opts.probes)
        .map(|i| {
            let len = range(&mut rng, opts.max_tokens.div_ceil(2), opts.max_tokens);
            let prompt = ids(&mut rng, len);
            let start = range(&mut rng, (len / 16).max(1), len / 8);
            let removed = range(&mut rng, (len / 8).max(2), len / 4);
            let stub = range(&mut rng, 1, 8.min(removed - 1));
            Probe {
                label: format!("synthetic#{i}"),
                prompt,
                edits: vec![Edit {
                    start,
                    end: start + removed,
                    replacement: ids(&mut rng, stub),
                }],
            }
        })
        .collect())
}

/// Index of the largest logit and its lead over the second largest (0 for fewer than two).
pub fn top_margin(logits: &[f32]) -> (u32, f32) {
    let (mut best, mut second) = ((0usize, f32::NEG_INFINITY), f32::NEG_INFINITY);
    for (i, &x) in logits.iter().enumerate() {
        if x > best.1 {
            second = best.1;
            best = (i, x);
        } else if x > second {
            second = x;
        }
    }
    let margin = if second.is_finite() {
        best.1 - second
    } else {
        0.0
    };
    (best.0 as u32, margin)
}

/// What one probe gave.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeOutcome {
    /// The probe's label.
    pub label: String,
    /// Prompt tokens before the edit.
    pub tokens: usize,
    /// Tokens removed by the edit.
    pub removed: usize,
    /// Stub tokens.
    pub stub: usize,
    /// Tokens after the edit (moved and rotated by AMORTIZE).
    pub downstream: usize,
    /// Next token of the unedited context, and its top1-top2 logit margin.
    pub full: (u32, f32),
    /// Next token after the AMORTIZE edit, and its margin.
    pub amortize: (u32, f32),
    /// Next token after the FORGET edit, and its margin.
    pub forget: (u32, f32),
    /// How far below the reference's top logit the reference puts AMORTIZE's token (0 when
    /// they agree).
    pub amortize_gap_in_full: f32,
    /// Largest absolute logit difference between AMORTIZE and FORGET.
    pub amortize_forget_max_diff: f32,
    /// The AMORTIZE edit's report.
    pub amortize_report: EditReport,
    /// KL(FORGET || AMORTIZE) of the next-token distributions, in nats.
    pub kl_forget: f64,
    /// The same edit in AMORTIZE with each repair asked for, in order.
    pub repairs: Vec<RepairOutcome>,
}

/// What one probe gave under AMORTIZE with a repair.
#[derive(Debug, Clone, PartialEq)]
pub struct RepairOutcome {
    /// The repair.
    pub repair: Repair,
    /// Next token and its margin.
    pub token: (u32, f32),
    /// KL(FORGET || this) of the next-token distributions, in nats.
    pub kl_forget: f64,
    /// Downstream tokens it recomputed.
    pub repaired: usize,
    /// Tokens its selection pass scanned (rule `deviation`).
    pub scanned: usize,
}

impl ProbeOutcome {
    /// AMORTIZE's token equals the unedited reference's.
    pub fn agree_full(&self) -> bool {
        self.amortize.0 == self.full.0
    }

    /// AMORTIZE's token equals FORGET's.
    pub fn agree_forget(&self) -> bool {
        self.amortize.0 == self.forget.0
    }

    /// FORGET's token equals the unedited reference's (the edit itself kept the answer).
    pub fn forget_agree_full(&self) -> bool {
        self.forget.0 == self.full.0
    }

    /// Downstream tokens FORGET recomputes and a splice keeps: those between the edit and
    /// the scored last token (the replacement left out).
    pub fn forget_recomputed(&self) -> usize {
        self.downstream.saturating_sub(1)
    }
}

/// KL(p || q) in nats of the softmax distributions of logits `p` and `q`.
pub fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let log_softmax = |x: &[f32]| -> Vec<f64> {
        let max = x
            .iter()
            .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let sum: f64 = x.iter().map(|&v| (f64::from(v) - max).exp()).sum();
        let log_z = max + sum.ln();
        x.iter().map(|&v| f64::from(v) - log_z).collect()
    };
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// Lower edges of the reference-margin bands that [`by_reference_margin`] reports; the last
/// band is open above.
pub const MARGIN_BANDS: [f64; 5] = [0.0, 0.1, 0.25, 0.5, 1.0];

/// Agreement among the probes whose unedited reference leads by a margin in `[lo, hi)`.
#[derive(Debug, Clone, PartialEq)]
pub struct MarginBand {
    /// Lowest reference margin of the band (inclusive).
    pub lo: f64,
    /// Upper bound (exclusive); infinite for the last band.
    pub hi: f64,
    /// Probes in the band.
    pub probes: usize,
    /// Of those, AMORTIZE = full context.
    pub agree_full: usize,
    /// Of those, FORGET = full context.
    pub forget_agree_full: usize,
}

/// Outcomes grouped by the reference's top1 - top2 margin into bands starting at each of
/// `edges` (ascending). A near-tie of the reference flips on any change of context, so the
/// bands separate misses of the splice from those of an undecided model. Probes below the
/// first edge are not counted.
pub fn by_reference_margin(outcomes: &[ProbeOutcome], edges: &[f64]) -> Vec<MarginBand> {
    edges
        .iter()
        .enumerate()
        .map(|(i, &lo)| {
            let hi = edges.get(i + 1).copied().unwrap_or(f64::INFINITY);
            let inside: Vec<&ProbeOutcome> = outcomes
                .iter()
                .filter(|o| (lo..hi).contains(&f64::from(o.full.1)))
                .collect();
            MarginBand {
                lo,
                hi,
                probes: inside.len(),
                agree_full: inside.iter().filter(|o| o.agree_full()).count(),
                forget_agree_full: inside.iter().filter(|o| o.forget_agree_full()).count(),
            }
        })
        .collect()
}

/// A new session whose cache holds exactly `tokens` (prefilled by one request, reusing
/// whatever prefix the tree holds; the generated token, if cached, is dropped).
///
/// # Errors
/// The request's failure, or engine errors.
pub fn session_with(engine: &mut Engine, tokens: &[u32]) -> Result<SessionId> {
    let id = engine.create_session();
    let failed = Arc::new(Mutex::new(None::<String>));
    let f = Arc::clone(&failed);
    let sink = Box::new(move |ev| {
        if let Event::Failed(m) = ev {
            if let Ok(mut g) = f.lock() {
                *g = Some(m.message);
            }
        }
        ControlFlow::Continue(())
    });
    engine.submit(
        Request::greedy(tokens.to_vec(), 1, sink).in_session(SessionRequest {
            id,
            mode: Mode::Amortize,
            edits: SessionEdits::Tokens,
        }),
    );
    engine.run_to_completion()?;
    let failure = failed.lock().ok().and_then(|mut g| g.take());
    if let Some(m) = failure {
        let _ = engine.delete_session(id);
        return Err(EngineError::InvalidRequest(format!(
            "building a session failed: {m}"
        )));
    }
    let have = engine.session_info(id)?.tokens.len();
    if have > tokens.len() {
        let drop = Directive::new(tokens.len(), have, Vec::new(), Mode::Amortize);
        engine.apply_directives(id, vec![drop])?;
    }
    if engine.session_info(id)?.tokens != tokens {
        let _ = engine.delete_session(id);
        return Err(EngineError::InvalidRequest(
            "the session does not hold the prompt it was built from".into(),
        ));
    }
    Ok(id)
}

/// Runs one probe: the unedited reference, the edit in AMORTIZE, the edit in FORGET (on a
/// second session), then the edit in AMORTIZE with each of `repairs` (a session each), each
/// scored by running the last prompt token after the cache. Every session is deleted
/// afterwards.
///
/// # Errors
/// Engine errors; an edit whose result is not the expected token sequence.
pub fn run_probe(engine: &mut Engine, probe: &Probe, repairs: &[Repair]) -> Result<ProbeOutcome> {
    let n = probe.prompt.len();
    let (Some(first), Some(final_edit)) = (probe.edits.first(), probe.edits.last()) else {
        return Err(EngineError::InvalidRequest(
            "a probe without an edit".into(),
        ));
    };
    if n < 2 || final_edit.end >= n - 1 {
        return Err(EngineError::InvalidRequest(
            "a probe's edits must end before its last token".into(),
        ));
    }
    let (head, last) = (&probe.prompt[..n - 1], &probe.prompt[n - 1..]);
    let want = apply_edits(head, &probe.edits)
        .map_err(|e| EngineError::InvalidRequest(format!("a probe's edits: {e}")))?;
    let directive = |mode| -> Vec<Directive> {
        probe
            .edits
            .iter()
            .map(|e| Directive::new(e.start, e.end, e.replacement.clone(), mode))
            .collect()
    };

    let a = session_with(engine, head)?;
    let result = (|| {
        let full = engine.peek_logits(a, last)?;
        let report =
            engine.apply_directives_repaired(a, directive(Mode::Amortize), Some(Repair::NONE))?;
        if engine.session_info(a)?.tokens != want {
            return Err(EngineError::InvalidRequest(
                "AMORTIZE produced an unexpected sequence".into(),
            ));
        }
        let amortize = engine.peek_logits(a, last)?;
        Ok((full, report, amortize))
    })();
    engine.delete_session(a)?;
    let (full, amortize_report, amortize) = result?;

    let f = session_with(engine, head)?;
    let result = (|| {
        engine.apply_directives(f, directive(Mode::Forget))?;
        if engine.session_info(f)?.tokens != want {
            return Err(EngineError::InvalidRequest(
                "FORGET produced an unexpected sequence".into(),
            ));
        }
        engine.peek_logits(f, last)
    })();
    engine.delete_session(f)?;
    let forget = result?;

    let mut repaired = Vec::with_capacity(repairs.len());
    for &repair in repairs {
        let r = session_with(engine, head)?;
        let result = (|| -> Result<RepairOutcome> {
            let report =
                engine.apply_directives_repaired(r, directive(Mode::Amortize), Some(repair))?;
            let logits = engine.peek_logits(r, last)?;
            Ok(RepairOutcome {
                repair,
                token: top_margin(&logits),
                kl_forget: kl_divergence(&forget, &logits),
                repaired: report.repaired,
                scanned: report.scanned,
            })
        })();
        engine.delete_session(r)?;
        repaired.push(result?);
    }

    let (full_top, amortize_top) = (top_margin(&full), top_margin(&amortize));
    let max_diff = amortize
        .iter()
        .zip(&forget)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    Ok(ProbeOutcome {
        label: probe.label.clone(),
        tokens: n,
        removed: probe.edits.iter().map(Edit::removed).sum(),
        stub: probe.edits.iter().map(|e| e.replacement.len()).sum(),
        downstream: n - first.end,
        full: full_top,
        amortize: amortize_top,
        forget: top_margin(&forget),
        amortize_gap_in_full: full[full_top.0 as usize] - full[amortize_top.0 as usize],
        amortize_forget_max_diff: max_diff,
        amortize_report,
        kl_forget: kl_divergence(&forget, &amortize),
        repairs: repaired,
    })
}

/// Where a chained shift does its arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RotationMath {
    /// f32 math, rounded once per shift to the storage dtype (the engine's kernel).
    F32,
    /// Every product and sum rounded to the storage dtype (a naive low-precision kernel).
    Storage,
}

/// Deterministic splice deltas: magnitudes uniform in `[1, max_abs]`, random signs.
pub fn splice_deltas(n: usize, seed: u64, max_abs: u64) -> Vec<i64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let max_abs = max_abs.clamp(1, i64::MAX as u64) as i64;
    (0..n)
        .map(|_| {
            let mag = rng.random_range(1..=max_abs);
            if rng.random() {
                mag
            } else {
                -mag
            }
        })
        .collect()
}

/// `keys` (rows of `k_heads * head_dim` f32 values) rotated by `R(total)` in f64, written
/// straight from the math: each rotary pair turns by `total * inv_freq[i]`.
pub fn rotate_reference(keys: &[f32], head_dim: usize, spec: &RopeSpec, total: i64) -> Vec<f64> {
    let freqs = spec.inv_freq();
    let half = spec.rotary_dim / 2;
    let mut out: Vec<f64> = keys.iter().map(|&x| f64::from(x)).collect();
    for head in out.chunks_exact_mut(head_dim) {
        for (i, f) in freqs.iter().enumerate() {
            let (s, c) = (total as f64 * f).sin_cos();
            let (a, b) = match spec.layout {
                RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
                RotaryLayout::Neox => (i, i + half),
            };
            let (x, y) = (head[a], head[b]);
            head[a] = x * c - y * s;
            head[b] = x * s + y * c;
        }
    }
    out
}

/// Stores `keys` in `storage`, applies one shift per entry of `deltas` with `math`, and
/// returns the rel-L2 distance `|got - want| / |want|` from [`rotate_reference`] by the sum
/// of the deltas. Storage rounding of the original keys counts as drift too.
///
/// The distance is taken over the first `spec.rotary_dim` dims of every head only: those are
/// what a shift rewrites. A position-free tail (`rotary_dim < head_dim`) is never touched
/// after its one storage rounding and would only dilute the figure. For MLA the pool's key
/// row is `k_pe` alone (one head of `qk_rope_head_dim`, all rotary; the position-free
/// `k_nope` is decompressed from the latent on the value side), so the whole row counts.
///
/// # Errors
/// [`EngineError::InvalidRequest`] if `keys` is not whole rows or `spec` was made for another
/// head width; kernel errors.
pub fn chained_shift_drift(
    keys: &[f32],
    k_heads: usize,
    head_dim: usize,
    spec: &RopeSpec,
    deltas: &[i64],
    storage: KvDtype,
    math: RotationMath,
) -> Result<f64> {
    let width = k_heads * head_dim;
    if width == 0 || !keys.len().is_multiple_of(width) {
        return Err(EngineError::InvalidRequest(format!(
            "{} key values are not whole rows of {width}",
            keys.len()
        )));
    }
    if spec.head_dim != head_dim || spec.rotary_dim > head_dim {
        return Err(EngineError::InvalidRequest(format!(
            "RoPE spec for head_dim {} (rotary {}), keys have head_dim {head_dim}",
            spec.head_dim, spec.rotary_dim
        )));
    }
    let slots: Vec<u32> = (0..(keys.len() / width) as u32).collect();
    let mut f32_buf;
    let mut half_buf: Vec<u16>;
    let got: Vec<f32> = {
        let shift = |rows: RowsMut<'_>, delta: i64| -> Result<()> {
            let shifted = match math {
                RotationMath::F32 => shift_rows(rows, k_heads, head_dim, &slots, spec, delta),
                RotationMath::Storage => {
                    shift_rows_lowprec(rows, k_heads, head_dim, &slots, spec, delta)
                }
            };
            Ok(shifted.map_err(KvError::from)?)
        };
        match storage {
            KvDtype::F32 => {
                f32_buf = keys.to_vec();
                for &d in deltas {
                    shift(RowsMut::F32(&mut f32_buf), d)?;
                }
                f32_buf
            }
            KvDtype::Bf16 => {
                half_buf = keys.iter().map(|&x| f32_to_bf16(x)).collect();
                for &d in deltas {
                    shift(RowsMut::Bf16(&mut half_buf), d)?;
                }
                half_buf.iter().map(|&b| bf16_to_f32(b)).collect()
            }
            KvDtype::F16 => {
                half_buf = keys.iter().map(|&x| f32_to_f16(x)).collect();
                for &d in deltas {
                    shift(RowsMut::F16(&mut half_buf), d)?;
                }
                half_buf.iter().map(|&b| f16_to_f32(b)).collect()
            }
        }
    };
    let want = rotate_reference(keys, head_dim, spec, deltas.iter().sum());
    let (mut err, mut norm) = (0.0f64, 0.0f64);
    let rotary = spec.rotary_dim;
    for (g, w) in got.chunks_exact(head_dim).zip(want.chunks_exact(head_dim)) {
        for (&g, &w) in g[..rotary].iter().zip(&w[..rotary]) {
            err += (f64::from(g) - w).powi(2);
            norm += w * w;
        }
    }
    Ok(if norm > 0.0 {
        (err / norm).sqrt()
    } else {
        err.sqrt()
    })
}

#[cfg(test)]
mod tests;
