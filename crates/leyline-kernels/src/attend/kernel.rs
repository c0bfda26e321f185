//! One task's kernel, generic over the storage dtype and compiled once per [`Tier`]: the
//! per-thread buffers, the online softmax over key blocks, the value sums, and the choice of
//! the score products of `portable.rs`, `avx2.rs` or `avx512.rs`.

use super::portable::scores_portable;
use super::task::{direct, finish, fold, last_piece, offset_of, Heads, Task, DR, KB, RB, SPAN};
#[cfg(target_arch = "x86_64")]
use super::{avx2, avx512};
use crate::fastmath::exp2;
use crate::rows::Strides;
use crate::Tier;

// `turned` marks a block's keys in a u64.
const _: () = assert!(KB <= 64);

/// Keys past a block's end whose rows AVX2's fused score product asks for ahead: two groups
/// of 8, about two groups' products of time for a row to come from memory.
pub(super) const AHEAD: usize = 16;

const _: () = assert!(AHEAD.is_multiple_of(8) && AHEAD <= KB);

/// Head-dim lanes per value accumulator row in the portable kernel; the x86 kernels use
/// as many as their registers hold (see [`task_for`]).
const DC: usize = 16;

/// The batch's query rows: row `t` starts at `t * stride` and holds every head's query
/// (rotated, unscaled) in its first `heads * head_dim` values; the rest of a row is not read.
#[derive(Debug, Clone, Copy)]
pub struct Queries<'a> {
    /// The rows.
    pub rows: &'a [f32],
    /// Values from one row's start to the next's.
    pub stride: usize,
}

/// Per-thread buffers, sized for one task.
pub(super) struct Scratch {
    /// Query rows, scaled (the direct-score path reads them).
    q: Vec<f32>,
    /// The same rows transposed, `[head_dim][lanes]`.
    qt: Vec<f32>,
    /// A key block transposed, `[head_dim][KB]` (the direct product reads it).
    kt: Vec<f32>,
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
    /// Per query row, the earlier spans folded ([`fold`]): max, sum, value sums.
    fm: Vec<f32>,
    fl: Vec<f32>,
    fo: Vec<f32>,
}

/// Query rows padded to whole vectors: 8 lanes for a direct task ([`DR`] rows at most), else
/// whole 16-lane vectors.
fn lanes_of(rows: usize) -> usize {
    if direct(rows) {
        DR
    } else {
        rows.div_ceil(16) * 16
    }
}

const _: () = assert!(DR == 8 && RB <= DR);

impl Scratch {
    pub(super) fn new(rows: usize, hd: usize) -> Self {
        let lanes = lanes_of(rows);
        Self {
            q: vec![0.0; lanes * hd],
            qt: vec![0.0; hd * lanes],
            kt: vec![0.0; hd * KB],
            kb: vec![0.0; KB * hd],
            vb: vec![0.0; KB * hd],
            zero: vec![0.0; hd],
            st: vec![0.0; KB * lanes],
            o: vec![0.0; lanes * hd],
            m: vec![0.0; lanes],
            l: vec![0.0; lanes],
            corr: vec![0.0; lanes],
            fm: vec![0.0; lanes],
            fl: vec![0.0; lanes],
            fo: vec![0.0; lanes * hd],
        }
    }
}

/// How rows of a storage dtype become f32.
pub(super) trait Load<T: Copy>: Copy {
    fn f32(self, x: T) -> f32;
    /// `dst[i] = f32(src[i])` for the shorter of both, with `tier`'s instructions where it has
    /// a conversion of its own (the same exact values).
    #[inline(always)]
    fn row(self, _tier: Tier, src: &[T], dst: &mut [f32]) {
        each(self, src, dst);
    }
    /// The rows themselves when they already are f32.
    fn in_place(self, rows: &[T]) -> Option<&[f32]>;
    /// The rows as f16 bits when the storage is f16 (the AVX2 direct path reads them as
    /// they are).
    #[inline(always)]
    fn f16_bits(self, _rows: &[T]) -> Option<&[u16]> {
        None
    }
}

/// [`Load::row`] one value at a time.
#[inline(always)]
fn each<T: Copy>(ld: impl Load<T>, src: &[T], dst: &mut [f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = ld.f32(x);
    }
}

