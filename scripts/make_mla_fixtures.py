#!/usr/bin/env python3
"""Regenerates tiny DeepSeek-V2 (MLA + MoE) reference fixtures with Hugging Face transformers.

Writes, for each variant (`plain`: RoPE theta 1e4 and q_lora_rank 48; `yarn`: YaRN factor 4 over
128 original positions, mscale = mscale_all_dim = 0.707, q_lora_rank null) into OUT/<variant>/:

  config.json, model.safetensors, generation_config.json   save_pretrained output (float32)
  reference.json             logits summaries of 3 seeded token sequences (5, 37, 130 tokens),
                             RoPE/gating details, per-token MoE routing, sensitivity to mistakes
  cache_seq130.safetensors   per layer: latent_normed [T, kv_lora_rank], k_pe_pre_rope and
                             k_pe_post_rope [T, qk_rope_head_dim] of the 130-token sequence

Everything runs in float32 on the CPU with eager attention, from the checkpoint reloaded from
disk. The compressed cache is captured with hooks (kv_a_layernorm output, the k_pe slice of
kv_a_proj_with_mqa) and by wrapping the modeling module's `apply_rotary_emb`, so it does not
depend on what transformers' own KV cache keeps.

    pip install "transformers>=5" torch safetensors numpy
    python scripts/make_mla_fixtures.py OUT_DIR
"""

import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mdv2

SEED, NORM_SEED, SEQ_SEED = 1234, 1235, 99
LENGTHS = (5, 37, 130)

COMMON = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, topk_method="greedy",
    norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 0.707}
