//! CPU matrix products with GGML-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
//! Q6_K): few-row products (decode steps, short prompts) and many-row ones (prefill).
//!
//! Design decision: by default ([`Activations::Int8`]) every product reads its activations
//! rounded to 8 bits (`q8.rs`), as llama.cpp's do, and from the AVX2 tier up meets the
//! weights' quants in integer dot products for any number of rows. From that tier up every
//! matrix is interleaved at load in groups of 16 rows (`interleave.rs`) and one kernel per
//! kind and tier serves decode and prefill, one output per 32-bit lane: `grouped.rs` with
//! `vpdpbusd` (AVX-512 VNNI, 16 rows a vector), `grouped_avx2.rs` with `maddubs` (two
//! halves of 8 rows). Every (weight row, activation row) pair takes the same instructions in
//! the same order whatever the batch, and each row is rounded alone, so a row computes the
//! same bits alone, batched, or as the tail of a prompt whose head is
//! cached. The portable tier multiplies the same rounded values in f32, per pair the same
//! way for any row count. [`Activations::F32`] is the reference path: f32 kernels (weights
//! dequantized in registers) for few rows, dequantized chunks through gemm (`wide.rs`) for
//! many; its rows are not batch-invariant.
//!
//! Files: `format.rs` holds the block formats and [`QMatrix`]; this file the few-row
//! products, their threading and the kernel dispatch; `q8.rs` the activations' rounding;
//! `interleave.rs` the integer kernels' layout, `grouped.rs` and `grouped_avx2.rs` their
//! kernels; `wide.rs` the many-row f32 products (dequantized
//! chunks through gemm); `scalar.rs`, `avx2.rs` and `avx512.rs` the f32 kernels per
//! instruction set, `tile.rs` what the x86 ones share.

use crate::pool::{split, SpinPool};
use crate::Tier;
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub use format::QMatrix;
pub use kind::GgmlKind;

mod format;
mod kind;
mod q8;
mod scalar;
mod wide;
#[cfg(target_arch = "x86_64")]
#[macro_use]
mod tile;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod grouped;
#[cfg(target_arch = "x86_64")]
mod grouped_avx2;
#[cfg(target_arch = "x86_64")]
mod interleave;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

/// Below this many weight bytes (times min(m, 4)) a product runs on the calling thread.
const SERIAL_BYTES: usize = 96 * 1024;

impl GgmlKind {
    /// The tier the f32 kernels of this kind take when `tier` is asked for: `tier` (AVX-512
    /// for AVX-512 VNNI, which adds nothing to them), or AVX2 where it is AVX-512 and there is
    /// no AVX-512 kernel for the kind (a CPU that runs AVX-512 runs AVX2).
    pub fn tier_on(self, tier: Tier) -> Tier {
        let tier = tier.min(Tier::Avx512);
        if tier == Tier::Avx512 && !has_avx512_kernels(self) {
            Tier::Avx2
        } else {
            tier
        }
    }

