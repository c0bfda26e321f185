//! K-quant products (Q4_K, Q5_K, Q6_K) on activations quantized per super-block of 256
//! ([`Q8KRow`]), for any number of activation rows, on the AVX2 tier and the AVX-512 one
//! without VNNI (the VNNI tier reads interleaved matrices, `interleave.rs`).
//!
//! Design decision: with one activation step per super-block, a super-block's whole product
//! stays in integers: each unit of 32 weights meets its activations in one `maddubs` (pairs
//! of byte products summed to 16 bits), whose sums are multiplied by the unit's integer
//! scale and summed to 32 bits in one `madd`; one conversion and one multiply-add per super-block
//! then apply `d * dx`, and the minimums (Q4_K, Q5_K) or Q6_K's offset of 32 come from the
//! activations' per-16/32 sums. The per-unit float scaling of `int8.rs`, which these kinds
//! took before, cost a conversion, a multiply and a multiply-add per unit and the scales'
//! conversion to floats per row: Qwen2.5-Coder-1.5B decoded 1.5x faster this way (AVX-512
//! VNNI VM, 5 alternated pairs).
//!
//! Integer sums are exact (a lane gathers at most 8 units of two `madd` terms of
//! `2 * 63 * 127 * 128`, 32.8M, far from overflow); their conversion to f32 is exact up to
//! 2^24, past which only Q6_K's largest scales on near-full activations could go.

use super::format::{GgmlKind, RowGeom, SLACK};
use super::format::{Q4_K, Q5_K, Q6_K};
use super::int8::quants;
use super::q8::Q8KRow;
use std::arch::x86_64::*;

/// Activation rows per pass: each unit's weights, once extracted, meet this many.
const A: usize = 4;

/// `out[j * m + i] = row j . x_i` for the `n` rows in `rows` (then the slack) and the `m`
/// activation rows `acts` (`out: [n, m]`, feature-major). Every (weight row, activation row)
/// pair takes the same instructions in the same order whatever `m` is, so a row of `x`
/// computed in a batch equals the same row computed alone, bit for bit.
///
/// The AVX-512 VNNI tier takes `interleave.rs` instead.
///
/// # Safety
/// AVX2, FMA and F16C. Lengths are asserted.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows(
    kind: GgmlKind,
    g: RowGeom,
    rows: &[u8],
    acts: &[Q8KRow],
    out: &mut [f32],
) {
    let m = acts.len();
    assert!(m > 0 && out.len().is_multiple_of(m) && kind.is_k());
    let n = out.len() / m;
    assert!(rows.len() >= n * g.stride + SLACK && g.nb.is_multiple_of(8));
    for act in acts {
        let ns = g.nb / 8;
        assert!(act.q.len() == 32 * g.nb && act.d.len() == ns);
        assert!(act.bs16.len() == 16 * ns && act.bs32.len() == 8 * ns);
    }
    // SAFETY: the features are the caller's contract; lengths were asserted.
    unsafe {
        macro_rules! of {
            ($k:expr) => {
                if m > A {
                    rows_of::<$k, true>(g, rows, acts, out)
                } else {
                    rows_of::<$k, false>(g, rows, acts, out)
                }
            };
        }
        match kind {
            GgmlKind::Q4K => of!(Q4_K),
            GgmlKind::Q5K => of!(Q5_K),
            GgmlKind::Q6K => of!(Q6_K),
            _ => unreachable!("not a K-quant"),
        }
    }
}

