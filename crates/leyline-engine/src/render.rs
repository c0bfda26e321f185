//! The real tokenizer and chat template as a [`leyline_policy::Renderer`]: messages become
//! tokens with the token index where each message starts, so the policy diff can anchor
//! its edits on message boundaries.

use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use leyline_model::tokenizer::{Specials, Tokenizer};
use leyline_policy::{Message, PolicyError, Rendered, Renderer};
use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::ops::Range;
use std::rc::Rc;

/// Renders with a model's chat template and tokenizer.
pub struct ChatRenderer<'a> {
    tokenizer: &'a Tokenizer,
    template: &'a ChatTemplate,
    generation_prompt: bool,
}

impl<'a> ChatRenderer<'a> {
    /// A renderer that appends the generation prompt when `generation_prompt` is set.
    pub fn new(
        tokenizer: &'a Tokenizer,
        template: &'a ChatTemplate,
        generation_prompt: bool,
    ) -> Self {
        Self {
            tokenizer,
            template,
            generation_prompt,
        }
    }
}

/// The chat-template form of a policy message.
pub fn to_chat_message(m: &Message) -> ChatMessage {
    let mut c = ChatMessage::new(m.role.as_str(), m.content.clone());
    c.name = m.name.clone();
    c.tool_call_id = m.tool_call_id.clone();
    if !m.tool_calls.is_empty() {
        c.tool_calls = Some(
            m.tool_calls
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "id": t.id,
                        "type": "function",
                        "function": {"name": t.name, "arguments": t.arguments},
                    })
                })
                .collect(),
        );
    }
    c
}

impl Renderer for ChatRenderer<'_> {
    fn render_tokens(&self, messages: &[Message]) -> leyline_policy::Result<Rendered> {
        let chat: Vec<ChatMessage> = messages.iter().map(to_chat_message).collect();
        let opts = RenderOptions {
            add_generation_prompt: self.generation_prompt,
            ..RenderOptions::default()
        };
        render_pieces(self.tokenizer, self.template, &chat, &opts)
    }
}

/// Renders `chat` with `opts` and tokenizes it message by message: the whole text once and
/// every prefix `chat[..k]` to find where message `k` starts in it, then each message's text
/// on its own. Templates open a message with a special token, which the tokenizer never
/// merges across, so the pieces' tokens are the whole text's (checked on every trace by
/// `tests/policy_traces.rs`). Tokenizes each character once, where tokenizing every prefix
/// would cost the square of the message count.
///
/// # Errors
/// [`PolicyError::Render`] if the template fails or does not render some prefix as a prefix
/// of the whole text.
pub fn render_pieces(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    chat: &[ChatMessage],
    opts: &RenderOptions,
) -> leyline_policy::Result<Rendered> {
    let render_err = |e: leyline_model::ModelError| PolicyError::Render(e.to_string());
    let full = template.render_with(chat, opts).map_err(render_err)?;
    pieces_of(tokenizer, template, chat, opts, &full)
}

/// A chat prompt rendered and tokenized for serving: its tokens and, when `with_bounds` is
/// set, where each message's piece starts (then where the last one ends), for a session's
/// diff.
///
/// Message content never supplies a control token: `<|im_end|>` typed by a user is text,
/// not the end of a turn. Only the template's own text is read for control tokens;
/// assistant content keeps the other added tokens (tool call tags) it was generated with.
/// The content is located by rendering it as unique markers (one more render; linear in the
/// conversation, where rendering every prefix would be quadratic). A piece starts at the last
/// control token the template writes before the message's content (a ChatML turn starts at
/// its `<|im_start|>`), or at the content itself; a message without content shares the piece
/// of the message before it. Bounds are given only when the pieces, tokenized apart, give
/// the prompt's tokens.
///
/// A template that rewrites content (trims it, say) cannot be located this way: then the
/// whole text is tokenized, no bounds are given, and content holding a control token's text
/// is refused.
///
/// # Errors
/// The template or the tokenizer fails, or (for such a template) content holds a control
/// token's text.
pub fn render_prompt(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    chat: &[ChatMessage],
    opts: &RenderOptions,
    with_bounds: bool,
) -> Result<(Vec<u32>, Option<Vec<usize>>), leyline_model::ModelError> {
    let text = template.render_with(chat, opts)?;
    let Some(layout) = locate_contents(template, chat, opts, &text)? else {
        for (i, m) in chat.iter().enumerate() {
            if let Some(t) = m
                .content
                .as_deref()
                .and_then(|c| tokenizer.find_control_text(c))
            {
                return Err(leyline_model::ModelError::Input(format!(
                    "messages[{i}].content holds the control token {t:?}, which this model's \
                     chat template cannot keep apart from its own"
                )));
            }
        }
        return Ok((tokenizer.encode(&text, false)?, None));
    };
    let pieces = layout.pieces(&text, chat);
    let prompt = tokenizer.encode_pieces(&pieces)?;
    if !with_bounds {
        return Ok((prompt, None));
    }
    let Some(end) = layout.messages_end else {
        return Ok((prompt, None));
    };
    let cuts = layout.cuts(tokenizer, &text, end);
    let mut bounds = Vec::with_capacity(cuts.len());
    let mut tokens = Vec::with_capacity(prompt.len());
    for w in cuts.windows(2) {
        bounds.push(tokens.len());
        tokens.extend(tokenizer.encode_pieces(&layout.pieces_in(&text, chat, w[0]..w[1]))?);
    }
    bounds.push(tokens.len());
    tokens.extend(tokenizer.encode_pieces(&layout.pieces_in(&text, chat, end..text.len()))?);
    Ok((prompt.clone(), (tokens == prompt).then_some(bounds)))
}

