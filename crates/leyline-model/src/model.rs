//! The forward contract between the engine and every architecture: what a model says about
//! itself ([`ModelInfo`]), a batch of sequences to run over the pool ([`ForwardSeq`]), the
//! [`CausalLm`] trait, and the checks and batch plumbing the architectures share.

use crate::error::{ModelError, Result};
use leyline_kernels::rope::LayerRopes;
use leyline_kv::{KvGeometry, KvStorage};

/// What the engine needs to know about a loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// Display name (file stem or registry name).
    pub name: String,
    /// Architecture (`llama`, `qwen2`, ...).
    pub arch: String,
    /// Vocabulary size (rows of the output head).
    pub vocab_size: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// What one slot holds per layer.
    pub geometry: KvGeometry,
    /// The rotary embedding of each layer's cached keys (for shifts): a model may rotate
    /// different layers differently (Gemma 3's local and global layers).
    pub rope: LayerRopes,
}

/// Which logits a sequence wants back from a forward call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsFor {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last new token's.
    Last,
    /// Every new token's (tests, scoring).
    All,
}

/// One sequence's part of a forward batch.
#[derive(Debug, Clone, Copy)]
pub struct ForwardSeq<'a> {
    /// New tokens to run.
    pub tokens: &'a [u32],
    /// Their positions (rotary phases); usually consecutive after the context's.
    pub positions: &'a [u32],
    /// Slots already holding the KV of the tokens before these, in sequence order.
    pub context: &'a [u32],
    /// Where the new tokens' KV is written, one slot per token.
    pub new_slots: &'a [u32],
    /// Which logits to return.
    pub logits: LogitsFor,
    /// Runs of `context` whose keys are encoded at positions other than their own (lazy
    /// splices left them there), as [`leyline_kv::slots::SlotPool::key_shifts`] finds them;
    /// empty when every key sits where it belongs. Attention reads such a run with the query
    /// rotated back by the run's offset.
    pub shifts: &'a [leyline_kv::shift::KeyShift],
}

/// A causal language model that runs over the slot pool.
pub trait CausalLm: Send + Sync {
    /// Static facts about the model.
    fn info(&self) -> &ModelInfo;

