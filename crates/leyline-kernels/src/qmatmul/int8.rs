//! Decode products (one activation row) with integer dot products on AVX2: the activation row
//! is quantized to 8 bits per block of 32 ([`Q8Row`]), and each unit of 32 weights meets its
//! block in one `maddubs` (unsigned quants times signed activations, pairs summed to 16 bits)
//! and one `madd` (to 32 bits).
//!
//! Design decision: the f32 kernels spend most of a decode step turning quants into floats
//! (`avx2.rs`: widening, conversion and a multiply-add per 8 weights, 66% of a Qwen2.5-0.5B
//! step's samples); here 32 weights take a few byte operations and two multiplies. The cost
//! is rounding the activations: each value moves by at most half its block's step
//! (`max |x| / 254`), as in llama.cpp's Q8 activations. Every kind is reduced to the
//! `w = d[k] * q + mn[k]` of `format::row_scales` with unsigned `q` (Q8_0: signed, `mn = 0`),
//! so a row's product is `sum_u d[u] * dx[u] * (q_u . qx_u) + sum_u mn[u] * dx[u] * sum(qx_u)`,
//! the second sum from per-16 activation sums made once per row of `x` (Q6_K's scales cover
//! 16 values).

use super::format::{GgmlKind, RowGeom, BLOCK, SLACK};
use super::format::{Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0};
use std::arch::x86_64::*;

/// One activation row quantized per block of 32 values: `x[i] ~ d[i / 32] * q[i]`.
pub(crate) struct Q8Row {
    /// The 8-bit values, `|q| <= 127`.
    pub(super) q: Vec<i8>,
    /// Each block's step, `max |x| / 127` of the block.
    pub(super) d: Vec<f32>,
    /// `d[b] * (sum of q over each half-block of 16)`, two per block.
    pub(super) s16: Vec<f32>,
    /// `s16` summed per block.
    pub(super) s32: Vec<f32>,
    /// `d` with each value twice (per half-block, as Q6_K's scales go).
    pub(super) d16: Vec<f32>,
}

impl Q8Row {
    /// Quantizes `x` (its length a multiple of 32): `q = round(x / d)`, ties away from zero.
    pub(crate) fn quantize(x: &[f32]) -> Self {
        debug_assert!(x.len().is_multiple_of(BLOCK));
        let nb = x.len() / BLOCK;
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; nb];
        let mut s16 = vec![0f32; 2 * nb];
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
            for h in 0..2 {
                let s: i32 = qb[16 * h..16 * h + 16].iter().map(|&v| i32::from(v)).sum();
                s16[2 * b + h] = step * s as f32;
            }
        }
        let s32 = s16.chunks_exact(2).map(|h| h[0] + h[1]).collect();
        let d16 = d.iter().flat_map(|&v| [v, v]).collect();
        Self {
            q,
            d,
            s16,
            s32,
            d16,
        }
    }
}

/// The 32 quants of unit `u` (32 values) of the row at `row`, one byte per value in value
/// order: unsigned for every kind but Q8_0 (signed).
///
/// # Safety
/// AVX2; `row` starts a whole row of geometry `g` and kind `K`, `u < g.nb`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn quants<const K: u8>(row: *const u8, g: RowGeom, u: usize) -> __m256i {
    let low4 = _mm256_set1_epi8(0x0f);
    // SAFETY: every load lies in unit u's bytes of the row (offsets from the formats).
    unsafe {
        match K {
            Q4_0 | Q4_1 | Q5_0 => {
                let v = _mm_loadu_si128(row.add(g.qs_off + 16 * u) as *const __m128i);
                let lo = _mm_and_si128(v, _mm_set1_epi8(0x0f));
                let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), _mm_set1_epi8(0x0f));
                let q = _mm256_set_m128i(hi, lo);
                if K == Q5_0 {
                    let qh = (row.add(g.qh_off + 4 * u) as *const u32).read_unaligned();
                    _mm256_or_si256(q, fifth_bits(qh))
                } else {
                    q
                }
            }
            Q8_0 => _mm256_loadu_si256(row.add(g.qs_off + 32 * u) as *const __m256i),
            Q4_K | Q5_K => {
                let (s, uu) = (u / 8, u % 8);
                let bytes = if K == Q5_K { 176 } else { 144 };
                let blk = row.add(s * bytes);
                let qs = blk.add(if K == Q5_K { 48 } else { 16 } + 32 * (uu / 2));
                let v = _mm256_loadu_si256(qs as *const __m256i);
                let mut q = if uu % 2 == 0 {
                    _mm256_and_si256(v, low4)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), low4)
                };
                if K == Q5_K {
                    // Bit uu of qh byte l is value l's 5th bit.
                    let qh = _mm256_loadu_si256(blk.add(16) as *const __m256i);
                    let bit = _mm256_and_si256(
                        _mm256_srl_epi16(qh, _mm_cvtsi32_si128(uu as i32)),
                        _mm256_set1_epi8(1),
                    );
                    q = _mm256_or_si256(q, _mm256_slli_epi16::<4>(bit));
                }
                q
            }
            _ => {
                // Q6_K: values 128n + 32k + l take the low nibble (k < 2) or high nibble of
                // ql[64n + 32(k & 1) + l] and bits 2k, 2k + 1 of qh[32n + l].
                let (s, uu) = (u / 8, u % 8);
                let (n, k) = (uu / 4, uu % 4);
                let blk = row.add(s * 210);
                let ql = _mm256_loadu_si256(blk.add(64 * n + 32 * (k & 1)) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * n) as *const __m256i);
                let lo = _mm256_and_si256(
                    _mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (k >> 1) as i32)),
                    low4,
                );
                let hi = _mm256_and_si256(
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)),
                    _mm256_set1_epi8(3),
                );
                _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
            }
        }
    }
}

