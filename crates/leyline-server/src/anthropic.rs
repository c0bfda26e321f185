//! Anthropic Messages API wire types (`POST /v1/messages`) and their conversion into chat
//! messages for the model's template; the response and stream shapes; errors in Anthropic's
//! envelope. Block shapes are checked by hand so a 400 names the field
//! (`messages[2].content[0].tool_use_id`).

use crate::error::{Result, ServerError};
use leyline_model::chat::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};

/// The top-level fields of `POST /v1/messages` this server reads. Any other field is a 400
/// naming it: a request is never served with part of it silently ignored.
///
/// Accepted with no effect on the answer (what a stock client such as Claude Code sends by
/// default): `metadata`, `service_tier`, `output_config.effort`, `thinking` (a model that
/// reasons returns thinking blocks unless `thinking.type` is `disabled`, which turns its
/// template's `enable_thinking` off; budgets are not enforced), `cache_control` on any block (the
/// prefix cache and implicit splices reuse KV without being asked; the breakpoints only split
/// `usage`), `disable_parallel_tool_use`, server tools such as `web_search_*` (not offered to
/// the model; named in `leyline.unsupported_tools`). Leyline's own fields
/// ([`crate::openai::LEYLINE_FIELDS`]) come on top.
pub const MESSAGES_FIELDS: [&str; 16] = [
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "stream",
    "context_management",
    "thinking",
    "output_config",
    "service_tier",
];

/// `POST /v1/messages` (Leyline's own fields, `session_id`, `leyline` and `cache_salt`, are
/// read from the same body as for chat completions).
#[derive(Debug, Clone, Deserialize)]
pub struct MessagesRequest {
    /// Model id.
    pub model: String,
    /// Most new tokens (required by the API).
    pub max_tokens: i64,
    /// The conversation: `user` and `assistant` messages, and `system` messages among them.
    pub messages: Vec<Value>,
    /// A system prompt: text, or text blocks.
    #[serde(default)]
    pub system: Option<Value>,
    /// Tools: `{name, description, input_schema}`, or server tools (`{type, name}`).
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
    /// Extended thinking: `{"type": "enabled" | "adaptive" | "disabled"}`; checked, no effect.
    #[serde(default)]
    pub thinking: Option<Value>,
    /// `{"effort": ...}`; checked, no effect.
    #[serde(default)]
    pub output_config: Option<Value>,
}

fn text_of(v: &Value, at: &str) -> Result<String> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| ServerError::invalid(at, format!("`{at}` must be a string")))
}

/// Whether block `b` carries a `cache_control` breakpoint (checked: an object whose `type`
/// is `ephemeral`).
fn breakpoint(b: &Value, at: &str) -> Result<bool> {
    match b.get("cache_control") {
        None | Some(Value::Null) => Ok(false),
        Some(c) if c.get("type").and_then(Value::as_str) == Some("ephemeral") => Ok(true),
        Some(_) => Err(ServerError::invalid(
            &format!("{at}.cache_control"),
            "cache_control must be {\"type\": \"ephemeral\"} (a `ttl` may follow)",
        )),
    }
}

/// The text of a `system` value or a `tool_result` content: a string, or text blocks
/// (joined with blank lines); and whether a block holds a cache breakpoint.
fn text_or_text_blocks(v: &Value, at: &str) -> Result<(String, bool)> {
    match v {
        Value::String(s) => Ok((s.clone(), false)),
        Value::Array(blocks) => {
            let mut parts = Vec::with_capacity(blocks.len());
            let mut marked = false;
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
                marked |= breakpoint(b, &here)?;
            }
            Ok((parts.join("\n\n"), marked))
        }
        _ => Err(ServerError::invalid(
            at,
            format!("`{at}` must be a string or a list of text blocks"),
        )),
    }
}

