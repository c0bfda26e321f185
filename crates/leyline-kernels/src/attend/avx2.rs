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
