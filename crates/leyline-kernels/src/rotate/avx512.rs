//! AVX-512 F/BW/VL kernels: 16 f32 lanes per vector; a head's remainder runs through masked
//! loads and stores (fault-suppressed past the mask), so any rotary width is vectorized.

use super::{prefetch, Head, Sel, Tables, PREFETCH_ROWS};
use crate::rope::RotaryLayout;
use crate::rows::RowsMut;
use std::arch::x86_64::*;

/// `(a*c - b*s, b*c + a*s)` lane-wise: the order of every tier.
#[inline]
#[target_feature(enable = "avx512f")]
fn rot(a: __m512, b: __m512, c: __m512, s: __m512) -> (__m512, __m512) {
    (
        _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)),
        _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)),
    )
}

/// 32 bf16 as 16 lanes: (even elements, odd elements) as exact f32.
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_split(v: __m512i) -> (__m512, __m512) {
    let even = _mm512_slli_epi32::<16>(v);
    let odd = _mm512_and_si512(v, _mm512_set1_epi32(0xffff_0000u32 as i32));
    (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
}

/// f32 to bf16 with round to nearest even (as `f32_to_bf16`), result in each lane's high
/// 16 bits; the low bits are garbage.
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_round(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    // b + 0x7fff + lsb, the lsb (bit 16) tested into a mask: 3 uops instead of 4.
    let odd = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0x1_0000));
    let r = _mm512_add_epi32(b, _mm512_set1_epi32(0x7fff));
    let r = _mm512_mask_add_epi32(r, odd, b, _mm512_set1_epi32(0x8000));
    let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
    _mm512_mask_or_epi32(r, nan, b, _mm512_set1_epi32(0x0040_0000))
}

/// Inverse of [`bf16_split`], rounding each lane once.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn bf16_join(even: __m512, odd: __m512) -> __m512i {
    let e = _mm512_srli_epi32::<16>(bf16_round(even));
    _mm512_mask_blend_epi16(0xaaaa_aaaa, e, bf16_round(odd))
}

/// 16 interleaved pairs (one per lane): no shuffles.
///
/// # Safety
/// `c` and `s` point to 16 readable f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_ilv_step(v: __m512i, c: *const f32, s: *const f32) -> __m512i {
    let (a, b) = bf16_split(v);
    let (a, b) = rot(a, b, _mm512_loadu_ps(c), _mm512_loadu_ps(s));
    bf16_join(a, b)
}

/// Rotates one bf16 head, interleaved pairs.
///
/// # Safety
/// `x` points to `2 * t.half` writable elements; `t`'s tables are padded (see [`Tables`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn head_bf16_ilv(x: *mut u16, t: &Tables) {
    let (half, c, s) = (t.half, t.c.as_ptr(), t.s.as_ptr());
    let mut i = 0;
    while i + 16 <= half {
        let p = x.add(2 * i) as *mut __m512i;
        _mm512_storeu_si512(p, bf16_ilv_step(_mm512_loadu_si512(p), c.add(i), s.add(i)));
        i += 16;
    }
    if i < half {
        let m: __mmask32 = (1u32 << (2 * (half - i))) - 1;
        let p = x.add(2 * i) as *mut i16;
        let v = bf16_ilv_step(_mm512_maskz_loadu_epi16(m, p), c.add(i), s.add(i));
        _mm512_mask_storeu_epi16(p, m, v);
    }
}

/// 32 Neox pairs `(lo[k], hi[k])`, split into even and odd lanes.
///
/// # Safety
/// `t`'s even/odd tables hold 16 readable f32 from `j`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_neox_step(l: __m512i, h: __m512i, t: &Tables, j: usize) -> (__m512i, __m512i) {
    let (ce, se) = (t.ce.as_ptr().add(j), t.se.as_ptr().add(j));
    let (co, so) = (t.co.as_ptr().add(j), t.so.as_ptr().add(j));
    let (le, lo) = bf16_split(l);
    let (he, ho) = bf16_split(h);
    let (le, he) = rot(le, he, _mm512_loadu_ps(ce), _mm512_loadu_ps(se));
    let (lo, ho) = rot(lo, ho, _mm512_loadu_ps(co), _mm512_loadu_ps(so));
    (bf16_join(le, lo), bf16_join(he, ho))
}

/// Rotates one bf16 head, Neox halves.
///
/// # Safety
/// As [`head_bf16_ilv`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn head_bf16_neox(x: *mut u16, t: &Tables) {
    let half = t.half;
    let mut k = 0;
    while k + 32 <= half {
        let (pl, ph) = (x.add(k) as *mut __m512i, x.add(half + k) as *mut __m512i);
        let (l, h) = bf16_neox_step(_mm512_loadu_si512(pl), _mm512_loadu_si512(ph), t, k / 2);
        _mm512_storeu_si512(pl, l);
        _mm512_storeu_si512(ph, h);
        k += 32;
    }
    if k < half {
        let m: __mmask32 = (1u32 << (half - k)) - 1;
        let (pl, ph) = (x.add(k) as *mut i16, x.add(half + k) as *mut i16);
        let (l, h) = bf16_neox_step(
            _mm512_maskz_loadu_epi16(m, pl),
            _mm512_maskz_loadu_epi16(m, ph),
            t,
            k / 2,
        );
        _mm512_mask_storeu_epi16(pl, m, l);
        _mm512_mask_storeu_epi16(ph, m, h);
    }
}

