//! The AVX2+FMA+F16C kernels: dot-product tiles, 8 lanes per vector, for every kind.
//!
//! Each kind has one [`weights`] that turns a step of a row (a block of 32, a Q4_K / Q5_K
//! pair of sub-blocks, a Q6_K pair of chunks of 32) into its weights, 8 at a time,
//! `d * q + mn` rounded once (`format::row_scales`), for the tile kernel ([`direct`]) and the
//! dequantizer for many rows ([`dequant`]).
//!
//! Factoring the scales out of each unit's dot product (`d * (q . x) + mn * sum(x)`, one
//! multiply-add fewer per 8 weights) was tried and dropped: at one activation row it ran
//! within 10% of this either way, slower for Q5_0, Q5_K and Q6_K (a throwaway probe, CPU time
//! of one thread, minimum of 31 samples, on the shared 2-core Zen 3 VM), since the quants'
//! extraction and conversion, not the multiply-adds, bound these kernels on AVX2.

use super::format::{RowGeom, SLACK};
use super::kind::{GgmlKind, BLOCK};
use super::kind::{Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0};
use super::tile::{prefetch_past_tile, Tile, DIRECT_MAX_M};
use std::arch::x86_64::*;

tile_driver!(rows, "avx2,fma,f16c", 2, 1, scales);

