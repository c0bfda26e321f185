//! The shift kernel: rotate cached keys in place from position `p` to `p + delta`.
//!
//! Every listed slot row holds `k_heads` heads of `k_head_dim` values; the first
//! `rotary_dim` dims of each head are multiplied by `R(delta)`. Cos/sin are unit-magnitude
//! values of `delta * inv_freq[i]` computed in f64 (never a forward pass's table, which may
//! bake in a YaRN attention factor), the math is f32, and each element is rounded once into
//! the storage dtype.
//!
//! One kernel per [`Tier`], [`Tier::best`] picked at run time: a portable generic kernel
//! (`rotate/portable.rs`), and hand-written AVX2+FMA+F16C (`avx2.rs`; FMA is enabled for the
//! target, never used for contraction) and AVX-512 F/BW/VL (`avx512.rs`) kernels. Every tier
//! computes, for each rotary pair `(a, b)`
//! with `(c, s)`, exactly `a' = a*c - b*s` and `b' = b*c + a*s` in f32 (two products, one
//! sum, no FMA contraction) and rounds once to nearest-even, so all tiers agree bit for bit;
//! the tests check it. (Only which sign/payload a NaN computed from two NaNs carries is left
//! to the compiler, which may commute a sum.) The SIMD kernels expand cos/sin once
//! per call into per-layout tables (`Tables`) reused over every row and head.
//!
//! Design decision: bf16 rows are read as 32-bit lanes, so a lane's even element becomes f32
//! by a left shift and its odd element by a mask. For interleaved pairs `(2i, 2i+1)` that
//! puts `a` and `b` of one pair in one lane: the rotation needs no shuffles at all.

use crate::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::error::{KernelError, Result};
use crate::rope::{LayerRopes, RopeSpec, RotaryLayout, Rotation};
use crate::rows::RowsMut;
use crate::Tier;
use std::ops::Range;

/// Rotates the key rows of `slots` by `R(delta)` in place, on the kernels of [`Tier::best`].
///
/// `rows` is a layer's key-part buffer `[capacity, k_heads * k_head_dim]`, and `slots` are
/// indices of its rows (the KV pool's slots). A slot listed twice is rotated twice.
///
/// # Errors
/// [`KernelError::NotShiftable`] / [`KernelError::InvalidRope`] from
/// [`RopeSpec::ensure_shiftable`], [`KernelError::InvalidRope`] if `spec.head_dim !=
/// k_head_dim`, [`KernelError::WidthMismatch`] if the buffer is not whole rows,
/// [`KernelError::RowOutOfRange`] for a slot past the buffer.
/// Nothing is written unless every check passes.
pub fn shift_rows(
    rows: RowsMut<'_>,
    k_heads: usize,
    k_head_dim: usize,
    slots: &[u32],
    spec: &RopeSpec,
    delta: i64,
) -> Result<()> {
    spec.ensure_shiftable()?;
    shift_rows_with(
        rows,
        k_heads,
        k_head_dim,
        slots,
        &shift_table(spec, delta)?,
        Tier::best(),
    )
}

/// [`shift_rows`] over the contiguous slots `slots.start..slots.end`.
///
/// # Errors
/// As [`shift_rows`].
pub fn shift_rows_range(
    rows: RowsMut<'_>,
    k_heads: usize,
    k_head_dim: usize,
    slots: Range<u32>,
    spec: &RopeSpec,
    delta: i64,
) -> Result<()> {
    spec.ensure_shiftable()?;
    let rot = shift_table(spec, delta)?;
    let head = check_rows(&rows, k_heads, k_head_dim, &rot)?;
    if slots.is_empty() {
        return Ok(());
    }
    check_slot(slots.end - 1, head.capacity)?;
    let sel = Sel::Range(slots.start as usize..slots.end as usize);
    dispatch(rows, head, &sel, &rot, Tier::best());
    Ok(())
}

/// The rotation `R(delta)` a shift applies, checked to be shiftable. Build it once per delta
/// and reuse it over every layer with [`shift_rows_with`].
///
/// # Errors
/// As [`RopeSpec::ensure_shiftable`].
pub fn shift_table(spec: &RopeSpec, delta: i64) -> Result<Rotation> {
    spec.ensure_shiftable()?;
    Ok(Rotation::new(spec, delta))
}

/// The rotations `R(delta)` of every spec of `ropes`, in the order of
/// [`LayerRopes::specs`]: layer `l` of a shift takes `tables[ropes.of_layer()[l]]`.
///
/// # Errors
/// As [`RopeSpec::ensure_shiftable`].
pub fn shift_tables(ropes: &LayerRopes, delta: i64) -> Result<Vec<Rotation>> {
    ropes
        .specs()
        .iter()
        .map(|s| shift_table(s, delta))
        .collect()
}

