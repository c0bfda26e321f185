//! Causal GQA attention that reads the pool's key and value rows in place, in tiles.
//!
//! Design decision: one task is one (sequence, kv head, block of query tokens). Its query rows
//! (the block's tokens times the query heads that share the kv head) meet the context in
//! blocks of [`KB`] keys. The queries are transposed once per task, so a block's scores come
//! out transposed too (`[key][query row]`, keys broadcast from their pool rows into
//! accumulators that span 64 query rows): the online softmax then runs down the keys with the
//! query rows across vector lanes, and the causal mask of a key is a prefix of its row. Value
//! sums read the pool's value rows. With f32 storage nothing is copied; bf16/f16 blocks are
//! converted once. Scores are kept in log2 units (the query is pre-scaled by `log2(e)`), so
//! the softmax needs only `exp2`, computed by a polynomial the compiler vectorizes.
//!
//! Decode batches have one query token per sequence, so few tasks and few rows per task: a
//! task then covers part of the context only (its running max and sum merged afterwards),
//! so that both threads stay busy, and scores are dot products of the few query rows with
//! the key rows, which wastes no vector lanes on absent rows. Decoding sequences whose
//! contexts begin with the same slots (agent sessions behind one system prompt, as the
//! prefix tree shares it) read that prefix once: its tasks hold every such sequence's query
//! rows, each sequence's own tasks cover the keys after it, and the parts are merged the
//! same way. The tasks depend on the batch only, so a forward pass plans them once
//! ([`Plan`]) for all its layers.

use crate::fastmath::exp2;
use crate::pool::SpinPool;
use crate::ForwardSeq;
use leyline_kv::storage::RowsRef;
use leyline_kv::KvStorage;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Keys per block.
const KB: usize = 64;
/// Query tokens per task.
const QB: usize = 64;
/// Query rows per register block.
const RB: usize = 4;
/// Head-dim lanes per value accumulator row in the portable kernel; the x86 kernels use
/// as many as their registers hold (see [`task_for`]).
const DC: usize = 16;
/// Fewest context keys a split task covers.
const MIN_SPLIT: usize = 4 * KB;
/// Tasks per thread below which the context is split.
const TASKS_PER_THREAD: usize = 4;

/// Head counts of an attention call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The batch's query rows: row `t` starts at `t * stride` and holds every head's query
/// (rotated, unscaled) in its first `heads * head_dim` values; the rest of a row is not read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Queries<'a> {
    pub rows: &'a [f32],
    pub stride: usize,
}

/// One piece of the work: the query tokens of one sequence (a block of its new tokens) or of
/// several decoding sequences that share a context prefix, one kv head, and a stretch of keys.
struct Task<'a> {
    /// The sequence whose context and new slots hold the keys (for a shared prefix: any of
    /// the sequences, they hold the same slots there).
    seq: &'a ForwardSeq<'a>,
    kv_head: usize,
    /// Per query token: its row in the flat batch, and where its `g` rows' partial sums
    /// go in the merge buffers (unread unless `merged`).
    toks: Vec<(usize, usize)>,
    /// Keys from here on are masked for some rows: row `r` sees key `j` iff
    /// `j < diag + r / g + 1`.
    diag: usize,
    /// Keys `k0..k1` of `seq`'s context followed by its new tokens.
    k0: usize,
    k1: usize,
    /// Whether other tasks cover other keys of the same query rows (partial sums merged).
    merged: bool,
    /// Whether this is the task with the first keys of its rows (it finishes the merge).
    first: bool,
}

impl Task<'_> {
    fn rows(&self, g: usize) -> usize {
        self.toks.len() * g
    }
}

/// Per-thread buffers, sized for one task.
struct Scratch {
    /// Query rows, scaled (the direct-score path reads them).
    q: Vec<f32>,
    /// The same rows transposed, `[head_dim][lanes]`.
    qt: Vec<f32>,
    /// A key block's K and V rows converted to f32 when the storage is not f32.
    kb: Vec<f32>,
    vb: Vec<f32>,
    /// The row of a key past the block's end.
    zero: Vec<f32>,
    /// Scores, then probabilities, `[KB][lanes]`: a key's scores for every query row.
    st: Vec<f32>,
    o: Vec<f32>,
    /// Per query row: running max, running sum, the last block's correction factor.
    m: Vec<f32>,
    l: Vec<f32>,
    corr: Vec<f32>,
}

/// Query rows padded to whole 16-lane vectors.
fn lanes_of(rows: usize) -> usize {
    rows.div_ceil(16) * 16
}

impl Scratch {
    fn new(rows: usize, hd: usize) -> Self {
        let lanes = lanes_of(rows);
        Self {
            q: vec![0.0; lanes * hd],
            qt: vec![0.0; hd * lanes],
            kb: vec![0.0; KB * hd],
            vb: vec![0.0; KB * hd],
            zero: vec![0.0; hd],
            st: vec![0.0; KB * lanes],
            o: vec![0.0; lanes * hd],
            m: vec![0.0; lanes],
            l: vec![0.0; lanes],
            corr: vec![0.0; lanes],
        }
    }
}

/// How rows of a storage dtype become f32.
trait Load<T>: Copy {
    fn f32(self, x: T) -> f32;
    /// The rows themselves when they already are f32.
    fn in_place(self, rows: &[T]) -> Option<&[f32]>;
}

/// f32 storage: rows are read where they are.
#[derive(Clone, Copy)]
struct AsIs;

impl Load<f32> for AsIs {
    #[inline(always)]
    fn f32(self, x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn in_place(self, rows: &[f32]) -> Option<&[f32]> {
        Some(rows)
    }
}

/// bf16 bit patterns (converted exactly).
#[derive(Clone, Copy)]
struct FromBf16;

impl Load<u16> for FromBf16 {
    #[inline(always)]
    fn f32(self, b: u16) -> f32 {
        leyline_kv::rotate::bf16_to_f32(b)
    }
    #[inline(always)]
    fn in_place(self, _: &[u16]) -> Option<&[f32]> {
        None
    }
}

/// f16 bit patterns (converted exactly).
#[derive(Clone, Copy)]
struct FromF16;

impl Load<u16> for FromF16 {
    #[inline(always)]
    fn f32(self, b: u16) -> f32 {
        leyline_kv::rotate::f16_to_f32(b)
    }
    #[inline(always)]
    fn in_place(self, _: &[u16]) -> Option<&[f32]> {
        None
    }
}

/// How a split task's partial sums are merged with the other parts of its rows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Merge {
    /// The task covers all keys of its rows.
    Alone,
    /// Parts are merged; part 0 finishes the merge.
    Leads,
    /// Parts are merged; another task finishes the merge.
    Joins,
}

