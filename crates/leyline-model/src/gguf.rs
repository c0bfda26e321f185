//! Reading GGUF files: metadata, hyper-parameters and tensors, with errors that name the file.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use leyline_kernels::mem::Arena;
use memmap2::Mmap;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An opened GGUF file: its parsed header, and the file mapped read-only for tensor data.
///
/// Tensors are read from the mapping: a matrix the kernels repack is built straight from
/// the file's pages, which are then given back ([`Self::release`]), so that loading never
/// holds the weights twice; a warm page cache makes a second start cost no read at all.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    map: Arc<Mmap>,
    /// Tensors read so far ([`Self::ensure_all_taken`]).
    taken: HashSet<String>,
    /// Where the file's quantized matrices are built ([`Self::arena`]).
    arena: Option<Arc<Arena>>,
}

/// A tensor as the file stores it: GGML's blocks, borrowed from the mapping.
pub struct StoredTensor<'f> {
    /// The stored type.
    pub dtype: GgmlDType,
    /// Dimensions, outermost first (GGUF lists them innermost first).
    pub dims: Vec<usize>,
    /// The tensor's bytes.
    pub bytes: &'f [u8],
    /// Where they start in the file ([`GgufFile::mapping`]).
    pub start: usize,
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
        // SAFETY: the mapping is read-only and owned by this value; what Rust cannot see is
        // another process changing the file while it is mapped. Leyline never writes a model
        // file in place (the hub renames a complete download over it, which leaves this
        // mapping on the old file), and the mapping outlives the load only where a tensor is
        // kept as stored (an embedding table that is not also the head). The same contract as
        // llama.cpp's and candle's mappings.
        let map = Arc::new(
            unsafe { Mmap::map(&file) }
                .map_err(|e| file_err(format!("cannot map the file: {e}")))?,
        );
        let content = Content::read(&mut Cursor::new(&map[..]))
            .map_err(|e| file_err(format!("not a readable GGUF file: {e}")))?;
        let this = Self {
            path: path.to_path_buf(),
            content,
            map,
            taken: HashSet::new(),
            arena: None,
        };
        this.check_tensor_extents()?;
        Ok(this)
    }

    /// Every tensor's data must lie inside the file; a truncated download fails here, early
    /// and with a clear message, instead of in the middle of loading.
    fn check_tensor_extents(&self) -> Result<()> {
        for name in self.content.tensor_infos.keys() {
            let Some((_, end)) = self.extent(name) else {
                return Err(self.file_error(format!("tensor {name}: its size overflows")));
            };
            if end > self.map.len() as u64 {
                return Err(ModelError::File {
                    path: self.path.clone(),
                    reason: format!(
                        "truncated file: tensor {name} ends at byte {end} but the file has {} bytes",
                        self.map.len()
                    ),
                });
            }
        }
        Ok(())
    }

    /// Where a tensor's bytes lie in the file: `(start, end)`; `None` for a missing tensor or
    /// a header whose numbers overflow.
    fn extent(&self, name: &str) -> Option<(u64, u64)> {
        let info = self.content.tensor_infos.get(name)?;
        let elems = info
            .shape
            .dims()
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d as u64))?;
        let block = info.ggml_dtype.block_size().max(1) as u64;
        let bytes = (elems / block).checked_mul(info.ggml_dtype.type_size() as u64)?;
        let start = self.content.tensor_data_offset.checked_add(info.offset)?;
        Some((start, start.checked_add(bytes)?))
    }

    /// Every tensor's name and size in bytes as stored, in the file's order of offsets.
    pub fn tensor_sizes(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(u64, String, u64)> = self
            .content
            .tensor_infos
            .iter()
            .map(|(name, info)| {
                // Extents were checked at open.
                let (start, end) = self.extent(name).unwrap_or_default();
                (info.offset, name.clone(), end - start)
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, n, b)| (n, b)).collect()
    }

    /// Every tensor's name, stored type and dimensions (outermost first).
    pub fn tensor_types(&self) -> impl Iterator<Item = (&str, GgmlDType, &[usize])> {
        self.content
            .tensor_infos
            .iter()
            .map(|(n, i)| (n.as_str(), i.ggml_dtype, i.shape.dims()))
    }

    /// The arena this file's repacked matrices share, made on first use with the capacity
    /// `size` gives for the file (`quant::load_qmatrix` knows what the kernels store).
    pub(crate) fn arena(&mut self, size: impl FnOnce(&Self) -> usize) -> Arc<Arena> {
        if self.arena.is_none() {
            self.arena = Some(Arena::new(size(self)));
        }
        Arc::clone(self.arena.as_ref().expect("made above"))
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata key-value map.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// Moves the metadata entries whose keys `pick` selects out of the file's map, for work
    /// that runs beside the loading of the weights; [`Self::put_metadata`] puts them back.
    pub fn take_metadata(&mut self, pick: impl Fn(&str) -> bool) -> HashMap<String, Value> {
        let keys: Vec<String> = self
            .content
            .metadata
            .keys()
            .filter(|k| pick(k))
            .cloned()
            .collect();
        keys.into_iter()
            .filter_map(|k| self.content.metadata.remove_entry(&k))
            .collect()
    }

    /// Puts entries taken by [`Self::take_metadata`] back.
    pub fn put_metadata(&mut self, entries: HashMap<String, Value>) {
        self.content.metadata.extend(entries);
    }

    /// Whether a tensor of that name exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads a tensor in its stored (possibly quantized) form, and counts it as taken
    /// ([`Self::ensure_all_taken`]).
    ///
    /// # Errors
    /// [`ModelError::File`] naming the tensor when it is missing or unreadable.
    pub fn tensor(&mut self, name: &str) -> Result<QTensor> {
        if !self.has_tensor(name) {
            return Err(self.file_error(format!("missing tensor {name}")));
        }
        self.taken.insert(name.to_string());
        self.content
            .tensor(&mut Cursor::new(&self.map[..]), name, &Device::Cpu)
            .map_err(|e| ModelError::File {
                path: self.path.clone(),
                reason: format!("tensor {name}: {e}"),
            })
    }

    /// A tensor's stored bytes, borrowed from the mapping, and counts it as taken
    /// ([`Self::ensure_all_taken`]).
    ///
    /// # Errors
    /// [`ModelError::File`] naming the tensor when it is missing.
    pub fn stored(&mut self, name: &str) -> Result<StoredTensor<'_>> {
        let Some((start, end)) = self.extent(name) else {
            return Err(self.file_error(format!("missing tensor {name}")));
        };
        // Every extent was checked against the file's length at open.
        self.taken.insert(name.to_string());
        let info = &self.content.tensor_infos[name];
        Ok(StoredTensor {
            dtype: info.ggml_dtype,
            dims: info.shape.dims().to_vec(),
            bytes: &self.map[start as usize..end as usize],
            start: start as usize,
        })
    }

    /// The file's mapping, for a tensor kept where it is stored (it keeps the mapping alive).
    pub fn mapping(&self) -> Arc<dyn AsRef<[u8]> + Send + Sync> {
        Arc::clone(&self.map) as Arc<dyn AsRef<[u8]> + Send + Sync>
    }

    /// Gives the pages that lie wholly inside a tensor back to the system, once it has been
    /// copied out (repacked), so that the process does not hold the file's pages beside the
    /// copy. The page cache keeps them: a later read, or the next start, finds them there.
    /// A tensor that was not read, or a refusal by the kernel, changes nothing.
    pub fn release(&self, name: &str) {
        let Some((start, end)) = self.extent(name) else {
            return;
        };
        let page = 4096;
        let (lo, hi) = (
            (start as usize).next_multiple_of(page),
            end as usize / page * page,
        );
        if hi > lo {
            // SAFETY: the mapping is read-only, so it holds no private page whose contents
            // could be lost: after MADV_DONTNEED a read faults the same bytes in from the
            // file again. No `&[u8]` handed out is invalidated, only its pages' residency.
            #[cfg(unix)]
            let _ = unsafe {
                self.map
                    .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo)
            };
        }
    }

    /// Reads a tensor as its f32 values, flattened (norm weights, frequency factors), and
    /// counts it as taken.
    ///
    /// # Errors
    /// As [`Self::tensor`]; unreadable data.
    pub fn tensor_f32(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self
            .tensor(name)?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Refuses a file holding tensors that nobody read through [`Self::tensor`] (llama.cpp
    /// refuses a file whose tensor count differs from what the architecture claimed).
    ///
    /// # Errors
    /// [`ModelError::Unread`] naming the tensors, sorted, and `arch`.
    pub fn ensure_all_taken(&self, arch: &str) -> Result<()> {
        let mut left: Vec<String> = self
            .content
            .tensor_infos
            .keys()
            .filter(|n| !self.taken.contains(*n))
            .cloned()
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        left.sort();
        Err(ModelError::Unread {
            path: self.path.clone(),
            arch: arch.to_string(),
            what: "tensor",
            names: left,
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

/// The metadata keys `{arch}.*` one architecture reads, declared up front (llama.cpp's
/// `load_arch_hparams`): the file may hold no other key under its architecture's prefix,
/// and the architecture reads no undeclared one. Keys under other prefixes (`general.*`,
/// `tokenizer.*`, `quantize.*`, `split.*`) are read where they matter and otherwise allowed.
pub struct ArchKeys<'f> {
    f: &'f GgufFile,
    arch: &'f str,
    declared: Vec<&'static str>,
}

impl<'f> ArchKeys<'f> {
    /// Checks the file's `{arch}.*` keys against `declared`, the concatenated lists of
    /// suffixes after `{arch}.` (the keys the architectures share, then its own).
    ///
    /// # Errors
    /// [`ModelError::Unread`] naming every key under the prefix that is not declared.
    pub fn new(
        f: &'f GgufFile,
        arch: &'f str,
        declared: &[&'static [&'static str]],
    ) -> Result<Self> {
        let declared: Vec<&'static str> = declared.iter().flat_map(|l| l.iter().copied()).collect();
        let prefix = format!("{arch}.");
        let mut unknown: Vec<String> = f
            .metadata()
            .keys()
            .filter(|k| {
                k.strip_prefix(&prefix)
                    .is_some_and(|rest| !declared.contains(&rest))
            })
            .cloned()
            .collect();
        if !unknown.is_empty() {
            unknown.sort();
            return Err(ModelError::Unread {
                path: f.path().to_path_buf(),
                arch: arch.to_string(),
                what: "metadata key",
                names: unknown,
            });
        }
        Ok(Self { f, arch, declared })
    }

    /// The full key of `suffix`, which must be declared (an undeclared one is a bug of the
    /// architecture's file, reported as an error rather than read).
    fn key(&self, suffix: &str) -> Result<String> {
        if !self.declared.contains(&suffix) {
            return Err(ModelError::Input(format!(
                "the {} architecture reads {suffix:?}, which it does not declare",
                self.arch
            )));
        }
        Ok(format!("{}.{suffix}", self.arch))
    }

    /// A required unsigned integer.
    ///
    /// # Errors
    /// Missing key, wrong type, undeclared suffix.
    pub fn usize(&self, suffix: &str) -> Result<usize> {
        self.f.get_usize(&self.key(suffix)?)
    }

    /// An optional unsigned integer.
    ///
    /// # Errors
    /// Wrong type, undeclared suffix.
    pub fn opt_usize(&self, suffix: &str) -> Result<Option<usize>> {
        self.f.opt_usize(&self.key(suffix)?)
    }

    /// An optional float.
    ///
    /// # Errors
    /// Wrong type, undeclared suffix.
    pub fn opt_f64(&self, suffix: &str) -> Result<Option<f64>> {
        self.f.opt_f64(&self.key(suffix)?)
    }

    /// An optional string.
    ///
    /// # Errors
    /// Wrong type, undeclared suffix.
    pub fn opt_str(&self, suffix: &str) -> Result<Option<&'f str>> {
        let key = self.key(suffix)?;
        match self.f.metadata().contains_key(&key) {
            true => self.f.get_str(&key).map(Some),
            false => Ok(None),
        }
    }

    /// The architecture's name.
    pub fn arch(&self) -> &str {
        self.arch
    }

    /// The file's path (for errors).
    pub fn path(&self) -> &Path {
        self.f.path()
    }

    /// The file (for keys outside the architecture's prefix).
    pub fn file(&self) -> &'f GgufFile {
        self.f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    #[test]
    fn tensors_read_from_the_mapping_and_a_truncated_file_is_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let vals: Vec<f32> = (0..32).map(|i| i as f32 * 0.5 - 3.0).collect();
        let t = Tensor::from_vec(vals.clone(), (4, 8), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        let mut out = File::create(&path).unwrap();
        candle_core::quantized::gguf_file::write(&mut out, &[], &[("w", &q)]).unwrap();
        drop(out);

        let mut f = GgufFile::open(&path).unwrap();
        let s = f.stored("w").unwrap();
        assert_eq!((s.dtype, s.dims.as_slice()), (GgmlDType::F32, &[4, 8][..]));
        let want: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(s.bytes, &want[..]);
        f.release("w");
        assert_eq!(f.tensor_f32("w").unwrap(), vals);
        assert!(f.stored("x").is_err());
        drop(f);

        let len = std::fs::metadata(&path).unwrap().len();
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 4)
            .unwrap();
        let err = GgufFile::open(&path)
            .err()
            .expect("a truncated file")
            .to_string();
        assert!(
            err.contains("truncated file: tensor w ends at byte"),
            "{err}"
        );
    }
}
