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