/// The work of one attention call, the same on every layer of a forward pass: the tasks,
/// and the buffers their outputs merge in.
pub(crate) struct Plan<'a> {
    shape: Heads,
    tasks: Vec<Task<'a>>,
    /// Query rows whose partial sums are merged.
    merge_rows: usize,
    /// The most query rows of one task.
    max_rows: usize,
    /// Task-major output: task i owns its rows' `head_dim` values, then each row's running
    /// max and sum. Every task writes all of its piece, so layers reuse it as it is.
    scratch: Vec<f32>,
}

impl<'a> Plan<'a> {
    /// The tasks for `seqs` on `threads` threads.
    pub(crate) fn new(seqs: &'a [ForwardSeq<'a>], shape: Heads, threads: usize) -> Self {
        let Heads {
            heads: h,
            kv_heads: kvh,
            ..
        } = shape;
        let g = h / kvh;
        let units: usize = seqs.iter().map(|s| s.tokens.len().div_ceil(QB) * kvh).sum();
        let wanted = TASKS_PER_THREAD * threads;
        let mut plan = Self {
            shape,
            tasks: Vec::new(),
            merge_rows: 0,
            max_rows: 0,
            scratch: Vec::new(),
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
        let mut shared = vec![0usize; seqs.len()];
        let mut base = vec![0usize; seqs.len()];
        for (members, len) in shared_prefixes(seqs) {
            for chunk in members.chunks(QB) {
                for &i in chunk {
                    shared[i] = len;
                    base[i] = plan.merge_rows;
                    plan.merge_rows += kvh * g;
                }
                let parts = wanted
                    .div_ceil(kvh * members.len().div_ceil(QB))
                    .min(len / MIN_SPLIT)
                    .max(1);
                let cuts: Vec<usize> = (0..=parts).map(|p| p * len / parts / KB * KB).collect();
                plan.push(&seqs[chunk[0]], len, &cuts, Merge::Leads, |kv_head| {
                    chunk
                        .iter()
                        .map(|&i| (rows_at[i], base[i] + kv_head * g))
                        .collect()
                });
            }
        }
        for (i, s) in seqs.iter().enumerate() {
            let (t, ctx, row) = (s.tokens.len(), s.context.len(), rows_at[i]);
            if shared[i] > 0 {
                // One new token; the keys from the end of the shared prefix on.
                let skip = shared[i];
                let parts = wanted.div_ceil(units).min((ctx - skip) / MIN_SPLIT).max(1);
                let mut cuts: Vec<usize> = (0..parts)
                    .map(|p| skip + p * (ctx - skip) / parts / KB * KB)
                    .collect();
                cuts.push(ctx + 1);
                plan.push(s, ctx, &cuts, Merge::Joins, |kv_head| {
                    vec![(row, base[i] + kv_head * g)]
                });
                continue;
            }
            // Only context keys are split: every row sees all of them, so no part is empty.
            let parts = if units >= wanted {
                1
            } else {
                wanted.div_ceil(units).min(ctx / MIN_SPLIT).max(1)
            };
            let merge = if parts > 1 {
                Merge::Leads
            } else {
                Merge::Alone
            };
            for t0 in (0..t).step_by(QB) {
                let t1 = (t0 + QB).min(t);
                let mut cuts: Vec<usize> = (0..parts).map(|p| p * ctx / parts / KB * KB).collect();
                cuts.push(ctx + t1);
                let at = plan.merge_rows;
                plan.push(s, ctx + t0, &cuts, merge, |kv_head| {
                    (t0..t1)
                        .map(|i| (row + i, at + (kv_head * (t1 - t0) + i - t0) * g))
                        .collect()
                });
                if merge != Merge::Alone {
                    plan.merge_rows += kvh * (t1 - t0) * g;
                }
            }
        }
        // Costliest first (keys times rows, plus a per-key share), so the dynamic hand-out
        // ends with cheap tasks.
        plan.tasks
            .sort_by_key(|t| std::cmp::Reverse((t.k1 - t.k0) * (t.rows(g) + 2 * RB)));
        plan.max_rows = plan.tasks.iter().map(|t| t.rows(g)).max().unwrap_or(0);
        let len = plan
            .tasks
            .iter()
            .map(|t| t.rows(g) * (shape.head_dim + 2))
            .sum();
        plan.scratch = vec![0f32; len];
        plan
    }

    /// Adds, for every kv head, the tasks of the query tokens `toks(kv_head)` over the keys
    /// `cuts[p]..cuts[p + 1]` of `seq`, masked from `diag` on.
    fn push(
        &mut self,
        seq: &'a ForwardSeq<'a>,
        diag: usize,
        cuts: &[usize],
        merge: Merge,
        toks: impl Fn(usize) -> Vec<(usize, usize)>,
    ) {
        for kv_head in 0..self.shape.kv_heads {
            let toks = toks(kv_head);
            for (p, keys) in cuts.windows(2).enumerate() {
                self.tasks.push(Task {
                    seq,
                    kv_head,
                    toks: toks.clone(),
                    diag,
                    k0: keys[0],
                    k1: keys[1],
                    merged: merge != Merge::Alone,
                    first: p == 0 && merge != Merge::Joins,
                });
            }
        }
    }
}

/// Writes into `out: [n, heads * head_dim]` the causal attention of the batch's queries `q`
/// over each sequence's context followed by its new slots (the sequences `plan` was made
/// for), reading keys and values from `kv` at `layer`. The new slots must be written.
pub(crate) fn attend(
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    q: Queries<'_>,
    plan: &mut Plan<'_>,
    out: &mut [f32],
) {
    attend_with(Isa::detect(), pool, kv, layer, q, plan, out)
}

