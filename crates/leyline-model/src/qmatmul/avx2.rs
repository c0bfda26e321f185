//! The AVX2+FMA+F16C kernels: dot-product tiles, 8 lanes per vector, for every kind.
//!
//! Each kind has one [`quants`] that turns a step of a row (a block of 32, a Q4_K / Q5_K
//! pair of sub-blocks, a Q6_K chunk of 32) into its quants as f32 integers, 8 at a time;
//! the tile kernel ([`direct`]) and the dequantizer for many rows ([`dequant`]) make the
//! weights from them, `d * q + mn` rounded once (`format::row_scales`).
//!
//! Factoring the scales out of each unit's dot product (`d * (q . x) + mn * sum(x)`, one
//! multiply-add fewer per 8 weights) was tried and dropped: at one activation row it ran
//! within 10% of this either way, slower for Q5_0, Q5_K and Q6_K (a throwaway probe, CPU time
//! of one thread, minimum of 31 samples, on the shared 2-core Zen 3 VM), since the quants'
//! extraction and conversion, not the multiply-adds, bound these kernels on AVX2.

use super::format::{GgmlKind, RowGeom, BLOCK, SLACK};
use super::tile::{prefetch_past_tile, Tile, DIRECT_MAX_M};
use std::arch::x86_64::*;

tile_driver!(rows, "avx2,fma,f16c", 2, 1, scales);

const Q4_0: u8 = GgmlKind::Q4_0 as u8;
const Q4_1: u8 = GgmlKind::Q4_1 as u8;
const Q5_0: u8 = GgmlKind::Q5_0 as u8;
const Q8_0: u8 = GgmlKind::Q8_0 as u8;
const Q4_K: u8 = GgmlKind::Q4K as u8;
const Q5_K: u8 = GgmlKind::Q5K as u8;
const Q6_K: u8 = GgmlKind::Q6K as u8;

/// Vectors of 8 quants per step of kind `k` ([`quants`]): a Q4_K / Q5_K step is two
/// sub-blocks, whose nibbles share bytes; any other step 32 values.
const fn step_vecs(k: u8) -> usize {
    match k {
        Q4_K | Q5_K => 8,
        _ => 4,
    }
}

/// Vectors per unit of scales (`format::row_scales`): 2 for Q6_K's units of 16, else 4.
const fn unit_vecs(k: u8) -> usize {
    if k == Q6_K {
        2
    } else {
        4
    }
}

/// The 6-bit scales and mins of a Q4_K / Q5_K super-block from its 12 scale bytes at `p`,
/// as 8 bytes each in sub-block order (see `format::k_scales_mins`), four fields per u32:
/// sub-blocks 4..8 take the low and high nibbles of bytes 8..12 and, for their top 2 bits,
/// bits 6 and 7 of bytes 0..4 (scales) and 4..8 (mins), moved to bits 4 and 5.
///
/// # Safety
/// 12 readable bytes at `p`.
#[inline]
unsafe fn k4_scales(p: *const u8) -> (u64, u64) {
    // SAFETY: the caller's contract covers bytes p .. p + 12.
    let [a, b, c] = [0, 4, 8].map(|o| unsafe { (p.add(o) as *const u32).read_unaligned() });
    let six = 0x3f3f_3f3f;
    let (nib, top) = (0x0f0f_0f0f, 0x3030_3030);
    let sc_hi = (c & nib) | ((a >> 2) & top);
    let mn_hi = ((c >> 4) & nib) | ((b >> 2) & top);
    (
        u64::from(a & six) | u64::from(sc_hi) << 32,
        u64::from(b & six) | u64::from(mn_hi) << 32,
    )
}

