//! Products of matrices interleaved in groups of 16 rows (`interleave.rs`) with 8-bit
//! activations ([`Q8Row`], [`Q8KRow`]) for any row count: the AVX-512 VNNI tier's
//! (`grouped_avx2.rs` holds the AVX2 tier's), and the loop both tiers share.
//!
//! Design decision: in GGML's layout a row's block is a stream of its own, so a kernel
//! that reads it keeps one output's partial sums across a vector's lanes and pays a
//! horizontal step per block and activation row; at prefill those float steps took as long
//! as the integer products (`perf`, Qwen2.5-Coder-1.5B, BENCHMARKS.md). Here each 64-byte
//! vector holds 4 consecutive quants of 16 rows, so one `vpdpbusd` with 4 activation bytes
//! broadcast adds 64 products into 16 outputs, one per lane, and every float step after it
//! serves 16 outputs. The same kernel serves decode (one activation row) and prefill
//! (passes of [`GA`]), and each output lane takes the same instructions in the same order
//! whatever the batch: a row computes the same bits alone or batched. Quants are unsigned
//! bytes (Q8_0's offset by 128); each kind's offset or minimum comes from the activations'
//! integer sums.

use super::interleave::{group_bytes, legacy_quants, GROUP, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES};
use super::interleave::{Q4K_LO, Q4K_MINS, Q5K_HI, Q6K_HI, Q6K_LO, SC};
use super::kind::GgmlKind;
use super::kind::{Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q8_0};
use super::q8::{Q8KRow, Q8Row};
use super::tile::PREFETCH;

/// Activation rows that meet a group's unpacked quants per pass.
const GA: usize = 4;

/// A grouped tier's two entry points over the invoking module's kernels (`group_q4k`,
/// `group_q6k`, `group32`), compiled with the target features `$features`; `$by_ga` maps a
/// pass's activation-row count (1..=`GA`) to the kernels' const parameter.
macro_rules! entry_points {
    ($features:literal, $by_ga:ident) => {
        /// `out[j * m + i] = row (16 g0 + j) . acts[i]` for `j < n` (`out: [n, m]`) from the
        /// interleaved K-quant matrix `data` of `kind` with `ns` super-blocks per row.
        ///
        /// # Safety
        #[doc = concat!("The CPU has ", $features, ". Lengths are asserted.")]
        #[target_feature(enable = $features)]
        pub(super) unsafe fn rows(
            kind: GgmlKind,
            data: &[u8],
            ns: usize,
            g0: usize,
            acts: &[Q8KRow],
            out: &mut [f32],
        ) {
            super::grouped::check_supers(acts, ns);
            super::grouped::drive::<_, GA>(
                kind,
                data,
                ns,
                g0,
                acts,
                out,
                |base, xs, ga, stream, sums| {
                    macro_rules! run {
                        ($ga:literal) => {{
                            // SAFETY: `drive` passes a whole group of `ns` super-blocks and
                            // activation rows of as many (asserted above); the features are
                            // the caller's contract.
                            let s: [[f32; GROUP]; $ga] = unsafe {
                                match (kind, stream) {
                                    (GgmlKind::Q4K, false) => {
                                        group_q4k::<Q4_K, $ga, false>(base, ns, xs)
                                    }
                                    (GgmlKind::Q4K, true) => {
                                        group_q4k::<Q4_K, $ga, true>(base, ns, xs)
                                    }
                                    (GgmlKind::Q5K, false) => {
                                        group_q4k::<Q5_K, $ga, false>(base, ns, xs)
                                    }
                                    (GgmlKind::Q5K, true) => {
                                        group_q4k::<Q5_K, $ga, true>(base, ns, xs)
                                    }
                                    (GgmlKind::Q6K, false) => group_q6k::<$ga, false>(base, ns, xs),
                                    (GgmlKind::Q6K, true) => group_q6k::<$ga, true>(base, ns, xs),
                                    _ => unreachable!("{kind:?} is not an interleaved K-quant"),
                                }
                            };
                            sums[..$ga].copy_from_slice(&s);
                        }};
                    }
                    $by_ga!(ga, run)
                },
            );
        }

        /// [`rows`] for the kinds in blocks of 32, `nb` blocks per row.
        ///
        /// # Safety
        /// As [`rows`].
        #[target_feature(enable = $features)]
        pub(super) unsafe fn rows32(
            kind: GgmlKind,
            data: &[u8],
            nb: usize,
            g0: usize,
            acts: &[Q8Row],
            out: &mut [f32],
        ) {
            super::grouped::check_blocks32(acts, nb);
            super::grouped::drive::<_, GA>(
                kind,
                data,
                nb,
                g0,
                acts,
                out,
                |base, xs, ga, stream, sums| {
                    macro_rules! run {
                        ($ga:literal) => {{
                            macro_rules! of {
                                ($k:expr) => {
                                    if stream {
                                        group32::<$k, $ga, true>(base, nb, xs)
                                    } else {
                                        group32::<$k, $ga, false>(base, nb, xs)
                                    }
                                };
                            }
                            // SAFETY: as in `rows`.
                            let s: [[f32; GROUP]; $ga] = unsafe {
                                match kind {
                                    GgmlKind::Q4_0 => of!(Q4_0),
                                    GgmlKind::Q4_1 => of!(Q4_1),
                                    GgmlKind::Q5_0 => of!(Q5_0),
                                    GgmlKind::Q8_0 => of!(Q8_0),
                                    _ => unreachable!("{kind:?} is not in blocks of 32"),
                                }
                            };
                            sums[..$ga].copy_from_slice(&s);
                        }};
                    }
                    $by_ga!(ga, run)
                },
            );
        }
    };
}
pub(super) use entry_points;

