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

/// [`super::kernel::transpose_block`] with AVX-512F: 16 keys x 16 head dims at a time,
/// transposed in registers (the compiler's strided stores cost a store per value); head
/// dims past the last whole 16 one by one.
///
/// # Safety
/// The CPU has AVX-512F; every key row holds `hd` values and `kt.len() >= hd * KB`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_avx512(krows: &[&[f32]; KB], kt: &mut [f32], hd: usize) {
    let full = hd / 16 * 16;
    for (g, kg) in krows.chunks_exact(16).enumerate() {
        for d0 in (0..full).step_by(16) {
            // SAFETY: `d0 + 16 <= hd`, inside every key row.
            let r: [__m512; 16] =
                std::array::from_fn(|i| unsafe { _mm512_loadu_ps(kg[i].as_ptr().add(d0)) });
            let t = transpose16(r);
            for (i, x) in t.iter().enumerate() {
                // SAFETY: `(d0 + i) * KB + 16 g + 16 <= hd * KB <= kt.len()`.
                unsafe { _mm512_storeu_ps(kt.as_mut_ptr().add((d0 + i) * KB + 16 * g), *x) };
            }
        }
        for d in full..hd {
            for (i, kr) in kg.iter().enumerate() {
                kt[d * KB + 16 * g + i] = kr[d];
            }
        }
    }
}

/// Row i of the result holds lane i of each of `r`'s 16 vectors.
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    // 32-bit interleaves of row pairs, then 64-bit ones of those: each 128-bit block then
    // holds a 4 x 4 tile; two 128-bit shuffles put the tiles in place.
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4q + e]: from t[4q + (e / 2)] and t[4q + 2 + (e / 2)], low (e even) or high pairs.
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (q, e) = (i / 4, i % 4);
        let a = _mm512_castps_pd(t[4 * q + e / 2]);
        let b = _mm512_castps_pd(t[4 * q + 2 + e / 2]);
        _mm512_castpd_ps(if e % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        })
    });
    // v[8h + 4s + e]: blocks 0 and 2 (s = 0) or 1 and 3 (s = 1) of u[8h + e], u[8h + 4 + e].
    let v: [__m512; 16] = std::array::from_fn(|i| {
        let (h, s, e) = (i / 8, (i / 4) % 2, i % 4);
        let (a, b) = (u[8 * h + e], u[8 * h + 4 + e]);
        if s == 0 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xdd>(a, b)
        }
    });
    // Result i: blocks of v[i % 8] and v[8 + i % 8], even (i < 8) or odd ones.
    std::array::from_fn(|i| {
        let (a, b) = (v[i % 8], v[8 + i % 8]);
        if i < 8 {
            _mm512_shuffle_f32x4::<0x88>(a, b)
        } else {
            _mm512_shuffle_f32x4::<0xdd>(a, b)
        }
    })
}
