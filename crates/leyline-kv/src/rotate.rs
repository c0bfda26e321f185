//! The shift kernel: rotate cached keys in place from position `p` to `p + delta`.
//!
//! Every listed slot row holds `k_heads` heads of `k_head_dim` values; the first
//! `rotary_dim` dims of each head are multiplied by `R(delta)`. Cos/sin are unit-magnitude
//! values of `delta * inv_freq[i]` computed in f64 (never a forward pass's table, which may
//! bake in a YaRN attention factor), the math is f32, and each element is rounded once into
//! the storage dtype.
//!
//! Paths: one generic kernel, compiled three times (portable baseline, AVX2+FMA, AVX-512)
//! and picked at run time by `is_x86_feature_detected!`, cached in a `OnceLock`. All paths do
//! the same IEEE operations in the same order (no FMA contraction), so they agree
//! bit-for-bit; the tests check it. Half types convert by bit operations, which vectorize.

use crate::error::{KvError, Result};
use crate::rope::{RopeSpec, RotaryLayout, Rotation};
use crate::storage::RowsMut;
use std::ops::Range;
use std::sync::OnceLock;

/// Which compiled copy of the kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// Baseline target features (whatever the compiler vectorizes for the default target).
    Portable,
    /// x86-64 AVX2 + FMA (FMA is enabled for the target, not used for contraction).
    Avx2,
    /// x86-64 AVX-512 F/BW/VL.
    Avx512,
}

impl KernelPath {
    /// Whether this machine can run the path.
    pub fn available(self) -> bool {
        match self {
            KernelPath::Portable => true,
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest path this machine runs (detected once).
    pub fn detect() -> KernelPath {
        static PATH: OnceLock<KernelPath> = OnceLock::new();
        *PATH.get_or_init(|| {
            [KernelPath::Avx512, KernelPath::Avx2]
                .into_iter()
                .find(|p| p.available())
                .unwrap_or(KernelPath::Portable)
        })
    }
}

/// Rotates the key rows of `slots` by `R(delta)` in place, with the detected kernel path.
///
/// `rows` is a layer's key-part buffer `[capacity, k_heads * k_head_dim]`. A slot listed
/// twice is rotated twice.
///
/// # Errors
/// [`KvError::NotShiftable`] / [`KvError::InvalidRope`] from [`RopeSpec::ensure_shiftable`],
/// [`KvError::InvalidRope`] if `spec.head_dim != k_head_dim`, [`KvError::WidthMismatch`] if
/// the buffer is not whole rows, [`KvError::SlotOutOfRange`] for a slot past the buffer.
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
        KernelPath::detect(),
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
    dispatch(rows, head, &sel, &rot, KernelPath::detect());
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

/// Rotates the key rows of `slots` by a prebuilt `rot` with the kernel `path`.
///
/// # Errors
/// [`KvError::InvalidRope`] if `rot` was built for another head width or `path` is not
/// available here, [`KvError::WidthMismatch`], [`KvError::SlotOutOfRange`] as
/// [`shift_rows`]. Nothing is written unless every check passes.
pub fn shift_rows_with(
    rows: RowsMut<'_>,
    k_heads: usize,
    k_head_dim: usize,
    slots: &[u32],
    rot: &Rotation,
    path: KernelPath,
) -> Result<()> {
    let head = check_rows(&rows, k_heads, k_head_dim, rot)?;
    if !path.available() {
        return Err(KvError::InvalidRope(format!(
            "kernel path {path:?} is not available here"
        )));
    }
    for &s in slots {
        check_slot(s, head.capacity)?;
    }
    dispatch(rows, head, &Sel::List(slots), rot, path);
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
            return shift_rows_with(rows, k_heads, k_head_dim, slots, &rot, KernelPath::Portable)
        }
        RowsMut::Bf16(b) => run(b, bf16_to_f32, f32_to_bf16),
        RowsMut::F16(b) => run(b, f16_to_f32, f32_to_f16),
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Internals
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Head {
    heads: usize,
    dim: usize,
    width: usize,
    capacity: usize,
}

enum Sel<'a> {
    List(&'a [u32]),
    Range(Range<usize>),
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
        return Err(KvError::InvalidRope(format!(
            "rotation built for head_dim {} (rotary {}), rows have head_dim {k_head_dim}",
            rot.head_dim,
            rot.rotary_dim()
        )));
    }
    let width = k_heads * k_head_dim;
    let len = rows_len(rows);
    if width == 0 || len % width != 0 {
        return Err(KvError::WidthMismatch {
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
        Err(KvError::SlotOutOfRange { slot, capacity })
    }
}

/// bf16 bits to f32: exact, a shift.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) as u16) | 0x0040;
    if x.is_nan() {
        nan
    } else {
        rounded
    }
}

/// f16 bits to f32: exact, including subnormals, infinities and NaN.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let em = (h & 0x7fff) as u32;
    let exp = em & 0x7c00;
    // Normal: rebias the exponent (+112 << 23 after the shift).
    let normal = (em << 13) + (112 << 23);
    // Inf/NaN: exponent all ones.
    let special = (em << 13) | 0x7f80_0000;
    // Subnormal: value = mantissa * 2^-24, exact in f32.
    let sub = ((em as f32) * f32::from_bits(0x3380_0000)).to_bits(); // 2^-24
    let mag = if exp == 0x7c00 {
        special
    } else if exp == 0 {
        sub
    } else {
        normal
    };
    f32::from_bits(mag | sign)
}

/// f32 to f16 bits, round to nearest even; overflow to infinity, NaN stays NaN.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = b & 0x7fff_ffff;
    // Normal range: rebias, then round the 13 dropped bits to nearest even.
    let normal = {
        let r = a.wrapping_sub(112 << 23);
        (r.wrapping_add(0x0fff + ((r >> 13) & 1)) >> 13) as u16
    };
    // Subnormal range (|x| < 2^-14): adding 0.5 makes the FPU round to the 2^-24 grid (RNE).
    let sub = (f32::from_bits(a) + 0.5f32)
        .to_bits()
        .wrapping_sub(0.5f32.to_bits()) as u16;
    let mag = if a > 0x7f80_0000 {
        0x7e00
    } else if a >= 0x4780_0000 {
        // >= 65536: infinity (65520 and up round to infinity via `normal` too).
        0x7c00
    } else if a < 0x3880_0000 {
        sub
    } else {
        normal.min(0x7c00)
    };
    mag | sign
}

