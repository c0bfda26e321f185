//! Leyline's CPU kernels: quantized matrix products ([`qmatmul`]), f32 products on packed
//! panels ([`panel`]) and through gemm ([`gemm`]), causal attention over row buffers
//! ([`attend`]), RoPE and the in-place rotation of cached keys ([`rope`], [`rotate`]),
//! elementwise math ([`fastmath`]), the 16-bit float converters ([`convert`]), the buffers
//! and thread pool they run on ([`mem`], [`pool`]), and the one instruction-set [`Tier`]
//! every family dispatches on (from the CPU features [`cpu`] detects once).
//!
//! This is the lowest layer beside `leyline-core`: it knows nothing of the KV pool's slot
//! metadata or prefix tree, of models, tokenizers or HTTP, and holds no tensors. `leyline-kv`
//! rotates its storage with these kernels, and `leyline-model` runs its forward passes on them.
//!
//! Every family dispatches on [`Tier::best`]: the CPU's best tier, or a lower one that the
//! environment variable `LEYLINE_KERNEL_TIER=portable|avx2|avx512` ([`TIER_ENV`]) forces,
//! read once per process (a tier the CPU lacks, or an unknown name, is logged as a warning
//! and ignored). Tests compare every tier the CPU runs whatever it says. The gemm crate and
//! candle pick their own kernels; the variable does not reach them.
//!
//! Design decision: the kernels take plain typed views of row buffers ([`rows::RowsMut`],
//! [`rows::RowsRef`]) and the RoPE description itself ([`rope::RopeSpec`]), which moved down
//! from `leyline-kv` with them: both are pure data and math, both layers above need them, and
//! a kernel taking bare slices plus cos/sin tables would have needed a second, spec-taking
//! entry point in every caller. Attention takes tasks with row indices
//! ([`attend::Task`]); the planner that knows the batch stays in the model. candle stays out
//! (so `leyline-kv` builds without tensors): `leyline_model::quant` turns a GGUF tensor into
//! a [`qmatmul::QMatrix`].
//!
//! ```
//! use leyline_kernels::rope::{RopeSpec, RotaryLayout};
//! use leyline_kernels::rotate::shift_rows;
//! use leyline_kernels::rows::RowsMut;
//!
//! // Two rows of one head of 4 dims, rotated by R(3) and back by R(-3).
//! let spec = RopeSpec::plain(10_000.0, 4, RotaryLayout::Neox);
//! let mut rows = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
//! shift_rows(RowsMut::F32(&mut rows), 1, 4, &[0, 1], &spec, 3).unwrap();
//! shift_rows(RowsMut::F32(&mut rows), 1, 4, &[0, 1], &spec, -3).unwrap();
//! assert!((rows[3] - 4.0).abs() < 1e-5);
//! ```
#![deny(missing_docs)]

pub mod attend;
pub mod convert;
pub mod cpu;
pub mod error;
pub mod fastmath;
pub mod gemm;
pub mod mem;
pub mod panel;
pub mod pool;
pub mod qmatmul;
pub mod rope;
pub mod rotate;
pub mod rows;
mod tier;

pub use error::{KernelError, Result};
pub use tier::{Tier, TIER_ENV};