entry_points!("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c", by_ga);

/// Asserts that each activation row has `ns` super-blocks with their sums.
pub(super) fn check_supers(acts: &[Q8KRow], ns: usize) {
    for act in acts {
        assert!(act.q.len() == 256 * ns && act.d.len() == ns);
        assert!(act.bs16.len() == 16 * ns && act.bs32.len() == 8 * ns);
    }
}

/// Asserts that each activation row has `nb` blocks of 32 with their sums.
pub(super) fn check_blocks32(acts: &[Q8Row], nb: usize) {
    for act in acts {
        assert!(act.q.len() == 32 * nb && act.d.len() == nb);
        assert!(act.bs.len() == nb);
    }
}

/// The loop the grouped products of every tier share: for each group of `n = out.len() / m`
/// rows from group `g0` of `data` (`nb` blocks per row), each pass of up to `P` activation
/// rows; `group(base, xs, ga, stream, sums)` leaves the group's outputs for `xs` in `sums`.
pub(super) fn drive<T, const P: usize>(
    kind: GgmlKind,
    data: &[u8],
    nb: usize,
    g0: usize,
    acts: &[T],
    out: &mut [f32],
    group: impl Fn(*const u8, &[T], usize, bool, &mut [[f32; GROUP]; P]),
) {
    let m = acts.len();
    assert!(m > 0 && out.len().is_multiple_of(m));
    let n = out.len() / m;
    let gb = group_bytes(kind) * nb;
    assert!(data.len() >= (g0 + n.div_ceil(GROUP)) * gb);
    // One pass over the weights (few activation rows) streams them from memory: ask for
    // them ahead. More passes read each group from cache.
    let stream = m <= P;
    for gi in 0..n.div_ceil(GROUP) {
        let base = data[(g0 + gi) * gb..].as_ptr();
        let live = GROUP.min(n - gi * GROUP);
        let mut i0 = 0;
        while i0 < m {
            let ga = P.min(m - i0);
            let mut sums = [[0f32; GROUP]; P];
            group(base, &acts[i0..i0 + ga], ga, stream, &mut sums);
            for r in 0..live {
                for (i, s) in sums[..ga].iter().enumerate() {
                    out[(gi * GROUP + r) * m + i0 + i] = s[r];
                }
            }
            i0 += ga;
        }
    }
}

use std::arch::x86_64::*;