/// Vectors of 8 weights per step of kind `k` ([`weights`]): a Q4_K / Q5_K step is two
/// sub-blocks, whose nibbles share bytes, a Q6_K step two chunks of 32 that do; any other
/// step 32 values.
const fn step_vecs(k: u8) -> usize {
    match k {
        Q4_K | Q5_K | Q6_K => 8,
        _ => 4,
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
pub(super) unsafe fn k4_scales(p: *const u8) -> (u64, u64) {
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
pub(super) unsafe fn half_at(p: *const u8) -> f32 {
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
pub(super) unsafe fn scales(
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

/// Where the values of a step's vectors lie, from the step's first value ([`weights`]):
/// 8 consecutive values each, in order, but for Q6_K, whose step is two chunks of 32 that
/// share their quant bytes, 64 values apart.
const fn offsets<const N: usize>(k: u8) -> [usize; N] {
    let mut o = [0; N];
    let mut v = 0;
    while v < N {
        o[v] = if k == Q6_K && v >= 4 {
            64 + 8 * (v - 4)
        } else {
            8 * v
        };
        v += 1;
    }
    o
}

/// The first value of step `st` of kind `k`: 32 or 64 per step, or for Q6_K four steps per
/// super-block, (half n, chunk pair p) at 128 n + 32 p.
const fn step_start(k: u8, st: usize) -> usize {
    match k {
        Q4_K | Q5_K => 64 * st,
        Q6_K => 256 * (st / 4) + 128 * (st % 4 / 2) + 32 * (st % 2),
        _ => 32 * st,
    }
}

/// Steps per row of kind `k` and `nb` units of 32 values.
const fn steps(k: u8, nb: usize) -> usize {
    match k {
        Q4_K | Q5_K | Q6_K => nb / 2,
        _ => nb,
    }
}

/// The weights of step `st` of the row starting at `row` (kind `K`, `N = step_vecs(K)`
/// vectors of 8, at [`offsets`] from [`step_start`]), `d * q + mn` from the row's f32
/// scales `d`, `mn` (`format::row_scales`' layout), each rounded once.
///
/// The quants come from bytes widened to 32-bit lanes. A 5th bit becomes 16 without a
/// shift: `min(bit, 16)` where it sits at bit 4 or above, a compare where it sits below
/// (shifts share two vector ports with the widening on Zen 3). Q6_K's high nibbles stay in
/// place, 16 times their value, and take `d / 16` (exact): its two chunks have scales of
/// their own anyway, and one shift serves both chunks' top bits.
///
/// # Safety
/// AVX2+FMA+F16C; `row` starts a whole row of geometry `g` and kind `K` whose scales `d`
/// and `mn` point to; `st < steps(K, nb)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weights<const K: u8, const N: usize>(
    row: *const u8,
    g: RowGeom,
    st: usize,
    d: *const f32,
    mn: *const f32,
) -> [__m256; N] {
    let low = _mm256_set1_epi32(0x0f);
    let high = _mm256_set1_epi32(0xf0);
    let sixteen = _mm256_set1_epi32(16);
    let lanes =
        |i: i32| _mm256_setr_epi32(i, i << 1, i << 2, i << 3, i << 4, i << 5, i << 6, i << 7);
    // Value q (integer lanes) times scale `s` plus `m`.
    let val = |q: __m256i, s: f32, m: f32| {
        _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(s), _mm256_set1_ps(m))
    };
    let mut w = [_mm256_setzero_ps(); N];
    // SAFETY: every byte read lies in step `st` of the row and every scale in the row's
    // (the caller's contract); the offsets follow the formats (see format.rs).
    unsafe {
        match K {
            Q4_0 | Q4_1 | Q5_0 => {
                // Values 0..8, 8..16 in the low nibbles of 16 bytes, 16..24, 24..32 in the
                // high ones.
                let qs = row.add(g.qs_off + 16 * st);
                let (v0, v1) = (u8x8(qs), u8x8(qs.add(8)));
                let mut q = [
                    _mm256_and_si256(v0, low),
                    _mm256_and_si256(v1, low),
                    _mm256_srli_epi32::<4>(v0),
                    _mm256_srli_epi32::<4>(v1),
                ];
                if K == Q5_0 {
                    // Value i's 5th bit is bit i of qh: lane k of vector j tests bit 8j + k.
                    let qh = (row.add(g.qh_off + 4 * st) as *const i32).read_unaligned();
                    let h = _mm256_set1_epi32(qh);
                    let b0 = _mm256_and_si256(h, lanes(1));
                    let b0 = _mm256_and_si256(_mm256_cmpeq_epi32(b0, lanes(1)), sixteen);
                    let bits = [
                        b0,
                        _mm256_min_epu32(_mm256_and_si256(h, lanes(1 << 8)), sixteen),
                        _mm256_min_epu32(_mm256_and_si256(h, lanes(1 << 16)), sixteen),
                        _mm256_min_epu32(_mm256_and_si256(h, lanes(1 << 24)), sixteen),
                    ];
                    for (qk, b) in q.iter_mut().zip(bits) {
                        *qk = _mm256_or_si256(*qk, b);
                    }
                }
                let (dd, m) = (*d.add(st), *mn.add(st));
                for (wk, qk) in w.iter_mut().zip(q) {
                    *wk = val(qk, dd, m);
                }
            }
            Q8_0 => {
                let qs = row.add(g.qs_off + 32 * st);
                let dv = _mm256_set1_ps(*d.add(st));
                for (k, wk) in w.iter_mut().enumerate() {
                    let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(qs.add(8 * k) as *const __m128i));
                    *wk = _mm256_mul_ps(_mm256_cvtepi32_ps(q), dv);
                }
            }
            Q4_K | Q5_K => {
                // Sub-blocks u and u + 1 of super-block s: the low and the high nibbles of
                // 32 bytes; Q5_K's 5th bits are bits 2c and 2c + 1 of the 32 qh bytes.
                let (s, c) = (st / 4, st % 4);
                let bytes = if K == Q5_K {
                    GgmlKind::Q5K.block_bytes()
                } else {
                    GgmlKind::Q4K.block_bytes()
                };
                let blk = row.add(s * bytes);
                let qs = blk.add(if K == Q5_K { 48 } else { 16 } + 32 * c);
                let u = 2 * st;
                let (d0, m0, d1, m1) = (*d.add(u), *mn.add(u), *d.add(u + 1), *mn.add(u + 1));
                let (bit0, bit1) = (
                    _mm256_set1_epi32(1 << (2 * c)),
                    _mm256_set1_epi32(2 << (2 * c)),
                );
                for k in 0..4 {
                    let v = u8x8(qs.add(8 * k));
                    let mut lo = _mm256_and_si256(v, low);
                    let mut hi = _mm256_srli_epi32::<4>(v);
                    if K == Q5_K {
                        let h = u8x8(blk.add(16 + 8 * k));
                        let set0 = _mm256_cmpeq_epi32(_mm256_and_si256(h, bit0), bit0);
                        let set1 = _mm256_cmpeq_epi32(_mm256_and_si256(h, bit1), bit1);
                        lo = _mm256_or_si256(lo, _mm256_and_si256(set0, sixteen));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(set1, sixteen));
                    }
                    w[k] = val(lo, d0, m0);
                    w[4 + k] = val(hi, d1, m1);
                }
            }
            Q6_K => {
                // Chunks p and p + 2 of half n of super-block s: the low and the high
                // nibbles of ql bytes 64 n + 32 p .., topped by bits 2p, 2p + 1 and 2p + 4,
                // 2p + 5 of qh bytes 32 n ..; one shift by 4 - 2p puts both pairs at bits
                // 4-5 and 8-9. Sub-blocks of 16: 16 s + 8 n + 2 p (+ 1), and + 4 for p + 2.
                let (s, n, p) = (st / 4, st % 4 / 2, st % 2);
                let blk = row.add(s * GgmlKind::Q6K.block_bytes());
                let (ql, qh) = (blk.add(64 * n + 32 * p), blk.add(128 + 32 * n));
                let shift = _mm_cvtsi32_si128(4 - 2 * p as i32);
                let (top_lo, top_hi) = (_mm256_set1_epi32(0x30), _mm256_set1_epi32(0x300));
                let t = 16 * s + 8 * n + 2 * p;
                for k in 0..4 {
                    let a = u8x8(ql.add(8 * k));
                    let h = _mm256_sll_epi32(u8x8(qh.add(8 * k)), shift);
                    let lo = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(h, top_lo));
                    let hi =
                        _mm256_or_si256(_mm256_and_si256(a, high), _mm256_and_si256(h, top_hi));
                    let (u0, u1) = (t + k / 2, t + 4 + k / 2);
                    w[k] = val(lo, *d.add(u0), *mn.add(u0));
                    w[4 + k] = val(hi, *d.add(u1) * 0.0625, *mn.add(u1));
                }
            }
            _ => unreachable!("kind {K} has no weights"),
        }
    }
    w
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
            GgmlKind::Q6K => direct::<Q6_K, 8, R, M>(t),
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
    let off = offsets::<N>(K);
    let mut acc = [[[_mm256_setzero_ps(); 2]; M]; R];
    for st in 0..steps(K, t.g.nb) {
        let x0 = step_start(K, st);
        for (j, acc_j) in acc.iter_mut().enumerate() {
            // SAFETY: st < steps and j < R, so the step lies in row j of the tile with its
            // scales at j * sb; the activations read are values x0 + off[v] + 0..8 < cols
            // of rows i < M (caller's contract).
            unsafe {
                let at = j * t.g.sb;
                let w =
                    weights::<K, N>(t.w.add(j * t.g.stride), t.g, st, t.d.add(at), t.mn.add(at));
                for (i, a) in acc_j.iter_mut().enumerate() {
                    let xs = t.x.add(i * cols + x0);
                    for (v, &wv) in w.iter().enumerate() {
                        let xv = _mm256_loadu_ps(xs.add(off[v]));
                        a[v & 1] = _mm256_fmadd_ps(wv, xv, a[v & 1]);
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
                GgmlKind::Q6K => fill::<Q6_K, 8>(r, g, d, mn, dst),
            }
        }
    }
}

/// Rows of geometry `g` into `w: [n, cols]` row-major (`n = w.len() / cols`), each weight as
/// the tile kernels make it: for products with many activation rows (`wide.rs`).
///
/// # Safety
/// AVX2+FMA+F16C. Lengths are asserted: `rows` must hold the `n` rows and [`SLACK`] bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_rows(kind: GgmlKind, g: RowGeom, rows: &[u8], w: &mut [f32]) {
    let cols = g.nb * BLOCK;
    let n = w.len() / cols;
    assert!(w.len() == n * cols && rows.len() >= n * g.stride + SLACK);
    let (mut d, mut mn) = (vec![0f32; g.sb], vec![0f32; g.sb]);
    for (j, wr) in w.chunks_exact_mut(cols).enumerate() {
        let row = &rows[j * g.stride..];
        // SAFETY: the CPU has the features (caller's contract); `row` starts row j < n and
        // runs to the slack, as `scales` and `dequant` read; `d`, `mn` hold one row's sb
        // scales and `wr` one row of weights.
        unsafe {
            scales(kind, g, row, 0, &mut d, &mut mn);
            dequant(kind, g, row.as_ptr(), 1, &d, &mn, wr);
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
    let off = offsets::<N>(K);
    for st in 0..steps(K, g.nb) {
        // SAFETY: st < steps, so the step, its scales and the stores at
        // step_start + off[v] + 0..8 < cols lie in the caller's ranges.
        unsafe {
            let w = weights::<K, N>(row, g, st, d, mn);
            let at = dst.add(step_start(K, st));
            for (v, wv) in w.into_iter().enumerate() {
                _mm256_storeu_ps(at.add(off[v]), wv);
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
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
    _mm_cvtss_f32(s)
}
