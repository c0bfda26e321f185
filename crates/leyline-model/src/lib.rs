//! leyline-model: loading models (GGUF files with the tokenizer and chat template from
//! the file's metadata; DeepSeek-V2 checkpoint directories of safetensors, no tokenizer),
//! and forward passes whose attention reads and writes Leyline's KV slot pool at explicit
//! positions.
//!
//! The crate's rooms, as llama.cpp's `src/models/` has them: `gguf` reads files (and holds
//! an architecture to the keys and tensors it declares), `arch/` has one file per
//! architecture and the one table that dispatches on `general.architecture`, `blocks/`
//! the shared pieces those files wire (attention over the pool, MLPs, MoE, norms, rope
//! tables), `hparams` the metadata keys the llama-lineage decoders share, `model` the
//! forward contract with the engine, `load` the entry points,
//! `tokenizer` and `chat` the text side. The kernels live in `leyline-kernels`; fetching
//! model files in `leyline-hub`.
//!
//! Design decision: a model never owns a cache. Each forward call is handed the pool storage,
//! the slots to read (the sequence's context) and the slots to write (the new tokens), so
//! the engine alone decides where a token's KV lives.
//!
//! ```
//! // Every architecture is one row of the table.
//! assert!(leyline_model::arch::find("qwen2").is_some());
//! assert!(leyline_model::arch::find("gpt2").is_none());
//! ```
#![deny(missing_docs)]

pub mod arch;
pub(crate) mod blocks;
pub mod chat;
mod checkpoint;
pub mod error;
pub mod gguf;
pub mod hparams;
pub mod linear;
mod load;
mod model;
pub mod quant;
pub mod tokenizer;

pub use error::{ModelError, Result};
pub use load::{
    load_gguf, load_model_path, load_network, load_with_tokenizer, AnyModel, BareModel, LoadedModel,
};
pub use model::{check_batch, CausalLm, ForwardSeq, LogitsFor, ModelInfo};
