//! The AVX-512F kernels: dot-product tiles for few activation rows, and broadcast tiles
//! against transposed activations (16 rows per vector) for many. Q4_1 and Q8_0 only:
//! `rows_into` sends the other kinds to the AVX2 kernels ([`has_kernels`]).

use super::format::{RowGeom, SLACK};
use super::kind::{GgmlKind, BLOCK};
use super::tile::{prefetch_past_tile, Tile, DIRECT_MAX_M};
use std::arch::x86_64::*;

tile_driver!(tiled_rows, "avx512f", 4, 4, scales);

/// Whether this module has kernels for `kind`.
pub(super) fn has_kernels(kind: GgmlKind) -> bool {
    matches!(kind, GgmlKind::Q4_1 | GgmlKind::Q8_0)
}

/// Whether [`rows`] broadcasts weights against transposed activations ([`bcast_rows`])
/// instead of running dot-product tiles: above 32 rows, and from 13 rows when at most a
/// quarter of the vector lanes are padding (13-16 and 24-32 rows). Measured on SmolLM2's
/// decode steps (BENCHMARKS.md, "Broadcast tiles"): 0.85-0.90x at 14-16 rows and
/// 0.81-0.91x at 24-32, level at 12 and 20, slower at 10.
pub(super) fn bcast_pays(m: usize) -> bool {
    m > 32 || (m > 12 && 4 * m >= 3 * m.div_ceil(16) * 16)
}

/// Activation rows per pass over the weights: up to four vectors of 16.
pub(super) const GROUP: usize = 64;

/// Weight rows per broadcast tile against `v` vectors of activation rows: as many as
/// keep `rows * v` accumulators, `v` activation vectors and a broadcast within the 32
/// registers (16, 24, 24 and 24 accumulators).
const fn tile_rows(v: usize) -> usize {
    match v {
        1 => 16,
        2 => 12,
        3 => 8,
        _ => 6,
    }
}

/// `rows` holds `n` rows then the slack; `out: [n, m]`, `x: [m, cols]`.
///
/// # Safety
/// The CPU has AVX-512F; the lengths are as `rows_into` checks them.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn rows(
    kind: GgmlKind,
    g: RowGeom,
    rows: &[u8],
    x: &[f32],
    xt: &[f32],
    m: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller's contract is both functions'.
    unsafe {
        if bcast_pays(m) {
            bcast_rows(kind, g, rows, xt, m, out)
        } else {
            tiled_rows(kind, g, rows, x, m, out)
        }
    }
}

/// A 16 x 16 block transposed: `y[c * ldy + j] = yt[j * ldt + c]` for `j, c < 16`, in
/// registers (a scalar copy strided across `y` took 13-15% of a 1.5B prefill).
///
/// # Safety
/// The CPU has AVX-512F; `yt` has 16 rows of 16 readable floats `ldt` apart and `y` 16 rows
/// of 16 writable floats `ldy` apart.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose16(yt: *const f32, ldt: usize, y: *mut f32, ldy: usize) {
    // SAFETY: the loads and stores are the caller's 16 rows of 16 floats.
    unsafe {
        let r: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(yt.add(j * ldt)));
        // Pairs of rows interleaved within 128-bit lanes, then quads: u[4i + c] holds rows
        // 4i .. 4i + 4 at column c of each lane.
        let t: [__m512; 16] = std::array::from_fn(|k| {
            let (a, b) = (r[2 * (k / 2)], r[2 * (k / 2) + 1]);
            if k % 2 == 0 {
                _mm512_unpacklo_ps(a, b)
            } else {
                _mm512_unpackhi_ps(a, b)
            }
        });
        let u: [__m512; 16] = std::array::from_fn(|k| {
            let (i, c) = (k / 4, k % 4);
            let (a, b) = (t[4 * i + c / 2], t[4 * i + 2 + c / 2]);
            if c % 2 == 0 {
                _mm512_shuffle_ps::<0x44>(a, b)
            } else {
                _mm512_shuffle_ps::<0xEE>(a, b)
            }
        });
        // Lane l of u[4i + c] is rows 4i .. 4i + 4 of column 4l + c: gather the four i.
        for c in 0..4 {
            let w0 = _mm512_shuffle_f32x4::<0x44>(u[c], u[4 + c]);
            let w1 = _mm512_shuffle_f32x4::<0xEE>(u[c], u[4 + c]);
            let w2 = _mm512_shuffle_f32x4::<0x44>(u[8 + c], u[12 + c]);
            let w3 = _mm512_shuffle_f32x4::<0xEE>(u[8 + c], u[12 + c]);
            let out = [
                _mm512_shuffle_f32x4::<0x88>(w0, w2),
                _mm512_shuffle_f32x4::<0xDD>(w0, w2),
                _mm512_shuffle_f32x4::<0x88>(w1, w3),
                _mm512_shuffle_f32x4::<0xDD>(w1, w3),
            ];
            for (l, v) in out.into_iter().enumerate() {
                _mm512_storeu_ps(y.add((4 * l + c) * ldy), v);
            }
        }
    }
}

