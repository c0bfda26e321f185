//! The scalar kernel: portable Rust for any CPU, each row dequantized into a buffer and
//! dotted with the activations in 8 running sums.

use super::format::{row_scales, RowGeom, SLACK};
use super::kind::{GgmlKind, BLOCK, SUPER};

/// `rows` holds `n` rows then the slack; `out: [n, m]`.
pub(super) fn rows(kind: GgmlKind, g: RowGeom, rows: &[u8], x: &[f32], m: usize, out: &mut [f32]) {
    let cols = g.nb * BLOCK;
    let mut w = vec![0f32; cols];
    let (mut d, mut mn) = (vec![0f32; g.sb], vec![0f32; g.sb]);
    let n = (rows.len() - SLACK) / g.stride;
    for (row, ys) in rows
        .chunks_exact(g.stride)
        .take(n)
        .zip(out.chunks_exact_mut(m))
    {
        row_scales(kind, g, row, &mut d, &mut mn);
        dequant_row(kind, g, row, &d, &mn, &mut w);
        for (i, y) in ys.iter_mut().enumerate() {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = [0f32; 8];
            for (wc, xc) in w.chunks_exact(8).zip(xi.chunks_exact(8)) {
                for k in 0..8 {
                    acc[k] += wc[k] * xc[k];
                }
            }
            *y = acc.iter().sum();
        }
    }
}

/// Rows of geometry `g` (`rows`: whole rows, no slack needed) into `w: [n, cols]` row-major,
/// each value as [`dequant_row`] rounds it.
pub(super) fn dequant_rows(kind: GgmlKind, g: RowGeom, rows: &[u8], w: &mut [f32]) {
    let cols = g.nb * BLOCK;
    let (mut d, mut mn) = (vec![0f32; g.sb], vec![0f32; g.sb]);
    for (row, wr) in rows.chunks_exact(g.stride).zip(w.chunks_exact_mut(cols)) {
        row_scales(kind, g, row, &mut d, &mut mn);
        dequant_row(kind, g, row, &d, &mn, wr);
    }
}

/// The values of one row of geometry `g` into `w: [cols]`, each `d[k] * q + mn[k]` with the
/// scales [`row_scales`] left in `d` and `mn` (so each is the format's value rounded once).
fn dequant_row(kind: GgmlKind, g: RowGeom, row: &[u8], d: &[f32], mn: &[f32], w: &mut [f32]) {
    let val = |q: u32, k: usize| q as f32 * d[k] + mn[k];
    match kind {
        GgmlKind::Q4_0 | GgmlKind::Q4_1 | GgmlKind::Q5_0 => {
            for (b, wb) in w.chunks_exact_mut(BLOCK).enumerate() {
                let q = &row[g.qs_off + 16 * b..g.qs_off + 16 * (b + 1)];
                let qh = if kind == GgmlKind::Q5_0 {
                    let at = g.qh_off + 4 * b;
                    u32::from_le_bytes([row[at], row[at + 1], row[at + 2], row[at + 3]])
                } else {
                    0
                };
                for j in 0..16 {
                    let lo = u32::from(q[j] & 15) | ((qh >> j) & 1) << 4;
                    let hi = u32::from(q[j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
                    wb[j] = val(lo, b);
                    wb[j + 16] = val(hi, b);
                }
            }
        }
        GgmlKind::Q8_0 => {
            for (b, wb) in w.chunks_exact_mut(BLOCK).enumerate() {
                let q = &row[g.qs_off + 32 * b..g.qs_off + 32 * (b + 1)];
                for (v, &q) in wb.iter_mut().zip(q) {
                    *v = f32::from(q as i8) * d[b];
                }
            }
        }
        GgmlKind::Q4K | GgmlKind::Q5K => {
            let bb = kind.block_bytes();
            for (s, (blk, ws)) in row
                .chunks_exact(bb)
                .zip(w.chunks_exact_mut(SUPER))
                .enumerate()
            {
                // Q5_K: 32 bytes of high bits before the nibbles.
                let (qh, qs) = if kind == GgmlKind::Q5K {
                    (&blk[16..48], &blk[48..176])
                } else {
                    (&blk[0..0], &blk[16..144])
                };
                for c in 0..4 {
                    let u = 8 * s + 2 * c;
                    for l in 0..32 {
                        let q = qs[32 * c + l];
                        let (hl, hh) = match qh.get(l) {
                            Some(&h) => {
                                (u32::from(h >> (2 * c)) & 1, u32::from(h >> (2 * c + 1)) & 1)
                            }
                            None => (0, 0),
                        };
                        ws[64 * c + l] = val(u32::from(q & 15) | hl << 4, u);
                        ws[64 * c + 32 + l] = val(u32::from(q >> 4) | hh << 4, u + 1);
                    }
                }
            }
        }
        GgmlKind::Q6K => {
            for (s, (blk, ws)) in row
                .chunks_exact(kind.block_bytes())
                .zip(w.chunks_exact_mut(SUPER))
                .enumerate()
            {
                for n in 0..2 {
                    let (ql, qh) = (&blk[64 * n..64 * n + 64], &blk[128 + 32 * n..160 + 32 * n]);
                    for k in 0..4 {
                        for l in 0..32 {
                            let lo = (ql[l + 32 * (k & 1)] >> (4 * (k >> 1))) & 15;
                            let hi = (qh[l] >> (2 * k)) & 3;
                            let t = 16 * s + 8 * n + 2 * k + l / 16;
                            ws[128 * n + 32 * k + l] = val(u32::from(lo | hi << 4), t);
                        }
                    }
                }
            }
        }
    }
}
