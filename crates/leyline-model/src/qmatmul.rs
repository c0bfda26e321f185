//! CPU matrix products with GGML-quantized weights (Q4_1, Q8_0) and f32 activations, for
//! decode shapes (a few activation rows).
//!
//! Design decision: activations stay f32 and each 32-weight block is dequantized in
//! registers (`w = d * q + m`), so results match the f32-dequantized weights up to float
//! rounding; the weights are read once per call for all activation rows. Rows are split
//! over rayon's pool; the SIMD path (AVX-512F, AVX2+FMA+F16C, scalar) is chosen at run time.

use crate::error::{ModelError, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Values per GGML block (both supported kinds).
const BLOCK: usize = 32;
/// Scales of a row are padded to a multiple of this many entries, so SIMD f16->f32
/// conversion never needs a tail.
const SCALE_PAD: usize = 16;

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
/// GGML blocks into three row-major streams: quant bytes (as in GGML, without the scales),
/// f16 scales `d` and (Q4_1) f16 minimums `m`, each row's scales padded to a multiple of 16.
#[derive(Debug, Clone)]
pub struct QMatrix {
    kind: GgmlKind,
    rows: usize,
    cols: usize,
    /// Quant bytes, `rows * nb * qs_bytes`.
    qs: Vec<u8>,
    /// f16 bits of `d`, `rows * sb` (zero padded).
    d: Vec<u16>,
    /// f16 bits of `m`, `rows * sb` (Q4_1 only; empty for Q8_0).
    m: Vec<u16>,
}

/// Activation rows handled together by one kernel call (bounded by SIMD registers).
const M_CHUNK: usize = 8;

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
        let sb = nb.div_ceil(SCALE_PAD) * SCALE_PAD;
        let qb = kind.qs_bytes();
        let mut qs = Vec::with_capacity(rows * nb * qb);
        let mut d = vec![0u16; rows * sb];
        let mut m = if kind == GgmlKind::Q4_1 {
            vec![0u16; rows * sb]
        } else {
            Vec::new()
        };
        for (i, blk) in raw.chunks_exact(kind.block_bytes()).enumerate() {
            let (r, b) = (i / nb, i % nb);
            d[r * sb + b] = u16::from_le_bytes([blk[0], blk[1]]);
            match kind {
                GgmlKind::Q4_1 => {
                    m[r * sb + b] = u16::from_le_bytes([blk[2], blk[3]]);
                    qs.extend_from_slice(&blk[4..20]);
                }
                GgmlKind::Q8_0 => qs.extend_from_slice(&blk[2..34]),
            }
        }
        Ok(Self {
            kind,
            rows,
            cols,
            qs,
            d,
            m,
        })
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

    /// `y = x W^T` for `x: [m, cols]` and `y: [m, rows]` (row-major), on the fastest path.
    ///
    /// # Panics
    /// If `x.len() != m * cols` or `y.len() != m * rows`.
    pub fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) {
        self.matmul_with(KernelPath::best(), x, m, y);
    }

    /// [`Self::matmul`] on a chosen path (tests, benchmarks).
    ///
    /// # Panics
    /// If the path is not available on this CPU, or on the length mismatches of `matmul`.
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
        let tile = self.row_tile(m);
        let serial = self.weight_bytes() * m.min(4) < SERIAL_BYTES;
        if m == 1 {
            // y is already [rows, 1]: write it in place.
            if serial {
                self.rows_into(path, 0, x, 1, y);
            } else {
                y.par_chunks_mut(tile).enumerate().for_each(|(t, out)| {
                    self.rows_into(path, t * tile, x, 1, out);
                });
            }
            return;
        }
        // Compute [rows, m], then transpose into [m, rows].
        let mut yt = vec![0f32; self.rows * m];
        if serial {
            self.rows_into(path, 0, x, m, &mut yt);
        } else {
            yt.par_chunks_mut(tile * m)
                .enumerate()
                .for_each(|(t, out)| {
                    self.rows_into(path, t * tile, x, m, out);
                });
        }
        for (r, ys) in yt.chunks_exact(m).enumerate() {
            for (i, &v) in ys.iter().enumerate() {
                y[i * self.rows + r] = v;
            }
        }
    }

    /// Rows per parallel task: about four tasks per thread, at least 16 rows.
    fn row_tile(&self, _m: usize) -> usize {
        let tasks = rayon::current_num_threads().max(1) * 4;
        self.rows.div_ceil(tasks).max(16)
    }

    /// Computes rows `r0 .. r0 + out.len() / m` into `out: [n, m]`.
    fn rows_into(&self, path: KernelPath, r0: usize, x: &[f32], m: usize, out: &mut [f32]) {
        let n = out.len() / m;
        debug_assert!(r0 + n <= self.rows && out.len() == n * m);
        let nb = self.cols / BLOCK;
        let sb = nb.div_ceil(SCALE_PAD) * SCALE_PAD;
        let qb = self.kind.qs_bytes();
        let mut dbuf = vec![0f32; sb];
        let mut mbuf = vec![0f32; if self.kind == GgmlKind::Q4_1 { sb } else { 0 }];
        let mut wbuf = if path == KernelPath::Scalar {
            vec![0f32; self.cols]
        } else {
            Vec::new()
        };
        for (j, ys) in out.chunks_exact_mut(m).enumerate() {
            let r = r0 + j;
            let row = RowRef {
                qs: &self.qs[r * nb * qb..(r + 1) * nb * qb],
                d: &self.d[r * sb..(r + 1) * sb],
                m: if self.kind == GgmlKind::Q4_1 {
                    &self.m[r * sb..(r + 1) * sb]
                } else {
                    &[]
                },
                nb,
            };
            match path {
                KernelPath::Scalar => scalar::row(self.kind, &row, x, ys, &mut wbuf),
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2 => {
                    // SAFETY: `matmul_with` asserted the path is available, i.e. this CPU
                    // has AVX2, FMA and F16C; `row` slices have the lengths RowRef promises.
                    unsafe { avx2::row(self.kind, &row, x, ys, &mut dbuf, &mut mbuf) }
                }
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx512 => {
                    // SAFETY: as above, the CPU has AVX-512F.
                    unsafe { avx512::row(self.kind, &row, x, ys, &mut dbuf, &mut mbuf) }
                }
                #[cfg(not(target_arch = "x86_64"))]
                _ => unreachable!("only the scalar path is available off x86-64"),
            }
        }
    }
}