/// The 4 bytes at `p` (four activation bytes, or two 16-bit sums) in every 32-bit lane.
#[inline(always)]
pub(super) unsafe fn bcast<T>(p: *const T) -> __m512i {
    // SAFETY: the caller's `p` has 4 readable bytes.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

/// Block `s` of `bytes` bytes from `base`, its weights asked for ahead when `STREAM`.
#[inline(always)]
pub(super) unsafe fn block<const STREAM: bool>(
    base: *const u8,
    s: usize,
    bytes: usize,
) -> *const u8 {
    // SAFETY: the caller's block s lies in the group.
    let b = unsafe { base.add(s * bytes) };
    if STREAM {
        prefetch_ahead(b, bytes);
    }
    b
}

/// Sixteen f16 at `p` as f32.
#[inline(always)]
pub(super) unsafe fn halves(p: *const u8) -> __m512 {
    // SAFETY: the caller's `p` has 32 readable bytes.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
}

/// The 16 outputs of one Q4_K group (from `base`, `ns` super-blocks) for `GA` activation
/// rows. Per super-block and lane: the units' integer dot products, each times its scale
/// `d * sc` in f32, in unit order; minus `dmin` times the integer sum of the minimums against
/// the activations' unit sums; then times the activations' step, added to the total.
///
/// # Safety
/// As [`rows`]: the group and the activation rows are whole. `STREAM` prefetches the
/// weights ahead.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_q4k<const K: u8, const GA: usize, const STREAM: bool>(
    base: *const u8,
    ns: usize,
    xs: &[Q8KRow],
) -> [[f32; GROUP]; GA] {
    let mut tot = [_mm512_setzero_ps(); GA];
    for s in 0..ns {
        // SAFETY: the offsets lie in super-block s of the group and of each activation row.
        unsafe {
            let bytes = if K == Q5_K { Q5K_BYTES } else { Q4K_BYTES };
            let b = block::<STREAM>(base, s, bytes);
            let d = halves(b);
            let dmin = halves(b.add(32));
            let mut sbf = [_mm512_setzero_ps(); GA];
            let mut mins = [_mm512_setzero_si512(); GA];
            for t in 0..4 {
                let mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    b.add(Q4K_MINS + 32 * t) as *const __m256i
                ));
                for i in 0..GA {
                    let bs = bcast(xs[i].bs32.as_ptr().add(8 * s + 2 * t));
                    mins[i] = _mm512_dpwssd_epi32(mins[i], mn, bs);
                }
            }
            for t in 0..4 {
                let mut ia = [[_mm512_setzero_si512(); GA]; 2];
                let mut ib = [[_mm512_setzero_si512(); GA]; 2];
                let mut plane = _mm512_setzero_si512();
                for q in 0..8 {
                    let (lo, hi) = q4k_quad::<K>(b, t, q, &mut plane);
                    let c = q % chains::<GA>();
                    for i in 0..GA {
                        let x = xs[i].q.as_ptr().add(256 * s + 64 * t + 4 * q);
                        ia[c][i] = _mm512_dpbusd_epi32(ia[c][i], lo, bcast(x));
                        ib[c][i] = _mm512_dpbusd_epi32(ib[c][i], hi, bcast(x.add(32)));
                    }
                }
                let (ia, ib) = (join(ia), join(ib));
                let unit = |u: usize| {
                    let sc = _mm_loadu_si128(b.add(SC + 16 * u) as *const __m128i);
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)), d)
                };
                let (sa, sb) = (unit(2 * t), unit(2 * t + 1));
                for i in 0..GA {
                    sbf[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]), sa, sbf[i]);
                    sbf[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib[i]), sb, sbf[i]);
                }
            }
            for i in 0..GA {
                let f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins[i]), dmin, sbf[i]);
                tot[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(xs[i].d[s]), tot[i]);
            }
        }
    }
    store(tot)
}

