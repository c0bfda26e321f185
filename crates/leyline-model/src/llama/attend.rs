//! Causal GQA attention that reads the pool's key and value rows in place, in tiles.
//!
//! Design decision: one task is one (sequence, kv head, block of query tokens). Its query rows
//! (the block's tokens times the query heads that share the kv head) meet the context in
//! blocks of [`KB`] keys: a key block is gathered and converted to f32 once for all rows,
//! scores and the value sums use register-sized accumulators, and an online softmax keeps a
//! running max and sum per row, so neither a score matrix over the whole context nor a mask
//! is ever built. Scores are kept in log2 units (the query is pre-scaled by `log2(e)`), so
//! the softmax needs only `exp2`, computed by a polynomial the compiler vectorizes.
//!
//! Decode batches have one query token per sequence, so few tasks and few rows per task: a
//! task then covers part of the context only (its running max and sum merged afterwards),
//! so that both threads stay busy, and scores come from the key rows directly, because
//! transposing a key block costs more than the few dot products it serves.

use crate::pool::SpinPool;
use crate::ForwardSeq;
use half::f16;
use leyline_kv::storage::RowsRef;
use leyline_kv::KvStorage;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Keys per block.
const KB: usize = 64;
/// Query tokens per task.
const QB: usize = 32;
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

/// One (sequence, kv head, query-token block) piece of the work.
struct Task<'a> {
    seq: &'a ForwardSeq<'a>,
    /// First row of the sequence in the flat batch.
    row: usize,
    kv_head: usize,
    /// Query tokens `t0..t1` of the sequence's new tokens.
    t0: usize,
    t1: usize,
    /// Keys `k0..k1` of the sequence's context followed by its new tokens.
    k0: usize,
    k1: usize,
    /// Tasks that split this one's keys (1: none), and this task's offset into the merge
    /// buffers of the split rows.
    parts: usize,
    merge_row: usize,
}

impl Task<'_> {
    fn rows(&self, g: usize) -> usize {
        (self.t1 - self.t0) * g
    }
}

/// Per-thread buffers, sized for one task.
struct Scratch {
    q: Vec<f32>,
    kt: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
}

impl Scratch {
    fn new(rows: usize, hd: usize) -> Self {
        let rows = rows.div_ceil(RB) * RB;
        Self {
            q: vec![0.0; rows * hd],
            kt: vec![0.0; hd * KB],
            v: vec![0.0; KB * hd],
            s: vec![0.0; rows * KB],
            o: vec![0.0; rows * hd],
            m: vec![0.0; rows],
            l: vec![0.0; rows],
        }
    }
}

/// `2^x` for `x <= 0` (what the online softmax needs), within 2e-7 relative, and exactly 0
/// below `2^-126` (masked scores are `-inf`). Branch-free, so loops over it vectorize.
#[inline(always)]
fn exp2(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let xc = x.max(-126.0);
    // Round to nearest through the f32 mantissa: the low bits of `y` then hold `n`.
    let y = xc + MAGIC;
    let n = y - MAGIC;
    let f = xc - n;
    // Taylor series of e^(f ln 2) on |f| <= 0.5, degree 7.
    let p = 1.525_273_4e-5_f32;
    let p = p.mul_add(f, 1.540_353e-4);
    let p = p.mul_add(f, 1.333_355_8e-3);
    let p = p.mul_add(f, 9.618_129e-3);
    let p = p.mul_add(f, 5.550_411e-2);
    let p = p.mul_add(f, 2.402_265e-1);
    let p = p.mul_add(f, std::f32::consts::LN_2);
    let p = p.mul_add(f, 1.0);
    // `n + 127` as a biased exponent, without a float-to-int conversion.
    let e = y.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23;
    let r = p * f32::from_bits(e);
    if x < -126.0 {
        0.0
    } else {
        r
    }
}

/// A bf16 bit pattern as f32 (exact).
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// An f16 bit pattern as f32 (exact).
fn f16_to_f32(b: u16) -> f32 {
    f16::from_bits(b).to_f32()
}