/// What Claude Code puts first in `system`: a text block `x-anthropic-billing-header: ...`,
/// metadata for Anthropic's billing whose hash changes with the conversation's first
/// message. Rendered, it would change the prompt's first tokens with every new conversation
/// and compaction, and no prefix would ever be shared; it says nothing to the model, so it
/// is left out (only as the first block, and only with that prefix).
const BILLING_HEADER: &str = "x-anthropic-billing-header:";

fn without_billing_header(system: &Value) -> std::borrow::Cow<'_, Value> {
    match system.as_array() {
        Some(blocks)
            if blocks.first().is_some_and(|b| {
                b.get("type").and_then(Value::as_str) == Some("text")
                    && b.get("text")
                        .and_then(Value::as_str)
                        .is_some_and(|t| t.starts_with(BILLING_HEADER))
            }) =>
        {
            std::borrow::Cow::Owned(Value::Array(blocks[1..].to_vec()))
        }
        _ => std::borrow::Cow::Borrowed(system),
    }
}

/// A request's messages as the template renders them.
#[derive(Debug, Clone, PartialEq)]
pub struct Converted {
    /// The chat messages, system prompt first.
    pub chat: Vec<ChatMessage>,
    /// How many of `chat` end at or before the last `cache_control` breakpoint (breakpoints
    /// on tools count with the system prompt); `None` without breakpoints.
    pub cached_messages: Option<usize>,
}

/// The chat messages the template renders: the system prompt, then each message's blocks
/// (tool results become `tool` messages before the user's text; tool uses become the
/// assistant's `tool_calls`, arguments as objects as templates expect). `system` messages
/// among the others stay at their place. Thinking blocks are checked and left out: these
/// models have no reasoning format, so they never wrote them.
///
/// # Errors
/// A 400 naming the first malformed field.
pub fn to_chat(req: &MessagesRequest) -> Result<Converted> {
    let mut out = Vec::with_capacity(req.messages.len() + 1);
    let mut cached_messages = None;
    if let Some(sys) = &req.system {
        let (text, marked) = text_or_text_blocks(&without_billing_header(sys), "system")?;
        if !text.is_empty() {
            out.push(ChatMessage::new("system", text));
        }
        if marked {
            cached_messages = Some(out.len());
        }
    }
    let tools_marked = req
        .tools
        .iter()
        .flatten()
        .any(|t| t.get("cache_control").is_some());
    if tools_marked {
        cached_messages = Some(out.len());
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
        if !["user", "assistant", "system"].contains(&role) {
            return Err(ServerError::invalid(
                &format!("{at}.role"),
                format!(
                    "role must be \"user\", \"assistant\" or \"system\", got {:?}",
                    m.get("role")
                ),
            ));
        }
        let content = m.get("content").unwrap_or(&Value::Null);
        if role == "system" {
            let (text, marked) = text_or_text_blocks(content, &format!("{at}.content"))?;
            out.push(ChatMessage::new("system", text));
            if marked {
                cached_messages = Some(out.len());
            }
            continue;
        }
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
        let mut marked = false;
        for (j, b) in blocks.iter().enumerate() {
            let here = format!("{at}.content[{j}]");
            let field = |name: &str| b.get(name).unwrap_or(&Value::Null);
            marked |= breakpoint(b, &here)?;
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push(text_of(field("text"), &format!("{here}.text"))?),
                Some("thinking") if role == "assistant" => {
                    text_of(field("thinking"), &format!("{here}.thinking"))?;
                }
                Some("redacted_thinking") if role == "assistant" => {
                    text_of(field("data"), &format!("{here}.data"))?;
                }
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
                        Some(c) => text_or_text_blocks(c, &format!("{here}.content"))?.0,
                    };
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        body = format!("Error: {body}");
                    }
                    let mut t = ChatMessage::new("tool", body);
                    t.tool_call_id = Some(id);
                    results.push(t);
                }
                Some(kind @ ("tool_use" | "tool_result" | "thinking" | "redacted_thinking")) => {
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
        if marked {
            cached_messages = Some(out.len());
        }
    }
    Ok(Converted {
        chat: out,
        cached_messages,
    })
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// No tools are offered.
    None,
    /// Some tool must be called.
    Any,
    /// This tool must be called.
    Tool(String),
}

