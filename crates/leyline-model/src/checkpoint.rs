//! Reading a checkpoint directory, the safetensors counterpart of `gguf.rs`: the tensors of
//! `model.safetensors`, or of the shards named by `model.safetensors.index.json`. Every
//! tensor is handed out as f32, and what nobody takes is refused.

use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// All tensors of a checkpoint, taken out one by one with their shapes checked.
pub(crate) struct Weights {
    dir: PathBuf,
    map: HashMap<String, Tensor>,
}

impl Weights {
    /// Reads every tensor of the checkpoint in `dir` into memory.
    pub(crate) fn load_dir(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            let err = |reason: String| ModelError::File {
                path: index.clone(),
                reason,
            };
            let text = std::fs::read_to_string(&index).map_err(|e| err(e.to_string()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| err("no weight_map object".into()))?;
            let mut names = BTreeSet::new();
            for f in map.values() {
                let f = f
                    .as_str()
                    .ok_or_else(|| err("weight_map values must be file names".into()))?;
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(err(format!("shard name {f:?} leaves the directory")));
                }
                names.insert(f.to_string());
            }
            names.into_iter().map(|f| dir.join(f)).collect()
        } else {
            return Err(ModelError::File {
                path: dir.to_path_buf(),
                reason: "neither model.safetensors nor model.safetensors.index.json is here".into(),
            });
        };
        let mut map = HashMap::new();
        for f in files {
            let part =
                candle_core::safetensors::load(&f, &Device::Cpu).map_err(|e| ModelError::File {
                    path: f.clone(),
                    reason: e.to_string(),
                })?;
            map.extend(part);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            map,
        })
    }

    /// Wraps tensors already in memory (tests).
    #[cfg(test)]
    pub(crate) fn from_map(dir: &Path, map: HashMap<String, Tensor>) -> Self {
        Self {
            dir: dir.to_path_buf(),
            map,
        }
    }

    /// Names not taken yet, sorted.
    pub(crate) fn remaining(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.map.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Refuses a checkpoint that holds tensors nobody took, naming them: a tensor the
    /// model does not read would be silently ignored otherwise.
    ///
    /// # Errors
    /// [`ModelError::Unread`] naming the tensors left.
    pub(crate) fn ensure_all_taken(&self, arch: &str) -> Result<()> {
        let left = self.remaining();
        if left.is_empty() {
            return Ok(());
        }
        Err(ModelError::Unread {
            path: self.dir.clone(),
            arch: arch.to_string(),
            what: "tensor",
            names: left.iter().map(|s| s.to_string()).collect(),
        })
    }

    /// Whether the checkpoint has `name`.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    /// Takes `name` out as an f32 tensor of exactly `shape`.
    pub(crate) fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.map.remove(name).ok_or_else(|| ModelError::File {
            path: self.dir.clone(),
            reason: format!("tensor {name:?} is missing"),
        })?;
        if t.dims() != shape {
            return Err(ModelError::File {
                path: self.dir.clone(),
                reason: format!(
                    "tensor {name:?} has shape {:?}, the config implies {shape:?}",
                    t.dims()
                ),
            });
        }
        Ok(t.to_dtype(DType::F32)?)
    }
}
