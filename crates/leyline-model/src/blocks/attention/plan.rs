//! Planning an attention call: the tasks (sequence, kv head, query rows, stretch of keys) a
//! batch splits into, and the grouping of decodes that share a context prefix. The kernels
//! run the tasks and merge split tasks' partial sums ([`leyline_kernels::attend`]).
//!
//! Layers with a sliding window read other keys than global ones, so a forward pass cuts
//! the batch once per distinct window ([`Cut`]), not per layer: a windowed cut's tasks begin
//! at the key block of the lowest key any of their rows sees.
//!
//! A row's output bits must not depend on the batch (rounded activations would turn float
//! noise into whole steps): tasks begin at key-block edges, split only at multiples of
//! [`SPAN`] (the kernel folds a row's spans the same way inside one task), and a block's
//! rotation of the queries follows the key at its start, not the task's rows.

use crate::model::ForwardSeq;
use leyline_kernels::attend::{last_piece, offset_of, Heads, Task, Work, KB, RB, SPAN};
use leyline_kernels::rope::{LayerRopes, Rotation};
use leyline_kv::shift::KeyShift;
use std::num::NonZeroUsize;

/// Query tokens per task.
pub(super) const QB: usize = 64;

/// Tasks per thread below which the keys are split into spans.
const TASKS_PER_THREAD: usize = 4;
/// Most values a split may add to the merge buffers (each span's partial sums of its rows
/// are kept apart): a long prompt's many rows are not split, whatever the thread count.
const SPLIT_BUDGET: usize = 1 << 22;

/// `lo`, then the multiples of [`SPAN`] after it and before `hi`, then `hi`: where a split
/// cuts keys `lo..hi`.
fn span_cuts(lo: usize, hi: usize) -> Vec<usize> {
    let inner = (lo / SPAN + 1..).map(|s| s * SPAN).take_while(|&c| c < hi);
    std::iter::once(lo).chain(inner).chain([hi]).collect()
}

/// The tasks of one attention call for every layer of a forward pass: one [`Cut`] per
/// distinct sliding window of the layers ([`Self::select`] hands out a layer's).
pub(crate) struct Plan<'a> {
    pub(super) cuts: Vec<Cut<'a>>,
    /// Per layer, the index of its cut.
    pub(super) cut_of_layer: Vec<usize>,
    rope: &'a LayerRopes,
}

impl<'a> Plan<'a> {
    /// The tasks for `seqs` on `threads` threads; `rope` turns queries back for the keys of
    /// shifted runs ([`ForwardSeq::shifts`]), each layer by its own spec. `windows[l]` is
    /// layer `l`'s sliding window (`None`: global); an empty slice makes every layer global.
    /// A window that reaches every key of the batch is planned as global (same bits).
    ///
    /// # Panics
    /// If `windows` is neither empty nor one entry per layer of `rope`.
    pub(crate) fn new(
        seqs: &'a [ForwardSeq<'a>],
        shape: Heads,
        rope: &'a LayerRopes,
        windows: &[Option<NonZeroUsize>],
        threads: usize,
    ) -> Self {
        let layers = rope.of_layer().len();
        assert!(
            windows.is_empty() || windows.len() == layers,
            "{} windows for {layers} layers",
            windows.len()
        );
        // A row at index p sees at most p + 1 keys: a window as wide as the longest
        // sequence hides nothing.
        let reach = seqs
            .iter()
            .map(|s| s.context.len() + s.tokens.len())
            .max()
            .unwrap_or(0);
        let mut kinds: Vec<Option<NonZeroUsize>> = Vec::new();
        let cut_of_layer = (0..layers)
            .map(|l| {
                let w = windows
                    .get(l)
                    .copied()
                    .flatten()
                    .filter(|w| w.get() < reach);
                kinds.iter().position(|&k| k == w).unwrap_or_else(|| {
                    kinds.push(w);
                    kinds.len() - 1
                })
            })
            .collect();
        if kinds.is_empty() {
            kinds.push(None);
        }
        Self {
            cuts: kinds
                .into_iter()
                .map(|w| Cut::new(seqs, shape, rope, w, threads))
                .collect(),
            cut_of_layer,
            rope,
        }
    }

    /// The work of `layer`: its window's tasks, with [`Work::rotations`] those of its rope
    /// spec.
    pub(crate) fn select(&mut self, layer: usize) -> &mut Work<'a> {
        let cut = &mut self.cuts[self.cut_of_layer[layer]];
        cut.select(self.rope.of_layer()[layer]);
        &mut cut.work
    }
}

