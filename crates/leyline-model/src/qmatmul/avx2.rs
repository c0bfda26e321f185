//! The AVX2+FMA+F16C kernels: dot-product tiles, 8 lanes per vector.

use super::format::{GgmlKind, RowGeom, BLOCK, SLACK};
use super::tile::{prefetch_past_tile, Tile, DIRECT_MAX_M};
use std::arch::x86_64::*;

tile_driver!(rows, "avx2,fma,f16c", 2, 1, scales);

/// Converts the f16 scales of the row at `row` into `dbuf[j * sb..]`, `mbuf[j * sb..]`.
///
/// # Safety
/// AVX2+FMA+F16C; otherwise as `avx512::scales`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales(
    kind: GgmlKind,
    g: RowGeom,
    row: *const u8,
    j: usize,
    dbuf: &mut [f32],
    mbuf: &mut [f32],
) {
    assert!((j + 1) * g.sb <= dbuf.len() && (j + 1) * g.sb <= mbuf.len());
    for k in (0..g.nb).step_by(8) {
        // SAFETY: k < nb, so bytes row + 2k .. + 16 (and row + 2nb + 2k .. + 16) lie in
        // the caller's range; k + 8 <= sb, so the stores stay in row j's buffers.
        unsafe {
            let h = _mm_loadu_si128(row.add(2 * k) as *const __m128i);
            _mm256_storeu_ps(dbuf.as_mut_ptr().add(j * g.sb + k), _mm256_cvtph_ps(h));
            if kind == GgmlKind::Q4_1 {
                let h = _mm_loadu_si128(row.add(2 * g.nb + 2 * k) as *const __m128i);
                _mm256_storeu_ps(mbuf.as_mut_ptr().add(j * g.sb + k), _mm256_cvtph_ps(h));
            }
        }
    }
}

/// As `avx512::dequant`.
///
/// # Safety
/// AVX2+FMA+F16C; otherwise as `avx512::dequant`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant(
    kind: GgmlKind,
    g: RowGeom,
    row: *const u8,
    rt: usize,
    dbuf: &[f32],
    mbuf: &[f32],
    wbuf: &mut [f32],
) {
    let cols = g.nb * BLOCK;
    assert!(wbuf.len() >= rt * cols && dbuf.len() >= rt * g.sb && mbuf.len() >= rt * g.sb);
    for j in 0..rt {
        for b in 0..g.nb {
            let (d, mn) = (dbuf[j * g.sb + b], mbuf[j * g.sb + b]);
            let dst = wbuf[j * cols + b * BLOCK..].as_mut_ptr();
            // SAFETY: row j's block b lies in the caller's rows; dst has 32 floats
            // (asserted above).
            unsafe {
                let qp = row.add(j * g.stride + g.qs_off + b * kind.qs_bytes());
                let w = match kind {
                    GgmlKind::Q4_1 => block_values::<true>(qp, d, mn),
                    GgmlKind::Q8_0 => block_values::<false>(qp, d, mn),
                };
                for (k, v) in w.into_iter().enumerate() {
                    _mm256_storeu_ps(dst.add(8 * k), v);
                }
            }
        }
    }
}

/// The 32 weights of the block whose quant bytes start at `qp`, as values 0..8, 8..16,
/// 16..24 and 24..32, with its f32 scale `d` and (Q4_1, `Q41`) minimum `mn`.
///
/// # Safety
/// AVX2+FMA+F16C; `qp` starts 16 (Q4_1) or 32 (Q8_0) readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_values<const Q41: bool>(qp: *const u8, d: f32, mn: f32) -> [__m256; 4] {
    let d = _mm256_set1_ps(d);
    // SAFETY: the caller's contract covers these 16 or 32 bytes.
    unsafe {
        if Q41 {
            let low = _mm256_set1_epi32(0x0f);
            let raw = _mm_loadu_si128(qp as *const __m128i);
            let v0 = _mm256_cvtepu8_epi32(raw);
            let v1 = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(raw));
            let mn = _mm256_set1_ps(mn);
            [
                _mm256_and_si256(v0, low),
                _mm256_and_si256(v1, low),
                _mm256_srli_epi32::<4>(v0),
                _mm256_srli_epi32::<4>(v1),
            ]
            .map(|q| _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, mn))
        } else {
            [0, 8, 16, 24].map(|k| {
                let q = _mm_loadl_epi64(qp.add(k) as *const __m128i);
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d)
            })
        }
    }
}

