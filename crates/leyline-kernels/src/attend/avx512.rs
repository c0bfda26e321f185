//! The score products with AVX-512F intrinsics: the compiler does not keep a
//! `[keys][lanes]` accumulator tile in registers on its own.

use super::task::KB;
use std::arch::x86_64::*;

/// [`super::kernel::scores`] with AVX-512F: 4 keys x 64 query lanes in 16 registers,
/// then 4 x 32 and 4 x 16 for the lanes left over.
///
/// # Safety
/// The CPU has AVX-512F; `lanes % 16 == 0`, `qt.len() >= hd * lanes`,
/// `st.len() >= KB * lanes` and every key row holds `hd` values.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scores_avx512(
    qt: &[f32],
    lanes: usize,
    krows: &[&[f32]; KB],
    st: &mut [f32],
    hd: usize,
) {
    let mut c0 = 0;
    while c0 < lanes {
        let left = (lanes - c0) / 16;
        // SAFETY (all three): lanes `c0..c0 + 16 n` lie within `lanes`, and the
        // caller's bounds cover the rest.
        if left >= 4 {
            unsafe { group_avx512::<4>(qt, lanes, krows, st, hd, c0) };
            c0 += 64;
        } else if left >= 2 {
            unsafe { group_avx512::<2>(qt, lanes, krows, st, hd, c0) };
            c0 += 32;
        } else {
            unsafe { group_avx512::<1>(qt, lanes, krows, st, hd, c0) };
            c0 += 16;
        }
    }
}

/// Lanes `c0..c0 + 16 N` of [`scores_avx512`].
///
/// # Safety
/// As [`scores_avx512`], and `c0 + 16 N <= lanes`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn group_avx512<const N: usize>(
    qt: &[f32],
    lanes: usize,
    krows: &[&[f32]; KB],
    st: &mut [f32],
    hd: usize,
    c0: usize,
) {
    for (jb, kg) in krows.chunks_exact(4).enumerate() {
        let mut acc = [[_mm512_setzero_ps(); N]; 4];
        for d in 0..hd {
            // SAFETY: `d * lanes + c0 + 16 N <= hd * lanes <= qt.len()`.
            let col = unsafe { qt.as_ptr().add(d * lanes + c0) };
            let mut q = [_mm512_setzero_ps(); N];
            for (i, x) in q.iter_mut().enumerate() {
                // SAFETY: within the column, as above.
                *x = unsafe { _mm512_loadu_ps(col.add(16 * i)) };
            }
            for (a, kr) in acc.iter_mut().zip(kg) {
                // SAFETY: key rows hold `hd` values.
                let k = _mm512_set1_ps(unsafe { *kr.get_unchecked(d) });
                for (x, &y) in a.iter_mut().zip(&q) {
                    *x = _mm512_fmadd_ps(k, y, *x);
                }
            }
        }
        for (kk, a) in acc.iter().enumerate() {
            // SAFETY: row `4 jb + kk < KB` of `st`, lanes `c0..c0 + 16 N`.
            let dst = unsafe { st.as_mut_ptr().add((4 * jb + kk) * lanes + c0) };
            for (i, x) in a.iter().enumerate() {
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(dst.add(16 * i), *x) };
            }
        }
    }
}

/// [`super::kernel::scores_direct`] with AVX-512F: per query row, 16 keys' dot products
/// in 16 accumulators, summed across lanes together by [`sum16`] and scattered into the
/// block's score rows: no per-score chain of horizontal adds. Groups of 16 keys that
/// start at or past `nb` are left at zero.
///
/// # Safety
/// The CPU has AVX-512F; `hd % 16 == 0`, `rows <= lanes`, `qb.len() >= rows * hd`,
/// `st.len() >= KB * lanes` and every key row holds `hd` values.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scores_few_avx512(
    qb: &[f32],
    rows: usize,
    lanes: usize,
    krows: &[&[f32]; KB],
    nb: usize,
    st: &mut [f32],
    hd: usize,
) {
    st[..KB * lanes].fill(0.0);
    let step = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lanes as i32),
    );
    for r in 0..rows {
        let q = &qb[r * hd..(r + 1) * hd];
        for (g, kg) in krows.chunks_exact(16).take(nb.div_ceil(16)).enumerate() {
            let mut acc = [_mm512_setzero_ps(); 16];
            for c in (0..hd).step_by(16) {
                // SAFETY: c + 16 <= hd, inside the query row and every key row.
                let qv = unsafe { _mm512_loadu_ps(q.as_ptr().add(c)) };
                for (a, kr) in acc.iter_mut().zip(kg) {
                    // SAFETY: as above.
                    *a = _mm512_fmadd_ps(qv, unsafe { _mm512_loadu_ps(kr.as_ptr().add(c)) }, *a);
                }
            }
            // SAFETY: lane j goes to st[(16 g + j) * lanes + r], inside the block's
            // KB * lanes scores since 16 g + j < KB and r < lanes.
            unsafe {
                _mm512_i32scatter_ps::<4>(
                    st.as_mut_ptr().add(16 * g * lanes + r),
                    step,
                    sum16(&acc),
                )
            };
        }
    }
}

/// Lane j of the result is the sum of the 16 lanes of `a[j]`: pairs are merged by
/// interleaving and adding, 15 merges in all.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn sum16(a: &[__m512; 16]) -> __m512 {
    // After the 32-bit then 64-bit interleaves, lane e of 128-bit block b of `s2[q]` holds
    // block b's sum of `a[4 q + e]`.
    let s1: [__m512; 8] = std::array::from_fn(|p| {
        let (x, y) = (a[2 * p], a[2 * p + 1]);
        _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y))
    });
    let s2: [__m512; 4] = std::array::from_fn(|q| {
        let (x, y) = (_mm512_castps_pd(s1[2 * q]), _mm512_castps_pd(s1[2 * q + 1]));
        _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
            _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)),
        )
    });
    // Then blocks are summed pairwise: 0x88 takes blocks 0 and 2 of each, 0xdd 1 and 3.
    let fold = |x: __m512, y: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(x, y),
            _mm512_shuffle_f32x4::<0xdd>(x, y),
        )
    };
    fold(fold(s2[0], s2[1]), fold(s2[2], s2[3]))
}
