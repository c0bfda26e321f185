//! `gemma3` (Gemma 3 text models, 270M to 27B): local sliding-window layers interleaved with
//! global ones (every sixth layer global, as llama.cpp assumes: the file has no key for the
//! pattern), each kind with its own RoPE base (`rope.freq_base` global, `rope.freq_base_swa`
//! local, 10000 when absent), per-head Q/K RMSNorms, norms before and after both attention
//! and the GELU-tanh MLP, and the embedding scaled by `sqrt(hidden)`. The files store the
//! norms' weights as `1 + w` already; the head is tied to the embedding. Queries are scaled
//! by `1/sqrt(head_dim)` (Gemma 3's `query_pre_attn_scalar` equals head_dim for every size
//! llama.cpp runs but 27B; this file refuses nothing on that account, as no key says).
//!
//! Sliding layers keep every key in the pool (a splice may need them), and their queries
//! see the last `attention.sliding_window` positions of their context, counted in the
//! positions the context has now: after a splice the window follows the new positions.

use crate::blocks::attention::Attention;
use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::blocks::norm::{add_into, load_layer_norm, rms_norm};
use crate::blocks::output::{load_embedding, Ends};
use crate::blocks::Pass;
use crate::error::{ModelError, Result};
use crate::gguf::{ArchKeys, GgufFile};
use crate::hparams::{Hparams, SHARED_KEYS};
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Network, Ran};
use leyline_kernels::rope::{LayerRopes, RotaryLayout};
use leyline_kv::KvStorage;
use std::num::NonZeroUsize;
use std::sync::Arc;

/// The `gemma3.*` keys read besides the shared ones.
const KEYS: &[&str] = &["attention.sliding_window", "rope.freq_base_swa"];

/// Every `SWA_PATTERN`-th layer (the last of each group) is global.
const SWA_PATTERN: usize = 6;

/// Loads a `gemma3` GGUF file (the entry of [`crate::arch::ARCHITECTURES`]).
///
/// # Errors
/// As [`Gemma3::load`].
pub fn load(f: &mut GgufFile, name: &str) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Gemma3::load(f, name)?))
}

/// One decoder layer's weights.
struct Layer {
    attn_norm: Vec<f32>,
    attn: Attention,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    mlp: GatedMlp,
    post_ffn_norm: Vec<f32>,
}

/// A loaded Gemma 3 model.
pub struct Gemma3 {
    hp: Hparams,
    info: ModelInfo,
    /// Per layer: the window of a local layer, `None` for a global one.
    windows: Vec<Option<NonZeroUsize>>,
    layers: Vec<Layer>,
    ends: Ends,
}

impl Gemma3 {
    /// Loads the weights of an opened `gemma3` GGUF file; every tensor and `gemma3.*` key of
    /// the file must be one it reads.
    ///
    /// # Errors
    /// Unsupported metadata, missing, unreadable or unread tensors or keys.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        let k = ArchKeys::new(f, "gemma3", &[SHARED_KEYS, KEYS])?;
        let hp = Hparams::read(&k)?;
        let window = NonZeroUsize::new(k.usize("attention.sliding_window")?).ok_or_else(|| {
            ModelError::Unsupported {
                path: f.path().to_path_buf(),
                reason: "gemma3.attention.sliding_window is 0".into(),
            }
        })?;
        let global = hp.rope(&k, hp.rope_theta, RotaryLayout::Neox)?;
        let local_theta = k.opt_f64("rope.freq_base_swa")?.unwrap_or(10_000.0);
        let local = hp.rope(&k, local_theta, RotaryLayout::Neox)?;
        let is_local = |i: usize| i % SWA_PATTERN < SWA_PATTERN - 1;
        let windows: Vec<Option<NonZeroUsize>> = (0..hp.layers)
            .map(|i| is_local(i).then_some(window))
            .collect();
        let of_layer = (0..hp.layers).map(|i| usize::from(is_local(i))).collect();
        let rope = LayerRopes::new(vec![global, local], of_layer).map_err(|e| {
            ModelError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!("rope: {e}"),
            }
        })?;
        let table = load_embedding(f, hp.hidden)?;
        let mut layers = Vec::with_capacity(hp.layers);
        for i in 0..hp.layers {
            layers.push(Layer {
                attn_norm: load_layer_norm(f, i, "attn_norm", hp.hidden)?,
                attn: Attention::load(f, i)?,
                q_norm: load_layer_norm(f, i, "attn_q_norm", hp.head_dim)?,
                k_norm: load_layer_norm(f, i, "attn_k_norm", hp.head_dim)?,
                post_attn_norm: load_layer_norm(f, i, "post_attention_norm", hp.hidden)?,
                ffn_norm: load_layer_norm(f, i, "ffn_norm", hp.hidden)?,
                mlp: GatedMlp::load(f, i, hp.ffn, Activation::GeluTanh)?,
                post_ffn_norm: load_layer_norm(f, i, "post_ffw_norm", hp.hidden)?,
            });
        }
        let mats = layers
            .iter_mut()
            .flat_map(|l| l.attn.quantized_mut().chain(l.mlp.quantized_mut()));
        let ends = Ends::load(f, table, hp.hidden, mats)?;
        f.ensure_all_taken("gemma3")?;
        let info = hp.info(name, "gemma3", ends.vocab(), rope);
        Ok(Self {
            hp,
            info,
            windows,
            layers,
            ends,
        })
    }
}

impl Network for Gemma3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn run(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        stop: Option<(usize, &[u32])>,
    ) -> Result<Ran> {
        let hp = &self.hp;
        let mut p = Pass::new(seqs, hp, &self.info.rope, &self.windows, &self.ends.embed)?;
        let (n, hid, eps) = (p.rows(), hp.hidden, hp.rms_eps as f32);
        let scale = (hid as f32).sqrt();
        p.x.iter_mut().for_each(|v| *v *= scale);
        let (mut xn, mut y) = (vec![0f32; n * hid], vec![0f32; n * hid]);
        let mut mlp = MlpScratch::default();
        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&p.x, &l.attn_norm, eps, &mut xn);
            p.att.project(&l.attn, &xn, &p.split)?;
            p.att.norm_q_k(&l.q_norm, &l.k_norm, eps)?;
            p.att.rope(li);
            if let Some(d) = p.att.deviation(kv, li, stop)? {
                return Ok(d);
            }
            p.att.store(kv, li, &p.batch.new_slots)?;
            p.att.attend(p.pool, kv, li, &l.attn, &p.split, &mut y)?;
            rms_norm(&y, &l.post_attn_norm, eps, &mut xn);
            add_into(&mut p.x, &xn);
            rms_norm(&p.x, &l.ffn_norm, eps, &mut xn);
            l.mlp.forward(&xn, &p.split, &mut mlp, &mut y)?;
            rms_norm(&y, &l.post_ffn_norm, eps, &mut xn);
            add_into(&mut p.x, &xn);
        }
        self.ends.logits(&p.x, seqs, eps)
    }
}