/// The tools the model is offered and what the request asks of them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// In the form chat templates take (`{"type": "function", "function": ...}`); `None`
    /// when none is offered.
    pub offered: Option<Vec<Value>>,
    /// The request's `tool_choice`.
    pub choice: ToolChoice,
    /// Server tools (`web_search_*` and the like) the request listed: not offered, since
    /// this server does not run them.
    pub unsupported: Vec<String>,
}

/// Reads `tools` and `tool_choice`.
///
/// # Errors
/// A 400 for a malformed tool or choice, or a choice naming a tool that is not offered.
pub fn template_tools(req: &MessagesRequest) -> Result<Tools> {
    let choice = match &req.tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(c) => match c.get("type").and_then(Value::as_str) {
            Some("auto") => ToolChoice::Auto,
            Some("none") => ToolChoice::None,
            Some("any") => ToolChoice::Any,
            Some("tool") => ToolChoice::Tool(text_of(
                c.get("name").unwrap_or(&Value::Null),
                "tool_choice.name",
            )?),
            other => {
                return Err(ServerError::invalid(
                    "tool_choice.type",
                    format!("tool_choice.type must be auto, none, any or tool, got {other:?}"),
                ))
            }
        },
    };
    let mut out = Vec::new();
    let mut unsupported = Vec::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        let name = text_of(
            t.get("name").unwrap_or(&Value::Null),
            &format!("tools[{i}].name"),
        )?;
        let kind = t.get("type").and_then(Value::as_str);
        let schema = t.get("input_schema");
        if schema.is_none() && kind.is_some_and(|k| k != "custom") {
            unsupported.push(name);
            continue;
        }
        let schema = schema.filter(|s| s.is_object()).ok_or_else(|| {
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
    if choice != ToolChoice::Auto && choice != ToolChoice::None && out.is_empty() {
        return Err(ServerError::invalid(
            "tool_choice",
            "tool_choice asks for a tool call but the request offers no tool the model can call",
        ));
    }
    if let ToolChoice::Tool(name) = &choice {
        if !crate::toolcall::tool_names(&out).contains(name) {
            return Err(ServerError::invalid(
                "tool_choice.name",
                format!("tool_choice names {name:?}, which is not among the request's tools"),
            ));
        }
    }
    let offered = (choice != ToolChoice::None && !out.is_empty()).then_some(out);
    Ok(Tools {
        offered,
        choice,
        unsupported,
    })
}

/// What `thinking` asks of a model that reasons: `Some(false)` for `disabled`, else the
/// template's default.
pub fn thinking_wanted(req: &MessagesRequest) -> Option<bool> {
    let t = req.thinking.as_ref()?;
    (t.get("type").and_then(Value::as_str) == Some("disabled")).then_some(false)
}

/// Checks `thinking` and `output_config`: their shapes must be the API's; only
/// `thinking.type: disabled` changes anything ([`thinking_wanted`]).
///
/// # Errors
/// A 400 naming the malformed field.
pub fn check_reasoning_fields(req: &MessagesRequest) -> Result<()> {
    if let Some(t) = req.thinking.as_ref().filter(|t| !t.is_null()) {
        match t.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                if !t.get("budget_tokens").is_some_and(Value::is_u64) {
                    return Err(ServerError::invalid(
                        "thinking.budget_tokens",
                        "thinking of type enabled needs a budget_tokens integer",
                    ));
                }
            }
            Some("adaptive" | "disabled") => {}
            other => {
                return Err(ServerError::invalid(
                    "thinking.type",
                    format!("thinking.type must be enabled, adaptive or disabled, got {other:?}"),
                ))
            }
        }
    }
    if let Some(c) = req.output_config.as_ref().filter(|c| !c.is_null()) {
        let Some(obj) = c.as_object() else {
            return Err(ServerError::invalid(
                "output_config",
                "output_config must be an object",
            ));
        };
        for (k, v) in obj {
            match k.as_str() {
                "effort" if v.is_string() => {}
                "effort" => {
                    return Err(ServerError::invalid(
                        "output_config.effort",
                        "output_config.effort must be a string",
                    ))
                }
                other => {
                    return Err(ServerError::invalid(
                        &format!("output_config.{other}"),
                        format!("output_config.{other} is not supported by this server"),
                    ))
                }
            }
        }
    }
    Ok(())
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
/// Anthropic's envelope has no `param`: a message that does not name the field gets it in
/// front (`thinking.budget_tokens: ...`); one with a code keeps its wording, which clients
/// match ("prompt is too long").
pub fn error_body(e: &ServerError) -> Value {
    let mut message = e.to_string();
    if let ServerError::InvalidRequest {
        param: Some(p),
        code: None,
        ..
    } = e
    {
        if !message.contains(p.as_str()) {
            message = format!("{p}: {message}");
        }
    }
    json!({"type": "error", "error": {"type": error_type(e.status().as_u16()), "message": message}})
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

/// The `usage` object, whose three input counts add up to the prompt:
/// `cache_read_input_tokens` were read from the cache, `cache_creation_input_tokens` were
/// prefilled up to the last `cache_control` breakpoint (at `breakpoint` prompt tokens), and
/// `input_tokens` are the rest.
pub fn usage(u: &leyline_engine::Usage, breakpoint: Option<usize>) -> Value {
    let read = u.cached_tokens.min(u.prompt_tokens);
    let created = breakpoint.map_or(0, |b| b.min(u.prompt_tokens).saturating_sub(read));
    json!({
        "input_tokens": u.prompt_tokens - read - created,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": created,
        "output_tokens": u.completion_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handler::refuse_unknown_fields;

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
        let chat = to_chat(&r).unwrap().chat;
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
                json!([{"role": "tool", "content": "x"}]),
                "messages[0].role",
            ),
            (
                json!([{"role": "system", "content": [{"type": "image"}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "thinking", "thinking": "t"}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "thinking"}]}]),
                "messages[0].content[0].thinking",
            ),
            (
                json!([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}]),
                "messages[0].content[0].cache_control",
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
    fn claude_code_history_keeps_system_messages_in_place_and_drops_thinking() {
        let r = req(json!({
            "model": "m", "max_tokens": 8,
            "system": [{"type": "text", "text": "S"},
                       {"type": "text", "text": "T", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q1"}]},
                {"role": "system", "content": [{"type": "text", "text": "reminder", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "a1"}
                ]},
                {"role": "user", "content": "q2"}
            ]
        }));
        let c = to_chat(&r).unwrap();
        // Claude Code's billing metadata, first in `system`, never reaches the prompt.
        let mut billed = r.clone();
        billed.system = Some(json!([
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.b5f; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": "S"},
            {"type": "text", "text": "T", "cache_control": {"type": "ephemeral"}}
        ]));
        assert_eq!(to_chat(&billed).unwrap(), c);
        let got: Vec<(&str, &str)> = c
            .chat
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_deref().unwrap_or("")))
            .collect();
        assert_eq!(
            got,
            [
                ("system", "S\n\nT"),
                ("user", "q1"),
                ("system", "reminder"),
                ("assistant", "a1"),
                ("user", "q2")
            ]
        );
        // The last breakpoint is on the system message inside `messages`: three chat
        // messages end at or before it.
        assert_eq!(c.cached_messages, Some(3));
    }

    #[test]
    fn tools_take_the_template_form_and_choice_is_checked() {
        let tools = json!([
            {"name": "f", "description": "d", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
        ]);
        let with = |choice: Value| {
            req(
                json!({"model": "m", "max_tokens": 1, "messages": [], "tools": tools, "tool_choice": choice}),
            )
        };
        let t = template_tools(&with(Value::Null)).unwrap();
        let offered = t.offered.unwrap();
        assert_eq!(offered.len(), 1, "the server tool is not offered");
        assert_eq!(
            offered[0]["function"]["parameters"],
            json!({"type": "object"})
        );
        assert_eq!(t.unsupported, ["web_search"]);
        assert_eq!(t.choice, ToolChoice::Auto);
        let none = template_tools(&with(json!({"type": "none"}))).unwrap();
        assert_eq!(none.offered, None);
        assert_eq!(
            template_tools(&with(json!({"type": "any"})))
                .unwrap()
                .choice,
            ToolChoice::Any
        );
        assert_eq!(
            template_tools(&with(json!({"type": "tool", "name": "f"})))
                .unwrap()
                .choice,
            ToolChoice::Tool("f".into())
        );
        for (choice, param) in [
            (
                json!({"type": "tool", "name": "web_search"}),
                "tool_choice.name",
            ),
            (json!({"type": "tool"}), "tool_choice.name"),
            (json!({"type": "sometimes"}), "tool_choice.type"),
        ] {
            let e = template_tools(&with(choice)).unwrap_err();
            assert_eq!(e.body()["error"]["param"], param);
        }
        let bare = req(
            json!({"model": "m", "max_tokens": 1, "messages": [], "tool_choice": {"type": "any"}}),
        );
        assert_eq!(
            template_tools(&bare).unwrap_err().body()["error"]["param"],
            "tool_choice"
        );
        let bad =
            req(json!({"model": "m", "max_tokens": 1, "messages": [], "tools": [{"name": "f"}]}));
        assert_eq!(
            template_tools(&bad).unwrap_err().body()["error"]["param"],
            "tools[0].input_schema"
        );
    }

    #[test]
    fn unknown_fields_and_malformed_reasoning_fields_are_named() {
        let body = json!({"model": "m", "max_tokens": 1, "messages": [], "mcp_servers": []});
        let known = [&MESSAGES_FIELDS[..], &crate::openai::LEYLINE_FIELDS];
        let e = refuse_unknown_fields(&body, &known).unwrap_err();
        assert_eq!(e.body()["error"]["param"], "mcp_servers");
        let claude_code = json!({"model": "m", "max_tokens": 32000, "messages": [],
            "thinking": {"type": "adaptive", "display": "omitted"}, "output_config": {"effort": "high"},
            "metadata": {"user_id": "u"}, "stream": true,
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}});
        refuse_unknown_fields(&claude_code, &known).unwrap();
        check_reasoning_fields(&req(claude_code)).unwrap();
        for (field, value, param) in [
            (
                "thinking",
                json!({"type": "enabled"}),
                "thinking.budget_tokens",
            ),
            ("thinking", json!({"type": "deep"}), "thinking.type"),
            (
                "output_config",
                json!({"format": {}}),
                "output_config.format",
            ),
            (
                "output_config",
                json!({"effort": 3}),
                "output_config.effort",
            ),
        ] {
            let mut v = json!({"model": "m", "max_tokens": 1, "messages": []});
            v[field] = value;
            let e = check_reasoning_fields(&req(v)).unwrap_err();
            assert_eq!(e.body()["error"]["param"], param);
        }
    }

    #[test]
    fn usage_splits_the_prompt_at_the_breakpoint() {
        let zero = std::time::Duration::ZERO;
        let u = leyline_engine::Usage {
            prompt_tokens: 100,
            cached_tokens: 30,
            prefilled_tokens: 70,
            reused_tokens: 30,
            completion_tokens: 5,
            queued: zero,
            ttft: zero,
            total: zero,
            edit: None,
        };
        let v = usage(&u, Some(80));
        assert_eq!(v["cache_read_input_tokens"], 30);
        assert_eq!(v["cache_creation_input_tokens"], 50);
        assert_eq!(v["input_tokens"], 20);
        let v = usage(&u, Some(10));
        assert_eq!(v["cache_creation_input_tokens"], 0);
        assert_eq!(v["input_tokens"], 70);
        assert_eq!(usage(&u, None)["input_tokens"], 70);
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