/// Writes into `out: [n, heads * head_dim]` the causal attention of the batch's queries
/// `q: [n, heads * head_dim]` (rotated, unscaled) over each sequence's context followed by its
/// new slots, reading keys and values from `kv` at `layer`. The new slots must be written.
pub(crate) fn attend(
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    shape: Heads,
    q: &[f32],
    seqs: &[ForwardSeq<'_>],
    out: &mut [f32],
) {
    attend_with(Isa::detect(), pool, kv, layer, shape, q, seqs, out)
}

/// [`attend`] with the kernel compiled for `isa`, which the CPU must support.
#[allow(clippy::too_many_arguments)]
fn attend_with(
    isa: Isa,
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    shape: Heads,
    q: &[f32],
    seqs: &[ForwardSeq<'_>],
    out: &mut [f32],
) {
    let Heads {
        heads: h,
        kv_heads: kvh,
        head_dim: hd,
    } = shape;
    let g = h / kvh;
    let units: usize = seqs.iter().map(|s| s.tokens.len().div_ceil(QB) * kvh).sum();
    let wanted = TASKS_PER_THREAD * pool.threads();
    let mut tasks = Vec::new();
    let (mut row, mut merge_rows) = (0, 0);
    for s in seqs {
        let (t, ctx) = (s.tokens.len(), s.context.len());
        // Only context keys are split: every row sees all of them, so no part is empty.
        let parts = if units >= wanted {
            1
        } else {
            wanted.div_ceil(units).min(ctx / MIN_SPLIT).max(1)
        };
        let bound = |p: usize| p * ctx / parts / KB * KB;
        for t0 in (0..t).step_by(QB) {
            let t1 = (t0 + QB).min(t);
            for kv_head in 0..kvh {
                for p in 0..parts {
                    tasks.push(Task {
                        seq: s,
                        row,
                        kv_head,
                        t0,
                        t1,
                        k0: bound(p),
                        k1: if p + 1 == parts {
                            ctx + t1
                        } else {
                            bound(p + 1)
                        },
                        parts,
                        merge_row: merge_rows,
                    });
                }
                if parts > 1 {
                    merge_rows += (t1 - t0) * g;
                }
            }
        }
        row += t;
    }
    // Longest first, so the dynamic hand-out below ends with short tasks.
    tasks.sort_by_key(|t| std::cmp::Reverse(t.k1 - t.k0));
    // Task-major output: task i owns its rows' `head_dim` values, then each row's running
    // max and sum.
    let mut scratch = vec![0f32; tasks.iter().map(|t| t.rows(g) * (hd + 2)).sum()];
    {
        let mut pieces = Vec::with_capacity(tasks.len());
        let mut rest = scratch.as_mut_slice();
        for t in &tasks {
            let (a, b) = rest.split_at_mut(t.rows(g) * (hd + 2));
            pieces.push(Mutex::new(a));
            rest = b;
        }
        let (kr, vr) = (kv.k_rows(layer), kv.v_rows(layer));
        let (kw, vw) = (kv.geometry().k_width(), kv.geometry().v_width);
        let next = AtomicUsize::new(0);
        // Sized for the largest task, not for `QB` tokens: a decode step's tasks have a
        // few rows, and this is allocated per thread and layer.
        let max_rows = tasks.iter().map(|t| t.rows(g)).max().unwrap_or(0);
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
                        isa.run(&job, k, v, |x| x, &mut buf, &mut o)
                    }
                    (RowsRef::Bf16(k), RowsRef::Bf16(v)) => {
                        isa.run(&job, k, v, bf16_to_f32, &mut buf, &mut o)
                    }
                    (RowsRef::F16(k), RowsRef::F16(v)) => {
                        isa.run(&job, k, v, f16_to_f32, &mut buf, &mut o)
                    }
                    _ => unreachable!("key and value rows share one dtype"),
                }
            }
        });
    }
    write_out(&tasks, &scratch, shape, merge_rows, out);
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
    // Where row `r` of task `t` goes in `out`.
    let place = |t: &Task<'_>, r: usize| {
        let (i, head) = (t.t0 + r / g, t.kv_head * g + r % g);
        (t.row + i) * h * hd + head * hd
    };
    let mut off = 0;
    for t in tasks {
        let rows = t.rows(g);
        if t.parts > 1 {
            let m = &scratch[off + rows * hd..off + rows * (hd + 1)];
            for (r, &mr) in m.iter().enumerate() {
                let a = &mut max[t.merge_row + r];
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
            if t.parts == 1 {
                dst.copy_from_slice(src);
                continue;
            }
            let mr = t.merge_row + r;
            let w = ml[rows + r] * (ml[r] - max[mr]).exp2();
            den[mr] += w;
            for (d, &x) in dst.iter_mut().zip(src) {
                *d += w * x;
            }
        }
        off += rows * (hd + 2);
    }
    for t in tasks.iter().filter(|t| t.parts > 1 && t.k0 == 0) {
        for r in 0..t.rows(g) {
            let inv = 1.0 / den[t.merge_row + r];
            for d in &mut out[place(t, r)..][..hd] {
                *d *= inv;
            }
        }
    }
}

