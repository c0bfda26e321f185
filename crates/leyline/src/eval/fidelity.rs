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

use leyline_core::{Directive, Mode};
use leyline_engine::{
    EditReport, Engine, EngineError, Event, Request, Result, SessionEdits, SessionId,
    SessionRequest,
};
use leyline_kv::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use leyline_kv::rope::{RopeSpec, RotaryLayout};
use leyline_kv::rotate::shift_rows;
use leyline_kv::rotate::shift_rows_lowprec;
use leyline_kv::storage::RowsMut;
use leyline_kv::KvDtype;
use leyline_policy::{diff_rendered, Edit, Renderer, Role, Trajectory};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex};

/// What an evicted tool output becomes in a probe.
pub const PROBE_STUB: &str = "[evicted: older tool output]";

/// One probe: a rendered prompt and one edit of an older tool output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    /// `trajectory id#turn`.
    pub label: String,
    /// The unedited prompt, generation prompt included.
    pub prompt: Vec<u32>,
    /// The edit (pre-edit indices into `prompt`); it ends before the last prompt token.
    pub edit: Edit,
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
    if edited[oldest].content == opts.stub {
        return Ok(None);
    }
    edited[oldest].content.clone_from(&opts.stub);
    let new = renderer.render_tokens(&edited)?;
    let edits = diff_rendered(&old, &new)?;
    let [edit] = edits.as_slice() else {
        return Ok(None);
    };
    if edit.end >= old.tokens.len() - 1 {
        return Ok(None);
    }
    let turn = traj.messages[..i]
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .count();
    Ok(Some(Probe {
        label: format!("{}#{turn}", traj.id),
        prompt: old.tokens,
        edit: edit.clone(),
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
                edit: Edit {
                    start,
                    end: start + removed,
                    replacement: ids(&mut rng, stub),
                },
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
/// second session), each scored by running the last prompt token after the cache. Both
/// sessions are deleted afterwards.
///
/// # Errors
/// Engine errors; an edit whose result is not the expected token sequence.
pub fn run_probe(engine: &mut Engine, probe: &Probe) -> Result<ProbeOutcome> {
    let n = probe.prompt.len();
    if n < 2 || probe.edit.end >= n - 1 {
        return Err(EngineError::InvalidRequest(
            "a probe's edit must end before its last token".into(),
        ));
    }
    let (head, last) = (&probe.prompt[..n - 1], &probe.prompt[n - 1..]);
    let mut want = head[..probe.edit.start].to_vec();
    want.extend_from_slice(&probe.edit.replacement);
    want.extend_from_slice(&head[probe.edit.end..]);
    let directive = |mode| {
        Directive::new(
            probe.edit.start,
            probe.edit.end,
            probe.edit.replacement.clone(),
            mode,
        )
    };

    let a = session_with(engine, head)?;
    let result = (|| {
        let full = engine.peek_logits(a, last)?;
        let report = engine.apply_directives(a, vec![directive(Mode::Amortize)])?;
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
        engine.apply_directives(f, vec![directive(Mode::Forget)])?;
        if engine.session_info(f)?.tokens != want {
            return Err(EngineError::InvalidRequest(
                "FORGET produced an unexpected sequence".into(),
            ));
        }
        engine.peek_logits(f, last)
    })();
    engine.delete_session(f)?;
    let forget = result?;

    let (full_top, amortize_top) = (top_margin(&full), top_margin(&amortize));
    let max_diff = amortize
        .iter()
        .zip(&forget)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    Ok(ProbeOutcome {
        label: probe.label.clone(),
        tokens: n,
        removed: probe.edit.end - probe.edit.start,
        stub: probe.edit.replacement.len(),
        downstream: n - probe.edit.end,
        full: full_top,
        amortize: amortize_top,
        forget: top_margin(&forget),
        amortize_gap_in_full: full[full_top.0 as usize] - full[amortize_top.0 as usize],
        amortize_forget_max_diff: max_diff,
        amortize_report,
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
            match math {
                RotationMath::F32 => shift_rows(rows, k_heads, head_dim, &slots, spec, delta)?,
                RotationMath::Storage => {
                    shift_rows_lowprec(rows, k_heads, head_dim, &slots, spec, delta)?
                }
            }
            Ok(())
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
mod tests {
    use super::*;
    use leyline_policy::{ByteChatMl, Message};

    fn keys(rows: usize, width: usize, seed: u64) -> Vec<f32> {
        // Uniform in [-4, 4) from the deltas generator's bits.
        splice_deltas(rows * width, seed, 1 << 20)
            .into_iter()
            .map(|d| d as f32 / (1 << 18) as f32)
            .collect()
    }

    fn spec() -> RopeSpec {
        RopeSpec::plain(10_000.0, 64, RotaryLayout::Neox)
    }

    #[test]
    fn reference_rotation_composes_and_inverts() {
        let k = keys(4, 128, 1);
        let s = spec();
        let there = rotate_reference(&k, 64, &s, 300);
        let back: Vec<f32> = there.iter().map(|&x| x as f32).collect();
        let again = rotate_reference(&back, 64, &s, -300);
        for (a, b) in again.iter().zip(&k) {
            assert!((a - f64::from(*b)).abs() < 1e-5, "{a} vs {b}");
        }
        // Norms are kept per pair.
        let n0: f64 = k.iter().map(|&x| f64::from(x).powi(2)).sum();
        let n1: f64 = there.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() / n0 < 1e-12);
        // Zero rotation is the identity, exactly.
        let same = rotate_reference(&k, 64, &s, 0);
        assert!(same.iter().zip(&k).all(|(a, b)| *a == f64::from(*b)));
    }

    #[test]
    fn reference_rotation_matches_hand_computed_pair() {
        // One head of width 4, NEOX halves (0, 2) and (1, 3); theta 100: freqs 1 and 0.1.
        let s = RopeSpec::plain(100.0, 4, RotaryLayout::Neox);
        let got = rotate_reference(&[1.0, 0.0, 0.0, 1.0], 4, &s, 2);
        let want = [2f64.cos(), -(0.2f64.sin()), 2f64.sin(), 0.2f64.cos()];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{got:?} vs {want:?}");
        }
    }

    #[test]
    fn drift_grows_with_low_precision_math_and_stays_small_in_f32() {
        let k = keys(64, 3 * 64, 7);
        let s = spec();
        let d1 = splice_deltas(1, 3, 512);
        let d100 = splice_deltas(100, 3, 512);
        let f32_100 =
            chained_shift_drift(&k, 3, 64, &s, &d100, KvDtype::F32, RotationMath::F32).unwrap();
        assert!(f32_100 < 1e-5, "f32 storage drifts {f32_100}");
        let bf_1 =
            chained_shift_drift(&k, 3, 64, &s, &d1, KvDtype::Bf16, RotationMath::F32).unwrap();
        // One bf16 rounding of the stored keys plus one of the result: below 2^-8.
        assert!(bf_1 > 1e-4 && bf_1 < 4e-3, "bf16 one shift {bf_1}");
        let bf_100 =
            chained_shift_drift(&k, 3, 64, &s, &d100, KvDtype::Bf16, RotationMath::F32).unwrap();
        let low_100 =
            chained_shift_drift(&k, 3, 64, &s, &d100, KvDtype::Bf16, RotationMath::Storage)
                .unwrap();
        assert!(bf_100 > bf_1, "{bf_100} <= {bf_1}");
        assert!(
            low_100 > 1.3 * bf_100,
            "bf16 math {low_100} vs f32 math {bf_100}"
        );
        assert!(bf_100.is_finite() && low_100.is_finite());
    }

    #[test]
    fn drift_counts_only_the_rotary_dims() {
        // Heads of 64 with 32 rotary dims and a huge position-free tail: the figure must
        // equal that of the rotary halves alone (a tail in the norm would shrink it ~1000x).
        let mut partial = RopeSpec::plain(10_000.0, 64, RotaryLayout::Neox);
        partial.rotary_dim = 32;
        let rotary_only = RopeSpec::plain(10_000.0, 32, RotaryLayout::Neox);
        let mut k = keys(16, 2 * 64, 5);
        let halves: Vec<f32> = k
            .chunks_exact(64)
            .flat_map(|h| h[..32].iter().copied())
            .collect();
        for h in k.chunks_exact_mut(64) {
            h[32..].iter_mut().for_each(|x| *x *= 1000.0);
        }
        let d = splice_deltas(10, 9, 512);
        for (storage, math) in [
            (KvDtype::Bf16, RotationMath::F32),
            (KvDtype::Bf16, RotationMath::Storage),
        ] {
            let got = chained_shift_drift(&k, 2, 64, &partial, &d, storage, math).unwrap();
            let want =
                chained_shift_drift(&halves, 2, 32, &rotary_only, &d, storage, math).unwrap();
            assert!(
                (got - want).abs() <= 1e-9 * want,
                "{storage:?} {math:?}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn drift_of_mla_k_pe_rows_with_yarn() {
        // MLA's key row: one interleaved rotary head of 8 (k_pe), YaRN frequencies as the
        // tiny fixture's: f32 stays tiny, bf16 math drifts further than f32 math.
        let s = RopeSpec {
            theta: 10_000.0,
            head_dim: 8,
            rotary_dim: 8,
            layout: RotaryLayout::Interleaved,
            scaling: leyline_kv::rope::RopeScaling::Yarn {
                factor: 4.0,
                original_max_position: 128.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 0.707,
                mscale_all_dim: 0.707,
            },
        };
        let k = keys(256, 8, 13);
        let d = splice_deltas(100, 3, 512);
        let f = chained_shift_drift(&k, 1, 8, &s, &d, KvDtype::F32, RotationMath::F32).unwrap();
        assert!(f < 1e-5, "f32 {f}");
        let b = chained_shift_drift(&k, 1, 8, &s, &d, KvDtype::Bf16, RotationMath::F32).unwrap();
        let low =
            chained_shift_drift(&k, 1, 8, &s, &d, KvDtype::Bf16, RotationMath::Storage).unwrap();
        assert!(b > f && low > b, "f32 {f}, bf16/f32 {b}, bf16/bf16 {low}");
        // A spec for another head width is refused, not silently mis-chunked.
        let wide = RopeSpec::plain(10_000.0, 16, RotaryLayout::Interleaved);
        assert!(
            chained_shift_drift(&k, 1, 8, &wide, &[], KvDtype::F32, RotationMath::F32).is_err()
        );
    }

    #[test]
    fn synthetic_probes_are_seeded_bounded_and_evict_an_older_span() {
        let opts = SyntheticOptions {
            probes: 50,
            vocab_size: 512,
            max_tokens: 300,
            seed: 7,
        };
        let probes = synthetic_probes(&opts).unwrap();
        assert_eq!(probes.len(), 50);
        assert_eq!(probes, synthetic_probes(&opts).unwrap());
        let other = synthetic_probes(&SyntheticOptions {
            seed: 8,
            ..opts.clone()
        })
        .unwrap();
        assert_ne!(probes, other);
        for (i, p) in probes.iter().enumerate() {
            let n = p.prompt.len();
            assert_eq!(p.label, format!("synthetic#{i}"));
            assert!((150..=300).contains(&n), "{n}");
            let e = &p.edit;
            assert!(e.start >= 1 && e.end <= 3 * n / 8, "{e:?} of {n}");
            assert!(e.end - e.start >= 2 && e.end - e.start >= n / 8 - 1);
            assert!(!e.replacement.is_empty() && e.replacement.len() < e.end - e.start);
            assert!(e.replacement.len() <= 8);
            assert!(p.prompt.iter().chain(&e.replacement).all(|&t| t < 512));
        }
        // The smallest budget still gives valid edits; below it is an error.
        for p in synthetic_probes(&SyntheticOptions {
            max_tokens: SYNTHETIC_MIN_TOKENS,
            ..opts.clone()
        })
        .unwrap()
        {
            assert!(
                p.edit.end < p.prompt.len() - 1 && p.edit.delta() < 0,
                "{p:?}"
            );
        }
        assert!(synthetic_probes(&SyntheticOptions {
            max_tokens: SYNTHETIC_MIN_TOKENS - 1,
            ..opts.clone()
        })
        .is_err());
        assert!(synthetic_probes(&SyntheticOptions {
            vocab_size: 1,
            ..opts
        })
        .is_err());
    }

    #[test]
    fn drift_rejects_partial_rows() {
        let err = chained_shift_drift(
            &[0.0; 10],
            3,
            64,
            &spec(),
            &[1],
            KvDtype::F32,
            RotationMath::F32,
        );
        assert!(err.is_err());
    }

    #[test]
    fn deltas_are_bounded_nonzero_and_mixed_in_sign() {
        let d = splice_deltas(1000, 11, 512);
        assert!(d.iter().all(|&x| x != 0 && x.abs() <= 512));
        assert!(d.iter().any(|&x| x < 0) && d.iter().any(|&x| x > 0));
        assert_eq!(d, splice_deltas(1000, 11, 512));
    }

    #[test]
    fn top_margin_finds_the_lead() {
        assert_eq!(top_margin(&[0.5, 3.0, 2.5, -1.0]), (1, 0.5));
        assert_eq!(top_margin(&[2.0, 2.0]), (0, 0.0));
        assert_eq!(top_margin(&[1.0]), (0, 0.0));
    }

    fn outcome(full: (u32, f32), amortize: u32, forget: u32) -> ProbeOutcome {
        ProbeOutcome {
            label: String::new(),
            tokens: 0,
            removed: 0,
            stub: 0,
            downstream: 0,
            full,
            amortize: (amortize, 0.0),
            forget: (forget, 0.0),
            amortize_gap_in_full: 0.0,
            amortize_forget_max_diff: 0.0,
            amortize_report: EditReport {
                mode: Mode::Amortize,
                directives: 1,
                reused: 0,
                rotated: 0,
                copied: 0,
                prefilled: 0,
                zeroed: 0,
                new_len: 0,
            },
        }
    }

    #[test]
    fn margin_bands_split_at_their_edges() {
        let o = [
            outcome((7, 0.05), 8, 8),  // near-tie: both arms move
            outcome((7, 0.125), 7, 8), // on an edge: the upper band
            outcome((7, 0.3), 7, 7),   // agrees
            outcome((7, 0.49), 9, 7),  // AMORTIZE alone moves
            outcome((7, 5.0), 7, 7),   // open last band
            outcome((7, -1.0), 7, 7),  // below the first edge: not counted
        ];
        let bands = by_reference_margin(&o, &[0.0, 0.125, 0.25, 1.0]);
        let rows: Vec<(f64, usize, usize, usize)> = bands
            .iter()
            .map(|b| (b.lo, b.probes, b.agree_full, b.forget_agree_full))
            .collect();
        assert_eq!(
            rows,
            vec![
                (0.0, 1, 0, 0),
                (0.125, 1, 1, 0),
                (0.25, 2, 1, 2),
                (1.0, 1, 1, 1)
            ]
        );
        assert_eq!(bands[0].hi, 0.125);
        assert!(bands[3].hi.is_infinite());
        assert!(by_reference_margin(&o, &[]).is_empty());
    }

    fn traj(id: &str, messages: Vec<Message>) -> Trajectory {
        Trajectory {
            id: id.into(),
            source: "test".into(),
            meta: serde_json::Value::Null,
            messages,
        }
    }

    #[test]
    fn probes_replace_the_oldest_tool_output_when_a_newer_one_exists() {
        let t = traj(
            "t",
            vec![
                Message::system("sys"),
                Message::user("hi"),
                Message::assistant("call a"),
                Message::tool("a", "first output"),
                Message::assistant("call b"),
                Message::tool("b", "second output"),
                Message::assistant("done"),
            ],
        );
        let one_tool = traj(
            "u",
            vec![
                Message::user("hi"),
                Message::assistant("call"),
                Message::tool("a", "only output"),
                Message::assistant("done"),
            ],
        );
        let opts = ProbeOptions {
            max_probes: 10,
            max_tokens: 10_000,
            stub: "[x]".into(),
        };
        let probes = build_probes(&[one_tool, t.clone()], &ByteChatMl, &opts).unwrap();
        assert_eq!(
            probes.len(),
            1,
            "only the last turn of `t` has two tool outputs"
        );
        let p = &probes[0];
        assert_eq!(p.label, "t#2");
        let text: String = p.prompt[p.edit.start..p.edit.end]
            .iter()
            .map(|&b| b as u8 as char)
            .collect();
        assert!(
            "first output".contains(&text) && !text.is_empty(),
            "{text:?}"
        );
        let repl: String = p
            .edit
            .replacement
            .iter()
            .map(|&b| b as u8 as char)
            .collect();
        assert!("[x]".contains(&repl), "{repl:?}");
        // The rendered history ends the prompt (ByteChatMl has no generation prompt).
        let want = ByteChatMl.render_tokens(&t.messages[..6]).unwrap().tokens;
        assert_eq!(p.prompt, want);

        // A budget below the prompt leaves no probe.
        let tight = ProbeOptions {
            max_tokens: want.len() - 1,
            ..opts
        };
        assert!(build_probes(&[t], &ByteChatMl, &tight).unwrap().is_empty());
    }
}
