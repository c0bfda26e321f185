//! `llama` (Llama 1-3, SmolLM) and `qwen2` (Qwen2, Qwen2.5): pre-norm decoder layers of GQA
//! attention and a SiLU-gated MLP. Qwen2 differs by its Q/K/V biases (optional tensors
//! here) and its rotary layout: GGUF llama files store Q/K rows permuted so that RoPE
//! rotates adjacent pairs, Qwen2 files keep the halves. Either way the model writes
//! post-RoPE keys into the pool in the layout of its weights, and the [`RopeSpec`] it
//! reports says which, so a later shift rotates the same pairs. Llama 3's frequency
//! scaling arrives as `rope_freqs.weight` (per-frequency divisors, as llama.cpp applies
//! them) and `rope.scaling.type` `linear` as a factor on every frequency.

use crate::blocks::attention::Attention;
use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::blocks::norm::{add_into, load_layer_norm, rms_norm};
use crate::blocks::output::{load_embedding, Ends};
use crate::blocks::Pass;
use crate::error::{ModelError, Result};
use crate::gguf::{ArchKeys, GgufFile};
use crate::hparams::{Hparams, SHARED_KEYS};
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Network, Ran};
use leyline_kernels::rope::{LayerRopes, RopeSpec, RotaryLayout};
use leyline_kv::KvStorage;
use std::sync::Arc;

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
    /// The shared hyper-parameters.
    pub hp: Hparams,
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
        let layout = match arch {
            "llama" => RotaryLayout::Interleaved,
            "qwen2" => RotaryLayout::Neox,
            other => {
                return Err(ModelError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!("{other:?} is not a llama-family architecture"),
                })
            }
        };
        let k = ArchKeys::new(f, arch, &[SHARED_KEYS])?;
        let hp = Hparams::read(&k)?;
        let rope = hp.rope(&k, hp.rope_theta, layout)?;
        Ok(Self {
            arch: arch.to_string(),
            hp,
            rope,
        })
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
        let table = load_embedding(f, cfg.hp.hidden)?;
        let mut layers = Vec::with_capacity(cfg.hp.layers);
        for i in 0..cfg.hp.layers {
            layers.push(Layer {
                attn_norm: load_layer_norm(f, i, "attn_norm", cfg.hp.hidden)?,
                attn: Attention::load(f, i)?,
                ffn_norm: load_layer_norm(f, i, "ffn_norm", cfg.hp.hidden)?,
                mlp: GatedMlp::load(f, i, cfg.hp.ffn, Activation::Silu)?,
            });
        }
        let mats = layers
            .iter_mut()
            .flat_map(|l| l.attn.quantized_mut().chain(l.mlp.quantized_mut()));
        let ends = Ends::load(f, table, cfg.hp.hidden, mats)?;
        f.ensure_all_taken(&cfg.arch)?;
        cfg.hp.vocab_size = ends.vocab();
        let rope = LayerRopes::uniform(cfg.rope.clone(), cfg.hp.layers);
        let info = cfg.hp.info(name, &cfg.arch, cfg.hp.vocab_size, rope);
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

impl Network for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Design decision: activations live in `Vec<f32>` buffers; on 8-bit activations (the
    /// default) every product computes each row's bits whatever the batch, so a sequence
    /// computes the same bits alone and batched; attention reads the pool's rows in place.
    fn run(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        stop: Option<(usize, &[u32])>,
    ) -> Result<Ran> {
        let hp = &self.cfg.hp;
        let mut p = Pass::new(seqs, hp, &self.info.rope, &[], &self.ends.embed)?;
        let (n, hid, eps) = (p.rows(), hp.hidden, hp.rms_eps as f32);
        let (mut xn, mut y) = (vec![0f32; n * hid], vec![0f32; n * hid]);
        let mut mlp = MlpScratch::default();
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&p.x, &l.attn_norm, eps, &mut xn);
            p.att.project(&l.attn, &xn, &p.split)?;
            p.att.rope(li);
            if let Some(d) = p.att.deviation(kv, li, stop)? {
                return Ok(d);
            }
            p.att.store(kv, li, &p.batch.new_slots)?;
            p.att.attend(p.pool, kv, li, &l.attn, &p.split, &mut y)?;
            add_into(&mut p.x, &y);
            rms_norm(&p.x, &l.ffn_norm, eps, &mut xn);
            l.mlp.forward(&xn, &p.split, &mut mlp, &mut y)?;
            add_into(&mut p.x, &y);
        }
        self.ends.logits(&p.x, seqs, eps)
    }
}
