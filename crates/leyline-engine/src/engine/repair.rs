//! Repair: after an AMORTIZE splice commits, the engine recomputes the downstream tokens a
//! [`leyline_core::Repair`] names under the edited context, in order, writing over their own
//! slots (a fresh slot first where another sequence shares one). The deviation rule first
//! runs a selection pass ([`leyline_model::CausalLm::kv_deviation`]) over everything after
//! the first edit and keeps the tokens whose KV moves most.

use super::edit::union;
use super::{Engine, REPAIR_DEVIATION_LAYER};
use crate::error::{EngineError, Result};
use crate::session::{EditReport, SessionId};
use leyline_core::{DirectiveBatch, Repair, RepairRule};
use leyline_model::{ForwardSeq, LogitsFor};
use std::ops::Range;

impl Engine {
    /// The post-edit ranges `repair` recomputes in the spliced session `id`; for the
    /// deviation rule this runs its selection pass (counted in `report.scanned`).
    pub(super) fn repair_ranges(
        &mut self,
        id: SessionId,
        batch: &DirectiveBatch,
        repair: Repair,
        report: &mut EditReport,
    ) -> Result<Vec<Range<usize>>> {
        if repair.rule != RepairRule::Deviation {
            return Ok(repair.ranges(batch));
        }
        let Some(scan) = repair.scan_range(batch) else {
            return Ok(Vec::new());
        };
        let deviation = self.kv_deviation(id, scan.clone())?;
        report.scanned = scan.len();
        let mut pick: Vec<usize> = (0..deviation.len()).collect();
        pick.sort_by(|&a, &b| deviation[b].total_cmp(&deviation[a]).then(a.cmp(&b)));
        pick.truncate(repair.tokens);
        pick.sort_unstable();
        Ok(union(
            pick.into_iter()
                .map(|i| scan.start + i..scan.start + i + 1)
                .collect(),
        ))
    }

    /// How far the KV of the session's tokens in `scan` moves at the layer
    /// [`REPAIR_DEVIATION_LAYER`] when they are recomputed in its current context
    /// ([`leyline_model::CausalLm::kv_deviation`]), chunk by chunk into scratch slots.
    fn kv_deviation(&mut self, id: SessionId, scan: Range<usize>) -> Result<Vec<f32>> {
        let layer = REPAIR_DEVIATION_LAYER.min(self.kv.geometry().layers.saturating_sub(1));
        let mut out = Vec::with_capacity(scan.len());
        // Tokens a lazy splice left shifted are recomputed where their cached keys are
        // encoded (so the two compare), one run of equal offset at a time, the context read
        // relative to that offset.
        let runs = self.offset_runs(id, scan)?;
        for (run, offset) in runs {
            for Range { start: a, end: b } in chunks(run, self.cfg.prefill_chunk) {
                let (scratch, removed) = self.cache.alloc_evicting(b - a)?;
                self.note_evicted(removed.freed.len());
                let s = self
                    .sessions
                    .get(&id)
                    .ok_or(EngineError::UnknownSession(id.0))?;
                let shifts = self.cache.pool().key_shifts_from(&s.slots[..a], offset)?;
                let positions: Vec<u32> = (a as i64 - offset..b as i64 - offset)
                    .map(|p| p as u32)
                    .collect();
                // The context is the session's own slots: the layers before `layer` that the
                // earlier scanned tokens feed do not depend on context at layer 0, and the pass
                // reads no deeper than that.
                let seq = ForwardSeq {
                    tokens: &s.tokens[a..b],
                    positions: &positions,
                    context: &s.slots[..a],
                    new_slots: &scratch,
                    logits: LogitsFor::None,
                    shifts: &shifts,
                };
                let got = self
                    .model
                    .kv_deviation(&mut self.kv, seq, layer, &s.slots[a..b]);
                self.scrub(&scratch)?;
                self.cache.pool_mut().release_all(&scratch)?;
                out.extend(got?);
            }
        }
        Ok(out)
    }

