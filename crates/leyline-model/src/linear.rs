//! Linear layers and embedding tables. A quantized weight is kept only as its file's blocks:
//! products with few rows (decode) run the quantized kernels, products with many rows
//! (prefill) dequantize chunks of it into gemm ([`QMatrix::matmul_wide`]). A weight stored as
//! f32 (or in a format without kernels, dequantized at load) runs gemm.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::quant::{ggml_kind, load_qmatrix, qmatrix, stored_qmatrix};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Storage, Tensor};
use leyline_kernels::gemm::gemm_into;
use leyline_kernels::mem::HugeBuf;
use leyline_kernels::panel::Panels;
use leyline_kernels::pool::SpinPool;
use leyline_kernels::qmatmul::{activations, Activations, QMatrix};

/// A linear layer `y = x W^T + b`.
pub struct Linear {
    w: Weight,
    out: usize,
    inp: usize,
    b: Option<Vec<f32>>,
}

/// A layer's weight: f32, or quantized matrices whose rows, side by side, are its outputs
/// (one matrix, or the parts of a [`FusedLinear`]).
enum Weight {
    F32(F32Weight),
    Quant(Vec<QMatrix>),
}

/// The f32 form of a weight `W: [out, in]`.
enum F32Weight {
    /// `W` column-major (`W^T` stored row-major): gemm reads 16-row panels of it in place.
    /// Row-major, gemm packed the whole weight again on every call: a [1536, 576] product
    /// of 17 / 128 / 512 rows took 1.16 / 3.98 / 11.1 ms that way against 0.61 / 3.51 / 11.3
    /// ms in place (1 thread, hot caches), and SmolLM2's prefill of 128 tokens gained 12%.
    ColMajor(HugeBuf<f32>),
    /// `W` in panels of 64 outputs, streamed as they lie by [`Panels::matmul`]; where the
    /// kernels run AVX-512 ([`Panels::available`]), instead of `ColMajor`.
    Panels(Panels),
    /// Row-major, shared with an embedding table (a tied head); packed per call.
    Shared(Tensor),
}

impl F32Weight {
    /// The form this CPU multiplies fastest, from `W` column-major.
    fn owned(wt: HugeBuf<f32>, out: usize, inp: usize) -> Self {
        if Panels::available() {
            Self::Panels(Panels::from_col_major(&wt, out, inp))
        } else {
            Self::ColMajor(wt)
        }
    }

    /// `y: [m, out] = x: [m, inp] W^T`.
    fn matmul(&self, out: usize, inp: usize, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        let threads = rayon::current_num_threads();
        match self {
            F32Weight::ColMajor(wt) => gemm_into(out, inp, wt, (1, out), x, m, y, threads),
            F32Weight::Panels(p) => p.matmul(SpinPool::global(), x, m, y),
            F32Weight::Shared(t) => with_f32_rows(t, |w| {
                gemm_into(out, inp, w, (inp, 1), x, m, y, threads);
            })?,
        }
        Ok(())
    }
}

/// On f32 activations (the reference path), a sequence that brings at most this many rows to
/// a batch runs them through the few-row f32 kernels ([`QMatrix::matmul_concat`]); more rows
/// take the dequantize-then-gemm product ([`QMatrix::matmul_wide`]). 32: where the f32
/// dot-product tiles crossed over with gemm. On 8-bit activations (the default) every row
/// takes [`QMatrix::matmul_concat`], whose integer kernels serve any row count.
pub const FEW_ROWS: usize = 32;

/// Which product a batch's rows take on f32 activations (the reference path): the few-row
/// kernels or the wide one, by the batch's row count. On 8-bit activations (the default)
/// every row takes the integer kernels, each row's bits its own whatever the batch, and the
/// split is not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowSplit {
    /// All `m` rows through the few-row kernels.
    Few(usize),
    /// All `m` rows through the wide product.
    Wide(usize),
}

impl RowSplit {
    /// `m` rows of one sequence (or of callers that do not batch).
    pub fn uniform(m: usize) -> Self {
        if m <= FEW_ROWS {
            Self::Few(m)
        } else {
            Self::Wide(m)
        }
    }

