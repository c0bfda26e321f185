//! `olmo2` (OLMo 2): a llama-like decoder whose norms come after each sub-layer, not before
//! it: the attention's and the MLP's outputs are RMS-normalized before their residual adds,
//! and their inputs are the raw residual stream. Its Q/K norms span the whole projection
//! (one RMS over all query heads together, another over all key heads), not each head.
//! NEOX rotary layout.

use crate::blocks::attention::Attention;
use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::blocks::norm::{add_into, load_layer_norm, rms_norm};
use crate::blocks::output::{load_embedding, Ends};
use crate::blocks::Pass;
use crate::error::Result;
use crate::gguf::{ArchKeys, GgufFile};
use crate::hparams::{Hparams, SHARED_KEYS};
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Network, Ran};
use leyline_kernels::rope::{LayerRopes, RotaryLayout};
use leyline_kv::KvStorage;
use std::sync::Arc;

/// Loads an `olmo2` GGUF file (the entry of [`crate::arch::ARCHITECTURES`]).
///
/// # Errors
/// As [`Olmo2::load`].
pub fn load(f: &mut GgufFile, name: &str) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Olmo2::load(f, name)?))
}

/// One decoder layer's weights.
struct Layer {
    attn: Attention,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    mlp: GatedMlp,
    post_ffn_norm: Vec<f32>,
}

/// A loaded OLMo 2 model.
pub struct Olmo2 {
    hp: Hparams,
    info: ModelInfo,
    layers: Vec<Layer>,
    ends: Ends,
}

impl Olmo2 {
    /// Loads the weights of an opened `olmo2` GGUF file; every tensor and `olmo2.*` key of
    /// the file must be one it reads.
    ///
    /// # Errors
    /// Unsupported metadata, missing, unreadable or unread tensors or keys.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        let k = ArchKeys::new(f, "olmo2", &[SHARED_KEYS])?;
        let hp = Hparams::read(&k)?;
        let rope = hp.rope(&k, hp.rope_theta, RotaryLayout::Neox)?;
        let table = load_embedding(f, hp.hidden)?;
        let mut layers = Vec::with_capacity(hp.layers);
        for i in 0..hp.layers {
            layers.push(Layer {
                attn: Attention::load(f, i)?,
                q_norm: load_layer_norm(f, i, "attn_q_norm", hp.heads * hp.head_dim)?,
                k_norm: load_layer_norm(f, i, "attn_k_norm", hp.kv_heads * hp.head_dim)?,
                post_attn_norm: load_layer_norm(f, i, "post_attention_norm", hp.hidden)?,
                mlp: GatedMlp::load(f, i, hp.ffn, Activation::Silu)?,
                post_ffn_norm: load_layer_norm(f, i, "post_ffw_norm", hp.hidden)?,
            });
        }
        let mats = layers
            .iter_mut()
            .flat_map(|l| l.attn.quantized_mut().chain(l.mlp.quantized_mut()));
        let ends = Ends::load(f, table, hp.hidden, mats)?;
        f.ensure_all_taken("olmo2")?;
        let info = hp.info(
            name,
            "olmo2",
            ends.vocab(),
            LayerRopes::uniform(rope, hp.layers),
        );
        Ok(Self {
            hp,
            info,
            layers,
            ends,
        })
    }
}

impl Network for Olmo2 {
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
        let mut p = Pass::new(seqs, hp, &self.info.rope, &[], &self.ends.embed)?;
        let (n, hid, eps) = (p.rows(), hp.hidden, hp.rms_eps as f32);
        let (mut yn, mut y) = (vec![0f32; n * hid], vec![0f32; n * hid]);
        let mut mlp = MlpScratch::default();
        for (li, l) in self.layers.iter().enumerate() {
            p.att.project(&l.attn, &p.x, &p.split)?;
            p.att.norm_q_k(&l.q_norm, &l.k_norm, eps)?;
            p.att.rope(li);
            if let Some(d) = p.att.deviation(kv, li, stop)? {
                return Ok(d);
            }
            p.att.store(kv, li, &p.batch.new_slots)?;
            p.att.attend(p.pool, kv, li, &l.attn, &p.split, &mut y)?;
            rms_norm(&y, &l.post_attn_norm, eps, &mut yn);
            add_into(&mut p.x, &yn);
            l.mlp.forward(&p.x, &p.split, &mut mlp, &mut y)?;
            rms_norm(&y, &l.post_ffn_norm, eps, &mut yn);
            add_into(&mut p.x, &yn);
        }
        self.ends.logits(&p.x, seqs, eps)
    }
}