/// f32 storage: rows are read where they are.
#[derive(Clone, Copy)]
pub(super) struct AsIs;

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
pub(super) struct FromBf16;

impl Load<u16> for FromBf16 {
    #[inline(always)]
    fn f32(self, b: u16) -> f32 {
        crate::convert::bf16_to_f32(b)
    }
    #[inline(always)]
    fn in_place(self, _: &[u16]) -> Option<&[f32]> {
        None
    }
}

/// f16 bit patterns (converted exactly).
#[derive(Clone, Copy)]
pub(super) struct FromF16;

impl Load<u16> for FromF16 {
    #[inline(always)]
    fn f32(self, b: u16) -> f32 {
        crate::convert::f16_to_f32(b)
    }
    #[inline(always)]
    fn row(self, tier: Tier, src: &[u16], dst: &mut [f32]) {
        match tier {
            // SAFETY: the task runs on `tier`, which the CPU runs ([`super::attend`] checked);
            // every x86 tier above the portable one has F16C.
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 | Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => unsafe {
                avx2::f16_row(src, dst)
            },
            _ => each(self, src, dst),
        }
    }
    #[inline(always)]
    fn in_place(self, _: &[u16]) -> Option<&[f32]> {
        None
    }
    #[inline(always)]
    fn f16_bits(self, rows: &[u16]) -> Option<&[u16]> {
        Some(rows)
    }
}

/// What one task reads.
pub(super) struct Job<'a> {
    pub(super) task: &'a Task<'a>,
    pub(super) q: Queries<'a>,
    /// The batch's `R(-offset)` per shifted run's offset ([`Task::pieces`] name them).
    pub(super) rotations: &'a [(i64, crate::rope::Rotation)],
    pub(super) shape: Heads,
    pub(super) kw: Strides,
    pub(super) vw: Strides,
}

/// Runs one task with the kernel of `tier`, which the CPU runs ([`super::attend`] checked).
pub(super) fn run<T: Copy>(
    tier: Tier,
    job: &Job<'_>,
    k: &[T],
    v: &[T],
    ld: impl Load<T>,
    buf: &mut Scratch,
    out: &mut [f32],
) {
    match tier {
        Tier::Portable => task::<T, DC>(tier, job, k, v, ld, buf, out),
        // SAFETY: `attend` checked that the CPU runs this tier: it has AVX-512F.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => unsafe {
            task_avx512(tier, job, k, v, ld, buf, out)
        },
        // SAFETY: `attend` checked that the CPU runs this tier: it has AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { task_avx2(tier, job, k, v, ld, buf, out) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the portable tier is available off x86-64"),
    }
}

/// `kt[d][jj] = krows[jj][d]`: the block's keys transposed (keys past its own may be too).
pub(super) fn transpose_block(
    tier: Tier,
    krows: &[&[f32]; KB],
    nb: usize,
    kt: &mut [f32],
    hd: usize,
) {
    assert!(kt.len() >= hd * KB && krows.iter().all(|r| r.len() >= hd));
    match tier {
        // SAFETY: the CPU has AVX-512F (see [`run`]), and the assert above holds the bounds
        // `transpose_avx512` relies on.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => unsafe {
            avx512::transpose_avx512(krows, kt, hd)
        },
        // SAFETY: the CPU has AVX2 (see [`run`]), and the assert above holds the bounds
        // `transpose_avx2` relies on.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { avx2::transpose_avx2(krows, kt, hd) },
        _ => transpose_portable(krows, nb, kt, hd),
    }
}

/// [`transpose_block`] in plain loops, for the block's first `nb` keys.
#[inline(always)]
fn transpose_portable(krows: &[&[f32]; KB], nb: usize, kt: &mut [f32], hd: usize) {
    for (jj, kr) in krows.iter().enumerate().take(nb) {
        for (d, &x) in kr[..hd].iter().enumerate() {
            kt[d * KB + jj] = x;
        }
    }
}

