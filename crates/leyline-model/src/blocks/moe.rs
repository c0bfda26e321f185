//! The mixture of experts (DeepSeekMoE; ready for Qwen3-MoE's renormalized top-k) and its
//! experts' SiLU-gated MLP, on candle tensors of f32 weights from a checkpoint directory.
//!
//! The routing is the reference's: softmax over every routed expert, greedy top-k (ties to
//! the lower index), each expert then running once over the tokens that picked it.

use crate::checkpoint::Weights;
use crate::error::Result;
use crate::linear::Linear;
use candle_core::{Device, Tensor};
use candle_nn::ops::softmax_last_dim;

/// A SiLU-gated MLP of f32 weights (an expert, a shared expert, or a dense layer).
pub(crate) struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

impl Mlp {
    pub(crate) fn load(w: &mut Weights, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        let mut lin = |n: &str, shape: &[usize]| -> Result<Linear> {
            Linear::from_f32(w.take(&format!("{prefix}.{n}.weight"), shape)?, None)
        };
        Ok(Self {
            gate: lin("gate_proj", &[inter, hidden])?,
            up: lin("up_proj", &[inter, hidden])?,
            down: lin("down_proj", &[hidden, inter])?,
        })
    }

    /// `n` routed experts of width `inter`, saved one by one (`mlp.experts.{e}.gate_proj.weight`, ...) or fused as
    /// transformers 5 holds them (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`).
    pub(crate) fn load_experts(
        w: &mut Weights,
        p: &str,
        hidden: usize,
        (n, inter): (usize, usize),
    ) -> Result<Vec<Self>> {
        let fused = format!("{p}.mlp.experts.gate_up_proj");
        if !w.has(&fused) {
            return (0..n)
                .map(|e| Self::load(w, &format!("{p}.mlp.experts.{e}"), hidden, inter))
                .collect();
        }
        let gate_up = w.take(&fused, &[n, 2 * inter, hidden])?;
        let down = w.take(&format!("{p}.mlp.experts.down_proj"), &[n, hidden, inter])?;
        let lin = |t: Tensor| Linear::from_f32(t.contiguous()?, None);
        (0..n)
            .map(|e| {
                let gu = gate_up.get(e)?;
                Ok(Self {
                    gate: lin(gu.narrow(0, 0, inter)?)?,
                    up: lin(gu.narrow(0, inter, inter)?)?,
                    down: lin(down.get(e)?)?,
                })
            })
            .collect()
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = (self.gate.forward(x)?.silu()? * self.up.forward(x)?)?;
        self.down.forward(&h)
    }
}

pub(crate) struct Moe {
    /// `[experts, hidden]`.
    pub(crate) router: Tensor,
    pub(crate) experts: Vec<Mlp>,
    /// Experts every token takes (DeepSeek's shared experts), fused into one MLP.
    pub(crate) shared: Option<Mlp>,
    pub(crate) top_k: usize,
    /// Whether the selected probabilities are renormalized to sum to 1 (Qwen3-MoE's
    /// `norm_topk_prob`) before the scale.
    pub(crate) norm_topk: bool,
    /// Multiplier of the selected probabilities (DeepSeek's `routed_scaling_factor`).
    pub(crate) scale: f64,
}

impl Moe {
    /// Softmax over all routed experts, greedy top-k, the selected probabilities
    /// (renormalized with [`Self::norm_topk`]) times [`Self::scale`], plus the shared
    /// experts. The tokens are grouped by expert, so each expert runs once per call.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let n = x.dim(0)?;
        let probs = softmax_last_dim(&x.matmul(&self.router.t()?)?)?.to_vec2::<f32>()?;
        let mut picked: Vec<(Vec<u32>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.experts.len()];
        let mut order: Vec<usize> = Vec::with_capacity(self.experts.len());
        for (t, p) in probs.iter().enumerate() {
            order.clear();
            order.extend(0..p.len());
            // Descending probability; a tie goes to the lower expert index.
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &order[..self.top_k];
            let sum: f64 = match self.norm_topk {
                true => top.iter().map(|&e| p[e] as f64).sum(),
                false => 1.0,
            };
            for &e in top {
                picked[e].0.push(t as u32);
                picked[e].1.push((p[e] as f64 / sum * self.scale) as f32);
            }
        }
        let mut out = x.zeros_like()?;
        for (e, (rows, w)) in picked.into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let m = rows.len();
            let idx = Tensor::from_vec(rows, m, &Device::Cpu)?;
            let w = Tensor::from_vec(w, (m, 1), &Device::Cpu)?;
            let y = self.experts[e]
                .forward(&x.index_select(&idx, 0)?)?
                .broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        debug_assert_eq!(out.dim(0)?, n);
        if let Some(s) = &self.shared {
            out = (out + s.forward(x)?)?;
        }
        Ok(out)
    }
}
