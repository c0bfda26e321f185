//! The DeepSeek-V2 family (multi-head latent attention, DeepSeekMoE) over Leyline's slot pool.
//!
//! Design decision: the pool holds MLA's *compressed* cache, one slot per token per layer:
//! the key-part row is the post-RoPE `k_pe` (one shared rotary "head" of `qk_rope_head_dim`,
//! interleaved pairs, YaRN frequencies) and the value-part row is the normalized latent `c_kv`.
//! A splice therefore rotates `qk_rope_head_dim` numbers per token and layer and never
//! touches the latent. Attention decompresses the gathered latents with `kv_b_proj` into
//! per-head `k_nope` and `v` on every call (no weight absorption).

mod config;

pub use config::{DeepseekV2Config, MoeConfig};

use crate::blocks::moe::{Mlp, Moe};
use crate::checkpoint::Weights;
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::model::{CausalLm, ForwardSeq, ModelInfo, Network, Ran};
use candle_core::{DType, Device, Tensor};
use candle_nn::ops::{rms_norm, softmax_last_dim};
use leyline_kernels::rope::{LayerRopes, Rotation};
use leyline_kv::{KvGeometry, KvStorage};
use std::path::Path;
use std::sync::Arc;

/// Loads a DeepSeek-V2-family checkpoint directory (`config.json` + safetensors) as a
/// [`CausalLm`].
///
/// # Errors
/// As [`DeepseekV2::load_dir`].
pub fn load_dir(dir: &Path) -> Result<Arc<dyn CausalLm>> {
    Ok(Arc::new(DeepseekV2::load_dir(dir)?))
}

/// [`read_config`] for the architecture table: the config checked, nothing kept.
///
/// # Errors
/// As [`read_config`].
pub fn check_config(dir: &Path) -> Result<()> {
    read_config(dir).map(drop)
}

/// Reads and checks `dir/config.json` without touching the weights, so a directory that is
/// not a checkpoint Leyline can run fails fast.
///
/// # Errors
/// [`ModelError::File`] naming `dir` when it is not a directory or holds no `config.json`,
/// naming `config.json` when it cannot be read or parsed; [`ModelError::Unsupported`] as
/// [`DeepseekV2Config::from_json`].
pub fn read_config(dir: &Path) -> Result<DeepseekV2Config> {
    if !dir.is_dir() {
        return Err(ModelError::File {
            path: dir.to_path_buf(),
            reason: "not a directory (a checkpoint directory holds config.json and safetensors)"
                .into(),
        });
    }
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        return Err(ModelError::File {
            path: dir.to_path_buf(),
            reason: "no config.json: not a DeepSeek-V2 checkpoint directory (config.json + \
                     safetensors)"
                .into(),
        });
    }
    let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::File {
        path: cfg_path.clone(),
        reason: e.to_string(),
    })?;
    DeepseekV2Config::from_json(&text, &cfg_path)
}

enum QProj {
    Full(Linear),
    Lora { a: Linear, norm: Tensor, b: Linear },
}

struct Attn {
    q: QProj,
    kv_a: Linear,
    kv_a_norm: Tensor,
    kv_b: Linear,
    o: Linear,
}

enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

struct Block {
    in_norm: Tensor,
    attn: Attn,
    post_norm: Tensor,
    ffn: Ffn,
}

/// A loaded DeepSeek-V2-family model (weights held as f32).
pub struct DeepseekV2 {
    cfg: DeepseekV2Config,
    info: ModelInfo,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: Linear,
    /// The magnitude a forward pass bakes into its cos/sin (HF `attention_scaling`).
    rope_gain: f32,
}