    /// Rows in all.
    pub fn len(&self) -> usize {
        match self {
            Self::Few(m) | Self::Wide(m) => *m,
        }
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Linear {
    /// Loads `{prefix}.weight` (and `{prefix}.bias` when present): a quantized weight keeps
    /// its blocks ([`Self::from_qtensor`]).
    ///
    /// # Errors
    /// Missing or unreadable tensors.
    pub fn load(f: &mut GgufFile, prefix: &str) -> Result<Self> {
        let bias = format!("{prefix}.bias");
        let b = if f.has_tensor(&bias) {
            Some(f.tensor(&bias)?.dequantize(&Device::Cpu)?)
        } else {
            None
        };
        let name = format!("{prefix}.weight");
        match load_qmatrix(f, &name)? {
            Some(q) => Self::from_qmatrix(q, b),
            None => Self::from_qtensor(&f.tensor(&name)?, b),
        }
    }

    /// A layer on a GGUF tensor `[out, in]`: its quantized blocks when [`QMatrix`] knows the
    /// format, else its values as f32.
    ///
    /// # Errors
    /// A tensor that is not 2-D, a bias of the wrong length, unreadable data.
    pub fn from_qtensor(q: &QTensor, b: Option<Tensor>) -> Result<Self> {
        if ggml_kind(q.dtype()).is_some() {
            Self::from_qmatrix(qmatrix(q)?, b)
        } else {
            Self::from_f32(q.dequantize(&Device::Cpu)?, b)
        }
    }

    /// A layer on a quantized matrix `[out, in]`.
    ///
    /// # Errors
    /// A bias of the wrong length.
    pub fn from_qmatrix(q: QMatrix, b: Option<Tensor>) -> Result<Self> {
        let (out, inp) = (q.rows(), q.cols());
        Self::build(Weight::Quant(vec![q]), out, inp, b)
    }

    /// A layer on an f32 weight `[out, in]`, of which it keeps its own transposed copy.
    ///
    /// # Errors
    /// A weight that is not a 2-D f32 tensor, or a bias of the wrong length.
    pub fn from_f32(w: Tensor, b: Option<Tensor>) -> Result<Self> {
        let (out, inp) = w.dims2()?;
        let t = w.t()?.contiguous()?;
        let mut wt = HugeBuf::zeroed(out * inp);
        with_f32_rows(&t, |src| wt.copy_from_slice(src))?;
        Self::build(Weight::F32(F32Weight::owned(wt, out, inp)), out, inp, b)
    }

    /// A head tied to an f32 embedding table `embed: [vocab, hidden]`, sharing its storage.
    /// (A quantized table is shared through [`Self::from_qmatrix`] and
    /// [`Embedding::Quant`].)
    ///
    /// # Errors
    /// A table that is not f32 or not 2-D.
    pub fn tied(embed: &Tensor) -> Result<Self> {
        let (out, inp) = embed.dims2()?;
        if embed.dtype() != DType::F32 {
            return Err(ModelError::Input(format!(
                "a tied head needs an f32 embedding table, not {:?}",
                embed.dtype()
            )));
        }
        let w = Weight::F32(F32Weight::Shared(embed.contiguous()?));
        Self::build(w, out, inp, None)
    }

    fn build(w: Weight, out: usize, inp: usize, b: Option<Tensor>) -> Result<Self> {
        let b = match b {
            Some(b) => Some(b.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        if let Some(b) = &b {
            if b.len() != out {
                return Err(ModelError::Input(format!(
                    "bias of length {} for a layer with {out} outputs",
                    b.len()
                )));
            }
        }
        Ok(Self { w, out, inp, b })
    }

    /// The quantized matrices of the layer, in output order (none for an f32 weight): for
    /// [`QMatrix::share_pages`].
    pub(crate) fn quantized_mut(&mut self) -> impl Iterator<Item = &mut QMatrix> {
        let mats = match &mut self.w {
            Weight::Quant(q) => Some(q),
            Weight::F32(_) => None,
        };
        mats.into_iter().flatten()
    }

    /// The quantized matrix of a layer that has exactly one.
    pub(crate) fn quantized(&self) -> Option<&QMatrix> {
        match &self.w {
            Weight::Quant(q) if q.len() == 1 => q.first(),
            _ => None,
        }
    }

    /// Output width.
    pub fn out(&self) -> usize {
        self.out
    }

    /// Input width.
    pub fn inp(&self) -> usize {
        self.inp
    }

    fn check_lengths(&self, x: &[f32], m: usize, y: &[f32]) -> Result<()> {
        if x.len() != m * self.inp || y.len() != m * self.out {
            return Err(ModelError::Input(format!(
                "linear layer [{}, {}]: input of {} values and output of {} for {m} rows",
                self.out,
                self.inp,
                x.len(),
                y.len()
            )));
        }
        Ok(())
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.b {
            for row in y.chunks_exact_mut(self.out) {
                for (o, bi) in row.iter_mut().zip(b) {
                    *o += bi;
                }
            }
        }
    }

    /// `x: [rows, in]` to `[rows, out]`.
    ///
    /// # Errors
    /// `x` is not an f32 matrix of width `in`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let mut y = vec![0f32; rows * self.out];
        self.forward_rows(&xs, rows, &mut y)?;
        Ok(Tensor::from_vec(y, (rows, self.out), &Device::Cpu)?)
    }

    /// `y: [m, out] = x: [m, in] W^T + b`: quantized weights through the integer kernels (on
    /// f32 activations: the few-row kernels up to [`FEW_ROWS`] rows, the wide product above);
    /// f32 weights through gemm.
    /// Products run on the global [`SpinPool`] (gemm: rayon's pool).
    ///
    /// # Errors
    /// Wrong lengths of `x` or `y`.
    pub fn forward_rows(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        self.forward_split(x, &RowSplit::uniform(m), y)
    }

    /// [`Self::forward_rows`] with the rows' kernels on f32 activations chosen by `split`.
    ///
    /// # Errors
    /// Wrong lengths of `x` or `y`.
    pub fn forward_split(&self, x: &[f32], split: &RowSplit, y: &mut [f32]) -> Result<()> {
        let m = split.len();
        self.check_lengths(x, m, y)?;
        match &self.w {
            Weight::Quant(q) => {
                let mats: Vec<&QMatrix> = q.iter().collect();
                let pool = SpinPool::global();
                match split {
                    // On 8-bit activations the integer kernels serve any row count.
                    _ if activations() == Activations::Int8 => {
                        QMatrix::matmul_concat(pool, x, m, &mats, y)
                    }
                    RowSplit::Few(_) => QMatrix::matmul_concat(pool, x, m, &mats, y),
                    RowSplit::Wide(_) => QMatrix::matmul_wide(pool, x, m, &mats, y),
                }
            }
            Weight::F32(w) => w.matmul(self.out, self.inp, x, m, y)?,
        }
        self.add_bias(y);
        Ok(())
    }

    /// The weight column-major (`[in, out]`) in f32.
    fn to_col_major(&self) -> Result<Vec<f32>> {
        let (out, inp) = (self.out, self.inp);
        Ok(match &self.w {
            Weight::F32(F32Weight::ColMajor(wt)) => wt.to_vec(),
            Weight::F32(F32Weight::Panels(p)) => p.to_col_major(),
            Weight::F32(F32Weight::Shared(_)) => {
                return Err(ModelError::Input("a shared weight cannot be fused".into()))
            }
            Weight::Quant(q) => {
                let mut rows = vec![0f32; out * inp];
                let mut at = 0;
                for p in q {
                    let part = &mut rows[at * inp..(at + p.rows()) * inp];
                    p.dequantize_rows(0, part);
                    at += p.rows();
                }
                let mut wt = vec![0f32; out * inp];
                for (i, row) in rows.chunks_exact(inp).enumerate() {
                    for (k, &v) in row.iter().enumerate() {
                        wt[k * out + i] = v;
                    }
                }
                wt
            }
        })
    }
}

/// Layers that read one input (Q/K/V, gate/up), run as one product: each row's input is
/// read once and the threads split one wide product instead of three narrow ones.
pub struct FusedLinear(Linear);

impl FusedLinear {
    /// Fuses layers of equal input width. Quantized parts stay as they are, side by side;
    /// if some part is f32, every part becomes one concatenated f32 matrix. A part without
    /// a bias adds zeros when another has one.
    ///
    /// # Errors
    /// No parts, input widths that differ, or a part whose weight is shared (a tied head).
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let Some(inp) = parts.first().map(|p| p.inp) else {
            return Err(ModelError::Input("fusing zero layers".into()));
        };
        if let Some(p) = parts.iter().find(|p| p.inp != inp) {
            return Err(ModelError::Input(format!(
                "fusing layers of input widths {inp} and {}",
                p.inp
            )));
        }
        let out: usize = parts.iter().map(|p| p.out).sum();
        let b = parts.iter().any(|p| p.b.is_some()).then(|| {
            parts
                .iter()
                .flat_map(|p| match &p.b {
                    Some(b) => b.clone(),
                    None => vec![0.0; p.out],
                })
                .collect()
        });
        let w = if parts.iter().all(|p| matches!(p.w, Weight::Quant(_))) {
            let mut mats = Vec::new();
            for p in parts {
                if let Weight::Quant(q) = p.w {
                    mats.extend(q);
                }
            }
            Weight::Quant(mats)
        } else {
            let mut cols = Vec::with_capacity(parts.len());
            for p in &parts {
                cols.push((p.out, p.to_col_major()?));
            }
            drop(parts);
            // Column-major W^T is [in, out] row-major: row k of the whole is row k of each part.
            let mut wt = HugeBuf::zeroed(inp * out);
            for (k, row) in wt.chunks_exact_mut(out).enumerate() {
                let mut col = 0;
                for (o, c) in &cols {
                    row[col..col + o].copy_from_slice(&c[k * o..(k + 1) * o]);
                    col += o;
                }
            }
            Weight::F32(F32Weight::owned(wt, out, inp))
        };
        Ok(Self(Linear { w, out, inp, b }))
    }

    /// The parts' quantized forms, in order (for [`QMatrix::share_pages`]).
    pub(crate) fn quantized_mut(&mut self) -> impl Iterator<Item = &mut QMatrix> {
        self.0.quantized_mut()
    }

    /// Total output width (the parts' widths summed).
    pub fn out(&self) -> usize {
        self.0.out
    }

    /// `y: [m, out] = x: [m, in] [W_0 | W_1 | ...]^T + [b_0 | b_1 | ...]`: each row of `y`
    /// holds the parts' outputs side by side, in the order they were fused.
    ///
    /// # Errors
    /// Wrong lengths of `x` or `y`.
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        self.0.forward_rows(x, m, y)
    }

    /// [`Self::forward`] with the rows' kernels on f32 activations chosen by `split`.
    ///
    /// # Errors
    /// Wrong lengths of `x` or `y`.
    pub fn forward_split(&self, x: &[f32], split: &RowSplit, y: &mut [f32]) -> Result<()> {
        self.0.forward_split(x, split, y)
    }
}

/// An embedding table `[vocab, hidden]`, read a row per token.
pub enum Embedding {
    /// f32 values, row-major (a tied head may share them: [`Linear::tied`]).
    F32(Tensor),
    /// Quantized rows, dequantized as they are read.
    Quant(QMatrix),
}

impl Embedding {
    /// A table `name` that is only read by rows (not also the output head): left where the
    /// file stores it when the kernels read its format in place, else as [`Self::load`].
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn load_stored(f: &mut GgufFile, name: &str) -> Result<Self> {
        match stored_qmatrix(f, name)? {
            Some(q) => Ok(Self::Quant(q)),
            None => Self::load(f, name),
        }
    }

