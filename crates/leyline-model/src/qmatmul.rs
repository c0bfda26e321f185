//! CPU matrix products with GGML-quantized weights (Q4_1, Q8_0) and f32 activations, for
//! decode steps and short prefills (up to 96 activation rows with AVX-512, 32 elsewhere).
//!
//! Design decision: activations stay f32 and each 32-weight block is dequantized in
//! registers or into an L1 buffer (`w = d * q + m`), so results match the f32-dequantized
//! weights up to float rounding. Few rows meet a tile of weight rows in dot products, the
//! weights read once per 32 activation rows; from 13 rows, where little of a vector would be
//! padding, AVX-512 broadcasts each weight against 16 transposed activation rows per vector,
//! up to 64 rows per pass over the weights. Output rows are split over the threads; the SIMD
//! path (AVX-512F, AVX2+FMA+F16C, scalar) is chosen at run time.

use crate::error::{ModelError, Result};
use crate::pool::{split, SpinPool};
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;
use leyline_kv::mem::HugeBuf;
use rayon::prelude::*;
use std::ops::Deref;
use std::sync::{Arc, Mutex, OnceLock};

/// Values per GGML block (both supported kinds).
const BLOCK: usize = 32;
/// Zero bytes after the last row, so 16-wide f16 scale loads may run past a row's scales.
const SLACK: usize = 64;
/// How far ahead of the current row tile the kernels prefetch weights.
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

/// Asks for the bytes [`PREFETCH`] past the tile of rows `r..r + rt` of `rows` (rows of
/// `stride` bytes); the tile's own rows are read while those are in flight (hardware
/// prefetchers stop at pages).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_past_tile(rows: &[u8], stride: usize, r: usize, rt: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = (r + rt) * stride + PREFETCH;
    let end = (ahead + rt * stride).min(rows.len());
    for off in (ahead..end).step_by(64) {
        // SAFETY: off < rows.len(), a valid address; a prefetch never faults or writes.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(off).cast::<i8>()) };
    }
}
/// Below this many weight bytes (times min(m, 4)) a product runs on the calling thread.
const SERIAL_BYTES: usize = 96 * 1024;

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
    const fn qs_bytes(self) -> usize {
        match self {
            Self::Q4_1 => 16,
            Self::Q8_0 => 32,
        }
    }
}

/// A SIMD code path of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KernelPath {
    /// Portable Rust, any CPU.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512F.
    Avx512,
}

impl KernelPath {
    /// Whether this CPU can run the path (detected once, then cached).
    pub fn is_available(self) -> bool {
        self <= Self::best()
    }

