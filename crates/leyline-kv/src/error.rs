//! The one error type of `leyline-kv`.

use leyline_kernels::KernelError;

/// Everything that can go wrong in the KV layer.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum KvError {
    /// A slot index outside the pool.
    #[error("slot {slot} is out of range for a pool of {capacity} slots")]
    SlotOutOfRange {
        /// The offending slot.
        slot: u32,
        /// Pool capacity.
        capacity: usize,
    },
    /// A row passed to the storage has the wrong width.
    #[error("{what}: expected {expected} values, got {got}")]
    WidthMismatch {
        /// Which buffer.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// The requested storage cannot be allocated.
    #[error("cannot size the KV pool: {0}")]
    Sizing(String),
    /// The pool has fewer free slots than requested (a normal state: evict, queue or refuse).
    #[error("KV pool exhausted: {requested} slots requested, {free} free")]
    PoolExhausted {
        /// Slots asked for.
        requested: usize,
        /// Slots free at the time.
        free: usize,
    },
    /// A slot was retained or released while free (double free).
    #[error("slot {slot} is free; it cannot be retained or released")]
    SlotNotInUse {
        /// The offending slot.
        slot: u32,
    },
    /// A sequence was given with a different number of token ids and slots.
    #[error("{tokens} token ids but {slots} slots")]
    LengthMismatch {
        /// Number of token ids.
        tokens: usize,
        /// Number of slots.
        slots: usize,
    },
    /// A slot of one lineage was offered to another lineage's namespace.
    #[error("slot {slot} of lineage {slot_lineage} may not serve lineage {namespace}")]
    LineageMismatch {
        /// The offending slot.
        slot: u32,
        /// The slot's lineage.
        slot_lineage: u64,
        /// The namespace's lineage.
        namespace: u64,
    },
    /// A radix node id that no longer (or never) named a live node.
    #[error("radix node {0} does not exist")]
    StaleNode(u32),
    /// A removal would drop a locked radix node.
    #[error("radix node {0} is locked by a running sequence")]
    NodeLocked(u32),
    /// A RoPE spec that cannot describe a rotation (odd or oversized rotary dim, bad theta...).
    #[error("invalid RoPE spec: {0}")]
    InvalidRope(String),
    /// The model's RoPE cannot be shifted by a relative rotation (AMORTIZE is refused).
    #[error("keys of this model cannot be shifted in place: {0}")]
    NotShiftable(String),
    /// Inputs of the splice planner disagree with each other or with the batch.
    #[error("splice plan: {0}")]
    SpliceInput(String),
    /// Copy-on-write before a rotation needs more slots than the allocator gave.
    #[error("copy-on-write needs {needed} fresh slots and the pool could not provide them")]
    CowExhausted {
        /// Slots needed.
        needed: usize,
    },
    /// A kernel refused an operation for a reason the variants above do not name.
    #[error(transparent)]
    Kernel(KernelError),
}

/// A kernel's refusal in this layer's terms: a row of the storage is a slot, so the errors
/// callers already match on (a bad RoPE, an unshiftable one, a width or slot out of range)
/// keep their variants.
impl From<KernelError> for KvError {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::InvalidRope(m) => KvError::InvalidRope(m),
            KernelError::NotShiftable(m) => KvError::NotShiftable(m),
            KernelError::WidthMismatch {
                what,
                expected,
                got,
            } => KvError::WidthMismatch {
                what,
                expected,
                got,
            },
            KernelError::RowOutOfRange { row, rows } => KvError::SlotOutOfRange {
                slot: row,
                capacity: rows,
            },
            other => KvError::Kernel(other),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = KvError> = std::result::Result<T, E>;
