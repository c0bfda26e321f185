//! Leyline's KV layer: the token-granular slot pool, the radix prefix tree over token ids,
//! the splice planner and the rotation kernels that move cached keys to new positions.
//!
//! Design decision: slot *metadata* (positions, lineage, refcounts, the tree) lives apart
//! from the *storage* buffers. An edit first plans on metadata, then one batched kernel pass
//! touches storage. This crate knows nothing of models, tokenizers or HTTP, and holds no
//! tensors: storage is plain typed buffers.
#![deny(missing_docs)]

pub mod convert;
pub mod cpu;
pub mod error;
pub mod mem;
pub mod radix;
pub mod rope;
pub mod rotate;
pub mod shift;
pub mod slots;
pub mod splice;
pub mod storage;

pub use error::{KvError, Result};
pub use storage::{KvDtype, KvGeometry, KvStorage};
