//! [`grouped`](super::grouped)'s products for the AVX2 tier (and AVX-512 without VNNI): the
//! same interleaved groups of 16 rows, read as two halves of 8 rows, one output per 32-bit
//! lane of a 256-bit vector.
//!
//! Design decision: without `vpdpbusd`, `maddubs` multiplies unsigned quants by signed
//! activation bytes and sums pairs to 16 bits; those sums are added in 16 bits over as many
//! quads as cannot overflow (8 for 4-bit quants, 4 for 5-bit, 2 for 6-bit: a pair is at most
//! `2 * 63 * 127`), then one `madd` against the unit's integer scale, duplicated into both
//! 16-bit halves of a row's lane, sums them to 32 bits. So a K-quant super-block stays in
//! integers up to one conversion (Q6_K's offset of 32 included), as llama.cpp's Q8_K kernels
//! do; Q4_K and Q5_K take their minimums from the activations' integer sums. Q8_0's quants
//! are flipped back to signed bytes and multiplied as `|w|` by `x` with `w`'s sign, since
//! offset bytes would saturate `maddubs`. Every sum is exact in integers, so a lane's result
//! depends on its row and activation row alone: batched equals solo bit for bit.

use super::grouped::{block, prefetch_ahead};
use super::interleave::{group_bytes, legacy_quants, GROUP, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES};
use super::interleave::{Q4K_LO, Q4K_MINS, Q5K_HI, Q6K_HI, Q6K_LO, SC};
use super::kind::GgmlKind;
use super::kind::{Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q8_0};
use super::q8::{Q8KRow, Q8Row};
use std::arch::x86_64::*;

/// Activation rows that meet a group's unpacked quants per pass (16 registers hold two
/// rows' accumulators of both halves).
const GA: usize = 2;

/// A pass's activation-row count (1 or 2) to the kernels' const parameter.
macro_rules! by_ga2 {
    ($ga:expr, $run:ident) => {
        match $ga {
            1 => $run!(1),
            _ => $run!(2),
        }
    };
}

super::grouped::entry_points!("avx2,fma,f16c", by_ga2);

/// Bytes from a row's entry to the same entry of the second half (rows 8-15) in a group's
/// region of `per_row` bytes per row.
const fn half(per_row: usize, h: usize) -> usize {
    8 * per_row * h
}