/// As `avx512::f32_tile`, 8 lanes at a time.
///
/// # Safety
/// AVX2+FMA+F16C; otherwise as `avx512::f32_tile`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_tile<const R: usize, const M: usize>(
    w: *const f32,
    x: *const f32,
    cols: usize,
    out: *mut f32,
    ostride: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); M]; R];
    for c in (0..cols).step_by(8) {
        // SAFETY: c + 8 <= cols, inside every row (caller's contract).
        unsafe {
            let wv: [__m256; R] = std::array::from_fn(|j| _mm256_loadu_ps(w.add(j * cols + c)));
            for i in 0..M {
                let xv = _mm256_loadu_ps(x.add(i * cols + c));
                for (a, &wj) in acc.iter_mut().zip(&wv) {
                    a[i] = _mm256_fmadd_ps(wj, xv, a[i]);
                }
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, &a) in acc_j.iter().enumerate() {
            // SAFETY: (j, i) is inside the tile's outputs.
            unsafe { *out.add(j * ostride + i) = hsum(a) };
        }
    }
}

/// Sum of the 8 lanes.
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}

/// # Safety
/// AVX2+FMA+F16C; `t` describes R rows and M activation rows as [`Tile`] says, in bounds.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1<const R: usize, const M: usize>(t: &Tile) {
    let cols = t.g.nb * BLOCK;
    let mut acc = [[[_mm256_setzero_ps(); 2]; M]; R];
    for b in 0..t.g.nb {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            // SAFETY: b < nb and j < R, so the 16 quant bytes, the scale floats and the
            // activation floats read here lie inside the tile (caller's contract).
            unsafe {
                let qp = t.w.add(j * t.g.stride + t.g.qs_off + b * 16);
                let at = j * t.g.sb + b;
                let w = block_values::<true>(qp, *t.d.add(at), *t.mn.add(at));
                for (i, a) in acc_j.iter_mut().enumerate() {
                    let xb = t.x.add(i * cols + b * BLOCK);
                    a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a[0]);
                    a[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), a[1]);
                    a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), a[0]);
                    a[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), a[1]);
                }
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, a) in acc_j.iter().enumerate() {
            // SAFETY: (j, i) is inside the tile's outputs.
            unsafe { *t.out.add(j * t.ostride + i) = hsum(_mm256_add_ps(a[0], a[1])) };
        }
    }
}

/// # Safety
/// AVX2+FMA+F16C; `t` describes R rows and M activation rows as [`Tile`] says, in bounds.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0<const R: usize, const M: usize>(t: &Tile) {
    let cols = t.g.nb * BLOCK;
    let mut acc = [[[_mm256_setzero_ps(); 2]; M]; R];
    for b in 0..t.g.nb {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            // SAFETY: b < nb and j < R, so the 32 quant bytes, the scale and the
            // activation floats read here lie inside the tile (caller's contract).
            unsafe {
                let qp = t.w.add(j * t.g.stride + t.g.qs_off + b * 32);
                let w = block_values::<false>(qp, *t.d.add(j * t.g.sb + b), 0.0);
                for (i, a) in acc_j.iter_mut().enumerate() {
                    let xb = t.x.add(i * cols + b * BLOCK);
                    a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a[0]);
                    a[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), a[1]);
                    a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), a[0]);
                    a[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), a[1]);
                }
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, a) in acc_j.iter().enumerate() {
            // SAFETY: (j, i) is inside the tile's outputs.
            unsafe { *t.out.add(j * t.ostride + i) = hsum(_mm256_add_ps(a[0], a[1])) };
        }
    }
}