/// The 16 outputs of one Q6_K group for `GA` activation rows: per super-block and lane,
/// the integer dot product of each sixteenth times `d * sc` in f32, minus `32 d` times the
/// integer sum of the scales against the activations' sums per 16; then times the step.
///
/// # Safety
/// As [`group_q4k`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group_q6k<const GA: usize, const STREAM: bool>(
    base: *const u8,
    ns: usize,
    xs: &[Q8KRow],
) -> [[f32; GROUP]; GA] {
    let mut tot = [_mm512_setzero_ps(); GA];
    for s in 0..ns {
        // SAFETY: as in `group_q4k`.
        unsafe {
            let b = block::<STREAM>(base, s, Q6K_BYTES);
            let d = halves(b);
            let mut sbf = [_mm512_setzero_ps(); GA];
            let mut off = [_mm512_setzero_si512(); GA];
            for t in 0..4 {
                // Scale pairs 2t (sixteenths 4t, 4t + 1: unit 2t) and 2t + 1 (unit 2t + 1).
                let pa =
                    _mm512_cvtepi8_epi16(_mm256_loadu_si256(b.add(SC + 64 * t) as *const __m256i));
                let pb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                    b.add(SC + 64 * t + 32) as *const __m256i
                ));
                for i in 0..GA {
                    let bs = xs[i].bs16.as_ptr().add(16 * s + 4 * t);
                    off[i] = _mm512_dpwssd_epi32(off[i], pa, bcast(bs));
                    off[i] = _mm512_dpwssd_epi32(off[i], pb, bcast(bs.add(2)));
                }
                for e in 0..2 {
                    let mut ia = [[_mm512_setzero_si512(); GA]; 2];
                    let mut ib = [[_mm512_setzero_si512(); GA]; 2];
                    for p in 2 * e..2 * e + 2 {
                        for (k, (lo, hi)) in q6k_quads(b, t, p).into_iter().enumerate() {
                            let q = 2 * p + k;
                            let c = q % chains::<GA>();
                            for i in 0..GA {
                                let x = xs[i].q.as_ptr().add(256 * s + 64 * t + 4 * q);
                                ia[c][i] = _mm512_dpbusd_epi32(ia[c][i], lo, bcast(x));
                                ib[c][i] = _mm512_dpbusd_epi32(ib[c][i], hi, bcast(x.add(32)));
                            }
                        }
                    }
                    let (ia, ib) = (join(ia), join(ib));
                    let (sa, sb) = (q6k_scale(pa, e, d), q6k_scale(pb, e, d));
                    for i in 0..GA {
                        sbf[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[i]), sa, sbf[i]);
                        sbf[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib[i]), sb, sbf[i]);
                    }
                }
            }
            let d32 = _mm512_mul_ps(d, _mm512_set1_ps(32.0));
            for i in 0..GA {
                let f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off[i]), d32, sbf[i]);
                tot[i] = _mm512_fmadd_ps(f, _mm512_set1_ps(xs[i].d[s]), tot[i]);
            }
        }
    }
    store(tot)
}

/// Each byte's bit `bit` (0..8) at bit 4 (other bits are the caller's to mask).
#[inline(always)]
fn bit_to_4(h: __m512i, bit: usize) -> __m512i {
    // SAFETY: AVX-512BW is the callers' contract (`target_feature` functions inlined here).
    unsafe {
        match bit {
            0 => _mm512_slli_epi16::<4>(h),
            1 => _mm512_slli_epi16::<3>(h),
            2 => _mm512_slli_epi16::<2>(h),
            3 => _mm512_slli_epi16::<1>(h),
            4 => h,
            5 => _mm512_srli_epi16::<1>(h),
            6 => _mm512_srli_epi16::<2>(h),
            _ => _mm512_srli_epi16::<3>(h),
        }
    }
}

/// Asks for the `len` bytes [`PREFETCH`] past `b` (hardware prefetchers stop at pages).
#[inline(always)]
pub(super) fn prefetch_ahead(b: *const u8, len: usize) {
    for off in (0..len).step_by(64) {
        // SAFETY: a prefetch never faults, whatever the address; `wrapping_add` makes none
        // of the arithmetic undefined past the matrix's end.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(PREFETCH + off).cast::<i8>()) };
    }
}

/// Integer accumulators per activation row and unit: two chains where few activation rows
/// leave `vpdpbusd`'s latency exposed, one where more rows fill the pipeline (and the
/// registers). Integer sums are exact, so the split changes no bit.
#[inline(always)]
const fn chains<const GA: usize>() -> usize {
    if GA <= 2 {
        2
    } else {
        1
    }
}

/// Each activation row's two chains summed.
#[inline(always)]
fn join<const GA: usize>(acc: [[__m512i; GA]; 2]) -> [__m512i; GA] {
    // SAFETY: AVX-512F is the callers' contract (`target_feature` functions inlined here).
    std::array::from_fn(|i| unsafe { _mm512_add_epi32(acc[0][i], acc[1][i]) })
}

