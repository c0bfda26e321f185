//! `qwen3` (Qwen3 and Qwen3-Coder, dense) and `qwen3moe` (Qwen3-30B-A3B,
//! Qwen3-Coder-30B-A3B): Qwen2's pre-norm decoder without Q/K/V biases, with an RMSNorm
//! over each query and each key head before RoPE (one weight vector per kind, shared by its
//! heads). Heads may be wider than `hidden / heads` (`key_length`: 128 in Qwen3-0.6B's
//! width of 1024 over 16 heads). NEOX rotary layout, as Qwen2's. The two differ in the
//! feed-forward block only: `qwen3moe` has routed experts in every layer, softmax routing
//! over `expert_count`, the top `expert_used_count` renormalized (the checkpoints'
//! `norm_topk_prob`, which llama.cpp assumes and the file does not state).

use crate::blocks::attention::Attention;
use crate::blocks::mlp::{Activation, GatedMlp, MlpScratch};
use crate::blocks::moe::{MoeScratch, RoutedExperts};
use crate::blocks::norm::{add_into, load_layer_norm, rms_norm};
use crate::blocks::output::{load_embedding, Ends};
use crate::blocks::Pass;
use crate::error::{ModelError, Result};
use crate::gguf::{ArchKeys, GgufFile};
use crate::hparams::{Hparams, SHARED_KEYS};
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Network, Ran};
use leyline_kernels::qmatmul::QMatrix;
use leyline_kernels::rope::{LayerRopes, RotaryLayout};
use leyline_kv::KvStorage;
use std::sync::Arc;

/// The `qwen3moe.*` keys read besides the shared ones.
const MOE_KEYS: &[&str] = &[
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
];

/// Loads a `qwen3` or `qwen3moe` GGUF file (the entry of [`crate::arch::ARCHITECTURES`]).
///
/// # Errors
/// As [`Qwen3::load`].
pub fn load(f: &mut GgufFile, name: &str) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(Qwen3::load(f, name)?))
}

/// A layer's feed-forward block.
enum Ffn {
    /// `qwen3`: the SiLU-gated MLP.
    Dense(GatedMlp),
    /// `qwen3moe`: routed experts.
    Experts(RoutedExperts),
}

impl Ffn {
    fn quantized_mut(&mut self) -> Box<dyn Iterator<Item = &mut QMatrix> + '_> {
        match self {
            Self::Dense(m) => Box::new(m.quantized_mut()),
            Self::Experts(e) => Box::new(e.quantized_mut()),
        }
    }
}

/// One decoder layer's weights.
struct Layer {
    attn_norm: Vec<f32>,
    attn: Attention,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

/// A loaded Qwen3 model, dense or mixture of experts.
pub struct Qwen3 {
    hp: Hparams,
    info: ModelInfo,
    layers: Vec<Layer>,
    ends: Ends,
}

impl Qwen3 {
    /// Loads the weights of an opened `qwen3` or `qwen3moe` GGUF file; every tensor and
    /// `{arch}.*` key of the file must be one it reads.
    ///
    /// # Errors
    /// Another architecture, unsupported metadata, missing, unreadable or unread tensors or
    /// keys.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        let arch = f.get_str("general.architecture")?.to_string();
        let moe = match arch.as_str() {
            "qwen3" => false,
            "qwen3moe" => true,
            other => {
                return Err(ModelError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!("{other:?} is not a Qwen3 architecture"),
                })
            }
        };
        let keys: &[&[&str]] = if moe {
            &[SHARED_KEYS, MOE_KEYS]
        } else {
            &[SHARED_KEYS]
        };
        let k = ArchKeys::new(f, &arch, keys)?;
        let hp = Hparams::read(&k)?;
        let rope = hp.rope(&k, hp.rope_theta, RotaryLayout::Neox)?;
        let experts = match moe {
            true => Some((
                k.usize("expert_count")?,
                k.usize("expert_feed_forward_length")?,
                k.usize("expert_used_count")?,
            )),
            false => None,
        };
        let table = load_embedding(f, hp.hidden)?;
        let mut layers = Vec::with_capacity(hp.layers);
        for i in 0..hp.layers {
            layers.push(Layer {
                attn_norm: load_layer_norm(f, i, "attn_norm", hp.hidden)?,
                attn: Attention::load(f, i)?,
                q_norm: load_layer_norm(f, i, "attn_q_norm", hp.head_dim)?,
                k_norm: load_layer_norm(f, i, "attn_k_norm", hp.head_dim)?,
                ffn_norm: load_layer_norm(f, i, "ffn_norm", hp.hidden)?,
                ffn: match experts {
                    Some(e) => Ffn::Experts(RoutedExperts::load(f, i, e, true)?),
                    None => Ffn::Dense(GatedMlp::load(f, i, hp.ffn, Activation::Silu)?),
                },
            });
        }
        let mats = layers
            .iter_mut()
            .flat_map(|l| l.attn.quantized_mut().chain(l.ffn.quantized_mut()));
        let ends = Ends::load(f, table, hp.hidden, mats)?;
        f.ensure_all_taken(&arch)?;
        let info = hp.info(
            name,
            &arch,
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
        let (mut mlp, mut moe) = (MlpScratch::default(), MoeScratch::default());
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
            match &l.ffn {
                Ffn::Dense(m) => m.forward(&xn, &p.split, &mut mlp, &mut y)?,
                Ffn::Experts(e) => e.forward(&xn, &mut moe, &mut y)?,
            }
            add_into(&mut p.x, &y);
        }
        self.ends.logits(&p.x, seqs, eps)
    }
}