/// [`rows`] for one kind. A few activation rows (decode, `!EXP`)
/// meet one weight row at a time as it streams from memory, its quants and scales extracted
/// in registers. More rows (prefill, `EXP`) take blocks of weight rows whose quants and
/// scales are extracted once into [`Expanded`], which stays in cache while every group of
/// [`A`] activation rows meets the block. The integers a tile reads are the same either way,
/// and so is every (weight row, activation row) pair's arithmetic.
///
/// # Safety
/// As [`rows`], whose asserts hold.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const K: u8, const EXP: bool>(
    g: RowGeom,
    rows: &[u8],
    acts: &[Q8KRow],
    out: &mut [f32],
) {
    let m = acts.len();
    let n = out.len() / m;
    let ns = g.nb / 8;
    // Weight rows per block: the whole block is read again for each group of activation rows.
    let block = if EXP {
        (EXPANDED_BYTES / (ns * EXP_SB)).clamp(1, n.max(1))
    } else {
        1
    };
    // Kept per thread between calls: fresh pages cost more than the products of a block.
    let mut ex = EXPANDED.with_borrow_mut(std::mem::take);
    let mut b0 = 0;
    while b0 < n {
        let b1 = (b0 + block).min(n);
        if EXP {
            // SAFETY: rows b0 .. b1 < n lie in `rows` (asserted by `rows`).
            unsafe { ex.fill::<K>(rows[b0 * g.stride..].as_ptr(), g, b1 - b0) };
        } else {
            super::tile::prefetch_past_tile(rows, g.stride, b0, 1);
        }
        let mut i0 = 0;
        while i0 < m {
            let ga = A.min(m - i0);
            let xs = &acts[i0..i0 + ga];
            for r in b0..b1 {
                let src = Src {
                    base: rows[r * g.stride..].as_ptr(),
                    ex: ex.bytes[((r - b0) * ns * EXP_QS).min(ex.bytes.len())..].as_ptr(),
                    exs: ex.scales[((r - b0) * ns).min(ex.scales.len())..].as_ptr(),
                };
                // SAFETY: row r < n lies in `rows` (asserted by `rows`) and, with `EXP`, in
                // the expanded block from its row r - b0; every activation row has the row's
                // units and super-blocks.
                let sums: [f32; A] = unsafe {
                    macro_rules! run {
                        ($ga:literal) => {
                            widen(tile::<K, $ga, EXP>(src, g, xs))
                        };
                    }
                    by_ga!(ga, run)
                };
                for (i, &v) in sums[..ga].iter().enumerate() {
                    out[r * m + i0 + i] = v;
                }
            }
            i0 += ga;
        }
        b0 = b1;
    }
    EXPANDED.with_borrow_mut(|e| *e = ex);
}

thread_local! {
    /// The calling thread's [`Expanded`] block.
    static EXPANDED: std::cell::RefCell<Expanded> = std::cell::RefCell::default();
}

/// Bytes of an [`Expanded`] block, which a core's second-level cache holds while the
/// activation rows pass.
const EXPANDED_BYTES: usize = 256 * 1024;
/// Quant and scale bytes per super-block in [`Expanded::bytes`].
const EXP_QS: usize = 512;
/// [`Expanded`] bytes per super-block, its [`Scales`] included.
const EXP_SB: usize = EXP_QS + std::mem::size_of::<Scales>();

/// A block of weight rows as the tiles read them, extracted once for many activation rows:
/// per row and super-block, the 256 quants in unit order ([`quants`]), then the eight units'
/// 16-bit scale lanes ([`unit_scales`]), 32 bytes each, in `bytes`; the super-blocks'
/// [`Scales`] in `scales`.
#[derive(Default)]
struct Expanded {
    bytes: Vec<u8>,
    scales: Vec<Scales>,
}