VARIANTS = {
    "plain": dict(q_lora_rank=48, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn": dict(q_lora_rank=None, rope_parameters=YARN),
}


def yarn_mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def f32list(t):
    return [float(x) for x in t.detach().to(torch.float32).reshape(-1).tolist()]


def build(variant, out):
    torch.manual_seed(SEED)
    cfg = DeepseekV2Config(**COMMON, **VARIANTS[variant])
    model = DeepseekV2ForCausalLM(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(NORM_SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return DeepseekV2ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()


class Capture:
    """Records per layer the normed latent, k_pe before and after RoPE, and the routing."""

    def __init__(self, model):
        self.model, self.handles, self.rows = model, [], {}
        self.orig_rope = mdv2.apply_rotary_emb
        self.rope_calls = []

    def __enter__(self):
        cfg = self.model.config
        for i, layer in enumerate(self.model.model.layers):
            a = layer.self_attn
            self.handles.append(a.kv_a_layernorm.register_forward_hook(
                lambda m, i_, o, i=i: self.rows.__setitem__(f"layers.{i}.latent_normed", o[0])))
            self.handles.append(a.kv_a_proj_with_mqa.register_forward_hook(
                lambda m, i_, o, i=i: self.rows.__setitem__(
                    f"layers.{i}.k_pe_pre_rope", o[0, :, cfg.kv_lora_rank:])))
            if i >= cfg.first_k_dense_replace:
                self.handles.append(layer.mlp.register_forward_pre_hook(
                    lambda m, args, i=i: self.route(i, m, args[0])))

        def rope(q, k, pe):
            qo, ko = self.orig_rope(q, k, pe)
            self.rope_calls.append(ko[0, 0])
            return qo, ko

        mdv2.apply_rotary_emb = rope
        return self

    def route(self, i, mlp, h):
        h = h.reshape(-1, h.shape[-1]).float()
        probs = torch.softmax(h @ mlp.gate.weight.float().t(), dim=-1)
        top = torch.topk(probs, k=self.model.config.num_experts_per_tok, dim=-1)
        srt = torch.sort(probs, dim=-1, descending=True).values
        k = self.model.config.num_experts_per_tok
        idx, order = torch.sort(top.indices, dim=-1)
        w = torch.gather(top.values, 1, order) * self.model.config.routed_scaling_factor
        self.rows[f"routing.{i}"] = {
            "experts": idx.tolist(),
            "weights": [[float(x) for x in r] for r in w.tolist()],
            "min_gap_kth_vs_next_score": float((srt[:, k - 1] - srt[:, k]).min()),
        }

    def __exit__(self, *exc):
        mdv2.apply_rotary_emb = self.orig_rope
        for h in self.handles:
            h.remove()


@torch.no_grad()
def logits_of(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


def summarize(logits):
    top5 = torch.topk(logits, 5, dim=-1)
    lse = torch.logsumexp(logits.double(), dim=-1)
    return {
        "argmax": logits.argmax(-1).tolist(),
        "top5_ids": top5.indices.tolist(),
        "top5_logits": [f32list(r) for r in top5.values],
        "logsumexp": [float(x) for x in lse.tolist()],
        "top1_minus_top2": f32list(top5.values[:, 0] - top5.values[:, 1]),
        "last_position_logits": f32list(logits[-1]),
    }


@torch.no_grad()
def sensitivity(model, ids, base):
    """Max |logit change| under typical implementation mistakes."""
    out, cfg = {}, model.config
    orig = mdv2.apply_rotary_emb

    def half_split(q, k, pe):  # pairs (i, i + d/2) instead of (2i, 2i + 1)
        perm = lambda x: torch.cat([x[..., 0::2], x[..., 1::2]], -1)
        inv = lambda x: torch.stack(x.chunk(2, -1), -1).flatten(-2)
        qo, ko = orig(inv(q), inv(k), pe)
        return perm(qo), perm(ko)

    mdv2.apply_rotary_emb = half_split
    try:
        out["rope_half_split_instead_of_interleaved"] = float((logits_of(model, ids) - base).abs().max())
    finally:
        mdv2.apply_rotary_emb = orig
    rp = cfg.rope_parameters
    if rp.get("rope_type") == "yarn":
        rot = model.model.rotary_emb
        saved = rot.inv_freq.clone()
        d = cfg.qk_rope_head_dim
        rot.inv_freq.copy_(1.0 / rp["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        out["plain_rope_frequencies_instead_of_yarn"] = float((logits_of(model, ids) - base).abs().max())
        rot.inv_freq.copy_(saved)
        scales = [l.self_attn.scaling for l in model.model.layers]
        for l in model.model.layers:
            l.self_attn.scaling = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
        out["softmax_scale_without_mscale_squared"] = float((logits_of(model, ids) - base).abs().max())
        for l, s in zip(model.model.layers, scales):
            l.self_attn.scaling = s
    return out


def make(variant, root):
    out = root / variant
    model = build(variant, out)
    cfg = model.config
    gen = torch.Generator().manual_seed(SEQ_SEED)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]
    rot = model.model.rotary_emb
    rp = dict(cfg.rope_parameters)
    ref = {
        "about": f"Tiny seeded DeepSeek-V2 ({variant}) made with transformers DeepseekV2Config / "
                 "DeepseekV2ForCausalLM, saved with save_pretrained, reloaded from disk, run in "
                 "float32 on CPU with eager attention, one uncached forward per sequence.",
        "generator": {"transformers": __import__("transformers").__version__,
                      "torch": torch.__version__},
        "seed": {"torch_manual_seed": SEED, "init_std": COMMON["initializer_range"],
                 "norm_weight_jitter": 0.1, "norm_jitter_generator_seed": NORM_SEED,
                 "sequence_seed": SEQ_SEED},
        "model_safetensors_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
        "config": {**COMMON, **VARIANTS[variant]},
        "layer_kinds": ["dense" if i < cfg.first_k_dense_replace else "moe"
                        for i in range(cfg.num_hidden_layers)],
        "rope": {
            "rope_parameters": rp,
            "inv_freq": f32list(rot.inv_freq),
            "cos_sin_scale": float(rot.attention_scaling),
            "softmax_scale": float(model.model.layers[0].self_attn.scaling),
            "softmax_scale_expected": (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
            * (yarn_mscale(rp["factor"], rp.get("mscale_all_dim") or 0) ** 2
               if rp.get("rope_type") == "yarn" and rp.get("mscale_all_dim") else 1.0),
            "layout": "interleaved pairs (2i, 2i+1) of the qk_rope_head_dim slice",
        },
        "sequences": [],
    }
    for ids in seqs:
        with Capture(model) as cap:
            logits = logits_of(model, ids)
        entry = {"ids": ids, "n_tokens": len(ids), **summarize(logits)}
        entry["moe_routing"] = {f"layer_{k.split('.')[1]}": v
                                for k, v in cap.rows.items() if k.startswith("routing.")}
        if len(ids) == max(LENGTHS):
            tensors = {k: v.detach().float().contiguous()
                       for k, v in cap.rows.items() if not k.startswith("routing.")}
            for i, k_pe in enumerate(cap.rope_calls):
                tensors[f"layers.{i}.k_pe_post_rope"] = k_pe.detach().float().contiguous()
            save_file(tensors, out / "cache_seq130.safetensors", metadata={"ids": json.dumps(ids)})
            entry["cache_file"] = "cache_seq130.safetensors"
            entry["sensitivity_max_abs_logit_change"] = sensitivity(model, ids, logits)
        ref["sequences"].append(entry)
    if abs(ref["rope"]["softmax_scale"] - ref["rope"]["softmax_scale_expected"]) > 1e-12:
        print(f"{variant}: note: transformers' softmax scale {ref['rope']['softmax_scale']} differs "
              f"from qk_head_dim^-0.5 * mscale^2 = {ref['rope']['softmax_scale_expected']}",
              file=sys.stderr)
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    print(f"{variant}: wrote {out}")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    torch.set_grad_enabled(False)
    for v in VARIANTS:
        make(v, Path(sys.argv[1]))


if __name__ == "__main__":
    main()
