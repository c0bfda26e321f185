//! The real tokenizer and chat template as a [`leyline_policy::Renderer`]: messages become
//! tokens with the token index where each message starts, so the policy diff can anchor
//! its edits on message boundaries.

use leyline_model::chat::{ChatMessage, ChatTemplate};
use leyline_model::tokenizer::Tokenizer;
use leyline_policy::{Message, PolicyError, Rendered, Renderer};

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
    /// Renders the whole list once and every prefix `messages[..k]` to find where message
    /// `k` starts in the text. Each message's text is tokenized on its own: templates open
    /// a message with a special token, which the tokenizer never merges across.
    fn render_tokens(&self, messages: &[Message]) -> leyline_policy::Result<Rendered> {
        let render_err = |e: leyline_model::ModelError| PolicyError::Render(e.to_string());
        let chat: Vec<ChatMessage> = messages.iter().map(to_chat_message).collect();
        let full = self
            .template
            .render(&chat, self.generation_prompt)
            .map_err(render_err)?;
        let mut cuts = vec![0usize];
        for k in 1..=chat.len() {
            let prefix = self
                .template
                .render(&chat[..k], false)
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
            let ids = self
                .tokenizer
                .encode(&full[w[0]..w[1]], false)
                .map_err(render_err)?;
            tokens.extend(ids);
        }
        // `bounds` has n + 1 entries: each message's start and the end of the last one; the
        // generation prompt after it is the trailing pseudo-message.
        bounds.truncate(chat.len() + 1);
        Ok(Rendered { tokens, bounds })
    }
}
