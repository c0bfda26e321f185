//! The tokenizer of a GGUF file, built from its `tokenizer.ggml.*` metadata: byte-level BPE
//! (`tokenizer.ggml.model = "gpt2"`: SmolLM2, Qwen, Llama 3, OLMo 2) or SentencePiece (`"llama"`:
//! Gemma 3; the private `spm` module describes its encoding).
//!
//! Byte-level BPE: the vocabulary and merges come from the file; the pre-tokenizer is chosen
//! by `tokenizer.ggml.pre`. Control tokens (`token_type == 3`) are special: their text in the
//! input maps to one id, and `skip_special` decoding drops them.
//!
//! Normalization: a `pre = "qwen2"` vocabulary is Qwen's, whose `tokenizer.json` recomposes
//! text to Unicode NFC before splitting it. GGUF has no field for a normalizer and llama.cpp
//! applies none, so there a decomposed accent (`e` + U+0301) gets other ids than the model
//! was trained on; Leyline applies NFC for `qwen2`, as the publisher's tokenizer does.
//!
//! Digits: for `pre = "smollm"` every `\p{N}` character is isolated before the byte-level
//! split, as llama.cpp and the upstream SmolLM2 `tokenizer.json` do. transformers' GGUF
//! converter omits that step, which changes the ids of some non-ASCII numerics (e.g. `" ½"`);
//! ASCII digits come out one per token either way.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{unicode::NFC, NormalizerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{ModelError, Result};

mod spm;

/// GGUF `token_type` of a control token (`<|im_start|>`, `<|endoftext|>`, ...).
const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF `token_type` of a user-defined token: matched in text, but not special.
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Split regex of llama.cpp's `llama-bpe` (Llama 3) pre-tokenizer.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Split regex of llama.cpp's `qwen2` pre-tokenizer.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Control-token texts that end a turn or a text in the common chat formats. A model may end a
/// reply with any of them, not only with the file's EOS (Qwen2.5 also ends with
/// `<|endoftext|>`; its Hugging Face generation config lists both).
const END_OF_GENERATION_TEXTS: [&str; 8] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

/// Which added tokens (control tokens such as `<|im_start|>`, and user-defined ones such as
/// Qwen's `<tool_call>`) may be read from a piece of text as their ids; the others' text is
/// tokenized as ordinary text.
///
/// In a SentencePiece vocabulary user-defined pieces are ordinary text (Gemma's newline,
/// tab and space runs, HTML tags: a newline has no other piece there), matched whatever this
/// says; only control tokens (`<start_of_turn>`, `<bos>`, ...) follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Specials {
    /// Every added token: text the chat template wrote.
    All,
    /// Added tokens that are not control tokens: what a model emits inside a message (tool
    /// call tags), which a resent assistant message must keep.
    NonControl,
    /// None: message content from a client, which must never open or close a turn.
    None,
}

/// The tokenizer of one model (byte-level BPE or SentencePiece) with its special tokens.
pub struct Tokenizer {
    model: Model,
    /// Finds added tokens' text, leftmost-longest as the inner tokenizer does.
    added_matcher: aho_corasick::AhoCorasick,
    /// Per pattern of `added_matcher`: the id and whether it is a control token.
    added: Vec<(u32, bool)>,
    /// Vocabulary strings as the file writes them, by id.
    tokens: Vec<String>,
    /// The bytes each id decodes to (special tokens: their text).
    token_bytes: Vec<Vec<u8>>,
    /// Whether each id is a control (special) token.
    special: Vec<bool>,
    bos: Option<u32>,
    eos: Option<u32>,
    /// Ids that end a generation: see [`Tokenizer::stop_ids`].
    stop: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
}

/// What the two kinds of vocabulary build differently.
struct Parts<'t> {
    model: Model,
    /// Texts of the added tokens [`Tokenizer::encode_pieces`] matches.
    added_texts: Vec<&'t str>,
    /// Per added text: its id and whether it is a control token.
    added_ids: Vec<(u32, bool)>,
    /// The bytes each id decodes to.
    token_bytes: Vec<Vec<u8>>,
}

