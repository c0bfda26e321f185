//! `llama` (Llama 1-3, SmolLM) and `qwen2` (Qwen2, Qwen2.5): pre-norm decoder layers of GQA
//! attention and a SiLU-gated MLP. Qwen2 differs by its Q/K/V biases (optional tensors
//! here) and its rotary layout: GGUF llama files store Q/K rows permuted so that RoPE
//! rotates adjacent pairs, Qwen2 files keep the halves. Either way the model writes
//! post-RoPE keys into the pool in the layout of its weights, and the [`RopeSpec`] it
//! reports says which, so a later shift rotates the same pairs. Llama 3's frequency
//! scaling arrives as `rope_freqs.weight` (per-frequency divisors, as llama.cpp applies
//! them) and `rope.scaling.type` `linear` as a factor on every frequency.

use crate::blocks::attention::{Attention, AttnPass};
use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::blocks::norm::{add_into, load_norm, rms_norm};
use crate::blocks::output::{load_embedding, Ends};
use crate::error::{ModelError, Result};
use crate::gguf::{ArchKeys, GgufFile};
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Ran};
use leyline_kernels::attend::Heads;
use leyline_kernels::pool::SpinPool;
use leyline_kernels::rope::{LayerRopes, RopeScaling, RopeSpec, RotaryLayout};
use leyline_kv::{KvGeometry, KvStorage};
use std::sync::Arc;

/// The `{arch}.*` keys this file reads.
const KEYS: &[&str] = &[
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

/// Loads a `llama` or `qwen2` GGUF file (the entry of [`crate::arch::ARCHITECTURES`]).
///
/// # Errors
/// As [`Llama::load`].
pub fn load(f: &mut GgufFile, name: &str) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Llama::load(f, name)?))
}

/// Hyper-parameters of a llama-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// GGUF architecture name (`llama`, `qwen2`).
    pub arch: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA groups).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Feed-forward width.
    pub ffn: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// Trained context length.
    pub context_length: usize,
    /// Rotary embedding (every layer's); its frequency factors come with the tensors.
    pub rope: RopeSpec,
}

impl LlamaConfig {
    /// Reads the hyper-parameters of a `llama` or `qwen2` GGUF file, refusing any
    /// `{arch}.*` key it does not read.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] for other architectures or rope scalings that Leyline
    /// cannot shift; [`ModelError::Unread`] for an unknown `{arch}.*` key;
    /// [`ModelError::File`] for missing metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f.get_str("general.architecture")?;
        let unsupported = |reason: String| ModelError::Unsupported {
            path: f.path().to_path_buf(),
            reason,
        };
        let layout = match arch {
            "llama" => RotaryLayout::Interleaved,
            "qwen2" => RotaryLayout::Neox,
            other => {
                return Err(unsupported(format!(
                    "{other:?} is not a llama-family architecture"
                )))
            }
        };
        let k = ArchKeys::new(f, arch, KEYS)?;
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
        let rotary_dim = k.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        let theta = k.opt_f64("rope.freq_base")?.unwrap_or(10_000.0);
        let vocab_size = match k.opt_usize("vocab_size")? {
            Some(v) => v,
            None => match f.metadata().get("tokenizer.ggml.tokens") {
                Some(v) => v.to_vec().map(Vec::len).unwrap_or(0),
                None => 0,
            },
        };
        let rope = RopeSpec {
            theta,
            head_dim,
            rotary_dim,
            layout,
            scaling: rope_scaling(&k)?,
            freq_factors: None,
        };
        rope.validate()
            .map_err(|e| unsupported(format!("rope: {e}")))?;
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
            rope,
            arch: arch.to_string(),
        })
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

/// One decoder layer's weights.
struct Layer {
    attn_norm: Vec<f32>,
    attn: Attention,
    ffn_norm: Vec<f32>,
    mlp: GatedMlp,
}

/// A loaded llama-family model.
pub struct Llama {
    cfg: LlamaConfig,
    info: ModelInfo,
    layers: Vec<Layer>,
    ends: Ends,
}

