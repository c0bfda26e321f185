//! The portable kernel: generic Rust over fixed-size blocks, which the compiler vectorizes
//! for the baseline target; also the scalar pair step the SIMD kernels use for tails.

use super::{Head, Sel, Tables};
use crate::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::rope::{RotaryLayout, Rotation};
use crate::rows::RowsMut;

/// A storage dtype: load to f32, store rounded once.
pub(super) trait Codec {
    type T: Copy;
    fn load(t: Self::T) -> f32;
    fn store(x: f32) -> Self::T;
}

pub(super) struct F32C;
pub(super) struct Bf16C;
pub(super) struct F16C;

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

/// The rotation of one pair, in the one order every tier uses (no FMA contraction).
#[inline(always)]
fn rot_pair(a: f32, b: f32, c: f32, s: f32) -> (f32, f32) {
    (a * c - b * s, b * c + a * s)
}

/// Rotates pair `k` of the head at `x` with the scalar step (SIMD tails).
///
/// # Safety
/// `x` points to a head of at least `2 * t.half` elements and `k < t.half`.
#[inline(always)]
pub(super) unsafe fn pair_scalar<C: Codec>(x: *mut C::T, k: usize, t: &Tables) {
    let (j0, j1) = match t.layout {
        RotaryLayout::Interleaved => (2 * k, 2 * k + 1),
        RotaryLayout::Neox => (k, k + t.half),
    };
    let (a, b) = rot_pair(C::load(*x.add(j0)), C::load(*x.add(j1)), t.c[k], t.s[k]);
    *x.add(j0) = C::store(a);
    *x.add(j1) = C::store(b);
}

/// Pairs per block: fixed-size blocks let the compiler vectorize reliably.
const LANES: usize = 8;

#[inline(always)]
fn rot_block<C: Codec>(lo: &mut [C::T], hi: &mut [C::T], cos: &[f32], sin: &[f32]) {
    for k in 0..lo.len() {
        let (a, b) = rot_pair(C::load(lo[k]), C::load(hi[k]), cos[k], sin[k]);
        lo[k] = C::store(a);
        hi[k] = C::store(b);
    }
}

/// Rotates one head's rotary dims (the first `2 * cos.len()` of `x`). Interleaved pairs are
/// de-interleaved into small stack blocks so both layouts run the same lane-wise loop.
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
                    let (p, q) = rot_pair(a[k], b[k], c[k], s[k]);
                    x[2 * k] = C::store(p);
                    x[2 * k + 1] = C::store(q);
                }
            }
            let (cr, sr) = (c_it.remainder(), s_it.remainder());
            for ((p, &c), &s) in x_it.into_remainder().chunks_exact_mut(2).zip(cr).zip(sr) {
                let (a, b) = rot_pair(C::load(p[0]), C::load(p[1]), c, s);
                p[0] = C::store(a);
                p[1] = C::store(b);
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

/// Rotates the selected rows with the portable kernel (bounds-checked safe Rust).
pub(super) fn run(rows: RowsMut<'_>, head: Head, sel: &Sel<'_>, rot: &Rotation) {
    match rows {
        RowsMut::F32(b) => kernel::<F32C>(b, head, sel, rot),
        RowsMut::Bf16(b) => kernel::<Bf16C>(b, head, sel, rot),
        RowsMut::F16(b) => kernel::<F16C>(b, head, sel, rot),
    }
}