/// The encoder between added tokens.
enum Model {
    /// Byte-level BPE: pre-tokenizer and merges.
    Bpe(Box<tokenizers::Tokenizer>),
    /// SentencePiece: user-defined pieces, then scored merges with byte fallback.
    Spm(Box<spm::SentencePiece>),
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field(
                "model",
                &match self.model {
                    Model::Bpe(_) => "bpe",
                    Model::Spm(_) => "sentencepiece",
                },
            )
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from GGUF metadata (`tokenizer.ggml.*` keys).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if the model is neither byte-level BPE (`gpt2`) nor
    /// SentencePiece (`llama`), the pre-tokenizer is unknown, or the vocabulary, types,
    /// scores or merges are missing or malformed.
    pub fn from_gguf_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let model = md_str(md, "tokenizer.ggml.model")?;
        if model != "gpt2" && model != "llama" {
            return Err(tok_err(format!(
                "tokenizer model '{model}' is not supported (byte-level BPE 'gpt2' and \
                 SentencePiece 'llama' are)"
            )));
        }
        let tokens: Vec<String> = md_array(md, "tokenizer.ggml.tokens")?
            .iter()
            .map(|v| {
                v.to_string()
                    .cloned()
                    .map_err(|e| tok_err(format!("tokens: {e}")))
            })
            .collect::<Result<_>>()?;
        let n = tokens.len();
        if n == 0 || u32::try_from(n).is_err() {
            return Err(tok_err(format!("vocabulary size {n} out of range")));
        }
        let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .map_err(|e| tok_err(format!("token_type: {e}")))?
                .iter()
                .map(|t| t.to_i32().map_err(|e| tok_err(format!("token_type: {e}"))))
                .collect::<Result<_>>()?,
            None => vec![1; n],
        };
        if types.len() != n {
            return Err(tok_err(format!(
                "{} token types for {n} tokens",
                types.len()
            )));
        }
        let special: Vec<bool> = types.iter().map(|&t| t == TOKEN_TYPE_CONTROL).collect();
        let Parts {
            model,
            added_texts,
            added_ids,
            token_bytes,
        } = if model == "gpt2" {
            Self::bpe_parts(md, &tokens, &types)?
        } else {
            Self::spm_parts(md, &tokens, &types)?
        };
        let added_matcher = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&added_texts)
            .map_err(|e| tok_err(format!("added tokens: {e}")))?;

        let bos = md_opt_u32(md, "tokenizer.ggml.bos_token_id")?;
        let eos = md_opt_u32(md, "tokenizer.ggml.eos_token_id")?;
        for (what, id) in [("bos", bos), ("eos", eos)] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(tok_err(format!("{what} id {id} >= vocabulary size {n}")));
                }
            }
        }
        let mut stop: Vec<u32> = Vec::new();
        for key in ["eos", "eot", "eom"] {
            let id = md_opt_u32(md, &format!("tokenizer.ggml.{key}_token_id"))?;
            stop.extend(id.filter(|&id| (id as usize) < n));
        }
        stop.extend(
            (0..n)
                .filter(|&id| special[id] && END_OF_GENERATION_TEXTS.contains(&tokens[id].as_str()))
                .map(|id| id as u32),
        );
        let mut seen = std::collections::HashSet::new();
        stop.retain(|id| seen.insert(*id));
        let add_bos = md_opt_bool(md, "tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let add_eos = md_opt_bool(md, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        Ok(Self {
            model,
            added_matcher,
            added: added_ids,
            tokens,
            token_bytes,
            special,
            bos,
            eos,
            stop,
            add_bos,
            add_eos,
        })
    }

    /// The byte-level BPE encoder of the file, its added tokens (control and user-defined:
    /// texts, and per text its id and whether it is a control token) and each id's bytes.
    fn bpe_parts<'t>(
        md: &HashMap<String, Value>,
        tokens: &'t [String],
        types: &[i32],
    ) -> Result<Parts<'t>> {
        let merges = md_array(md, "tokenizer.ggml.merges")?
            .iter()
            .map(|v| {
                let s = v.to_string().map_err(|e| tok_err(format!("merges: {e}")))?;
                s.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| tok_err(format!("merge without a space: {s:?}")))
            })
            .collect::<Result<Vec<_>>>()?;

        let mut vocab = tokenizers::models::bpe::Vocab::default();
        for (id, t) in tokens.iter().enumerate() {
            // A duplicate string keeps its first id; the later id still decodes via our table.
            vocab.entry(t.clone()).or_insert(id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| tok_err(format!("BPE: {e}")))?;

        let pre = md_opt_str(md, "tokenizer.ggml.pre")?.unwrap_or("default");
        let pre_tokenizer = pre_tokenizer_for(pre)?;

        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_normalizer(normalizer_for(pre));
        inner.with_pre_tokenizer(Some(pre_tokenizer));
        inner.with_decoder(Some(ByteLevelDecoder::default()));

        let added = |kind: i32, is_special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(types)
                .filter(|(_, &t)| t == kind)
                .map(|(s, _)| AddedToken::from(s.clone(), is_special).normalized(false))
                .collect()
        };
        inner.add_special_tokens(&added(TOKEN_TYPE_CONTROL, true));
        inner.add_tokens(&added(TOKEN_TYPE_USER_DEFINED, false));
        let mut added_texts = Vec::new();
        let mut added_ids = Vec::new();
        for (id, (t, &ty)) in tokens.iter().zip(types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
                added_texts.push(t.as_str());
                added_ids.push((id as u32, ty == TOKEN_TYPE_CONTROL));
            }
        }
        let token_bytes = tokens
            .iter()
            .zip(types)
            .map(|(t, &ty)| {
                if ty == TOKEN_TYPE_CONTROL {
                    t.as_bytes().to_vec()
                } else {
                    byte_level_bytes(t)
                }
            })
            .collect();
        Ok(Parts {
            model: Model::Bpe(Box::new(inner)),
            added_texts,
            added_ids,
            token_bytes,
        })
    }

    /// The SentencePiece encoder of the file (`tokenizer.ggml.scores`, `unknown_token_id`,
    /// `add_space_prefix`), its control tokens as added tokens (user-defined pieces are the
    /// encoder's) and each id's bytes.
    fn spm_parts<'t>(
        md: &HashMap<String, Value>,
        tokens: &'t [String],
        types: &[i32],
    ) -> Result<Parts<'t>> {
        let scores: Vec<f32> = md_array(md, "tokenizer.ggml.scores")?
            .iter()
            .map(|v| v.to_f32().map_err(|e| tok_err(format!("scores: {e}"))))
            .collect::<Result<_>>()?;
        let params = spm::SpmParams {
            unk: md_opt_u32(md, "tokenizer.ggml.unknown_token_id")?,
            // llama.cpp's default where the key is missing: SentencePiece's add_dummy_prefix.
            add_space_prefix: md_opt_bool(md, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true),
        };
        let enc = spm::SentencePiece::new(tokens, &scores, types, params)?;
        let mut added_texts = Vec::new();
        let mut added_ids = Vec::new();
        for (id, (t, &ty)) in tokens.iter().zip(types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL && !t.is_empty() {
                added_texts.push(t.as_str());
                added_ids.push((id as u32, true));
            }
        }
        let token_bytes = tokens
            .iter()
            .zip(types)
            .map(|(t, &ty)| spm::piece_bytes(t, ty))
            .collect();
        Ok(Parts {
            model: Model::Spm(Box::new(enc)),
            added_texts,
            added_ids,
            token_bytes,
        })
    }

    /// Encodes `text`. Special-token text inside it (e.g. `<|im_end|>`) becomes one id.
    /// With `add_special`, BOS / EOS are added where the file asks for them
    /// (`tokenizer.ggml.add_bos_token` / `add_eos_token`; SmolLM2 asks for neither).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if the underlying tokenizer fails.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_special && self.add_bos {
            ids.extend(self.bos);
        }
        match &self.model {
            Model::Bpe(inner) => {
                let enc = inner
                    .encode_fast(text, false)
                    .map_err(|e| tok_err(format!("encode: {e}")))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Model::Spm(_) => ids.extend(self.encode_pieces(&[(text, Specials::All)])?),
        }
        if add_special && self.add_eos {
            ids.extend(self.eos);
        }
        Ok(ids)
    }

    /// Encodes the concatenation of `pieces`, reading added tokens' text as their ids only
    /// where the piece's [`Specials`] allows it. Text between those ids is tokenized as one
    /// run across piece boundaries, so where every piece allows everything the result is
    /// [`Self::encode`]'s (no BOS / EOS is added).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if the underlying tokenizer fails.
    pub fn encode_pieces(&self, pieces: &[(&str, Specials)]) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        let mut run = String::new();
        for &(text, specials) in pieces {
            let mut done = 0;
            if specials != Specials::None {
                for m in self.added_matcher.find_iter(text) {
                    let (id, control) = self.added[m.pattern().as_usize()];
                    if control && specials == Specials::NonControl {
                        continue;
                    }
                    run.push_str(&text[done..m.start()]);
                    self.encode_plain(&run, &mut ids)?;
                    run.clear();
                    ids.push(id);
                    done = m.end();
                }
            }
            run.push_str(&text[done..]);
        }
        self.encode_plain(&run, &mut ids)?;
        Ok(ids)
    }

    /// The first control token whose text occurs in `text`, if any.
    pub fn find_control_text<'t>(&self, text: &'t str) -> Option<&'t str> {
        self.added_matcher
            .find_iter(text)
            .find(|m| self.added[m.pattern().as_usize()].1)
            .map(|m| &text[m.start()..m.end()])
    }

    /// The byte offset of the last control token whose text occurs in `text`, if any.
    pub fn last_control_text(&self, text: &str) -> Option<usize> {
        self.added_matcher
            .find_iter(text)
            .filter(|m| self.added[m.pattern().as_usize()].1)
            .last()
            .map(|m| m.start())
    }

    /// Tokenizes `text` with no added token matched: pre-tokenizer and BPE alone, which is
    /// what [`Self::encode`] does between added tokens (SentencePiece: user-defined pieces,
    /// then scored merges).
    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        use tokenizers::{Model as _, NormalizedString, Normalizer as _, OffsetType};
        use tokenizers::{PreTokenizedString, PreTokenizer};
        if text.is_empty() {
            return Ok(());
        }
        let inner = match &self.model {
            Model::Bpe(inner) => inner,
            Model::Spm(enc) => return enc.encode(text, ids),
        };
        let err = |e: tokenizers::Error| tok_err(format!("encode: {e}"));
        let mut normalized = NormalizedString::from(text);
        if let Some(n) = inner.get_normalizer() {
            n.normalize(&mut normalized).map_err(err)?;
        }
        let mut pts = PreTokenizedString::from(normalized);
        if let Some(pre) = inner.get_pre_tokenizer() {
            pre.pre_tokenize(&mut pts).map_err(err)?;
        }
        let model = inner.get_model();
        pts.tokenize(|n| model.tokenize(n.get())).map_err(err)?;
        let enc = pts.into_encoding(None, 0, OffsetType::Byte).map_err(err)?;
        ids.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// Decodes `ids` to text; bytes that do not form valid UTF-8 become U+FFFD.
    /// With `skip_special`, control tokens are left out.
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if an id is outside the vocabulary.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.check_ids(ids)?;
        match &self.model {
            Model::Bpe(inner) => inner
                .decode(ids, skip_special)
                .map_err(|e| tok_err(format!("decode: {e}"))),
            Model::Spm(_) => {
                let mut bytes = Vec::new();
                for &id in ids {
                    if !(skip_special && self.special[id as usize]) {
                        bytes.extend_from_slice(&self.token_bytes[id as usize]);
                    }
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// A streaming decoder over this tokenizer's vocabulary.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream {
        DecodeStream::new(skip_special)
    }

    /// Number of ids in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The beginning-of-sequence id, if the file names one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id, if the file names one (SmolLM2: `<|im_end|>`).
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The ids at which a generation stops: EOS, the file's end-of-turn and end-of-message ids,
    /// and every control token whose text ends a turn or a text in a common chat format
    /// (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, ...), EOS first, each once.
    pub fn stop_ids(&self) -> &[u32] {
        &self.stop
    }

    /// Whether `encode(.., true)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The vocabulary string of `id` as the file writes it (byte-level BPE: space is `Ġ`;
    /// SentencePiece: space is `▁`, a byte piece `<0x0A>`), or `None` outside the vocabulary.
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The raw bytes `id` decodes to (a special token: its text), or `None` outside
    /// the vocabulary. May be part of a multi-byte character.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// The id of a vocabulary string (as [`Self::token_str`] writes it, or a special token's
    /// text).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.model {
            Model::Bpe(inner) => inner.token_to_id(token),
            Model::Spm(enc) => enc.id(token),
        }
    }

    /// Whether `id` is a control token (`token_type == 3`); false outside the vocabulary.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.tokens.len()) {
            Some(id) => Err(tok_err(format!(
                "id {id} outside the vocabulary of {}",
                self.tokens.len()
            ))),
            None => Ok(()),
        }
    }
}

