//! The transposed score product with AVX2 and FMA intrinsics, as `avx512.rs` has it for 16 lanes.

use super::kernel::{prefetch, AHEAD};
use super::task::KB;
use std::arch::x86_64::*;

/// [`super::kernel::scores`] with AVX2 and FMA: 4 keys x 16 query lanes (8 registers).
///
/// # Safety
/// As [`super::avx512::scores_avx512`], with AVX2 and FMA instead of AVX-512F.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores_avx2(
    qt: &[f32],
    lanes: usize,
    krows: &[&[f32]; KB],
    st: &mut [f32],
    hd: usize,
) {
    for c0 in (0..lanes).step_by(16) {
        for (jb, kg) in krows.chunks_exact(4).enumerate() {
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            for d in 0..hd {
                // SAFETY: `d * lanes + c0 + 16 <= hd * lanes <= qt.len()`.
                let col = unsafe { qt.as_ptr().add(d * lanes + c0) };
                // SAFETY: within the column, as above.
                let q = unsafe { [_mm256_loadu_ps(col), _mm256_loadu_ps(col.add(8))] };
                for (a, kr) in acc.iter_mut().zip(kg) {
                    // SAFETY: key rows hold `hd` values.
                    let k = _mm256_set1_ps(unsafe { *kr.get_unchecked(d) });
                    for (x, &y) in a.iter_mut().zip(&q) {
                        *x = _mm256_fmadd_ps(k, y, *x);
                    }
                }
            }
            for (kk, a) in acc.iter().enumerate() {
                // SAFETY: row `4 jb + kk < KB` of `st`, lanes `c0..c0 + 16`.
                let dst = unsafe { st.as_mut_ptr().add((4 * jb + kk) * lanes + c0) };
                // SAFETY: as above.
                unsafe {
                    _mm256_storeu_ps(dst, a[0]);
                    _mm256_storeu_ps(dst.add(8), a[1]);
                }
            }
        }
    }
}

/// [`super::kernel::transpose_block`] with AVX2: 8 keys x 8 head dims at a time, transposed
/// in registers; head dims past the last whole 8 one by one.
///
/// # Safety
/// The CPU has AVX2; every key row holds `hd` values and `kt.len() >= hd * KB`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn transpose_avx2(krows: &[&[f32]; KB], kt: &mut [f32], hd: usize) {
    let full = hd / 8 * 8;
    for (g, kg) in krows.chunks_exact(8).enumerate() {
        for d0 in (0..full).step_by(8) {
            // SAFETY: `d0 + 8 <= hd`, inside every key row.
            let r: [__m256; 8] =
                std::array::from_fn(|i| unsafe { _mm256_loadu_ps(kg[i].as_ptr().add(d0)) });
            let t = transpose8(r);
            for (i, x) in t.iter().enumerate() {
                // SAFETY: `(d0 + i) * KB + 8 g + 8 <= hd * KB <= kt.len()`.
                unsafe { _mm256_storeu_ps(kt.as_mut_ptr().add((d0 + i) * KB + 8 * g), *x) };
            }
        }
        for d in full..hd {
            for (i, kr) in kg.iter().enumerate() {
                kt[d * KB + 8 * g + i] = kr[d];
            }
        }
    }
}

/// `st[j][r] = q[r] . k[j]` for one key block and the 8 query lanes of `qt: [hd][8]` (the
/// scaled queries transposed; lanes past the task's rows zero) with AVX2 and FMA: 8 keys
/// broadcast against the rows' lanes, as [`scores_avx2`] does for 16 lanes. Each score is one
/// FMA per head dim in order.
///
/// # Safety
/// The CPU has AVX2 and FMA; `qt.len() >= 8 hd`, every key row holds `hd` values and
/// `st.len() >= 8 KB`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores8_avx2(qt: &[f32], krows: &[&[f32]; KB], st: &mut [f32], hd: usize) {
    for (group, out) in krows.chunks_exact(8).zip(st.chunks_exact_mut(64)) {
        let group: &[&[f32]; 8] = group.try_into().expect("8 keys");
        // SAFETY: the CPU has AVX2 and FMA; the caller's bounds are the group's.
        unsafe { group8(qt, group, out, hd) };
    }
}

