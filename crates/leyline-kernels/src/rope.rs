//! Rotary position embedding: frequencies, layouts, and the rotation of one head vector.
//!
//! A key at position `p` holds `R(p) k` on its rotary dims, where `R(p)` rotates each pair
//! `i` by `p * inv_freq[i]`. Because `R(a) R(b) = R(a + b)` whenever `inv_freq` depends on
//! the dimension only, a cached key moves from `p` to `p + delta` by `R(delta)` alone
//! ([`crate::rotate`]). Sequence-length-dependent scaling (dynamic NTK) breaks that and is
//! refused by [`RopeSpec::ensure_shiftable`].

use crate::error::{KernelError, Result};
use std::f64::consts::PI;
use std::sync::Arc;

/// Which dims form a rotating pair inside the first `rotary_dim` dims of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RotaryLayout {
    /// Adjacent pairs `(2i, 2i+1)` (GGUF llama after its Q/K row permutation; DeepSeek `k_pe`).
    Interleaved,
    /// Halves `(i, i + rotary_dim/2)` (HF `rotate_half`; Qwen2 GGUF).
    Neox,
}

/// Frequency scaling of a RoPE model (HF `rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain `theta^(-2i/d)`.
    None,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// Interpolation factor.
        factor: f64,
    },
    /// Llama 3.x: long wavelengths divided by `factor`, short ones kept, a smooth ramp between.
    Llama3 {
        /// Scale of the long wavelengths.
        factor: f64,
        /// Wavelengths above `original_max_position / low_freq_factor` are scaled fully.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// Context length of pre-training.
        original_max_position: f64,
    },
    /// YaRN (DeepSeek-V2 / HF `_compute_yarn_parameters`, `truncate = true`).
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Context length of pre-training.
        original_max_position: f64,
        /// Rotations over the original context above which a dim is extrapolated (HF default 32).
        beta_fast: f64,
        /// Rotations below which a dim is fully interpolated (HF default 1).
        beta_slow: f64,
        /// `mscale` (0 = absent, as HF treats a falsy value).
        mscale: f64,
        /// `mscale_all_dim` (0 = absent).
        mscale_all_dim: f64,
    },
    /// Dynamic NTK: the base grows with the *current* sequence length. Not shiftable.
    DynamicNtk {
        /// Scaling factor.
        factor: f64,
        /// Context length of pre-training.
        original_max_position: f64,
    },
}

/// Everything needed to rotate one head's rotary dims.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Base of the frequencies (`rope_theta`).
    pub theta: f64,
    /// Width of one head of the key part.
    pub head_dim: usize,
    /// Leading dims that rotate (even, `<= head_dim`); the rest is position-free.
    pub rotary_dim: usize,
    /// Pairing of dims.
    pub layout: RotaryLayout,
    /// Frequency scaling.
    pub scaling: RopeScaling,
    /// Per-frequency divisors, one per rotating pair (`rotary_dim / 2`), applied after
    /// [`Self::scaling`]: frequency `i` becomes `inv_freq[i] / freq_factors[i]`. What a GGUF
    /// file's `rope_freqs.weight` holds (Llama 3's scaling, computed by the converter;
    /// llama.cpp's `ggml_rope_ext` `freq_factors`). They depend on the dimension only, so
    /// shifts still compose.
    pub freq_factors: Option<Arc<[f64]>>,
}

/// YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for `scale <= 1`).
///
/// A forward pass of a DeepSeek model also multiplies its softmax scale by
/// `yarn_get_mscale(factor, mscale_all_dim)^2`; that is the model's business, not a shift's.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeSpec {
    /// A spec without scaling whose rotary dims cover the whole head.
    pub fn plain(theta: f64, head_dim: usize, layout: RotaryLayout) -> Self {
        Self {
            theta,
            head_dim,
            rotary_dim: head_dim,
            layout,
            scaling: RopeScaling::None,
            freq_factors: None,
        }
    }

    /// Checks that the spec describes a rotation.
    ///
    /// # Errors
    /// [`KernelError::InvalidRope`] for a non-positive or non-finite theta or factor, a zero, odd
    /// or oversized `rotary_dim`.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(KernelError::InvalidRope(m));
        if !(self.theta.is_finite() && self.theta > 1.0) {
            return bad(format!("theta {} must be finite and > 1", self.theta));
        }
        if self.rotary_dim == 0
            || !self.rotary_dim.is_multiple_of(2)
            || self.rotary_dim > self.head_dim
        {
            return bad(format!(
                "rotary_dim {} must be even, non-zero and <= head_dim {}",
                self.rotary_dim, self.head_dim
            ));
        }
        let factor = match self.scaling {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } => factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                ..
            } => {
                if high_freq_factor.partial_cmp(&low_freq_factor)
                    != Some(std::cmp::Ordering::Greater)
                {
                    return bad("llama3 high_freq_factor must exceed low_freq_factor".into());
                }
                factor
            }
            RopeScaling::Yarn {
                factor,
                original_max_position,
                ..
            }
            | RopeScaling::DynamicNtk {
                factor,
                original_max_position,
            } => {
                if original_max_position.is_nan() || original_max_position <= 0.0 {
                    return bad("original_max_position must be positive".into());
                }
                factor
            }
        };
        if !(factor.is_finite() && factor > 0.0) {
            return bad(format!(
                "scaling factor {factor} must be finite and positive"
            ));
        }
        if let Some(ff) = &self.freq_factors {
            if ff.len() != self.rotary_dim / 2 {
                return bad(format!(
                    "{} frequency factors for {} rotating pairs",
                    ff.len(),
                    self.rotary_dim / 2
                ));
            }
            if let Some((i, f)) = ff
                .iter()
                .enumerate()
                .find(|(_, f)| !(f.is_finite() && **f > 0.0))
            {
                return bad(format!(
                    "frequency factor {i} is {f}; it must be finite and positive"
                ));
            }
        }
        Ok(())
    }

    /// `rotary_dim / 2` angular frequencies (radians per position), scaling and
    /// [`Self::freq_factors`] applied.
    ///
    /// For [`RopeScaling::DynamicNtk`] these are the frequencies for sequences within the
    /// original context (the base is unchanged there).
    pub fn inv_freq(&self) -> Vec<f64> {
        let mut f = self.scaled_inv_freq();
        if let Some(ff) = &self.freq_factors {
            for (f, d) in f.iter_mut().zip(ff.iter()) {
                *f /= d;
            }
        }
        f
    }

    /// The frequencies with [`Self::scaling`] applied, before the per-frequency factors.
    fn scaled_inv_freq(&self) -> Vec<f64> {
        let d = self.rotary_dim as f64;
        let base: Vec<f64> = (0..self.rotary_dim / 2)
            .map(|i| self.theta.powf(-((2 * i) as f64) / d))
            .collect();
        match self.scaling {
            RopeScaling::None | RopeScaling::DynamicNtk { .. } => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let low_wavelen = original_max_position / low_freq_factor;
                let high_wavelen = original_max_position / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original_max_position / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position,
                beta_fast,
                beta_slow,
                ..
            } => {
                // Dim index at which a frequency makes `rotations` turns over the original context.
                let correction_dim = |rotations: f64| {
                    d * (original_max_position / (rotations * 2.0 * PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let low = correction_dim(beta_fast).floor().max(0.0);
                let mut high = correction_dim(beta_slow).ceil().min(d - 1.0);
                if low == high {
                    high += 0.001;
                }
                base.iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        // ramp 0: extrapolate (keep f); ramp 1: interpolate (f / factor).
                        f / factor * ramp + f * (1.0 - ramp)
                    })
                    .collect()
            }
        }
    }

    /// The magnitude factor a *forward pass* bakes into its cos/sin tables (HF
    /// `attention_scaling`): YaRN's `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`
    /// when both are given, else `mscale(factor, 1)`; 1.0 for every other scaling.
    ///
    /// Never use it in a shift: a relative rotation must be unit-magnitude, or every shift
    /// multiplies key norms by this factor again.
    pub fn attention_factor(&self) -> f64 {
        match self.scaling {
            RopeScaling::Yarn {
                factor,
                mscale,
                mscale_all_dim,
                ..
            } => {
                if mscale != 0.0 && mscale_all_dim != 0.0 {
                    yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
                } else {
                    yarn_get_mscale(factor, 1.0)
                }
            }
            _ => 1.0,
        }
    }

    /// Checks that cached keys can be moved by a relative rotation.
    ///
    /// # Errors
    /// [`KernelError::NotShiftable`] for dynamic NTK (frequencies depend on the sequence length,
    /// so `R(a) R(b) != R(a + b)` across lengths), [`KernelError::InvalidRope`] for a bad spec.
    pub fn ensure_shiftable(&self) -> Result<()> {
        self.validate()?;
        if let RopeScaling::DynamicNtk { .. } = self.scaling {
            return Err(KernelError::NotShiftable(
                "dynamic NTK RoPE scaling depends on the sequence length; use FORGET mode".into(),
            ));
        }
        Ok(())
    }

    /// Rotates one head vector `x` (its first `rotary_dim` dims) in place by `position`,
    /// with unit cos/sin computed in f64 and math in f32. No attention factor is applied.
    ///
    /// For many vectors at one position build a [`Rotation`] once instead.
    ///
    /// # Panics
    /// If `x.len() < rotary_dim`.
    pub fn rotate_f32(&self, x: &mut [f32], position: i64) {
        Rotation::new(self, position).apply_f32(x);
    }
}