/// The tasks of the layers of one sliding window (or of the global layers), the same on
/// each of them, and the RoPE that turns queries back for the keys of shifted runs: the
/// rotations of every rope spec, the selected one's in [`Work::rotations`].
pub(super) struct Cut<'a> {
    pub(super) work: Work<'a>,
    rope: &'a LayerRopes,
    /// Per rope spec, its rotations by the offsets of [`Work::rotations`] (same order); the
    /// selected spec's entry is empty, its rotations being in `work`.
    others: Vec<Vec<(i64, Rotation)>>,
    /// The spec whose rotations `work` holds.
    selected: usize,
}

impl<'a> Cut<'a> {
    /// The tasks for `seqs` on `threads` threads for layers of sliding window `window`.
    fn new(
        seqs: &'a [ForwardSeq<'a>],
        shape: Heads,
        rope: &'a LayerRopes,
        window: Option<NonZeroUsize>,
        threads: usize,
    ) -> Self {
        let Heads {
            heads: h,
            kv_heads: kvh,
            ..
        } = shape;
        let g = h / kvh;
        let units: usize = seqs.iter().map(|s| s.tokens.len().div_ceil(QB) * kvh).sum();
        let wanted = TASKS_PER_THREAD * threads;
        let mut plan = Self {
            work: Work {
                shape,
                tasks: Vec::new(),
                merge_rows: 0,
                max_rows: 0,
                scratch: Vec::new(),
                rotations: Vec::new(),
            },
            rope,
            others: Vec::new(),
            selected: 0,
        };
        let rows_at: Vec<usize> = seqs
            .iter()
            .scan(0, |at, s| {
                let r = *at;
                *at += s.tokens.len();
                Some(r)
            })
            .collect();
        // Decoding sequences that share a context prefix read it once, in tasks that hold all
        // their query rows; their own tasks cover the keys after it, and the parts are merged.
        // Not with a window: a decode then reads its last keys only, rarely any shared ones.
        let mut shared = vec![0usize; seqs.len()];
        let mut base = vec![0usize; seqs.len()];
        let groups = match window {
            None => shared_prefixes(seqs),
            Some(_) => Vec::new(),
        };
        for (members, len) in groups {
            // Whole spans only: a member's parts must be those it would have alone.
            let len = len / SPAN * SPAN;
            if len == 0 {
                continue;
            }
            for chunk in members.chunks(QB) {
                for &i in chunk {
                    shared[i] = len;
                    base[i] = plan.work.merge_rows;
                    plan.work.merge_rows += kvh * g;
                }
                // Equal slots at equal indices: the members' shifts agree on the prefix.
                let cuts = span_cuts(0, len);
                plan.push(&seqs[chunk[0]], len, &cuts, true, None, |kv_head| {
                    chunk
                        .iter()
                        .map(|&i| (rows_at[i], base[i] + kv_head * g))
                        .collect()
                });
            }
        }
        // The keys of a block of new tokens: from the key block of the lowest key its first
        // token sees (the window's) to its last token.
        let keys_of = |s: &ForwardSeq<'_>, t0: usize, t1: usize| {
            let ctx = s.context.len();
            let lo = window.map_or(0, |w| (ctx + t0 + 1).saturating_sub(w.get()));
            (lo / KB * KB, ctx + t1)
        };
        // Split into spans when there are too few tasks for the threads, and the merge
        // buffers stay small. The bits are the same either way.
        let split_size: usize = seqs
            .iter()
            .enumerate()
            .filter(|&(i, _)| shared[i] == 0)
            .flat_map(|(_, s)| {
                (0..s.tokens.len()).step_by(QB).map(move |t0| {
                    let t1 = (t0 + QB).min(s.tokens.len());
                    let (lo, hi) = keys_of(s, t0, t1);
                    (span_cuts(lo, hi).len() - 1) * (t1 - t0)
                })
            })
            .sum::<usize>()
            * h
            * (shape.head_dim + 2);
        let split = units < wanted && split_size <= SPLIT_BUDGET;
        for (i, s) in seqs.iter().enumerate() {
            let (t, ctx, row) = (s.tokens.len(), s.context.len(), rows_at[i]);
            if shared[i] > 0 {
                // One new token; the keys from the end of the shared prefix on.
                let cuts = span_cuts(shared[i], ctx + 1);
                plan.push(s, ctx, &cuts, true, None, |kv_head| {
                    vec![(row, base[i] + kv_head * g)]
                });
                continue;
            }
            for t0 in (0..t).step_by(QB) {
                let t1 = (t0 + QB).min(t);
                let (lo, hi) = keys_of(s, t0, t1);
                let mut cuts = span_cuts(lo, hi);
                // Without a split, one task folds the spans itself.
                if !split {
                    cuts = vec![lo, hi];
                }
                let merged = cuts.len() > 2;
                let at = plan.work.merge_rows;
                plan.push(s, ctx + t0, &cuts, merged, window, |kv_head| {
                    (t0..t1)
                        .map(|i| (row + i, at + (kv_head * (t1 - t0) + i - t0) * g))
                        .collect()
                });
                if merged {
                    plan.work.merge_rows += kvh * (t1 - t0) * g;
                }
            }
        }
        // Costliest first (keys times rows, plus a per-key share), so the dynamic hand-out
        // ends with cheap tasks.
        plan.work
            .tasks
            .sort_by_key(|t| std::cmp::Reverse((t.k1 - t.k0) * (t.rows(g) + 2 * RB)));
        plan.work.max_rows = plan.work.tasks.iter().map(|t| t.rows(g)).max().unwrap_or(0);
        let len = plan
            .work
            .tasks
            .iter()
            .map(|t| t.rows(g) * (shape.head_dim + 2))
            .sum();
        plan.work.scratch = vec![0f32; len];
        plan.others = (0..rope.specs().len())
            .map(|s| match s {
                0 => Vec::new(),
                _ => plan
                    .work
                    .rotations
                    .iter()
                    .map(|&(o, _)| (o, Rotation::new(&rope.specs()[s], -o)))
                    .collect(),
            })
            .collect();
        plan
    }

    /// Makes [`Work::rotations`] those of rope spec `want`.
    fn select(&mut self, want: usize) {
        if want != self.selected {
            std::mem::swap(&mut self.work.rotations, &mut self.others[self.selected]);
            std::mem::swap(&mut self.work.rotations, &mut self.others[want]);
            self.selected = want;
        }
    }

    /// Adds, for every kv head, the tasks of the query tokens `toks(kv_head)` over the keys
    /// `cuts[p]..cuts[p + 1]` of `seq`, masked from `diag` on and below `window`; `merged`:
    /// other tasks hold other parts of the rows' keys.
    fn push(
        &mut self,
        seq: &'a ForwardSeq<'a>,
        diag: usize,
        cuts: &[usize],
        merged: bool,
        window: Option<NonZeroUsize>,
        toks: impl Fn(usize) -> Vec<(usize, usize)>,
    ) {
        let pieces: Vec<_> = cuts
            .windows(2)
            .map(|keys| self.pieces(seq.shifts, keys[0], keys[1]))
            .collect();
        for kv_head in 0..self.work.shape.kv_heads {
            let toks = toks(kv_head);
            for (p, keys) in cuts.windows(2).enumerate() {
                self.work.tasks.push(Task {
                    context: seq.context,
                    new_rows: seq.new_slots,
                    kv_head,
                    toks: toks.clone(),
                    diag,
                    window,
                    k0: keys[0],
                    k1: keys[1],
                    merged,
                    pieces: pieces[p].0.clone(),
                    loads: pieces[p].1.clone(),
                });
            }
        }
    }

    /// Keys `k0..k1` as pieces of one offset each ([`Task::pieces`]), and where a task
    /// turns its queries ([`Task::loads`]).
    ///
    /// Each key block turns the queries to the offset of the piece that holds its first key
    /// and the other offsets' keys to it: a rule of the keys alone, so a row gets the same
    /// bits in every task (turning the queries costs about a vector rotation per row and
    /// a transpose, turning a key one; runs are long, so few keys turn).
    #[allow(clippy::type_complexity)]
    fn pieces(
        &mut self,
        shifts: &[KeyShift],
        k0: usize,
        k1: usize,
    ) -> (Vec<(usize, Option<usize>)>, Vec<(usize, Option<usize>)>) {
        let mut out = Vec::new();
        let mut at = k0;
        while at < k1 {
            let i = shifts.partition_point(|s| s.range.end <= at);
            let (end, rot) = match shifts.get(i) {
                Some(s) if s.range.start <= at => {
                    (s.range.end.min(k1), Some(self.rotation(s.offset)))
                }
                Some(s) => (s.range.start.min(k1), None),
                None => (k1, None),
            };
            out.push((end, rot));
            at = end;
        }
        let mut loads: Vec<(usize, Option<usize>)> = Vec::new();
        let mut first = 0;
        for j0 in (k0..k1).step_by(KB) {
            let j1 = (j0 + KB).min(k1);
            while out[first].0 <= j0 {
                first += 1;
            }
            let last = last_piece(&out, j1);
            let want = out[first].1;
            let target = self.offset(want);
            if loads.last().is_none_or(|l| self.offset(l.1) != target) {
                loads.push((j0, want));
            }
            for &(_, rot) in &out[first..=last] {
                let d = target - self.offset(rot);
                if d != 0 {
                    self.rotation(d);
                }
            }
        }
        (out, loads)
    }

    /// The offset of a piece's run ([`Task::pieces`]).
    fn offset(&self, rot: Option<usize>) -> i64 {
        offset_of(&self.work.rotations, rot)
    }

    /// The index in [`Work::rotations`] of `R(-offset)`, added on first use.
    fn rotation(&mut self, offset: i64) -> usize {
        if let Some(at) = self.work.rotations.iter().position(|r| r.0 == offset) {
            return at;
        }
        self.work
            .rotations
            .push((offset, Rotation::new(&self.rope.specs()[0], -offset)));
        self.work.rotations.len() - 1
    }
}