/// f16 at `p` as f32.
///
/// # Safety
/// F16C; 2 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_at(p: *const u8) -> f32 {
    // SAFETY: the caller's contract covers the 2 bytes.
    let bits = unsafe { (p as *const u16).read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Converts the scales of the row starting `row` into `dbuf[j * sb..]`, `mbuf[j * sb..]`, as
/// `format::row_scales` defines them: the f16 scales of blocks of 32 8 at a time, the
/// K-quants' one super-block (8 or 16 units) at a time.
///
/// # Safety
/// AVX2+FMA+F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales(
    kind: GgmlKind,
    g: RowGeom,
    row: &[u8],
    j: usize,
    dbuf: &mut [f32],
    mbuf: &mut [f32],
) {
    let (d, mn) = (
        &mut dbuf[j * g.sb..(j + 1) * g.sb],
        &mut mbuf[j * g.sb..(j + 1) * g.sb],
    );
    let (dp, mp) = (d.as_mut_ptr(), mn.as_mut_ptr());
    if kind.is_k() {
        let bb = kind.block_bytes();
        let units = if kind == GgmlKind::Q6K { 16 } else { 8 };
        let blocks = &row[..g.stride];
        assert!(blocks.len() / bb * units <= g.sb);
        for (s, blk) in blocks.chunks_exact(bb).enumerate() {
            let p = blk.as_ptr();
            // SAFETY: the reads lie in the super-block `blk` (offsets from the format);
            // the stores are units s * units .. (s + 1) * units <= sb (asserted above).
            unsafe {
                if kind == GgmlKind::Q6K {
                    let dv = _mm256_set1_ps(half_at(p.add(208)));
                    for h in 0..2 {
                        let sc = _mm_loadl_epi64(p.add(192 + 8 * h) as *const __m128i);
                        let v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), dv);
                        _mm256_storeu_ps(dp.add(16 * s + 8 * h), v);
                        let m = _mm256_mul_ps(v, _mm256_set1_ps(-32.0));
                        _mm256_storeu_ps(mp.add(16 * s + 8 * h), m);
                    }
                } else {
                    let dv = _mm256_set1_ps(half_at(p));
                    let mv = _mm256_set1_ps(-half_at(p.add(2)));
                    let (sc, mins) = k4_scales(p.add(4));
                    let sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
                    let mins = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mins as i64));
                    let v = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), dv);
                    _mm256_storeu_ps(dp.add(8 * s), v);
                    let m = _mm256_mul_ps(_mm256_cvtepi32_ps(mins), mv);
                    _mm256_storeu_ps(mp.add(8 * s), m);
                }
            }
        }
        return;
    }
    // The loads below read 16 bytes at 2k and (Q4_1) 2nb + 2k for k < nb, k a multiple of 8.
    assert!(row.len() >= 4 * g.nb.next_multiple_of(8));
    for k in (0..g.nb).step_by(8) {
        // SAFETY: the loads lie in `row` (asserted above); k + 8 <= sb, so the stores stay
        // in this row's part of the buffers.
        unsafe {
            let h = _mm_loadu_si128(row.as_ptr().add(2 * k) as *const __m128i);
            let dv = _mm256_cvtph_ps(h);
            _mm256_storeu_ps(dp.add(k), dv);
            let mv = match kind {
                GgmlKind::Q4_1 => _mm256_cvtph_ps(_mm_loadu_si128(
                    row.as_ptr().add(2 * g.nb + 2 * k) as *const __m128i,
                )),
                GgmlKind::Q4_0 => _mm256_mul_ps(dv, _mm256_set1_ps(-8.0)),
                GgmlKind::Q5_0 => _mm256_mul_ps(dv, _mm256_set1_ps(-16.0)),
                _ => _mm256_setzero_ps(),
            };
            _mm256_storeu_ps(mp.add(k), mv);
        }
    }
}

/// Eight bytes at `p`, zero-extended to 32-bit lanes.
///
/// # Safety
/// AVX2; 8 readable bytes at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8x8(p: *const u8) -> __m256i {
    // SAFETY: the caller's contract.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
}

