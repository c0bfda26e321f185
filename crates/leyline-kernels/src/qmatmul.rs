//! CPU matrix products with GGML-quantized weights (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K,
//! Q6_K) and f32 activations, for decode steps and short prefills (up to 96 activation rows
//! with AVX-512, 32 elsewhere).
//!
//! Design decision: activations stay f32 and the weights are dequantized in registers or
//! into an L1 buffer (`w = d * q + m`, every kind reduced to that form with exact f32 scales,
//! see `format::row_scales`), so results match the f32-dequantized weights up to float
//! rounding. Few rows meet a tile of weight rows in dot products, the
//! weights read once per 32 activation rows; from 13 rows, where little of a vector would be
//! padding, AVX-512 broadcasts each weight against 16 transposed activation rows per vector,
//! up to 64 rows per pass over the weights. Output rows are split over the threads; the
//! kernels' [`Tier`] (AVX-512, AVX2+FMA+F16C, portable) is chosen at run time. AVX-512
//! kernels exist for Q4_1 and Q8_0 only; the other kinds run the AVX2 ones on an AVX-512 CPU
//! ([`GgmlKind::best_tier`]).
//!
//! Files: `format.rs` holds the block formats and the repacked [`QMatrix`]; this file the
//! few-row products, their threading and the kernel dispatch; `wide.rs` the many-row
//! products (dequantized chunks through gemm); `scalar.rs`, `avx2.rs` and `avx512.rs`
//! one kernel family per instruction set, `tile.rs` what the two x86 ones share.

use crate::pool::{split, SpinPool};
use crate::Tier;
use format::SLACK;
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

pub use format::{GgmlKind, QMatrix};

mod format;
mod scalar;
mod wide;
#[cfg(target_arch = "x86_64")]
#[macro_use]
mod tile;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod int8;
#[cfg(test)]
mod reference;
#[cfg(test)]
mod tests;

/// Below this many weight bytes (times min(m, 4)) a product runs on the calling thread.
const SERIAL_BYTES: usize = 96 * 1024;

impl GgmlKind {
    /// The tier the products of a matrix of this kind take when `tier` is asked for: `tier`,
    /// or AVX2 where `tier` is AVX-512 and it has no kernel for the kind (a CPU that runs
    /// AVX-512 runs AVX2).
    pub fn tier_on(self, tier: Tier) -> Tier {
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
        if m == 1 {
            // One row: each product is a slice of it, already in the kernels' [rows_i, 1].
            let mut targets = Vec::with_capacity(mats.len());
            let mut rest = y;
            for &w in mats {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(w.rows);
                targets.push((w, head));
                rest = tail;
            }
            let act = Q8Act::for_row(tier, mats, x);
            Self::feature_major_many(pool, tier, x, &[], 1, act.get(), targets.into_iter());
            return;
        }
        SCRATCH.with_borrow_mut(|Scratch { xt, yt }| {
            // One transposition (if a kernel wants one) serves every matrix and thread.
            if let Some(w) = mats.iter().find(|w| w.kind.tier_on(tier) == tier) {
                prepare(Some(pool), tier, x, m, w.cols, xt);
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
            Self::feature_major_many(pool, tier, x, xt, m, None, targets.into_iter());
            let (mut col, mut at) = (0, 0);
            for w in mats {
                feature_major_to_rows(&yt[at..at + w.rows * m], m, y, width, col);
                col += w.rows;
                at += w.rows * m;
            }
        });
    }

    /// The products of [`Self::matmul_concat`] into feature-major `[rows_i, m]` targets.
    fn feature_major_many<'a>(
        pool: &SpinPool,
        tier: Tier,
        x: &[f32],
        xt: &[f32],
        m: usize,
        act: Option<&Q8Act>,
        targets: impl Iterator<Item = (&'a QMatrix, &'a mut [f32])>,
    ) {
        let parts = pool.threads();
        let mut pieces: Vec<Vec<Mutex<&mut [f32]>>> = Vec::new();
        let mut mats: Vec<&QMatrix> = Vec::new();
        for (w, mut out) in targets {
            let mut v = Vec::with_capacity(parts);
            for p in 0..parts {
                let r = split(w.rows, p, parts, 4);
                let (head, tail) = out.split_at_mut(r.len() * m);
                v.push(Mutex::new(head));
                out = tail;
            }
            pieces.push(v);
            mats.push(w);
        }
        pool.run(&|tid, n| {
            for (w, piece) in mats.iter().zip(&pieces) {
                let r = split(w.rows, tid, n, 4);
                if r.is_empty() {
                    continue;
                }
                let mut out = piece[tid].lock().unwrap_or_else(|e| e.into_inner());
                match act {
                    Some(act) if act.serves(tier, w.kind) => w.rows_int8(r.start, act, &mut out),
                    _ => w.rows_into(tier, r.start, x, xt, m, &mut out),
                }
            }
        });
    }

