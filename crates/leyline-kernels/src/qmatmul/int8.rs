//! Products on the kinds in blocks of 32 (Q4_0, Q4_1, Q5_0, Q8_0) with integer dot products
//! from the AVX2 tier up, for any number of activation rows: each activation row is quantized
//! to 8 bits per block of 32 ([`Q8Row`]), and each block of 32 weights meets its block in one
//! `maddubs` (unsigned quants times signed activations, pairs summed to 16 bits) and one
//! `madd` (to 32 bits). The K-quants' products are in `kq.rs`; [`quants`], which extracts
//! a unit's 32 quants, serves both. The AVX-512 VNNI tier reads interleaved matrices
//! instead (`interleave.rs`).
//!
//! Design decision: the f32 kernels spend most of a decode step turning quants into floats
//! (`avx2.rs`: widening, conversion and a multiply-add per 8 weights, 66% of a Qwen2.5-0.5B
//! step's samples); here 32 weights take a few byte operations and two multiplies. The cost
//! is rounding the activations: each value moves by at most half its block's step
//! (`max |x| / 254`), as in llama.cpp's Q8 activations. Every kind is reduced to the
//! `w = d[k] * q + mn[k]` of `format::row_scales` with unsigned `q` (Q8_0: signed, `mn = 0`),
//! so a row's product is `sum_u d[u] * dx[u] * (q_u . qx_u) + sum_u mn[u] * dx[u] * sum(qx_u)`,
//! the second sum from per-block activation sums made once per row of `x`.

use super::format::{GgmlKind, RowGeom, BLOCK, SLACK};
use super::format::{Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q8_0};
use super::q8::Q8Row;
use std::arch::x86_64::*;

/// The 32 quants of unit `u` (32 values) of the row at `row`, one byte per value in value
/// order: unsigned for every kind but Q8_0 (signed).
///
/// # Safety
/// AVX2; `row` starts a whole row of geometry `g` and kind `K`, `u < g.nb`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quants<const K: u8>(row: *const u8, g: RowGeom, u: usize) -> __m256i {
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

/// `out[j * m + i] = row j . x_i` for the `n` rows in `rows` (then the slack) and the `m`
/// activation rows `acts` (`out: [n, m]`, feature-major as the f32 kernels write it).
///
/// Batch invariance by construction: every (weight row, activation row) pair takes the same
/// instructions in the same order whatever `m` is and however the rows are grouped, so a row
/// of `x` computed in a batch equals the same row computed alone, bit for bit.
///
/// # Safety
/// AVX2, FMA and F16C. Lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows(
    kind: GgmlKind,
    g: RowGeom,
    rows: &[u8],
    acts: &[Q8Row],
    out: &mut [f32],
) {
    let m = acts.len();
    assert!(m > 0 && out.len().is_multiple_of(m));
    let n = out.len() / m;
    assert!(rows.len() >= n * g.stride + SLACK);
    for act in acts {
        assert!(act.q.len() == g.nb * BLOCK && act.d.len() == g.nb && act.s32.len() == g.nb);
    }
    // SAFETY: the features are the caller's contract; lengths were asserted.
    unsafe {
        macro_rules! of {
            ($k:expr) => {
                if m > A {
                    rows_of::<$k, true>(kind, g, rows, acts, out)
                } else {
                    rows_of::<$k, false>(kind, g, rows, acts, out)
                }
            };
        }
        match kind {
            GgmlKind::Q4_0 => of!(Q4_0),
            GgmlKind::Q4_1 => of!(Q4_1),
            GgmlKind::Q5_0 => of!(Q5_0),
            GgmlKind::Q8_0 => of!(Q8_0),
            GgmlKind::Q4K | GgmlKind::Q5K | GgmlKind::Q6K => {
                unreachable!("the K-quants' products are kq.rs's")
            }
        }
    }
}

/// Activation rows per pass: each weight unit, once extracted, meets this many activation
/// rows.
const A: usize = 4;

/// Bytes of a block of extracted quants ([`expand`]), which a core's second-level cache
/// holds while the activation rows pass.
const EXPANDED_BYTES: usize = 256 * 1024;

