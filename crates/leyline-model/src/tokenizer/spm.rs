//! SentencePiece (GGUF `tokenizer.ggml.model = "llama"`, as Gemma 3 and Llama 2 carry it):
//! the vocabulary, scores and token types of the file, encoded the way llama.cpp's SPM
//! tokenizer and sentencepiece's BPE mode encode.
//!
//! Encoding one run of text (no control token in it; the caller splits those off):
//! 1. User-defined pieces (`token_type` 4: Gemma's runs of newlines, tabs and spaces, HTML
//!    tags) are cut out whole, leftmost-longest; they are ordinary text for such a
//!    vocabulary (a newline has no other piece in Gemma's), so they are matched wherever
//!    text is encoded.
//! 2. In each stretch between them every space becomes U+2581 (`▁`), and, where the file asks
//!    for it (`add_space_prefix`), a `▁` is put in front of a stretch that opens the run or
//!    follows a user-defined piece, as llama.cpp does.
//! 3. The stretch starts as one symbol per character; repeatedly, of all adjacent pairs whose
//!    joined text is a piece (normal or user-defined; never a control, byte or unused one),
//!    the pair whose piece has the highest score is joined, the leftmost on a tie. A
//!    priority queue holds the candidate pairs; an entry whose symbols changed since it was
//!    queued is dropped when it comes out, so a stretch of n characters costs O(n log n).
//! 4. A symbol left that is no piece (a character outside the vocabulary) is written as its
//!    UTF-8 bytes, each the byte piece `<0xNN>` (byte fallback), or the unknown id where
//!    the file has no such piece.
//!
//! Design decision: control tokens are never formed by step 3 (sentencepiece keeps them out
//! of its merge table too), so text from a client can never turn into `<start_of_turn>`.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use crate::error::Result;

use super::tok_err;

/// GGUF `token_type` of an ordinary piece.
pub(super) const TYPE_NORMAL: i32 = 1;
/// GGUF `token_type` of the unknown piece.
pub(super) const TYPE_UNKNOWN: i32 = 2;
/// GGUF `token_type` of a user-defined piece.
pub(super) const TYPE_USER_DEFINED: i32 = 4;
/// GGUF `token_type` of a byte piece `<0xNN>`.
pub(super) const TYPE_BYTE: i32 = 6;

/// What one space is written as in the vocabulary.
const SPACE: char = '\u{2581}';

/// A SentencePiece vocabulary ready to encode.
pub(super) struct SentencePiece {
    /// Every piece's id by its text (the first id where a text repeats).
    ids: HashMap<Box<str>, u32>,
    /// Per id: the piece's score, or `None` when step 3 may not form it.
    merge_score: Vec<Option<f32>>,
    /// The id of `<0xNN>` per byte, where the vocabulary has it.
    byte_ids: [Option<u32>; 256],
    /// The unknown piece, for a byte without a byte piece.
    unk: Option<u32>,
    /// Finds user-defined pieces, leftmost-longest; `None` when there are none.
    user_matcher: Option<aho_corasick::AhoCorasick>,
    /// Per pattern of `user_matcher`: its id.
    user_ids: Vec<u32>,
    add_space_prefix: bool,
}

/// Settings of a [`SentencePiece`] read from the file besides the pieces.
pub(super) struct SpmParams {
    /// `tokenizer.ggml.unknown_token_id`, if the file names it.
    pub unk: Option<u32>,
    /// `tokenizer.ggml.add_space_prefix` (sentencepiece's `add_dummy_prefix`).
    pub add_space_prefix: bool,
}