impl Llama {
    /// Loads the weights of an opened GGUF file; every tensor of the file must be one it
    /// reads.
    ///
    /// # Errors
    /// Unsupported architecture or metadata, missing, unreadable or unread tensors.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        let mut cfg = LlamaConfig::from_gguf(f)?;
        if cfg.arch == "llama" && f.has_tensor("rope_freqs.weight") {
            cfg.rope.freq_factors = Some(rope_freqs(f, cfg.rope.rotary_dim / 2)?);
            cfg.rope.validate().map_err(|e| ModelError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!("rope_freqs.weight: {e}"),
            })?;
        }
        let table = load_embedding(f, cfg.hidden)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            layers.push(Layer {
                attn_norm: load_norm(f, &format!("blk.{i}.attn_norm.weight"), cfg.hidden)?,
                attn: Attention::load(f, i)?,
                ffn_norm: load_norm(f, &format!("blk.{i}.ffn_norm.weight"), cfg.hidden)?,
                mlp: GatedMlp::load(f, i, cfg.ffn, Activation::Silu)?,
            });
        }
        let mats = layers
            .iter_mut()
            .flat_map(|l| l.attn.quantized_mut().chain(l.mlp.quantized_mut()));
        let ends = Ends::load(f, table, cfg.hidden, mats)?;
        f.ensure_all_taken(&cfg.arch)?;
        cfg.vocab_size = ends.vocab();
        let info = ModelInfo {
            name: name.to_string(),
            arch: cfg.arch.clone(),
            vocab_size: cfg.vocab_size,
            context_length: cfg.context_length,
            geometry: KvGeometry {
                layers: cfg.layers,
                k_heads: cfg.kv_heads,
                k_head_dim: cfg.head_dim,
                v_width: cfg.kv_heads * cfg.head_dim,
            },
            rope: LayerRopes::uniform(cfg.rope.clone(), cfg.layers),
        };
        Ok(Self {
            cfg,
            info,
            layers,
            ends,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// The forward pass ([`CausalLm::forward`], checked by the caller), or with `stop =
    /// (layer, cached)` [`CausalLm::kv_deviation`]: it ends at `layer`, before writing that
    /// layer's KV.
    ///
    /// Design decision: activations live in `Vec<f32>` buffers; each sequence's rows take
    /// the kernels its own size picks ([`crate::blocks::row_split`]), so that a sequence
    /// computes the same bits alone and batched; attention reads the pool's rows in place.
    fn run(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        stop: Option<(usize, &[u32])>,
    ) -> Result<Ran> {
        let pool = SpinPool::global();
        let c = &self.cfg;
        let batch = crate::model::FlatBatch::new(seqs);
        let (n, hid, eps) = (batch.tokens.len(), c.hidden, c.rms_eps as f32);
        let split = crate::blocks::row_split(seqs);
        let shape = Heads {
            heads: c.heads,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
        };
        let mut att = AttnPass::new(
            seqs,
            &batch.positions,
            shape,
            &self.info.rope,
            &[],
            pool.threads(),
        );
        let mut x = Vec::with_capacity(n * hid);
        self.ends.embed.gather(&batch.tokens, &mut x)?;
        let (mut xn, mut y) = (vec![0f32; n * hid], vec![0f32; n * hid]);
        let mut mlp = MlpScratch::default();
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, eps, &mut xn);
            att.project(&l.attn, &xn, &split)?;
            att.rope(li);
            if let Some((_, cached)) = stop.filter(|&(layer, _)| layer == li) {
                let (k, v) = att.kv_rows();
                return Ok(Ran::Deviation(crate::model::kv_distances(
                    kv, li, cached, &k, &v,
                )?));
            }
            att.store(kv, li, &batch.new_slots)?;
            att.attend(pool, kv, li, &l.attn, &split, &mut y)?;
            add_into(&mut x, &y);
            rms_norm(&x, &l.ffn_norm, eps, &mut xn);
            l.mlp.forward(&xn, &split, &mut mlp, &mut y)?;
            add_into(&mut x, &y);
        }
        self.ends.logits(&x, seqs, eps)
    }
}

/// `rope_freqs.weight`: `pairs` positive per-frequency divisors.
///
/// # Errors
/// Another length, unreadable data.
fn rope_freqs(f: &mut GgufFile, pairs: usize) -> Result<Arc<[f64]>> {
    let v = f.tensor_f32("rope_freqs.weight")?;
    if v.len() != pairs {
        return Err(ModelError::File {
            path: f.path().to_path_buf(),
            reason: format!(
                "rope_freqs.weight has {} values for {pairs} rotating pairs",
                v.len()
            ),
        });
    }
    Ok(v.iter().map(|&x| f64::from(x)).collect())
}

impl CausalLm for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&self, kv: &mut KvStorage, seqs: &[ForwardSeq<'_>]) -> Result<Vec<Vec<f32>>> {
        crate::model::check_batch(&self.info, kv, seqs)?;
        self.run(kv, seqs, None)?.logits()
    }

    fn kv_deviation(
        &self,
        kv: &mut KvStorage,
        seq: ForwardSeq<'_>,
        layer: usize,
        cached: &[u32],
    ) -> Result<Vec<f32>> {
        crate::model::kv_deviation_by(
            &self.info,
            kv,
            seq,
            layer,
            cached,
            Box::new(|kv, s, stop| self.run(kv, s, stop)),
        )
    }
}
