//! Server-side context editing: `context_management.edits` (Anthropic's
//! `clear_tool_uses_20250919` and `clear_thinking_20251015`, or any policy of
//! `leyline-policy` by name) applied to the
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
    /// Assistant turns whose thinking it cleared (`clear_thinking_*` only).
    pub cleared_thinking_turns: Option<usize>,
}

/// Anthropic's edit that clears thinking blocks of older turns.
pub const CLEAR_THINKING: &str = "clear_thinking_20251015";

impl AppliedEdit {
    /// The JSON Anthropic's API returns for it.
    pub fn to_json(&self) -> Value {
        match self.cleared_thinking_turns {
            Some(turns) => json!({
                "type": self.kind,
                "cleared_thinking_turns": turns,
                "cleared_input_tokens": self.cleared_input_tokens,
            }),
            None => json!({
                "type": self.kind,
                "cleared_tool_uses": self.cleared_tool_uses,
                "cleared_input_tokens": self.cleared_input_tokens,
            }),
        }
    }
}

/// Checks a `clear_thinking_20251015` edit (`keep`: `"all"` or `{"type": "thinking_turns",
/// "value": N}`) and says what it did: nothing, since these models have no reasoning format
/// and so no thinking reaches their prompt (the Messages API leaves thinking blocks out).
fn clear_thinking(e: &Value, at: &str) -> Result<AppliedEdit> {
    if let Some(k) = e
        .as_object()
        .and_then(|o| o.keys().find(|k| *k != "type" && *k != "keep"))
    {
        return Err(ServerError::invalid(
            &format!("{at}.{k}"),
            format!("{k} is not a field of {CLEAR_THINKING}"),
        ));
    }
    match e.get("keep") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "all" => {}
        Some(k)
            if k.get("type").and_then(Value::as_str) == Some("thinking_turns")
                && k.get("value").is_some_and(Value::is_u64) => {}
        Some(_) => {
            return Err(ServerError::invalid(
                &format!("{at}.keep"),
                "keep must be \"all\" or {\"type\": \"thinking_turns\", \"value\": N}",
            ))
        }
    }
    Ok(AppliedEdit {
        kind: CLEAR_THINKING.to_string(),
        cleared_tool_uses: 0,
        cleared_input_tokens: 0,
        cleared_thinking_turns: Some(0),
    })
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
        if kind == CLEAR_THINKING {
            applied.push(clear_thinking(e, &at)?);
            continue;
        }
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
            cleared_thinking_turns: None,
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
        let path = leyline_hub::default_model_path();
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
        // Claude Code's default edit clears nothing (no thinking reaches these prompts) and
        // reports it in Anthropic's shape; a malformed `keep` is named.
        let thinking = json!({"edits": [{"type": CLEAR_THINKING, "keep": "all"},
            {"type": CLEAR_THINKING, "keep": {"type": "thinking_turns", "value": 1}}]});
        let done = apply(&mut chat, &thinking, &tok).unwrap();
        assert_eq!(done[0].to_json()["cleared_thinking_turns"], 0);
        assert!(done[1].to_json().get("cleared_tool_uses").is_none());
        let bad_keep = json!({"edits": [{"type": CLEAR_THINKING, "keep": 3}]});
        let e = apply(&mut chat, &bad_keep, &tok).unwrap_err();
        assert_eq!(
            e.body()["error"]["param"],
            "context_management.edits[0].keep"
        );
        let extra = json!({"edits": [{"type": CLEAR_THINKING, "trigger": 3}]});
        let e = apply(&mut chat, &extra, &tok).unwrap_err();
        assert_eq!(
            e.body()["error"]["param"],
            "context_management.edits[0].trigger"
        );
    }
}
