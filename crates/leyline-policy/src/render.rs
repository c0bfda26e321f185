//! A stand-in [`Renderer`] for tests and benches without a model: bytes as tokens and a
//! ChatML template.

use crate::diff::{Rendered, Renderer};
use crate::error::Result;
use crate::message::Message;

/// Byte-level tokens (`0..=255`) in a ChatML template,
/// `<|im_start|>{role}\n{content}{calls}<|im_end|>\n` per message, where `<|im_start|>` and
/// `<|im_end|>` are the special tokens [`ByteChatMl::IM_START`] and [`ByteChatMl::IM_END`] and
/// `{calls}` writes each structured tool call as `\n<tool_call>{json}</tool_call>`. Tokens
/// never cross a message boundary, so rendering is stable at every boundary.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByteChatMl;

impl ByteChatMl {
    /// `<|im_start|>`.
    pub const IM_START: u32 = 256;
    /// `<|im_end|>`.
    pub const IM_END: u32 = 257;

    fn push_message(out: &mut Vec<u32>, m: &Message) {
        out.push(Self::IM_START);
        out.extend(m.role.as_str().bytes().map(u32::from));
        out.push(u32::from(b'\n'));
        out.extend(m.content.bytes().map(u32::from));
        for c in &m.tool_calls {
            let body = serde_json::json!({"name": c.name, "arguments": c.arguments});
            let text = format!("\n<tool_call>{body}</tool_call>");
            out.extend(text.bytes().map(u32::from));
        }
        out.push(Self::IM_END);
        out.push(u32::from(b'\n'));
    }
}

impl Renderer for ByteChatMl {
    fn render_tokens(&self, messages: &[Message]) -> Result<Rendered> {
        let mut tokens = Vec::new();
        let mut bounds = Vec::with_capacity(messages.len() + 1);
        for m in messages {
            bounds.push(tokens.len());
            Self::push_message(&mut tokens, m);
        }
        bounds.push(tokens.len());
        Ok(Rendered { tokens, bounds })
    }
}
