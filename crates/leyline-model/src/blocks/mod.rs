//! The shared blocks an architecture file wires together (llama.cpp's `build_norm`,
//! `build_attn`, `build_ffn`, `build_moe_ffn`): attention over the pool, the gated MLP,
//! the mixture of experts, norms, the forward's rotary tables, and the two ends of a
//! decoder (embedding in, final norm and head out).
//!
//! Design decision: a block is a set of weights plus plain functions over row-major `f32`
//! buffers, not a layer object with its own forward, so that an architecture's quirk (Q/K
//! norms before RoPE, norms after attention) is a line in its own file between two calls,
//! never a flag threaded through a shared forward.

pub(crate) mod attention;
pub(crate) mod mlp;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod output;
pub(crate) mod rope;

use crate::blocks::attention::AttnPass;
use crate::error::Result;
use crate::hparams::Hparams;
use crate::linear::{Embedding, RowSplit};
use crate::model::{FlatBatch, ForwardSeq};
use leyline_kernels::attend::Heads;
use leyline_kernels::pool::SpinPool;
use leyline_kernels::rope::LayerRopes;
use std::num::NonZeroUsize;

/// What every decoder's forward pass starts from: the batch flattened, the cut of its rows
/// for the linear layers, the attention state over the pool, and the residual stream.
pub(crate) struct Pass<'a> {
    /// The compute threads.
    pub(crate) pool: &'static SpinPool,
    /// The batch's tokens in order.
    pub(crate) batch: FlatBatch,
    /// How the linear layers cut the rows ([`row_split`]).
    pub(crate) split: RowSplit,
    /// Attention over the pool, shared by the layers.
    pub(crate) att: AttnPass<'a>,
    /// The residual stream `[n, hidden]`: the tokens' embeddings to begin with.
    pub(crate) x: Vec<f32>,
}

impl<'a> Pass<'a> {
    /// The start of a forward pass of `seqs` through a model of `hp` whose layers rotate
    /// keys by `rope` and attend within `windows` (empty: every layer global).
    ///
    /// # Errors
    /// A token outside the embedding.
    pub(crate) fn new(
        seqs: &'a [ForwardSeq<'a>],
        hp: &Hparams,
        rope: &'a LayerRopes,
        windows: &[Option<NonZeroUsize>],
        embed: &Embedding,
    ) -> Result<Self> {
        let pool = SpinPool::global();
        let batch = FlatBatch::new(seqs);
        let shape = Heads {
            heads: hp.heads,
            kv_heads: hp.kv_heads,
            head_dim: hp.head_dim,
        };
        let att = AttnPass::new(seqs, &batch.positions, shape, rope, windows, pool.threads());
        let mut x = Vec::with_capacity(batch.tokens.len() * hp.hidden);
        embed.gather(&batch.tokens, &mut x)?;
        Ok(Self {
            pool,
            batch,
            split: row_split(seqs),
            att,
            x,
        })
    }

    /// New tokens in the batch.
    pub(crate) fn rows(&self) -> usize {
        self.batch.tokens.len()
    }
}

/// How the rows of a batch are cut for the linear layers on f32 activations: by the batch's
/// size, as the paths differ by float noise only (8-bit activations take the integer
/// kernels for any rows).
pub(crate) fn row_split(seqs: &[ForwardSeq<'_>]) -> RowSplit {
    RowSplit::uniform(seqs.iter().map(|s| s.tokens.len()).sum())
}
