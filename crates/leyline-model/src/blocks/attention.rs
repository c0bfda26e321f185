//! Causal GQA self-attention over the pool's key and value rows: the weights of one layer
//! ([`Attention`]), and one forward pass's state shared by its layers ([`AttnPass`]: the
//! Q/K/V rows, the plan of the batch's tasks (`plan.rs`), run by the kernels of
//! [`leyline_kernels::attend`], which read the pool's rows in place).
//!
//! Decode batches have one query token per sequence, so few tasks and few rows per task: a
//! task then covers part of the context only (its running max and sum merged afterwards),
//! so that both threads stay busy. Decoding sequences whose contexts begin with the same
//! slots (agent sessions behind one system prompt, as the prefix tree shares it) read that
//! prefix once: its tasks hold every such sequence's query rows, each sequence's own tasks
//! cover the keys after it, and the parts are merged the same way. The tasks depend on the
//! batch only, so a forward pass plans them once ([`Plan`]) for all its layers, once per
//! distinct sliding window when some layers have one.
//!
//! A layer with a sliding window of `w` keys (Gemma 3's local layers) lets the query at
//! index `i` of its sequence (context then new tokens) see key `j` iff `j <= i` and
//! `i - j < w`, as Hugging Face and llama.cpp define it. Indices, not encoded positions:
//! after a splice the context is re-indexed and the window follows; keys a lazy splice left
//! at older rotary positions still sit at their index. Windowed layers keep every key (a
//! splice needs them); their tasks merely start at the window.
//!
//! An architecture wires the steps in its own order: [`AttnPass::project`], then whatever
//! it does to the heads (per-head norms: [`AttnPass::norm_q_k`]), [`AttnPass::rope`],
//! [`AttnPass::store`] and [`AttnPass::attend`].

use crate::blocks::norm::rms_norm_heads;
use crate::blocks::rope::RopeTables;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::linear::{FusedLinear, Linear, RowSplit};
use crate::model::{ForwardSeq, Ran};
use leyline_kernels::attend::{Heads, Queries};
use leyline_kernels::pool::SpinPool;
use leyline_kernels::qmatmul::QMatrix;
use leyline_kernels::rope::LayerRopes;
use leyline_kernels::Tier;
use leyline_kv::KvStorage;
use std::num::NonZeroUsize;

pub(crate) use plan::Plan;

#[cfg(test)]
mod bits_tests;
mod plan;
#[cfg(test)]
mod tests;

/// The weights of one attention layer: Q, K and V fused into one product (with their
/// biases when the file has them), and the output projection.
pub(crate) struct Attention {
    qkv: FusedLinear,
    o: Linear,
}

impl Attention {
    /// Loads `blk.{layer}.attn_q`, `attn_k`, `attn_v` (and their `.bias` when present) and
    /// `attn_output`.
    ///
    /// # Errors
    /// Missing or unreadable tensors, Q/K/V that do not fuse.
    pub(crate) fn load(f: &mut GgufFile, layer: usize) -> Result<Self> {
        let mut lin = |n: &str| Linear::load(f, &format!("blk.{layer}.{n}"));
        let qkv = FusedLinear::new(vec![lin("attn_q")?, lin("attn_k")?, lin("attn_v")?])?;
        Ok(Self {
            qkv,
            o: lin("attn_output")?,
        })
    }

    /// The layer's quantized matrices (for [`QMatrix::share_pages`]).
    pub(crate) fn quantized_mut(&mut self) -> impl Iterator<Item = &mut QMatrix> {
        self.qkv.quantized_mut().chain(self.o.quantized_mut())
    }
}

/// One forward pass's attention state, reused by every layer: the batch's Q/K/V rows
/// (`[n, (heads + 2 kv_heads) * head_dim]`, queries then keys then values), its output, the
/// rotary tables of each rope spec at the new tokens' positions, and the tasks' plan.
pub(crate) struct AttnPass<'a> {
    shape: Heads,
    rope: &'a LayerRopes,
    tables: Vec<RopeTables>,
    plan: Plan<'a>,
    qkv: Vec<f32>,
    out: Vec<f32>,
}

