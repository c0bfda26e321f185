//! The dense gated MLP: `down(act(gate(x)) * up(x))`, gate and up fused into one product.

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::linear::{FusedLinear, Linear, RowSplit};
use leyline_kernels::fastmath::silu_mul;
use leyline_kernels::qmatmul::QMatrix;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    /// SiLU (SwiGLU: Llama, Qwen).
    Silu,
    /// GELU, tanh approximation (GeGLU: Gemma).
    GeluTanh,
}

/// The weights of one gated MLP.
pub(crate) struct GatedMlp {
    gate_up: FusedLinear,
    down: Linear,
    act: Activation,
    width: usize,
}

impl GatedMlp {
    /// Loads `blk.{layer}.ffn_gate`, `ffn_up` and `ffn_down` of `width` hidden units.
    ///
    /// # Errors
    /// Missing or unreadable tensors, gate and up that do not fuse.
    pub(crate) fn load(
        f: &mut GgufFile,
        layer: usize,
        width: usize,
        act: Activation,
    ) -> Result<Self> {
        let mut lin = |n: &str| Linear::load(f, &format!("blk.{layer}.{n}"));
        let gate_up = FusedLinear::new(vec![lin("ffn_gate")?, lin("ffn_up")?])?;
        Ok(Self {
            gate_up,
            down: lin("ffn_down")?,
            act,
            width,
        })
    }

    /// An MLP of given gate, up and down layers (a mixture's expert).
    ///
    /// # Errors
    /// Gate and up that do not fuse.
    pub(crate) fn new(
        gate: Linear,
        up: Linear,
        down: Linear,
        width: usize,
        act: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: FusedLinear::new(vec![gate, up])?,
            down,
            act,
            width,
        })
    }

    /// The layer's quantized matrices (for [`QMatrix::share_pages`]).
    pub(crate) fn quantized_mut(&mut self) -> impl Iterator<Item = &mut QMatrix> {
        self.gate_up
            .quantized_mut()
            .chain(self.down.quantized_mut())
    }

    /// `y = down(act(gate(xn)) * up(xn))` for the rows of `xn`; `scratch` is resized as
    /// needed and may be reused across layers.
    ///
    /// # Errors
    /// Widths that do not match the layer.
    pub(crate) fn forward(
        &self,
        xn: &[f32],
        split: &RowSplit,
        scratch: &mut MlpScratch,
        y: &mut [f32],
    ) -> Result<()> {
        let n = split.len();
        scratch.gate_up.resize(n * 2 * self.width, 0.0);
        scratch.act.resize(n * self.width, 0.0);
        self.gate_up
            .forward_split(xn, split, &mut scratch.gate_up)?;
        match self.act {
            Activation::Silu => silu_mul(&scratch.gate_up, self.width, &mut scratch.act),
            Activation::GeluTanh => gelu_tanh_mul(&scratch.gate_up, self.width, &mut scratch.act),
        }
        self.down.forward_split(&scratch.act, split, y)
    }
}

/// Buffers of [`GatedMlp::forward`].
#[derive(Default)]
pub(crate) struct MlpScratch {
    gate_up: Vec<f32>,
    act: Vec<f32>,
}

/// GeGLU: `out = gelu_tanh(g) * u` elementwise, where each row of `gu` holds `g` and then
/// `u`, `width` values each; `gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`.
pub(crate) fn gelu_tanh_mul(gu: &[f32], width: usize, out: &mut [f32]) {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    for (row, o) in gu.chunks_exact(2 * width).zip(out.chunks_exact_mut(width)) {
        let (g, u) = row.split_at(width);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = 0.5 * g * (1.0 + (C * (g + 0.044_715 * g * g * g)).tanh()) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against f64 values of the definition, and against the exact GELU (erf) where the
    /// tanh form is known to be within 1e-3 of it.
    #[test]
    fn gelu_tanh_matches_its_definition() {
        let g: Vec<f32> = (-40..=40).map(|i| i as f32 * 0.15).collect();
        let u: Vec<f32> = g.iter().map(|x| 1.0 + 0.1 * x).collect();
        let gu: Vec<f32> = g.iter().chain(&u).copied().collect();
        let mut out = vec![0f32; g.len()];
        gelu_tanh_mul(&gu, g.len(), &mut out);
        for ((&o, &g), &u) in out.iter().zip(&g).zip(&u) {
            let x = g as f64;
            let t = ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh();
            let want = 0.5 * x * (1.0 + t) * u as f64;
            assert!(
                (o as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                "{g}: {o} vs {want}"
            );
        }
        // gelu(1) = 0.841345 (erf form); the tanh form gives 0.841192.
        let mut one = [0f32];
        gelu_tanh_mul(&[1.0, 1.0], 1, &mut one);
        assert!((one[0] - 0.841_192).abs() < 1e-5 && (one[0] - 0.841_345).abs() < 1e-3);
    }
}
