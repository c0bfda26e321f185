//! Quantized matrices interleaved in groups of 16 rows, the layout the integer products read
//! (`grouped.rs`, which says why, and `grouped_avx2.rs`), and back to GGML's blocks for the
//! kernels that read rows.
//!
//! The layout per group of 16 rows and block (`r` a row of the group, `k` a byte of a quad
//! of 4 values):
//! - Q4_K, [`Q4K_BYTES`] per super-block: `d` and `dmin` as f16 `[r]`; the unit scales
//!   `[unit][r]` and the minimums `[unit pair][r][2]` as bytes; the nibbles
//!   `[unit pair t][quad q][r][4]`, the low nibble from unit `2t`, the high one from unit
//!   `2t + 1` (the pairing GGML uses).
//! - Q5_K, [`Q5K_BYTES`]: Q4_K's, then the fifth bits `[unit pair t][quad half e][r][4]`,
//!   bit `2 (q % 4) + u % 2` of each byte for unit `u`, quad `q`.
//! - Q6_K, [`Q6K_BYTES`]: `d` as f16 `[r]`; the sixteen scales `[pair][r][2]` (signed
//!   bytes); the low nibbles as Q4_K; then the top 2 bits `[unit pair t][quad pair p][r][4]`,
//!   bits `2 (u % 2) + 4 (q % 2)` of each byte for unit `u`, quad `q`.
//! - Blocks of 32 ([`legacy_quants`]): `d` `[r]`, Q4_1's `m` `[r]`, Q5_0's fifth bits
//!   `[r][4]` (bit `q` for quad `q`), then the nibbles `[j][r][4]` (low: quad `j`, high:
//!   quad `j + 4`, GGML's pairing) or Q8_0's bytes `[q][r][4]`.
//!
//! Weights stay about the size of GGML's (Q4_K 2368 bytes per group's super-block against
//! 2304, Q5_K 2880 against 2816, Q6_K 3392 against 3360; the blocks of 32 exactly), so
//! decode, which streams them, reads no more.

use super::kind::GgmlKind;
use rayon::prelude::*;

/// Rows per interleaved group: one output per 32-bit lane of a 512-bit vector.
pub(super) const GROUP: usize = 16;
/// Bytes per group and super-block of Q4_K.
pub(super) const Q4K_BYTES: usize = 2368;
/// Bytes per group and super-block of Q5_K: Q4_K's, then the fifth bits.
pub(super) const Q5K_BYTES: usize = 2880;
/// Bytes per group and super-block of Q6_K.
pub(super) const Q6K_BYTES: usize = 3392;

// Offsets in a group's super-block: scales, Q4_K / Q5_K's minimums, the low nibbles, the
// fifth or top bits.
pub(super) const SC: usize = 64;
pub(super) const Q4K_MINS: usize = 192;
pub(super) const Q4K_LO: usize = 320;
pub(super) const Q6K_LO: usize = 320;
pub(super) const Q5K_HI: usize = 2368;
pub(super) const Q6K_HI: usize = 2368;

/// Bytes per group and block (super-block for the K-quants) of `kind`: GGML's bytes for 16
/// rows, but for the K-quants' unpacked scales and fifth or sixth bits.
pub(super) fn group_bytes(kind: GgmlKind) -> usize {
    match kind {
        GgmlKind::Q4K => Q4K_BYTES,
        GgmlKind::Q5K => Q5K_BYTES,
        GgmlKind::Q6K => Q6K_BYTES,
        _ => GROUP * kind.block_bytes(),
    }
}