/// Incremental decoder for streaming: push ids, get the text they complete.
///
/// Output never splits a multi-byte character: bytes of an unfinished character wait for
/// the next id. The concatenation of every [`push`](Self::push) and the final
/// [`finish`](Self::finish) equals [`Tokenizer::decode`] of all ids (invalid bytes
/// become U+FFFD in both).
#[derive(Debug, Clone, Default)]
pub struct DecodeStream {
    skip_special: bool,
    pending: Vec<u8>,
}

impl DecodeStream {
    /// A fresh stream; `skip_special` leaves control tokens out.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Appends `ids` and returns the newly completed text (possibly empty).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] if an id is outside the vocabulary; the stream is then
    /// unchanged.
    pub fn push(&mut self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String> {
        tokenizer.check_ids(ids)?;
        for &id in ids {
            if self.skip_special && tokenizer.is_special(id) {
                continue;
            }
            self.pending
                .extend_from_slice(&tokenizer.token_bytes[id as usize]);
        }
        Ok(self.drain_complete())
    }

    /// Bytes held back because they may start a character the next id completes.
    pub fn pending_bytes(&self) -> usize {
        self.pending.len()
    }

    /// Ends the stream: an unfinished character left over becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Emits the longest prefix of `pending` that no later byte can change.
    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The first `valid_up_to` bytes are valid UTF-8, so this copies them as is.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Bytes that no continuation can fix: one U+FFFD, as from_utf8_lossy.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + len;
                        }
                        // An unfinished character at the end: keep it for the next id.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

/// The pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` name.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| tok_err(format!("split regex: {e}")))?;
        Ok(PreTokenizerWrapper::Split(s))
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        "smollm" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        // DBRX's and OLMo 2's cl100k vocabularies: llama.cpp splits them as Llama 3's.
        "llama-bpe" | "llama3" | "dbrx" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(LLAMA3_SPLIT)?,
            byte_level(false),
        ])),
        "qwen2" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(QWEN2_SPLIT)?,
            byte_level(false),
        ])),
        other => return Err(tok_err(format!("pre-tokenizer '{other}' is not supported"))),
    })
}

