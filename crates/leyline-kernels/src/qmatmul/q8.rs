//! The rounding of activations that every quantized product shares: each row to 8 bits per
//! block of 32 values ([`Q8Row`]) for the formats in blocks of 32, per super-block of 256
//! ([`Q8KRow`]) for the K-quants, as llama.cpp's Q8 and Q8_K activations. The integer
//! kernels (`grouped.rs`, `grouped_avx2.rs`) read the quantized values; the kernels that
//! multiply in f32 (the portable tier's and the many-row gemm of `wide.rs`) read the same
//! values turned back into floats ([`Q8Row::dequantize_into`]), so every path and every tier
//! computes the same products up to the order of f32 additions.

use super::kind::{GgmlKind, BLOCK};

/// One activation row quantized per block of 32 values: `x[i] ~ d[i / 32] * q[i]`.
pub(crate) struct Q8Row {
    /// The 8-bit values, `|q| <= 127`.
    pub(super) q: Vec<i8>,
    /// Each block's step, `max |x| / 127` of the block.
    pub(super) d: Vec<f32>,
    /// The sum of `q` over each block (at most 4,064 in size).
    pub(super) bs: Vec<i16>,
}

impl Q8Row {
    /// `d[b] * (sum of q over block b)`: what a block's offset or minimum meets.
    #[inline(always)]
    pub(super) fn dsum(&self, b: usize) -> f32 {
        self.d[b] * f32::from(self.bs[b])
    }

    /// Quantizes `x` (its length a multiple of 32): `q = round(x / d)`, ties away from zero.
    pub(crate) fn quantize(x: &[f32]) -> Self {
        debug_assert!(x.len().is_multiple_of(BLOCK));
        let nb = x.len() / BLOCK;
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; nb];
        let mut bs = vec![0i16; nb];
        for (b, (xb, qb)) in x
            .chunks_exact(BLOCK)
            .zip(q.chunks_exact_mut(BLOCK))
            .enumerate()
        {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            if amax == 0.0 || !amax.is_finite() {
                // Zeros (or a non-finite row, which the f32 path would spread anyway).
                d[b] = if amax.is_finite() { 0.0 } else { f32::NAN };
                continue;
            }
            let step = amax / 127.0;
            let inv = 127.0 / amax;
            for (qv, &v) in qb.iter_mut().zip(xb) {
                *qv = (v * inv).round().clamp(-127.0, 127.0) as i8;
            }
            d[b] = step;
            let sum: i32 = qb.iter().map(|&v| i32::from(v)).sum();
            bs[b] = sum as i16;
        }
        Self { q, d, bs }
    }

    /// The values the row stands for, `d[i / 32] * q[i]`, into `out` (the row's length).
    pub(crate) fn dequantize_into(&self, out: &mut [f32]) {
        dequantize(&self.q, &self.d, BLOCK, out);
    }
}

/// `d[i / block] * q[i]` into `out`.
fn dequantize(q: &[i8], d: &[f32], block: usize, out: &mut [f32]) {
    for ((ob, qb), &d) in out
        .chunks_exact_mut(block)
        .zip(q.chunks_exact(block))
        .zip(d)
    {
        for (o, &q) in ob.iter_mut().zip(qb) {
            *o = d * f32::from(q);
        }
    }
}

/// One activation row quantized per super-block of 256 values, for the K-quant kernels
/// (`grouped.rs`): `x[i] ~ d[i / 256] * q[i]`. One step per super-block lets a kernel sum a
/// super-block's integer products with the weights' integer sub-block scales before any
/// float operation, as llama.cpp's Q8_K does; the price is a coarser step than [`Q8Row`]'s
/// where a super-block's values differ much in size.
pub(crate) struct Q8KRow {
    /// The 8-bit values, `|q| <= 127`.
    pub(super) q: Vec<i8>,
    /// Each super-block's step, `max |x| / 127` of the super-block.
    pub(super) d: Vec<f32>,
    /// Sums of `q` per 16 values (at most 2,032 in size).
    pub(super) bs16: Vec<i16>,
    /// Sums of `q` per 32 values.
    pub(super) bs32: Vec<i16>,
}

/// Values per K-quant super-block.
const SUPER: usize = 256;

impl Q8KRow {
    /// Quantizes `x` (its length a multiple of 256): `q = round(x / d)`, ties away from zero.
    pub(crate) fn quantize(x: &[f32]) -> Self {
        assert!(x.len().is_multiple_of(SUPER));
        let ns = x.len() / SUPER;
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; ns];
        for (s, (xb, qb)) in x
            .chunks_exact(SUPER)
            .zip(q.chunks_exact_mut(SUPER))
            .enumerate()
        {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            if amax == 0.0 || !amax.is_finite() {
                // Zeros (or a non-finite row, which the f32 path would spread anyway).
                d[s] = if amax.is_finite() { 0.0 } else { f32::NAN };
                continue;
            }
            let inv = 127.0 / amax;
            for (qv, &v) in qb.iter_mut().zip(xb) {
                *qv = (v * inv).round().clamp(-127.0, 127.0) as i8;
            }
            d[s] = amax / 127.0;
        }
        let sums = |n: usize| -> Vec<i16> {
            q.chunks_exact(n)
                .map(|c| c.iter().map(|&v| i16::from(v)).sum())
                .collect()
        };
        let (bs16, bs32) = (sums(16), sums(32));
        Self { q, d, bs16, bs32 }
    }

    /// The values the row stands for, `d[i / 256] * q[i]`, into `out` (the row's length).
    pub(crate) fn dequantize_into(&self, out: &mut [f32]) {
        dequantize(&self.q, &self.d, SUPER, out);
    }
}

/// `x: [m, cols]` with each row rounded as the products with a `kind` matrix read it:
/// [`Q8KRow`] for the K-quants, [`Q8Row`] for the blocks of 32 (`cols` a multiple of the
/// block).
pub(crate) fn round_rows_for(kind: GgmlKind, x: &[f32], cols: usize) -> Vec<f32> {
    let block = if kind.is_k() { SUPER } else { BLOCK };
    assert!(cols.is_multiple_of(block) && x.len().is_multiple_of(cols.max(1)));
    let mut out = vec![0f32; x.len()];
    for (row, o) in x
        .chunks_exact(cols.max(1))
        .zip(out.chunks_exact_mut(cols.max(1)))
    {
        if kind.is_k() {
            Q8KRow::quantize(row).dequantize_into(o);
        } else {
            Q8Row::quantize(row).dequantize_into(o);
        }
    }
    out
}
