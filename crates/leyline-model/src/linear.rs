//! Linear layers that keep two forms of one weight: f32 for matrix-matrix products
//! (prefill, where compute dominates), and the quantized form for products with few rows
//! (decode), where reading fewer bytes is what counts.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::panel::Panels;
use crate::pool::SpinPool;
use crate::qmatmul::{GgmlKind, KernelPath, QMatrix};
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Storage, Tensor};
use leyline_kv::mem::HugeBuf;

/// A linear layer `y = x W^T + b`.
pub struct Linear {
    w: F32Weight,
    out: usize,
    inp: usize,
    q: Option<QMatrix>,
    b: Option<Vec<f32>>,
}

/// The f32 form of a weight `W: [out, in]`.
enum F32Weight {
    /// `W` column-major (`W^T` stored row-major): gemm reads 16-row panels of it in place.
    /// Row-major, gemm packed the whole weight again on every call: a [1536, 576] product
    /// of 17 / 128 / 512 rows took 1.16 / 3.98 / 11.1 ms that way against 0.61 / 3.51 / 11.3
    /// ms in place (1 thread, hot caches), and SmolLM2's prefill of 128 tokens gained 12%.
    ColMajor(HugeBuf<f32>),
    /// `W` in panels of 64 outputs, streamed as they lie by [`Panels::matmul`]; where the CPU
    /// has AVX-512F, instead of `ColMajor`.
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
}

/// Rows at or below this count use the quantized weights when they exist. With AVX-512 the
/// quantized products broadcast weights against 16-32 activation rows at a time, and on
/// SmolLM2-135M (2 threads, weights on huge pages) a prefill of 64 / 96 / 128 tokens ran at
/// 695-705 / 700-714 / 676-727 tok/s that way against 373-400 / 462-480 / 679-741 through
/// the f32 GEMM, which must stream four bytes per weight. Elsewhere the dot-product tiles
/// cross over near 32 rows (1 thread: 24 / 32 / 40 / 64 tokens in 142 / 220 / 260-287 / 421
/// ms against 179 / 213 / 239-244 / 285 ms through the GEMM). The bound is that of the path
/// the kind's products take ([`KernelPath::best_for`]): 32 for a kind without AVX-512 kernels.
pub(crate) fn quantized_max_rows(kind: GgmlKind) -> usize {
    if KernelPath::best_for(kind) == KernelPath::Avx512 {
        96
    } else {
        32
    }
}

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

    /// Builds a layer from an f32 weight `[out, in]`, its quantized form and a bias. The
    /// layer keeps its own transposed copy of `w`.
    ///
    /// # Errors
    /// A weight that is not a 2-D f32 tensor, a bias of the wrong length, or a quantized form
    /// that candle cannot wrap.
    pub fn from_parts(w: Tensor, q: Option<&QTensor>, b: Option<Tensor>) -> Result<Self> {
        let (out, inp) = w.dims2()?;
        let t = w.t()?.contiguous()?;
        let mut wt = HugeBuf::zeroed(out * inp);
        with_f32_rows(&t, |src| wt.copy_from_slice(src))?;
        Self::build(F32Weight::owned(wt, out, inp), out, inp, q, b)
    }

    /// A head tied to the embedding table `embed: [vocab, hidden]`, sharing its storage.
    ///
    /// # Errors
    /// As [`Self::from_parts`].
    pub fn tied(embed: &Tensor, q: Option<&QTensor>) -> Result<Self> {
        let (out, inp) = embed.dims2()?;
        if embed.dtype() != DType::F32 {
            return Err(ModelError::Input(format!(
                "a tied head needs an f32 embedding table, not {:?}",
                embed.dtype()
            )));
        }
        Self::build(F32Weight::Shared(embed.contiguous()?), out, inp, q, None)
    }

    fn build(
        w: F32Weight,
        out: usize,
        inp: usize,
        q: Option<&QTensor>,
        b: Option<Tensor>,
    ) -> Result<Self> {
        let q = match q {
            Some(q) if GgmlKind::from_dtype(q.dtype()).is_some() => Some(QMatrix::from_qtensor(q)?),
            _ => None,
        };
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
        Ok(Self { w, out, inp, q, b })
    }

    /// The quantized form, if the layer has one (for [`QMatrix::share_pages`]).
    pub(crate) fn quantized_mut(&mut self) -> Option<&mut QMatrix> {
        self.q.as_mut()
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

    /// `y: [m, out] = x: [m, in] W^T + b`: on the quantized weights for at most
    /// [`quantized_max_rows`] rows (one region of the global [`SpinPool`]), through the f32
    /// GEMM otherwise.
    ///
    /// # Errors
    /// Wrong lengths of `x` or `y`.
    pub fn forward_rows(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        self.check_lengths(x, m, y)?;
        match &self.q {
            Some(q) if m <= quantized_max_rows(q.kind()) => {
                QMatrix::matmul_concat(SpinPool::global(), x, m, &[q], y)
            }
            _ => match &self.w {
                F32Weight::ColMajor(wt) => {
                    gemm_into(self.out, self.inp, wt, (1, self.out), x, m, y)
                }
                F32Weight::Panels(p) => p.matmul(SpinPool::global(), x, m, y),
                F32Weight::Shared(t) => with_f32_rows(t, |w| {
                    gemm_into(self.out, self.inp, w, (self.inp, 1), x, m, y);
                })?,
            },
        }
        self.add_bias(y);
        Ok(())
    }
}