/// [`attend`] with the kernel compiled for `isa`, which the CPU must support.
fn attend_with(
    isa: Isa,
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    q: Queries<'_>,
    plan: &mut Plan<'_>,
    out: &mut [f32],
) {
    let shape = plan.shape;
    let (g, hd) = (shape.heads / shape.kv_heads, shape.head_dim);
    let tasks = &plan.tasks;
    {
        let mut pieces = Vec::with_capacity(tasks.len());
        let mut rest = plan.scratch.as_mut_slice();
        for t in tasks {
            let (a, b) = rest.split_at_mut(t.rows(g) * (hd + 2));
            pieces.push(Mutex::new(a));
            rest = b;
        }
        let (kr, vr) = (kv.k_rows(layer), kv.v_rows(layer));
        let (kw, vw) = (kv.geometry().k_width(), kv.geometry().v_width);
        let next = AtomicUsize::new(0);
        // Sized for the largest task, not for `QB` tokens: a decode step's tasks have a
        // few rows, and this is allocated per thread and layer.
        let max_rows = plan.max_rows;
        pool.run(&|_, _| {
            let mut buf = Scratch::new(max_rows, hd);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(task) = tasks.get(i) else { break };
                let mut o = pieces[i].lock().unwrap_or_else(|e| e.into_inner());
                let job = Job {
                    task,
                    q,
                    shape,
                    kw,
                    vw,
                };
                match (kr, vr) {
                    (RowsRef::F32(k), RowsRef::F32(v)) => {
                        isa.run(&job, k, v, AsIs, &mut buf, &mut o)
                    }
                    (RowsRef::Bf16(k), RowsRef::Bf16(v)) => {
                        isa.run(&job, k, v, FromBf16, &mut buf, &mut o)
                    }
                    (RowsRef::F16(k), RowsRef::F16(v)) => {
                        isa.run(&job, k, v, FromF16, &mut buf, &mut o)
                    }
                    _ => unreachable!("key and value rows share one dtype"),
                }
            }
        });
    }
    write_out(tasks, &plan.scratch, shape, plan.merge_rows, out);
}

/// Fewest context keys that sequences must share for [`shared_prefixes`] to group them.
const MIN_SHARED: usize = 4 * KB;

/// Groups of decoding sequences (one new token each) whose contexts begin with the same
/// slots, at least [`MIN_SHARED`] of them: each group's members (indices into `seqs`) and
/// the length they share, a multiple of [`KB`]. A sequence that shares less with the
/// group's first member stays out of it.
fn shared_prefixes(seqs: &[ForwardSeq<'_>]) -> Vec<(Vec<usize>, usize)> {
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

/// How many leading elements `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
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

/// Copies each task's rows from the task-major `scratch` to their places in `out`, merging
/// the parts of split tasks: `out = sum_p w_p o_p / sum_p w_p` with
/// `w_p = l_p 2^(m_p - max_p m_p)`, where each part's `o_p` is already divided by its sum `l_p`.
fn write_out(
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
            let w = ml[rows + r] * (ml[r] - max[mr]).exp2();
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

/// What one task reads.
struct Job<'a> {
    task: &'a Task<'a>,
    q: Queries<'a>,
    shape: Heads,
    kw: usize,
    vw: usize,
}

/// The instruction set the kernel is compiled for, picked at run time.
#[derive(Debug, Clone, Copy)]
enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// Every variant this CPU can run, the portable one first.
    #[cfg(test)]
    fn available() -> Vec<Self> {
        let mut v = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                v.push(Isa::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Isa::Avx512);
            }
        }
        v
    }

    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    fn run<T: Copy>(
        self,
        job: &Job<'_>,
        k: &[T],
        v: &[T],
        ld: impl Load<T>,
        buf: &mut Scratch,
        out: &mut [f32],
    ) {
        match self {
            Isa::Portable => task::<T, DC>(self, job, k, v, ld, buf, out),
            // SAFETY: only `detect` and `available` make this variant, after the CPU reported AVX-512F.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { task_avx512(self, job, k, v, ld, buf, out) },
            // SAFETY: only `detect` and `available` make this variant, after the CPU reported AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { task_avx2(self, job, k, v, ld, buf, out) },
        }
    }

    /// `st[j][r] = q[r] . k[j]` for one key block and the first `rows` query rows of `qb:
    /// [lanes][hd]` (scaled, untransposed); lanes from `rows` on are zero, and so may be the
    /// scores of keys from `nb` on (the caller masks them).
    #[allow(clippy::too_many_arguments)]
    fn scores_direct(
        self,
        qb: &[f32],
        rows: usize,
        lanes: usize,
        krows: &[&[f32]; KB],
        nb: usize,
        st: &mut [f32],
        hd: usize,
    ) {
        assert!(rows <= lanes && qb.len() >= rows * hd && st.len() >= KB * lanes);
        assert!(krows.iter().all(|r| r.len() >= hd));
        match self {
            // SAFETY: the CPU has AVX-512F (see `run`), `hd` is a multiple of 16, and the
            // asserts above are the bounds `scores_few_avx512` relies on.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if hd.is_multiple_of(16) => unsafe {
                x86::scores_few_avx512(qb, rows, lanes, krows, nb, st, hd)
            },
            // SAFETY: the CPU has AVX2 and FMA (see `run`), `hd` is a multiple of 8, and the
            // asserts above are the bounds `scores_few_avx2` relies on.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if hd.is_multiple_of(8) => unsafe {
                x86::scores_few_avx2(qb, rows, lanes, krows, nb, st, hd)
            },
            _ => {
                for (srow, kr) in st.chunks_exact_mut(lanes).zip(krows) {
                    for (r, x) in srow.iter_mut().enumerate() {
                        *x = if r < rows {
                            dot(&qb[r * hd..(r + 1) * hd], kr)
                        } else {
                            0.0
                        };
                    }
                }
            }
        }
    }

    /// `st[j][r] = q[r] . k[j]` for one key block, from the transposed queries
    /// `qt: [hd][lanes]` (`lanes` a multiple of 16).
    fn scores(self, qt: &[f32], lanes: usize, krows: &[&[f32]; KB], st: &mut [f32], hd: usize) {
        assert!(lanes.is_multiple_of(16) && qt.len() >= hd * lanes && st.len() >= KB * lanes);
        assert!(krows.iter().all(|r| r.len() >= hd));
        match self {
            Isa::Portable => scores_portable(qt, lanes, krows, st, hd),
            // SAFETY: the CPU has AVX-512F (see `run`), and the asserts above are the bounds
            // `scores_avx512` relies on.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { x86::scores_avx512(qt, lanes, krows, st, hd) },
            // SAFETY: the CPU has AVX2 and FMA (see `run`), and the asserts above are the
            // bounds `scores_avx2` relies on.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { x86::scores_avx2(qt, lanes, krows, st, hd) },
        }
    }
}

/// `task` compiled for an instruction set; callers must have checked that the CPU has it.
/// `$w` is the value accumulators' width per row: [`RB`] rows of it take 16 of AVX-512's 32
/// registers, and 8 of AVX2's 16 (at 16 registers, all of them, AVX2 spilled: prefill
/// attention took 2.5x as long).
macro_rules! task_for {
    ($name:ident, $features:literal, $w:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<T: Copy>(
            isa: Isa,
            job: &Job<'_>,
            k: &[T],
            v: &[T],
            ld: impl Load<T>,
            buf: &mut Scratch,
            out: &mut [f32],
        ) {
            task::<T, $w>(isa, job, k, v, ld, buf, out)
        }
    };
}
task_for!(task_avx512, "avx512f", 64);
task_for!(task_avx2, "avx2,fma", 16);

