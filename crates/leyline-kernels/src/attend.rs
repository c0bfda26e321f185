//! Causal GQA attention that reads key and value rows in place, in tiles: the kernel side.
//! A planner (the model's, which knows its batch) cuts a call into [`Task`]s; [`attend`] runs
//! them on a pool and merges their outputs.
//!
//! Design decision: one task is one (sequence, kv head, block of query tokens). Its query rows
//! (the block's tokens times the query heads that share the kv head) meet the context in
//! blocks of [`KB`] keys. The queries are transposed once per task, so a block's scores come
//! out transposed too (`[key][query row]`, keys broadcast from their rows into accumulators
//! that span 64 query rows): the online softmax then runs down the keys with the query rows
//! across vector lanes, and the causal mask of a key is a prefix of its row (a sliding
//! window's, [`Task::window`], a suffix of its real rows). Value sums read
//! the value rows. With f32 storage nothing is copied; bf16/f16 blocks are converted once.
//! Scores are kept in log2 units (the query is pre-scaled by `log2(e)`), so the softmax needs
//! only `exp2`, computed by a polynomial the compiler vectorizes.
//!
//! A task with few query rows (a decode step's) takes its scores with the block's keys across
//! lanes instead ([`direct`]: the block transposed), which wastes no lanes on absent rows.
//!
//! A row's output bits do not depend on the batch: both products sum a score in one order
//! (an FMA per head dim, in order); key blocks fall at multiples of [`KB`] from key 0; each
//! [`SPAN`] of keys gets its own online softmax and the spans are folded in key order, by
//! the task when it covers several, or after the tasks when a planner split a row's keys
//! ([`Task::merged`]). Keys stored at positions other than their own (lazy splices) are read
//! with the queries turned back by the run's offset ([`Task::pieces`], [`Task::loads`]).
//!
//! Files: `task.rs` holds what a task is and the merge of split tasks' outputs; `kernel.rs`
//! runs one task (online softmax, value sums) on the [`Tier`] given; `portable.rs`,
//! `avx2.rs` and `avx512.rs` hold the score products for each; this file runs the tasks on
//! the pool.

use crate::pool::SpinPool;
use crate::rope::Rotation;
use crate::rows::{RowsRef, Strides};
use crate::Tier;
use kernel::{run, AsIs, FromBf16, FromF16, Job, Scratch};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use task::write_out;

pub use kernel::Queries;
pub use task::{direct, last_piece, offset_of, Heads, Task, DR, KB, RB, SPAN};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod kernel;
mod portable;
mod task;
#[cfg(test)]
mod tests;

/// The work of one attention call as a planner cut it, the same on every layer of a forward
/// pass: the tasks, and the buffers their outputs merge in.
pub struct Work<'a> {
    /// Head counts.
    pub shape: Heads,
    /// The tasks, in the order they are handed out (costliest first balances best).
    pub tasks: Vec<Task<'a>>,
    /// Query rows whose partial sums are merged ([`Task::toks`] index them).
    pub merge_rows: usize,
    /// The most query rows of one task.
    pub max_rows: usize,
    /// Task-major output: task i owns its rows' `head_dim` values, then each row's running
    /// max and sum, `rows * (head_dim + 2)` values per task. Every task writes all of its
    /// piece, so layers reuse it as it is.
    pub scratch: Vec<f32>,
    /// `R(-offset)` for each distinct offset of the batch's shifted runs.
    pub rotations: Vec<(i64, Rotation)>,
}

/// The key and value rows one layer's attention reads, at one storage dtype: a kv head's
/// row of a slot (`head_dim` values) starts where its [`Strides`] say.
#[derive(Debug, Clone, Copy)]
pub struct KvRows<'a> {
    /// Key rows.
    pub k: RowsRef<'a>,
    /// Value rows.
    pub v: RowsRef<'a>,
    /// Where the key rows lie.
    pub k_strides: Strides,
    /// Where the value rows lie.
    pub v_strides: Strides,
}

/// Writes into `out: [n, heads * head_dim]` the causal attention of the batch's queries `q`
/// over the keys and values of `rows` that `work`'s tasks name (within each task's sliding
/// window, if it has one), with the kernel compiled for
/// `tier`, on `pool`'s threads.
///
/// # Panics
/// If the CPU does not run `tier`, the key and value rows differ in dtype, or `work` does not fit
/// `rows`, `q` and `out` (a row index past the buffers, a scratch shorter than its tasks).
pub fn attend(
    tier: Tier,
    pool: &SpinPool,
    rows: KvRows<'_>,
    q: Queries<'_>,
    work: &mut Work<'_>,
    out: &mut [f32],
) {
    assert!(
        tier.available(),
        "kernel tier {tier} is not available on this CPU"
    );
    let shape = work.shape;
    let (g, hd) = (shape.heads / shape.kv_heads, shape.head_dim);
    let (tasks, rotations) = (&work.tasks, &work.rotations);
    {
        let mut pieces = Vec::with_capacity(tasks.len());
        let mut rest = work.scratch.as_mut_slice();
        for t in tasks {
            let (a, b) = rest.split_at_mut(t.rows(g) * (hd + 2));
            pieces.push(Mutex::new(a));
            rest = b;
        }
        let (kr, vr) = (rows.k, rows.v);
        let (kw, vw) = (rows.k_strides, rows.v_strides);
        let next = AtomicUsize::new(0);
        // Sized for the largest task, not for a whole block of query tokens: a decode step's
        // tasks have a few rows, and this is allocated per thread and layer.
        let max_rows = work.max_rows;
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
                        run(tier, &job, k, v, AsIs, &mut buf, &mut o)
                    }
                    (RowsRef::Bf16(k), RowsRef::Bf16(v)) => {
                        run(tier, &job, k, v, FromBf16, &mut buf, &mut o)
                    }
                    (RowsRef::F16(k), RowsRef::F16(v)) => {
                        run(tier, &job, k, v, FromF16, &mut buf, &mut o)
                    }
                    _ => panic!("key and value rows must share one dtype"),
                }
            }
        });
    }
    write_out(tasks, &work.scratch, shape, work.merge_rows, out);
}
