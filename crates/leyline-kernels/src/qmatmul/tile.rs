//! What the x86 kernels share: the tile driver macro that walks a product's rows in
//! tiles, the [`Tile`] a tile kernel reads and writes, and the weight prefetch.

use super::format::RowGeom;

/// How far ahead of the weights being read the kernels that stream them prefetch.
pub(super) const PREFETCH: usize = 4096;

/// Asks for the bytes [`PREFETCH`] past the tile of rows `r..r + rt` of `rows` (rows of
/// `stride` bytes); the tile's own rows are read while those are in flight (hardware
/// prefetchers stop at pages).
#[inline(always)]
pub(super) fn prefetch_past_tile(rows: &[u8], stride: usize, r: usize, rt: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = (r + rt) * stride + PREFETCH;
    let end = (ahead + rt * stride).min(rows.len());
    for off in (ahead..end).step_by(64) {
        // SAFETY: off < rows.len(), a valid address; a prefetch never faults or writes.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(off).cast::<i8>()) };
    }
}

/// Activation rows up to which the kernels dequantize weights in registers for each chunk of
/// at most 4 rows; above it a tile's rows are dequantized once into an f32 buffer that every
/// chunk then reads, so the conversion is not repeated per chunk. Measured on SmolLM2's
/// decode shapes (2 threads, AVX-512): see BENCHMARKS.md, "Few-row products".
pub(super) const DIRECT_MAX_M: usize = 4;

/// Defines `$name`, the driver of one ISA's tile kernels: for each tile of `R` output rows
/// (`R1` when m == 1, else `RM`; single rows for the remainder) it converts the tile's
/// scales to f32 (`$scales`), then runs the module's `tile::<R, M>` for chunks of `M <= 4`
/// activation rows, or, above
/// [`DIRECT_MAX_M`] rows, `dequant` once and `f32_tile::<R, M>` per chunk.
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
                            &rows[(r + j) * g.stride..],
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
                        match (rt == 1, mc) {
                            (true, 1) => tile::<1, 1>(kind, &t),
                            (true, 2) => tile::<1, 2>(kind, &t),
                            (true, 3) => tile::<1, 3>(kind, &t),
                            (true, _) => tile::<1, 4>(kind, &t),
                            (false, 1) if m == 1 => tile::<$r1, 1>(kind, &t),
                            (false, 1) => tile::<$rm, 1>(kind, &t),
                            (false, 2) => tile::<$rm, 2>(kind, &t),
                            (false, 3) => tile::<$rm, 3>(kind, &t),
                            (false, _) => tile::<$rm, 4>(kind, &t),
                        }
                    }
                    i += mc;
                }
                r += rt;
            }
        }
    };
}

/// Calls the caller's `$run!(GA)` with the const activation-row count of an integer tile
/// from the runtime `$ga`: 1 to 4 (4 for anything more).
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

/// What a tile kernel reads and writes. Row `j` of the tile starts at `w + j * g.stride`;
/// its f32 scales are `d[j * g.sb ..]` and `mn[j * g.sb ..]`; activation row `i` is
/// `x + i * cols`; the result of (row j, activation i) goes to `out[j * ostride + i]`.
pub(super) struct Tile {
    pub(super) w: *const u8,
    pub(super) g: RowGeom,
    pub(super) d: *const f32,
    pub(super) mn: *const f32,
    pub(super) x: *const f32,
    pub(super) out: *mut f32,
    pub(super) ostride: usize,
}