/// The normalizer of llama.cpp's `tokenizer.ggml.pre` name: NFC for Qwen's (see the module
/// docs), none for the others.
fn normalizer_for(pre: &str) -> Option<NormalizerWrapper> {
    (pre == "qwen2").then_some(NormalizerWrapper::NFC(NFC))
}

/// GPT-2's byte-level alphabet: the char each byte is written as.
fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 33..=126 | 161..=172 | 174..=255);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
            next += 1;
            c
        };
    }
    table
}

/// How a byte-level BPE vocabulary (`tokenizer.ggml.model = gpt2`) spells a token of
/// these bytes: each byte as its char of GPT-2's alphabet (the inverse of the decoder's map).
pub fn byte_level_text(bytes: &[u8]) -> String {
    use std::sync::OnceLock;
    static CHARS: OnceLock<[char; 256]> = OnceLock::new();
    let chars = CHARS.get_or_init(byte_to_char);
    bytes.iter().map(|&b| chars[b as usize]).collect()
}

/// The bytes a byte-level token stands for; a token with a char outside the alphabet
/// stands for its own UTF-8 (as the `tokenizers` byte-level decoder treats it).
fn byte_level_bytes(token: &str) -> Vec<u8> {
    use std::sync::OnceLock;
    static INV: OnceLock<HashMap<char, u8>> = OnceLock::new();
    let inv = INV.get_or_init(|| {
        byte_to_char()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    });
    token
        .chars()
        .map(|c| inv.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

fn tok_err(msg: String) -> ModelError {
    ModelError::Tokenizer(msg)
}

fn md_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a Vec<Value>> {
    md.get(key)
        .ok_or_else(|| tok_err(format!("metadata key {key} missing")))?
        .to_vec()
        .map_err(|e| tok_err(format!("{key}: {e}")))
}

fn md_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a str> {
    md_opt_str(md, key)?.ok_or_else(|| tok_err(format!("metadata key {key} missing")))
}

fn md_opt_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    md.get(key)
        .map(|v| v.to_string().map(String::as_str))
        .transpose()
        .map_err(|e| tok_err(format!("{key}: {e}")))
}

fn md_opt_u32(md: &HashMap<String, Value>, key: &str) -> Result<Option<u32>> {
    md.get(key)
        .map(|v| {
            v.to_u64()
                .ok()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| tok_err(format!("{key}: not a u32: {v:?}")))
        })
        .transpose()
}