/// Rotates the key rows of `slots` by a prebuilt `rot` with the kernel of `tier`.
///
/// # Errors
/// [`KernelError::InvalidRope`] if `rot` was built for another head width,
/// [`KernelError::TierUnavailable`] if this CPU does not run `tier`,
/// [`KernelError::WidthMismatch`], [`KernelError::RowOutOfRange`] as [`shift_rows`]. Nothing is written unless every check passes.
pub fn shift_rows_with(
    rows: RowsMut<'_>,
    k_heads: usize,
    k_head_dim: usize,
    slots: &[u32],
    rot: &Rotation,
    tier: Tier,
) -> Result<()> {
    let head = check_rows(&rows, k_heads, k_head_dim, rot)?;
    if !tier.available() {
        return Err(KernelError::TierUnavailable(tier));
    }
    for &s in slots {
        check_slot(s, head.capacity)?;
    }
    dispatch(rows, head, &Sel::List(slots), rot, tier);
    Ok(())
}

/// Like [`shift_rows`] but with the arithmetic done in the *storage* dtype: cos/sin, every
/// product and every sum rounded to bf16 (or f16). Only for measuring the drift such a
/// kernel would cause (fidelity report); f32 storage behaves as [`shift_rows`]. Scalar.
///
/// # Errors
/// As [`shift_rows`].
pub fn shift_rows_lowprec(
    rows: RowsMut<'_>,
    k_heads: usize,
    k_head_dim: usize,
    slots: &[u32],
    spec: &RopeSpec,
    delta: i64,
) -> Result<()> {
    let rot = shift_table(spec, delta)?;
    let head = check_rows(&rows, k_heads, k_head_dim, &rot)?;
    for &s in slots {
        check_slot(s, head.capacity)?;
    }
    let (h, half) = (k_head_dim, rot.cos.len());
    let pairs = |layout: RotaryLayout, i: usize| match layout {
        RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
        RotaryLayout::Neox => (i, i + half),
    };
    let run = |buf: &mut [u16], dec: fn(u16) -> f32, enc: fn(f32) -> u16| {
        let q = |x: f32| dec(enc(x));
        for &s in slots {
            let row = &mut buf[s as usize * head.width..(s as usize + 1) * head.width];
            for x in row.chunks_exact_mut(h) {
                for i in 0..half {
                    let (c, sn) = (q(rot.cos[i]), q(rot.sin[i]));
                    let (j0, j1) = pairs(rot.layout, i);
                    let (a, b) = (dec(x[j0]), dec(x[j1]));
                    x[j0] = enc(q(a * c) - q(b * sn));
                    x[j1] = enc(q(a * sn) + q(b * c));
                }
            }
        }
    };
    match rows {
        RowsMut::F32(_) => {
            return shift_rows_with(rows, k_heads, k_head_dim, slots, &rot, Tier::Portable)
        }
        RowsMut::Bf16(b) => run(b, bf16_to_f32, f32_to_bf16),
        RowsMut::F16(b) => run(b, f16_to_f32, f32_to_f16),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------

/// Generates a row loop `$name(base, g, sel, t)` for one ISA, element type and head kernel:
/// rows in the order of `sel`, the next rows prefetched, each row's heads in turn.
macro_rules! row_loop {
    ($feat:literal, $name:ident, $t:ty, $head:ident) => {
        /// Rotates the rows of `sel`.
        ///
        /// # Safety
        /// The CPU has the target features; `base` points to `g.capacity * g.width` elements;
        /// every selected row is `< g.capacity`; `t` was built for `g.dim`.
        #[target_feature(enable = $feat)]
        unsafe fn $name(base: *mut $t, g: Head, sel: &Sel<'_>, t: &Tables) {
            let row_bytes = g.width * std::mem::size_of::<$t>();
            match sel {
                Sel::List(slots) => {
                    for (i, &s) in slots.iter().enumerate() {
                        if let Some(&n) = slots.get(i + PREFETCH_ROWS) {
                            prefetch(
                                base.wrapping_add(n as usize * g.width) as *const u8,
                                row_bytes,
                            );
                        }
                        let row = base.add(s as usize * g.width);
                        for h in 0..g.heads {
                            $head(row.add(h * g.dim), t);
                        }
                    }
                }
                Sel::Range(r) => {
                    for s in r.clone() {
                        let row = base.add(s * g.width);
                        for h in 0..g.heads {
                            $head(row.add(h * g.dim), t);
                        }
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;
#[cfg(test)]
mod tests;

/// How many rows ahead a slot list is prefetched (a scattered list defeats the hardware
/// prefetcher; a sequential one costs a few hint instructions per row).
const PREFETCH_ROWS: usize = 4;

/// Row geometry, checked against the buffer.
#[derive(Clone, Copy)]
struct Head {
    heads: usize,
    dim: usize,
    width: usize,
    capacity: usize,
}

/// Which rows to rotate.
enum Sel<'a> {
    List(&'a [u32]),
    Range(Range<usize>),
}

/// Cos/sin of one [`Rotation`] expanded for the SIMD kernels, built once per call. Every
/// table is zero-padded by at least one 512-bit vector, so a kernel may load whole vectors.
struct Tables {
    /// Rotary pairs per head (`rotary_dim / 2`).
    half: usize,
    layout: RotaryLayout,
    /// `cos[i]`, `sin[i]` in pair order.
    c: Vec<f32>,
    s: Vec<f32>,
    /// Per element, interleaved layout: `cos[i]` at `2i` and `2i + 1`; `-sin[i]` at `2i`,
    /// `sin[i]` at `2i + 1` (so `x * cd + swap_pairs(x) * sa` is the rotation).
    cd: Vec<f32>,
    sa: Vec<f32>,
    /// Neox layout, bf16 lanes: pair index `2j` (even) and `2j + 1` (odd) of `c` and `s`.
    ce: Vec<f32>,
    co: Vec<f32>,
    se: Vec<f32>,
    so: Vec<f32>,
}

impl Tables {
    const PAD: usize = 16;

    fn new(rot: &Rotation) -> Tables {
        let half = rot.cos.len();
        let len = half.div_ceil(Self::PAD) * Self::PAD + Self::PAD;
        let padded = |v: &mut Vec<f32>, n: usize| v.resize(n, 0.0);
        let (mut c, mut s) = (rot.cos.clone(), rot.sin.clone());
        padded(&mut c, len);
        padded(&mut s, len);
        let mut cd: Vec<f32> = (0..2 * half).map(|j| c[j / 2]).collect();
        let mut sa: Vec<f32> = (0..2 * half)
            .map(|j| if j % 2 == 0 { -s[j / 2] } else { s[j / 2] })
            .collect();
        padded(&mut cd, 2 * len);
        padded(&mut sa, 2 * len);
        let pick = |v: &[f32], odd: usize| -> Vec<f32> {
            (0..len)
                .map(|j| {
                    if 2 * j + odd < half {
                        v[2 * j + odd]
                    } else {
                        0.0
                    }
                })
                .collect()
        };
        Tables {
            half,
            layout: rot.layout,
            ce: pick(&c, 0),
            co: pick(&c, 1),
            se: pick(&s, 0),
            so: pick(&s, 1),
            c,
            s,
            cd,
            sa,
        }
    }
}

/// Hints the cache to fetch `bytes` from `p` (never faults, so `p` may be any address).
#[inline(always)]
fn prefetch(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch is a hint: it reads nothing architecturally and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

fn rows_len(rows: &RowsMut<'_>) -> usize {
    match rows {
        RowsMut::F32(b) => b.len(),
        RowsMut::F16(b) | RowsMut::Bf16(b) => b.len(),
    }
}

fn check_rows(
    rows: &RowsMut<'_>,
    k_heads: usize,
    k_head_dim: usize,
    rot: &Rotation,
) -> Result<Head> {
    if rot.head_dim != k_head_dim || rot.rotary_dim() > k_head_dim {
        return Err(KernelError::InvalidRope(format!(
            "rotation built for head_dim {} (rotary {}), rows have head_dim {k_head_dim}",
            rot.head_dim,
            rot.rotary_dim()
        )));
    }
    let width = k_heads * k_head_dim;
    let len = rows_len(rows);
    if width == 0 || !len.is_multiple_of(width) {
        return Err(KernelError::WidthMismatch {
            what: "key rows (buffer length / row width)",
            expected: width,
            got: len,
        });
    }
    Ok(Head {
        heads: k_heads,
        dim: k_head_dim,
        width,
        capacity: len / width,
    })
}

fn check_slot(slot: u32, capacity: usize) -> Result<()> {
    if (slot as usize) < capacity {
        Ok(())
    } else {
        Err(KernelError::RowOutOfRange {
            row: slot,
            rows: capacity,
        })
    }
}

/// Runs the kernel of `tier` over the checked rows.
///
/// Preconditions (checked by every caller): `head` came from [`check_rows`] for `rows` and
/// `rot`, every selected slot passed [`check_slot`], and `tier.available()`.
fn dispatch(rows: RowsMut<'_>, head: Head, sel: &Sel<'_>, rot: &Rotation, tier: Tier) {
    debug_assert!(tier.available());
    debug_assert_eq!(head.capacity * head.width, rows_len(&rows));
    debug_assert!(rot.rotary_dim() <= head.dim);
    if rot.cos.is_empty() {
        return;
    }
    match tier {
        Tier::Portable => portable::run(rows, head, sel, rot),
        #[cfg(target_arch = "x86_64")]
        Tier::Avx2 => {
            let t = Tables::new(rot);
            // SAFETY: `tier.available()` (checked by callers) means avx2, fma and f16c were
            // detected; the rows, slots and rotation width were checked against `head` as the
            // precondition above states, which is what the kernel's pointer arithmetic needs.
            unsafe { avx2::run(rows, head, sel, &t) }
        }
        #[cfg(target_arch = "x86_64")]
        Tier::Avx512 | Tier::Avx512Vnni | Tier::Amx => {
            let t = Tables::new(rot);
            // SAFETY: as above, with avx512f/bw/vl detected.
            unsafe { avx512::run(rows, head, sel, &t) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => portable::run(rows, head, sel, rot),
    }
}
