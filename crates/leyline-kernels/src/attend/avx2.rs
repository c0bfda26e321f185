//! The score products with AVX2 and FMA intrinsics, as `avx512.rs` has them for 16 lanes.

use super::task::KB;
use std::arch::x86_64::*;

/// [`super::avx512::scores_few_avx512`] with AVX2 and FMA: 8 keys at a time, summed by
/// [`sum8`] and written lane by lane (AVX2 has no scatter).
///
/// # Safety
/// The CPU has AVX2 and FMA; `hd % 8 == 0`, and the bounds of
/// [`super::avx512::scores_few_avx512`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores_few_avx2(
    qb: &[f32],
    rows: usize,
    lanes: usize,
    krows: &[&[f32]; KB],
    nb: usize,
    st: &mut [f32],
    hd: usize,
) {
    st[..KB * lanes].fill(0.0);
    let mut sums = [0f32; 8];
    for r in 0..rows {
        let q = &qb[r * hd..(r + 1) * hd];
        for (g, kg) in krows.chunks_exact(8).take(nb.div_ceil(8)).enumerate() {
            let mut acc = [_mm256_setzero_ps(); 8];
            for c in (0..hd).step_by(8) {
                // SAFETY: c + 8 <= hd, inside the query row and every key row.
                let qv = unsafe { _mm256_loadu_ps(q.as_ptr().add(c)) };
                for (a, kr) in acc.iter_mut().zip(kg) {
                    // SAFETY: as above.
                    *a = _mm256_fmadd_ps(qv, unsafe { _mm256_loadu_ps(kr.as_ptr().add(c)) }, *a);
                }
            }
            // SAFETY: the store writes the 8 floats of `sums`.
            unsafe { _mm256_storeu_ps(sums.as_mut_ptr(), sum8(&acc)) };
            for (j, &x) in sums.iter().enumerate() {
                st[(8 * g + j) * lanes + r] = x;
            }
        }
    }
}

/// Lane j of the result is the sum of the 8 lanes of `a[j]`, as [`super::avx512::sum16`] does
/// for 16 (7 merges: 32-bit and 64-bit interleaves, then one fold of the 128-bit halves).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn sum8(a: &[__m256; 8]) -> __m256 {
    let s1: [__m256; 4] = std::array::from_fn(|p| {
        let (x, y) = (a[2 * p], a[2 * p + 1]);
        _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y))
    });
    let s2: [__m256; 2] = std::array::from_fn(|q| {
        let (x, y) = (_mm256_castps_pd(s1[2 * q]), _mm256_castps_pd(s1[2 * q + 1]));
        _mm256_add_ps(
            _mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
            _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)),
        )
    });
    // 0x20 takes the low halves of both, 0x31 the high halves.
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(s2[0], s2[1]),
        _mm256_permute2f128_ps::<0x31>(s2[0], s2[1]),
    )
}

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