/// Runs one task into `out` (its rows, token-major, heads within a token).
///
/// Per key block: scores land transposed (`st[key][row]`), so the online softmax runs down
/// the keys with the query rows across vector lanes, and the masks of the causal diagonal
/// are prefixes of a key's row. With f32 storage the key and value rows are read in place.
#[inline(always)]
fn task<T: Copy, const W: usize>(
    isa: Isa,
    job: &Job<'_>,
    k: &[T],
    v: &[T],
    ld: impl Load<T>,
    buf: &mut Scratch,
    out: &mut [f32],
) {
    let Job {
        task,
        q,
        shape,
        kw,
        vw,
    } = *job;
    let (h, hd) = (shape.heads, shape.head_dim);
    let g = h / shape.kv_heads;
    let seq = task.seq;
    let rows = task.rows(g);
    let padded = rows.div_ceil(RB) * RB;
    let lanes = lanes_of(rows);
    let c = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    let Scratch {
        q: qb,
        qt,
        kb,
        vb,
        zero,
        st,
        o,
        m,
        l,
        corr,
    } = buf;
    // With a register block's rows or fewer, dot products straight from the key rows are
    // cheaper than the transposed product, whose lanes would be mostly padding.
    let direct = padded == RB;
    for r in 0..lanes {
        let dst = &mut qb[r * hd..(r + 1) * hd];
        if r < rows {
            let head = task.kv_head * g + r % g;
            let src = task.toks[r / g].0 * q.stride + head * hd;
            for (d, &x) in dst.iter_mut().zip(&q.rows[src..src + hd]) {
                *d = x * c;
            }
        } else {
            dst.fill(0.0);
        }
    }
    if !direct {
        for (d, col) in qt.chunks_exact_mut(lanes).take(hd).enumerate() {
            for (x, row) in col.iter_mut().zip(qb.chunks_exact(hd)) {
                *x = row[d];
            }
        }
    }
    m[..lanes].fill(f32::NEG_INFINITY);
    l[..lanes].fill(0.0);
    o[..padded * hd].fill(0.0);
    let ctx = seq.context.len();
    // Key and value rows both hold the kv heads side by side.
    let off = task.kv_head * hd;
    let slot = |j: usize| {
        (if j < ctx {
            seq.context[j]
        } else {
            seq.new_slots[j - ctx]
        }) as usize
    };
    let (kf, vf) = (ld.in_place(k), ld.in_place(v));
    // Keys from here on are masked for some rows: row `r` sees key `j` iff
    // `j < diag + r / g + 1`.
    let diag = task.diag;
    for j0 in (task.k0..task.k1).step_by(KB) {
        let nb = KB.min(task.k1 - j0);
        // The next block's rows sit at scattered slots, which hardware prefetchers do not
        // follow: ask for them while this block computes.
        for j in j0 + KB..(j0 + 2 * KB).min(task.k1) {
            let s = slot(j);
            prefetch(&k[s * kw + off..s * kw + off + hd]);
            prefetch(&v[s * vw + off..s * vw + off + hd]);
        }
        let slots: [usize; KB] = std::array::from_fn(|jj| if jj < nb { slot(j0 + jj) } else { 0 });
        if kf.is_none() {
            for (jj, &s) in slots[..nb].iter().enumerate() {
                let (kr, vr) = (&k[s * kw + off..][..hd], &v[s * vw + off..][..hd]);
                for (d, &x) in kb[jj * hd..(jj + 1) * hd].iter_mut().zip(kr) {
                    *d = ld.f32(x);
                }
                for (d, &x) in vb[jj * hd..(jj + 1) * hd].iter_mut().zip(vr) {
                    *d = ld.f32(x);
                }
            }
        }
        let zero = &zero[..hd];
        let krows = block_rows(kf, |jj| slots[jj] * kw + off, kb, zero, nb, hd);
        let vrows = block_rows(vf, |jj| slots[jj] * vw + off, vb, zero, nb, hd);
        if direct {
            isa.scores_direct(qb, rows, lanes, &krows, nb, st, hd);
        } else {
            isa.scores(qt, lanes, &krows, st, hd);
        }
        if j0 + KB > diag {
            for (jj, srow) in st.chunks_exact_mut(lanes).enumerate() {
                let j = j0 + jj;
                let hidden = if jj >= nb {
                    lanes
                } else {
                    (j.saturating_sub(diag) * g).min(lanes)
                };
                srow[..hidden].fill(f32::NEG_INFINITY);
            }
        }
        softmax_block(st, lanes, m, l, corr);
        for (r, &cr) in corr[..padded].iter().enumerate() {
            if cr != 1.0 {
                for x in &mut o[r * hd..(r + 1) * hd] {
                    *x *= cr;
                }
            }
        }
        values::<W>(st, lanes, &vrows, o, padded, hd, nb);
    }
    for r in 0..rows {
        let inv = 1.0 / l[r];
        for (d, &x) in out[r * hd..(r + 1) * hd]
            .iter_mut()
            .zip(&o[r * hd..(r + 1) * hd])
        {
            *d = x * inv;
        }
    }
    out[rows * hd..rows * (hd + 1)].copy_from_slice(&m[..rows]);
    out[rows * (hd + 1)..rows * (hd + 2)].copy_from_slice(&l[..rows]);
}

/// A key block's rows for one kv head: in place in `rows` (at `at(jj)`) when the storage is
/// f32, else the converted rows of `conv`; `zero` past the block's `nb` keys.
#[inline(always)]
fn block_rows<'a>(
    rows: Option<&'a [f32]>,
    at: impl Fn(usize) -> usize,
    conv: &'a [f32],
    zero: &'a [f32],
    nb: usize,
    hd: usize,
) -> [&'a [f32]; KB] {
    std::array::from_fn(|jj| match (jj < nb, rows) {
        (false, _) => zero,
        (true, Some(f)) => &f[at(jj)..at(jj) + hd],
        (true, None) => &conv[jj * hd..(jj + 1) * hd],
    })
}

