//! Norms and the residual add, on row-major `f32` buffers.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use std::ops::Range;

/// `out = x / rms(x) * w`, row by row (rows of `w.len()`).
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / d as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

/// RMSNorm of each head in place: in every `stride`-wide row of `x`, the values `span` are
/// cut into heads of `w.len()` values, each normalized by `w` (Qwen3's and Gemma 3's Q/K
/// norms: one weight vector shared by all heads of a kind; OLMo 2's: one head spanning
/// them all).
pub(crate) fn rms_norm_heads(
    x: &mut [f32],
    stride: usize,
    span: Range<usize>,
    w: &[f32],
    eps: f32,
) {
    let d = w.len();
    debug_assert_eq!(span.len() % d, 0, "a span of whole heads");
    let mut tmp = vec![0f32; d];
    for row in x.chunks_exact_mut(stride) {
        for h in row[span.clone()].chunks_exact_mut(d) {
            rms_norm(h, w, eps, &mut tmp);
            h.copy_from_slice(&tmp);
        }
    }
}

/// `acc += y`.
pub(crate) fn add_into(acc: &mut [f32], y: &[f32]) {
    for (a, b) in acc.iter_mut().zip(y) {
        *a += b;
    }
}

/// A norm's weight vector `name`, as f32, of `width` values.
///
/// # Errors
/// Missing or unreadable tensor, or another length.
pub(crate) fn load_norm(f: &mut GgufFile, name: &str, width: usize) -> Result<Vec<f32>> {
    let v = f.tensor_f32(name)?;
    if v.len() != width {
        return Err(ModelError::File {
            path: f.path().to_path_buf(),
            reason: format!(
                "tensor {name} has {} values; the model needs {width}",
                v.len()
            ),
        });
    }
    Ok(v)
}

/// Layer `layer`'s norm `blk.{layer}.{name}.weight`, of `width` values.
///
/// # Errors
/// As [`load_norm`].
pub(crate) fn load_layer_norm(
    f: &mut GgufFile,
    layer: usize,
    name: &str,
    width: usize,
) -> Result<Vec<f32>> {
    load_norm(f, &format!("blk.{layer}.{name}.weight"), width)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the definition in f64: `x_i / sqrt(mean(x^2) + eps) * w_i`, per head.
    #[test]
    fn head_norm_normalizes_each_head_alone() {
        let (d, stride) = (4, 14);
        let x: Vec<f32> = (0..2 * stride)
            .map(|i| (i as f32 * 0.37).sin() * 3.0)
            .collect();
        let w = [0.5f32, 1.0, 1.5, 2.0];
        let mut y = x.clone();
        rms_norm_heads(&mut y, stride, d..3 * d, &w, 1e-6);
        for r in 0..2 {
            for i in 0..stride {
                let at = r * stride + i;
                let in_heads = (d..3 * d).contains(&i);
                if !in_heads {
                    assert_eq!(y[at], x[at], "row {r} dim {i} untouched");
                    continue;
                }
                let h0 = r * stride + i / d * d;
                let ms: f64 = x[h0..h0 + d]
                    .iter()
                    .map(|&v| (v as f64).powi(2))
                    .sum::<f64>()
                    / d as f64;
                let want = x[at] as f64 / (ms + 1e-6).sqrt() * w[i % d] as f64;
                assert!(
                    (y[at] as f64 - want).abs() < 1e-5,
                    "row {r} dim {i}: {} vs {want}",
                    y[at]
                );
            }
        }
    }
}