    /// Computes rows `r0 .. r0 + out.len() / m` into `out: [n, m]`.
    /// `xt` is `x` as [`prepare`] leaves it for `tier` at `m` rows.
    fn rows_into(&self, tier: Tier, r0: usize, x: &[f32], xt: &[f32], m: usize, out: &mut [f32]) {
        let n = out.len() / m;
        assert!(r0 + n <= self.rows && out.len() == n * m && x.len() == m * self.cols);
        let g = Self::geom_of(self.kind, self.cols);
        let rows = &self.data[r0 * g.stride..(r0 + n) * g.stride + SLACK];
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
            Tier::Avx512 => {
                // SAFETY: as above, the CPU has AVX-512F; `tier_on` kept the tier, so the
                // module has kernels for this kind.
                unsafe { avx512::rows(self.kind, g, rows, x, xt, m, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("only the portable tier is available off x86-64"),
        }
    }
}

/// Whether one-row products may run the integer kernels ([`set_int8_decode`]).
static INT8_DECODE: AtomicBool = AtomicBool::new(false);

/// Lets one-row products (decode steps of one sequence) run the integer kernels where the
/// kind takes the AVX2 tier: faster, but their activations are rounded to 8 bits per block
/// of 32, so a sequence decoded alone no longer computes what it computes batched with
/// others (more rows take the f32 kernels). Off by default; process-wide.
pub fn set_int8_decode(on: bool) {
    INT8_DECODE.store(on, Ordering::Relaxed);
}

/// Whether a one-row product of a `kind` matrix runs the integer kernels now, on this CPU,
/// its activations rounded to 8 bits per block of 32 (`int8.rs`).
pub fn decodes_in_int8(kind: GgmlKind) -> bool {
    INT8_DECODE.load(Ordering::Relaxed)
        && cfg!(target_arch = "x86_64")
        && kind.best_tier() == Tier::Avx2
}

/// A decode row's activations quantized to 8 bits, for the integer kernels (`int8.rs`),
/// which serve every kind whose products take the AVX2 tier; the kinds with AVX-512 kernels
/// keep theirs.
struct Q8Act {
    #[cfg(target_arch = "x86_64")]
    row: Option<int8::Q8Row>,
}

impl Q8Act {
    /// The quantized row, when some matrix of `mats` takes the integer kernels.
    fn for_row(tier: Tier, mats: &[&QMatrix], x: &[f32]) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let used = INT8_DECODE.load(Ordering::Relaxed)
                && mats.iter().any(|w| w.kind.tier_on(tier) == Tier::Avx2);
            Self {
                row: used.then(|| int8::Q8Row::quantize(x)),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (tier, mats, x);
            Self {}
        }
    }

    fn get(&self) -> Option<&Self> {
        #[cfg(target_arch = "x86_64")]
        return self.row.as_ref().map(|_| self);
        #[cfg(not(target_arch = "x86_64"))]
        None
    }

    /// Whether a product of a `kind` matrix on `tier` runs the integer kernels.
    fn serves(&self, tier: Tier, kind: GgmlKind) -> bool {
        kind.tier_on(tier) == Tier::Avx2
    }
}

impl QMatrix {
    /// Rows `r0 .. r0 + out.len()` against one quantized activation row.
    fn rows_int8(&self, r0: usize, act: &Q8Act, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let Some(row) = &act.row {
            let n = out.len();
            assert!(r0 + n <= self.rows && row.q.len() == self.cols);
            let g = Self::geom_of(self.kind, self.cols);
            let rows = &self.data[r0 * g.stride..(r0 + n) * g.stride + SLACK];
            // SAFETY: `serves` chose this because the kind's products take the AVX2 tier,
            // which `tier_on` gives only where the CPU runs it (AVX2, FMA and F16C).
            unsafe { int8::rows(self.kind, g, rows, row, out) };
            return;
        }
        unreachable!(
            "integer kernels without a quantized row ({r0}, {})",
            out.len()
        );
    }

    /// `y = x W^T` for one row `x` through the integer kernels (activations rounded to 8 bits
    /// per block of 32), on the calling thread: for tests and benchmarks. `None` where the
    /// CPU lacks AVX2, FMA or F16C.
    ///
    /// # Panics
    /// If `x.len() != cols` or `y.len() != rows`.
    pub fn matvec_int8(&self, x: &[f32], y: &mut [f32]) -> Option<()> {
        assert!(x.len() == self.cols && y.len() == self.rows);
        if !Tier::Avx2.available() {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        let act = Q8Act {
            row: Some(int8::Q8Row::quantize(x)),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let act = Q8Act {};
        self.rows_int8(0, &act, y);
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
    if tier == Tier::Avx512 && avx512::bcast_pays(m) {
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
    for (r, ys) in yt.chunks_exact(m).enumerate() {
        for (i, &v) in ys.iter().enumerate() {
            y[i * stride + col + r] = v;
        }
    }
}