/// The scores of 8 keys (rows of `hd` values) for the 8 query lanes of `qt: [hd][8]`, into
/// `out: [8 keys][8 lanes]`.
///
/// # Safety
/// The CPU has AVX2 and FMA; `qt.len() >= 8 hd`, every row of `keys` holds `hd` values and
/// `out.len() >= 64`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn group8(qt: &[f32], keys: &[&[f32]; 8], out: &mut [f32], hd: usize) {
    let mut acc = [_mm256_setzero_ps(); 8];
    for d in 0..hd {
        // SAFETY: `8 d + 8 <= 8 hd <= qt.len()`.
        let q = unsafe { _mm256_loadu_ps(qt.as_ptr().add(8 * d)) };
        for (a, kr) in acc.iter_mut().zip(keys) {
            // SAFETY: key rows hold `hd` values.
            let k = _mm256_set1_ps(unsafe { *kr.get_unchecked(d) });
            *a = _mm256_fmadd_ps(k, q, *a);
        }
    }
    for (kk, a) in acc.into_iter().enumerate() {
        // SAFETY: `8 kk + 8 <= 64 <= out.len()`.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * kk), a) };
    }
}

/// [`scores8_avx2`] reading f16 key rows: each group of 8 keys is converted into `kg` (8 rows
/// of `hd`, reused, so it stays in the L1 cache) right before its products. Only the groups
/// that hold the block's first `nb` keys are computed (rows past `nb` may be empty). The
/// same bits as [`scores8_avx2`] on the converted rows.
///
/// Memory: each group asks for the keys [`AHEAD`] keys on (from `ahead`, the next block's
/// first rows, past the block's end) and for its own keys' value rows, which
/// [`values8_f16_avx2`] reads after the block. A few rows at a time: asking for a whole
/// block's rows at once fills the cache's miss buffers, and the products wait on the first
/// loads of their keys (measured with `benches/attend.rs`).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `qt.len() >= 8 hd`, `kg.len() >= 8 hd` and
/// `st.len() >= 8 KB`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores8_f16_avx2(
    qt: &[f32],
    krows: &[&[u16]; KB],
    ahead: &[&[u16]; AHEAD],
    vrows: &[&[u16]; KB],
    nb: usize,
    kg: &mut [f32],
    st: &mut [f32],
    hd: usize,
) {
    let group_at = |at: usize| {
        krows
            .get(at..at + 8)
            .unwrap_or_else(|| &ahead[at - KB..at - KB + 8])
    };
    for (jb, group) in krows.chunks_exact(8).take(nb.div_ceil(8)).enumerate() {
        for row in group_at(8 * jb + AHEAD)
            .iter()
            .chain(&vrows[8 * jb..8 * jb + 8])
        {
            prefetch(row);
        }
        for (kk, kr) in group.iter().enumerate() {
            let row = &mut kg[kk * hd..(kk + 1) * hd];
            if kr.is_empty() {
                // A key past the block's `nb`: its scores are not read.
                row.fill(0.0);
            } else {
                // SAFETY: the CPU has AVX and F16C.
                unsafe { f16_row(&kr[..hd], row) };
            }
        }
        let keys: [&[f32]; 8] = std::array::from_fn(|kk| &kg[kk * hd..(kk + 1) * hd]);
        // SAFETY: the CPU has AVX2 and FMA; `8 jb + 8 <= KB`, so `st` holds the group's 64.
        unsafe { group8(qt, &keys, &mut st[64 * jb..], hd) };
    }
}

/// `o[r] += sum_j st[j][r] * v[j]` over the block's first `nb` keys for the first `rows`
/// (at most 8) rows of `o: [8][hd]` and the probabilities `st: [KB][8]`, reading f16 value
/// rows: each value vector converted once per key and used by every row. One FMA per key, in
/// key order, as the portable `values` sums them. Rows from `rows` on are padding: they may
/// change.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `rows <= 8`, `st.len() >= 8 nb`, `o.len() >= 8 hd`, and
/// the first `nb` value rows hold `hd` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn values8_f16_avx2(
    st: &[f32],
    vrows: &[&[u16]; KB],
    o: &mut [f32],
    hd: usize,
    nb: usize,
    rows: usize,
) {
    // Accumulators: rows x chunks of 8 dims; 8 or more chains hide the FMA latency, and with
    // the value vectors and a broadcast they fit AVX2's 16 registers.
    // SAFETY (all arms): the caller's bounds, `rows` rows of `o` included.
    unsafe {
        match rows {
            ..=4 => values_rows::<4, 2>(st, vrows, o, hd, nb, rows),
            5 => values_rows::<5, 2>(st, vrows, o, hd, nb, rows),
            6 => values_rows::<6, 2>(st, vrows, o, hd, nb, rows),
            7 => values_rows::<7, 1>(st, vrows, o, hd, nb, rows),
            _ => values_rows::<8, 1>(st, vrows, o, hd, nb, rows),
        }
    }
}