/// The quants of step `st` of the row starting at `row` (kind `K`, `N = step_vecs(K)`
/// vectors), as f32 integers in value order: the unsigned stored quant (the 5th or 6th bits
/// included), Q8_0's signed byte. Step `st` covers values `8 N st ..`.
///
/// # Safety
/// AVX2+FMA+F16C; `row` starts a whole row of geometry `g` and kind `K`;
/// `st < cols / (8 N)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quants<const K: u8, const N: usize>(
    row: *const u8,
    g: RowGeom,
    st: usize,
) -> [__m256; N] {
    let low = _mm256_set1_epi32(15);
    let sixteen = _mm256_set1_epi32(16);
    let mut q = [_mm256_setzero_si256(); N];
    // SAFETY: every byte read lies in step `st` of the row (the caller's contract); the
    // offsets follow the formats (see format.rs).
    unsafe {
        match K {
            Q4_0 | Q4_1 | Q5_0 => {
                let qs = row.add(g.qs_off + 16 * st);
                let (v0, v1) = (u8x8(qs), u8x8(qs.add(8)));
                // Values 0..8, 8..16 in the low nibbles, 16..24, 24..32 in the high ones.
                q[0] = _mm256_and_si256(v0, low);
                q[1] = _mm256_and_si256(v1, low);
                q[2] = _mm256_srli_epi32::<4>(v0);
                q[3] = _mm256_srli_epi32::<4>(v1);
                if K == Q5_0 {
                    // Value i's 5th bit is bit i of qh, wanted at bit 4 of lane i % 8:
                    // shifted right by i from qh << 4 (values 0..24), by i - 4 from qh for
                    // values 24..32, whose bits qh << 4 lost.
                    let qh = (row.add(g.qh_off + 4 * st) as *const i32).read_unaligned();
                    let h = _mm256_set1_epi32(qh);
                    let h4 = _mm256_slli_epi32::<4>(h);
                    let at = |i: i32| {
                        _mm256_setr_epi32(i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7)
                    };
                    let bits = [
                        _mm256_srlv_epi32(h4, at(0)),
                        _mm256_srlv_epi32(h4, at(8)),
                        _mm256_srlv_epi32(h4, at(16)),
                        _mm256_srlv_epi32(h, at(20)),
                    ];
                    for (qk, b) in q.iter_mut().zip(bits) {
                        *qk = _mm256_or_si256(*qk, _mm256_and_si256(b, sixteen));
                    }
                }
            }
            Q8_0 => {
                let qs = row.add(g.qs_off + 32 * st);
                for (k, qk) in q.iter_mut().enumerate() {
                    *qk = _mm256_cvtepi8_epi32(_mm_loadl_epi64(qs.add(8 * k) as *const __m128i));
                }
            }
            Q4_K | Q5_K => {
                // Sub-blocks 2c and 2c + 1 of super-block s: the low and the high nibbles of
                // 32 bytes; Q5_K's 5th bits are bits 2c and 2c + 1 of the 32 qh bytes.
                let (s, c) = (st / 4, st % 4);
                let bytes = if K == Q5_K {
                    GgmlKind::Q5K.block_bytes()
                } else {
                    GgmlKind::Q4K.block_bytes()
                };
                let blk = row.add(s * bytes);
                let qs = blk.add(if K == Q5_K { 48 } else { 16 } + 32 * c);
                let shift = _mm_cvtsi32_si128(2 * c as i32);
                for k in 0..4 {
                    let v = u8x8(qs.add(8 * k));
                    q[k] = _mm256_and_si256(v, low);
                    q[4 + k] = _mm256_srli_epi32::<4>(v);
                    if K == Q5_K {
                        let h = _mm256_srl_epi32(u8x8(blk.add(16 + 8 * k)), shift);
                        let lo = _mm256_and_si256(_mm256_slli_epi32::<4>(h), sixteen);
                        let hi = _mm256_and_si256(_mm256_slli_epi32::<3>(h), sixteen);
                        q[k] = _mm256_or_si256(q[k], lo);
                        q[4 + k] = _mm256_or_si256(q[4 + k], hi);
                    }
                }
            }
            Q6_K => {
                // Chunk k of half n of super-block s: the low (k < 2) or high nibbles of ql
                // bytes 64 n + 32 (k & 1) .., topped by bits 2k, 2k + 1 of qh bytes 32 n ..
                let (s, r) = (st / 8, st % 8);
                let (n, k) = (r / 4, r % 4);
                let blk = row.add(s * GgmlKind::Q6K.block_bytes());
                let (ql, qh) = (blk.add(64 * n + 32 * (k & 1)), blk.add(128 + 32 * n));
                let nib = _mm_cvtsi32_si128(4 * (k as i32 >> 1));
                let top = _mm_cvtsi32_si128(2 * k as i32);
                let two = _mm256_set1_epi32(0x30);
                for (gq, qk) in q.iter_mut().enumerate() {
                    let a = _mm256_and_si256(_mm256_srl_epi32(u8x8(ql.add(8 * gq)), nib), low);
                    let h = _mm256_slli_epi32::<4>(u8x8(qh.add(8 * gq)));
                    *qk = _mm256_or_si256(a, _mm256_and_si256(_mm256_srl_epi32(h, top), two));
                }
            }
            _ => unreachable!("kind {K} has no quants"),
        }
    }
    q.map(|v| _mm256_cvtepi32_ps(v))
}

/// The tile kernel of `kind`.
///
/// # Safety
/// As [`direct`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const R: usize, const M: usize>(kind: GgmlKind, t: &Tile) {
    // SAFETY: the caller's contract is `direct`'s.
    unsafe {
        match kind {
            GgmlKind::Q4_0 => direct::<Q4_0, 4, R, M>(t),
            GgmlKind::Q4_1 => direct::<Q4_1, 4, R, M>(t),
            GgmlKind::Q5_0 => direct::<Q5_0, 4, R, M>(t),
            GgmlKind::Q8_0 => direct::<Q8_0, 4, R, M>(t),
            GgmlKind::Q4K => direct::<Q4_K, 8, R, M>(t),
            GgmlKind::Q5K => direct::<Q5_K, 8, R, M>(t),
            GgmlKind::Q6K => direct::<Q6_K, 4, R, M>(t),
        }
    }
}