    /// The table `name` of a GGUF file: its blocks when [`QMatrix`] knows the format, else
    /// f32.
    ///
    /// # Errors
    /// A missing tensor, one that is not 2-D, or unreadable data.
    pub fn load(f: &mut GgufFile, name: &str) -> Result<Self> {
        match load_qmatrix(f, name)? {
            Some(q) => Ok(Self::Quant(q)),
            None => Self::from_qtensor(&f.tensor(name)?),
        }
    }

    /// The table of a GGUF tensor: its blocks when [`QMatrix`] knows the format, else f32.
    ///
    /// # Errors
    /// A tensor that is not 2-D, or unreadable data.
    pub fn from_qtensor(t: &QTensor) -> Result<Self> {
        if ggml_kind(t.dtype()).is_some() {
            Ok(Self::Quant(qmatrix(t)?))
        } else {
            let e = t.dequantize(&Device::Cpu)?;
            e.dims2()?;
            Ok(Self::F32(e))
        }
    }

    /// `(vocab, hidden)`.
    pub fn dims(&self) -> (usize, usize) {
        match self {
            Self::F32(t) => {
                let d = t.dims();
                (d[0], d[1])
            }
            Self::Quant(q) => (q.rows(), q.cols()),
        }
    }

    /// Appends the rows of `tokens` to `x`.
    ///
    /// # Errors
    /// A token outside the table.
    pub fn gather(&self, tokens: &[u32], x: &mut Vec<f32>) -> Result<()> {
        let (vocab, hid) = self.dims();
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "token {t} is outside the embedding table of {vocab} rows"
            )));
        }
        match self {
            Self::F32(table) => with_f32_rows(table, |table| {
                for &t in tokens {
                    let t = t as usize;
                    x.extend_from_slice(&table[t * hid..(t + 1) * hid]);
                }
            }),
            Self::Quant(q) => {
                let at = x.len();
                x.resize(at + tokens.len() * hid, 0.0);
                for (&t, row) in tokens.iter().zip(x[at..].chunks_exact_mut(hid)) {
                    q.dequantize_rows(t as usize, row);
                }
                Ok(())
            }
        }
    }
}