/// The 16 outputs of one group of a kind in blocks of 32 (`K`, from `base`, `nb` blocks)
/// for `GA` activation rows. Per block and lane: the integer dot product of the unsigned
/// quants with the activations, less the kind's offset (8, 16, or Q8_0's 128) times the
/// activations' integer sum, times `d * dx` added to the total; Q4_1 adds `m` times the
/// activations' `dx * sum` instead of an offset.
///
/// # Safety
/// As [`group_q4k`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn group32<const K: u8, const GA: usize, const STREAM: bool>(
    base: *const u8,
    nb: usize,
    xs: &[Q8Row],
) -> [[f32; GROUP]; GA] {
    let bytes = group_bytes(kind32::<K>());
    let offset: i32 = match K {
        Q4_0 => 8,
        Q5_0 => 16,
        Q8_0 => 128,
        _ => 0,
    };
    let mut tot = [_mm512_setzero_ps(); GA];
    for b in 0..nb {
        // SAFETY: the offsets lie in block b of the group and of each activation row.
        unsafe {
            let g = block::<STREAM>(base, b, bytes);
            let d = halves(g);
            let w = quads32::<K>(g);
            let mut acc = [[_mm512_setzero_si512(); GA]; 2];
            for (q, &wq) in w.iter().enumerate() {
                let c = q % chains::<GA>();
                for i in 0..GA {
                    let x = bcast(xs[i].q.as_ptr().add(32 * b + 4 * q));
                    acc[c][i] = _mm512_dpbusd_epi32(acc[c][i], wq, x);
                }
            }
            let acc = join(acc);
            for i in 0..GA {
                let mut v = acc[i];
                if offset != 0 {
                    let o = offset * i32::from(xs[i].bs[b]);
                    v = _mm512_sub_epi32(v, _mm512_set1_epi32(o));
                }
                let ddx = _mm512_mul_ps(d, _mm512_set1_ps(xs[i].d[b]));
                tot[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), ddx, tot[i]);
                if K == Q4_1 {
                    let m = halves(g.add(32));
                    tot[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i].dsum(b)), tot[i]);
                }
            }
        }
    }
    store(tot)
}

/// The kind in blocks of 32 that the const `K` names.
#[inline(always)]
pub(super) const fn kind32<const K: u8>() -> GgmlKind {
    match K {
        Q4_0 => GgmlKind::Q4_0,
        Q4_1 => GgmlKind::Q4_1,
        Q5_0 => GgmlKind::Q5_0,
        _ => GgmlKind::Q8_0,
    }
}

/// The unsigned quants of quad `q` of units `2t` (first) and `2t + 1` of the Q4_K or Q5_K
/// (`K`) group super-block at `b`, one row per 32-bit lane; `plane` holds Q5_K's fifth bits,
/// loaded at every fourth quad.
///
/// # Safety
/// `b` is a whole group super-block of the kind; AVX-512BW is the caller's contract.
#[inline(always)]
pub(super) unsafe fn q4k_quad<const K: u8>(
    b: *const u8,
    t: usize,
    q: usize,
    plane: &mut __m512i,
) -> (__m512i, __m512i) {
    // SAFETY: the offsets lie in the group super-block (the caller's contract).
    unsafe {
        let nib = _mm512_set1_epi8(15);
        let l = _mm512_loadu_si512(b.add(Q4K_LO + 64 * (8 * t + q)) as *const _);
        let mut lo = _mm512_and_si512(l, nib);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(l), nib);
        if K == Q5_K {
            if q.is_multiple_of(4) {
                let at = Q5K_HI + 64 * (2 * t + q / 4);
                *plane = _mm512_loadu_si512(b.add(at) as *const _);
            }
            let fifth = _mm512_set1_epi8(16);
            let bit = 2 * (q % 4);
            lo = _mm512_or_si512(lo, _mm512_and_si512(bit_to_4(*plane, bit), fifth));
            hi = _mm512_or_si512(hi, _mm512_and_si512(bit_to_4(*plane, bit + 1), fifth));
        }
        (lo, hi)
    }
}