/// [`values8_f16_avx2`] for `R` rows (the first `rows` of them real), `C` chunks of 8
/// head dims at a time, then 8 at a time, then one by one.
///
/// # Safety
/// As [`values8_f16_avx2`], with `rows <= R <= 8`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values_rows<const R: usize, const C: usize>(
    st: &[f32],
    vrows: &[&[u16]; KB],
    o: &mut [f32],
    hd: usize,
    nb: usize,
    rows: usize,
) {
    let mut dc = 0;
    while dc + 8 * C <= hd {
        // SAFETY: `dc + 8 C <= hd`; the caller's bounds.
        unsafe { values_chunk::<R, C>(st, vrows, o, hd, nb, dc) };
        dc += 8 * C;
    }
    while dc + 8 <= hd {
        // SAFETY: as above, one chunk.
        unsafe { values_chunk::<R, 1>(st, vrows, o, hd, nb, dc) };
        dc += 8;
    }
    for (j, vr) in vrows.iter().enumerate().take(nb) {
        for d in dc..hd {
            let v = crate::convert::f16_to_f32(vr[d]);
            for r in 0..rows {
                o[r * hd + d] = st[8 * j + r].mul_add(v, o[r * hd + d]);
            }
        }
    }
}

/// Head dims `dc..dc + 8 C` of [`values_rows`] for its `R` rows.
///
/// # Safety
/// As [`values_rows`], with `dc + 8 C <= hd`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values_chunk<const R: usize, const C: usize>(
    st: &[f32],
    vrows: &[&[u16]; KB],
    o: &mut [f32],
    hd: usize,
    nb: usize,
    dc: usize,
) {
    let base = o.as_mut_ptr();
    // SAFETY: `r * hd + dc + 8 c + 8 <= 8 hd <= o.len()` for `r < R <= 8`, `c < C`.
    let at = |r: usize, c: usize| unsafe { base.add(r * hd + dc + 8 * c) };
    // SAFETY: as `at`.
    let mut acc: [[__m256; C]; R] =
        std::array::from_fn(|r| std::array::from_fn(|c| unsafe { _mm256_loadu_ps(at(r, c)) }));
    for (j, vr) in vrows.iter().enumerate().take(nb) {
        // SAFETY: `dc + 8 C <= hd`, inside the value row.
        let v: [__m256; C] = std::array::from_fn(|c| unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(
                vr.as_ptr().add(dc + 8 * c) as *const __m128i
            ))
        });
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: `8 j + r < 8 nb <= st.len()`.
            let p = _mm256_set1_ps(unsafe { *st.get_unchecked(8 * j + r) });
            for (x, &y) in a.iter_mut().zip(&v) {
                *x = _mm256_fmadd_ps(p, y, *x);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        for (c, &x) in a.iter().enumerate() {
            // SAFETY: as `at`.
            unsafe { _mm256_storeu_ps(at(r, c), x) };
        }
    }
}

/// f16 bits to f32 (exact) for the shorter of `src` and `dst`, 8 at a time with F16C.
///
/// # Safety
/// The CPU has AVX and F16C.
#[target_feature(enable = "avx,f16c")]
#[inline]
pub(super) unsafe fn f16_row(src: &[u16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: `i + 8 <= n`, inside both slices.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    for i in full..n {
        dst[i] = crate::convert::f16_to_f32(src[i]);
    }
}

/// Row i of the result holds lane i of each of `r`'s 8 vectors.
#[target_feature(enable = "avx2")]
#[inline]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4q + e]: 0x44 takes the low pairs of t[4q + e / 2] and t[4q + 2 + e / 2], 0xee the high.
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (q, e) = (i / 4, i % 4);
        let (a, b) = (t[4 * q + e / 2], t[4 * q + 2 + e / 2]);
        if e % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xee>(a, b)
        }
    });
    // 0x20 takes the low 128-bit halves of both, 0x31 the high ones.
    std::array::from_fn(|i| {
        if i < 4 {
            _mm256_permute2f128_ps::<0x20>(u[i], u[4 + i])
        } else {
            _mm256_permute2f128_ps::<0x31>(u[i - 4], u[i])
        }
    })
}
