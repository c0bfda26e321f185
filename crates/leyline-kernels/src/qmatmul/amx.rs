//! The AMX tier's products of many activation rows: the grouped kernels' arithmetic
//! (`grouped.rs`) with the integer dot products on AMX-INT8 tiles.
//!
//! Design decision: a tile product (`tdpbsud`) takes 16 activation rows against 16 weight
//! rows, one unit (32 values; a sixteenth of 16 for Q6_K, whose scales are per 16) at a
//! time, and leaves one exact `i32` dot product per pair: the same integers the VNNI kernel
//! sums in its lanes. Each is then stored and meets the same float steps, in the same order,
//! as in `grouped.rs`, so a row's outputs are the VNNI kernel's to the bit and a batch that
//! takes the tiles equals its rows alone (which take VNNI). The weights' nibbles are
//! unpacked to bytes once per group (tiles read bytes) and reused by every tile of
//! activation rows; the activations are packed as tiles of 16 rows by 32 values, 512
//! contiguous bytes each (`Packed`), padded to whole tiles with zero rows.

use super::grouped::{bcast, halves, q4k_quad, q6k_quads, q6k_scale, quads32, store};
use super::interleave::{group_bytes, GROUP, Q4K_BYTES, Q4K_MINS, Q5K_BYTES, Q6K_BYTES, SC};
use super::kind::GgmlKind;
use super::kind::{Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q8_0};
use super::q8::{Q8KRow, Q8Row};
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Activation rows from which a product takes the tiles (fewer take the VNNI kernels).
pub(super) const MIN_ROWS: usize = 16;

/// Activation rows per tile (a tile's 16 rows).
const TM: usize = 16;

/// Bytes of unpacked weights one pass over the activation tiles keeps (in L2: half of a 2 MiB
/// L2 measured a little faster than a quarter).
const UNPACKED_BYTES: usize = 1024 * 1024;

/// Activation rows quantized for the tiles: the rows of [`Q8Row`]s or [`Q8KRow`]s side by
/// side, padded with zero rows to whole tiles.
pub(super) struct Packed {
    /// The rows as packed (before padding).
    m: usize,
    /// Values per row.
    cols: usize,
    /// The 8-bit values as activation tiles: per tile of 16 rows and block of 32 values, the
    /// 16 rows' 32 bytes (512 contiguous bytes, which a tile load reads 32 apart).
    q: Vec<i8>,
    /// `[rows, blocks]` steps (blocks of 32, or super-blocks of 256).
    d: Vec<f32>,
    /// `[rows, cols / 32]` sums of the values per 32.
    bs32: Vec<i16>,
    /// `[rows, cols / 16]` sums per 16 (K-quant rows only).
    bs16: Vec<i16>,
}

impl Packed {
    /// Rows quantized per block of 32.
    pub(super) fn of_blocks32(rows: &[Q8Row]) -> Packed {
        Packed::new(rows, |r| (&r.q, &r.d, &r.bs, &[]))
    }

    /// Rows quantized per super-block of 256.
    pub(super) fn of_supers(rows: &[Q8KRow]) -> Packed {
        Packed::new(rows, |r| (&r.q, &r.d, &r.bs32, &r.bs16))
    }

    #[allow(clippy::type_complexity)]
    fn new<T>(rows: &[T], parts: impl Fn(&T) -> (&[i8], &[f32], &[i16], &[i16])) -> Packed {
        let m = rows.len();
        let padded = m.div_ceil(TM) * TM;
        let (cols, nd, n32, n16) = rows.first().map_or((0, 0, 0, 0), |r| {
            let (q, d, b32, b16) = parts(r);
            (q.len(), d.len(), b32.len(), b16.len())
        });
        let mut p = Packed {
            m,
            cols,
            q: vec![0; padded * cols],
            d: vec![0.0; padded * nd],
            bs32: vec![0; padded * n32],
            bs16: vec![0; padded * n16],
        };
        for (i, r) in rows.iter().enumerate() {
            let (q, d, b32, b16) = parts(r);
            let (tile, r) = (i / TM, i % TM);
            for (c, v) in q.chunks_exact(32).enumerate() {
                let at = ((tile * cols / 32 + c) * TM + r) * 32;
                p.q[at..at + 32].copy_from_slice(v);
            }
            p.d[i * nd..(i + 1) * nd].copy_from_slice(d);
            p.bs32[i * n32..(i + 1) * n32].copy_from_slice(b32);
            p.bs16[i * n16..(i + 1) * n16].copy_from_slice(b16);
        }
        p
    }