/// 32 bytes at `p`.
#[inline(always)]
unsafe fn ld(p: *const u8) -> __m256i {
    // SAFETY: the caller's `p` has 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// 16 bytes at `p`.
#[inline(always)]
unsafe fn ld16(p: *const u8) -> __m128i {
    // SAFETY: the caller's `p` has 16 readable bytes.
    unsafe { _mm_loadu_si128(p as *const __m128i) }
}

/// The 4 bytes at `p` (four activation bytes, or two 16-bit sums) in every 32-bit lane.
#[inline(always)]
unsafe fn bcast<T>(p: *const T) -> __m256i {
    // SAFETY: the caller's `p` has 4 readable bytes; AVX is the callers' contract.
    unsafe { _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

/// Eight f16 at `p` as f32.
#[inline(always)]
unsafe fn halves(p: *const u8) -> __m256 {
    // SAFETY: the caller's `p` has 16 readable bytes; F16C is the callers' contract.
    unsafe { _mm256_cvtph_ps(ld16(p)) }
}

/// Eight unsigned byte scales at `p`, each in both 16-bit halves of its row's lane: the
/// `madd` operand that scales a lane's two pair sums alike.
#[inline(always)]
unsafe fn scale_lanes(p: *const u8) -> __m256i {
    // SAFETY: the caller's `p` has 8 readable bytes; AVX2 is the callers' contract.
    unsafe {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
    }
}

/// Each byte's bit `bit` (0..8) at bit 4 (other bits are the caller's to mask).
#[inline(always)]
fn bit_to_4(h: __m256i, bit: usize) -> __m256i {
    // SAFETY: AVX2 is the callers' contract (`target_feature` functions inlined here).
    unsafe {
        match bit {
            0 => _mm256_slli_epi16::<4>(h),
            1 => _mm256_slli_epi16::<3>(h),
            2 => _mm256_slli_epi16::<2>(h),
            3 => _mm256_slli_epi16::<1>(h),
            4 => h,
            5 => _mm256_srli_epi16::<1>(h),
            6 => _mm256_srli_epi16::<2>(h),
            _ => _mm256_srli_epi16::<3>(h),
        }
    }
}

/// The 16 outputs of one Q4_K (or Q5_K) group (from `base`, `ns` super-blocks) for `GA`
/// activation rows. Per super-block, half and lane: the units' 16-bit pair sums times their
/// scales summed in 32 bits, times `d`; minus `dmin` times the minimums against the
/// activations' unit sums; times the activations' step, added to the total.
///
/// # Safety
/// As [`rows`]: the group and the activation rows are whole. `STREAM` prefetches the
/// weights ahead.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_q4k<const K: u8, const GA: usize, const STREAM: bool>(
    base: *const u8,
    ns: usize,
    xs: &[Q8KRow],
) -> [[f32; GROUP]; GA] {
    let nib = _mm256_set1_epi8(15);
    let fifth = _mm256_set1_epi8(16);
    // 4-bit quads: 8 pair sums fit 16 bits; 5-bit ones: 4.
    let run = if K == Q5_K { 4 } else { 8 };
    let mut tot = [[_mm256_setzero_ps(); GA]; 2];
    for s in 0..ns {
        // SAFETY: the offsets lie in super-block s of the group and of each activation row.
        unsafe {
            let bytes = if K == Q5_K { Q5K_BYTES } else { Q4K_BYTES };
            // Streaming, the super-block's lines are asked for one by one as the first half
            // reads them: a burst of 37 at its start stalled the loads (AMD Zen 3).
            let b = block::<false>(base, s, bytes);
            if STREAM {
                prefetch_ahead(b, Q4K_LO);
            }
            for (h, th) in tot.iter_mut().enumerate() {
                let mut isum = [_mm256_setzero_si256(); GA];
                for t in 0..4 {
                    let sa = scale_lanes(b.add(SC + 16 * (2 * t) + half(1, h)));
                    let sb = scale_lanes(b.add(SC + 16 * (2 * t + 1) + half(1, h)));
                    let mut ia = [_mm256_setzero_si256(); GA];
                    let mut ib = [_mm256_setzero_si256(); GA];
                    let mut plane = _mm256_setzero_si256();
                    for q in 0..8 {
                        let at = Q4K_LO + 64 * (8 * t + q);
                        if STREAM && h == 0 {
                            prefetch_ahead(b.add(at), 64);
                        }
                        let l = ld(b.add(at + half(4, h)));
                        let mut lo = _mm256_and_si256(l, nib);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(l), nib);
                        if K == Q5_K {
                            if q % 4 == 0 {
                                let at = Q5K_HI + 64 * (2 * t + q / 4);
                                if STREAM && h == 0 {
                                    prefetch_ahead(b.add(at), 64);
                                }
                                plane = ld(b.add(at + half(4, h)));
                            }
                            let bit = 2 * (q % 4);
                            lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(plane, bit), fifth));
                            hi = _mm256_or_si256(
                                hi,
                                _mm256_and_si256(bit_to_4(plane, bit + 1), fifth),
                            );
                        }
                        for i in 0..GA {
                            let x = xs[i].q.as_ptr().add(256 * s + 64 * t + 4 * q);
                            ia[i] = _mm256_add_epi16(ia[i], _mm256_maddubs_epi16(lo, bcast(x)));
                            ib[i] =
                                _mm256_add_epi16(ib[i], _mm256_maddubs_epi16(hi, bcast(x.add(32))));
                        }
                        if (q + 1) % run == 0 {
                            for i in 0..GA {
                                let u = _mm256_add_epi32(
                                    _mm256_madd_epi16(ia[i], sa),
                                    _mm256_madd_epi16(ib[i], sb),
                                );
                                isum[i] = _mm256_add_epi32(isum[i], u);
                                ia[i] = _mm256_setzero_si256();
                                ib[i] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                let d = halves(b.add(half(2, h)));
                let dmin = halves(b.add(32 + half(2, h)));
                for i in 0..GA {
                    let mut mins = _mm256_setzero_si256();
                    for t in 0..4 {
                        let mn = _mm256_cvtepu8_epi16(ld16(b.add(Q4K_MINS + 32 * t + half(2, h))));
                        let bs = bcast(xs[i].bs32.as_ptr().add(8 * s + 2 * t));
                        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mn, bs));
                    }
                    let f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum[i]), d);
                    let f = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dmin, f);
                    th[i] = _mm256_fmadd_ps(f, _mm256_set1_ps(xs[i].d[s]), th[i]);
                }
            }
        }
    }
    store(tot)
}