/// One block's online softmax, 16 query rows at a time: updates each row's running max `m`
/// and sum `l`, turns the scores `st` into `2^(s - m)`, and leaves in `corr` the factor by
/// which the row's earlier value sums must be scaled.
#[inline(always)]
fn softmax_block(st: &mut [f32], lanes: usize, m: &mut [f32], l: &mut [f32], corr: &mut [f32]) {
    for c0 in (0..lanes).step_by(16) {
        let at = |jj: usize| jj * lanes + c0;
        let mut mx: [f32; 16] = m[c0..c0 + 16].try_into().expect("16 lanes");
        for jj in 0..KB {
            let s: &[f32; 16] = st[at(jj)..at(jj) + 16].try_into().expect("16 lanes");
            for (a, &x) in mx.iter_mut().zip(s) {
                *a = a.max(x);
            }
        }
        let mut sum = [0f32; 16];
        for jj in 0..KB {
            let s: &mut [f32; 16] = (&mut st[at(jj)..at(jj) + 16]).try_into().expect("16 lanes");
            for ((x, a), &mr) in s.iter_mut().zip(&mut sum).zip(&mx) {
                *x = exp2(*x - mr);
                *a += *x;
            }
        }
        let rows = c0..c0 + 16;
        for ((((mo, lo), co), &mr), &sr) in m[rows.clone()]
            .iter_mut()
            .zip(&mut l[rows.clone()])
            .zip(&mut corr[rows])
            .zip(&mx)
            .zip(&sum)
        {
            let cr = exp2(*mo - mr);
            *co = cr;
            *lo = *lo * cr + sr;
            *mo = mr;
        }
    }
}

/// Hints the CPU to bring `row` into the cache; no effect on results.
#[inline(always)]
fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(row);
        let base = row.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults or writes, and `base + off` stays inside `row`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// `q . k`, in 16 independent accumulators so the loop vectorizes.