fn md_opt_bool(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>> {
    md.get(key)
        .map(|v| v.to_bool().map_err(|e| tok_err(format!("{key}: {e}"))))
        .transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2() {
        let t = byte_to_char();
        assert_eq!(t[b' ' as usize], '\u{120}');
        assert_eq!(t[b'\n' as usize], '\u{10a}');
        assert_eq!(t[b'\t' as usize], '\u{109}');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0xad], '\u{143}');
        let mut seen: Vec<char> = t.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(byte_level_bytes("Ġhello"), b" hello");
        assert_eq!(byte_level_text(b" hello"), "Ġhello");
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(byte_level_bytes(&byte_level_text(&all)), all);
        assert_eq!(byte_level_bytes("ÃĥÂ"), vec![0xc3, 0x83, 0xc2]);
    }

    fn pieces(pre: &str, text: &str) -> Vec<String> {
        use tokenizers::{PreTokenizedString, PreTokenizer};
        let p = pre_tokenizer_for(pre).expect("known pre-tokenizer");
        let mut s = PreTokenizedString::from(text);
        p.pre_tokenize(&mut s).expect("pre-tokenize");
        s.get_splits(
            tokenizers::OffsetReferential::Original,
            tokenizers::OffsetType::Byte,
        )
        .into_iter()
        .map(|(s, _, _)| s.to_string())
        .collect()
    }

    #[test]
    fn digit_rules_per_pre_tokenizer() {
        assert_eq!(
            pieces("smollm", "a 12345"),
            ["a", "Ġ", "1", "2", "3", "4", "5"]
        );
        assert_eq!(pieces("gpt2", "a 12345"), ["a", "Ġ12345"]);
        assert_eq!(pieces("llama-bpe", "a 12345"), ["a", "Ġ", "123", "45"]);
        assert_eq!(pieces("qwen2", "a 12"), ["a", "Ġ", "1", "2"]);
        assert!(pre_tokenizer_for("nope").is_err());
    }

    #[test]
    fn stream_holds_back_unfinished_chars() {
        let mut s = DecodeStream::new(false);
        s.pending.extend_from_slice(&[b'a', 0xe2, 0x82]);
        assert_eq!(s.drain_complete(), "a");
        assert_eq!(s.pending_bytes(), 2);
        s.pending.push(0xac);
        assert_eq!(s.drain_complete(), "€");
        s.pending.extend_from_slice(&[0xff, b'b', 0xe2]);
        assert_eq!(s.drain_complete(), "\u{fffd}b");
        assert_eq!(s.finish(), "\u{fffd}");
        assert_eq!(s.pending_bytes(), 0);
    }
}