/// Layers that read one input (Q/K/V, gate/up), run as one product. Their f32 weights are
/// concatenated along the output, so many rows make one product: the threads split one
/// wide product, each row's input read once, instead of three narrow ones. Few rows run the
/// parts' quantized weights in one region of the global [`SpinPool`].
pub struct FusedLinear {
    /// The concatenated f32 weight and bias; no quantized form.
    whole: Linear,
    /// The parts' quantized forms, when every part has one.
    q: Option<Vec<QMatrix>>,
}

impl FusedLinear {
    /// Fuses layers of equal input width. The f32 weights move into one concatenated matrix
    /// (no extra copy is kept); a part without a bias adds zeros when another has one.
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
        let mut cols = Vec::with_capacity(parts.len());
        let mut q = Some(Vec::with_capacity(parts.len()));
        for p in parts {
            match p.w {
                F32Weight::ColMajor(wt) => cols.push((p.out, wt.to_vec())),
                F32Weight::Panels(panels) => cols.push((p.out, panels.to_col_major())),
                F32Weight::Shared(_) => {
                    return Err(ModelError::Input("a shared weight cannot be fused".into()))
                }
            }
            q = q.zip(p.q).map(|(mut v, pq)| {
                v.push(pq);
                v
            });
        }
        // Column-major W^T is [in, out] row-major: row k of the whole is row k of each part.
        let mut wt = HugeBuf::zeroed(inp * out);
        for (k, row) in wt.chunks_exact_mut(out).enumerate() {
            let mut col = 0;
            for (o, c) in &cols {
                row[col..col + o].copy_from_slice(&c[k * o..(k + 1) * o]);
                col += o;
            }
        }
        let whole = Linear {
            w: F32Weight::owned(wt, out, inp),
            out,
            inp,
            q: None,
            b,
        };
        Ok(Self { whole, q })
    }

    /// The parts' quantized forms, in order (for [`QMatrix::share_pages`]).
    pub(crate) fn quantized_mut(&mut self) -> impl Iterator<Item = &mut QMatrix> {
        self.q.iter_mut().flatten()
    }

    /// Total output width (the parts' widths summed).
    pub fn out(&self) -> usize {
        self.whole.out
    }

    /// `y: [m, out] = x: [m, in] [W_0 | W_1 | ...]^T + [b_0 | b_1 | ...]`: each row of `y`
    /// holds the parts' outputs side by side, in the order they were fused. At most
    /// [`quantized_max_rows`] rows run the parts' quantized weights in one pool region.
    ///
    /// # Errors
    /// Wrong lengths of `x` or `y`.
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        self.whole.check_lengths(x, m, y)?;
        match &self.q {
            Some(q) if q.iter().all(|p| m <= quantized_max_rows(p.kind())) => {
                let mats: Vec<&QMatrix> = q.iter().collect();
                QMatrix::matmul_concat(SpinPool::global(), x, m, &mats, y);
                self.whole.add_bias(y);
                Ok(())
            }
            _ => self.whole.forward_rows(x, m, y),
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

/// `y: [m, out] = x: [m, inp] W^T` with `W(i, k) = w[i * rs + k * cs]` for `(rs, cs) =
/// strides`, on gemm's f32 kernels (its run-time dispatch picks AVX-512 where the CPU has it).
///
/// # Panics
/// If a length does not match, or `w` is too short for the strides.
fn gemm_into(
    out: usize,
    inp: usize,
    w: &[f32],
    strides: (usize, usize),
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    let (rs, cs) = strides;
    assert_eq!(x.len(), m * inp, "x must be [m, in]");
    assert_eq!(y.len(), m * out, "y must be [m, out]");
    if m == 0 || out == 0 {
        return;
    }
    if inp == 0 {
        y.fill(0.0);
        return;
    }
    assert!(
        (out - 1) * rs + (inp - 1) * cs < w.len(),
        "weight too short for its strides"
    );
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // gemm's view is column-major: dst = y^T [out, m], lhs = W [out, inp], rhs = x^T [inp, m].
    // SAFETY: every index gemm forms is (i, j) with i < out, j < m for dst (offset j * out + i <
    // y.len()), (i, k) with k < inp for lhs (offset i * rs + k * cs < w.len(), asserted above),
    // and (k, j) for rhs (offset j * inp + k < x.len()); dst does not alias lhs or rhs (it is a
    // unique borrow), and read_dst = false so y's old contents are not read.
    unsafe {
        gemm::gemm(
            out,
            m,
            inp,
            y.as_mut_ptr(),
            out as isize,
            1,
            false,
            w.as_ptr(),
            cs as isize,
            rs as isize,
            x.as_ptr(),
            inp as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

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
        let owned = Linear::from_parts(wt.clone(), None, Some(bt.clone())).unwrap();
        // gemm on the column-major weight, which `owned` holds only without AVX-512.
        let mut cm = HugeBuf::zeroed(out * inp);
        for (k, row) in cm.chunks_exact_mut(out).enumerate() {
            for (i, v) in row.iter_mut().enumerate() {
                *v = w[i * inp + k];
            }
        }
        let col_major = Linear::build(F32Weight::ColMajor(cm), out, inp, None, Some(bt)).unwrap();
        let tied = Linear::tied(&wt, None).unwrap();
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
            parts.push(Linear::from_parts(w, Some(&q), bt).unwrap());
        }
        let fused = FusedLinear::new(parts).unwrap();
        let width: usize = outs.iter().sum();
        assert_eq!(fused.out(), width);
        for m in [1, 5, 32, 33, 70, 97, 130] {
            let x = values(m * inp, 30 + m as u64);
            let mut y = vec![f32::NAN; m * width];
            fused.forward(&x, m, &mut y).unwrap();
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
        let narrow = Linear::from_parts(
            Tensor::from_vec(values(8 * 32, 2), (8, 32), &Device::Cpu).unwrap(),
            None,
            None,
        )
        .unwrap();
        let wide = Linear::from_parts(
            Tensor::from_vec(values(8 * 64, 3), (8, 64), &Device::Cpu).unwrap(),
            None,
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
            let mut layer = Linear::from_parts(w.clone(), Some(&q), None).unwrap();
            let qm = layer.quantized_mut().expect("a quantized form");
            assert_eq!(Some(qm.kind()), GgmlKind::from_dtype(dt), "{dt:?}");
            let wv = w.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for m in [1, 3, 32] {
                let x = values(m * inp, 50 + m as u64);
                let mut y = vec![f32::NAN; m * out];
                layer.forward_rows(&x, m, &mut y).unwrap();
                let want = reference(&wv, &vec![0.0; out], &x, m, out, inp);
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
            let want = reference(w, &vec![0.0; out], &x, 1, out, inp);
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