/// `(message index, byte range)` of each located content, in text order.
type Spans = Vec<(usize, Range<usize>)>;

/// Where each message's content lies in a rendered prompt.
struct Layout {
    spans: Spans,
    /// Where the last message ends (the generation prompt follows), when known.
    messages_end: Option<usize>,
}

/// A character that never occurs in text exchanged between systems (a Unicode
/// noncharacter); it brackets the markers.
const MARK_OPEN: char = '\u{FDD0}';
const MARK_CLOSE: char = '\u{FDD1}';

/// Renders `chat` with each non-empty content replaced by a marker, then puts the contents
/// back; `None` when that does not reproduce `text` (the template rewrites or repeats
/// content) or a content holds a marker character.
fn locate_contents(
    template: &ChatTemplate,
    chat: &[ChatMessage],
    opts: &RenderOptions,
    text: &str,
) -> Result<Option<Layout>, leyline_model::ModelError> {
    fn content(m: &ChatMessage) -> Option<&str> {
        m.content.as_deref().filter(|c| !c.is_empty())
    }
    if chat
        .iter()
        .filter_map(content)
        .any(|c| c.contains([MARK_OPEN, MARK_CLOSE]))
    {
        return Ok(None);
    }
    let marked: Vec<ChatMessage> = chat
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut m = m.clone();
            if content(&m).is_some() {
                m.content = Some(format!("{MARK_OPEN}{i}{MARK_CLOSE}"));
            }
            m
        })
        .collect();
    let Some((real, spans)) = unmark(&template.render_with(&marked, opts)?, chat) else {
        return Ok(None);
    };
    if real != text {
        return Ok(None);
    }
    // The generation prompt is template text after the last message.
    let messages_end = if opts.add_generation_prompt {
        let no_gen = RenderOptions {
            add_generation_prompt: false,
            ..opts.clone()
        };
        unmark(&template.render_with(&marked, &no_gen)?, chat)
            .filter(|(t, s)| text.starts_with(t.as_str()) && *s == spans)
            .map(|(t, _)| t.len())
    } else {
        Some(text.len())
    };
    Ok(Some(Layout {
        spans,
        messages_end,
    }))
}

/// Replaces the markers in `marked` by the messages' contents: the real text and where
/// each content went. `None` if a marker is repeated, out of order or malformed.
fn unmark(marked: &str, chat: &[ChatMessage]) -> Option<(String, Spans)> {
    let mut out = String::with_capacity(marked.len());
    let mut spans: Spans = Vec::new();
    let mut rest = marked;
    while let Some(open) = rest.find(MARK_OPEN) {
        out.push_str(&rest[..open]);
        let after = &rest[open + MARK_OPEN.len_utf8()..];
        let close = after.find(MARK_CLOSE)?;
        let i: usize = after[..close].parse().ok()?;
        if spans.last().is_some_and(|(j, _)| *j >= i) {
            return None;
        }
        let c = chat.get(i)?.content.as_deref()?;
        spans.push((i, out.len()..out.len() + c.len()));
        out.push_str(c);
        rest = &after[close + MARK_CLOSE.len_utf8()..];
    }
    if rest.contains(MARK_CLOSE) {
        return None;
    }
    out.push_str(rest);
    Some((out, spans))
}

impl Layout {
    /// The trust of each stretch of `range` of `text`: content as its role allows,
    /// everything else as template text.
    fn pieces_in<'t>(
        &self,
        text: &'t str,
        chat: &[ChatMessage],
        range: Range<usize>,
    ) -> Vec<(&'t str, Specials)> {
        let mut out = Vec::new();
        let mut at = range.start;
        for (i, span) in &self.spans {
            let (s, e) = (span.start.max(range.start), span.end.min(range.end));
            if s >= e {
                continue;
            }
            if at < s {
                out.push((&text[at..s], Specials::All));
            }
            let trust = if chat[*i].role == "assistant" {
                Specials::NonControl
            } else {
                Specials::None
            };
            out.push((&text[s..e], trust));
            at = e;
        }
        if at < range.end {
            out.push((&text[at..range.end], Specials::All));
        }
        out
    }

    fn pieces<'t>(&self, text: &'t str, chat: &[ChatMessage]) -> Vec<(&'t str, Specials)> {
        self.pieces_in(text, chat, 0..text.len())
    }

    /// Byte offsets where the message pieces start: 0, then for each later message with
    /// content, the last control token of the template text before it (or its start).
    fn cuts(&self, tokenizer: &Tokenizer, text: &str, end: usize) -> Vec<usize> {
        let mut cuts = vec![0];
        let mut prev_end = 0;
        for (i, span) in &self.spans {
            if span.start >= end {
                break;
            }
            // The first message starts the prompt, whatever the template writes before it.
            if *i > 0 {
                let gap = &text[prev_end..span.start];
                let at = tokenizer
                    .last_control_text(gap)
                    .map_or(span.start, |o| prev_end + o);
                if cuts.last().is_some_and(|&c| at > c) {
                    cuts.push(at);
                }
            }
            prev_end = span.end;
        }
        cuts.push(end);
        cuts
    }
}