trait Codec {
    type T: Copy;
    fn load(t: Self::T) -> f32;
    fn store(x: f32) -> Self::T;
}

struct F32C;
struct Bf16C;
struct F16C;

impl Codec for F32C {
    type T = f32;
    #[inline(always)]
    fn load(t: f32) -> f32 {
        t
    }
    #[inline(always)]
    fn store(x: f32) -> f32 {
        x
    }
}

impl Codec for Bf16C {
    type T = u16;
    #[inline(always)]
    fn load(t: u16) -> f32 {
        bf16_to_f32(t)
    }
    #[inline(always)]
    fn store(x: f32) -> u16 {
        f32_to_bf16(x)
    }
}

impl Codec for F16C {
    type T = u16;
    #[inline(always)]
    fn load(t: u16) -> f32 {
        f16_to_f32(t)
    }
    #[inline(always)]
    fn store(x: f32) -> u16 {
        f32_to_f16(x)
    }
}

/// Rotates one head's rotary dims. Interleaved pairs are de-interleaved into small stack
/// blocks so both layouts run the same lane-wise loop.
/// Pairs per block: fixed-size blocks let the compiler vectorize reliably.
const LANES: usize = 8;

#[inline(always)]
fn rot_block<C: Codec>(lo: &mut [C::T], hi: &mut [C::T], cos: &[f32], sin: &[f32]) {
    for k in 0..lo.len() {
        let (a, b) = (C::load(lo[k]), C::load(hi[k]));
        lo[k] = C::store(a * cos[k] - b * sin[k]);
        hi[k] = C::store(a * sin[k] + b * cos[k]);
    }
}

