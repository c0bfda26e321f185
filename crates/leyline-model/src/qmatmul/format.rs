//! The weight formats: GGML's Q4_1 and Q8_0 blocks, and [`QMatrix`], a matrix of them
//! repacked into one stream per row (scales first, then quant bytes), on its own or on
//! huge pages shared by a model's matrices.

use crate::error::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use leyline_kv::mem::HugeBuf;
use std::ops::Deref;
use std::sync::Arc;

/// Values per GGML block (both supported kinds).
pub(super) const BLOCK: usize = 32;
/// Zero bytes after the last row, so 16-wide f16 scale loads may run past a row's scales.
pub(super) const SLACK: usize = 64;

/// The quantized weight formats [`QMatrix`] accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlKind {
    /// Blocks of 32: f16 scale `d`, f16 minimum `m`, 16 bytes of nibbles; `w = d * q + m`.
    Q4_1,
    /// Blocks of 32: f16 scale `d`, 32 signed bytes; `w = d * q`.
    Q8_0,
}

impl GgmlKind {
    /// Bytes of one GGML block.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Bytes of quant values (without scales) per block.
    pub(super) const fn qs_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 16,
            Self::Q8_0 => 32,
        }
    }
}

/// One quantized weight matrix `[rows = out_features, cols = in_features]`, repacked from
/// GGML blocks so each row is one stream of the same size: `nb` f16 scales `d`, then (Q4_1)
/// `nb` f16 minimums `m`, then the `nb` blocks' quant bytes as GGML stores them.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub(super) kind: GgmlKind,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// `rows * stride` bytes, then [`SLACK`] zero bytes.
    pub(super) data: Bytes,
}

/// A matrix's bytes: a vector of its own once built, a range of a buffer that the model's
/// matrices share after [`QMatrix::share_pages`].
#[derive(Debug, Clone)]
pub(super) enum Bytes {
    Own(Vec<u8>),
    Shared {
        buf: Arc<HugeBuf<u8>>,
        start: usize,
        len: usize,
    },
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Shared { buf, start, len } => &buf[*start..*start + *len],
        }
    }
}

/// Geometry of a row, shared by the kernels.
#[derive(Clone, Copy)]
pub(super) struct RowGeom {
    /// Blocks per row.
    pub(super) nb: usize,
    /// Bytes per row.
    pub(super) stride: usize,
    /// Offset of the quant bytes in a row.
    pub(super) qs_off: usize,
    /// Floats per row in the scale buffers (`nb` rounded up to 16).
    pub(super) sb: usize,
}

impl QMatrix {
    /// Repacks raw GGML block bytes of a `[rows, cols]` matrix (row-major blocks).
    ///
    /// # Errors
    /// [`ModelError::Input`] when `cols` is not a multiple of 32 or `raw` has the wrong length.
    pub fn from_ggml(kind: GgmlKind, raw: &[u8], rows: usize, cols: usize) -> Result<Self> {
        if cols == 0 || !cols.is_multiple_of(BLOCK) {
            return Err(ModelError::Input(format!(
                "quantized matrix: {cols} columns is not a positive multiple of {BLOCK}"
            )));
        }
        let nb = cols / BLOCK;
        let want = rows
            .checked_mul(nb)
            .and_then(|b| b.checked_mul(kind.block_bytes()))
            .ok_or_else(|| ModelError::Input("quantized matrix: size overflows".into()))?;
        if raw.len() != want {
            return Err(ModelError::Input(format!(
                "quantized matrix {kind:?} [{rows}, {cols}]: {} bytes, expected {want}",
                raw.len()
            )));
        }
        let mut data = vec![0u8; want + SLACK];
        let g = Self::geom_of(kind, cols);
        let qb = kind.qs_bytes();
        for (r, (src, dst)) in raw
            .chunks_exact(g.stride)
            .zip(data.chunks_exact_mut(g.stride))
            .enumerate()
        {
            debug_assert!(r < rows);
            for (b, blk) in src.chunks_exact(kind.block_bytes()).enumerate() {
                dst[2 * b..2 * b + 2].copy_from_slice(&blk[0..2]);
                let q = match kind {
                    GgmlKind::Q4_1 => {
                        dst[2 * nb + 2 * b..2 * nb + 2 * b + 2].copy_from_slice(&blk[2..4]);
                        &blk[4..20]
                    }
                    GgmlKind::Q8_0 => &blk[2..34],
                };
                dst[g.qs_off + b * qb..g.qs_off + (b + 1) * qb].copy_from_slice(q);
            }
        }
        Ok(Self {
            kind,
            rows,
            cols,
            data: Bytes::Own(data),
        })
    }

    /// Moves the bytes of `mats` into one buffer on transparent huge pages, in the order
    /// given (a forward's order makes one forward stream). A decode step reads every weight
    /// once; on 4 KiB pages that is a page walk per 4 KiB, expensive under virtualization,
    /// and a matrix of 0.2-1.7 MB in a mapping of its own holds no whole 2 MiB page. Products
    /// are unchanged: the same bytes, in another place.
    pub fn share_pages<'a>(mats: impl IntoIterator<Item = &'a mut QMatrix>) {
        let mut mats: Vec<&mut QMatrix> = mats.into_iter().collect();
        // Each matrix starts on a cache line.
        let at = |len: usize| len.next_multiple_of(64);
        let total: usize = mats.iter().map(|m| at(m.data.len())).sum();
        let mut buf = HugeBuf::<u8>::zeroed(total);
        let mut spans = Vec::with_capacity(mats.len());
        let mut start = 0;
        for m in &mats {
            let len = m.data.len();
            buf[start..start + len].copy_from_slice(&m.data);
            spans.push((start, len));
            start += at(len);
        }
        let buf = Arc::new(buf);
        for (m, (start, len)) in mats.iter_mut().zip(spans) {
            m.data = Bytes::Shared {
                buf: Arc::clone(&buf),
                start,
                len,
            };
        }
    }

    /// Repacks a 2-D Q4_1 or Q8_0 [`QTensor`] of shape `[rows, cols]`.
    ///
    /// # Errors
    /// Another dtype or rank, or unreadable data.
    pub fn from_qtensor(t: &QTensor) -> Result<Self> {
        let kind = match t.dtype() {
            GgmlDType::Q4_1 => GgmlKind::Q4_1,
            GgmlDType::Q8_0 => GgmlKind::Q8_0,
            other => {
                return Err(ModelError::Input(format!(
                    "quantized matrix: dtype {other:?} is not supported (Q4_1, Q8_0)"
                )))
            }
        };
        let (rows, cols) = t.shape().dims2()?;
        let data = t.data()?;
        Self::from_ggml(kind, &data, rows, cols)
    }

    pub(super) fn geom_of(kind: GgmlKind, cols: usize) -> RowGeom {
        let nb = cols / BLOCK;
        let scales = if kind == GgmlKind::Q4_1 {
            4 * nb
        } else {
            2 * nb
        };
        RowGeom {
            nb,
            stride: nb * kind.block_bytes(),
            qs_off: scales,
            sb: nb.div_ceil(16) * 16,
        }
    }

    /// The weight format.
    pub fn kind(&self) -> GgmlKind {
        self.kind
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes the weights take in GGML form (what a product must read).
    pub fn weight_bytes(&self) -> usize {
        self.rows * (self.cols / BLOCK) * self.kind.block_bytes()
    }
}