/// 16 in byte `i` where bit `i` of `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2")]
fn fifth_bits(qh: u32) -> __m256i {
    let x = _mm256_set1_epi32(qh as i32);
    // Byte i takes byte i / 8 of qh (within each 128-bit lane, which both hold qh).
    let spread = _mm256_shuffle_epi8(
        x,
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    // Byte i tests bit i % 8 of its byte.
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// `out[j] = row j . x` for the `n` rows in `rows` (then the slack), `x` quantized as `act`.
///
/// # Safety
/// AVX2, FMA and F16C. Lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows(kind: GgmlKind, g: RowGeom, rows: &[u8], act: &Q8Row, out: &mut [f32]) {
    let n = out.len();
    assert!(rows.len() >= n * g.stride + SLACK);
    assert!(act.q.len() == g.nb * BLOCK && act.d.len() == g.nb && act.s16.len() == 2 * g.nb);
    // SAFETY: the features are the caller's contract; lengths were asserted.
    unsafe {
        match kind {
            GgmlKind::Q4_0 => rows_of::<Q4_0>(kind, g, rows, act, out),
            GgmlKind::Q4_1 => rows_of::<Q4_1>(kind, g, rows, act, out),
            GgmlKind::Q5_0 => rows_of::<Q5_0>(kind, g, rows, act, out),
            GgmlKind::Q8_0 => rows_of::<Q8_0>(kind, g, rows, act, out),
            GgmlKind::Q4K => rows_of::<Q4_K>(kind, g, rows, act, out),
            GgmlKind::Q5K => rows_of::<Q5_K>(kind, g, rows, act, out),
            GgmlKind::Q6K => rows_of::<Q6_K>(kind, g, rows, act, out),
        }
    }
}

/// Rows per pass for Q6_K and Q5_K: their products share each activation load and run in
/// independent accumulators. The other kinds go one row at a time. Streamed from memory
/// (`benches/decode_formats.rs`, 2 threads, medians of 5), four rows at a time took Q6_K /
/// Q5_K [896, 4864] from 666 / 507 us to 536 / 446 us, but Q4_K from 305 to 345 us, Q5_0
/// [4864, 896] from 338 to 574 us, and a Q8_0 head of [151936, 896] from 8.2-9.1 ms to
/// 16-20 ms.
const R: usize = 4;

/// Whether rows of kind `K` go [`R`] at a time.
const fn in_fours(k: u8) -> bool {
    k == Q6_K || k == Q5_K
}

/// [`rows`] for one kind: `R` rows at a time (single rows for the rest). Per row, the scales
/// times the activations' steps and the offset term are vector products over the row's
/// scales; per unit, one `maddubs`, one `madd` and one multiply-add per row.
///
/// # Safety
/// As [`rows`], whose asserts hold.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const K: u8>(
    kind: GgmlKind,
    g: RowGeom,
    rows: &[u8],
    act: &Q8Row,
    out: &mut [f32],
) {
    // Scale entries per row: one per unit, or (Q6_K) one per half-unit.
    let per = if K == Q6_K { 2 } else { 1 };
    let ns = per * g.nb;
    let (dx, sx) = if K == Q6_K {
        (&act.d16, &act.s16)
    } else {
        (&act.d, &act.s32)
    };
    let (mut d, mut mn) = (vec![0f32; R * g.sb], vec![0f32; R * g.sb]);
    let n = out.len();
    let mut r = 0;
    while r < n {
        let rt = if n - r >= R && in_fours(K) { R } else { 1 };
        let mut offset = [0f32; R];
        for j in 0..rt {
            let row = &rows[(r + j) * g.stride..];
            // SAFETY: `row` starts row r + j < n and runs to the slack (asserted by `rows`), as
            // the conversion reads; d and mn hold R * sb floats.
            unsafe { super::avx2::scales(kind, g, row, j, &mut d, &mut mn) };
            let (dj, mj) = (
                &mut d[j * g.sb..j * g.sb + ns],
                &mn[j * g.sb..j * g.sb + ns],
            );
            offset[j] = scale_and_dot(dj, dx, mj, sx);
        }
        super::tile::prefetch_past_tile(rows, g.stride, r, rt);
        let base = rows[r * g.stride..].as_ptr();
        // SAFETY: rows r .. r + rt lie in `rows` (asserted by `rows`); their scales are in d.
        let sums = unsafe {
            if rt == R {
                tile::<K, R>(base, g, act, &d)
            } else {
                let [s] = tile::<K, 1>(base, g, act, &d);
                let mut all = [0f32; R];
                all[0] = s;
                all
            }
        };
        for j in 0..rt {
            out[r + j] = sums[j] + offset[j];
        }
        r += rt;
    }
}