/// `st[j][r] = q[r] . k[j]` for one key block and the first `rows` (at most [`DR`]) query
/// rows of `qb: [DR][hd]` (scaled, untransposed, rows from `rows` on zero), with keys across
/// lanes: `kt` holds the block transposed ([`transpose_block`]). Each score is one FMA per
/// head dim in order, as [`scores`] sums it, so both give the same bits. Lanes from `rows` on
/// are zeroed.
#[inline(always)]
fn scores_keys<const W: usize>(
    qb: &[f32],
    rows: usize,
    lanes: usize,
    kt: &[f32],
    st: &mut [f32],
    hd: usize,
) {
    assert!(rows <= DR && qb.len() >= DR * hd && kt.len() >= hd * KB);
    assert!(lanes == DR && st.len() >= KB * DR);
    match rows {
        1 => keys_rows::<1, W>(qb, lanes, kt, st, hd),
        2 => keys_rows::<2, W>(qb, lanes, kt, st, hd),
        3 => keys_rows::<3, W>(qb, lanes, kt, st, hd),
        ..=RB => keys_rows::<RB, W>(qb, lanes, kt, st, hd),
        _ => {
            keys_rows::<RB, W>(qb, lanes, kt, st, hd);
            keys_rows::<RB, W>(&qb[RB * hd..], lanes, kt, &mut st[RB..], hd);
        }
    }
    for srow in st.chunks_exact_mut(lanes).take(KB) {
        srow[rows..].fill(0.0);
    }
}

