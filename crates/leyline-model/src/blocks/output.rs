//! The two ends of a decoder over a GGUF file: the token embedding, and the final norm and
//! output head (tied to the embedding when the file has no `output.weight`).

use crate::blocks::norm::{load_norm, rms_norm};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::linear::{Embedding, Linear, RowSplit};
use crate::model::{ForwardSeq, Ran};
use leyline_kernels::qmatmul::QMatrix;

/// `token_embd.weight` as the embedding table; left in the file's mapping where it is not
/// also the head and its format is read in place ([`Embedding::load_stored`]).
///
/// # Errors
/// Missing or unreadable tensor, or a width other than `hidden`.
pub(crate) fn load_embedding(f: &mut GgufFile, hidden: usize) -> Result<Embedding> {
    // A table that is not also the head is only read a row per token: it stays in the file.
    let table = if f.has_tensor("output.weight") {
        Embedding::load_stored(f, "token_embd.weight")?
    } else {
        Embedding::load(f, "token_embd.weight")?
    };
    let (_, width) = table.dims();
    if width != hidden {
        return Err(ModelError::File {
            path: f.path().to_path_buf(),
            reason: format!("token_embd has width {width}, metadata says {hidden}"),
        });
    }
    Ok(table)
}

/// The embedding table, the final norm and the head.
pub(crate) struct Ends {
    /// The token embedding.
    pub(crate) embed: Embedding,
    /// `output_norm.weight`.
    pub(crate) norm: Vec<f32>,
    /// The output head, `[vocab, hidden]`.
    pub(crate) head: Linear,
}

impl Ends {
    /// Loads the final norm and the head (`output.weight`, else the embedding `table`
    /// tied), after which the quantized matrices of the blocks (`blocks`) and of the head
    /// share pages ([`QMatrix::share_pages`]). A tied head over a quantized table takes the
    /// table's matrix; the table takes it back, shared, once the pages are placed.
    ///
    /// # Errors
    /// Missing or unreadable tensors.
    pub(crate) fn load<'m>(
        f: &mut GgufFile,
        table: Embedding,
        hidden: usize,
        blocks: impl Iterator<Item = &'m mut QMatrix>,
    ) -> Result<Self> {
        let norm = load_norm(f, "output_norm.weight", hidden)?;
        let (mut head, embed) = if f.has_tensor("output.weight") {
            (Linear::load(f, "output")?, Some(table))
        } else {
            match table {
                Embedding::F32(t) => (Linear::tied(&t)?, Some(Embedding::F32(t))),
                Embedding::Quant(q) => (Linear::from_qmatrix(q, None)?, None),
            }
        };
        let mut mats: Vec<&mut QMatrix> = blocks.collect();
        mats.extend(head.quantized_mut());
        QMatrix::share_pages(mats);
        let embed =
            match embed {
                Some(e) => e,
                None => Embedding::Quant(head.quantized().cloned().ok_or_else(|| {
                    ModelError::Input("a tied head lost its quantized table".into())
                })?),
            };
        Ok(Self { embed, norm, head })
    }

    /// Vocabulary size (rows of the table).
    pub(crate) fn vocab(&self) -> usize {
        self.embed.dims().0
    }

    /// The logits each sequence of `seqs` asked for: the final norm and the head over the
    /// wanted rows of the residual stream `x: [n, hidden]`.
    ///
    /// # Errors
    /// Widths that do not match the head.
    pub(crate) fn logits(&self, x: &[f32], seqs: &[ForwardSeq<'_>], eps: f32) -> Result<Ran> {
        let (rows, counts) = crate::model::logit_rows(seqs);
        if rows.is_empty() {
            return Ok(Ran::Logits(vec![Vec::new(); seqs.len()]));
        }
        let hid = self.norm.len();
        let vocab = self.head.out();
        let m = rows.len();
        let mut xs = vec![0f32; m * hid];
        for (dst, &r) in xs.chunks_exact_mut(hid).zip(&rows) {
            let r = r as usize;
            rms_norm(&x[r * hid..(r + 1) * hid], &self.norm, eps, dst);
        }
        let mut logits = vec![0f32; m * vocab];
        self.head
            .forward_split(&xs, &RowSplit::uniform(m), &mut logits)?;
        Ok(Ran::Logits(crate::model::split_logits(
            &logits, &counts, vocab,
        )))
    }
}
