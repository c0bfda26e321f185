//! Causal GQA attention over the pool's key and value rows: the plan of a batch's tasks
//! (`plan.rs`), run by the kernels of [`leyline_kernels::attend`], which read the rows in place.
//!
//! Decode batches have one query token per sequence, so few tasks and few rows per task: a
//! task then covers part of the context only (its running max and sum merged afterwards),
//! so that both threads stay busy. Decoding sequences whose contexts begin with the same
//! slots (agent sessions behind one system prompt, as the prefix tree shares it) read that
//! prefix once: its tasks hold every such sequence's query rows, each sequence's own tasks
//! cover the keys after it, and the parts are merged the same way. The tasks depend on the
//! batch only, so a forward pass plans them once ([`Plan`]) for all its layers.

use leyline_kernels::attend::{KvRows, Queries};
use leyline_kernels::pool::SpinPool;
use leyline_kernels::Tier;
use leyline_kv::KvStorage;

pub(crate) use plan::Plan;

mod plan;
#[cfg(test)]
mod tests;

/// Writes into `out: [n, heads * head_dim]` the causal attention of the batch's queries `q`
/// over each sequence's context followed by its new slots (the sequences `plan` was made
/// for), reading keys and values from `kv` at `layer`. The new slots must be written.
pub(crate) fn attend(
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    q: Queries<'_>,
    plan: &mut Plan<'_>,
    out: &mut [f32],
) {
    attend_with(Tier::best(), pool, kv, layer, q, plan, out)
}

/// [`attend`] with the kernel compiled for `tier`, which the CPU must run.
fn attend_with(
    tier: Tier,
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    q: Queries<'_>,
    plan: &mut Plan<'_>,
    out: &mut [f32],
) {
    let rows = KvRows {
        k: kv.k_rows(layer),
        v: kv.v_rows(layer),
        k_width: kv.geometry().k_width(),
        v_width: kv.geometry().v_width,
    };
    leyline_kernels::attend::attend(tier, pool, rows, q, &mut plan.work, out)
}