/// Length of [`transpose_cols`]'s layout of `m` rows of `cols` floats: groups of
/// [`GROUP`] rows, the group of rows `i0..` at `xt[i0 * cols..]` as `[cols][16 v]`
/// floats, `v` vectors of 16 rows (zeros past `m`).
pub(super) fn transposed_len(m: usize, cols: usize) -> usize {
    cols * m.div_ceil(16) * 16
}

/// Columns `c` of the group of rows `i0 .. i0 + GROUP` (or to `m`) of `x: [m, cols]` into
/// `dst: [c.len()][16 v]`, that group's piece of [`transposed_len`]'s layout.
///
/// # Safety
/// The CPU has AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transpose_cols(
    x: &[f32],
    m: usize,
    cols: usize,
    i0: usize,
    c: std::ops::Range<usize>,
    dst: &mut [f32],
) {
    assert!(x.len() == m * cols && m * cols <= i32::MAX as usize && i0 < m);
    assert!(c.end <= cols);
    let mg = (m - i0).min(GROUP);
    let v = mg.div_ceil(16);
    let lanes = 16 * v;
    assert_eq!(dst.len(), c.len() * lanes);
    let idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(cols as i32),
    );
    for vi in 0..v {
        let rows_here = (mg - 16 * vi).min(16);
        let keep = ((1u32 << rows_here) - 1) as __mmask16;
        let base = x[(i0 + 16 * vi) * cols..].as_ptr();
        for (k, cc) in c.clone().enumerate() {
            // SAFETY: lane i reads x[(i0 + 16 vi + i) * cols + cc] only for the rows
            // that exist (the mask), inside `x`; the store lies in dst's column k.
            unsafe {
                let col =
                    _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), keep, idx, base.add(cc));
                _mm512_storeu_ps(dst.as_mut_ptr().add(k * lanes + 16 * vi), col);
            }
        }
    }
}

/// The products for many activation rows without horizontal sums: the activations come
/// transposed (`xt`, [`transposed_len`]'s layout), so one weight broadcast meets 16 rows
/// in one vector, and a tile's outputs leave its accumulators as rows of `out`. Each
/// block of 32 weights of a tile's rows is dequantized once into an L1 buffer that the
/// broadcasts read.
///
/// # Safety
/// As [`rows`].
#[target_feature(enable = "avx512f")]
unsafe fn bcast_rows(
    kind: GgmlKind,
    g: RowGeom,
    rows: &[u8],
    xt: &[f32],
    m: usize,
    out: &mut [f32],
) {
    let n = (rows.len() - SLACK) / g.stride;
    let cols = g.nb * BLOCK;
    assert!(rows.len() == n * g.stride + SLACK && out.len() == n * m);
    assert!(xt.len() >= transposed_len(m, cols));
    let most = tile_rows(1);
    let mut dbuf = vec![0f32; most * g.sb];
    let mut mbuf = vec![0f32; most * g.sb];
    for i0 in (0..m).step_by(GROUP) {
        let mg = (m - i0).min(GROUP);
        let v = mg.div_ceil(16);
        let xg = &xt[i0 * cols..];
        // Lanes of the last vector that hold activation rows.
        let mask: __mmask16 = (1u32 << (mg - 16 * (v - 1))).wrapping_sub(1) as __mmask16;
        let full = tile_rows(v);
        let mut r = 0;
        while r < n {
            let rt = if n - r >= full {
                full
            } else if n - r >= 4 {
                4
            } else {
                1
            };
            for j in 0..rt {
                // SAFETY: as in the tile driver: row r + j < n lies in `rows`, and the
                // buffers hold `most` >= rt rows of scales.
                unsafe {
                    scales(
                        kind,
                        g,
                        &rows[(r + j) * g.stride..],
                        j,
                        &mut dbuf,
                        &mut mbuf,
                    )
                };
            }
            prefetch_past_tile(rows, g.stride, r, rt);
            let t = Tile {
                w: rows[r * g.stride..].as_ptr(),
                g,
                d: dbuf.as_ptr(),
                mn: mbuf.as_ptr(),
                x: xg.as_ptr(),
                out: out[r * m + i0..].as_mut_ptr(),
                ostride: m,
            };
            // SAFETY: rows r .. r + rt <= n and their scales are in the buffers; xg
            // holds cols x lanes floats; the outputs (r + j) * m + i0 + [0, mg) lie in
            // `out`, and the mask keeps the stores there.
            unsafe {
                if kind == GgmlKind::Q4_1 {
                    bcast_tile::<true>(&t, v, rt, full, mask)
                } else {
                    bcast_tile::<false>(&t, v, rt, full, mask)
                }
            }
            r += rt;
        }
    }
}

