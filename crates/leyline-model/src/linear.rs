//! Linear layers that keep two forms of one weight: f32 for matrix-matrix products
//! (prefill, where compute dominates and candle's f32 GEMM is fast), and the quantized form
//! for products with few rows (decode), where reading fewer bytes is what counts.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::pool::SpinPool;
use crate::qmatmul::QMatrix;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// A linear layer `y = x W^T + b`.
pub struct Linear {
    w: Tensor,
    q: Option<QMatrix>,
    b: Option<Tensor>,
    /// The bias as plain values, for the quantized path.
    b_vals: Option<Vec<f32>>,
}

/// Rows at or below this count use the quantized weights when they exist. Measured on
/// SmolLM2-135M (2 threads, AVX-512): one forward of 17 / 32 / 64 tokens took 46 / 122 / 277 ms
/// on the quantized kernels against 216 / 268 / 332 ms through the f32 GEMM, which streams the
/// dequantized weights (4x the bytes); at 128 tokens the GEMM wins (493 against 672 ms).
pub(crate) const QUANTIZED_MAX_ROWS: usize = 64;

impl Linear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` when present).
    ///
    /// # Errors
    /// Missing or unreadable tensors.
    pub fn load(f: &mut GgufFile, prefix: &str) -> Result<Self> {
        let q = f.tensor(&format!("{prefix}.weight"))?;
        let w = q.dequantize(&Device::Cpu)?;
        let bias = format!("{prefix}.bias");
        let b = if f.has_tensor(&bias) {
            Some(f.tensor(&bias)?.dequantize(&Device::Cpu)?)
        } else {
            None
        };
        Self::from_parts(w, Some(&q), b)
    }

    /// Builds a layer from an f32 weight `[out, in]`, its quantized form and a bias.
    ///
    /// # Errors
    /// A quantized form that candle cannot wrap.
    pub fn from_parts(w: Tensor, q: Option<&QTensor>, b: Option<Tensor>) -> Result<Self> {
        let q = match q {
            Some(q) if matches!(q.dtype(), GgmlDType::Q4_1 | GgmlDType::Q8_0) => {
                Some(QMatrix::from_qtensor(q)?)
            }
            _ => None,
        };
        let b_vals = match &b {
            Some(b) => Some(b.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        Ok(Self { w, q, b, b_vals })
    }

    /// Whether the layer keeps a quantized form (so [`Self::forward_quantized`] applies).
    pub fn is_quantized(&self) -> bool {
        self.q.is_some()
    }

    /// `y_i = x W_i^T + b_i` for layers sharing the input `x: [m, in]`, on the quantized
    /// weights, in one region of `pool`.
    ///
    /// # Errors
    /// [`ModelError::Input`] when a layer has no quantized form.
    ///
    /// # Panics
    /// When `x` or a `y_i` has the wrong length.
    pub fn forward_quantized(
        pool: &SpinPool,
        x: &[f32],
        m: usize,
        layers: &mut [(&Linear, &mut [f32])],
    ) -> Result<()> {
        let mut jobs = Vec::with_capacity(layers.len());
        for (l, y) in layers.iter_mut() {
            let q = l.q.as_ref().ok_or_else(|| {
                ModelError::Input("layer has no quantized weights for the decode path".into())
            })?;
            jobs.push((q, &mut **y));
        }
        QMatrix::matmul_many(pool, x, m, &mut jobs);
        for (l, y) in layers.iter_mut() {
            if let Some(b) = &l.b_vals {
                for row in y.chunks_exact_mut(b.len()) {
                    for (o, bi) in row.iter_mut().zip(b) {
                        *o += bi;
                    }
                }
            }
        }
        Ok(())
    }

    /// `x: [rows, in]` to `[rows, out]`.
    ///
    /// # Errors
    /// Shape mismatch.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let y = match &self.q {
            Some(q) if rows <= QUANTIZED_MAX_ROWS => {
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let mut y = vec![0f32; rows * q.rows()];
                q.matmul(&xs, rows, &mut y);
                Tensor::from_vec(y, (rows, q.rows()), &Device::Cpu)?
            }
            _ => x.matmul(&self.w.t()?)?,
        };
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
