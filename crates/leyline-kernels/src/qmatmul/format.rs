//! The weight formats: GGML's Q4_0, Q4_1, Q5_0 and Q8_0 blocks of 32 and its K-quant
//! super-blocks of 256 (Q4_K, Q5_K, Q6_K), and [`QMatrix`], a matrix of them with one stream
//! per row, on its own or on huge pages shared by a model's matrices. Blocks of 32 are
//! repacked (scales first, then quant bytes); K-quant rows keep GGML's super-blocks as they are.
//! From the AVX2 tier up every kind is interleaved instead, in groups of 16 rows
//! (`interleave.rs`), and the kernels that read rows rebuild them ([`QMatrix::ggml_rows`]).

use super::kind::{k_scales_mins, GgmlKind, BLOCK};
use crate::error::{KernelError, Result};
use crate::mem::{Arena, ArenaBytes, HugeBuf};
use half::f16;
use std::borrow::Cow;
use std::ops::Deref;
use std::sync::Arc;

/// Zero bytes after the last row, so 16-wide f16 scale loads may run past a row's scales.
pub(super) const SLACK: usize = 64;

/// One quantized weight matrix `[rows = out_features, cols = in_features]`, one stream of the
/// same size per row. Q4_0, Q4_1, Q5_0 and Q8_0 rows are repacked: the `nb` f16 scales `d`,
/// then (Q4_1) the `nb` f16 minimums `m` or (Q5_0) the `nb` 4-byte `qh`, then the blocks'
/// quant bytes as GGML stores them. K-quant rows are GGML's super-blocks as they are, or
/// (`interleaved`) groups of 16 rows in the layout of `interleave.rs`.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub(super) kind: GgmlKind,
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// `rows * stride` bytes (interleaved: whole groups), then [`SLACK`] zero bytes.
    pub(super) data: Bytes,
    /// Whether `data` holds interleaved groups rather than rows.
    pub(super) interleaved: bool,
}

/// A matrix's bytes: a mapping of its own, or a piece of an [`Arena`] on huge pages that the
/// model's matrices share (built there by [`QMatrix::from_ggml_in`], or moved there by
/// [`QMatrix::share_pages`]). Its own bytes are a mapping rather than a heap vector so that
/// they go back to the system when they move: glibc keeps freed heap blocks of up to 32 MB,
/// and a 1.5B model's load stayed 0.6 GB above its weights that way; on small pages, since a
/// matrix of 0.2 MB in a huge page would take 2 MB until it moves.
#[derive(Debug, Clone)]
pub(super) enum Bytes {
    Own(HugeBuf<u8>),
    Shared(ArenaBytes),
    /// Left where they were stored ([`QMatrix::from_stored`]).
    Stored(Stored),
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Shared(b) => b,
            Bytes::Stored(s) => &(*s.owner).as_ref()[s.start..s.start + s.len],
        }
    }
}

/// Bytes that stay in a buffer owned elsewhere (a mapped file), kept alive here.
#[derive(Clone)]
pub(super) struct Stored {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    start: usize,
    len: usize,
}

impl std::fmt::Debug for Stored {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Stored({}..{})", self.start, self.start + self.len)
    }
}

/// Geometry of a row, shared by the kernels.
#[derive(Clone, Copy)]
pub(super) struct RowGeom {
    /// Units of 32 values per row (`cols / 32`).
    pub(super) nb: usize,
    /// Bytes per row.
    pub(super) stride: usize,
    /// Offset of the quant bytes in a repacked row (0 for the K-quants).
    pub(super) qs_off: usize,
    /// Offset of Q5_0's `qh` words in a row (0 for the other kinds).
    pub(super) qh_off: usize,
    /// Floats per row in the scale buffers of [`row_scales`] (its count rounded up to 16).
    pub(super) sb: usize,
}

/// f16 at `p[i..i + 2]` as f32.
fn half_at(p: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([p[i], p[i + 1]])).to_f32()
}