    /// The activation tile of rows `i0 .. i0 + 16` and values `32 c .. 32 c + 32`: 16 rows
    /// [`LDA`] bytes apart.
    ///
    /// # Safety
    /// `i0` is a multiple of 16 below the padded rows, `c` below `cols / 32`.
    #[inline(always)]
    unsafe fn tile(&self, i0: usize, c: usize) -> *const i8 {
        // SAFETY: the caller's bounds keep the offset within `q`.
        unsafe { self.q.as_ptr().add((i0 * self.cols / 32 + c * TM) * 32) }
    }
}

/// Bytes between an activation tile's rows.
const LDA: usize = 32;

/// A tile configuration (palette 1): `tmm0` to `tmm3` 16 x 16 `i32` products; `tmm4`,
/// `tmm5` activation tiles of 16 rows of `k` bytes; `tmm6`, `tmm7` weight tiles of `k / 4`
/// rows of 64 bytes (16 rows' quads of 4 bytes).
#[repr(C, align(64))]
struct Config {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

impl Config {
    fn new(k: usize) -> Config {
        let mut c = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let shapes = [(64, 16); 4]
            .into_iter()
            .chain([(k, 16); 2])
            .chain([(64, k / 4); 2]);
        for (t, (cb, r)) in shapes.enumerate() {
            c.colsb[t] = cb as u16;
            c.rows[t] = r as u8;
        }
        c
    }
}

/// Products of `k` values per tile pair for the tiles this thread runs next.
///
/// # Safety
/// The CPU runs the AMX tier (the process holds the tile permission, `cpu.rs`).
unsafe fn configure(k: usize) {
    let c = Config::new(k);
    // SAFETY: `c` is a valid palette-1 configuration of 64 bytes (rows <= 16, columns <= 64
    // bytes) and the caller's CPU runs AMX with the permission granted.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &c, options(nostack, readonly)) };
}

/// Returns the tiles to their initial state (no configuration), so a context switch saves
/// no tile data.
///
/// # Safety
/// As [`configure`].
unsafe fn release() {
    // SAFETY: the CPU runs AMX (the caller's contract); no tile is live across the call.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// `c[i][j] = a_i . b_j` over the configured `k` values: activation rows `a` (16 rows, stride
/// `lda` bytes, signed) against the weight tile at `b` (`k / 4` rows of 64 bytes, unsigned),
/// stored to `c` (16 rows of 16 `i32`). Product `j` of a run takes product tile `j % 4` and
/// operand tiles `j % 2`, so that four products are in flight.
///
/// # Safety
/// [`configure`] ran on this thread; `a` has 16 rows of `k` readable bytes `lda` apart, `b`
/// `k / 4 * 64` readable bytes and `c` 1024 writable bytes.
#[inline(always)]
unsafe fn dot(j: usize, a: *const i8, lda: usize, b: *const u8, c: *mut i32) {
    macro_rules! run {
        ($c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tilezero tmm", $c),
                concat!("tileloadd tmm", $a, ", [{a} + {lda} * 1]"),
                concat!("tileloadd tmm", $b, ", [{b} + {ldb} * 1]"),
                concat!("tdpbsud tmm", $c, ", tmm", $a, ", tmm", $b),
                concat!("tilestored [{c} + {ldb} * 1], tmm", $c),
                a = in(reg) a, lda = in(reg) lda, b = in(reg) b, ldb = in(reg) 64usize,
                c = in(reg) c, options(nostack)
            )
        };
    }
    // SAFETY: the caller's contract; the tiles named are configured and hold nothing live
    // between calls.
    unsafe {
        match j % 4 {
            0 => run!("0", "4", "6"),
            1 => run!("1", "5", "7"),
            2 => run!("2", "4", "6"),
            _ => run!("3", "5", "7"),
        }
    }
}

/// Four [`dot`] products in one run: the four product tiles are zeroed, the four products
/// issued, then stored, so that no store waits on the product just issued (a store right
/// after its product held each product's whole latency).
///
/// # Safety
/// As [`dot`], for each of the four.
#[inline(always)]
unsafe fn dot4(a: [*const i8; 4], lda: usize, b: [*const u8; 4], c: [*mut i32; 4]) {
    // SAFETY: as in `dot`.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tileloadd tmm4, [{a0} + {lda} * 1]",
            "tileloadd tmm6, [{b0} + {ldb} * 1]",
            "tdpbsud tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {lda} * 1]",
            "tileloadd tmm7, [{b1} + {ldb} * 1]",
            "tdpbsud tmm1, tmm5, tmm7",
            "tileloadd tmm4, [{a2} + {lda} * 1]",
            "tileloadd tmm6, [{b2} + {ldb} * 1]",
            "tdpbsud tmm2, tmm4, tmm6",
            "tileloadd tmm5, [{a3} + {lda} * 1]",
            "tileloadd tmm7, [{b3} + {ldb} * 1]",
            "tdpbsud tmm3, tmm5, tmm7",
            "tilestored [{c0} + {ldb} * 1], tmm0",
            "tilestored [{c1} + {ldb} * 1], tmm1",
            "tilestored [{c2} + {ldb} * 1], tmm2",
            "tilestored [{c3} + {ldb} * 1], tmm3",
            a0 = in(reg) a[0], a1 = in(reg) a[1], a2 = in(reg) a[2], a3 = in(reg) a[3],
            b0 = in(reg) b[0], b1 = in(reg) b[1], b2 = in(reg) b[2], b3 = in(reg) b[3],
            c0 = in(reg) c[0], c1 = in(reg) c[1], c2 = in(reg) c[2], c3 = in(reg) c[3],
            lda = in(reg) lda, ldb = in(reg) 64usize, options(nostack)
        );
    }
}