/// [`render_pieces`] of the already rendered `full` text.
fn pieces_of(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    chat: &[ChatMessage],
    opts: &RenderOptions,
    full: &str,
) -> leyline_policy::Result<Rendered> {
    let render_err = |e: leyline_model::ModelError| PolicyError::Render(e.to_string());
    let prefix_opts = RenderOptions {
        add_generation_prompt: false,
        ..opts.clone()
    };
    let mut cuts = vec![0usize];
    for k in 1..=chat.len() {
        let prefix = template
            .render_with(&chat[..k], &prefix_opts)
            .map_err(render_err)?;
        if !full.starts_with(&prefix) {
            return Err(PolicyError::Render(format!(
                "the template does not render message {} as a stable prefix",
                k - 1
            )));
        }
        cuts.push(prefix.len());
    }
    cuts.push(full.len());
    let mut tokens = Vec::new();
    let mut bounds = Vec::with_capacity(chat.len() + 1);
    for w in cuts.windows(2) {
        bounds.push(tokens.len());
        let ids = tokenizer
            .encode(&full[w[0]..w[1]], false)
            .map_err(render_err)?;
        tokens.extend(ids);
    }
    // `bounds` has n + 1 entries: each message's start and the end of the last one; the
    // generation prompt after it is the trailing pseudo-message.
    bounds.truncate(chat.len() + 1);
    Ok(Rendered { tokens, bounds })
}

/// [`ChatRenderer`] without the generation prompt (template text cut where each message
/// starts, each piece tokenized on its own), memoized: the piece of message `k` by a hash
/// chained over `messages[..=k]`, the tokens by piece text. A replay then tokenizes each
/// distinct piece once instead of every prompt in full. The policy-trace tests check that both
/// renderers agree. Not `Sync`: one per thread.
pub struct MemoRenderer<'a> {
    tok: &'a Tokenizer,
    tmpl: &'a ChatTemplate,
    pieces: RefCell<HashMap<u64, (usize, Rc<str>)>>,
    tokens: RefCell<HashMap<Rc<str>, Rc<[u32]>>>,
}

impl<'a> MemoRenderer<'a> {
    /// An empty memo over `tok` and `tmpl`.
    pub fn new(tok: &'a Tokenizer, tmpl: &'a ChatTemplate) -> Self {
        Self {
            tok,
            tmpl,
            pieces: RefCell::default(),
            tokens: RefCell::default(),
        }
    }

    /// Forgets every memoized piece (bounds memory between trajectories).
    pub fn clear(&self) {
        self.pieces.borrow_mut().clear();
        self.tokens.borrow_mut().clear();
    }
}

fn chain(h: u64, m: &Message) -> u64 {
    let mut s = DefaultHasher::new();
    h.hash(&mut s);
    m.role.as_str().hash(&mut s);
    m.content.hash(&mut s);
    m.name.hash(&mut s);
    m.tool_call_id.hash(&mut s);
    for c in &m.tool_calls {
        (&c.id, &c.name, &c.arguments).hash(&mut s);
    }
    s.finish()
}

impl Renderer for MemoRenderer<'_> {
    fn render_tokens(&self, messages: &[Message]) -> leyline_policy::Result<Rendered> {
        let err = |e: leyline_model::ModelError| PolicyError::Render(e.to_string());
        let (mut h, mut text_len) = (0u64, 0usize);
        let mut out = Rendered::default();
        for k in 0..messages.len() {
            h = chain(h, &messages[k]);
            let known = self.pieces.borrow().get(&h).cloned();
            let (len, piece) = match known {
                Some(x) => x,
                None => {
                    let chat: Vec<_> = messages[..=k].iter().map(to_chat_message).collect();
                    let text = self.tmpl.render(&chat, false).map_err(err)?;
                    let piece: Rc<str> = text.get(text_len..).unwrap_or_default().into();
                    let x = (text.len(), piece);
                    self.pieces.borrow_mut().insert(h, x.clone());
                    x
                }
            };
            text_len = len;
            let known = self.tokens.borrow().get(&piece).cloned();
            let ids = match known {
                Some(ids) => ids,
                None => {
                    let ids: Rc<[u32]> = self.tok.encode(&piece, false).map_err(err)?.into();
                    self.tokens.borrow_mut().insert(piece, Rc::clone(&ids));
                    ids
                }
            };
            out.bounds.push(out.tokens.len());
            out.tokens.extend_from_slice(&ids);
        }
        out.bounds.push(out.tokens.len());
        Ok(out)
    }
}
