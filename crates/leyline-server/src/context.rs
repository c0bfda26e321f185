//! Server-side context editing: `context_management.edits` (Anthropic's
//! `clear_tool_uses_20250919`, or any policy of `leyline-policy` by name) applied to the
//! history the client sent, before it is rendered. The client keeps sending its whole
//! history; the model sees the edited one, and in a session the difference to the cached
//! context becomes directives like any other edit.

use crate::error::{Result, ServerError};
use leyline_model::chat::ChatMessage;
use leyline_model::tokenizer::Tokenizer;
use leyline_policy::{Message, PolicyConfig};
use serde_json::{json, Value};
use std::sync::Arc;

/// What one edit did, as the response reports it (`context_management.applied_edits`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppliedEdit {
    /// The edit's type as the request named it.
    pub kind: String,
    /// Tool results (and arguments) it replaced.
    pub cleared_tool_uses: usize,
    /// Tokens those held, less the placeholders' (by the model's tokenizer).
    pub cleared_input_tokens: usize,
}

impl AppliedEdit {
    /// The JSON Anthropic's API returns for it.
    pub fn to_json(&self) -> Value {
        json!({
            "type": self.kind,
            "cleared_tool_uses": self.cleared_tool_uses,
            "cleared_input_tokens": self.cleared_input_tokens,
        })
    }
}

/// Applies `spec` (`{"edits": [...]}`) to `chat` in place; returns what each edit did.
///
/// # Errors
/// A 400 naming `context_management.edits[i]` for an edit this server does not know or a
/// malformed one.
pub fn apply(
    chat: &mut [ChatMessage],
    spec: &Value,
    tokenizer: &Arc<Tokenizer>,
) -> Result<Vec<AppliedEdit>> {
    let edits = match spec.get("edits") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(e)) => e,
        Some(_) => {
            return Err(ServerError::invalid(
                "context_management.edits",
                "context_management.edits must be a list",
            ))
        }
    };
    let tok = Arc::clone(tokenizer);
    let count = move |t: &str| tok.encode(t, false).map_or(t.len() / 4, |ids| ids.len());
    let counter: Arc<dyn leyline_policy::TokenCounter> = Arc::new(count.clone());
    let mut applied = Vec::with_capacity(edits.len());
    for (i, e) in edits.iter().enumerate() {
        let at = format!("context_management.edits[{i}]");
        let kind = e
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let config: PolicyConfig = serde_json::from_value(e.clone())
            .map_err(|err| ServerError::invalid(&at, format!("invalid edit: {err}")))?;
        let policy = config.build_with_counter(Arc::clone(&counter));
        let before: Vec<Message> = chat
            .iter()
            .map(|m| serde_json::to_value(m).and_then(serde_json::from_value))
            .collect::<std::result::Result<_, _>>()
            .map_err(|err| ServerError::invalid("messages", format!("{err}")))?;
        let turn = before
            .iter()
            .filter(|m| m.role == leyline_policy::Role::Assistant)
            .count();
        let after = policy.transform(&before, turn);
        let mut done = AppliedEdit {
            kind,
            cleared_tool_uses: 0,
            cleared_input_tokens: 0,
        };
        for ((m, old), new) in chat.iter_mut().zip(&before).zip(&after) {
            if new.content != old.content {
                done.cleared_tool_uses += usize::from(old.role == leyline_policy::Role::Tool);
                done.cleared_input_tokens +=
                    count(&old.content).saturating_sub(count(&new.content));
                m.content = Some(new.content.clone());
            }
            let calls = m.tool_calls.iter_mut().flatten();
            for ((call, o), n) in calls.zip(&old.tool_calls).zip(&new.tool_calls) {
                if n.arguments != o.arguments {
                    done.cleared_input_tokens +=
                        count(&o.arguments).saturating_sub(count(&n.arguments));
                    call["function"]["arguments"] = Value::String(n.arguments.clone());
                }
            }
        }
        applied.push(done);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `apply` refuses (counting needs the default model's tokenizer; the edits
    /// themselves are checked through the official client in tests/anthropic_client.rs).
    #[test]
    fn malformed_edit_lists_are_refused_by_name() {
        let bad = json!({"edits": {"type": "clear_tool_uses_20250919"}});
        let path = leyline_model::registry::default_model_path();
        let Ok(path) = path else {
            panic!("the default model is needed for its tokenizer");
        };
        let f = leyline_model::gguf::GgufFile::open(&path).expect("GGUF");
        let tok = Arc::new(Tokenizer::from_gguf_metadata(f.metadata()).expect("tokenizer"));
        let mut chat = vec![ChatMessage::new("user", "hi")];
        let e = apply(&mut chat, &bad, &tok).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "context_management.edits");
        let unknown = json!({"edits": [{"type": "summarize_everything"}]});
        let e = apply(&mut chat, &unknown, &tok).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "context_management.edits[0]");
        assert!(apply(&mut chat, &json!({}), &tok).unwrap().is_empty());
    }
}