impl<'a> AttnPass<'a> {
    /// The state for a batch of `positions.len()` new tokens (`seqs`, flattened in order).
    /// `rope` gives each layer's rope spec; `windows[l]` is layer `l`'s sliding window in
    /// keys (`None`: global attention), or `&[]` when every layer is global.
    ///
    /// # Panics
    /// If `windows` is neither empty nor one entry per layer of `rope`.
    pub(crate) fn new(
        seqs: &'a [ForwardSeq<'a>],
        positions: &[u32],
        shape: Heads,
        rope: &'a LayerRopes,
        windows: &[Option<NonZeroUsize>],
        threads: usize,
    ) -> Self {
        let n = positions.len();
        let Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        } = shape;
        Self {
            shape,
            rope,
            tables: rope
                .specs()
                .iter()
                .map(|s| RopeTables::new(s, positions))
                .collect(),
            plan: Plan::new(seqs, shape, rope, windows, threads),
            qkv: vec![0f32; n * (h + 2 * kvh) * hd],
            out: vec![0f32; n * h * hd],
        }
    }

    /// Width of a Q/K/V row.
    fn stride(&self) -> usize {
        (self.shape.heads + 2 * self.shape.kv_heads) * self.shape.head_dim
    }

    /// `Q, K, V = xn W_qkv (+ b)`.
    ///
    /// # Errors
    /// Widths that do not match the layer.
    pub(crate) fn project(&mut self, a: &Attention, xn: &[f32], split: &RowSplit) -> Result<()> {
        a.qkv.forward_split(xn, split, &mut self.qkv)
    }

    /// RMSNorm of the queries by `q_norm` and the keys by `k_norm` before RoPE: per head
    /// when a weight vector is one head wide (Qwen3's and Gemma 3's Q/K norms, the vector
    /// shared by the heads), over all heads of a kind together when it spans them (OLMo 2's).
    ///
    /// # Errors
    /// A weight vector of another width.
    pub(crate) fn norm_q_k(&mut self, q_norm: &[f32], k_norm: &[f32], eps: f32) -> Result<()> {
        let Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        } = self.shape;
        for (w, heads) in [(q_norm, h), (k_norm, kvh)] {
            if w.len() != hd && w.len() != heads * hd {
                return Err(ModelError::Input(format!(
                    "a Q/K norm of {} values for {heads} heads of {hd}",
                    w.len()
                )));
            }
        }
        let stride = self.stride();
        rms_norm_heads(&mut self.qkv, stride, 0..h * hd, q_norm, eps);
        rms_norm_heads(&mut self.qkv, stride, h * hd..(h + kvh) * hd, k_norm, eps);
        Ok(())
    }

    /// Rotates the queries and keys by the positions' rotary tables of `layer`'s rope spec.
    pub(crate) fn rope(&mut self, layer: usize) {
        let stride = self.stride();
        let spec = self.rope.of_layer()[layer];
        let heads = self.shape.heads + self.shape.kv_heads;
        self.tables[spec].apply(&mut self.qkv, stride, 0..heads);
    }

    /// The new tokens' keys and values, each row-major as the pool stores them.
    fn kv_rows(&self) -> (Vec<f32>, Vec<f32>) {
        let (qw, w) = (
            self.shape.heads * self.shape.head_dim,
            self.shape.kv_heads * self.shape.head_dim,
        );
        let rows = self.qkv.chunks_exact(self.stride());
        let k = rows.clone().flat_map(|r| &r[qw..qw + w]).copied().collect();
        let v = rows.flat_map(|r| &r[qw + w..qw + 2 * w]).copied().collect();
        (k, v)
    }

    /// At the stop layer of a deviation pass ([`crate::model::Network::run`]), the
    /// distances of the new tokens' keys and values (rotated, not yet stored) from those the
    /// `cached` slots hold; `None` at any other layer or without a stop.
    ///
    /// # Errors
    /// A slot outside the pool.
    pub(crate) fn deviation(
        &self,
        kv: &KvStorage,
        layer: usize,
        stop: Option<(usize, &[u32])>,
    ) -> Result<Option<Ran>> {
        match stop {
            Some((at, cached)) if at == layer => {
                let (k, v) = self.kv_rows();
                let d = crate::model::kv_distances(kv, layer, cached, &k, &v)?;
                Ok(Some(Ran::Deviation(d)))
            }
            _ => Ok(None),
        }
    }

    /// Writes the new tokens' keys and values into `new_slots` of `layer`.
    ///
    /// # Errors
    /// A slot outside the pool.
    pub(crate) fn store(&self, kv: &mut KvStorage, layer: usize, new_slots: &[u32]) -> Result<()> {
        let (qw, w) = (
            self.shape.heads * self.shape.head_dim,
            self.shape.kv_heads * self.shape.head_dim,
        );
        for (row, &slot) in self.qkv.chunks_exact(self.stride()).zip(new_slots) {
            kv.write(layer, slot, &row[qw..qw + w], &row[qw + w..qw + 2 * w])?;
        }
        Ok(())
    }

    /// The causal attention of the queries over each sequence's context followed by its new
    /// slots at `layer` (whose new keys and values must be stored), within the layer's
    /// sliding window if it has one, then the output
    /// projection into `y: [n, hidden]`.
    ///
    /// # Errors
    /// Widths that do not match the layer.
    pub(crate) fn attend(
        &mut self,
        pool: &SpinPool,
        kv: &KvStorage,
        layer: usize,
        a: &Attention,
        split: &RowSplit,
        y: &mut [f32],
    ) -> Result<()> {
        let q = Queries {
            rows: &self.qkv,
            stride: self.stride(),
        };
        attend_with(
            Tier::best(),
            pool,
            kv,
            layer,
            q,
            &mut self.plan,
            &mut self.out,
        );
        a.o.forward_split(&self.out, split, y)
    }
}

/// Writes into `out: [n, heads * head_dim]` the causal attention of the batch's queries `q`
/// over each sequence's context followed by its new slots (the sequences `plan` was made
/// for, within `layer`'s window), reading keys and values from `kv` at `layer`, with the kernel compiled for `tier`,
/// which the CPU must run. The new slots must be written.
fn attend_with(
    tier: Tier,
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    q: Queries<'_>,
    plan: &mut Plan<'_>,
    out: &mut [f32],
) {
    let work = plan.select(layer);
    let rows = kv.attend_rows(layer);
    leyline_kernels::attend::attend(tier, pool, rows, q, work, out)
}