/// The rotary embeddings of a model's layers: a few distinct specs, and which one each layer
/// uses (Gemma 3's local and global layers have different bases; most models have one spec).
///
/// A shift builds one table per spec, not per layer ([`crate::rotate::shift_tables`]), and
/// rotates each layer's keys by its own spec's table.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerRopes {
    specs: Vec<RopeSpec>,
    of_layer: Vec<usize>,
}

impl LayerRopes {
    /// Every one of `layers` layers uses `spec`.
    pub fn uniform(spec: RopeSpec, layers: usize) -> Self {
        Self {
            specs: vec![spec],
            of_layer: vec![0; layers],
        }
    }

    /// Layer `l` uses `specs[of_layer[l]]`.
    ///
    /// # Errors
    /// [`KernelError::InvalidRope`] for no specs, an index past them, a spec unused by every
    /// layer, or a spec that [`RopeSpec::validate`] refuses.
    pub fn new(specs: Vec<RopeSpec>, of_layer: Vec<usize>) -> Result<Self> {
        if specs.is_empty() {
            return Err(KernelError::InvalidRope(
                "no rope spec for the layers".into(),
            ));
        }
        for (i, s) in specs.iter().enumerate() {
            s.validate()?;
            if !of_layer.contains(&i) {
                return Err(KernelError::InvalidRope(format!(
                    "rope spec {i} is used by no layer"
                )));
            }
        }
        if let Some((l, &i)) = of_layer.iter().enumerate().find(|(_, &i)| i >= specs.len()) {
            return Err(KernelError::InvalidRope(format!(
                "layer {l} names rope spec {i} of {}",
                specs.len()
            )));
        }
        Ok(Self { specs, of_layer })
    }

    /// The distinct specs.
    pub fn specs(&self) -> &[RopeSpec] {
        &self.specs
    }

    /// Per layer, the index of its spec in [`Self::specs`].
    pub fn of_layer(&self) -> &[usize] {
        &self.of_layer
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.of_layer.len()
    }

    /// The spec of `layer`.
    ///
    /// # Panics
    /// If `layer >= self.layers()`.
    pub fn spec(&self, layer: usize) -> &RopeSpec {
        &self.specs[self.of_layer[layer]]
    }

    /// Checks that every spec can move cached keys by a relative rotation.
    ///
    /// # Errors
    /// As [`RopeSpec::ensure_shiftable`], for the first spec that cannot.
    pub fn ensure_shiftable(&self) -> Result<()> {
        self.specs.iter().try_for_each(RopeSpec::ensure_shiftable)
    }
}

/// Unit cos/sin of `angle * inv_freq[i]` for one spec: a rotation `R(angle)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotation {
    /// `cos(angle * inv_freq[i])`, rounded once to f32.
    pub cos: Vec<f32>,
    /// `sin(angle * inv_freq[i])`, rounded once to f32.
    pub sin: Vec<f32>,
    /// Pairing of dims.
    pub layout: RotaryLayout,
    /// Width of the head this rotation was built for (its tail past `rotary_dim` is kept).
    pub head_dim: usize,
}