/// The f32 scales of one row of geometry `g`: value `v` of the row is `d[k] * q + mn[k]`
/// with `k = v / 16` for Q6_K, `v / 32` otherwise, and `q` the stored quant as an unsigned
/// integer (Q4_0, Q4_1, Q4_K: 0..16; Q5_0, Q5_K: 0..32 with the 5th bit; Q6_K: 0..64) or
/// Q8_0's signed byte. Every `d[k]` and `mn[k]` is exact in f32 (an f16 times an integer of
/// at most 8 bits), and so is `d[k] * q` (at most 24 significant bits): a kernel computing
/// `d * q + mn` rounds each weight once, to the f32 nearest the format's value.
pub(super) fn row_scales(kind: GgmlKind, g: RowGeom, row: &[u8], d: &mut [f32], mn: &mut [f32]) {
    match kind {
        GgmlKind::Q4_0 | GgmlKind::Q4_1 | GgmlKind::Q5_0 | GgmlKind::Q8_0 => {
            for b in 0..g.nb {
                d[b] = half_at(row, 2 * b);
                mn[b] = match kind {
                    GgmlKind::Q4_0 => -8.0 * d[b],
                    GgmlKind::Q4_1 => half_at(row, 2 * g.nb + 2 * b),
                    GgmlKind::Q5_0 => -16.0 * d[b],
                    _ => 0.0,
                };
            }
        }
        GgmlKind::Q4K | GgmlKind::Q5K => {
            for (s, blk) in row.chunks_exact(kind.block_bytes()).enumerate() {
                let (dd, dmin) = (half_at(blk, 0), half_at(blk, 2));
                let (sc, mins) = k_scales_mins(&blk[4..16]);
                for j in 0..8 {
                    d[8 * s + j] = dd * f32::from(sc[j]);
                    mn[8 * s + j] = -dmin * f32::from(mins[j]);
                }
            }
        }
        GgmlKind::Q6K => {
            for (s, blk) in row.chunks_exact(kind.block_bytes()).enumerate() {
                let dd = half_at(blk, 208);
                for j in 0..16 {
                    let v = dd * f32::from(blk[192 + j] as i8);
                    d[16 * s + j] = v;
                    mn[16 * s + j] = -32.0 * v;
                }
            }
        }
    }
}

/// GGML's rows `raw` of `kind` (`cols` values each) into `dst` in [`QMatrix`]'s row
/// layout: the kinds in blocks of 32 repacked, the K-quants as they are.
fn repack(kind: GgmlKind, cols: usize, raw: &[u8], dst: &mut [u8]) {
    if kind.is_k() {
        dst.copy_from_slice(raw);
        return;
    }
    let g = QMatrix::geom_of(kind, cols);
    let (nb, qb) = (g.nb, kind.qs_bytes());
    for (src, dst) in raw
        .chunks_exact(g.stride)
        .zip(dst.chunks_exact_mut(g.stride))
    {
        for (b, blk) in src.chunks_exact(kind.block_bytes()).enumerate() {
            dst[2 * b..2 * b + 2].copy_from_slice(&blk[0..2]);
            let q = match kind {
                GgmlKind::Q4_1 => {
                    dst[2 * nb + 2 * b..2 * nb + 2 * b + 2].copy_from_slice(&blk[2..4]);
                    &blk[4..20]
                }
                GgmlKind::Q5_0 => {
                    dst[g.qh_off + 4 * b..g.qh_off + 4 * b + 4].copy_from_slice(&blk[2..6]);
                    &blk[6..22]
                }
                _ => &blk[2..],
            };
            dst[g.qs_off + b * qb..g.qs_off + (b + 1) * qb].copy_from_slice(q);
        }
    }
}

impl QMatrix {
    /// Repacks raw GGML block bytes of a `[rows, cols]` matrix (row-major blocks).
    ///
    /// # Errors
    /// [`KernelError::Quantized`] when `cols` is not a positive multiple of the kind's block
    /// length (32, or 256 for the K-quants) or `raw` has the wrong length.
    pub fn from_ggml(kind: GgmlKind, raw: &[u8], rows: usize, cols: usize) -> Result<Self> {
        Self::from_ggml_in(kind, raw, rows, cols, None)
    }