impl SentencePiece {
    /// Builds the encoder from the pieces, their scores and GGUF token types.
    ///
    /// # Errors
    /// [`crate::ModelError::Tokenizer`] if the lengths differ, a byte piece is malformed or
    /// the user-defined pieces cannot be compiled into a matcher.
    pub(super) fn new(
        tokens: &[String],
        scores: &[f32],
        types: &[i32],
        params: SpmParams,
    ) -> Result<Self> {
        let n = tokens.len();
        if scores.len() != n || types.len() != n {
            return Err(tok_err(format!(
                "{n} tokens, {} scores, {} token types",
                scores.len(),
                types.len()
            )));
        }
        let mut ids = HashMap::with_capacity(n);
        let mut byte_ids = [None; 256];
        let mut user_texts = Vec::new();
        let mut user_ids = Vec::new();
        let mut merge_score = Vec::with_capacity(n);
        let mut unk = params.unk;
        for (id, ((text, &score), &ty)) in tokens.iter().zip(scores).zip(types).enumerate() {
            let id = id as u32;
            ids.entry(text.as_str().into()).or_insert(id);
            merge_score.push(matches!(ty, TYPE_NORMAL | TYPE_USER_DEFINED).then_some(score));
            match ty {
                TYPE_BYTE => {
                    let b = byte_piece_value(text).ok_or_else(|| {
                        tok_err(format!("byte token {id} is {text:?}, not <0xNN>"))
                    })?;
                    byte_ids[b as usize].get_or_insert(id);
                }
                TYPE_USER_DEFINED if !text.is_empty() => {
                    user_texts.push(text.as_str());
                    user_ids.push(id);
                }
                TYPE_UNKNOWN => {
                    unk.get_or_insert(id);
                }
                _ => {}
            }
        }
        let user_matcher = if user_texts.is_empty() {
            None
        } else {
            Some(
                aho_corasick::AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&user_texts)
                    .map_err(|e| tok_err(format!("user-defined tokens: {e}")))?,
            )
        };
        Ok(Self {
            ids,
            merge_score,
            byte_ids,
            unk: unk.filter(|&u| (u as usize) < n),
            user_matcher,
            user_ids,
            add_space_prefix: params.add_space_prefix,
        })
    }

    /// The id of a piece's text (`▁` for a space; `<0x0A>` for a byte piece).
    pub(super) fn id(&self, piece: &str) -> Option<u32> {
        self.ids.get(piece).copied()
    }

    /// Encodes a run of text that holds no control token, appending to `out`.
    ///
    /// # Errors
    /// [`crate::ModelError::Tokenizer`] for a character outside the vocabulary whose bytes
    /// have no byte piece, where the file names no unknown piece either.
    pub(super) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut done = 0;
        let mut after_piece = true;
        if let Some(m) = &self.user_matcher {
            for hit in m.find_iter(text) {
                self.encode_stretch(&text[done..hit.start()], after_piece, out)?;
                out.push(self.user_ids[hit.pattern().as_usize()]);
                done = hit.end();
                after_piece = true;
            }
        }
        self.encode_stretch(&text[done..], after_piece, out)
    }

    /// Steps 2-4 of the module docs on text without user-defined pieces.
    fn encode_stretch(&self, text: &str, after_piece: bool, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let mut escaped = String::with_capacity(text.len() + 3 * (1 + text.len() / 4));
        if self.add_space_prefix && after_piece {
            escaped.push(SPACE);
        }
        escaped.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let mut merge = Merge::new(&escaped);
        for left in 0..merge.symbols.len().saturating_sub(1) {
            self.queue_pair(&mut merge, left, left + 1);
        }
        while let Some(pair) = merge.queue.pop() {
            let (l, r) = (pair.left, pair.right);
            let (sl, sr) = (merge.symbols[l], merge.symbols[r]);
            // Stale: one side was joined into another symbol, or grew since queued.
            if sl.len == 0 || sr.len == 0 || sl.next != Some(r) || sl.len + sr.len != pair.len {
                continue;
            }
            merge.symbols[l].len += sr.len;
            merge.symbols[l].next = sr.next;
            merge.symbols[r].len = 0;
            if let Some(next) = sr.next {
                merge.symbols[next].prev = Some(l);
            }
            if let Some(prev) = sl.prev {
                self.queue_pair(&mut merge, prev, l);
            }
            if let Some(next) = sr.next {
                self.queue_pair(&mut merge, l, next);
            }
        }
        let mut at = (!merge.symbols.is_empty()).then_some(0);
        while let Some(i) = at {
            let sym = merge.symbols[i];
            let piece = &escaped[sym.start..sym.start + sym.len];
            match self.id(piece).filter(|&id| self.mergeable(id)) {
                Some(id) => out.push(id),
                None => self.push_bytes(piece, out)?,
            }
            at = sym.next;
        }
        Ok(())
    }

    /// Queues the pair of adjacent symbols `left`, `right` if their joined text is a piece
    /// step 3 may form.
    fn queue_pair(&self, merge: &mut Merge<'_>, left: usize, right: usize) {
        let (a, b) = (merge.symbols[left], merge.symbols[right]);
        let len = a.len + b.len;
        let Some(id) = self.id(&merge.text[a.start..a.start + len]) else {
            return;
        };
        if let Some(score) = self.merge_score[id as usize] {
            merge.queue.push(Pair {
                score,
                left,
                right,
                len,
            });
        }
    }

    fn mergeable(&self, id: u32) -> bool {
        self.merge_score[id as usize].is_some()
    }

    /// Byte fallback: each byte of `piece` as its byte piece (or the unknown piece).
    fn push_bytes(&self, piece: &str, out: &mut Vec<u32>) -> Result<()> {
        for b in piece.bytes() {
            match self.byte_ids[b as usize].or(self.unk) {
                Some(id) => out.push(id),
                None => {
                    return Err(tok_err(format!(
                        "{piece:?} is not in the vocabulary, which has no byte piece <0x{b:02X}> \
                         and no unknown piece"
                    )))
                }
            }
        }
        Ok(())
    }
}

