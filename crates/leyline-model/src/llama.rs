//! The llama family (Llama, SmolLM, Qwen2) over Leyline's slot pool.
//!
//! GGUF llama files store Q/K rows permuted so that RoPE rotates adjacent pairs; Qwen2 GGUF
//! files keep the halves layout. Either way the model writes post-RoPE keys into the pool
//! in the layout of its weights, and the [`RopeSpec`] it reports says which layout that is,
//! so a later shift rotates the same pairs.

mod attend;
mod forward;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::linear::{Embedding, FusedLinear, Linear};
use crate::{CausalLm, ForwardSeq, ModelInfo};
use candle_core::{Device, Tensor};
use leyline_kernels::qmatmul::QMatrix;
use leyline_kernels::rope::{LayerRopes, RopeScaling, RopeSpec, RotaryLayout};
use leyline_kv::{KvGeometry, KvStorage};

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
    /// Rotary embedding.
    pub rope: RopeSpec,
}

impl LlamaConfig {
    /// Reads the hyper-parameters of a `llama` or `qwen2` GGUF file.
    ///
    /// # Errors
    /// [`ModelError::Unsupported`] for other architectures or rope scalings that Leyline
    /// cannot shift; [`ModelError::File`] for missing metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch = f.get_str("general.architecture")?.to_string();
        let layout = match arch.as_str() {
            "llama" => RotaryLayout::Interleaved,
            "qwen2" => RotaryLayout::Neox,
            other => {
                return Err(ModelError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!(
                        "architecture {other:?} is not supported (supported: llama, qwen2)"
                    ),
                })
            }
        };
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = f.get_usize(&k("embedding_length"))?;
        let heads = f.get_usize(&k("attention.head_count"))?;
        let kv_heads = f.opt_usize(&k("attention.head_count_kv"))?.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 || hidden % heads != 0 {
            return Err(ModelError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!(
                    "{heads} heads, {kv_heads} kv heads and width {hidden} do not divide"
                ),
            });
        }
        let head_dim = f
            .opt_usize(&k("attention.key_length"))?
            .unwrap_or(hidden / heads);
        let rotary_dim = f.opt_usize(&k("rope.dimension_count"))?.unwrap_or(head_dim);
        let theta = f.opt_f64(&k("rope.freq_base"))?.unwrap_or(10_000.0);
        let scaling = match f.get_str(&k("rope.scaling.type")).ok() {
            None | Some("none") => RopeScaling::None,
            Some("linear") => RopeScaling::Linear {
                factor: f.opt_f64(&k("rope.scaling.factor"))?.unwrap_or(1.0),
            },
            Some(other) => {
                return Err(ModelError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!("rope scaling {other:?} is not supported for GGUF models yet"),
                })
            }
        };
        let vocab_size = match f.opt_usize(&k("vocab_size"))? {
            Some(v) => v,
            None => match f.metadata().get("tokenizer.ggml.tokens") {
                Some(v) => v.to_vec().map(Vec::len).unwrap_or(0),
                None => 0,
            },
        };
        Ok(Self {
            vocab_size,
            hidden,
            layers: f.get_usize(&k("block_count"))?,
            heads,
            kv_heads,
            head_dim,
            ffn: f.get_usize(&k("feed_forward_length"))?,
            rms_eps: f
                .opt_f64(&k("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            context_length: f.opt_usize(&k("context_length"))?.unwrap_or(2048),
            rope: RopeSpec {
                theta,
                head_dim,
                rotary_dim,
                layout,
                scaling,
                freq_factors: None,
            },
            arch,
        })
    }
}

struct Block {
    attn_norm_vals: Vec<f32>,
    ffn_norm_vals: Vec<f32>,
    /// Q, K, V.
    qkv: FusedLinear,
    o: Linear,
    /// Gate, up.
    gate_up: FusedLinear,
    down: Linear,
}

/// A loaded llama-family model.
pub struct Llama {
    cfg: LlamaConfig,
    info: ModelInfo,
    embed: Embedding,
    blocks: Vec<Block>,
    norm_vals: Vec<f32>,
    lm_head: Linear,
    inv_freq: Vec<f64>,
}