/// The offset of the quants in a group's block of 32: after `d` `[r]` (32 bytes), Q4_1's
/// `m` `[r]` (32) and Q5_0's fifth bits `[r][4]` (64).
pub(super) const fn legacy_quants(kind: GgmlKind) -> usize {
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
    #[cfg(test)]
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
            GgmlKind::Q4K | GgmlKind::Q5K => {
                self.d = half(0);
                self.dmin = half(2);
                let (sc, mn) = super::kind::k_scales_mins(&b[4..16]);
                for (d, &v) in self.sc.iter_mut().zip(&sc) {
                    *d = v as i8;
                }
                self.mn = mn;
                let five = kind == GgmlKind::Q5K;
                let qs = &b[if five { 48 } else { 16 }..];
                for c in 0..4 {
                    for l in 0..32 {
                        let v = qs[32 * c + l];
                        self.q[64 * c + l] = v & 15;
                        self.q[64 * c + 32 + l] = v >> 4;
                    }
                }
                if five {
                    // Bit u of qh byte l: value l of unit u's fifth bit.
                    for u in 0..8 {
                        for l in 0..32 {
                            self.q[32 * u + l] |= ((b[16 + l] >> u) & 1) << 4;
                        }
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
            GgmlKind::Q4K | GgmlKind::Q5K => {
                b[0..2].copy_from_slice(&self.d.to_le_bytes());
                b[2..4].copy_from_slice(&self.dmin.to_le_bytes());
                let (sc, mn) = (self.sc.map(|v| v as u8), self.mn);
                for j in 0..4 {
                    b[4 + j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
                    b[8 + j] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
                    b[12 + j] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
                }
                let five = kind == GgmlKind::Q5K;
                let at = if five { 48 } else { 16 };
                for c in 0..4 {
                    for l in 0..32 {
                        let (lo, hi) = (self.q[64 * c + l] & 15, self.q[64 * c + 32 + l] & 15);
                        b[at + 32 * c + l] = lo | (hi << 4);
                    }
                }
                if five {
                    for l in 0..32 {
                        b[16 + l] = (0..8).fold(0, |h, u| h | ((self.q[32 * u + l] >> 4) << u));
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
        }
    }

    /// As row `r` of the group's super-block (block of 32) `g`: the layout's definition, which
    /// [`write_group`] computes straight from GGML's bytes.
    #[cfg(test)]
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
            GgmlKind::Q4K | GgmlKind::Q5K => {
                g[32 + 2 * r..34 + 2 * r].copy_from_slice(&self.dmin.to_le_bytes());
                for u in 0..8 {
                    g[SC + 16 * u + r] = self.sc[u] as u8;
                    g[Q4K_MINS + 32 * (u / 2) + 2 * r + u % 2] = self.mn[u];
                }
                if kind == GgmlKind::Q5K {
                    for (t, e, k) in planes() {
                        let mut h = 0;
                        for (bit, u, qd) in plane_bits(t, e) {
                            h |= (q[32 * u + 4 * qd + k] >> 4) << bit;
                        }
                        g[Q5K_HI + 64 * (2 * t + e) + 4 * r + k] = h;
                    }
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
            GgmlKind::Q4K | GgmlKind::Q5K => {
                self.dmin = u16::from_le_bytes([g[32 + 2 * r], g[33 + 2 * r]]);
                for u in 0..8 {
                    self.sc[u] = g[SC + 16 * u + r] as i8;
                    self.mn[u] = g[Q4K_MINS + 32 * (u / 2) + 2 * r + u % 2];
                }
                if kind == GgmlKind::Q5K {
                    for (t, e, k) in planes() {
                        let h = g[Q5K_HI + 64 * (2 * t + e) + 4 * r + k];
                        for (bit, u, qd) in plane_bits(t, e) {
                            self.q[32 * u + 4 * qd + k] |= ((h >> bit) & 1) << 4;
                        }
                    }
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

/// Q5_K's fifth-bit planes: unit pair `t`, half `e` of the quads, byte `k` of a quad.
fn planes() -> impl Iterator<Item = (usize, usize, usize)> {
    (0..4).flat_map(|t| (0..2).flat_map(move |e| (0..4).map(move |k| (t, e, k))))
}

/// The bits of plane `(t, e)`: bit `2 (q % 4) + u % 2` holds unit `u`'s quad `q`.
fn plane_bits(t: usize, e: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..8).map(move |bit| (bit, 2 * t + bit % 2, 4 * e + bit / 2))
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
            for r in 0..GROUP.min(rows - gi * GROUP) {
                let row = &raw[(gi * GROUP + r) * ns * bb..];
                for s in 0..ns {
                    write_group(kind, &row[s * bb..(s + 1) * bb], &mut group[s * gb..], r);
                }
            }
        });
}

/// Copies the 4 bytes at `src[from..]` to `dst[to..]`.
#[inline(always)]
fn quad(dst: &mut [u8], to: usize, src: &[u8], from: usize) {
    dst[to..to + 4].copy_from_slice(&src[from..from + 4]);
}

/// The 4 bytes at `src[at..]`, little-endian.
#[inline(always)]
fn word(src: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([src[at], src[at + 1], src[at + 2], src[at + 3]])
}

/// Writes `v` little-endian at `dst[at..]`.
#[inline(always)]
fn put(dst: &mut [u8], at: usize, v: u32) {
    dst[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// GGML's block `b` of `kind` as row `r` of the group's super-block (block of 32) `g`,
/// computed from the bytes as they lie: a load streams a model's weights through here once,
/// so no block is unpacked into values first ([`Super`] does that for the way back). Most of
/// the layout is GGML's own bytes regrouped: the nibble pairs of Q4_0/Q4_1/Q5_0 and Q4_K/Q5_K
/// are GGML's bytes, Q6_K's low nibbles two of its bytes' halves.
fn write_group(kind: GgmlKind, b: &[u8], g: &mut [u8], r: usize) {
    // Fixed-size views and `r < 16` let the compiler drop the bounds checks of the
    // constant-offset accesses below.
    let r = r % GROUP;
    match kind {
        GgmlKind::Q4_0 => legacy::<{ GROUP * 18 }, 18>(kind, b, g, r),
        GgmlKind::Q4_1 => legacy::<{ GROUP * 20 }, 20>(kind, b, g, r),
        GgmlKind::Q5_0 => legacy::<{ GROUP * 22 }, 22>(kind, b, g, r),
        GgmlKind::Q8_0 => legacy::<{ GROUP * 34 }, 34>(kind, b, g, r),
        GgmlKind::Q4K => k45::<Q4K_BYTES, 144>(b, g, r),
        GgmlKind::Q5K => k45::<Q5K_BYTES, 176>(b, g, r),
        GgmlKind::Q6K => k6(fixed(b), fixed_mut(g), r),
    }
}

/// The first `N` bytes of `s` as an array.
#[inline(always)]
fn fixed<const N: usize>(s: &[u8]) -> &[u8; N] {
    s[..N].try_into().expect("N bytes")
}

/// The first `N` bytes of `s` as a mutable array.
#[inline(always)]
fn fixed_mut<const N: usize>(s: &mut [u8]) -> &mut [u8; N] {
    (&mut s[..N]).try_into().expect("N bytes")
}

/// [`write_group`] for the blocks of 32 (`B` bytes each, `G` per group).
#[inline(always)]
fn legacy<const G: usize, const B: usize>(kind: GgmlKind, b: &[u8], g: &mut [u8], r: usize) {
    let (b, g): (&[u8; B], &mut [u8; G]) = (fixed(b), fixed_mut(g));
    g[2 * r..2 * r + 2].copy_from_slice(&b[0..2]);
    let at = legacy_quants(kind);
    if kind == GgmlKind::Q8_0 {
        for j in 0..8 {
            put(g, at + 64 * j + 4 * r, word(b, 2 + 4 * j) ^ 0x8080_8080);
        }
        return;
    }
    let qs = match kind {
        GgmlKind::Q4_1 => {
            g[32 + 2 * r..34 + 2 * r].copy_from_slice(&b[2..4]);
            4
        }
        GgmlKind::Q5_0 => {
            // Byte k of the row: bit j holds value 4 j + k's fifth bit.
            let qh = word(b, 2);
            for k in 0..4 {
                g[32 + 4 * r + k] =
                    (0..8).fold(0, |h, j| h | ((((qh >> (4 * j + k)) & 1) as u8) << j));
            }
            6
        }
        _ => 2,
    };
    for j in 0..4 {
        quad(g, at + 64 * j + 4 * r, b, qs + 4 * j);
    }
}

/// [`write_group`] for Q4_K and Q5_K (`B` bytes a block, `G` a group's super-block).
#[inline(always)]
fn k45<const G: usize, const B: usize>(b: &[u8], g: &mut [u8], r: usize) {
    let (b, g): (&[u8; B], &mut [u8; G]) = (fixed(b), fixed_mut(g));
    let five = G == Q5K_BYTES;
    g[2 * r..2 * r + 2].copy_from_slice(&b[0..2]);
    g[32 + 2 * r..34 + 2 * r].copy_from_slice(&b[2..4]);
    let (sc, mn) = super::kind::k_scales_mins(&b[4..16]);
    for u in 0..8 {
        g[SC + 16 * u + r] = sc[u];
        g[Q4K_MINS + 32 * (u / 2) + 2 * r + u % 2] = mn[u];
    }
    let qs = if five { 48 } else { 16 };
    for t in 0..4 {
        for qd in 0..8 {
            quad(
                g,
                Q4K_LO + 64 * (8 * t + qd) + 4 * r,
                b,
                qs + 32 * t + 4 * qd,
            );
        }
    }
    if five {
        // GGML: bit u of qh[v] (at byte 16 + v) is unit u's value v's fifth bit; four bytes k
        // at once.
        for (t, e) in (0..4).flat_map(|t| (0..2).map(move |e| (t, e))) {
            let mut h = 0;
            for (bit, u, qd) in plane_bits(t, e) {
                h |= ((word(b, 16 + 4 * qd) >> u) & 0x0101_0101) << bit;
            }
            put(g, Q5K_HI + 64 * (2 * t + e) + 4 * r, h);
        }
    }
}

/// [`write_group`] for Q6_K.
#[inline(always)]
fn k6(b: &[u8; 210], g: &mut [u8; Q6K_BYTES], r: usize) {
    g[2 * r..2 * r + 2].copy_from_slice(&b[208..210]);
    for j in 0..16 {
        g[SC + 32 * (j / 2) + 2 * r + j % 2] = b[192 + j];
    }
    // ql at bytes 0..128, qh at 128..192.
    for t in 0..4 {
        let h = t / 2;
        for qd in 0..8 {
            let (a, c) = (word(b, 64 * h + 4 * qd), word(b, 64 * h + 32 + 4 * qd));
            let v = if t % 2 == 0 {
                (a & 0x0f0f_0f0f) | ((c & 0x0f0f_0f0f) << 4)
            } else {
                ((a >> 4) & 0x0f0f_0f0f) | (c & 0xf0f0_f0f0)
            };
            put(g, Q6K_LO + 64 * (8 * t + qd) + 4 * r, v);
        }
    }
    // GGML: value 128 h + 32 s + l keeps its top two bits at bits 2 s of qh[32 h + l]; four
    // bytes k at once.
    let top =
        |u: usize, qd: usize| (word(b, 128 + 32 * (u / 4) + 4 * qd) >> (2 * (u % 4))) & 0x0303_0303;
    for t in 0..4 {
        for p in 0..4 {
            let (u0, q0) = (2 * t, 2 * p);
            let v = top(u0, q0)
                | (top(u0 + 1, q0) << 2)
                | (top(u0, q0 + 1) << 4)
                | (top(u0 + 1, q0 + 1) << 6);
            put(g, Q6K_HI + 64 * (4 * t + p) + 4 * r, v);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaving_round_trips_every_byte() {
        // Random GGML bytes (any bytes are a valid block) of 37 rows (a padded last group)
        // interleaved and read back row by row from several starting rows.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for kind in GgmlKind::ALL {
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
            // The direct writer against the layout's definition (unpack, then place values).
            let (ns, gb, bb) = (
                cols / kind.block_len(),
                group_bytes(kind),
                kind.block_bytes(),
            );
            let mut sb = Super::new();
            for (gi, group) in il.chunks_exact(ns * gb).enumerate() {
                let mut want = vec![0u8; ns * gb];
                for r in 0..GROUP.min(rows - gi * GROUP) {
                    for s in 0..ns {
                        let at = ((gi * GROUP + r) * ns + s) * bb;
                        sb.read_ggml(kind, &raw[at..at + bb]);
                        sb.write_group(kind, &mut want[s * gb..(s + 1) * gb], r);
                    }
                }
                assert!(
                    group == want,
                    "{kind:?}: group {gi} differs from the definition"
                );
            }
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