/// Fewest context keys that sequences must share for [`shared_prefixes`] to group them.
const MIN_SHARED: usize = 4 * KB;

/// Groups of decoding sequences (one new token each) whose contexts begin with the same
/// slots, at least [`MIN_SHARED`] of them: each group's members (indices into `seqs`) and
/// the length they share, a multiple of [`KB`]. A sequence that shares less with the
/// group's first member stays out of it.
pub(super) fn shared_prefixes(seqs: &[ForwardSeq<'_>]) -> Vec<(Vec<usize>, usize)> {
    let mut cand: Vec<usize> = (0..seqs.len())
        .filter(|&i| seqs[i].tokens.len() == 1 && seqs[i].context.len() >= MIN_SHARED)
        .collect();
    cand.sort_by_key(|&i| seqs[i].context[0]);
    let mut groups = Vec::new();
    for run in cand.chunk_by(|&a, &b| seqs[a].context[0] == seqs[b].context[0]) {
        let lead = seqs[run[0]].context;
        let mut len = usize::MAX;
        let mut members = vec![run[0]];
        for &i in &run[1..] {
            let common = common_prefix(lead, seqs[i].context);
            let common = shifts_agree(seqs[run[0]].shifts, seqs[i].shifts, common);
            if common >= MIN_SHARED {
                members.push(i);
                len = len.min(common);
            }
        }
        if members.len() > 1 {
            groups.push((members, len / KB * KB));
        }
    }
    groups
}

/// How many of the first `len` keys two contexts' shifts treat alike (`len` when the shifts
/// come from the slots, as [`leyline_kv::shift::key_shifts`] finds them).
fn shifts_agree(a: &[KeyShift], b: &[KeyShift], len: usize) -> usize {
    let offset_at = |s: &[KeyShift], i: usize| {
        s.iter()
            .find(|r| r.range.contains(&i))
            .map_or(0, |r| r.offset)
    };
    let mut edges: Vec<usize> = a
        .iter()
        .chain(b)
        .flat_map(|r| [r.range.start, r.range.end])
        .filter(|&x| x < len)
        .collect();
    edges.push(0);
    edges.sort_unstable();
    edges.dedup();
    edges
        .into_iter()
        .find(|&i| offset_at(a, i) != offset_at(b, i))
        .unwrap_or(len)
}

/// How many leading elements `a` and `b` share.
pub(super) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    // Whole chunks compare as slices (vectorized), then the first differing chunk by element.
    let whole = a[..n]
        .chunks(64)
        .zip(b[..n].chunks(64))
        .take_while(|(x, y)| x == y)
        .count()
        * 64;
    let whole = whole.min(n);
    whole
        + a[whole..n]
            .iter()
            .zip(&b[whole..n])
            .take_while(|(x, y)| x == y)
            .count()
}
