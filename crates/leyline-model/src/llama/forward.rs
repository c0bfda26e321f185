//! The forward pass over plain buffers, for every batch size.
//!
//! Design decision: the tensor library's per-op cost (allocation, layout bookkeeping, copies)
//! outweighed the arithmetic at decode shapes and cost several percent at prefill shapes.
//! Activations live in `Vec<f32>` buffers; each projection picks its kernel by row count
//! ([`Linear::forward_many`]: the quantized weights through the spinning [`SpinPool`] for a
//! few rows, Q/K/V and gate/up sharing one dispatch; gemm on the f32 weights above that), and
//! attention reads the pool's key and value rows in place.

use super::attend;
use super::Llama;
use crate::error::Result;
use crate::linear::Linear;
use crate::pool::SpinPool;
use crate::ForwardSeq;
use candle_core::{Device, Tensor};
use leyline_kv::KvStorage;

/// `out = x / rms(x) * w`, row by row.
fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

fn add_into(acc: &mut [f32], y: &[f32]) {
    for (a, b) in acc.iter_mut().zip(y) {
        *a += b;
    }
}

impl Llama {
    /// The forward pass; same contract as [`crate::CausalLm::forward`], whose checks the
    /// caller has run.
    pub(super) fn forward_buffers(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
    ) -> Result<Vec<Vec<f32>>> {
        let pool = SpinPool::global();
        let crate::FlatBatch {
            tokens,
            positions,
            new_slots,
        } = crate::FlatBatch::new(seqs);
        let n = tokens.len();
        let c = &self.cfg;
        let (hid, h, kvh, hd, ffn) = (c.hidden, c.heads, c.kv_heads, c.head_dim, c.ffn);
        let eps = c.rms_eps as f32;
        let (cos, sin) = self.rope_tables(&positions);
        let ids = Tensor::from_vec(tokens, n, &Device::Cpu)?;
        let mut x = self
            .embed
            .index_select(&ids, 0)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut xn = vec![0f32; n * hid];
        let (mut q, mut att) = (vec![0f32; n * h * hd], vec![0f32; n * h * hd]);
        let (mut k, mut v) = (vec![0f32; n * kvh * hd], vec![0f32; n * kvh * hd]);
        let (mut gate, mut up) = (vec![0f32; n * ffn], vec![0f32; n * ffn]);
        let mut y = vec![0f32; n * hid];
        let w = kvh * hd;
        let shape = attend::Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        };
        for (li, b) in self.blocks.iter().enumerate() {
            rms_norm(&x, &b.attn_norm_vals, eps, &mut xn);
            Linear::forward_many(
                pool,
                &xn,
                n,
                &mut [(&b.q, &mut q), (&b.k, &mut k), (&b.v, &mut v)],
            )?;
            self.apply_rope(&mut q, h, &cos, &sin);
            self.apply_rope(&mut k, kvh, &cos, &sin);
            for (i, &slot) in new_slots.iter().enumerate() {
                kv.write(li, slot, &k[i * w..(i + 1) * w], &v[i * w..(i + 1) * w])?;
            }
            attend::attend(pool, kv, li, shape, &q, seqs, &mut att);
            Linear::forward_many(pool, &att, n, &mut [(&b.o, &mut y)])?;
            add_into(&mut x, &y);
            rms_norm(&x, &b.ffn_norm_vals, eps, &mut xn);
            Linear::forward_many(pool, &xn, n, &mut [(&b.gate, &mut gate), (&b.up, &mut up)])?;
            crate::fastmath::silu_mul(&mut gate, &up);
            Linear::forward_many(pool, &gate, n, &mut [(&b.down, &mut y)])?;
            add_into(&mut x, &y);
        }
        let (rows, counts) = crate::logit_rows(seqs);
        if rows.is_empty() {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        let m = rows.len();
        let mut xs = vec![0f32; m * hid];
        for (dst, &r) in xs.chunks_exact_mut(hid).zip(&rows) {
            let r = r as usize;
            rms_norm(&x[r * hid..(r + 1) * hid], &self.norm_vals, eps, dst);
        }
        let mut logits = vec![0f32; m * self.info.vocab_size];
        Linear::forward_many(pool, &xs, m, &mut [(&self.lm_head, &mut logits)])?;
        Ok(crate::split_logits(&logits, &counts, self.info.vocab_size))
    }
}
