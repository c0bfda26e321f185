//! The [`Policy`] trait, token counting, and the tool-use index the built-in policies share.

use crate::message::{Message, Role, ToolCall};

/// A context policy: edits the message history before a request. It never sees tokens; the
/// engine finds the token directives by diffing the rendered prompts ([`crate::diff()`]).
pub trait Policy: Send + Sync {
    /// The policy's config name (`none`, `truncate_tool_outputs`, `clear_tool_uses`).
    fn name(&self) -> &str;

    /// The history the model should see when it writes assistant turn `turn` (0-based count of
    /// assistant messages before it). `messages` is the history so far; the result has the same
    /// number of messages, in the same order, with some contents replaced. Pure: same input, same
    /// output, and idempotent on its own output.
    fn transform(&self, messages: &[Message], turn: usize) -> Vec<Message>;
}

/// Counts tokens in text without a tokenizer being required.
pub trait TokenCounter: Send + Sync {
    /// Tokens in `text`.
    fn count(&self, text: &str) -> usize;
}

/// The default estimate: one token per 4 characters, rounded up.
#[derive(Debug, Clone, Copy, Default)]
pub struct CharEstimate;

impl TokenCounter for CharEstimate {
    fn count(&self, text: &str) -> usize {
        text.chars().count().div_ceil(4)
    }
}

impl<F: Fn(&str) -> usize + Send + Sync> TokenCounter for F {
    fn count(&self, text: &str) -> usize {
        self(text)
    }
}

/// The `none` policy: the history as it is.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoPolicy;

impl Policy for NoPolicy {
    fn name(&self) -> &str {
        "none"
    }
    fn transform(&self, messages: &[Message], _turn: usize) -> Vec<Message> {
        messages.to_vec()
    }
}

/// One tool use: a tool message and, when found, the assistant call it answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolUse {
    /// Index of the tool message.
    pub result: usize,
    /// `(assistant message index, call index in Message::calls())`, when the call is found.
    pub call: Option<(usize, usize)>,
    /// The tool's name: the tool message's `name`, else the call's.
    pub name: Option<String>,
}

/// Every tool use of `messages`, oldest first. A tool message answers the call whose id equals
/// its `tool_call_id`, else the call of the same rank among the tool messages after the
/// nearest preceding assistant message.
pub fn tool_uses(messages: &[Message]) -> Vec<ToolUse> {
    let mut out = Vec::new();
    let mut last: Option<(usize, Vec<ToolCall>)> = None;
    let mut rank = 0;
    for (j, m) in messages.iter().enumerate() {
        match m.role {
            Role::Assistant => {
                last = Some((j, m.calls()));
                rank = 0;
            }
            Role::Tool => {
                let call = last.as_ref().and_then(|(a, calls)| {
                    let by_id = m
                        .tool_call_id
                        .as_ref()
                        .and_then(|id| calls.iter().position(|c| c.id.as_ref() == Some(id)));
                    by_id
                        .or((rank < calls.len()).then_some(rank))
                        .map(|k| (*a, k, calls[k].name.clone()))
                });
                rank += 1;
                out.push(ToolUse {
                    result: j,
                    call: call.as_ref().map(|(a, k, _)| (*a, *k)),
                    name: m.name.clone().or(call.map(|(_, _, n)| n)),
                });
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_uses_pair_by_rank_and_by_id() {
        let mut a = Message::assistant(
            "<tool_call>{\"name\":\"x\",\"arguments\":{}}</tool_call>\
             <tool_call>{\"name\":\"y\",\"arguments\":{}}</tool_call>",
        );
        let msgs = vec![
            Message::user("u"),
            a.clone(),
            Message::tool("x", "1"),
            Message::new(Role::Tool, "2"),
        ];
        let uses = tool_uses(&msgs);
        assert_eq!(uses.len(), 2);
        assert_eq!(uses[0].call, Some((1, 0)));
        assert_eq!(uses[1].call, Some((1, 1)));
        assert_eq!(uses[1].name.as_deref(), Some("y"));

        a.content.clear();
        a.tool_calls = vec![
            ToolCall {
                id: Some("p".into()),
                name: "x".into(),
                arguments: "{}".into(),
            },
            ToolCall {
                id: Some("q".into()),
                name: "y".into(),
                arguments: "{}".into(),
            },
        ];
        let mut t = Message::new(Role::Tool, "out");
        t.tool_call_id = Some("q".into());
        let uses = tool_uses(&[a, t]);
        assert_eq!(uses[0].call, Some((0, 1)));
        assert_eq!(uses[0].name.as_deref(), Some("y"));
    }

    #[test]
    fn char_estimate_rounds_up() {
        assert_eq!(CharEstimate.count(""), 0);
        assert_eq!(CharEstimate.count("abcde"), 2);
        assert_eq!(CharEstimate.count("éééé"), 1);
        let words = |s: &str| s.split_whitespace().count();
        assert_eq!(TokenCounter::count(&words, "a b  c"), 3);
    }
}