/// The unsigned quants (0..64) of quads `2p` and `2p + 1` of units `2t` and `2t + 1` (each
/// pair: unit `2t`'s, then `2t + 1`'s) of the Q6_K group super-block at `b`.
///
/// # Safety
/// As [`q4k_quad`].
#[inline(always)]
pub(super) unsafe fn q6k_quads(b: *const u8, t: usize, p: usize) -> [(__m512i, __m512i); 2] {
    // SAFETY: as in `q4k_quad`.
    unsafe {
        let h = _mm512_loadu_si512(b.add(Q6K_HI + 64 * (4 * t + p)) as *const _);
        let l0 = _mm512_loadu_si512(b.add(Q6K_LO + 64 * (8 * t + 2 * p)) as *const _);
        let l1 = _mm512_loadu_si512(b.add(Q6K_LO + 64 * (8 * t + 2 * p + 1)) as *const _);
        [q6k_split(l0, _mm512_slli_epi16::<4>(h)), q6k_split(l1, h)]
    }
}

/// The low (`e` = 0) or high (`e` = 1) scale of each lane's pair in `p` (16-bit scales
/// widened from a scale-pair vector), times `d`.
#[inline(always)]
pub(super) fn q6k_scale(p: __m512i, e: usize, d: __m512) -> __m512 {
    // SAFETY: AVX-512F is the callers' contract (`target_feature` functions inlined here).
    unsafe {
        let v = if e == 0 {
            _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(p))
        } else {
            _mm512_srai_epi32::<16>(p)
        };
        _mm512_mul_ps(_mm512_cvtepi32_ps(v), d)
    }
}

/// A Q6_K quad's two units from its nibbles `l` and its top bits `hs` (unit `2t`'s at bits
/// 4-5 of each byte, unit `2t + 1`'s two above).
#[inline(always)]
fn q6k_split(l: __m512i, hs: __m512i) -> (__m512i, __m512i) {
    // SAFETY: AVX-512BW is the callers' contract (`target_feature` functions inlined here).
    unsafe {
        let (nib, top) = (_mm512_set1_epi8(15), _mm512_set1_epi8(0x30));
        let lo = _mm512_or_si512(_mm512_and_si512(l, nib), _mm512_and_si512(hs, top));
        let hi = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(l), nib),
            _mm512_and_si512(_mm512_srli_epi16::<2>(hs), top),
        );
        (lo, hi)
    }
}

/// The unsigned quants of the 8 quads of the group block at `g` of the kind in blocks of 32
/// that `K` names (Q8_0's offset by 128).
///
/// # Safety
/// As [`q4k_quad`], for a group block of the kind.
#[inline(always)]
pub(super) unsafe fn quads32<const K: u8>(g: *const u8) -> [__m512i; 8] {
    let at = legacy_quants(kind32::<K>());
    // SAFETY: as in `q4k_quad`.
    unsafe {
        let mut w = [_mm512_setzero_si512(); 8];
        if K == Q8_0 {
            for (j, wj) in w.iter_mut().enumerate() {
                *wj = _mm512_loadu_si512(g.add(at + 64 * j) as *const _);
            }
        } else {
            let nib = _mm512_set1_epi8(15);
            for j in 0..4 {
                let l = _mm512_loadu_si512(g.add(at + 64 * j) as *const _);
                w[j] = _mm512_and_si512(l, nib);
                w[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(l), nib);
            }
            if K == Q5_0 {
                // Bit q of each top-bit byte is quad q's fifth bit: to bit 4.
                let fifth = _mm512_set1_epi8(16);
                let h = _mm512_loadu_si512(g.add(32) as *const _);
                for (j, wj) in w.iter_mut().enumerate() {
                    *wj = _mm512_or_si512(*wj, _mm512_and_si512(bit_to_4(h, j), fifth));
                }
            }
        }
        w
    }
}

/// The lanes of each total.
#[inline(always)]
pub(super) fn store<const GA: usize>(tot: [__m512; GA]) -> [[f32; GROUP]; GA] {
    let mut out = [[0f32; GROUP]; GA];
    for (o, t) in out.iter_mut().zip(tot) {
        // SAFETY: `o` holds 16 writable floats; AVX-512F is the callers' contract (they are
        // `target_feature` functions inlined here).
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), t) };
    }
    out
}