/// Stored tile products: two halves of 16 products of 16 x 16 `i32`, one filled by the
/// tiles while the other meets its float steps.
#[repr(C, align(64))]
struct Stage([[i32; 256]; 32]);

impl Stage {
    /// Row `i` (16 weight rows' sums for activation row `i`) of product `t`.
    #[inline(always)]
    fn row(&self, t: usize, i: usize) -> __m512i {
        // SAFETY: 16 `i32` at row i of product t; AVX-512F is the callers' contract
        // (`target_feature` functions inlined here).
        unsafe { _mm512_loadu_si512(self.0[t][16 * i..].as_ptr() as *const _) }
    }

    fn ptr(&mut self, t: usize) -> *mut i32 {
        self.0[t].as_mut_ptr()
    }
}

thread_local! {
    /// Each thread's unpacked weights, kept between products.
    static UNPACKED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `out[j * m + i] = row (16 g0 + j) . act i` for `j < n` (`out: [n, m]`, `m` =
/// `a.rows()`) from the interleaved matrix `data` of `kind` with `nb` blocks per row (blocks
/// of 32, or super-blocks of 256): `a` packs the activations as the kind's family rounds them.
///
/// # Safety
/// The CPU runs the AMX tier. Lengths are asserted.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows(
    kind: GgmlKind,
    data: &[u8],
    nb: usize,
    g0: usize,
    a: &Packed,
    out: &mut [f32],
) {
    let m = a.m;
    assert!(m > 0 && out.len().is_multiple_of(m));
    let n = out.len() / m;
    let cols = nb * kind.block_len();
    let (padded, blocks) = (m.div_ceil(TM) * TM, cols / kind.block_len());
    assert!(a.cols == cols && a.q.len() == padded * cols && a.d.len() == padded * blocks);
    assert!(a.bs32.len() == padded * cols / 32);
    if kind == GgmlKind::Q6K {
        assert!(a.bs16.len() == padded * cols / 16);
    }
    let gb = group_bytes(kind) * nb;
    let groups = n.div_ceil(GROUP);
    assert!(data.len() >= (g0 + groups) * gb);
    // Unpacked, a group holds one byte per weight: 16 rows of `cols`.
    let ub = GROUP * cols;
    let per = (UNPACKED_BYTES / ub).clamp(1, groups);
    let mut stage = Box::new(Stage([[0; 256]; 32]));
    UNPACKED.with_borrow_mut(|buf| {
        if buf.len() < per * ub {
            buf.resize(per * ub, 0);
        }
        // SAFETY: the CPU runs AMX (the caller's contract); every pointer below is in bounds
        // by the asserts above: groups `g0 ..` of `data`, `per` unpacked groups in `buf`,
        // whole tiles of packed rows in `a`.
        unsafe {
            configure(if kind == GgmlKind::Q6K { 16 } else { 32 });
            for gs in (0..groups).step_by(per) {
                let ge = (gs + per).min(groups);
                for g in gs..ge {
                    let w = data[(g0 + g) * gb..].as_ptr();
                    unpack(kind, w, nb, buf[(g - gs) * ub..].as_mut_ptr());
                }
                for i0 in (0..padded).step_by(TM) {
                    for g in gs..ge {
                        let w = data[(g0 + g) * gb..].as_ptr();
                        let u = buf[(g - gs) * ub..].as_ptr();
                        let st = &mut *stage;
                        let t = match kind {
                            GgmlKind::Q4K => tiles_q4k::<Q4_K>(w, u, nb, a, i0, st),
                            GgmlKind::Q5K => tiles_q4k::<Q5_K>(w, u, nb, a, i0, st),
                            GgmlKind::Q6K => tiles_q6k(w, u, nb, a, i0, st),
                            GgmlKind::Q4_0 => tiles32::<Q4_0>(w, u, nb, a, i0, st),
                            GgmlKind::Q4_1 => tiles32::<Q4_1>(w, u, nb, a, i0, st),
                            GgmlKind::Q5_0 => tiles32::<Q5_0>(w, u, nb, a, i0, st),
                            GgmlKind::Q8_0 => tiles32::<Q8_0>(w, u, nb, a, i0, st),
                        };
                        let live = GROUP.min(n - g * GROUP);
                        for (i, ti) in t.iter().enumerate().take(m - i0) {
                            for (r, &v) in ti[..live].iter().enumerate() {
                                out[(g * GROUP + r) * m + i0 + i] = v;
                            }
                        }
                    }
                }
            }
            release();
        }
    });
}

/// The group's weights at `w` (`nb` blocks) as unsigned bytes into `u`: per block of 32
/// values (each unit of a super-block), 8 quads of 64 bytes (16 rows' 4 values), the
/// layout of a weight tile.
///
/// # Safety
/// `w` is a whole interleaved group of `kind`; `u` has 16 writable bytes per weight value.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack(kind: GgmlKind, w: *const u8, nb: usize, u: *mut u8) {
    // SAFETY: the caller's contract; each store lies in the unit's 512 bytes.
    unsafe {
        let put = |unit: usize, q: usize, v: __m512i| {
            _mm512_storeu_si512(u.add(512 * unit + 64 * q) as *mut _, v);
        };
        let bytes = group_bytes(kind);
        for s in 0..nb {
            let b = w.add(s * bytes);
            match kind {
                GgmlKind::Q4K | GgmlKind::Q5K => {
                    for t in 0..4 {
                        let mut plane = _mm512_setzero_si512();
                        for q in 0..8 {
                            let (lo, hi) = if kind == GgmlKind::Q5K {
                                q4k_quad::<Q5_K>(b, t, q, &mut plane)
                            } else {
                                q4k_quad::<Q4_K>(b, t, q, &mut plane)
                            };
                            put(8 * s + 2 * t, q, lo);
                            put(8 * s + 2 * t + 1, q, hi);
                        }
                    }
                }
                GgmlKind::Q6K => {
                    for t in 0..4 {
                        for p in 0..4 {
                            for (k, (lo, hi)) in q6k_quads(b, t, p).into_iter().enumerate() {
                                put(8 * s + 2 * t, 2 * p + k, lo);
                                put(8 * s + 2 * t + 1, 2 * p + k, hi);
                            }
                        }
                    }
                }
                _ => {
                    let quads = match kind {
                        GgmlKind::Q4_0 => quads32::<Q4_0>(b),
                        GgmlKind::Q4_1 => quads32::<Q4_1>(b),
                        GgmlKind::Q5_0 => quads32::<Q5_0>(b),
                        _ => quads32::<Q8_0>(b),
                    };
                    for (q, v) in quads.into_iter().enumerate() {
                        put(s, q, v);
                    }
                }
            }
        }
    }
}