    /// Runs the new tokens of every sequence in one batch, writing their KV into `kv` and
    /// attending causally to `context` followed by the new tokens. Returns per sequence the
    /// requested logits, row-major `[rows, vocab]` (empty for [`LogitsFor::None`]).
    ///
    /// # Errors
    /// Inconsistent lengths, out-of-range slots or token ids, tensor failures.
    fn forward(&self, kv: &mut KvStorage, seqs: &[ForwardSeq<'_>]) -> Result<Vec<Vec<f32>>>;

    /// The selection pass of a repair by deviation: runs `seq` through layers `0..layer` (its
    /// KV for those layers goes to `seq.new_slots`, which are scratch), computes its tokens'
    /// keys and values at `layer`, and returns per token the L2 distance of those from the
    /// keys and values `cached` (one slot per token) holds at `layer`: how far each token's
    /// KV moves when it is recomputed in `seq`'s context.
    ///
    /// # Errors
    /// As [`Self::forward`]; `layer` is not a layer of the model or `cached` does not match
    /// the tokens.
    fn kv_deviation(
        &self,
        kv: &mut KvStorage,
        seq: ForwardSeq<'_>,
        layer: usize,
        cached: &[u32],
    ) -> Result<Vec<f32>>;
}

/// What a model's forward pass returns: the logits of [`CausalLm::forward`], or the
/// distances of [`CausalLm::kv_deviation`] (the same pass, stopped at a layer).
pub(crate) enum Ran {
    Logits(Vec<Vec<f32>>),
    Deviation(Vec<f32>),
}

impl Ran {
    pub(crate) fn logits(self) -> Result<Vec<Vec<f32>>> {
        match self {
            Self::Logits(l) => Ok(l),
            Self::Deviation(_) => Err(ModelError::Input(
                "a forward pass without a stop layer stopped".into(),
            )),
        }
    }

    pub(crate) fn deviation(self) -> Result<Vec<f32>> {
        match self {
            Self::Deviation(d) => Ok(d),
            Self::Logits(_) => Err(ModelError::Input(
                "the deviation pass ran past its layer".into(),
            )),
        }
    }
}

/// What an architecture implements; [`CausalLm`] follows from it (the checks, the deviation
/// pass): one forward pass that stops at a layer when asked.
pub(crate) trait Network: Send + Sync {
    /// Static facts about the model.
    fn info(&self) -> &ModelInfo;

    /// The forward pass of checked `seqs` ([`CausalLm::forward`]), or with `stop = (layer,
    /// cached)` the pass of [`CausalLm::kv_deviation`]: it ends at `layer`, before writing
    /// that layer's KV, and returns the distances of [`kv_distances`].
    fn run(
        &self,
        kv: &mut KvStorage,
        seqs: &[ForwardSeq<'_>],
        stop: Option<(usize, &[u32])>,
    ) -> Result<Ran>;
}

impl<N: Network> CausalLm for N {
    fn info(&self) -> &ModelInfo {
        Network::info(self)
    }

    fn forward(&self, kv: &mut KvStorage, seqs: &[ForwardSeq<'_>]) -> Result<Vec<Vec<f32>>> {
        check_batch(Network::info(self), kv, seqs)?;
        self.run(kv, seqs, None)?.logits()
    }

    fn kv_deviation(
        &self,
        kv: &mut KvStorage,
        seq: ForwardSeq<'_>,
        layer: usize,
        cached: &[u32],
    ) -> Result<Vec<f32>> {
        let info = Network::info(self);
        let seqs = [seq];
        check_batch(info, kv, &seqs)?;
        let (layers, cap) = (info.geometry.layers, kv.capacity());
        if layer >= layers || cached.len() != seqs[0].tokens.len() {
            return Err(ModelError::Input(format!(
                "deviation at layer {layer} of {layers} for {} tokens and {} cached slots",
                seqs[0].tokens.len(),
                cached.len()
            )));
        }
        if let Some(&bad) = cached.iter().find(|&&x| x as usize >= cap) {
            return Err(ModelError::Input(format!(
                "cached slot {bad} is outside the pool of {cap} slots"
            )));
        }
        self.run(kv, &seqs, Some((layer, cached)))?.deviation()
    }
}

/// Per token, the L2 distance between freshly computed key and value rows (`fresh_k`,
/// `fresh_v`: row-major, as the pool stores them) and those `cached` holds at `layer`.
pub(crate) fn kv_distances(
    kv: &KvStorage,
    layer: usize,
    cached: &[u32],
    fresh_k: &[f32],
    fresh_v: &[f32],
) -> Result<Vec<f32>> {
    let g = kv.geometry();
    let (kw, vw) = (g.k_width(), g.v_width);
    let mut ck = vec![0f32; cached.len() * kw];
    let mut cv = vec![0f32; cached.len() * vw];
    kv.gather_k(layer, cached, &mut ck)?;
    kv.gather_v(layer, cached, &mut cv)?;
    let sq =
        |a: &[f32], b: &[f32]| -> f32 { a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum() };
    Ok((0..cached.len())
        .map(|i| {
            let k = sq(&fresh_k[i * kw..(i + 1) * kw], &ck[i * kw..(i + 1) * kw]);
            let v = sq(&fresh_v[i * vw..(i + 1) * vw], &cv[i * vw..(i + 1) * vw]);
            (k + v).sqrt()
        })
        .collect())
}

/// Checks a forward batch against the model and pool before any work is done.
///
/// # Errors
/// [`ModelError::Input`] naming the sequence and the problem.
pub fn check_batch(info: &ModelInfo, kv: &KvStorage, seqs: &[ForwardSeq<'_>]) -> Result<()> {
    if kv.geometry() != info.geometry {
        return Err(ModelError::Input(format!(
            "KV pool geometry {:?} does not match the model's {:?}",
            kv.geometry(),
            info.geometry
        )));
    }
    for (i, s) in seqs.iter().enumerate() {
        let t = s.tokens.len();
        if t == 0 {
            return Err(ModelError::Input(format!("sequence {i}: no tokens to run")));
        }
        if s.positions.len() != t || s.new_slots.len() != t {
            return Err(ModelError::Input(format!(
                "sequence {i}: {t} tokens but {} positions and {} slots",
                s.positions.len(),
                s.new_slots.len()
            )));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&x| x as usize >= info.vocab_size) {
            return Err(ModelError::Input(format!(
                "sequence {i}: token id {bad} is outside the vocabulary of {}",
                info.vocab_size
            )));
        }
        leyline_kv::shift::check_shifts(s.shifts, s.context.len())
            .map_err(|e| ModelError::Input(format!("sequence {i}: {e}")))?;
        let cap = kv.capacity();
        if let Some(&bad) = s
            .context
            .iter()
            .chain(s.new_slots)
            .find(|&&x| x as usize >= cap)
        {
            return Err(ModelError::Input(format!(
                "sequence {i}: slot {bad} is outside the pool of {cap} slots"
            )));
        }
    }
    Ok(())
}

/// A forward batch flattened to one entry per new token, in batch order.
pub(crate) struct FlatBatch {
    pub(crate) tokens: Vec<u32>,
    pub(crate) positions: Vec<u32>,
    pub(crate) new_slots: Vec<u32>,
}

impl FlatBatch {
    pub(crate) fn new(seqs: &[ForwardSeq<'_>]) -> Self {
        fn cat<'a>(seqs: &[ForwardSeq<'a>], f: fn(&ForwardSeq<'a>) -> &'a [u32]) -> Vec<u32> {
            seqs.iter().flat_map(|s| f(s).iter().copied()).collect()
        }
        Self {
            tokens: cat(seqs, |s| s.tokens),
            positions: cat(seqs, |s| s.positions),
            new_slots: cat(seqs, |s| s.new_slots),
        }
    }
}

/// The flattened rows whose logits the batch wants, and how many belong to each sequence.
pub(crate) fn logit_rows(seqs: &[ForwardSeq<'_>]) -> (Vec<u32>, Vec<usize>) {
    let mut rows = Vec::new();
    let mut counts = Vec::with_capacity(seqs.len());
    let mut start = 0u32;
    for s in seqs {
        let t = s.tokens.len() as u32;
        let c = match s.logits {
            LogitsFor::None => 0,
            LogitsFor::Last => 1,
            LogitsFor::All => t,
        };
        rows.extend(start + t - c..start + t);
        counts.push(c as usize);
        start += t;
    }
    (rows, counts)
}

/// Splits the head's output `[rows, vocab]` back into one block per sequence.
pub(crate) fn split_logits(logits: &[f32], counts: &[usize], vocab: usize) -> Vec<Vec<f32>> {
    let mut off = 0;
    counts
        .iter()
        .map(|&c| {
            let block = logits[off * vocab..(off + c) * vocab].to_vec();
            off += c;
            block
        })
        .collect()
}
