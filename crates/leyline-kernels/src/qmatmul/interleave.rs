//! K-quant matrices interleaved in groups of 16 rows for the AVX-512 VNNI tier, and their
//! products with activations quantized per super-block ([`Q8KRow`]) for any row count.
//!
//! Design decision: in GGML's layout a row's super-block is a stream of its own, so a kernel
//! that reads it keeps one output's partial sums across a vector's lanes and pays a
//! horizontal step per super-block and activation row; at prefill those float steps took
//! as long as the integer products (`perf`, Qwen2.5-Coder-1.5B, BENCHMARKS.md). Here each
//! 64-byte vector holds 4 consecutive quants of 16 rows, so one `vpdpbusd` with 4
//! activation bytes broadcast adds 64 products into 16 outputs, one per lane, and every
//! float step after it serves 16 outputs. The same kernel serves decode (one activation
//! row) and prefill (groups of [`GA`]), and each output lane takes the same instructions in
//! the same order whatever the batch: a row computes the same bits alone or batched.
//!
//! The layout per group of 16 rows and super-block (`g` below; `r` a row of the group):
//! - Q4_K, [`Q4K_BYTES`]: `d` and `dmin` as f16 `[r]`; the unit scales `[unit][r]` and the
//!   minimums `[unit pair][r][2]` as bytes; the nibbles `[unit pair t][quad q][r][4]`, the
//!   low nibble from unit `2t`, the high one from unit `2t + 1` (the pairing GGML uses).
//! - Q6_K, [`Q6K_BYTES`]: `d` as f16 `[r]`; the sixteen scales `[pair][r][2]` (signed
//!   bytes); the low nibbles as Q4_K; then the top 2 bits `[unit pair t][quad pair p][r][4]`,
//!   bits `2 (u % 2) + 4 (q % 2)` of each byte for unit `u`, quad `q`.
//!
//! Weights stay about the size of GGML's (2368 bytes per group's super-block against 2304
//! for Q4_K, 3392 against 3360 for Q6_K), so decode, which streams them, reads no more.

use super::format::GgmlKind;
use super::format::{Q4_0, Q4_1, Q5_0, Q8_0};
use super::q8::{Q8KRow, Q8Row};
use rayon::prelude::*;

/// Rows per interleaved group: one output per 32-bit lane of a 512-bit vector.
pub(super) const GROUP: usize = 16;
/// Activation rows that meet a group's unpacked quants per pass.
const GA: usize = 4;
/// Bytes per group and super-block of Q4_K.
pub(super) const Q4K_BYTES: usize = 2368;
/// Bytes per group and super-block of Q6_K.
pub(super) const Q6K_BYTES: usize = 3392;

// Offsets in a group's super-block.
const SC: usize = 64;
const Q4K_MINS: usize = 192;
const Q4K_LO: usize = 320;
const Q6K_LO: usize = 320;
const Q6K_HI: usize = 2368;

/// Whether matrices of `kind` are interleaved on the AVX-512 VNNI tier.
pub(super) fn interleaves(kind: GgmlKind) -> bool {
    kind != GgmlKind::Q5K
}

/// Bytes per group and block (super-block for the K-quants) of `kind` (an [`interleaves`]
/// kind): GGML's bytes for 16 rows, but for the K-quants' unpacked scales.
pub(super) fn group_bytes(kind: GgmlKind) -> usize {
    match kind {
        GgmlKind::Q4K => Q4K_BYTES,
        GgmlKind::Q6K => Q6K_BYTES,
        _ => GROUP * kind.block_bytes(),
    }
}

// Offsets in a group's block of 32: `d` `[r]` at 0, then Q4_1's `m` `[r]`, Q5_0's top bits
// `[r][4]` (bit `q` of byte `k` for value `4q + k`), then the nibbles `[j][r][4]` (low:
// value `4j + k`, high: `16 + 4j + k`) or Q8_0's bytes `[q][r][4]`, offset by 128.
const fn legacy_quants(kind: GgmlKind) -> usize {
    match kind {
        GgmlKind::Q4_1 => 64,
        GgmlKind::Q5_0 => 96,
        _ => 32,
    }
}