/// [`scores_keys`] for `R` rows, `W` keys at a time (`R` times `W` lanes of accumulators fit
/// the registers, as in [`values`]).
#[inline(always)]
fn keys_rows<const R: usize, const W: usize>(
    qb: &[f32],
    lanes: usize,
    kt: &[f32],
    st: &mut [f32],
    hd: usize,
) {
    let w = W.min(KB);
    debug_assert!(KB.is_multiple_of(w));
    for c0 in (0..KB).step_by(w) {
        let mut acc = [[0f32; W]; R];
        // `st` may start at a later row's lane: `(KB - 1) * lanes + R` is the last one written.
        debug_assert!(st.len() >= (KB - 1) * lanes + R);
        for d in 0..hd {
            let col = &kt[d * KB + c0..d * KB + c0 + w];
            for (r, a) in acc.iter_mut().enumerate() {
                let qd = qb[r * hd + d];
                for (x, &k) in a.iter_mut().zip(col) {
                    *x = k.mul_add(qd, *x);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (jj, &x) in a[..w].iter().enumerate() {
                st[(c0 + jj) * lanes + r] = x;
            }
        }
    }
}

/// `st[j][r] = q[r] . k[j]` for one key block, from the transposed queries
/// `qt: [hd][lanes]` (`lanes` a multiple of 16).
fn scores(tier: Tier, qt: &[f32], lanes: usize, krows: &[&[f32]; KB], st: &mut [f32], hd: usize) {
    assert!(lanes.is_multiple_of(16) && qt.len() >= hd * lanes && st.len() >= KB * lanes);
    assert!(krows.iter().all(|r| r.len() >= hd));
    match tier {
        Tier::Portable => scores_portable(qt, lanes, krows, st, hd),
        // SAFETY: the CPU has AVX-512F (see [`run`]), and the asserts above are the bounds
        // `scores_avx512` relies on.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => unsafe {
            avx512::scores_avx512(qt, lanes, krows, st, hd)
        },
        // SAFETY: the CPU has AVX2 and FMA (see [`run`]), and the asserts above are the
        // bounds `scores_avx2` relies on.
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => unsafe { avx2::scores_avx2(qt, lanes, krows, st, hd) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the portable tier is available off x86-64"),
    }
}

/// `task` compiled for a tier; callers must have checked that the CPU runs it.
/// `$w` is the value accumulators' width per row: [`RB`] rows of it take 16 of AVX-512's 32
/// registers, and 8 of AVX2's 16 (at 16 registers, all of them, AVX2 spilled: prefill
/// attention took 2.5x as long).
macro_rules! task_for {
    ($name:ident, $features:literal, $w:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name<T: Copy>(
            tier: Tier,
            job: &Job<'_>,
            k: &[T],
            v: &[T],
            ld: impl Load<T>,
            buf: &mut Scratch,
            out: &mut [f32],
        ) {
            task::<T, $w>(tier, job, k, v, ld, buf, out)
        }
    };
}
task_for!(task_avx512, "avx512f,f16c", 64);
task_for!(task_avx2, "avx2,fma,f16c", 16);

/// Runs one task into `out` (its rows, token-major, heads within a token).
///
/// Per key block: scores land transposed (`st[key][row]`), so the online softmax runs down
/// the keys with the query rows across vector lanes, and the masks of the causal diagonal
/// are prefixes of a key's row. With f32 storage the key and value rows are read in place.
#[inline(always)]
fn task<T: Copy, const W: usize>(
    tier: Tier,
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
        rotations,
        shape,
        kw,
        vw,
    } = *job;
    let (h, hd) = (shape.heads, shape.head_dim);
    let g = h / shape.kv_heads;
    let rows = task.rows(g);
    let lanes = lanes_of(rows);
    let c = std::f32::consts::LOG2_E / (hd as f32).sqrt();
    let Scratch {
        q: qb,
        qt,
        kt,
        kb,
        vb,
        zero,
        st,
        o,
        m,
        l,
        corr,
        fm,
        fl,
        fo,
    } = buf;
    let direct = direct(rows);
    // AVX2 takes the scores of a direct task of more than `RB` rows (a GQA group's decode)
    // with its rows across 8 lanes: keys broadcast, no block transposed.
    let rows_across = direct && rows > RB && tier == Tier::Avx2;
    // With f16 storage it reads the rows as stored, converting a few at a time (a block's
    // worth of f32 copies does not stay in the L1 cache), and sums the values of all 8 rows.
    let (k16, v16) = (ld.f16_bits(k), ld.f16_bits(v));
    let fused = rows_across && k16.is_some() && v16.is_some();
    let padded = if fused { DR } else { rows.div_ceil(RB) * RB };
    // The queries, scaled, turned back by a shifted run's offset, and transposed for the
    // wide product; loaded again wherever the task's keys enter a run of another offset.
    let load = |rot: Option<usize>, qb: &mut [f32], qt: &mut [f32]| {
        for r in 0..lanes {
            let dst = &mut qb[r * hd..(r + 1) * hd];
            if r < rows {
                let head = task.kv_head * g + r % g;
                let src = task.toks[r / g].0 * q.stride + head * hd;
                for (d, &x) in dst.iter_mut().zip(&q.rows[src..src + hd]) {
                    *d = x * c;
                }
                if let Some(i) = rot {
                    rotations[i].1.apply_f32(dst);
                }
            } else {
                dst.fill(0.0);
            }
        }
        if !direct || rows_across {
            for (d, col) in qt.chunks_exact_mut(lanes).take(hd).enumerate() {
                for (x, row) in col.iter_mut().zip(qb.chunks_exact(hd)) {
                    *x = row[d];
                }
            }
        }
    };
    debug_assert!(task.k0.is_multiple_of(KB), "key blocks fall at fixed keys");
    debug_assert!(!task.merged || task.k0 / SPAN == (task.k1 - 1) / SPAN);
    m[..lanes].fill(f32::NEG_INFINITY);
    l[..lanes].fill(0.0);
    o[..padded * hd].fill(0.0);
    fm[..rows].fill(f32::NEG_INFINITY);
    fl[..rows].fill(0.0);
    let ctx = task.context.len();
    let kvh = task.kv_head;
    let slot = |j: usize| {
        (if j < ctx {
            task.context[j]
        } else {
            task.new_rows[j - ctx]
        }) as usize
    };
    let (kf, vf) = (ld.in_place(k), ld.in_place(v));
    // Keys from here on are masked for some rows: row `r` sees key `j` iff
    // `j < diag + r / g + 1`.
    let diag = task.diag;
    let window = task.window.map(|w| w.get());
    let (mut first, mut loads) = (0, task.loads.iter().peekable());
    let mut rot = None;
    let mut j0 = task.k0;
    while j0 < task.k1 {
        // Each span starts its own softmax; the spans before are folded, in key order.
        if j0 > task.k0 && j0.is_multiple_of(SPAN) {
            for r in 0..rows {
                let span = &o[r * hd..(r + 1) * hd];
                fold(
                    &mut fm[r],
                    &mut fl[r],
                    &mut fo[r * hd..(r + 1) * hd],
                    m[r],
                    l[r],
                    span,
                );
            }
            m[..lanes].fill(f32::NEG_INFINITY);
            l[..lanes].fill(0.0);
            o[..padded * hd].fill(0.0);
        }
        if let Some(&(_, r)) = loads.next_if(|l| l.0 == j0) {
            load(r, qb, qt);
            rot = r;
        }
        let nb = KB.min(loads.peek().map_or(task.k1, |l| l.0) - j0);
        while task.pieces[first].0 <= j0 {
            first += 1;
        }
        let last = last_piece(&task.pieces, j0 + nb);
        // The next block's rows sit at scattered slots, which hardware prefetchers do not
        // follow: ask for them while this block computes.
        if fused {
            // The fused score product asks for the keys two groups of 8 ahead and for its
            // group's values as it goes (see `scores8_f16_avx2`); only a task's first keys
            // are asked for here. (Asking for a whole block's rows at once floods the
            // cache's miss buffers: measured with `benches/attend.rs`.)
            if j0 == task.k0 {
                for j in j0..(j0 + AHEAD).min(task.k1) {
                    let s = slot(j);
                    prefetch(&k[kw.at(s, kvh)..][..hd]);
                }
            }
        } else {
            for j in j0 + KB..(j0 + 2 * KB).min(task.k1) {
                let s = slot(j);
                prefetch(&k[kw.at(s, kvh)..][..hd]);
                prefetch(&v[vw.at(s, kvh)..][..hd]);
            }
        }
        let slots: [usize; KB] = std::array::from_fn(|jj| if jj < nb { slot(j0 + jj) } else { 0 });
        let target = offset_of(rotations, rot);
        // A block whose keys all share the queries' offset needs no turned copy.
        let fuse =
            fused && (first..=last).all(|p| offset_of(rotations, task.pieces[p].1) == target);
        if kf.is_none() && !fuse {
            for (jj, &s) in slots[..nb].iter().enumerate() {
                let (kr, vr) = (&k[kw.at(s, kvh)..][..hd], &v[vw.at(s, kvh)..][..hd]);
                ld.row(tier, kr, &mut kb[jj * hd..(jj + 1) * hd]);
                ld.row(tier, vr, &mut vb[jj * hd..(jj + 1) * hd]);
            }
        }
        // Keys of other offsets than the queries' turn by the difference, in the f32 copy
        // (f32 storage: copied first); `turned` marks them.
        let mut turned = 0u64;
        for p in first..=last {
            let d = target - offset_of(rotations, task.pieces[p].1);
            if d == 0 {
                continue;
            }
            let r = &rotations[rotations
                .iter()
                .position(|r| r.0 == d)
                .expect("the plan made every turn a block needs")]
            .1;
            let start = if p == 0 {
                task.k0
            } else {
                task.pieces[p - 1].0
            };
            for jj in start.max(j0) - j0..task.pieces[p].0.min(j0 + nb) - j0 {
                let row = &mut kb[jj * hd..(jj + 1) * hd];
                if let Some(f) = kf {
                    row.copy_from_slice(&f[kw.at(slots[jj], kvh)..][..hd]);
                }
                r.apply_f32(row);
                turned |= 1 << jj;
            }
        }
        let zero = &zero[..hd];
        let krows = block_rows(kf, turned, |jj| kw.at(slots[jj], kvh), kb, zero, nb, hd);
        let vrows = block_rows(vf, 0, |jj| vw.at(slots[jj], kvh), vb, zero, nb, hd);
        let (k16b, v16b) = match (fuse, k16, v16) {
            (true, Some(k16), Some(v16)) => (
                stored_rows(k16, |jj| kw.at(slots[jj], kvh), nb, hd),
                stored_rows(v16, |jj| vw.at(slots[jj], kvh), nb, hd),
            ),
            _ => ([&[][..]; KB], [&[][..]; KB]),
        };
        // The next block's first keys, for the score product to ask for ahead.
        let ahead: [&[u16]; AHEAD] = match k16 {
            Some(k16) if fuse => std::array::from_fn(|i| {
                let j = j0 + nb + i;
                if j < task.k1 {
                    &k16[kw.at(slot(j), kvh)..][..hd]
                } else {
                    &[]
                }
            }),
            _ => [&[][..]; AHEAD],
        };
        if fuse {
            assert!(qt.len() >= 8 * hd && kb.len() >= 8 * hd && st.len() >= 8 * KB);
            // SAFETY: `fuse` is the AVX2 tier's, which the CPU runs (see [`run`]): it has AVX2,
            // FMA and F16C; the assert above and the first `nb` rows of `hd` values are its
            // bounds.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                super::avx2::scores8_f16_avx2(qt, &k16b, &ahead, &v16b, nb, kb, st, hd)
            };
        } else if rows_across {
            assert!(qt.len() >= 8 * hd && st.len() >= 8 * KB);
            // SAFETY: `rows_across` is the AVX2 tier's, which the CPU runs (see [`run`]); the
            // assert above and the block's rows of `hd` values are its bounds.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                super::avx2::scores8_avx2(qt, &krows, st, hd)
            };
        } else if direct {
            transpose_block(tier, &krows, nb, kt, hd);
            scores_keys::<W>(qb, rows, lanes, kt, st, hd);
        } else {
            scores(tier, qt, lanes, &krows, st, hd);
        }
        // Rows past a short block's `nb` keys are not read from here on.
        if j0 + nb > diag {
            for (jj, srow) in st.chunks_exact_mut(lanes).take(nb).enumerate() {
                let hidden = ((j0 + jj).saturating_sub(diag) * g).min(lanes);
                srow[..hidden].fill(f32::NEG_INFINITY);
            }
        }
        // The window hides key `j` from rows `r >= (j + w - diag) g`, a suffix of its real
        // rows (padding lanes keep their finite scores); only blocks that begin below the
        // last row's window are touched.
        if let Some(w) = window {
            if j0 + w < diag + task.toks.len() {
                for (jj, srow) in st.chunks_exact_mut(lanes).take(nb).enumerate() {
                    let from = ((j0 + jj + w).saturating_sub(diag) * g).min(rows);
                    srow[from..rows].fill(f32::NEG_INFINITY);
                }
            }
        }
        softmax_block(st, lanes, nb, m, l, corr);
        for (r, &cr) in corr[..padded].iter().enumerate() {
            if cr != 1.0 {
                for x in &mut o[r * hd..(r + 1) * hd] {
                    *x *= cr;
                }
            }
        }
        if fuse {
            assert!(st.len() >= 8 * nb && o.len() >= 8 * hd);
            // SAFETY: as for the scores above; the assert is the rest of its bounds.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                super::avx2::values8_f16_avx2(st, &v16b, o, hd, nb, rows)
            };
        } else {
            values::<W>(st, lanes, &vrows, o, padded, hd, nb);
        }
        j0 += nb;
    }
    if task.merged {
        // One span: its state as it is, for the merge to fold.
        out[..rows * hd].copy_from_slice(&o[..rows * hd]);
        out[rows * hd..rows * (hd + 1)].copy_from_slice(&m[..rows]);
        out[rows * (hd + 1)..rows * (hd + 2)].copy_from_slice(&l[..rows]);
        return;
    }
    for r in 0..rows {
        let span = &o[r * hd..(r + 1) * hd];
        let fr = &mut fo[r * hd..(r + 1) * hd];
        fold(&mut fm[r], &mut fl[r], fr, m[r], l[r], span);
        // A row that saw no key (a windowed part below its window) writes zeros, not NaN.
        finish(fl[r], fr, &mut out[r * hd..(r + 1) * hd]);
    }
    out[rows * hd..rows * (hd + 1)].copy_from_slice(&fm[..rows]);
    out[rows * (hd + 1)..rows * (hd + 2)].copy_from_slice(&fl[..rows]);
}

