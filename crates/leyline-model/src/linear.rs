//! Linear layers that keep two forms of one weight: f32 for matrix-matrix products
//! (prefill), and the quantized form for matrix-vector products (decode), where reading
//! fewer bytes is what counts.

use crate::error::Result;
use crate::gguf::GgufFile;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use std::sync::Arc;

/// A linear layer `y = x W^T + b`.
pub struct Linear {
    w: Tensor,
    q: Option<QMatMul>,
    b: Option<Tensor>,
}

/// Rows at or below this count use the quantized weights when they exist.
const QUANTIZED_MAX_ROWS: usize = 0;

impl Linear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` when present).
    ///
    /// # Errors
    /// Missing or unreadable tensors.
    pub fn load(f: &mut GgufFile, prefix: &str) -> Result<Self> {
        let q = f.tensor(&format!("{prefix}.weight"))?;
        let w = q.dequantize(&Device::Cpu)?;
        let bias = format!("{prefix}.bias");
        let b = if f.has_tensor(&bias) { Some(f.tensor(&bias)?.dequantize(&Device::Cpu)?) } else { None };
        Self::from_parts(w, Some(Arc::new(q)), b)
    }

    /// Builds a layer from an f32 weight `[out, in]`, its quantized form and a bias.
    ///
    /// # Errors
    /// A quantized form that candle cannot wrap.
    pub fn from_parts(w: Tensor, q: Option<Arc<QTensor>>, b: Option<Tensor>) -> Result<Self> {
        let q = match q {
            Some(q) if !matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) => Some(QMatMul::from_arc(q)?),
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
            Some(q) if rows <= QUANTIZED_MAX_ROWS => q.forward(x)?,
            _ => x.matmul(&self.w.t()?)?,
        };
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}