impl Expanded {
    /// Extracts `n` rows of geometry `g` from `base`.
    ///
    /// # Safety
    /// AVX2, F16C; `n` whole rows of kind `K` from `base`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn fill<const K: u8>(&mut self, base: *const u8, g: RowGeom, n: usize) {
        let ns = g.nb / 8;
        let bytes = g.stride / ns;
        self.bytes.resize(n * ns * EXP_QS, 0);
        self.scales.clear();
        for j in 0..n {
            let row = base.wrapping_add(j * g.stride);
            for s in 0..ns {
                // SAFETY: super-block s of row j < n lies in the caller's rows; the stores
                // are the 512 bytes of (j, s), inside `bytes` (resized above).
                unsafe {
                    let sc = block_scales::<K>(row.add(s * bytes));
                    let dst = self.bytes.as_mut_ptr().add((j * ns + s) * EXP_QS);
                    for k in 0..8 {
                        let q = quants::<K>(row, g, 8 * s + k);
                        _mm256_storeu_si256(dst.add(32 * k) as *mut __m256i, q);
                        let su = unit_scales::<K>(sc.sc, k);
                        _mm256_storeu_si256(dst.add(256 + 32 * k) as *mut __m256i, su);
                    }
                    self.scales.push(sc);
                }
            }
        }
    }
}

/// Where a tile's weight row is read: at `base` as stored, or (for the tiles' `EXP`) at
/// `ex` and `exs` in an [`Expanded`] block.
#[derive(Clone, Copy)]
struct Src {
    base: *const u8,
    ex: *const u8,
    exs: *const Scales,
}

/// A tile's sums in the largest tile's shape.
#[inline(always)]
fn widen<const GA: usize>(s: [f32; GA]) -> [f32; A] {
    let mut all = [0f32; A];
    all[..GA].copy_from_slice(&s);
    all
}

/// The scaled dot products of the weight row from `src` with `GA` activation rows, on
/// AVX2. Each activation row takes the same instructions in the same order whatever `GA`
/// is.
///
/// # Safety
/// AVX2, FMA, F16C; a whole row of geometry `g` and kind `K` from `src`; `xs` holds `GA`
/// rows of `g.nb` units.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const GA: usize, const EXP: bool>(
    src: Src,
    g: RowGeom,
    xs: &[Q8KRow],
) -> [f32; GA] {
    let ns = g.nb / 8;
    // Bytes per super-block, from the row's geometry.
    let bytes = g.stride / ns;
    let mut accf = [_mm256_setzero_ps(); GA];
    let mut accm = [_mm_setzero_ps(); GA];
    for s in 0..ns {
        // SAFETY: super-block s lies in the row (stored or expanded); the activation loads
        // are units 8s .. 8s + 8 and sums of super-block s, inside each activation row
        // (asserted by `rows`).
        unsafe {
            // The unit scales as 16-bit integers, and d / dmin.
            let sc = if EXP {
                *src.exs.add(s)
            } else {
                block_scales::<K>(src.base.add(s * bytes))
            };
            let mut acc = [_mm256_setzero_si256(); GA];
            for k in 0..8 {
                let u = 8 * s + k;
                let (w, su) = if EXP {
                    let p = src.ex.add(s * EXP_QS + 32 * k);
                    (
                        _mm256_loadu_si256(p as *const __m256i),
                        _mm256_loadu_si256(p.add(256) as *const __m256i),
                    )
                } else {
                    let w = quants::<K>(src.base, g, u);
                    (w, unit_scales::<K>(sc.sc, k))
                };
                for i in 0..GA {
                    let x = _mm256_loadu_si256(xs[i].q.as_ptr().add(32 * u) as *const __m256i);
                    let p = _mm256_maddubs_epi16(w, x);
                    acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, su));
                }
            }
            let Scales {
                d,
                dmin,
                sc: scv,
                mins,
            } = sc;
            for i in 0..GA {
                let dx = xs[i].d[s];
                let dd = _mm256_set1_ps(d * dx);
                accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), dd, accf[i]);
                if K == Q6_K {
                    // sum_j sc_j * (sum of q over the 16 values j): the offset of 32.
                    let bs = _mm256_loadu_si256(xs[i].bs16.as_ptr().add(16 * s) as *const __m256i);
                    let off = _mm256_cvtepi32_ps(_mm256_madd_epi16(scv, bs));
                    let c = _mm256_set1_ps(-32.0 * (d * dx));
                    accf[i] = _mm256_fmadd_ps(off, c, accf[i]);
                } else {
                    // sum_k mn_k * (sum of q over unit k): the minimums.
                    let bs = _mm_loadu_si128(xs[i].bs32.as_ptr().add(8 * s) as *const __m128i);
                    let mm = _mm_cvtepi32_ps(_mm_madd_epi16(mins, bs));
                    accm[i] = _mm_fmadd_ps(mm, _mm_set1_ps(-(dmin * dx)), accm[i]);
                }
            }
        }
    }
    // SAFETY: AVX2, FMA and F16C are this function's contract.
    std::array::from_fn(|i| unsafe { super::avx2::hsum(accf[i]) + hsum128(accm[i]) })
}