/// Runs `f` on the values of a contiguous f32 CPU tensor in place (row-major), without the
/// copy that `to_vec` makes: a tied head's or the embedding's table, a weight being loaded.
///
/// # Errors
/// A tensor that is not on the CPU, not f32 or not contiguous.
pub(crate) fn with_f32_rows<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(ModelError::Input(
            "an f32 weight or table must live on the CPU".into(),
        ));
    };
    let Some((start, end)) = layout.contiguous_offsets() else {
        return Err(ModelError::Input(
            "an f32 weight or table must be contiguous".into(),
        ));
    };
    Ok(f(&cpu.as_slice::<f32>()?[start..end]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;
    use leyline_kernels::qmatmul::GgmlKind;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    /// `x W^T + b` in f64, one dot product at a time.
    fn reference(w: &[f32], b: &[f32], x: &[f32], m: usize, out: usize, inp: usize) -> Vec<f64> {
        let mut y = Vec::with_capacity(m * out);
        for r in 0..m {
            for o in 0..out {
                let dot: f64 = (0..inp)
                    .map(|k| f64::from(x[r * inp + k]) * f64::from(w[o * inp + k]))
                    .sum();
                y.push(dot + f64::from(b[o]));
            }
        }
        y
    }

    #[test]
    fn both_weight_layouts_match_a_scalar_reference_at_every_row_count() {
        // Widths that are not multiples of gemm's panels, so edge tiles run too.
        let (out, inp) = (70, 45);
        let w = values(out * inp, 1);
        let b = values(out, 2);
        let wt = Tensor::from_vec(w.clone(), (out, inp), &Device::Cpu).unwrap();
        let bt = Tensor::from_vec(b.clone(), out, &Device::Cpu).unwrap();
        let owned = Linear::from_f32(wt.clone(), Some(bt.clone())).unwrap();
        // gemm on the column-major weight, which `owned` holds only without AVX-512.
        let mut cm = HugeBuf::zeroed(out * inp);
        for (k, row) in cm.chunks_exact_mut(out).enumerate() {
            for (i, v) in row.iter_mut().enumerate() {
                *v = w[i * inp + k];
            }
        }
        let col_major =
            Linear::build(Weight::F32(F32Weight::ColMajor(cm)), out, inp, Some(bt)).unwrap();
        let tied = Linear::tied(&wt).unwrap();
        for m in [1, 3, 16, 17, 64, 65, 97, 130] {
            let x = values(m * inp, 3 + m as u64);
            let want = reference(&w, &b, &x, m, out, inp);
            let zero = vec![0f32; out];
            let want_tied = reference(&w, &zero, &x, m, out, inp);
            for (layer, want) in [(&owned, &want), (&col_major, &want), (&tied, &want_tied)] {
                let mut y = vec![f32::NAN; m * out];
                layer.forward_rows(&x, m, &mut y).unwrap();
                for (i, (&got, &exp)) in y.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (f64::from(got) - exp).abs() <= 1e-5 * (1.0 + exp.abs()),
                        "m = {m}, output {i}: {got} vs {exp}"
                    );
                }
            }
        }
        let mut y = vec![0f32; 2 * out];
        assert!(owned.forward_rows(&values(inp, 9), 2, &mut y).is_err());
    }

    /// `x: [.., inp]` as a product with `kind` weights reads it.
    fn reads(kind: leyline_kernels::qmatmul::GgmlKind, x: &[f32], inp: usize) -> Vec<f32> {
        leyline_kernels::qmatmul::activations_as_read(kind, x, inp)
    }

    #[test]
    fn fused_parts_match_a_scalar_reference_on_both_paths() {
        // Q8_0 parts (widths of 32) so both the quantized path (m <= 32 or 96) and the GEMM run, on
        // the same dequantized weights; the middle part has no bias.
        let inp = 64;
        let outs = [40, 24, 72];
        let mut parts = Vec::new();
        let mut refs = Vec::new();
        for (i, &out) in outs.iter().enumerate() {
            let t = Tensor::from_vec(values(out * inp, 10 + i as u64), (out, inp), &Device::Cpu)
                .unwrap();
            let q = QTensor::quantize(&t, GgmlDType::Q8_0).unwrap();
            let w = q.dequantize(&Device::Cpu).unwrap();
            let b = (i != 1).then(|| values(out, 20 + i as u64));
            let bt = b
                .clone()
                .map(|b| Tensor::from_vec(b, out, &Device::Cpu).unwrap());
            refs.push((
                w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                b.unwrap_or_else(|| vec![0.0; out]),
            ));
            parts.push(Linear::from_qtensor(&q, bt).unwrap());
        }
        let fused = FusedLinear::new(parts).unwrap();
        let width: usize = outs.iter().sum();
        assert_eq!(fused.out(), width);
        for m in [1, 5, 32, 33, 70, 97, 130] {
            let x = values(m * inp, 30 + m as u64);
            let mut y = vec![f32::NAN; m * width];
            fused.forward(&x, m, &mut y).unwrap();
            let x = reads(GgmlKind::Q8_0, &x, inp);
            let mut col = 0;
            for ((w, b), &out) in refs.iter().zip(&outs) {
                let want = reference(w, b, &x, m, out, inp);
                for (i, &exp) in want.iter().enumerate() {
                    let got = y[i / out * width + col + i % out];
                    assert!(
                        (f64::from(got) - exp).abs() <= 1e-5 * (1.0 + exp.abs()),
                        "m = {m}, part at column {col}, output {i}: {got} vs {exp}"
                    );
                }
                col += out;
            }
        }
        let mut short = vec![0f32; width - 1];
        assert!(fused.forward(&values(inp, 1), 1, &mut short).is_err());
        let narrow = Linear::from_f32(
            Tensor::from_vec(values(8 * 32, 2), (8, 32), &Device::Cpu).unwrap(),
            None,
        )
        .unwrap();
        let wide = Linear::from_f32(
            Tensor::from_vec(values(8 * 64, 3), (8, 64), &Device::Cpu).unwrap(),
            None,
        )
        .unwrap();
        assert!(FusedLinear::new(vec![narrow, wide]).is_err());
    }

    #[test]
    fn every_format_of_the_model_files_decodes_from_its_quantized_blocks() {
        // The kinds of Qwen2.5's Q4_K_M files (Q4_K, Q6_K, Q5_0, Q8_0) and their families:
        // each layer and each fused part keeps its blocks, and decode-sized products read
        // them (equal to the f32 weights' products up to f32 reordering).
        let (out, inp) = (40, 512);
        let kinds = [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ];
        let mut parts = Vec::new();
        let mut refs = Vec::new();
        for (i, &dt) in kinds.iter().enumerate() {
            let t = Tensor::from_vec(values(out * inp, 40 + i as u64), (out, inp), &Device::Cpu)
                .unwrap();
            let q = QTensor::quantize(&t, dt).unwrap();
            let w = q.dequantize(&Device::Cpu).unwrap();
            let layer = Linear::from_qtensor(&q, None).unwrap();
            let qm = layer.quantized().expect("a quantized form");
            assert_eq!(Some(qm.kind()), ggml_kind(dt), "{dt:?}");
            let wv = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for m in [1, 3, 32] {
                let x = values(m * inp, 50 + m as u64);
                let mut y = vec![f32::NAN; m * out];
                layer.forward_rows(&x, m, &mut y).unwrap();
                let xr = reads(qm.kind(), &x, inp);
                let want = reference(&wv, &vec![0.0; out], &xr, m, out, inp);
                for (j, (&got, &exp)) in y.iter().zip(&want).enumerate() {
                    assert!(
                        (f64::from(got) - exp).abs() <= 1e-5 * (1.0 + exp.abs()),
                        "{dt:?} m = {m}, output {j}: {got} vs {exp}"
                    );
                }
            }
            parts.push(layer);
            refs.push(wv);
        }
        let mut fused = FusedLinear::new(parts).unwrap();
        assert_eq!(fused.quantized_mut().count(), kinds.len());
        let width = out * kinds.len();
        let x = values(inp, 60);
        let mut y = vec![f32::NAN; width];
        fused.forward(&x, 1, &mut y).unwrap();
        for (p, w) in refs.iter().enumerate() {
            let kind = ggml_kind(kinds[p]).expect("a kernel kind");
            let want = reference(w, &vec![0.0; out], &reads(kind, &x, inp), 1, out, inp);
            for (j, &exp) in want.iter().enumerate() {
                let got = y[p * out + j];
                assert!(
                    (f64::from(got) - exp).abs() <= 1e-5 * (1.0 + exp.abs()),
                    "fused part {p}, output {j}: {got} vs {exp}"
                );
            }
        }
    }
}
