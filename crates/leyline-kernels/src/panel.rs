//! f32 products `y = x W^T` for many rows, on weights stored in panels of 64 outputs.
//!
//! Design decision: the gemm crate packs its left operand (here the weight) into panels on
//! every call with many rows, and a tau-bench replay spent 9% of its time there. Storing the
//! weight once in that order (`[out / 64][in][64]`, the last panel padded with zeros) lets a
//! 4-vector x 6-row tile stream it as it lies: per input column, four loads of the panel and
//! six broadcasts of activations feed 24 accumulators. A thread takes a block of activation
//! rows and walks every panel over it, so a panel (147 KB at 576 inputs) is read from the
//! shared cache once per block and then from its own L2 for each tile of the block.

use crate::mem::HugeBuf;
use crate::pool::SpinPool;
use crate::Tier;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Outputs per panel: four 16-lane vectors.
pub const PANEL: usize = 64;
/// Activation rows per register tile.
const TILE: usize = 6;

/// A weight `W: [out, in]` in panels of [`PANEL`] outputs.
pub struct Panels {
    data: HugeBuf<f32>,
    out: usize,
    inp: usize,
}

impl Panels {
    /// Whether the kernels run AVX-512 here ([`Tier::best`]), which [`Panels::matmul`] needs.
    pub fn available() -> bool {
        Tier::best() >= Tier::Avx512
    }

    /// Packs `W` given column-major (`wt[k * out + i] = W(i, k)`).
    ///
    /// # Panics
    /// If `wt.len() != out * inp`.
    pub fn from_col_major(wt: &[f32], out: usize, inp: usize) -> Self {
        assert_eq!(wt.len(), out * inp, "weight must be [in, out]");
        let panels = out.div_ceil(PANEL);
        let mut data = HugeBuf::zeroed(panels * inp * PANEL);
        for (p, panel) in data.chunks_exact_mut(inp * PANEL).enumerate() {
            let (i0, i1) = (p * PANEL, ((p + 1) * PANEL).min(out));
            for (k, dst) in panel.chunks_exact_mut(PANEL).enumerate() {
                dst[..i1 - i0].copy_from_slice(&wt[k * out + i0..k * out + i1]);
            }
        }
        Self { data, out, inp }
    }

    /// The weight column-major again (`[in, out]`), as [`Self::from_col_major`] took it.
    pub fn to_col_major(&self) -> Vec<f32> {
        let mut wt = vec![0f32; self.out * self.inp];
        for (p, panel) in self.data.chunks_exact(self.inp * PANEL).enumerate() {
            let (i0, i1) = (p * PANEL, ((p + 1) * PANEL).min(self.out));
            for (k, src) in panel.chunks_exact(PANEL).enumerate() {
                wt[k * self.out + i0..k * self.out + i1].copy_from_slice(&src[..i1 - i0]);
            }
        }
        wt
    }

    /// `y: [m, out] = x: [m, in] W^T`, split over `pool` by blocks of rows.
    ///
    /// # Panics
    /// If this CPU does not run [`Tier::Avx512`] or a length does not match.
    pub fn matmul(&self, pool: &SpinPool, x: &[f32], m: usize, y: &mut [f32]) {
        assert!(Tier::Avx512.available(), "panel products need AVX-512F");
        let (out, inp) = (self.out, self.inp);
        assert_eq!(x.len(), m * inp, "x must be [m, in]");
        assert_eq!(y.len(), m * out, "y must be [m, out]");
        if m == 0 || out == 0 {
            return;
        }
        // Two blocks per thread, whole tiles each, so a slow thread is not left with half.
        let blocks = 2 * pool.threads();
        let rows = m.div_ceil(blocks).div_ceil(TILE) * TILE;
        let pieces: Vec<Mutex<&mut [f32]>> = y.chunks_mut(rows * out).map(Mutex::new).collect();
        let next = AtomicUsize::new(0);
        pool.run(&|_, _| loop {
            let b = next.fetch_add(1, Ordering::Relaxed);
            let Some(piece) = pieces.get(b) else { break };
            let mut yb = piece.lock().unwrap_or_else(|e| e.into_inner());
            let xb = &x[b * rows * inp..][..yb.len() / out * inp];
            self.block(xb, &mut yb);
        });
    }