/// One row's super-block, unpacked: what both layouts store.
struct Super {
    /// `d` and (Q4_K) `dmin`, as f16 bits.
    d: u16,
    dmin: u16,
    /// Q4_K's eight unit scales (as `u8`) or Q6_K's sixteen signed ones.
    sc: [i8; 16],
    /// Q4_K's eight minimums.
    mn: [u8; 8],
    /// The 256 quants, unsigned (Q4_K 0..16, Q6_K 0..64).
    q: [u8; 256],
}

impl Super {
    fn new() -> Self {
        Self {
            d: 0,
            dmin: 0,
            sc: [0; 16],
            mn: [0; 8],
            q: [0; 256],
        }
    }

    /// From GGML's block bytes `b`.
    fn read_ggml(&mut self, kind: GgmlKind, b: &[u8]) {
        let half = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        match kind {
            GgmlKind::Q4_0 | GgmlKind::Q4_1 | GgmlKind::Q5_0 => {
                self.d = half(0);
                let (qh, qs) = match kind {
                    GgmlKind::Q4_1 => {
                        self.dmin = half(2);
                        (0, &b[4..20])
                    }
                    GgmlKind::Q5_0 => (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
                    _ => (0, &b[2..18]),
                };
                for (i, &v) in qs.iter().enumerate() {
                    self.q[i] = (v & 15) | (((qh >> i) & 1) << 4) as u8;
                    self.q[16 + i] = (v >> 4) | (((qh >> (16 + i)) & 1) << 4) as u8;
                }
            }
            GgmlKind::Q8_0 => {
                self.d = half(0);
                for i in 0..32 {
                    self.q[i] = b[2 + i] ^ 0x80;
                }
            }
            GgmlKind::Q4K => {
                self.d = half(0);
                self.dmin = half(2);
                let (sc, mn) = super::format::k_scales_mins(&b[4..16]);
                for (d, &v) in self.sc.iter_mut().zip(&sc) {
                    *d = v as i8;
                }
                self.mn = mn;
                let qs = &b[16..144];
                for c in 0..4 {
                    for l in 0..32 {
                        let v = qs[32 * c + l];
                        self.q[64 * c + l] = v & 15;
                        self.q[64 * c + 32 + l] = v >> 4;
                    }
                }
            }
            GgmlKind::Q6K => {
                self.d = half(208);
                for j in 0..16 {
                    self.sc[j] = b[192 + j] as i8;
                }
                let (ql, qh) = (&b[..128], &b[128..192]);
                for h in 0..2 {
                    for l in 0..32 {
                        let hi = qh[32 * h + l];
                        let (a, c) = (ql[64 * h + l], ql[64 * h + 32 + l]);
                        let q = &mut self.q[128 * h..];
                        q[l] = (a & 15) | ((hi & 3) << 4);
                        q[32 + l] = (c & 15) | (((hi >> 2) & 3) << 4);
                        q[64 + l] = (a >> 4) | (((hi >> 4) & 3) << 4);
                        q[96 + l] = (c >> 4) | (((hi >> 6) & 3) << 4);
                    }
                }
            }
            _ => unreachable!(),
        }
    }

    /// Into GGML's block bytes `b` (the inverse of [`Self::read_ggml`]).
    fn write_ggml(&self, kind: GgmlKind, b: &mut [u8]) {
        b[0..2].copy_from_slice(&self.d.to_le_bytes());
        let q = &self.q;
        match kind {
            GgmlKind::Q4_0 | GgmlKind::Q4_1 | GgmlKind::Q5_0 => {
                let at = match kind {
                    GgmlKind::Q4_1 => {
                        b[2..4].copy_from_slice(&self.dmin.to_le_bytes());
                        4
                    }
                    GgmlKind::Q5_0 => {
                        let qh = (0..32).fold(0u32, |h, i| h | (u32::from(q[i] >> 4) << i));
                        b[2..6].copy_from_slice(&qh.to_le_bytes());
                        6
                    }
                    _ => 2,
                };
                for i in 0..16 {
                    b[at + i] = (q[i] & 15) | ((q[16 + i] & 15) << 4);
                }
            }
            GgmlKind::Q8_0 => {
                for i in 0..32 {
                    b[2 + i] = q[i] ^ 0x80;
                }
            }
            GgmlKind::Q4K => {
                b[0..2].copy_from_slice(&self.d.to_le_bytes());
                b[2..4].copy_from_slice(&self.dmin.to_le_bytes());
                let (sc, mn) = (self.sc.map(|v| v as u8), self.mn);
                for j in 0..4 {
                    b[4 + j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
                    b[8 + j] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
                    b[12 + j] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
                }
                for c in 0..4 {
                    for l in 0..32 {
                        b[16 + 32 * c + l] = self.q[64 * c + l] | (self.q[64 * c + 32 + l] << 4);
                    }
                }
            }
            GgmlKind::Q6K => {
                for h in 0..2 {
                    let q = &self.q[128 * h..];
                    for l in 0..32 {
                        b[64 * h + l] = (q[l] & 15) | ((q[64 + l] & 15) << 4);
                        b[64 * h + 32 + l] = (q[32 + l] & 15) | ((q[96 + l] & 15) << 4);
                        b[128 + 32 * h + l] = (q[l] >> 4)
                            | ((q[32 + l] >> 4) << 2)
                            | ((q[64 + l] >> 4) << 4)
                            | ((q[96 + l] >> 4) << 6);
                    }
                }
                for j in 0..16 {
                    b[192 + j] = self.sc[j] as u8;
                }
                b[208..210].copy_from_slice(&self.d.to_le_bytes());
            }
            _ => unreachable!(),
        }
    }

    /// As row `r` of the group's super-block (block of 32) `g`.
    fn write_group(&self, kind: GgmlKind, g: &mut [u8], r: usize) {
        g[2 * r..2 * r + 2].copy_from_slice(&self.d.to_le_bytes());
        let q = &self.q;
        let at = legacy_quants(kind);
        match kind {
            GgmlKind::Q4_0 | GgmlKind::Q4_1 | GgmlKind::Q5_0 => {
                if kind == GgmlKind::Q4_1 {
                    g[32 + 2 * r..34 + 2 * r].copy_from_slice(&self.dmin.to_le_bytes());
                }
                for k in 0..4 {
                    if kind == GgmlKind::Q5_0 {
                        g[32 + 4 * r + k] = (0..8).fold(0, |h, j| h | ((q[4 * j + k] >> 4) << j));
                    }
                    for j in 0..4 {
                        let (lo, hi) = (q[4 * j + k] & 15, q[16 + 4 * j + k] & 15);
                        g[at + 64 * j + 4 * r + k] = lo | (hi << 4);
                    }
                }
                return;
            }
            GgmlKind::Q8_0 => {
                for j in 0..8 {
                    g[at + 64 * j + 4 * r..at + 64 * j + 4 * r + 4]
                        .copy_from_slice(&q[4 * j..4 * j + 4]);
                }
                return;
            }
            GgmlKind::Q4K => {
                g[32 + 2 * r..34 + 2 * r].copy_from_slice(&self.dmin.to_le_bytes());
                for u in 0..8 {
                    g[SC + 16 * u + r] = self.sc[u] as u8;
                    g[Q4K_MINS + 32 * (u / 2) + 2 * r + u % 2] = self.mn[u];
                }
            }
            GgmlKind::Q6K => {
                for j in 0..16 {
                    g[SC + 32 * (j / 2) + 2 * r + j % 2] = self.sc[j] as u8;
                }
                for t in 0..4 {
                    for p in 0..4 {
                        for k in 0..4 {
                            let at = |u: usize, qd: usize| q[32 * u + 4 * qd + k] >> 4;
                            let (u0, q0) = (2 * t, 2 * p);
                            g[Q6K_HI + 64 * (4 * t + p) + 4 * r + k] = at(u0, q0)
                                | (at(u0 + 1, q0) << 2)
                                | (at(u0, q0 + 1) << 4)
                                | (at(u0 + 1, q0 + 1) << 6);
                        }
                    }
                }
            }
            _ => unreachable!(),
        }
        for t in 0..4 {
            for qd in 0..8 {
                for k in 0..4 {
                    let (a, b) = (q[64 * t + 4 * qd + k], q[64 * t + 32 + 4 * qd + k]);
                    g[Q4K_LO + 64 * (8 * t + qd) + 4 * r + k] = (a & 15) | ((b & 15) << 4);
                }
            }
        }
    }

    /// From row `r` of the group's super-block (block of 32) `g` (the inverse of
    /// [`Self::write_group`]).
    fn read_group(&mut self, kind: GgmlKind, g: &[u8], r: usize) {
        self.d = u16::from_le_bytes([g[2 * r], g[2 * r + 1]]);
        let at = legacy_quants(kind);
        match kind {
            GgmlKind::Q4_0 | GgmlKind::Q4_1 | GgmlKind::Q5_0 => {
                if kind == GgmlKind::Q4_1 {
                    self.dmin = u16::from_le_bytes([g[32 + 2 * r], g[33 + 2 * r]]);
                }
                for k in 0..4 {
                    let h = if kind == GgmlKind::Q5_0 {
                        g[32 + 4 * r + k]
                    } else {
                        0
                    };
                    for j in 0..4 {
                        let v = g[at + 64 * j + 4 * r + k];
                        self.q[4 * j + k] = (v & 15) | (((h >> j) & 1) << 4);
                        self.q[16 + 4 * j + k] = (v >> 4) | (((h >> (4 + j)) & 1) << 4);
                    }
                }
                return;
            }
            GgmlKind::Q8_0 => {
                for j in 0..8 {
                    let src = &g[at + 64 * j + 4 * r..at + 64 * j + 4 * r + 4];
                    self.q[4 * j..4 * j + 4].copy_from_slice(src);
                }
                return;
            }
            _ => {}
        }
        for t in 0..4 {
            for qd in 0..8 {
                for k in 0..4 {
                    let v = g[Q4K_LO + 64 * (8 * t + qd) + 4 * r + k];
                    self.q[64 * t + 4 * qd + k] = v & 15;
                    self.q[64 * t + 32 + 4 * qd + k] = v >> 4;
                }
            }
        }
        match kind {
            GgmlKind::Q4K => {
                self.dmin = u16::from_le_bytes([g[32 + 2 * r], g[33 + 2 * r]]);
                for u in 0..8 {
                    self.sc[u] = g[SC + 16 * u + r] as i8;
                    self.mn[u] = g[Q4K_MINS + 32 * (u / 2) + 2 * r + u % 2];
                }
            }
            GgmlKind::Q6K => {
                for j in 0..16 {
                    self.sc[j] = g[SC + 32 * (j / 2) + 2 * r + j % 2] as i8;
                }
                for t in 0..4 {
                    for p in 0..4 {
                        for k in 0..4 {
                            let h = g[Q6K_HI + 64 * (4 * t + p) + 4 * r + k];
                            let (u0, q0) = (2 * t, 2 * p);
                            for (bits, u, qd) in [
                                (0, u0, q0),
                                (2, u0 + 1, q0),
                                (4, u0, q0 + 1),
                                (6, u0 + 1, q0 + 1),
                            ] {
                                self.q[32 * u + 4 * qd + k] |= ((h >> bits) & 3) << 4;
                            }
                        }
                    }
                }
            }
            _ => unreachable!(),
        }
    }
}

/// Bytes of a `[rows, cols]` matrix of `kind` interleaved: whole groups (the last one
/// padded with zero rows).
pub(super) fn interleaved_len(kind: GgmlKind, rows: usize, cols: usize) -> usize {
    rows.div_ceil(GROUP) * (cols / kind.block_len()) * group_bytes(kind)
}

/// GGML's row-major blocks `raw` of a `[rows, cols]` matrix into `dst`
/// ([`interleaved_len`] bytes, zeroed), groups in parallel.
pub(super) fn interleave(kind: GgmlKind, raw: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    let ns = cols / kind.block_len();
    let (gb, bb) = (group_bytes(kind), kind.block_bytes());
    dst.par_chunks_mut(ns * gb)
        .enumerate()
        .for_each(|(gi, group)| {
            let mut sb = Super::new();
            for r in 0..GROUP.min(rows - gi * GROUP) {
                let row = &raw[(gi * GROUP + r) * ns * bb..];
                for s in 0..ns {
                    sb.read_ggml(kind, &row[s * bb..(s + 1) * bb]);
                    sb.write_group(kind, &mut group[s * gb..(s + 1) * gb], r);
                }
            }
        });
}

/// Rows `r0 .. r0 + n` of an interleaved matrix `data` as GGML's blocks (not repacked),
/// into `dst` (`n` rows of GGML blocks).
pub(super) fn deinterleave(kind: GgmlKind, data: &[u8], cols: usize, r0: usize, dst: &mut [u8]) {
    let ns = cols / kind.block_len();
    let (gb, bb) = (group_bytes(kind), kind.block_bytes());
    let mut sb = Super::new();
    for (j, row) in dst.chunks_exact_mut(ns * bb).enumerate() {
        let (gi, r) = ((r0 + j) / GROUP, (r0 + j) % GROUP);
        let group = &data[gi * ns * gb..];
        for s in 0..ns {
            sb.q = [0; 256];
            sb.read_group(kind, &group[s * gb..(s + 1) * gb], r);
            sb.write_ggml(kind, &mut row[s * bb..(s + 1) * bb]);
        }
    }
}

/// `out[j * m + i] = row (16 g0 + j) . acts[i]` for `j < n` (`out: [n, m]`) from the
/// interleaved K-quant matrix `data` of `kind` with `ns` super-blocks per row.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C. Lengths are asserted.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows(
    kind: GgmlKind,
    data: &[u8],
    ns: usize,
    g0: usize,
    acts: &[Q8KRow],
    out: &mut [f32],
) {
    for act in acts {
        assert!(act.q.len() == 256 * ns && act.d.len() == ns);
        assert!(act.bs16.len() == 16 * ns && act.bs32.len() == 8 * ns);
    }
    drive(
        kind,
        data,
        ns,
        g0,
        acts,
        out,
        |base, xs, ga, stream, sums| {
            macro_rules! run {
                ($ga:literal) => {{
                    // SAFETY: `drive` passes a whole group of `ns` super-blocks and activation
                    // rows of as many (asserted above); the features are the caller's contract.
                    let s: [[f32; GROUP]; $ga] = unsafe {
                        match (kind, stream) {
                            (GgmlKind::Q4K, false) => group_q4k::<$ga, false>(base, ns, xs),
                            (GgmlKind::Q4K, true) => group_q4k::<$ga, true>(base, ns, xs),
                            (GgmlKind::Q6K, false) => group_q6k::<$ga, false>(base, ns, xs),
                            (GgmlKind::Q6K, true) => group_q6k::<$ga, true>(base, ns, xs),
                            _ => unreachable!("{kind:?} is not an interleaved K-quant"),
                        }
                    };
                    sums[..$ga].copy_from_slice(&s);
                }};
            }
            by_ga!(ga, run)
        },
    );
}

/// [`rows`] for the kinds in blocks of 32, `nb` blocks per row.
///
/// # Safety
/// As [`rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn rows32(
    kind: GgmlKind,
    data: &[u8],
    nb: usize,
    g0: usize,
    acts: &[Q8Row],
    out: &mut [f32],
) {
    for act in acts {
        assert!(act.q.len() == 32 * nb && act.d.len() == nb);
        assert!(act.bs.len() == nb && act.s32.len() == nb);
    }
    drive(
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
            by_ga!(ga, run)
        },
    );
}