    /// The fastest path this CPU supports.
    pub fn best() -> Self {
        static BEST: OnceLock<KernelPath> = OnceLock::new();
        *BEST.get_or_init(detect)
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> KernelPath {
    if std::arch::is_x86_feature_detected!("avx512f") {
        KernelPath::Avx512
    } else if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        KernelPath::Avx2
    } else {
        KernelPath::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> KernelPath {
    KernelPath::Scalar
}

/// One quantized weight matrix `[rows = out_features, cols = in_features]`, repacked from
/// GGML blocks so each row is one stream of the same size: `nb` f16 scales `d`, then (Q4_1)
/// `nb` f16 minimums `m`, then the `nb` blocks' quant bytes as GGML stores them.
#[derive(Debug, Clone)]
pub struct QMatrix {
    kind: GgmlKind,
    rows: usize,
    cols: usize,
    /// `rows * stride` bytes, then [`SLACK`] zero bytes.
    data: Bytes,
}

/// A matrix's bytes: a vector of its own once built, a range of a buffer that the model's
/// matrices share after [`QMatrix::share_pages`].
#[derive(Debug, Clone)]
enum Bytes {
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
struct RowGeom {
    /// Blocks per row.
    nb: usize,
    /// Bytes per row.
    stride: usize,
    /// Offset of the quant bytes in a row.
    qs_off: usize,
    /// Floats per row in the scale buffers (`nb` rounded up to 16).
    sb: usize,
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

    fn geom_of(kind: GgmlKind, cols: usize) -> RowGeom {
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

    /// `y = x W^T` for `x: [m, cols]` and `y: [m, rows]` (row-major) on a chosen kernel
    /// path, split over rayon's threads: for tests and benchmarks that compare the paths. The
    /// engine's products go through [`Self::matmul_concat`].
    ///
    /// # Panics
    /// If the path is not available on this CPU, `x.len() != m * cols` or
    /// `y.len() != m * rows`.
    pub fn matmul_with(&self, path: KernelPath, x: &[f32], m: usize, y: &mut [f32]) {
        assert!(
            path.is_available(),
            "kernel path {path:?} is not available on this CPU"
        );
        assert_eq!(x.len(), m * self.cols, "x must be [m, cols]");
        assert_eq!(y.len(), m * self.rows, "y must be [m, rows]");
        if m == 0 || self.rows == 0 {
            return;
        }
        let serial = self.weight_bytes() * m.min(4) < SERIAL_BYTES;
        let mut xt = Vec::new();
        prepare(None, path, x, m, self.cols, &mut xt);
        let xt = xt.as_slice();
        // Rows per task: about four tasks per thread, a multiple of 4 rows.
        let tile = (self
            .rows
            .div_ceil(rayon::current_num_threads().max(1) * 4)
            .div_ceil(4)
            * 4)
        .max(16);
        if m == 1 {
            // y is already [rows, 1]: write it in place.
            if serial {
                self.rows_into(path, 0, x, xt, 1, y);
            } else {
                y.par_chunks_mut(tile).enumerate().for_each(|(t, out)| {
                    self.rows_into(path, t * tile, x, xt, 1, out);
                });
            }
            return;
        }
        // Compute [rows, m], then transpose into [m, rows].
        let mut yt = vec![0f32; self.rows * m];
        if serial {
            self.rows_into(path, 0, x, xt, m, &mut yt);
        } else {
            yt.par_chunks_mut(tile * m)
                .enumerate()
                .for_each(|(t, out)| {
                    self.rows_into(path, t * tile, x, xt, m, out);
                });
        }
        feature_major_to_rows(&yt, m, y, self.rows, 0);
    }

    /// `y = x [W_0 | W_1 | ...]^T` for `x: [m, cols]` and `y: [m, sum of rows_i]`, each row of
    /// `y` holding the products side by side, in one region of `pool`: every thread computes
    /// its share of the rows of every matrix, so a decode step pays one dispatch for, e.g.,
    /// the Q, K and V projections together.
    ///
    /// # Panics
    /// If `x.len() != m * cols` of some matrix or `y` is not `[m, sum of rows_i]`.
    pub fn matmul_concat(pool: &SpinPool, x: &[f32], m: usize, mats: &[&QMatrix], y: &mut [f32]) {
        let width: usize = mats.iter().map(|w| w.rows).sum();
        assert_eq!(y.len(), m * width, "y must be [m, sum of rows]");
        for w in mats {
            assert_eq!(x.len(), m * w.cols, "x must be [m, cols]");
        }
        let path = KernelPath::best();
        if m == 1 {
            // One row: each product is a slice of it, already in the kernels' [rows_i, 1].
            let mut targets = Vec::with_capacity(mats.len());
            let mut rest = y;
            for &w in mats {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(w.rows);
                targets.push((w, head));
                rest = tail;
            }
            Self::feature_major_many(pool, path, x, &[], 1, targets.into_iter());
            return;
        }
        SCRATCH.with_borrow_mut(|Scratch { xt, yt }| {
            // One transposition (if the kernel wants one) serves every matrix and thread.
            if let Some(w) = mats.first() {
                prepare(Some(pool), path, x, m, w.cols, xt);
            }
            if yt.len() < m * width {
                yt.resize(m * width, 0.0);
            }
            let mut targets = Vec::with_capacity(mats.len());
            let mut rest = &mut yt[..m * width];
            for &w in mats {
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(w.rows * m);
                targets.push((w, head));
                rest = tail;
            }
            Self::feature_major_many(pool, path, x, xt, m, targets.into_iter());
            let (mut col, mut at) = (0, 0);
            for w in mats {
                feature_major_to_rows(&yt[at..at + w.rows * m], m, y, width, col);
                col += w.rows;
                at += w.rows * m;
            }
        });
    }

    /// The products of [`Self::matmul_concat`] into feature-major `[rows_i, m]` targets.
    fn feature_major_many<'a>(
        pool: &SpinPool,
        path: KernelPath,
        x: &[f32],
        xt: &[f32],
        m: usize,
        targets: impl Iterator<Item = (&'a QMatrix, &'a mut [f32])>,
    ) {
        let parts = pool.threads();
        let mut pieces: Vec<Vec<Mutex<&mut [f32]>>> = Vec::new();
        let mut mats: Vec<&QMatrix> = Vec::new();
        for (w, mut out) in targets {
            let mut v = Vec::with_capacity(parts);
            for p in 0..parts {
                let r = split(w.rows, p, parts, 4);
                let (head, tail) = out.split_at_mut(r.len() * m);
                v.push(Mutex::new(head));
                out = tail;
            }
            pieces.push(v);
            mats.push(w);
        }
        pool.run(&|tid, n| {
            for (w, piece) in mats.iter().zip(&pieces) {
                let r = split(w.rows, tid, n, 4);
                if r.is_empty() {
                    continue;
                }
                let mut out = piece[tid].lock().unwrap_or_else(|e| e.into_inner());
                w.rows_into(path, r.start, x, xt, m, &mut out);
            }
        });
    }

    /// Computes rows `r0 .. r0 + out.len() / m` into `out: [n, m]`.
    /// `xt` is `x` as [`prepare`] leaves it for `path` at `m` rows.
    fn rows_into(
        &self,
        path: KernelPath,
        r0: usize,
        x: &[f32],
        xt: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        let n = out.len() / m;
        assert!(r0 + n <= self.rows && out.len() == n * m && x.len() == m * self.cols);
        let g = Self::geom_of(self.kind, self.cols);
        let rows = &self.data[r0 * g.stride..(r0 + n) * g.stride + SLACK];
        match path {
            KernelPath::Scalar => scalar::rows(self.kind, g, rows, x, m, out),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => {
                // SAFETY: `matmul_with` asserted the path is available, i.e. this CPU has
                // AVX2, FMA and F16C; the slice lengths were asserted above.
                unsafe { avx2::rows(self.kind, g, rows, x, m, out) }
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => {
                // SAFETY: as above; the CPU has AVX-512F.
                unsafe { avx512::rows(self.kind, g, rows, x, xt, m, out) }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("only the scalar path is available off x86-64"),
        }
    }
}

/// Buffers of [`QMatrix::matmul_concat`], kept per calling thread between calls.
#[derive(Default)]
struct Scratch {
    /// The activations as [`prepare`] leaves them.
    xt: Vec<f32>,
    /// The feature-major products before [`feature_major_to_rows`].
    yt: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Puts `x: [m, cols]` into `xt` in the layout the kernel of `path` wants at `m` rows, if it
/// wants one other than `x` itself (AVX-512's broadcast tiles: transposed groups of 32 rows),
/// the columns split over `pool`'s threads (or serial without a pool). `xt` only grows.
fn prepare(
    pool: Option<&SpinPool>,
    path: KernelPath,
    x: &[f32],
    m: usize,
    cols: usize,
    xt: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    if path == KernelPath::Avx512 && avx512::bcast_pays(m) {
        let len = avx512::transposed_len(m, cols);
        if xt.len() < len {
            xt.resize(len, 0.0);
        }
        let parts = pool.map_or(1, SpinPool::threads);
        // Group (of 32 rows) by part: each piece is one group's columns `c`.
        let mut pieces = Vec::with_capacity(m.div_ceil(32) * parts);
        let mut rest = &mut xt[..len];
        for i0 in (0..m).step_by(avx512::GROUP) {
            let lanes = (m - i0).min(avx512::GROUP).div_ceil(16) * 16;
            for p in 0..parts {
                let c = split(cols, p, parts, 1);
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len() * lanes);
                pieces.push((i0, c, Mutex::new(head)));
                rest = tail;
            }
        }
        let job = |tid: usize, _: usize| {
            for (i0, c, dst) in pieces.iter().skip(tid).step_by(parts) {
                let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: the path is AVX-512, which the caller checked this CPU has.
                unsafe { avx512::transpose_cols(x, m, cols, *i0, c.clone(), &mut dst) };
            }
        };
        match pool {
            Some(pool) => pool.run(&job),
            None => job(0, 1),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (pool, path, x, m, cols, xt);
}

/// Transposes the kernels' feature-major output `yt: [rows, m]` into columns `col ..` of
/// `y: [m, stride]`.
fn feature_major_to_rows(yt: &[f32], m: usize, y: &mut [f32], stride: usize, col: usize) {
    for (r, ys) in yt.chunks_exact(m).enumerate() {
        for (i, &v) in ys.iter().enumerate() {
            y[i * stride + col + r] = v;
        }
    }
}

mod scalar {
    use super::{f16, GgmlKind, RowGeom, BLOCK, SLACK};

    /// `rows` holds `n` rows then the slack; `out: [n, m]`.
    pub(super) fn rows(
        kind: GgmlKind,
        g: RowGeom,
        rows: &[u8],
        x: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        let cols = g.nb * BLOCK;
        let mut w = vec![0f32; cols];
        let n = (rows.len() - SLACK) / g.stride;
        for (row, ys) in rows
            .chunks_exact(g.stride)
            .take(n)
            .zip(out.chunks_exact_mut(m))
        {
            let half_at =
                |i: usize| f16::from_bits(u16::from_le_bytes([row[i], row[i + 1]])).to_f32();
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
}

/// Activation rows up to which the kernels dequantize weights in registers for each chunk of
/// at most 4 rows; above it a tile's rows are dequantized once into an f32 buffer that every
/// chunk then reads, so the conversion is not repeated per chunk. Measured on SmolLM2's
/// decode shapes (2 threads, AVX-512): see BENCHMARKS.md, "Few-row products".
const DIRECT_MAX_M: usize = 4;

/// Defines `$name`, the driver of one ISA's tile kernels: for each tile of `R` output rows
/// (`R1` when m == 1, else `RM`; single rows for the remainder) it converts the tile's
/// scales to f32, then runs `q4_1` / `q8_0::<R, M>` for chunks of `M <= 4` activation rows,
/// or, above [`DIRECT_MAX_M`] rows, `dequant` once and `f32_tile::<R, M>` per chunk.
#[cfg(target_arch = "x86_64")]
macro_rules! tile_driver {
    ($name:ident, $feat:literal, $r1:literal, $rm:literal, $scales:ident) => {
        /// `rows` holds `n` rows then the slack; `out: [n, m]`, `x: [m, cols]`.
        ///
        /// # Safety
        /// The CPU must support the module's target features; `rows.len() == n * g.stride
        /// + SLACK`, `x.len() == m * cols` and `out.len() == n * m` (checked by `rows_into`).
        #[target_feature(enable = $feat)]
        pub(super) unsafe fn $name(
            kind: GgmlKind,
            g: RowGeom,
            rows: &[u8],
            x: &[f32],
            m: usize,
            out: &mut [f32],
        ) {
            let n = (rows.len() - SLACK) / g.stride;
            assert!(rows.len() == n * g.stride + SLACK && out.len() == n * m);
            assert!(x.len() == m * g.nb * BLOCK);
            let r_tile = if m == 1 { $r1 } else { $rm };
            let mut dbuf = vec![0f32; r_tile * g.sb];
            let mut mbuf = vec![0f32; r_tile * g.sb];
            let cols = g.nb * BLOCK;
            let mut wbuf = if m > DIRECT_MAX_M {
                vec![0f32; r_tile * cols]
            } else {
                Vec::new()
            };
            let mut r = 0;
            while r < n {
                let rt = if n - r >= r_tile { r_tile } else { 1 };
                for j in 0..rt {
                    // SAFETY: row r + j < n starts inside `rows`, and the conversion reads
                    // at most 32 bytes past a row's scales, inside the row or the slack;
                    // dbuf/mbuf hold rt * sb floats.
                    unsafe {
                        $scales(
                            kind,
                            g,
                            rows.as_ptr().add((r + j) * g.stride),
                            j,
                            &mut dbuf,
                            &mut mbuf,
                        )
                    };
                }
                prefetch_past_tile(rows, g.stride, r, rt);
                if m > DIRECT_MAX_M {
                    // SAFETY: rows r .. r + rt lie in `rows` and their scales were converted
                    // above; wbuf holds r_tile * cols floats, x holds m rows and out n * m.
                    unsafe {
                        dequant(
                            kind,
                            g,
                            rows[r * g.stride..].as_ptr(),
                            rt,
                            &dbuf,
                            &mbuf,
                            &mut wbuf,
                        );
                        let mut i = 0;
                        while i < m {
                            let mc = (m - i).min(4);
                            let (w, xi) = (wbuf.as_ptr(), x[i * cols..].as_ptr());
                            let o = out[r * m + i..].as_mut_ptr();
                            match (rt == 1, mc) {
                                (true, 1) => f32_tile::<1, 1>(w, xi, cols, o, m),
                                (true, 2) => f32_tile::<1, 2>(w, xi, cols, o, m),
                                (true, 3) => f32_tile::<1, 3>(w, xi, cols, o, m),
                                (true, _) => f32_tile::<1, 4>(w, xi, cols, o, m),
                                (false, 1) => f32_tile::<$rm, 1>(w, xi, cols, o, m),
                                (false, 2) => f32_tile::<$rm, 2>(w, xi, cols, o, m),
                                (false, 3) => f32_tile::<$rm, 3>(w, xi, cols, o, m),
                                (false, _) => f32_tile::<$rm, 4>(w, xi, cols, o, m),
                            }
                            i += mc;
                        }
                    }
                    r += rt;
                    continue;
                }
                let mut i = 0;
                while i < m {
                    let mc = (m - i).min(4);
                    let t = Tile {
                        w: rows[r * g.stride..].as_ptr(),
                        g,
                        d: dbuf.as_ptr(),
                        mn: mbuf.as_ptr(),
                        x: x[i * g.nb * BLOCK..].as_ptr(),
                        out: out[r * m + i..].as_mut_ptr(),
                        ostride: m,
                    };
                    // SAFETY: the tile covers rows r .. r + rt < = n and activation rows
                    // i .. i + mc <= m, whose bytes / floats lie in `rows`, `x` and `out` by
                    // the asserts above; the scale buffers were filled for these rows.
                    unsafe {
                        match (kind, rt == 1, mc) {
                            (GgmlKind::Q4_1, true, 1) => q4_1::<1, 1>(&t),
                            (GgmlKind::Q4_1, true, 2) => q4_1::<1, 2>(&t),
                            (GgmlKind::Q4_1, true, 3) => q4_1::<1, 3>(&t),
                            (GgmlKind::Q4_1, true, _) => q4_1::<1, 4>(&t),
                            (GgmlKind::Q4_1, false, 1) if m == 1 => q4_1::<$r1, 1>(&t),
                            (GgmlKind::Q4_1, false, 1) => q4_1::<$rm, 1>(&t),
                            (GgmlKind::Q4_1, false, 2) => q4_1::<$rm, 2>(&t),
                            (GgmlKind::Q4_1, false, 3) => q4_1::<$rm, 3>(&t),
                            (GgmlKind::Q4_1, false, _) => q4_1::<$rm, 4>(&t),
                            (GgmlKind::Q8_0, true, 1) => q8_0::<1, 1>(&t),
                            (GgmlKind::Q8_0, true, 2) => q8_0::<1, 2>(&t),
                            (GgmlKind::Q8_0, true, 3) => q8_0::<1, 3>(&t),
                            (GgmlKind::Q8_0, true, _) => q8_0::<1, 4>(&t),
                            (GgmlKind::Q8_0, false, 1) if m == 1 => q8_0::<$r1, 1>(&t),
                            (GgmlKind::Q8_0, false, 1) => q8_0::<$rm, 1>(&t),
                            (GgmlKind::Q8_0, false, 2) => q8_0::<$rm, 2>(&t),
                            (GgmlKind::Q8_0, false, 3) => q8_0::<$rm, 3>(&t),
                            (GgmlKind::Q8_0, false, _) => q8_0::<$rm, 4>(&t),
                        }
                    }
                    i += mc;
                }
                r += rt;
            }
        }
    };
}

/// What a tile kernel reads and writes. Row `j` of the tile starts at `w + j * g.stride`;
/// its f32 scales are `d[j * g.sb ..]` and `mn[j * g.sb ..]`; activation row `i` is
/// `x + i * cols`; the result of (row j, activation i) goes to `out[j * ostride + i]`.
#[cfg(target_arch = "x86_64")]
struct Tile {
    w: *const u8,
    g: RowGeom,
    d: *const f32,
    mn: *const f32,
    x: *const f32,
    out: *mut f32,
    ostride: usize,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{prefetch_past_tile, GgmlKind, RowGeom, Tile, BLOCK, DIRECT_MAX_M, SLACK};
    use std::arch::x86_64::*;

    tile_driver!(tiled_rows, "avx512f", 4, 4, scales);

    /// Whether [`rows`] broadcasts weights against transposed activations ([`bcast_rows`])
    /// instead of running dot-product tiles: above 32 rows, and from 13 rows when at most a
    /// quarter of the vector lanes are padding (13-16 and 24-32 rows). Measured on SmolLM2's
    /// decode steps (BENCHMARKS.md, "Broadcast tiles"): 0.85-0.90x at 14-16 rows and
    /// 0.81-0.91x at 24-32, level at 12 and 20, slower at 10.
    pub(super) fn bcast_pays(m: usize) -> bool {
        m > 32 || (m > 12 && 4 * m >= 3 * m.div_ceil(16) * 16)
    }

    /// Activation rows per pass over the weights: up to four vectors of 16.
    pub(super) const GROUP: usize = 64;

    /// Weight rows per broadcast tile against `v` vectors of activation rows: as many as
    /// keep `rows * v` accumulators, `v` activation vectors and a broadcast within the 32
    /// registers (16, 24, 24 and 24 accumulators).
    const fn tile_rows(v: usize) -> usize {
        match v {
            1 => 16,
            2 => 12,
            3 => 8,
            _ => 6,
        }
    }

    /// `rows` holds `n` rows then the slack; `out: [n, m]`, `x: [m, cols]`.
    ///
    /// # Safety
    /// The CPU has AVX-512F; the lengths are as `rows_into` checks them.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows(
        kind: GgmlKind,
        g: RowGeom,
        rows: &[u8],
        x: &[f32],
        xt: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        // SAFETY: the caller's contract is both functions'.
        unsafe {
            if bcast_pays(m) {
                bcast_rows(kind, g, rows, xt, m, out)
            } else {
                tiled_rows(kind, g, rows, x, m, out)
            }
        }
    }

    /// Length of [`transpose_cols`]'s layout of `m` rows of `cols` floats: groups of
    /// [`GROUP`] rows, the group of rows `i0..` at `xt[i0 * cols..]` as `[cols][16 v]`
    /// floats, `v` vectors of 16 rows (zeros past `m`).
    pub(super) fn transposed_len(m: usize, cols: usize) -> usize {
        cols * m.div_ceil(16) * 16
    }

    /// Columns `c` of the group of rows `i0 .. i0 + GROUP` (or to `m`) of `x: [m, cols]` into
    /// `dst: [c.len()][16 v]`, that group's piece of [`transposed_len`]'s layout.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose_cols(
        x: &[f32],
        m: usize,
        cols: usize,
        i0: usize,
        c: std::ops::Range<usize>,
        dst: &mut [f32],
    ) {
        assert!(x.len() == m * cols && m * cols <= i32::MAX as usize && i0 < m);
        assert!(c.end <= cols);
        let mg = (m - i0).min(GROUP);
        let v = mg.div_ceil(16);
        let lanes = 16 * v;
        assert_eq!(dst.len(), c.len() * lanes);
        let idx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(cols as i32),
        );
        for vi in 0..v {
            let rows_here = (mg - 16 * vi).min(16);
            let keep = ((1u32 << rows_here) - 1) as __mmask16;
            let base = x[(i0 + 16 * vi) * cols..].as_ptr();
            for (k, cc) in c.clone().enumerate() {
                // SAFETY: lane i reads x[(i0 + 16 vi + i) * cols + cc] only for the rows
                // that exist (the mask), inside `x`; the store lies in dst's column k.
                unsafe {
                    let col =
                        _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), keep, idx, base.add(cc));
                    _mm512_storeu_ps(dst.as_mut_ptr().add(k * lanes + 16 * vi), col);
                }
            }
        }
    }

    /// The products for many activation rows without horizontal sums: the activations come
    /// transposed (`xt`, [`transposed_len`]'s layout), so one weight broadcast meets 16 rows
    /// in one vector, and a tile's outputs leave its accumulators as rows of `out`. Each
    /// block of 32 weights of a tile's rows is dequantized once into an L1 buffer that the
    /// broadcasts read.
    ///
    /// # Safety
    /// As [`rows`].
    #[target_feature(enable = "avx512f")]
    unsafe fn bcast_rows(
        kind: GgmlKind,
        g: RowGeom,
        rows: &[u8],
        xt: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        let n = (rows.len() - SLACK) / g.stride;
        let cols = g.nb * BLOCK;
        assert!(rows.len() == n * g.stride + SLACK && out.len() == n * m);
        assert!(xt.len() >= transposed_len(m, cols));
        let most = tile_rows(1);
        let mut dbuf = vec![0f32; most * g.sb];
        let mut mbuf = vec![0f32; most * g.sb];
        for i0 in (0..m).step_by(GROUP) {
            let mg = (m - i0).min(GROUP);
            let v = mg.div_ceil(16);
            let xg = &xt[i0 * cols..];
            // Lanes of the last vector that hold activation rows.
            let mask: __mmask16 = (1u32 << (mg - 16 * (v - 1))).wrapping_sub(1) as __mmask16;
            let full = tile_rows(v);
            let mut r = 0;
            while r < n {
                let rt = if n - r >= full {
                    full
                } else if n - r >= 4 {
                    4
                } else {
                    1
                };
                for j in 0..rt {
                    // SAFETY: as in the tile driver: row r + j < n lies in `rows`, and the
                    // buffers hold `most` >= rt rows of scales.
                    unsafe {
                        scales(
                            kind,
                            g,
                            rows.as_ptr().add((r + j) * g.stride),
                            j,
                            &mut dbuf,
                            &mut mbuf,
                        )
                    };
                }
                prefetch_past_tile(rows, g.stride, r, rt);
                let t = Tile {
                    w: rows[r * g.stride..].as_ptr(),
                    g,
                    d: dbuf.as_ptr(),
                    mn: mbuf.as_ptr(),
                    x: xg.as_ptr(),
                    out: out[r * m + i0..].as_mut_ptr(),
                    ostride: m,
                };
                // SAFETY: rows r .. r + rt <= n and their scales are in the buffers; xg
                // holds cols x lanes floats; the outputs (r + j) * m + i0 + [0, mg) lie in
                // `out`, and the mask keeps the stores there.
                unsafe {
                    if kind == GgmlKind::Q4_1 {
                        bcast_tile::<true>(&t, v, rt, full, mask)
                    } else {
                        bcast_tile::<false>(&t, v, rt, full, mask)
                    }
                }
                r += rt;
            }
        }
    }

    /// [`bcast`] for `v` activation vectors and a tile of `rt` rows: `full` (the most for
    /// `v`), 4 or 1.
    ///
    /// # Safety
    /// As [`bcast`].
    #[target_feature(enable = "avx512f")]
    unsafe fn bcast_tile<const Q41: bool>(
        t: &Tile,
        v: usize,
        rt: usize,
        full: usize,
        mask: __mmask16,
    ) {
        const T1: usize = tile_rows(1);
        const T2: usize = tile_rows(2);
        const T3: usize = tile_rows(3);
        const T4: usize = tile_rows(4);
        let rt = if rt == full { 0 } else { rt };
        // SAFETY: the caller's contract.
        unsafe {
            match (v, rt) {
                (1, 0) => bcast::<Q41, T1, 1>(t, mask),
                (2, 0) => bcast::<Q41, T2, 2>(t, mask),
                (3, 0) => bcast::<Q41, T3, 3>(t, mask),
                (_, 0) => bcast::<Q41, T4, 4>(t, mask),
                (1, 4) => bcast::<Q41, 4, 1>(t, mask),
                (2, 4) => bcast::<Q41, 4, 2>(t, mask),
                (3, 4) => bcast::<Q41, 4, 3>(t, mask),
                (_, 4) => bcast::<Q41, 4, 4>(t, mask),
                (1, _) => bcast::<Q41, 1, 1>(t, mask),
                (2, _) => bcast::<Q41, 1, 2>(t, mask),
                (3, _) => bcast::<Q41, 1, 3>(t, mask),
                (_, _) => bcast::<Q41, 1, 4>(t, mask),
            }
        }
    }

    /// One broadcast tile: `R` weight rows against `V` vectors of transposed activation rows
    /// (`t.x: [cols][16 V]`); row j's outputs go to `t.out + j * t.ostride`, the last
    /// vector's lanes through `mask`.
    ///
    /// # Safety
    /// AVX-512F; `t` describes R rows in bounds, `t.x` holds `cols * 16 V` floats and the
    /// masked outputs lie in the caller's buffer.
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn bcast<const Q41: bool, const R: usize, const V: usize>(t: &Tile, mask: __mmask16) {
        let qs = if Q41 { 16 } else { 32 };
        let lanes = 16 * V;
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        let mut blk = [[0f32; BLOCK]; R];
        for b in 0..t.g.nb {
            // SAFETY: b < nb and j < R: the quant bytes and scales lie in the tile's rows,
            // and xt holds the block's 32 columns of `lanes` floats.
            unsafe {
                for (j, dst) in blk.iter_mut().enumerate() {
                    let at = j * t.g.sb + b;
                    let mn = if Q41 { *t.mn.add(at) } else { 0.0 };
                    let w = block_values::<Q41>(
                        t.w.add(j * t.g.stride + t.g.qs_off + b * qs),
                        *t.d.add(at),
                        mn,
                    );
                    _mm512_storeu_ps(dst.as_mut_ptr(), w[0]);
                    _mm512_storeu_ps(dst.as_mut_ptr().add(16), w[1]);
                }
                let xb = t.x.add(b * BLOCK * lanes);
                for kk in 0..BLOCK {
                    let xv: [__m512; V] =
                        std::array::from_fn(|v| _mm512_loadu_ps(xb.add(kk * lanes + 16 * v)));
                    for (a, wj) in acc.iter_mut().zip(&blk) {
                        let w = _mm512_set1_ps(wj[kk]);
                        for (av, &xvv) in a.iter_mut().zip(&xv) {
                            *av = _mm512_fmadd_ps(w, xvv, *av);
                        }
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            for (v, &av) in a.iter().enumerate() {
                // SAFETY: row j's outputs, masked on the last vector (caller's contract).
                unsafe {
                    let o = t.out.add(j * t.ostride + 16 * v);
                    if v + 1 < V {
                        _mm512_storeu_ps(o, av);
                    } else {
                        _mm512_mask_storeu_ps(o, mask, av);
                    }
                }
            }
        }
    }

    /// Converts the f16 scales of the row at `row` into `dbuf[j * sb..]`, `mbuf[j * sb..]`.
    ///
    /// # Safety
    /// AVX-512F; `row` is a row start with at least `4 * nb + 32` readable bytes (the row
    /// or the slack), `(j + 1) * sb <= dbuf.len(), mbuf.len()`.
    #[target_feature(enable = "avx512f")]
    unsafe fn scales(
        kind: GgmlKind,
        g: RowGeom,
        row: *const u8,
        j: usize,
        dbuf: &mut [f32],
        mbuf: &mut [f32],
    ) {
        assert!((j + 1) * g.sb <= dbuf.len() && (j + 1) * g.sb <= mbuf.len());
        for k in (0..g.nb).step_by(16) {
            // SAFETY: k < nb, so bytes row + 2k .. + 32 (and row + 2nb + 2k .. + 32) lie in
            // the caller's range; k + 16 <= sb, so the stores stay in row j's buffers.
            unsafe {
                let h = _mm256_loadu_si256(row.add(2 * k) as *const __m256i);
                _mm512_storeu_ps(dbuf.as_mut_ptr().add(j * g.sb + k), _mm512_cvtph_ps(h));
                if kind == GgmlKind::Q4_1 {
                    let h = _mm256_loadu_si256(row.add(2 * g.nb + 2 * k) as *const __m256i);
                    _mm512_storeu_ps(mbuf.as_mut_ptr().add(j * g.sb + k), _mm512_cvtph_ps(h));
                }
            }
        }
    }

    /// The 32 weights of the block whose quant bytes start at `qp`, with its f32 scale `d`
    /// and (Q4_1) minimum `mn`. Q4_1 (`Q41`): low nibbles are weights 0..16, high nibbles
    /// 16..32; its 16 possible values `d * q + m` are made once and looked up (`vpermps` reads
    /// only an index's low 4 bits), which costs fewer instructions than converting every
    /// nibble and rounds each value the same single time. Q8_0: the bytes in order, `d * q`.
    ///
    /// # Safety
    /// AVX-512F; `qp` starts 16 (Q4_1) or 32 (Q8_0) readable bytes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block_values<const Q41: bool>(qp: *const u8, d: f32, mn: f32) -> [__m512; 2] {
        let d = _mm512_set1_ps(d);
        // SAFETY: the caller's contract covers these 16 or 32 bytes.
        unsafe {
            if Q41 {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qp as *const __m128i));
                let iota = _mm512_setr_ps(
                    0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                    15.0,
                );
                let table = _mm512_fmadd_ps(iota, d, _mm512_set1_ps(mn));
                [
                    _mm512_permutexvar_ps(v, table),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), table),
                ]
            } else {
                let q0 = _mm_loadu_si128(qp as *const __m128i);
                let q1 = _mm_loadu_si128(qp.add(16) as *const __m128i);
                [
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d),
                ]
            }
        }
    }

    /// The Q4_1 (`Q41`) or Q8_0 tile kernel: one accumulator per (row, activation row); each
    /// block's activation floats are loaded once and meet all `R` dequantized rows, so loads
    /// do not outnumber the products. Kept out of line: inlined into the driver, its 4 x 4
    /// tile spilled registers (a cache-resident [576, 576] product with 4 rows: 36 against 26 us).
    ///
    /// # Safety
    /// AVX-512F; `t` describes R rows and M activation rows as [`Tile`] says, all in bounds.
    #[inline(never)]
    #[target_feature(enable = "avx512f")]
    unsafe fn direct<const Q41: bool, const R: usize, const M: usize>(t: &Tile) {
        let cols = t.g.nb * BLOCK;
        let qs = if Q41 { 16 } else { 32 };
        let mut acc = [[_mm512_setzero_ps(); M]; R];
        for b in 0..t.g.nb {
            // SAFETY: b < nb, j < R and i < M, so the quant bytes, the scale floats and the
            // activation floats read here lie inside the tile (caller's contract).
            unsafe {
                let w: [[__m512; 2]; R] = std::array::from_fn(|j| {
                    let at = j * t.g.sb + b;
                    let mn = if Q41 { *t.mn.add(at) } else { 0.0 };
                    block_values::<Q41>(
                        t.w.add(j * t.g.stride + t.g.qs_off + b * qs),
                        *t.d.add(at),
                        mn,
                    )
                });
                for i in 0..M {
                    let xb = t.x.add(i * cols + b * BLOCK);
                    let (x0, x1) = (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)));
                    for (a, wj) in acc.iter_mut().zip(&w) {
                        a[i] = _mm512_fmadd_ps(wj[1], x1, _mm512_fmadd_ps(wj[0], x0, a[i]));
                    }
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            for (i, &a) in acc_j.iter().enumerate() {
                // SAFETY: (j, i) is inside the tile's outputs.
                unsafe { *t.out.add(j * t.ostride + i) = _mm512_reduce_add_ps(a) };
            }
        }
    }

    /// [`direct`] for Q4_1 rows.
    ///
    /// # Safety
    /// As [`direct`].
    #[target_feature(enable = "avx512f")]
    unsafe fn q4_1<const R: usize, const M: usize>(t: &Tile) {
        // SAFETY: the caller's contract is `direct`'s.
        unsafe { direct::<true, R, M>(t) }
    }

    /// [`direct`] for Q8_0 rows.
    ///
    /// # Safety
    /// As [`direct`].
    #[target_feature(enable = "avx512f")]
    unsafe fn q8_0<const R: usize, const M: usize>(t: &Tile) {
        // SAFETY: the caller's contract is `direct`'s.
        unsafe { direct::<false, R, M>(t) }
    }

    /// Dequantizes `rt` rows starting at `row` into `wbuf: [rt, cols]`, with the f32 scales
    /// `scales` left in `dbuf` / `mbuf` (row j's at `j * g.sb`).
    ///
    /// # Safety
    /// AVX-512F; `row` starts `rt` whole rows of geometry `g`; the buffers hold `rt` rows.
    #[target_feature(enable = "avx512f")]
    unsafe fn dequant(
        kind: GgmlKind,
        g: RowGeom,
        row: *const u8,
        rt: usize,
        dbuf: &[f32],
        mbuf: &[f32],
        wbuf: &mut [f32],
    ) {
        let cols = g.nb * BLOCK;
        assert!(wbuf.len() >= rt * cols && dbuf.len() >= rt * g.sb && mbuf.len() >= rt * g.sb);
        for j in 0..rt {
            for b in 0..g.nb {
                let (d, mn) = (dbuf[j * g.sb + b], mbuf[j * g.sb + b]);
                let dst = wbuf[j * cols + b * BLOCK..].as_mut_ptr();
                // SAFETY: row j's block b lies in the caller's rows; dst has 32 floats
                // (asserted above).
                unsafe {
                    let qp = row.add(j * g.stride + g.qs_off + b * kind.qs_bytes());
                    let w = match kind {
                        GgmlKind::Q4_1 => block_values::<true>(qp, d, mn),
                        GgmlKind::Q8_0 => block_values::<false>(qp, d, mn),
                    };
                    _mm512_storeu_ps(dst, w[0]);
                    _mm512_storeu_ps(dst.add(16), w[1]);
                }
            }
        }
    }

    /// `out[j * ostride + i] = w_j . x_i` for R rows of `w: [R, cols]` and M rows of
    /// `x: [M, cols]`, `cols` a multiple of 32.
    ///
    /// # Safety
    /// AVX-512F; `w`, `x` hold R and M rows of `cols` floats, `out` the R x M outputs.
    #[target_feature(enable = "avx512f")]
    unsafe fn f32_tile<const R: usize, const M: usize>(
        w: *const f32,
        x: *const f32,
        cols: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); M]; R];
        for c in (0..cols).step_by(16) {
            // SAFETY: c + 16 <= cols, inside every row (caller's contract).
            unsafe {
                let wv: [__m512; R] = std::array::from_fn(|j| _mm512_loadu_ps(w.add(j * cols + c)));
                for i in 0..M {
                    let xv = _mm512_loadu_ps(x.add(i * cols + c));
                    for (a, &wj) in acc.iter_mut().zip(&wv) {
                        a[i] = _mm512_fmadd_ps(wj, xv, a[i]);
                    }
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            for (i, &a) in acc_j.iter().enumerate() {
                // SAFETY: (j, i) is inside the tile's outputs.
                unsafe { *out.add(j * ostride + i) = _mm512_reduce_add_ps(a) };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{prefetch_past_tile, GgmlKind, RowGeom, Tile, BLOCK, DIRECT_MAX_M, SLACK};
    use std::arch::x86_64::*;

    tile_driver!(rows, "avx2,fma,f16c", 2, 1, scales);

    /// Converts the f16 scales of the row at `row` into `dbuf[j * sb..]`, `mbuf[j * sb..]`.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; otherwise as `avx512::scales`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(
        kind: GgmlKind,
        g: RowGeom,
        row: *const u8,
        j: usize,
        dbuf: &mut [f32],
        mbuf: &mut [f32],
    ) {
        assert!((j + 1) * g.sb <= dbuf.len() && (j + 1) * g.sb <= mbuf.len());
        for k in (0..g.nb).step_by(8) {
            // SAFETY: k < nb, so bytes row + 2k .. + 16 (and row + 2nb + 2k .. + 16) lie in
            // the caller's range; k + 8 <= sb, so the stores stay in row j's buffers.
            unsafe {
                let h = _mm_loadu_si128(row.add(2 * k) as *const __m128i);
                _mm256_storeu_ps(dbuf.as_mut_ptr().add(j * g.sb + k), _mm256_cvtph_ps(h));
                if kind == GgmlKind::Q4_1 {
                    let h = _mm_loadu_si128(row.add(2 * g.nb + 2 * k) as *const __m128i);
                    _mm256_storeu_ps(mbuf.as_mut_ptr().add(j * g.sb + k), _mm256_cvtph_ps(h));
                }
            }
        }
    }

    /// As `avx512::dequant`.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; otherwise as `avx512::dequant`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dequant(
        kind: GgmlKind,
        g: RowGeom,
        row: *const u8,
        rt: usize,
        dbuf: &[f32],
        mbuf: &[f32],
        wbuf: &mut [f32],
    ) {
        let cols = g.nb * BLOCK;
        assert!(wbuf.len() >= rt * cols && dbuf.len() >= rt * g.sb && mbuf.len() >= rt * g.sb);
        for j in 0..rt {
            for b in 0..g.nb {
                let (d, mn) = (dbuf[j * g.sb + b], mbuf[j * g.sb + b]);
                let dst = wbuf[j * cols + b * BLOCK..].as_mut_ptr();
                // SAFETY: row j's block b lies in the caller's rows; dst has 32 floats
                // (asserted above).
                unsafe {
                    let qp = row.add(j * g.stride + g.qs_off + b * kind.qs_bytes());
                    let w = match kind {
                        GgmlKind::Q4_1 => block_values::<true>(qp, d, mn),
                        GgmlKind::Q8_0 => block_values::<false>(qp, d, mn),
                    };
                    for (k, v) in w.into_iter().enumerate() {
                        _mm256_storeu_ps(dst.add(8 * k), v);
                    }
                }
            }
        }
    }

    /// The 32 weights of the block whose quant bytes start at `qp`, as values 0..8, 8..16,
    /// 16..24 and 24..32, with its f32 scale `d` and (Q4_1, `Q41`) minimum `mn`.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; `qp` starts 16 (Q4_1) or 32 (Q8_0) readable bytes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_values<const Q41: bool>(qp: *const u8, d: f32, mn: f32) -> [__m256; 4] {
        let d = _mm256_set1_ps(d);
        // SAFETY: the caller's contract covers these 16 or 32 bytes.
        unsafe {
            if Q41 {
                let low = _mm256_set1_epi32(0x0f);
                let raw = _mm_loadu_si128(qp as *const __m128i);
                let v0 = _mm256_cvtepu8_epi32(raw);
                let v1 = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(raw));
                let mn = _mm256_set1_ps(mn);
                [
                    _mm256_and_si256(v0, low),
                    _mm256_and_si256(v1, low),
                    _mm256_srli_epi32::<4>(v0),
                    _mm256_srli_epi32::<4>(v1),
                ]
                .map(|q| _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, mn))
            } else {
                [0, 8, 16, 24].map(|k| {
                    let q = _mm_loadl_epi64(qp.add(k) as *const __m128i);
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d)
                })
            }
        }
    }

    /// As `avx512::f32_tile`, 8 lanes at a time.
    ///
    /// # Safety
    /// AVX2+FMA+F16C; otherwise as `avx512::f32_tile`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f32_tile<const R: usize, const M: usize>(
        w: *const f32,
        x: *const f32,
        cols: usize,
        out: *mut f32,
        ostride: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); M]; R];
        for c in (0..cols).step_by(8) {
            // SAFETY: c + 8 <= cols, inside every row (caller's contract).
            unsafe {
                let wv: [__m256; R] = std::array::from_fn(|j| _mm256_loadu_ps(w.add(j * cols + c)));
                for i in 0..M {
                    let xv = _mm256_loadu_ps(x.add(i * cols + c));
                    for (a, &wj) in acc.iter_mut().zip(&wv) {
                        a[i] = _mm256_fmadd_ps(wj, xv, a[i]);
                    }
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            for (i, &a) in acc_j.iter().enumerate() {
                // SAFETY: (j, i) is inside the tile's outputs.
                unsafe { *out.add(j * ostride + i) = hsum(a) };
            }
        }
    }

    /// Sum of the 8 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2+FMA+F16C; `t` describes R rows and M activation rows as [`Tile`] says, in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1<const R: usize, const M: usize>(t: &Tile) {
        let cols = t.g.nb * BLOCK;
        let mut acc = [[[_mm256_setzero_ps(); 2]; M]; R];
        for b in 0..t.g.nb {
            for (j, acc_j) in acc.iter_mut().enumerate() {
                // SAFETY: b < nb and j < R, so the 16 quant bytes, the scale floats and the
                // activation floats read here lie inside the tile (caller's contract).
                unsafe {
                    let qp = t.w.add(j * t.g.stride + t.g.qs_off + b * 16);
                    let at = j * t.g.sb + b;
                    let w = block_values::<true>(qp, *t.d.add(at), *t.mn.add(at));
                    for (i, a) in acc_j.iter_mut().enumerate() {
                        let xb = t.x.add(i * cols + b * BLOCK);
                        a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a[0]);
                        a[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), a[1]);
                        a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), a[0]);
                        a[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), a[1]);
                    }
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            for (i, a) in acc_j.iter().enumerate() {
                // SAFETY: (j, i) is inside the tile's outputs.
                unsafe { *t.out.add(j * t.ostride + i) = hsum(_mm256_add_ps(a[0], a[1])) };
            }
        }
    }

    /// # Safety
    /// AVX2+FMA+F16C; `t` describes R rows and M activation rows as [`Tile`] says, in bounds.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0<const R: usize, const M: usize>(t: &Tile) {
        let cols = t.g.nb * BLOCK;
        let mut acc = [[[_mm256_setzero_ps(); 2]; M]; R];
        for b in 0..t.g.nb {
            for (j, acc_j) in acc.iter_mut().enumerate() {
                // SAFETY: b < nb and j < R, so the 32 quant bytes, the scale and the
                // activation floats read here lie inside the tile (caller's contract).
                unsafe {
                    let qp = t.w.add(j * t.g.stride + t.g.qs_off + b * 32);
                    let w = block_values::<false>(qp, *t.d.add(j * t.g.sb + b), 0.0);
                    for (i, a) in acc_j.iter_mut().enumerate() {
                        let xb = t.x.add(i * cols + b * BLOCK);
                        a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), a[0]);
                        a[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), a[1]);
                        a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), a[0]);
                        a[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), a[1]);
                    }
                }
            }
        }
        for (j, acc_j) in acc.iter().enumerate() {
            for (i, a) in acc_j.iter().enumerate() {
                // SAFETY: (j, i) is inside the tile's outputs.
                unsafe { *t.out.add(j * t.ostride + i) = hsum(_mm256_add_ps(a[0], a[1])) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// splitmix64: a small seeded generator for test data.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        /// Uniform in [-1, 1).
        fn unit(&mut self) -> f32 {
            ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// Random GGML bytes of a `[rows, cols]` matrix.
    fn random_ggml(kind: GgmlKind, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
        let mut raw = Vec::with_capacity(rows * cols / 32 * kind.block_bytes());
        for _ in 0..rows * cols / 32 {
            let d = f16::from_f32(rng.unit() * 0.05);
            raw.extend_from_slice(&d.to_bits().to_le_bytes());
            match kind {
                GgmlKind::Q4_1 => {
                    let m = f16::from_f32(rng.unit() * 0.4);
                    raw.extend_from_slice(&m.to_bits().to_le_bytes());
                    raw.extend((0..16).map(|_| rng.next() as u8));
                }
                GgmlKind::Q8_0 => raw.extend((0..32).map(|_| rng.next() as u8)),
            }
        }
        raw
    }

    /// Dequantizes GGML bytes straight from the format description, in f64.
    fn dequant_ref(kind: GgmlKind, raw: &[u8]) -> Vec<f64> {
        let mut w = Vec::new();
        for blk in raw.chunks_exact(kind.block_bytes()) {
            let d = f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f64();
            match kind {
                GgmlKind::Q4_1 => {
                    let m = f16::from_bits(u16::from_le_bytes([blk[2], blk[3]])).to_f64();
                    let mut vals = [0f64; 32];
                    for j in 0..16 {
                        vals[j] = d * f64::from(blk[4 + j] & 0x0f) + m;
                        vals[j + 16] = d * f64::from(blk[4 + j] >> 4) + m;
                    }
                    w.extend_from_slice(&vals);
                }
                GgmlKind::Q8_0 => w.extend(blk[2..34].iter().map(|&q| d * f64::from(q as i8))),
            }
        }
        w
    }

    /// Checks `y` against `x W^T` in f64: |y - ref| <= gamma(cols + 2) * sum |w x|, the
    /// classic bound for f32 sums of products in any order (u = 2^-24), plus a tiny floor.
    fn check(w: &[f64], rows: usize, cols: usize, x: &[f32], m: usize, y: &[f32], what: &str) {
        let u = f64::powi(2.0, -24);
        let n = (cols + 2) as f64;
        let gamma = n * u / (1.0 - n * u);
        for i in 0..m {
            for r in 0..rows {
                let (mut s, mut a) = (0f64, 0f64);
                for c in 0..cols {
                    let p = w[r * cols + c] * f64::from(x[i * cols + c]);
                    s += p;
                    a += p.abs();
                }
                let got = f64::from(y[i * rows + r]);
                let err = (got - s).abs();
                assert!(
                    err <= gamma * a + 1e-30,
                    "{what}: y[{i},{r}] = {got}, reference {s}, error {err} > {}",
                    gamma * a
                );
            }
        }
    }

    fn paths() -> Vec<KernelPath> {
        [KernelPath::Scalar, KernelPath::Avx2, KernelPath::Avx512]
            .into_iter()
            .filter(|p| p.is_available())
            .collect()
    }

    #[test]
    fn every_path_matches_the_f64_reference() {
        let mut rng = Rng(7);
        let shapes = [(192, 576), (1000, 576), (37, 1536), (64, 32), (5, 2080)];
        for kind in [GgmlKind::Q4_1, GgmlKind::Q8_0] {
            for &(rows, cols) in &shapes {
                let raw = random_ggml(kind, rows, cols, &mut rng);
                let qm = QMatrix::from_ggml(kind, &raw, rows, cols).unwrap();
                let w = dequant_ref(kind, &raw);
                for m in [1, 3, 6, 9, 16, 24, 33, 70] {
                    let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
                    for path in paths() {
                        let mut y = vec![f32::NAN; m * rows];
                        qm.matmul_with(path, &x, m, &mut y);
                        check(
                            &w,
                            rows,
                            cols,
                            &x,
                            m,
                            &y,
                            &format!("{kind:?} {path:?} [{rows},{cols}] m={m}"),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matrices_on_shared_pages_keep_their_products() {
        let mut rng = Rng(13);
        // Byte sizes that are not multiples of a cache line, so every start is rounded.
        let specs = [
            (GgmlKind::Q4_1, 37, 1536),
            (GgmlKind::Q8_0, 5, 2080),
            (GgmlKind::Q4_1, 64, 32),
            (GgmlKind::Q8_0, 192, 576),
        ];
        let mut mats = Vec::new();
        let mut refs = Vec::new();
        for &(kind, rows, cols) in &specs {
            let raw = random_ggml(kind, rows, cols, &mut rng);
            mats.push(QMatrix::from_ggml(kind, &raw, rows, cols).unwrap());
            refs.push(dequant_ref(kind, &raw));
        }
        let kept = mats.clone();
        QMatrix::share_pages(mats.iter_mut());
        // One buffer, in the order given, no overlaps.
        for pair in mats.windows(2) {
            let end = pair[0].data.as_ptr() as usize + pair[0].data.len();
            assert!(end <= pair[1].data.as_ptr() as usize);
            assert!(pair[1].data.as_ptr() as usize - end < 64);
        }
        for ((qm, w), old) in mats.iter().zip(&refs).zip(&kept) {
            assert!(matches!(qm.data, Bytes::Shared { .. }));
            assert_eq!(&*qm.data, &*old.data);
            let (rows, cols) = (qm.rows(), qm.cols());
            for m in [1, 6] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
                for path in paths() {
                    let mut y = vec![f32::NAN; m * rows];
                    qm.matmul_with(path, &x, m, &mut y);
                    check(
                        w,
                        rows,
                        cols,
                        &x,
                        m,
                        &y,
                        &format!("shared {path:?} [{rows},{cols}]"),
                    );
                }
                let mut y = vec![f32::NAN; m * rows];
                QMatrix::matmul_concat(SpinPool::global(), &x, m, &[qm], &mut y);
                check(
                    w,
                    rows,
                    cols,
                    &x,
                    m,
                    &y,
                    &format!("shared, concat [{rows},{cols}]"),
                );
            }
        }
    }

    #[test]
    fn concatenated_products_match_the_reference_at_every_row_count() {
        // One activation layout (transposed once per call for the broadcast tiles) feeds
        // every matrix and thread; three threads split the columns unevenly.
        let mut rng = Rng(17);
        let cols = 320;
        let specs = [
            (GgmlKind::Q4_1, 72),
            (GgmlKind::Q8_0, 40),
            (GgmlKind::Q4_1, 8),
        ];
        let mut mats = Vec::new();
        let mut refs = Vec::new();
        for &(kind, rows) in &specs {
            let raw = random_ggml(kind, rows, cols, &mut rng);
            mats.push(QMatrix::from_ggml(kind, &raw, rows, cols).unwrap());
            refs.push(dequant_ref(kind, &raw));
        }
        let width: usize = mats.iter().map(QMatrix::rows).sum();
        let pools = [SpinPool::new(1), SpinPool::new(3)];
        for pool in &pools {
            for m in [1, 6, 13, 16, 24, 32, 33, 47, 70, 96] {
                let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
                let mut y = vec![f32::NAN; m * width];
                let refs_of: Vec<&QMatrix> = mats.iter().collect();
                QMatrix::matmul_concat(pool, &x, m, &refs_of, &mut y);
                let mut col = 0;
                for (qm, w) in mats.iter().zip(&refs) {
                    let rows = qm.rows();
                    let part: Vec<f32> = (0..m)
                        .flat_map(|i| y[i * width + col..i * width + col + rows].to_vec())
                        .collect();
                    let what = format!("concat, {} threads, m={m}, rows {rows}", pool.threads());
                    check(w, rows, cols, &x, m, &part, &what);
                    col += rows;
                }
            }
        }
    }

    #[test]
    fn byte_layout_matches_candle() {
        let mut rng = Rng(11);
        let (rows, cols) = (48, 576);
        let data: Vec<f32> = (0..rows * cols).map(|_| rng.unit()).collect();
        let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
        for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&t, dt).unwrap();
            let w: Vec<f64> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f64::from)
                .collect();
            let qm = QMatrix::from_qtensor(&q).unwrap();
            assert_eq!((qm.rows(), qm.cols()), (rows, cols));
            let m = 3;
            let x: Vec<f32> = (0..m * cols).map(|_| rng.unit()).collect();
            for path in paths() {
                let mut y = vec![0f32; m * rows];
                qm.matmul_with(path, &x, m, &mut y);
                check(
                    &w,
                    rows,
                    cols,
                    &x,
                    m,
                    &y,
                    &format!("candle {dt:?} {path:?}"),
                );
            }
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        assert!(QMatrix::from_ggml(GgmlKind::Q4_1, &[0; 20], 1, 16).is_err());
        assert!(QMatrix::from_ggml(GgmlKind::Q4_1, &[0; 21], 1, 32).is_err());
        assert!(QMatrix::from_ggml(GgmlKind::Q8_0, &[0; 34 * 2], 2, 32).is_ok());
        let t = Tensor::zeros((4, 32), candle_core::DType::F32, &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q4_0).unwrap();
        assert!(QMatrix::from_qtensor(&q).is_err());
    }
}