    /// The tier the engine's products of a matrix of this kind take ([`Tier::best`]).
    pub fn best_tier(self) -> Tier {
        self.tier_on(Tier::best())
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx512_kernels(kind: GgmlKind) -> bool {
    avx512::has_kernels(kind)
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512_kernels(_: GgmlKind) -> bool {
    false
}

impl QMatrix {
    /// `y = x W^T` for `x: [m, cols]` and `y: [m, rows]` (row-major) on the kernels of
    /// `tier` (lowered by [`GgmlKind::tier_on`] where it has none for the kind), split over
    /// rayon's threads: for tests and benchmarks that compare the tiers. The engine's products go through
    /// [`Self::matmul_concat`].
    ///
    /// # Panics
    /// If this CPU does not run `tier`, `x.len() != m * cols` or `y.len() != m * rows`.
    pub fn matmul_with(&self, tier: Tier, x: &[f32], m: usize, y: &mut [f32]) {
        assert!(
            tier.available(),
            "kernel tier {tier} is not available on this CPU"
        );
        assert_eq!(x.len(), m * self.cols, "x must be [m, cols]");
        assert_eq!(y.len(), m * self.rows, "y must be [m, rows]");
        if m == 0 || self.rows == 0 {
            return;
        }
        let serial = self.weight_bytes() * m.min(4) < SERIAL_BYTES;
        let mut xt = Vec::new();
        prepare(None, self.kind.tier_on(tier), x, m, self.cols, &mut xt);
        let xt = xt.as_slice();
        // Rows per task: about four tasks per thread, a multiple of 4 rows.
        let tile = (self
            .rows
            .div_ceil(rayon::current_num_threads().max(1) * 4)
            .div_ceil(4)
            * 4)
        .max(16);
        if m == 1 {
            // y is already [rows, 1]: write it in place.
            if serial {
                self.rows_into(tier, 0, x, xt, 1, y);
            } else {
                y.par_chunks_mut(tile).enumerate().for_each(|(t, out)| {
                    self.rows_into(tier, t * tile, x, xt, 1, out);
                });
            }
            return;
        }
        // Compute [rows, m], then transpose into [m, rows].
        let mut yt = vec![0f32; self.rows * m];
        if serial {
            self.rows_into(tier, 0, x, xt, m, &mut yt);
        } else {
            yt.par_chunks_mut(tile * m)
                .enumerate()
                .for_each(|(t, out)| {
                    self.rows_into(tier, t * tile, x, xt, m, out);
                });
        }
        feature_major_to_rows(&yt, m, y, self.rows, 0);
    }

    /// `y = x [W_0 | W_1 | ...]^T` for `x: [m, cols]` and `y: [m, sum of rows_i]`, each row of
    /// `y` holding the products side by side, in one region of `pool`: every thread computes
    /// its share of the rows of every matrix, so a decode step pays one dispatch for, e.g.,
    /// the Q, K and V projections together.
    ///
    /// # Panics
    /// If `x.len() != m * cols` of some matrix or `y` is not `[m, sum of rows_i]`.
    pub fn matmul_concat(pool: &SpinPool, x: &[f32], m: usize, mats: &[&QMatrix], y: &mut [f32]) {
        let width: usize = mats.iter().map(|w| w.rows).sum();
        assert_eq!(y.len(), m * width, "y must be [m, sum of rows]");
        for w in mats {
            assert_eq!(x.len(), m * w.cols, "x must be [m, cols]");
        }
        let tier = Tier::best();
        let cols = mats.first().map_or(0, |w| w.cols);
        let rounded = activations() == Activations::Int8;
        // The integer kernels read interleaved matrices; a matrix loaded below their tier
        // (under a lower `LEYLINE_KERNEL_TIER`) is not.
        let int8 = if rounded && mats.iter().all(|w| w.interleaved) {
            Int8::on_pool(Some(pool), tier, x, m, cols, mats.iter().map(|w| w.kind))
        } else {
            None
        };
        // Below the integer kernels' tiers the f32 kernels read the rounded values.
        let held = (rounded && int8.is_none() && m > 0).then(|| Rounded::new(x, cols, mats));
        if m == 1 {
            // One row: each product is a slice of it, already in the kernels' [rows_i, 1].
            let mut targets = Vec::with_capacity(mats.len());
            let mut rest = y;
            for &w in mats {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(w.rows);
                targets.push((w, head));
                rest = tail;
            }
            let act = match (&int8, &held) {
                (Some(q), _) => Act::Int8(q),
                (None, Some(r)) => Act::Rounded(r),
                (None, None) => Act::F32 { x, xt: &[] },
            };
            Self::feature_major_many(pool, tier, act, 1, targets.into_iter());
            return;
        }
        SCRATCH.with_borrow_mut(|Scratch { xt, yt }| {
            // One transposition (if a kernel wants one) serves every matrix and thread.
            if int8.is_none() && held.is_none() {
                // The f32 kernels' tier (AVX-512 VNNI adds nothing to them).
                let ft = tier.min(Tier::Avx512);
                if let Some(w) = mats.iter().find(|w| w.kind.tier_on(tier) == ft) {
                    prepare(Some(pool), ft, x, m, w.cols, xt);
                }
            }
            if yt.len() < m * width {
                yt.resize(m * width, 0.0);
            }
            let mut targets = Vec::with_capacity(mats.len());
            let mut rest = &mut yt[..m * width];
            for &w in mats {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(w.rows * m);
                targets.push((w, head));
                rest = tail;
            }
            let act = match (&int8, &held) {
                (Some(q), _) => Act::Int8(q),
                (None, Some(r)) => Act::Rounded(r),
                (None, None) => Act::F32 { x, xt },
            };
            Self::feature_major_many(pool, tier, act, m, targets.into_iter());
            // The transposition, split over the threads by rows of y.
            let yt = &yt[..m * width];
            let parts = pool.threads();
            let mut pieces = Vec::with_capacity(parts);
            let mut rest = &mut *y;
            for p in 0..parts {
                let rows = split(m, p, parts, 1);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(rows.len() * width);
                pieces.push((rows, Mutex::new(head)));
                rest = tail;
            }
            pool.run(&|tid, _| {
                let (rows, piece) = &pieces[tid];
                let mut out = piece.lock().unwrap_or_else(|e| e.into_inner());
                let (mut col, mut at) = (0, 0);
                for w in mats {
                    let part = &yt[at..at + w.rows * m];
                    feature_major_rows_into(part, m, rows.clone(), &mut out, width, col);
                    col += w.rows;
                    at += w.rows * m;
                }
            });
        });
    }

    /// The products of [`Self::matmul_concat`] into feature-major `[rows_i, m]` targets.
    fn feature_major_many<'a>(
        pool: &SpinPool,
        tier: Tier,
        act: Act<'_>,
        m: usize,
        targets: impl Iterator<Item = (&'a QMatrix, &'a mut [f32])>,
    ) {
        let parts = pool.threads();
        let mut pieces: Vec<Vec<Mutex<&mut [f32]>>> = Vec::new();
        let mut mats: Vec<&QMatrix> = Vec::new();
        for (w, mut out) in targets {
            let mut v = Vec::with_capacity(parts);
            for p in 0..parts {
                let r = split(w.rows, p, parts, w.row_align());
                let (head, tail) = out.split_at_mut(r.len() * m);
                v.push(Mutex::new(head));
                out = tail;
            }
            pieces.push(v);
            mats.push(w);
        }
        pool.run(&|tid, n| {
            for (w, piece) in mats.iter().zip(&pieces) {
                let r = split(w.rows, tid, n, w.row_align());
                if r.is_empty() {
                    continue;
                }
                let mut out = piece[tid].lock().unwrap_or_else(|e| e.into_inner());
                match act {
                    Act::Int8(q) => w.rows_int8(r.start, q, &mut out),
                    Act::F32 { x, xt } => w.rows_into(tier, r.start, x, xt, m, &mut out),
                    Act::Rounded(x) => w.rows_into(tier, r.start, x.of(w.kind), &[], m, &mut out),
                }
            }
        });
    }

    /// The multiple of rows a thread's share of a product starts on: a group of an
    /// interleaved matrix, else 4.
    fn row_align(&self) -> usize {
        #[cfg(target_arch = "x86_64")]
        if self.interleaved {
            return interleave::GROUP;
        }
        4
    }

    /// Computes rows `r0 .. r0 + out.len() / m` into `out: [n, m]`.
    /// `xt` is `x` as [`prepare`] leaves it for `tier` at `m` rows.
    fn rows_into(&self, tier: Tier, r0: usize, x: &[f32], xt: &[f32], m: usize, out: &mut [f32]) {
        let n = out.len() / m;
        assert!(r0 + n <= self.rows && out.len() == n * m && x.len() == m * self.cols);
        let g = Self::geom_of(self.kind, self.cols);
        let rows = &*self.ggml_rows(r0, n);
        match self.kind.tier_on(tier) {
            Tier::Portable => scalar::rows(self.kind, g, rows, x, m, out),
            #[cfg(target_arch = "x86_64")]
            Tier::Avx2 => {
                // SAFETY: the tier is AVX2 because `matmul_with` asserted it is available,
                // `matmul_concat` took `Tier::best`, or `tier_on` lowered AVX-512 to it; each
                // means the CPU has AVX2, FMA and F16C. The slice lengths were asserted above.
                unsafe { avx2::rows(self.kind, g, rows, x, m, out) }
            }
            #[cfg(target_arch = "x86_64")]
            Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => {
                // SAFETY: as above, the CPU has AVX-512F; `tier_on` kept the tier, so the
                // module has kernels for this kind.
                unsafe { avx512::rows(self.kind, g, rows, x, xt, m, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("only the portable tier is available off x86-64"),
        }
    }
}

/// The activations a product's kernels read.
#[derive(Clone, Copy)]
enum Act<'a> {
    /// f32 rows and, where the tier's kernel wants one, their transposition ([`prepare`]).
    F32 { x: &'a [f32], xt: &'a [f32] },
    /// The rows quantized for the integer kernels.
    Int8(&'a Int8),
    /// The rows as the integer kernels would read them, in f32, for kernels below their
    /// tiers (which want no transposition).
    Rounded(&'a Rounded),
}

/// Activation rows rounded as each family of kinds reads them ([`q8::round_rows_for`]),
/// each family's made only if a matrix of the product needs it.
struct Rounded {
    /// For the kinds in blocks of 32.
    legacy: Vec<f32>,
    /// For the K-quants.
    k: Vec<f32>,
}

impl Rounded {
    /// `x: [m, cols]` rounded for the kinds of `mats`.
    fn new(x: &[f32], cols: usize, mats: &[&QMatrix]) -> Self {
        let of = |k: bool, kind| {
            if mats.iter().any(|w| w.kind.is_k() == k) {
                q8::round_rows_for(kind, x, cols)
            } else {
                Vec::new()
            }
        };
        Self {
            legacy: of(false, GgmlKind::Q8_0),
            k: of(true, GgmlKind::Q4K),
        }
    }

    /// The rows for a matrix of `kind`.
    fn of(&self, kind: GgmlKind) -> &[f32] {
        if kind.is_k() {
            &self.k
        } else {
            &self.legacy
        }
    }
}

/// Activation rows quantized to 8 bits for the integer kernels, which serve every kind
/// from the AVX2 tier up: per block of 32 ([`q8::Q8Row`]) for the kinds in blocks of 32,
/// per super-block of 256 ([`q8::Q8KRow`]) for the K-quants, each made only if a matrix of
/// the product needs it. Each row is quantized alone and each (weight row, activation row) product takes
/// the same instructions whatever the batch, so a row computes the same bits alone or
/// batched.
pub struct Int8 {
    #[cfg(target_arch = "x86_64")]
    rows: Vec<q8::Q8Row>,
    #[cfg(target_arch = "x86_64")]
    krows: Vec<q8::Q8KRow>,
    /// The tier whose kernels read the rows (AVX2 and up).
    #[cfg(target_arch = "x86_64")]
    tier: Tier,
    /// On the AMX tier, from [`amx::MIN_ROWS`] rows: `rows` and `krows` packed for the tiles.
    #[cfg(target_arch = "x86_64")]
    tiles: Option<(amx::Packed, amx::Packed)>,
}

impl Int8 {
    /// `x: [m, cols]` quantized for `tier`'s integer kernels and the kinds `kinds` (the
    /// matrices of a product); `None` below AVX2 (the portable tier keeps the f32 kernels)
    /// and off x86-64.
    ///
    /// # Panics
    /// If the CPU does not run `tier`, or `x` is not `[m, cols]` with `cols` a multiple of 32
    /// (of 256 where a kind is a K-quant).
    pub fn on(
        tier: Tier,
        x: &[f32],
        m: usize,
        cols: usize,
        kinds: impl IntoIterator<Item = GgmlKind>,
    ) -> Option<Self> {
        Self::on_pool(None, tier, x, m, cols, kinds)
    }

    /// [`Self::on`] with the rows quantized on `pool`'s threads (serially without one).
    fn on_pool(
        pool: Option<&SpinPool>,
        tier: Tier,
        x: &[f32],
        m: usize,
        cols: usize,
        kinds: impl IntoIterator<Item = GgmlKind>,
    ) -> Option<Self> {
        assert!(
            tier.available(),
            "kernel tier {tier} is not available on this CPU"
        );
        #[cfg(target_arch = "x86_64")]
        if tier >= Tier::Avx2 {
            assert!(x.len() == m * cols && cols.is_multiple_of(32));
            let (mut legacy, mut k) = (false, false);
            for kind in kinds {
                if kind.is_k() {
                    k = true;
                } else {
                    legacy = true;
                }
            }
            let rows = quantize_rows(pool, legacy, x, m, cols, q8::Q8Row::quantize);
            let krows = quantize_rows(pool, k, x, m, cols, q8::Q8KRow::quantize);
            let tiles = (tier >= Tier::Amx && m >= amx::MIN_ROWS).then(|| {
                (
                    amx::Packed::of_blocks32(&rows),
                    amx::Packed::of_supers(&krows),
                )
            });
            return Some(Self {
                rows,
                krows,
                tier,
                tiles,
            });
        }
        let _ = (pool, tier, x, m, cols, kinds.into_iter().count());
        None
    }
}

/// The `m` rows of `x: [m, cols]` quantized by `f` (none unless `on`), split over `pool`'s
/// threads where there are enough rows to pay for a dispatch.
#[cfg(target_arch = "x86_64")]
fn quantize_rows<T: Send>(
    pool: Option<&SpinPool>,
    on: bool,
    x: &[f32],
    m: usize,
    cols: usize,
    f: fn(&[f32]) -> T,
) -> Vec<T> {
    if !on || m == 0 {
        return Vec::new();
    }
    let rows = || x.chunks_exact(cols.max(1));
    match pool {
        Some(pool) if m > 4 * pool.threads() => {
            let parts = pool.threads();
            let done: Vec<Mutex<Vec<T>>> = (0..parts).map(|_| Mutex::new(Vec::new())).collect();
            pool.run(&|tid, _| {
                let r = split(m, tid, parts, 1);
                let q: Vec<T> = rows().skip(r.start).take(r.len()).map(f).collect();
                *done[tid].lock().unwrap_or_else(|e| e.into_inner()) = q;
            });
            done.into_iter()
                .flat_map(|d| d.into_inner().unwrap_or_else(|e| e.into_inner()))
                .collect()
        }
        _ => rows().map(f).collect(),
    }
}

/// How the quantized products read their activations ([`set_activations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    /// Rounded to 8 bits (per block of 32 values, per super-block of 256 for the K-quants),
    /// for every row count and tier: the integer kernels from the AVX2 tier up, the same
    /// rounded values in f32 on the portable tier. The default.
    Int8,
    /// As they are, in f32 (`--f32-activations`): the reference path. A row's bits depend on
    /// the rows it is batched with (few-row kernels or gemm), by float noise.
    F32,
}

/// Set by [`set_activations`]: whether products read 8-bit activations.
static INT8_ACTIVATIONS: AtomicBool = AtomicBool::new(true);

/// Chooses, process-wide, how the quantized products read their activations (the default is
/// [`Activations::Int8`]).
pub fn set_activations(a: Activations) {
    INT8_ACTIVATIONS.store(a == Activations::Int8, Ordering::Relaxed);
}

/// How the quantized products read their activations now.
pub fn activations() -> Activations {
    if INT8_ACTIVATIONS.load(Ordering::Relaxed) {
        Activations::Int8
    } else {
        Activations::F32
    }
}

/// `x: [m, cols]` as the quantized products with a `kind` matrix read it: under
/// [`Activations::Int8`] each row rounded to 8 bits per block of 32 (per super-block of 256
/// for the K-quants), else `x` itself. For callers' tests that compare products with a
/// reference.
///
/// # Panics
/// If `cols` is not a multiple of the rounding's block or does not divide `x.len()`.
pub fn activations_as_read(kind: GgmlKind, x: &[f32], cols: usize) -> Vec<f32> {
    match activations() {
        Activations::Int8 => q8::round_rows_for(kind, x, cols),
        Activations::F32 => x.to_vec(),
    }
}

impl QMatrix {
    /// Rows `r0 .. r0 + out.len() / m` against the `m` quantized activation rows, into
    /// `out: [n, m]`.
    fn rows_int8(&self, r0: usize, act: &Int8, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        {
            let m = act.rows.len().max(act.krows.len());
            let n = out.len() / m;
            assert!(r0 + n <= self.rows);
            assert!(
                self.interleaved,
                "integer products read matrices interleaved at load (from the AVX2 tier up)"
            );
            assert!(
                r0.is_multiple_of(interleave::GROUP),
                "a product starts on a group"
            );
            let (nb, g0) = (self.cols / self.kind.block_len(), r0 / interleave::GROUP);
            let (k, data) = (self.kind, &self.data[..]);
            let vnni = act.tier >= Tier::Avx512Vnni;
            // SAFETY: `act` is made only for a tier from AVX2 (with FMA and F16C) up that the
            // CPU runs (`Int8::on`), and holds tiles only on the AMX tier; lengths are
            // asserted by the kernels.
            unsafe {
                match (&act.tiles, vnni, k.is_k()) {
                    (Some((_, p)), _, true) => amx::rows(k, data, nb, g0, p, out),
                    (Some((p, _)), _, false) => amx::rows(k, data, nb, g0, p, out),
                    (None, true, true) => grouped::rows(k, data, nb, g0, &act.krows, out),
                    (None, true, false) => grouped::rows32(k, data, nb, g0, &act.rows, out),
                    (None, false, true) => grouped_avx2::rows(k, data, nb, g0, &act.krows, out),
                    (None, false, false) => grouped_avx2::rows32(k, data, nb, g0, &act.rows, out),
                }
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (r0, act, out);
    }

    /// `y = x W^T` for `x: [m, cols]` through the integer kernels of `tier` (activations
    /// rounded to 8 bits per block of 32), on the calling thread: for tests and benchmarks.
    /// `None` below the AVX2 tier, or for a matrix loaded below it (not interleaved).
    ///
    /// # Panics
    /// If the CPU does not run `tier`, `x.len() != m * cols` or `y.len() != m * rows`.
    pub fn matmul_int8(&self, tier: Tier, x: &[f32], m: usize, y: &mut [f32]) -> Option<()> {
        assert!(x.len() == m * self.cols && y.len() == m * self.rows);
        if !self.interleaved {
            return None;
        }
        let act = Int8::on(tier, x, m, self.cols, [self.kind])?;
        if m == 0 {
            return Some(());
        }
        let mut yt = vec![0f32; self.rows * m];
        self.rows_int8(0, &act, &mut yt);
        feature_major_to_rows(&yt, m, y, self.rows, 0);
        Some(())
    }
}

/// Buffers of [`QMatrix::matmul_concat`], kept per calling thread between calls.
#[derive(Default)]
struct Scratch {
    /// The activations as [`prepare`] leaves them.
    xt: Vec<f32>,
    /// The feature-major products before [`feature_major_to_rows`].
    yt: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Puts `x: [m, cols]` into `xt` in the layout the kernel of `tier` wants at `m` rows, if it
/// wants one other than `x` itself (AVX-512's broadcast tiles: transposed groups of 32 rows),
/// the columns split over `pool`'s threads (or serial without a pool). `xt` only grows.
fn prepare(
    pool: Option<&SpinPool>,
    tier: Tier,
    x: &[f32],
    m: usize,
    cols: usize,
    xt: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    if tier >= Tier::Avx512 && avx512::bcast_pays(m) {
        let len = avx512::transposed_len(m, cols);
        if xt.len() < len {
            xt.resize(len, 0.0);
        }
        let parts = pool.map_or(1, SpinPool::threads);
        // Group (of 32 rows) by part: each piece is one group's columns `c`.
        let mut pieces = Vec::with_capacity(m.div_ceil(32) * parts);
        let mut rest = &mut xt[..len];
        for i0 in (0..m).step_by(avx512::GROUP) {
            let lanes = (m - i0).min(avx512::GROUP).div_ceil(16) * 16;
            for p in 0..parts {
                let c = split(cols, p, parts, 1);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len() * lanes);
                pieces.push((i0, c, Mutex::new(head)));
                rest = tail;
            }
        }
        let job = |tid: usize, _: usize| {
            for (i0, c, dst) in pieces.iter().skip(tid).step_by(parts) {
                let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: the tier is AVX-512, which the caller checked this CPU runs.
                unsafe { avx512::transpose_cols(x, m, cols, *i0, c.clone(), &mut dst) };
            }
        };
        match pool {
            Some(pool) => pool.run(&job),
            None => job(0, 1),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (pool, tier, x, m, cols, xt);
}

/// Transposes the kernels' feature-major output `yt: [rows, m]` into columns `col ..` of
/// `y: [m, stride]`.
fn feature_major_to_rows(yt: &[f32], m: usize, y: &mut [f32], stride: usize, col: usize) {
    feature_major_rows_into(yt, m, 0..m, y, stride, col);
}

/// [`feature_major_to_rows`] for rows `rows` of the product only, into `y` holding just
/// those rows.
fn feature_major_rows_into(
    yt: &[f32],
    m: usize,
    rows: std::ops::Range<usize>,
    y: &mut [f32],
    stride: usize,
    col: usize,
) {
    // In blocks of 16 outputs: each row of y takes 64 contiguous bytes per block, and the 16
    // rows of yt a block reads stay in cache across the block's rows of y; whole 16 x 16
    // blocks are transposed in registers where the CPU has AVX-512.
    const B: usize = 16;
    let n = yt.len() / m.max(1);
    #[cfg(target_arch = "x86_64")]
    let simd = Tier::best() >= Tier::Avx512;
    for r0 in (0..n).step_by(B) {
        let r1 = (r0 + B).min(n);
        let mut k = 0;
        #[cfg(target_arch = "x86_64")]
        if simd && r1 - r0 == B {
            while k + B <= rows.len() {
                let (src, dst) = (r0 * m + rows.start + k, k * stride + col + r0);
                assert!(src + (B - 1) * m + B <= yt.len() && dst + (B - 1) * stride + B <= y.len());
                // SAFETY: the tier is AVX-512 (`Tier::best`); the assert keeps the 16 rows
                // of 16 floats read and written inside `yt` and `y`.
                unsafe {
                    avx512::transpose16(yt[src..].as_ptr(), m, y[dst..].as_mut_ptr(), stride)
                };
                k += B;
            }
        }
        for (k, i) in rows.clone().enumerate().skip(k) {
            let at = k * stride + col;
            for (j, o) in y[at + r0..at + r1].iter_mut().enumerate() {
                *o = yt[(r0 + j) * m + i];
            }
        }
    }
}
