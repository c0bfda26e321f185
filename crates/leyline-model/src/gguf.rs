//! Reading GGUF files: metadata, hyper-parameters and tensors, with errors that name the file.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;
use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

/// An opened GGUF file: its parsed header and a reader for tensor data.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
    file_len: u64,
}

impl GgufFile {
    /// Opens and parses the header of a GGUF file.
    ///
    /// # Errors
    /// [`ModelError::File`] when the file is missing, unreadable or not a valid GGUF header.
    pub fn open(path: &Path) -> Result<Self> {
        let file_err = |reason: String| ModelError::File {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(|e| file_err(format!("cannot open: {e}")))?;
        let file_len = file.metadata().map_err(|e| file_err(e.to_string()))?.len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)
            .map_err(|e| file_err(format!("not a readable GGUF file: {e}")))?;
        let this = Self {
            path: path.to_path_buf(),
            content,
            reader,
            file_len,
        };
        this.check_tensor_extents()?;
        Ok(this)
    }

    /// Every tensor's data must lie inside the file; a truncated download fails here, early
    /// and with a clear message, instead of in the middle of loading.
    fn check_tensor_extents(&self) -> Result<()> {
        for (name, info) in &self.content.tensor_infos {
            let elems: usize = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            let bytes = (elems / block.max(1)) as u64 * info.ggml_dtype.type_size() as u64;
            let end = self.content.tensor_data_offset + info.offset + bytes;
            if end > self.file_len {
                return Err(ModelError::File {
                    path: self.path.clone(),
                    reason: format!(
                        "truncated file: tensor {name} ends at byte {end} but the file has {} bytes",
                        self.file_len
                    ),
                });
            }
        }
        Ok(())
    }

    /// Every tensor's name and size in bytes as stored, in the file's order of offsets.
    pub fn tensor_sizes(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(u64, String, u64)> = self
            .content
            .tensor_infos
            .iter()
            .map(|(name, info)| {
                let elems = info.shape.elem_count();
                let block = info.ggml_dtype.block_size().max(1);
                let bytes = (elems / block) as u64 * info.ggml_dtype.type_size() as u64;
                (info.offset, name.clone(), bytes)
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, n, b)| (n, b)).collect()
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata key-value map.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Whether a tensor of that name exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads a tensor in its stored (possibly quantized) form.
    ///
    /// # Errors
    /// [`ModelError::File`] naming the tensor when it is missing or unreadable.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(self.file_error(format!("missing tensor {name}")));
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| ModelError::File {
                path: self.path.clone(),
                reason: format!("tensor {name}: {e}"),
            })
    }

    fn file_error(&self, reason: String) -> ModelError {
        ModelError::File {
            path: self.path.clone(),
            reason,
        }
    }

    /// A required string value.
    ///
    /// # Errors
    /// Missing key or wrong type.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.metadata().get(key) {
            Some(v) => v
                .to_string()
                .map(String::as_str)
                .map_err(|_| self.file_error(format!("metadata {key} is not a string"))),
            None => Err(self.file_error(format!("missing metadata {key}"))),
        }
    }

    /// A required unsigned integer value (any integer width).
    ///
    /// # Errors
    /// Missing key or wrong type.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.file_error(format!("missing metadata {key}")))
    }

    /// An optional unsigned integer value.
    ///
    /// # Errors
    /// Wrong type.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        let Some(v) = self.metadata().get(key) else {
            return Ok(None);
        };
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => {
                return Err(self.file_error(format!("metadata {key} is not a non-negative integer")))
            }
        };
        Ok(Some(n as usize))
    }

    /// An optional float value.
    ///
    /// # Errors
    /// Wrong type.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        let Some(v) = self.metadata().get(key) else {
            return Ok(None);
        };
        match v {
            Value::F32(x) => Ok(Some(*x as f64)),
            Value::F64(x) => Ok(Some(*x)),
            _ => Err(self.file_error(format!("metadata {key} is not a float"))),
        }
    }
}