/// A key block's first `nb` rows for one kv head as stored (at `at(jj)`), empty past them.
#[inline(always)]
fn stored_rows<T>(rows: &[T], at: impl Fn(usize) -> usize, nb: usize, hd: usize) -> [&[T]; KB] {
    std::array::from_fn(|jj| if jj < nb { &rows[at(jj)..][..hd] } else { &[] })
}

/// A key block's rows for one kv head: in place in `rows` (at `at(jj)`) when the storage is
/// f32 and bit `jj` of `copied` is clear, else the converted rows of `conv`; `zero` past the
/// block's `nb` keys.
#[inline(always)]
fn block_rows<'a>(
    rows: Option<&'a [f32]>,
    copied: u64,
    at: impl Fn(usize) -> usize,
    conv: &'a [f32],
    zero: &'a [f32],
    nb: usize,
    hd: usize,
) -> [&'a [f32]; KB] {
    std::array::from_fn(|jj| match (jj < nb, rows) {
        (false, _) => zero,
        (true, Some(f)) if copied & (1 << jj) == 0 => &f[at(jj)..at(jj) + hd],
        (true, _) => &conv[jj * hd..(jj + 1) * hd],
    })
}

/// One block's online softmax over its first `nb` keys, 16 query rows at a time (8 for a
/// direct task's 8 lanes; a row's bits are the same either way): updates
/// each row's running max `m` and sum `l`, turns the scores `st` into `2^(s - m)`, and
/// leaves in `corr` the factor by which the row's earlier value sums must be scaled.
///
/// A row may have seen no key yet (max `-inf`: below its window, or past its diagonal in a
/// span): it then subtracts 0 instead, so its probabilities and correction are 0, not
/// `2^(-inf - -inf)` = NaN, and its max stays `-inf` and its sum 0. A block in which a row
/// sees no key thus leaves its state as it was, bit for bit.
#[inline(always)]
fn softmax_block(
    st: &mut [f32],
    lanes: usize,
    nb: usize,
    m: &mut [f32],
    l: &mut [f32],
    corr: &mut [f32],
) {
    if lanes.is_multiple_of(16) {
        softmax_lanes::<16>(st, lanes, nb, m, l, corr)
    } else {
        softmax_lanes::<8>(st, lanes, nb, m, l, corr)
    }
}