    /// All panels over the rows of `x` (and `y`).
    fn block(&self, x: &[f32], y: &mut [f32]) {
        let (out, inp) = (self.out, self.inp);
        let m = y.len() / out;
        for (p, panel) in self.data.chunks_exact(inp * PANEL).enumerate() {
            let col = p * PANEL;
            let valid = (out - col).min(PANEL);
            for r0 in (0..m).step_by(TILE) {
                let c = (m - r0).min(TILE);
                let xs = &x[r0 * inp..(r0 + c) * inp];
                let ys = &mut y[r0 * out..(r0 + c - 1) * out + col + valid];
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `matmul` asserted AVX-512F; `panel` holds `inp` rows of PANEL
                // values, `xs` c rows of `inp`, and `ys` reaches output `col + valid` of its
                // last row, which `tile` checks too.
                unsafe {
                    match c {
                        6 => avx512::tile::<6>(panel, xs, inp, ys, out, col, valid),
                        5 => avx512::tile::<5>(panel, xs, inp, ys, out, col, valid),
                        4 => avx512::tile::<4>(panel, xs, inp, ys, out, col, valid),
                        3 => avx512::tile::<3>(panel, xs, inp, ys, out, col, valid),
                        2 => avx512::tile::<2>(panel, xs, inp, ys, out, col, valid),
                        _ => avx512::tile::<1>(panel, xs, inp, ys, out, col, valid),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                unreachable!("panel products run on x86-64 only ({c} rows at {col})");
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::PANEL;
    use std::arch::x86_64::*;

    /// `ys[r * out + col + i] = sum_k xs[r * inp + k] * panel[k * PANEL + i]` for rows
    /// `r < C` and outputs `i < valid`.
    ///
    /// # Safety
    /// The CPU must have AVX-512F. Lengths are asserted.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile<const C: usize>(
        panel: &[f32],
        xs: &[f32],
        inp: usize,
        ys: &mut [f32],
        out: usize,
        col: usize,
        valid: usize,
    ) {
        assert!(panel.len() >= inp * PANEL && xs.len() >= C * inp && valid <= PANEL);
        assert!(ys.len() >= (C - 1) * out + col + valid);
        let mut acc = [[_mm512_setzero_ps(); 4]; C];
        let (w, x) = (panel.as_ptr(), xs.as_ptr());
        for k in 0..inp {
            // SAFETY: k < inp, so the panel row `k * PANEL .. + 64` and every row's
            // element `r * inp + k` (r < C) lie inside the slices asserted above.
            unsafe {
                let row = w.add(k * PANEL);
                let wv = [
                    _mm512_loadu_ps(row),
                    _mm512_loadu_ps(row.add(16)),
                    _mm512_loadu_ps(row.add(32)),
                    _mm512_loadu_ps(row.add(48)),
                ];
                for (r, a) in acc.iter_mut().enumerate() {
                    let xb = _mm512_set1_ps(*x.add(r * inp + k));
                    for (a, &w) in a.iter_mut().zip(&wv) {
                        *a = _mm512_fmadd_ps(w, xb, *a);
                    }
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, &a) in row.iter().enumerate() {
                let lanes = valid.saturating_sub(v * 16).min(16);
                if lanes == 0 {
                    break;
                }
                let at = r * out + col + v * 16;
                let dst = &mut ys[at..at + lanes];
                let mask: __mmask16 = if lanes == 16 {
                    0xffff
                } else {
                    (1 << lanes) - 1
                };
                // SAFETY: the masked store writes `lanes` floats, all inside `dst`.
                unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr(), mask, a) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Output widths around the panel size, every tile height, uneven blocks: against a
    /// scalar f64 product.
    #[test]
    fn products_match_a_scalar_reference() {
        Tier::note_lacking();
        if !Tier::Avx512.available() {
            return;
        }
        for (out, inp) in [(64, 32), (100, 45), (17, 8), (192, 576), (130, 1)] {
            let wt = values(out * inp, out as u64);
            let panels = Panels::from_col_major(&wt, out, inp);
            assert_eq!(panels.to_col_major(), wt);
            for threads in [1, 3] {
                let pool = SpinPool::new(threads);
                for m in [1, 2, 5, 6, 7, 13, 97, 150] {
                    let x = values(m * inp, 7 + m as u64);
                    let mut y = vec![f32::NAN; m * out];
                    panels.matmul(&pool, &x, m, &mut y);
                    for r in 0..m {
                        for i in 0..out {
                            let terms = (0..inp)
                                .map(|k| f64::from(x[r * inp + k]) * f64::from(wt[k * out + i]));
                            let want: f64 = terms.clone().sum();
                            // The worst-case rounding of an f32 sum of `inp` products.
                            let bound = inp as f64 * 6e-8 * terms.map(f64::abs).sum::<f64>();
                            let got = f64::from(y[r * out + i]);
                            assert!(
                                (got - want).abs() <= bound + 1e-30,
                                "[{out}, {inp}] m={m} threads={threads} row {r} output {i}: \
                                 {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