/// The 16 x 16 outputs of a Q4_K or Q5_K group (interleaved at `w`, unpacked at `u`, `ns`
/// super-blocks) for packed activation rows `i0 .. i0 + 16`: `grouped.rs`'s `group_q4k`
/// step for step, its unit dot products from the tiles. The tiles of super-block `s + 1` are
/// issued before the float steps of `s`, so the two overlap.
///
/// # Safety
/// As [`rows`], whose asserts cover the pointers.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles_q4k<const K: u8>(
    w: *const u8,
    u: *const u8,
    ns: usize,
    a: &Packed,
    i0: usize,
    stage: &mut Stage,
) -> [[f32; GROUP]; TM] {
    let bytes = if K == Q5_K { Q5K_BYTES } else { Q4K_BYTES };
    // Super-block s's 8 unit products into half s % 2 of the stage.
    let issue = |stage: &mut Stage, s: usize| {
        for h in [0, 4] {
            // SAFETY: units h .. h + 4 of super-block s, of rows i0 .. i0 + 16 and of the
            // group.
            unsafe {
                let c = 8 * s + h;
                let xs = std::array::from_fn(|j| a.tile(i0, c + j));
                let ws = std::array::from_fn(|j| u.add(512 * (c + j)));
                let cs = std::array::from_fn(|j| stage.ptr(8 * (s % 2) + h + j));
                dot4(xs, LDA, ws, cs);
            }
        }
    };
    issue(stage, 0);
    let mut tot = [_mm512_setzero_ps(); TM];
    for s in 0..ns {
        if s + 1 < ns {
            issue(stage, s + 1);
        }
        // SAFETY: super-block s of the group and of rows i0 .. i0 + 16.
        unsafe {
            let b = w.add(s * bytes);
            let (d, dmin) = (halves(b), halves(b.add(32)));
            let mut sbf = [_mm512_setzero_ps(); TM];
            for unit in 0..8 {
                let sc = _mm_loadu_si128(b.add(SC + 16 * unit) as *const __m128i);
                let scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), d);
                let t = 8 * (s % 2) + unit;
                for (i, f) in sbf.iter_mut().enumerate() {
                    *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(stage.row(t, i)), scale, *f);
                }
            }
            let mn: [__m512i; 4] = std::array::from_fn(|t| {
                _mm512_cvtepu8_epi16(_mm256_loadu_si256(b.add(Q4K_MINS + 32 * t) as *const _))
            });
            for i in 0..TM {
                let row = i0 + i;
                let mut mins = _mm512_setzero_si512();
                for (t, &mt) in mn.iter().enumerate() {
                    let bs = bcast(a.bs32.as_ptr().add(row * 8 * ns + 8 * s + 2 * t));
                    mins = _mm512_dpwssd_epi32(mins, mt, bs);
                }
                let f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), dmin, sbf[i]);
                tot[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(a.d[row * ns + s]), tot[i]);
            }
        }
    }
    store(tot)
}

