//! `config.json` of a DeepSeek-V2-family checkpoint (HF transformers 5 `rope_parameters`,
//! or the legacy `rope_scaling` + top-level `rope_theta` of the official configs).

use crate::error::{ModelError, Result};
use leyline_kernels::rope::{yarn_get_mscale, RopeScaling, RopeSpec, RotaryLayout};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The mixture-of-experts part of a DeepSeek-V2 config (softmax gating, greedy top-k).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Width of one routed (and one shared) expert.
    pub moe_intermediate_size: usize,
    /// Number of routed experts.
    pub n_routed_experts: usize,
    /// Experts chosen per token.
    pub num_experts_per_tok: usize,
    /// Shared experts (always on), fused into one MLP of `n * moe_intermediate_size`.
    pub n_shared_experts: usize,
    /// Layers below this index are dense.
    pub first_k_dense_replace: usize,
    /// From `first_k_dense_replace` on, every `moe_layer_freq`-th layer is MoE.
    pub moe_layer_freq: usize,
    /// Multiplier of the selected (not renormalized) gate probabilities.
    pub routed_scaling_factor: f64,
}

/// Hyper-parameters of a DeepSeek-V2-family model.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekV2Config {
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Number of transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Rank of the query compression (`None`: one `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Width of the cached latent `c_kv`.
    pub kv_lora_rank: usize,
    /// Position-free part of a query/key head.
    pub qk_nope_head_dim: usize,
    /// Rotary part of a query/key head (one `k_pe` shared by all heads).
    pub qk_rope_head_dim: usize,
    /// Width of a value head.
    pub v_head_dim: usize,
    /// Width of the dense MLP.
    pub intermediate_size: usize,
    /// Experts, when the model has any.
    pub moe: Option<MoeConfig>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Trained context length.
    pub max_position_embeddings: usize,
    /// Whether `lm_head` is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// RoPE of `q_pe` / `k_pe`: interleaved pairs, `rotary_dim == head_dim == qk_rope_head_dim`.
    pub rope: RopeSpec,
    /// Softmax scale: `qk_head_dim^-0.5`, times `yarn_get_mscale(factor, mscale_all_dim)^2`
    /// under YaRN with `mscale_all_dim` set.
    pub softmax_scale: f64,
}

impl DeepseekV2Config {
    /// Width of a query/key head (`qk_nope_head_dim + qk_rope_head_dim`).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Whether block `layer` has a mixture of experts (else a dense MLP).
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.moe {
            Some(m) => layer >= m.first_k_dense_replace && layer.is_multiple_of(m.moe_layer_freq),
            None => false,
        }
    }

    /// Parses the text of `config.json`; `path` only names the file in errors.
    ///
    /// # Errors
    /// [`ModelError::File`] for malformed JSON or missing/ill-typed fields,
    /// [`ModelError::Unsupported`] for what Leyline cannot run (another `model_type`,
    /// `topk_method` other than `greedy`, sigmoid scoring, renormalized top-k, dynamic or
    /// unknown RoPE scaling, an activation other than SiLU).
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| file(path, format!("not JSON: {e}")))?;
        let o = v
            .as_object()
            .ok_or_else(|| file(path, "config is not a JSON object".into()))?;
        let c = Fields { o, path };
        if let Some(t) = c.opt_str("model_type")? {
            if t != "deepseek_v2" {
                return Err(c.unsupported(format!("model_type {t:?} (supported: deepseek_v2)")));
            }
        }
        if let Some(act) = c.opt_str("hidden_act")? {
            if act != "silu" {
                return Err(c.unsupported(format!("hidden_act {act:?} (supported: silu)")));
            }
        }
        let layers = c.usize("num_hidden_layers")?;
        let moe = match c.opt_usize("n_routed_experts")? {
            None | Some(0) => None,
            Some(n_routed_experts) => {
                let method = c.opt_str("topk_method")?.unwrap_or("greedy");
                if method != "greedy" {
                    return Err(
                        c.unsupported(format!("topk_method {method:?} (supported: greedy)"))
                    );
                }
                let scoring = c.opt_str("scoring_func")?.unwrap_or("softmax");
                if scoring != "softmax" {
                    return Err(
                        c.unsupported(format!("scoring_func {scoring:?} (supported: softmax)"))
                    );
                }
                if c.opt_bool("norm_topk_prob")?.unwrap_or(false) {
                    // The official remote code renormalizes, transformers' V2 does not.
                    return Err(c.unsupported(
                        "norm_topk_prob true (reference implementations disagree on it)".into(),
                    ));
                }
                let m = MoeConfig {
                    moe_intermediate_size: c.usize("moe_intermediate_size")?,
                    n_routed_experts,
                    num_experts_per_tok: c.usize("num_experts_per_tok")?,
                    n_shared_experts: c.opt_usize("n_shared_experts")?.unwrap_or(0),
                    first_k_dense_replace: c.opt_usize("first_k_dense_replace")?.unwrap_or(0),
                    moe_layer_freq: c.opt_usize("moe_layer_freq")?.unwrap_or(1),
                    routed_scaling_factor: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0),
                };
                if m.num_experts_per_tok == 0
                    || m.num_experts_per_tok > m.n_routed_experts
                    || m.moe_layer_freq == 0
                {
                    return Err(c.unsupported(format!(
                        "{} experts per token of {}, moe_layer_freq {}",
                        m.num_experts_per_tok, m.n_routed_experts, m.moe_layer_freq
                    )));
                }
                Some(m)
            }
        };
        let qk_nope_head_dim = c.usize("qk_nope_head_dim")?;
        let qk_rope_head_dim = c.usize("qk_rope_head_dim")?;
        let max_position_embeddings = c.usize("max_position_embeddings")?;
        let (rope, mscale_all_dim) = parse_rope(&c, qk_rope_head_dim, max_position_embeddings)?;
        let mut softmax_scale = 1.0 / ((qk_nope_head_dim + qk_rope_head_dim) as f64).sqrt();
        if let RopeScaling::Yarn { factor, .. } = rope.scaling {
            if mscale_all_dim != 0.0 {
                let m = yarn_get_mscale(factor, mscale_all_dim);
                softmax_scale *= m * m;
            }
        }
        let cfg = Self {
            vocab_size: c.usize("vocab_size")?,
            hidden_size: c.usize("hidden_size")?,
            num_hidden_layers: layers,
            num_attention_heads: c.usize("num_attention_heads")?,
            q_lora_rank: c.opt_usize("q_lora_rank")?,
            kv_lora_rank: c.usize("kv_lora_rank")?,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim: c.usize("v_head_dim")?,
            intermediate_size: c.usize("intermediate_size")?,
            moe,
            rms_norm_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings,
            tie_word_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            rope,
            softmax_scale,
        };
        let dims = [
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.kv_lora_rank,
            cfg.v_head_dim,
            cfg.intermediate_size,
        ];
        if dims.contains(&0) || cfg.q_lora_rank == Some(0) {
            return Err(c.unsupported("a zero dimension".into()));
        }
        Ok(cfg)
    }
}

/// The RoPE of `k_pe` and the YaRN `mscale_all_dim` (0 when absent).
fn parse_rope(c: &Fields<'_>, dim: usize, max_pos: usize) -> Result<(RopeSpec, f64)> {
    let top_theta = c.opt_f64("rope_theta")?;
    let (params, legacy) = match (c.o.get("rope_parameters"), c.o.get("rope_scaling")) {
        (Some(Value::Object(p)), _) => (Some(p), false),
        (_, Some(Value::Object(p))) => (Some(p), true),
        _ => (None, false),
    };
    let p = params.map(|o| Fields { o, path: c.path });
    let theta = match &p {
        Some(p) if !legacy => p.opt_f64("rope_theta")?.or(top_theta),
        _ => top_theta,
    }
    .unwrap_or(10_000.0);
    let kind = match &p {
        Some(p) => p
            .opt_str("rope_type")?
            .or(p.opt_str("type")?)
            .unwrap_or("default"),
        None => "default",
    };
    let mut mscale_all_dim = 0.0;
    let scaling = match (kind, &p) {
        ("default", _) | (_, None) => RopeScaling::None,
        ("linear", Some(p)) => RopeScaling::Linear {
            factor: p.f64("factor")?,
        },
        ("yarn", Some(p)) => {
            if p.o.contains_key("attention_factor") {
                return Err(c.unsupported("an explicit YaRN attention_factor".into()));
            }
            if p.opt_bool("truncate")? == Some(false) {
                return Err(c.unsupported("YaRN with truncate false".into()));
            }
            mscale_all_dim = p.opt_f64("mscale_all_dim")?.unwrap_or(0.0);
            RopeScaling::Yarn {
                factor: p.f64("factor")?,
                original_max_position: p
                    .opt_f64("original_max_position_embeddings")?
                    .unwrap_or(max_pos as f64),
                beta_fast: p.opt_f64("beta_fast")?.unwrap_or(32.0),
                beta_slow: p.opt_f64("beta_slow")?.unwrap_or(1.0),
                mscale: p.opt_f64("mscale")?.unwrap_or(0.0),
                mscale_all_dim,
            }
        }
        (other, _) => {
            return Err(c.unsupported(format!(
                "rope type {other:?} (supported: default, linear, yarn; dynamic scaling cannot be \
                 shifted)"
            )))
        }
    };
    let spec = RopeSpec {
        theta,
        head_dim: dim,
        rotary_dim: dim,
        layout: RotaryLayout::Interleaved,
        scaling,
        freq_factors: None,
    };
    spec.validate()
        .map_err(|e| c.unsupported(format!("rope: {e}")))?;
    Ok((spec, mscale_all_dim))
}

fn file(path: &Path, reason: String) -> ModelError {
    ModelError::File {
        path: path.to_path_buf(),
        reason,
    }
}

/// Typed access to one JSON object, with errors naming the file and field.
struct Fields<'a> {
    o: &'a Map<String, Value>,
    path: &'a Path,
}

impl Fields<'_> {
    fn unsupported(&self, reason: String) -> ModelError {
        ModelError::Unsupported {
            path: PathBuf::from(self.path),
            reason,
        }
    }

    fn bad(&self, key: &str, want: &str) -> ModelError {
        file(self.path, format!("field {key:?} must be {want}"))
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.o.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| self.bad(key, "a non-negative integer"))
            })
            .transpose()
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| file(self.path, format!("missing field {key:?}")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| self.bad(key, "a number"))
            })
            .transpose()
    }

    fn f64(&self, key: &str) -> Result<f64> {
        self.opt_f64(key)?
            .ok_or_else(|| file(self.path, format!("missing field {key:?}")))
    }

    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.bad(key, "a string")))
            .transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.bad(key, "a boolean")))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"model_type":"deepseek_v2","vocab_size":512,"hidden_size":128,
        "num_hidden_layers":3,"num_attention_heads":4,"q_lora_rank":null,"kv_lora_rank":32,
        "qk_nope_head_dim":16,"qk_rope_head_dim":8,"v_head_dim":16,"intermediate_size":256,
        "moe_intermediate_size":64,"n_routed_experts":4,"num_experts_per_tok":2,
        "n_shared_experts":1,"first_k_dense_replace":1,"moe_layer_freq":1,
        "routed_scaling_factor":1.0,"topk_method":"greedy","norm_topk_prob":false,
        "rms_norm_eps":1e-6,"max_position_embeddings":512,"tie_word_embeddings":false"#;

    fn parse(extra: &str) -> Result<DeepseekV2Config> {
        DeepseekV2Config::from_json(&format!("{BASE}{extra}}}"), Path::new("config.json"))
    }

    fn yarn_scale(factor: f64, m: f64) -> f64 {
        (0.1 * m * factor.ln() + 1.0).powi(2) / 24f64.sqrt()
    }

    #[test]
    fn legacy_rope_scaling_equals_rope_parameters() {
        let new = parse(
            r#","rope_parameters":{"rope_type":"yarn","rope_theta":10000.0,"factor":4.0,
            "original_max_position_embeddings":128,"mscale":0.707,"mscale_all_dim":0.707}"#,
        )
        .unwrap();
        let old = parse(
            r#","rope_theta":10000.0,"rope_scaling":{"type":"yarn","factor":4.0,
            "original_max_position_embeddings":128,"mscale":0.707,"mscale_all_dim":0.707,
            "beta_fast":32,"beta_slow":1}"#,
        )
        .unwrap();
        assert_eq!(new, old);
        assert!((new.softmax_scale - yarn_scale(4.0, 0.707)).abs() < 1e-15);
        assert!(matches!(new.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 4.0));
        assert_eq!(new.rope.layout, RotaryLayout::Interleaved);
        assert_eq!((new.rope.head_dim, new.rope.rotary_dim), (8, 8));
        assert!(!new.is_moe_layer(0) && new.is_moe_layer(1) && new.is_moe_layer(2));
    }

    #[test]
    fn plain_rope_and_defaults() {
        let c = parse(r#","rope_theta":500.0"#).unwrap();
        assert_eq!(c.rope.theta, 500.0);
        assert_eq!(c.rope.scaling, RopeScaling::None);
        assert_eq!(c.softmax_scale, 1.0 / 24f64.sqrt());
        let c = parse(r#","rope_parameters":{"rope_type":"default","rope_theta":300.0}"#).unwrap();
        assert_eq!(c.rope.theta, 300.0);
    }

    #[test]
    fn unsupported_configs_say_why() {
        let cases = [
            (
                r#","rope_scaling":{"type":"dynamic","factor":2.0}"#,
                "dynamic",
            ),
            (r#","topk_method":"group_limited_greedy""#, "topk_method"),
            (r#","scoring_func":"sigmoid""#, "scoring_func"),
            (r#","norm_topk_prob":true"#, "norm_topk_prob"),
            (r#","hidden_act":"gelu""#, "hidden_act"),
            (r#","model_type":"deepseek_v3""#, "model_type"),
        ];
        for (extra, word) in cases {
            // Later keys override earlier ones in serde_json maps.
            let e = parse(extra).unwrap_err();
            assert!(matches!(e, ModelError::Unsupported { .. }), "{extra}: {e}");
            assert!(e.to_string().contains(word), "{extra}: {e}");
        }
        let e = parse(r#","kv_lora_rank":"x""#).unwrap_err();
        assert!(matches!(e, ModelError::File { .. }), "{e}");
        let e = DeepseekV2Config::from_json("{", Path::new("c.json")).unwrap_err();
        assert!(matches!(e, ModelError::File { .. }), "{e}");
    }
}
