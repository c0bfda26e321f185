//! AVX2 (+ F16C) kernels: 8 f32 lanes per vector; a head's remainder runs through the
//! scalar pair step, which rounds exactly as the vector code does.

use super::portable::{pair_scalar, Bf16C, F16C, F32C};
use super::{prefetch, Head, Sel, Tables, PREFETCH_ROWS};
use crate::rope::RotaryLayout;
use crate::rows::RowsMut;
use std::arch::x86_64::*;

/// `(a*c - b*s, b*c + a*s)` lane-wise: the order of every tier.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rot(a: __m256, b: __m256, c: __m256, s: __m256) -> (__m256, __m256) {
    (
        _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)),
        _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)),
    )
}

/// 16 bf16 as 8 lanes: (even elements, odd elements) as exact f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bf16_split(v: __m256i) -> (__m256, __m256) {
    let even = _mm256_slli_epi32::<16>(v);
    let odd = _mm256_and_si256(v, _mm256_set1_epi32(0xffff_0000u32 as i32));
    (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
}

/// f32 to bf16 with round to nearest even (as `f32_to_bf16`), result in each lane's high
/// 16 bits; the low bits are garbage.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bf16_round(x: __m256) -> __m256i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
    let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(x, x));
    let quiet = _mm256_or_si256(b, _mm256_set1_epi32(0x0040_0000));
    _mm256_blendv_epi8(r, quiet, nan)
}

/// Inverse of [`bf16_split`], rounding each lane once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bf16_join(even: __m256, odd: __m256) -> __m256i {
    let e = _mm256_srli_epi32::<16>(bf16_round(even));
    _mm256_blend_epi16::<0b1010_1010>(e, bf16_round(odd))
}

/// Rotates one bf16 head, interleaved pairs (8 pairs per vector, one per lane).
///
/// # Safety
/// `x` points to `2 * t.half` writable elements; `t`'s tables are padded (see [`Tables`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn head_bf16_ilv(x: *mut u16, t: &Tables) {
    let (half, c, s) = (t.half, t.c.as_ptr(), t.s.as_ptr());
    let mut i = 0;
    while i + 8 <= half {
        let p = x.add(2 * i) as *mut __m256i;
        let (a, b) = bf16_split(_mm256_loadu_si256(p));
        let (a, b) = rot(a, b, _mm256_loadu_ps(c.add(i)), _mm256_loadu_ps(s.add(i)));
        _mm256_storeu_si256(p, bf16_join(a, b));
        i += 8;
    }
    for k in i..half {
        pair_scalar::<Bf16C>(x, k, t);
    }
}

/// Rotates one bf16 head, Neox halves (16 pairs per step, as even and odd lanes).
///
/// # Safety
/// As [`head_bf16_ilv`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn head_bf16_neox(x: *mut u16, t: &Tables) {
    let half = t.half;
    let mut k = 0;
    while k + 16 <= half {
        let (pl, ph) = (x.add(k) as *mut __m256i, x.add(half + k) as *mut __m256i);
        let j = k / 2;
        let (ce, se) = (t.ce.as_ptr().add(j), t.se.as_ptr().add(j));
        let (co, so) = (t.co.as_ptr().add(j), t.so.as_ptr().add(j));
        let (le, lo) = bf16_split(_mm256_loadu_si256(pl));
        let (he, ho) = bf16_split(_mm256_loadu_si256(ph));
        let (le, he) = rot(le, he, _mm256_loadu_ps(ce), _mm256_loadu_ps(se));
        let (lo, ho) = rot(lo, ho, _mm256_loadu_ps(co), _mm256_loadu_ps(so));
        _mm256_storeu_si256(pl, bf16_join(le, lo));
        _mm256_storeu_si256(ph, bf16_join(he, ho));
        k += 16;
    }
    for k in k..half {
        pair_scalar::<Bf16C>(x, k, t);
    }
}

// Loads and stores of 8 lanes.

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ld_f32(p: *const f32) -> __m256 {
    _mm256_loadu_ps(p)
}
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn st_f32(p: *mut f32, v: __m256) {
    _mm256_storeu_ps(p, v)
}
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ld_f16(p: *const u16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}
/// Round to nearest even (imm bit 2 clear: the MXCSR mode is not consulted).
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT;
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn st_f16(p: *mut u16, v: __m256) {
    _mm_storeu_si128(p as *mut __m128i, _mm256_cvtps_ph::<RNE>(v))
}

