//! The hyper-parameters the decoders of the llama lineage share (llama.cpp's
//! `llm_load_hparams` before its per-architecture switch): widths, head counts, norm epsilon
//! and the rotary embedding, read from `{arch}.*` keys every such file may carry. An
//! architecture declares these keys plus its own ([`ArchKeys::new`]) and builds its rope
//! specs from [`Hparams::rope`].

use crate::error::{ModelError, Result};
use crate::gguf::ArchKeys;
use crate::model::ModelInfo;
use leyline_kernels::rope::{LayerRopes, RopeScaling, RopeSpec, RotaryLayout};
use leyline_kv::KvGeometry;

/// The `{arch}.*` keys [`Hparams::read`] reads.
pub(crate) const SHARED_KEYS: &[&str] = &[
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scale_linear",
];

/// Hyper-parameters of a llama-lineage decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Hparams {
    /// Vocabulary size as the metadata states it (0 when absent; the head decides).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA groups).
    pub kv_heads: usize,
    /// Width of one head (may differ from `hidden / heads`: Qwen3, Gemma 3).
    pub head_dim: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Trained context length.
    pub context_length: usize,
    /// RoPE base of the (global) layers.
    pub rope_theta: f64,
    /// Rotated dims per head.
    pub rotary_dim: usize,
    /// Frequency scaling.
    pub rope_scaling: RopeScaling,
}

impl Hparams {
    /// Reads the shared keys (which `k` must declare: [`SHARED_KEYS`]).
    ///
    /// # Errors
    /// [`ModelError::File`] for missing required keys or wrong types,
    /// [`ModelError::Unsupported`] for head counts that do not divide, value heads of
    /// another width than key heads, or a rope scaling Leyline cannot shift.
    pub(crate) fn read(k: &ArchKeys<'_>) -> Result<Self> {
        let unsupported = |reason: String| ModelError::Unsupported {
            path: k.path().to_path_buf(),
            reason,
        };
        let hidden = k.usize("embedding_length")?;
        let heads = k.usize("attention.head_count")?;
        let kv_heads = k.opt_usize("attention.head_count_kv")?.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || hidden % heads != 0 {
            return Err(unsupported(format!(
                "{heads} heads, {kv_heads} kv heads and width {hidden} do not divide"
            )));
        }
        let head_dim = k
            .opt_usize("attention.key_length")?
            .unwrap_or(hidden / heads);
        if let Some(v) = k.opt_usize("attention.value_length")? {
            if v != head_dim {
                return Err(unsupported(format!(
                    "value heads of {v} with key heads of {head_dim}"
                )));
            }
        }
        let vocab_size = match k.opt_usize("vocab_size")? {
            Some(v) => v,
            None => match k.file().metadata().get("tokenizer.ggml.tokens") {
                Some(v) => v.to_vec().map(Vec::len).unwrap_or(0),
                None => 0,
            },
        };
        Ok(Self {
            vocab_size,
            hidden,
            layers: k.usize("block_count")?,
            heads,
            kv_heads,
            head_dim,
            ffn: k.usize("feed_forward_length")?,
            rms_eps: k
                .opt_f64("attention.layer_norm_rms_epsilon")?
                .unwrap_or(1e-5),
            context_length: k.opt_usize("context_length")?.unwrap_or(2048),
            rope_theta: k.opt_f64("rope.freq_base")?.unwrap_or(10_000.0),
            rotary_dim: k.opt_usize("rope.dimension_count")?.unwrap_or(head_dim),
            rope_scaling: rope_scaling(k)?,
        })
    }

    /// The rope spec of base `theta` in `layout`, checked.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] for a spec Leyline cannot rotate (odd rotary width, ...).
    pub(crate) fn rope(
        &self,
        k: &ArchKeys<'_>,
        theta: f64,
        layout: RotaryLayout,
    ) -> Result<RopeSpec> {
        let spec = RopeSpec {
            theta,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            layout,
            scaling: self.rope_scaling,
            freq_factors: None,
        };
        spec.validate().map_err(|e| ModelError::Unsupported {
            path: k.path().to_path_buf(),
            reason: format!("rope: {e}"),
        })?;
        Ok(spec)
    }
}

impl Hparams {
    /// What the engine is told about a model of these hyper-parameters whose head has
    /// `vocab` rows and whose layers rotate keys by `rope`.
    pub(crate) fn info(&self, name: &str, arch: &str, vocab: usize, rope: LayerRopes) -> ModelInfo {
        ModelInfo {
            name: name.to_string(),
            arch: arch.to_string(),
            vocab_size: vocab,
            context_length: self.context_length,
            geometry: KvGeometry {
                layers: self.layers,
                k_heads: self.kv_heads,
                k_head_dim: self.head_dim,
                v_width: self.kv_heads * self.head_dim,
            },
            rope,
        }
    }
}

/// The frequency scaling as llama.cpp reads it: `rope.scaling.type` (default `linear`) and
/// `rope.scaling.factor` (or the older `rope.scale_linear`); a factor of 0 or 1 scales
/// nothing, and type `none` ignores the factor.
///
/// # Errors
/// [`ModelError::Unsupported`] naming a type other than `none` and `linear` (`yarn` and
/// `longrope` GGUF parameters are not read yet).
fn rope_scaling(k: &ArchKeys<'_>) -> Result<RopeScaling> {
    let factor = match k.opt_f64("rope.scaling.factor")? {
        Some(f) => Some(f),
        None => k.opt_f64("rope.scale_linear")?,
    };
    match k.opt_str("rope.scaling.type")?.unwrap_or("linear") {
        "none" => Ok(RopeScaling::None),
        "linear" => Ok(match factor {
            None => RopeScaling::None,
            Some(f) if f == 0.0 || f == 1.0 => RopeScaling::None,
            Some(factor) => RopeScaling::Linear { factor },
        }),
        other => Err(ModelError::Unsupported {
            path: k.path().to_path_buf(),
            reason: format!(
                "{}.rope.scaling.type {other:?} is not supported (supported: none, linear, and \
                 Llama 3's rope_freqs.weight)",
                k.arch()
            ),
        }),
    }
}