/// The scaled dot products of `RT` rows starting at `base` (row j's scales times the
/// activations' steps at `d[j * sb ..]`) with the quantized activations.
///
/// # Safety
/// AVX2, FMA, F16C; `RT` whole rows of geometry `g` and kind `K` at `base`; `d` holds their
/// scales as [`rows_of`] leaves them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const RT: usize>(
    base: *const u8,
    g: RowGeom,
    act: &Q8Row,
    d: &[f32],
) -> [f32; RT] {
    let mut acc = [_mm256_setzero_ps(); RT];
    for u in 0..g.nb {
        // SAFETY: u < nb: each row's unit lies in the row, the activations at 32u; the
        // scales read are entries u (or 2u, 2u + 1) of each row's, inside `d`.
        unsafe {
            let xq = _mm256_loadu_si256(act.q.as_ptr().add(BLOCK * u) as *const __m256i);
            for (j, a) in acc.iter_mut().enumerate() {
                let q = quants::<K>(base.add(j * g.stride), g, u);
                let p = if K == Q8_0 {
                    _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xq, q))
                } else {
                    _mm256_maddubs_epi16(q, xq)
                };
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                let ds = d.as_ptr().add(j * g.sb);
                // Lanes 0..4 hold values 0..16 of the unit, lanes 4..8 values 16..32.
                let sc = if K == Q6_K {
                    let two = _mm_castpd_ps(_mm_load_sd(ds.add(2 * u) as *const f64));
                    _mm256_permutevar8x32_ps(
                        _mm256_castps128_ps256(two),
                        _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0),
                    )
                } else {
                    _mm256_broadcast_ss(&*ds.add(u))
                };
                *a = _mm256_fmadd_ps(p, sc, *a);
            }
        }
    }
    acc.map(|a| super::avx2::hsum(a))
}

/// `d[k] *= dx[k]` for every k, and returns `sum_k mn[k] * sx[k]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_and_dot(d: &mut [f32], dx: &[f32], mn: &[f32], sx: &[f32]) -> f32 {
    let n = d.len();
    assert!(dx.len() >= n && mn.len() >= n && sx.len() >= n);
    let mut acc = _mm256_setzero_ps();
    let mut k = 0;
    while k + 8 <= n {
        // SAFETY: k + 8 <= n and every slice holds at least n floats (asserted above).
        unsafe {
            let v = _mm256_mul_ps(
                _mm256_loadu_ps(d.as_ptr().add(k)),
                _mm256_loadu_ps(dx.as_ptr().add(k)),
            );
            _mm256_storeu_ps(d.as_mut_ptr().add(k), v);
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(mn.as_ptr().add(k)),
                _mm256_loadu_ps(sx.as_ptr().add(k)),
                acc,
            );
        }
        k += 8;
    }
    let mut tail = 0f32;
    for k in k..n {
        d[k] *= dx[k];
        tail += mn[k] * sx[k];
    }
    super::avx2::hsum(acc) + tail
}