/// Interleaved pairs of 16 f32 lanes: `x * cd + swap_pairs(x) * sa`, which is
/// `a*c + b*(-s)` (= `a*c - b*s` exactly) and `b*c + a*s`.
///
/// # Safety
/// `cd` and `sa` point to 16 readable f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn ilv_step(v: __m512, cd: *const f32, sa: *const f32) -> __m512 {
    let sw = _mm512_permute_ps::<0b1011_0001>(v);
    _mm512_add_ps(
        _mm512_mul_ps(v, _mm512_loadu_ps(cd)),
        _mm512_mul_ps(sw, _mm512_loadu_ps(sa)),
    )
}

// Loads and stores of 16 lanes, whole or masked.

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn ld_f32(p: *const f32) -> __m512 {
    _mm512_loadu_ps(p)
}
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn ldm_f32(p: *const f32, m: __mmask16) -> __m512 {
    _mm512_maskz_loadu_ps(m, p)
}
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn st_f32(p: *mut f32, v: __m512) {
    _mm512_storeu_ps(p, v)
}
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn stm_f32(p: *mut f32, m: __mmask16, v: __m512) {
    _mm512_mask_storeu_ps(p, m, v)
}
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn ld_f16(p: *const u16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn ldm_f16(p: *const u16, m: __mmask16) -> __m512 {
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p as *const i16))
}
/// Round to nearest even, exceptions suppressed (the MXCSR mode is not consulted).
const RNE: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn st_f16(p: *mut u16, v: __m512) {
    _mm256_storeu_si256(p as *mut __m256i, _mm512_cvtps_ph::<RNE>(v))
}
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn stm_f16(p: *mut u16, m: __mmask16, v: __m512) {
    _mm256_mask_storeu_epi16(p as *mut i16, m, _mm512_cvtps_ph::<RNE>(v))
}

/// Head kernels for a dtype read as 16 f32 lanes per vector (f32, f16).
macro_rules! heads16 {
    ($t:ty, $ilv:ident, $neox:ident, $ld:ident, $ldm:ident, $st:ident, $stm:ident) => {
        /// Rotates one head, interleaved pairs.
        ///
        /// # Safety
        /// `x` points to `2 * t.half` writable elements; `t`'s tables are padded.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn $ilv(x: *mut $t, t: &Tables) {
            let (n, cd, sa) = (2 * t.half, t.cd.as_ptr(), t.sa.as_ptr());
            let mut j = 0;
            while j + 16 <= n {
                let p = x.add(j);
                $st(p, ilv_step($ld(p), cd.add(j), sa.add(j)));
                j += 16;
            }
            if j < n {
                let (p, m) = (x.add(j), ((1u32 << (n - j)) - 1) as __mmask16);
                $stm(p, m, ilv_step($ldm(p, m), cd.add(j), sa.add(j)));
            }
        }

        /// Rotates one head, Neox halves.
        ///
        /// # Safety
        /// As the interleaved kernel.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
        unsafe fn $neox(x: *mut $t, t: &Tables) {
            let (half, c, s) = (t.half, t.c.as_ptr(), t.s.as_ptr());
            let mut k = 0;
            while k + 16 <= half {
                let (pl, ph) = (x.add(k), x.add(half + k));
                let (c, s) = (_mm512_loadu_ps(c.add(k)), _mm512_loadu_ps(s.add(k)));
                let (l, h) = rot($ld(pl), $ld(ph), c, s);
                $st(pl, l);
                $st(ph, h);
                k += 16;
            }
            if k < half {
                let m = ((1u32 << (half - k)) - 1) as __mmask16;
                let (pl, ph) = (x.add(k), x.add(half + k));
                let (c, s) = (_mm512_loadu_ps(c.add(k)), _mm512_loadu_ps(s.add(k)));
                let (l, h) = rot($ldm(pl, m), $ldm(ph, m), c, s);
                $stm(pl, m, l);
                $stm(ph, m, h);
            }
        }
    };
}

heads16!(
    f32,
    head_f32_ilv,
    head_f32_neox,
    ld_f32,
    ldm_f32,
    st_f32,
    stm_f32
);
heads16!(
    u16,
    head_f16_ilv,
    head_f16_neox,
    ld_f16,
    ldm_f16,
    st_f16,
    stm_f16
);

row_loop!(
    "avx512f,avx512bw,avx512vl",
    rows_bf16_ilv,
    u16,
    head_bf16_ilv
);
row_loop!(
    "avx512f,avx512bw,avx512vl",
    rows_bf16_neox,
    u16,
    head_bf16_neox
);
row_loop!("avx512f,avx512bw,avx512vl", rows_f16_ilv, u16, head_f16_ilv);
row_loop!(
    "avx512f,avx512bw,avx512vl",
    rows_f16_neox,
    u16,
    head_f16_neox
);
row_loop!("avx512f,avx512bw,avx512vl", rows_f32_ilv, f32, head_f32_ilv);
row_loop!(
    "avx512f,avx512bw,avx512vl",
    rows_f32_neox,
    f32,
    head_f32_neox
);

/// Rotates the selected rows.
///
/// # Safety
/// The CPU has avx512f/bw/vl; `g` was checked against `rows` and `t` (`2 * t.half <= g.dim`),
/// every selected row is `< g.capacity`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
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
pub(super) fn convert(x: &[f32; 16]) -> ([u16; 16], [u16; 16]) {
    assert!(crate::Tier::Avx512.available());
    let (mut h, mut b) = ([0u16; 16], [0u16; 16]);
    // SAFETY: features detected just above; the arrays hold 16 elements each.
    unsafe { convert_inner(x, &mut h, &mut b) };
    (h, b)
}

#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn convert_inner(x: &[f32; 16], h: &mut [u16; 16], b: &mut [u16; 16]) {
    let v = _mm512_loadu_ps(x.as_ptr());
    st_f16(h.as_mut_ptr(), v);
    let r = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(bf16_round(v)));
    _mm256_storeu_si256(b.as_mut_ptr() as *mut __m256i, r);
}