    /// `range` of session `id` cut into runs whose slots share one offset (true position
    /// less encoded position; 0 unless a lazy splice moved them), in order.
    fn offset_runs(&self, id: SessionId, range: Range<usize>) -> Result<Vec<(Range<usize>, i64)>> {
        let s = self.session(id)?;
        let pool = self.cache.pool();
        let mut runs: Vec<(Range<usize>, i64)> = Vec::new();
        for i in range {
            let o = i as i64 - i64::from(pool.position(s.slots[i])?);
            match runs.last_mut() {
                Some((r, last)) if *last == o => r.end = i + 1,
                _ => runs.push((i..i + 1, o)),
            }
        }
        Ok(runs)
    }

    /// Recomputes the session's tokens in `ranges` (post-edit indices, sorted and disjoint)
    /// under its current context, in order, writing over their slots; a slot another
    /// sequence shares is replaced by a fresh one first. Returns the tokens recomputed.
    pub(super) fn repair_session(
        &mut self,
        id: SessionId,
        ranges: &[Range<usize>],
    ) -> Result<usize> {
        let mut repaired = 0;
        for r in ranges {
            self.unshare(id, r.clone())?;
            for Range { start: a, end: b } in chunks(r.clone(), self.cfg.prefill_chunk) {
                // The session by field, so the model and the storage stay borrowable.
                let s = self
                    .sessions
                    .get(&id)
                    .ok_or(EngineError::UnknownSession(id.0))?;
                let positions: Vec<u32> = (a as u32..b as u32).collect();
                let shifts = self.cache.pool().key_shifts(&s.slots[..a])?;
                let seq = ForwardSeq {
                    tokens: &s.tokens[a..b],
                    positions: &positions,
                    context: &s.slots[..a],
                    new_slots: &s.slots[a..b],
                    logits: LogitsFor::None,
                    shifts: &shifts,
                };
                if let Err(e) = self.model.forward(&mut self.kv, &[seq]) {
                    let sess = self.session_mut(id)?;
                    sess.tokens.truncate(a);
                    sess.bounds = None;
                    let tail = sess.slots.split_off(a);
                    self.release_slots(&tail)?;
                    return Err(e.into());
                }
                // Recomputed where they belong: no longer shifted.
                let pool = self.cache.pool_mut();
                for (i, &slot) in s.slots[a..b].iter().enumerate() {
                    pool.set_position(slot, (a + i) as u32)?;
                }
            }
            repaired += r.len();
        }
        self.metrics
            .add(&self.metrics.prefilled_tokens, repaired as u64);
        Ok(repaired)
    }

    /// Gives session `id` slots of its own for `range`: each slot there that another
    /// sequence (or the prefix tree) also holds is swapped for a fresh one at the same
    /// position, in the session's lineage. The fresh slots' KV is left for the caller to
    /// write.
    fn unshare(&mut self, id: SessionId, range: Range<usize>) -> Result<()> {
        let s = self.session(id)?;
        let pool = self.cache.pool();
        let mut shared = Vec::new();
        for i in range {
            if pool.refcount(s.slots[i])? > 1 {
                shared.push(i);
            }
        }
        if shared.is_empty() {
            return Ok(());
        }
        let (lineage, clean_len) = (s.lineage, s.clean_len);
        let (fresh, removed) = self.cache.alloc_evicting(shared.len())?;
        self.note_evicted(removed.freed.len());
        let pool = self.cache.pool_mut();
        for (&i, &slot) in shared.iter().zip(&fresh) {
            pool.set_position(slot, i as u32)?;
            if i >= clean_len {
                pool.set_lineage(slot, lineage)?;
            }
        }
        let sess = self.session_mut(id)?;
        let old: Vec<u32> = shared
            .iter()
            .zip(&fresh)
            .map(|(&i, &slot)| std::mem::replace(&mut sess.slots[i], slot))
            .collect();
        self.release_slots(&old)?;
        Ok(())
    }
}

/// `range` in consecutive pieces of at most `chunk` tokens (a prefill step's budget).
fn chunks(range: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let end = range.end;
    range
        .step_by(chunk.max(1))
        .map(move |a| a..(a + chunk.max(1)).min(end))
}
