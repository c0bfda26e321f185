//! What one attention task is — its query rows, its stretch of keys, the pieces of one
//! offset those keys fall into — and the merge of split tasks' partial sums into the output.
//! The planner that cuts a batch into tasks is the caller's (it knows the batch).

use crate::rope::Rotation;
use std::num::NonZeroUsize;

/// Keys per block.
pub const KB: usize = 64;
/// Query rows per register block.
pub const RB: usize = 4;
/// Keys per span: a row's keys are cut at multiples of `SPAN` from key 0, each span gets its
/// own online softmax, and the spans are folded in key order (`fold`), whether one task
/// runs them all or a planner hands them to several (a split). So a row's bits depend only on
/// its keys, not on how a batch is cut. 512: a 16K-key decode still splits into 32 parts
/// (enough for any thread count), and a fold per 512 keys costs under 1% of their work.
pub const SPAN: usize = 512;

const _: () = assert!(SPAN.is_multiple_of(KB));

/// Query rows up to which a task takes the direct product ([`direct`]): a decode step's GQA
/// group (up to 8 query heads per kv head) fills one AVX2 vector of rows.
pub const DR: usize = 8;

/// Whether a task of `rows` query rows takes its scores with keys across vector lanes (a key
/// block transposed) instead of query rows: with [`DR`] rows or fewer, the 16 lanes of rows
/// would be mostly padding. Both sum each score in the same order (one FMA per head dim, in
/// order), so a row's bits do not depend on the choice.
pub fn direct(rows: usize) -> bool {
    rows <= DR
}

/// Head counts of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (each serves `heads / kv_heads` query heads).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

/// One piece of the work: the query tokens of one sequence (a block of its new tokens) or of
/// several decoding sequences that share a context prefix, one kv head, and a stretch of keys.
pub struct Task<'a> {
    /// Rows of the keys before the query tokens' own (for a shared prefix: any of the
    /// sequences' context, they hold the same rows there).
    pub context: &'a [u32],
    /// Rows of the sequence's new tokens' keys, which follow the context.
    pub new_rows: &'a [u32],
    /// The kv head.
    pub kv_head: usize,
    /// Per query token: its row in the flat batch, and where its `g` rows' partial sums
    /// go in the merge buffers (unread unless `merged`).
    pub toks: Vec<(usize, usize)>,
    /// Keys from here on are masked for some rows: row `r` sees key `j` iff
    /// `j < diag + r / g + 1`.
    pub diag: usize,
    /// A sliding window of `w` keys: row `r` sees key `j` only if `diag + r / g - j < w`
    /// (key indices, not encoded positions: after a splice the window follows the new
    /// indices). A row may then see no key of a task (part of a split row): its output is 0,
    /// its running max `-inf` and its sum 0, and the merge gives it weight 0. `None`: all
    /// keys up to the diagonal.
    pub window: Option<NonZeroUsize>,
    /// Keys `k0..k1` of the context followed by the new tokens; `k0` is a multiple of [`KB`]
    /// (key blocks fall at fixed keys).
    pub k0: usize,
    /// End of the task's keys.
    pub k1: usize,
    /// Whether other tasks cover other keys of the same query rows (partial sums merged in
    /// key order): then the task's keys lie in one [`SPAN`].
    pub merged: bool,
    /// The task's keys as consecutive pieces of one offset each: a piece ends at `.0`, and
    /// `.1` names the [`super::Work::rotations`] entry that turns the queries back by its
    /// run's offset (`None`: keys at their own positions).
    pub pieces: Vec<(usize, Option<usize>)>,
    /// Where the queries are turned (again): from key `.0` (a key block's start) on they are
    /// turned back by the offset of rotation `.1`, and a key block's keys of other offsets are
    /// turned to it by the difference. For the same bits in every cut, a block's offset is
    /// that of the piece holding its first key.
    pub loads: Vec<(usize, Option<usize>)>,
}

impl Task<'_> {
    /// Query rows of the task: its tokens times `g` query heads per kv head.
    pub fn rows(&self, g: usize) -> usize {
        self.toks.len() * g
    }
}

/// The offset of the run a piece's rotation entry turns back (0 for `None`).
pub fn offset_of(rotations: &[(i64, Rotation)], rot: Option<usize>) -> i64 {
    rot.map_or(0, |i| rotations[i].0)
}

