//! Leyline's KV layer: the token-granular slot pool, the radix prefix tree over token ids,
//! and the splice planner, which moves cached keys to new positions with the rotation
//! kernels of `leyline-kernels`.
//!
//! Design decision: slot *metadata* (positions, lineage, refcounts, the tree) lives apart
//! from the *storage* buffers. An edit first plans on metadata, then one batched kernel pass
//! touches storage. This crate knows nothing of models, tokenizers or HTTP, and holds no
//! tensors: storage is plain typed buffers, handed to the kernels as row views.
#![deny(missing_docs)]

pub mod error;
pub mod radix;
pub mod shift;
pub mod slots;
pub mod splice;
pub mod storage;

pub use error::{KvError, Result};
pub use storage::{KvDtype, KvGeometry, KvStorage};