    /// [`Self::from_ggml`], built straight into a piece of `arena` when one is given and has
    /// room ([`Self::stored_len`] bytes), else into a buffer of its own.
    ///
    /// # Errors
    /// As [`Self::from_ggml`].
    pub fn from_ggml_in(
        kind: GgmlKind,
        raw: &[u8],
        rows: usize,
        cols: usize,
        arena: Option<&Arc<Arena>>,
    ) -> Result<Self> {
        let want = Self::ggml_len(kind, rows, cols)?;
        if raw.len() != want {
            return Err(KernelError::Quantized(format!(
                "quantized matrix {kind:?} [{rows}, {cols}]: {} bytes, expected {want}",
                raw.len()
            )));
        }
        let interleaved = Self::interleaves();
        let len = Self::layout_len(kind, rows, cols, interleaved);
        let fill = |dst: &mut [u8]| {
            #[cfg(target_arch = "x86_64")]
            if interleaved {
                super::interleave::interleave(kind, raw, rows, cols, &mut dst[..len]);
                return;
            }
            repack(kind, cols, raw, &mut dst[..len]);
        };
        let data = match arena.and_then(|a| a.take(len + SLACK)) {
            Some(mut piece) => {
                fill(&mut piece);
                Bytes::Shared(piece.freeze())
            }
            None => {
                let mut own = HugeBuf::<u8>::zeroed_small_pages(len + SLACK);
                fill(&mut own);
                Bytes::Own(own)
            }
        };
        Ok(Self {
            kind,
            rows,
            cols,
            data,
            interleaved,
        })
    }

    /// A K-quant matrix left where it is stored: GGML's rows at `owner[start..]`, which must
    /// be followed by at least [`SLACK`] bytes of the same buffer (the kernels' loads may run
    /// past the last row; those bytes are read, not used). For tables read by rows, such as
    /// an embedding that is not also the output head: nothing is copied, and a product over
    /// it takes the f32 kernels. `None` for the kinds in blocks of 32 (their row layout is
    /// repacked) and where fewer than [`SLACK`] bytes follow.
    ///
    /// # Errors
    /// As [`Self::from_ggml`], for the shape; a range outside `owner`.
    pub fn from_stored(
        kind: GgmlKind,
        rows: usize,
        cols: usize,
        owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
        start: usize,
    ) -> Result<Option<Self>> {
        let len = Self::ggml_len(kind, rows, cols)?;
        let have = (*owner).as_ref().len();
        let end = start
            .checked_add(len)
            .filter(|&e| e <= have)
            .ok_or_else(|| {
                KernelError::Quantized(format!(
                    "quantized matrix {kind:?} [{rows}, {cols}]: bytes {start}.. of a buffer of \
                     {have}"
                ))
            })?;
        if !kind.is_k() || have - end < SLACK {
            return Ok(None);
        }
        Ok(Some(Self {
            kind,
            rows,
            cols,
            data: Bytes::Stored(Stored {
                owner,
                start,
                len: len + SLACK,
            }),
            interleaved: false,
        }))
    }

    /// Bytes a `[rows, cols]` matrix of `kind` takes once built, [`SLACK`] included: what an
    /// [`Arena`] needs for it ([`Self::from_ggml_in`]).
    ///
    /// # Errors
    /// As [`Self::from_ggml`], for the shape.
    pub fn stored_len(kind: GgmlKind, rows: usize, cols: usize) -> Result<usize> {
        Self::ggml_len(kind, rows, cols)?;
        Ok(Self::layout_len(kind, rows, cols, Self::interleaves()) + SLACK)
    }

    /// GGML's bytes for the shape, checked.
    fn ggml_len(kind: GgmlKind, rows: usize, cols: usize) -> Result<usize> {
        let len = kind.block_len();
        if cols == 0 || !cols.is_multiple_of(len) {
            return Err(KernelError::Quantized(format!(
                "quantized matrix {kind:?}: {cols} columns is not a positive multiple of {len}"
            )));
        }
        rows.checked_mul(cols / len)
            .and_then(|b| b.checked_mul(kind.block_bytes()))
            .ok_or_else(|| KernelError::Quantized("quantized matrix: size overflows".into()))
    }