/// A K-quant super-block's scales, as the tiles read them.
#[derive(Clone, Copy)]
struct Scales {
    /// The super-block's scale.
    d: f32,
    /// Its scale of the minimums (Q4_K, Q5_K; 0 for Q6_K).
    dmin: f32,
    /// The unit scales as 16-bit integers: Q4_K / Q5_K's eight in both 128-bit halves, Q6_K's
    /// sixteen (one per 16 values) in order.
    sc: __m256i,
    /// Q4_K / Q5_K's eight minimums as 16-bit integers (zeros for Q6_K).
    mins: __m128i,
}

/// The scales of the super-block at `blk`.
///
/// # Safety
/// AVX2, F16C; a whole super-block of kind `K` at `blk`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_scales<const K: u8>(blk: *const u8) -> Scales {
    // SAFETY: the loads lie in the super-block (offsets from the format).
    unsafe {
        if K == Q6_K {
            let sc = _mm_loadu_si128(blk.add(192) as *const __m128i);
            Scales {
                d: super::avx2::half_at(blk.add(208)),
                dmin: 0.0,
                sc: _mm256_cvtepi8_epi16(sc),
                mins: _mm_setzero_si128(),
            }
        } else {
            let (sc, mn) = super::avx2::k4_scales(blk.add(4));
            let sc16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64));
            Scales {
                d: super::avx2::half_at(blk),
                dmin: super::avx2::half_at(blk.add(2)),
                sc: _mm256_set_m128i(sc16, sc16),
                mins: _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64)),
            }
        }
    }
}

/// Unit `k`'s scales in the 16-bit lanes that `maddubs` leaves its products in: Q4_K / Q5_K
/// scale `k` in every lane (from `scv`, the eight scales in both halves); Q6_K's two scales
/// of 16 values, `2k` in the low half and `2k + 1` in the high one (from `scv`, the sixteen
/// scales in order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unit_scales<const K: u8>(scv: __m256i, k: usize) -> __m256i {
    {
        if K == Q6_K {
            // Scales 2k and 2k + 1 lie in 128-bit half k / 4 at lanes 2(k % 4), 2(k % 4) + 1.
            let half = if k < 4 {
                _mm256_castsi256_si128(scv)
            } else {
                _mm256_extracti128_si256::<1>(scv)
            };
            let j = (2 * (k % 4)) as i8;
            let both = _mm256_set_m128i(half, half);
            let (a, b) = (2 * j, 2 * j + 2);
            let mask = _mm256_setr_epi8(
                a,
                a + 1,
                a,
                a + 1,
                a,
                a + 1,
                a,
                a + 1,
                a,
                a + 1,
                a,
                a + 1,
                a,
                a + 1,
                a,
                a + 1,
                b,
                b + 1,
                b,
                b + 1,
                b,
                b + 1,
                b,
                b + 1,
                b,
                b + 1,
                b,
                b + 1,
                b,
                b + 1,
                b,
                b + 1,
            );
            _mm256_shuffle_epi8(both, mask)
        } else {
            let a = (2 * k) as i8;
            _mm256_shuffle_epi8(
                scv,
                _mm256_set1_epi16(i16::from_le_bytes([a as u8, a as u8 + 1])),
            )
        }
    }
}

/// The sum of four lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum128(v: __m128) -> f32 {
    {
        let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }
}