/// The value of a byte piece's text `<0xNN>`.
pub(super) fn byte_piece_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The bytes a piece of type `ty` decodes to: a byte piece its byte, an ordinary or
/// user-defined piece its text with `▁` read as a space, any other its text.
pub(super) fn piece_bytes(text: &str, ty: i32) -> Vec<u8> {
    match ty {
        TYPE_BYTE => byte_piece_value(text).map_or_else(|| text.as_bytes().to_vec(), |b| vec![b]),
        TYPE_NORMAL | TYPE_USER_DEFINED => text.replace(SPACE, " ").into_bytes(),
        _ => text.as_bytes().to_vec(),
    }
}

/// One symbol of a stretch being merged: a byte range of the escaped text, linked to its
/// neighbours; `len == 0` once joined into its left neighbour.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate join of two adjacent symbols.
#[derive(Debug)]
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the joined text when queued (detects stale entries).
    len: usize,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pair {}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Pair {
    /// The max-heap's order: higher score first, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// The state of merging one stretch.
struct Merge<'t> {
    text: &'t str,
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Pair>,
}

impl<'t> Merge<'t> {
    /// One symbol per character of `text`.
    fn new(text: &'t str) -> Self {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        Self {
            text,
            queue: BinaryHeap::with_capacity(symbols.len()),
            symbols,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy vocabulary: `<unk>`, two control pieces, byte pieces for `a`..`c` and 0xC3,
    /// then ordinary pieces with descending scores, and one user-defined piece `\n`.
    fn toy(add_space_prefix: bool) -> SentencePiece {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "ab"].map(String::from).to_vec();
        let mut types = vec![TYPE_UNKNOWN, 3, 3];
        for b in [b'a', b'b', b'c', 0xC3] {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TYPE_BYTE);
        }
        for t in ["a", "b", "c", "▁", "bc", "▁a", "abc", "▁ab"] {
            tokens.push(t.to_string());
            types.push(TYPE_NORMAL);
        }
        tokens.push("\n".into());
        types.push(TYPE_USER_DEFINED);
        let scores: Vec<f32> = (0..tokens.len()).map(|i| -(i as f32)).collect();
        SentencePiece::new(
            &tokens,
            &scores,
            &types,
            SpmParams {
                unk: None,
                add_space_prefix,
            },
        )
        .expect("toy vocabulary")
    }

    fn enc(s: &SentencePiece, text: &str) -> Vec<String> {
        let mut ids = Vec::new();
        s.encode(text, &mut ids).expect("encodes");
        let by_id: HashMap<u32, &str> = s.ids.iter().map(|(t, &i)| (i, &**t)).collect();
        ids.iter().map(|i| by_id[i].to_string()).collect()
    }

    #[test]
    fn highest_score_first_and_never_a_control_piece() {
        let s = toy(false);
        // "ab" is a control piece: never formed, though its score is the highest.
        assert_eq!(enc(&s, "ab"), ["a", "b"]);
        // "bc" first, then "a" + "bc" = "abc".
        assert_eq!(enc(&s, "abc"), ["abc"]);
        // " a b": "▁a" (-12) then "▁" + "b" is no piece.
        assert_eq!(enc(&s, " a b"), ["▁a", "▁", "b"]);
        assert_eq!(enc(&s, "a\nb"), ["a", "\n", "b"]);
    }

    #[test]
    fn ties_go_to_the_leftmost_pair() {
        // Equal scores everywhere: "aa" + "a" leftmost.
        let tokens: Vec<String> = ["a", "aa"].map(String::from).to_vec();
        let s = SentencePiece::new(
            &tokens,
            &[0.0, 0.0],
            &[TYPE_NORMAL, TYPE_NORMAL],
            SpmParams {
                unk: None,
                add_space_prefix: false,
            },
        )
        .expect("vocabulary");
        let mut ids = Vec::new();
        s.encode("aaa", &mut ids).expect("encodes");
        assert_eq!(ids, [1, 0]);
    }

    #[test]
    fn byte_fallback_and_unknown() {
        let s = toy(false);
        // "é" is C3 A9: C3 has a byte piece, A9 does not and there is no unk id given, but
        // the vocabulary's type-2 piece serves as unknown.
        assert_eq!(enc(&s, "é"), ["<0xC3>", "<unk>"]);
    }

    #[test]
    fn space_prefix_at_the_start_and_after_user_pieces() {
        let s = toy(true);
        assert_eq!(enc(&s, "ab\nab"), ["▁ab", "\n", "▁ab"]);
        assert_eq!(enc(&toy(false), "ab\nab"), ["a", "b", "\n", "a", "b"]);
    }

    #[test]
    fn byte_pieces_and_decoding() {
        assert_eq!(byte_piece_value("<0x0A>"), Some(10));
        assert_eq!(byte_piece_value("<0xff>"), Some(255));
        assert_eq!(byte_piece_value("<0x1>"), None);
        assert_eq!(piece_bytes("▁hi▁", TYPE_NORMAL), b" hi ");
        assert_eq!(piece_bytes("<0xF1>", TYPE_BYTE), [0xF1]);
        assert_eq!(piece_bytes("<bos>", 3), b"<bos>");
    }
}
