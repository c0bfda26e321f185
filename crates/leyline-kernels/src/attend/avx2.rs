//! The transposed score product with AVX2 and FMA intrinsics, as `avx512.rs` has it for 16 lanes.

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
