//! Engine counters and gauges, readable from any thread without locking the engine.

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! metrics {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        /// Live counters (monotonic) and gauges (current values) of an engine.
        #[derive(Debug, Default)]
        pub struct Metrics {
            $($(#[$doc])* pub $name: AtomicU64,)*
        }

        /// A plain copy of [`Metrics`] at one moment.
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct MetricsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Metrics {
            /// Reads every value.
            pub fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }

        impl MetricsSnapshot {
            /// `(name, value)` pairs, for exporters.
            pub fn pairs(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

metrics! {
    /// Requests submitted.
    requests_submitted,
    /// Requests that finished normally.
    requests_finished,
    /// Requests that failed.
    requests_failed,
    /// Requests dropped because their receiver went away while they were queued or
    /// prefilling (a prefilling one also counts as finished: it leaves through retirement).
    requests_cancelled,
    /// Requests refused because the queue was full.
    requests_rejected_queue_full,
    /// Prompt tokens of admitted requests.
    prompt_tokens,
    /// Prompt tokens served from the prefix cache.
    cached_prompt_tokens,
    /// Tokens run through prefill.
    prefilled_tokens,
    /// Tokens generated.
    generated_tokens,
    /// Time to first token of finished requests, summed, in microseconds (divided by
    /// `requests_finished`: the mean).
    ttft_us,
    /// Keys rotated by AMORTIZE splices.
    rotated_tokens,
    /// AMORTIZE directives applied.
    directives_amortize,
    /// FORGET directives applied.
    directives_forget,
    /// Slots freed by prefix-cache eviction.
    evicted_slots,
    /// Idle sessions whose KV was dropped to make room (each keeps its id; its next
    /// request prefills again).
    sessions_shed,
    /// Sessionless requests that continued a cached conversation by a splice (implicit
    /// splices).
    implicit_splices,
    /// Forward calls.
    forward_calls,
    /// Sequences decoded in forward calls that decoded more than one (batching at work).
    batched_decode_seqs,
    /// Largest number of sequences in one forward call.
    max_batch_seqs,
    /// Lazy-rotation compactions put off because their copies did not fit in the pool.
    compactions_deferred,
    /// Gauge: requests waiting for admission.
    queue_depth,
    /// Gauge: requests running.
    running,
    /// Gauge: cached conversations of sessionless requests (implicit splices).
    conversations,
    /// Gauge: slots in use (held by requests or the prefix tree).
    pool_used_slots,
    /// Gauge: pool capacity in slots.
    pool_capacity_slots,
    /// Gauge: bytes of KV one slot holds over all layers (times `pool_used_slots`: the
    /// resident KV).
    pool_slot_bytes,
}

impl Metrics {
    pub(crate) fn add(&self, c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn set(&self, c: &AtomicU64, n: u64) {
        c.store(n, Ordering::Relaxed);
    }

    pub(crate) fn max(&self, c: &AtomicU64, n: u64) {
        c.fetch_max(n, Ordering::Relaxed);
    }
}