impl DeepseekV2 {
    /// Loads `config.json` and the safetensors weights of `dir`. Weights of any float dtype
    /// are converted to f32.
    ///
    /// # Errors
    /// [`ModelError::File`] for a missing or malformed config or tensor (with its expected
    /// shape), [`ModelError::Unsupported`] for a config Leyline cannot run.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let cfg = read_config(dir)?;
        let mut w = Weights::load_dir(dir)?;
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|s| s.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "deepseek_v2".into());
        Self::from_weights(cfg, &mut w, &name)
    }

    fn from_weights(cfg: DeepseekV2Config, w: &mut Weights, name: &str) -> Result<Self> {
        let (hd, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let (r, dr, qk) = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim());
        let embed = w.take("model.embed_tokens.weight", &[cfg.vocab_size, hd])?;
        let lin = |w: &mut Weights, n: &str, shape: &[usize]| -> Result<Linear> {
            Linear::from_f32(w.take(&format!("{n}.weight"), shape)?, None)
        };
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let a = format!("{p}.self_attn");
            let q = match cfg.q_lora_rank {
                None => QProj::Full(lin(w, &format!("{a}.q_proj"), &[heads * qk, hd])?),
                Some(qr) => QProj::Lora {
                    a: lin(w, &format!("{a}.q_a_proj"), &[qr, hd])?,
                    norm: w.take(&format!("{a}.q_a_layernorm.weight"), &[qr])?,
                    b: lin(w, &format!("{a}.q_b_proj"), &[heads * qk, qr])?,
                },
            };
            let attn = Attn {
                q,
                kv_a: lin(w, &format!("{a}.kv_a_proj_with_mqa"), &[r + dr, hd])?,
                kv_a_norm: w.take(&format!("{a}.kv_a_layernorm.weight"), &[r])?,
                kv_b: lin(
                    w,
                    &format!("{a}.kv_b_proj"),
                    &[heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), r],
                )?,
                o: lin(w, &format!("{a}.o_proj"), &[hd, heads * cfg.v_head_dim])?,
            };
            let ffn = match (&cfg.moe, cfg.is_moe_layer(i)) {
                (Some(m), true) => {
                    let experts = Mlp::load_experts(
                        w,
                        &p,
                        hd,
                        (m.n_routed_experts, m.moe_intermediate_size),
                    )?;
                    let shared = if m.n_shared_experts > 0 {
                        let inter = m.moe_intermediate_size * m.n_shared_experts;
                        Some(Mlp::load(w, &format!("{p}.mlp.shared_experts"), hd, inter)?)
                    } else {
                        None
                    };
                    Ffn::Moe(Moe {
                        router: w
                            .take(&format!("{p}.mlp.gate.weight"), &[m.n_routed_experts, hd])?,
                        experts,
                        shared,
                        top_k: m.num_experts_per_tok,
                        norm_topk: false,
                        scale: m.routed_scaling_factor,
                    })
                }
                _ => Ffn::Dense(Mlp::load(
                    w,
                    &format!("{p}.mlp"),
                    hd,
                    cfg.intermediate_size,
                )?),
            };
            blocks.push(Block {
                in_norm: w.take(&format!("{p}.input_layernorm.weight"), &[hd])?,
                attn,
                post_norm: w.take(&format!("{p}.post_attention_layernorm.weight"), &[hd])?,
                ffn,
            });
        }
        let norm = w.take("model.norm.weight", &[hd])?;
        let lm_head = if cfg.tie_word_embeddings && !w.has("lm_head.weight") {
            Linear::tied(&embed)?
        } else {
            lin(w, "lm_head", &[cfg.vocab_size, hd])?
        };
        w.ensure_all_taken("deepseek_v2")?;
        let info = ModelInfo {
            name: name.to_string(),
            arch: "deepseek_v2".into(),
            vocab_size: cfg.vocab_size,
            context_length: cfg.max_position_embeddings,
            geometry: KvGeometry {
                layers: cfg.num_hidden_layers,
                k_heads: 1,
                k_head_dim: dr,
                v_width: r,
            },
            rope: LayerRopes::uniform(cfg.rope.clone(), cfg.num_hidden_layers),
        };
        let rope_gain = cfg.rope.attention_factor() as f32;
        Ok(Self {
            cfg,
            info,
            embed,
            blocks,
            norm,
            lm_head,
            rope_gain,
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &DeepseekV2Config {
        &self.cfg
    }

    /// Per new token, the forward rotation: unit cos/sin times the YaRN attention factor.
    fn rotations(&self, positions: &[u32]) -> Vec<Rotation> {
        positions
            .iter()
            .map(|&p| {
                let mut r = Rotation::new(&self.cfg.rope, i64::from(p));
                if self.rope_gain != 1.0 {
                    r.cos
                        .iter_mut()
                        .chain(r.sin.iter_mut())
                        .for_each(|x| *x *= self.rope_gain);
                }
                r
            })
            .collect()
    }

    /// Queries `[n, heads * qk_head_dim]` with each head's rope slice rotated.
    fn queries(&self, a: &Attn, xn: &Tensor, rot: &[Rotation]) -> Result<Vec<f32>> {
        let q = match &a.q {
            QProj::Full(l) => l.forward(xn)?,
            QProj::Lora { a, norm, b } => b.forward(&rms_norm(
                &a.forward(xn)?,
                norm,
                self.cfg.rms_norm_eps as f32,
            )?)?,
        };
        let mut q = q.flatten_all()?.to_vec1::<f32>()?;
        let (qk, dn) = (self.cfg.qk_head_dim(), self.cfg.qk_nope_head_dim);
        let row = self.cfg.num_attention_heads * qk;
        for (r, qr) in rot.iter().zip(q.chunks_exact_mut(row)) {
            for h in qr.chunks_exact_mut(qk) {
                r.apply_f32(&mut h[dn..]);
            }
        }
        Ok(q)
    }

    /// Computes the new tokens' post-RoPE `k_pe` and normed latent: what the pool holds as
    /// their key and value rows.
    fn cache_rows(&self, a: &Attn, xn: &Tensor, rot: &[Rotation]) -> Result<(Vec<f32>, Vec<f32>)> {
        let (r, dr) = (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim);
        let kva = a.kv_a.forward(xn)?;
        let latent = rms_norm(
            &kva.narrow(1, 0, r)?.contiguous()?,
            &a.kv_a_norm,
            self.cfg.rms_norm_eps as f32,
        )?;
        let latent = latent.flatten_all()?.to_vec1::<f32>()?;
        let mut k_pe = kva
            .narrow(1, r, dr)?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (k, rot) in k_pe.chunks_exact_mut(dr).zip(rot) {
            rot.apply_f32(k);
        }
        Ok((k_pe, latent))
    }

    /// `pe: [rows, keys]` (query rows times `k_pe` rows) with the columns of each shifted
    /// run recomputed from the queries turned back by the run's offset: lazy rotation's
    /// `q_pe` path (the latent part has no position and is read as it is).
    fn shifted_scores(
        &self,
        pe: Tensor,
        q_pe: &Tensor,
        k_pe: &[f32],
        shifts: &[leyline_kv::shift::KeyShift],
    ) -> Result<Tensor> {
        let (rows, m) = pe.dims2()?;
        let dr = self.cfg.qk_rope_head_dim;
        let mut out = pe.flatten_all()?.to_vec1::<f32>()?;
        let q = q_pe.flatten_all()?.to_vec1::<f32>()?;
        let mut turned = q.clone();
        for run in shifts {
            let rot = Rotation::new(&self.cfg.rope, -run.offset);
            turned.copy_from_slice(&q);
            for (i, row) in turned.chunks_exact_mut(dr).enumerate() {
                rot.apply_f32(row);
                for j in run.range.clone() {
                    let k = &k_pe[j * dr..(j + 1) * dr];
                    out[i * m + j] = row.iter().zip(k).map(|(a, b)| a * b).sum();
                }
            }
        }
        Ok(Tensor::from_vec(out, (rows, m), &Device::Cpu)?)
    }

    /// MLA over each sequence's context slots followed by its new slots, causally.
    /// `q` is `[n, heads * qk_head_dim]` (post-RoPE); returns `[n, heads * v_head_dim]`.
    fn attention(
        &self,
        kv: &KvStorage,
        layer: usize,
        a: &Attn,
        q: &Tensor,
        seqs: &[ForwardSeq<'_>],
    ) -> Result<Tensor> {
        let c = &self.cfg;
        let (h, dn, dr, dv, r) = (
            c.num_attention_heads,
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
            c.kv_lora_rank,
        );
        let mut outs = Vec::with_capacity(seqs.len());
        let mut row = 0;
        let mut slots = Vec::new();
        for s in seqs {
            let t = s.tokens.len();
            slots.clear();
            slots.extend_from_slice(s.context);
            slots.extend_from_slice(s.new_slots);
            let m = slots.len();
            let mut latent = vec![0f32; m * r];
            let mut k_pe = vec![0f32; m * dr];
            kv.gather_v(layer, &slots, &mut latent)?;
            kv.gather_k(layer, &slots, &mut k_pe)?;
            let latent = Tensor::from_vec(latent, (m, r), &Device::Cpu)?;
            let k_pe_rows = (!s.shifts.is_empty()).then(|| k_pe.clone());
            let k_pe = Tensor::from_vec(k_pe, (m, dr), &Device::Cpu)?;
            // Decompress: per head [k_nope | v].
            let kvb = a
                .kv_b
                .forward(&latent)?
                .reshape((m, h, dn + dv))?
                .transpose(0, 1)?;
            let k_nope = kvb.narrow(2, 0, dn)?.contiguous()?;
            let v = kvb.narrow(2, dn, dv)?.contiguous()?;
            let qs = q
                .narrow(0, row, t)?
                .reshape((t, h, dn + dr))?
                .transpose(0, 1)?;
            let q_nope = qs.narrow(2, 0, dn)?.contiguous()?;
            let q_pe = qs.narrow(2, dn, dr)?.contiguous()?.reshape((h * t, dr))?;
            let nope = q_nope.matmul(&k_nope.t()?)?;
            let mut pe = q_pe.matmul(&k_pe.t()?)?;
            if let Some(k_pe) = k_pe_rows {
                pe = self.shifted_scores(pe, &q_pe, &k_pe, s.shifts)?;
            }
            let pe = pe.reshape((h, t, m))?;
            let mut att = ((nope + pe)? * c.softmax_scale)?;
            if t > 1 {
                let ctx = s.context.len();
                let mask: Vec<f32> = (0..t)
                    .flat_map(|i| {
                        (0..m).map(move |j| if j <= ctx + i { 0.0 } else { f32::NEG_INFINITY })
                    })
                    .collect();
                att = att.broadcast_add(&Tensor::from_vec(mask, (t, m), &Device::Cpu)?)?;
            }
            let att = softmax_last_dim(&att)?;
            outs.push(att.matmul(&v)?.transpose(0, 1)?.reshape((t, h * dv))?);
            row += t;
        }
        Ok(Tensor::cat(&outs, 0)?)
    }
}

impl Network for DeepseekV2 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn run(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        stop: Option<(usize, &[u32])>,
    ) -> Result<Ran> {
        let crate::model::FlatBatch {
            tokens,
            positions,
            new_slots,
        } = crate::model::FlatBatch::new(seqs);
        let n = tokens.len();
        let rot = self.rotations(&positions);
        let eps = self.cfg.rms_norm_eps as f32;
        let mut x = self
            .embed
            .index_select(&Tensor::from_vec(tokens, n, &Device::Cpu)?, 0)?;
        let row = self.cfg.num_attention_heads * self.cfg.qk_head_dim();
        for (li, b) in self.blocks.iter().enumerate() {
            let xn = rms_norm(&x, &b.in_norm, eps)?;
            let q = Tensor::from_vec(self.queries(&b.attn, &xn, &rot)?, (n, row), &Device::Cpu)?;
            let (k_pe, latent) = self.cache_rows(&b.attn, &xn, &rot)?;
            if let Some((layer, cached)) = stop.filter(|&(layer, _)| layer == li) {
                let d = crate::model::kv_distances(kv, layer, cached, &k_pe, &latent)?;
                return Ok(Ran::Deviation(d));
            }
            let (r, dr) = (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim);
            for (i, &slot) in new_slots.iter().enumerate() {
                kv.write(
                    li,
                    slot,
                    &k_pe[i * dr..(i + 1) * dr],
                    &latent[i * r..(i + 1) * r],
                )?;
            }
            let att = self.attention(kv, li, &b.attn, &q, seqs)?;
            x = (x + b.attn.o.forward(&att)?)?;
            let xn = rms_norm(&x, &b.post_norm, eps)?;
            let y = match &b.ffn {
                Ffn::Dense(m) => m.forward(&xn)?,
                Ffn::Moe(m) => m.forward(&xn)?,
            };
            x = (x + y)?;
        }
        // Only the rows whose logits are wanted go through the head.
        let (rows, counts) = crate::model::logit_rows(seqs);
        if rows.is_empty() {
            return Ok(Ran::Logits(vec![Vec::new(); seqs.len()]));
        }
        let nrows = rows.len();
        let idx = Tensor::from_vec(rows, nrows, &Device::Cpu)?;
        let xs = rms_norm(&x.index_select(&idx, 0)?, &self.norm, eps)?;
        let logits = self.lm_head.forward(&xs)?.to_dtype(DType::F32)?;
        let logits = logits.flatten_all()?.to_vec1::<f32>()?;
        Ok(Ran::Logits(crate::model::split_logits(
            &logits,
            &counts,
            self.info.vocab_size,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LogitsFor;
    use std::collections::HashMap;

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/mla")
            .join(name)
    }

    fn logits(m: &DeepseekV2, tokens: &[u32]) -> Vec<f32> {
        let mut kv = KvStorage::new(m.info.geometry, leyline_kv::KvDtype::F32, 16).unwrap();
        let pos: Vec<u32> = (0..tokens.len() as u32).collect();
        let s = ForwardSeq {
            tokens,
            positions: &pos,
            context: &[],
            new_slots: &pos,
            logits: LogitsFor::All,
            shifts: &[],
        };
        m.forward(&mut kv, &[s]).unwrap().remove(0)
    }

    fn parts(
        name: &str,
    ) -> (
        std::path::PathBuf,
        DeepseekV2Config,
        HashMap<String, Tensor>,
    ) {
        let dir = fixture(name);
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let cfg = DeepseekV2Config::from_json(&text, &dir).unwrap();
        let map =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        (dir, cfg, map)
    }

    /// The fused expert layout of transformers 5 loads into the same model as per-expert files.
    #[test]
    fn fused_experts_load_like_per_expert_ones() {
        let (dir, cfg, mut map) = parts("yarn");
        let per = DeepseekV2::load_dir(&dir).unwrap();
        for l in 1..3 {
            let p = format!("model.layers.{l}.mlp.experts");
            let (mut gu, mut d) = (Vec::new(), Vec::new());
            for e in 0..4 {
                let mut take = |n: &str| map.remove(&format!("{p}.{e}.{n}_proj.weight")).unwrap();
                let (g, u) = (take("gate"), take("up"));
                d.push(take("down"));
                gu.push(Tensor::cat(&[g, u], 0).unwrap());
            }
            map.insert(format!("{p}.gate_up_proj"), Tensor::stack(&gu, 0).unwrap());
            map.insert(format!("{p}.down_proj"), Tensor::stack(&d, 0).unwrap());
        }
        let mut w = Weights::from_map(&dir, map);
        let fused = DeepseekV2::from_weights(cfg, &mut w, "fused").unwrap();
        assert!(w.remaining().is_empty());
        let tokens = [3, 141, 59, 265, 35, 89, 79, 323];
        assert_eq!(logits(&per, &tokens), logits(&fused, &tokens));
    }

    #[test]
    fn missing_or_misshapen_tensors_are_file_errors() {
        let (dir, cfg, full) = parts("plain");
        let mut map = full.clone();
        map.remove("model.layers.2.self_attn.kv_b_proj.weight");
        let e = DeepseekV2::from_weights(cfg.clone(), &mut Weights::from_map(&dir, map), "x");
        let e = e.err().unwrap().to_string();
        assert!(e.contains("kv_b_proj") && e.contains("missing"), "{e}");
        let mut map = full;
        let bad = Tensor::zeros(127, DType::F32, &Device::Cpu).unwrap();
        map.insert("model.norm.weight".into(), bad);
        let e = DeepseekV2::from_weights(cfg, &mut Weights::from_map(&dir, map), "x");
        let e = e.err().unwrap().to_string();
        assert!(
            e.contains("model.norm.weight") && e.contains("[127]"),
            "{e}"
        );
    }
}