/// Rotates one head's rotary dims (the first `2 * cos.len()` of `x`).
#[inline(always)]
fn rotate_head<C: Codec>(x: &mut [C::T], cos: &[f32], sin: &[f32], layout: RotaryLayout) {
    let half = cos.len();
    let sin = &sin[..half];
    match layout {
        RotaryLayout::Neox => {
            let (lo, hi) = x[..2 * half].split_at_mut(half);
            let mut lo_it = lo.chunks_exact_mut(LANES);
            let mut hi_it = hi.chunks_exact_mut(LANES);
            let (mut c_it, mut s_it) = (cos.chunks_exact(LANES), sin.chunks_exact(LANES));
            for (((l, h), c), s) in (&mut lo_it).zip(&mut hi_it).zip(&mut c_it).zip(&mut s_it) {
                let (l, h): (&mut [C::T; LANES], &mut [C::T; LANES]) =
                    (l.try_into().expect("block"), h.try_into().expect("block"));
                let (c, s): (&[f32; LANES], &[f32; LANES]) =
                    (c.try_into().expect("block"), s.try_into().expect("block"));
                rot_block::<C>(l, h, c, s);
            }
            let (cr, sr) = (c_it.remainder(), s_it.remainder());
            rot_block::<C>(lo_it.into_remainder(), hi_it.into_remainder(), cr, sr);
        }
        RotaryLayout::Interleaved => {
            let mut x_it = x[..2 * half].chunks_exact_mut(2 * LANES);
            let (mut c_it, mut s_it) = (cos.chunks_exact(LANES), sin.chunks_exact(LANES));
            for ((x, c), s) in (&mut x_it).zip(&mut c_it).zip(&mut s_it) {
                let x: &mut [C::T; 2 * LANES] = x.try_into().expect("block");
                let mut a = [0f32; LANES];
                let mut b = [0f32; LANES];
                for k in 0..LANES {
                    a[k] = C::load(x[2 * k]);
                    b[k] = C::load(x[2 * k + 1]);
                }
                for k in 0..LANES {
                    x[2 * k] = C::store(a[k] * c[k] - b[k] * s[k]);
                    x[2 * k + 1] = C::store(a[k] * s[k] + b[k] * c[k]);
                }
            }
            let (cr, sr) = (c_it.remainder(), s_it.remainder());
            for ((p, &c), &s) in x_it.into_remainder().chunks_exact_mut(2).zip(cr).zip(sr) {
                let (a, b) = (C::load(p[0]), C::load(p[1]));
                p[0] = C::store(a * c - b * s);
                p[1] = C::store(a * s + b * c);
            }
        }
    }
}

#[inline(always)]
fn rotate_row<C: Codec>(buf: &mut [C::T], r: usize, head: Head, rot: &Rotation) {
    let row = &mut buf[r * head.width..(r + 1) * head.width];
    for x in row.chunks_exact_mut(head.dim).take(head.heads) {
        rotate_head::<C>(x, &rot.cos, &rot.sin, rot.layout);
    }
}

// No closures here: a closure is not `inline(always)` and would be compiled once, without
// the caller's target features.
#[inline(always)]
fn kernel<C: Codec>(buf: &mut [C::T], head: Head, sel: &Sel<'_>, rot: &Rotation) {
    match sel {
        Sel::List(slots) => {
            for &s in slots.iter() {
                rotate_row::<C>(buf, s as usize, head, rot);
            }
        }
        Sel::Range(r) => {
            for s in r.clone() {
                rotate_row::<C>(buf, s, head, rot);
            }
        }
    }
}