impl Rotation {
    /// `R(angle)` for `spec` (phases and cos/sin in f64; unit magnitude by construction).
    pub fn new(spec: &RopeSpec, angle: i64) -> Self {
        let (cos, sin) = spec
            .inv_freq()
            .iter()
            .map(|f| {
                let (s, c) = (angle as f64 * f).sin_cos();
                (c as f32, s as f32)
            })
            .unzip();
        Self {
            cos,
            sin,
            layout: spec.layout,
            head_dim: spec.head_dim,
        }
    }

    /// Number of rotating dims (`2 * cos.len()`).
    pub fn rotary_dim(&self) -> usize {
        2 * self.cos.len()
    }

    /// Rotates the first `rotary_dim` dims of one head vector in place.
    ///
    /// # Panics
    /// If `x.len() < rotary_dim`.
    pub fn apply_f32(&self, x: &mut [f32]) {
        let h = self.cos.len();
        match self.layout {
            RotaryLayout::Interleaved => {
                for ((p, &c), &s) in x[..2 * h].chunks_exact_mut(2).zip(&self.cos).zip(&self.sin) {
                    let (a, b) = (p[0], p[1]);
                    p[0] = a * c - b * s;
                    p[1] = a * s + b * c;
                }
            }
            RotaryLayout::Neox => {
                let (lo, hi) = x[..2 * h].split_at_mut(h);
                for (((a, b), &c), &s) in lo
                    .iter_mut()
                    .zip(hi.iter_mut())
                    .zip(&self.cos)
                    .zip(&self.sin)
                {
                    let (x0, x1) = (*a, *b);
                    *a = x0 * c - x1 * s;
                    *b = x0 * s + x1 * c;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yarn_fixture_spec() -> RopeSpec {
        RopeSpec {
            theta: 10000.0,
            head_dim: 8,
            rotary_dim: 8,
            layout: RotaryLayout::Interleaved,
            scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_max_position: 128.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 0.707,
                mscale_all_dim: 0.707,
            },
            freq_factors: None,
        }
    }

    #[test]
    fn yarn_inv_freq_by_hand() {
        // theta 1e4, d 8: base 1, 0.1, 0.01, 0.001. Correction dims: beta_fast 32 ->
        // 8 ln(128/(64 pi)) / (2 ln 1e4) = -0.196 -> floor -> 0; beta_slow 1 -> 1.309 -> ceil 2.
        // Ramp over i = 0..4 is [0, .5, 1, 1]: 1, (0.1 + 0.025)/2, 0.01/4, 0.001/4.
        let got = yarn_fixture_spec().inv_freq();
        let want = [1.0, 0.0625, 0.0025, 0.00025];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-12 * w, "{g} vs {w}");
        }
        assert_eq!(yarn_fixture_spec().attention_factor(), 1.0);
    }

    #[test]
    fn yarn_attention_factor_without_mscale_all_dim() {
        let mut spec = yarn_fixture_spec();
        if let RopeScaling::Yarn {
            ref mut mscale,
            ref mut mscale_all_dim,
            ..
        } = spec.scaling
        {
            *mscale = 0.0;
            *mscale_all_dim = 0.0;
        }
        assert!((spec.attention_factor() - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-15);
    }

    #[test]
    fn llama3_regimes() {
        let spec = RopeSpec {
            theta: 500000.0,
            head_dim: 128,
            rotary_dim: 128,
            layout: RotaryLayout::Neox,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192.0,
            },
            freq_factors: None,
        };
        let got = spec.inv_freq();
        for (i, g) in got.iter().enumerate() {
            let f = 500000f64.powf(-(2.0 * i as f64) / 128.0);
            let wl = 2.0 * PI / f;
            if wl < 2048.0 {
                assert_eq!(*g, f);
            } else if wl > 8192.0 {
                assert!((g - f / 8.0).abs() < 1e-18);
            } else {
                assert!(*g < f && *g > f / 8.0, "dim {i} is between the regimes");
            }
        }
        // Monotone decreasing: the smoothing never reorders frequencies.
        assert!(got.windows(2).all(|w| w[1] < w[0]));
    }

    /// Frequency factors divide the scaled frequencies pair by pair (llama.cpp's
    /// `theta / freq_factors[i]`, then `freq_scale`), and a bad list is refused.
    #[test]
    fn freq_factors_divide_each_frequency() {
        let ff: Arc<[f64]> = vec![1.0, 2.0, 4.0, 8.0].into();
        let spec = RopeSpec {
            scaling: RopeScaling::Linear { factor: 2.0 },
            freq_factors: Some(ff.clone()),
            ..RopeSpec::plain(10000.0, 8, RotaryLayout::Neox)
        };
        spec.validate().unwrap();
        for (i, g) in spec.inv_freq().iter().enumerate() {
            let want = 10000f64.powf(-(2.0 * i as f64) / 8.0) / 2.0 / ff[i];
            assert!((g - want).abs() <= 1e-15 * want, "pair {i}: {g} vs {want}");
        }
        let short = RopeSpec {
            freq_factors: Some(vec![1.0, 2.0].into()),
            ..spec.clone()
        };
        assert!(short
            .validate()
            .unwrap_err()
            .to_string()
            .contains("2 frequency factors"));
        let zero = RopeSpec {
            freq_factors: Some(vec![1.0, 0.0, 1.0, 1.0].into()),
            ..spec
        };
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("factor 1"));
    }

