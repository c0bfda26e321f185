//! The forward pass over plain buffers, for every batch size.
//!
//! Design decision: the tensor library's per-op cost (allocation, layout bookkeeping, copies)
//! outweighed the arithmetic at decode shapes and cost several percent at prefill shapes.
//! Activations live in `Vec<f32>` buffers; each sequence's rows take the kernels its own
//! size picks ([`crate::linear::RowSplit`]: up to [`crate::linear::FEW_ROWS`] rows the
//! quantized few-row kernels through the spinning [`SpinPool`], Q/K/V and gate/up sharing
//! one dispatch; above that one gemm on dequantized chunks), so that a sequence computes the
//! same bits alone and batched; attention reads the pool's key and value rows in place.

use super::attend;
use super::Llama;
use crate::error::Result;
use crate::linear::RowSplit;
use crate::{ForwardSeq, Ran};
use leyline_kernels::attend::{Heads, Queries};
use leyline_kernels::fastmath::silu_mul;
use leyline_kernels::pool::SpinPool;
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
    /// caller has run. With `stop = (layer, cached)` it is [`crate::CausalLm::kv_deviation`]
    /// instead: it ends at `layer`, before writing that layer's KV.
    pub(super) fn forward_buffers(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        stop: Option<(usize, &[u32])>,
    ) -> Result<Ran> {
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
        let mut x = Vec::with_capacity(n * hid);
        self.embed.gather(&tokens, &mut x)?;
        let mut xn = vec![0f32; n * hid];
        // Q/K/V side by side in each row, then gate/up: what the fused products write.
        let (qw, w) = (h * hd, kvh * hd);
        let qkv_w = qw + 2 * w;
        let mut qkv = vec![0f32; n * qkv_w];
        let mut att = vec![0f32; n * qw];
        let mut gate_up = vec![0f32; n * 2 * ffn];
        let mut act = vec![0f32; n * ffn];
        let mut y = vec![0f32; n * hid];
        let shape = Heads {
            heads: h,
            kv_heads: kvh,
            head_dim: hd,
        };
        // On 8-bit activations each sequence's rows take the kernels its own size picks
        // (batch invariance); on f32 ones the batch's size picks, as the paths differ by float
        // noise only.
        let int8 =
            leyline_kernels::qmatmul::activations() == leyline_kernels::qmatmul::Activations::Int8;
        let split = if int8 {
            RowSplit::by_sequence(seqs.iter().map(|s| (s.tokens.len(), s.tokens.len())))
        } else {
            RowSplit::uniform(n)
        };
        let mut plan = attend::Plan::new(seqs, shape, &self.cfg.rope, pool.threads());
        for (li, b) in self.blocks.iter().enumerate() {
            rms_norm(&x, &b.attn_norm_vals, eps, &mut xn);
            b.qkv.forward_split(&xn, &split, &mut qkv)?;
            // Queries and keys are the first h + kvh heads of a row.
            self.apply_rope(&mut qkv, qkv_w, h + kvh, &cos, &sin);
            if let Some((layer, cached)) = stop.filter(|&(layer, _)| layer == li) {
                let rows = qkv.chunks_exact(qkv_w);
                let k: Vec<f32> = rows.clone().flat_map(|r| &r[qw..qw + w]).copied().collect();
                let v: Vec<f32> = rows.flat_map(|r| &r[qw + w..qw + 2 * w]).copied().collect();
                return Ok(Ran::Deviation(crate::kv_distances(
                    kv, layer, cached, &k, &v,
                )?));
            }
            for (row, &slot) in qkv.chunks_exact(qkv_w).zip(&new_slots) {
                kv.write(li, slot, &row[qw..qw + w], &row[qw + w..qw + 2 * w])?;
            }
            let q = Queries {
                rows: &qkv,
                stride: qkv_w,
            };
            attend::attend(pool, kv, li, q, &mut plan, &mut att);
            b.o.forward_split(&att, &split, &mut y)?;
            add_into(&mut x, &y);
            rms_norm(&x, &b.ffn_norm_vals, eps, &mut xn);
            b.gate_up.forward_split(&xn, &split, &mut gate_up)?;
            silu_mul(&gate_up, ffn, &mut act);
            b.down.forward_split(&act, &split, &mut y)?;
            add_into(&mut x, &y);
        }
        let (rows, counts) = crate::logit_rows(seqs);
        if rows.is_empty() {
            return Ok(Ran::Logits(vec![Vec::new(); seqs.len()]));
        }
        let m = rows.len();
        let mut xs = vec![0f32; m * hid];
        for (dst, &r) in xs.chunks_exact_mut(hid).zip(&rows) {
            let r = r as usize;
            rms_norm(&x[r * hid..(r + 1) * hid], &self.norm_vals, eps, dst);
        }
        let mut logits = vec![0f32; m * self.info.vocab_size];
        let head_split = if int8 {
            RowSplit::by_sequence(counts.iter().zip(seqs).map(|(&c, s)| (c, s.tokens.len())))
        } else {
            RowSplit::uniform(m)
        };
        self.lm_head.forward_split(&xs, &head_split, &mut logits)?;
        Ok(Ran::Logits(crate::split_logits(
            &logits,
            &counts,
            self.info.vocab_size,
        )))
    }
}