/// `R` rows of kind `K` against `M` activation rows: each step's weights are made once per
/// row, `d * q + mn`, and meet all `M` activation rows, in two accumulators per pair
/// (alternate vectors).
///
/// # Safety
/// AVX2+FMA+F16C; `t` describes R rows and M activation rows as [`Tile`] says, in bounds;
/// `N == step_vecs(K)`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn direct<const K: u8, const N: usize, const R: usize, const M: usize>(t: &Tile) {
    debug_assert_eq!(N, step_vecs(K));
    let cols = t.g.nb * BLOCK;
    let uv = unit_vecs(K);
    let mut acc = [[[_mm256_setzero_ps(); 2]; M]; R];
    for st in 0..cols / (8 * N) {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            // SAFETY: st < cols / 8N and j < R, so the step lies in row j of the tile,
            // its units' scales at N / uv * st .. in row j's; the activations read are values
            // 8N st .. 8N (st + 1) of rows i < M (caller's contract).
            unsafe {
                let q = quants::<K, N>(t.w.add(j * t.g.stride), t.g, st);
                let at = j * t.g.sb + N / uv * st;
                let (d, mn) = (t.d.add(at), t.mn.add(at));
                let w: [__m256; N] = std::array::from_fn(|v| {
                    let u = v / uv;
                    _mm256_fmadd_ps(q[v], _mm256_set1_ps(*d.add(u)), _mm256_set1_ps(*mn.add(u)))
                });
                for (i, a) in acc_j.iter_mut().enumerate() {
                    let xs = t.x.add(i * cols + 8 * N * st);
                    for (v, &wv) in w.iter().enumerate() {
                        a[v & 1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xs.add(8 * v)), a[v & 1]);
                    }
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

/// Dequantizes `rt` rows starting at `row` into `wbuf: [rt, cols]`, with the f32 scales
/// [`scales`] left in `dbuf` / `mbuf` (row j's at `j * g.sb`).
///
/// # Safety
/// AVX2+FMA+F16C; `row` starts `rt` whole rows of geometry `g`; the buffers hold `rt` rows.
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
        // SAFETY: row j lies in the caller's rows with its scales at j * sb; its
        // destination is wbuf[j * cols..][..cols] (asserted above).
        unsafe {
            let (r, d, mn) = (
                row.add(j * g.stride),
                dbuf.as_ptr().add(j * g.sb),
                mbuf.as_ptr().add(j * g.sb),
            );
            let dst = wbuf.as_mut_ptr().add(j * cols);
            match kind {
                GgmlKind::Q4_0 => fill::<Q4_0, 4>(r, g, d, mn, dst),
                GgmlKind::Q4_1 => fill::<Q4_1, 4>(r, g, d, mn, dst),
                GgmlKind::Q5_0 => fill::<Q5_0, 4>(r, g, d, mn, dst),
                GgmlKind::Q8_0 => fill::<Q8_0, 4>(r, g, d, mn, dst),
                GgmlKind::Q4K => fill::<Q4_K, 8>(r, g, d, mn, dst),
                GgmlKind::Q5K => fill::<Q5_K, 8>(r, g, d, mn, dst),
                GgmlKind::Q6K => fill::<Q6_K, 4>(r, g, d, mn, dst),
            }
        }
    }
}

/// The f32 weights of one row, `d * q + mn` rounded once, into `dst: [cols]`.
///
/// # Safety
/// AVX2+FMA+F16C; `row` starts a row of geometry `g` and kind `K` whose scales are at `d`
/// and `mn`; `dst` holds `cols` floats; `N == step_vecs(K)`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fill<const K: u8, const N: usize>(
    row: *const u8,
    g: RowGeom,
    d: *const f32,
    mn: *const f32,
    dst: *mut f32,
) {
    let uv = unit_vecs(K);
    for st in 0..g.nb * BLOCK / (8 * N) {
        // SAFETY: st < cols / 8N, so the step, its units' scales and the stores at
        // 8N st + 8v < cols lie in the caller's ranges.
        unsafe {
            let q = quants::<K, N>(row, g, st);
            for (v, qv) in q.into_iter().enumerate() {
                let u = st * (N / uv) + v / uv;
                let w = _mm256_fmadd_ps(qv, _mm256_set1_ps(*d.add(u)), _mm256_set1_ps(*mn.add(u)));
                _mm256_storeu_ps(dst.add(8 * (N * st + v)), w);
            }
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
