//! Causal GQA attention that reads the pool's key and value rows in place, in tiles.
//!
//! Design decision: one task is one (sequence, kv head, block of query tokens). Its query rows
//! (the block's tokens times the query heads that share the kv head) meet the context in
//! blocks of [`plan::KB`] keys. The queries are transposed once per task, so a block's scores come
//! out transposed too (`[key][query row]`, keys broadcast from their pool rows into
//! accumulators that span 64 query rows): the online softmax then runs down the keys with the
//! query rows across vector lanes, and the causal mask of a key is a prefix of its row. Value
//! sums read the pool's value rows. With f32 storage nothing is copied; bf16/f16 blocks are
//! converted once. Scores are kept in log2 units (the query is pre-scaled by `log2(e)`), so
//! the softmax needs only `exp2`, computed by a polynomial the compiler vectorizes.
//!
//! Decode batches have one query token per sequence, so few tasks and few rows per task: a
//! task then covers part of the context only (its running max and sum merged afterwards),
//! so that both threads stay busy, and scores are dot products of the few query rows with
//! the key rows, which wastes no vector lanes on absent rows. Decoding sequences whose
//! contexts begin with the same slots (agent sessions behind one system prompt, as the
//! prefix tree shares it) read that prefix once: its tasks hold every such sequence's query
//! rows, each sequence's own tasks cover the keys after it, and the parts are merged the
//! same way. The tasks depend on the batch only, so a forward pass plans them once
//! ([`Plan`]) for all its layers.
//!
//! Files: `plan.rs` cuts a batch into tasks and merges their outputs; `kernel.rs` runs one
//! task (online softmax, value sums) and picks the instruction set; `portable.rs`, `avx2.rs`
//! and `avx512.rs` hold the score products for each; this file runs the tasks on the pool.

use crate::pool::SpinPool;
use kernel::{AsIs, FromBf16, FromF16, Isa, Job, Scratch};
use leyline_kv::storage::RowsRef;
use leyline_kv::KvStorage;
use plan::write_out;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

pub(crate) use kernel::Queries;
pub(crate) use plan::{Heads, Plan};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod kernel;
mod plan;
mod portable;
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
    attend_with(Isa::detect(), pool, kv, layer, q, plan, out)
}

/// [`attend`] with the kernel compiled for `isa`, which the CPU must support.
fn attend_with(
    isa: Isa,
    pool: &SpinPool,
    kv: &KvStorage,
    layer: usize,
    q: Queries<'_>,
    plan: &mut Plan<'_>,
    out: &mut [f32],
) {
    let shape = plan.shape;
    let (g, hd) = (shape.heads / shape.kv_heads, shape.head_dim);
    let (tasks, rotations) = (&plan.tasks, &plan.rotations);
    {
        let mut pieces = Vec::with_capacity(tasks.len());
        let mut rest = plan.scratch.as_mut_slice();
        for t in tasks {
            let (a, b) = rest.split_at_mut(t.rows(g) * (hd + 2));
            pieces.push(Mutex::new(a));
            rest = b;
        }
        let (kr, vr) = (kv.k_rows(layer), kv.v_rows(layer));
        let (kw, vw) = (kv.geometry().k_width(), kv.geometry().v_width);
        let next = AtomicUsize::new(0);
        // Sized for the largest task, not for `QB` tokens: a decode step's tasks have a
        // few rows, and this is allocated per thread and layer.
        let max_rows = plan.max_rows;
        pool.run(&|_, _| {
            let mut buf = Scratch::new(max_rows, hd);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(task) = tasks.get(i) else { break };
                let mut o = pieces[i].lock().unwrap_or_else(|e| e.into_inner());
                let job = Job {
                    task,
                    q,
                    rotations,
                    shape,
                    kw,
                    vw,
                };
                match (kr, vr) {
                    (RowsRef::F32(k), RowsRef::F32(v)) => {
                        isa.run(&job, k, v, AsIs, &mut buf, &mut o)
                    }
                    (RowsRef::Bf16(k), RowsRef::Bf16(v)) => {
                        isa.run(&job, k, v, FromBf16, &mut buf, &mut o)
                    }
                    (RowsRef::F16(k), RowsRef::F16(v)) => {
                        isa.run(&job, k, v, FromF16, &mut buf, &mut o)
                    }
                    _ => unreachable!("key and value rows share one dtype"),
                }
            }
        });
    }
    write_out(tasks, &plan.scratch, shape, plan.merge_rows, out);
}
