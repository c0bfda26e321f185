//! The real tokenizer and chat template as a [`leyline_policy::Renderer`]: messages become
//! tokens with the token index where each message starts, so the policy diff can anchor
//! its edits on message boundaries.

use leyline_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use leyline_model::tokenizer::Tokenizer;
use leyline_policy::{Message, PolicyError, Rendered, Renderer};
use std::cell::RefCell;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
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

/// A chat prompt rendered once and tokenized: its tokens (the whole text's tokenization)
/// and, when `with_bounds` is set and the message pieces tokenize to exactly those tokens,
/// where each message starts (then where the last one ends), for a session's diff.
///
/// # Errors
/// The template or the tokenizer fails.
pub fn render_prompt(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    chat: &[ChatMessage],
    opts: &RenderOptions,
    with_bounds: bool,
) -> Result<(Vec<u32>, Option<Vec<usize>>), leyline_model::ModelError> {
    let text = template.render_with(chat, opts)?;
    let prompt = tokenizer.encode(&text, false)?;
    let bounds = with_bounds
        .then(|| pieces_of(tokenizer, template, chat, opts, &text).ok())
        .flatten()
        .filter(|r| r.tokens == prompt)
        .map(|r| r.bounds);
    Ok((prompt, bounds))
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
