//! The architectures: one file each, wiring the shared [`crate::blocks`], and the one table
//! that dispatches on a file's `general.architecture` (a checkpoint directory's
//! `config.json` `model_type`). A new architecture is a new file plus one row here.

pub mod deepseek2;
pub mod gemma3;
pub mod llama;
pub mod olmo2;
pub mod qwen3;

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::model::CausalLm;
use std::path::Path;
use std::sync::Arc;

/// How an architecture's weights are read.
#[derive(Clone, Copy)]
pub enum Loader {
    /// From an opened GGUF file (the model's display name given).
    Gguf(fn(&mut GgufFile, &str) -> Result<Arc<dyn CausalLm>>),
    /// From a checkpoint directory (`config.json` + safetensors).
    Checkpoint {
        /// Reads and checks `config.json` alone, touching no weight.
        config: fn(&Path) -> Result<()>,
        /// Loads the network.
        load: fn(&Path) -> Result<Arc<dyn CausalLm>>,
    },
}

/// One row of [`ARCHITECTURES`].
#[derive(Clone, Copy)]
pub struct Architecture {
    /// `general.architecture` of a GGUF file, or `model_type` of a checkpoint's config.
    pub name: &'static str,
    /// Its loader.
    pub loader: Loader,
}

/// Every architecture Leyline runs.
pub const ARCHITECTURES: &[Architecture] = &[
    Architecture {
        name: "llama",
        loader: Loader::Gguf(llama::load),
    },
    Architecture {
        name: "qwen2",
        loader: Loader::Gguf(llama::load),
    },
    Architecture {
        name: "qwen3",
        loader: Loader::Gguf(qwen3::load),
    },
    Architecture {
        name: "qwen3moe",
        loader: Loader::Gguf(qwen3::load),
    },
    Architecture {
        name: "gemma3",
        loader: Loader::Gguf(gemma3::load),
    },
    Architecture {
        name: "olmo2",
        loader: Loader::Gguf(olmo2::load),
    },
    Architecture {
        name: "deepseek_v2",
        loader: Loader::Checkpoint {
            config: deepseek2::check_config,
            load: deepseek2::load_dir,
        },
    },
];

/// The row of `name`.
pub fn find(name: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.name == name)
}

/// The names of the architectures loaded from `gguf` files (else from checkpoint
/// directories), comma-separated, for error messages.
pub(crate) fn names(gguf: bool) -> String {
    ARCHITECTURES
        .iter()
        .filter(|a| matches!(a.loader, Loader::Gguf(_)) == gguf)
        .map(|a| a.name)
        .collect::<Vec<_>>()
        .join(", ")
}