/// [`bcast`] for `v` activation vectors and a tile of `rt` rows: `full` (the most for
/// `v`), 4 or 1.
///
/// # Safety
/// As [`bcast`].
#[target_feature(enable = "avx512f")]
unsafe fn bcast_tile<const Q41: bool>(t: &Tile, v: usize, rt: usize, full: usize, mask: __mmask16) {
    const T1: usize = tile_rows(1);
    const T2: usize = tile_rows(2);
    const T3: usize = tile_rows(3);
    const T4: usize = tile_rows(4);
    let rt = if rt == full { 0 } else { rt };
    // SAFETY: the caller's contract.
    unsafe {
        match (v, rt) {
            (1, 0) => bcast::<Q41, T1, 1>(t, mask),
            (2, 0) => bcast::<Q41, T2, 2>(t, mask),
            (3, 0) => bcast::<Q41, T3, 3>(t, mask),
            (_, 0) => bcast::<Q41, T4, 4>(t, mask),
            (1, 4) => bcast::<Q41, 4, 1>(t, mask),
            (2, 4) => bcast::<Q41, 4, 2>(t, mask),
            (3, 4) => bcast::<Q41, 4, 3>(t, mask),
            (_, 4) => bcast::<Q41, 4, 4>(t, mask),
            (1, _) => bcast::<Q41, 1, 1>(t, mask),
            (2, _) => bcast::<Q41, 1, 2>(t, mask),
            (3, _) => bcast::<Q41, 1, 3>(t, mask),
            (_, _) => bcast::<Q41, 1, 4>(t, mask),
        }
    }
}

/// One broadcast tile: `R` weight rows against `V` vectors of transposed activation rows
/// (`t.x: [cols][16 V]`); row j's outputs go to `t.out + j * t.ostride`, the last
/// vector's lanes through `mask`.
///
/// # Safety
/// AVX-512F; `t` describes R rows in bounds, `t.x` holds `cols * 16 V` floats and the
/// masked outputs lie in the caller's buffer.
#[inline(never)]
#[target_feature(enable = "avx512f")]
unsafe fn bcast<const Q41: bool, const R: usize, const V: usize>(t: &Tile, mask: __mmask16) {
    let qs = if Q41 { 16 } else { 32 };
    let lanes = 16 * V;
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    let mut blk = [[0f32; BLOCK]; R];
    for b in 0..t.g.nb {
        // SAFETY: b < nb and j < R: the quant bytes and scales lie in the tile's rows,
        // and xt holds the block's 32 columns of `lanes` floats.
        unsafe {
            for (j, dst) in blk.iter_mut().enumerate() {
                let at = j * t.g.sb + b;
                let mn = if Q41 { *t.mn.add(at) } else { 0.0 };
                let w = block_values::<Q41>(
                    t.w.add(j * t.g.stride + t.g.qs_off + b * qs),
                    *t.d.add(at),
                    mn,
                );
                _mm512_storeu_ps(dst.as_mut_ptr(), w[0]);
                _mm512_storeu_ps(dst.as_mut_ptr().add(16), w[1]);
            }
            let xb = t.x.add(b * BLOCK * lanes);
            for kk in 0..BLOCK {
                let xv: [__m512; V] =
                    std::array::from_fn(|v| _mm512_loadu_ps(xb.add(kk * lanes + 16 * v)));
                for (a, wj) in acc.iter_mut().zip(&blk) {
                    let w = _mm512_set1_ps(wj[kk]);
                    for (av, &xvv) in a.iter_mut().zip(&xv) {
                        *av = _mm512_fmadd_ps(w, xvv, *av);
                    }
                }
            }
        }
    }
    for (j, a) in acc.iter().enumerate() {
        for (v, &av) in a.iter().enumerate() {
            // SAFETY: row j's outputs, masked on the last vector (caller's contract).
            unsafe {
                let o = t.out.add(j * t.ostride + 16 * v);
                if v + 1 < V {
                    _mm512_storeu_ps(o, av);
                } else {
                    _mm512_mask_storeu_ps(o, mask, av);
                }
            }
        }
    }
}