/// What one task reads.
struct Job<'a> {
    task: &'a Task<'a>,
    q: &'a [f32],
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
        cvt: impl Fn(T) -> f32 + Copy,
        buf: &mut Scratch,
        out: &mut [f32],
    ) {
        match self {
            Isa::Portable => task::<T, DC>(job, k, v, cvt, buf, out),
            // SAFETY: only `detect` and `available` make this variant, after the CPU reported AVX-512F.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { task_avx512(job, k, v, cvt, buf, out) },
            // SAFETY: only `detect` and `available` make this variant, after the CPU reported AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { task_avx2(job, k, v, cvt, buf, out) },
        }
    }
}

/// `task` compiled for an instruction set; callers must have checked that the CPU has it.
/// `$dc` is the value accumulators' width per row: [`RB`] rows of it fill 16 vector
/// registers (4 x 64 lanes in zmm with AVX-512, 4 x 32 lanes in ymm with AVX2).
macro_rules! task_for {
    ($name:ident, $features:literal, $dc:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<T: Copy>(
            job: &Job<'_>,
            k: &[T],
            v: &[T],
            cvt: impl Fn(T) -> f32 + Copy,
            buf: &mut Scratch,
            out: &mut [f32],
        ) {
            task::<T, $dc>(job, k, v, cvt, buf, out)
        }
    };
}
task_for!(task_avx512, "avx512f", 64);
task_for!(task_avx2, "avx2,fma", 32);

