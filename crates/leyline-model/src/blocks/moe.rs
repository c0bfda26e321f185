//! The mixture of experts: DeepSeekMoE on candle tensors of f32 weights from a checkpoint
//! directory ([`Moe`]), and a GGUF file's routed experts on the quantized kernels
//! ([`RoutedExperts`], Qwen3-MoE).
//!
//! The routing is the reference's: softmax over every routed expert, greedy top-k (ties to
//! the lower index), each expert then running once over the tokens that picked it.

use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::checkpoint::Weights;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::linear::{Linear, RowSplit};
use crate::quant::ggml_kind;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use candle_nn::ops::softmax_last_dim;
use leyline_kernels::qmatmul::QMatrix;

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

/// A GGUF layer's routed experts (Qwen3-MoE): the router `ffn_gate_inp` `[experts, hidden]`
/// and the experts stacked in 3-D tensors `ffn_{gate,up,down}_exps`, each expert kept in
/// its file's format (quantized blocks stay quantized). Softmax over every expert, greedy
/// top-k (ties to the lower index), the k weights renormalized to sum to 1 when
/// `norm_topk` (llama.cpp's qwen3moe always does). The batch's tokens are grouped by
/// expert, so each expert's weights are read once per call, however many tokens chose it.
pub(crate) struct RoutedExperts {
    router: Linear,
    experts: Vec<GatedMlp>,
    top_k: usize,
    norm_topk: bool,
}

/// Buffers of [`RoutedExperts::forward`].
#[derive(Default)]
pub(crate) struct MoeScratch {
    logits: Vec<f32>,
    rows: Vec<f32>,
    out: Vec<f32>,
    mlp: MlpScratch,
}

impl RoutedExperts {
    /// Loads `blk.{layer}.ffn_gate_inp` and the stacked experts of `width` hidden units
    /// each, `top_k` of which each token takes.
    ///
    /// # Errors
    /// Missing or unreadable tensors, shapes that do not match `experts`, `width` and the
    /// router, `top_k` of 0 or above the expert count.
    pub(crate) fn load(
        f: &mut GgufFile,
        layer: usize,
        (experts, width, top_k): (usize, usize, usize),
        norm_topk: bool,
    ) -> Result<Self> {
        let name = |n: &str| format!("blk.{layer}.{n}");
        let router = Linear::load(f, &name("ffn_gate_inp"))?;
        if router.out() != experts || top_k == 0 || top_k > experts {
            return Err(ModelError::File {
                path: f.path().to_path_buf(),
                reason: format!(
                    "layer {layer}: a router of {} experts, {experts} experts declared, top {top_k}",
                    router.out()
                ),
            });
        }
        let mut stacked = |n: &str| -> Result<Vec<Linear>> {
            let t = f.tensor(&name(&format!("{n}.weight")))?;
            split_experts(&t, experts).map_err(|e| ModelError::File {
                path: f.path().to_path_buf(),
                reason: format!("layer {layer} {n}: {e}"),
            })
        };
        let (gate, up, down) = (
            stacked("ffn_gate_exps")?,
            stacked("ffn_up_exps")?,
            stacked("ffn_down_exps")?,
        );
        let experts = gate
            .into_iter()
            .zip(up)
            .zip(down)
            .map(|((g, u), d)| {
                if g.out() != width || d.out() != router.inp() {
                    return Err(ModelError::Input(format!(
                        "layer {layer}: an expert of {} units and {} outputs, {width} declared",
                        g.out(),
                        d.out()
                    )));
                }
                GatedMlp::new(g, u, d, width, Activation::Silu)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            router,
            experts,
            top_k,
            norm_topk,
        })
    }

    /// The experts' quantized matrices (for [`QMatrix::share_pages`]).
    pub(crate) fn quantized_mut(&mut self) -> impl Iterator<Item = &mut QMatrix> {
        self.experts.iter_mut().flat_map(GatedMlp::quantized_mut)
    }

    /// `y = sum over each row's top-k experts e of w_e expert_e(xn)` for the rows of `xn`.
    ///
    /// # Errors
    /// Widths that do not match the layer.
    pub(crate) fn forward(&self, xn: &[f32], s: &mut MoeScratch, y: &mut [f32]) -> Result<()> {
        let hidden = self.router.inp();
        let n = xn.len() / hidden;
        let ne = self.experts.len();
        s.logits.resize(n * ne, 0.0);
        self.router.forward_rows(xn, n, &mut s.logits)?;
        // Per expert: the rows that chose it and their weights.
        let mut picked: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); ne];
        let mut order: Vec<usize> = Vec::with_capacity(ne);
        let mut p = vec![0f64; ne];
        for (t, l) in s.logits.chunks_exact(ne).enumerate() {
            let max = l.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            for (q, &x) in p.iter_mut().zip(l) {
                *q = f64::from(x - max).exp();
            }
            let total: f64 = p.iter().sum();
            order.clear();
            order.extend(0..ne);
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &order[..self.top_k];
            let sum = match self.norm_topk {
                true => top.iter().map(|&e| p[e]).sum(),
                false => total,
            };
            for &e in top {
                picked[e].0.push(t);
                picked[e].1.push((p[e] / sum) as f32);
            }
        }
        y[..n * hidden].fill(0.0);
        for (e, (rows, w)) in picked.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let m = rows.len();
            s.rows.clear();
            for &t in rows {
                s.rows.extend_from_slice(&xn[t * hidden..(t + 1) * hidden]);
            }
            s.out.resize(m * hidden, 0.0);
            self.experts[e].forward(&s.rows, &RowSplit::uniform(m), &mut s.mlp, &mut s.out)?;
            for ((&t, &wt), o) in rows.iter().zip(w).zip(s.out.chunks_exact(hidden)) {
                for (a, &b) in y[t * hidden..(t + 1) * hidden].iter_mut().zip(o) {
                    *a += wt * b;
                }
            }
        }
        Ok(())
    }
}

/// The `experts` matrices of a stacked 3-D tensor `[experts, out, in]`, each in the
/// tensor's format (a quantized kind Leyline multiplies stays quantized).
fn split_experts(t: &QTensor, experts: usize) -> Result<Vec<Linear>> {
    let (e, out, inp) = t.shape().dims3()?;
    if e != experts {
        return Err(ModelError::Input(format!(
            "{e} stacked experts, {experts} declared"
        )));
    }
    match ggml_kind(t.dtype()) {
        Some(kind) => {
            let data = t.data()?;
            let per = data.len() / e;
            (0..e)
                .map(|i| {
                    let q = QMatrix::from_ggml(kind, &data[i * per..(i + 1) * per], out, inp)?;
                    Linear::from_qmatrix(q, None)
                })
                .collect()
        }
        None => {
            let all = t.dequantize(&Device::Cpu)?;
            (0..e)
                .map(|i| Linear::from_f32(all.get(i)?, None))
                .collect()
        }
    }
}