/// Converts the f16 scales of the row starting `row` into `dbuf[j * sb..]`, `mbuf[j * sb..]`.
///
/// # Safety
/// AVX-512F; `kind` is Q4_1 or Q8_0; `(j + 1) * sb <= dbuf.len(), mbuf.len()`.
#[target_feature(enable = "avx512f")]
unsafe fn scales(
    kind: GgmlKind,
    g: RowGeom,
    row: &[u8],
    j: usize,
    dbuf: &mut [f32],
    mbuf: &mut [f32],
) {
    assert!(has_kernels(kind));
    assert!((j + 1) * g.sb <= dbuf.len() && (j + 1) * g.sb <= mbuf.len());
    // The loads read 32 bytes at 2k and (Q4_1) 2nb + 2k for k < nb, k a multiple of 16.
    assert!(row.len() >= 4 * g.nb.next_multiple_of(16));
    let row = row.as_ptr();
    for k in (0..g.nb).step_by(16) {
        // SAFETY: the loads lie in `row` (asserted above); k + 16 <= sb, so the stores stay
        // in row j's buffers.
        unsafe {
            let h = _mm256_loadu_si256(row.add(2 * k) as *const __m256i);
            _mm512_storeu_ps(dbuf.as_mut_ptr().add(j * g.sb + k), _mm512_cvtph_ps(h));
            if kind == GgmlKind::Q4_1 {
                let h = _mm256_loadu_si256(row.add(2 * g.nb + 2 * k) as *const __m256i);
                _mm512_storeu_ps(mbuf.as_mut_ptr().add(j * g.sb + k), _mm512_cvtph_ps(h));
            }
        }
    }
}

/// The 32 weights of the block whose quant bytes start at `qp`, with its f32 scale `d`
/// and (Q4_1) minimum `mn`. Q4_1 (`Q41`): low nibbles are weights 0..16, high nibbles
/// 16..32; its 16 possible values `d * q + m` are made once and looked up (`vpermps` reads
/// only an index's low 4 bits), which costs fewer instructions than converting every
/// nibble and rounds each value the same single time. Q8_0: the bytes in order, `d * q`.
///
/// # Safety
/// AVX-512F; `qp` starts 16 (Q4_1) or 32 (Q8_0) readable bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_values<const Q41: bool>(qp: *const u8, d: f32, mn: f32) -> [__m512; 2] {
    let d = _mm512_set1_ps(d);
    // SAFETY: the caller's contract covers these 16 or 32 bytes.
    unsafe {
        if Q41 {
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qp as *const __m128i));
            let iota = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            let table = _mm512_fmadd_ps(iota, d, _mm512_set1_ps(mn));
            [
                _mm512_permutexvar_ps(v, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table),
            ]
        } else {
            let q0 = _mm_loadu_si128(qp as *const __m128i);
            let q1 = _mm_loadu_si128(qp.add(16) as *const __m128i);
            [
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d),
            ]
        }
    }
}

