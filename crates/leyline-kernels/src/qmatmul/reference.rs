//! The tests' reference: GGML block bytes dequantized in f64 straight from the format
//! definitions, one value at a time, on GGML's own (not the repacked) layout. Every value of
//! every kind is exact in f64 (an f16 times small integers), so this is the format's value.

use super::GgmlKind;
use half::f16;

/// f16 at `b[i..i + 2]`, exactly, in f64.
fn half(b: &[u8], i: usize) -> f64 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f64()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K super-block from its 12
/// scale bytes `p`: for j < 4 the low 6 bits of `p[j]` and `p[j + 4]`; else the low and high
/// nibbles of `p[j + 4]`, topped by the top 2 bits of `p[j - 4]` and `p[j]`.
fn scale_min(j: usize, p: &[u8]) -> (f64, f64) {
    let (sc, m) = if j < 4 {
        (p[j] & 63, p[j + 4] & 63)
    } else {
        (
            (p[j + 4] & 0x0f) | ((p[j - 4] >> 6) << 4),
            (p[j + 4] >> 4) | ((p[j] >> 6) << 4),
        )
    };
    (f64::from(sc), f64::from(m))
}

/// The values of the GGML blocks `raw` of `kind`, in order.
///
/// # Panics
/// If `raw` is not whole blocks.
pub(super) fn dequantize(kind: GgmlKind, raw: &[u8]) -> Vec<f64> {
    let bb = kind.block_bytes();
    assert!(raw.len().is_multiple_of(bb), "whole blocks");
    let mut w = Vec::with_capacity(raw.len() / bb * kind.block_len());
    for blk in raw.chunks_exact(bb) {
        match kind {
            GgmlKind::Q4_0 => {
                let d = half(blk, 0);
                let qs = &blk[2..18];
                w.extend((0..32).map(|i| {
                    let q = if i < 16 {
                        qs[i] & 0x0f
                    } else {
                        qs[i - 16] >> 4
                    };
                    d * (f64::from(q) - 8.0)
                }));
            }
            GgmlKind::Q4_1 => {
                let (d, m) = (half(blk, 0), half(blk, 2));
                let qs = &blk[4..20];
                w.extend((0..32).map(|i| {
                    let q = if i < 16 {
                        qs[i] & 0x0f
                    } else {
                        qs[i - 16] >> 4
                    };
                    d * f64::from(q) + m
                }));
            }
            GgmlKind::Q5_0 => {
                let d = half(blk, 0);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                let qs = &blk[6..22];
                w.extend((0..32).map(|i| {
                    let low = if i < 16 {
                        qs[i] & 0x0f
                    } else {
                        qs[i - 16] >> 4
                    };
                    let q = u32::from(low) + 16 * ((qh >> i) & 1);
                    d * (f64::from(q) - 16.0)
                }));
            }
            GgmlKind::Q8_0 => {
                let d = half(blk, 0);
                w.extend(blk[2..34].iter().map(|&q| d * f64::from(q as i8)));
            }
            GgmlKind::Q4K | GgmlKind::Q5K => {
                let (d, dmin) = (half(blk, 0), half(blk, 2));
                let scales = &blk[4..16];
                let five = kind == GgmlKind::Q5K;
                let (qh, qs) = if five {
                    (&blk[16..48], &blk[48..176])
                } else {
                    (&blk[0..0], &blk[16..144])
                };
                w.extend((0..256).map(|i| {
                    // Sub-block j: bytes 32 (j / 2) .. of qs, low nibbles for even j.
                    let (j, l) = (i / 32, i % 32);
                    let byte = qs[32 * (j / 2) + l];
                    let mut q = f64::from(if j % 2 == 0 { byte & 0x0f } else { byte >> 4 });
                    if five && (qh[l] >> j) & 1 == 1 {
                        q += 16.0;
                    }
                    let (sc, m) = scale_min(j, scales);
                    d * sc * q - dmin * m
                }));
            }
            GgmlKind::Q6K => {
                let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
                let d = half(blk, 208);
                w.extend((0..256).map(|i| {
                    // Half h, chunk k of 32 in it, position l in the chunk.
                    let (h, k, l) = (i / 128, i % 128 / 32, i % 32);
                    let byte = ql[64 * h + 32 * (k % 2) + l];
                    let low = if k < 2 { byte & 0x0f } else { byte >> 4 };
                    let high = (qh[32 * h + l] >> (2 * k)) & 3;
                    let q = f64::from(low) + 16.0 * f64::from(high);
                    d * f64::from(sc[i / 16] as i8) * (q - 32.0)
                }));
            }
        }
    }
    w
}