#[inline(always)]
fn dot(q: &[f32], k: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let full = q.len() / 16 * 16;
    for (qc, kc) in q[..full].chunks_exact(16).zip(k[..full].chunks_exact(16)) {
        for ((a, &x), &y) in acc.iter_mut().zip(qc).zip(kc) {
            *a = x.mul_add(y, *a);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (&x, &y) in q[full..].iter().zip(&k[full..q.len()]) {
        sum = x.mul_add(y, sum);
    }
    sum
}

/// [`Isa::scores`] without SIMD intrinsics: four keys against 16 query lanes at a time.
fn scores_portable(qt: &[f32], lanes: usize, krows: &[&[f32]; KB], st: &mut [f32], hd: usize) {
    for c0 in (0..lanes).step_by(16) {
        for (kg, sg) in krows.chunks_exact(4).zip(st.chunks_exact_mut(4 * lanes)) {
            let mut acc = [[0f32; 16]; 4];
            for (d, col) in qt.chunks_exact(lanes).take(hd).enumerate() {
                let qv: &[f32; 16] = col[c0..c0 + 16].try_into().expect("16 lanes");
                for (a, kr) in acc.iter_mut().zip(kg) {
                    let kd = kr[d];
                    for (x, &y) in a.iter_mut().zip(qv) {
                        *x = kd.mul_add(y, *x);
                    }
                }
            }
            for (a, srow) in acc.iter().zip(sg.chunks_exact_mut(lanes)) {
                srow[c0..c0 + 16].copy_from_slice(a);
            }
        }
    }
}

/// The score products with intrinsics: the compiler does not keep a `[keys][lanes]`
/// accumulator tile in registers on its own.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::KB;
    use std::arch::x86_64::*;

    /// [`super::Isa::scores`] with AVX-512F: 4 keys x 64 query lanes in 16 registers, then
    /// 4 x 32 and 4 x 16 for the lanes left over.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `lanes % 16 == 0`, `qt.len() >= hd * lanes`,
    /// `st.len() >= KB * lanes` and every key row holds `hd` values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_avx512(
        qt: &[f32],
        lanes: usize,
        krows: &[&[f32]; KB],
        st: &mut [f32],
        hd: usize,
    ) {
        let mut c0 = 0;
        while c0 < lanes {
            let left = (lanes - c0) / 16;
            // SAFETY (all three): lanes `c0..c0 + 16 n` lie within `lanes`, and the
            // caller's bounds cover the rest.
            if left >= 4 {
                unsafe { group_avx512::<4>(qt, lanes, krows, st, hd, c0) };
                c0 += 64;
            } else if left >= 2 {
                unsafe { group_avx512::<2>(qt, lanes, krows, st, hd, c0) };
                c0 += 32;
            } else {
                unsafe { group_avx512::<1>(qt, lanes, krows, st, hd, c0) };
                c0 += 16;
            }
        }
    }

    /// Lanes `c0..c0 + 16 N` of [`scores_avx512`].
    ///
    /// # Safety
    /// As [`scores_avx512`], and `c0 + 16 N <= lanes`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group_avx512<const N: usize>(
        qt: &[f32],
        lanes: usize,
        krows: &[&[f32]; KB],
        st: &mut [f32],
        hd: usize,
        c0: usize,
    ) {
        for (jb, kg) in krows.chunks_exact(4).enumerate() {
            let mut acc = [[_mm512_setzero_ps(); N]; 4];
            for d in 0..hd {
                // SAFETY: `d * lanes + c0 + 16 N <= hd * lanes <= qt.len()`.
                let col = unsafe { qt.as_ptr().add(d * lanes + c0) };
                let mut q = [_mm512_setzero_ps(); N];
                for (i, x) in q.iter_mut().enumerate() {
                    // SAFETY: within the column, as above.
                    *x = unsafe { _mm512_loadu_ps(col.add(16 * i)) };
                }
                for (a, kr) in acc.iter_mut().zip(kg) {
                    // SAFETY: key rows hold `hd` values.
                    let k = _mm512_set1_ps(unsafe { *kr.get_unchecked(d) });
                    for (x, &y) in a.iter_mut().zip(&q) {
                        *x = _mm512_fmadd_ps(k, y, *x);
                    }
                }
            }
            for (kk, a) in acc.iter().enumerate() {
                // SAFETY: row `4 jb + kk < KB` of `st`, lanes `c0..c0 + 16 N`.
                let dst = unsafe { st.as_mut_ptr().add((4 * jb + kk) * lanes + c0) };
                for (i, x) in a.iter().enumerate() {
                    // SAFETY: as above.
                    unsafe { _mm512_storeu_ps(dst.add(16 * i), *x) };
                }
            }
        }
    }

    /// [`super::Isa::scores_direct`] with AVX-512F: per query row, 16 keys' dot products in
    /// 16 accumulators, summed across lanes together by [`sum16`] and scattered into the
    /// block's score rows: no per-score chain of horizontal adds. Groups of 16 keys that
    /// start at or past `nb` are left at zero.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `hd % 16 == 0`, `rows <= lanes`, `qb.len() >= rows * hd`,
    /// `st.len() >= KB * lanes` and every key row holds `hd` values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_few_avx512(
        qb: &[f32],
        rows: usize,
        lanes: usize,
        krows: &[&[f32]; KB],
        nb: usize,
        st: &mut [f32],
        hd: usize,
    ) {
        st[..KB * lanes].fill(0.0);
        let step = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(lanes as i32),
        );
        for r in 0..rows {
            let q = &qb[r * hd..(r + 1) * hd];
            for (g, kg) in krows.chunks_exact(16).take(nb.div_ceil(16)).enumerate() {
                let mut acc = [_mm512_setzero_ps(); 16];
                for c in (0..hd).step_by(16) {
                    // SAFETY: c + 16 <= hd, inside the query row and every key row.
                    let qv = unsafe { _mm512_loadu_ps(q.as_ptr().add(c)) };
                    for (a, kr) in acc.iter_mut().zip(kg) {
                        // SAFETY: as above.
                        *a =
                            _mm512_fmadd_ps(qv, unsafe { _mm512_loadu_ps(kr.as_ptr().add(c)) }, *a);
                    }
                }
                // SAFETY: lane j goes to st[(16 g + j) * lanes + r], inside the block's
                // KB * lanes scores since 16 g + j < KB and r < lanes.
                unsafe {
                    _mm512_i32scatter_ps::<4>(
                        st.as_mut_ptr().add(16 * g * lanes + r),
                        step,
                        sum16(&acc),
                    )
                };
            }
        }
    }

    /// Lane j of the result is the sum of the 16 lanes of `a[j]`: pairs are merged by
    /// interleaving and adding, 15 merges in all.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) fn sum16(a: &[__m512; 16]) -> __m512 {
        // After the 32-bit then 64-bit interleaves, lane e of 128-bit block b of `s2[q]` holds
        // block b's sum of `a[4 q + e]`.
        let s1: [__m512; 8] = std::array::from_fn(|p| {
            let (x, y) = (a[2 * p], a[2 * p + 1]);
            _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
        });
        let s2: [__m512; 4] = std::array::from_fn(|q| {
            let (x, y) = (_mm512_castps_pd(s1[2 * q]), _mm512_castps_pd(s1[2 * q + 1]));
            _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
            )
        });
        // Then blocks are summed pairwise: 0x88 takes blocks 0 and 2 of each, 0xdd 1 and 3.
        let fold = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(x, y),
                _mm512_shuffle_f32x4::<0xdd>(x, y),
            )
        };
        fold(fold(s2[0], s2[1]), fold(s2[2], s2[3]))
    }

    /// [`scores_few_avx512`] with AVX2 and FMA: 8 keys at a time, summed by [`sum8`] and
    /// written lane by lane (AVX2 has no scatter).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `hd % 8 == 0`, and the bounds of [`scores_few_avx512`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_few_avx2(
        qb: &[f32],
        rows: usize,
        lanes: usize,
        krows: &[&[f32]; KB],
        nb: usize,
        st: &mut [f32],
        hd: usize,
    ) {
        st[..KB * lanes].fill(0.0);
        let mut sums = [0f32; 8];
        for r in 0..rows {
            let q = &qb[r * hd..(r + 1) * hd];
            for (g, kg) in krows.chunks_exact(8).take(nb.div_ceil(8)).enumerate() {
                let mut acc = [_mm256_setzero_ps(); 8];
                for c in (0..hd).step_by(8) {
                    // SAFETY: c + 8 <= hd, inside the query row and every key row.
                    let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
                    for (a, kr) in acc.iter_mut().zip(kg) {
                        // SAFETY: as above.
                        *a =
                            _mm256_fmadd_ps(qv, unsafe { _mm256_loadu_ps(kr.as_ptr().add(c)) }, *a);
                    }
                }
                // SAFETY: the store writes the 8 floats of `sums`.
                unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), sum8(&acc)) };
                for (j, &x) in sums.iter().enumerate() {
                    st[(8 * g + j) * lanes + r] = x;
                }
            }
        }
    }

    /// Lane j of the result is the sum of the 8 lanes of `a[j]`, as [`sum16`] does for 16
    /// (7 merges: 32-bit and 64-bit interleaves, then one fold of the 128-bit halves).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn sum8(a: &[__m256; 8]) -> __m256 {
        let s1: [__m256; 4] = std::array::from_fn(|p| {
            let (x, y) = (a[2 * p], a[2 * p + 1]);
            _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
        });
        let s2: [__m256; 2] = std::array::from_fn(|q| {
            let (x, y) = (_mm256_castps_pd(s1[2 * q]), _mm256_castps_pd(s1[2 * q + 1]));
            _mm256_add_ps(
                _mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)),
            )
        });
        // 0x20 takes the low halves of both, 0x31 the high halves.
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(s2[0], s2[1]),
            _mm256_permute2f128_ps::<0x31>(s2[0], s2[1]),
        )
    }

    /// [`super::Isa::scores`] with AVX2 and FMA: 4 keys x 16 query lanes (8 registers).
    ///
    /// # Safety
    /// As [`scores_avx512`], with AVX2 and FMA instead of AVX-512F.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_avx2(
        qt: &[f32],
        lanes: usize,
        krows: &[&[f32]; KB],
        st: &mut [f32],
        hd: usize,
    ) {
        for c0 in (0..lanes).step_by(16) {
            for (jb, kg) in krows.chunks_exact(4).enumerate() {
                let mut acc = [[_mm256_setzero_ps(); 2]; 4];
                for d in 0..hd {
                    // SAFETY: `d * lanes + c0 + 16 <= hd * lanes <= qt.len()`.
                    let col = unsafe { qt.as_ptr().add(d * lanes + c0) };
                    // SAFETY: within the column, as above.
                    let q = unsafe { [_mm256_loadu_ps(col), _mm256_loadu_ps(col.add(8))] };
                    for (a, kr) in acc.iter_mut().zip(kg) {
                        // SAFETY: key rows hold `hd` values.
                        let k = _mm256_set1_ps(unsafe { *kr.get_unchecked(d) });
                        for (x, &y) in a.iter_mut().zip(&q) {
                            *x = _mm256_fmadd_ps(k, y, *x);
                        }
                    }
                }
                for (kk, a) in acc.iter().enumerate() {
                    // SAFETY: row `4 jb + kk < KB` of `st`, lanes `c0..c0 + 16`.
                    let dst = unsafe { st.as_mut_ptr().add((4 * jb + kk) * lanes + c0) };
                    // SAFETY: as above.
                    unsafe {
                        _mm256_storeu_ps(dst, a[0]);
                        _mm256_storeu_ps(dst.add(8), a[1]);
                    }
                }
            }
        }
    }
}

