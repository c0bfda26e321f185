//! Anthropic Messages API wire types (`POST /v1/messages`) and their conversion into chat
//! messages for the model's template; the response and stream shapes; errors in Anthropic's
//! envelope. Block shapes are checked by hand so a 400 names the field
//! (`messages[2].content[0].tool_use_id`).

use crate::error::{Result, ServerError};
use leyline_model::chat::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};

/// `POST /v1/messages` (Leyline's own fields, `session_id`, `leyline` and `cache_salt`, are
/// read from the same body as for chat completions).
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// Model id.
    pub model: String,
    /// Most new tokens (required by the API).
    pub max_tokens: i64,
    /// The conversation: alternating `user` and `assistant` messages.
    pub messages: Vec<Value>,
    /// A system prompt: text, or text blocks.
    #[serde(default)]
    pub system: Option<Value>,
    /// Tools: `{name, description, input_schema}`.
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// `{"type": "auto" | "none" | "any" | "tool"}`.
    #[serde(default)]
    pub tool_choice: Option<Value>,
    /// Stop strings.
    #[serde(default)]
    pub stop_sequences: Option<Vec<String>>,
    /// Temperature in [0, 1].
    #[serde(default)]
    pub temperature: Option<f64>,
    /// Nucleus mass.
    #[serde(default)]
    pub top_p: Option<f64>,
    /// Keep the k most likely tokens.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Request metadata (`user_id`); accepted, not used.
    #[serde(default)]
    pub metadata: Option<Value>,
    /// Stream the answer as server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Server-side context editing: `{"edits": [{"type": "clear_tool_uses_20250919", ...}]}`.
    #[serde(default)]
    pub context_management: Option<Value>,
}

fn text_of(v: &Value, at: &str) -> Result<String> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| ServerError::invalid(at, format!("`{at}` must be a string")))
}

/// The text of a `system` value or a `tool_result` content: a string, or text blocks
/// (joined with blank lines).
fn text_or_text_blocks(v: &Value, at: &str) -> Result<String> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                let here = format!("{at}[{j}]");
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(text_of(
                        b.get("text").unwrap_or(&Value::Null),
                        &format!("{here}.text"),
                    )?),
                    Some(other) => {
                        return Err(ServerError::invalid(
                            &format!("{here}.type"),
                            format!("only text blocks are supported here, got {other:?}"),
                        ))
                    }
                    None => {
                        return Err(ServerError::invalid(
                            &format!("{here}.type"),
                            "every content block needs a `type`",
                        ))
                    }
                }
            }
            Ok(parts.join("\n\n"))
        }
        _ => Err(ServerError::invalid(
            at,
            format!("`{at}` must be a string or a list of text blocks"),
        )),
    }
}