    /// Whether matrices built now are interleaved: the integer kernels from the AVX2 tier up
    /// read groups of 16 rows (`interleave.rs`).
    fn interleaves() -> bool {
        #[cfg(target_arch = "x86_64")]
        return crate::Tier::best() >= crate::Tier::Avx2;
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// Bytes of the layout before [`SLACK`]: interleaved groups, or GGML's size.
    fn layout_len(kind: GgmlKind, rows: usize, cols: usize, interleaved: bool) -> usize {
        #[cfg(target_arch = "x86_64")]
        if interleaved {
            return super::interleave::interleaved_len(kind, rows, cols);
        }
        let _ = interleaved;
        rows * (cols / kind.block_len()) * kind.block_bytes()
    }

    /// Rows `r0 .. r0 + n` in GGML's layout (repacked for the kinds in blocks of 32), then
    /// [`SLACK`] zero bytes: borrowed, or rebuilt from an interleaved matrix (for the kernels
    /// that read rows).
    pub(super) fn ggml_rows(&self, r0: usize, n: usize) -> Cow<'_, [u8]> {
        let stride = Self::geom_of(self.kind, self.cols).stride;
        assert!(
            r0 + n <= self.rows,
            "rows {r0}..{} of {}",
            r0 + n,
            self.rows
        );
        #[cfg(target_arch = "x86_64")]
        if self.interleaved {
            let mut raw = vec![0u8; n * stride];
            super::interleave::deinterleave(self.kind, &self.data, self.cols, r0, &mut raw);
            let mut out = vec![0u8; n * stride + SLACK];
            repack(self.kind, self.cols, &raw, &mut out[..n * stride]);
            return Cow::Owned(out);
        }
        Cow::Borrowed(&self.data[r0 * stride..(r0 + n) * stride + SLACK])
    }

    /// Moves the bytes of `mats` that are not yet in an [`Arena`] into one new arena on
    /// transparent huge pages, in the order given (a forward's order makes one forward
    /// stream); matrices built in an arena ([`Self::from_ggml_in`]) or left where they are
    /// stored ([`Self::from_stored`]) stay where they are. A
    /// decode step reads every weight once; on 4 KiB pages that is a page walk per 4 KiB,
    /// expensive under virtualization, and a matrix of 0.2-1.7 MB in a mapping of its own
    /// holds no whole 2 MiB page. Products are unchanged: the same bytes, in another place.
    pub fn share_pages<'a>(mats: impl IntoIterator<Item = &'a mut QMatrix>) {
        let mut mats: Vec<&mut QMatrix> = mats
            .into_iter()
            .filter(|m| matches!(m.data, Bytes::Own(_)))
            .collect();
        if mats.is_empty() {
            return;
        }
        let total = mats
            .iter()
            .try_fold(0usize, |t, m| {
                t.checked_add(m.data.len().next_multiple_of(64))
            })
            .expect("the sizes of matrices that exist add up");
        let arena = Arena::new(total);
        for m in &mut mats {
            let mut piece = arena
                .take(m.data.len())
                .expect("the arena was sized for these matrices");
            piece.copy_from_slice(&m.data);
            // Each matrix's old bytes go as they move, so that loading a model never holds
            // its weights twice (the arena's pages are only touched as they are written).
            m.data = Bytes::Shared(piece.freeze());
        }
    }

    pub(super) fn geom_of(kind: GgmlKind, cols: usize) -> RowGeom {
        let nb = cols / BLOCK;
        let stride = cols / kind.block_len() * kind.block_bytes();
        let (qs_off, qh_off) = match kind {
            GgmlKind::Q4_1 => (4 * nb, 0),
            GgmlKind::Q5_0 => (6 * nb, 2 * nb),
            GgmlKind::Q4_0 | GgmlKind::Q8_0 => (2 * nb, 0),
            GgmlKind::Q4K | GgmlKind::Q5K | GgmlKind::Q6K => (0, 0),
        };
        let scales = if kind == GgmlKind::Q6K { 2 * nb } else { nb };
        RowGeom {
            nb,
            stride,
            qs_off,
            qh_off,
            sb: scales.div_ceil(16) * 16,
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
        self.rows * (self.cols / self.kind.block_len()) * self.kind.block_bytes()
    }
}