/// Below this many weight bytes (times min(m, 4)) a product runs on the calling thread.
const SERIAL_BYTES: usize = 96 * 1024;

/// One row of a [`QMatrix`]: `qs.len() == nb * qs_bytes`, `d.len() == m.len() (or 0) ==
/// round_up(nb, 16)`.
struct RowRef<'a> {
    qs: &'a [u8],
    d: &'a [u16],
    m: &'a [u16],
    nb: usize,
}

mod scalar {
    use super::{f16, GgmlKind, RowRef, BLOCK};

    /// Dequantizes the row into `w` (len cols), then one dot product per activation row.
    pub(super) fn row(kind: GgmlKind, row: &RowRef<'_>, x: &[f32], ys: &mut [f32], w: &mut [f32]) {
        let cols = row.nb * BLOCK;
        for b in 0..row.nb {
            let d = f16::from_bits(row.d[b]).to_f32();
            let wb = &mut w[b * BLOCK..(b + 1) * BLOCK];
            match kind {
                GgmlKind::Q4_1 => {
                    let mn = f16::from_bits(row.m[b]).to_f32();
                    let q = &row.qs[b * 16..(b + 1) * 16];
                    for j in 0..16 {
                        wb[j] = (q[j] & 0x0f) as f32 * d + mn;
                        wb[j + 16] = (q[j] >> 4) as f32 * d + mn;
                    }
                }
                GgmlKind::Q8_0 => {
                    let q = &row.qs[b * 32..(b + 1) * 32];
                    for j in 0..32 {
                        wb[j] = q[j] as i8 as f32 * d;
                    }
                }
            }
        }
        for (i, y) in ys.iter_mut().enumerate() {
            let xi = &x[i * cols..(i + 1) * cols];
            let mut acc = [0f32; 8];
            for (wc, xc) in w[..cols].chunks_exact(8).zip(xi.chunks_exact(8)) {
                for k in 0..8 {
                    acc[k] += wc[k] * xc[k];
                }
            }
            *y = acc.iter().sum();
        }
    }
}

