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

use crate::linear::RowSplit;
use crate::model::ForwardSeq;

/// Whether the quantized products read 8-bit activations (`--int8-decode`).
pub(crate) fn int8_activations() -> bool {
    use leyline_kernels::qmatmul::{activations, Activations};
    activations() == Activations::Int8
}

/// How the rows of a batch are cut for the linear layers: on 8-bit activations each
/// sequence's rows take the kernels its own size picks (batch invariance); on f32 ones the
/// batch's size picks, as the paths differ by float noise only.
pub(crate) fn row_split(seqs: &[ForwardSeq<'_>]) -> RowSplit {
    if int8_activations() {
        RowSplit::by_sequence(seqs.iter().map(|s| (s.tokens.len(), s.tokens.len())))
    } else {
        RowSplit::uniform(seqs.iter().map(|s| s.tokens.len()).sum())
    }
}