impl Llama {
    /// Loads the weights of an opened GGUF file.
    ///
    /// # Errors
    /// Unsupported architecture, missing or unreadable tensors.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(f)?;
        let table = Embedding::from_qtensor(&f.tensor("token_embd.weight")?)?;
        let (vocab, hidden) = table.dims();
        if hidden != cfg.hidden {
            return Err(ModelError::File {
                path: f.path().to_path_buf(),
                reason: format!(
                    "token_embd has width {hidden}, metadata says {}",
                    cfg.hidden
                ),
            });
        }
        let mut blocks = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let mut lin = |n: &str| Linear::load(f, &format!("blk.{i}.{n}"));
            let qkv = FusedLinear::new(vec![lin("attn_q")?, lin("attn_k")?, lin("attn_v")?])?;
            let o = lin("attn_output")?;
            let gate_up = FusedLinear::new(vec![lin("ffn_gate")?, lin("ffn_up")?])?;
            let down = lin("ffn_down")?;
            let attn_norm = f
                .tensor(&format!("blk.{i}.attn_norm.weight"))?
                .dequantize(&Device::Cpu)?;
            let ffn_norm = f
                .tensor(&format!("blk.{i}.ffn_norm.weight"))?
                .dequantize(&Device::Cpu)?;
            blocks.push(Block {
                attn_norm_vals: to_rows(&attn_norm)?,
                ffn_norm_vals: to_rows(&ffn_norm)?,
                qkv,
                o,
                gate_up,
                down,
            });
        }
        let norm = f.tensor("output_norm.weight")?.dequantize(&Device::Cpu)?;
        // A tied head over a quantized table takes the table's matrix; the table takes it
        // back, shared, once the pages are placed below.
        let (mut lm_head, embed) = if f.has_tensor("output.weight") {
            (Linear::load(f, "output")?, Some(table))
        } else {
            match table {
                Embedding::F32(t) => (Linear::tied(&t)?, Some(Embedding::F32(t))),
                Embedding::Quant(q) => (Linear::from_qmatrix(q, None)?, None),
            }
        };
        QMatrix::share_pages(
            blocks
                .iter_mut()
                .flat_map(|b| {
                    let Block {
                        qkv,
                        o,
                        gate_up,
                        down,
                        ..
                    } = b;
                    qkv.quantized_mut()
                        .chain(o.quantized_mut())
                        .chain(gate_up.quantized_mut())
                        .chain(down.quantized_mut())
                })
                .chain(lm_head.quantized_mut()),
        );
        let embed =
            match embed {
                Some(e) => e,
                None => Embedding::Quant(lm_head.quantized().cloned().ok_or_else(|| {
                    ModelError::Input("a tied head lost its quantized table".into())
                })?),
            };
        let cfg = LlamaConfig {
            vocab_size: vocab,
            ..cfg
        };
        let info = ModelInfo {
            name: name.to_string(),
            arch: cfg.arch.clone(),
            vocab_size: vocab,
            context_length: cfg.context_length,
            geometry: KvGeometry {
                layers: cfg.layers,
                k_heads: cfg.kv_heads,
                k_head_dim: cfg.head_dim,
                v_width: cfg.kv_heads * cfg.head_dim,
            },
            rope: LayerRopes::uniform(cfg.rope.clone(), cfg.layers),
        };
        let inv_freq = cfg.rope.inv_freq();
        Ok(Self {
            cfg,
            info,
            embed,
            blocks,
            norm_vals: to_rows(&norm)?,
            lm_head,
            inv_freq,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// cos/sin of every new token's position, `[tokens, rotary_dim / 2]` each.
    fn rope_tables(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for f in &self.inv_freq {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(c as f32);
                sin.push(s as f32);
            }
        }
        (cos, sin)
    }

    /// Rotates the first `heads` heads of each `stride`-wide row of `x` (row `t` at position
    /// `t` of the tables).
    fn apply_rope(&self, x: &mut [f32], stride: usize, heads: usize, cos: &[f32], sin: &[f32]) {
        let hd = self.cfg.head_dim;
        let half = self.inv_freq.len();
        for (t, xr) in x.chunks_exact_mut(stride).enumerate() {
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            for h in xr[..heads * hd].chunks_exact_mut(hd) {
                match self.cfg.rope.layout {
                    RotaryLayout::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (h[2 * i], h[2 * i + 1]);
                            h[2 * i] = a * c[i] - b * s[i];
                            h[2 * i + 1] = a * s[i] + b * c[i];
                        }
                    }
                    RotaryLayout::Neox => {
                        for i in 0..half {
                            let (a, b) = (h[i], h[i + half]);
                            h[i] = a * c[i] - b * s[i];
                            h[i + half] = a * s[i] + b * c[i];
                        }
                    }
                }
            }
        }
    }
}

fn to_rows(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

impl CausalLm for Llama {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(&self, kv: &mut KvStorage, seqs: &[ForwardSeq<'_>]) -> Result<Vec<Vec<f32>>> {
        crate::check_batch(&self.info, kv, seqs)?;
        self.forward_buffers(kv, seqs, None)?.logits()
    }

    fn kv_deviation(
        &self,
        kv: &mut KvStorage,
        seq: ForwardSeq<'_>,
        layer: usize,
        cached: &[u32],
    ) -> Result<Vec<f32>> {
        crate::kv_deviation_by(
            &self.info,
            kv,
            seq,
            layer,
            cached,
            Box::new(|kv, s, stop| self.forward_buffers(kv, s, stop)),
        )
    }
}