/// `o[r] += sum_j st[j][r] * v[j]` over the block's `nb` keys: [`RB`] rows at a time, in
/// head-dim chunks of `W` lanes, then of [`DC`], then one lane at a time.
#[inline(always)]
fn values<const W: usize>(
    st: &[f32],
    lanes: usize,
    vrows: &[&[f32]; KB],
    o: &mut [f32],
    rows: usize,
    hd: usize,
    nb: usize,
) {
    for rb in (0..rows).step_by(RB) {
        let o = &mut o[rb * hd..(rb + RB) * hd];
        let mut dc = 0;
        while dc + W <= hd {
            values_chunk::<W>(st, lanes, vrows, o, hd, rb, dc, nb);
            dc += W;
        }
        while dc + DC <= hd {
            values_chunk::<DC>(st, lanes, vrows, o, hd, rb, dc, nb);
            dc += DC;
        }
        for (srow, vr) in st.chunks_exact(lanes).zip(vrows).take(nb) {
            for (rr, &p) in srow[rb..rb + RB].iter().enumerate() {
                for d in dc..hd {
                    o[rr * hd + d] += p * vr[d];
                }
            }
        }
    }
}

/// Lanes `dc..dc + W` of [`values`] for the register block of rows `rb..rb + RB` (`o` holds
/// its rows).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn values_chunk<const W: usize>(
    st: &[f32],
    lanes: usize,
    vrows: &[&[f32]; KB],
    o: &mut [f32],
    hd: usize,
    rb: usize,
    dc: usize,
    nb: usize,
) {
    let mut acc = [[0f32; W]; RB];
    for (rr, a) in acc.iter_mut().enumerate() {
        a.copy_from_slice(&o[rr * hd + dc..rr * hd + dc + W]);
    }
    for (srow, vrow) in st.chunks_exact(lanes).zip(vrows).take(nb) {
        let p: &[f32; RB] = srow[rb..rb + RB].try_into().expect("RB rows");
        let vr: &[f32; W] = vrow[dc..dc + W].try_into().expect("W lanes");
        for (a, &pj) in acc.iter_mut().zip(p) {
            for (x, &y) in a.iter_mut().zip(vr) {
                *x = pj.mul_add(y, *x);
            }
        }
    }
    for (rr, a) in acc.iter().enumerate() {
        o[rr * hd + dc..rr * hd + dc + W].copy_from_slice(a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LogitsFor;
    use leyline_kv::storage::{KvDtype, KvGeometry};

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// Scalar f64 attention over the values the pool actually stores.
    fn reference(
        kv: &KvStorage,
        layer: usize,
        shape: Heads,
        q: &[f32],
        seqs: &[ForwardSeq<'_>],
    ) -> Vec<f64> {
        let Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        } = shape;
        let g = h / kvh;
        let n: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let mut out = vec![0f64; n * h * hd];
        let mut row = 0;
        for s in seqs {
            let slots: Vec<u32> = s.context.iter().chain(s.new_slots).copied().collect();
            let mut ks = vec![0f32; slots.len() * kvh * hd];
            let mut vs = vec![0f32; slots.len() * kvh * hd];
            kv.gather_k(layer, &slots, &mut ks).unwrap();
            kv.gather_v(layer, &slots, &mut vs).unwrap();
            for i in 0..s.tokens.len() {
                let visible = s.context.len() + i + 1;
                for head in 0..h {
                    let kh = head / g;
                    let qr = &q[(row + i) * h * hd + head * hd..][..hd];
                    let sc: Vec<f64> = (0..visible)
                        .map(|j| {
                            let kr = &ks[j * kvh * hd + kh * hd..][..hd];
                            qr.iter()
                                .zip(kr)
                                .map(|(&a, &b)| a as f64 * b as f64)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let o = &mut out[(row + i) * h * hd + head * hd..][..hd];
                    for (j, p) in e.iter().enumerate() {
                        let vr = &vs[j * kvh * hd + kh * hd..][..hd];
                        for (o, &x) in o.iter_mut().zip(vr) {
                            *o += p / z * x as f64;
                        }
                    }
                }
            }
            row += s.tokens.len();
        }
        out
    }

    fn check(dtype: KvDtype, shape: Heads, plan: &[(usize, usize)], threads: usize) {
        let plan: Vec<_> = plan.iter().map(|&(c, t)| (c, t, 0)).collect();
        check_shared(dtype, shape, &plan, threads);
    }

    /// [`check`] for sequences `(context, new tokens, shared)` whose contexts begin with the
    /// first `shared` slots of one common run, as the prefix tree hands them out.
    fn check_shared(dtype: KvDtype, shape: Heads, plan: &[(usize, usize, usize)], threads: usize) {
        let Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        } = shape;
        let common = plan.iter().map(|p| p.2).max().unwrap_or(0);
        let total: usize = common + plan.iter().map(|(c, t, sh)| c - sh + t).sum::<usize>();
        let cap = total + 37;
        let geo = KvGeometry {
            layers: 2,
            k_heads: kvh,
            k_head_dim: hd,
            v_width: kvh * hd,
        };
        let mut kv = KvStorage::new(geo, dtype, cap).unwrap();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (hd as u64) << 7);
        // Scattered slots, in a shuffled order.
        let mut free: Vec<u32> = (0..cap as u32).collect();
        for i in (1..free.len()).rev() {
            let j = ((rng.next() + 1.0) * 0.5 * i as f32) as usize % (i + 1);
            free.swap(i, j);
        }
        let w = kvh * hd;
        let layer = 1;
        // Keys with a large common component make the softmax peaked in places. Layer 0
        // holds other rows, read first with the same plan.
        for li in [0, layer] {
            for &slot in &free[..total] {
                let k: Vec<f32> = (0..w).map(|_| rng.next() * 3.0).collect();
                let shift = if li == layer { 0.0 } else { 2.0 };
                let v: Vec<f32> = (0..w).map(|_| rng.next() + shift).collect();
                kv.write(li, slot, &k, &v).unwrap();
            }
        }
        let mut parts = Vec::new();
        let mut at = common;
        for &(c, t, sh) in plan {
            let own = c - sh;
            let ctx: Vec<u32> = free[..sh]
                .iter()
                .chain(&free[at..at + own])
                .copied()
                .collect();
            parts.push((ctx, free[at + own..at + own + t].to_vec()));
            at += own + t;
        }
        let toks: Vec<Vec<u32>> = plan.iter().map(|&(_, t, _)| vec![0; t]).collect();
        let seqs: Vec<ForwardSeq<'_>> = parts
            .iter()
            .zip(&toks)
            .map(|((ctx, new), tk)| ForwardSeq {
                tokens: tk,
                positions: tk,
                context: ctx,
                new_slots: new,
                logits: LogitsFor::None,
            })
            .collect();
        let n: usize = plan.iter().map(|(_, t, _)| t).sum();
        let q: Vec<f32> = (0..n * h * hd).map(|_| rng.next() * 2.0).collect();
        let pool = SpinPool::new(threads);
        let want = reference(&kv, layer, shape, &q, &seqs);
        // Rows wider than the queries (as in the fused Q/K/V buffer), padding unread.
        let stride = h * hd + 5;
        let padded: Vec<f32> = q
            .chunks_exact(h * hd)
            .flat_map(|r| r.iter().copied().chain([f32::NAN; 5]))
            .collect();
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; n * h * hd];
            let q = Queries {
                rows: &padded,
                stride,
            };
            // The plan serves every layer: a stale output of layer 0 must not leak into layer 1.
            let mut work = Plan::new(&seqs, shape, pool.threads());
            attend_with(isa, &pool, &kv, 0, q, &mut work, &mut out);
            attend_with(isa, &pool, &kv, layer, q, &mut work, &mut out);
            let (mut num, mut den) = (0f64, 0f64);
            for (a, b) in out.iter().zip(&want) {
                num += (*a as f64 - b).powi(2);
                den += b * b;
            }
            let rel = (num / den).sqrt();
            assert!(
                rel < 2e-6,
                "{isa:?} {dtype:?} hd={hd} plan={plan:?}: rel-L2 {rel:e} against the f64 reference"
            );
        }
    }

    /// The lane-sum trees alone ([`x86::sum16`], [`x86::sum8`]). Lane i of vector j holds
    /// `1024 j + 2^i`, so every sum is exact in f32 and a lane taken from another vector,
    /// dropped or counted twice changes it.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn lane_sum_trees_put_each_vectors_sum_in_its_lane() {
        use std::arch::x86_64::*;
        fn check<const N: usize>(sum: impl Fn(&[[f32; N]; N]) -> [f32; N]) {
            let rows: [[f32; N]; N] = std::array::from_fn(|j| {
                std::array::from_fn(|i| j as f32 * 1024.0 + (1u32 << i) as f32)
            });
            let want: [f32; N] = std::array::from_fn(|j| rows[j].iter().sum());
            assert_eq!(sum(&rows), want, "{N}-way lane sums");
        }
        let mut ran = false;
        if is_x86_feature_detected!("avx512f") {
            check::<16>(|rows| {
                let mut out = [0f32; 16];
                // SAFETY: the CPU has AVX-512F; each load reads one 16-float row and the
                // store writes the 16 floats of `out`.
                unsafe {
                    let a: [__m512; 16] =
                        std::array::from_fn(|j| _mm512_loadu_ps(rows[j].as_ptr()));
                    _mm512_storeu_ps(out.as_mut_ptr(), x86::sum16(&a));
                }
                out
            });
            ran = true;
        }
        if is_x86_feature_detected!("avx2") {
            check::<8>(|rows| {
                let mut out = [0f32; 8];
                // SAFETY: the CPU has AVX2; each load reads one 8-float row and the store
                // writes the 8 floats of `out`.
                unsafe {
                    let a: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(rows[j].as_ptr()));
                    _mm256_storeu_ps(out.as_mut_ptr(), x86::sum8(&a));
                }
                out
            });
            ran = true;
        }
        if !ran {
            eprintln!("this CPU has neither AVX-512F nor AVX2, where the lane-sum trees are used");
        }
    }

    #[test]
    fn decodes_that_share_a_prefix_match_the_reference() {
        let shape = Heads {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        // (context, new tokens, leading slots shared with the others)
        let plans: &[&[(usize, usize, usize)]] = &[
            // A group of three with different tails, a sequence too short to join, one with
            // three new tokens (not a decode), one that shares only 100 slots.
            &[
                (300, 1, 300),
                (520, 1, 300),
                (1000, 1, 300),
                (10, 1, 0),
                (700, 3, 300),
                (900, 1, 100),
            ],
            // A context that is all prefix (its own part is its new token), long tails.
            &[
                (1024, 1, 1024),
                (2100, 1, 1024),
                (1500, 1, 1024),
                (1030, 1, 1024),
            ],
            // More members than one task holds (chunks of QB).
            &[(640, 1, 600); QB + 6],
        ];
        for plan in plans {
            for threads in [1, 2, 8] {
                check_shared(KvDtype::F32, shape, plan, threads);
            }
            check_shared(KvDtype::F16, shape, plan, 2);
        }
        fn slots(v: &[u32]) -> ForwardSeq<'_> {
            ForwardSeq {
                tokens: &[0],
                positions: &[0],
                context: v,
                new_slots: &[9999],
                logits: LogitsFor::None,
            }
        }
        // Grouping: the shared length is what all members share, cut to whole key blocks.
        let a: Vec<u32> = (0..700).collect();
        let mut b = a.clone();
        b[650] = 5000;
        let mut c = a.clone();
        c[100] = 6000;
        let seqs = [slots(&a), slots(&b), slots(&c), slots(&a[..300])];
        assert_eq!(shared_prefixes(&seqs), vec![(vec![0, 1, 3], 256)]);
        assert_eq!(common_prefix(&a, &b), 650);
        assert_eq!(common_prefix(&a, &a[..300]), 300);
        assert_eq!(common_prefix(&a[..64], &a[..64]), 64);
    }

    #[test]
    fn matches_a_scalar_f64_reference() {
        let plans: &[&[(usize, usize)]] = &[
            &[(0, 1)],
            &[(0, 70)],
            &[(130, 1), (5, 3), (0, 17)],
            &[(300, 33), (64, 64), (63, 2)],
            // Several blocks of query tokens, the last one partial.
            &[(100, 2 * QB + 22)],
            // Decode shapes with long contexts: the context is split over several tasks.
            &[(1000, 1)],
            &[(2100, 1), (700, 2)],
            &[(777, 5)],
        ];
        for &hd in &[64, 128, 40] {
            let shape = Heads {
                heads: 6,
                kv_heads: 2,
                head_dim: hd,
            };
            for plan in plans {
                for dtype in [KvDtype::F32, KvDtype::Bf16, KvDtype::F16] {
                    check(dtype, shape, plan, 2);
                }
            }
        }
        // One thread, and more threads than tasks.
        let shape = Heads {
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
        };
        check(KvDtype::F32, shape, &[(200, 40)], 1);
        check(KvDtype::F32, shape, &[(10, 2)], 8);
        check(KvDtype::F32, shape, &[(3000, 1)], 1);
        check(KvDtype::Bf16, shape, &[(3000, 1), (513, 1)], 8);
        // MHA (a task of up to four tokens takes the direct-score path) and a group of 8.
        for (heads, kv_heads) in [(4, 4), (8, 1)] {
            let shape = Heads {
                heads,
                kv_heads,
                head_dim: 64,
            };
            for plan in plans {
                check(KvDtype::F32, shape, plan, 2);
            }
        }
    }
}