    #[test]
    fn layer_ropes_map_layers_to_specs() {
        let local = RopeSpec::plain(10_000.0, 8, RotaryLayout::Neox);
        let global = RopeSpec::plain(1_000_000.0, 8, RotaryLayout::Neox);
        let r = LayerRopes::new(vec![local.clone(), global.clone()], vec![0, 0, 1, 0]).unwrap();
        assert_eq!((r.layers(), r.spec(2), r.spec(3)), (4, &global, &local));
        assert!(LayerRopes::new(vec![local.clone()], vec![0, 1]).is_err());
        assert!(LayerRopes::new(vec![local.clone(), global], vec![0, 0]).is_err());
        assert!(LayerRopes::new(Vec::new(), vec![]).is_err());
        assert_eq!(LayerRopes::uniform(local, 3).of_layer(), &[0, 0, 0]);
    }

    #[test]
    fn shiftability_and_validation() {
        let mut spec = RopeSpec::plain(10000.0, 64, RotaryLayout::Neox);
        assert!(spec.ensure_shiftable().is_ok());
        spec.scaling = RopeScaling::DynamicNtk {
            factor: 2.0,
            original_max_position: 4096.0,
        };
        let e = spec.ensure_shiftable().unwrap_err();
        assert!(matches!(e, KernelError::NotShiftable(_)), "{e}");
        assert!(e.to_string().contains("dynamic NTK"));
        let odd = RopeSpec {
            rotary_dim: 7,
            ..RopeSpec::plain(10000.0, 64, RotaryLayout::Neox)
        };
        assert!(matches!(odd.validate(), Err(KernelError::InvalidRope(_))));
        let wide = RopeSpec {
            rotary_dim: 66,
            ..odd
        };
        assert!(wide.validate().is_err());
    }

    #[test]
    fn rotate_matches_f64_by_hand_and_keeps_the_tail() {
        let spec = RopeSpec {
            rotary_dim: 4,
            ..RopeSpec::plain(100.0, 6, RotaryLayout::Interleaved)
        };
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut y = x;
        spec.rotate_f32(&mut y, 7);
        // pair 0 freq 1, pair 1 freq 100^(-1/2) = 0.1
        let (c0, s0) = (7f64.cos(), 7f64.sin());
        let (c1, s1) = (0.7f64.cos(), 0.7f64.sin());
        let want = [
            c0 - 2.0 * s0,
            s0 + 2.0 * c0,
            3.0 * c1 - 4.0 * s1,
            3.0 * s1 + 4.0 * c1,
            5.0,
            6.0,
        ];
        for (g, w) in y.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{y:?} vs {want:?}");
        }
        let neox = RopeSpec {
            layout: RotaryLayout::Neox,
            ..spec
        };
        let mut z = x;
        neox.rotate_f32(&mut z, 7);
        // halves: (0, 2) at freq 1, (1, 3) at freq 0.1
        let want = [
            c0 - 3.0 * s0,
            2.0 * c1 - 4.0 * s1,
            s0 + 3.0 * c0,
            2.0 * s1 + 4.0 * c1,
            5.0,
            6.0,
        ];
        for (g, w) in z.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-6, "{z:?} vs {want:?}");
        }
    }
}
