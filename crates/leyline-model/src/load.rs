//! Loading a model from a path: a GGUF file or a checkpoint directory, dispatched through
//! the one table of [`crate::arch::ARCHITECTURES`], with the tokenizer and chat template of
//! a GGUF file.

use crate::arch::{self, Loader};
use crate::error::{ModelError, Result};
use crate::model::CausalLm;
use crate::{chat, gguf, tokenizer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A model ready to serve: weights, tokenizer and (when the file has one) chat template.
pub struct LoadedModel {
    /// The network.
    pub model: Arc<dyn CausalLm>,
    /// Its tokenizer.
    pub tokenizer: tokenizer::Tokenizer,
    /// Its chat template, if the file carries one.
    pub chat: Option<chat::ChatTemplate>,
    /// Where it was loaded from.
    pub path: PathBuf,
}

/// Loads a GGUF file of an architecture of [`arch::ARCHITECTURES`] with its tokenizer and
/// chat template. The architecture's own loader reads its metadata first (so an
/// unsupported file fails before any weight is read), then its weights, and refuses any
/// `{arch}.*` key or tensor it does not read.
///
/// # Errors
/// [`ModelError::File`], [`ModelError::Unsupported`] or [`ModelError::Unread`] naming the
/// file and the reason.
pub fn load_gguf(path: &Path) -> Result<LoadedModel> {
    let mut f = gguf::GgufFile::open(path)?;
    // The tokenizer (a few hundred ms for a vocabulary of 150K) is built on a thread of its
    // own from its keys, moved out of the header meanwhile, while the weights load.
    let keys = f.take_metadata(|k| k.starts_with("tokenizer.ggml."));
    let (model, tokenizer) = std::thread::scope(|s| {
        let tokenizer = s.spawn(|| tokenizer::Tokenizer::from_gguf_metadata(&keys));
        let model = load_network(&mut f);
        (model, tokenizer.join())
    });
    f.put_metadata(keys);
    let model = model?;
    let tokenizer = tokenizer
        .map_err(|_| ModelError::Input("the tokenizer's thread panicked".into()))?
        .map_err(|e| ModelError::File {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    // A file without a usable template still runs raw prompts; chat requests are then
    // refused, and the reason is logged here rather than dropped.
    let chat = match chat::ChatTemplate::from_gguf_metadata(f.metadata(), &tokenizer) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("{}: no usable chat template: {e}", path.display());
            None
        }
    };
    Ok(LoadedModel {
        model,
        tokenizer,
        chat,
        path: path.to_path_buf(),
    })
}

/// The network of an opened GGUF file, by the loader [`arch::ARCHITECTURES`] names for its
/// `general.architecture`; named after the file's stem.
///
/// # Errors
/// [`ModelError::Unsupported`] for an architecture the table lacks; the loader's errors.
pub fn load_network(f: &mut gguf::GgufFile) -> Result<Arc<dyn CausalLm>> {
    let name = f.get_str("general.architecture")?.to_string();
    let Some(&arch::Architecture {
        loader: Loader::Gguf(load),
        ..
    }) = arch::find(&name)
    else {
        return Err(ModelError::Unsupported {
            path: f.path().to_path_buf(),
            reason: format!(
                "architecture {name:?} is not supported (supported: {})",
                arch::names(true)
            ),
        });
    };
    let stem = f
        .path()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    load(f, &stem)
}

/// The checkpoint loaders of the directory `dir`, by its `config.json`'s `model_type`. A
/// config that cannot be read, or names no `model_type`, goes to the one checkpoint
/// architecture (DeepSeek-V2), whose config check then names what is wrong.
///
/// # Errors
/// [`ModelError::Unsupported`] naming a `model_type` the table lacks.
#[allow(clippy::type_complexity)]
fn checkpoint(
    dir: &Path,
) -> Result<(
    fn(&Path) -> Result<()>,
    fn(&Path) -> Result<Arc<dyn CausalLm>>,
)> {
    let cfg = dir.join("config.json");
    let model_type = std::fs::read_to_string(&cfg)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("model_type")?.as_str().map(str::to_string));
    let name = model_type.as_deref().unwrap_or("deepseek_v2");
    match arch::find(name) {
        Some(&arch::Architecture {
            loader: Loader::Checkpoint { config, load },
            ..
        }) => Ok((config, load)),
        _ => Err(ModelError::Unsupported {
            path: cfg,
            reason: format!(
                "model_type {name:?} (supported in checkpoint directories: {})",
                arch::names(false)
            ),
        }),
    }
}

/// A network loaded without a tokenizer or chat template (a checkpoint directory holds
/// weights and config only).
pub struct BareModel {
    /// The network.
    pub model: Arc<dyn CausalLm>,
    /// Where it was loaded from.
    pub path: PathBuf,
}

/// What [`load_model_path`] loaded: a model ready to serve, or a bare network.
pub enum AnyModel {
    /// A GGUF file: the network with its tokenizer and (maybe) chat template.
    Served(Box<LoadedModel>),
    /// A DeepSeek-V2 checkpoint directory: the network alone.
    Bare(BareModel),
}

impl AnyModel {
    /// The network.
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        match self {
            Self::Served(m) => &m.model,
            Self::Bare(m) => &m.model,
        }
    }

    /// Where it was loaded from.
    pub fn path(&self) -> &Path {
        match self {
            Self::Served(m) => &m.path,
            Self::Bare(m) => &m.path,
        }
    }

    /// The tokenizer, if the model came with one.
    pub fn tokenizer(&self) -> Option<&tokenizer::Tokenizer> {
        match self {
            Self::Served(m) => Some(&m.tokenizer),
            Self::Bare(_) => None,
        }
    }

    /// The model with its tokenizer.
    ///
    /// # Errors
    /// [`ModelError::NoTokenizer`] for a bare network.
    pub fn into_served(self) -> Result<LoadedModel> {
        match self {
            Self::Served(m) => Ok(*m),
            Self::Bare(m) => Err(ModelError::NoTokenizer { path: m.path }),
        }
    }
}

/// Loads `path`: a directory as a DeepSeek-V2 checkpoint (`config.json` + safetensors, no
/// tokenizer), anything else as a GGUF file.
///
/// # Errors
/// As [`load_gguf`] and the checkpoint architecture's loader: a one-line error naming the
/// path and the reason (a directory without `config.json`, an unsupported config, a bad
/// tensor ...).
pub fn load_model_path(path: &Path) -> Result<AnyModel> {
    if path.is_dir() {
        let (_, load) = checkpoint(path)?;
        let model = load(path)?;
        Ok(AnyModel::Bare(BareModel {
            model,
            path: path.to_path_buf(),
        }))
    } else {
        Ok(AnyModel::Served(Box::new(load_gguf(path)?)))
    }
}

/// Loads `path` for a caller that needs a tokenizer. A directory is refused with
/// [`ModelError::NoTokenizer`] after only its `config.json` was checked (so a directory that
/// is no checkpoint at all names that problem instead), without reading any weight.
///
/// # Errors
/// As [`load_gguf`] and the checkpoint architecture's config check;
/// [`ModelError::NoTokenizer`].
pub fn load_with_tokenizer(path: &Path) -> Result<LoadedModel> {
    if path.is_dir() {
        let (config, _) = checkpoint(path)?;
        config(path)?;
        return Err(ModelError::NoTokenizer {
            path: path.to_path_buf(),
        });
    }
    load_gguf(path)
}