/// Runs `$run!(GA)` for the activation-row count `$ga` (1 to [`GA`]).
macro_rules! by_ga {
    ($ga:expr, $run:ident) => {
        match $ga {
            1 => $run!(1),
            2 => $run!(2),
            3 => $run!(3),
            _ => $run!(4),
        }
    };
}
use by_ga;

/// The loop both [`rows`] share: for each group of `n = out.len() / m` rows from group `g0`
/// of `data` (`nb` blocks per row), each pass of up to [`GA`] activation rows;
/// `group(base, xs, ga, stream, sums)` leaves the group's outputs for `xs` in `sums`.
fn drive<T>(
    kind: GgmlKind,
    data: &[u8],
    nb: usize,
    g0: usize,
    acts: &[T],
    out: &mut [f32],
    group: impl Fn(*const u8, &[T], usize, bool, &mut [[f32; GROUP]; GA]),
) {
    let m = acts.len();
    assert!(m > 0 && out.len().is_multiple_of(m));
    let n = out.len() / m;
    let gb = group_bytes(kind) * nb;
    assert!(data.len() >= (g0 + n.div_ceil(GROUP)) * gb);
    // One pass over the weights (few activation rows) streams them from memory: ask for
    // them ahead. More passes read each group from cache.
    let stream = m <= GA;
    for gi in 0..n.div_ceil(GROUP) {
        let base = data[(g0 + gi) * gb..].as_ptr();
        let live = GROUP.min(n - gi * GROUP);
        let mut i0 = 0;
        while i0 < m {
            let ga = GA.min(m - i0);
            let mut sums = [[0f32; GROUP]; GA];
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

/// Four activation bytes at `p` in every 32-bit lane.
#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m512i {
    // SAFETY: the caller's `p` has 4 readable bytes.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

/// Two 16-bit sums at `p` in every 32-bit lane.
#[inline(always)]
unsafe fn bcast2(p: *const i16) -> __m512i {
    // SAFETY: the caller's `p` has 4 readable bytes.
    unsafe { _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32)) }
}

/// Sixteen f16 at `p` as f32.
#[inline(always)]
unsafe fn halves(p: *const u8) -> __m512 {
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
unsafe fn group_q4k<const GA: usize, const STREAM: bool>(
    base: *const u8,
    ns: usize,
    xs: &[Q8KRow],
) -> [[f32; GROUP]; GA] {
    let nib = _mm512_set1_epi8(15);
    let mut tot = [_mm512_setzero_ps(); GA];
    for s in 0..ns {
        // SAFETY: the offsets lie in super-block s of the group and of each activation row.
        unsafe {
            let b = base.add(s * Q4K_BYTES);
            if STREAM {
                prefetch_ahead(b, Q4K_BYTES);
            }
            let d = halves(b);
            let dmin = halves(b.add(32));
            let mut sbf = [_mm512_setzero_ps(); GA];
            let mut mins = [_mm512_setzero_si512(); GA];
            for t in 0..4 {
                let mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                    b.add(Q4K_MINS + 32 * t) as *const __m256i
                ));
                for i in 0..GA {
                    let bs = bcast2(xs[i].bs32.as_ptr().add(8 * s + 2 * t));
                    mins[i] = _mm512_dpwssd_epi32(mins[i], mn, bs);
                }
            }
            for t in 0..4 {
                let mut ia = [[_mm512_setzero_si512(); GA]; 2];
                let mut ib = [[_mm512_setzero_si512(); GA]; 2];
                for q in 0..8 {
                    let l = _mm512_loadu_si512(b.add(Q4K_LO + 64 * (8 * t + q)) as *const _);
                    let lo = _mm512_and_si512(l, nib);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(l), nib);
                    let c = q % chains::<GA>();
                    for i in 0..GA {
                        let x = xs[i].q.as_ptr().add(256 * s + 64 * t + 4 * q);
                        ia[c][i] = _mm512_dpbusd_epi32(ia[c][i], lo, bcast4(x));
                        ib[c][i] = _mm512_dpbusd_epi32(ib[c][i], hi, bcast4(x.add(32)));
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
    let nib = _mm512_set1_epi8(15);
    let top = _mm512_set1_epi8(0x30);
    let mut tot = [_mm512_setzero_ps(); GA];
    for s in 0..ns {
        // SAFETY: as in `group_q4k`.
        unsafe {
            let b = base.add(s * Q6K_BYTES);
            if STREAM {
                prefetch_ahead(b, Q6K_BYTES);
            }
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
                    off[i] = _mm512_dpwssd_epi32(off[i], pa, bcast2(bs));
                    off[i] = _mm512_dpwssd_epi32(off[i], pb, bcast2(bs.add(2)));
                }
                // The low (e = 0) and high (e = 1) scale of a pair, times d.
                let scale = |p: __m512i, e: usize| {
                    let v = if e == 0 {
                        _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(p))
                    } else {
                        _mm512_srai_epi32::<16>(p)
                    };
                    _mm512_mul_ps(_mm512_cvtepi32_ps(v), d)
                };
                for e in 0..2 {
                    let mut ia = [[_mm512_setzero_si512(); GA]; 2];
                    let mut ib = [[_mm512_setzero_si512(); GA]; 2];
                    for p in 2 * e..2 * e + 2 {
                        let h = _mm512_loadu_si512(b.add(Q6K_HI + 64 * (4 * t + p)) as *const _);
                        for (k, hs) in [(0, _mm512_slli_epi16::<4>(h)), (1, h)] {
                            let q = 2 * p + k;
                            let l =
                                _mm512_loadu_si512(b.add(Q6K_LO + 64 * (8 * t + q)) as *const _);
                            // Unit 2t's top bits at bits 4-5 of hs, unit 2t + 1's two above.
                            let lo = _mm512_or_si512(
                                _mm512_and_si512(l, nib),
                                _mm512_and_si512(hs, top),
                            );
                            let hi = _mm512_or_si512(
                                _mm512_and_si512(_mm512_srli_epi16::<4>(l), nib),
                                _mm512_and_si512(_mm512_srli_epi16::<2>(hs), top),
                            );
                            let c = q % chains::<GA>();
                            for i in 0..GA {
                                let x = xs[i].q.as_ptr().add(256 * s + 64 * t + 4 * q);
                                ia[c][i] = _mm512_dpbusd_epi32(ia[c][i], lo, bcast4(x));
                                ib[c][i] = _mm512_dpbusd_epi32(ib[c][i], hi, bcast4(x.add(32)));
                            }
                        }
                    }
                    let (ia, ib) = (join(ia), join(ib));
                    let (sa, sb) = (scale(pa, e), scale(pb, e));
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

/// How far ahead of the super-block being read a streaming pass asks for weights.
const PREFETCH: usize = 4096;

/// Asks for the `len` bytes [`PREFETCH`] past `b` (hardware prefetchers stop at pages).
#[inline(always)]
fn prefetch_ahead(b: *const u8, len: usize) {
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
    let nib = _mm512_set1_epi8(15);
    let fifth = _mm512_set1_epi8(16);
    let kind = match K {
        Q4_0 => GgmlKind::Q4_0,
        Q4_1 => GgmlKind::Q4_1,
        Q5_0 => GgmlKind::Q5_0,
        _ => GgmlKind::Q8_0,
    };
    let (bytes, at) = (group_bytes(kind), legacy_quants(kind));
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
            let g = base.add(b * bytes);
            if STREAM {
                prefetch_ahead(g, bytes);
            }
            let d = halves(g);
            let mut w = [_mm512_setzero_si512(); 8];
            if K == Q8_0 {
                for (j, wj) in w.iter_mut().enumerate() {
                    *wj = _mm512_loadu_si512(g.add(at + 64 * j) as *const _);
                }
            } else {
                for j in 0..4 {
                    let l = _mm512_loadu_si512(g.add(at + 64 * j) as *const _);
                    w[j] = _mm512_and_si512(l, nib);
                    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(l), nib);
                }
                if K == Q5_0 {
                    // Bit q of each top-bit byte is quad q's fifth bit: to bit 4.
                    let h = _mm512_loadu_si512(g.add(32) as *const _);
                    let hs = [
                        _mm512_slli_epi16::<4>(h),
                        _mm512_slli_epi16::<3>(h),
                        _mm512_slli_epi16::<2>(h),
                        _mm512_slli_epi16::<1>(h),
                        h,
                        _mm512_srli_epi16::<1>(h),
                        _mm512_srli_epi16::<2>(h),
                        _mm512_srli_epi16::<3>(h),
                    ];
                    for (wj, hj) in w.iter_mut().zip(hs) {
                        *wj = _mm512_or_si512(*wj, _mm512_and_si512(hj, fifth));
                    }
                }
            }
            let mut acc = [[_mm512_setzero_si512(); GA]; 2];
            for (q, &wq) in w.iter().enumerate() {
                let c = q % chains::<GA>();
                for i in 0..GA {
                    let x = bcast4(xs[i].q.as_ptr().add(32 * b + 4 * q));
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
                    tot[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i].s32[b]), tot[i]);
                }
            }
        }
    }
    store(tot)
}

/// The lanes of each total.
#[inline(always)]
fn store<const GA: usize>(tot: [__m512; GA]) -> [[f32; GROUP]; GA] {
    let mut out = [[0f32; GROUP]; GA];
    for (o, t) in out.iter_mut().zip(tot) {
        // SAFETY: `o` holds 16 writable floats; AVX-512F is the callers' contract (they are
        // `target_feature` functions inlined here).
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), t) };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_round_trips_every_byte() {
        // Random GGML bytes (any bytes are a valid block) of 37 rows (a padded last group)
        // interleaved and read back row by row from several starting rows.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for kind in GgmlKind::ALL.into_iter().filter(|&k| interleaves(k)) {
            let (rows, cols) = (37, 512);
            let row = cols / kind.block_len() * kind.block_bytes();
            let raw: Vec<u8> = (0..rows * row)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    state as u8
                })
                .collect();
            let mut il = vec![0u8; interleaved_len(kind, rows, cols)];
            interleave(kind, &raw, rows, cols, &mut il);
            for (r0, n) in [(0, rows), (5, 1), (15, 3), (32, 5)] {
                let mut back = vec![0u8; n * row];
                deinterleave(kind, &il, cols, r0, &mut back);
                assert!(
                    back == raw[r0 * row..(r0 + n) * row],
                    "{kind:?}: rows {r0}..{} changed",
                    r0 + n
                );
            }
        }
    }
}
