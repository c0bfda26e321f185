//! The forward pass for batches of a few tokens (decode steps), on plain buffers.
//!
//! Design decision: at decode shapes the tensor library's per-op cost (allocation, layout
//! bookkeeping, copies) and rayon's wake-ups outweighed the arithmetic. This path keeps
//! activations in reused `Vec<f32>` buffers, runs projections on the quantized weights
//! through the spinning [`SpinPool`] (Q/K/V and gate/up share one dispatch), and attends by
//! reading the pool's key and value rows in place instead of gathering the context.

use super::attend::{bf16_to_f32, f16_to_f32};
use super::Llama;
use crate::error::Result;
use crate::linear::Linear;
use crate::pool::SpinPool;
use crate::ForwardSeq;
use candle_core::{Device, Tensor};
use leyline_kv::storage::RowsRef;
use leyline_kv::KvStorage;
use std::sync::Mutex;

/// Largest batch (tokens over all sequences) the decode path takes.
pub(super) const MAX_TOKENS: usize = 16;

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

/// Eight independent lanes so the compiler vectorizes the reduction.
#[inline(always)]
fn dot<T: Copy>(q: &[f32], k: &[T], cvt: impl Fn(T) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let (qc, qr) = q.split_at(q.len() / 8 * 8);
    let (kc, kr) = k[..q.len()].split_at(qc.len());
    for (a, b) in qc.chunks_exact(8).zip(kc.chunks_exact(8)) {
        for l in 0..8 {
            acc[l] += a[l] * cvt(b[l]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (a, &b) in qr.iter().zip(kr) {
        s += a * cvt(b);
    }
    s
}

#[inline(always)]
fn axpy<T: Copy>(p: f32, v: &[T], out: &mut [f32], cvt: impl Fn(T) -> f32) {
    for (o, &x) in out.iter_mut().zip(v) {
        *o += p * cvt(x);
    }
}

/// One (sequence, query head) pair of a batch's attention.
struct Task<'a> {
    seq: &'a ForwardSeq<'a>,
    /// First row of the sequence in the flat batch.
    row: usize,
    head: usize,
}

/// Softmax attention of one query row over `slots`, accumulated into `out` (zeroed).
#[allow(clippy::too_many_arguments)]
fn attend_row<T: Copy>(
    q: &[f32],
    k: &[T],
    v: &[T],
    (k_off, kw, v_off, vw): (usize, usize, usize, usize),
    slots: impl Iterator<Item = u32> + Clone,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
    cvt: impl Fn(T) -> f32 + Copy,
) {
    let hd = q.len();
    scores.clear();
    let mut max = f32::NEG_INFINITY;
    for s in slots.clone() {
        let base = s as usize * kw + k_off;
        let x = dot(q, &k[base..base + hd], cvt) * scale;
        max = max.max(x);
        scores.push(x);
    }
    let mut sum = 0f32;
    for x in scores.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    out.fill(0.0);
    let inv = 1.0 / sum;
    for (s, &p) in slots.zip(scores.iter()) {
        let base = s as usize * vw + v_off;
        axpy(p * inv, &v[base..base + hd], out, cvt);
    }
}

impl Llama {
    /// Whether every projection has quantized weights (the decode path needs them).
    pub(super) fn decode_path_ok(&self) -> bool {
        self.lm_head.is_quantized()
            && self.blocks.iter().all(|b| {
                [&b.q, &b.k, &b.v, &b.o, &b.gate, &b.up, &b.down]
                    .iter()
                    .all(|l| l.is_quantized())
            })
    }

    /// The forward pass of a small batch (at most [`MAX_TOKENS`] tokens); same contract as
    /// [`crate::CausalLm::forward`], whose checks the caller has run.
    pub(super) fn forward_small(
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
        for (li, b) in self.blocks.iter().enumerate() {
            rms_norm(&x, &b.attn_norm_vals, eps, &mut xn);
            Linear::forward_quantized(
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
            self.attend_small(pool, kv, li, &q, seqs, &mut att);
            Linear::forward_quantized(pool, &att, n, &mut [(&b.o, &mut y)])?;
            add_into(&mut x, &y);
            rms_norm(&x, &b.ffn_norm_vals, eps, &mut xn);
            Linear::forward_quantized(pool, &xn, n, &mut [(&b.gate, &mut gate), (&b.up, &mut up)])?;
            for (g, u) in gate.iter_mut().zip(&up) {
                *g = *g / (1.0 + (-*g).exp()) * u;
            }
            Linear::forward_quantized(pool, &gate, n, &mut [(&b.down, &mut y)])?;
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
        Linear::forward_quantized(pool, &xs, m, &mut [(&self.lm_head, &mut logits)])?;
        Ok(crate::split_logits(&logits, &counts, self.info.vocab_size))
    }

    /// Causal attention of the batch's queries `q: [n, heads * head_dim]` over each
    /// sequence's context and new slots, read from the pool in place, into `out`.
    fn attend_small(
        &self,
        pool: &SpinPool,
        kv: &KvStorage,
        layer: usize,
        q: &[f32],
        seqs: &[ForwardSeq<'_>],
        out: &mut [f32],
    ) {
        let (h, kvh, hd) = (self.cfg.heads, self.cfg.kv_heads, self.cfg.head_dim);
        let g = h / kvh;
        let scale = 1.0 / (hd as f32).sqrt();
        let (kw, vw) = (kv.geometry().k_width(), kv.geometry().v_width);
        let mut tasks = Vec::with_capacity(seqs.len() * h);
        let mut row = 0;
        for s in seqs {
            for head in 0..h {
                tasks.push(Task { seq: s, row, head });
            }
            row += s.tokens.len();
        }
        // Task-major scratch: task i owns `t_i * head_dim` values.
        let mut scratch = vec![0f32; row * h * hd];
        {
            let mut pieces = Vec::with_capacity(tasks.len());
            let mut rest = scratch.as_mut_slice();
            for t in &tasks {
                let (a, b) = rest.split_at_mut(t.seq.tokens.len() * hd);
                pieces.push(Mutex::new(a));
                rest = b;
            }
            let (kr, vr) = (kv.k_rows(layer), kv.v_rows(layer));
            pool.run(&|tid, nthreads| {
                let mut scores = Vec::new();
                for (task, piece) in tasks.iter().zip(&pieces).skip(tid).step_by(nthreads) {
                    let mut o = piece.lock().unwrap_or_else(|e| e.into_inner());
                    let s = task.seq;
                    let offs = ((task.head / g) * hd, kw, (task.head / g) * hd, vw);
                    for (i, orow) in o.chunks_exact_mut(hd).enumerate() {
                        let qr = (task.row + i) * h * hd + task.head * hd;
                        let qv = &q[qr..qr + hd];
                        let slots = s.context.iter().chain(&s.new_slots[..=i]).copied();
                        match (kr, vr) {
                            (RowsRef::F32(k), RowsRef::F32(v)) => attend_row(
                                qv,
                                k,
                                v,
                                offs,
                                slots,
                                scale,
                                &mut scores,
                                orow,
                                |x: f32| x,
                            ),
                            (RowsRef::Bf16(k), RowsRef::Bf16(v)) => attend_row(
                                qv,
                                k,
                                v,
                                offs,
                                slots,
                                scale,
                                &mut scores,
                                orow,
                                bf16_to_f32,
                            ),
                            (RowsRef::F16(k), RowsRef::F16(v)) => attend_row(
                                qv,
                                k,
                                v,
                                offs,
                                slots,
                                scale,
                                &mut scores,
                                orow,
                                f16_to_f32,
                            ),
                            _ => unreachable!("key and value rows share one dtype"),
                        }
                    }
                }
            });
        }
        let mut off = 0;
        for t in &tasks {
            let len = t.seq.tokens.len() * hd;
            for (i, src) in scratch[off..off + len].chunks_exact(hd).enumerate() {
                let dst = (t.row + i) * h * hd + t.head * hd;
                out[dst..dst + hd].copy_from_slice(src);
            }
            off += len;
        }
    }
}