/// The Q4_1 (`Q41`) or Q8_0 tile kernel: one accumulator per (row, activation row); each
/// block's activation floats are loaded once and meet all `R` dequantized rows, so loads
/// do not outnumber the products. Kept out of line: inlined into the driver, its 4 x 4
/// tile spilled registers (a cache-resident [576, 576] product with 4 rows: 36 against 26 us).
///
/// # Safety
/// AVX-512F; `t` describes R rows and M activation rows as [`Tile`] says, all in bounds.
#[inline(never)]
#[target_feature(enable = "avx512f")]
unsafe fn direct<const Q41: bool, const R: usize, const M: usize>(t: &Tile) {
    let cols = t.g.nb * BLOCK;
    let qs = if Q41 { 16 } else { 32 };
    let mut acc = [[_mm512_setzero_ps(); M]; R];
    for b in 0..t.g.nb {
        // SAFETY: b < nb, j < R and i < M, so the quant bytes, the scale floats and the
        // activation floats read here lie inside the tile (caller's contract).
        unsafe {
            let w: [[__m512; 2]; R] = std::array::from_fn(|j| {
                let at = j * t.g.sb + b;
                let mn = if Q41 { *t.mn.add(at) } else { 0.0 };
                block_values::<Q41>(
                    t.w.add(j * t.g.stride + t.g.qs_off + b * qs),
                    *t.d.add(at),
                    mn,
                )
            });
            for i in 0..M {
                let xb = t.x.add(i * cols + b * BLOCK);
                let (x0, x1) = (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)));
                for (a, wj) in acc.iter_mut().zip(&w) {
                    a[i] = _mm512_fmadd_ps(wj[1], x1, _mm512_fmadd_ps(wj[0], x0, a[i]));
                }
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, &a) in acc_j.iter().enumerate() {
            // SAFETY: (j, i) is inside the tile's outputs.
            unsafe { *t.out.add(j * t.ostride + i) = _mm512_reduce_add_ps(a) };
        }
    }
}

/// [`direct`] for `kind`'s rows.
///
/// # Safety
/// As [`direct`]; `kind` is Q4_1 or Q8_0.
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize, const M: usize>(kind: GgmlKind, t: &Tile) {
    // SAFETY: the caller's contract is `direct`'s.
    unsafe {
        match kind {
            GgmlKind::Q4_1 => direct::<true, R, M>(t),
            GgmlKind::Q8_0 => direct::<false, R, M>(t),
            _ => unreachable!("no AVX-512 kernel for {kind:?}"),
        }
    }
}

/// Dequantizes `rt` rows starting at `row` into `wbuf: [rt, cols]`, with the f32 scales
/// `scales` left in `dbuf` / `mbuf` (row j's at `j * g.sb`).
///
/// # Safety
/// AVX-512F; `row` starts `rt` whole rows of geometry `g`; the buffers hold `rt` rows.
#[target_feature(enable = "avx512f")]
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
                    _ => unreachable!("no AVX-512 kernel for {kind:?}"),
                };
                _mm512_storeu_ps(dst, w[0]);
                _mm512_storeu_ps(dst.add(16), w[1]);
            }
        }
    }
}

/// `out[j * ostride + i] = w_j . x_i` for R rows of `w: [R, cols]` and M rows of
/// `x: [M, cols]`, `cols` a multiple of 32.
///
/// # Safety
/// AVX-512F; `w`, `x` hold R and M rows of `cols` floats, `out` the R x M outputs.
#[target_feature(enable = "avx512f")]
unsafe fn f32_tile<const R: usize, const M: usize>(
    w: *const f32,
    x: *const f32,
    cols: usize,
    out: *mut f32,
    ostride: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); M]; R];
    for c in (0..cols).step_by(16) {
        // SAFETY: c + 16 <= cols, inside every row (caller's contract).
        unsafe {
            let wv: [__m512; R] = std::array::from_fn(|j| _mm512_loadu_ps(w.add(j * cols + c)));
            for i in 0..M {
                let xv = _mm512_loadu_ps(x.add(i * cols + c));
                for (a, &wj) in acc.iter_mut().zip(&wv) {
                    a[i] = _mm512_fmadd_ps(wj, xv, a[i]);
                }
            }
        }
    }
    for (j, acc_j) in acc.iter().enumerate() {
        for (i, &a) in acc_j.iter().enumerate() {
            // SAFETY: (j, i) is inside the tile's outputs.
            unsafe { *out.add(j * ostride + i) = _mm512_reduce_add_ps(a) };
        }
    }
}