/// [`tiles_q4k`] for Q6_K: `group_q6k` step for step, a tile product per sixteenth.
///
/// # Safety
/// As [`tiles_q4k`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles_q6k(
    w: *const u8,
    u: *const u8,
    ns: usize,
    a: &Packed,
    i0: usize,
    stage: &mut Stage,
) -> [[f32; GROUP]; TM] {
    // Product 2 unit + e of half s % 2: sixteenth e of the unit (its quads 4e .. 4e + 4).
    let issue = |stage: &mut Stage, s: usize| {
        for h in [0, 2, 4, 6] {
            // SAFETY: as in `tiles_q4k`.
            unsafe {
                // Products 2 unit + e for units h, h + 1 and e = 0, 1.
                let c = 8 * s + h;
                let xs = std::array::from_fn(|j| a.tile(i0, c + j / 2).add(16 * (j % 2)));
                let ws = std::array::from_fn(|j| u.add(512 * (c + j / 2) + 256 * (j % 2)));
                let cs = std::array::from_fn(|j| stage.ptr(16 * (s % 2) + 2 * h + j));
                dot4(xs, LDA, ws, cs);
            }
        }
    };
    issue(stage, 0);
    let mut tot = [_mm512_setzero_ps(); TM];
    for s in 0..ns {
        if s + 1 < ns {
            issue(stage, s + 1);
        }
        // SAFETY: as in `tiles_q4k`.
        unsafe {
            let b = w.add(s * Q6K_BYTES);
            let d = halves(b);
            let mut sbf = [_mm512_setzero_ps(); TM];
            let mut pairs = [_mm512_setzero_si512(); 8];
            for t in 0..4 {
                let at = |h: usize| _mm256_loadu_si256(b.add(SC + 64 * t + 32 * h) as *const _);
                let (pa, pb) = (_mm512_cvtepi8_epi16(at(0)), _mm512_cvtepi8_epi16(at(1)));
                (pairs[2 * t], pairs[2 * t + 1]) = (pa, pb);
                for e in 0..2 {
                    let (sa, sb) = (q6k_scale(pa, e, d), q6k_scale(pb, e, d));
                    let h = 16 * (s % 2);
                    let (ta, tb) = (h + 2 * (2 * t) + e, h + 2 * (2 * t + 1) + e);
                    for (i, f) in sbf.iter_mut().enumerate() {
                        *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(stage.row(ta, i)), sa, *f);
                        *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(stage.row(tb, i)), sb, *f);
                    }
                }
            }
            let d32 = _mm512_mul_ps(d, _mm512_set1_ps(32.0));
            for i in 0..TM {
                let row = i0 + i;
                let mut off = _mm512_setzero_si512();
                for t in 0..4 {
                    let bs = a.bs16.as_ptr().add(row * 16 * ns + 16 * s + 4 * t);
                    off = _mm512_dpwssd_epi32(off, pairs[2 * t], bcast(bs));
                    off = _mm512_dpwssd_epi32(off, pairs[2 * t + 1], bcast(bs.add(2)));
                }
                let f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off), d32, sbf[i]);
                tot[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(a.d[row * ns + s]), tot[i]);
            }
        }
    }
    store(tot)
}