/// The 16 outputs of one Q6_K group for `GA` activation rows: per super-block, half and
/// lane, each sixteenth's pair sums times its signed scale summed in 32 bits, less 32 times
/// the scales against the activations' sums per 16, times `d` and the activations' step.
///
/// # Safety
/// As [`group_q4k`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_q6k<const GA: usize, const STREAM: bool>(
    base: *const u8,
    ns: usize,
    xs: &[Q8KRow],
) -> [[f32; GROUP]; GA] {
    let nib = _mm256_set1_epi8(15);
    let top = _mm256_set1_epi8(0x30);
    let mut tot = [[_mm256_setzero_ps(); GA]; 2];
    for s in 0..ns {
        // SAFETY: as in `group_q4k`.
        unsafe {
            // Lines asked for one by one, as in `group_q4k`.
            let b = block::<false>(base, s, Q6K_BYTES);
            if STREAM {
                prefetch_ahead(b, Q6K_LO);
            }
            for (h, th) in tot.iter_mut().enumerate() {
                let mut isum = [_mm256_setzero_si256(); GA];
                let mut off = [_mm256_setzero_si256(); GA];
                for t in 0..4 {
                    // Scale pairs 2t (sixteenths 4t, 4t + 1: unit 2t) and 2t + 1 (unit
                    // 2t + 1), as [row][2] 16-bit lanes.
                    let pa = _mm256_cvtepi8_epi16(ld16(b.add(SC + 64 * t + half(2, h))));
                    let pb = _mm256_cvtepi8_epi16(ld16(b.add(SC + 64 * t + 32 + half(2, h))));
                    for i in 0..GA {
                        let bs = xs[i].bs16.as_ptr().add(16 * s + 4 * t);
                        off[i] = _mm256_add_epi32(off[i], _mm256_madd_epi16(pa, bcast(bs)));
                        off[i] = _mm256_add_epi32(off[i], _mm256_madd_epi16(pb, bcast(bs.add(2))));
                    }
                    for e in 0..2 {
                        // The pair's low (e = 0) or high scale in both halves of each lane.
                        let (sa, sb) = if e == 0 {
                            (dup_even(pa), dup_even(pb))
                        } else {
                            (dup_odd(pa), dup_odd(pb))
                        };
                        for p in 2 * e..2 * e + 2 {
                            let at = Q6K_HI + 64 * (4 * t + p);
                            if STREAM && h == 0 {
                                prefetch_ahead(b.add(at), 64);
                            }
                            let hb = ld(b.add(at + half(4, h)));
                            let mut ia = [_mm256_setzero_si256(); GA];
                            let mut ib = [_mm256_setzero_si256(); GA];
                            for (k, hs) in [(0, _mm256_slli_epi16::<4>(hb)), (1, hb)] {
                                let q = 2 * p + k;
                                let at = Q6K_LO + 64 * (8 * t + q);
                                if STREAM && h == 0 {
                                    prefetch_ahead(b.add(at), 64);
                                }
                                let l = ld(b.add(at + half(4, h)));
                                let lo = _mm256_or_si256(
                                    _mm256_and_si256(l, nib),
                                    _mm256_and_si256(hs, top),
                                );
                                let hi = _mm256_or_si256(
                                    _mm256_and_si256(_mm256_srli_epi16::<4>(l), nib),
                                    _mm256_and_si256(_mm256_srli_epi16::<2>(hs), top),
                                );
                                for i in 0..GA {
                                    let x = xs[i].q.as_ptr().add(256 * s + 64 * t + 4 * q);
                                    let pl = _mm256_maddubs_epi16(lo, bcast(x));
                                    let ph = _mm256_maddubs_epi16(hi, bcast(x.add(32)));
                                    ia[i] = _mm256_add_epi16(ia[i], pl);
                                    ib[i] = _mm256_add_epi16(ib[i], ph);
                                }
                            }
                            // Two 6-bit quads' pair sums fill 16 bits: to 32 bits, scaled.
                            for i in 0..GA {
                                let u = _mm256_add_epi32(
                                    _mm256_madd_epi16(ia[i], sa),
                                    _mm256_madd_epi16(ib[i], sb),
                                );
                                isum[i] = _mm256_add_epi32(isum[i], u);
                            }
                        }
                    }
                }
                let d = halves(b.add(half(2, h)));
                for i in 0..GA {
                    let v = _mm256_sub_epi32(isum[i], _mm256_slli_epi32::<5>(off[i]));
                    let f = _mm256_mul_ps(_mm256_cvtepi32_ps(v), d);
                    th[i] = _mm256_fmadd_ps(f, _mm256_set1_ps(xs[i].d[s]), th[i]);
                }
            }
        }
    }
    store(tot)
}

/// The even 16-bit lanes of each 32-bit lane in both its halves.
#[inline(always)]
fn dup_even(v: __m256i) -> __m256i {
    // SAFETY: AVX2 is the callers' contract (`target_feature` functions inlined here).
    unsafe { _mm256_shufflehi_epi16::<0xA0>(_mm256_shufflelo_epi16::<0xA0>(v)) }
}

