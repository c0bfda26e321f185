//! What one attention task is — its query rows, its stretch of keys, the pieces of one
//! offset those keys fall into — and the merge of split tasks' partial sums into the output.
//! The planner that cuts a batch into tasks is the caller's (it knows the batch).

use crate::rope::Rotation;
use std::num::NonZeroUsize;

/// Keys per block.
pub const KB: usize = 64;
/// Query rows per register block.
pub const RB: usize = 4;

/// Whether a task of `rows` query rows takes dot products straight from the key rows: with
/// one register block of rows or fewer, the transposed product's lanes would be mostly
/// padding. The direct product costs what a block's keys cost, so its blocks may end short.
pub fn direct(rows: usize) -> bool {
    rows <= RB
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
    /// Keys `k0..k1` of the context followed by the new tokens.
    pub k0: usize,
    /// End of the task's keys.
    pub k1: usize,
    /// Whether other tasks cover other keys of the same query rows (partial sums merged).
    pub merged: bool,
    /// Whether this is the task with the first keys of its rows (it finishes the merge).
    pub first: bool,
    /// The task's keys as consecutive pieces of one offset each: a piece ends at `.0`, and
    /// `.1` names the [`super::Work::rotations`] entry that turns the queries back by its
    /// run's offset (`None`: keys at their own positions).
    pub pieces: Vec<(usize, Option<usize>)>,
    /// Where the queries are turned (again): from key `.0` on they are turned back by the
    /// offset of rotation `.1`, and a key block's keys of other offsets are turned to it by
    /// the difference. A key block ends at the next entry.
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

/// Copies each task's rows from the task-major `scratch` to their places in `out`, merging
/// the parts of split tasks: `out = sum_p w_p o_p / sum_p w_p` with
/// `w_p = l_p 2^(m_p - max_p m_p)`, where each part's `o_p` is already divided by its sum `l_p`
/// (a part in which the row sees no key, `l_p = 0`, weighs 0).
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
    let mut den = vec![0f32; merge_rows];
    // Where row `r` of task `t` goes in `out`, and its merge index.
    let place = |t: &Task<'_>, r: usize| {
        let head = t.kv_head * g + r % g;
        t.toks[r / g].0 * h * hd + head * hd
    };
    let merge_at = |t: &Task<'_>, r: usize| t.toks[r / g].1 + r % g;
    let mut off = 0;
    for t in tasks {
        let rows = t.rows(g);
        if t.merged {
            let m = &scratch[off + rows * hd..off + rows * (hd + 1)];
            for (r, &mr) in m.iter().enumerate() {
                let a = &mut max[merge_at(t, r)];
                *a = a.max(mr);
                out[place(t, r)..][..hd].fill(0.0);
            }
        }
        off += rows * (hd + 2);
    }
    let mut off = 0;
    for t in tasks {
        let rows = t.rows(g);
        let (o, ml) = scratch[off..off + rows * (hd + 2)].split_at(rows * hd);
        for (r, src) in o.chunks_exact(hd).enumerate() {
            let dst = &mut out[place(t, r)..][..hd];
            if !t.merged {
                dst.copy_from_slice(src);
                continue;
            }
            let mr = merge_at(t, r);
            let l = ml[rows + r];
            // Tested first: `2^(-inf - -inf)` would be NaN where every part is empty so far.
            let w = if l > 0.0 {
                l * (ml[r] - max[mr]).exp2()
            } else {
                0.0
            };
            den[mr] += w;
            for (d, &x) in dst.iter_mut().zip(src) {
                *d += w * x;
            }
        }
        off += rows * (hd + 2);
    }
    for t in tasks.iter().filter(|t| t.merged && t.first) {
        for r in 0..t.rows(g) {
            let inv = 1.0 / den[merge_at(t, r)];
            for d in &mut out[place(t, r)..][..hd] {
                *d *= inv;
            }
        }
    }
}
