//! GGML's quantized block kinds: their sizes, the constants the kernels walk them by, and the
//! K-quants' packed 6-bit scales. Everything above this file (storage, interleaving, kernels)
//! reads blocks through these definitions.

/// Values per unit the kernels walk: a GGML block of 32, or a K-quant sub-block of 32 (two of
/// Q6_K's sub-blocks of 16).
pub(super) const BLOCK: usize = 32;
/// Values per K-quant super-block.
pub(super) const SUPER: usize = 256;
/// The quantized weight formats [`super::QMatrix`] accepts. `d`, `dmin` and `m` below are f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlKind {
    /// Blocks of 32: scale `d`, 16 bytes of nibbles (low: values 0..16, high: 16..32);
    /// `w = d * (q - 8)`.
    Q4_0,
    /// Blocks of 32: scale `d`, minimum `m`, 16 bytes of nibbles as Q4_0; `w = d * q + m`.
    Q4_1,
    /// Blocks of 32: scale `d`, 4 bytes `qh` (bit `i` is value `i`'s 5th bit), 16 bytes of
    /// nibbles as Q4_0; `w = d * (q - 16)`.
    Q5_0,
    /// Blocks of 32: scale `d`, 32 signed bytes; `w = d * q`.
    Q8_0,
    /// Super-blocks of 256: `d`, `dmin`, 12 bytes packing eight 6-bit scales `sc` and mins
    /// `mn`, 128 bytes of nibbles (per 64 values, 32 bytes: low nibbles the first sub-block
    /// of 32, high the second); `w = d * sc * q - dmin * mn`.
    Q4K,
    /// Super-blocks of 256: as Q4_K, then 32 bytes `qh` before the nibbles (bit `j` of byte
    /// `l` is the 5th bit of value `l` of sub-block `j`).
    Q5K,
    /// Super-blocks of 256: 128 bytes of low nibbles `ql`, 64 bytes of high 2-bit pairs `qh`,
    /// 16 signed 8-bit scales (one per 16 values), then `d`; `w = d * sc * (q - 32)`.
    Q6K,
}

// Each kind as a `u8`, the const-generic parameter of the SIMD kernels.
pub(super) const Q4_0: u8 = GgmlKind::Q4_0 as u8;
pub(super) const Q4_1: u8 = GgmlKind::Q4_1 as u8;
pub(super) const Q5_0: u8 = GgmlKind::Q5_0 as u8;
pub(super) const Q8_0: u8 = GgmlKind::Q8_0 as u8;
pub(super) const Q4_K: u8 = GgmlKind::Q4K as u8;
pub(super) const Q5_K: u8 = GgmlKind::Q5K as u8;
pub(super) const Q6_K: u8 = GgmlKind::Q6K as u8;

impl GgmlKind {
    /// Every kind, for tests and benchmarks.
    pub const ALL: [GgmlKind; 7] = [
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q8_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
    ];

    /// Bytes of one GGML block (super-block for the K-quants).
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Values per GGML block: 32, or 256 for the K-quants.
    pub const fn block_len(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K | Self::Q6K => SUPER,
            _ => BLOCK,
        }
    }

    /// Whether this is a K-quant (super-blocks of 256).
    pub(super) const fn is_k(self) -> bool {
        self.block_len() == SUPER
    }

    /// Bytes of quant values (without scales) per block of 32 (Q4_0, Q4_1, Q5_0's nibbles,
    /// Q8_0); 0 for the K-quants, whose rows are not repacked.
    pub(super) const fn qs_bytes(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 => 16,
            Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 0,
        }
    }
}

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K / Q5_K super-block, from its 12
/// packed bytes `p`: sub-blocks 0..4 keep theirs in the low 6 bits of bytes 0..4 (scales) and
/// 4..8 (mins); sub-blocks 4..8 keep their low 4 bits in bytes 8..12 (scale in the low
/// nibble, min in the high one) and their top 2 bits in the top 2 bits of bytes 0..4
/// (scales) and 4..8 (mins).
pub(super) fn k_scales_mins(p: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 15) | ((p[j] >> 6) << 4);
        mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    (sc, mn)
}
