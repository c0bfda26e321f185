//! Linear layers that keep two forms of one weight: f32 for matrix-matrix products
//! (prefill, where compute dominates and candle's f32 GEMM is fast), and the quantized form
//! for products with few rows (decode), where reading fewer bytes is what counts.

use crate::error::Result;
use crate::gguf::GgufFile;
use crate::qmatmul::QMatrix;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

/// A linear layer `y = x W^T + b`.
pub struct Linear {
    w: Tensor,
    q: Option<QMatrix>,
    b: Option<Tensor>,
}

/// Rows at or below this count use the quantized weights when they exist.
const QUANTIZED_MAX_ROWS: usize = 16;

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
        Ok(Self { w, q, b })
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