/// Head kernels for a dtype read as 8 f32 lanes per vector (f32, f16).
macro_rules! heads8 {
    ($t:ty, $codec:ty, $ilv:ident, $neox:ident, $ld:ident, $st:ident) => {
        /// Rotates one head, interleaved pairs: `x * cd + swap_pairs(x) * sa`, which is
        /// `a*c + b*(-s)` (= `a*c - b*s` exactly) and `b*c + a*s`.
        ///
        /// # Safety
        /// `x` points to `2 * t.half` writable elements; `t`'s tables are padded.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $ilv(x: *mut $t, t: &Tables) {
            let (n, cd, sa) = (2 * t.half, t.cd.as_ptr(), t.sa.as_ptr());
            let mut j = 0;
            while j + 8 <= n {
                let p = x.add(j);
                let v = $ld(p);
                let sw = _mm256_permute_ps::<0b1011_0001>(v);
                let y = _mm256_add_ps(
                    _mm256_mul_ps(v, _mm256_loadu_ps(cd.add(j))),
                    _mm256_mul_ps(sw, _mm256_loadu_ps(sa.add(j))),
                );
                $st(p, y);
                j += 8;
            }
            for k in j / 2..t.half {
                pair_scalar::<$codec>(x, k, t);
            }
        }

        /// Rotates one head, Neox halves.
        ///
        /// # Safety
        /// As the interleaved kernel.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $neox(x: *mut $t, t: &Tables) {
            let (half, c, s) = (t.half, t.c.as_ptr(), t.s.as_ptr());
            let mut k = 0;
            while k + 8 <= half {
                let (pl, ph) = (x.add(k), x.add(half + k));
                let (c, s) = (_mm256_loadu_ps(c.add(k)), _mm256_loadu_ps(s.add(k)));
                let (l, h) = rot($ld(pl), $ld(ph), c, s);
                $st(pl, l);
                $st(ph, h);
                k += 8;
            }
            for k in k..half {
                pair_scalar::<$codec>(x, k, t);
            }
        }
    };
}

heads8!(f32, F32C, head_f32_ilv, head_f32_neox, ld_f32, st_f32);
heads8!(u16, F16C, head_f16_ilv, head_f16_neox, ld_f16, st_f16);

row_loop!("avx2,fma,f16c", rows_bf16_ilv, u16, head_bf16_ilv);
row_loop!("avx2,fma,f16c", rows_bf16_neox, u16, head_bf16_neox);
row_loop!("avx2,fma,f16c", rows_f16_ilv, u16, head_f16_ilv);
row_loop!("avx2,fma,f16c", rows_f16_neox, u16, head_f16_neox);
row_loop!("avx2,fma,f16c", rows_f32_ilv, f32, head_f32_ilv);
row_loop!("avx2,fma,f16c", rows_f32_neox, f32, head_f32_neox);

/// Rotates the selected rows.
///
/// # Safety
/// The CPU has avx2, fma and f16c; `g` was checked against `rows` and `t`
/// (`2 * t.half <= g.dim`), every selected row is `< g.capacity`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run(rows: RowsMut<'_>, g: Head, sel: &Sel<'_>, t: &Tables) {
    use RotaryLayout::{Interleaved as I, Neox as N};
    match (rows, t.layout) {
        (RowsMut::Bf16(b), I) => rows_bf16_ilv(b.as_mut_ptr(), g, sel, t),
        (RowsMut::Bf16(b), N) => rows_bf16_neox(b.as_mut_ptr(), g, sel, t),
        (RowsMut::F16(b), I) => rows_f16_ilv(b.as_mut_ptr(), g, sel, t),
        (RowsMut::F16(b), N) => rows_f16_neox(b.as_mut_ptr(), g, sel, t),
        (RowsMut::F32(b), I) => rows_f32_ilv(b.as_mut_ptr(), g, sel, t),
        (RowsMut::F32(b), N) => rows_f32_neox(b.as_mut_ptr(), g, sel, t),
    }
}

/// The store conversions on their own, for tests against the scalar ones.
#[cfg(test)]
pub(super) fn convert(x: &[f32; 8]) -> ([u16; 8], [u16; 8]) {
    assert!(crate::Tier::Avx2.available());
    let (mut h, mut b) = ([0u16; 8], [0u16; 8]);
    // SAFETY: features detected just above; the arrays hold 8 elements each.
    unsafe { convert_inner(x, &mut h, &mut b) };
    (h, b)
}

#[cfg(test)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn convert_inner(x: &[f32; 8], h: &mut [u16; 8], b: &mut [u16; 8]) {
    let v = _mm256_loadu_ps(x.as_ptr());
    st_f16(h.as_mut_ptr(), v);
    let r = _mm256_srli_epi32::<16>(bf16_round(v));
    let mut lanes = [0u32; 8];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, r);
    for (o, l) in b.iter_mut().zip(lanes) {
        *o = l as u16;
    }
}
