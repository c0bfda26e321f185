//! `qwen3` (Qwen3 and Qwen3-Coder, dense): Qwen2's pre-norm decoder without Q/K/V biases,
//! with an RMSNorm over each query and each key head before RoPE (one weight vector per
//! kind, shared by its heads). Heads may be wider than `hidden / heads` (`key_length`: 128
//! in Qwen3-0.6B's width of 1024 over 16 heads). NEOX rotary layout, as Qwen2's.

use crate::blocks::attention::Attention;
use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::blocks::norm::{add_into, load_norm, rms_norm};
use crate::blocks::output::{load_embedding, Ends};
use crate::blocks::Pass;
use crate::error::Result;
use crate::gguf::{ArchKeys, GgufFile};
use crate::hparams::{Hparams, SHARED_KEYS};
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Network, Ran};
use leyline_kernels::rope::{LayerRopes, RotaryLayout};
use leyline_kv::KvStorage;
use std::sync::Arc;

/// Loads a `qwen3` GGUF file (the entry of [`crate::arch::ARCHITECTURES`]).
///
/// # Errors
/// As [`Qwen3::load`].
pub fn load(f: &mut GgufFile, name: &str) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Qwen3::load(f, name)?))
}

/// One decoder layer's weights.
struct Layer {
    attn_norm: Vec<f32>,
    attn: Attention,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    mlp: GatedMlp,
}

/// A loaded Qwen3 dense model.
pub struct Qwen3 {
    hp: Hparams,
    info: ModelInfo,
    layers: Vec<Layer>,
    ends: Ends,
}

impl Qwen3 {
    /// Loads the weights of an opened `qwen3` GGUF file; every tensor and `qwen3.*` key of
    /// the file must be one it reads.
    ///
    /// # Errors
    /// Unsupported metadata, missing, unreadable or unread tensors or keys.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        let k = ArchKeys::new(f, "qwen3", &[SHARED_KEYS])?;
        let hp = Hparams::read(&k)?;
        let rope = hp.rope(&k, hp.rope_theta, RotaryLayout::Neox)?;
        let table = load_embedding(f, hp.hidden)?;
        let norm = |f: &mut GgufFile, i: usize, n: &str, w: usize| {
            load_norm(f, &format!("blk.{i}.{n}.weight"), w)
        };
        let mut layers = Vec::with_capacity(hp.layers);
        for i in 0..hp.layers {
            layers.push(Layer {
                attn_norm: norm(f, i, "attn_norm", hp.hidden)?,
                attn: Attention::load(f, i)?,
                q_norm: norm(f, i, "attn_q_norm", hp.head_dim)?,
                k_norm: norm(f, i, "attn_k_norm", hp.head_dim)?,
                ffn_norm: norm(f, i, "ffn_norm", hp.hidden)?,
                mlp: GatedMlp::load(f, i, hp.ffn, Activation::Silu)?,
            });
        }
        let mats = layers
            .iter_mut()
            .flat_map(|l| l.attn.quantized_mut().chain(l.mlp.quantized_mut()));
        let ends = Ends::load(f, table, hp.hidden, mats)?;
        f.ensure_all_taken("qwen3")?;
        let info = hp.info(
            name,
            "qwen3",
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

impl Network for Qwen3 {
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
            add_into(&mut p.x, &y);
            rms_norm(&p.x, &l.ffn_norm, eps, &mut xn);
            l.mlp.forward(&xn, &p.split, &mut mlp, &mut y)?;
            add_into(&mut p.x, &y);
        }
        self.ends.logits(&p.x, seqs, eps)
    }
}
