//! Products with many activation rows (prefill) on quantized weights: chunks of weight rows
//! are dequantized into a per-thread f32 buffer and multiplied by gemm's f32 kernels.
//!
//! Design decision: the weights stay in their file's format; an f32 copy of every weight
//! took 7x the bytes of a Q4_K file (4.46 GB resident for Qwen2.5-Coder-0.5B). Here each
//! weight is converted once per product and then meets every activation row inside gemm,
//! so at hundreds of rows the conversion is a small share of the product, and the results
//! are those of the f32 weights (each weight the format's value rounded once, as in every
//! kernel here) against the activations as every product reads them (`q8.rs`).

use super::format::SLACK;
use super::{scalar, QMatrix};
use crate::gemm::gemm_into;
use crate::pool::SpinPool;
use crate::Tier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Weight rows per chunk: gemm packs the activations once per chunk, so wider chunks pack
/// less often; a chunk's f32 weights (128 rows x 4,864 inputs: 2.5 MB) stay in the shared
/// cache.
const CHUNK: usize = 128;

impl QMatrix {
    /// Rows `r0 .. r0 + n` into `w: [n, cols]` row-major, each weight the format's value
    /// rounded once to f32, as every kernel of this module sees it.
    ///
    /// # Panics
    /// If `w.len()` is not a multiple of `cols` or the rows run past the matrix.
    pub fn dequantize_rows(&self, r0: usize, w: &mut [f32]) {
        let n = w.len() / self.cols;
        assert!(
            w.len() == n * self.cols && r0 + n <= self.rows,
            "rows {r0}..{} of a [{}, {}] matrix into {} values",
            r0 + n,
            self.rows,
            self.cols,
            w.len()
        );
        let g = Self::geom_of(self.kind, self.cols);
        // The n rows, then the slack.
        let rows = &*self.ggml_rows(r0, n);
        #[cfg(target_arch = "x86_64")]
        if Tier::best() >= Tier::Avx2 {
            // SAFETY: the CPU runs the AVX2 tier (`best` never exceeds what it runs, and a CPU
            // runs every tier below one it runs): it has AVX2, FMA and F16C. `rows` holds the
            // n rows and the slack after the last row of the matrix.
            unsafe { super::avx2::dequant_rows(self.kind, g, rows, w) };
            return;
        }
        scalar::dequant_rows(self.kind, g, &rows[..rows.len() - SLACK], w);
    }

    /// `y = x [W_0 | W_1 | ...]^T` as [`Self::matmul_concat`] computes it, for many rows
    /// `m`: the threads of `pool` take chunks of weight rows in turn, dequantize each once
    /// and multiply it with all of `x` in one gemm call on their own thread.
    ///
    /// # Panics
    /// If `x.len() != m * cols` of some matrix or `y` is not `[m, sum of rows_i]`.
    pub fn matmul_wide(pool: &SpinPool, x: &[f32], m: usize, mats: &[&QMatrix], y: &mut [f32]) {
        let width: usize = mats.iter().map(|w| w.rows).sum();
        assert_eq!(y.len(), m * width, "y must be [m, sum of rows]");
        for w in mats {
            assert_eq!(x.len(), m * w.cols, "x must be [m, cols]");
        }
        if m == 0 {
            return;
        }
        // The activations rounded as the few-row products round them (`q8.rs`).
        let cols = mats.first().map_or(0, |w| w.cols);
        let held = (super::activations() == super::Activations::Int8)
            .then(|| super::Rounded::new(x, cols, mats));
        // (matrix, first row, rows, column of y)
        let mut jobs = Vec::new();
        let mut col = 0;
        for (k, w) in mats.iter().enumerate() {
            for r0 in (0..w.rows).step_by(CHUNK) {
                jobs.push((k, r0, CHUNK.min(w.rows - r0), col + r0));
            }
            col += w.rows;
        }
        let next = AtomicUsize::new(0);
        let y = Mutex::new(y);
        pool.run(&|_, _| {
            let (mut wbuf, mut ybuf) = (Vec::new(), Vec::new());
            while let Some(&(k, r0, n, c)) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                let w = mats[k];
                wbuf.resize(n * w.cols, 0.0);
                w.dequantize_rows(r0, &mut wbuf);
                ybuf.resize(m * n, 0.0);
                let x = held.as_ref().map_or(x, |r| r.of(w.kind));
                gemm_into(n, w.cols, &wbuf, (w.cols, 1), x, m, &mut ybuf, 1);
                // Columns c .. c + n of every row: a copy of m * n floats per chunk of
                // 2 * m * n * cols flops, so the lock is rarely contended.
                let mut y = y.lock().unwrap_or_else(|e| e.into_inner());
                for (yr, br) in y.chunks_exact_mut(width).zip(ybuf.chunks_exact(n)) {
                    yr[c..c + n].copy_from_slice(br);
                }
            }
        });
    }
}