/// [`tiles_q4k`] for a kind in blocks of 32 (`K`, `nb` blocks): `group32` step for step, in
/// runs of 8 blocks, each run's tiles issued before the float steps of the run before.
///
/// # Safety
/// As [`tiles_q4k`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tiles32<const K: u8>(
    w: *const u8,
    u: *const u8,
    nb: usize,
    a: &Packed,
    i0: usize,
    stage: &mut Stage,
) -> [[f32; GROUP]; TM] {
    let bytes = group_bytes(super::grouped::kind32::<K>());
    let offset: i32 = match K {
        Q4_0 => 8,
        Q5_0 => 16,
        Q8_0 => 128,
        _ => 0,
    };
    // Run r's blocks into half r % 2 of the stage.
    let issue = |stage: &mut Stage, r: usize| {
        let end = (8 * r + 8).min(nb);
        let mut b = 8 * r;
        while b < end {
            // SAFETY: blocks b .. of rows i0 .. i0 + 16 and of the unpacked group.
            unsafe {
                if b + 4 <= end {
                    let xs = std::array::from_fn(|j| a.tile(i0, b + j));
                    let ws = std::array::from_fn(|j| u.add(512 * (b + j)));
                    let cs = std::array::from_fn(|j| stage.ptr(8 * (r % 2) + b % 8 + j));
                    dot4(xs, LDA, ws, cs);
                    b += 4;
                } else {
                    let c = stage.ptr(8 * (r % 2) + b % 8);
                    dot(b, a.tile(i0, b), LDA, u.add(512 * b), c);
                    b += 1;
                }
            }
        }
    };
    issue(stage, 0);
    let mut tot = [_mm512_setzero_ps(); TM];
    for r in 0..nb.div_ceil(8) {
        if 8 * (r + 1) < nb {
            issue(stage, r + 1);
        }
        for b in 8 * r..(8 * r + 8).min(nb) {
            // SAFETY: block b of the group and of rows i0 .. i0 + 16.
            unsafe {
                let g = w.add(b * bytes);
                let d = halves(g);
                for (i, t) in tot.iter_mut().enumerate() {
                    let at = (i0 + i) * nb + b;
                    let mut v = stage.row(8 * (r % 2) + b % 8, i);
                    if offset != 0 {
                        let o = offset * i32::from(a.bs32[at]);
                        v = _mm512_sub_epi32(v, _mm512_set1_epi32(o));
                    }
                    let ddx = _mm512_mul_ps(d, _mm512_set1_ps(a.d[at]));
                    *t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), ddx, *t);
                    if K == Q4_1 {
                        let mh = halves(g.add(32));
                        let dsum = a.d[at] * f32::from(a.bs32[at]);
                        *t = _mm512_fmadd_ps(mh, _mm512_set1_ps(dsum), *t);
                    }
                }
            }
        }
    }
    store(tot)
}