/// [`softmax_block`] in chunks of `L` lanes (`lanes` a multiple of `L`).
#[inline(always)]
fn softmax_lanes<const L: usize>(
    st: &mut [f32],
    lanes: usize,
    nb: usize,
    m: &mut [f32],
    l: &mut [f32],
    corr: &mut [f32],
) {
    debug_assert!(lanes.is_multiple_of(L));
    for c0 in (0..lanes).step_by(L) {
        let at = |jj: usize| jj * lanes + c0;
        let mut mx: [f32; L] = m[c0..c0 + L].try_into().expect("L lanes");
        for jj in 0..nb {
            let s: &[f32; L] = st[at(jj)..at(jj) + L].try_into().expect("L lanes");
            for (a, &x) in mx.iter_mut().zip(s) {
                *a = a.max(x);
            }
        }
        let base = mx.map(|x| if x == f32::NEG_INFINITY { 0.0 } else { x });
        let mut sum = [0f32; L];
        for jj in 0..nb {
            let s: &mut [f32; L] = (&mut st[at(jj)..at(jj) + L]).try_into().expect("L lanes");
            for ((x, a), &mr) in s.iter_mut().zip(&mut sum).zip(&base) {
                *x = exp2(*x - mr);
                *a += *x;
            }
        }
        let rows = c0..c0 + L;
        for (((((mo, lo), co), &mr), &b), &sr) in m[rows.clone()]
            .iter_mut()
            .zip(&mut l[rows.clone()])
            .zip(&mut corr[rows])
            .zip(&mx)
            .zip(&base)
            .zip(&sum)
        {
            let cr = exp2(*mo - b);
            *co = cr;
            *lo = *lo * cr + sr;
            *mo = mr;
        }
    }
}

/// Hints the CPU to bring `row` into the cache; no effect on results.
#[inline(always)]
pub(super) fn prefetch<T>(row: &[T]) {
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

/// `o[r] += sum_j st[j][r] * v[j]` over the block's `nb` keys: [`RB`] rows at a time, in
/// head-dim chunks of `W` lanes, then of [`DC`], then one lane at a time. Every value is one
/// FMA per key, in key order, however it is chunked (AVX2's fused f16 kernel sums the same).
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
                    o[rr * hd + d] = p.mul_add(vr[d], o[rr * hd + d]);
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
