//! The scalar kernel: portable Rust for any CPU, each row dequantized into a buffer and
//! dotted with the activations in 8 running sums.

use super::format::{GgmlKind, RowGeom, BLOCK, SLACK};
use half::f16;

/// `rows` holds `n` rows then the slack; `out: [n, m]`.
pub(super) fn rows(kind: GgmlKind, g: RowGeom, rows: &[u8], x: &[f32], m: usize, out: &mut [f32]) {
    let cols = g.nb * BLOCK;
    let mut w = vec![0f32; cols];
    let n = (rows.len() - SLACK) / g.stride;
    for (row, ys) in rows
        .chunks_exact(g.stride)
        .take(n)
        .zip(out.chunks_exact_mut(m))
    {
        let half_at = |i: usize| f16::from_bits(u16::from_le_bytes([row[i], row[i + 1]])).to_f32();
        for b in 0..g.nb {
            let d = half_at(2 * b);
            let wb = &mut w[b * BLOCK..(b + 1) * BLOCK];
            match kind {
                GgmlKind::Q4_1 => {
                    let mn = half_at(2 * g.nb + 2 * b);
                    let q = &row[g.qs_off + b * 16..g.qs_off + (b + 1) * 16];
                    for j in 0..16 {
                        wb[j] = (q[j] & 0x0f) as f32 * d + mn;
                        wb[j + 16] = (q[j] >> 4) as f32 * d + mn;
                    }
                }
                GgmlKind::Q8_0 => {
                    let q = &row[g.qs_off + b * 32..g.qs_off + (b + 1) * 32];
                    for j in 0..32 {
                        wb[j] = q[j] as i8 as f32 * d;
                    }
                }
            }
        }
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