/// The chat messages the template renders: the system prompt, then each message's blocks
/// (tool results become `tool` messages before the user's text; tool uses become the
/// assistant's `tool_calls`, arguments as objects as templates expect).
///
/// # Errors
/// A 400 naming the first malformed field.
pub fn to_chat(req: &MessagesRequest) -> Result<Vec<ChatMessage>> {
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    if let Some(sys) = &req.system {
        let text = text_or_text_blocks(sys, "system")?;
        if !text.is_empty() {
            out.push(ChatMessage::new("system", text));
        }
    }
    if req.messages.is_empty() {
        return Err(ServerError::invalid(
            "messages",
            "messages must not be empty",
        ));
    }
    for (i, m) in req.messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        if role != "user" && role != "assistant" {
            return Err(ServerError::invalid(
                &format!("{at}.role"),
                format!(
                    "role must be \"user\" or \"assistant\", got {:?}",
                    m.get("role")
                ),
            ));
        }
        let content = m.get("content").unwrap_or(&Value::Null);
        let blocks: Vec<Value> = match content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => {
                return Err(ServerError::invalid(
                    &format!("{at}.content"),
                    "content must be a string or a list of content blocks",
                ))
            }
        };
        let (mut text, mut calls, mut results) = (Vec::new(), Vec::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let here = format!("{at}.content[{j}]");
            let field = |name: &str| b.get(name).unwrap_or(&Value::Null);
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push(text_of(field("text"), &format!("{here}.text"))?),
                Some("tool_use") if role == "assistant" => {
                    let id = text_of(field("id"), &format!("{here}.id"))?;
                    let name = text_of(field("name"), &format!("{here}.name"))?;
                    let input = field("input");
                    if !input.is_object() {
                        return Err(ServerError::invalid(
                            &format!("{here}.input"),
                            "a tool_use input must be an object",
                        ));
                    }
                    calls.push(json!({
                        "id": id, "type": "function",
                        "function": {"name": name, "arguments": input},
                    }));
                }
                Some("tool_result") if role == "user" => {
                    let id = text_of(field("tool_use_id"), &format!("{here}.tool_use_id"))?;
                    let mut body = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(c) => text_or_text_blocks(c, &format!("{here}.content"))?,
                    };
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        body = format!("Error: {body}");
                    }
                    let mut t = ChatMessage::new("tool", body);
                    t.tool_call_id = Some(id);
                    results.push(t);
                }
                Some(kind @ ("tool_use" | "tool_result")) => {
                    return Err(ServerError::invalid(
                        &format!("{here}.type"),
                        format!("a {kind} block cannot appear in a {role} message"),
                    ))
                }
                Some(other) => {
                    return Err(ServerError::invalid(
                        &format!("{here}.type"),
                        format!("content blocks of type {other:?} are not supported"),
                    ))
                }
                None => {
                    return Err(ServerError::invalid(
                        &format!("{here}.type"),
                        "every content block needs a `type`",
                    ))
                }
            }
        }
        out.extend(results);
        let joined = text.join("\n\n");
        if role == "assistant" {
            // Content stays a string (maybe empty) beside tool calls: templates that
            // concatenate it (SmolLM2's) fail on a missing one, and `if content` is false
            // either way for those that test it (Qwen2.5's).
            let mut a = ChatMessage::new("assistant", joined);
            if !calls.is_empty() {
                a.tool_calls = Some(calls);
            }
            out.push(a);
        } else if !joined.is_empty() || out.last().is_none_or(|m| m.role != "tool") {
            out.push(ChatMessage::new("user", joined));
        }
    }
    Ok(out)
}

/// The tools in the form chat templates take (`{"type": "function", "function": ...}`), or
/// none when `tool_choice` is `none`.
///
/// # Errors
/// A 400 for a malformed tool, or a `tool_choice` this server cannot enforce.
pub fn template_tools(req: &MessagesRequest) -> Result<Option<Vec<Value>>> {
    match req
        .tool_choice
        .as_ref()
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
    {
        None | Some("auto") => {}
        Some("none") => return Ok(None),
        Some(other) => {
            return Err(ServerError::invalid(
                "tool_choice.type",
                format!("tool_choice {other:?} is not supported: this server cannot force a tool call; use \"auto\" or \"none\""),
            ))
        }
    }
    let Some(tools) = &req.tools else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        let name = text_of(
            t.get("name").unwrap_or(&Value::Null),
            &format!("tools[{i}].name"),
        )?;
        let schema = t
            .get("input_schema")
            .filter(|s| s.is_object())
            .ok_or_else(|| {
                ServerError::invalid(
                    &format!("tools[{i}].input_schema"),
                    "a tool needs an input_schema object",
                )
            })?;
        // OpenAI's key order (name, description, parameters): templates print the object
        // as it lies, and models were trained on that form.
        let mut f = serde_json::Map::new();
        f.insert("name".into(), json!(name));
        if let Some(d) = t.get("description").and_then(Value::as_str) {
            f.insert("description".into(), json!(d));
        }
        f.insert("parameters".into(), schema.clone());
        out.push(json!({"type": "function", "function": f}));
    }
    Ok((!out.is_empty()).then_some(out))
}

/// Anthropic's error `type` for an HTTP status.
fn error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `{"type": "error", "error": {"type", "message"}}` for `e`.
pub fn error_body(e: &ServerError) -> Value {
    json!({"type": "error", "error": {"type": error_type(e.status().as_u16()), "message": e.to_string()}})
}

