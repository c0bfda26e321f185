//! The forward pass's rotary embedding: cos/sin of every new token's position for one
//! [`RopeSpec`], applied to the heads of Q/K rows. (A shift of cached keys uses the
//! kernels' [`leyline_kernels::rotate`] with the same spec, so both see the same
//! frequencies.)

use leyline_kernels::rope::{RopeSpec, RotaryLayout};
use std::ops::Range;

/// cos/sin of each position times each frequency of one spec, `[tokens, rotary_dim / 2]`
/// each: phases in f64, rounded once to f32, unit magnitude (no attention factor).
pub(crate) struct RopeTables {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    head_dim: usize,
    layout: RotaryLayout,
}

impl RopeTables {
    /// The tables of `spec` at `positions`.
    pub(crate) fn new(spec: &RopeSpec, positions: &[u32]) -> Self {
        let inv_freq = spec.inv_freq();
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        Self {
            cos,
            sin,
            half,
            head_dim: spec.head_dim,
            layout: spec.layout,
        }
    }

    /// Rotates the heads `heads` of each `stride`-wide row of `x` (row `t` at position `t`
    /// of the tables): the first `rotary_dim` dims of each head, the rest kept.
    pub(crate) fn apply(&self, x: &mut [f32], stride: usize, heads: Range<usize>) {
        let (hd, half) = (self.head_dim, self.half);
        for (t, xr) in x.chunks_exact_mut(stride).enumerate() {
            let (c, s) = (
                &self.cos[t * half..(t + 1) * half],
                &self.sin[t * half..(t + 1) * half],
            );
            for h in xr[heads.start * hd..heads.end * hd].chunks_exact_mut(hd) {
                match self.layout {
                    RotaryLayout::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (h[2 * i], h[2 * i + 1]);
                            h[2 * i] = a * c[i] - b * s[i];
                            h[2 * i + 1] = a * s[i] + b * c[i];
                        }
                    }
                    RotaryLayout::Neox => {
                        for i in 0..half {
                            let (a, b) = (h[i], h[i + half]);
                            h[i] = a * c[i] - b * s[i];
                            h[i + half] = a * s[i] + b * c[i];
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leyline_kernels::rope::RopeScaling;

    /// The forward's tables rotate as the kernels' rotation does (the shift's reference),
    /// frequency factors and partial rotary dims included: a key rotated to `p` by the
    /// forward and shifted by `d` is a key rotated to `p + d`.
    #[test]
    fn forward_tables_agree_with_the_shift_rotation() {
        for layout in [RotaryLayout::Interleaved, RotaryLayout::Neox] {
            let spec = RopeSpec {
                rotary_dim: 8,
                scaling: RopeScaling::Linear { factor: 2.0 },
                freq_factors: Some(vec![1.0, 2.0, 4.0, 8.0].into()),
                ..RopeSpec::plain(500_000.0, 12, layout)
            };
            let x: Vec<f32> = (0..24).map(|i| (i as f32 * 0.91).cos()).collect();
            let (p, d) = (1000u32, 37i64);
            let mut fwd = x.clone();
            RopeTables::new(&spec, &[p]).apply(&mut fwd, 24, 0..2);
            let mut want = x.clone();
            for h in want.chunks_exact_mut(12) {
                spec.rotate_f32(h, p as i64);
            }
            assert_eq!(fwd, want, "{layout:?}: same phases, same products");
            let mut later = x;
            RopeTables::new(&spec, &[p + d as u32]).apply(&mut later, 24, 0..2);
            for h in fwd.chunks_exact_mut(12) {
                spec.rotate_f32(h, d);
            }
            for (a, b) in fwd.iter().zip(&later) {
                assert!((a - b).abs() < 1e-5, "{layout:?}: {a} vs {b}");
            }
        }
    }
}
