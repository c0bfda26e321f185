//! The rounding of activations that every quantized product shares: each row to 8 bits per
//! block of 32 values ([`Q8Row`]) for the formats in blocks of 32, per super-block of 256
//! ([`Q8KRow`]) for the K-quants, as llama.cpp's Q8 and Q8_K activations. The integer
//! kernels (`grouped.rs`, `grouped_avx2.rs`) read the quantized values; the kernels that
//! multiply in f32 (the portable tier's and the many-row gemm of `wide.rs`) read the same
//! values turned back into floats ([`Q8Row::dequantize_into`]), so every path and every tier
//! computes the same products up to the order of f32 additions.

use super::kind::{GgmlKind, BLOCK};

/// `quantize(x)`, which runs `quantize_in(x)` compiled for the widest tier this CPU runs
/// that the compiler vectorizes for (AVX-512, AVX2) or for the baseline target: the same
/// scalar operations, each exact, so every version returns the same bits (the baseline's
/// 4-wide SSE2 took 15% of a many-row product).
macro_rules! multiversioned_quantize {
    () => {
        /// Quantizes `x` (its length a multiple of the block): `q = round(x / d)`, ties away
        /// from zero.
        pub(crate) fn quantize(x: &[f32]) -> Self {
            #[cfg(target_arch = "x86_64")]
            {
                let tier = crate::Tier::best();
                if tier >= crate::Tier::Avx512 {
                    // SAFETY: the CPU runs the AVX-512 tier (`Tier::best`).
                    return unsafe { Self::quantize_avx512(x) };
                }
                if tier >= crate::Tier::Avx2 {
                    // SAFETY: the CPU runs the AVX2 tier (`Tier::best`).
                    return unsafe { Self::quantize_avx2(x) };
                }
            }
            Self::quantize_in(x)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn quantize_avx512(x: &[f32]) -> Self {
            Self::quantize_in(x)
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn quantize_avx2(x: &[f32]) -> Self {
            Self::quantize_in(x)
        }
    };
}

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

    multiversioned_quantize!();

    /// [`Self::quantize`]'s body, for a length a multiple of 32.
    #[inline(always)]
    fn quantize_in(x: &[f32]) -> Self {
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
                *qv = to_i8(v * inv);
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

/// `y` rounded to the nearest integer, ties away from zero, then clamped to `-127..=127`:
/// `y.round().clamp(-127.0, 127.0) as i8` to the bit, in operations the compiler vectorizes
/// (`round` is a libm call per value on the baseline target). `y - trunc(y)` is exact for
/// every `f32` within the clamp, and a NaN gives 0 as the cast does.
#[inline(always)]
fn to_i8(y: f32) -> i8 {
    // Within +-128 first, so that the integer steps cannot overflow (NaN stays NaN).
    let y = y.clamp(-128.0, 128.0);
    let t = y as i32;
    let f = y - t as f32;
    let q = t + i32::from(f >= 0.5) - i32::from(f <= -0.5);
    q.clamp(-127, 127) as i8
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
    multiversioned_quantize!();

    /// [`Self::quantize`]'s body, for a length a multiple of 256.
    #[inline(always)]
    fn quantize_in(x: &[f32]) -> Self {
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
                *qv = to_i8(v * inv);
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

#[cfg(test)]
mod tests {
    use super::to_i8;

    #[test]
    fn rounding_equals_libms_round_then_clamp() {
        // Ties, values a hair on either side of a tie, the clamp, huge values, zeros and
        // NaN, then a sweep over the magnitudes the quantizer produces.
        let mut ys = vec![
            0.5f32, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5, 127.49, 127.5, 200.0,
        ];
        ys.extend([
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            -1e30,
            3e9,
            f32::MIN_POSITIVE,
        ]);
        for t in [0.5f32, 1.5, 64.5] {
            ys.extend([t.next_down(), t.next_up(), -t.next_down(), -t.next_up()]);
        }
        let mut v = -140.0f32;
        while v < 140.0 {
            ys.push(v);
            v += 0.000_731;
        }
        for y in ys {
            let want = y.round().clamp(-127.0, 127.0) as i8;
            assert_eq!(to_i8(y), want, "{y:e}");
        }
    }
}