/// `e` as a response in Anthropic's envelope, with the status and headers it has anyway.
pub fn error_response(e: ServerError) -> axum::response::Response {
    use axum::response::IntoResponse;
    let body = error_body(&e);
    let mut resp = e.into_response();
    let headers = resp.headers().clone();
    let status = resp.status();
    resp = (status, axum::Json(body)).into_response();
    for (k, v) in headers.iter() {
        if k != axum::http::header::CONTENT_LENGTH && k != axum::http::header::CONTENT_TYPE {
            resp.headers_mut().insert(k.clone(), v.clone());
        }
    }
    resp
}

/// Anthropic's `stop_reason` for how a generation ended.
pub fn stop_reason(
    finish_reason: &str,
    stop_sequence: Option<&str>,
    called_tool: bool,
) -> &'static str {
    if called_tool {
        "tool_use"
    } else if stop_sequence.is_some() {
        "stop_sequence"
    } else if finish_reason == "length" {
        "max_tokens"
    } else {
        "end_turn"
    }
}

/// The `usage` object: `input_tokens` excludes what was read from the cache.
pub fn usage(u: &leyline_engine::Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": u.completion_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn blocks_become_template_messages() {
        let r = req(json!({
            "model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": true},
                    {"type": "text", "text": "And tomorrow?"}
                ]}
            ]
        }));
        let chat = to_chat(&r).unwrap();
        let roles: Vec<&str> = chat.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "tool", "user"]
        );
        assert_eq!(chat[2].content.as_deref(), Some("Checking."));
        let call = &chat[2].tool_calls.as_ref().unwrap()[0];
        assert_eq!(call["function"]["arguments"], json!({"city": "Paris"}));
        assert_eq!(chat[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(chat[3].content.as_deref(), Some("18C"));
        assert_eq!(chat[4].content.as_deref(), Some("Error: down"));
        assert_eq!(chat[5].content.as_deref(), Some("And tomorrow?"));
    }

    #[test]
    fn malformed_blocks_name_the_field() {
        let cases = [
            (
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "tool_result"}]}]),
                "messages[0].content[0].tool_use_id",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": 3}]}]),
                "messages[0].content[0].input",
            ),
            (
                json!([{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "system", "content": "x"}]),
                "messages[0].role",
            ),
            (
                json!([{"role": "user", "content": [{"text": "no type"}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": 5}]),
                "messages[0].content",
            ),
        ];
        for (messages, param) in cases {
            let r = req(json!({"model": "m", "max_tokens": 1, "messages": messages}));
            let e = to_chat(&r).unwrap_err();
            assert_eq!(e.body()["error"]["param"], param, "{e}");
            assert_eq!(error_body(&e)["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn tools_take_the_template_form_and_choice_is_checked() {
        let tools = json!([{"name": "f", "description": "d", "input_schema": {"type": "object"}}]);
        let r = req(json!({"model": "m", "max_tokens": 1, "messages": [], "tools": tools}));
        let t = template_tools(&r).unwrap().unwrap();
        assert_eq!(t[0]["function"]["parameters"], json!({"type": "object"}));
        let none = req(
            json!({"model": "m", "max_tokens": 1, "messages": [], "tools": tools, "tool_choice": {"type": "none"}}),
        );
        assert_eq!(template_tools(&none).unwrap(), None);
        let any = req(
            json!({"model": "m", "max_tokens": 1, "messages": [], "tools": tools, "tool_choice": {"type": "any"}}),
        );
        assert_eq!(
            template_tools(&any).unwrap_err().body()["error"]["param"],
            "tool_choice.type"
        );
        let bad =
            req(json!({"model": "m", "max_tokens": 1, "messages": [], "tools": [{"name": "f"}]}));
        assert_eq!(
            template_tools(&bad).unwrap_err().body()["error"]["param"],
            "tools[0].input_schema"
        );
    }

    #[test]
    fn errors_and_stop_reasons_follow_the_api() {
        assert_eq!(error_type(400), "invalid_request_error");
        assert_eq!(error_type(401), "authentication_error");
        assert_eq!(error_type(404), "not_found_error");
        assert_eq!(error_type(503), "overloaded_error");
        assert_eq!(error_type(500), "api_error");
        assert_eq!(stop_reason("stop", None, true), "tool_use");
        assert_eq!(stop_reason("stop", Some("END"), false), "stop_sequence");
        assert_eq!(stop_reason("length", None, false), "max_tokens");
        assert_eq!(stop_reason("stop", None, false), "end_turn");
    }
}