/// Runs one task into `out` (its rows, token-major, heads within a token).
#[inline(always)]
fn task<T: Copy, const W: usize>(
    job: &Job<'_>,
    k: &[T],
    v: &[T],
    cvt: impl Fn(T) -> f32 + Copy,
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
    let rows = (task.t1 - task.t0) * g;
    let padded = rows.div_ceil(RB) * RB;
    let c = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    let Scratch {
        q: qb,
        kt,
        v: vb,
        s,
        o,
        m,
        l,
    } = buf;
    for r in 0..padded {
        let dst = &mut qb[r * hd..(r + 1) * hd];
        if r < rows {
            let head = task.kv_head * g + r % g;
            let src = (task.row + task.t0 + r / g) * h * hd + head * hd;
            for (d, &x) in dst.iter_mut().zip(&q[src..src + hd]) {
                *d = x * c;
            }
        } else {
            dst.fill(0.0);
        }
    }
    m[..padded].fill(f32::NEG_INFINITY);
    l[..padded].fill(0.0);
    o[..padded * hd].fill(0.0);
    let ctx = seq.context.len();
    // Key and value rows both hold the kv heads side by side.
    let off = task.kv_head * hd;
    // With a register block's rows or fewer, dot products straight from the key rows are
    // cheaper than transposing the block.
    let direct = padded == RB;
    // Key `j`'s K and V rows for this kv head: the context, then the new tokens.
    let rows_of = |j: usize| {
        let slot = if j < ctx {
            seq.context[j]
        } else {
            seq.new_slots[j - ctx]
        } as usize;
        (
            &k[slot * kw + off..slot * kw + off + hd],
            &v[slot * vw + off..slot * vw + off + hd],
        )
    };
    if direct {
        // Padding rows go through `values` too; zero scores, as a zero query gives below.
        s[rows * KB..padded * KB].fill(0.0);
    }
    for j0 in (task.k0..task.k1).step_by(KB) {
        let nb = KB.min(task.k1 - j0);
        // The next block's rows sit at scattered slots, which hardware prefetchers do not
        // follow: ask for them while this block computes (not worth it for a few rows).
        let ahead = if direct {
            j0..j0
        } else {
            j0 + KB..(j0 + 2 * KB).min(task.k1)
        };
        for (kr, vr) in ahead.map(rows_of) {
            prefetch(kr);
            prefetch(vr);
        }
        for jj in 0..KB {
            if jj < nb {
                let (kr, vr) = rows_of(j0 + jj);
                if direct {
                    for r in 0..rows {
                        s[r * KB + jj] = dot(&qb[r * hd..(r + 1) * hd], kr, cvt);
                    }
                } else {
                    for (row, &x) in kt.chunks_exact_mut(KB).zip(kr) {
                        row[jj] = cvt(x);
                    }
                }
                for (d, &x) in vb[jj * hd..(jj + 1) * hd].iter_mut().zip(vr) {
                    *d = cvt(x);
                }
            } else if !direct {
                for row in kt.chunks_exact_mut(KB) {
                    row[jj] = 0.0;
                }
            }
        }
        if !direct {
            scores(qb, kt, s, padded, hd);
        }
        for r in 0..rows {
            // Keys this row may see: the context and its own token and those before it.
            let visible = ctx + task.t0 + r / g + 1;
            let lim = visible.saturating_sub(j0).min(nb);
            let sr: &mut [f32; KB] = (&mut s[r * KB..(r + 1) * KB])
                .try_into()
                .expect("score rows are KB wide");
            if lim == 0 {
                sr.fill(0.0);
                continue;
            }
            for (jj, x) in sr.iter_mut().enumerate() {
                if jj >= lim {
                    *x = f32::NEG_INFINITY;
                }
            }
            let mut lanes = [f32::NEG_INFINITY; 16];
            for c in sr.chunks_exact(16) {
                for (a, &x) in lanes.iter_mut().zip(c) {
                    *a = a.max(x);
                }
            }
            let mnew = lanes.iter().fold(m[r], |a, &b| a.max(b));
            let corr = exp2(m[r] - mnew);
            let mut lanes = [0f32; 16];
            for c in sr.chunks_exact_mut(16) {
                for (a, x) in lanes.iter_mut().zip(c) {
                    *x = exp2(*x - mnew);
                    *a += *x;
                }
            }
            let sum: f32 = lanes.iter().sum();
            l[r] = l[r] * corr + sum;
            m[r] = mnew;
            if corr != 1.0 {
                for x in &mut o[r * hd..(r + 1) * hd] {
                    *x *= corr;
                }
            }
        }
        values::<W>(s, vb, o, padded, hd, nb);
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

/// `q . k` over `q.len()` lanes, in 16 independent accumulators so the loop vectorizes.
#[inline(always)]
fn dot<T: Copy>(q: &[f32], k: &[T], cvt: impl Fn(T) -> f32 + Copy) -> f32 {
    let mut acc = [0f32; 16];
    let full = q.len() / 16 * 16;
    for (qc, kc) in q[..full].chunks_exact(16).zip(k[..full].chunks_exact(16)) {
        for ((a, &x), &y) in acc.iter_mut().zip(qc).zip(kc) {
            *a = x.mul_add(cvt(y), *a);
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for (&x, &y) in q[full..].iter().zip(&k[full..q.len()]) {
        sum = x.mul_add(cvt(y), sum);
    }
    sum
}

/// `s[r] = q[r] . kt` for `rows` (a multiple of [`RB`]) query rows against one key block.
#[inline(always)]
fn scores(qb: &[f32], kt: &[f32], s: &mut [f32], rows: usize, hd: usize) {
    for rb in (0..rows).step_by(RB) {
        let mut acc = [[0f32; KB]; RB];
        for d in 0..hd {
            let kr: &[f32; KB] = kt[d * KB..(d + 1) * KB]
                .try_into()
                .expect("key block rows are KB wide");
            for (rr, a) in acc.iter_mut().enumerate() {
                let x = qb[(rb + rr) * hd + d];
                for (a, &k) in a.iter_mut().zip(kr) {
                    *a = x.mul_add(k, *a);
                }
            }
        }
        for (rr, a) in acc.iter().enumerate() {
            s[(rb + rr) * KB..(rb + rr + 1) * KB].copy_from_slice(a);
        }
    }
}

/// `o[r] += sum_j s[r][j] * vb[j]` over the block's `nb` keys: [`RB`] rows at a time, in
/// head-dim chunks of `W` lanes, then of [`DC`], then one lane at a time.
#[inline(always)]
fn values<const W: usize>(s: &[f32], vb: &[f32], o: &mut [f32], rows: usize, hd: usize, nb: usize) {
    for rb in (0..rows).step_by(RB) {
        let p: [&[f32]; RB] = std::array::from_fn(|rr| &s[(rb + rr) * KB..(rb + rr) * KB + nb]);
        let o = &mut o[rb * hd..(rb + RB) * hd];
        let mut dc = 0;
        while dc + W <= hd {
            values_chunk::<W>(&p, vb, o, hd, dc);
            dc += W;
        }
        while dc + DC <= hd {
            values_chunk::<DC>(&p, vb, o, hd, dc);
            dc += DC;
        }
        for (rr, pr) in p.iter().enumerate() {
            for (j, &pj) in pr.iter().enumerate() {
                for d in dc..hd {
                    o[rr * hd + d] += pj * vb[j * hd + d];
                }
            }
        }
    }
}

/// Lanes `dc..dc + W` of [`values`] for one register block of rows (`o` holds its rows).
#[inline(always)]
fn values_chunk<const W: usize>(p: &[&[f32]; RB], vb: &[f32], o: &mut [f32], hd: usize, dc: usize) {
    let mut acc = [[0f32; W]; RB];
    for (rr, a) in acc.iter_mut().enumerate() {
        a.copy_from_slice(&o[rr * hd + dc..rr * hd + dc + W]);
    }
    let [p0, p1, p2, p3] = *p;
    let probs = p0.iter().zip(p1).zip(p2).zip(p3);
    for ((((&a0, &a1), &a2), &a3), vrow) in probs.zip(vb.chunks_exact(hd)) {
        let vr: &[f32; W] = vrow[dc..dc + W].try_into().expect("W lanes");
        for (rr, pj) in [a0, a1, a2, a3].into_iter().enumerate() {
            for (a, &x) in acc[rr].iter_mut().zip(vr) {
                *a = pj.mul_add(x, *a);
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
        let Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        } = shape;
        let total: usize = plan.iter().map(|(c, t)| c + t).sum();
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
        // Keys with a large common component make the softmax peaked in places.
        for &slot in &free[..total] {
            let k: Vec<f32> = (0..w).map(|_| rng.next() * 3.0).collect();
            let v: Vec<f32> = (0..w).map(|_| rng.next()).collect();
            kv.write(layer, slot, &k, &v).unwrap();
        }
        let mut parts = Vec::new();
        let mut at = 0;
        for &(c, t) in plan {
            parts.push((free[at..at + c].to_vec(), free[at + c..at + c + t].to_vec()));
            at += c + t;
        }
        let toks: Vec<Vec<u32>> = plan.iter().map(|&(_, t)| vec![0; t]).collect();
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
        let n: usize = plan.iter().map(|(_, t)| t).sum();
        let q: Vec<f32> = (0..n * h * hd).map(|_| rng.next() * 2.0).collect();
        let pool = SpinPool::new(threads);
        let want = reference(&kv, layer, shape, &q, &seqs);
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; n * h * hd];
            attend_with(isa, &pool, &kv, layer, shape, &q, &seqs, &mut out);
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

    #[test]
    fn matches_a_scalar_f64_reference() {
        let plans: &[&[(usize, usize)]] = &[
            &[(0, 1)],
            &[(0, 70)],
            &[(130, 1), (5, 3), (0, 17)],
            &[(300, 33), (64, 64), (63, 2)],
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

    #[test]
    fn exp2_is_accurate_on_the_softmax_range() {
        let mut worst = 0f64;
        let mut x = -126.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp2();
            let got = exp2(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.003_7;
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp2(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp2(0.0), 1.0);
    }
}