/// The last of `pieces` (which end in order) that keys before `j1` reach.
pub fn last_piece(pieces: &[(usize, Option<usize>)], j1: usize) -> usize {
    pieces.partition_point(|p| p.0 < j1).min(pieces.len() - 1)
}

/// Folds a span's (or a split task's) partial state `(mb, lb, ob)` (running max, sum and
/// unnormalized value sums of one row) into the running `(ma, la, oa)`. A state with sum 0
/// saw no key: folding it changes nothing, and folding into it copies (so a row with one
/// part gets that part's bits). The kernel and [`write_out`] share this, so a row gets the
/// same bits whether one task folds its spans or the merge does.
#[inline]
pub(super) fn fold(ma: &mut f32, la: &mut f32, oa: &mut [f32], mb: f32, lb: f32, ob: &[f32]) {
    if lb == 0.0 {
        return;
    }
    if *la == 0.0 {
        (*ma, *la) = (mb, lb);
        oa.copy_from_slice(ob);
        return;
    }
    let m = ma.max(mb);
    let (ca, cb) = ((*ma - m).exp2(), (mb - m).exp2());
    *la = *la * ca + lb * cb;
    for (x, &y) in oa.iter_mut().zip(ob) {
        *x = *x * ca + y * cb;
    }
    *ma = m;
}

/// Writes `o / l` into `out` (zeros for a row that saw no key).
#[inline]
pub(super) fn finish(l: f32, o: &[f32], out: &mut [f32]) {
    if l > 0.0 {
        let inv = 1.0 / l;
        for (d, &x) in out.iter_mut().zip(o) {
            *d = x * inv;
        }
    } else {
        out.fill(0.0);
    }
}

/// [`finish`] with `o` in `out`'s place (the same arithmetic).
fn finish_in_place(l: f32, o: &mut [f32]) {
    if l > 0.0 {
        let inv = 1.0 / l;
        for x in o {
            *x *= inv;
        }
    } else {
        o.fill(0.0);
    }
}

/// Copies each task's rows from the task-major `scratch` to their places in `out`, merging
/// the parts of split tasks: [`fold`] over the parts in key order, then [`finish`]. A
/// merged task's part holds its rows' unnormalized value sums, max and sum.
pub(super) fn write_out(
    tasks: &[Task<'_>],
    scratch: &[f32],
    shape: Heads,
    merge_rows: usize,
    out: &mut [f32],
) {
    let (h, hd) = (shape.heads, shape.head_dim);
    let g = h / shape.kv_heads;
    let mut max = vec![f32::NEG_INFINITY; merge_rows];
    let mut sum = vec![0f32; merge_rows];
    // Where row `r` of task `t` goes in `out`, and its merge index.
    let place = |t: &Task<'_>, r: usize| {
        let head = t.kv_head * g + r % g;
        t.toks[r / g].0 * h * hd + head * hd
    };
    let merge_at = |t: &Task<'_>, r: usize| t.toks[r / g].1 + r % g;
    let offs: Vec<usize> = tasks
        .iter()
        .scan(0, |off, t| {
            let at = *off;
            *off += t.rows(g) * (hd + 2);
            Some(at)
        })
        .collect();
    let mut merged = Vec::new();
    for (i, t) in tasks.iter().enumerate() {
        let rows = t.rows(g);
        let (o, _) = scratch[offs[i]..offs[i] + rows * (hd + 2)].split_at(rows * hd);
        if t.merged {
            merged.push(i);
            continue;
        }
        for (r, src) in o.chunks_exact(hd).enumerate() {
            out[place(t, r)..][..hd].copy_from_slice(src);
        }
    }
    // Parts in key order: the fold is not associative in floats.
    merged.sort_by_key(|&i| tasks[i].k0);
    for &i in &merged {
        let t = &tasks[i];
        let rows = t.rows(g);
        let (o, ml) = scratch[offs[i]..offs[i] + rows * (hd + 2)].split_at(rows * hd);
        for (r, src) in o.chunks_exact(hd).enumerate() {
            let mr = merge_at(t, r);
            let dst = &mut out[place(t, r)..][..hd];
            fold(&mut max[mr], &mut sum[mr], dst, ml[r], ml[rows + r], src);
        }
    }
    let mut done = vec![false; merge_rows];
    for &i in &merged {
        let t = &tasks[i];
        for r in 0..t.rows(g) {
            let mr = merge_at(t, r);
            if !std::mem::replace(&mut done[mr], true) {
                finish_in_place(sum[mr], &mut out[place(t, r)..][..hd]);
            }
        }
    }
}