/// Calls `$f::<N>` for a run-time `n` in `1..=8`.
#[cfg(target_arch = "x86_64")]
macro_rules! dispatch_m {
    ($n:expr, $f:ident, $($arg:expr),*) => {
        match $n {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            6 => $f::<6>($($arg),*),
            7 => $f::<7>($($arg),*),
            _ => $f::<8>($($arg),*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    // The AVX-512 intrinsics are stable since Rust 1.89; the workspace states 1.85.
    #![allow(clippy::incompatible_msrv)]
    use super::{GgmlKind, RowRef, BLOCK, M_CHUNK};
    use std::arch::x86_64::*;

    /// One output row for every activation row, `M_CHUNK` activation rows per pass.
    ///
    /// # Safety
    /// The CPU must support AVX-512F. `row` must satisfy RowRef's length contract,
    /// `x.len() >= ys.len() * nb * 32` and `dbuf`, `mbuf` (Q4_1) hold `row.d.len()` floats.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn row(
        kind: GgmlKind,
        row: &RowRef<'_>,
        x: &[f32],
        ys: &mut [f32],
        dbuf: &mut [f32],
        mbuf: &mut [f32],
    ) {
        let sb = row.d.len();
        assert!(dbuf.len() >= sb && sb.is_multiple_of(16) && row.nb <= sb);
        assert!(x.len() >= ys.len() * row.nb * BLOCK);
        assert!(row.qs.len() >= row.nb * if kind == GgmlKind::Q4_1 { 16 } else { 32 });
        let q41 = kind == GgmlKind::Q4_1;
        if q41 {
            assert!(mbuf.len() >= sb && row.m.len() == sb);
        }
        // f16 -> f32 scales, 16 at a time; sb is a multiple of 16 (asserted).
        for k in (0..sb).step_by(16) {
            // SAFETY: k + 16 <= sb <= len of row.d, dbuf (and row.m, mbuf when Q4_1).
            unsafe {
                let h = _mm256_loadu_si256(row.d.as_ptr().add(k) as *const __m256i);
                _mm512_storeu_ps(dbuf.as_mut_ptr().add(k), _mm512_cvtph_ps(h));
                if q41 {
                    let h = _mm256_loadu_si256(row.m.as_ptr().add(k) as *const __m256i);
                    _mm512_storeu_ps(mbuf.as_mut_ptr().add(k), _mm512_cvtph_ps(h));
                }
            }
        }
        let cols = row.nb * BLOCK;
        let mut i = 0;
        while i < ys.len() {
            let n = (ys.len() - i).min(M_CHUNK);
            let xs = &x[i * cols..(i + n) * cols];
            let out = &mut ys[i..i + n];
            // SAFETY: the asserts above establish every bound the kernels rely on.
            unsafe {
                if q41 {
                    dispatch_m!(n, q4_1, row, xs, out, dbuf, mbuf);
                } else {
                    dispatch_m!(n, q8_0, row, xs, out, dbuf, mbuf);
                }
            }
            i += n;
        }
    }

    /// # Safety
    /// AVX-512F; `xs.len() == M * nb * 32`, `out.len() == M`, `qs.len() >= nb * 16`,
    /// `dbuf`, `mbuf` at least `nb` long.
    #[target_feature(enable = "avx512f")]
    unsafe fn q4_1<const M: usize>(
        row: &RowRef<'_>,
        xs: &[f32],
        out: &mut [f32],
        dbuf: &[f32],
        mbuf: &[f32],
    ) {
        let cols = row.nb * BLOCK;
        debug_assert!(xs.len() == M * cols && out.len() == M);
        let mut acc0 = [_mm512_setzero_ps(); M];
        let mut acc1 = [_mm512_setzero_ps(); M];
        let low = _mm512_set1_epi32(0x0f);
        let qp = row.qs.as_ptr();
        let xp = xs.as_ptr();
        for b in 0..row.nb {
            // SAFETY: b < nb, so bytes b*16..b*16+16 lie in qs, floats i*cols + b*32 .. +32
            // lie in xs for i < M, and b indexes dbuf/mbuf (caller's contract).
            unsafe {
                let raw = _mm_loadu_si128(qp.add(b * 16) as *const __m128i);
                let v = _mm512_cvtepu8_epi32(raw);
                let d = _mm512_set1_ps(*dbuf.get_unchecked(b));
                let mn = _mm512_set1_ps(*mbuf.get_unchecked(b));
                let w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, mn);
                let w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)), d, mn);
                for i in 0..M {
                    let xb = xp.add(i * cols + b * BLOCK);
                    acc0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc0[i]);
                    acc1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb.add(16)), acc1[i]);
                }
            }
        }
        for i in 0..M {
            out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
        }
    }

    /// # Safety
    /// AVX-512F; `xs.len() == M * nb * 32`, `out.len() == M`, `qs.len() >= nb * 32`,
    /// `dbuf` at least `nb` long.
    #[target_feature(enable = "avx512f")]
    unsafe fn q8_0<const M: usize>(
        row: &RowRef<'_>,
        xs: &[f32],
        out: &mut [f32],
        dbuf: &[f32],
        _mbuf: &[f32],
    ) {
        let cols = row.nb * BLOCK;
        debug_assert!(xs.len() == M * cols && out.len() == M);
        let mut acc0 = [_mm512_setzero_ps(); M];
        let mut acc1 = [_mm512_setzero_ps(); M];
        let qp = row.qs.as_ptr();
        let xp = xs.as_ptr();
        for b in 0..row.nb {
            // SAFETY: b < nb, so bytes b*32..b*32+32 lie in qs, floats i*cols + b*32 .. +32
            // lie in xs for i < M, and b indexes dbuf (caller's contract).
            unsafe {
                let q0 = _mm_loadu_si128(qp.add(b * 32) as *const __m128i);
                let q1 = _mm_loadu_si128(qp.add(b * 32 + 16) as *const __m128i);
                let d = _mm512_set1_ps(*dbuf.get_unchecked(b));
                let w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d);
                let w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d);
                for i in 0..M {
                    let xb = xp.add(i * cols + b * BLOCK);
                    acc0[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc0[i]);
                    acc1[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb.add(16)), acc1[i]);
                }
            }
        }
        for i in 0..M {
            out[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{GgmlKind, RowRef, BLOCK};
    use std::arch::x86_64::*;

    /// Activation rows per pass (16 ymm registers: 2 accumulators each plus 4 weights).
    const M2: usize = 4;

    /// One output row for every activation row.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; the contract of `avx512::row` otherwise.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn row(
        kind: GgmlKind,
        row: &RowRef<'_>,
        x: &[f32],
        ys: &mut [f32],
        dbuf: &mut [f32],
        mbuf: &mut [f32],
    ) {
        let sb = row.d.len();
        assert!(dbuf.len() >= sb && sb.is_multiple_of(16) && row.nb <= sb);
        assert!(x.len() >= ys.len() * row.nb * BLOCK);
        assert!(row.qs.len() >= row.nb * if kind == GgmlKind::Q4_1 { 16 } else { 32 });
        let q41 = kind == GgmlKind::Q4_1;
        if q41 {
            assert!(mbuf.len() >= sb && row.m.len() == sb);
        }
        for k in (0..sb).step_by(8) {
            // SAFETY: k + 8 <= sb <= len of row.d, dbuf (and row.m, mbuf when Q4_1).
            unsafe {
                let h = _mm_loadu_si128(row.d.as_ptr().add(k) as *const __m128i);
                _mm256_storeu_ps(dbuf.as_mut_ptr().add(k), _mm256_cvtph_ps(h));
                if q41 {
                    let h = _mm_loadu_si128(row.m.as_ptr().add(k) as *const __m128i);
                    _mm256_storeu_ps(mbuf.as_mut_ptr().add(k), _mm256_cvtph_ps(h));
                }
            }
        }
        let cols = row.nb * BLOCK;
        let mut i = 0;
        while i < ys.len() {
            let n = (ys.len() - i).min(M2);
            let xs = &x[i * cols..(i + n) * cols];
            let out = &mut ys[i..i + n];
            // SAFETY: the asserts above establish every bound the kernels rely on.
            unsafe {
                match (q41, n) {
                    (true, 1) => q4_1::<1>(row, xs, out, dbuf, mbuf),
                    (true, 2) => q4_1::<2>(row, xs, out, dbuf, mbuf),
                    (true, 3) => q4_1::<3>(row, xs, out, dbuf, mbuf),
                    (true, _) => q4_1::<4>(row, xs, out, dbuf, mbuf),
                    (false, 1) => q8_0::<1>(row, xs, out, dbuf),
                    (false, 2) => q8_0::<2>(row, xs, out, dbuf),
                    (false, 3) => q8_0::<3>(row, xs, out, dbuf),
                    (false, _) => q8_0::<4>(row, xs, out, dbuf),
                }
            }
            i += n;
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
    /// AVX2+FMA+F16C; `xs.len() == M * nb * 32`, `out.len() == M`, `qs.len() >= nb * 16`,
    /// `dbuf`, `mbuf` at least `nb` long.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_1<const M: usize>(
        row: &RowRef<'_>,
        xs: &[f32],
        out: &mut [f32],
        dbuf: &[f32],
        mbuf: &[f32],
    ) {
        let cols = row.nb * BLOCK;
        debug_assert!(xs.len() == M * cols && out.len() == M);
        let mut acc0 = [_mm256_setzero_ps(); M];
        let mut acc1 = [_mm256_setzero_ps(); M];
        let low = _mm256_set1_epi32(0x0f);
        let qp = row.qs.as_ptr();
        let xp = xs.as_ptr();
        for b in 0..row.nb {
            // SAFETY: b < nb, so bytes b*16..b*16+16 lie in qs, floats i*cols + b*32 .. +32
            // lie in xs for i < M, and b indexes dbuf/mbuf (caller's contract).
            unsafe {
                let raw = _mm_loadu_si128(qp.add(b * 16) as *const __m128i);
                let v0 = _mm256_cvtepu8_epi32(raw);
                let v1 = _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(raw));
                let d = _mm256_set1_ps(*dbuf.get_unchecked(b));
                let mn = _mm256_set1_ps(*mbuf.get_unchecked(b));
                // Values 0..8, 8..16 (low nibbles), 16..24, 24..32 (high nibbles).
                let w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), d, mn);
                let w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), d, mn);
                let w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v0)), d, mn);
                let w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v1)), d, mn);
                for i in 0..M {
                    let xb = xp.add(i * cols + b * BLOCK);
                    acc0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb), acc0[i]);
                    acc1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb.add(8)), acc1[i]);
                    acc0[i] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb.add(16)), acc0[i]);
                    acc1[i] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb.add(24)), acc1[i]);
                }
            }
        }
        for i in 0..M {
            out[i] = hsum(_mm256_add_ps(acc0[i], acc1[i]));
        }
    }

    /// # Safety
    /// AVX2+FMA+F16C; `xs.len() == M * nb * 32`, `out.len() == M`, `qs.len() >= nb * 32`,
    /// `dbuf` at least `nb` long.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0<const M: usize>(row: &RowRef<'_>, xs: &[f32], out: &mut [f32], dbuf: &[f32]) {
        let cols = row.nb * BLOCK;
        debug_assert!(xs.len() == M * cols && out.len() == M);
        let mut acc0 = [_mm256_setzero_ps(); M];
        let mut acc1 = [_mm256_setzero_ps(); M];
        let qp = row.qs.as_ptr();
        let xp = xs.as_ptr();
        for b in 0..row.nb {
            // SAFETY: b < nb, so bytes b*32..b*32+32 lie in qs, floats i*cols + b*32 .. +32
            // lie in xs for i < M, and b indexes dbuf (caller's contract).
            unsafe {
                let d = _mm256_set1_ps(*dbuf.get_unchecked(b));
                let mut w = [_mm256_setzero_ps(); 4];
                for (k, wk) in w.iter_mut().enumerate() {
                    let q = _mm_loadl_epi64(qp.add(b * 32 + k * 8) as *const __m128i);
                    *wk = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
                }
                for i in 0..M {
                    let xb = xp.add(i * cols + b * BLOCK);
                    acc0[i] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc0[i]);
                    acc1[i] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb.add(8)), acc1[i]);
                    acc0[i] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb.add(16)), acc0[i]);
                    acc1[i] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb.add(24)), acc1[i]);
                }
            }
        }
        for i in 0..M {
            out[i] = hsum(_mm256_add_ps(acc0[i], acc1[i]));
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
                for m in [1, 3, 16] {
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
