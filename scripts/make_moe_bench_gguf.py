#!/usr/bin/env python3
"""Writes a synthetic `qwen3moe` GGUF with Qwen3-30B-A3B's per-layer shapes for the MoE
speed benchmark of issue 60 (`scripts/bench_moe.sh` quantizes it with llama.cpp's
`llama-quantize` and runs it side by side with llama.cpp).

Shapes (Qwen3-30B-A3B's config): width 2048, 32 query heads and 4 KV heads of 128, 128
routed experts of FFN width 768, 8 active, RMS eps 1e-6, rope base 1e6; 8 layers (not 48)
and a 32,000-token vocabulary (not 151,936), so the head does not dominate. Weights are
seeded random normals (scale 0.02; norms 1; the router scaled so routing is not flat),
written as F16 (norms and the router F32), streamed tensor by tensor so that memory stays
near one expert stack (about 0.8 GB). The vocabulary is synthetic (byte-level single
characters, then `tok{i}`, one merge): enough for both engines to load the file and run
token ids, not to tokenize text.

Usage: make_moe_bench_gguf.py OUT.gguf [--layers 8] [--seed 1]
Needs numpy and gguf-py (llama.cpp's `gguf-py` folder, or `pip install gguf`).
"""

import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("gguf-py is needed: pip install gguf (or llama.cpp's gguf-py folder)")

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_FFN, DENSE_FFN = 128, 8, 768, 6144
VOCAB = 32000


def byte_chars():
    """GPT-2's byte-to-character map: printable bytes as themselves, the rest shifted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)

    tensors = []  # (name, numpy shape (outermost first), dtype, maker)

    def normal(shape, scale=0.02, dtype=np.float16):
        return lambda: (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    def ones(n):
        return lambda: np.ones(n, dtype=np.float32)

    tensors.append(("token_embd.weight", (VOCAB, HIDDEN), np.float16, normal((VOCAB, HIDDEN))))
    for i in range(a.layers):
        p = f"blk.{i}."
        q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
        tensors += [
            (p + "attn_norm.weight", (HIDDEN,), np.float32, ones(HIDDEN)),
            (p + "attn_q.weight", (q, HIDDEN), np.float16, normal((q, HIDDEN))),
            (p + "attn_k.weight", (kv, HIDDEN), np.float16, normal((kv, HIDDEN))),
            (p + "attn_v.weight", (kv, HIDDEN), np.float16, normal((kv, HIDDEN))),
            (p + "attn_output.weight", (HIDDEN, q), np.float16, normal((HIDDEN, q))),
            (p + "attn_q_norm.weight", (HEAD_DIM,), np.float32, ones(HEAD_DIM)),
            (p + "attn_k_norm.weight", (HEAD_DIM,), np.float32, ones(HEAD_DIM)),
            (p + "ffn_norm.weight", (HIDDEN,), np.float32, ones(HIDDEN)),
            (p + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), np.float32,
             normal((EXPERTS, HIDDEN), scale=0.2, dtype=np.float32)),
            (p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), np.float16,
             normal((EXPERTS, EXPERT_FFN, HIDDEN))),
            (p + "ffn_up_exps.weight", (EXPERTS, EXPERT_FFN, HIDDEN), np.float16,
             normal((EXPERTS, EXPERT_FFN, HIDDEN))),
            (p + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN), np.float16,
             normal((EXPERTS, HIDDEN, EXPERT_FFN))),
        ]
    tensors += [
        ("output_norm.weight", (HIDDEN,), np.float32, ones(HIDDEN)),
        ("output.weight", (VOCAB, HIDDEN), np.float16, normal((VOCAB, HIDDEN))),
    ]

    w = gguf.GGUFWriter(a.out, "qwen3moe")
    w.add_name("leyline-synthetic-qwen3moe-30b-a3b-shapes")
    w.add_context_length(32768)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(DENSE_FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(USED)
    w.add_expert_feed_forward_length(EXPERT_FFN)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    chars = byte_chars()
    tokens = chars + ["ab"] + [f"tok{i}" for i in range(VOCAB - len(chars) - 1)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_eos_token_id(1)
    for name, shape, dtype, _ in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for k, (name, shape, dtype, make) in enumerate(tensors):
        arr = make()
        assert arr.shape == shape and arr.dtype == dtype, name
        w.write_tensor_data(arr)
        print(f"[{k + 1}/{len(tensors)}] {name} {shape}", file=sys.stderr, flush=True)
    w.close()


if __name__ == "__main__":
    main()