fn kernel_portable<C: Codec>(buf: &mut [C::T], head: Head, sel: &Sel<'_>, rot: &Rotation) {
    kernel::<C>(buf, head, sel, rot)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn kernel_avx2<C: Codec>(buf: &mut [C::T], head: Head, sel: &Sel<'_>, rot: &Rotation) {
    kernel::<C>(buf, head, sel, rot)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn kernel_avx512<C: Codec>(buf: &mut [C::T], head: Head, sel: &Sel<'_>, rot: &Rotation) {
    kernel::<C>(buf, head, sel, rot)
}

fn run<C: Codec>(buf: &mut [C::T], head: Head, sel: &Sel<'_>, rot: &Rotation, path: KernelPath) {
    match path {
        KernelPath::Portable => kernel_portable::<C>(buf, head, sel, rot),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: callers only pass a path whose `available()` is true, i.e. the CPU
        // reports avx2 and fma; the function is otherwise ordinary safe Rust.
        KernelPath::Avx2 => unsafe { kernel_avx2::<C>(buf, head, sel, rot) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, avx512f/bw/vl (and avx2/fma, implied) were detected.
        KernelPath::Avx512 => unsafe { kernel_avx512::<C>(buf, head, sel, rot) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => kernel_portable::<C>(buf, head, sel, rot),
    }
}

fn dispatch(rows: RowsMut<'_>, head: Head, sel: &Sel<'_>, rot: &Rotation, path: KernelPath) {
    debug_assert!(path.available());
    match rows {
        RowsMut::F32(b) => run::<F32C>(b, head, sel, rot, path),
        RowsMut::Bf16(b) => run::<Bf16C>(b, head, sel, rot, path),
        RowsMut::F16(b) => run::<F16C>(b, head, sel, rot, path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rope::RopeScaling;
    use half::{bf16, f16};

    /// splitmix64: seeded, dependency-free test data.
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
        fn unit(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        }
    }

    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Dt {
        F32,
        F16,
        Bf16,
    }

    enum Buf {
        F32(Vec<f32>),
        F16(Vec<u16>),
        Bf16(Vec<u16>),
    }

    impl Buf {
        /// Rounds through `half` (independent of this module's bit tricks).
        fn from_f64(dt: Dt, v: &[f64]) -> Buf {
            match dt {
                Dt::F32 => Buf::F32(v.iter().map(|&x| x as f32).collect()),
                Dt::F16 => Buf::F16(v.iter().map(|&x| f16::from_f64(x).to_bits()).collect()),
                Dt::Bf16 => Buf::Bf16(v.iter().map(|&x| bf16::from_f64(x).to_bits()).collect()),
            }
        }
        fn to_f64(&self) -> Vec<f64> {
            match self {
                Buf::F32(b) => b.iter().map(|&x| x as f64).collect(),
                Buf::F16(b) => b.iter().map(|&x| f16::from_bits(x).to_f64()).collect(),
                Buf::Bf16(b) => b.iter().map(|&x| bf16::from_bits(x).to_f64()).collect(),
            }
        }
        fn bits(&self) -> Vec<u32> {
            match self {
                Buf::F32(b) => b.iter().map(|x| x.to_bits()).collect(),
                Buf::F16(b) | Buf::Bf16(b) => b.iter().map(|&x| x as u32).collect(),
            }
        }
        fn rows(&mut self) -> RowsMut<'_> {
            match self {
                Buf::F32(b) => RowsMut::F32(b),
                Buf::F16(b) => RowsMut::F16(b),
                Buf::Bf16(b) => RowsMut::Bf16(b),
            }
        }
    }

    /// Unit roundoff of the storage type.
    fn unit_roundoff(dt: Dt) -> f64 {
        match dt {
            Dt::F32 => 2f64.powi(-24),
            Dt::F16 => 2f64.powi(-11),
            Dt::Bf16 => 2f64.powi(-8),
        }
    }

    /// Independent f64 RoPE: pairs by layout, frequency `1 / (theta^(2i/rd) * factor)`.
    fn ref_rope(
        x: &[f64],
        pos: f64,
        theta: f64,
        rd: usize,
        factor: f64,
        layout: RotaryLayout,
    ) -> Vec<f64> {
        let mut y = x.to_vec();
        for i in 0..rd / 2 {
            let f = 1.0 / (theta.powf(2.0 * i as f64 / rd as f64) * factor);
            let (j0, j1) = match layout {
                RotaryLayout::Interleaved => (2 * i, 2 * i + 1),
                RotaryLayout::Neox => (i, i + rd / 2),
            };
            let (c, s) = ((pos * f).cos(), (pos * f).sin());
            y[j0] = x[j0] * c - x[j1] * s;
            y[j1] = x[j0] * s + x[j1] * c;
        }
        y
    }

    fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
        let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
        let den: f64 = want.iter().map(|w| w * w).sum();
        (num / den).sqrt()
    }

    const DELTAS: [i64; 11] = [0, 1, -1, 127, -127, 128, -128, 129, -129, 1024, -1024];

    /// Keys rotated to p, stored, shifted by delta, vs keys rotated from scratch to p + delta.
    #[test]
    fn shift_equals_rotation_from_scratch() {
        let (k_heads, head_dim, cap) = (3usize, 64usize, 12usize);
        let width = k_heads * head_dim;
        let theta = 10000.0;
        let mut rng = Rng(7);
        let pre: Vec<Vec<f64>> = (0..cap)
            .map(|_| (0..width).map(|_| rng.unit()).collect())
            .collect();
        let pos = |s: usize| 3000.0 + 13.0 * s as f64;
        let shifted: Vec<u32> = vec![1, 4, 5, 6, 10];
        for layout in [RotaryLayout::Interleaved, RotaryLayout::Neox] {
            for (rd, factor) in [(64usize, 1.0), (32, 1.5)] {
                let scaling = if factor == 1.0 {
                    RopeScaling::None
                } else {
                    RopeScaling::Linear { factor }
                };
                let spec = RopeSpec {
                    theta,
                    head_dim,
                    rotary_dim: rd,
                    layout,
                    scaling,
                };
                let at = |s: usize, p: f64| -> Vec<f64> {
                    pre[s]
                        .chunks(head_dim)
                        .flat_map(|h| ref_rope(h, p, theta, rd, factor, layout))
                        .collect()
                };
                for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
                    let bound = 2.0 * unit_roundoff(dt) + 1e-6;
                    let mut worst = 0f64;
                    for delta in DELTAS {
                        let start: Vec<f64> = (0..cap).flat_map(|s| at(s, pos(s))).collect();
                        let mut buf = Buf::from_f64(dt, &start);
                        let before = buf.bits();
                        shift_rows(buf.rows(), k_heads, head_dim, &shifted, &spec, delta).unwrap();
                        let after = buf.to_f64();
                        let bits = buf.bits();
                        for s in 0..cap {
                            let row = s * width..(s + 1) * width;
                            if !shifted.contains(&(s as u32)) {
                                assert_eq!(bits[row.clone()], before[row], "slot {s} untouched");
                                continue;
                            }
                            let want = at(s, pos(s) + delta as f64);
                            let e = rel_l2(&after[row.clone()], &want);
                            worst = worst.max(e);
                            assert!(
                                e <= bound,
                                "{layout:?} rd {rd} {dt:?} delta {delta}: {e} > {bound}"
                            );
                            for h in 0..k_heads {
                                let tail =
                                    s * width + h * head_dim + rd..s * width + (h + 1) * head_dim;
                                assert_eq!(
                                    bits[tail.clone()],
                                    before[tail],
                                    "non-rotary tail kept"
                                );
                            }
                        }
                    }
                    if dt == Dt::F32 {
                        assert!(
                            worst > 0.0,
                            "a rounding-free result would mean nothing was checked"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn contiguous_range_equals_list() {
        let spec = RopeSpec::plain(10000.0, 16, RotaryLayout::Neox);
        let mut rng = Rng(3);
        let v: Vec<f64> = (0..10 * 32).map(|_| rng.unit()).collect();
        let (mut a, mut b) = (Buf::from_f64(Dt::Bf16, &v), Buf::from_f64(Dt::Bf16, &v));
        shift_rows(a.rows(), 2, 16, &[2, 3, 4, 5], &spec, -77).unwrap();
        shift_rows_range(b.rows(), 2, 16, 2..6, &spec, -77).unwrap();
        assert_eq!(a.bits(), b.bits());
        assert!(shift_rows_range(b.rows(), 2, 16, 8..11, &spec, 1).is_err());
        shift_rows_range(b.rows(), 2, 16, 4..4, &spec, 1).unwrap();
    }

    /// A YaRN spec with an attention factor != 1: 100 shifts must keep every norm, and land
    /// where one rotation by the sum lands.
    #[test]
    fn yarn_norms_survive_100_shifts() {
        let spec = RopeSpec {
            theta: 10000.0,
            head_dim: 24,
            rotary_dim: 8,
            layout: RotaryLayout::Interleaved,
            scaling: RopeScaling::Yarn {
                factor: 40.0,
                original_max_position: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 0.0,
            },
        };
        assert!(spec.attention_factor() > 1.3);
        let mut rng = Rng(11);
        let v: Vec<f32> = (0..4 * 24).map(|_| rng.unit() as f32).collect();
        let mut buf = v.clone();
        let mut total = 0i64;
        for _ in 0..100 {
            let d = (rng.next() % 2001) as i64 - 1000;
            total += d;
            shift_rows(RowsMut::F32(&mut buf), 1, 24, &[0, 1, 2, 3], &spec, d).unwrap();
        }
        let mut once = v.clone();
        shift_rows(RowsMut::F32(&mut once), 1, 24, &[0, 1, 2, 3], &spec, total).unwrap();
        for s in 0..4 {
            let r = s * 24..(s + 1) * 24;
            let n = |x: &[f32]| x.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt();
            let (n0, n1) = (n(&v[r.clone()]), n(&buf[r.clone()]));
            assert!((n1 / n0 - 1.0).abs() < 2e-5, "norm ratio {}", n1 / n0);
            let a: Vec<f64> = buf[r.clone()].iter().map(|&x| x as f64).collect();
            let b: Vec<f64> = once[r].iter().map(|&x| x as f64).collect();
            assert!(rel_l2(&a, &b) < 2e-5);
        }
    }

    /// Every available SIMD path equals the portable path bit for bit (odd shapes, specials).
    #[test]
    fn simd_paths_equal_portable() {
        let specials = [
            f32::NAN,
            f32::INFINITY,
            -0.0,
            1e-40,
            6.0e-8,
            70000.0,
            65519.0,
        ];
        let mut tested = 0;
        for path in [KernelPath::Avx2, KernelPath::Avx512] {
            if !path.available() {
                eprintln!("skipping {path:?}: not available on this CPU");
                continue;
            }
            for (k_heads, head_dim, rd) in
                [(3, 64, 64), (2, 24, 18), (1, 8, 8), (4, 128, 64), (5, 6, 2)]
            {
                for layout in [RotaryLayout::Interleaved, RotaryLayout::Neox] {
                    let spec = RopeSpec {
                        rotary_dim: rd,
                        ..RopeSpec::plain(1e6, head_dim, layout)
                    };
                    let mut rng = Rng(rd as u64 * 31 + head_dim as u64);
                    let n = 9 * k_heads * head_dim;
                    let mut v: Vec<f64> = (0..n).map(|_| rng.unit() * 4.0).collect();
                    for (i, &s) in specials.iter().enumerate() {
                        v[i * 7 % n] = s as f64;
                    }
                    for dt in [Dt::F32, Dt::F16, Dt::Bf16] {
                        for delta in [1i64, -129, 100_003] {
                            let rot = shift_table(&spec, delta).unwrap();
                            let slots = [0u32, 2, 3, 8, 5];
                            let (mut a, mut b) = (Buf::from_f64(dt, &v), Buf::from_f64(dt, &v));
                            shift_rows_with(
                                a.rows(),
                                k_heads,
                                head_dim,
                                &slots,
                                &rot,
                                KernelPath::Portable,
                            )
                            .unwrap();
                            shift_rows_with(b.rows(), k_heads, head_dim, &slots, &rot, path)
                                .unwrap();
                            assert_eq!(
                                a.bits(),
                                b.bits(),
                                "{path:?} {dt:?} {layout:?} {head_dim}/{rd}"
                            );
                            tested += 1;
                        }
                    }
                }
            }
        }
        eprintln!("{tested} SIMD comparisons");
    }

    #[test]
    fn bit_conversions_match_half() {
        for h in 0..=u16::MAX {
            let (a, b) = (f16_to_f32(h), f16::from_bits(h).to_f32());
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "f16 {h:#06x}"
            );
            let (a, b) = (bf16_to_f32(h), bf16::from_bits(h).to_f32());
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "bf16 {h:#06x}"
            );
        }
        let mut rng = Rng(5);
        let check = |x: f32| {
            let (a, b) = (f32_to_f16(x), f16::from_f32(x).to_bits());
            assert!(
                a == b || (x.is_nan() && f16::from_bits(a).is_nan()),
                "f16 of {x:e}: {a:#x} vs {b:#x}"
            );
            let (a, b) = (f32_to_bf16(x), bf16::from_f32(x).to_bits());
            assert!(
                a == b || (x.is_nan() && bf16::from_bits(a).is_nan()),
                "bf16 of {x:e}: {a:#x} vs {b:#x}"
            );
        };
        for _ in 0..2_000_000 {
            check(f32::from_bits(rng.next() as u32));
        }
        // Ties and edges: halfway points of both grids, subnormals, overflow.
        for h in 0..=u16::MAX {
            let lo = f16::from_bits(h).to_f32();
            check(lo);
            check(f32::from_bits(lo.to_bits() + (1 << 12)));
            check(f32::from_bits(lo.to_bits() + (1 << 12) + 1));
            let lo = bf16::from_bits(h).to_f32();
            check(f32::from_bits(lo.to_bits() + 0x8000));
        }
        for x in [
            65504.0,
            65519.99,
            65520.0,
            1e9,
            5.96e-8,
            2.98e-8,
            2.99e-8,
            6.1e-5,
            f32::MAX,
        ] {
            check(x);
            check(-x);
        }
    }

    #[test]
    fn bad_input_is_refused_before_writing() {
        let spec = RopeSpec::plain(10000.0, 8, RotaryLayout::Neox);
        let mut v = vec![1.0f32; 32];
        let e = shift_rows(RowsMut::F32(&mut v), 2, 8, &[0, 2], &spec, 3).unwrap_err();
        assert_eq!(
            e,
            KvError::SlotOutOfRange {
                slot: 2,
                capacity: 2
            }
        );
        assert!(v.iter().all(|&x| x == 1.0), "nothing written on error");
        assert!(matches!(
            shift_rows(RowsMut::F32(&mut v[..30]), 2, 8, &[0], &spec, 3),
            Err(KvError::WidthMismatch { .. })
        ));
        assert!(matches!(
            shift_rows(RowsMut::F32(&mut v), 4, 4, &[0], &spec, 3),
            Err(KvError::InvalidRope(_))
        ));
        let ntk = RopeSpec {
            scaling: RopeScaling::DynamicNtk {
                factor: 2.0,
                original_max_position: 2048.0,
            },
            ..spec
        };
        assert!(matches!(
            shift_rows(RowsMut::F32(&mut v), 2, 8, &[0], &ntk, 3),
            Err(KvError::NotShiftable(_))
        ));
    }

    /// bf16 arithmetic drifts more than f32 arithmetic over a chain of shifts.
    #[test]
    fn lowprec_rotation_drifts_more() {
        let spec = RopeSpec::plain(10000.0, 64, RotaryLayout::Neox);
        let mut rng = Rng(19);
        let pre: Vec<f64> = (0..8 * 64).map(|_| rng.unit()).collect();
        let (mut hi, mut lo) = (Buf::from_f64(Dt::Bf16, &pre), Buf::from_f64(Dt::Bf16, &pre));
        let slots: Vec<u32> = (0..8).collect();
        for _ in 0..20 {
            shift_rows(hi.rows(), 1, 64, &slots, &spec, 37).unwrap();
            shift_rows_lowprec(lo.rows(), 1, 64, &slots, &spec, 37).unwrap();
        }
        let want: Vec<f64> = pre
            .chunks(64)
            .flat_map(|h| ref_rope(h, 740.0, 10000.0, 64, 1.0, RotaryLayout::Neox))
            .collect();
        let (e_hi, e_lo) = (rel_l2(&hi.to_f64(), &want), rel_l2(&lo.to_f64(), &want));
        assert!(e_hi < e_lo, "f32 math {e_hi} vs bf16 math {e_lo}");
        assert!(e_hi < 20.0 * 2f64.powi(-8));
    }
}