/// The odd 16-bit lanes of each 32-bit lane in both its halves.
#[inline(always)]
fn dup_odd(v: __m256i) -> __m256i {
    // SAFETY: as `dup_even`.
    unsafe { _mm256_shufflehi_epi16::<0xF5>(_mm256_shufflelo_epi16::<0xF5>(v)) }
}

/// The 16 outputs of one group of a kind in blocks of 32 (`K`, from `base`, `nb` blocks)
/// for `GA` activation rows. Per block, half and lane: the integer dot product of the quants
/// with the activations, less the kind's offset (8, 16) times the activations' integer sum,
/// times `d * dx` added to the total; Q4_1 adds `m` times the activations' `dx * sum`.
///
/// # Safety
/// As [`group_q4k`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group32<const K: u8, const GA: usize, const STREAM: bool>(
    base: *const u8,
    nb: usize,
    xs: &[Q8Row],
) -> [[f32; GROUP]; GA] {
    let nib = _mm256_set1_epi8(15);
    let fifth = _mm256_set1_epi8(16);
    let flip = _mm256_set1_epi8(-128);
    let ones = _mm256_set1_epi16(1);
    let kind = match K {
        Q4_0 => GgmlKind::Q4_0,
        Q4_1 => GgmlKind::Q4_1,
        Q5_0 => GgmlKind::Q5_0,
        _ => GgmlKind::Q8_0,
    };
    let (bytes, at) = (group_bytes(kind), legacy_quants(kind));
    // Q8_0 is multiplied as signed bytes: no offset.
    let offset: i32 = match K {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let mut tot = [[_mm256_setzero_ps(); GA]; 2];
    for b in 0..nb {
        // SAFETY: the offsets lie in block b of the group and of each activation row.
        unsafe {
            let g = block::<STREAM>(base, b, bytes);
            for (h, th) in tot.iter_mut().enumerate() {
                let mut acc = [_mm256_setzero_si256(); GA];
                if K == Q8_0 {
                    for q in 0..8 {
                        let w = _mm256_xor_si256(ld(g.add(at + 64 * q + half(4, h))), flip);
                        let wa = _mm256_abs_epi8(w);
                        for i in 0..GA {
                            let x = bcast(xs[i].q.as_ptr().add(32 * b + 4 * q));
                            let p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(x, w));
                            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
                        }
                    }
                } else {
                    let mut w = [_mm256_setzero_si256(); 8];
                    for j in 0..4 {
                        let l = ld(g.add(at + 64 * j + half(4, h)));
                        w[j] = _mm256_and_si256(l, nib);
                        w[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(l), nib);
                    }
                    if K == Q5_0 {
                        // Bit q of each top-bit byte is quad q's fifth bit: to bit 4.
                        let hb = ld(g.add(32 + half(4, h)));
                        for (j, wj) in w.iter_mut().enumerate() {
                            *wj = _mm256_or_si256(*wj, _mm256_and_si256(bit_to_4(hb, j), fifth));
                        }
                    }
                    // 4-bit quads: 8 pair sums fit 16 bits; Q5_0's 5-bit ones: 4.
                    let run = if K == Q5_0 { 4 } else { 8 };
                    for i in 0..GA {
                        let mut p16 = _mm256_setzero_si256();
                        for (q, &wq) in w.iter().enumerate() {
                            let x = bcast(xs[i].q.as_ptr().add(32 * b + 4 * q));
                            p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wq, x));
                            if (q + 1) % run == 0 {
                                acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p16, ones));
                                p16 = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                let d = halves(g.add(half(2, h)));
                // Q4_1's minimums, one per row.
                let m = if K == Q4_1 {
                    halves(g.add(32 + half(2, h)))
                } else {
                    _mm256_setzero_ps()
                };
                for i in 0..GA {
                    let mut v = acc[i];
                    if offset != 0 {
                        let o = offset * i32::from(xs[i].bs[b]);
                        v = _mm256_sub_epi32(v, _mm256_set1_epi32(o));
                    }
                    let ddx = _mm256_mul_ps(d, _mm256_set1_ps(xs[i].d[b]));
                    th[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), ddx, th[i]);
                    if K == Q4_1 {
                        th[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i].dsum(b)), th[i]);
                    }
                }
            }
        }
    }
    store(tot)
}

/// The lanes of each half's totals, rows 0-7 then 8-15.
#[inline(always)]
fn store<const GA: usize>(tot: [[__m256; GA]; 2]) -> [[f32; GROUP]; GA] {
    let mut out = [[0f32; GROUP]; GA];
    for (i, o) in out.iter_mut().enumerate() {
        for (h, t) in tot.iter().enumerate() {
            // SAFETY: `o[8h..]` holds 8 writable floats; AVX is the callers' contract (they
            // are `target_feature` functions inlined here).
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), t[i]) };
        }
    }
    out
}