/// [`rows`] for one kind. A few activation rows (decode, `!EXP`) meet one weight row at a
/// time as it streams from memory, its quants extracted in registers. More rows (prefill,
/// `EXP`) take blocks of weight rows whose quants are extracted once ([`expand`]) into a
/// buffer that stays in cache while every group of [`A`] activation rows meets the block;
/// the integers a tile reads are the same either way. Per (weight row, activation row):
/// per unit one `maddubs`, one `madd`, the product of the two scales and one multiply-add;
/// then the offset term, a vector product over the row's scales.
///
/// # Safety
/// As [`rows`], whose asserts hold.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const K: u8, const EXP: bool>(
    kind: GgmlKind,
    g: RowGeom,
    rows: &[u8],
    acts: &[Q8Row],
    out: &mut [f32],
) {
    let ns = g.nb;
    let m = acts.len();
    let n = out.len() / m;
    let ex_row = expanded_row_bytes(g);
    let block = if EXP {
        (EXPANDED_BYTES / ex_row).clamp(1, n.max(1))
    } else {
        1
    };
    let (mut d, mut mn) = (vec![0f32; block * g.sb], vec![0f32; block * g.sb]);
    // Kept per thread between calls: fresh pages cost more than the products of a block.
    let mut ex = EXPANDED.with_borrow_mut(std::mem::take);
    let mut b0 = 0;
    while b0 < n {
        let b1 = (b0 + block).min(n);
        for j in 0..b1 - b0 {
            let row = &rows[(b0 + j) * g.stride..];
            // SAFETY: `row` starts row b0 + j < n and runs to the slack (asserted by `rows`),
            // as the conversion reads; d and mn hold block * sb floats.
            unsafe { super::avx2::scales(kind, g, row, j, &mut d, &mut mn) };
        }
        if EXP {
            // SAFETY: rows b0 .. b1 < n lie in `rows` (asserted by `rows`).
            unsafe { expand::<K>(rows[b0 * g.stride..].as_ptr(), g, b1 - b0, &mut ex) };
        } else {
            super::tile::prefetch_past_tile(rows, g.stride, b0, 1);
        }
        let mut i0 = 0;
        while i0 < m {
            let ga = A.min(m - i0);
            let xs = &acts[i0..i0 + ga];
            for r in b0..b1 {
                let base = if EXP {
                    ex[(r - b0) * ex_row..].as_ptr()
                } else {
                    rows[r * g.stride..].as_ptr()
                };
                let k = r - b0;
                // SAFETY: row r < n lies in `rows` (asserted by `rows`) or, with `EXP`, in
                // `ex` from its row k; its scales are in `d` from k * sb; every activation
                // row has nb units.
                let sums: [f32; A] = unsafe {
                    macro_rules! run {
                        ($ga:literal) => {
                            widen(tile::<K, $ga, EXP>(base, g, xs, &d[k * g.sb..]))
                        };
                    }
                    by_ga!(ga, run)
                };
                let mk = &mn[k * g.sb..k * g.sb + ns];
                for (i, act) in xs.iter().enumerate() {
                    // Q8_0 has no offset (its minimums are 0).
                    out[r * m + i0 + i] = if K == Q8_0 {
                        sums[i]
                    } else {
                        sums[i] + offset(mk, &act.s32)
                    };
                }
            }
            i0 += ga;
        }
        b0 = b1;
    }
    EXPANDED.with_borrow_mut(|e| *e = ex);
}

thread_local! {
    /// The calling thread's block of extracted quants ([`expand`]).
    static EXPANDED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Bytes of one row's extracted quants ([`expand`]).
fn expanded_row_bytes(g: RowGeom) -> usize {
    g.nb * BLOCK
}

/// Extracts the quants of the `n` rows of geometry `g` from `base` into `ex`: per row, each
/// unit's 32 bytes ([`quants`]) in unit order.
///
/// # Safety
/// AVX2; `n` whole rows of kind `K` from `base`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand<const K: u8>(base: *const u8, g: RowGeom, n: usize, ex: &mut Vec<u8>) {
    let per_row = expanded_row_bytes(g);
    ex.clear();
    ex.resize(n * per_row, 0);
    for j in 0..n {
        for u in 0..g.nb {
            // SAFETY: unit u of row j < n lies in the caller's rows; the store is inside
            // `ex` (resized above).
            unsafe {
                let q = quants::<K>(base.wrapping_add(j * g.stride), g, u);
                let dst = ex.as_mut_ptr().add(j * per_row + BLOCK * u);
                _mm256_storeu_si256(dst as *mut __m256i, q);
            }
        }
    }
}

/// A tile's sums in the largest tile's shape.
#[inline(always)]
fn widen<const GA: usize>(s: [f32; GA]) -> [f32; A] {
    let mut all = [0f32; A];
    all[..GA].copy_from_slice(&s);
    all
}

/// The scaled dot products of the weight row at `base` (its raw scales in `d`) with `GA`
/// quantized activation rows: `sum_u (d[u] * dx_i[u]) * (q_u . qx_i,u)`, the scale product
/// rounded to f32 before the multiply-add, as for any other grouping.
///
/// # Safety
/// AVX2, FMA, F16C; a whole row of geometry `g` and kind `K` at `base`; `d` holds its
/// scales as [`rows_of`] leaves them; `xs` holds `GA` rows of `nb` units.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const GA: usize, const EXP: bool>(
    base: *const u8,
    g: RowGeom,
    xs: &[Q8Row],
    d: &[f32],
) -> [f32; GA] {
    let mut acc = [_mm256_setzero_ps(); GA];
    for u in 0..g.nb {
        // SAFETY: u < nb: the row's unit lies in the row, the activations at 32u; the
        // scales read are entry u of the row's, inside `d`, and of each activation row's
        // steps.
        unsafe {
            let q = if EXP {
                _mm256_loadu_si256(base.add(BLOCK * u) as *const __m256i)
            } else {
                quants::<K>(base, g, u)
            };
            let dw = _mm256_broadcast_ss(&*d.as_ptr().add(u));
            let qa = if K == Q8_0 { _mm256_abs_epi8(q) } else { q };
            for i in 0..GA {
                let x = &xs[i];
                let xq = _mm256_loadu_si256(x.q.as_ptr().add(BLOCK * u) as *const __m256i);
                let dx = _mm256_broadcast_ss(&*x.d.as_ptr().add(u));
                let p = if K == Q8_0 {
                    _mm256_maddubs_epi16(qa, _mm256_sign_epi8(xq, q))
                } else {
                    _mm256_maddubs_epi16(qa, xq)
                };
                let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(dw, dx), acc[i]);
            }
        }
    }
    std::array::from_fn(|i| super::avx2::hsum(acc[i]))
}

/// `sum_k mn[k] * sx[k]`: eight lanes of multiply-adds, then their sum, then the tail.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn offset(mn: &[f32], sx: &[f32]) -> f32 {
    let n = mn.len();
    assert!(sx.len() >= n);
    let mut acc = _mm256_setzero_ps();
    let mut k = 0;
    while k + 8 <= n {
        // SAFETY: k + 8 <= n and both slices hold at least n floats (asserted above).
        unsafe {
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
        tail += mn[k] * sx[k];
    }
    super::avx2::hsum(acc) + tail
}
